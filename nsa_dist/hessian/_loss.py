"""The loss C(f) = (1/N) Σ_i c(f_i, y_i) and its curvature in output space (private).

The loss is a :class:`~nsa_dist.config.LossName` (l2, the Hessian paper's MSE ``c = ½‖f − y‖²``,
``HC = Id``; or cross_entropy ``c = −Σ_k y_k log softmax(f)_k``, ``HC_i = diag p − p pᵀ``, K ≥ 2);
its gradient ``∇_f c`` is :func:`nsa_dist.losses.residual`.  Every function here works on one
block of outputs ``F (b, K)`` and targets ``Y (b, K)`` and returns *sums* over the block (no
1/N): the operators divide by the full N once.
"""

from __future__ import annotations

import numpy as np
import torch

from nsa_dist._checks import check_finite
from nsa_dist.config import LossName
from nsa_dist.errors import ShapeError

__all__ = ["prepare_targets", "loss_sum", "loss_curvature", "curvature_sqrt"]


def prepare_targets(
    Y: object, loss: LossName, N: int, K: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Targets as a (N, K) float tensor: MSE values, or one-hot / probability rows for cross-entropy.

    Raises:
        ShapeError: Y's shape does not fit N points and K outputs (or K = 1 for cross-entropy).
        ValueError: class indices outside 0..K−1, negative cross-entropy targets.
        TypeError: complex targets.
        NonFiniteError: NaN/inf targets.
    """
    Yt = Y if isinstance(Y, torch.Tensor) else torch.as_tensor(np.asarray(Y))
    if Yt.ndim not in (1, 2) or Yt.shape[0] != N:
        raise ShapeError(f"Y must have shape (N,) or (N, K) with N = {N} points (the rows of X); got {tuple(Yt.shape)}")
    check_finite("Y", Yt)
    if Yt.is_complex():  # (its imaginary part was dropped with a torch warning only: an audit)
        raise TypeError(f"Y must be real; got dtype {Yt.dtype}")
    if loss is LossName.CROSS_ENTROPY:
        if K < 2:
            raise ShapeError(f"loss='cross_entropy' needs a model with K >= 2 outputs (logits); this one has K = {K}")
        if Yt.ndim == 1:
            if Yt.is_floating_point() or Yt.is_complex():
                raise ShapeError(
                    "cross_entropy targets of shape (N,) must be integer class indices; "
                    f"got dtype {Yt.dtype} (pass one-hot rows (N, K) for float targets)"
                )
            if int(Yt.min()) < 0 or int(Yt.max()) >= K:
                raise ValueError(f"class indices in Y must lie in 0..{K - 1}; got {int(Yt.min())}..{int(Yt.max())}")
            return torch.nn.functional.one_hot(Yt.long(), K).to(dtype=dtype, device=device)  # (N, K)
    elif Yt.ndim == 1:
        if K != 1:
            raise ShapeError(
                f"Y of shape {tuple(Yt.shape)} fits a scalar-output model; this one has K = {K} "
                f"outputs, so Y must be (N, K) = ({N}, {K})"
            )
        Yt = Yt[:, None]
    if loss is LossName.CROSS_ENTROPY and Yt.dtype != torch.bool and bool((Yt < _rounding_below(Yt)).any()):
        # a negative weight makes HC indefinite: I, documented PSD, had a most negative entry −0.745 (an audit);
        # integer rows too, and a rounding's −1e-17 of a user's softmax is no negative weight (a review)
        raise ValueError(
            f"cross_entropy targets must be non-negative (one-hot or probability rows); Y has {int((Yt < 0).sum())} "
            f"negative entries (the smallest {float(Yt.min()):.3g})"
        )
    if Yt.shape[1] != K:
        hint = ""
        if loss is LossName.CROSS_ENTROPY and not (Yt.is_floating_point() or Yt.is_complex()):
            hint = f" (integer class indices go as shape (N,): Y.reshape(-1), or one-hot rows (N, {K}))"
        raise ShapeError(f"Y must have K = {K} columns (the model's outputs); got shape {tuple(Yt.shape)}{hint}")
    return Yt.to(dtype=dtype, device=device)


def _rounding_below(Y: torch.Tensor) -> float:
    """The most negative entry of targets that is rounding, not a weight: −16·eps·max(1, max|Y|) (0 for integers)."""
    if not Y.is_floating_point() or not Y.numel():
        return 0.0
    return -16 * float(torch.finfo(Y.dtype).eps) * max(1.0, float(Y.abs().max()))


def loss_sum(loss: LossName, F: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """``Σ_i c(F_i, Y_i)`` over the block; F, Y (b, K) → scalar."""
    if loss is LossName.L2:
        return 0.5 * ((F - Y) ** 2).sum()
    return -(Y * torch.log_softmax(F, dim=-1)).sum()


def loss_curvature(loss: LossName, F: torch.Tensor, Y: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """``HC_i U_i`` per row (``HC_i = ∇²_f c(F_i, Y_i)``); F, Y (b, K), U (..., b, K) → (..., b, K)."""
    if loss is LossName.L2:
        return U
    p = torch.softmax(F, dim=-1)  # (b, K)
    s = Y.sum(-1, keepdim=True)  # (b, 1): 1 for one-hot / probability rows
    return s * (p * U - p * (p * U).sum(-1, keepdim=True))


def curvature_sqrt(loss: LossName, F: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """``HC_i^{1/2}`` per row, (b, K, K) symmetric PSD (identity for MSE)."""
    b, K = F.shape
    if loss is LossName.L2:
        return torch.eye(K, dtype=F.dtype, device=F.device).expand(b, K, K)
    p = torch.softmax(F, dim=-1)  # (b, K)
    HC = Y.sum(-1)[:, None, None] * (torch.diag_embed(p) - p[:, :, None] * p[:, None, :])  # (b, K, K)
    evals, evecs = torch.linalg.eigh(HC)
    return (evecs * evals.clamp_min(0).sqrt()[:, None, :]) @ evecs.transpose(1, 2)
