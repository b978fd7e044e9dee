"""What the stochastic estimators share: operators as float64 NumPy maps, probes, argument checks (private)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from nsa_dist.errors import ShapeError
from nsa_dist.linalg import Backend, as_symmetric_map, sym_rtol
from nsa_dist.linalg.operator import LinearOperator

__all__ = ["LinearMap", "as_linear_map", "rademacher", "gaussian", "check_int"]


class LinearMap:
    """``V (P, m) ↦ A V`` on float64 NumPy arrays, counting the columns applied.

    Attributes:
        P: dimension.
        n_products: columns applied through this map.
        sym_rtol: the products' relative asymmetry a Krylov solver tolerates (their precision's rounding).
    """

    def __init__(self, P: int, apply: Callable[[np.ndarray], Any], sym_rtol: float = 1.5e-8) -> None:
        self.P, self._apply, self.n_products, self.sym_rtol = P, apply, 0, sym_rtol

    def __call__(self, V: np.ndarray) -> np.ndarray:
        self.n_products += V.shape[1]
        out = np.asarray(self._apply(np.ascontiguousarray(V)))
        return out.reshape(V.shape).astype(np.float64, copy=False)


def as_linear_map(A: Any, name: str = "A") -> LinearMap:
    """A dense symmetric matrix or an operator as the estimators see it (NumPy float64 in and out).

    The project's operators (:class:`nsa_dist.linalg.LinearOperator`: H, I, S, G, local or on a
    gang) already take and return NumPy; anything else goes through the eigensolvers' one input
    adapter (:func:`nsa_dist.linalg.as_symmetric_map`: shape, dtype, finiteness and
    symmetry checks, the array type an operator consumes found by one probe product).

    Raises:
        ShapeError: not square.
        TypeError: neither a matrix nor an operator.
        ValueError: a dense matrix that is not symmetric.
    """
    if isinstance(A, LinearOperator):
        if len(A.shape) != 2 or A.shape[0] != A.shape[1]:
            raise ShapeError(f"{name} must be square (P, P); the operator has shape {tuple(A.shape)}")
        # a float32 operator's products are symmetric to float32's rounding (slq_density refused every float32
        # H and I at float64's 1.5e-8: an audit)
        return LinearMap(A.shape[0], A.matmat, sym_rtol(_eps(A.dtype)))
    smap = as_symmetric_map(A, Backend.NUMPY, name)
    return LinearMap(smap.N, smap.product(), smap.sym_rtol)  # (inf for a dense matrix: checked here already)


def _eps(dtype: Any) -> float:
    """The machine epsilon of a torch or NumPy floating dtype (float64's for anything else)."""
    try:
        return float(torch.finfo(dtype).eps) if isinstance(dtype, torch.dtype) else float(np.finfo(dtype).eps)
    except (TypeError, ValueError):
        return float(np.finfo(np.float64).eps)


def rademacher(rng: np.random.Generator, P: int, m: int) -> np.ndarray:
    """(P, m) independent ±1 entries (float64)."""
    return rng.integers(0, 2, size=(P, m)).astype(np.float64) * 2 - 1


def gaussian(rng: np.random.Generator, P: int, m: int) -> np.ndarray:
    """(P, m) independent standard normal entries (float64)."""
    return rng.standard_normal((P, m))


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
