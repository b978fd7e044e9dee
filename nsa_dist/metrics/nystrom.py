"""Nyström extension of Gramian eigenvectors to new points (NSA App. A, Eq. 9)."""

from __future__ import annotations

from typing import Any

import numpy as np

from nsa_dist.errors import NonFiniteError, ShapeError
from nsa_dist.metrics._validate import as_real, check_rows, work_dtype

__all__ = ["nystrom_extension", "nystrom_from_products"]


def nystrom_extension(g_test: Any, evals: Any, evecs: Any) -> np.ndarray:
    """Eigenfunctions of g_t at new points, ṽ_k(X) ≈ g_t(X, 𝒳) v_k / λ_k (NSA App. A, Eq. 9).

    At the training points (g_test = G_t) this reproduces v_k exactly.  ṽ_k is on the scale of
    v_k (entries ~ 1/√N), not of the unit-L2(P) eigenfunction (which is √N ṽ_k).

    Args:
        g_test: (M, N) kernel rows g_t(X, 𝒳) between M new points and the N training points.
        evals: (K,) eigenvalues λ_k of G_t, all > 0.  Zero eigenvalues have no extension:
            keep only the positive ones, e.g. ``evals[:K'], evecs[:, :K']`` (drop eigenvalues
            below ~1e-12·λ_max yourself: dividing by round-off amplifies noise).
        evecs: (N, K) eigenvectors v_k of G_t as columns.

    Returns:
        (M, K) array, column k = ṽ_k at the M points; float32 if every input is float32,
        else float64.

    Raises:
        ShapeError: g_test not (M, N), evecs not (N, K), or evals not (K,).
        NonFiniteError: NaN/inf input, or a zero eigenvalue (division by 0).
        ValueError: a negative eigenvalue (G_t is positive semi-definite).
        TypeError: a non-real dtype.
    """
    g = as_real("g_test", g_test, (2,))  # (M, N)
    V = as_real("evecs", evecs, (2,))  # (N, K)
    check_rows("evecs", V, "g_test", g, axis_b=1)
    lam = as_real("evals", evals, (1,))  # (K,)
    if lam.shape[0] != V.shape[1]:
        raise ShapeError(
            f"evals has shape {lam.shape} but evecs has {V.shape[1]} columns {V.shape}; they must match (K,) and (N, K)"
        )
    dtype = work_dtype(g, lam, V)
    return nystrom_from_products(g.astype(dtype, copy=False) @ V.astype(dtype, copy=False), evals)


def nystrom_from_products(gV: Any, evals: Any) -> np.ndarray:
    """ṽ_k(X) = (g_t(X, 𝒳) v_k) / λ_k (NSA Eq. 9) from the products g_t(X, 𝒳) V already taken (e.g.
    by Jacobian-vector products, never forming the (M, N) kernel rows).

    Args:
        gV: (M, K) the kernel rows times the eigenvectors.
        evals: (K,) λ_k > 0.

    Returns:
        (M, K), float32 if both inputs are float32, else float64.

    Raises:
        ShapeError: gV not (M, K) with evals (K,).
        NonFiniteError: NaN/inf input, or a zero eigenvalue.
        ValueError: a negative eigenvalue.
    """
    P = as_real("gV", gV, (2,))  # (M, K)
    lam = as_real("evals", evals, (1,))  # (K,)
    if lam.shape[0] != P.shape[1]:
        raise ShapeError(
            f"evals has shape {lam.shape} but the products have {P.shape[1]} columns {P.shape}; "
            "they must match (K,) and (M, K)"
        )
    if np.any(lam < 0):
        bad = np.flatnonzero(lam < 0)[:10].tolist()
        raise ValueError(
            f"evals must be > 0, got negative values at indices {bad} "
            f"(min {lam.min()}); a Gramian is PSD: drop round-off eigenvalues"
        )
    if np.any(lam == 0):
        bad = np.flatnonzero(lam == 0)[:10].tolist()
        raise NonFiniteError(
            f"evals holds zeros at indices {bad}: g v_k / λ_k is x/0; pass only eigenpairs with λ_k > 0"
        )
    dtype = work_dtype(P, lam)
    return P.astype(dtype, copy=False) / lam.astype(dtype)  # (M, K)
