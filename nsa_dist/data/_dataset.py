"""The container every dataset loader returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Dataset"]


@dataclass(frozen=True)
class Dataset:
    """Train and test splits as float arrays.

    Attributes:
        X: (N, d) training inputs.
        y: (N,) or (N, K) training targets.
        X_test: (M, d) test inputs (M may be 0).
        y_test: (M,) or (M, K) test targets.
        meta: loader details (source, normalisation constants, ...), JSON-serialisable.
        extra: per-point arrays a loss needs besides y (NCE: "label", "log_noise" and their
            "_test" forms; see :mod:`nsa_dist.data.density`).
    """

    X: np.ndarray
    y: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(self.X.shape[0])
