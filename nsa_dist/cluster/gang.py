"""A step's gang on Ray: SpectralShard actors co-scheduled in one placement group.

:class:`RayGang` owns the placement group and the actors (the coordinator creates and replaces
gangs); :class:`GangMembers` is the picklable view of a gang that the step's driver — the spectral
worker analysing the step — uses as its :class:`~nsa_dist.pipeline.layout.Pool`: member calls
(typed method calls, :class:`~nsa_dist.pipeline.layout.Member`) are actor tasks, broadcast blocks
go through the object store once (``ray.put``), and the per-block features travel between members
as object refs the driver never fetches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from nsa_dist.cluster.actors import gang_members
from nsa_dist.cluster.resources import GangUnplaceable, check_gang_fits, gang_bundle
from nsa_dist.cluster.runtime import alive_nodes
from nsa_dist.pipeline.layout import Handle, Member, ShardCalls, each

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["GangUnplaceable", "GangMembers", "RayGang"]


class _ActorCalls(ShardCalls):
    """A member that is a SpectralShard actor: a call is an actor task; its handle is the task's ObjectRef."""

    def _start(self, method: Callable[..., R], *args: Any) -> Handle[R]:
        return cast(Any, method).remote(*args)

    def _start_each(self, n: int, method: Callable[..., Any], *args: Any) -> list[Handle[Any]]:
        m = cast(Any, method)
        if n == 1:
            return [m.remote(*args)]
        return list(m.options(num_returns=n).remote(*args) or [])  # a ref per result (none for n = 0)


class GangMembers:
    """The members of a gang as a :class:`~nsa_dist.pipeline.layout.Pool` (picklable: it holds actor handles only)."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors, self.size = actors, len(actors)

    def member(self, i: int) -> Member:
        return _ActorCalls(self.actors[i])

    def get(self, handles: Iterable[Handle[T]]) -> list[T]:
        return ray.get(cast("list[ray.ObjectRef[T]]", list(handles)))

    def put(self, value: T) -> Handle[T]:
        return ray.put(value)


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

    def __init__(
        self,
        size: int,
        cpus: float = 1.0,
        gpus: float = 0.0,
        resources: dict | None = None,
        threads: int | None = None,
        timeout: float = 120.0,
    ) -> None:
        bundle = gang_bundle(cpus, gpus, resources)
        check_gang_fits(size, bundle, alive_nodes())
        self.pg = placement_group([dict(bundle) for _ in range(size)], strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout)
        if not ready:
            remove_placement_group(self.pg)
            raise GangUnplaceable(
                f"a gang of {size} spectral workers ({bundle} each) could not be placed within "
                f"{timeout:.0f} s: the cluster's free resources are {ray.available_resources()}"
            )
        self.actors = gang_members(self.pg, size, cpus, gpus, resources, threads)
        self.members = GangMembers(self.actors)
        self.member_pids = self.members.get([m.pid() for m in each(self.members)])  # members are up before use

    def peak_rss(self) -> list[int]:
        return self.members.get([m.peak_rss() for m in each(self.members)])

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.pg)
