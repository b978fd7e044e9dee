"""Fourier transform of a function sampled at the data points (NSA App. G, Eq. 27)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from nsa_dist.errors import ShapeError
from nsa_dist.metrics._validate import as_real, block_size, check_rows, count, positive_scalar

__all__ = ["fourier_transform", "frequency_grid", "FrequencyGrid"]


class FrequencyGrid(NamedTuple):
    """Frequencies ξ on a regular grid and the grid's shape, to draw |φ̂| as an image."""

    points: np.ndarray
    """(n**d, d) float64 frequencies, C order: ``values.reshape(shape)`` has axis j = ξ_j."""
    shape: tuple[int, ...]
    """(n,) * d."""


def frequency_grid(limit: float = 40.0, n: int = 81, d: int = 2) -> FrequencyGrid:
    """The grid [−limit, limit]^d with n points per axis used for the images of NSA App. G.

    The default is the paper's [−40, 40]² with 81² integer frequencies (spacing 2·limit/(n−1)).

    Args:
        limit: half-width of the grid, > 0.
        n: points per axis, >= 2.
        d: input dimension, >= 1.

    Returns:
        ``FrequencyGrid(points, shape)``: points (n**d, d) float64, shape (n,) * d.

    Raises:
        ValueError: limit not a finite number > 0.
        ShapeError: n < 2 or d < 1.
        TypeError: n or d not an integer.
    """
    limit, n, d = positive_scalar("limit", limit), count("n", n, 2), count("d", d, 1)
    axis = np.linspace(-limit, limit, n)  # (n,)
    mesh = np.meshgrid(*([axis] * d), indexing="ij")  # d arrays of shape (n,)*d
    return FrequencyGrid(np.stack([g.ravel() for g in mesh], axis=1), (n,) * d)


def fourier_transform(phi: Any, X: Any, freqs: Any) -> np.ndarray:
    """φ̂(ξ) = (1/N) Σ_k φ(X^k) exp(−2πi⟨ξ, X^k⟩) at each frequency ξ (NSA App. G, Eq. 27).

    The Monte-Carlo transform of φ w.r.t. the data density P(X).  Computed in float64 over
    blocks of frequencies, each (block, N) with ~2**21 entries (16 MiB per float64 array), so
    N = 10,000 points and 81² frequencies never hold an (F, N) matrix.

    Args:
        phi: φ̄, values at the N points: (N,) (an eigenvector v_i, the residual m̄_t, ...) or (N, M).
        X: (N, d) the points X^k.
        freqs: (F, d) frequencies ξ (e.g. ``frequency_grid().points``); (d,) for one
            frequency, except for d = 1 where a 1-D array holds F frequencies.

    Returns:
        complex128 array (F,) or (F, M); draw ``np.abs(out).reshape(grid.shape)``.

    Raises:
        ShapeError: X not (N, d), phi not (N,) / (N, M), or freqs without d columns.
        NonFiniteError: NaN/inf input.
        TypeError: a non-real dtype.
    """
    phi = as_real("phi", phi, (1, 2)).astype(np.float64)  # (N,) or (N, M)
    X = as_real("X", X, (2,)).astype(np.float64)  # (N, d)
    xi = as_real("freqs", freqs, (1, 2)).astype(np.float64)
    check_rows("phi", phi, "X", X)
    if xi.ndim == 1:
        xi = xi[:, None] if X.shape[1] == 1 else xi[None, :]  # (F, d)
    if xi.shape[1] != X.shape[1]:
        raise ShapeError(f"freqs has shape {np.shape(freqs)} but X has shape {X.shape}: "
                         f"each frequency must have d = {X.shape[1]} entries")
    N, B = X.shape[0], block_size(X.shape[0])
    out = np.empty((xi.shape[0],) + phi.shape[1:], dtype=np.complex128)  # (F,) or (F, M)
    for a in range(0, xi.shape[0], B):
        phase = 2.0 * np.pi * (xi[a:a + B] @ X.T)  # (B, N): 2π⟨ξ, X^k⟩
        out[a:a + B] = (np.cos(phase) @ phi - 1j * (np.sin(phase) @ phi)) / N  # exp(−iθ) = cos θ − i sin θ
    return out
