"""Spectra of a K-output network's full NTK and of its per-output blocks.

* :func:`full_kernel_top` — λ_1 ≥ … ≥ λ_k of the full (N·K)×(N·K) NTK Θ = J Jᵀ, the kernel that
  sets GD's stability (the output-traced Gram Σ_a J_a J_aᵀ has a λ_max up to K times larger).
* :func:`per_class_top` — the top eigenvalues of each diagonal block Θ_aa = J_a J_aᵀ.

Both run Lanczos / dense eigh on the matrix-free operator ``v ↦ J Jᵀ v``, never the dense
(NK)×(NK) matrix for large NK.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from nsa_dist.linalg import top_eigenpairs
from nsa_dist.ntk.gram import ntk_operator

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["full_kernel_top", "per_class_top"]


class _Block:
    """The diagonal block a of the full kernel, Θ_aa = J_a J_aᵀ (N, N), as an operator on (N, m)."""

    def __init__(self, full: Any, a: int, K: int) -> None:
        self.full, self.a, self.K = full, a, K
        n = full.shape[0] // K
        self.shape = (n, n)

    def matmat(self, V: np.ndarray) -> np.ndarray:
        V = np.asarray(V)
        W = np.zeros((self.shape[0], self.K) + V.shape[1:], dtype=np.float64)  # (N, K[, m])
        W[:, self.a] = V
        out = np.asarray(self.full.matmat(W.reshape(self.shape[0] * self.K, -1)))  # (N·K, m)
        out = out.reshape(self.shape[0], self.K, -1)[:, self.a]  # (N, m)
        return out if V.ndim == 2 else out[:, 0]


def per_class_top(
    model: nn.Module,
    X: torch.Tensor,
    k: int,
    *,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
    tol: float = 1e-10,
) -> np.ndarray:
    """Top k eigenvalues of each diagonal block Θ_aa = J_a J_aᵀ of the full NTK (per-class spectra).

    Θ_aa is the kernel of output a alone (class a for one-hot targets); Σ_a Θ_aa is the traced
    Gram G.  Each block is an operator built on the full kernel's products (never dense).

    Returns:
        (K, k) float64, each row descending.
    """
    full = ntk_operator(model, X, kernel="full", block_size=block_size, dtype=dtype)
    K = full.shape[0] // X.shape[0]
    if not 1 <= k <= X.shape[0]:
        raise ValueError(f"k={k} outside 1..N={X.shape[0]}")
    return np.stack([top_eigenpairs(_Block(full, a, K), k, "auto", tol=tol).evals for a in range(K)])


def full_kernel_top(
    model: nn.Module,
    X: torch.Tensor,
    k: int,
    *,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
    tol: float = 1e-10,
) -> np.ndarray:
    """The k largest eigenvalues of the full NTK Θ = J Jᵀ, (N·K)×(N·K), J = ∂f(X)/∂θ (N·K, P).

    GD on L = (1/N) Σ ½‖f_i − y_i‖² moves the stacked residual as m ← (I − (δ/N) Θ) m to first
    order, so 2N/λ_max(Θ) is its stability bound (NSA §4 with Θ in place of G).

    Args:
        model: maps (n, d) → (n, K).
        X: (N, d) training points.
        k: 1 ≤ k ≤ N·K eigenvalues.
        dtype: product dtype (float64 for reference checks).
        block_size: points per VJP/JVP block of the operator.
        tol: Lanczos residual tolerance relative to λ_max.

    Returns:
        (k,) float64, descending.
    """
    op = ntk_operator(model, X, kernel="full", block_size=block_size, dtype=dtype)  # (N·K, N·K)
    if not 1 <= k <= op.shape[0]:
        raise ValueError(f"k={k} outside 1..N·K={op.shape[0]}")
    return np.asarray(top_eigenpairs(op, k, "auto", tol=tol).evals, dtype=np.float64)
