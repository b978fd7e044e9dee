"""A Gram too big for one worker, for any model: tiles on several actors, Lanczos on their sum.

The library counterpart of the ``block_rows`` layout that runs and sweeps use (``RayGang`` +
:class:`~nsa_dist.pipeline.layout.TiledGram`): here the caller has a model in hand, so the
per-block structured features are computed once in this process and shipped through the
object store; each actor builds its balanced share of the upper tile pairs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray
import torch
from torch import nn

from nsa_dist.linalg import Eigenpairs, top_eigenpairs
from nsa_dist.linalg.operator import LinearOperator
from nsa_dist.ntk.shards import GramTiles, shard_features, tile_plan

__all__ = ["DistributedGram", "distributed_top_eigenpairs"]


class _TilesFromRefs(GramTiles):
    """GramTiles whose block features arrive as object refs (fetched once, zero-copy numpy)."""

    def __init__(self, refs: dict[int, Any], ranges: list, pairs: list, device: str = "cpu") -> None:
        super().__init__(dict(zip(refs, ray.get(list(refs.values())))), ranges, pairs, device)

    def peak_rss(self) -> int:
        """This worker process's peak resident memory (bytes, Linux VmHWM)."""
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


class DistributedGram(LinearOperator):
    """The traced NTK Gram G (N×N) as upper tiles dealt to ``n_workers`` actors (symmetry kept).

    ``matmat(V)`` broadcasts V once and sums the actors' partial products: an operator for
    :func:`nsa_dist.linalg.top_eigenpairs`.
    """

    def __init__(self, model: nn.Module, x: torch.Tensor, n_workers: int, *, dtype: torch.dtype = torch.float64,
                 num_cpus: float = 1.0, num_gpus: float = 0.0, resources: dict | None = None) -> None:
        import copy

        self.plan = tile_plan(x.shape[0], n_workers)
        feats = shard_features(copy.deepcopy(model), x, self.plan.ranges, dtype)
        refs = [ray.put(f) for f in feats]
        device = "cuda" if num_gpus > 0 else "cpu"
        cls = ray.remote(_TilesFromRefs).options(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {})
        self.actors = []
        for pairs in self.plan.pairs:
            need = sorted({b for p in pairs for b in p})
            self.actors.append(cls.remote({b: refs[b] for b in need}, self.plan.ranges, pairs, device))
        try:
            ray.get([a.nbytes.remote() for a in self.actors])  # tiles built
        except BaseException:
            self.shutdown()
            raise
        super().__init__(x.shape[0], np.dtype(np.float64))

    def _matmat(self, V: np.ndarray) -> np.ndarray:
        """G V for V (N, m): one broadcast of V, the sum of the actors' partial products."""
        ref = ray.put(np.ascontiguousarray(V))
        return np.sum(ray.get([a.matmat.remote(ref) for a in self.actors]), axis=0)

    def tile_bytes(self) -> list[int]:
        """Memory of each actor's tiles."""
        return ray.get([a.nbytes.remote() for a in self.actors])

    def peak_rss(self) -> list[int]:
        """Peak resident memory of each actor's process."""
        return ray.get([a.peak_rss.remote() for a in self.actors])

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)


def distributed_top_eigenpairs(model: nn.Module, x: torch.Tensor, k: int, n_workers: int = 2, *,
                               dtype: torch.dtype = torch.float64, tol: float = 1e-10, **resources: Any) -> Eigenpairs:
    """Top-k eigenpairs of the NTK Gram at x, with G's tiles spread over ``n_workers`` actors."""
    G = DistributedGram(model, x, n_workers, dtype=dtype, **resources)
    try:
        return top_eigenpairs(G, k, method="lanczos", tol=tol)
    finally:
        G.shutdown()
