"""The loss-Hessian measurements of one recorded step (H = I + S), for the SpectralAnalyzer."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from nsa_dist.config import ExperimentSpec
from nsa_dist.hessian import (extreme_eigenpairs, gauss_newton_moments, hessian_parts, hutchpp_moments, orthogonality,
                              rayleigh_quotients, slq_density)

__all__ = ["HessianAnalysis", "hessian_dims"]

PARTS = ("H", "I", "S")


def hessian_dims(spec: ExperimentSpec, n_params: int) -> tuple[int, int, int]:
    """(top_k, rayleigh_k, density grid) of the stored arrays, capped below P."""
    h = spec.hessian
    if h is None:
        return 0, 0, 0
    return min(h.top_k, n_params - 1), min(h.rayleigh_k, n_params - 1), h.density_grid if h.density else 0


class HessianAnalysis:
    """Computes the Hessian quantities the spec asks for at its analysed recorded steps.

    Everything is matrix-free (Hessian-vector products with torch.func, float64): moments by
    Hutch++ with standard errors plus exact Tr(I^k) from the NTK Gram, orthogonality of I and S,
    the Fig. 2 Rayleigh quotients, top eigenvalues by Lanczos, and the SLQ density of H.
    """

    def __init__(self, spec: ExperimentSpec, X: torch.Tensor, y: np.ndarray, n_params: int) -> None:
        self.h = spec.hessian
        self.X, self.y = X, y
        self.indices = set(self.h.indices(spec.record_steps())) if self.h else set()
        self.top_k, self.rayleigh_k, self.grid = hessian_dims(spec, n_params)
        self.seed = spec.seed

    def wanted(self, index: int) -> bool:
        return index in self.indices

    def analyze(self, model: nn.Module, ops: dict[str, Any] | None = None) -> dict[str, Any]:
        """The step's Hessian quantities on ``model`` at its θ.

        ``ops``: H, I, S as operators summed over a gang's data shards (distributed layouts);
        every estimate then runs on them, and the exact Tr(I^k) — which needs the whole Gram —
        is left NaN.
        """
        h = self.h
        exact_I = ops is None
        if ops is None:
            H, I, S = hessian_parts(model, self.X, self.y, loss="mse", block_size=h.block_size, dtype=torch.float64)
            ops = {"H": H, "I": I, "S": S}
        H, I, S = ops["H"], ops["I"], ops["S"]
        out: dict[str, Any] = {}
        if h.moments:
            est = [hutchpp_moments(ops[p], h.probes, max_order=4, seed=self.seed) for p in PARTS]
            out["hessian_moments"] = np.stack([m.estimate for m in est])  # (3, 4)
            out["hessian_moments_stderr"] = np.stack([m.stderr for m in est])  # (3, 4)
            out["hessian_moments_I_exact"] = (gauss_newton_moments(model, self.X, self.y, loss="mse").estimate if exact_I
                                              else np.full(4, np.nan))  # (4,)
        if h.orthogonality:
            o = orthogonality(I, S, n_probes=h.probes, seed=self.seed)
            out["hessian_orthogonality"] = np.array([o.value, o.stderr])
        if self.rayleigh_k:
            along_I, along_S = rayleigh_quotients(I, S, self.rayleigh_k, tol=h.eig_tol, seed=self.seed)
            out["hessian_rayleigh"] = np.array([[along_I.vIv, along_I.vSv], [along_S.vIv, along_S.vSv]])  # (2, 2, k)
            out["hessian_rayleigh_evals"] = np.stack([along_I.evals, along_S.evals])  # (2, k)
        if self.top_k:
            out["hessian_top"] = np.stack([extreme_eigenpairs(ops[p], self.top_k, which="largest", tol=h.eig_tol,
                                                              seed=self.seed).evals for p in PARTS])  # (3, k)
        if self.grid:
            d = slq_density(H, n_probes=h.density_probes, n_steps=h.lanczos_steps, n_grid=self.grid, seed=self.seed)
            out["hessian_density_grid"], out["hessian_density"] = d.grid, d.density
        out["hessian_products"] = sum(op.n_products for op in ops.values())
        return out
