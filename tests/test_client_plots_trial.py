"""A researcher's trial of the client and the figures: every number :class:`~nsa_dist.client.Run` /
:class:`~nsa_dist.client.Sweep` return and every point a figure draws is checked against the
arrays read straight out of the zarr store (``runs/<id>/<array>``, the ``done`` flags), never
through the client."""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import zarr

matplotlib.use("Agg")

from nsa_dist.client import Client  # noqa: E402
from nsa_dist.config import SweepSpec  # noqa: E402
from nsa_dist.pipeline import run_experiment, run_id  # noqa: E402
from nsa_dist.store import SpectrumStore  # noqa: E402

HESSIAN = {"every": 2, "probes": 8, "rayleigh_k": 3, "top_k": 1, "density_grid": 32, "lanczos_steps": 8}
BASE = {
    "data": {"n": 10, "n_test": 4},
    "steps": 4,
    "record": {"every": 2},
    "model": {"depth": 2, "init": "ntk", "activation": "atan"},
    "schedule": {"lr": 0.5},
    "spectrum": {"k": "all", "images": []},
}
# the first variant (the first grid point of the sweep) has neither test points nor a hessian: block;
# the two others have both: a researcher adding the Hessian measurements to part of a sweep
VARIANTS = [
    {"model.width": 2, "data.n_test": 0},
    {"model.width": 3, "hessian": HESSIAN},
    {"model.width": 6, "hessian": HESSIAN},
]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Sweep "mixed": the three VARIANTS × seeds 0, 1 (six finished runs), as the coordinator records it."""
    url = str(tmp_path_factory.mktemp("mixed") / "s.zarr")
    store = SpectrumStore(url)
    sweep = SweepSpec(name="mixed", base=BASE, grid={"seed": [0, 1]}, variants=VARIANTS)
    ids = []
    for spec in sweep.expand():
        assert run_experiment(spec, store).status == "done"
        ids.append(run_id(spec))
    store.record_sweep(sweep.name, sweep.model_dump(mode="json"), ids)
    return url


def _raw(url: str, rid: str, name: str) -> np.ndarray:
    """Array ``name`` of run ``rid`` at its finished steps, straight from zarr."""
    g = zarr.open_group(url, mode="r")[f"runs/{rid}"]
    done = np.asarray(g["done"][:], bool)
    return np.asarray(g[name][:], np.float64)[done]


def _raw_width(url: str, rid: str) -> int:
    return int(zarr.open_group(url, mode="r")[f"runs/{rid}"].attrs["spec"]["model"]["width"])


def _ids_of_width(url: str, sweep, width: int) -> list[str]:
    return sorted(r for r in sweep.runs["id"] if _raw_width(url, r) == width)


def test_seeds_of_a_point_whose_spec_lacks_a_varied_field_are_pooled(mixed: str) -> None:
    """The variant without a hessian: block has NaN in every hessian.* column; its two seeds are one
    grid point (mean over both), not two one-seed points, and it is not reported unfinished."""
    sweep = Client(mixed).sweep("mixed")
    sizes = sorted(len(ids) for _, ids in sweep.groups())
    assert sizes == [2, 2, 2], f"groups of sizes {sizes}, expected three points of 2 seeds: {sweep.groups()}"
    assert sweep.unfinished_points() == [], f"finished points reported unfinished: {sweep.unfinished_points()}"
    ids = _ids_of_width(mixed, sweep, 2)
    ref = np.mean([_raw(mixed, r, "energy_y")[:, 1] for r in ids], axis=0)  # E_t(y, 2), k 1-based
    (cv,) = [c for c in sweep.curves("energy_y", 2) if c.key["model.width"] == 2]
    assert cv.n == 2 and "(2 seeds)" in cv.label, f"n={cv.n}, label {cv.label!r}"
    np.testing.assert_allclose(cv.mean, ref, rtol=0, atol=1e-12, err_msg="mean E_t(y, 2) over the seeds")


def test_figures_drawn_when_the_first_grid_point_lacks_them(mixed: str, tmp_path: Path, caplog) -> None:
    """plot_sweep draws Fig. 7c and the Hessian figures from the points that record them, though the
    first point records neither, warns which points it left out, and each drawn line is the mean over
    the seeds of the stored values."""
    from nsa_dist.plots.sweep import fig7c, hessian_moments_figure, plot_sweep

    sweep = Client(mixed).sweep("mixed")
    with caplog.at_level(logging.WARNING, logger="nsa_dist.plots"):
        want = {"fig7c_test_loss", "hessian_moments_H", "hessian_width_convergence"}
        written = {p.stem for p in plot_sweep(sweep, tmp_path, figures=sorted(want))}
    assert want <= written, f"not drawn: {sorted(want - written)} (written: {sorted(written)})"
    assert "leaves out 1 grid point(s) whose runs do not record loss_test" in caplog.text, caplog.text

    ax = fig7c(sweep).axes[0]
    lines = {ln.get_label(): ln for ln in ax.lines}
    for w in (3, 6):
        ids = _ids_of_width(mixed, sweep, w)
        ref = np.mean([_raw(mixed, r, "loss_test") for r in ids], axis=0)
        (label,) = [lb for lb in lines if lb.startswith(f"width={w},")]
        got = lines[label].get_ydata()
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12, err_msg=f"Fig. 7c width {w}: {got} vs {ref}")
    assert not [lb for lb in lines if lb.startswith("width=2,")], f"a line for the run without test points: {lines}"

    ax = hessian_moments_figure(sweep, "H").axes[1]  # Tr(H²)
    for w in (3, 6):
        ids = _ids_of_width(mixed, sweep, w)
        g = zarr.open_group(mixed, mode="r")
        ref = []
        for r in ids:
            hs = np.asarray(g[f"runs/{r}/hessian_steps"][:], bool) & np.asarray(g[f"runs/{r}/done"][:], bool)
            ref.append(np.asarray(g[f"runs/{r}/hessian_moments"][:], np.float64)[hs][:, 0, 1])  # H, k = 2
        (line,) = [ln for ln in ax.lines if ln.get_label().startswith(f"width={w},")]
        np.testing.assert_allclose(
            line.get_ydata(), np.mean(ref, 0), rtol=0, atol=1e-9, err_msg=f"Tr(H²) of width {w}, mean over seeds"
        )


def test_width_convergence_reference_line_over_the_drawn_widths(mixed: str) -> None:
    """The ∝ w^{-1/2} guide starts at the first drawn point (width 3, not the sweep's smallest width 2,
    which has no Hessian) and spans exactly the widths drawn."""
    from nsa_dist.plots.sweep import width_convergence

    sweep = Client(mixed).sweep("mixed")
    ax = width_convergence(sweep).axes[0]
    (guide,) = [ln for ln in ax.lines if "w^{-1/2}" in str(ln.get_label())]
    first = ax.lines[0]
    gx, gy = guide.get_xdata(), guide.get_ydata()
    np.testing.assert_array_equal(gx, first.get_xdata(), err_msg=f"guide widths {gx} vs drawn {first.get_xdata()}")
    assert gy[0] == first.get_ydata()[0], f"guide starts at {gy[0]}, the first point is {first.get_ydata()[0]}"
    np.testing.assert_allclose(gy, gy[0] * np.sqrt(gx[0] / gx), rtol=1e-12)


# ---------------------------------------------------------------- the quadrature route: bands against k and t
@pytest.fixture(scope="module")
def quad(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A run on the quadrature route (top 4 exact, a 12-point k grid to N = 80): brackets beyond k = 4."""
    from nsa_dist.config import ExperimentSpec

    url = str(tmp_path_factory.mktemp("quad") / "q.zarr")
    spec = ExperimentSpec.model_validate(
        {
            "name": "q",
            "data": {"n": 80},
            "model": {"depth": 2, "width": 16},
            "steps": 4,
            "record": {"every": 2},
            "spectrum": {
                "k": "all",
                "energy": "quadrature",
                "images": [],
                "quadrature": {"top": 4, "lanczos_steps": 8, "probes": 4, "curve_points": 12, "block_size": 4},
            },
        }
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    return url


def _stored_bracket(url: str, rid: str, curve: str, top: str, i: int, increasing: bool):
    """(lower, upper) along the finished steps at k = i from the raw arrays: the exact top column, a grid
    column, or between two grid points the monotone bracket of the neighbours."""
    g = zarr.open_group(url, mode="r")[f"runs/{rid}"]
    done = np.asarray(g["done"][:], bool)
    exact = np.asarray(g[top][:], np.float64)[done]
    if i <= exact.shape[1]:
        return exact[:, i - 1], exact[:, i - 1]
    ck = np.asarray(g["curve_k"][:], np.int64)
    lo = np.asarray(g[f"{curve}_lower"][:], np.float64)[done]
    hi = np.asarray(g[f"{curve}_upper"][:], np.float64)[done]
    if i in ck:
        j = int(np.flatnonzero(ck == i)[0])
        return lo[:, j], hi[:, j]
    b = int(np.searchsorted(ck, i))
    a = b - 1
    return (lo[:, a], hi[:, b]) if increasing else (lo[:, b], hi[:, a])


def _band_at(coll, x: float) -> tuple[float, float]:
    """(min, max) of a fill_between band's outline at abscissa x."""
    v = coll.get_paths()[0].vertices
    at = v[np.isclose(v[:, 0], x, rtol=0, atol=1e-9)]
    return float(at[:, 1].min()), float(at[:, 1].max())


def test_fig2b_band_never_narrower_than_the_stored_bracket(quad: str) -> None:
    """Fig. 2b (λ_i^t along t, log y): the band at each step spans at least [stored lower, stored upper];
    a positive lower bound is drawn where it is (it was raised to half the smallest λ drawn: λ_20's
    lower 0.018 drawn at 0.075)."""
    from nsa_dist.plots.eigenvalues import fig2b

    run = Client(quad).run("q")
    ax = fig2b(run).axes[0]
    bands = list(ax.collections)
    checked = 0
    for line in ax.lines:
        label = str(line.get_label())
        if not label.startswith(r"$\lambda_{"):
            continue
        i = int(label.split("{")[1].split("}")[0])
        lo, hi = _stored_bracket(quad, run.id, "curve_eigenvalue", "eigenvalues", i, increasing=False)
        if not np.any(hi > lo):
            continue
        color = line.get_color()
        (band,) = [b for b in bands if np.allclose(b.get_facecolor()[0][:3], matplotlib.colors.to_rgb(color))]
        for t, lo_t, hi_t in zip(line.get_xdata(), lo, hi):
            blo, bhi = _band_at(band, t)
            assert bhi >= hi_t * (1 - 1e-12), f"λ_{i} at t = {t}: band top {bhi:.6g} below stored upper {hi_t:.6g}"
            if lo_t > 0:
                assert blo <= lo_t * (1 + 1e-12), (
                    f"λ_{i} at t = {t}: band bottom {blo:.6g} above the stored lower {lo_t:.6g} "
                    f"(narrower by {blo - lo_t:.3g})"
                )
            checked += 1
    assert checked >= 6, f"only {checked} bracketed points checked"


# ---------------------------------------------------------------- the Hessian view at steps it did not analyse
@pytest.fixture(scope="module")
def hess2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A run recording every step, its Hessian every second one (steps 0, 2 of 0..3)."""
    from nsa_dist.config import ExperimentSpec

    url = str(tmp_path_factory.mktemp("hess2") / "h.zarr")
    spec = ExperimentSpec.model_validate(
        {
            "name": "h",
            "data": {"n": 10},
            "model": {"depth": 2, "width": 4, "init": "ntk"},
            "steps": 3,
            "record": {"every": 1},
            "spectrum": {"k": "all", "images": []},
            "hessian": HESSIAN,
        }
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    return url


def test_hessian_reads_at_a_step_it_did_not_analyse_are_refused(hess2: str) -> None:
    """hessian.every 2 with every step recorded: at step 1 the Rayleigh quotients, the density and G
    were never measured — the reads said NaN (the arrays' fill, as if a measurement had failed);
    they name the analysed steps instead.  At an analysed step they are the stored rows."""
    url = hess2
    run = Client(url).run("h")
    assert run.hessian.steps.tolist() == [0, 2], run.hessian.steps
    for read in (run.hessian.rayleigh, run.hessian.density, run.hessian.G):
        try:
            got = read(1)
        except KeyError as e:
            assert "[0, 2]" in str(e), str(e)
        else:
            raise AssertionError(f"{read.__name__}(1) at a step without Hessian measurements gave {got}")
    g = zarr.open_group(url, mode="r")[f"runs/{run.id}"]
    raw = np.asarray(g["hessian_rayleigh"][2], np.float64)  # storage index 2 = step 2
    got = run.hessian.rayleigh(2)
    np.testing.assert_array_equal(np.stack([got["I"], got["S"]]), raw, err_msg="Rayleigh quotients at t = 2")


def test_xarray_hessian_moments_by_order_and_part(hess2: str) -> None:
    """``ds.hessian_moments.sel(moment=k, hessian_part=A)`` is Tr(A^k) (k 1-based as in the paper):
    the dims had no coordinates, so ``.isel(moment=1)`` — Tr(A²) — was the only way to read them."""
    run = Client(hess2).run("h")
    ds = run.to_xarray()
    g = zarr.open_group(hess2, mode="r")[f"runs/{run.id}"]
    raw = np.asarray(g["hessian_moments"][:], np.float64)  # (S, 3, 4): H, I, S × Tr(A^1..4)
    for part, p in zip("HIS", range(3)):
        for k in range(1, 5):
            got = ds.hessian_moments.sel(moment=k, hessian_part=part).values
            np.testing.assert_array_equal(got, raw[:, p, k - 1], err_msg=f"Tr({part}^{k}) along t")
    assert ds.moment.values.tolist() == [1, 2, 3, 4], ds.moment.values


def test_width_convergence_lines_of_one_order_are_told_apart(tmp_path: Path) -> None:
    """A sweep over width × depth: the width-convergence figure draws, per order k, one line per depth,
    each the relative error |Tr(I^k) − limit| / limit read from the store; the lines of one order had
    one colour and one style (two legend entries one could not tell apart)."""
    from nsa_dist.plots.sweep import width_convergence

    url = str(tmp_path / "wd.zarr")
    store = SpectrumStore(url)
    hessian = {k: v for k, v in HESSIAN.items() if k != "every"}
    base = {**BASE, "data": {"n": 8}, "steps": 1, "record": {"every": 1}, "hessian": {**hessian, "steps": [0]}}
    sweep = SweepSpec(name="wd", base=base, grid={"model.width": [3, 6], "model.depth": [2, 3]})
    ids = []
    for spec in sweep.expand():
        assert run_experiment(spec, store).status == "done"
        ids.append(run_id(spec))
    store.record_sweep(sweep.name, sweep.model_dump(mode="json"), ids)
    sw = Client(url).sweep("wd")
    ax = width_convergence(sw).axes[0]
    handles, labels = ax.get_legend_handles_labels()
    drawn = [(h, lb) for h, lb in zip(handles, labels) if lb.startswith("|Tr(I^")]
    assert len(drawn) == 4, labels  # orders 1, 2 × depths 2, 3
    looks = [(matplotlib.colors.to_hex(h[0].get_color()), h[0].get_marker(), h[0].get_linestyle()) for h, _ in drawn]
    alike = [(lb, lk) for (_, lb), lk in zip(drawn, looks)]
    assert len(set(looks)) == len(looks), f"legend entries drawn alike: {alike}"
    g = zarr.open_group(url, mode="r")
    for h, lb in drawn:
        k, depth = int(lb[len("|Tr(I^")]), int(lb.split("depth=")[1].split(")")[0])
        ref = []
        for w in (3, 6):
            (rid,) = [
                r
                for r in ids
                if g[f"runs/{r}"].attrs["spec"]["model"]["width"] == w
                and g[f"runs/{r}"].attrs["spec"]["model"]["depth"] == depth
            ]
            ex = np.asarray(g[f"runs/{rid}/hessian_moments_I_exact"][0], np.float64)[k - 1]  # t = 0
            lim = np.asarray(g[f"runs/{rid}/hessian_I_limit_moments"][0], np.float64)[k - 1]
            ref.append(abs(ex - lim) / abs(lim))
        np.testing.assert_allclose(h[0].get_ydata(), ref, rtol=1e-12, err_msg=lb)


# ---------------------------------------------------------------- a Tracker run's learning rate
def test_fig1e_draws_the_stored_learning_rate_of_a_tracker_run(tmp_path: Path) -> None:
    """A Tracker run's δ_t is the user's (0.05, then 0.01 from step 3); its spec holds the default
    schedule (lr 0.25).  Fig. 1e drew δ_t = 0.25 at every step; it draws the stored δ_t."""
    import torch
    from torch import nn

    from nsa_dist.plots.dynamics import fig1e
    from nsa_dist.tracker import Tracker

    url = str(tmp_path / "t.zarr")
    X = torch.randn(16, 2, dtype=torch.float64)
    y = torch.sin(X[:, 0])
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    T = 6
    tr = Tracker(
        url,
        "trk",
        model,
        X.numpy(),
        y.numpy(),
        steps=T,
        record={"every": 2},
        cluster=None,
        spectrum={"k": 4, "images": []},
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(T):
        lr = 0.05 if step < 3 else 0.01
        for group in opt.param_groups:
            group["lr"] = lr
        loss = 0.5 * ((model(X).squeeze(-1) - y) ** 2).mean()
        if tr.due(step):
            tr.record(step, lr=lr, loss=float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    tr.close()
    run = Client(url).run("trk")
    g = zarr.open_group(url, mode="r")[f"runs/{run.id}"]
    done = np.asarray(g["done"][:], bool)
    steps, lr = np.asarray(g["steps"][:])[done], np.asarray(g["lr"][:], np.float64)[done]
    assert lr.tolist() == [0.05, 0.05, 0.01, 0.01], lr
    ax = fig1e(run).axes[0]
    (line,) = [ln for ln in ax.lines if ln.get_label() == r"$\delta_t$"]
    x, v = np.asarray(line.get_xdata()), np.asarray(line.get_ydata(), np.float64)
    for t, want in zip(steps, lr):
        # steps-post: the value drawn at t is the last vertex at or before t
        got = v[np.flatnonzero(x <= t)[-1]]
        assert got == want, f"δ_t drawn at t = {t}: {got}, stored {want} (line {list(zip(x, v))})"


def test_width_convergence_leaves_out_grid_points_without_a_limit(tmp_path: Path) -> None:
    """A sweep over regime × width: the active regime has no limit of I (NaN errors), so its lines are
    not drawn — they were legend entries "slope +nan" with nothing drawn — and the figure says so."""
    from nsa_dist.plots.sweep import width_convergence

    url = str(tmp_path / "rg.zarr")
    store = SpectrumStore(url)
    hessian = {k: v for k, v in HESSIAN.items() if k != "every"}
    base = {**BASE, "data": {"n": 8}, "steps": 1, "record": {"every": 1}, "hessian": {**hessian, "steps": [0]}}
    sweep = SweepSpec(name="rg", base=base, grid={"model.width": [3, 6], "model.regime": ["ntk", "active"]})
    ids = []
    for spec in sweep.expand():
        assert run_experiment(spec, store).status == "done"
        ids.append(run_id(spec))
    store.record_sweep(sweep.name, sweep.model_dump(mode="json"), ids)
    ax = width_convergence(Client(url).sweep("rg")).axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert not [lb for lb in labels if "nan" in lb], labels
    assert [lb for lb in labels if "regime=ntk" in lb], labels
    said = " ".join(t.get_text() for t in ax.texts)
    assert "not drawn, no limit of I there" in said and "active" in said, said
