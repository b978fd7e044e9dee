"""A step's gang on Ray: SpectralShard actors co-scheduled in one placement group.

:class:`RayGang` owns the placement group and the actors (the coordinator creates and replaces
gangs); :class:`GangPool` is the picklable view of a gang that the step's driver — the spectral
worker analysing the step — uses as its :class:`~nsa_dist.pipeline.layout.Pool`: member calls are
actor tasks, broadcast blocks go through the object store once (``ray.put``), and the per-block
features travel between members as object refs the driver never fetches.
"""

from __future__ import annotations

import math
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nsa_dist.pipeline.shard import SpectralShard

__all__ = ["GangUnplaceable", "GangPool", "RayGang", "check_bundles_fit", "check_gang_fits", "gang_bundle"]


class GangUnplaceable(RuntimeError):
    """The cluster cannot host the gang (a member bigger than every node, or not enough in all)."""


class _ShardFromRefs(SpectralShard):
    """SpectralShard whose ``build_tiles`` receives the blocks' features as object refs."""

    def build_tiles(self, key: str, ranges: list, pairs: list, features: dict[int, Any]) -> int:
        fetched = dict(zip(features, ray.get(list(features.values()))))
        return super().build_tiles(key, ranges, pairs, fetched)


class GangPool:
    """The members of a gang as a Pool (picklable: it holds actor handles only)."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors, self.size = actors, len(actors)

    def submit(self, i: int, method: str, *args: Any, num_returns: int = 1) -> Any:
        m = getattr(self.actors[i], method)
        return (m.options(num_returns=num_returns) if num_returns != 1 else m).remote(*args)

    def get(self, handles: list[Any]) -> list[Any]:
        return ray.get(list(handles))

    def put(self, value: Any) -> Any:
        return ray.put(value)


def gang_bundle(cpus: float, gpus: float, resources: dict[str, float] | None) -> dict[str, float]:
    """One member's placement-group bundle (Ray needs a non-empty bundle: 0.01 CPU at least)."""
    b = {"CPU": cpus or 0.01, **({"GPU": gpus} if gpus else {}), **(resources or {})}
    return {k: float(v) for k, v in b.items() if v}


def check_gang_fits(size: int, bundle: dict[str, float], nodes: list[dict[str, float]]) -> None:
    """GangUnplaceable naming what is missing, when no packing of ``size`` bundles onto ``nodes`` exists
    (each member on one node; a first-fit check — exact for identical bundles)."""
    if not nodes:
        raise GangUnplaceable("the Ray cluster has no alive nodes to place a spectral gang on")
    too_big = [k for k, v in bundle.items() if all(n.get(k, 0.0) + 1e-9 < v for n in nodes)]
    if too_big:
        best = {k: max(n.get(k, 0.0) for n in nodes) for k in too_big}
        raise GangUnplaceable(f"a spectral-gang member needs {bundle}, but no node has that much "
                              f"{', '.join(too_big)} (largest node: {best}); lower cluster.worker_cpus / worker_gpus "
                              "/ worker_resources")
    fits = sum(min(math.floor((n.get(k, 0.0) + 1e-9) / v) for k, v in bundle.items()) for n in nodes)
    if fits < size:
        total = {k: sum(n.get(k, 0.0) for n in nodes) for k in bundle}
        raise GangUnplaceable(f"spectrum.workers={size} gang members of {bundle} each do not fit this Ray cluster "
                              f"(room for {fits}; cluster totals {total}); lower spectrum.workers or the per-worker "
                              "resources, or add nodes")


def check_bundles_fit(bundles: list[dict[str, float]], nodes: list[dict[str, float]], what: str) -> None:
    """ValueError unless the bundles (each on one node) pack onto the nodes (first fit, largest first).

    Cluster totals are not enough: two nodes with half a GPU free each do not host a one-GPU actor.
    """
    free = [dict(n) for n in nodes]
    for b in sorted(bundles, key=lambda b: sorted(b.items()), reverse=True):
        node = next((n for n in free if all(n.get(k, 0.0) + 1e-9 >= v for k, v in b.items())), None)
        if node is None:
            raise ValueError(f"{what}: an actor needing {b} fits on no node once the others are placed (nodes: "
                             f"{nodes}); lower the per-actor resources or add nodes")
        for k, v in b.items():
            node[k] -= v


def _node_resources() -> list[dict[str, float]]:
    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]


class RayGang:
    """``size`` SpectralShard actors in one placement group; fails fast when it cannot be placed.

    Args:
        size: members.
        cpus, gpus, resources: per member (its bundle).
        threads: torch threads per member.
        timeout: seconds to wait for the placement group when the cluster is busy.

    Raises:
        GangUnplaceable: the cluster can never host the gang, or not within ``timeout``.
    """

    def __init__(self, size: int, cpus: float = 1.0, gpus: float = 0.0, resources: dict | None = None,
                 threads: int | None = None, timeout: float = 120.0) -> None:
        bundle = gang_bundle(cpus, gpus, resources)
        check_gang_fits(size, bundle, _node_resources())
        self.pg = placement_group([dict(bundle) for _ in range(size)], strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout)
        if not ready:
            remove_placement_group(self.pg)
            raise GangUnplaceable(f"a gang of {size} spectral workers ({bundle} each) could not be placed within "
                                  f"{timeout:.0f} s: the cluster's free resources are {ray.available_resources()}")
        cls = ray.remote(_ShardFromRefs)
        self.actors = [cls.options(num_cpus=cpus, num_gpus=gpus, resources=resources or {}, max_restarts=0,
                                   scheduling_strategy=PlacementGroupSchedulingStrategy(
                                       self.pg, placement_group_bundle_index=i)).remote(threads)
                       for i in range(size)]
        self.pool = GangPool(self.actors)
        self.member_pids = ray.get([a.pid.remote() for a in self.actors])  # members are up before use

    def peak_rss(self) -> list[int]:
        return ray.get([a.peak_rss.remote() for a in self.actors])

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.pg)
