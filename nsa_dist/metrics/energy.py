"""Relative energy of a vector in the top-k eigenvectors of a Gramian (NSA §6, Figs. 3, 4a)."""

from __future__ import annotations

from typing import Any

import numpy as np

from nsa_dist.errors import ShapeError
from nsa_dist.metrics._validate import as_real, check_rows, count, nonzero_norms, work_dtype

__all__ = ["spectral_projections", "relative_energy"]


def _validated(evecs: Any, phi: Any) -> tuple[np.ndarray, np.ndarray]:
    """``evecs`` (N, K) with K <= N and ``phi`` (N,) or (N, M) as checked arrays."""
    V = as_real("evecs", evecs, (2,))  # (N, K)
    phi = as_real("phi", phi, (1, 2))  # (N,) or (N, M)
    if V.shape[1] > V.shape[0]:
        raise ShapeError(f"evecs must be (N, K) with K <= N orthonormal columns, got shape {V.shape}; "
                         "eigenvectors go in columns (transpose a (K, N) array)")
    check_rows("phi", phi, "evecs", V)
    return V, phi


def _projections2(V: np.ndarray, phi: np.ndarray) -> np.ndarray:
    """⟨v_i, φ⟩² in float64: (K,) for phi (N,), (M, K) for phi (N, M)."""
    dtype = work_dtype(V, phi)
    coeffs = V.T.astype(dtype, copy=False) @ phi.astype(dtype, copy=False)  # (K,) or (K, M)
    return np.square(coeffs.astype(np.float64)).T


def spectral_projections(evecs: Any, phi: Any) -> np.ndarray:
    """Squared projections ⟨v_i, φ⟩² of ``phi`` on each eigenvector (NSA Fig. 4a).

    Args:
        evecs: (N, K) float array, orthonormal eigenvectors v_i of G_t as columns.
        phi: (N,) vector φ, or (N, M) for M vectors at once.

    Returns:
        float64 array (K,) of ⟨v_i, φ⟩², or (M, K) with one row per column of ``phi``.

    Raises:
        ShapeError: ``evecs`` not 2-D with K <= N, ``phi`` not 1-/2-D, or their N differ.
        NonFiniteError: NaN/inf in either input.
        TypeError: a non-real dtype.
    """
    return _projections2(*_validated(evecs, phi))


def relative_energy(evecs: Any, phi: Any, k: int | None = None) -> np.ndarray | float:
    """Relative energy E_t(φ, k) of ``phi`` in the top-k eigenvectors, for every k <= K (NSA §6).

    E_t(φ, k) = Σ_{i≤k} ⟨v_i, φ⟩² / ‖φ‖² = cos²α_t(φ, k), the share of ‖φ‖² inside
    span{v_1, …, v_k}.  Columns of ``evecs`` must be ordered by DESCENDING eigenvalue
    (``np.linalg.eigh`` returns them ascending: pass ``evecs[:, ::-1]``).

    Args:
        evecs: (N, K) float array, orthonormal eigenvectors v_1..v_K of G_t as columns.
        phi: (N,) vector φ (labels ȳ, outputs f̄_t, residual m̄_t, df̄_t, ...), or (N, M).
        k: if given, a count 1 <= k <= K; only E_t(φ, k) is returned.

    Returns:
        float64 array (K,) whose entry k-1 is E_t(φ, k) (non-decreasing in k; 1 at k = N),
        or (M, K) for ``phi`` of shape (N, M).  With ``k``: a float, or an (M,) array.

    Raises:
        ShapeError: bad shapes (see :func:`spectral_projections`) or k outside [1, K].
        NonFiniteError: NaN/inf input, or a zero vector φ (E is 0/0).
        TypeError: a non-real dtype, or ``k`` not an integer.
    """
    V, phi = _validated(evecs, phi)
    if k is not None:
        k = count("k", k, 1, V.shape[1])
    norm2 = np.sum(np.square(phi.astype(np.float64)), axis=0)  # () or (M,)
    nonzero_norms("phi", norm2, "the relative energy Σ⟨v_i,φ⟩²/‖φ‖²")
    energy = np.cumsum(_projections2(V, phi), axis=-1) / np.asarray(norm2)[..., None]  # (K,)|(M, K)
    if k is None:
        return energy
    out = energy[..., k - 1]
    return float(out) if out.ndim == 0 else out
