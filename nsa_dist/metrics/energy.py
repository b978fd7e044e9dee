"""Relative energy of a vector in the top-k eigenvectors of a Gramian (NSA §6, Figs. 3, 4a)."""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np

from nsa_dist.errors import NonFiniteError, ShapeError
from nsa_dist.metrics._validate import as_real, check_rows, count, nonzero_norms, work_dtype

__all__ = ["spectral_projections", "relative_energy", "energy_from_projections"]


def _validated(evecs: Any, phi: Any) -> tuple[np.ndarray, np.ndarray]:
    """``evecs`` (N, K) with K <= N and ``phi`` (N,) or (N, M) as checked arrays."""
    V = as_real("evecs", evecs, (2,))  # (N, K)
    phi = as_real("phi", phi, (1, 2))  # (N,) or (N, M)
    if V.shape[1] > V.shape[0]:
        raise ShapeError(
            f"evecs must be (N, K) with K <= N orthonormal columns, got shape {V.shape}; "
            "eigenvectors go in columns (transpose a (K, N) array)"
        )
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


def relative_energy(
    evecs: Any, phi: Any, k: int | None = None, *, pooled: bool = False, undefined: Literal["raise", "nan"] = "raise"
) -> np.ndarray | float:
    """Relative energy E_t(φ, k) of ``phi`` in the top-k eigenvectors, for every k <= K (NSA §6).

    E_t(φ, k) = Σ_{i≤k} ⟨v_i, φ⟩² / ‖φ‖² = cos²α_t(φ, k), the share of ‖φ‖² inside
    span{v_1, …, v_k}.  Columns of ``evecs`` must be ordered by DESCENDING eigenvalue
    (``np.linalg.eigh`` returns them ascending: pass ``evecs[:, ::-1]``).  ``pooled``: the M
    columns of a (N, M) φ (a K-output network's outputs) as one vector,
    E_t(φ, k) = Σ_c Σ_{i≤k} ⟨v_i, φ_c⟩² / Σ_c ‖φ_c‖².

    Args:
        evecs: (N, K) float array, orthonormal eigenvectors v_1..v_K of G_t as columns.
        phi: (N,) vector φ (the paper's ȳ, f̄_t, m̄_t: the labels, outputs, residual, … at the N
            points as vectors — not centred; the runs centre only an NCE run's y), or (N, M).
        k: if given, a count 1 <= k <= K; only E_t(φ, k) is returned.
        pooled: one energy for all columns of a (N, M) φ (no effect on a (N,) φ).
        undefined: a zero or non-finite φ (the update of a diverging step) raises ("raise") or
            gives NaN ("nan") where E is undefined.

    Returns:
        float64 array (K,) whose entry k-1 is E_t(φ, k) (non-decreasing in k; 1 at k = N),
        or (M, K) for ``phi`` of shape (N, M) unless pooled.  With ``k``: a float, or an (M,) array.
        Float32 ``evecs`` and ``phi`` are projected in float32, anything else in float64.

    Raises:
        ShapeError: bad shapes (see :func:`spectral_projections`) or k outside [1, K].
        NonFiniteError: NaN/inf input, or a zero vector φ (E is 0/0) — for φ only with
            ``undefined="raise"``.
        TypeError: a non-real dtype, or ``k`` not an integer.
        ValueError: ``undefined`` not "raise" or "nan".
    """
    if undefined not in ("raise", "nan"):
        raise ValueError(f"undefined={undefined!r} is not one of 'raise', 'nan'")
    try:
        V, phi = _validated(evecs, phi)
        bad: np.ndarray | bool = False
    except NonFiniteError:
        if undefined == "raise":
            raise
        raw = np.asarray(phi.detach().cpu().numpy() if hasattr(phi, "detach") else phi)
        V, phi = _validated(evecs, _zeroed(raw))  # NaN/inf in evecs still raise
        bad = ~np.isfinite(raw).all(axis=0) if raw.ndim == 2 else True  # () | (M,): the columns with NaN/inf
    if k is not None:
        k = count("k", k, 1, V.shape[1])
    phi = _unit_scale(phi, per_column=not pooled)  # squares neither underflow nor overflow
    P2 = _projections2(V, phi)  # (K,) | (M, K)
    norm2 = np.sum(np.square(phi.astype(np.float64)), axis=0)  # () | (M,)
    if pooled:
        P2, norm2, bad = P2.reshape(-1, V.shape[1]).sum(axis=0), norm2.sum(), np.any(bad)  # (K,), (), ()
    if undefined == "raise":
        nonzero_norms("phi", norm2, "the relative energy Σ⟨v_i,φ⟩²/‖φ‖²")
    with np.errstate(divide="ignore", invalid="ignore"):
        # ≤ 1 by Bessel's inequality; the cumulative sum's rounding may pass it by ulps
        energy = np.minimum(np.cumsum(P2, axis=-1) / np.asarray(norm2)[..., None], 1.0)  # (K,) | (M, K)
    energy[np.asarray(norm2) == 0] = np.nan  # 0/0 (only reached with undefined="nan")
    energy[bad] = np.nan  # only the non-finite columns of φ (only reached with undefined="nan")
    if k is None:
        return energy
    out = energy[..., k - 1]
    return float(out) if out.ndim == 0 else out


def _unit_scale(phi: np.ndarray, per_column: bool) -> np.ndarray:
    """``phi`` times a power of two per column (or one for all) that brings its largest |entry| into
    [½, 1): E is scale-free, and the squares of a φ ~ 10⁻²⁰¹ (a vanishing update) underflowed to 0/0,
    those of a φ ~ 10¹⁶⁰ overflowed.  Exact (no rounding), zero and non-finite columns left as they are."""
    if phi.dtype.kind not in "fc" or phi.size == 0:
        return phi
    top = np.abs(phi).max(axis=0) if per_column else np.abs(phi).max()
    e = np.frexp(np.where(np.isfinite(top) & (top > 0), top, 1.0))[1]
    if not np.any(e):
        return phi
    return np.ldexp(phi, -np.asarray(e, dtype=np.int32)).astype(phi.dtype, copy=False)


def _zeroed(phi: Any) -> np.ndarray:
    """``phi`` with its NaN/inf entries replaced by 0 (the caller then returns NaN)."""
    arr = np.asarray(phi.detach().cpu().numpy() if hasattr(phi, "detach") else phi)
    return np.where(np.isfinite(arr), arr, 0).astype(arr.dtype, copy=False) if arr.dtype.kind in "fc" else arr


def energy_from_projections(P: np.ndarray, phi: np.ndarray) -> np.ndarray:
    """E(φ, k) for k = 1..K from the coordinates P = Vᵀφ (K, C) already computed (a step projects
    every φ once, during its eigensolve): Σ_c Σ_{i≤k} P_ic² / Σ_c ‖φ_c‖² (NSA §6; the pooled
    :func:`relative_energy`), at most 1 (Bessel; the sum's rounding may pass it by ulps); NaN for
    φ = 0 or a non-finite φ (the update of a diverging step).  P may be (K,) for one column; it is
    summed in float64 whatever its dtype."""
    P = np.asarray(P.detach().cpu().numpy() if hasattr(P, "detach") else P, dtype=np.float64)
    P = P.reshape(P.shape[0], -1)  # (K, C)
    phi = np.asarray(phi.detach().cpu().numpy() if hasattr(phi, "detach") else phi, dtype=np.float64)
    top = float(np.abs(phi).max()) if phi.size else 0.0
    if 0.0 < top < np.inf:  # P and φ scaled alike by a power of two: ‖φ‖² of a φ ~ 10⁻²⁰¹ underflowed to 0/0
        e = -math.frexp(top)[1]
        P, phi = np.ldexp(P, e), np.ldexp(phi, e)
    norm2 = float(np.sum(phi**2))
    if norm2 == 0.0 or not np.isfinite(norm2):
        return np.full(P.shape[0], np.nan)
    return np.minimum(np.cumsum(np.sum(P**2, axis=1)) / norm2, 1.0)  # (K,)
