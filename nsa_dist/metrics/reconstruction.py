"""Reconstruction of a vector from the top-k eigenvectors of G_t (NSA Fig. 4d)."""

from __future__ import annotations

from typing import Any

import numpy as np

from nsa_dist.errors import ShapeError
from nsa_dist.metrics._validate import as_real, check_rows

__all__ = ["RECONSTRUCTION_KS", "reconstruction_ks", "top_k_reconstructions"]

RECONSTRUCTION_KS = (10, 100, 200, 500)  # NSA Fig. 4d


def reconstruction_ks(K: int) -> tuple[int, ...]:
    """The k of Fig. 4d (10, 100, 200, 500) clamped to the K eigenvectors kept, without repeats."""
    return tuple(sorted({min(k, K) for k in RECONSTRUCTION_KS}))


def top_k_reconstructions(evecs: Any, phi: Any, ks: tuple[int, ...]) -> np.ndarray:
    """φ̄_k = Σ_{i≤k} ⟨v_i, φ̄⟩ v_i for each k of ``ks`` (NSA Fig. 4d with φ̄ = f̄_t), per column.

    Args:
        evecs: (N, K) orthonormal eigenvectors of G_t, descending eigenvalue.
        phi: (N,) or (N, Ko), e.g. the outputs f̄_t at the training points.
        ks: each 1 ≤ k ≤ K.

    Returns:
        (len(ks), N) or (len(ks), N, Ko) float64.

    Raises:
        ShapeError: evecs not (N, K) with K <= N, phi not (N,…), no k, or a k outside 1..K.
        TypeError: a k that is not an integer.
    """
    V = as_real("evecs", evecs, (2,)).astype(np.float64)  # (N, K)
    f = as_real("phi", phi, (1, 2))
    check_rows("phi", f, "evecs", V)
    if V.shape[1] > V.shape[0]:
        raise ShapeError(f"evecs must be (N, K) with K <= N orthonormal columns, got shape {V.shape}")
    ks_ = np.asarray(ks).reshape(-1)
    if ks_.size == 0:
        raise ShapeError(f"ks must hold at least one k in 1..K={V.shape[1]}, got {ks!r}")
    if ks_.dtype.kind not in "iu":
        raise TypeError(f"ks must be integers in 1..K={V.shape[1]}, got {ks!r} (dtype {ks_.dtype})")
    ks = tuple(int(k) for k in ks_)
    if any(not 1 <= k <= V.shape[1] for k in ks):
        raise ShapeError(f"ks {list(ks)} must lie in 1..K={V.shape[1]}")
    F = f.astype(np.float64).reshape(V.shape[0], -1)  # (N, Ko)
    C = V.T @ F  # (K, Ko)
    out = np.stack([V[:, :k] @ C[:k] for k in ks])  # (nR, N, Ko)
    return out[..., 0] if f.ndim == 1 else out
