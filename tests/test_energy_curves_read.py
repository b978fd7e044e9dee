"""E_t(φ, k) and λ_i at every k, with their brackets, as the readers give them: ``Run.energy`` /
``energy_curve`` / ``eigenvalue_curve`` / ``gram_density``, ``nsa plot``'s band, ``nsa serve``'s
panels and ``nsa export`` — on the exact route (``spectrum.k: all``, one process: lower = upper =
value, no band) and on the quadrature route (the bracket contains the exact route's value)."""

from __future__ import annotations

import numpy as np
import pytest

from nsa_dist.client import BracketedCurve, Client, Run
from nsa_dist.config import ExperimentSpec
from nsa_dist.pipeline import run_experiment
from nsa_dist.store import SpectrumStore

N = 48
BASE = {
    "data": {"n": N, "n_test": 12},
    "model": {"depth": 2, "width": 96},  # G (N = 48) of full rank: no null-space cluster (width 24: rank 33)
    "steps": 6,
    "record": {"every": 3},
    "seed": 3,
}
EXACT = ExperimentSpec.model_validate(
    {**BASE, "name": "exact", "spectrum": {"k": "all", "dtype": "float64", "test_points": True}}
)
TOP = ExperimentSpec.model_validate({**BASE, "name": "top", "spectrum": {"k": 5, "dtype": "float64"}})
PHIS = ("y", "f", "residual", "df", "df_pred", "f_test")


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A store with the exact route's run (k: all, layout local) and a top-5 run of the same spec."""
    url = str(tmp_path_factory.mktemp("curves") / "s.zarr")
    store = SpectrumStore(url)
    for spec in (EXACT, TOP):
        assert run_experiment(spec, store).status == "done"
    return url


@pytest.fixture(scope="module")
def exact(store_url: str) -> Run:
    return Client(store_url).run("exact")


# --------------------------------------------------------------------------- the exact route
def test_exact_route_energy_is_the_stored_value_with_a_degenerate_bracket(exact: Run) -> None:
    """Run.energy(φ, k, step) is energy_φ[step, k − 1] bitwise at every k and step, lower = upper = value;
    the curve datasets are the stored arrays; E(y, ·) is the float64 cumsum of ⟨v_i, ȳ⟩² / ‖ȳ‖²
    from the stored eigenvectors."""
    assert exact.energy_route == "exact" and exact.k_max == N
    for phi in PHIS:
        E = exact.per_step(f"energy_{phi}")
        K = E.shape[1]
        ds = exact.energy_curve(phi)
        np.testing.assert_array_equal(ds["value"].values, E)
        np.testing.assert_array_equal(ds["lower"].values, E)
        np.testing.assert_array_equal(ds["upper"].values, E)
        assert ds["k"].values.tolist() == list(range(1, K + 1)) and ds["exact"].values.all()
        np.testing.assert_array_equal(ds["step"].values, exact.steps)
        assert ds.attrs["route"] == "exact" and ds.attrs["phi"] == phi
        for j, t in enumerate(exact.steps):
            for k in (1, 2, 7, K // 2, K):
                got = exact.energy(phi, k, step=int(t))
                assert got == (E[j, k - 1],) * 3, f"{phi} t={t} k={k}: {got} vs {E[j, k - 1]}"
        value, lower, upper = exact.energy(phi, 3, step=None)
        np.testing.assert_array_equal(value, E[:, 2])
        assert np.array_equal(lower, value) and np.array_equal(upper, value)
        assert exact.energy(phi, 3) == exact.energy(phi, 3, step=int(exact.steps[-1]))  # step=-1: the last
    lam = exact.eigenvalue_curve()
    np.testing.assert_array_equal(lam["value"].values, exact.eigenvalues)
    assert lam["value"].shape == (len(exact.steps), N)
    assert exact.eigenvalue(4) == (exact.eigenvalues[-1, 3],) * 3
    for t in exact.eigenvector_steps:  # a reference: E from the stored (float32) eigenvectors, in float64
        V, y = exact.eigenvectors(int(t)), np.asarray(exact.y, np.float64).ravel()
        want = np.cumsum((V.T @ y) ** 2) / (y @ y)
        got = exact.energy_curve("y")["value"].sel(step=t).values
        tol = 20 * N * np.finfo(np.float32).eps  # the eigenvectors' float32 storage
        assert np.abs(got - want).max() <= tol, f"t={t}: E(y, ·) off by {np.abs(got - want).max():.1e} > {tol:.1e}"


def test_bad_phi_k_and_step_are_refused_in_one_line(exact: Run, store_url: str) -> None:
    with pytest.raises(ValueError, match="phi='z' is not one of y, f, residual"):
        exact.energy("z", 1)
    with pytest.raises(ValueError, match="phi='z'"):
        exact.energy_curve("z")
    for k in (0, -3, N + 1):
        with pytest.raises(ValueError, match=rf"k={k} outside 1\.\.{N}"):
            exact.energy("y", k)
    with pytest.raises(ValueError, match=r"k=13 outside 1\.\.12 \(M, the number of test points\)"):
        exact.energy("f_test", 13)
    with pytest.raises(ValueError, match="not an integer"):
        exact.energy("y", 2.5)
    with pytest.raises(KeyError, match=r"step 4 is not a finished recorded step .*finished: \[0, 3, 5\]"):
        exact.energy("y", 3, step=4)
    with pytest.raises(KeyError, match="no gram_density .*route is 'exact'"):
        exact.gram_density()
    top = Client(store_url).run("top")
    assert top.k_max == 5 and top.energy("y", 5)[0] == top.energy("y")[-1, 4]
    with pytest.raises(ValueError, match=r"k=6: this run measured energy_y only for k ≤ 5 .*spectrum.k: all"):
        top.energy("y", 6)
    with pytest.raises(ValueError, match=rf"k={N + 1} outside 1\.\.{N}"):
        top.energy("y", N + 1)


# --------------------------------------------------------------------------- between measured k
def _synthetic(increasing: bool, rng: np.random.Generator) -> tuple[BracketedCurve, np.ndarray]:
    """A monotone curve at every k = 1..200 and a BracketedCurve that measured it exactly at
    k ≤ 10 and within random brackets on a log grid beyond."""
    n = 200
    exact = np.cumsum(rng.random((3, n)), axis=1)
    exact = exact / exact[:, -1:] if increasing else exact[:, ::-1]
    grid = np.unique(np.concatenate([np.arange(1, 11), np.geomspace(11, n, 12).round().astype(int)]))
    v = exact[:, grid - 1]
    pad_lo, pad_hi = rng.random(v.shape) * 0.05, rng.random(v.shape) * 0.05
    top = grid <= 10
    pad_lo[:, top] = pad_hi[:, top] = 0
    c = BracketedCurve(
        "energy_y" if increasing else "eigenvalue",
        np.arange(3),
        grid,
        v,
        v - pad_lo,
        v + pad_hi,
        top,
        n,
        "quadrature",
        "statistical",
        0.95,
    )
    return c, exact


@pytest.mark.parametrize("increasing", [True, False])
def test_a_k_between_measured_ones_is_bracketed_by_its_neighbours(increasing: bool) -> None:
    """At every integer k — measured or between two measured ones — the bracket of ``at(k)`` and the
    band ``nsa plot`` / ``nsa serve`` draw (band_polygon) contain the exact monotone curve."""
    from nsa_dist.plots.brackets import band_polygon

    c, exact = _synthetic(increasing, np.random.default_rng(7))
    for k in range(1, 201):
        value, lower, upper = c.at(k)
        assert np.all(lower <= exact[:, k - 1]) and np.all(exact[:, k - 1] <= upper), k
        assert np.all(lower <= value) and np.all(value <= upper), k
    for j in range(3):
        x, lo, hi = band_polygon(c.k, c.lower[j], c.upper[j], increasing)
        for k in range(1, 201):  # the band's extent at k: every polygon piece that covers k
            at = np.flatnonzero(x == k)
            if len(at):
                lo_k, hi_k = lo[at].min(), hi[at].max()
            else:
                i = np.searchsorted(x, k)
                lo_k, hi_k = min(lo[i - 1], lo[i]), max(hi[i - 1], hi[i])
                assert lo[i - 1] == lo[i] and hi[i - 1] == hi[i], f"k={k}: band sloped between measured k"
            assert lo_k <= exact[j, k - 1] <= hi_k, f"row {j} k={k}: {exact[j, k - 1]} outside [{lo_k}, {hi_k}]"
    assert not c.degenerate and c.exact[:10].all() and not c.exact[10:].any()


# --------------------------------------------------------------------------- figures, pages
def test_exact_route_plot_draws_no_band_and_says_so(exact: Run) -> None:
    from matplotlib.collections import PolyCollection

    from nsa_dist.plots import make_figure

    for name in ("energy_against_k", "fig2a_eigenvalues", "fig3a_energy_y", "fig2b_eigenvalues_t"):
        fig = make_figure(exact, name)
        bands = [c for ax in fig.axes for c in ax.collections if isinstance(c, PolyCollection)]
        assert not bands, f"{name}: {len(bands)} band(s) on the exact route"
    fig = make_figure(exact, "energy_against_k")
    assert "exact route" in fig.get_supxlabel()
    ax = fig.axes[0]
    line = ax.get_lines()[0]
    np.testing.assert_array_equal(line.get_xdata(), np.arange(1, N + 1))
    np.testing.assert_array_equal(line.get_ydata(), exact.energy("y")[0])


def test_exact_route_serve_panel_draws_every_k_without_a_band(exact: Run) -> None:
    from nsa_dist.serve._nsa_panels import Energy, Fig2a

    p = Energy(exact)
    p.update(p.guarded(exact))
    assert not p.error.visible, p.error.text
    d = p.sources[1]["lines"].data
    for label, ys in zip(d["label"], d["ys"]):
        t = int(label.removeprefix("t = "))
        np.testing.assert_array_equal(ys, exact.energy_curve("y")["value"].sel(step=t).values)
    assert not any(len(v) for v in p.sources[1]["bands"].data.values())
    cells = p.map.sources[0].data  # the heat map over (t, log k): each cell is E at its step and k
    E, steps = exact.energy("y"), exact.steps
    for left, right, bottom, top, v in zip(cells["left"], cells["right"], cells["bottom"], cells["top"], cells["v"]):
        (j,) = np.flatnonzero((steps > left) & (steps < right))
        inside = [k for k in range(1, N + 1) if bottom < k < top]  # one measured k, drawn at its own value
        assert inside and v in E[j, np.array(inside) - 1], (left, bottom, top, v)
    assert len(cells["v"]) >= 3 * len(steps) and not np.any(p.map.sources[1].data["v"])  # widths: all 0
    p = Fig2a(exact)
    p.update(p.guarded(exact))
    assert not p.error.visible and not any(len(v) for v in p.sources[0]["bands"].data.values())


# --------------------------------------------------------------------------- the quadrature route
NQ = 150
# width 64: P ≈ 4,400 parameters, so G (N = 150) has full rank — beyond rank(G) the exact route's E_t(φ, k)
# depends on the basis eigh picks in G's null space (with width 24, P < N, it lay outside the bracket there)
QBASE = {
    "data": {"n": NQ, "n_test": 12},
    "model": {"depth": 2, "width": 64},
    "steps": 6,
    "record": {"every": 3},
    "seed": 5,
}
QEXACT = ExperimentSpec.model_validate(
    {**QBASE, "name": "q-exact", "spectrum": {"k": "all", "dtype": "float64", "energy": "exact"}}
)
QUAD = ExperimentSpec.model_validate(
    {
        **QBASE,
        "name": "q-quad",
        "spectrum": {
            "k": "all",
            "dtype": "float64",
            "energy": "quadrature",
            "quadrature": {"top": 10, "lanczos_steps": 20, "probes": 8, "curve_points": 25},
        },
    }
)
QPHIS = ("y", "f", "residual", "df", "df_pred")


@pytest.fixture(scope="module")
def quad_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Run, str]:
    """The same run (seed, data, net) measured on the exact and on the quadrature route, layout local."""
    url = str(tmp_path_factory.mktemp("quad") / "s.zarr")
    store = SpectrumStore(url)
    for spec in (QEXACT, QUAD):
        assert run_experiment(spec, store).status == "done"
    c = Client(url)
    return c.run("q-exact"), c.run("q-quad"), url


@pytest.mark.slow  # the pair of runs: ~40 s on a free core
def test_quadrature_brackets_contain_the_exact_routes_value_at_every_k(quad_pair) -> None:
    """Run.energy(φ, k)'s bracket holds the exact route's E_t(φ, k) at every k = 1..N (on the grid and
    between it) and step, for every φ; λ_k's bracket holds the exact λ_k; k ≤ top is exact."""
    ex, qu, _ = quad_pair
    assert qu.energy_route == "quadrature" and ex.energy_route == "exact" and qu.k_max == NQ
    np.testing.assert_array_equal(qu.per_step("f"), ex.per_step("f"))  # the same training
    top = int(qu.shape("eigenvalues")[1])
    assert qu.curve_bracket and qu.curve_bracket != ex.curve_bracket
    slop = 1e-9
    widest = (0.0, None)
    for name in [f"energy_{p}" for p in QPHIS] + ["eigenvalue"]:
        want = ex.curve(name).value  # (S, N)
        c = qu.curve(name)
        assert c.k[-1] == NQ and np.all(np.diff(c.k) > 0) and c.exact[:top].all()
        scale = 1.0 if name != "eigenvalue" else float(np.abs(want).max())
        bad = []
        for k in range(1, NQ + 1):
            v, lo, hi = c.at(k)
            out = np.flatnonzero((lo > want[:, k - 1] + slop * scale) | (hi < want[:, k - 1] - slop * scale))
            bad += [
                f"{name} t={int(qu.steps[j])} k={k}: exact {want[j, k - 1]:.6g} not in [{lo[j]:.6g}, {hi[j]:.6g}]"
                for j in out
            ]
            if k <= top:
                assert np.all(lo == hi), f"{name} k={k} ≤ top={top} is not exact"
            w = float(np.max(hi - lo)) / scale
            if w > widest[0]:
                widest = (w, f"{name} k={k}")
        assert not bad, "\n".join(bad[:20]) + f"\n({len(bad)} in all)"
    print(f"widest bracket: {widest[0]:.3g} at {widest[1]}")
    v, lo, hi = qu.energy("y", NQ // 3, step=int(qu.steps[1]))
    assert lo <= v <= hi
    grid, density = qu.gram_density()
    assert grid.shape == density.shape and np.isfinite(density).all()
    assert abs(np.trapezoid(density, grid) - 1) < 0.05, np.trapezoid(density, grid)
    ds = qu.energy_curve("y")
    assert ds.attrs["route"] == "quadrature" and ds.attrs["bracket"] == qu.curve_bracket
    assert (ds["lower"] <= ds["value"]).all() and (ds["value"] <= ds["upper"]).all()


@pytest.mark.slow  # the pair of runs: ~40 s on a free core
def test_quadrature_plot_draws_the_bracket_as_a_band_and_names_it(quad_pair) -> None:
    from matplotlib.collections import PolyCollection

    from nsa_dist.plots import make_figure

    ex, qu, _ = quad_pair
    assert not qu.curve("energy_y").degenerate  # something beyond the top was bracketed, not measured
    fig = make_figure(qu, "energy_against_k")
    bands = [c for c in fig.axes[0].collections if isinstance(c, PolyCollection)]
    assert bands, "no band on the quadrature route"
    assert qu.curve_bracket.split()[0] in fig.get_supxlabel().replace("\n", " ")
    # the band holds the exact route's curve at every k (it is drawn from the same bracket)
    paths = bands[0].get_paths()[0].vertices
    want = ex.curve("energy_y").value[0]
    for k in range(1, NQ + 1):
        ys = paths[np.abs(paths[:, 0] - k) < 1e-9, 1]
        if len(ys):
            assert ys.min() - 1e-9 <= want[k - 1] <= ys.max() + 1e-9, f"k={k}: {want[k - 1]} outside the band"
    for name in ("fig2a_eigenvalues", "fig3a_energy_y", "fig2b_eigenvalues_t"):
        fig = make_figure(qu, name)
        assert fig is not None and qu.curve_bracket.split()[0] in fig.get_supxlabel().replace("\n", " "), name
    from test_plots import layout_problems

    for name in ("energy_against_k", "fig2a_eigenvalues", "fig2b_eigenvalues_t", "fig3a_energy_y", "fig3d_energy_df"):
        assert not layout_problems(make_figure(qu, name)), (name, layout_problems(make_figure(qu, name)))


@pytest.mark.slow  # the pair of runs: ~40 s on a free core
def test_quadrature_export_round_trips_the_curves_bitwise(quad_pair, tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    from nsa_dist.export import export_tensorboard

    _, qu, _ = quad_pair
    export_tensorboard(qu, tmp_path)
    acc = EventAccumulator(str(tmp_path / qu.id), size_guidance={"tensors": 0})
    acc.Reload()
    ks_ = qu.array("curve_k").tolist()
    names = [f"curve_energy_{p}{s}" for p in QPHIS for s in ("", "_lower", "_upper")] + [
        f"curve_eigenvalue{s}" for s in ("", "_lower", "_upper")
    ]
    for name in names:
        stored = qu.per_step(name)
        for j, k in enumerate(ks_):
            events = acc.Tensors(f"{name}/k_{k}")
            assert [e.step for e in events] == qu.steps.tolist(), (name, k)
            got = np.array([tensor_util.make_ndarray(e.tensor_proto) for e in events], np.float64)
            np.testing.assert_array_equal(got, stored[:, j], err_msg=f"{name}/k_{k}")


@pytest.mark.slow  # the pair of runs: ~40 s on a free core
def test_quadrature_runs_page_opens_and_shades_the_bracket(quad_pair) -> None:
    from test_serve import _Served

    from nsa_dist.serve import ServeOptions
    from nsa_dist.serve.run_page import run_panels

    _, qu, url = quad_pair
    panels = {type(p).__name__: p for p in run_panels(qu)}
    for p in panels.values():
        p.update(p.guarded(qu))
        assert not p.error.visible, (p.title, p.error.text)
    energy = panels["Energy"]
    bands = energy.sources[1]["bands"].data
    assert len(bands["xs"]) and any(len(x) for x in bands["xs"]), "no band against k on the quadrature route"
    assert qu.curve_bracket in energy.note.text or qu.curve_bracket.split()[0] in energy.note.text
    lines = dict(zip(energy.sources[1]["lines"].data["label"], energy.sources[1]["lines"].data["ys"]))
    t = int(qu.steps[-1])
    np.testing.assert_array_equal(lines[f"t = {t}"], qu.energy_curve("y")["value"].sel(step=t).values)
    with _Served(ServeOptions(url, port=0)) as s:
        assert s.get(f"/run?id={qu.id}")[0] == 200


@pytest.mark.slow  # the pair of runs: ~40 s on a free core
def test_fig7a_of_a_quadrature_sweep_hatches_the_bracket_of_the_mean(quad_pair) -> None:
    """Fig. 7a at a k beyond the exact top: the grid point's curve carries a bracket holding the
    exact route's E_t(y, k), and the figure hatches it."""
    from nsa_dist.config import SweepSpec
    from nsa_dist.plots.sweep import fig7a

    ex, qu, url = quad_pair
    base = QUAD.model_dump(mode="json")
    SpectrumStore(url).record_sweep(
        "qs", SweepSpec(name="qs", base=base, grid={"seed": [QBASE["seed"]]}).model_dump(mode="json"), [qu.id]
    )
    sweep = Client(url).sweep("qs")
    k = 60  # beyond top = 10, between two points of the grid
    (cv,) = sweep.curves("energy_y", k)
    want = ex.energy("y", k, step=None)[0]
    assert np.all(cv.bracket[0] <= want) and np.all(want <= cv.bracket[1]), (cv.bracket, want)
    assert np.any(cv.bracket[1] > cv.bracket[0])
    fig = fig7a(sweep, k)
    assert [c for c in fig.axes[0].collections if c.get_hatch()], "no hatched bracket"


@pytest.mark.slow  # a gang of two Ray workers: ~20 s
def test_a_block_rows_runs_curves_read_the_same_way(quad_pair) -> None:
    """k: all on layout block_rows (2 workers) takes the quadrature route; its curves read through the
    same client, and every bracket holds the exact route's value of the same seed."""
    ex, _, url = quad_pair
    spec = ExperimentSpec.model_validate(
        {
            **QBASE,
            "name": "q-rows",
            "spectrum": {
                "k": "all",
                "dtype": "float64",
                "layout": "block_rows",
                "workers": 2,
                "quadrature": {"top": 10, "lanczos_steps": 20, "probes": 8, "curve_points": 25},
            },
        }
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    rows = Client(url).run("q-rows")
    assert rows.energy_route == "quadrature" and rows.attrs.get("layout") == "block_rows"
    for name in ("energy_y", "energy_residual", "eigenvalue"):
        want, c = ex.curve(name).value, rows.curve(name)
        slop = 1e-9 * (1.0 if name != "eigenvalue" else float(np.abs(want).max()))
        for k in range(1, NQ + 1):
            _, lo, hi = c.at(k)
            assert np.all(lo <= want[:, k - 1] + slop) and np.all(want[:, k - 1] - slop <= hi), (name, k, lo, hi)
    v, lo, hi = rows.energy("y", 40)
    assert lo <= v <= hi and hi > lo


def test_a_top_eigenvalue_bracket_is_read_relative_to_its_own_size():
    """A λ bracket of ±0.1 % is a bracket at any scale of G (at 10⁻¹⁷⁰ an absolute floor read it as
    exact); one of ±10⁻¹⁰ relative reads as exact at any scale (review of a753d5e)."""
    from types import SimpleNamespace

    from nsa_dist.client._curves import _widen_top

    for s in (1.0, 1e-3, 1e-170):
        for half, exact_read in ((1e-3, False), (1e-10, True)):
            stored = {
                "curve_k": np.array([1, 2, 3]),
                "curve_eigenvalue_lower": np.array([[3.0, 2.0, 1.0 - half]]) * s,
                "curve_eigenvalue_upper": np.array([[3.0, 2.0, 1.0 + half]]) * s,
            }
            run = SimpleNamespace(array=stored.__getitem__, per_step=stored.__getitem__)
            lower, upper = np.array([[3.0, 2.0, 1.0]]) * s, np.array([[3.0, 2.0, 1.0]]) * s
            exact = np.ones(3, bool)
            _widen_top(run, "curve_eigenvalue", np.array([1, 2, 3]), 3, lower, upper, exact, False)
            assert bool(exact[2]) is exact_read, (s, half, lower, upper)
            if not exact_read:
                assert lower[0, 2] == (1.0 - half) * s and upper[0, 2] == (1.0 + half) * s, (s, lower, upper)


@pytest.mark.slow  # the pair of runs: ~40 s on a free core
def test_figures_drawn_from_eigenvectors_say_they_stop_at_the_quadrature_top(quad_pair) -> None:
    """Figs. 4a, 4d, 7d and Eqs. 4–5 stop at the exact top on the quadrature route, without a word while
    2a/3c said so (audit Y: 4a ended at i = 20 where the paper goes to N)."""
    from nsa_dist.plots import make_figure

    ex, qu, _ = quad_pair
    for name in ("fig4a_residual_projections", "fig4d_reconstructions", "fig7d_preservation", "eqs45_constant_gram"):
        said = " ".join(t.get_text() for t in make_figure(qu, name).texts)
        assert "its exact top 10 (spectrum.quadrature.top), so i and k stop at 10 here" in said, (name, said)
        assert "quadrature route" not in " ".join(t.get_text() for t in make_figure(ex, name).texts), name
