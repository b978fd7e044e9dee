"""The one place plain classes become Ray actors (``ray.remote(Cls).options(...)``).

Retries are Ray's: a killed trainer or spectral worker is restarted (``max_restarts``) and the
task it was running is retried on it (``max_task_retries``).  A gang member is not restarted
(``max_restarts=0``): a step's tiles live in its memory, so the coordinator replaces the whole
gang and recomputes the step — the one retry Ray has no primitive for.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nsa_dist.cluster.resources import resolve_gpus, threads
from nsa_dist.config import ClusterSpec
from nsa_dist.pipeline.member import SpectralShard
from nsa_dist.pipeline.services import SpectralService, TrainerService

__all__ = ["trainer_actor", "spectral_workers", "tracked_run_workers", "gang_members"]


def trainer_actor(plan: Any, store_url: str, cl: ClusterSpec, has_gpus: bool, token: str | None = None) -> Any:
    """A restartable trainer: killed, it comes back, resumes from the store and Ray retries its task;
    after ``cluster.max_retries`` restarts it stays dead and its run fails with the reason.
    ``token``: the driver's lease token, fencing the trainer's writes (the loss trace)."""
    gpus = resolve_gpus(cl.trainer_gpus, has_gpus, 1.0)
    cls = ray.remote(TrainerService).options(
        num_cpus=cl.trainer_cpus,
        num_gpus=gpus,
        resources=cl.trainer_resources,
        max_restarts=cl.max_retries,
        max_task_retries=-1,
    )
    return cls.remote(plan, store_url, threads=threads(cl.trainer_cpus), token=token)


def spectral_workers(store_url: str, cl: ClusterSpec, has_gpus: bool) -> list[Any]:
    """The spectral-worker pool; a dead worker restarts and Ray retries its (idempotent) task there,
    up to ``cluster.max_retries`` times per task — a step that keeps killing its worker fails its run."""
    gpus = resolve_gpus(cl.worker_gpus, has_gpus, 0.5)
    cls = ray.remote(SpectralService).options(
        num_cpus=cl.worker_cpus,
        num_gpus=gpus,
        resources=cl.worker_resources,
        max_restarts=-1,
        max_task_retries=cl.max_retries,
    )
    n, cpus = cl.spectral_workers, threads(cl.worker_cpus)
    return [cls.remote(store_url, threads=cpus, relay_notes=True) for _ in range(n)]


def tracked_run_workers(
    store_url: str,
    plan: Any,
    model_ref: Any,
    data_ref: Any,
    n: int,
    cpus: float = 1.0,
    gpus: float = 0.0,
    max_retries: int = 3,
    token: str | None = None,
) -> list[Any]:
    """The spectral-worker pool of a Tracker's run: ``n`` TrackedRunService actors.

    ``model_ref`` / ``data_ref`` are object refs (put once, shared by the pool); a dead worker
    restarts from them (``max_restarts=-1``) and Ray retries its step there, up to ``max_retries`` times.
    """
    from nsa_dist.pipeline.tracked import TrackedRunService

    cls = ray.remote(TrackedRunService).options(
        num_cpus=cpus, num_gpus=gpus, max_restarts=-1, max_task_retries=max_retries
    )
    return [
        cls.remote(store_url, plan, model_ref, data_ref, threads=threads(cpus), token=token, relay_notes=True)
        for _ in range(n)
    ]


class _ShardFromRefs(SpectralShard):
    """SpectralShard whose ``build_tiles`` receives the blocks' features as object refs."""

    def build_tiles(self, key: str, ranges: list, pairs: list, features: dict[int, Any]) -> int:
        fetched = dict(zip(features, ray.get(list(features.values()))))
        return super().build_tiles(key, ranges, pairs, fetched)


def gang_members(
    pg: Any, size: int, cpus: float, gpus: float, resources: dict | None, n_threads: int | None
) -> list[Any]:
    """``size`` SpectralShard actors, member i in bundle i of placement group ``pg``; never restarted."""
    cls = ray.remote(_ShardFromRefs)
    return [
        cls.options(
            num_cpus=cpus,
            num_gpus=gpus,
            resources=resources or {},
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote(n_threads)
        for i in range(size)
    ]
