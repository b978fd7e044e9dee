"""Speed of information flow along each eigenvector and the GD stability bound (NSA §4, Figs. 1e, 2c-d)."""

from __future__ import annotations

from typing import Any

import numpy as np

from nsa_dist.errors import NonFiniteError, ShapeError
from nsa_dist.metrics._validate import as_real, count

__all__ = ["lr_eigen_product", "flow_speed", "stability_bound"]


def _lr_array(lr: Any, evals: np.ndarray) -> np.ndarray:
    """``lr`` as a finite array of values > 0 that broadcasts against ``evals``."""
    lr = as_real("lr", lr, (0, 1, 2)).astype(np.float64)
    if np.any(lr <= 0):
        raise ValueError(f"lr must be > 0, got min(lr) = {lr.min()}")
    if 0 < lr.ndim < evals.ndim:
        # NumPy would align a (T,) δ_t with the LAST axis of (T, K) eigenvalues (the eigenvalue
        # index): silently δ_k λ_tk/N when T == K.  A learning rate is per step, never per eigenvalue.
        raise ShapeError(
            f"lr of shape {lr.shape} against evals of shape {evals.shape} is ambiguous: "
            "pass a scalar, or lr with as many dimensions as evals (e.g. lr[:, None] for evals (T, K))"
        )
    try:
        np.broadcast_shapes(lr.shape, evals.shape)
    except ValueError:
        raise ShapeError(
            f"lr of shape {lr.shape} does not broadcast against evals of shape "
            f"{evals.shape}; pass a scalar, or e.g. lr[:, None] for evals (T, K)"
        ) from None
    return lr


def lr_eigen_product(evals: Any, lr: Any, N: int) -> np.ndarray:
    """δλ_i/N, the step of GD along eigenvector v_i in units of its eigenvalue (NSA Fig. 2d).

    Eq. (5) contracts the residual along v_i by the factor 1 − δλ_i/N per step.

    Args:
        evals: float array of eigenvalues λ_i of G_t, any shape — (K,), or (T, K) over time.
        lr: learning rate δ > 0: a scalar, or an array broadcasting against ``evals``
            (e.g. δ_t of shape (T, 1) for ``evals`` of shape (T, K)).
        N: number of training points (G_t is N × N), N >= 1.

    Returns:
        float64 array of the broadcast shape of ``evals`` and ``lr``.

    Raises:
        ShapeError: ``lr`` does not broadcast against ``evals``, has fewer dimensions than a
            non-scalar ``evals`` without being a scalar (δ_t (T,) for (T, K) eigenvalues: pass
            ``lr[:, None]``), or N < 1.
        NonFiniteError: NaN/inf input.
        ValueError: an ``lr`` <= 0.
        TypeError: a non-real dtype, or N not an integer.
    """
    evals = as_real("evals", evals, (0, 1, 2, 3)).astype(np.float64)
    lr = _lr_array(lr, evals)
    return lr * evals / count("N", N, 1)


def flow_speed(evals: Any, lr: Any, N: int) -> np.ndarray:
    """Information-flow speed s_i = 1 − |1 − δλ_i/N| along each eigenvector (NSA §4, Fig. 2c).

    s_i = 1 at δλ_i/N = 1 (the residual along v_i vanishes in one step); s_i = 0 at λ_i = 0 and
    at δλ_i/N = 2 (the stability edge); s_i < 0 means GD diverges along v_i.

    Args:
        evals: float array of eigenvalues λ_i of G_t, any shape — (K,), or (T, K) over time.
        lr: learning rate δ > 0, scalar or broadcasting against ``evals``.
        N: number of training points, N >= 1.

    Returns:
        float64 array of the broadcast shape of ``evals`` and ``lr``.

    Raises:
        Same as :func:`lr_eigen_product`.
    """
    return 1.0 - np.abs(1.0 - lr_eigen_product(evals, lr, N))


def stability_bound(evals_max: Any, N: int) -> np.ndarray | float:
    """Largest stable learning rate 2N/λ_max of GD on the L2 loss (NSA §4, Fig. 1e).

    GD with constant G_t converges along every v_i iff δ < 2N/λ_max (Eqs. 4–5).

    Args:
        evals_max: λ_max^t > 0, a scalar or an array (e.g. (T,) along training).
        N: number of training points, N >= 1.

    Returns:
        2N/λ_max: a float for a scalar ``evals_max``, else a float64 array of its shape.

    Raises:
        NonFiniteError: NaN/inf input, or λ_max = 0 (the bound is infinite).
        ValueError: a negative λ_max (a Gramian is positive semi-definite).
        ShapeError: N < 1.
        TypeError: a non-real dtype, or N not an integer.
    """
    lam = as_real("evals_max", evals_max, (0, 1, 2)).astype(np.float64)
    N = count("N", N, 1)
    if np.any(lam < 0):
        raise ValueError(f"evals_max must be >= 0 (a Gramian is PSD), got min = {lam.min()}")
    if np.any(lam == 0):
        raise NonFiniteError(f"evals_max holds {int(np.sum(lam == 0))} zero(s): 2N/λ_max is infinite")
    bound = 2.0 * N / lam
    return float(bound) if bound.ndim == 0 else bound
