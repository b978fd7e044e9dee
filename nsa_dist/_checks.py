"""Input validation shared by the numerics (private)."""

from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

import numpy as np
import torch

from nsa_dist.errors import NonFiniteError

E = TypeVar("E", bound=Enum)


def parse_enum(cls: type[E], value: object, name: str) -> E:
    """``cls(value)``, or a ValueError naming ``name`` and the allowed values."""
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{name}={value!r} is not one of {allowed}") from None


def check_finite(name: str, x: Any) -> None:
    """Raise :class:`NonFiniteError` naming ``name`` if ``x`` holds NaN or inf."""
    if isinstance(x, torch.Tensor):
        bad = ~torch.isfinite(x)
        n_bad = int(bad.sum()) if x.is_floating_point() or x.is_complex() else 0
    else:
        arr = np.asarray(x)
        n_bad = int((~np.isfinite(arr)).sum()) if arr.dtype.kind in "fc" else 0
    if n_bad:
        raise NonFiniteError(
            f"{name} holds {n_bad} NaN/inf entries (of {np.prod(tuple(x.shape))}); "
            "clean the data or lower the learning rate"
        )
