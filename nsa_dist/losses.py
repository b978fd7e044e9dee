"""The training losses and their functional derivatives m = ∂ℓ/∂f at the training points (NSA Eq. 3).

L = (1/N) Σ_i ℓ(f_i), so GD moves the outputs by df̄ = −(δ/N) G m to first order for every loss:
m̄_t "is a functional derivative of any considered loss" (NSA §3).

* L2: ℓ_i = ½‖f_i − y_i‖², m_i = f_i − y_i.
* Cross-entropy: ℓ_i = −Σ_k y_ik log softmax(f_i)_k, m_i = softmax(f_i)·Σ_k y_ik − y_i
  (= softmax(f_i) − y_i on one-hot rows).
* NCE: ℓ_i = −[c_i log σ(h_i) + (1 − c_i) log(1 − σ(h_i))], h_i = f_i − log(ν q(x_i)),
  m_i = σ(h_i) − c_i (c: 1 data, 0 noise; see :mod:`nsa_dist.data.density`).

The loss names are :class:`~nsa_dist.config.LossName` (the spec's); :func:`residual` is the one
formula of m that the spectral pipeline, the client and the loss Hessian (``∇_f c``) use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from nsa_dist.config import ExperimentSpec, LossName

if TYPE_CHECKING:
    from nsa_dist.data import Dataset

__all__ = [
    "parse_loss",
    "is_nce",
    "is_cross_entropy",
    "nce_loss",
    "nce_residual",
    "cross_entropy_loss",
    "softmax",
    "residual",
    "training_residual",
    "loss_value",
]

Array = TypeVar("Array", np.ndarray, torch.Tensor)


def parse_loss(value: object) -> LossName:
    """The loss of a model measured outside a spec (the Tracker, :mod:`nsa_dist.hessian`).

    "l2" — also called "mse", the Hessian paper's name — or "cross_entropy"; NCE needs a density
    dataset's noise points, so only a spec names it.

    Args:
        value: a :class:`~nsa_dist.config.LossName` or its value, or "mse".

    Returns:
        ``LossName.L2`` or ``LossName.CROSS_ENTROPY``.

    Raises:
        ValueError: any other value (one line naming the allowed ones).
    """
    v = getattr(value, "value", value)
    if v in ("mse", LossName.L2.value):
        return LossName.L2
    if v == LossName.CROSS_ENTROPY.value:
        return LossName.CROSS_ENTROPY
    raise ValueError(f"loss={v!r} is not one of 'mse', 'cross_entropy' (or 'l2', an alias of 'mse')")


def is_nce(spec: ExperimentSpec) -> bool:
    return LossName(spec.loss) is LossName.NCE


def is_cross_entropy(spec: ExperimentSpec) -> bool:
    return LossName(spec.loss) is LossName.CROSS_ENTROPY


def cross_entropy_loss(f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(1/N) Σ_i −Σ_k y_ik log softmax(f_i)_k; f, y (N, K)."""
    return -(y * torch.log_softmax(f, dim=-1)).sum(-1).mean()


def softmax(f: np.ndarray) -> np.ndarray:
    """Row-wise softmax of (N, K) logits, float64, overflow-free."""
    z = np.asarray(f, np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def nce_loss(f: torch.Tensor, label: torch.Tensor, log_noise: torch.Tensor) -> torch.Tensor:
    """(1/N) Σ_i ℓ_i of NCE (module docstring); f, label, log_noise (N,)."""
    return F.binary_cross_entropy_with_logits(f - log_noise, label, reduction="mean")


def nce_residual(f: np.ndarray, label: np.ndarray, log_noise: np.ndarray) -> np.ndarray:
    """m_i = ∂ℓ_i/∂f_i = σ(f_i − log(ν q_i)) − c_i, (N,) float64."""
    h = np.asarray(f, np.float64) - np.asarray(log_noise, np.float64)
    return 0.5 * (1.0 + np.tanh(0.5 * h)) - np.asarray(label, np.float64)  # σ(h), overflow-free


def residual(loss: LossName | str, f: Array, y: Array, *, log_noise: np.ndarray | None = None) -> Array:
    """m_i = ∂ℓ_i/∂f_i row by row (NSA Eq. 3; the Hessian paper's ∇_f c_i).

    l2: m = f − y.  cross_entropy: m = softmax(f)·Σ_k y_k − y, the gradient of
    −Σ_k y_k log softmax(f)_k (softmax(f) − y on one-hot rows).  nce: m = σ(f − log(ν q)) − c with
    ``y`` the labels c and ``log_noise`` = log(ν q).

    Args:
        loss: a :class:`~nsa_dist.config.LossName` or its value, or "mse" (= "l2").
        f: outputs (N,) or (N, K) — a NumPy array (any real dtype) or a torch tensor.
        y: targets of f's shape (one-hot or probability rows for cross_entropy; nce: labels (N,)).
        log_noise: nce only: log(ν q(x_i)), (N,).

    Returns:
        m of f's shape: float64 NumPy for NumPy ``f``; for a tensor ``f``, a tensor of its dtype
        and device (``y`` a tensor like it).

    Raises:
        ValueError: an unknown loss, or nce without ``log_noise`` or with tensors.
    """
    # "mse" too, as the Hessian API takes it (its residuals for trace_S_from_G were refused by name: an audit)
    loss = LossName.L2 if loss == "mse" else LossName(loss)
    is_tensor = isinstance(f, torch.Tensor)
    if loss is LossName.NCE:
        if log_noise is None or is_tensor:
            raise ValueError("residual: loss='nce' needs NumPy outputs, the labels c as y and log_noise = log(ν q)")
        return nce_residual(f, y, log_noise)
    if not is_tensor:
        f, y = np.asarray(f, np.float64), np.asarray(y, np.float64)
    if loss is LossName.CROSS_ENTROPY:
        p = torch.softmax(f, dim=-1) if is_tensor else softmax(f)  # (N, K)
        return p * y.sum(-1, keepdims=True) - y
    return f - y


def training_residual(spec: ExperimentSpec, data: Dataset, f: np.ndarray) -> np.ndarray:
    """m_t at the training points of ``data``: :func:`residual` with the run's loss, f's shape, float64."""
    if is_nce(spec):
        return residual(LossName.NCE, f, data.extra["label"], log_noise=data.extra["log_noise"])
    return residual(spec.loss, f, data.y)


def loss_value(spec: ExperimentSpec, data: Dataset, f: np.ndarray, test: bool = False) -> float:
    """L at the training (or test) points from the outputs f, float64; NaN with no points."""
    y = data.y_test if test else data.y
    if np.asarray(f).shape[0] == 0:
        return float("nan")
    if is_nce(spec):
        tag = "_test" if test else ""
        lab = torch.as_tensor(data.extra["label" + tag], dtype=torch.float64)
        ln = torch.as_tensor(data.extra["log_noise" + tag], dtype=torch.float64)
        return float(nce_loss(torch.as_tensor(np.asarray(f), dtype=torch.float64), lab, ln))
    if is_cross_entropy(spec):
        return float(
            cross_entropy_loss(
                torch.as_tensor(np.asarray(f), dtype=torch.float64), torch.as_tensor(np.asarray(y), dtype=torch.float64)
            )
        )
    r = (np.asarray(f, np.float64) - np.asarray(y, np.float64)).reshape(len(y), -1)
    return float(0.5 * np.mean(np.sum(r**2, axis=1)))
