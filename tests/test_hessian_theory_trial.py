"""Adversarial trial of the Hessian paper's theory side (theory, s_limit, moments, orthogonality, slq).

Every reference here is computed independently in float64: dense H, I = Jᵀ ∇²_f C J and
S = H − I by torch.func.hessian / jacrev of a small net and its loss; traces, ranks and spectra by
numpy; the limiting kernels by an own Gauss–Hermite recursion (the 2 × 2 covariance diagonalised,
not Cholesky-factored), an own depth-2 derivation of Φ, Υ, Λ integrated by a fine 2-D trapezoid
rule, and a Monte-Carlo mean of empirical NTKs of wide random nets.  Statistical checks state
their tolerance at a fixed seed.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from scipy.stats import norm
from torch.func import functional_call, hessian, jacrev

from nsa_dist.config import ModelSpec
from nsa_dist.errors import NonFiniteError, ShapeError
from nsa_dist.hessian import (
    additivity_gap,
    hessian_parts,
    limit_gauss_newton_eigenvalues,
    numerical_ranks,
)
from nsa_dist.hessian.moments import (
    dense_moments,
    gauss_newton_eigenvalues,
    gauss_newton_moments,
    hutchinson_moments,
    hutchpp_moments,
)
from nsa_dist.hessian.orthogonality import orthogonality, rayleigh_quotients
from nsa_dist.hessian.s_limit import limit_S_kernels, limit_trace_S2, limit_trace_S_gd, limit_trace_S_init
from nsa_dist.hessian.slq import slq_density
from nsa_dist.hessian.theory import power_moments
from nsa_dist.models import SOFTPLUS_SCALE, SOFTPLUS_SHIFT, build_model

F64 = torch.float64


# --------------------------------------------------------------------------- independent references


def _net(depth=3, width=4, d=3, K=1, act="tanh", seed=1, beta=0.1, dtype=F64):
    spec = ModelSpec(input_dim=d, output_dim=K, depth=depth, width=width, activation=act, init="ntk", bias_scale=beta)
    return build_model(spec, seed=seed, dtype=dtype)


def _dense_parts(model, X, Y, loss):
    """Dense float64 (H, I, S) of C = (1/N) Σ c(f(x_i), y_i) over every parameter."""
    params = {k: p.detach().to(F64) for k, p in model.named_parameters()}
    names, shapes = list(params), [p.shape for p in params.values()]
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    m64 = model.to(F64)
    X = X.to(F64)
    N = X.shape[0]

    def F(v):
        out, o = {}, 0
        for n, s in zip(names, shapes):
            out[n] = v[o : o + s.numel()].view(s)
            o += s.numel()
        return functional_call(m64, out, (X,)).reshape(N, -1)

    def C(v):
        f = F(v)
        if loss == "mse":
            return 0.5 * ((f - Y.reshape(N, -1)) ** 2).sum() / N
        return -(Y * torch.log_softmax(f, -1)).sum() / N

    H = hessian(C)(flat)
    J = jacrev(F)(flat).reshape(-1, flat.numel())  # (N·K, P)
    if loss == "mse":
        HC = torch.eye(J.shape[0], dtype=F64)
    else:
        p = torch.softmax(F(flat).detach(), -1)
        HC = torch.block_diag(*[(torch.diag(q) - torch.outer(q, q)) * Y[i].sum() for i, q in enumerate(p)])
    I = J.T @ HC @ J / N
    return H.numpy(), I.numpy(), (H - I).numpy()


def _tr(A, kmax=4):
    return np.array([np.trace(np.linalg.matrix_power(A, k)) for k in range(1, kmax + 1)])


def _targets(loss, N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    if loss == "mse":
        return torch.randn(N, K, dtype=F64, generator=g)
    return torch.nn.functional.one_hot(torch.randint(0, K, (N,), generator=g), K).to(F64)


def _close(name, got, ref, rtol, atol=0.0):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    err = np.abs(got - ref)
    assert np.all(err <= atol + rtol * np.abs(ref)), (
        f"{name}: got {got}, reference {ref}, max |diff| {err.max():.3g} (allowed {atol:.1g} + {rtol:.1g}·|ref|)"
    )


# Adversarial networks: (depth, width, activation, K, N, loss).  Width 1, depth 1 (S = 0: a net linear
# in θ), ReLU / leaky ReLU (σ̈ = 0 a.e.), N = 1, cross-entropy with K = 3, a rank-deficient Jacobian
# (repeated inputs).
CASES = [
    (3, 4, "tanh", 1, 5, "mse", False),
    (2, 1, "tanh", 1, 3, "mse", False),
    (1, 3, "tanh", 2, 4, "mse", False),
    (3, 4, "relu", 3, 4, "cross_entropy", False),
    (3, 3, "gelu", 2, 1, "cross_entropy", False),
    (3, 3, "leaky_relu", 1, 6, "mse", True),
]


@pytest.fixture(
    scope="module", params=CASES, ids=lambda c: f"L{c[0]}w{c[1]}-{c[2]}-K{c[3]}N{c[4]}-{c[5]}{'-dup' * c[6]}"
)
def case(request):
    depth, width, act, K, N, loss, dup = request.param
    model = _net(depth, width, K=K, act=act)
    X = torch.randn(N, 3, dtype=F64, generator=torch.Generator().manual_seed(2))
    if dup:
        X[N // 2 :] = X[: N - N // 2]  # repeated points: J has rank ≤ N/2 · K
    Y = _targets(loss, N, K)
    Hd, Id, Sd = _dense_parts(model, X, Y, loss)
    return dict(model=model, X=X, Y=Y, loss=loss, K=K, N=N, depth=depth, width=width, Hd=Hd, Id=Id, Sd=Sd)


# --------------------------------------------------------------------------- moments: found right


def test_moments_and_gauss_newton_spectrum_against_dense(case):
    c = case
    H, I, S = hessian_parts(c["model"], c["X"], c["Y"], loss=c["loss"], dtype=F64)
    for name, op, ref in (("H", H, c["Hd"]), ("I", I, c["Id"]), ("S", S, c["Sd"])):
        scale = np.array([np.sum(np.abs(np.linalg.eigvalsh(ref)) ** k) for k in range(1, 5)])  # Σ|λ|^k
        P = ref.shape[0]
        _close(f"dense_moments({name})", dense_moments(op).estimate, _tr(ref), 0, 1e-10 * scale + 1e-14)
        _close(
            f"hutch++ with s = P ({name})", hutchpp_moments(op, 2 * P + 2).estimate, _tr(ref), 0, 1e-10 * scale + 1e-14
        )
    mu = gauss_newton_eigenvalues(c["model"], c["X"], c["Y"], loss=c["loss"])
    ev = np.sort(np.linalg.eigvalsh(c["Id"]))[::-1]
    n = c["N"] * c["K"]
    assert mu.shape == (n,)
    top = max(ev[0], 1e-300)
    _close("eig I from the NTK Gram", mu, ev[:n], 0, 1e-10 * top)
    assert np.all(np.abs(ev[n:]) <= 1e-10 * top), f"I has rank > N·K: {ev[n:]}"
    _close(
        "gauss_newton_moments",
        gauss_newton_moments(c["model"], c["X"], c["Y"], loss=c["loss"]).estimate,
        _tr(c["Id"]),
        1e-9,
        1e-14,
    )
    _close("power_moments", power_moments(mu), [np.sum(mu**k) for k in range(1, 5)], 1e-12)


def test_additivity_gap_against_dense(case):
    c = case
    H, I, S = hessian_parts(c["model"], c["X"], c["Y"], loss=c["loss"], dtype=F64)
    Hd, Id, Sd = c["Hd"], c["Id"], c["Sd"]
    P = Hd.shape[0]
    ref = _tr(Hd) - _tr(Id) - _tr(Sd)
    scale = _tr(np.abs(Hd)) + _tr(np.abs(Id)) + _tr(np.abs(Sd))
    exact = additivity_gap(H, I, S, n_probes=2 * P + 2, seed=1)
    _close("additivity gap (sketch spans R^P)", exact.estimate, ref, 0, 1e-9 * np.abs(scale) + 1e-14)
    _close("k = 2 gap is 2 Tr(IS)", exact.estimate[1], 2 * np.trace(Id @ Sd), 0, 1e-9 * abs(scale[1]) + 1e-14)
    est = additivity_gap(H, I, S, n_probes=16, seed=4)
    for k in range(4):  # a real estimate: its stated standard error must cover the dense gap
        assert abs(est.estimate[k] - ref[k]) <= 4 * est.stderr[k] + 1e-10 * abs(scale[k]), (
            f"k = {k + 1}: gap {est.estimate[k]:.6g} ± {est.stderr[k]:.3g} vs dense {ref[k]:.6g}"
        )


def test_numerical_ranks_and_the_papers_bounds(case):
    c = case
    r = numerical_ranks(c["model"], c["X"], c["Y"], loss=c["loss"])

    def rank(A):
        lam = np.linalg.eigvalsh(A)
        top = np.abs(lam).max()
        return int(np.sum(np.abs(lam) > 1e-9 * top)) if top > 1e-12 else 0  # S of a linear net: rounding only

    assert (r.I, r.H) == (rank(c["Id"]), rank(c["Hd"])), ((r.I, r.H), (rank(c["Id"]), rank(c["Hd"])))
    assert r.S == rank(c["Sd"]) or (r.S == 0 and rank(c["Sd"]) == 0), (r.S, rank(c["Sd"]))
    N, K, L, w = c["N"], c["K"], c["depth"], c["width"]
    assert r.bound_I == N * K and r.I <= N * K
    assert r.bound_S == 2 * (L - 1) * w * N * K and r.S <= r.bound_S, (r.S, r.bound_S)


def test_orthogonality_and_rayleigh_quotients_against_dense(case):
    c = case
    Id, Sd = c["Id"], c["Sd"]
    if np.linalg.norm(Sd) < 1e-10:
        pytest.skip("S = 0 (a net linear in θ): see test_orthogonality_of_a_zero_S")
    H, I, S = hessian_parts(c["model"], c["X"], c["Y"], loss=c["loss"], dtype=F64)
    ref = np.linalg.norm(Id @ Sd) / (np.linalg.norm(Id) * np.linalg.norm(Sd))  # ‖IS‖_F / (‖I‖_F ‖S‖_F)
    ex = orthogonality(I, S, exact=True)
    _close("ρ exact", ex.value, ref, 1e-10)
    assert 0 <= ex.value <= 1
    pr = orthogonality(I, S, n_probes=64, seed=2)
    assert abs(pr.value - ref) <= 4 * pr.stderr, f"ρ by probes {pr.value:.4g} ± {pr.stderr:.2g} vs dense {ref:.4g}"
    P = Id.shape[0]
    k = min(3, P - 1, c["N"] * c["K"] - 1) if c["loss"] == "mse" else 1
    along_I, along_S = rayleigh_quotients(I, S, k)
    lam, V = np.linalg.eigh(Id)
    _close("λ(I)", along_I.evals, lam[::-1][:k], 1e-8, 1e-12)
    _close("vᵀIv on I's eigenvectors", along_I.vIv, along_I.evals, 1e-8, 1e-12)
    v = along_I.evecs
    _close("vᵀSv on I's eigenvectors", along_I.vSv, np.sum(v * (Sd @ v), 0), 1e-8, 1e-12)
    v = along_S.evecs
    _close("‖v‖ of S's eigenvectors", np.linalg.norm(v, axis=0), np.ones(k), 1e-10)
    _close("vᵀIv on S's eigenvectors", along_S.vIv, np.sum(v * (Id @ v), 0), 1e-8, 1e-12)
    top = np.sort(np.abs(np.linalg.eigvalsh(Sd)))[::-1][:k]
    _close("|λ(S)| (magnitude)", np.sort(np.abs(along_S.evals))[::-1], top, 1e-8, 1e-12)


def test_float32_model_and_inputs_give_the_float64_numbers():
    m32, m64 = _net(K=2, dtype=torch.float32), _net(K=2)
    X = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    Y = torch.tensor([0, 1, 1, 0, 1])
    a = gauss_newton_eigenvalues(m32, X, Y, loss="cross_entropy")
    b = gauss_newton_eigenvalues(m64, X.double(), Y, loss="cross_entropy")
    _close("float32 vs float64 eig(I)", a, b, 1e-6, 1e-9)
    A = np.random.default_rng(0).normal(size=(20, 20)).astype(np.float32)
    A = (A + A.T) / 2
    _close("dense_moments of a float32 matrix", dense_moments(A).estimate, _tr(A.astype(np.float64)), 1e-12, 1e-9)


def test_hutchinson_and_hutchpp_stderr_cover_the_dense_trace():
    rng = np.random.default_rng(0)
    B = rng.normal(size=(40, 5))
    W = rng.normal(size=(40, 40))
    A = B @ B.T + 0.3 * (W + W.T) / np.sqrt(40)  # a few outliers on a bulk, like H
    ref = _tr(A)
    for est in (hutchinson_moments(A, 40, seed=3), hutchpp_moments(A, 40, seed=3)):
        z = (est.estimate - ref) / est.stderr
        assert np.all(np.abs(z) < 4), f"{est.method}: (estimate − dense)/stderr = {z}"


# --------------------------------------------------------------------------- SLQ


def test_slq_moments_and_density_against_eigh():
    rng = np.random.default_rng(0)
    P = 40
    B = rng.normal(size=(P, 5))
    W = rng.normal(size=(P, P))
    A = B @ B.T + 0.3 * (W + W.T) / np.sqrt(P)
    lam = np.linalg.eigvalsh(A)
    d = slq_density(A, n_probes=20, n_steps=12, seed=1)
    for k in (1, 2, 3, 4, 6):
        m, se = d.moment(k)
        ref = np.mean(lam**k)
        assert abs(m - ref) <= 4 * se, f"SLQ Tr(A^{k})/P = {m:.6g} ± {se:.3g} vs eigh {ref:.6g}"
    sig = 0.3
    d = slq_density(A, n_probes=200, n_steps=P, sigma=sig, seed=0, probe_block=7)
    ref = np.exp(-0.5 * ((d.grid[:, None] - lam) / sig) ** 2).sum(1) / (sig * math.sqrt(2 * math.pi)) / P
    assert abs(np.trapezoid(d.density, d.grid) - 1) < 1e-3
    err = np.abs(d.density - ref).max()
    assert err < 0.05 * ref.max(), f"SLQ density off the broadened eigh density by {err:.3g} (max {ref.max():.3g})"


@pytest.mark.parametrize("P, n_probes", [(1, 10), (6, 10), (6, 7)])
def test_slq_with_more_probes_than_parameters(P, n_probes):
    """Defect: a probe block wider than P (the default n_probes = 10 on any P < 10) made the block
    Lanczos basis rank-deficient and slq_density crashed with a broadcast ValueError."""
    rng = np.random.default_rng(P)
    A = rng.normal(size=(P, P))
    A = A + A.T
    lam = np.linalg.eigvalsh(A)
    d = slq_density(A, n_probes=n_probes, n_steps=3)
    assert d.nodes.shape[0] == n_probes
    assert abs(np.trapezoid(d.density, d.grid) - 1) < 1e-3
    for k in (1, 2, 3):
        m, se = d.moment(k)
        ref = np.mean(lam**k)
        assert abs(m - ref) <= 4 * se + 1e-10 * np.mean(np.abs(lam) ** k), f"k={k}: {m} ± {se} vs {ref}"


# --------------------------------------------------------------------------- orthogonality: S = 0


def test_orthogonality_of_a_zero_S():
    """Defect: S = 0 (a net linear in θ; a zero loss gradient) made exact=True raise
    ZeroDivisionError and the probes return NaN through numpy warnings: ρ = 0/0 is now NaN, stated."""
    model = _net(depth=1, K=2)
    X = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(0))
    Y = _targets("mse", 4, 2)
    H, I, S = hessian_parts(model, X, Y, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for o in (orthogonality(I, S, exact=True), orthogonality(I, S, n_probes=8)):
            assert math.isnan(o.value) and math.isnan(o.stderr), o
            assert o.norm_S == 0 and o.norm_I > 0 and o.norm_IS == 0, o


# --------------------------------------------------------------------------- the limit of I


def test_limit_gauss_newton_eigenvalues_against_own_weighted_kernel_pca():
    rng = np.random.default_rng(0)
    N, K = 5, 3
    A = rng.normal(size=(N, N))
    T = A @ A.T
    _close(
        "MSE: eig(Θ̃ ⊗ Id_K)/N",
        limit_gauss_newton_eigenvalues(T, np.zeros((N, K))),
        np.sort(np.linalg.eigvalsh(np.kron(T, np.eye(K)) / N))[::-1],
        1e-10,
        1e-14,
    )
    F = rng.normal(size=(N, K))
    lab = np.array([0, 1, 2, 0, 1])
    p = np.exp(F) / np.exp(F).sum(1, keepdims=True)
    HC = np.zeros((N * K, N * K))
    for i in range(N):
        HC[i * K : (i + 1) * K, i * K : (i + 1) * K] = np.diag(p[i]) - np.outer(p[i], p[i])
    # I = Jᵀ HC J / N with J Jᵀ = Θ̃ ⊗ Id: nonzero spectrum of (Θ̃ ⊗ Id)^{1/2} HC (Θ̃ ⊗ Id)^{1/2} / N
    lt, Vt = np.linalg.eigh(np.kron(T, np.eye(K)))
    R = Vt @ np.diag(np.sqrt(lt.clip(0))) @ Vt.T
    ref = np.sort(np.linalg.eigvalsh(R @ HC @ R / N))[::-1]
    got = limit_gauss_newton_eigenvalues(T, F, np.eye(K)[lab], loss="cross_entropy")
    _close("cross-entropy weighted kernel PCA", got, ref, 1e-9, 1e-12)
    # Defect: (N,) integer class indices (what gauss_newton_eigenvalues takes) raised a reshape error
    _close(
        "class indices = one-hot rows",
        limit_gauss_newton_eigenvalues(T, F, lab, loss="cross_entropy"),
        ref,
        1e-9,
        1e-12,
    )


def test_limit_gauss_newton_eigenvalues_refuses_what_it_cannot_read():
    """Defects: F with the wrong number of rows was reshaped into another K (2N values → K = 2);
    (K, N) targets were reshaped into scrambled (N, K) rows (all-zero eigenvalues); K = 1
    cross-entropy gave zeros; a non-symmetric theta was silently symmetrised; NaN / inf gave
    numpy's LinAlgError."""
    rng = np.random.default_rng(1)
    A = rng.normal(size=(3, 3))
    T = A @ A.T
    with pytest.raises(ShapeError, match="F must be"):
        limit_gauss_newton_eigenvalues(T, np.zeros(6))
    with pytest.raises(ShapeError, match="Y must"):
        limit_gauss_newton_eigenvalues(T, rng.normal(size=(3, 2)), np.eye(2)[[0, 1, 1]].T, loss="cross_entropy")
    with pytest.raises(ShapeError, match="K >= 2"):
        limit_gauss_newton_eigenvalues(T, np.zeros((3, 1)), loss="cross_entropy")
    with pytest.raises(ValueError, match="symmetric"):
        limit_gauss_newton_eigenvalues(T + np.triu(np.ones((3, 3)), 1))
    for bad in (np.nan, np.inf):
        Tb = T.copy()
        Tb[0, 0] = bad
        with pytest.raises(NonFiniteError, match="theta"):
            limit_gauss_newton_eigenvalues(Tb)
    with pytest.raises(NonFiniteError, match="F"):
        limit_gauss_newton_eigenvalues(T, np.full((3, 2), np.nan), np.eye(2)[[0, 1, 1]], loss="cross_entropy")
    T32 = torch.tensor(T, dtype=torch.float32)  # a float32 Gram's rounding asymmetry is accepted
    assert limit_gauss_newton_eigenvalues(T32 + 1e-7 * torch.triu(torch.ones(3, 3), 1)).shape == (3,)


def test_additivity_gap_mismatched_sizes_is_a_shape_error():
    """Defect (minor): the docstring promises ShapeError; a plain ValueError was raised."""
    with pytest.raises(ShapeError, match="one size"):
        additivity_gap(np.eye(4), np.eye(4), np.eye(3))


# --------------------------------------------------------------------------- the limits of S


def _own_pairs(x, beta, act, nodes=96):
    """Own GH 𝕃^{σ^(a), σ^(b)} on a Gram K: the 2 × 2 covariance diagonalised (not Cholesky)."""
    zs, ws = np.polynomial.hermite.hermgauss(nodes)
    zs, ws = zs * np.sqrt(2), ws / np.sqrt(np.pi)
    Z1, Z2 = np.meshgrid(zs, zs, indexing="ij")
    W = np.outer(ws, ws)

    def L(K, a, b):
        N = K.shape[0]
        out = np.empty((N, N))
        for i in range(N):
            for j in range(N):
                lam, V = np.linalg.eigh(np.array([[K[i, i], K[i, j]], [K[j, i], K[j, j]]]))
                R = V * np.sqrt(np.clip(lam, 0, None))
                out[i, j] = np.sum(W * act[a](R[0, 0] * Z1 + R[0, 1] * Z2) * act[b](R[1, 0] * Z1 + R[1, 1] * Z2))
        return out

    return L


_ACTS = {
    "tanh": [
        np.tanh,
        lambda u: 1 - np.tanh(u) ** 2,
        lambda u: -2 * np.tanh(u) * (1 - np.tanh(u) ** 2),
        lambda u: (1 - np.tanh(u) ** 2) * (6 * np.tanh(u) ** 2 - 2),
    ],
    "atan": [
        np.arctan,
        lambda u: 1 / (1 + u * u),
        lambda u: -2 * u / (1 + u * u) ** 2,
        lambda u: (6 * u * u - 2) / (1 + u * u) ** 3,
    ],
    "gelu": [
        lambda u: u * norm.cdf(u),
        lambda u: norm.cdf(u) + u * norm.pdf(u),
        lambda u: norm.pdf(u) * (2 - u * u),
        lambda u: norm.pdf(u) * (u**3 - 4 * u),
    ],
}
_sg = lambda u: 1 / (1 + np.exp(-u))  # noqa: E731
_ACTS["softplus_normalized"] = [
    lambda u: (np.logaddexp(0, u) - SOFTPLUS_SHIFT) / SOFTPLUS_SCALE,
    lambda u: _sg(u) / SOFTPLUS_SCALE,
    lambda u: _sg(u) * (1 - _sg(u)) / SOFTPLUS_SCALE,
    lambda u: _sg(u) * (1 - _sg(u)) * (1 - 2 * _sg(u)) / SOFTPLUS_SCALE,
]


def _own_recursion(x, depth, act, beta):
    """Σ, Θ by the paper's recursion (§2); Φ, Υ, Λ by Stein's lemma layer by layer (derived here:
    Φ' = ΦΣ̇ + D(y)𝕃^{σ,σ̈}, Υ' = 2Σ̇Θ + 𝕃^{σ̈,σ̈}Θ² + Σ̇Υ, Λ' = D(x)𝕃^{σ̈,σ} + Φᵀ Σ̇ + Θ D(x) 𝕃^{σ⃛,σ̇}
    + Θ Φᵀ 𝕃^{σ̈,σ̈} + ΛΣ̇, D = diag(Θ + Φ))."""
    s, L = _ACTS[act], _own_pairs(x, beta, _ACTS[act])
    Sg = x @ x.T / x.shape[1] + beta**2
    Th, Ph, Up, La = Sg.copy(), 0 * Sg, 0 * Sg, 0 * Sg
    del s
    for _ in range(depth - 1):
        Sd, D = L(Sg, 1, 1), np.diag(Th) + np.diag(Ph)
        Ph, Up, La = (
            Ph * Sd + D[None, :] * L(Sg, 0, 2),
            2 * Sd * Th + L(Sg, 2, 2) * Th**2 + Sd * Up,
            D[:, None] * L(Sg, 2, 0) + Ph.T * Sd + Th * D[:, None] * L(Sg, 3, 1) + Th * Ph.T * L(Sg, 2, 2) + La * Sd,
        )
        Sg = L(Sg, 0, 0) + beta**2
        Th = Th * Sd + Sg
    return Sg, Th, Ph, Up, La


@pytest.mark.parametrize("act", ["tanh", "atan", "gelu", "softplus_normalized"])
@pytest.mark.parametrize("depth, beta", [(1, 0.1), (2, 0.3), (4, 0.0)])
def test_limit_S_kernels_against_own_recursion(act, depth, beta):
    x = np.random.default_rng(0).normal(size=(3, 2)) * 0.8
    x[2] = -x[0]
    k = limit_S_kernels(x, depth=depth, activation=act, bias_scale=beta)
    for name, got, ref in zip(
        ("Σ", "Θ", "Φ", "Υ", "Λ"), (k.sigma, k.theta, k.phi, k.upsilon, k.lam), _own_recursion(x, depth, act, beta)
    ):
        scale = max(np.abs(ref).max(), 1e-300)
        _close(f"{act} L={depth} β={beta}: {name}", got.numpy(), ref, 0, 1e-7 * scale + 1e-15)


def _trapezoid_pair(f, g, k11, k22, k12, h=0.01, span=9.0):
    """E[f(u) g(u′)] for (u, u′) ~ N(0, [[k11, k12], [k12, k22]]) by a 2-D trapezoid rule in z (fine,
    spectrally accurate for these smooth integrands; independent of any Gauss–Hermite rule)."""
    z = np.arange(-span, span + h / 2, h)
    w = norm.pdf(z) * h
    s1, s2 = math.sqrt(k11), math.sqrt(k22)
    rho = k12 / (s1 * s2)
    fu = f(s1 * z)
    gv = g(s2 * (rho * z[:, None] + math.sqrt(max(1 - rho * rho, 0)) * z[None, :]))  # (z1, z2)
    return float((fu * w) @ (gv @ w))


def test_limit_S_kernels_resolve_unstandardised_inputs():
    """Defect: 64 Gauss–Hermite nodes step over σ̈, σ⃛ (alive on |u| ≲ 3) once the pre-activation
    variance Σ⁽¹⁾(x, x) = |x|²/n₀ + β² is ≈ 3: atan's Υ, Λ came out 2-3 % wrong (now < 2e-4).  Reference:
    the depth-2 kernels in closed form (Φ = 𝕃^{σ,σ̈} Σ⁽¹⁾(y,y), Υ = 2Σ̇Σ⁽¹⁾ + 𝕃^{σ̈,σ̈}(Σ⁽¹⁾)²,
    Λ = Σ⁽¹⁾(x,x)[𝕃^{σ̈,σ} + Σ⁽¹⁾(x,y) 𝕃^{σ⃛,σ̇}]), each 𝕃 by a 2-D trapezoid rule."""
    beta = 0.1
    x = np.array([[1.7, 1.7], [0.5, -0.3]])  # Σ⁽¹⁾(x₀, x₀) = 2.9
    s = _ACTS["atan"]
    T = x @ x.T / 2 + beta**2
    E = {
        (a, b): np.array([[_trapezoid_pair(s[a], s[b], T[i, i], T[j, j], T[i, j]) for j in range(2)] for i in range(2)])
        for a, b in ((0, 0), (1, 1), (0, 2), (2, 0), (2, 2), (3, 1))
    }
    D = np.diag(T)
    ref = {
        "sigma": E[(0, 0)] + beta**2,
        "theta": T * E[(1, 1)] + E[(0, 0)] + beta**2,
        "phi": D[None, :] * E[(0, 2)],
        "upsilon": 2 * E[(1, 1)] * T + E[(2, 2)] * T**2,
        "lam": D[:, None] * E[(2, 0)] + T * D[:, None] * E[(3, 1)],
    }
    k = limit_S_kernels(x, depth=2, activation="atan", bias_scale=beta)
    for name, r in ref.items():
        got = getattr(k, name).numpy()
        rel = np.abs(got - r).max() / np.abs(r).max()
        assert rel < 2e-4, f"{name}: relative error {rel:.2g} against the trapezoid reference\n{got}\nvs\n{r}"


def test_limit_S_kernels_refuse_inputs_no_quadrature_resolves():
    """Defect: |x|²/n₀ ≈ 100 gave tanh kernels with the wrong sign of 𝕃^{σ̈,σ̈} and no warning."""
    x = np.array([[10.0, -10.0], [3.0, 9.0]])
    with pytest.raises(ValueError, match="standardise"):
        limit_S_kernels(x, depth=3, activation="tanh")


def test_limit_ntk_theta_against_monte_carlo_over_wide_nets():
    """Θ̃ of the recursion against the mean empirical NTK of 8 random nets of width 1024 (depth 3,
    erf, β = 0.5, the paper's NTK parametrisation): within 4 standard errors of the mean + 1 %
    (the O(1/width) bias), at a fixed seed."""
    x = torch.tensor(np.random.default_rng(0).normal(size=(3, 2)))
    k = limit_S_kernels(x, depth=3, activation="erf", bias_scale=0.5).theta.numpy()
    Ts = []
    for seed in range(8):
        m = _net(depth=3, width=1024, d=2, act="erf", seed=seed, beta=0.5)
        p = {n: q.detach() for n, q in m.named_parameters()}
        J = jacrev(lambda p, m=m: functional_call(m, p, (x,)))(p)
        J = torch.cat([v.reshape(3, -1) for v in J.values()], 1)
        Ts.append((J @ J.T).numpy())
    Ts = np.array(Ts)
    mean, se = Ts.mean(0), Ts.std(0, ddof=1) / np.sqrt(len(Ts))
    err = np.abs(mean - k)
    assert np.all(err <= 4 * se + 0.01 * np.abs(k).max()), f"MC NTK {mean}\n± {se}\nvs limit {k}"


def test_limit_traces_of_S_against_own_formulae():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 2))
    k = limit_S_kernels(x, depth=3, activation="tanh", bias_scale=0.2)
    U, Ph, Th, Lm, Sg = (t.numpy() for t in (k.upsilon, k.phi, k.theta, k.lam, k.sigma))
    g = rng.normal(size=(4, 2))
    _close("Tr(S²) = Σ_k g_kᵀ Υ̃ g_k", limit_trace_S2(k.upsilon, g), sum(g[:, j] @ U @ g[:, j] for j in range(2)), 1e-12)
    _close("E Tr S₀ = K Tr Φ̃ / N", limit_trace_S_init(k, 2), 2 * np.trace(Ph) / 4, 1e-12)
    y = rng.normal(size=(4, 2))
    lrs = [0.5, 1.0, 0.25, 2.0]
    B, C, ref = np.eye(4), np.zeros((4, 4)), []
    for t in range(5):  # the plain matrix recursion of the linearised MSE dynamics
        ref.append(
            sum(np.trace(B @ Ph.T) - np.trace(B @ Lm @ C @ (Sg + np.outer(y[:, j], y[:, j]))) for j in range(2)) / 4
        )
        if t < 4:
            C = C + lrs[t] / 4 * B
            B = (np.eye(4) - lrs[t] / 4 * Th) @ B
    _close("E Tr S_t along GD", limit_trace_S_gd(k, y, lrs, range(5)), ref, 1e-9, 1e-12)


def test_limit_traces_of_S_refuse_misshapen_inputs():
    """Defect: grad_C / y with the wrong number of rows were reshaped into another K (6 values on 3
    points → K = 2) and NaN went through to a NaN trace."""
    k = limit_S_kernels(np.random.default_rng(0).normal(size=(3, 2)), depth=2)
    with pytest.raises(ShapeError, match="grad_C"):
        limit_trace_S2(k.upsilon, np.ones(6))
    with pytest.raises(NonFiniteError, match="grad_C"):
        limit_trace_S2(k.upsilon, np.array([1.0, np.nan, 0.0]))
    with pytest.raises(ShapeError, match="y must"):
        limit_trace_S_gd(k, np.ones(6), [0.1], [1])
    with pytest.raises(ValueError, match="n_outputs"):
        limit_trace_S_init(k, 0)


def _erf_kernels(x, depth, beta):
    """Σ, Θ of an erf net in closed form (arcsine kernel, Williams 1997):
    E[erf u erf u′] = (2/π) arcsin(2k₁₂ / √((1 + 2k₁₁)(1 + 2k₂₂))),
    E[erf′ u erf′ u′] = (4/π) / √((1 + 2k₁₁)(1 + 2k₂₂) − 4k₁₂²)."""
    S = x @ x.T / x.shape[1] + beta**2
    T = S.copy()
    for _ in range(depth - 1):
        d = 1 + 2 * np.diag(S)
        Sd = 4 / np.pi / np.sqrt(np.outer(d, d) - 4 * S**2)
        S = 2 / np.pi * np.arcsin(2 * S / np.sqrt(np.outer(d, d))) + beta**2
        T = T * Sd + S
    return S, T


def test_limit_S_kernels_at_large_variance_against_the_erf_closed_form():
    """Defect (the quadrature one, seen on Θ̃): pre-activation variances 9–26 with 64 nodes; the
    closed-form arcsine kernels are the reference (no quadrature at all)."""
    x = np.array([[3.0, -3.0], [0.5, 0.2], [2.1, 2.7], [5.0, 5.0]])
    k = limit_S_kernels(x, depth=3, activation="erf", bias_scale=0.2)
    S, T = _erf_kernels(x, 3, 0.2)
    _close("Σ (erf, closed form)", k.sigma.numpy(), S, 1e-6)
    _close("Θ (erf, closed form)", k.theta.numpy(), T, 1e-6)


def test_limit_S_kernels_refuse_a_non_smooth_callable_sigma():
    """A callable relu (σ̇ jumps, σ̈ a delta) is refused like the named one, and the message says why."""
    with pytest.raises(ValueError, match="not smooth"):
        limit_S_kernels(np.random.default_rng(0).normal(size=(3, 2)), depth=3, activation=torch.relu)


class _DictOut(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return {"aux": x.sum(-1), "logits": self.net(x)}


def test_gauss_newton_moments_take_the_output_selector_of_the_eigenvalues():
    """Defect (missing option): gauss_newton_moments had no ``output`` while the eigenvalues it sums
    take one, so a dict-returning model could not be used; and power_moments(max_order=0) returned []."""
    net = _net(K=2)
    X = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(5))
    Y = _targets("mse", 4, 2)
    _, Id, _ = _dense_parts(net, X, Y, "mse")
    got = gauss_newton_moments(_DictOut(net), X, Y, output="logits").estimate
    _close("Tr(I^k) through output='logits'", got, _tr(Id), 1e-9, 1e-14)
    with pytest.raises(ValueError, match="max_order"):
        power_moments(np.ones(3), 0)


def test_a_failure_of_the_per_point_traces_is_not_called_a_failure_of_the_loss_hessian():
    """An audit: a SiLU model's note read "computing the loss Hessian failed" where the loss
    Hessian was measured and only G_i's forward-over-forward pass had no rule (silu_backward; G_i
    of such a model is now taken by reverse mode, tests/test_hessian_follows.py).  A Function that
    torch.func cannot transform fails G_i: the error names G_i."""
    from torch.autograd.function import once_differentiable

    from nsa_dist.errors import ModelForwardError
    from nsa_dist.hessian.theory import output_hessian_traces

    class Tanh(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = torch.tanh(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        @once_differentiable
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return g * (1 - y * y)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 4), torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.b(Tanh.apply(self.a(x)))

    with pytest.raises(ModelForwardError) as e:
        output_hessian_traces(Net().double(), torch.randn(5, 2, dtype=torch.float64), 2)
    assert str(e.value).startswith("computing the per-point output Hessian traces G_i of Net failed"), str(e.value)


def test_rayleigh_quotients_on_a_repeated_or_paired_eigenvalue_do_not_depend_on_the_solver_s_basis():
    """S's ± pairs of one |λ| were ordered by rounding, and vᵀIv on a repeated eigenvalue's eigenvectors took
    any value of the eigenspace (the local and gang layouts stored 3.5361 and 3.5342 where it spans 2.29 to
    11.33, an audit): now the tie puts +λ first and the basis diagonalises I compressed to the eigenspace."""
    rng = np.random.default_rng(0)
    P = 30
    Q, _ = np.linalg.qr(rng.standard_normal((P, P)))
    s = np.concatenate([[5.0, 5.0, -5.0, 3.0, -2.0], rng.uniform(-1, 1, P - 5)])
    Sd = (Q * s) @ Q.T
    B = rng.standard_normal((P, 6))
    Id = B @ B.T
    Sd, Id = (Sd + Sd.T) / 2, (Id + Id.T) / 2
    C = Q[:, :2].T @ Id @ Q[:, :2]  # I compressed to S's double eigenvalue 5
    want = np.linalg.eigvalsh((C + C.T) / 2)[::-1]
    runs = [rayleigh_quotients(Id, Sd, 4, method=m, seed=seed)[1] for m in ("lanczos", "dense") for seed in (0, 1, 2)]
    for r in runs:
        _close("S's top by |λ|: +5, +5, −5, 3", r.evals, [5.0, 5.0, -5.0, 3.0], 1e-8, 1e-12)
        _close("vᵀIv on the double eigenvalue", r.vIv[:2], want, 1e-7, 1e-10)
        _close("vᵀIv elsewhere", r.vIv[2:], runs[0].vIv[2:], 1e-7, 1e-10)
