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
BASE = {"data": {"n": N, "n_test": 12}, "model": {"depth": 2, "width": 24}, "steps": 6, "record": {"every": 3},
        "seed": 3}
EXACT = ExperimentSpec.model_validate({**BASE, "name": "exact",
                                       "spectrum": {"k": "all", "dtype": "float64", "test_points": True}})
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
    c = BracketedCurve("energy_y" if increasing else "eigenvalue", np.arange(3), grid, v, v - pad_lo, v + pad_hi,
                       top, n, "quadrature", "statistical", 0.95)
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

