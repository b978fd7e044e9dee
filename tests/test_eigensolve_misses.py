"""Block Lanczos's top-k never returns a missed eigenvalue as converged (audit E, session 30).

A warm start (the previous step's eigenvectors, ``spectrum.warm_start``) is an invariant subspace when
those vectors are still eigenvectors: their zero residuals "converged" before the one random column grew
a new top eigenvalue orthogonal to them (λ₁ 12.1 for 25.1 in 43 of 80 trials, converged, no warning).
And copies of a repeated top eigenvalue beyond the block were replaced by a cluster 10⁻⁷ below it
unreported (the missed-copy check's margin was 10⁻⁶ of λ_1)."""

from __future__ import annotations

import numpy as np
import pytest

from nsa_dist.linalg import top_eigenpairs

N = 400


@pytest.mark.parametrize("k", [2, 5, 16])
def test_a_new_top_eigenvalue_orthogonal_to_a_warm_start_is_found(k: int) -> None:
    rng = np.random.default_rng(0)
    A = rng.standard_normal((N, 60))
    G_prev = A @ A.T / 60
    V = top_eigenpairs(G_prev, k, "dense").evecs  # last step's top k
    for trial in range(4):
        u = np.random.default_rng(100 + trial).standard_normal(N)
        u -= V @ (V.T @ u)
        u /= np.linalg.norm(u)
        G = G_prev + 2 * np.linalg.eigvalsh(G_prev)[-1] * np.outer(u, u)
        G = (G + G.T) / 2
        w = np.linalg.eigvalsh(G)[::-1]
        got = top_eigenpairs(G, k, "lanczos", start=V, seed=trial)
        err = np.abs(got.evals - w[:k]).max() / w[0]
        assert err < 1e-8, f"trial {trial}: λ_1…λ_k {got.evals[:3]} against eigh's {w[:3]} ({err:.2g} of λ_1 off)"


def test_copies_of_a_repeated_top_eigenvalue_just_above_another_cluster_are_found() -> None:
    rng = np.random.default_rng(4)
    n = 600
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    lam = np.concatenate([np.full(40, 10.0), np.full(40, 10 * (1 - 1e-7)), np.linspace(5, 0.1, n - 80)])
    G = (Q * lam) @ Q.T
    G = (G + G.T) / 2
    got = top_eigenpairs(G, 20, "lanczos")
    P = Q[:, :40]  # the top eigenspace: every returned vector lies in it
    outside = np.linalg.norm(got.evecs - P @ (P.T @ got.evecs), axis=0).max()
    assert outside < 1e-3, f"returned vectors lie {outside:.2f} outside the 40-fold top eigenspace: {got.evals[-3:]}"


@pytest.mark.parametrize(
    ("method", "scale"),
    [
        ("lanczos", 1e155),
        ("lanczos", 1e-162),
        ("lanczos", 1e-300),
        ("lanczos", 1e-310),  # a subnormal G: e below −1022 (2^1030 is not a float: OverflowError, a review)
        ("lanczos", 1e307),
        ("arpack", 1e-17),
        ("arpack", 1e-100),
        ("arpack", 1e-310),
    ],
)
@pytest.mark.parametrize("as_operator", [False, True])
def test_a_gram_at_any_float64_scale_gets_its_own_top(method: str, scale: float, as_operator: bool) -> None:
    """Column norms square G's entries: at λ_1 ~ 10¹⁵⁵ they overflowed (inf residuals, λ/λ_1 0.21 for 1)
    and at ~10⁻¹⁶² underflowed (zero residuals: λ/λ_1 0.14 for 1, "converged"); ARPACK's residuals
    missed tol below λ_1 ~ 10⁻¹⁷ (audit E)."""
    rng = np.random.default_rng(2)
    J = rng.standard_normal((200, 20))
    G0 = J @ J.T
    G0 /= np.linalg.eigvalsh(G0)[-1]
    w = np.linalg.eigvalsh(G0)[::-1][:5]
    G = scale * G0
    arg = G
    if as_operator:
        from scipy.sparse.linalg import aslinearoperator

        arg = aslinearoperator(G)
    got = top_eigenpairs(arg, 5, method, seed=1)
    lam = got.evals / scale
    assert got.converged
    assert np.abs(lam - w).max() < 1e-9, f"λ/scale {lam} against eigh's {w}"
    Gs = G / scale  # G0 as G holds it (a subnormal G keeps fewer digits)
    res = np.linalg.norm(Gs @ got.evecs - got.evecs * lam, axis=0).max()
    assert res < 1e-8, f"‖G v − λ v‖/λ_1 {res:.2g}"
    if got.max_residual is not None and scale > 1e-300:  # a subnormal G's entries keep ~11 digits: not compared
        assert got.max_residual / scale == pytest.approx(res, rel=0.5, abs=1e-12), (
            f"reported residual {got.max_residual / scale:.3g} of λ_1, measured {res:.3g}"
        )


def test_a_missed_eigenvalue_is_reported_at_g_s_scale(monkeypatch) -> None:
    """The warning printed the scaled solve's numbers (6.53 for 10·10²⁰⁰, a review)."""
    import nsa_dist.linalg.eigenpairs as ep
    from nsa_dist.linalg.lanczos import LanczosConvergenceWarning

    monkeypatch.setattr(ep, "_MISSED_TRIES", 0)
    rng = np.random.default_rng(4)
    n = 600
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    lam = np.concatenate([np.full(100, 10.0), np.linspace(5, 0.1, n - 100)])
    G = (Q * lam) @ Q.T
    G = 1e200 * (G + G.T) / 2
    with pytest.warns(LanczosConvergenceWarning, match="missed an eigenvalue") as ws:
        top_eigenpairs(G, 120, "lanczos")
    said = str(ws[0].message)
    above = float(said.split(": ")[1].split(" lies")[0])
    assert 9e200 < above < 1.1e201, said
