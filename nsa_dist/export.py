"""A run's per-step scalars and spectra as TensorBoard event files (``nsa export RUN --tensorboard DIR``).

Written with ``torch.utils.tensorboard.SummaryWriter`` into ``DIR/<run id>/``, so that a run sits
beside the training curves a researcher already logs there.  Values are kept exactly:

* scalars are float64 scalar summaries (``new_style``, ``double_precision``: TensorBoard's Scalars
  dashboard shows them), one point per step where the value is finite;
* the spectrum λ_1^t ≥ … ≥ λ_K^t of each recorded step is a histogram whose bucket edges ARE the
  eigenvalues (one count each), so that TensorBoard's reader gives them back unbinned — its
  Histograms and Distributions dashboards draw them as the spectrum's distribution.

TensorBoard's reader samples by default (10,000 scalars, 500 histograms per tag): read every point
with ``EventAccumulator(path, size_guidance={"tensors": 0, "histograms": 0})``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from nsa_dist.errors import StoreError

if TYPE_CHECKING:
    from nsa_dist.client import Run

__all__ = ["export_tensorboard", "ExportSummary", "scalar_series", "spectra"]


@dataclass(frozen=True)
class ExportSummary:
    """What :func:`export_tensorboard` wrote: the log directory, the scalar tags, the number of
    scalar points and of spectra (histograms)."""

    logdir: Path
    tags: tuple[str, ...]
    scalars: int
    spectra: int


def scalar_series(run: "Run") -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """(tag, t, value) of every scalar series the run stores (through :func:`nsa_dist.client.quantity`).

    Tags: ``loss/train`` (every trained step), ``loss/recorded``, ``loss/test``, ``lr``,
    ``spectrum/lambda_max``, ``spectrum/stability_bound`` (2N/λ_max), ``spectrum/lambda_<i>`` and
    ``energy_<φ>/k_<k>`` for i, k in 1, 2, 5, 10, … ≤ K, ``alignment``, ``first_order/error``,
    ``first_order/cos``, and ``hessian/Tr(<A>^<k>)`` with ``…_stderr`` for A = H, I, S, k = 1..4.
    """
    from nsa_dist.client import PHI_NAMES, quantity
    from nsa_dist.plots.axes import ks

    named: list[tuple[str, Callable[[], tuple[np.ndarray, np.ndarray]]]] = [
        ("loss/train", lambda: quantity(run, "loss")), ("loss/recorded", lambda: quantity(run, "loss_recorded")),
        ("lr", lambda: quantity(run, "lr")), ("spectrum/lambda_max", lambda: quantity(run, "lambda_max")),
        ("spectrum/stability_bound", lambda: quantity(run, "stability_bound")),
        ("alignment", lambda: quantity(run, "alignment"))]
    if run.has("loss_test"):
        named.append(("loss/test", lambda: quantity(run, "loss_test")))
    if run.has("first_order_error"):
        named += [("first_order/error", lambda: quantity(run, "first_order_error")),
                  ("first_order/cos", lambda: quantity(run, "first_order_cos"))]
    K = int(run.dims.K)
    named += [(f"spectrum/lambda_{i}", lambda i=i: quantity(run, "eigenvalues", i)) for i in ks(K)]
    for phi in PHI_NAMES:
        if run.has(f"energy_{phi}"):
            Kphi = int(run.shape(f"energy_{phi}")[1])
            named += [(f"energy_{phi}/k_{k}", lambda phi=phi, k=k: quantity(run, f"energy_{phi}", k)) for k in ks(Kphi)]
    for tag, get in named:
        t, v = get()
        yield tag, np.asarray(t), np.asarray(v, np.float64)
    if run.has("hessian_moments"):
        t = run.hessian.steps
        for part in "HIS":
            m = run.hessian.moments(part)
            for k in range(4):
                yield f"hessian/Tr({part}^{k + 1})", t, m["estimate"][:, k]
                yield f"hessian/Tr({part}^{k + 1})_stderr", t, m["stderr"][:, k]


def spectra(run: "Run") -> Iterator[tuple[str, int, np.ndarray]]:
    """(tag, t, eigenvalues) of every finished recorded step: ``spectrum/eigenvalues`` (λ_i^t of
    G_t) and, for K-output runs, ``spectrum/eigenvalues_full`` (the full kernel's)."""
    arrays = [("spectrum/eigenvalues", run.eigenvalues)]
    if run.has("eigenvalues_full"):
        arrays.append(("spectrum/eigenvalues_full", run.stability_eigenvalues))
    for tag, lam in arrays:
        for t, row in zip(run.steps, lam):
            yield tag, int(t), np.asarray(row, np.float64)


def export_tensorboard(run: "Run", logdir: str | Path) -> ExportSummary:
    """Write ``run``'s scalars and spectra as TensorBoard event files under ``logdir/<run id>/``.

    Args:
        run: a recorded run (``Client(url).run(id)``); its finished steps are written.
        logdir: TensorBoard's log directory (``tensorboard --logdir logdir``); created if missing.

    Returns:
        :class:`ExportSummary`.

    Raises:
        MissingDependencyError: the ``tensorboard`` package is missing (the extra to install is named).
        StoreError: ``logdir/<run id>`` holds event files already (a second export would
            interleave with them), or a damaged chunk of the run (the file is named).
    """
    from nsa_dist._extras import require

    require("tensorboard", "tensorboard", "nsa export --tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    out = Path(logdir) / run.id
    if out.is_dir() and any(out.glob("events.out.tfevents.*")):
        raise StoreError(f"{out} holds TensorBoard event files already: remove it (or export to another "
                         "directory) — a second export would interleave with the first")
    tags, n_scalars, n_spectra = [], 0, 0
    with SummaryWriter(str(out)) as w:
        for tag, t, v in scalar_series(run):
            ok = np.flatnonzero(np.isfinite(v))
            for i in ok:
                w.add_scalar(tag, float(v[i]), int(t[i]), new_style=True, double_precision=True)
            tags.append(tag)
            n_scalars += len(ok)
        for tag, t, lam in spectra(run):
            lam = np.sort(lam[np.isfinite(lam)])
            if not len(lam):
                continue
            w.add_histogram_raw(tag, min=float(lam[0]), max=float(lam[-1]), num=len(lam), sum=float(lam.sum()),
                                sum_squares=float((lam ** 2).sum()), bucket_limits=lam.tolist(),
                                bucket_counts=[1] * len(lam), global_step=t)
            n_spectra += 1
    return ExportSummary(out, tuple(tags), n_scalars, n_spectra)
