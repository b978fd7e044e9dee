"""Extreme eigenpairs of H, I, S by Lanczos, and the edge-of-stability ratio ``λ_max(H) δ / 2``."""

from __future__ import annotations

from dataclasses import replace
from enum import Enum
from typing import Any

import numpy as np

from nsa_dist._checks import parse_enum
from nsa_dist.hessian._probes import check_int
from nsa_dist.linalg import Eigenpairs, EigMethod, top_eigenpairs

__all__ = ["Which", "extreme_eigenpairs", "edge_of_stability"]


class Which(str, Enum):
    """Which end of a symmetric spectrum :func:`extreme_eigenpairs` returns.

    LARGEST: the k largest algebraic eigenvalues, descending — the outliers of H and I
        (``top_eigenpairs`` as it is).
    SMALLEST: the k smallest algebraic, ascending (most negative first), as the top of −A —
        the negative directions of H and S.
    MAGNITUDE: the k largest |λ|, by descending |λ|: both ends (k of each) merged — for S,
        whose spectrum is two-sided and not symmetric about 0.  Costs two Lanczos runs; when
        2k ≥ P the two ends would overlap, and all P eigenpairs come from one dense eigh
        (P products for an operator) instead.
    """

    LARGEST = "largest"
    SMALLEST = "smallest"
    MAGNITUDE = "magnitude"


class _Negated:
    """−A for an operator (``shape`` + ``matmat`` / ``matvec``), keeping its dtype/device for the probe."""

    def __init__(self, A: Any) -> None:
        self.A, self.shape = A, tuple(A.shape)
        for attr in ("dtype", "device"):
            if hasattr(A, attr):
                setattr(self, attr, getattr(A, attr))
        if hasattr(A, "matmat"):
            self.matmat = lambda V: -A.matmat(V)
        if hasattr(A, "matvec"):
            self.matvec = lambda v: -A.matvec(v)


def _negate(A: Any) -> Any:
    return -A if hasattr(A, "__neg__") and hasattr(A, "ndim") else _Negated(A)


def extreme_eigenpairs(
    A: Any,
    k: int,
    *,
    which: str | Which = "largest",
    method: str | EigMethod = "auto",
    tol: float = 1e-10,
    max_iter: int | None = None,
    seed: int = 0,
) -> Eigenpairs:
    """The k extreme eigenpairs ``A v_i = λ_i v_i`` of a symmetric (P, P) matrix or operator.

    Wraps :func:`nsa_dist.linalg.top_eigenpairs` (which returns the largest *algebraic*
    eigenvalues) so the smallest, or the largest in magnitude, come out too.

    Args:
        A: dense (P, P) NumPy/torch or an operator (``shape``, ``matmat``), e.g. H, I or S from
            :func:`~nsa_dist.hessian.hessian_operator`.
        k: 1 ≤ k < P.
        which: "largest" | "smallest" | "magnitude" (see :class:`Which`).
        method, tol, max_iter, seed: as :func:`~nsa_dist.linalg.top_eigenpairs` ("auto" is dense
            eigh for P ≤ 500, Lanczos above).

    Returns:
        :class:`~nsa_dist.linalg.Eigenpairs` with evals (k,) in the order of ``which``, evecs
        (P, k), n_matvec summed over the runs.

    Raises:
        ValueError: k outside 1..P−1, an unknown ``which`` or method.
    """
    w = parse_enum(Which, which, "which")
    P = int(tuple(A.shape)[0])
    k = check_int("k", k, 1, P - 1)
    kw = {"method": method, "tol": tol, "max_iter": max_iter, "seed": seed}
    if w is Which.LARGEST:
        return top_eigenpairs(A, k, **kw)
    if w is Which.MAGNITUDE and 2 * k >= P:  # the two ends overlap: all P eigenpairs, once each
        full = top_eigenpairs(A, P, **{**kw, "method": "dense"})
        order = _by_magnitude(full.evals, tol)[:k]
        return replace(full, evals=full.evals[order], evecs=full.evecs[:, order])
    low = top_eigenpairs(_negate(A), k, **kw)
    low = replace(low, evals=-low.evals)  # ascending
    if w is Which.SMALLEST:
        return low
    high = top_eigenpairs(A, k, **kw)
    evals = np.concatenate([high.evals, low.evals])  # (2k,)
    evecs = np.concatenate([high.evecs, low.evecs], axis=1)  # (P, 2k)
    order = _by_magnitude(evals, tol)[:k]
    res = [r for r in (high.max_residual, low.max_residual) if r is not None]
    return replace(
        high,
        evals=evals[order],
        evecs=evecs[:, order],
        n_matvec=high.n_matvec + low.n_matvec,
        max_residual=max(res) if res else None,
        converged=high.converged and low.converged,
    )


def _by_magnitude(evals: np.ndarray, tol: float) -> np.ndarray:
    """The order of ``evals`` by |λ| descending, where |λ| within the solve's accuracy (10·tol of the
    largest) counts as a tie and a tie puts +λ before −λ: S's spectrum comes in ± pairs of one |λ|, and
    rounding alone decided which came first — and which the top k kept (a gang and the local layout
    stored them swapped, an audit)."""
    a = np.abs(evals)
    desc = np.argsort(-a, kind="stable")
    scale = float(a.max()) if a.size else 0.0
    tie = np.concatenate([[False], -np.diff(a[desc]) <= 10 * tol * scale])  # close to the one before
    group = np.cumsum(~tie)  # (n,) a tie group's id, in descending |λ|
    return desc[np.lexsort((-evals[desc], group))]


def edge_of_stability(lam_max: float, lr: float) -> float:
    """``λ_max(H) / (2/δ)``: gradient descent with step δ is stable along the top direction
    while this is < 1, and training "at the edge of stability" holds it near 1 (Cohen et al. 2021).

    Raises:
        ValueError: lr ≤ 0 or non-finite inputs.
    """
    if not (np.isfinite(lr) and lr > 0):
        raise ValueError(f"lr (the step δ) must be a finite float > 0, got {lr!r}")
    if not np.isfinite(lam_max):
        raise ValueError(f"lam_max must be finite, got {lam_max!r}")
    return float(lam_max) * float(lr) / 2.0
