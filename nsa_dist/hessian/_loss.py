"""The loss C(f) = (1/N) Σ_i c(f_i, y_i), its gradient and curvature in output space (private).

Every function here works on one block of outputs ``F (b, K)`` and targets ``Y (b, K)`` and
returns *sums* over the block (no 1/N): the operators divide by the full N once.
"""

from __future__ import annotations

from enum import Enum

import numpy as np
import torch

from nsa_dist._checks import check_finite
from nsa_dist.errors import ShapeError

__all__ = ["Loss", "parse_loss", "prepare_targets", "loss_sum", "loss_gradient", "loss_curvature", "curvature_sqrt"]


class Loss(str, Enum):
    """The loss whose Hessian is taken, ``C(θ) = (1/N) Σ_i c(f(x_i; θ), y_i)``.

    MSE: ``c = ½‖f − y‖²``, so ``∇_f c = f − y`` and the curvature ``HC = Id / N`` (the Hessian
        paper's ``C(Y) = (1/2N)‖Y − Y*‖²``; the same loss as the NSA paper's "l2").
    CROSS_ENTROPY: ``c = −Σ_k y_k log softmax(f)_k`` with y class indices (N,) or one-hot /
        probability rows (N, K), so ``∇_f c = p − y`` and ``HC_i = (diag p − p pᵀ) / N``
        (p = softmax f_i); needs K ≥ 2 outputs.
    """

    MSE = "mse"
    CROSS_ENTROPY = "cross_entropy"


def parse_loss(value: object) -> Loss:
    """``Loss(value)``, accepting the config's ``"l2"`` as MSE; else a ValueError naming the allowed values."""
    if getattr(value, "value", value) == "l2":
        return Loss.MSE
    try:
        return Loss(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in Loss)
        raise ValueError(f"loss={value!r} is not one of {allowed} (or 'l2', an alias of 'mse')") from None


def prepare_targets(Y: object, loss: Loss, N: int, K: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Targets as a (N, K) float tensor: MSE values, or one-hot / probability rows for cross-entropy.

    Raises:
        ShapeError: Y's shape does not fit N points and K outputs (or K = 1 for cross-entropy).
        ValueError: class indices outside 0..K−1.
        NonFiniteError: NaN/inf targets.
    """
    Yt = Y if isinstance(Y, torch.Tensor) else torch.as_tensor(np.asarray(Y))
    if Yt.ndim not in (1, 2) or Yt.shape[0] != N:
        raise ShapeError(f"Y must have shape (N,) or (N, K) with N = {N} points (the rows of X); got {tuple(Yt.shape)}")
    check_finite("Y", Yt)
    if loss is Loss.CROSS_ENTROPY:
        if K < 2:
            raise ShapeError(f"loss='cross_entropy' needs a model with K >= 2 outputs (logits); this one has K = {K}")
        if Yt.ndim == 1:
            if Yt.is_floating_point() or Yt.is_complex():
                raise ShapeError("cross_entropy targets of shape (N,) must be integer class indices; "
                                 f"got dtype {Yt.dtype} (pass one-hot rows (N, K) for float targets)")
            if int(Yt.min()) < 0 or int(Yt.max()) >= K:
                raise ValueError(f"class indices in Y must lie in 0..{K - 1}; got {int(Yt.min())}..{int(Yt.max())}")
            return torch.nn.functional.one_hot(Yt.long(), K).to(dtype=dtype, device=device)  # (N, K)
    elif Yt.ndim == 1:
        if K != 1:
            raise ShapeError(f"Y of shape {tuple(Yt.shape)} fits a scalar-output model; this one has K = {K} "
                             f"outputs, so Y must be (N, K) = ({N}, {K})")
        Yt = Yt[:, None]
    if Yt.shape[1] != K:
        raise ShapeError(f"Y must have K = {K} columns (the model's outputs); got shape {tuple(Yt.shape)}")
    return Yt.to(dtype=dtype, device=device)


def loss_sum(loss: Loss, F: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """``Σ_i c(F_i, Y_i)`` over the block; F, Y (b, K) → scalar."""
    if loss is Loss.MSE:
        return 0.5 * ((F - Y) ** 2).sum()
    return -(Y * torch.log_softmax(F, dim=-1)).sum()


def loss_gradient(loss: Loss, F: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """``∇_f c(F_i, Y_i)`` per row; (b, K)."""
    if loss is Loss.MSE:
        return F - Y
    return torch.softmax(F, dim=-1) * Y.sum(-1, keepdim=True) - Y


def loss_curvature(loss: Loss, F: torch.Tensor, Y: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """``HC_i U_i`` per row (``HC_i = ∇²_f c(F_i, Y_i)``); F, Y (b, K), U (..., b, K) → (..., b, K)."""
    if loss is Loss.MSE:
        return U
    p = torch.softmax(F, dim=-1)  # (b, K)
    s = Y.sum(-1, keepdim=True)  # (b, 1): 1 for one-hot / probability rows
    return s * (p * U - p * (p * U).sum(-1, keepdim=True))


def curvature_sqrt(loss: Loss, F: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """``HC_i^{1/2}`` per row, (b, K, K) symmetric PSD (identity for MSE)."""
    b, K = F.shape
    if loss is Loss.MSE:
        return torch.eye(K, dtype=F.dtype, device=F.device).expand(b, K, K)
    p = torch.softmax(F, dim=-1)  # (b, K)
    HC = Y.sum(-1)[:, None, None] * (torch.diag_embed(p) - p[:, :, None] * p[:, None, :])  # (b, K, K)
    evals, evecs = torch.linalg.eigh(HC)
    return (evecs * evals.clamp_min(0).sqrt()[:, None, :]) @ evecs.transpose(1, 2)
