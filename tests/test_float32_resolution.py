"""What float32 cannot resolve is not stored as a confident number (an audit compared float32 and
float64 runs of one spec): the update Δf_t at a small rate, and the rounding allowance of the
stored spectrum's brackets."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch.nn.utils import vector_to_parameters

from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec
from nsa_dist.models import build_model
from nsa_dist.pipeline import run_experiment
from nsa_dist.store import SpectrumStore


def _tiny_lr_run(tmp_path, dtype: str, lr: float = 1e-5):
    spec = ExperimentSpec(
        name=f"tiny-lr-{dtype}",
        data={"n": 96, "n_test": 0},
        model={"depth": 3, "width": 48},
        optimizer={"name": "gd"},
        schedule={"lr": lr},
        steps=2,
        record={"steps": [0, 1]},
        spectrum={"k": 10, "dtype": dtype, "images": []},
    )
    url = str(tmp_path / f"{dtype}.zarr")
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    return spec, Client(url).run(spec.name)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_update_at_a_small_rate_is_the_networks_change_not_float32_rounding(tmp_path, caplog, dtype):
    """At lr 1e-5 the trainer's Δf_t = f_{t+1} − f_t of two float32 forwards was 0.6 % rounding: the first
    order's error stored 6.2e-3 where its definition in float64 gives 1.0e-3.  Now Δf_t is the float64
    forward's change at the trained (float32) parameters — both analysis dtypes — and the log says what
    the rest of the error is (the float32 update absorbs what rounds below half a parameter's spacing)."""
    with caplog.at_level(logging.WARNING, logger="nsa_dist"):
        spec, run = _tiny_lr_run(tmp_path, dtype)
    model = build_model(spec.model, seed=spec.seed, dtype=torch.float64)
    X = torch.as_tensor(run.X, dtype=torch.float64)
    theta = run.per_step("theta").astype(np.float64)

    def f(t: np.ndarray) -> np.ndarray:
        vector_to_parameters(torch.as_tensor(t), model.parameters())
        with torch.no_grad():
            return model(X).numpy().reshape(-1)

    df_ref = f(theta[1]) - f(theta[0])  # θ_1 = θ_0 + Δθ_0: both float32 parameter vectors, exact in float64
    df = run.per_step("df")[0].astype(np.float64).reshape(-1)
    rel = np.linalg.norm(df - df_ref) / np.linalg.norm(df_ref)
    assert rel < 1e-6, f"stored Δf_0 is {rel:.3g} (relative) from the float64 change f(θ_1) − f(θ_0)"
    pred = run.per_step("df_pred")[0].astype(np.float64).reshape(-1)
    want = np.linalg.norm(df_ref - pred) / np.linalg.norm(df_ref)
    got = float(run.first_order["error"][0])
    assert abs(got - want) <= 1e-3 * want, f"first_order_error {got:.6g}, from the float64 change {want:.6g}"
    said = [r.getMessage() for r in caplog.records if "not GD's" in r.getMessage()]
    assert len(said) == 1 and "float32 parameters absorb" in said[0], said


def test_a_float64_forward_that_is_not_the_trainers_function_keeps_the_float32_change():
    """Where the float64 forward does not give the trainer's outputs (here: a forward that adds 1 in
    float64 only), Δf_t stays f_{t+1} − f_t as trained — never another function's change."""
    from types import SimpleNamespace

    from nsa_dist.pipeline.producers import float64_change

    class Shifted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + (1.0 if x.dtype == torch.float64 else 0.0)

    model, X = Shifted(), torch.randn(5, 2)
    theta = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()
    with torch.no_grad():
        f0 = model(X).numpy()
    run = SimpleNamespace(model=model, X=X, plan=SimpleNamespace(coupled=False), spec=SimpleNamespace(name="s"))
    run.logged = set()
    ck = SimpleNamespace(theta=theta, dtheta=np.full_like(theta, 1e-3), f=f0, df=np.full_like(f0, 2e-3))
    assert np.array_equal(float64_change(run, ck), ck.df)
    assert run.logged == {"float64_change"}
    np.testing.assert_array_equal(torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy(), theta)


def _pair(tmp_path, name: str, spectrum: dict, n: int = 96):
    """The same network measured in float32 and float64 (training is float32 in both: the same θ_t)."""
    runs = {}
    for dtype in ("float32", "float64"):
        spec = ExperimentSpec(
            name=f"{name}-{dtype}",
            data={"n": n, "n_test": 0},
            model={"depth": 3, "width": 32},
            steps=30,
            record={"steps": [0, 1, 29]},
            spectrum={**spectrum, "dtype": dtype, "images": []},
        )
        url = str(tmp_path / f"{name}-{dtype}.zarr")
        assert run_experiment(spec, SpectrumStore(url)).status == "done"
        runs[dtype] = Client(url).run(spec.name)
    return runs["float32"], runs["float64"]


def _outside(curve, truth: np.ndarray) -> tuple[int, float]:
    lo, hi = np.asarray(curve.lower), np.asarray(curve.upper)
    miss = np.maximum(lo - truth, truth - hi)  # beyond float64's rounding of the truth (E(φ, N) = 1 − 7e-16)
    return int((miss > 1e-12 * np.fmax(np.abs(truth), 1e-300)).sum()), float(np.nanmax(miss))


def test_float32_eigenvalue_brackets_hold_the_float64_eigenvalues(tmp_path):
    """The exact route's λ_k brackets were points: under float32 the float64 λ lay outside at all 1,600
    entries of an audit's run, its tail 2.6 % off or of the wrong sign.  Now λ_k ± δ, δ = 4·eps₃₂·‖G‖_F."""
    r32, r64 = _pair(tmp_path, "eig", {"k": "all"})
    c32 = r32.curve("eigenvalue")
    truth = np.asarray(r64.curve("eigenvalue").value)
    n, worst = _outside(c32, truth)
    assert n == 0, f"{n} float64 eigenvalues outside the float32 brackets (worst by {worst:.3g})"
    tail = np.abs(truth[-1]) < 1e-3 * truth[-1, 0]  # the rounding-level tail: not exact
    assert tail.any() and not np.asarray(c32.exact)[tail].any()
    width = np.asarray(c32.upper) - np.asarray(c32.lower)
    lam, fro = np.asarray(r32.eigenvalues, np.float64), np.sqrt(r32.per_step("gram_sq_frobenius")[:, 0])
    np.testing.assert_allclose(width, 2 * 4 * np.finfo(np.float32).eps * fro[:, None] * np.ones_like(lam), rtol=1e-9)
    c64 = r64.curve("eigenvalue")  # float64: ± n·eps₆₄·λ_1, its top exact to TOP_RESOLUTION
    assert np.asarray(c64.exact)[:5].all() and _outside(c64, truth)[0] == 0


def test_float32_quadrature_brackets_hold_the_exact_float64_energies(tmp_path):
    """The quadrature route's float32 brackets left out the n·eps₃₂ rounding of the projections the exact
    route's carry: the exact float64 E(residual, k) lay 1.2e-6 above one (an audit, N = 400)."""
    q32, _ = _pair(tmp_path, "quad", {"k": "all", "energy": "quadrature", "quadrature": {"top": 12}})
    _, e64 = _pair(tmp_path, "exact", {"k": "all", "energy": "exact"})
    for name in ("eigenvalue", "energy_y", "energy_f", "energy_residual"):
        c = q32.curve(name)
        truth = np.asarray(e64.curve(name).value)[:, np.asarray(c.k) - 1]
        n, worst = _outside(c, truth)
        assert n == 0, f"{name}: {n} exact float64 values outside the float32 quadrature brackets (by {worst:.3g})"
    # its SLQ density below float32's resolution was noise (3.6e-5 for 3.2e5 in the audit): NaN there
    grid, dens = q32.gram_density(step=None)
    floor = 4 * np.finfo(np.float32).eps * np.sqrt(q32.per_step("gram_sq_frobenius")[:, :1].astype(np.float64))
    below = np.abs(grid) < floor
    assert below.any() and np.isnan(dens[below]).all() and np.isfinite(dens[~below]).all()


def test_the_kernel_change_of_a_float32_run_is_measured_in_float64(tmp_path):
    """App. F's measured G_{t+1} − G_t was two float32 products' difference: at lr 1e-5 its distance from
    the first order was 860–1,670× the float64 value and v₁ᵀΔG v₁ 4.6 % off (an audit).  Both dtypes'
    runs of one network now store the float64 measurement."""
    runs = []
    for dtype in ("float32", "float64"):
        spec = ExperimentSpec(
            name=f"dg-{dtype}",
            data={"n": 64, "n_test": 0},
            model={"depth": 3, "width": 32},
            schedule={"lr": 1e-5},
            steps=2,
            record={"steps": [0, 1]},
            spectrum={"k": 10, "dtype": dtype, "images": [], "gram_change_k": 3},
        )
        url = str(tmp_path / f"{dtype}.zarr")
        assert run_experiment(spec, SpectrumStore(url)).status == "done"
        runs.append(Client(url).run(spec.name))
    r32, r64 = runs
    for name in ("gram_change", "gram_change_fro"):
        a, b = r32.per_step(name).astype(np.float64), r64.per_step(name).astype(np.float64)
        rel = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert rel < 1e-6, f"{name}: float32 run {a.ravel()[:4]} against float64 {b.ravel()[:4]} ({rel:.3g})"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_numerical_rank_is_said_and_drawn_where_projections_are_one_basis_of_many(tmp_path, dtype):
    """Beyond G_t's numerical rank the eigenvectors are one basis of many, so ⟨v_i, m⟩² there is that
    basis's value (float32 stored 0.54 for the float64 run's 3.11, an audit): Run.numerical_rank counts
    the eigenvalues above the rounding δ, and Fig. 4a shades the indices beyond it."""
    from nsa_dist.plots import make_figure

    spec = ExperimentSpec(
        name=f"rank-{dtype}",
        data={"n": 64, "n_test": 0},
        model={"depth": 2, "width": 8},  # 2·8 + 8 + 8 + 1 = 33 parameters: rank ≤ 33 < N
        steps=4,
        record={"steps": [0, 3]},
        spectrum={"k": "all", "dtype": dtype, "images": []},
    )
    url = str(tmp_path / "r.zarr")
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run(spec.name)
    lam = np.asarray(run.eigenvalues, np.float64)
    fro = np.sqrt(run.per_step("gram_sq_frobenius")[:, 0].astype(np.float64))
    eps32 = np.finfo(np.float32).eps if dtype == "float32" else 0.0
    delta = np.maximum(64 * np.finfo(np.float64).eps * lam[:, 0], 4 * eps32 * fro)
    want = (lam > delta[:, None]).sum(axis=1)
    assert run.numerical_rank(step=None).tolist() == want.tolist() and (want <= 33).all() and (want >= 10).all()
    assert run.numerical_rank(3) == want[1]
    ax = make_figure(run, "fig4a_residual_projections").axes[0]
    spans = [p for p in ax.patches if p.get_label() == "beyond $G_t$'s numerical rank"]
    assert len(spans) == 1 and np.isclose(spans[0].get_x(), want.min() + 0.5), [p.get_label() for p in ax.patches]
