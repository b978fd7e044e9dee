"""Per-step quantities beyond the traced spectrum, kept out of ``spectral.py``.

* :class:`StepExtras` — the step's :class:`~nsa_dist.store.records.KernelExtras`: Fig. 4a's
  projections, the test loss (:func:`nsa_dist.losses.loss_value`), the full-kernel and per-class
  eigenvalues of a K-output network (:mod:`nsa_dist.ntk.kernel_spectra`).
* :func:`predicted_update` — the first-order change of f in update t, aware of momentum:
  df̄_t = −(δ/N) G_t m_t − δ μ J_t b_{t−1} for GD with heavy-ball momentum μ (buffer b),
  J_t·Δθ_t otherwise (SGD, Adam, K > 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from nsa_dist.config import ExperimentSpec, OptimizerName
from nsa_dist.losses import loss_value
from nsa_dist.ntk.kernel_spectra import full_kernel_top, per_class_top
from nsa_dist.store.records import KernelExtras

if TYPE_CHECKING:
    import torch
    from torch import nn

    from nsa_dist.data import Dataset
    from nsa_dist.pipeline.checkpoint import Checkpoint
    from nsa_dist.pipeline.plan import RunPlan

__all__ = ["predicted_update", "StepExtras"]


def predicted_update(
    spec: ExperimentSpec,
    ck: Checkpoint,
    residual: np.ndarray,
    G_times: Callable[[np.ndarray], np.ndarray],
    J_times: Callable[[np.ndarray], np.ndarray],
) -> np.ndarray:
    """First-order change df̄_t of the training outputs in update t (NSA Eq. 3, with momentum).

    GD (full batch, one output): Δθ_t = −δ (μ b_{t−1} + g_t) with g_t = (1/N) Jᵀ m_t and the
    heavy-ball buffer b_{t−1} (PyTorch SGD, dampening 0; b = 0 before the first update), so

        df̄_t = J Δθ_t = −(δ/N) G_t m_t − δ μ J_t b_{t−1}.

    μ = 0 gives the paper's −(δ/N) G m.  Other optimizers (minibatch SGD, Adam), K > 1 and a step
    without one learning rate (δ_t NaN: a Tracker's step whose update was not GD at one rate) use
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
    if OptimizerName(opt.name) is not OptimizerName.GD or residual.ndim != 1 or not np.isfinite(ck.lr):
        return np.asarray(J_times(ck.dtheta), np.float64)
    N = residual.shape[0]
    pred = -(ck.lr / N) * np.asarray(G_times(np.asarray(residual, np.float64)), np.float64)  # (N,)
    slots = np.asarray(ck.state.slots)
    if opt.momentum > 0 and slots.shape[0] and np.any(slots[0]):
        pred = pred - ck.lr * opt.momentum * np.asarray(J_times(slots[0]), np.float64)
    return pred


class StepExtras:
    """The quantities beyond the traced spectrum of one recorded step
    (:class:`~nsa_dist.store.records.KernelExtras`): Fig. 4a's projections always, the test loss
    with test points, the full-kernel and per-class eigenvalues of a multi-output network."""

    def __init__(self, plan: RunPlan, data: Dataset) -> None:
        self.plan, self.spec, self.data, self.dtype = plan, plan.spec, data, plan.torch_dtype

    def analyze(
        self, model: nn.Module, X: torch.Tensor, ck: Checkpoint, residual_proj: np.ndarray, residual: np.ndarray
    ) -> KernelExtras:
        """``residual_proj``: (K, Ko) = Vᵀ m_t, the residual's coordinates in G_t's top-K eigenvectors
        (squared and summed over the outputs: Fig. 4a's p_i = Σ_c ⟨v_i, m_c⟩²)."""
        out: dict[str, Any] = {"projections_residual": np.sum(np.asarray(residual_proj, np.float64) ** 2, axis=1)}
        has, D, block = self.plan.has, self.plan.dims, self.spec.spectrum.block_size
        if has("loss_test"):
            out["loss_test"] = loss_value(self.spec, self.data, ck.f_test, test=True)
        if has("eigenvalues_full"):
            out["eigenvalues_full"] = full_kernel_top(model, X, D.k_full, dtype=self.dtype, block_size=block)
        if has("eigenvalues_per_class"):
            out["eigenvalues_per_class"] = per_class_top(model, X, D.k_class, dtype=self.dtype, block_size=block)
        return KernelExtras(**out)
