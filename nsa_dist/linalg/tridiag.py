"""Every eigenvalue of a dense symmetric G and the projections ⟨v_i, φ⟩ of a few vectors φ,
without the (N, N) eigenvector matrix.

One Householder tridiagonalisation ``G = Q T Qᵀ`` (LAPACK ``dsytrd``, the work of ``eigvalsh``),
then ``ψ = Qᵀ Φ`` by applying the N − 1 reflectors to the few columns of Φ (2N²c flops), the
eigenvalues of T (``dsterf``) and, with ``T = S diag(λ) Sᵀ``,

    Vᵀ Φ = Sᵀ Qᵀ Φ = Sᵀ ψ,

where S is produced ``chunk`` columns at a time by MRRR (``dstemr`` with an index range,
O(N · chunk) each), so no N × N matrix is ever held besides G's own copy.  A few eigenvectors
(the images of Fig. 5) are ``v_i = Q s_i``: the reflectors applied to those columns of S.
Cost at N = 10⁴: the ``dsytrd`` (≈ ``eigvalsh``); a full ``eigh`` with vectors is ~6× that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.linalg.lapack as lapack

__all__ = ["SpectralProjections", "eig_projections"]


@dataclass(frozen=True)
class SpectralProjections:
    """All eigenvalues of G and the coordinates of Φ in its eigenbasis.

    Attributes:
        evals: (N,) float64, descending.
        proj: (N, c) float64, ``proj[i, j] = ⟨v_i, φ_j⟩`` with v_i the eigenvector of evals[i].
        vectors: (N, m) float64, the eigenvectors of ``indices`` (0-based, into evals), each
            signed so that its largest-|entry| component is positive (as ``top_eigenpairs``).
        indices: the m indices of ``vectors``.
    """

    evals: np.ndarray
    proj: np.ndarray
    vectors: np.ndarray
    indices: tuple[int, ...]


def eig_projections(G: Any, Phi: np.ndarray, indices: tuple[int, ...] = (), chunk: int = 1024) -> SpectralProjections:
    """λ_1 ≥ … ≥ λ_N of G and ``Vᵀ Φ``, plus the eigenvectors ``indices`` (see module docstring).

    Args:
        G: (N, N) symmetric matrix, NumPy or torch (CPU), any float dtype; copied to float64
            (``dsytrd`` overwrites its input), so G itself is left alone.
        Phi: (N, c) or (N,) float vectors φ_j.
        indices: 0-based positions (in descending order of λ) of eigenvectors to return.
        chunk: columns of S made per ``dstemr`` call.

    Returns:
        :class:`SpectralProjections`.

    Raises:
        ShapeError: G not square, or Phi's rows ≠ N.
        ValueError: an index outside 0..N−1, or chunk < 1.
        RuntimeError: LAPACK reports a failure (its ``info`` is named).
    """
    from nsa_dist.errors import ShapeError

    A = np.array(G.detach().cpu().numpy() if hasattr(G, "detach") else G, dtype=np.float64, order="F")  # (N, N)
    if A.ndim != 2 or A.shape[0] != A.shape[1]:
        raise ShapeError(f"G must be a square (N, N) matrix, got shape {A.shape}")
    N = A.shape[0]
    Phi2 = np.asarray(Phi, dtype=np.float64).reshape(N, -1) if np.size(Phi) % max(N, 1) == 0 and np.ndim(Phi) in (1, 2) \
        and np.shape(Phi)[0] == N else None
    if Phi2 is None:
        raise ShapeError(f"Phi must be (N,) or (N, c) with N = {N}, got shape {np.shape(Phi)}")
    if chunk < 1 or any(not 0 <= i < N for i in indices):
        raise ValueError(f"indices must lie in 0..{N - 1} and chunk >= 1; got indices {list(indices)}, chunk {chunk}")
    c, d, e, tau, info = lapack.dsytrd(A, lower=1, overwrite_a=1)
    _ok("dsytrd", info)
    del A
    psi = _apply_qt(c, tau, Phi2)  # (N, c) = Qᵀ Φ
    w, info = lapack.dsterf(d, e)[:2]
    _ok("dsterf", info)
    proj = np.empty((N, Phi2.shape[1]))
    want = sorted({N - 1 - i for i in indices})  # ascending positions of the wanted eigenvectors
    S_want = np.empty((N, len(want)))
    for lo in range(0, N, chunk):
        hi = min(N, lo + chunk)
        S = _tridiagonal_vectors(d, e, lo, hi)  # (N, hi − lo), ascending eigenvalues lo..hi−1
        proj[lo:hi] = S.T @ psi
        for j, a in enumerate(want):
            if lo <= a < hi:
                S_want[:, j] = S[:, a - lo]
    order = {a: j for j, a in enumerate(want)}
    V = _apply_q(c, tau, S_want[:, [order[N - 1 - i] for i in indices]]) if indices else np.empty((N, 0))
    flip = V[np.abs(V).argmax(axis=0), np.arange(V.shape[1])] < 0 if V.size else np.zeros(0, bool)
    V[:, flip] *= -1
    return SpectralProjections(w[::-1].copy(), proj[::-1].copy(), V, tuple(indices))


def _ok(name: str, info: int) -> None:
    if info != 0:
        raise RuntimeError(f"LAPACK {name} failed with info = {info}")


def _apply_qt(c: np.ndarray, tau: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Qᵀ X for ``dsytrd(lower=1)``'s Q = H_1 ⋯ H_{N−1}, H_i = I − τ_i u_i u_iᵀ with
    u_i = (0…0, 1, c[i+2:, i]) (1 at row i+1): Qᵀ X = H_{N−1} ⋯ H_1 X."""
    X = np.array(X, dtype=np.float64)
    for i in range(c.shape[0] - 1):
        _reflect(c, tau, i, X)
    return X


def _apply_q(c: np.ndarray, tau: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Q X = H_1 ⋯ H_{N−1} X (reflectors applied last to first)."""
    X = np.array(X, dtype=np.float64)
    for i in range(c.shape[0] - 2, -1, -1):
        _reflect(c, tau, i, X)
    return X


def _reflect(c: np.ndarray, tau: np.ndarray, i: int, X: np.ndarray) -> None:
    """X ← H_i X in place."""
    t = tau[i]
    if t == 0.0:
        return
    u = c[i + 2:, i]  # (N − i − 2,), the reflector's tail (its head, at row i + 1, is 1)
    Xs = X[i + 1:]  # (N − i − 1, c) view
    w = Xs[0] + u @ Xs[1:]  # (c,) = u_iᵀ X
    Xs[0] -= t * w
    Xs[1:] -= t * np.outer(u, w)


def _tridiagonal_vectors(d: np.ndarray, e: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Orthonormal eigenvectors (N, hi − lo) of T = tridiag(e, d, e), ascending indices lo..hi−1 (MRRR)."""
    N = d.shape[0]
    e_ = np.append(e, 0.0)  # dstemr wants e of length N
    m, _, Z, info = lapack.dstemr(d.copy(), e_, 3, 0.0, 0.0, lo + 1, hi, compute_v=1)
    _ok("dstemr", info)
    if m != hi - lo:
        raise RuntimeError(f"LAPACK dstemr returned {m} eigenvectors for the index range {lo + 1}..{hi} of N = {N}")
    return Z[:, :m]
