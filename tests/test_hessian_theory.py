"""The Hessian paper's predictions as measured quantities, against dense float64 references.

Additivity gap, Tr(S) = ∇Cᵀ·G, the Θ∞ limit of I, numerical ranks, the new activations, the
active regime and cross-entropy — each on a tiny net where torch.func.hessian / jacrev / eigh
give the exact answer.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import flat_model
from torch.func import hessian, jacrev

from nsa_dist.config import Activation, ExperimentSpec, ModelSpec
from nsa_dist.hessian import (
    additivity_gap,
    hessian_parts,
    limit_gauss_newton_eigenvalues,
    numerical_ranks,
    output_hessian_traces,
    trace_S_from_G,
)
from nsa_dist.hessian._probes import rademacher
from nsa_dist.models import SOFTPLUS_SCALE, SOFTPLUS_SHIFT, build_model, normalized_softplus
from nsa_dist.ntk import limit_ntk

F64 = torch.float64


def _net(depth=3, width=5, d=3, K=1, act="tanh", seed=0):
    return build_model(
        ModelSpec(input_dim=d, output_dim=K, depth=depth, width=width, activation=act, init="ntk"), seed=seed, dtype=F64
    )


_flat = flat_model


def _dense(model, X, Y, loss="mse"):
    """Dense H, I, S (P, P) of C = (1/N) Σ c(f_i, y_i) from torch.func.hessian / jacrev."""
    flat, f = _flat(model)
    N = X.shape[0]

    def F(v):
        out = f(v, X)
        return out[:, None] if out.ndim == 1 else out

    if loss == "mse":
        C = lambda v: 0.5 * ((F(v) - Y.reshape(N, -1)) ** 2).sum() / N  # noqa: E731
    else:
        C = lambda v: -(Y * torch.log_softmax(F(v), -1)).sum() / N  # noqa: E731
    H = hessian(C)(flat)
    J = jacrev(F)(flat).reshape(-1, flat.numel())  # (N·K, P)
    out = F(flat).detach()
    if loss == "mse":
        HC = torch.eye(J.shape[0], dtype=F64)
    else:
        p = torch.softmax(out, -1)
        HC = torch.block_diag(*[torch.diag(pi) - torch.outer(pi, pi) for pi in p])
    I = J.T @ HC @ J / N
    return H.numpy(), I.numpy(), (H - I).numpy(), J.numpy(), out.numpy()


def _traces(A, kmax=4):
    return np.array([np.trace(np.linalg.matrix_power(A, k)) for k in range(1, kmax + 1)])


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = _net()
    X = torch.randn(6, 3, dtype=F64)
    Y = torch.randn(6, dtype=F64)
    return model, X, Y


# --------------------------------------------------------------------------- Theorem 1


def test_additivity_gap_matches_the_dense_gap(tiny):
    model, X, Y = tiny
    H, I, S = hessian_parts(model, X, Y, dtype=F64)
    Hd, Id, Sd, _, _ = _dense(model, X, Y)
    P = Hd.shape[0]
    ref = _traces(Hd) - _traces(Id) - _traces(Sd)
    exact = additivity_gap(H, I, S, n_probes=2 * P + 2, seed=3)  # sketch spans R^P: exact
    np.testing.assert_allclose(
        exact.estimate, ref, rtol=1e-8, atol=1e-12, err_msg=f"gap {exact.estimate} vs dense {ref}"
    )
    np.testing.assert_allclose(exact.estimate[1], 2 * np.trace(Id @ Sd), rtol=1e-8)  # k = 2: 2 Tr(IS) ≠ 0
    est = additivity_gap(H, I, S, n_probes=16, seed=4)  # a real estimate: within its standard error
    scale = _traces(Hd)
    assert abs(est.estimate[0]) < 1e-12 * scale[0], f"k = 1: H = I + S exactly, gap {est.estimate[0]}"
    assert est.stderr[0] < 1e-12 * scale[0]
    for k in range(1, 4):
        assert abs(est.estimate[k] - ref[k]) <= 5 * est.stderr[k] + 1e-12 * scale[k], (
            f"k = {k + 1}: {est.estimate[k]} ± {est.stderr[k]} vs dense {ref[k]}"
        )


# --------------------------------------------------------------------------- Proposition 4: Tr(S) = ∇Cᵀ G


def test_output_traces_and_trace_S_against_dense_model_hessians(tiny):
    model, X, Y = tiny
    flat, f = _flat(model)
    P = flat.numel()
    Hf = torch.stack([hessian(lambda v, i=i: f(v, X[i : i + 1])[0])(flat) for i in range(X.shape[0])])  # (N, P, P)
    G_ref = torch.einsum("ipp->i", Hf).numpy()
    m, seed = 12, 5
    tr = output_hessian_traces(model, X, m, seed=seed, block_size=4)  # two blocks
    Z = rademacher(np.random.default_rng(seed), P, m)  # the same probes
    q_ref = np.einsum("pm,ipq,qm->mi", Z, Hf.numpy(), Z)
    np.testing.assert_allclose(
        tr.per_probe[:, :, 0], q_ref, rtol=1e-9, atol=1e-12, err_msg="zᵀ ∇²f(x_i) z per probe and point"
    )
    assert np.all(np.abs(tr.estimate[:, 0] - G_ref) <= 5 * tr.stderr[:, 0] + 1e-12), (tr.estimate[:, 0], G_ref)
    _, _, Sd, _, out = _dense(model, X, Y)
    R = out[:, 0] - Y.numpy()
    value, se = trace_S_from_G(R, tr)
    np.testing.assert_allclose(value, np.mean(np.einsum("pm,pq,qm->m", Z, Sd, Z)), rtol=1e-9)  # = mean zᵀSz
    assert abs(value - np.trace(Sd)) <= 5 * se, (value, se, np.trace(Sd))
    np.testing.assert_allclose(np.mean(R * G_ref), np.trace(Sd), rtol=1e-9, err_msg="Tr(S) = (1/N) Σ r_i G_i")


# --------------------------------------------------------------------------- the limit of I


def test_limit_eigenvalues_are_the_weighted_kernel_pca():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(5, 3))
    T = limit_ntk(X, depth=3, activation="tanh").numpy()
    mse = limit_gauss_newton_eigenvalues(T, np.zeros((5, 2)))
    np.testing.assert_allclose(mse, np.sort(np.linalg.eigvalsh(np.kron(T, np.eye(2)) / 5))[::-1], rtol=1e-10)
    F = rng.normal(size=(5, 3))
    Y = np.eye(3)[[0, 1, 2, 0, 1]]
    ce = limit_gauss_newton_eigenvalues(T, F, Y, loss="cross_entropy")
    p = np.exp(F) / np.exp(F).sum(1, keepdims=True)
    HC = np.zeros((15, 15))
    for i in range(5):
        HC[3 * i : 3 * i + 3, 3 * i : 3 * i + 3] = np.diag(p[i]) - np.outer(p[i], p[i])
    ref = np.sort(np.linalg.eigvals(np.kron(T, np.eye(3)) @ HC / 5).real)[::-1]  # similar to HC½ Θ HC½
    np.testing.assert_allclose(ce, ref, rtol=1e-8, atol=1e-12, err_msg="CE: eig((1/N) Θ⊗Id · HC)")
    with pytest.raises(ValueError, match="needs the outputs F"):
        limit_gauss_newton_eigenvalues(T, loss="cross_entropy")


def test_measured_I_approaches_its_limit_with_width():
    X = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    lim = limit_gauss_newton_eigenvalues(limit_ntk(X, depth=2, activation="atan"))
    from nsa_dist.hessian import gauss_newton_eigenvalues

    errs = []
    for w in (16, 1024):  # fluctuations O(1/√w): 8× smaller in expectation
        mu = [
            gauss_newton_eigenvalues(_net(depth=2, width=w, act="atan", seed=s), X, torch.zeros(4, dtype=F64))
            for s in range(3)
        ]
        errs.append(np.mean([np.abs(m - lim).max() / lim.max() for m in mu]))
    assert errs[1] < errs[0] / 3 and errs[1] < 0.1, f"relative error of I's spectrum at w = 16, 1024: {errs}"


# --------------------------------------------------------------------------- rank bounds


def test_numerical_ranks_against_dense_eigendecompositions():
    torch.manual_seed(2)
    model = _net(depth=3, width=2, d=6, K=1, act="softplus", seed=2)  # P = 6·2+2 + 2·2+2 + 2+1 = 23
    X, Y = torch.randn(2, 6, dtype=F64), torch.randn(2, dtype=F64)
    r = numerical_ranks(model, X, Y, tol=1e-9)
    Hd, Id, Sd, _, _ = _dense(model, X, Y)
    for name, A in (("I", Id), ("S", Sd), ("H", Hd)):
        lam = np.linalg.eigvalsh(A)
        ref = int(np.sum(np.abs(lam) > 1e-9 * np.abs(lam).max()))
        assert getattr(r, name) == ref, f"Rank({name}): {getattr(r, name)} vs dense {ref} (P = {r.P})"
        np.testing.assert_allclose(np.sort(r.evals[name]), np.sort(lam), atol=1e-10 * np.abs(lam).max())
    assert (r.bound_I, r.bound_S, r.P) == (2, 2 * 2 * 2 * 2 * 1, 23)
    assert r.I <= r.bound_I and r.S <= r.bound_S < r.P, r
    with pytest.raises(ValueError, match="tol"):
        numerical_ranks(model, X, Y, tol=0)


# --------------------------------------------------------------------------- activations


@pytest.mark.parametrize("act", ["atan", "softplus_normalized"])
def test_new_activations_derivative_and_normalisation(act):
    from nsa_dist.ntk.limit import _ACTIVATIONS

    phi, dphi = _ACTIVATIONS[Activation(act)]
    u = torch.linspace(-6, 6, 101, dtype=F64, requires_grad=True)
    (g,) = torch.autograd.grad(phi(u).sum(), u)
    np.testing.assert_allclose(dphi(u.detach()).numpy(), g.numpy(), rtol=1e-12, atol=1e-14, err_msg=f"σ′ of {act}")
    model_act = build_model(ModelSpec(input_dim=1, output_dim=1, depth=2, width=1, activation=act), dtype=F64).act
    np.testing.assert_allclose(model_act(u.detach()).numpy(), phi(u.detach()).numpy(), rtol=0, atol=0)
    if act == "softplus_normalized":
        z = torch.as_tensor(np.random.default_rng(0).normal(size=2_000_000))
        v = normalized_softplus(z)
        assert abs(float(v.mean())) < 3e-3 and abs(float((v**2).mean()) - 1) < 3e-3, (
            float(v.mean()),
            float((v**2).mean()),
        )
        assert abs(SOFTPLUS_SHIFT - 0.80606) < 1e-4 and abs(SOFTPLUS_SCALE - 0.52107) < 1e-4


@pytest.mark.parametrize("act", ["atan", "softplus_normalized"])
def test_limit_ntk_of_new_activations_against_monte_carlo_recursion(act):
    """Θ∞ by quadrature against the recursion Σ⁽ℓ⁺¹⁾ = E[σ(u)σ(u′)] + β², Σ̇ = E[σ′σ′′] by Monte Carlo."""
    from nsa_dist.ntk.limit import _ACTIVATIONS

    phi, dphi = _ACTIVATIONS[Activation(act)]
    rng = np.random.default_rng(1)
    X = rng.normal(size=(3, 4))
    beta2, L, n = 0.1**2, 3, 400_000
    K = X @ X.T / 4 + beta2
    theta = K.copy()
    for _ in range(L - 1):
        u = torch.as_tensor(rng.normal(size=(n, 3)) @ np.linalg.cholesky(K + 1e-12 * np.eye(3)).T)
        s, ds = phi(u).numpy(), dphi(u).numpy()
        K, Kd = s.T @ s / n + beta2, ds.T @ ds / n
        theta = theta * Kd + K
    quad = limit_ntk(X, depth=L, activation=act).numpy()
    np.testing.assert_allclose(
        quad, theta, rtol=1e-2, atol=4e-3 * np.abs(theta).max(), err_msg=f"Θ∞ ({act}): quadrature vs Monte Carlo"
    )


# --------------------------------------------------------------------------- the active regime


def test_active_regime_divides_the_output_and_scales_the_learning_rate():
    base = dict(
        data={"n": 8},
        model={"depth": 3, "width": 7, "init": "ntk", "activation": "atan"},
        steps=3,
        record={"every": 1},
        schedule={"lr": 0.05},
        spectrum={"k": 4, "images": []},
    )
    ntk = ExperimentSpec(**base)
    act = ExperimentSpec(**{**base, "model": {**base["model"], "regime": "active"}})
    X = torch.randn(5, 2, dtype=F64)
    f_ntk = build_model(ntk.model, seed=0, dtype=F64)(X)
    f_act = build_model(act.model, seed=0, dtype=F64)(X)
    np.testing.assert_allclose(f_act.detach().numpy(), f_ntk.detach().numpy() / math.sqrt(7), rtol=1e-12)
    assert act.lr_at(2) == pytest.approx(0.05 * 7) and ntk.lr_at(2) == 0.05
    from nsa_dist.data import load_dataset
    from nsa_dist.pipeline import Trainer, plan_run

    data = load_dataset(act.data, seed=0)
    tr = Trainer(plan_run(act, data), data)
    ck = next(tr.train_until(1))
    model = build_model(act.model, seed=0)
    Xd, yd = torch.as_tensor(data.X, dtype=torch.float32), torch.as_tensor(data.y, dtype=torch.float32)
    loss = 0.5 * ((model(Xd) - yd) ** 2).mean()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    step = -0.05 * 7 * torch.cat([g.reshape(-1) for g in grads]).numpy()
    assert ck.lr == pytest.approx(0.05 * 7)
    np.testing.assert_allclose(ck.dtheta, step, rtol=1e-4, atol=1e-7, err_msg="θ₁ − θ₀ = −(lr · w) ∇L")
    from nsa_dist.pipeline.hessian_step import HessianAnalysis, limit_reason

    assert limit_reason(ntk) is None and "active" in limit_reason(act)
    assert "init='xavier'" in limit_reason(ExperimentSpec(**{**base, "model": {"depth": 3, "width": 7}}))
    active = ExperimentSpec(**{**base, "model": {**base["model"], "regime": "active"}, "hessian": {}})
    h = HessianAnalysis(plan_run(active, data), torch.zeros(5, 2), np.zeros(5))
    with pytest.raises(ValueError, match="no infinite-width limit of I.*regime='active'"):
        h.limit_gram()
    with pytest.raises(ValueError, match="regime='active'.*init='ntk'"):
        ExperimentSpec(**{**base, "model": {"depth": 3, "width": 7, "regime": "active"}})


def test_rank_bound_of_S_only_for_a_network_of_linear_layers():
    """A trainable weight outside the Linear layers: its L and w read from the Linears alone gave
    bound_S = 0 (L = 1) beside a numerical Rank(S) > 0 — a bound the model broke, reported as the paper's."""

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))
            self.out = torch.nn.Linear(3, 1).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(x * self.w))

    torch.manual_seed(0)
    X, Y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)
    r = numerical_ranks(Scaled(), X, Y)
    assert r.S > 0 and r.bound_S is None, r
    frozen = Scaled()
    frozen.w.requires_grad_(False)  # only the Linear trains: the bound holds again (L = 1: S = 0)
    r = numerical_ranks(frozen, X, Y)
    assert r.bound_S == 0 and r.S == 0, r
