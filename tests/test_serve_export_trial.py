"""An adversarial trial of the reading-out side: ``nsa export --tensorboard`` and ``nsa serve``
against the store read directly with Zarr (never through the client whose reads they share).

Real runs on both routes of the NSA paper's curves (exact ``spectrum.k: all`` with a Hessian
block, quadrature ``k: all``, top-K) and a small sweep; each test says what it checks and, where
it guards a fix, what the code did before it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlencode

import numpy as np
import pytest
import zarr

from nsa_dist.config import ExperimentSpec, SweepSpec
from nsa_dist.errors import StoreError
from nsa_dist.pipeline import run_experiment
from nsa_dist.store import SpectrumStore

_BASE = dict(data={"n": 24, "n_test": 8}, steps=8, model={"depth": 2, "width": 12}, record={"every": 4})
EXACT = ExperimentSpec(
    name="exact",
    **_BASE,
    spectrum={"k": "all", "test_points": True},
    hessian={"probes": 4, "rayleigh_k": 3, "top_k": 1, "density": True},
)
QUAD = ExperimentSpec(
    name="quad",
    **{**_BASE, "data": {"n": 40, "n_test": 8}},
    spectrum={
        "k": "all",
        "energy": "quadrature",
        "test_points": True,
        "quadrature": {"top": 5, "lanczos_steps": 10, "probes": 4, "curve_points": 12, "block_size": 4},
    },
)
TOPK = ExperimentSpec(name="topk", **_BASE, spectrum={"k": 6, "test_points": True})


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """(url, {name: run id}) of one store holding the three runs, finished."""
    url = str(tmp_path_factory.mktemp("trial") / "s.zarr")
    ids = {}
    for spec in (EXACT, QUAD, TOPK):
        out = run_experiment(spec, SpectrumStore(url))
        assert out.status == "done", out
        ids[spec.name] = out.run_id
    return url, ids


def _copy(store: tuple[str, dict[str, str]], tmp_path: Path) -> str:
    url = str(tmp_path / "copy.zarr")
    shutil.copytree(store[0], url)
    return url


def _group(url: str, rid: str) -> zarr.Group:
    return zarr.open_group(url, mode="r")["runs"][rid]


# ------------------------------------------------------------------------------------- export
def _events(folder: Path) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, np.ndarray]]]:
    """Every scalar ({tag: {step: value}}) and histogram ({tag: {step: bucket edges}}) of an export."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0, "histograms": 0})
    acc.Reload()

    def value(e) -> float:
        t = e.tensor_proto
        return float(np.frombuffer(t.tensor_content, np.float64)[0]) if t.tensor_content else t.double_val[0]

    scalars = {tag: {e.step: value(e) for e in acc.Tensors(tag)} for tag in acc.Tags()["tensors"]}
    hists = {
        tag: {h.step: np.asarray(h.histogram_value.bucket_limit) for h in acc.Histograms(tag)}
        for tag in acc.Tags()["histograms"]
    }
    return scalars, hists


def test_every_exported_value_is_the_stores_bit_for_bit(store, tmp_path):
    """Both routes and a Hessian run: each stored series under its tag, at the steps the store
    marks done (Hessian arrays: at its analysed steps), NaN left out, float64 bit for bit; the
    quadrature curves under ``k_<k>`` of ``curve_k``; each spectrum unbinned; loss/train, λ_max,
    2N/λ_max from the raw arrays.  (Found right: no defect.)"""
    from nsa_dist import Client
    from nsa_dist.export import export_tensorboard, scalar_sources

    url, ids = store
    for name, rid in ids.items():
        run = Client(url).run(rid)
        export_tensorboard(run, tmp_path / "tb")
        scalars, hists = _events(tmp_path / "tb" / rid)
        g = _group(url, rid)
        steps, done = g["steps"][:], g["done"][:]
        hess = g["hessian_steps"][:] if "hessian_steps" in g else np.zeros(len(steps), bool)
        wrong = []
        for src in (s for s in scalar_sources(run) if s.array is not None):
            a = g[src.array][:]
            rows = [i for i in range(len(steps)) if done[i] and (hess[i] or not src.array.startswith("hessian_"))]
            want = {int(steps[i]): a[(i,) + src.index] for i in rows}
            want = {t: float(v) for t, v in want.items() if np.isfinite(v)}
            got = scalars.get(src.tag, {})
            same = got.keys() == want.keys() and all(
                np.float64(got[t]).tobytes() == np.float64(v).tobytes() for t, v in want.items()
            )
            if not same:
                wrong.append(f"{src.tag}: exported {got}, stored {want}")
        assert not wrong, f"{name}: {len(wrong)} series differ from the store:\n" + "\n".join(wrong[:10])
        if "curve_k" in g:
            for j, k in enumerate(g["curve_k"][:]):
                want = {int(t): float(g["curve_energy_y_upper"][i, j]) for i, t in enumerate(steps)}
                assert scalars[f"curve_energy_y_upper/k_{k}"] == want, (k, scalars[f"curve_energy_y_upper/k_{k}"], want)
        lam = g["eigenvalues"][:]
        for i, t in enumerate(steps):
            np.testing.assert_array_equal(
                hists["spectrum/eigenvalues"][int(t)], np.sort(lam[i]), err_msg=f"{name} t={t}"
            )
        assert scalars["spectrum/lambda_max"] == {int(t): float(lam[i, 0]) for i, t in enumerate(steps)}
        n = g["y"].shape[0]
        assert scalars["spectrum/stability_bound"] == {int(t): 2 * n / float(lam[i, 0]) for i, t in enumerate(steps)}
        assert scalars["loss/train"] == {t: float(v) for t, v in enumerate(g["loss_trace"][:])}
        if name == "exact":
            want = {int(t): np.sort(g["hessian_I_eigenvalues"][i]) for i, t in enumerate(steps) if hess[i]}
            got = hists["hessian/I_eigenvalues"]
            assert got.keys() == want.keys() and all(np.array_equal(got[t], want[t]) for t in want)


def test_a_killed_export_leaves_nothing_tensorboard_reads_and_the_next_one_cleans_up(store, tmp_path):
    """An export killed outright (SIGKILL: no handler runs) midway through its event file.

    Before: its temporary folder ``.<run id>.<hex>.partial`` held a half-written event file under
    its final name, which ``tensorboard --logdir`` loads as a run of its own (a truncated copy of
    the run, named ``.<run id>….partial``), and no later export removed it."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    url, ids = store
    rid, logdir = ids["topk"], tmp_path / "tb"
    kill = (
        "import os, signal, sys\n"
        "from tensorboard.summary.writer.record_writer import RecordWriter\n"
        "real, n = RecordWriter.write, [0]\n"
        "def write(self, data):\n"
        "    n[0] += 1\n"
        "    if n[0] == 40:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return real(self, data)\n"
        "RecordWriter.write = write\n"
        "from nsa_dist.cli import main\n"
        f"sys.exit(main(['export', {rid!r}, '--tensorboard', {str(logdir)!r}, '--store', {url!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", kill], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])
    left = sorted(str(p.relative_to(logdir)) for p in logdir.rglob("*"))
    assert left and all(p.startswith(f".{rid}.") for p in left), left  # the killed export's folder only
    seen = EventMultiplexer().AddRunsFromDirectory(str(logdir))
    seen.Reload()
    assert list(seen.Runs()) == [], f"TensorBoard loads the killed export as a run: {list(seen.Runs())} ({left})"
    from nsa_dist.cli import main as nsa

    assert nsa(["export", rid, "--tensorboard", str(logdir), "--store", url]) == 0
    left = sorted(str(p.relative_to(logdir)) for p in logdir.rglob("*"))
    events = [p for p in left if p.startswith(f"{rid}/events.out.tfevents.")]
    assert len(events) == 1 and set(left) - set(events) == {rid, f"{rid}/nsa-export.json"}, left


def test_a_live_exports_folder_is_left_alone(store, tmp_path):
    """The clean-up removes only folders of dead writers on this host: a folder whose writer is
    alive (this process) or another host's stays."""
    from nsa_dist.export import export_tensorboard

    url, ids = store
    rid, logdir = ids["topk"], tmp_path / "tb"
    mine, other = logdir / f".{rid}.aaaaaaaaaaaa.partial", logdir / f".{rid}.bbbbbbbbbbbb.partial"
    for folder, owner in ((mine, f"{socket.gethostname()}\n{os.getpid()}\n"), (other, "elsewhere\n1\n")):
        folder.mkdir(parents=True)
        (folder / "writer").write_text(owner)
    from nsa_dist import Client

    export_tensorboard(Client(url).run(rid), logdir)
    assert mine.is_dir() and other.is_dir()


def test_two_exports_of_a_run_at_once_never_leave_two_event_files(store, tmp_path, monkeypatch):
    """Another export of the run into the same folder finishes while this one writes.

    Before: the check for event files was made at the start only, so the second export moved its
    event file in beside the first — the interleaving the refusal exists to prevent."""
    import nsa_dist.export as export
    from nsa_dist import Client

    url, ids = store
    rid, logdir = ids["topk"], tmp_path / "tb"
    run = Client(url).run(rid)
    real = export._write_events

    def meanwhile(run, folder):
        got = real(run, folder)
        monkeypatch.setattr(export, "_write_events", real)
        export.export_tensorboard(run, logdir)  # the other export, done first
        return got

    monkeypatch.setattr(export, "_write_events", meanwhile)
    with pytest.raises(StoreError, match="holds TensorBoard event files already"):
        export.export_tensorboard(run, logdir)
    left = sorted(str(p.relative_to(logdir)) for p in logdir.rglob("*"))
    events = [p for p in left if p.startswith(f"{rid}/events.out.tfevents.")]
    assert len(events) == 1 and set(left) - set(events) == {rid, f"{rid}/nsa-export.json"}, left


_MISSING = [  # (run, chunk of a static array) whose fill value the readers would give as data
    ("topk", "steps/c/0"),  # every step at t = 0
    ("exact", "hessian_steps/c/0"),  # the Hessian's series left out
    ("quad", "curve_k/c/0"),  # every curve under one tag k_0
    ("exact", "y_test/c/0"),  # App. E's measured residual ‖f_test − 0‖
]


@pytest.mark.parametrize(("name", "chunk"), _MISSING, ids=[c.split("/")[0] for _, c in _MISSING])
def test_a_missing_static_chunk_is_named_by_export_and_serve(store, tmp_path, name, chunk):
    """A deleted chunk of an array written whole when the run was created.

    Before: the export wrote the fill value as data (``steps`` missing: every point at step 0;
    ``curve_k``: 11 curves under the one tag ``curve_energy_y/k_0``; ``hessian_steps``: 221 of
    428 points, the Hessian's left out; ``y_test``: App. E's residual of the wrong target) and
    ``nsa serve`` drew every step of Figs. 2b … at t = 0 with ``last t = 0`` in its header."""
    from nsa_dist import Client
    from nsa_dist.export import export_tensorboard

    url = _copy(store, tmp_path)
    rid = store[1][name]
    path = Path(url) / "runs" / rid / chunk
    path.unlink()
    with pytest.raises(StoreError) as err:
        export_tensorboard(Client(url).run(rid), tmp_path / "tb")
    assert str(path) in str(err.value), err.value
    assert not (tmp_path / "tb" / rid).exists()
    with _Served(url) as s:
        answer = s.data(rid)
    assert "message" in answer and str(path) in answer["message"], answer.get("header", answer.get("message"))


def test_a_live_runs_missing_loss_chunk_of_finished_steps_is_named(store, tmp_path):
    """A running run has written the losses of every step up to its last finished recorded step
    (the trainer writes them before the step is analysed): a missing chunk of them is damage, named
    — it was taken for the current chunk not written yet, and the export dropped those losses."""
    from nsa_dist import Client
    from nsa_dist.errors import StoreError
    from nsa_dist.export import export_tensorboard

    url = _copy(store, tmp_path)
    rid = store[1]["topk"]
    run_dir = Path(url) / "runs" / rid
    (run_dir / "done" / "c" / "2").unlink()
    (run_dir / "loss_trace" / "c" / "0").unlink()
    meta = json.loads((run_dir / "zarr.json").read_text())
    meta["attributes"]["status"] = "running"
    (run_dir / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match=r"array 'loss_trace' is damaged: chunk .*loss_trace/c/0 is missing"):
        export_tensorboard(Client(url).run(rid), tmp_path / "tb")


def test_a_run_without_a_finished_step_exports_its_training_losses(store, tmp_path):
    """A run started but with no recorded step finished yet (a Tracker's first analysis running).

    Before: ``nsa export`` failed with "evals_max must not be empty, got shape (0,)" (the derived
    λ_max and 2N/λ_max of no step), a message naming neither the run nor what is missing."""
    from nsa_dist import Client
    from nsa_dist.export import export_tensorboard

    url = _copy(store, tmp_path)
    rid = store[1]["topk"]
    run_dir = Path(url) / "runs" / rid
    shutil.rmtree(run_dir / "done" / "c")
    meta = json.loads((run_dir / "zarr.json").read_text())
    meta["attributes"]["status"] = "running"
    (run_dir / "zarr.json").write_text(json.dumps(meta))
    out = export_tensorboard(Client(url).run(rid), tmp_path / "tb")
    scalars, hists = _events(out.logdir)
    want = {t: float(v) for t, v in enumerate(_group(url, rid)["loss_trace"][:])}
    assert scalars.get("loss/train") == want and out.spectra == 0 and not hists, (sorted(scalars), hists)
    assert out.scalars == len(want), out


# -------------------------------------------------------------------------------------- serve
class _Served:
    """``nsa serve`` of ``url`` on loopback, on its own IO loop thread."""

    def __init__(self, url: str, refresh_s: float = 2.0) -> None:
        from nsa_dist.serve import ServeOptions, make_server

        self.server = make_server(ServeOptions(url, port=0, refresh_s=refresh_s))
        self.server.start()
        self.thread = threading.Thread(target=self.server.io_loop.start, daemon=True)

    def __enter__(self) -> _Served:
        self.thread.start()
        return self

    def data(self, rid: str, tab: int = 0) -> dict:
        query = urlencode({"id": rid, "tab": tab})
        with urllib.request.urlopen(f"http://127.0.0.1:{self.server.port}/run/data?{query}", timeout=120) as r:
            assert r.status == 200
            return json.loads(r.read())

    def __exit__(self, *exc) -> None:
        self.server.io_loop.add_callback(self.server.io_loop.stop)
        self.thread.join(timeout=10)
        self.server.stop()


def _plots(answer: dict, heading: str) -> dict[str, dict[str, np.ndarray]]:
    """The lines of the panel whose heading starts with ``heading``, by figure title, by label."""
    from bokeh.document import Document
    from bokeh.models import Div, GlyphRenderer, Plot

    for item in answer["page"]["items"]:
        doc = Document.from_json(item["doc"])
        if not any(f"<h3>{heading}" in d.text for d in doc.select({"type": Div})):
            continue
        out = {}
        for p in doc.select({"type": Plot}):
            lines = {}
            for r in p.renderers:
                d = r.data_source.data if isinstance(r, GlyphRenderer) else {}
                if "label" in d:
                    lines.update(
                        {lab: (np.asarray(x), np.asarray(y, float)) for lab, x, y in zip(d["label"], d["xs"], d["ys"])}
                    )
            out[p.title.text if p.title else ""] = lines
        return out
    raise AssertionError(f"no panel {heading!r} on the page")


def _heat(answer: dict, heading: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The cells (left, right, bottom, top, v) of the panel ``heading``'s heat maps: E, its width."""
    from bokeh.document import Document
    from bokeh.models import Div, GlyphRenderer, Plot

    for item in answer["page"]["items"]:
        doc = Document.from_json(item["doc"])
        if any(f"<h3>{heading}" in d.text for d in doc.select({"type": Div})):
            maps = {
                p.title.text: {k: np.asarray(v, float) for k, v in r.data_source.data.items()}
                for p in doc.select({"type": Plot})
                for r in p.renderers
                if isinstance(r, GlyphRenderer) and "left" in r.data_source.data
            }
            return maps["E_t(φ, k) over t and k"], maps["its bracket's width, upper − lower"]
    raise AssertionError(f"no panel {heading!r}")


def _cell_at(cells: dict[str, np.ndarray], ks: np.ndarray) -> np.ndarray:
    """The value a heat map shows at each k of ``ks`` in its last column (the cell k lies in)."""
    last = cells["left"] == cells["left"].max()
    bottom, top, v = cells["bottom"][last], cells["top"][last], cells["v"][last]
    return np.array([v[(bottom <= k) & (k < top)][0] for k in ks])


def test_the_served_numbers_are_the_stores(store):
    """Over HTTP (``/run/data``): Fig. 2a's λ_i^t, Fig. 3's E_t(y, k) against k (top part and
    quadrature curve) and its heat maps (E and the bracket's width) at every measured k, the
    Hessian's Tr(A^k), each equal to the arrays read with Zarr.

    Before: the heat map promised every measured k up to 120 of them but drew 16 of N = 24 (120
    log-spaced points merged at small k): the cell at a k left out showed its neighbour's E
    (E_7(y, 9) drawn as E_7(y, 10), 0.580 for 0.576; at most 0.08 off at k = 18 here)."""
    url, ids = store
    with _Served(url) as s:
        for name in ("exact", "quad", "topk"):
            rid, g = ids[name], _group(url, ids[name])
            steps, answer = g["steps"][:], s.data(rid)
            lam = g["eigenvalues"][:]
            (fig2a,) = _plots(answer, "NSA Fig. 2a").values()
            for i, t in enumerate(steps):  # a log axis: a rounding-level λ ≤ 0 is left out (NaN)
                want = np.where(lam[i] > 0, lam[i], np.nan)
                np.testing.assert_array_equal(fig2a[f"t = {t}"][1][: lam.shape[1]], want, err_msg=f"{name} t={t}")
            energy = _plots(answer, "NSA Fig. 3a")
            (against_k,) = [lines for lines in energy.values() if "t = 0" in lines]
            ks, e = against_k[f"t = {steps[-1]}"]
            if "curve_k" in g:  # the exact top part (k ≤ quadrature.top) from energy_y, beyond it the curve
                want_k, want = g["curve_k"][:], g["curve_energy_y"][-1].copy()
                top = g["energy_y"].shape[1]
                want[want_k <= top] = g["energy_y"][-1][want_k[want_k <= top] - 1]
            else:
                want_k, want = np.arange(1, lam.shape[1] + 1), g["energy_y"][-1]
            np.testing.assert_array_equal(ks, want_k, err_msg=name)
            np.testing.assert_array_equal(e, want, err_msg=name)
            values, width = _heat(answer, "NSA Fig. 3a")  # E, and its bracket's width
            shown = _cell_at(values, want_k)
            np.testing.assert_array_equal(shown, want, err_msg=f"{name}: the heat map's cell at each k, last t")
            if "curve_k" in g:
                upper, lower = g["curve_energy_y_upper"][-1], g["curve_energy_y_lower"][-1]
                np.testing.assert_allclose(_cell_at(width, want_k), upper - lower, rtol=0, atol=1e-15)
        hess = _group(url, ids["exact"])
        moments = _plots(s.data(ids["exact"], tab=1), "Hessian paper Fig. 1")
        m = hess["hessian_moments"][:]
        for k in range(4):
            got = moments[f"Tr(A^{k + 1})"]
            for j, part in enumerate("HIS"):
                np.testing.assert_array_equal(got[f"{part} (Hutch++)"][1], m[:, j, k], err_msg=f"Tr({part}^{k + 1})")
            np.testing.assert_array_equal(got["I exact (NTK Gram)"][1], hess["hessian_moments_I_exact"][:, k])


def test_a_run_recorded_anew_under_its_id_is_drawn_anew(store, tmp_path):
    """A run deleted and recorded again under the same id (a Tracker's name) while its page is
    open, with as many steps finished and the same status.

    Before: the page's builds were keyed by the finished steps and the status only, so it went on
    serving the old run's figures (λ_i^t half the stored values here) for as long as anyone watched."""
    url = _copy(store, tmp_path)
    rid = store[1]["topk"]
    with _Served(url, refresh_s=0.2) as s:
        (before,) = _plots(s.data(rid), "NSA Fig. 2a").values()
        g = zarr.open_group(url, mode="r+")["runs"][rid]
        g["eigenvalues"][:] = 2 * g["eigenvalues"][:]  # the new recording's numbers …
        g.attrs["created"] = g.attrs["updated"] = time.time()  # … in a run created anew
        lam, steps = g["eigenvalues"][:], g["steps"][:]
        deadline = time.monotonic() + 300  # a rebuild at 5–10× load; stops once shown
        while True:
            time.sleep(0.3)
            (now,) = _plots(s.data(rid), "NSA Fig. 2a").values()
            if np.array_equal(now[f"t = {steps[0]}"][1], lam[0]) or time.monotonic() > deadline:
                break
    for i, t in enumerate(steps):
        np.testing.assert_array_equal(now[f"t = {t}"][1], lam[i], err_msg=f"t = {t}: the old run's λ still shown")
    assert not np.array_equal(before[f"t = {steps[0]}"][1], lam[0])


@pytest.fixture(scope="module")
def sweep_store(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("sweep") / "sw.zarr")
    base = dict(
        name="sw",
        data={"n": 16, "n_test": 4},
        steps=4,
        model={"depth": 2, "width": 8},
        record={"every": 2},
        spectrum={"k": 4},
    )
    sweep = SweepSpec(name="widths", base=base, grid={"model.width": [6, 8]})
    ids = [run_experiment(s, SpectrumStore(url)).run_id for s in sweep.expand()]
    SpectrumStore(url).record_sweep("widths", sweep.model_dump(mode="json"), ids)
    return url


def test_a_sweep_that_cannot_be_read_any_more_says_so_on_its_page(sweep_store, tmp_path, monkeypatch):
    """The sweep's page open, then its sweep deleted from the store.

    Before: the refresh's error was dropped — the page went on showing the last figures and its
    header ("2 runs, 2 with a finished step") as if they were current, with no word of it."""
    from bokeh.document import Document

    import nsa_dist.serve._live as live
    from nsa_dist.serve.sweep_page import sweep_page

    url = str(tmp_path / "sw.zarr")
    shutil.copytree(sweep_store, url)
    ticks = {}
    monkeypatch.setattr(live, "every", lambda doc, period, read, apply, lock=None: ticks.update(read=read, apply=apply))
    doc = Document()
    sweep_page(SpectrumStore(url, mode="r"), 0.05).build({"name": "widths"})(doc)
    header, *rest = doc.roots[0].children
    figures = rest[1:]
    assert "sweep widths" in header.text and all(f.visible for f in figures)
    shutil.rmtree(Path(url) / "sweeps" / "widths")
    time.sleep(0.1)
    ticks["apply"](ticks["read"]())  # one refresh, as the page's periodic callback runs it
    assert "cannot read sweep widths" in header.text and "no sweep" in header.text, header.text
    assert not any(f.visible for f in figures), "the last state's figures still shown as current"


def test_a_step_whose_energy_is_nan_has_no_bracket_width_either(tmp_path) -> None:
    """A Tracker loop that ends right after record(12): E_12(df, k) is NaN (update 12 not seen), and the
    heat map of bracket widths showed 0 there — "exact" — and ``Run.bracket_widths`` k = 0 (an audit)."""
    import pandas as pd
    import torch
    from torch import nn

    from nsa_dist import Client, Tracker
    from nsa_dist.serve._nsa_panels import _EnergyMap

    torch.manual_seed(0)
    X = torch.rand(40, 2)
    y = torch.sin(3 * X[:, 0]) + X[:, 1] ** 2
    model = nn.Sequential(nn.Linear(2, 12), nn.Tanh(), nn.Linear(12, 1), nn.Flatten(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    url = str(tmp_path / "t.zarr")
    tr = Tracker(url, "ends", model, X, y, steps=13, record={"every": 4}, spectrum={"k": "all", "images": []})
    for t in range(13):
        loss = 0.5 * ((model(X) - y) ** 2).mean()
        if tr.due(t):
            tr.record(t, lr=opt, loss=loss.item())
        if t == 12:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    tr.close()
    run = Client(url).run("ends")
    assert list(run.steps) == [0, 4, 8, 12] and np.isnan(run.energy("df")[-1]).all()
    maps = _EnergyMap.read(run.curve("energy_df"))
    value, width = (np.asarray(m["v"], float).reshape(4, -1) for m in maps["maps"])
    assert np.isnan(value[-1]).all() and np.isnan(width[-1]).all(), width[-1]
    assert np.isfinite(width[:-1]).all() and maps["wide"] == np.nanmax(width)
    bw = run.bracket_widths("df").set_index("step")
    assert bw.loc[12, "k"] is pd.NA and bw.loc[0, "k"] > 0, bw
