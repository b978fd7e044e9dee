"""Adversarial trial of the eigensolvers (nsa_dist/linalg): each result against a float64
``numpy.linalg.eigh`` of the same matrix — eigenvalues, eigenspace projectors ‖P − P_ref‖ and
energies E(φ, k) at cluster ends — on the inputs that used to come back wrong, "converged"."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from nsa_dist.errors import NonFiniteError
from nsa_dist.linalg import LanczosConvergenceWarning, LinearOperator, step_spectrum, top_eigenpairs


def _psd(lam: np.ndarray, seed: int) -> np.ndarray:
    """Q diag(λ) Qᵀ, exactly symmetric, Q a random orthogonal (N, N)."""
    N = lam.size
    Q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((N, N)))
    G = (Q * lam) @ Q.T
    return (G + G.T) / 2


def _reference(G: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w, V = np.linalg.eigh(np.asarray(G, dtype=np.float64))
    return w[::-1].copy(), V[:, ::-1].copy()  # descending


def _projector_gap(V: np.ndarray, V_ref: np.ndarray) -> float:
    """‖V Vᵀ − V_ref V_refᵀ‖₂ of two orthonormal bases of the same width."""
    return float(np.linalg.norm(V @ V.T - V_ref @ V_ref.T, 2))


class _Dense(LinearOperator):
    """G behind the package's own operator interface (torch, CPU)."""

    def __init__(self, G: np.ndarray) -> None:
        super().__init__(G.shape[0], torch.float64, "torch", "cpu")
        self.G = torch.from_numpy(G)

    def _matmat(self, V: torch.Tensor) -> torch.Tensor:
        return self.G @ V


def _hundredfold(N: int = 600) -> np.ndarray:
    """A 100-fold top eigenvalue (5.0), then a spread tail 1 … 0.01: a multi-output Gram's
    Kronecker structure K ⊗ I_C at C = 100, or data with that many symmetric copies."""
    return _psd(np.concatenate([np.full(100, 5.0), np.linspace(1.0, 0.01, N - 100)]), 100)


@pytest.mark.parametrize("kind", ["numpy", "torch", "operator"])
def test_a_repeated_eigenvalue_wider_than_the_lanczos_block_is_found_whole(kind: str) -> None:
    """k = 120 > m = 100 > block 16: block Lanczos found 96 of the 100 copies and returned four tail
    eigenvalues (~0.97) in their place, every residual small, ``converged`` True (max error 4.0)."""
    G = _hundredfold()
    w, V = _reference(G)
    arg = _Dense(G) if kind == "operator" else G
    with warnings.catch_warnings():
        warnings.simplefilter("error", LanczosConvergenceWarning)
        ep = top_eigenpairs(arg, 120, "lanczos", backend="torch" if kind == "torch" else "auto")
    err = np.abs(ep.evals - w[:120])
    n5 = int((np.abs(ep.evals - 5.0) < 1e-8).sum())
    assert err.max() <= 1e-10 * w[0], (
        f"max |λ - λ_ref| = {err.max():.3g} at i = {err.argmax()}; copies of 5.0: {n5}/100"
    )
    gap = _projector_gap(ep.evecs[:, :100], V[:, :100])
    assert gap <= 1e-8, f"‖P_100 − P_ref‖ = {gap:.3g}"
    assert ep.converged
    assert np.all(np.diff(ep.evals) <= 0), "not descending"


def test_a_miss_that_reruns_cannot_mend_is_said(monkeypatch) -> None:
    """With no reruns allowed the same miss is a LanczosConvergenceWarning and ``converged`` False,
    never a converged answer."""
    import nsa_dist.linalg.eigenpairs as eigenpairs

    monkeypatch.setattr(eigenpairs, "_MISSED_TRIES", 0)
    G = _hundredfold()
    w, _ = _reference(G)
    with pytest.warns(LanczosConvergenceWarning, match=r"missed an eigenvalue: 5 lies above its k-th"):
        ep = top_eigenpairs(G, 120, "lanczos")
    err = float(np.abs(ep.evals - w[:120]).max())
    assert not ep.converged, f"returned as converged with max |λ - λ_ref| = {err:.3g}"


def test_an_ordinary_spectrum_pays_nothing_for_the_check() -> None:
    """No returned cluster as wide as the block: no check runs, the products are those of block
    Lanczos itself (λ_i ∝ i⁻³, condition 1e12 at N = 10⁴ scale, here N = 800)."""
    from nsa_dist.linalg._backend import ArrayOps
    from nsa_dist.linalg.lanczos import block_lanczos

    N = 800
    lam = np.arange(1, N + 1.0) ** -3.0
    G = _psd(lam, 3)
    ep = top_eigenpairs(G, 40, "lanczos")
    plain = block_lanczos(lambda X: G @ X, N, 40, ArrayOps(np))
    assert ep.n_matvec == plain.n_matvec, (ep.n_matvec, plain.n_matvec)
    w, V = _reference(G)
    rel = np.abs(ep.evals - w[:40]) / w[:40]
    assert rel.max() <= 1e-6, f"max relative error {rel.max():.3g} at i = {rel.argmax()}"


def _block_diagonal() -> tuple[np.ndarray, np.ndarray]:
    """G = diag(G₁, G₂) with G₂'s top (3.0, 2.5) above G₁'s (1.0), and the last step's top 20
    eigenvectors of G₁ alone — exact zeros on G₂'s rows — as the warm start."""
    G1 = _psd(np.linspace(1.0, 0.5, 100), 1)
    G2 = _psd(np.concatenate([[3.0, 2.5], np.linspace(0.1, 0.05, 98)]), 2)
    G = np.zeros((200, 200))
    G[:100, :100], G[100:, 100:] = G1, G2
    start = np.zeros((200, 20))
    start[:100] = _reference(G1)[1][:, :20]
    return G, start


@pytest.mark.parametrize("k", [1, 5, 16, 20])
def test_a_warm_start_does_not_hide_eigenvectors_orthogonal_to_it(k: int) -> None:
    """The previous step's vectors spanned only G₁'s block: Lanczos from them never left it and
    returned G₁'s top (1.0, 0.995, …) for G's (3.0, 2.5, 1.0, …), ``converged`` True."""
    G, start = _block_diagonal()
    w, V = _reference(G)
    ep = top_eigenpairs(G, k, "lanczos", start=start)
    err = np.abs(ep.evals - w[:k])
    assert err.max() <= 1e-10 * w[0], f"λ = {ep.evals[:3]} against eigh's {w[:3]}: max error {err.max():.3g}"
    gap = _projector_gap(ep.evecs, V[:, :k])
    assert gap <= 1e-6, f"‖P_k − P_ref‖ = {gap:.3g}"


@pytest.mark.parametrize("route", ["auto", "tridiagonal"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_k_all_routes_refuse_what_the_eigenpairs_route_refuses(route: str, dtype: type) -> None:
    """A ``k: all`` step on a dense G reduces one triangle: a NaN came back as "LAPACK dstevd failed
    with info = 24", an inf as λ_1 = inf, an unsymmetric G (5e-5 of max |G| apart) as the spectrum
    of its lower triangle — the eigenpairs route refuses all three with a named error."""
    N = 120
    G = _psd(np.arange(1, N + 1.0) ** -3.0, 4).astype(dtype)
    y = np.sin(np.arange(N, dtype=np.float64))
    for bad, what in ((np.nan, "NaN"), (np.inf, "inf")):
        Gb = G.copy()
        Gb[3, 5] = Gb[5, 3] = bad
        with pytest.raises(NonFiniteError, match=r"G holds 2 NaN/inf entries"):
            sp = step_spectrum(Gb, N, {"y": y}, route=route)
            pytest.fail(f"a G with {what} gave evals {sp.evals[:3]} by route {sp.route}")
    Ga = G.copy()
    Ga[0, 1] += dtype(1e-2 * G[0, 0])
    with pytest.raises(ValueError, match=r"G must be symmetric; max \|G - Gᵀ\|"):
        sp = step_spectrum(Ga, N, {"y": y}, route=route)
        pytest.fail(f"an unsymmetric G gave evals {sp.evals[:3]} by route {sp.route}")
    # rounding-size asymmetry of G's own precision is accepted, and the result is eigh's of (G + Gᵀ)/2
    Gr = G.copy()
    Gr[0, 1] = np.nextafter(Gr[0, 1], dtype(1.0))
    sp = step_spectrum(Gr, N, {"y": y}, route=route)
    w, _ = _reference((Gr.astype(np.float64) + Gr.T.astype(np.float64)) / 2)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    assert np.abs(sp.evals - w).max() <= tol * w[0], np.abs(sp.evals - w).max()


def test_k_all_of_an_operator_with_only_matvec() -> None:
    """``top_eigenpairs`` takes an operator with ``shape`` and ``matvec`` only; ``step_spectrum`` at
    ``k: all`` took it for a dense matrix ("G must be a square (N, N) matrix, got shape ()")."""
    N = 80
    G = _psd(np.concatenate([np.full(4, 2.0), np.arange(1, N - 3.0) ** -2.0]), 5)

    class MatvecOnly:
        shape = (N, N)

        def matvec(self, v: np.ndarray) -> np.ndarray:
            return G @ v

    y = np.cos(np.arange(N, dtype=np.float64))
    sp = step_spectrum(MatvecOnly(), N, {"y": y})
    w, V = _reference(G)
    assert np.abs(sp.evals - w).max() <= 1e-10 * w[0], np.abs(sp.evals - w).max()
    E, E_ref = (np.cumsum(p**2) / (y @ y) for p in (sp.proj["y"][:, 0], V.T @ y))
    ends = [3, 10, 40, N - 1]  # the 4-fold top's end and beyond
    assert np.abs(E[ends] - E_ref[ends]).max() <= 1e-9, np.abs(E[ends] - E_ref[ends])
