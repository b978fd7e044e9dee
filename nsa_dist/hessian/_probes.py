"""What the stochastic estimators share: operators as float64 NumPy maps, probes, argument checks (private)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from nsa_dist.errors import ShapeError

__all__ = ["LinearMap", "as_linear_map", "rademacher", "check_int"]


class LinearMap:
    """``V (P, m) ↦ A V`` on float64 NumPy arrays, counting the columns applied.

    Attributes:
        P: dimension.
        n_products: columns applied through this map.
    """

    def __init__(self, P: int, apply: Callable[[np.ndarray], Any]) -> None:
        self.P, self._apply, self.n_products = P, apply, 0

    def __call__(self, V: np.ndarray) -> np.ndarray:
        self.n_products += V.shape[1]
        out = self._apply(np.ascontiguousarray(V))
        out = out.detach().cpu().numpy() if isinstance(out, torch.Tensor) else np.asarray(out)
        return out.reshape(V.shape).astype(np.float64, copy=False)


def as_linear_map(A: Any, name: str = "A") -> LinearMap:
    """Wrap a dense square matrix (NumPy / torch) or an operator (``shape`` + ``matmat``/``matvec``).

    Raises:
        ShapeError: not square.
        TypeError: neither a matrix nor an operator.
    """
    if isinstance(A, (np.ndarray, torch.Tensor)):
        M = A.detach().cpu().double().numpy() if isinstance(A, torch.Tensor) else np.asarray(A, dtype=np.float64)
        if M.ndim != 2 or M.shape[0] != M.shape[1]:
            raise ShapeError(f"{name} must be a square (P, P) matrix, got shape {M.shape}")
        return LinearMap(M.shape[0], lambda V: M @ V)
    if not hasattr(A, "shape") or not (hasattr(A, "matmat") or hasattr(A, "matvec")):
        raise TypeError(f"{name} must be a (P, P) array or an operator with `shape` and `matmat(V)`; "
                        f"got {type(A).__name__}")
    shape = tuple(A.shape)
    if len(shape) != 2 or shape[0] != shape[1]:
        raise ShapeError(f"{name} must be square (P, P); the operator has shape {shape}")
    if hasattr(A, "matmat"):
        return LinearMap(shape[0], A.matmat)
    return LinearMap(shape[0], lambda V: np.stack([np.asarray(A.matvec(v)).reshape(-1) for v in V.T], 1))


def rademacher(rng: np.random.Generator, P: int, m: int) -> np.ndarray:
    """(P, m) independent ±1 entries (float64)."""
    return rng.integers(0, 2, size=(P, m)).astype(np.float64) * 2 - 1


def check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int in [minimum, maximum]; else a ValueError naming ``name`` and the range."""
    try:
        if isinstance(value, bool):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        v = None
    if v is None or v < minimum or (maximum is not None and v > maximum):
        rng = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ValueError(f"{name} must be an int {rng}, got {value!r}")
    return v
