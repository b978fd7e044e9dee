"""A run's per-step scalars and spectra as TensorBoard event files (``nsa export RUN --tensorboard DIR``).

Written with ``torch.utils.tensorboard.SummaryWriter`` into ``DIR/<run id>/``, so that a run sits
beside the training curves a researcher already logs there.  Values are kept exactly:

* scalars are float64 scalar summaries (``new_style``, ``double_precision``: TensorBoard's Scalars
  dashboard shows them), one point per step where the value is finite — every scalar series the
  store holds, the papers' predictions included (:func:`scalar_sources` lists them from the
  store's arrays, so that a new array is exported without a change here);
* E_t(φ, k) and λ_k^t beyond the exact top (the quadrature route) with their brackets, one scalar
  series per measured k: ``curve_energy_<φ>[_lower|_upper]/k_<k>``, ``curve_eigenvalue[…]/k_<k>``;
* the spectrum λ_1^t ≥ … ≥ λ_K^t of each recorded step is a histogram whose bucket edges ARE the
  eigenvalues (one count each), so that TensorBoard's reader gives them back unbinned — its
  Histograms and Distributions dashboards draw them as the spectrum's distribution.

TensorBoard's reader samples by default (10,000 scalars, 500 histograms per tag): read every point
with ``EventAccumulator(path, size_guidance={"tensors": 0, "histograms": 0})``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from glob import escape as glob_escape
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.errors import OutsideError, StoreError
from nsa_dist.store.lease import process_alive
from nsa_dist.store.schema import AXIS_LABELS

if TYPE_CHECKING:
    from nsa_dist.client import Run

__all__ = [
    "export_tensorboard",
    "ExportSummary",
    "Source",
    "PER_ITEM_DIMS",
    "scalar_series",
    "scalar_sources",
    "curve_sources",
    "spectra",
]


@dataclass(frozen=True)
class ExportSummary:
    """What :func:`export_tensorboard` wrote: the log directory, the scalar tags, the number of
    scalar points and of spectra (histograms)."""

    logdir: Path
    tags: tuple[str, ...]
    scalars: int
    spectra: int
    kept: bool = False  # the folder held this export already (the same finished steps): nothing written


# Axes along which an array holds one value per point, pixel, parameter, … (not a handful of
# scalars): such arrays are not scalar series.  Every other per-step numeric array is exported.
PER_ITEM_DIMS = frozenset(
    {
        "point",
        "test_point",
        "input",
        "param",
        "slot",
        "rng_byte",
        "image",
        "pixel_y",
        "pixel_x",
        "freq_y",
        "freq_x",
        "density_bin",
        "density",
        "reconstruction",
        "predicted_step",
        "preservation_row",
        "train_step",
        "curve",
        "curve_test",  # exported by k through curve_sources, as "curve": its position is not a k
    }
)
_FULL = 8  # an axis this short is exported whole; a longer one (k, i) at 1, 2, 5, 10, … (NSA Fig. 3's k)
_ANY_STEP = ("every", "")


@dataclass(frozen=True)
class Source:
    """Where an exported scalar series comes from: stored array ``array`` at ``index`` (the
    position along its axes after ``step``), or — ``array`` None — a quantity the client derives."""

    tag: str
    array: str | None
    index: tuple[int, ...] = ()


def _legacy(name: str, labels: tuple[str, ...], index: tuple[int, ...]) -> str | None:
    """The tags of the first exports, kept: loss, lr, λ_i, E_t(φ, k), alignment, first order, Tr(A^k)."""
    plain = {
        "loss": "loss/recorded",
        "loss_test": "loss/test",
        "lr": "lr",
        "alignment": "alignment",
        "first_order_error": "first_order/error",
        "first_order_cos": "first_order/cos",
    }
    if not index and name in plain:
        return plain[name]
    if name == "eigenvalues":
        return f"spectrum/lambda_{index[0] + 1}"
    if name.startswith("energy_") and len(index) == 1:
        return f"{name}/k_{index[0] + 1}"
    if name in ("hessian_moments", "hessian_moments_stderr"):
        return f"hessian/Tr({labels[0]}^{index[1] + 1})" + ("_stderr" if name.endswith("stderr") else "")
    return None


def scalar_sources(run: Run) -> list[Source]:
    """Every scalar series the run stores, named, with where each comes from.

    Every per-step numeric array of the store whose axes after ``step`` are not per point, pixel
    or parameter (:data:`PER_ITEM_DIMS`) — predictions included: Eqs. 4–5 (``constant_gram_*``),
    App. F (``gram_change*``), the first-order accuracy, the Hessian's moments, their Θ∞ and S
    limits, orthogonality, additivity, ∇Cᵀ·G, ‖S‖_op … — one series per entry of its short axes
    (named: ``hessian_S_limit/trace_S2``, ``hessian_additivity/value/moment_2``) and per
    i = 1, 2, 5, 10, … of a long one (every class of an ``output`` axis); the quadrature route's
    curves and their brackets at every k they were measured at (:func:`curve_sources`); the first
    exports' names are kept (``loss/recorded``, ``spectrum/lambda_<i>``, ``energy_<φ>/k_<k>``,
    ``hessian/Tr(<A>^<k>)``).  Derived from the client: ``loss/train`` (every step),
    ``spectrum/lambda_max`` and ``spectrum/stability_bound`` (2N/λ_max of the kernel that sets GD's
    stability), ``hessian/edge_of_stability`` and App. E's
    test residual ``app_E/test_residual/{predicted,measured}``.
    """
    from itertools import product

    from nsa_dist.plots.axes import ks

    out = [Source("loss/train", None), Source("spectrum/lambda_max", None), Source("spectrum/stability_bound", None)]
    if run.has("hessian_top") and len(run.hessian.steps):
        out.append(Source("hessian/edge_of_stability", None))
    if run.has("constant_gram_f_test"):
        out += [Source("app_E/test_residual/predicted", None), Source("app_E/test_residual/measured", None)]
    for name in run.array_names():
        dims = run.dimension_names(name)
        if (
            not dims
            or dims[0] != "step"
            or name in ("steps", "done")
            or PER_ITEM_DIMS & set(dims[1:])
            or run.g[name].dtype.kind not in "fiu"
        ):
            continue
        axes = []
        for dim, n in zip(dims[1:], run.shape(name)[1:]):
            # classes are series of their own: every one (a k or i axis is sampled; the output axis of
            # `eigenvalues_per_class` was too, and 6 of 10 classes went missing without a word)
            idx = range(n) if n <= _FULL or dim == "output" else [k - 1 for k in ks(n)]
            names = AXIS_LABELS.get(dim) if len(AXIS_LABELS.get(dim, ())) == n else None
            axes.append([(j, names[j] if names else f"{dim}_{j + 1}") for j in idx])
        for combo in product(*axes):
            index, labels = tuple(j for j, _ in combo), tuple(lab for _, lab in combo)
            tag = _legacy(name, labels, index) or "/".join((name,) + labels)
            out.append(Source(tag, name, index))
    return out + curve_sources(run)


def curve_sources(run: Run) -> list[Source]:
    """The quadrature route's curves beyond the exact top, every point: ``curve_energy_<φ>/k_<k>``,
    ``curve_energy_<φ>_lower/k_<k>``, ``curve_energy_<φ>_upper/k_<k>`` and the same of
    ``curve_eigenvalue`` at each k of ``curve_k`` (``curve_energy_f_test…`` at each k of the test
    Gram's ``curve_k_test``; the exact top part is ``energy_<φ>/k_<k>`` and ``spectrum/lambda_<i>``);
    none on the exact route."""
    out = []
    for grid, axis in (("curve_k", "curve"), ("curve_k_test", "curve_test")):
        if not run.has(grid):
            continue
        ks_ = [int(k) for k in run.array(grid)]
        for name in run.array_names():
            if name.startswith("curve_") and run.dimension_names(name) == ("step", axis):
                out += [Source(f"{name}/k_{k}", name, (j,)) for j, k in enumerate(ks_)]
    return out


def _steps_of(run: Run, name: str) -> np.ndarray:
    """The finished steps array ``name`` is written at (Hessian arrays: the analysed steps, …)."""
    from nsa_dist.store import run_arrays

    at = {a.name: a.at for a in run_arrays(run.dims)}.get(name, "every")
    if at == "hessian":
        return run.hessian.steps
    if at == "eigenvectors":
        return run.eigenvector_steps
    if at == "first":
        return run.steps[:1] if len(run.steps) and run.steps[0] == run.schedule[0] else run.steps[:0]
    return run.steps


def _derived(run: Run, tag: str) -> tuple[np.ndarray, np.ndarray]:
    from nsa_dist.client import quantity

    if tag == "loss/train":
        return quantity(run, "loss")
    if not len(run.steps):  # no finished recorded step yet: the training losses so far only
        return run.steps, np.zeros(0)
    if tag == "spectrum/lambda_max":
        return quantity(run, "lambda_max")
    if tag == "spectrum/stability_bound":
        return quantity(run, "stability_bound")
    if tag == "hessian/edge_of_stability":
        return run.hessian.steps, run.hessian.edge_of_stability()
    idx = [int(np.flatnonzero(run.schedule == t)[0]) for t in run.steps]  # App. E, Eq. 22 (Nyström)
    yt = run.array("y_test")
    if tag.endswith("predicted"):
        F = run.kernel.constant_gram_test()[idx]
    else:
        F = np.stack([run.outputs(int(t), "f_test") for t in run.steps]) if len(run.steps) else yt[None, :0]
    return run.steps, np.linalg.norm((F - yt[None]).reshape(len(F), -1), axis=1)


def scalar_series(run: Run) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """(tag, t, value) of every scalar series the run stores (:func:`scalar_sources`), values as
    stored (float64), at the steps each is written at."""
    cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for src in scalar_sources(run):
        if src.array is None:
            t, v = _derived(run, src.tag)
            yield src.tag, np.asarray(t), np.asarray(v, np.float64)
            continue
        if src.array not in cache:
            steps = _steps_of(run, src.array)
            rows = np.asarray(run.per_step(src.array))[np.isin(run.steps, steps)]
            cache = {src.array: (steps, rows)}
        steps, rows = cache[src.array]
        yield src.tag, steps, np.asarray(rows[(slice(None),) + src.index], np.float64)


def spectra(run: Run) -> Iterator[tuple[str, int, np.ndarray]]:
    """(tag, t, eigenvalues) of every finished recorded step: ``spectrum/eigenvalues`` (λ_i^t of
    G_t), for K-output runs ``spectrum/eigenvalues_full`` (the full kernel's), with test points
    ``spectrum/eigenvalues_test``, and at the analysed Hessian steps ``hessian/I_eigenvalues`` and
    its Θ∞ limit ``hessian/I_limit_eigenvalues``."""
    arrays = [("spectrum/eigenvalues", run.steps, run.eigenvalues)]
    if run.has("eigenvalues_full"):
        arrays.append(("spectrum/eigenvalues_full", run.steps, run.stability_eigenvalues))
    if run.has("eigenvalues_test"):
        arrays.append(("spectrum/eigenvalues_test", run.steps, run.per_step("eigenvalues_test")))
    if run.has("hessian_I_eigenvalues") and len(run.hessian.steps):
        arrays += [
            ("hessian/I_eigenvalues", run.hessian.steps, run.hessian.I_eigenvalues()),
            ("hessian/I_limit_eigenvalues", run.hessian.steps, run.hessian.I_eigenvalues(limit=True)),
        ]
    for tag, steps, lam in arrays:
        for t, row in zip(steps, lam):
            yield tag, int(t), np.asarray(row, np.float64)


def export_tensorboard(run: Run, logdir: str | Path) -> ExportSummary:
    """Write ``run``'s scalars and spectra as TensorBoard event files under ``logdir/<run id>/``.

    The export is atomic: the event file is written into a temporary folder beside the
    destination (``logdir/.<run id>.*.partial``) and moved into place only once complete, so that
    a failure — a full disk, a damaged chunk of the run, Ctrl-C — leaves nothing behind and the
    next export into ``logdir`` starts clean.  An export killed outright (SIGKILL, out of memory)
    leaves its temporary folder, holding no file TensorBoard reads (the event file gets its name
    only once complete), and the next export of the run on this host removes it.  Events are
    written synchronously (TensorBoard's ``SummaryWriter`` writes on a thread that prints a
    traceback of its own when the disk fills).

    Args:
        run: a recorded run (``Client(url).run(id)``); its finished steps are written.
        logdir: TensorBoard's log directory (``tensorboard --logdir logdir``); created if missing.

    Returns:
        :class:`ExportSummary`.

    Raises:
        MissingDependencyError: the ``tensorboard`` package is missing (the extra to install is named).
        StoreError: ``logdir/<run id>`` holds event files already (a second export would
            interleave with them), or a damaged chunk of the run (the file is named).
        OutsideError: the export folder cannot be written (disk full, permission denied …: the
            folder and the cause are named).
    """
    from nsa_dist._extras import require

    require("tensorboard", "tensorboard", "nsa export --tensorboard")

    out = Path(logdir) / run.id
    done = _exported(out, run)
    if done is not None:
        return done
    _refuse_second(out)
    _check_static(run)
    failed = None
    try:
        Path(logdir).mkdir(parents=True, exist_ok=True)
        _remove_killed(Path(logdir), run.id)
        tmp = Path(logdir) / f".{run.id}.{uuid.uuid4().hex[:12]}.partial"
        tmp.mkdir()
        (tmp / _OWNER).write_text(f"{socket.gethostname()}\n{os.getpid()}\n")
    except OSError as exc:
        failed = _write_error(exc, out)
    if failed is not None:
        raise failed  # outside the handler: the OSError is not chained (it is not the store's)
    try:
        summary = _write_events(run, tmp)
        (tmp / _MARK).write_text(
            json.dumps(
                {
                    "run": run.id,
                    "status": run.status,
                    "data_fingerprint": run.data_fingerprint,
                    "steps": [int(t) for t in run.steps],
                    "tags": list(summary.tags),
                    "scalars": summary.scalars,
                    "spectra": summary.spectra,
                }
            )
        )
        _move_into_place(tmp, out)
    except OSError as exc:
        failed = _write_error(exc, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # on success only the emptied folder (or nothing) is left
    if failed is not None:
        raise failed
    return replace(summary, logdir=out)


_MARK = "nsa-export.json"  # beside the event file: the run and the finished steps it holds


def _exported(out: Path, run: Run) -> ExportSummary | None:
    """The summary of the export ``out`` holds already when it is of this run done, as it is now (None
    otherwise): exporting it again changes nothing, so it is kept, not refused — a killed ``nsa export
    --sweep`` run again told the user to remove the complete exports it had made.  Only a run that was
    done at that export and is now: a run exported while running can gain arrays between its steps
    (those written after the last step, App. E's, 10 tags in a review) that the same steps do not show;
    and the same data fingerprint (another store's run of the same id)."""
    try:
        mark = json.loads((out / _MARK).read_text())
        same = (
            mark["run"] == run.id
            and mark["status"] == "done" == run.status
            and mark["data_fingerprint"] == run.data_fingerprint
            and mark["steps"] == [int(t) for t in run.steps]
        )
        if not same or not any(out.glob("events.out.tfevents.*")):
            return None
        return ExportSummary(out, tuple(mark["tags"]), int(mark["scalars"]), int(mark["spectra"]), kept=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _check_static(run: Run) -> None:
    """StoreError naming the first chunk missing from a static array of ``run``
    (:meth:`~nsa_dist.store.reader.RunReader.static_damage`: ``steps`` read as its fill value would
    put every point at t = 0), asked before anything is written, as of a finished step's chunk."""
    damage = run._r.static_damage()  # the run's checked reader (nsa_dist.store.RunReader)
    if damage is not None:
        raise StoreError(damage)


_OWNER = "writer"  # in a temporary folder: the host and process id of the export writing it
_WRITING = "events.writing"  # the event file while it is written: no TensorBoard event file's name


def _remove_killed(logdir: Path, rid: str) -> None:
    """Remove the temporary folders ``logdir/.<rid>.*.partial`` of exports of ``rid`` killed on
    this host (SIGKILL, out of memory: no handler ran), whose writer process is gone.  Each holds
    at most an event file under a name TensorBoard does not read (:data:`_WRITING`), so that it
    never shows as a run of its own; a folder of a live export, or of another host's, is left."""
    for folder in logdir.glob(f".{glob_escape(rid)}.*.partial"):
        try:
            host, pid = (folder / _OWNER).read_text().split()[:2]
        except (OSError, ValueError):
            continue  # being created (its writer file comes next), or not an export's
        if host != socket.gethostname() or process_alive(int(pid)):
            continue
        shutil.rmtree(folder, ignore_errors=True)


def _write_error(exc: OSError, out: Path) -> OutsideError:
    """The one-line error for an export folder that cannot be written (the folder, the cause)."""
    from nsa_dist._faults import outside_cause

    cause = outside_cause(exc, str(out)) or f"{type(exc).__name__}: {exc.strerror or exc}"
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():  # said "FileExistsError: File exists" (an audit)
        cause = f"{existing} is a file, not a folder"
    return OutsideError(f"cannot write the export folder {out}: {cause}; nothing was left there")


def _refuse_second(out: Path) -> None:
    if out.is_dir() and any(out.glob("events.out.tfevents.*")):
        raise StoreError(
            f"{out} holds TensorBoard event files already: remove it (or export to another "
            "directory) — a second export would interleave with the first"
        )


def _move_into_place(tmp: Path, out: Path) -> None:
    """Move the finished export from ``tmp`` to ``out``: the folder in one rename, or — ``out``
    exists already (without event files: an export of the run that finished meanwhile is
    refused as at the start) — each file in one rename."""
    _refuse_second(out)
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    (tmp / _OWNER).unlink()
    if not out.exists():
        os.rename(tmp, out)
        return
    for f in tmp.iterdir():
        os.replace(f, out / f.name)


def _write_events(run: Run, folder: Path) -> ExportSummary:
    """Write every scalar series and spectrum of ``run`` as one event file in ``folder``."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter
    from torch.utils.tensorboard.summary import histogram_raw, scalar

    name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.0"
    tags, n_scalars, n_spectra = [], 0, 0
    with open(folder / _WRITING, "wb") as f:
        w = RecordWriter(f)

        def put(step: int, summary=None, **fields) -> None:
            e = Event(wall_time=time.time(), step=step, summary=summary, **fields)
            w.write(e.SerializeToString())

        put(0, file_version="brain.Event:2")
        for tag, t, v in scalar_series(run):
            ok = np.flatnonzero(np.isfinite(v))
            for i in ok:
                put(int(t[i]), scalar(tag, float(v[i]), new_style=True, double_precision=True))
            tags.append(tag)
            n_scalars += len(ok)
        for tag, t, lam in spectra(run):
            lam = np.sort(lam[np.isfinite(lam)])
            if not len(lam):
                continue
            put(
                t,
                histogram_raw(
                    tag,
                    min=float(lam[0]),
                    max=float(lam[-1]),
                    num=len(lam),
                    sum=float(lam.sum()),
                    sum_squares=float((lam**2).sum()),
                    bucket_limits=lam.tolist(),
                    bucket_counts=[1] * len(lam),
                ),
            )
            n_spectra += 1
        f.flush()
        os.fsync(f.fileno())
    os.rename(folder / _WRITING, folder / name)  # complete: now an event file TensorBoard reads
    return ExportSummary(folder, tuple(tags), n_scalars, n_spectra)
