"""Which kernel of a K-output model (private; re-exported from :mod:`nsa_dist.ntk`).

The algorithm choice :class:`~nsa_dist.config.NTKMethod` lives with the spec that names it.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Kernel"]


class Kernel(str, Enum):
    """Which kernel of a K-output model.

    TRACE: the output-traced (N, N) kernel ``Σ_a ∇f_a(x)·∇f_a(x′)`` — for K = 1 the NSA Gramian.
    FULL: the full (N, K, N, K) kernel ``∇f_a(x)·∇f_b(x′)``.
    """

    TRACE = "trace"
    FULL = "full"
