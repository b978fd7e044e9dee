"""A Gram too big for one worker: block rows on several actors, Lanczos on the sum of their products."""

from __future__ import annotations

from typing import Any

import numpy as np
import ray
import torch
from torch import nn

from nsa_dist.cluster.actors import gram_row_actor
from nsa_dist.linalg import Eigenpairs, top_eigenpairs
from nsa_dist.ntk.blocks import block_features, row_blocks

__all__ = ["DistributedGram", "distributed_top_eigenpairs"]


class DistributedGram:
    """The traced NTK Gram G (N×N) held as block rows G[I, :] by ``n_workers`` actors.

    The structured features of every block are computed once here and shipped through the
    object store (one ``ray.put`` per block); each actor assembles its block row from them.
    ``matmat(V)`` broadcasts V once and concatenates the actors' ``G[I, :] V``: an operator for
    :func:`nsa_dist.linalg.top_eigenpairs`.
    """

    def __init__(self, model: nn.Module, x: torch.Tensor, n_workers: int, *, dtype: torch.dtype = torch.float64,
                 num_cpus: float = 1.0, num_gpus: float = 0.0, resources: dict | None = None) -> None:
        import copy

        self.ranges = row_blocks(x.shape[0], n_workers)
        feats = block_features(copy.deepcopy(model), x, self.ranges, dtype=dtype)
        refs = [ray.put(f) for f in feats]
        device = "cuda" if num_gpus > 0 else "cpu"
        cls = gram_row_actor(num_cpus, num_gpus, resources)
        self.actors = [cls.remote(refs, I, device) for I in range(n_workers)]
        try:
            ray.get([a.nbytes.remote() for a in self.actors])  # block rows built
        except BaseException:
            self.shutdown()
            raise
        self.shape = (x.shape[0], x.shape[0])
        self.n_matvec = 0

    def matmat(self, V: Any) -> np.ndarray:
        """G V for V (N, m): one broadcast of V, one block-row product per actor."""
        Vn = np.asarray(V, dtype=np.float64)
        ref = ray.put(Vn)
        parts = ray.get([a.matmat.remote(ref) for a in self.actors])
        self.n_matvec += Vn.shape[1] if Vn.ndim == 2 else 1
        return np.concatenate(parts, axis=0)

    def row_bytes(self) -> list[int]:
        """Memory of each actor's block row."""
        return ray.get([a.nbytes.remote() for a in self.actors])

    def peak_rss(self) -> list[int]:
        """Peak resident memory of each actor's process."""
        return ray.get([a.peak_rss.remote() for a in self.actors])

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)


def distributed_top_eigenpairs(model: nn.Module, x: torch.Tensor, k: int, n_workers: int = 2, *,
                               dtype: torch.dtype = torch.float64, tol: float = 1e-10, **resources: Any) -> Eigenpairs:
    """Top-k eigenpairs of the NTK Gram at x, with G assembled block-row-wise on ``n_workers`` actors."""
    G = DistributedGram(model, x, n_workers, dtype=dtype, **resources)
    try:
        return top_eigenpairs(G, k, method="lanczos", tol=tol)
    finally:
        G.shutdown()
