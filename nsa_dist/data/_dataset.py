"""The container every dataset loader returns."""

from __future__ import annotations

import hashlib
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

    def fingerprint(self) -> str:
        """``"sha256:<32 hex>"``: a hash of the arrays the run trains and is measured on — X, y,
        X_test, y_test and the ``extra`` arrays, each with its name, dtype and shape.

        Hashing the loaded arrays, not the files, catches every way the data can change (a file
        replaced at the same path in any format, a changed loader or normalisation, generated
        data) and nothing else (a re-compressed file with the same pixels is the same data); X,
        y, X_test, y_test are what the run stores, so a plain reader can recompute it.
        """
        h = hashlib.sha256()
        named = [("X", self.X), ("y", self.y), ("X_test", self.X_test), ("y_test", self.y_test)]
        for name, a in named + sorted(self.extra.items()):
            a = np.ascontiguousarray(a)
            h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
            h.update(a.reshape(-1).view(np.uint8) if a.size else b"")
        return f"sha256:{h.hexdigest()[:32]}"
