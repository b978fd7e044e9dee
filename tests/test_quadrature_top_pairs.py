"""The exact top part given to ``spectral_curves`` is checked against G: its evecs orthonormal, its evals
their vectors' Rayleigh quotients (an audit, session 30: evals 10⁻⁶ off their exact vectors put λ_1 outside
its bracket by 10⁻⁶; the top vectors in reversed order reported E(y, 1) = 0.00054 for 0.00203 as exact;
evecs scaled ×2 bracketed λ_2 = 0.5 in [1.53, 7.97])."""

from __future__ import annotations

import numpy as np
import pytest

from nsa_dist.linalg.quadrature import spectral_curves

N, K = 120, 10
KW = {"lanczos_steps": 20, "probes": 8, "block_size": 8}


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(2)
    Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    G = (Q * np.arange(1, N + 1) ** -1.0) @ Q.T
    G = (G + G.T) / 2
    w, V = np.linalg.eigh(G)
    return G, w[::-1].copy(), V[:, ::-1].copy(), np.random.default_rng(0).standard_normal(N)


def test_evals_a_little_off_their_vectors_widen_the_top_bracket(case) -> None:  # noqa: ANN001
    G, w, V, y = case
    for given in (w[:K] * (1 + 1e-6), w[:K].astype(np.float32).astype(np.float64)):
        e = spectral_curves(G, given, V[:, :K], {"y": y}, np.arange(1, N + 1), **KW).eigenvalue
        out = np.maximum(e.lower[:K] - w[:K], w[:K] - e.upper[:K])
        assert (out <= 0).all(), f"exact top eigenvalues outside their brackets by up to {out.max():.3g}"


@pytest.mark.parametrize(
    ("alter", "match"),
    [
        (lambda w, V: (w[:K], V[:, :K][:, ::-1].copy()), "not the Rayleigh quotients"),
        (lambda w, V: (w[:K], 2 * V[:, :K]), "orthonormal"),
        (lambda w, V: (w[1 : K + 1], V[:, :K]), "not the Rayleigh quotients"),
    ],
    ids=["reversed-vectors", "scaled-vectors", "shifted-values"],
)
def test_top_pairs_that_are_not_g_s_are_refused(case, alter, match) -> None:  # noqa: ANN001
    G, w, V, y = case
    evals, evecs = alter(w, V)
    with pytest.raises(ValueError, match=match):
        spectral_curves(G, evals, evecs, {"y": y}, np.arange(1, N + 1), **KW)


def test_float32_pairs_of_a_float32_gram_are_taken(case) -> None:  # noqa: ANN001
    G, _, _, y = case
    G32 = G.astype(np.float32)
    w32, V32 = np.linalg.eigh(G32)
    w32, V32 = w32[::-1].copy(), V32[:, ::-1].copy()
    c = spectral_curves(G32, w32[:K], V32[:, :K], {"y": y}, np.arange(1, N + 1), **KW)
    w = np.linalg.eigvalsh(G32.astype(np.float64))[::-1]
    out = np.maximum(c.eigenvalue.lower - w, w - c.eigenvalue.upper)
    assert out[:K].max() <= 0, f"the top eigenvalues of the float32 G outside by {out[:K].max():.3g}"


def test_a_slightly_asymmetric_gram_is_bracketed_as_the_exact_route_reduces_it() -> None:
    """A G asymmetric by 4·10⁻¹⁰ of max|G| passes the symmetry check (1.5·10⁻⁸), and eigh reduces one
    triangle of it: 8 of 300 eigenvalues fell outside brackets made for (G + Gᵀ)/2 (an audit).  The brackets
    now take ‖G − Gᵀ‖_F / 2 in."""
    n = 300
    spec = np.sort(np.concatenate([np.linspace(1, 0.5, 20), 0.3 + 1e-10 * np.arange(30), np.logspace(-1, -10, n - 50)]))
    Q, _ = np.linalg.qr(np.random.default_rng(4).standard_normal((n, n)))
    G = (Q * spec[::-1]) @ Q.T
    S = np.random.default_rng(0).standard_normal((n, n))
    G = (G + G.T) / 2 + 1e-10 * (S - S.T) / 2
    w, V = np.linalg.eigh(G)  # the exact route: the lower triangle
    w, V = w[::-1].copy(), V[:, ::-1].copy()
    e = spectral_curves(G, w[:20], V[:, :20], {}, np.arange(1, n + 1), lanczos_steps=20, probes=8, block_size=8)
    e = e.eigenvalue
    out = np.maximum(e.lower - w, w - e.upper)
    assert (out <= 0).sum() == n, f"{int((out > 0).sum())} eigenvalues outside, by up to {out.max():.3g}"
