"""Spectral density of a symmetric operator by stochastic Lanczos quadrature (Ghorbani et al. 2019).

For a unit probe ``v = z / √P`` (z Rademacher), m Lanczos steps from v give a tridiagonal
``T_m = U diag(θ) Uᵀ``; the Gauss quadrature ``Σ_j τ_j f(θ_j)``, ``τ_j = U_{1j}²``, equals
``vᵀ f(A) v`` for every polynomial f of degree ≤ 2m − 1, and ``E[vᵀ f(A) v] = Tr f(A) / P``.
Averaging over probes and broadening each node by a Gaussian of width σ gives

    φ(t) = (1/n_v) Σ_probes Σ_j τ_j N(t; θ_j, σ²)  ≈  (1/P) Σ_i N(t; λ_i, σ²),

a density that integrates to 1 (normalised by P).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from nsa_dist.hessian._probes import LinearMap, as_linear_map, check_int, rademacher

__all__ = ["SpectralDensity", "slq_density"]

_BREAKDOWN = 1e-10  # β_j below this (× the largest |α|, β seen) ends a probe's recursion: invariant subspace
_BASIS_BYTES = 512e6  # default probe_block keeps the Lanczos bases under about this


@dataclass(frozen=True)
class SpectralDensity:
    """A spectral density estimate ``φ(t) ≈ (1/P) Σ_i δ(t − λ_i) * N(0, σ²)`` on a grid.

    Attributes:
        grid: (n_grid,) points t.
        density: (n_grid,) φ(t); ``np.trapezoid(density, grid) ≈ 1``.
        nodes: (n_probes, n_steps) Ritz values θ per probe (padding where a probe broke down early).
        weights: (n_probes, n_steps) quadrature weights τ (0 on padding; each row sums to 1).
        sigma: the Gaussian broadening σ.
        n_products: operator columns applied.
    """

    grid: np.ndarray
    density: np.ndarray
    nodes: np.ndarray
    weights: np.ndarray
    sigma: float
    n_products: int

    def moment(self, k: int) -> tuple[float, float]:
        """``(Tr(A^k) / P`` estimate, its standard error over probes) from the unbroadened nodes;
        exact per probe while ``k ≤ 2·n_steps − 1``."""
        per_probe = np.sum(self.weights * self.nodes ** k, axis=1)  # (n_probes,)
        n = per_probe.size
        return float(per_probe.mean()), float(per_probe.std(ddof=1) / np.sqrt(n)) if n > 1 else float("nan")


def _lanczos(A: LinearMap, V: np.ndarray, n_steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lanczos with full reorthogonalisation, one recursion per column of V (P, b), products batched.

    Returns:
        alpha (b, n_steps), beta (b, n_steps − 1), length (b,) — steps before breakdown.
    """
    P, b = V.shape
    Q = np.zeros((n_steps, P, b))  # the bases, one per column
    alpha, beta = np.zeros((b, n_steps)), np.zeros((b, max(n_steps - 1, 0)))
    length = np.full(b, n_steps)
    Q[0] = V / np.linalg.norm(V, axis=0)
    scale = 0.0
    for j in range(n_steps):
        W = A(Q[j])  # (P, b)
        alpha[:, j] = np.sum(Q[j] * W, axis=0)
        for _ in range(2):  # full reorthogonalisation, twice (classical Gram–Schmidt)
            W -= np.einsum("jpb,jb->pb", Q[:j + 1], np.einsum("jpb,pb->jb", Q[:j + 1], W))
        if j == n_steps - 1:
            break
        bj = np.linalg.norm(W, axis=0)  # (b,)
        scale = max(scale, float(np.abs(alpha[:, j]).max()), float(bj.max()))
        stop = (bj <= _BREAKDOWN * scale) & (length == n_steps)
        length[stop] = j + 1
        live = length > j + 1
        beta[:, j] = np.where(live, bj, 0.0)
        Q[j + 1] = np.where(live, W / np.where(live, bj, 1.0), 0.0)
        if not live.any():
            break
    return alpha, beta, length


def slq_density(A: Any, *, n_probes: int = 10, n_steps: int = 80, sigma: float | None = None,
                grid: np.ndarray | None = None, n_grid: int = 1000, seed: int = 0,
                probe_block: int | None = None) -> SpectralDensity:
    """The spectral density of a symmetric (P, P) A (e.g. the loss Hessian H) by SLQ.

    Args:
        A: dense (P, P) matrix or operator (``shape``, ``matmat``).
        n_probes: Rademacher probes n_v ≥ 1 (the density's noise falls like 1/√n_v).
        n_steps: Lanczos steps m ≥ 1 per probe (capped at P); resolution of the outliers grows
            with m, the quadrature is exact for moments up to 2m − 1.
        sigma: Gaussian broadening σ > 0; default 1% of the span of the Ritz values.
        grid: points t (1-D); default ``n_grid`` points from min θ − 5σ to max θ + 5σ.
        n_grid: points of the default grid (≥ 2).
        seed: NumPy seed of the probes.
        probe_block: probes run together (batched products); default as many as keep the
            (m, P, block) float64 bases under ~512 MB.

    Returns:
        :class:`SpectralDensity`; ``n_products = n_probes · m`` (fewer on breakdown).

    Raises:
        ValueError: n_probes, n_steps, n_grid or probe_block < 1 (n_grid < 2), sigma ≤ 0, a grid
            that is not 1-D and finite.
    """
    nv = check_int("n_probes", n_probes, 1)
    m = check_int("n_steps", n_steps, 1)
    n_grid = check_int("n_grid", n_grid, 2)
    if sigma is not None and not (np.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be None or a finite float > 0, got {sigma!r}")
    if grid is not None:
        grid = np.asarray(grid, dtype=np.float64)
        if grid.ndim != 1 or grid.size < 2 or not np.all(np.isfinite(grid)):
            raise ValueError(f"grid must be a finite 1-D array of >= 2 points, got shape {grid.shape}")
    Amap = as_linear_map(A)
    m = min(m, Amap.P)
    default_block = max(1, int(_BASIS_BYTES // (8 * m * Amap.P)))
    block = check_int("probe_block", default_block if probe_block is None else probe_block, 1)
    rng = np.random.default_rng(seed)
    nodes, weights = np.zeros((nv, m)), np.zeros((nv, m))
    for s in range(0, nv, block):
        b = min(block, nv - s)
        alpha, beta, length = _lanczos(Amap, rademacher(rng, Amap.P, b), m)
        for i in range(b):
            L = length[i]
            T = np.diag(alpha[i, :L]) + np.diag(beta[i, :L - 1], 1) + np.diag(beta[i, :L - 1], -1)  # (L, L)
            theta, U = np.linalg.eigh(T)
            nodes[s + i, :L], weights[s + i, :L] = theta, U[0] ** 2
    live = weights > 0
    lo, hi = float(nodes[live].min()), float(nodes[live].max())
    sig = float(sigma) if sigma is not None else (0.01 * (hi - lo) if hi > lo else max(1e-3, 1e-3 * abs(hi)))
    t = np.linspace(lo - 5 * sig, hi + 5 * sig, n_grid) if grid is None else grid
    gauss = np.exp(-0.5 * ((t[:, None] - nodes[live][None, :]) / sig) ** 2) / (sig * np.sqrt(2 * np.pi))
    density = gauss @ weights[live] / nv  # (n_grid,)
    return SpectralDensity(t, density, nodes, weights, sig, Amap.n_products)
