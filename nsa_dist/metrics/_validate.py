"""Conversion and validation at the boundary of the metrics (private).

Conventions shared by every metric:

* inputs may be NumPy arrays, torch CPU tensors or nested sequences; they become NumPy arrays;
  float32 stays float32, float64 stays float64, integer/bool become float64;
* :class:`ShapeError` for a wrong number of dimensions, mismatched lengths, or an index/count
  outside its range; :class:`NonFiniteError` for NaN/inf input and for a quantity that would be
  0/0 or x/0 (a zero-norm vector, a zero eigenvalue in a denominator); ``ValueError`` for other
  values outside their domain (a negative learning rate); ``TypeError`` for a non-real dtype.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch

from nsa_dist._checks import check_finite
from nsa_dist.errors import NonFiniteError, ShapeError

_BUDGET_ELEMENTS = 1 << 21  # entries of one working block (32 MiB as complex128)


def as_real(name: str, x: Any, ndims: tuple[int, ...]) -> np.ndarray:
    """``x`` as a finite real NumPy array with ``x.ndim in ndims`` (float32 kept, ints → float64)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype.kind in "biu":
        arr = arr.astype(np.float64)
    elif arr.dtype not in (np.float32, np.float64):
        raise TypeError(f"{name} must hold real numbers (float32/float64), got dtype {arr.dtype}")
    if arr.ndim not in ndims:
        allowed = " or ".join(f"{d}-D" for d in ndims)
        raise ShapeError(f"{name} must be {allowed}, got shape {arr.shape}")
    if arr.size == 0:
        raise ShapeError(f"{name} must not be empty, got shape {arr.shape}")
    check_finite(name, arr)
    return arr


def work_dtype(*arrays: np.ndarray) -> np.dtype:
    """float32 when every array is float32, else float64."""
    return np.result_type(np.float32, *(a.dtype for a in arrays))


def check_rows(name_a: str, a: np.ndarray, name_b: str, b: np.ndarray, axis_b: int = 0) -> None:
    """Raise :class:`ShapeError` unless ``a.shape[0] == b.shape[axis_b]`` (the same N points)."""
    if a.shape[0] != b.shape[axis_b]:
        raise ShapeError(
            f"{name_a} has shape {a.shape} and {name_b} has shape {b.shape}: "
            f"{name_a}.shape[0] must equal {name_b}.shape[{axis_b}] (the same N points)"
        )


def positive_scalar(name: str, x: Any) -> float:
    """``x`` as a finite float > 0, else ``ValueError`` naming ``name``."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim != 0 or arr.dtype.kind not in "iuf":
        raise ValueError(f"{name} must be a real number > 0, got {x!r}")
    value = float(arr)
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def count(name: str, x: Any, low: int, high: int | None = None) -> int:
    """``x`` as an int in [low, high] (``high=None``: no upper limit), else an error naming it."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {x!r} ({type(x).__name__})")
    value = int(x)
    if value < low or (high is not None and value > high):
        upper = "" if high is None else f" <= {high}"
        raise ShapeError(f"{name} must satisfy {low} <= {name}{upper}, got {value}")
    return value


def nonzero_norms(name: str, norm2: np.ndarray, what: str) -> None:
    """Raise :class:`NonFiniteError` naming the columns of ``name`` whose squared norm is 0."""
    zero = np.flatnonzero(np.atleast_1d(norm2) == 0)
    if zero.size:
        cols = "" if np.ndim(norm2) == 0 else f" (columns {zero[:10].tolist()})"
        raise NonFiniteError(f"{name} has zero norm{cols}: {what} is 0/0; pass a non-zero vector")


def block_size(width: int) -> int:
    """Rows per block so that a (block, width) working array stays near 2**21 entries."""
    return max(1, _BUDGET_ELEMENTS // max(1, width))
