"""The training losses and their functional derivatives m = ∂ℓ/∂f at the training points (NSA Eq. 3).

L = (1/N) Σ_i ℓ(f_i), so GD moves the outputs by df̄ = −(δ/N) G m to first order for every loss:
m̄_t "is a functional derivative of any considered loss" (NSA §3).

* L2: ℓ_i = ½‖f_i − y_i‖², m_i = f_i − y_i.
* Cross-entropy: ℓ_i = −Σ_k y_ik log softmax(f_i)_k, m_i = softmax(f_i) − y_i (y one-hot rows).
* NCE: ℓ_i = −[c_i log σ(h_i) + (1 − c_i) log(1 − σ(h_i))], h_i = f_i − log(ν q(x_i)),
  m_i = σ(h_i) − c_i (c: 1 data, 0 noise; see :mod:`nsa_dist.data.density`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from nsa_dist.config import ExperimentSpec, LossName

if TYPE_CHECKING:
    from nsa_dist.data import Dataset

__all__ = ["is_nce", "is_cross_entropy", "nce_loss", "nce_residual", "cross_entropy_loss", "softmax", "residual",
           "loss_value"]


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


def residual(spec: ExperimentSpec, data: "Dataset", f: np.ndarray) -> np.ndarray:
    """m_t at the training points: f − y (L2), softmax(f) − y (cross-entropy) or the NCE derivative,
    shape of f, float64."""
    if is_nce(spec):
        return nce_residual(f, data.extra["label"], data.extra["log_noise"])
    if is_cross_entropy(spec):
        return softmax(f) - np.asarray(data.y, np.float64)
    return np.asarray(f, np.float64) - np.asarray(data.y, np.float64)


def loss_value(spec: ExperimentSpec, data: "Dataset", f: np.ndarray, test: bool = False) -> float:
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
        return float(cross_entropy_loss(torch.as_tensor(np.asarray(f), dtype=torch.float64),
                                        torch.as_tensor(np.asarray(y), dtype=torch.float64)))
    r = (np.asarray(f, np.float64) - np.asarray(y, np.float64)).reshape(len(y), -1)
    return float(0.5 * np.mean(np.sum(r**2, axis=1)))
