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
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group

from nsa_dist.cluster.actors import gang_members
from nsa_dist.cluster.resources import GangUnplaceable, check_gang_fits, gang_bundle
from nsa_dist.cluster.runtime import alive_nodes
from nsa_dist.pipeline.layout import Handle, Member, ShardCalls, each

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["GangUnplaceable", "GangMembers", "RayGang"]


def _from_ray(exc: BaseException) -> bool:
    """Whether ``exc`` is one of Ray's own errors."""
    return any(c.__module__.split(".")[0] == "ray" for c in type(exc).__mro__)


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
        """The results, or the error a member raised — as itself, as an in-process gang raises it
        (a member's numerical error in a diagnostic is then that diagnostic's NaN, not taken for
        Ray's failure and the step's); Ray's own errors (a member died) stay as Ray raises them."""
        try:
            return ray.get(cast("list[ray.ObjectRef[T]]", list(handles)))
        except RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, Exception) and not _from_ray(cause):
                raise cause from exc
            raise

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

    def member_died(self, exc: BaseException) -> bool:
        """Whether ``exc`` (a ``RayActorError`` a step's analysis raised) is the death of one of
        this gang's members — not of another actor the step used (its trainer, whose restarts
        are spent): only then is the gang's state gone and a fresh gang to recompute the step.
        An error naming no actor counts as the gang's when a member does not answer."""
        actor = getattr(exc, "actor_id", None)
        if actor:
            return actor in {a._actor_id.hex() for a in self.actors}
        return not self.alive()

    def alive(self, timeout: float = 30.0) -> bool:
        """Whether every member answers within ``timeout`` seconds."""
        try:
            ray.get([a.pid.remote() for a in self.actors], timeout=timeout)
        except (RayActorError, GetTimeoutError):
            return False
        return True

    def peak_rss(self) -> list[int]:
        return self.members.get([m.peak_rss() for m in each(self.members)])

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.pg)
