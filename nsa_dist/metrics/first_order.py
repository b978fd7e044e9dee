"""First-order (NTK) prediction of one GD step and how well it matches the real step (Eq. 3, Fig. 1d)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from nsa_dist.errors import ShapeError
from nsa_dist.metrics._validate import as_real, check_rows, nonzero_norms, positive_scalar, work_dtype

__all__ = ["first_order_update", "first_order_accuracy", "FirstOrderAccuracy"]


class FirstOrderAccuracy(NamedTuple):
    """How well df̄_t = −(δ/N) G_t m̄_t predicts the real change df̃_t (NSA Fig. 1d)."""

    error: float
    """‖df̃_t − df̄_t‖ / ‖df̃_t‖, relative to the REAL change df̃_t."""
    cos_alpha: float
    """cos α_t = ⟨df̃_t, df̄_t⟩ / (‖df̃_t‖ ‖df̄_t‖)."""


def first_order_update(G: Any, residual: Any, lr: float) -> np.ndarray:
    """First-order change of the outputs in one GD step, df̄_t = −(δ/N) G_t m̄_t (NSA Eq. 3).

    With G of shape (P, N) = g_t(X, 𝒳) at P other points this is the change at those points
    (Eq. 3 left, Eq. 17); N is always the number of training points, ``residual.shape[0]``.

    Args:
        G: (N, N) Gramian G_t, or (P, N) kernel rows g_t(X, 𝒳).
        residual: m̄_t = ℓ'(f_t(X^i)) at the N training points (f̄_t − ȳ for L2): (N,) or (N, M).
        lr: learning rate δ > 0.

    Returns:
        (P,) or (P, M) array in the inputs' dtype (float32 if both are float32, else float64).

    Raises:
        ShapeError: G not 2-D, residual not 1-/2-D, or G.shape[1] != residual.shape[0].
        NonFiniteError: NaN/inf input.
        ValueError: lr <= 0.
        TypeError: a non-real dtype.
    """
    G = as_real("G", G, (2,))  # (P, N)
    m = as_real("residual", residual, (1, 2))  # (N,) or (N, M)
    check_rows("residual", m, "G", G, axis_b=1)
    lr = positive_scalar("lr", lr)
    dtype = work_dtype(G, m)
    N = m.shape[0]
    return (-(lr / N) * (G.astype(dtype, copy=False) @ m.astype(dtype, copy=False))).astype(dtype, copy=False)


def first_order_accuracy(df_real: Any, df_pred: Any) -> FirstOrderAccuracy:
    """Relative error and cosine between the real output change and its first-order prediction (Fig. 1d).

    error_t = ‖df̃_t − df̄_t‖ / ‖df̃_t‖ and cos α_t = ⟨df̃_t, df̄_t⟩ / (‖df̃_t‖ ‖df̄_t‖), where
    df̃_t = f̄_{t+1} − f̄_t is the REAL change and df̄_t the prediction of Eq. (3).

    Args:
        df_real: df̃_t, float array (N,) or (N, M) (flattened for the norms).
        df_pred: df̄_t from :func:`first_order_update`, same shape as ``df_real``.

    Returns:
        ``FirstOrderAccuracy(error, cos_alpha)`` (a NamedTuple of Python floats, float64 maths).

    Raises:
        ShapeError: shapes differ or are not 1-/2-D.
        NonFiniteError: NaN/inf input, or a zero vector (the ratio is x/0).
        TypeError: a non-real dtype.
    """
    real = as_real("df_real", df_real, (1, 2)).astype(np.float64)  # (N,) or (N, M)
    pred = as_real("df_pred", df_pred, (1, 2)).astype(np.float64)
    if real.shape != pred.shape:
        raise ShapeError(f"df_real has shape {real.shape} and df_pred has shape {pred.shape}; they must be equal")
    real, pred = real.ravel(), pred.ravel()
    norm_real, norm_pred = np.linalg.norm(real), np.linalg.norm(pred)
    nonzero_norms("df_real", np.asarray(norm_real), "the relative error ‖df̃ − df‖/‖df̃‖")
    nonzero_norms("df_pred", np.asarray(norm_pred), "cos α = ⟨df̃, df⟩/(‖df̃‖‖df‖)")
    error = np.linalg.norm(real - pred) / norm_real
    cos_alpha = float(real @ pred) / (norm_real * norm_pred)
    return FirstOrderAccuracy(float(error), float(cos_alpha))
