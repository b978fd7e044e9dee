"""Per-step quantities beyond the traced spectrum (issue 11), kept out of ``spectral.py``.

* :func:`full_kernel_top` — λ_1 ≥ … ≥ λ_k of the full (N·K)×(N·K) NTK of a K-output network,
  the kernel that sets GD's stability (the stored ``eigenvalues`` are of the output-traced Gram
  Σ_a J_a J_aᵀ, whose λ_max is up to K times larger).  Computed by Lanczos / dense eigh on the
  matrix-free operator ``v ↦ J Jᵀ v`` (never the dense (NK)×(NK) matrix for large NK).
* :func:`held_out_loss` — L_test(θ_t) = (1/M) Σ_j ½‖f_t(x_j) − y_j‖² from f_test and y_test
  (the L2 case of :func:`nsa_dist.losses.loss_value`, which the pipeline calls).
* :func:`predicted_update` — the first-order change of f in update t, aware of momentum:
  df̄_t = −(δ/N) G_t m_t − δ μ J_t b_{t−1} for GD with heavy-ball momentum μ (buffer b),
  J_t·Δθ_t otherwise (SGD, Adam, K > 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from nsa_dist.config import ExperimentSpec, OptimizerName
from nsa_dist.losses import loss_value
from nsa_dist.store.records import KernelExtras

if TYPE_CHECKING:
    import torch
    from torch import nn

    from nsa_dist.data import Dataset
    from nsa_dist.pipeline.checkpoint import Checkpoint
    from nsa_dist.pipeline.plan import RunPlan

__all__ = ["full_kernel_top", "per_class_top", "held_out_loss", "predicted_update", "residual_projections",
           "StepExtras"]


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


def per_class_top(model: "nn.Module", X: "torch.Tensor", k: int, *, dtype: "torch.dtype | None" = None,
                  block_size: int | None = None, tol: float = 1e-10) -> np.ndarray:
    """Top k eigenvalues of each diagonal block Θ_aa = J_a J_aᵀ of the full NTK (per-class spectra).

    Θ_aa is the kernel of output a alone (class a for one-hot targets); Σ_a Θ_aa is the traced
    Gram G.  Each block is an operator built on the full kernel's products (never dense).

    Returns:
        (K, k) float64, each row descending.
    """
    from nsa_dist.linalg import top_eigenpairs
    from nsa_dist.ntk import ntk_operator

    full = ntk_operator(model, X, kernel="full", block_size=block_size, dtype=dtype)
    K = full.shape[0] // X.shape[0]
    if not 1 <= k <= X.shape[0]:
        raise ValueError(f"k={k} outside 1..N={X.shape[0]}")
    return np.stack([top_eigenpairs(_Block(full, a, K), k, "auto", tol=tol).evals for a in range(K)])


def full_kernel_top(model: "nn.Module", X: "torch.Tensor", k: int, *, dtype: "torch.dtype | None" = None,
                    block_size: int | None = None, tol: float = 1e-10) -> np.ndarray:
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
    from nsa_dist.linalg import top_eigenpairs
    from nsa_dist.ntk import ntk_operator

    op = ntk_operator(model, X, kernel="full", block_size=block_size, dtype=dtype)  # (N·K, N·K)
    if not 1 <= k <= op.shape[0]:
        raise ValueError(f"k={k} outside 1..N·K={op.shape[0]}")
    return np.asarray(top_eigenpairs(op, k, "auto", tol=tol).evals, dtype=np.float64)


def held_out_loss(f_test: np.ndarray, y_test: np.ndarray) -> float:
    """L_test = (1/M) Σ_j ½‖f(x_j) − y_j‖² at the M test points (NaN when M = 0).

    Args:
        f_test: (M,) or (M, K) outputs.
        y_test: same shape, targets.
    """
    f, y = np.asarray(f_test, np.float64), np.asarray(y_test, np.float64)
    if f.shape != y.shape:
        raise ValueError(f"f_test {f.shape} and y_test {y.shape} differ in shape")
    if f.shape[0] == 0:
        return float("nan")
    r = (f - y).reshape(f.shape[0], -1)  # (M, K)
    return float(0.5 * np.mean(np.sum(r**2, axis=1)))


def residual_projections(evecs: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """p_i = Σ_c ⟨v_i, m_c⟩² for i = 1..K (NSA Fig. 4a), so Fig. 4a needs no stored eigenvectors.

    Args:
        evecs: (N, K) eigenvectors of G_t.
        residual: m_t, (N,) or (N, Ko).

    Returns:
        (K,) float64; Σ_{i≤k} p_i / ‖m‖² is E_t(m_t, k).
    """
    m = np.asarray(residual, np.float64).reshape(evecs.shape[0], -1)  # (N, Ko)
    return np.sum((np.asarray(evecs, np.float64).T @ m) ** 2, axis=1)  # (K,)


def predicted_update(spec: ExperimentSpec, ck: "Checkpoint", residual: np.ndarray,
                     G_times: Callable[[np.ndarray], np.ndarray],
                     J_times: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """First-order change df̄_t of the training outputs in update t (NSA Eq. 3, with momentum).

    GD (full batch, one output): Δθ_t = −δ (μ b_{t−1} + g_t) with g_t = (1/N) Jᵀ m_t and the
    heavy-ball buffer b_{t−1} (PyTorch SGD, dampening 0; b = 0 before the first update), so

        df̄_t = J Δθ_t = −(δ/N) G_t m_t − δ μ J_t b_{t−1}.

    μ = 0 gives the paper's −(δ/N) G m.  Other optimizers (minibatch SGD, Adam) and K > 1 use
    the actual update, J_t Δθ_t.

    Args:
        spec: the run's spec (optimizer, momentum).
        ck: the checkpoint of step t (lr, dtheta, state.slots[0] = b_{t−1}).
        residual: m_t = f_t − y, (N,) or (N, K).
        G_times: v (N,) ↦ G_t v.
        J_times: u (P,) ↦ J_t u, (N,) or (N, K).

    Returns:
        (N,) or (N, K) float64.
    """
    opt = spec.optimizer
    if OptimizerName(opt.name) is not OptimizerName.GD or residual.ndim != 1:
        return np.asarray(J_times(ck.dtheta), np.float64)
    N = residual.shape[0]
    pred = -(ck.lr / N) * np.asarray(G_times(np.asarray(residual, np.float64)), np.float64)  # (N,)
    slots = np.asarray(ck.state.slots)
    if opt.momentum > 0 and slots.shape[0] and np.any(slots[0]):
        pred = pred - ck.lr * opt.momentum * np.asarray(J_times(slots[0]), np.float64)
    return pred


class StepExtras:
    """The issue-11 quantities of one recorded step (:class:`~nsa_dist.store.records.KernelExtras`):
    Fig. 4a's projections always, the test loss with test points, the full-kernel and per-class
    eigenvalues of a multi-output network."""

    def __init__(self, plan: "RunPlan", data: "Dataset") -> None:
        self.plan, self.spec, self.data, self.dtype = plan, plan.spec, data, plan.torch_dtype

    def analyze(self, model: "nn.Module", X: "torch.Tensor", ck: "Checkpoint", residual_proj: np.ndarray,
                residual: np.ndarray) -> KernelExtras:
        """``residual_proj``: (K, Ko) = Vᵀ m_t, the residual's coordinates in G_t's top-K eigenvectors
        (what :func:`residual_projections` squares and sums over the outputs)."""
        out: dict[str, Any] = {"projections_residual": np.sum(np.asarray(residual_proj, np.float64) ** 2, axis=1)}
        has, D, block = self.plan.has, self.plan.dims, self.spec.spectrum.block_size
        if has("loss_test"):
            out["loss_test"] = loss_value(self.spec, self.data, ck.f_test, test=True)
        if has("eigenvalues_full"):
            out["eigenvalues_full"] = full_kernel_top(model, X, D.k_full, dtype=self.dtype, block_size=block)
        if has("eigenvalues_per_class"):
            out["eigenvalues_per_class"] = per_class_top(model, X, D.k_class, dtype=self.dtype, block_size=block)
        return KernelExtras(**out)
