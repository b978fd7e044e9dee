"""``nsa serve`` without a browser (issue 21): the table's rows, the safe defaults, damage shown
on the page, never a write, every figure of ``nsa plot`` as a panel of the run's or the sweep's
page with the data the client reads, store strings escaped (issue 33) — and ``nsa export
--tensorboard`` read back with TensorBoard's reader."""

from __future__ import annotations

import hashlib
import html
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from test_s3 import s3_env  # noqa: F401  (the moto S3 server on loopback)

from nsa_dist import Client
from nsa_dist.cli import main as nsa
from nsa_dist.config import ExperimentSpec
from nsa_dist.errors import ServeError, StoreError
from nsa_dist.pipeline import run_experiment, run_id
from nsa_dist.serve import ServeOptions, is_loopback, make_server
from nsa_dist.store import SpectrumStore, run_summaries

SPEC = ExperimentSpec(
    name="served",
    data={"n": 24, "n_test": 8},
    steps=8,
    model={"depth": 2, "width": 12, "init": "ntk", "regime": "ntk", "activation": "tanh"},
    record={"every": 4},
    spectrum={"k": 6, "images": [1, 2], "image_size": 5, "fourier_size": 4, "test_points": True, "gram_change_k": 3},
    hessian={"probes": 4, "rayleigh_k": 3, "top_k": 1, "density": True},
)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A store holding one finished run of SPEC (image data: eigenvector images; a Hessian block)."""
    url = str(tmp_path_factory.mktemp("serve") / "s.zarr")
    assert run_experiment(SPEC, SpectrumStore(url)).status == "done"
    return url


def _tree(url: str) -> dict[str, tuple[str, int]]:
    """Every file of a local store: its content hash and mtime."""
    return {
        str(p.relative_to(url)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(Path(url).rglob("*"))
        if p.is_file()
    }


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kw):
        return None  # the 3xx answer itself is returned (as an HTTPError)


class _Served:
    """A server of ``opts`` on its own IO loop thread, stopped on exit."""

    def __init__(self, opts: ServeOptions, **server_kw) -> None:
        self.server = make_server(opts, **server_kw)
        self.server.start()
        self.thread = threading.Thread(target=self.server.io_loop.start, daemon=True)

    def __enter__(self) -> _Served:
        self.thread.start()
        return self

    def get(self, path: str, headers: dict | None = None, follow: bool = True) -> tuple[int, str, dict]:
        """(status, body, headers) of GET ``path``; ``follow``: follow a redirect (else its answer)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.server.port}{path}", headers=headers or {})
        opener = urllib.request.build_opener(*(() if follow else (_NoRedirect(),)))
        try:
            with opener.open(req, timeout=60) as r:
                return r.status, r.read().decode(), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(), dict(e.headers)

    def __exit__(self, *exc) -> None:
        self.server.io_loop.add_callback(self.server.io_loop.stop)
        self.thread.join(timeout=10)
        self.server.stop()


# --------------------------------------------------------------------------- the table's rows
def test_run_summaries_give_what_the_client_reads(store):
    run = Client(store).run("served")
    (s,) = run_summaries(SpectrumStore(store, mode="r"))
    assert (s.id, s.status, s.steps_done, s.steps_total, s.last_step) == (run.id, "done", 3, 3, int(run.steps[-1]))
    assert s.loss == float(run.train_loss[-1]) and s.lambda_max == float(run.lambda_max[-1])
    (quick,) = run_summaries(SpectrumStore(store, mode="r"), steps=False)
    assert quick.steps_done is None and quick.steps_total == 3 and quick.spec == s.spec


def test_the_run_table_reads_the_steps_again_only_for_live_or_changed_runs(store, tmp_path):
    from nsa_dist.serve.table import RunTable

    table = RunTable(SpectrumStore(store, mode="r"))
    assert [s.steps_done for s in table.quick()] == [None]  # the first listing: metadata only
    assert [s.steps_done for s in table.refresh()] == [3]
    assert [s.steps_done for s in table.quick()] == [3]  # a finished run keeps its step columns
    cols = table.columns(table.refresh(), ["model.width"])
    assert cols["progress"] == ["3/3"] and cols["model.width"] == ["12"] and cols["id"] == [run_id(SPEC)]


def test_a_damaged_chunk_is_a_row_and_a_panel_message_not_a_crash(store, tmp_path):
    import shutil

    from nsa_dist.serve.run_page import run_panels

    url = str(tmp_path / "d.zarr")
    shutil.copytree(store, url)
    rid = run_id(SPEC)
    chunk = Path(url) / "runs" / rid / "eigenvalues" / "c" / "2" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    (row,) = run_summaries(SpectrumStore(url, mode="r"))
    assert row.status == "damaged" and str(chunk) in row.reason, row.reason
    run = Client(url).run(rid)
    panels = {type(p).__name__: p for p in run_panels(run)}
    for p in panels.values():
        p.update(p.guarded(run))
    eig = panels["Fig2b"]
    assert eig.error.visible and not eig.body.visible and str(chunk) in eig.error.text, eig.error.text
    assert not panels["Loss"].error.visible and panels["Loss"].body.visible  # the others go on
    with _Served(ServeOptions(url, port=0)) as s:
        assert s.get(f"/run?id={rid}")[0] == 200 and s.get("/")[0] == 200
        shown = _item_texts(_run_data(s, rid))
    assert str(chunk) in html.unescape(shown), shown[:3000]  # the page's panel names the file


def _run_data(s: _Served, rid: str, tab: int = 0, **args: str) -> dict:
    """The answer of ``/run/data`` (what a run's page asks for its header and figures) as JSON."""
    import json
    from urllib.parse import urlencode

    status, body, _ = s.get("/run/data?" + urlencode({"id": rid, "tab": tab, **args}))
    assert status == 200, (status, body[:2000])
    return json.loads(body)


def _item_texts(answer: dict) -> str:
    """Every Div's text of the figures a ``/run/data`` answer carries (a Bokeh document's JSON per panel)."""
    from bokeh.document import Document
    from bokeh.models import Div

    docs = [Document.from_json(item["doc"]) for item in answer["page"]["items"]]
    return " ".join(m.text for doc in docs for m in doc.select({"type": Div}))


# --------------------------------------------------------------------------- a run's page: both papers
def _series(panel, plot: int = 0) -> dict[str, np.ndarray]:
    """The lines a panel's figure ``plot`` draws, by legend label (the last of a repeated label)."""
    d = panel.sources[plot]["lines"].data
    return dict(zip(d["label"], d["ys"]))


def test_every_figure_of_nsa_plot_has_a_panel_on_the_run_page():
    from nsa_dist.plots.registry import FIGURES
    from nsa_dist.serve.run_page import panel_classes

    drawn = [f for cls in panel_classes() for f in cls.figures]
    assert sorted(drawn) == sorted(FIGURES), f"missing {set(FIGURES) - set(drawn)}, unknown {set(drawn) - set(FIGURES)}"
    titles = [cls.title for cls in panel_classes()]
    assert all(t.startswith(("NSA ", "Hessian paper", "Loss")) for t in titles), titles


def test_the_run_page_draws_what_nsa_plot_draws_with_the_predictions(store):
    from nsa_dist.plots.registry import _FIGURES
    from nsa_dist.serve.run_page import run_sections

    run = Client(store).run("served")
    sections = run_sections(run)
    assert list(sections) == ["NSA paper", "Hessian paper"]
    panels = {f: p for ps in sections.values() for p in ps for f in p.figures}
    want = [name for name, (_, needs) in _FIGURES.items() if needs(run)]
    assert len(want) == len(_FIGURES), [n for n in _FIGURES if n not in want]  # SPEC has every figure's data
    assert set(want) <= set(panels), set(want) - set(panels)
    for p in {id(p): p for p in panels.values()}.values():
        p.update(p.guarded(run))
        assert not p.error.visible and not p.waiting.visible, (p.title, p.error.text, p.waiting.text)
    h, t = run.hessian, run.hessian.steps
    moments = panels["hessian_moments"]
    for k in range(4):  # the measurements and each prediction the run stores, in every Tr(A^k) panel
        got = _series(moments, k)
        np.testing.assert_array_equal(got["S (Hutch++)"], h.moments("S")["estimate"][:, k])
        np.testing.assert_array_equal(got["I exact (NTK Gram)"], h.moments("I_exact")["estimate"][:, k])
        np.testing.assert_array_equal(got["I limit (Θ∞, kernel PCA)"], h.moments("I_limit")["estimate"][:, k])
    np.testing.assert_array_equal(_series(moments, 0)["S limit: E[Tr S_t] (MSE GD)"], h.S_limit()["trace_S"])
    np.testing.assert_array_equal(_series(moments, 1)["S limit: ∇CᵀΥ̃∇C"], h.S_limit()["trace_S2"])
    trace = _series(panels["hessian_trace_S"])
    np.testing.assert_array_equal(trace["limit E[Tr S] at init = K Tr(Φ̃)/N"], h.S_limit()["trace_S_init"][:1])
    assert len(t) and np.isfinite(h.S_limit()["trace_S"]).all()
    energy = panels["fig3a_energy_y"]
    assert energy.plots[1].x_log and energy.phi.value == "y"
    steps = run.steps
    assert energy.pick.value == []  # nothing picked: the first, middle and last, following a live run
    against_k = _series(energy, 1)
    assert list(against_k) == [f"t = {s}" for s in (steps[0], steps[len(steps) // 2], steps[-1])]
    for j, s in enumerate(steps):
        np.testing.assert_array_equal(against_k[f"t = {s}"], run.energy("y")[j])  # E_t(y, ·) over log k
    energy.pick.value = [str(steps[-1])]
    energy.phi.value = "df_pred"
    energy.update(energy.guarded(run))
    assert list(_series(energy, 1)) == [f"t = {steps[-1]}"]
    assert "k = 1, real df̃" in _series(energy, 0)  # Fig. 3d: the real update dashed beside the first-order one
    eqs = _series(panels["eqs45_constant_gram"])
    pred = run.array("constant_gram_residual")
    np.testing.assert_array_equal(
        eqs["Eq. 5 with G_0 fixed"], pred[[int(np.flatnonzero(run.schedule == s)[0]) for s in steps], 0]
    )
    lines = panels["fig1e_lr_stability"].sources[0]["lines"].data
    x, y = np.asarray(lines["xs"][0]), np.asarray(lines["ys"][0])  # δ_t: the schedule's staircase, as nsa plot
    assert x[0] == 0 and x[-1] == steps[-1] and np.allclose(y, run.lr[0]), (x, y)


def test_the_eigenvector_panel_draws_every_stored_image(tmp_path):
    """Images v_1 … v_6 only were drawn of [1, …, 6, 8, 10] (a cap of six, not said), where `nsa plot
    fig5` draws all: every stored one now, six to a row, each above its |Fourier|."""
    from nsa_dist.serve._eigvec_panel import Eigenvectors

    url = str(tmp_path / "im.zarr")
    spec = ExperimentSpec(
        name="images",
        data={"n": 24},
        steps=2,
        model={"depth": 2, "width": 8},
        record={"every": 2},
        spectrum={"k": 10, "images": [1, 2, 3, 4, 5, 6, 8, 10], "image_size": 4, "fourier_size": 3},
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run("images")
    panel = Eigenvectors(run)
    panel.update(panel.guarded(run))
    assert not panel.error.visible, panel.error.text
    at = run.images.at(run.steps[-1])
    titles = [v.fig.title.text for v in panel.vecs]
    assert titles == [f"v_{i}" for i in (1, 2, 3, 4, 5, 6, 8, 10)], titles
    floor = 1.0 / 24  # a unit eigenvector's sampling s.e.: the |Fourier| panels' log scale starts there
    for v, img, f, fft in zip(panel.vecs, at["eigvec_images"], panel.ffts, at["eigvec_fourier"]):
        np.testing.assert_array_equal(v.source.data["image"][0], img)
        np.testing.assert_array_equal(f.source.data["image"][0], np.clip(np.asarray(fft, np.float64).T, floor, None))
        assert type(f.mapper).__name__ == "LogColorMapper" and f.mapper.low == floor, (f.mapper, f.mapper.low)
        assert f.mapper.high == max(float(np.max(fft)), 10 * floor)
    m = np.asarray(run.outputs(run.steps[-1]), np.float64).reshape(-1) - np.asarray(run.y, np.float64).reshape(-1)
    assert np.isclose(panel.residual[1].mapper.low, np.linalg.norm(m) / 24, rtol=1e-6), panel.residual[1].mapper.low
    widths = [len(r.children) for r in panel.body.children[1:]]  # below the slider row
    assert widths == [2, 6, 6, 2, 2], widths  # the residual and its |Fourier|, then images over transforms


@pytest.mark.slow  # an NCE run of its own
def test_an_nce_runs_page_draws_what_nsa_plot_draws(tmp_path):
    from nsa_dist.plots.axes import gd_note
    from nsa_dist.plots.registry import _FIGURES
    from nsa_dist.serve.run_page import run_sections

    url = str(tmp_path / "nce.zarr")
    spec = ExperimentSpec(
        name="nce",
        loss="nce",
        data={"name": "density2d", "n": 40, "n_test": 12},
        model={"depth": 2, "width": 12},
        steps=8,
        record={"every": 4},
        spectrum={"k": 6, "images": [1, 2], "image_size": 5, "fourier_size": 4, "test_points": True},
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run("nce")
    sections = run_sections(run)
    assert list(sections) == ["NSA paper"]  # no hessian block: no Hessian tab
    panels = {f: p for p in sections["NSA paper"] for f in p.figures}
    want = {name for name, (_, needs) in _FIGURES.items() if needs(run)}
    assert want <= set(panels), want - set(panels)
    for p in sections["NSA paper"]:
        p.update(p.guarded(run))
        assert not p.error.visible and not p.waiting.visible, (p.title, p.error.text, p.waiting.text)
    fig1e = panels["fig1e_lr_stability"]
    assert fig1e.note.visible and fig1e.note.text == html.escape(gd_note(run))  # GD's bound is an L2 formula


def test_eqs45_says_where_its_prediction_diverges(store, tmp_path):
    import shutil

    import zarr

    from nsa_dist.serve._nsa_panels import Eqs45

    url = str(tmp_path / "diverging.zarr")  # as GD with G fixed diverges above 2N/λ_max(G_t0)
    shutil.copytree(store, url)
    g = zarr.open_group(str(Path(url) / "runs" / run_id(SPEC)), mode="r+")
    pred = g["constant_gram_residual"][:]
    pred[1:, 0] = np.inf
    g["constant_gram_residual"][:] = pred
    run = Client(url).run("served")
    p = Eqs45(run)
    p.update(p.guarded(run))
    assert not p.error.visible and p.note.visible, p.error.text
    assert f"not finite from t = {int(run.steps[1])}" in p.note.text, p.note.text
    assert np.isnan(_series(p)[f"Eq. 5 with G_{int(run.schedule[0])} fixed"][1:]).all()  # not drawn (log axis)


def test_a_run_page_waits_for_its_first_step_and_for_data_written_at_the_end(store, tmp_path):
    """A run's page opened before the run finished: panels whose data is not there yet say so
    (a note, not an error)."""
    from nsa_dist.serve._live import Waiting
    from nsa_dist.serve.run_page import _read, run_panels

    run = Client(store).run("served")
    panels = run_panels(run)
    run.finished = run.finished[:0]  # as a reader sees a run before its first finished step
    for p in panels:
        got = _read(p, run)
        assert isinstance(got, Waiting), (p.title, got)
        p.update(got)
        assert p.waiting.visible and not p.error.visible and not p.body.visible


def test_the_run_page_is_a_document_with_a_tab_per_paper(store):
    """A tab per paper; the open tab's panels come with the page, another's when it is opened."""
    nsa_numbers = ("NSA Fig. 1e", "NSA Fig. 3a–e", "NSA Fig. 4a", "NSA Fig. 7d", "NSA Eqs. 4–5", "NSA App. F")
    hessian_numbers = ("Hessian paper Fig. 1", "Hessian paper Fig. 3", "Theorem 1", "Proposition 4")
    with _Served(ServeOptions(store, port=0)) as s:
        answer = _run_data(s, "served")
        tabs, first = answer["tabs"], _item_texts(answer)
        builds = s.server.nsa_shared.reads["build"]
        opened = _item_texts(_run_data(s, "served", tab=1))
    assert tabs == ["NSA paper", "Hessian paper"], tabs
    for number in nsa_numbers:
        assert number in first, number
    assert not any(n in first for n in hessian_numbers), first  # built when opened
    assert builds == 1, builds
    for number in hessian_numbers:
        assert number in opened, (number, opened[:2000])


def test_store_strings_are_escaped_on_every_page(store, tmp_path):
    import dataclasses
    import json
    import shutil

    import zarr
    from bokeh.models import Div

    from nsa_dist.serve._live import Panel
    from nsa_dist.serve.run_page import header_text
    from nsa_dist.serve.table import RunTable, _count_text, _sweep_links

    evil = '<img src=x onerror="alert(1)">'
    run = Client(store).run("served")
    run.id, run.status, run.reason = evil, evil, evil
    text = header_text(run)
    assert "<img" not in text and text.count("&lt;img src=x onerror=&quot;alert(1)&quot;&gt;") == 3, text
    links = _sweep_links({evil: ["a"]})
    assert "<img" not in links and 'href="sweep?name=%3Cimg%20src%3Dx' in links, links
    # a sweep names its runs before they start: the header counts those the table lists yet
    assert "(1 of 3 runs)" in _sweep_links({"s": ["a", "b", "c"]}, {"a", "z"})
    assert "(3 runs)" in _sweep_links({"s": ["a", "b", "c"]}, {"a", "b", "c"})
    (row,) = run_summaries(SpectrumStore(store, mode="r"))
    row = dataclasses.replace(row, id=evil, status=evil)
    assert "<img" not in _count_text([row])
    cols = RunTable(SpectrumStore(store, mode="r")).columns([row], [])
    assert cols["href"] == ["run?id=%3Cimg%20src%3Dx%20onerror%3D%22alert%281%29%22%3E"], cols["href"]
    url = str(tmp_path / "noted.zarr")  # a diagnostic's reason, as the store keeps it for a NaN
    shutil.copytree(store, url)
    zarr.open_group(str(Path(url) / "runs" / run_id(SPEC)), mode="r+")["step_notes"][0] = json.dumps(
        {"constant_gram_residual": evil}
    )
    noted = Client(url).run("served")
    assert noted.notes == {0: {"constant_gram_residual": evil}}
    text = header_text(noted)
    assert "<img" not in text and "t = 0, constant_gram_residual: &lt;img src=x" in text, text
    p = Panel(Div(text=""))
    p.update(ValueError(evil))  # a read's error message (it may quote the store) shown in place of a figure
    assert "<img" not in p.error.text and "&lt;img" in p.error.text


# --------------------------------------------------------------------------- safe by default
def test_a_non_loopback_bind_needs_allow_remote_and_a_token(capsys):
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0")
    with pytest.raises(ServeError, match="not a loopback address: pass --allow-remote and a --token"):
        ServeOptions("x.zarr", host="0.0.0.0").check()
    with pytest.raises(ServeError, match="needs a --token"):
        ServeOptions("x.zarr", host="0.0.0.0", allow_remote=True).check()
    ServeOptions("x.zarr", host="0.0.0.0", allow_remote=True, token="s3cret").check()
    assert nsa(["serve", "x.zarr", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refusing to listen on '0.0.0.0'" in err[0], err


def test_every_request_must_carry_the_token(store):
    with _Served(ServeOptions(store, port=0, token="s3cret")) as s:
        assert s.get("/")[0] == 403
        assert s.get("/?token=wrong")[0] == 403
        for path, to in (
            ("/?token=s3cret", "/"),
            (f"/run?id={run_id(SPEC)}&token=s3cret&x=1", f"/run?id={run_id(SPEC)}&x=1"),
        ):
            # the token goes into an HttpOnly cookie and out of the address: a redirect to the page without it
            status, body, headers = s.get(path, follow=False)
            assert status == 302 and headers.get("Location") == to, (path, status, headers)
            cookie = headers.get("Set-Cookie", "")
            assert "nsa_serve_token=s3cret" in cookie and "httponly" in cookie.lower(), headers
        assert s.get(f"/run?id={run_id(SPEC)}", {"Cookie": "nsa_serve_token=s3cret"})[0] == 200
        assert s.get(f"/run/data?id={run_id(SPEC)}", {"Cookie": "nsa_serve_token=s3cret"})[0] == 200
        assert s.get("/run?id=x", {"Cookie": "nsa_serve_token=nope"})[0] == 403
        for path in (f"/run/data?id={run_id(SPEC)}", "/run/data?id=x&token=wrong"):
            assert s.get(path)[0] == 403 and s.get(path, {"Cookie": "nsa_serve_token=nope"})[0] == 403


def test_serving_never_writes_to_the_store(store):
    before = _tree(store)
    with _Served(ServeOptions(store, port=0, refresh_s=0.2)) as s:
        for path in (
            "/",
            f"/run?id={run_id(SPEC)}",
            f"/run/data?id={run_id(SPEC)}",
            f"/run/data?id={run_id(SPEC)}&tab=1",
            "/run/data?id=nosuchrun",
            "/sweep?name=nosuchsweep",
        ):
            assert s.get(path)[0] == 200
        threading.Event().wait(1.0)  # the pages' periodic re-reads run meanwhile
    assert _tree(store) == before


def test_a_port_in_use_is_a_serve_error(store):
    with _Served(ServeOptions(store, port=0)) as s:
        with pytest.raises(ServeError, match=f"cannot listen on 127.0.0.1:{s.server.port}"):
            make_server(ServeOptions(store, port=s.server.port))


def test_a_missing_store_is_one_line(tmp_path, capsys):
    assert nsa(["serve", str(tmp_path / "none.zarr"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no spectrum store at" in err[0], err


# --------------------------------------------------------------------------- export
def test_export_reads_back_with_tensorboards_reader(store, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    from nsa_dist.export import PER_ITEM_DIMS, scalar_series, scalar_sources

    logdir = tmp_path / "tb"
    assert nsa(["export", "served", "--tensorboard", str(logdir), "--store", store]) == 0
    run = Client(store).run("served")
    acc = EventAccumulator(str(logdir / run.id), size_guidance={"tensors": 0, "histograms": 0})
    acc.Reload()
    series = list(scalar_series(run))
    tags = [t for t, _, _ in series]
    assert len(tags) == len(set(tags)), sorted(t for t in tags if tags.count(t) > 1)
    predictions = {
        "loss/train",
        "spectrum/lambda_max",
        "energy_y/k_5",
        "hessian/Tr(S^2)_stderr",
        "first_order/error",
        "constant_gram_residual/predicted",
        "constant_gram_energy/k_1",
        "app_E/test_residual/predicted",
        "gram_change_fro/first_order",
        "hessian_S_limit/trace_S2",
        "hessian_S_limit/trace_S_init",
        "hessian_I_limit_moments/moment_2",
        "hessian_orthogonality/value",
        "hessian_additivity/value/moment_2",
        "hessian_trace_S_G/value",
        "hessian_moments_I_exact/moment_1",
    }
    assert predictions <= set(tags), predictions - set(tags)
    # every per-step numeric array of the store is exported, unless it holds one value per point /
    # pixel / parameter — the list comes from the store, so that a new array cannot be missed
    exported = {src.array for src in scalar_sources(run)}
    skipped = []
    for name in run.array_names():
        dims = run.dimension_names(name)
        if dims[:1] != ("step",) or name in ("steps", "done") or run.g[name].dtype.kind not in "fiu":
            continue
        if name not in exported:
            skipped.append(name)
            assert PER_ITEM_DIMS & set(dims[1:]), f"{name} {dims} is a scalar series the export leaves out"
    assert len(exported) >= 30 and len(skipped) >= 10, (sorted(exported), skipped)
    # each exported series is the stored column, bitwise, at the steps it is written at
    schedule = {int(t): i for i, t in enumerate(run.schedule)}
    by_tag = {t: (steps, v) for t, steps, v in series}
    for src in scalar_sources(run):
        if src.array is None:
            continue
        steps, v = by_tag[src.tag]
        want = run.array(src.array)[[schedule[int(t)] for t in steps]][(slice(None),) + src.index]
        np.testing.assert_array_equal(v, want.astype(np.float64), err_msg=src.tag)
        written = run.hessian.steps if src.array.startswith("hessian_") else run.steps
        assert set(steps.tolist()) <= set(written.tolist()), src.tag
    assert set(acc.Tags()["tensors"]) == {t for t, _, v in series if np.isfinite(v).any()}
    for tag, t, v in series:
        ok = np.isfinite(v)
        if not ok.any():
            continue
        events = acc.Tensors(tag)
        assert [e.step for e in events] == t[ok].tolist(), tag
        got = np.array([tensor_util.make_ndarray(e.tensor_proto) for e in events], np.float64)
        np.testing.assert_array_equal(got, v[ok], err_msg=tag)  # float64, exact
        assert acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars", tag
    np.testing.assert_array_equal([e.step for e in acc.Tensors("loss/train")], np.arange(SPEC.steps))
    for tag, steps, spectra in (
        ("spectrum/eigenvalues", run.steps, run.eigenvalues),
        ("hessian/I_limit_eigenvalues", run.hessian.steps, run.hessian.I_eigenvalues(limit=True)),
    ):
        hist = acc.Histograms(tag)
        assert [h.step for h in hist] == steps.tolist(), tag
        for h, lam in zip(hist, spectra):
            np.testing.assert_array_equal(h.histogram_value.bucket_limit, np.sort(lam))  # the spectrum, unbinned
            assert h.histogram_value.num == len(lam)
    capsys.readouterr()
    # the same export again (the same finished steps: a killed `nsa export --sweep` run again) is kept,
    # not refused; an export of other steps into the folder is refused (it would interleave)
    events = sorted(p.name for p in (logdir / run.id).iterdir())
    assert nsa(["export", "served", "--tensorboard", str(logdir), "--store", store]) == 0
    assert "exported already (the same finished steps): kept" in capsys.readouterr().out
    assert sorted(p.name for p in (logdir / run.id).iterdir()) == events
    mark = logdir / run.id / "nsa-export.json"
    mark.write_text(mark.read_text().replace('"steps": [0', '"steps": [7'))
    assert nsa(["export", "served", "--tensorboard", str(logdir), "--store", store]) == 2
    assert "holds TensorBoard event files already" in capsys.readouterr().err
    with pytest.raises(StoreError, match="no run 'nosuch'"):
        Client(store).run("nosuch")


# --------------------------------------------------------------------------- a sweep's page
@pytest.fixture(scope="module")
def sweep_store(tmp_path_factory) -> str:
    """A sweep over model.width (8, 12) of SPEC, its Hessian block included."""
    from nsa_dist.config import SweepSpec

    url = str(tmp_path_factory.mktemp("sweep") / "sw.zarr")
    base = SPEC.model_dump(mode="json")
    base["hessian"].update(rayleigh_k=0, density=False)
    base["spectrum"].update(images=[], gram_change_k=0)
    base["model"].update(init="ntk", regime="ntk")  # the Θ∞ limits apply
    sweep = SweepSpec(name="widths", base=base, grid={"model.width": [8, 12]})
    ids = [run_experiment(s, SpectrumStore(url)).run_id for s in sweep.expand()]
    SpectrumStore(url).record_sweep("widths", sweep.model_dump(mode="json"), ids)
    return url


def test_the_sweep_page_draws_every_sweep_figure_per_selected_grid_point(sweep_store):
    from nsa_dist.plots.axes import energy_k
    from nsa_dist.plots.sweep import HESSIAN_SWEEP_FIGURES, SWEEP_FIGURES
    from nsa_dist.serve.sweep_page import default_k, sweep_panels

    sw = Client(sweep_store).sweep("widths")
    panels = sweep_panels(sw)
    drawn = {f for p in panels for f in p.figures}
    every = set(SWEEP_FIGURES) | set(HESSIAN_SWEEP_FIGURES)
    assert drawn == every, f"missing {every - drawn}, unknown {drawn - every}"
    k = default_k(sw)
    assert k == energy_k(sw.smallest_n(), sw.smallest_k()) == 1  # N = 24: the paper's 4 % of N, never N
    both = (sw, k, {"model.width": ["8", "12"]})
    for p in panels:
        p.update(p.guarded(both))
        assert not p.error.visible and not p.waiting.visible, (p.title, p.error.text, p.waiting.text)
        assert all(len(src["lines"].data["xs"]) for src in p.sources), p.title
    by = {f: p for p in panels for f in p.figures}
    fig7a = by["fig7a_energy_y"]
    line = dict(zip(fig7a.sources[0]["lines"].data["label"], fig7a.sources[0]["lines"].data["ys"]))
    for c in sw.curves("energy_y", k):
        np.testing.assert_array_equal(line[c.label], c.mean)  # the curves of `nsa plot --sweep`
    assert fig7a.figs[0].yaxis.axis_label == f"E_t(y, {k})"
    fig7b = by["fig7b_train_loss"]
    fig7b.update(fig7b.guarded((sw, k, {"model.width": ["12"]})))  # the selector keeps one grid point
    assert fig7b.sources[0]["lines"].data["label"] == ["width=12"]
    moments = by["hessian_moments_S"]
    got = dict(zip(moments.sources[1]["lines"].data["label"], moments.sources[1]["lines"].data["ys"]))
    for c in sw.curves("hessian_S", 2):
        np.testing.assert_array_equal(got[c.label], c.mean)  # Tr(S²) per grid point
    with _Served(ServeOptions(sweep_store, port=0)) as s:
        assert s.get("/sweep?name=widths")[0] == 200
    from nsa_dist.serve.run_page import run_panels

    run = sw.run(sw.groups()[0][1][0])  # data without 2-D images: V_t itself in place of Figs. 4b–c, 5–6
    for p in run_panels(run):
        p.update(p.guarded(run))
        assert not p.error.visible and not p.waiting.visible, (p.title, p.error.text, p.waiting.text)
    assert any(p.title.startswith("Eigenvectors V_t") for p in run_panels(run))


# --------------------------------------------------------------------------- s3://
def test_the_table_and_a_run_page_read_an_s3_store(store, s3_env):
    import boto3
    from test_s3 import _bucket

    bucket = _bucket(s3_env)
    s3 = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"])
    for p in Path(store).rglob("*"):
        if p.is_file():
            s3.put_object(Bucket=bucket, Key=f"s.zarr/{p.relative_to(store)}", Body=p.read_bytes())
    url = f"s3://{bucket}/s.zarr"
    remote, local = (run_summaries(SpectrumStore(u, mode="r")) for u in (url, store))
    assert remote == local
    from nsa_dist.serve.run_page import run_panels

    run = Client(url).run("served")
    for p in run_panels(run):
        p.update(p.guarded(run))
        assert not p.error.visible, p.error.text
    with _Served(ServeOptions(url, port=0)) as s:
        assert s.get("/")[0] == 200 and s.get(f"/run?id={run_id(SPEC)}")[0] == 200
        assert "NSA" in _item_texts(_run_data(s, run_id(SPEC)))


def test_a_flat_curve_is_served_flat() -> None:
    """E(y, N) ≡ 1 to rounding: the linear axis keeps at least ±5 % of the value instead of
    stretching 1e-15 of noise over the figure (a zig-zag); a curve that moves autoscales as before."""
    pytest.importorskip("bokeh")
    from nsa_dist.serve._curves import Curves, Plot, Series, flat_interval

    t = np.arange(6.0)
    flat = [Series(t, 1.0 + 1e-15 * np.array([0, 1, -1, 1, 0, -1]), "E(y, N)")]
    assert flat_interval(flat, Plot("t", "E")) == pytest.approx(0.1)
    assert flat_interval([Series(t, np.zeros(6), "0")], Plot("t", "E")) == pytest.approx(0.1)
    assert flat_interval([Series(t, t / 10, "moving")], Plot("t", "E")) is None
    assert flat_interval(flat, Plot("t", "E", y_log=True)) is None

    class Flat(Curves):
        plots = (Plot("t", "E"),)

        def series(self, run):
            return [self.curves]

    panel = Flat()
    panel.curves = flat
    panel.show(panel.read(None))
    assert panel.figs[0].y_range.min_interval == pytest.approx(0.1)
    panel.curves = [Series(t, t / 10, "moving")]
    panel.show(panel.read(None))
    assert panel.figs[0].y_range.min_interval is None


# --------------------------------------------------------------------------- a store is untrusted input
def test_a_run_id_is_looked_up_among_the_listed_runs_never_as_a_path(store, tmp_path):
    import shutil

    from nsa_dist.serve.run_page import UNKNOWN_RUN, open_run

    url = tmp_path / "in" / "s.zarr"
    shutil.copytree(store, url)
    outside = url.parent / "secret"  # a Zarr group outside the store, where runs/../../secret points
    shutil.copytree(url / "runs" / run_id(SPEC), outside)
    sneaky = "../../secret"
    assert (url / "runs" / sneaky / "zarr.json").is_file()
    opened = SpectrumStore(str(url), mode="r")
    assert open_run(opened, run_id(SPEC)[:6]).id == run_id(SPEC) and open_run(opened, "served").id == run_id(SPEC)
    for rid in (sneaky, "../../nothing", "", "nosuchrun", "/etc", "runs/../" + run_id(SPEC)):
        with pytest.raises(LookupError) as got:
            open_run(opened, rid)
        assert str(got.value) == UNKNOWN_RUN, (rid, str(got.value))
    with _Served(ServeOptions(str(url), port=0)) as s:
        pages = {rid: _run_data(s, rid) for rid in (sneaky, "../../nothing")}
    assert pages[sneaky] == pages["../../nothing"], pages  # one fixed message: nothing told of the filesystem
    message = pages[sneaky]["message"]
    assert UNKNOWN_RUN in message and str(tmp_path) not in message and set(pages[sneaky]) == {"message"}, message


def test_a_pages_session_token_never_carries_the_serve_token(store):
    import re

    from bokeh.util.token import get_token_payload

    with _Served(ServeOptions(store, port=0, token="s3cret")) as s:
        pages = [
            s.get("/sweep?name=x", {"Cookie": "nsa_serve_token=s3cret; other=1"}),
            s.get("/?token=s3cret&x=1", {"Cookie": "nsa_serve_token=s3cret"}),
        ]
        run_pages = [
            s.get(f"/run?id={run_id(SPEC)}&x=1", {"Cookie": "nsa_serve_token=s3cret; other=1"}),
            s.get(f"/run/data?id={run_id(SPEC)}&x=1", {"Cookie": "nsa_serve_token=s3cret; other=1"}),
        ]
    for status, body, headers in run_pages:  # a run's page: static HTML and JSON, no session token at all
        assert status == 200 and "s3cret" not in body and '"token"' not in body, body[:2000]
        assert "s3cret" not in str(headers), headers
    for status, body, _ in pages:
        tokens = re.findall(r'"token":"([^"]+)"', body.replace('\\"', '"'))
        assert status == 200 and len(tokens) == 1, (status, body[:2000])
        payload = get_token_payload(tokens[0])
        assert "s3cret" not in repr(payload) and "s3cret" not in body, payload  # what the page's script sees
        assert payload["cookies"] == {} and "Cookie" not in payload["headers"], payload
    assert payload["arguments"].keys() == {"x"}, payload  # the other query arguments still reach the page


def _upgrade(port: int, path: str, headers: str = "") -> str:
    """The status line the server answers a websocket upgrade request for ``path`` with."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(
            (
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n{headers}\r\n"
            ).encode()
        )
        return sock.recv(4096).decode(errors="replace").split("\r\n")[0]


def test_a_websocket_without_the_token_is_refused_quietly(store, caplog):
    import logging
    import re

    caplog.set_level(logging.INFO)
    with _Served(ServeOptions(store, port=0, token="s3cret")) as s:
        caplog.clear()
        got = [
            _upgrade(s.server.port, path, h)
            for path, h in (
                ("/ws", ""),
                ("/sweep/ws", "Sec-WebSocket-Protocol: bokeh, x\r\n"),
                ("/ws", "Cookie: nsa_serve_token=nope\r\n"),
            )
        ]
        threading.Event().wait(0.3)  # the server logs after it answers
        body = s.get("/sweep?name=x", {"Cookie": "nsa_serve_token=s3cret"})[1]
        (session_token,) = re.findall(r'"token":"([^"]+)"', body.replace('\\"', '"'))
        admitted = _upgrade(
            s.server.port,
            "/sweep/ws",
            f"Cookie: nsa_serve_token=s3cret\r\nSec-WebSocket-Protocol: bokeh, {session_token}\r\n",
        )
    assert got == ["HTTP/1.1 403 Forbidden"] * 3 and admitted == "HTTP/1.1 101 Switching Protocols", (got, admitted)
    logged = [r for r in caplog.records if "/ws" in r.getMessage() or r.exc_info]
    refused = logged[:3]
    assert [r.getMessage().split()[:3] for r in refused] == [
        ["403", "GET", "/ws"],
        ["403", "GET", "/sweep/ws"],
        ["403", "GET", "/ws"],
    ], [r.getMessage() for r in logged]
    assert not any(r.exc_info for r in refused), [r.getMessage() for r in refused]  # one line each, no traceback


def test_a_malformed_bokeh_websocket_is_refused_quietly(store, caplog):
    """A websocket to a page whose Bokeh subprotocol header is not ``bokeh, <session token>`` (or
    whose token cannot be read) is a 400 before its handshake: one access-log line, no traceback."""
    import logging
    import re

    caplog.set_level(logging.INFO)
    with _Served(ServeOptions(store, port=0)) as s:
        status, body, _ = s.get("/sweep?name=x")
        (session_token,) = re.findall(r'"token":"([^"]+)"', body.replace('\\"', '"'))
        caplog.clear()
        bad = [
            "Sec-WebSocket-Protocol: bokeh, garbage\r\n",
            "Sec-WebSocket-Protocol: nope\r\n",
            "Sec-WebSocket-Protocol: bokeh\r\n",
            "",
            "Sec-WebSocket-Protocol: other, " + session_token + "\r\n",
            "Sec-WebSocket-Protocol: bokeh, e30.e30.x\r\n",
        ]  # a readable token without a session id
        got = [_upgrade(s.server.port, "/sweep/ws", h) for h in bad]
        threading.Event().wait(0.3)  # the server logs after it answers
        admitted = _upgrade(s.server.port, "/sweep/ws", f"Sec-WebSocket-Protocol: bokeh, {session_token}\r\n")
        threading.Event().wait(0.3)
    assert [g.split()[1] for g in got] == ["400"] * len(bad) and admitted == "HTTP/1.1 101 Switching Protocols", (
        got,
        admitted,
    )
    refused = [r for r in caplog.records if "/sweep/ws" in r.getMessage() and "400" in r.getMessage()]
    assert len(refused) == len(bad), [r.getMessage() for r in caplog.records]
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not tracebacks, tracebacks


def _pull(port: int, path: str, **args: str) -> int:
    """A Bokeh client session of page ``path`` (as a browser's BokehJS opens one): the number of
    models of its document; closed on return."""
    from bokeh.client import pull_session

    with pull_session(url=f"http://127.0.0.1:{port}{path}", arguments=args) as session:
        return len(session.document.roots)


def test_viewers_share_the_store_reads_and_the_page_builds(store):
    """Six viewers opened at once of a run's page cost one read of the run, one of each panel the
    open tab shows and one build of each panel's figures — not six of each; three of the table one
    listing.  A viewer that has the newest build gets no figures again; another choice of a
    widget is one more build of that panel only, shared in turn."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from nsa_dist.serve.run_page import run_sections

    run = Client(store).run(run_id(SPEC))
    first_tab = list(run_sections(run).values())[0]
    i = [type(p).__name__ for p in first_tab].index("Fig2a")
    choice = json.dumps({f"{i}.{first_tab[i].controls.index(first_tab[i].pick)}": [str(int(run.steps[1]))]})
    with _Served(ServeOptions(store, port=0, refresh_s=600)) as s:  # no refresh within the test
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: _run_data(s, run_id(SPEC)), range(6)))
            roots = list(pool.map(lambda _: _pull(s.server.port, "/"), range(3)))
        reads = dict(s.server.nsa_shared.reads)
        seen = answers[0]["page"]["seen"]
        again = _run_data(s, run_id(SPEC), have=seen)
        picked = [_run_data(s, run_id(SPEC), c=choice) for _ in range(3)]  # Fig. 2a at the second step
        after = dict(s.server.nsa_shared.reads)
    assert roots == [1] * 3, roots
    n = len(first_tab)
    assert reads == {"open": 1, "run": 1, "panel": n, "item": n, "build": 1, "table-quick": 1}, reads
    assert all(a == answers[0] for a in answers), "the viewers got different pages"
    assert again["page"]["items"] is None and again["page"]["seen"] == seen and again["header"], again
    assert after["build"] == 2 and after["panel"] == n + 1 and after["item"] == n + 1, after  # Fig. 2a's only
    items, before = picked[0]["page"]["items"], answers[0]["page"]["items"]
    assert picked[0] == picked[1] == picked[2] and len(items) == len(before) == n, (len(items), len(before), n)
    changed = [k for k in range(n) if items[k] != before[k]]
    assert changed == [i], changed


def test_sessions_come_and_go_without_a_traceback(store, caplog):
    """Viewers open and close pages while the pages re-read the store every 0.2 s; the server
    destroys their sessions (a closed page's session lives 0.5 s here), reads in flight included:
    nothing is logged as an error, no traceback."""
    import logging
    from concurrent.futures import ThreadPoolExecutor

    caplog.set_level(logging.INFO)
    with _Served(
        ServeOptions(store, port=0, refresh_s=0.2),
        unused_session_lifetime_milliseconds=500,
        check_unused_sessions_milliseconds=200,
    ) as s:
        pages = [
            ("/sweep", {"name": "nosuchsweep"}),
            ("/", {}),
            ("/sweep", {"name": "x"}),
            ("/", {}),
        ]
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda pa: _pull(s.server.port, pa[0], **pa[1]), pages))
            list(pool.map(lambda rid: _run_data(s, rid), [run_id(SPEC), "nosuchrun", run_id(SPEC)]))
        made = s.server.nsa_shared.reads.get("run", 0)
        end = threading.Event()
        deadline = time.monotonic() + 120  # every session destroyed (10 s were tight at 5–10× load)
        while time.monotonic() < deadline:
            if not any(ctx.sessions for ctx in s.server._tornado._applications.values()):
                break
            end.wait(0.1)
        left = sum(len(ctx.sessions) for ctx in s.server._tornado._applications.values())
        end.wait(1.0)  # reads begun before the destruction come back
    assert made >= 1 and left == 0, (made, left)
    bad = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, bad


# --------------------------------------------------------------------------- hostile requests
def _damaged_copy(store: str, tmp_path: Path) -> tuple[str, str]:
    import shutil

    url = str(tmp_path / "c.zarr")
    shutil.copytree(store, url)
    return url, run_id(SPEC)


def test_made_up_widget_choices_reuse_the_default_build(store):
    """Two hundred requests with choices of panels and widgets the tab lacks, or values no widget
    offers, are each answered with the default build: no build is stored per made-up choice."""
    import json
    from urllib.parse import urlencode

    from nsa_dist.serve.run_page import _MAX_BUILT

    rid = run_id(SPEC)
    with _Served(ServeOptions(store, port=0, refresh_s=60)) as s:
        default = _run_data(s, rid)
        n = len(default["page"]["items"])
        builds = s.server.nsa_shared.reads["build"]
        for k in range(200):
            c = [{f"{900 + k % 99}.0": k}, {"0.0": f"bogus{k}"}, {f"{n}.s": k}, {"0.97": k}][k % 4]
            if k % 50 == 0:  # the whole answer now and then: the default page
                got = _run_data(s, rid, c=json.dumps(c))
                assert got["page"] == default["page"], f"choices {c} changed the page"
            else:
                args = {"id": rid, "c": json.dumps(c), "have": default["page"]["seen"]}
                status, _, _ = s.get("/run/data?" + urlencode(args))
                assert status == 200
        held = len(s.server.nsa_pages)
        assert held == 1 <= _MAX_BUILT, f"{held} tab builds held after 200 made-up choices (one expected)"
        assert s.server.nsa_shared.reads["build"] == builds, s.server.nsa_shared.reads
        assert len(s.server.nsa_shared) <= s.server.nsa_shared.max_entries


def test_made_up_run_ids_hold_no_cache_entry(store):
    """Two hundred ids the store does not list each get the fixed message, and none of them keeps
    an entry in the shared cache (where it would push the watched runs' reads out)."""
    import json
    from urllib.parse import urlencode

    rid = run_id(SPEC)
    with _Served(ServeOptions(store, port=0, refresh_s=60)) as s:
        _run_data(s, rid)
        before = len(s.server.nsa_shared)
        for k in range(200):
            status, body, _ = s.get("/run/data?" + urlencode({"id": f"no-such-run-{k}"}))
            assert status == 200 and "message" in json.loads(body), (status, body[:300])
        held = len(s.server.nsa_shared)
        assert held == before, f"{held - before} cache entries left by 200 made-up ids (none expected)"
        assert _run_data(s, rid)["id"] == rid


def test_cross_site_requests_for_a_runs_data_are_refused(store):
    """A page of another site may link to a run's page (a navigation), never fetch its data."""
    rid = run_id(SPEC)
    with _Served(ServeOptions(store, port=0)) as s:
        builds = s.server.nsa_shared.reads.get("build", 0)
        status, body, _ = s.get(f"/run/data?id={rid}", headers={"Sec-Fetch-Site": "cross-site"})
        assert status == 403 and rid not in body, (status, body[:300])
        assert s.server.nsa_shared.reads.get("build", 0) == builds, "a refused request built the tab"
        for same in ("same-origin", "none"):
            assert s.get(f"/run/data?id={rid}", headers={"Sec-Fetch-Site": same})[0] == 200, same
        assert s.get(f"/run?id={rid}", headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"})[0] == 200


def test_tab_builds_past_the_limit_evict_the_least_recently_asked(store, monkeypatch):
    """With room for one tab build, opening the second tab drops the first one's build, and asking
    for the first tab again builds it again (the bound holds; nothing stale is served)."""
    from nsa_dist.serve import run_page

    monkeypatch.setattr(run_page, "_MAX_BUILT", 1)
    rid = run_id(SPEC)
    with _Served(ServeOptions(store, port=0, refresh_s=60)) as s:
        first = _run_data(s, rid, tab=0)
        assert len(first["tabs"]) >= 2, first["tabs"]
        b0 = s.server.nsa_shared.reads["build"]
        second = _run_data(s, rid, tab=1)
        assert second["tab"] == 1 and len(s.server.nsa_pages) == 1
        assert s.server.nsa_shared.reads["build"] == b0 + 1
        again = _run_data(s, rid, tab=0)
        assert s.server.nsa_shared.reads["build"] == b0 + 2, "the evicted tab was served without a build"
        assert len(s.server.nsa_pages) == 1
        assert again["page"]["seen"] == first["page"]["seen"]
        assert len(again["page"]["items"]) == len(first["page"]["items"])


def test_a_foreign_host_name_is_refused_without_a_token(store, caplog):
    """DNS rebinding: a page of another site whose name resolves to 127.0.0.1 sends its own Host."""
    import logging

    rid = run_id(SPEC)
    caplog.set_level(logging.INFO)
    with _Served(ServeOptions(store, port=0)) as s:
        port = s.server.port
        for path in (f"/run?id={rid}", f"/run/data?id={rid}&tab=1", "/"):
            status, body, _ = s.get(path, headers={"Host": f"attacker.example:{port}"})
            assert status == 403, (path, status, body[:300])
            assert rid not in body
            assert s.get(path, headers={"Host": f"localhost:{port}"})[0] == 200, path
            assert s.get(path, headers={"Host": f"127.0.0.1:{port + 1}"})[0] == 403, path
        assert s.get(f"/run/data?id={rid}")[0] == 200
    refused = [r for r in caplog.records if "attacker.example" in r.getMessage() and r.name == "nsa_dist.serve"]
    assert refused and all("\n" not in r.getMessage() for r in refused), [r.getMessage() for r in refused]


def test_a_query_argument_that_is_not_utf8_is_a_400_not_a_500(store, caplog):
    """`/?x=%ff` and `/sweep?name=%ff` answered 500 with two UnicodeDecodeError tracebacks (an audit)."""
    import logging

    caplog.set_level(logging.INFO)
    with _Served(ServeOptions(store, port=0)) as s:
        for path in ("/?x=%ff", "/sweep?name=%ff", "/sweep?name=%c3%28", f"/run?id={run_id(SPEC)}&x=%ff"):
            status, body, _ = s.get(path)
            assert status == 400, (path, status, body[:300])
        assert s.get("/sweep?name=caf%C3%A9")[0] == 200  # UTF-8 beyond ASCII is fine
    tracebacks = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not tracebacks, [r.getMessage()[:200] for r in tracebacks]


def test_damaged_metadata_is_a_panel_message_not_a_500(store, tmp_path, caplog):
    import logging

    url, rid = _damaged_copy(store, tmp_path)
    meta = Path(url) / "runs" / rid / "eigenvector_steps" / "zarr.json"
    meta.write_text("{bad")
    caplog.set_level(logging.INFO)
    with _Served(ServeOptions(url, port=0)) as s:
        for _ in range(3):
            got = _run_data(s, rid)
        assert len(got["page"]["items"]) > 1
        shown = html.unescape(_item_texts(got))
    assert "cannot show this" in shown, shown[:2000]
    assert "Traceback" not in caplog.text, caplog.text[-3000:]


def test_deeply_nested_choices_are_refused_in_one_line(store, caplog):
    import logging

    rid = run_id(SPEC)
    caplog.set_level(logging.INFO)
    with _Served(ServeOptions(store, port=0)) as s:
        status, body, _ = s.get(f"/run/data?id={rid}&c=" + "%5B" * 4000)
        assert status == 400, (status, body[:300])
        assert s.get(f"/run/data?id={rid}&c=" + "%7B%22a%22%3A" * 3 + "1" + "%7D" * 3)[0] == 400
        assert s.get(f"/run/data?id={rid}&c=%7B%220.0%22%3A%5B%22x%22%5D%7D")[0] == 200  # {"0.0": ["x"]}
    assert "Traceback" not in caplog.text and "RecursionError" not in caplog.text, caplog.text[-3000:]


def test_a_repaired_chunk_shows_at_the_next_refresh(store, tmp_path):
    url, rid = _damaged_copy(store, tmp_path)
    chunk = Path(url) / "runs" / rid / "eigenvalues" / "c" / "2" / "0"
    good = chunk.read_bytes()
    raw = bytearray(good)
    raw[len(raw) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    with _Served(ServeOptions(url, port=0, refresh_s=0.2)) as s:
        bad = _run_data(s, rid)
        assert "cannot show this" in _item_texts(bad)
        chunk.write_bytes(good)
        have, shown = bad["page"]["seen"], _item_texts(bad)
        deadline = time.monotonic() + 300  # a rebuild at 5–10× load; stops once shown
        while time.monotonic() < deadline:  # a page polling as the browser's does
            threading.Event().wait(0.2)
            got = _run_data(s, rid, have=have)
            if got["page"]["items"] is not None:
                have, shown = got["page"]["seen"], _item_texts(got)
            if "cannot show this" not in shown:
                break
    assert "cannot show this" not in shown, shown[:2000]


def test_the_token_is_not_written_to_the_access_log(store, caplog):
    import logging

    caplog.set_level(logging.INFO)
    secret = "SECRETTOKEN123"
    with _Served(ServeOptions(store, port=0, token=secret)) as s:
        assert s.get(f"/nope?token={secret}")[0] == 404
        assert s.get(f"/run/data/x?token={secret}&id=1")[0] == 404
        assert s.get("/run/data?token=wrong")[0] == 403
    assert "token=" in caplog.text and secret not in caplog.text, caplog.text[-2000:]


def test_the_run_table_names_every_sweep_a_run_is_in(tmp_path):
    """A run in two sweeps (the same spec in two grids): the table showed one of them, runs() both."""
    from nsa_dist.serve.table import RunTable

    url = str(tmp_path / "two.zarr")
    store = SpectrumStore(url)
    spec = SPEC.model_copy(update={"name": "shared"})
    rid = run_experiment(spec, store).run_id
    store.record_sweep("grid-a", {"name": "grid-a"}, [rid])
    store.record_sweep("grid-b", {"name": "grid-b"}, [rid])
    table = RunTable(store)
    rows = table.refresh()
    cols = table.columns(rows, table.fields())
    assert cols["sweep"] == ["grid-a, grid-b"] == Client(url).runs()["sweep"].tolist(), cols["sweep"]
