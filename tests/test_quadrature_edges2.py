"""Edges of the quadrature route's brackets found by a second adversarial trial of ``spectral_curves``:
φ's of extreme scale, repeated reported k, an eigenvalue repeated across the top's end (λ_K = λ_{K+1})
and a block Lanczos solver's top eigenvectors between near-equal eigenvalues.  Each checks E(φ, k)
against dense eigh routes of the same G (LAPACK's evd, evr and ev drivers and torch's), whose bases
of a repeated eigenvalue differ."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg as sla
import torch
from conftest import rotated_gram as _gram

from nsa_dist.linalg.eigenpairs import top_eigenpairs
from nsa_dist.linalg.quadrature import curve_ks, spectral_curves


def _routes(G: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Eigenvalues (descending) and eigenvectors of G from four dense float64 eigh routes."""
    out = {"evd": np.linalg.eigh(G)}
    for driver in ("evr", "ev"):
        out[driver] = sla.eigh(G, driver=driver)
    w, V = torch.linalg.eigh(torch.from_numpy(G))
    out["torch"] = (w.numpy(), V.numpy())
    return {k: (w[::-1].copy(), V[:, ::-1].copy()) for k, (w, V) in out.items()}


def _energy_misses(G, b, P, ks, tol=1e-11) -> list[str]:
    P = np.asarray(P, dtype=np.float64).reshape(G.shape[0], -1)
    out = []
    for name, (_, V) in _routes(G).items():
        E = (np.cumsum(np.sum((V.T @ P) ** 2, axis=1)) / np.sum(P * P))[ks - 1]
        miss = np.nonzero((E < b.lower - tol) | (E > b.upper + tol))[0]
        out += [f"{name} k={ks[i]}: E={E[i]:.10g} outside [{b.lower[i]:.10g}, {b.upper[i]:.10g}]" for i in miss]
    return out


@pytest.mark.parametrize("scale", [1e-200, 1e-160, 1e160, 1e200])
def test_a_phi_of_extreme_scale_gets_the_curves_of_its_direction(scale):
    """E(φ, k) does not depend on ‖φ‖, but ⟨v, φ⟩² and ‖φ‖² under/overflowed: 1e-200 gave NaN curves,
    1e-160 a value 2.3·10⁻⁶ outside its zero-width bracket (subnormal squares), 1e160 a ValueError
    from eigh_tridiagonal (inf in the Lanczos block)."""
    N, K = 200, 10
    G, _ = _gram(10.0 ** (-4 * np.arange(N) / (N - 1)), 1)
    w, V = _routes(G)["evd"]
    x = np.random.default_rng(2).standard_normal(N)
    ks = curve_ks(N, 20)
    kw = dict(lanczos_steps=20, probes=8)
    ref = spectral_curves(torch.from_numpy(G), w[:K], V[:, :K], {"p": x}, ks, **kw).energy["p"]
    got = spectral_curves(torch.from_numpy(G), w[:K], V[:, :K], {"p": scale * x}, ks, **kw).energy["p"]
    assert np.isfinite(got.value).all() and np.isfinite(got.lower).all() and np.isfinite(got.upper).all()
    assert not _energy_misses(G, got, x, ks)
    for part in ("value", "lower", "upper"):
        np.testing.assert_allclose(getattr(got, part), getattr(ref, part), rtol=1e-12, atol=1e-14, err_msg=part)


def test_repeated_ks_are_refused():
    """ks = [1, 2, 2, 5] passed the check (only a descent was refused)."""
    N = 30
    G, _ = _gram(10.0 ** (-2 * np.arange(N) / (N - 1)), 0)
    w, V = _routes(G)["evd"]
    with pytest.raises(ValueError, match="without repeats"):
        spectral_curves(G, w[:3], V[:, :3], {"p": np.ones(N)}, np.array([1, 2, 2, 5]), lanczos_steps=5, probes=4)


@pytest.mark.parametrize("seed", range(4))
def test_an_eigenvalue_repeated_across_the_top_end_brackets_e_at_k(seed):
    """λ_K = λ_{K+1} (λ_{K−1} well above): the exact route may return any basis of the pair, so E(φ, K)
    may take any part of the pair's energy — it was a zero-width value, 0.58–0.996 away from another
    eigh driver's E (seeds 0–3)."""
    N, K = 200, 10
    lam = 10.0 ** (-4 * np.arange(N) / (N - 1))
    lam[K] = lam[K - 1]
    G, Q = _gram(lam, seed)
    w, V = _routes(G)["evd"]
    rng = np.random.default_rng(seed + 10)
    phis = {"x": rng.standard_normal(N), "pair": Q[:, K - 1] + 0.3 * Q[:, K], "second": Q[:, K]}
    ks = np.arange(1, N + 1)
    c = spectral_curves(torch.from_numpy(G), w[:K], V[:, :K], phis, ks, lanczos_steps=30, probes=16, block_size=6)
    misses = [m for name, P in phis.items() for m in _energy_misses(G, c.energy[name], P, ks)]
    assert not misses, "; ".join(misses[:4])
    # the value at K−1 stays exact: only the straddling cluster is widened
    b = c.energy["x"]
    assert b.lower[K - 2] == b.upper[K - 2]


def test_lanczos_eigenvectors_between_near_equal_top_eigenvalues_are_bracketed():
    """Top eigenpairs from block Lanczos (tol 10⁻¹⁰, residual ~2·10⁻¹¹) on pairs 10⁻¹¹·λ_1 apart (20×
    the exact route's rounding δ, below the residual): the solver's eigenvectors rotate within each
    pair, and E(φ, k) in the top part was a zero-width value up to 6.9·10⁻⁸ off the exact route's
    (N = 1,500, K = 60; here at N = 600, K = 40: 80 (route, k) misses, 3.4·10⁻⁹ at k = 1)."""
    N, K = 600, 40
    rng = np.random.default_rng(3)
    lam = np.arange(1, N + 1) ** -1.5
    for i in range(0, K + 10, 2):
        lam[i + 1] = lam[i] - 1e-11 * lam[0]
    G, _ = _gram(lam, 4)
    ep = top_eigenpairs(torch.from_numpy(G), K, method="lanczos", tol=1e-10, seed=0)
    phi = rng.standard_normal(N)
    ks = np.arange(1, K + 2)
    c = spectral_curves(
        torch.from_numpy(G), ep.evals, ep.evecs, {"p": phi}, ks, lanczos_steps=10, probes=8,
        top_residual=ep.max_residual,
    )  # fmt: skip
    misses = _energy_misses(G, c.energy["p"], phi, ks, tol=1e-11)
    assert not misses, f"{len(misses)} misses: " + "; ".join(misses[:4])


def test_a_gram_made_in_float32_and_held_in_float64_keeps_its_negative_tail_inside():
    """X Xᵀ of rank 12 formed in float32, then stored in float64: its null space is float32 rounding of
    either sign (±6·10⁻⁶), far above the float64 rounding δ.  The Krylov space became the whole space,
    whose K Ritz values on range(U) are PGP's zeros — above the negative tail — and Cauchy's lower end
    θ_j of λ_{K+j} passed λ_82 … λ_150 by up to 2.3·10⁻⁶ (E off by 0.14 at k = 135 with it)."""
    N, K = 150, 12
    X = np.random.default_rng(99).standard_normal((N, 12)).astype(np.float32)
    G = (X @ X.T).astype(np.float64)
    w, V = _routes(G)["evd"]
    phi = np.random.default_rng(5).standard_normal(N)
    ks = np.arange(1, N + 1)
    c = spectral_curves(torch.from_numpy(G), w[:K], V[:, :K], {"x": phi}, ks)
    for name, (wr, _) in _routes(G).items():
        e = c.eigenvalue
        tol = 1e-12 * wr[0]  # the top part is the given (evd's) values, other drivers' differ by rounding
        out = np.nonzero((wr < e.lower - tol) | (wr > e.upper + tol))[0]
        assert not out.size, f"{name}: λ_k outside at k = {(out + 1).tolist()[:8]}"
    misses = _energy_misses(G, c.energy["x"], phi, ks)
    assert not misses, "; ".join(misses[:4])


@pytest.mark.parametrize(
    "kw", [dict(block_size=1, lanczos_steps=50), dict(basis_bytes=1000.0)], ids=["b=1", "tiny-basis"]
)
def test_one_column_runs_beside_a_repeated_eigenvalue_keep_e_inside(kw):
    """One-column Lanczos runs (block_size 1, or a basis cap that holds one column) on a G with a
    30-fold eigenvalue: rounding lets the Krylov space take a second copy of it, which φ does not
    see (weight 3·10⁻²¹), so φ's rule had 49 nodes of 50 steps and was taken for φ's measure itself
    ("fewer atoms than nodes") — E 0.009–0.037 outside its bracket at k = 141–142."""
    N, K = 150, 8
    rng = np.random.default_rng(7)
    lam = 10.0 ** (-5 * np.arange(N) / (N - 1))
    lam[30:60] = lam[30]
    Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    G = (Q * lam) @ Q.T
    G = (G + G.T) / 2
    w, V = _routes(G)["evd"]
    phi = rng.standard_normal(N)
    ks = np.arange(1, N + 1)
    c = spectral_curves(torch.from_numpy(G), w[:K], V[:, :K], {"x": phi}, ks, **kw)
    misses = _energy_misses(G, c.energy["x"], phi, ks)
    assert not misses, "; ".join(misses[:4])
