"""k: all beyond one node: λ_k and E_t(φ, k) for every k from products with G, with brackets that
contain the exact (dense float64 eigh) values — on a trained network's Gram, in float64 and float32,
and the same curves in every layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from torch.nn.utils import vector_to_parameters

from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.linalg.quadrature import _Rule, curve_ks, spectral_curves
from nsa_dist.models import build_model
from nsa_dist.ntk import gram
from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run, run_experiment
from nsa_dist.store import SpectrumStore

PHIS = ("y", "f", "residual", "df", "df_pred")
CURVES = ("curve_eigenvalue",) + tuple(f"curve_energy_{p}" for p in PHIS)


@pytest.fixture(scope="module")
def trained() -> dict:
    """The Gram of a trained leaky-ReLU net (the NSA paper's kind, narrower) on the 2-D image task,
    its exact spectrum and the step's φ."""
    spec = ExperimentSpec.model_validate(
        {
            "name": "q",
            "seed": 0,
            "data": {"name": "image2d", "n": 500, "n_test": 10},
            "model": {"depth": 4, "width": 64, "activation": "leaky_relu", "init": "xavier"},
            "schedule": {"lr": 0.25},
            "steps": 200,
            "record": {"steps": [0, 199]},
            "spectrum": {"k": 10},
        }
    )
    data = load_dataset(spec.data, seed=0)
    ck = list(Trainer(plan_run(spec, data), data).train_until(200))[-1]
    model = build_model(spec.model, seed=0)
    vector_to_parameters(torch.as_tensor(ck.theta, dtype=torch.float32), model.parameters())
    G = gram(model, torch.as_tensor(np.asarray(data.X), dtype=torch.float32), dtype=torch.float64)
    y, f = np.asarray(data.y, np.float64), np.asarray(ck.f, np.float64)
    return {"G": G, "phis": {"y": y, "f": f, "residual": f - y, "df": np.asarray(ck.df, np.float64)}}


def _exact(G: np.ndarray, phis: dict) -> tuple[np.ndarray, np.ndarray, dict]:
    w, V = np.linalg.eigh(G)
    w, V = w[::-1].copy(), V[:, ::-1].copy()
    return w, V, {n: np.cumsum((V.T @ p) ** 2) / np.sum(p**2) for n, p in phis.items()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_brackets_contain_the_exact_curves_of_a_trained_gram(trained, dtype):
    G = trained["G"].to(dtype)
    w, V, E = _exact(G.double().numpy(), trained["phis"])
    N, K = G.shape[0], 40
    ks = curve_ks(N, 60)
    c = spectral_curves(G, w[:K], V[:, :K], trained["phis"], ks, lanczos_steps=40, probes=16, block_size=16)
    lam = w[ks - 1]
    tol = 1e-9 * w[0]
    e = c.eigenvalue
    out = (lam < e.lower - tol) | (lam > e.upper + tol)
    assert not out.any(), f"λ_k outside its bracket at k = {ks[out]}: {e.lower[out]} ≤ {lam[out]} ≤ {e.upper[out]}?"
    assert np.all(e.lower <= e.value) and np.all(e.value <= e.upper)
    widths = {}
    for name, Ex in E.items():
        b, x = c.energy[name], Ex[ks - 1]
        out = (x < b.lower - 1e-9) | (x > b.upper + 1e-9)
        assert not out.any(), (
            f"E({name}, k) outside its bracket at k = {ks[out]}: lower {b.lower[out]}, exact "
            f"{x[out]}, upper {b.upper[out]}"
        )
        assert np.all(b.lower <= b.value + 1e-15) and np.all(b.value <= b.upper + 1e-15)
        top = ks <= K
        np.testing.assert_allclose(b.value[top], x[top], rtol=1e-8, atol=1e-10, err_msg=f"E({name}, k ≤ K) exact")
        assert np.all(b.lower[top] == b.upper[top]) and b.value[-1] == 1.0
        wd = b.upper - b.lower
        widths[name] = (float(wd.max()), int(ks[np.argmax(wd)]))
    print(f"{dtype}: largest bracket widths (width, at k):", widths)
    # the target and the measured φ: where the trained network has put them (the top of the spectrum);
    # in float32 the exact route reduces G in float32, and the brackets take in that rounding
    # (δ ≥ 4·eps₃₂·‖G‖_F: y 0.0297 wide at k = 365 here), so the width target is float64's
    for name in ("y", "f") if dtype == torch.float64 else ("f",):
        assert widths[name][0] <= 0.02, f"E({name}, k) bracket {widths[name][0]:.4f} wide at k = {widths[name][1]}"


def test_gauss_and_radau_bounds_hold_for_any_measure_with_the_moments():
    """The Chebyshev–Markov–Stieltjes bounds from 2m moments bracket the measure's tail at every t;
    Radau's (through t) are inside the Gauss nodes' ones."""
    rng = np.random.default_rng(3)
    lam, c = np.sort(rng.gamma(0.4, size=500)), rng.standard_normal(500) ** 2
    r = _Rule(lam, c, 10, False)
    ts = np.concatenate([np.linspace(0, lam.max() * 1.1, 400), lam[::25]])
    closed = np.array([c[lam >= t].sum() for t in ts])
    opened = np.array([c[lam > t].sum() for t in ts])
    lo, hi = r.radau(ts)
    assert np.all(r.tail_lower(ts) <= opened + 1e-9) and np.all(closed <= r.tail_upper(ts) + 1e-9)
    assert np.all(lo <= opened + 1e-9) and np.all(closed <= hi + 1e-9), np.max(lo - opened)
    assert np.all(lo >= r.tail_lower(ts) - 1e-12) and np.all(hi <= r.tail_upper(ts) + 1e-12)


def test_every_eigenpair_exact_when_the_top_is_all_of_g():
    rng = np.random.default_rng(0)
    N = 60
    X = rng.standard_normal((N, 8))
    G = X @ X.T + np.eye(N)
    w, V, _ = _exact(G, {})
    ks = curve_ks(N, 20)
    c = spectral_curves(G, w, V, {"y": V[:, 3], "z": None}, ks)  # y is the 4th eigenvector: E = 1[k ≥ 4]
    assert np.array_equal(c.eigenvalue.lower, c.eigenvalue.upper)
    np.testing.assert_allclose(c.eigenvalue.value, w[ks - 1])
    assert np.isnan(c.energy["z"].value).all()
    np.testing.assert_allclose(c.energy["y"].value, (ks >= 4).astype(float), atol=1e-12)


def test_bad_inputs_are_named():
    G = np.eye(5)
    with pytest.raises(ValueError, match="evecs must be"):
        spectral_curves(G, np.ones(2), np.ones((5, 3)), {}, np.array([1, 5]))
    with pytest.raises(ValueError, match="ks must be sorted"):
        spectral_curves(G, np.ones(2), np.ones((5, 2)), {}, np.array([1, 6]))
    with pytest.raises(ValueError, match="N >= 1 and points >= 2"):
        curve_ks(10, 1)
    k = curve_ks(10_000, 100)
    assert k[0] == 1 and k[-1] == 10_000 and np.all(np.diff(k) > 0)


# --------------------------------------------------------------------------- the spec and the pipeline
def _spec(layout: str, workers: int, **spectrum) -> ExperimentSpec:
    return ExperimentSpec.model_validate(
        {
            "name": "curve",
            "seed": 0,
            "data": {"n": 160, "n_test": 20},
            "model": {"depth": 3, "width": 32},
            "steps": 5,
            "record": {"steps": [0, 4]},
            "spectrum": {
                "dtype": "float64",
                "k": "all",
                "layout": layout,
                "workers": workers,
                "images": [],
                "quadrature": {"top": 20, "lanczos_steps": 25, "probes": 12, "curve_points": 40},
                **spectrum,
            },
        }
    )


def test_spec_routes():
    assert plan_run(_spec("local", 1), load_dataset(_spec("local", 1).data, seed=0)).energy_route == "exact"
    for layout, W in (("block_rows", 2), ("matrix_free", 2)):
        spec = _spec(layout, W)
        plan = plan_run(spec, load_dataset(spec.data, seed=0))
        assert plan.energy_route == "quadrature" and plan.K == 20 and plan.has("curve_energy_y_upper")
    with pytest.raises(ValidationError, match="energy='exact' with k='all'"):
        _spec("block_rows", 2, energy="exact")
    with pytest.raises(ValidationError, match="energy='quadrature' is the route of k='all'"):
        ExperimentSpec.model_validate({"spectrum": {"k": 10, "energy": "quadrature"}})


def _assert_bracketed(a: dict, what: str) -> None:
    for name in CURVES:
        v, lo, hi = (np.asarray(a[name + s], np.float64) for s in ("", "_lower", "_upper"))
        assert np.isfinite(v).all() and np.isfinite(lo).all() and np.isfinite(hi).all(), f"{what}: {name} not finite"
        assert np.all(lo <= v) and np.all(v <= hi), f"{what}: {name} outside its own bracket"


def _analyses(layouts) -> dict:
    out = {}
    for layout, W in layouts:
        spec = _spec(layout, W, energy="quadrature")
        data = load_dataset(spec.data, seed=0)
        plan = plan_run(spec, data)
        ck = list(Trainer(plan, data).train_until(5))[-1]
        out[(layout, W)] = SpectralAnalyzer(plan, data).analyze(ck).arrays()
    return out


def _assert_same_curves(got: dict, ref: dict, what: str) -> None:
    """Values within the larger of the two brackets' widths (plus rounding), brackets overlapping."""
    for name in CURVES:
        a, b = (np.asarray(x[name], np.float64) for x in (got, ref))
        width = np.maximum(got[name + "_upper"] - got[name + "_lower"], ref[name + "_upper"] - ref[name + "_lower"])
        scale = 1e-9 * max(np.abs(b).max(), 1e-300)
        bad = np.abs(a - b) > width + scale
        assert not bad.any(), (
            f"{what}: {name} differs beyond the bracket widths at {np.nonzero(bad)[0]}: "
            f"{a[bad]} vs {b[bad]} (widths {width[bad]})"
        )
        assert np.all(got[name + "_lower"] <= ref[name + "_upper"] + scale) and np.all(
            ref[name + "_lower"] <= got[name + "_upper"] + scale
        ), f"{what}: {name} brackets do not overlap"


def test_layouts_give_the_same_curves_in_process():
    """local, block_rows ×3 and matrix_free ×2 (in-process gangs): the same curves within the brackets."""
    res = _analyses([("local", 1), ("block_rows", 3), ("matrix_free", 2)])
    ref = res[("local", 1)]
    for key, got in res.items():
        _assert_bracketed(got, str(key))
        _assert_same_curves(got, ref, f"{key} vs local")
    np.testing.assert_allclose(res[("block_rows", 3)]["eigenvalues"], ref["eigenvalues"], rtol=1e-9)


@pytest.mark.slow
def test_block_rows_and_matrix_free_on_ray_end_done_with_bracketed_curves(local_ray, tmp_path):
    """A sweep on a real local Ray cluster, gangs of block_rows ×3 and matrix_free ×2: done, every curve
    finite and bracketed, the same curves as the single-process local run within the bracket widths."""
    from nsa_dist.client import Client
    from nsa_dist.cluster import SweepCoordinator
    from nsa_dist.config import SweepSpec

    ref_spec = _spec("local", 1, energy="quadrature")
    ref_url = str(tmp_path / "ref.zarr")
    assert run_experiment(ref_spec, SpectrumStore(ref_url)).status == "done"
    ref = Client(ref_url).run("curve")
    for layout, W in (("block_rows", 3), ("matrix_free", 2)):
        base = _spec(layout, W).model_dump(mode="json")
        sweep = SweepSpec(name=f"curve-{layout}", base=base, cluster={"spectral_workers": 1, "worker_cpus": 1})
        url = str(tmp_path / f"{layout}.zarr")
        (outcome,) = SweepCoordinator(sweep, url).run()
        assert outcome.status == "done", outcome
        run = Client(url).run(outcome.run_id)
        assert run.g.attrs["energy_route"] == "quadrature" and "provable" in run.g.attrs["curve_bracket"]
        assert run.g["curve_k"][:][-1] == 160
        for i in range(2):
            got = {n + s: run.g[n + s][i] for n in CURVES for s in ("", "_lower", "_upper")}
            want = {n + s: ref.g[n + s][i] for n in CURVES for s in ("", "_lower", "_upper")}
            _assert_bracketed(got, f"{layout} step {i}")
            _assert_same_curves(got, want, f"{layout} step {i} vs local")
            dens, grid = run.g["gram_density"][i], run.g["gram_density_grid"][i]
            assert abs(np.trapezoid(dens, grid) - 1) < 1e-6


def test_the_budget_counts_the_quadrature_route():
    from nsa_dist.pipeline.budget import footprint

    base = {"data": {"n": 200_000}, "model": {"depth": 6, "width": 256}}
    q = footprint(
        ExperimentSpec.model_validate({**base, "spectrum": {"k": "all", "layout": "matrix_free", "workers": 2}})
    )
    top = footprint(
        ExperimentSpec.model_validate({**base, "spectrum": {"k": 100, "layout": "matrix_free", "workers": 2}})
    )
    assert q.parts["eigenvectors"] == top.parts["eigenvectors"] == 8.0 * 200_000 * 100  # top = 100: not N²
    assert q.parts["quadrature Lanczos basis"] >= 16.0 * 200_000 * 60  # one block's V and G·V at least
    assert "quadrature Lanczos basis" not in top.parts
    local = footprint(ExperimentSpec.model_validate({"data": {"n": 2000}, "spectrum": {"k": "all"}}))
    assert local.parts["eigenvectors"] == 8.0 * 2000**2 and "quadrature Lanczos basis" not in local.parts
