"""The one place plain classes become Ray actors (``ray.remote(Cls).options(...)``)."""

from __future__ import annotations

import math
from typing import Any

import ray

from nsa_dist.config import ClusterSpec
from nsa_dist.pipeline.services import SpectralService, TrainerService

__all__ = ["trainer_actor", "spectral_workers", "resolve_gpus", "tracked_run_workers"]


def resolve_gpus(value: float | str, has_gpus: bool, auto: float) -> float:
    return (auto if has_gpus else 0.0) if value == "auto" else float(value)


def _threads(cpus: float) -> int:
    return max(1, int(math.floor(cpus)) or 1)


def trainer_actor(plan: Any, store_url: str, cl: ClusterSpec, has_gpus: bool, token: str | None = None) -> Any:
    """A restartable trainer: killed, it comes back, resumes from the store and Ray retries its task;
    after ``cluster.max_retries`` restarts it stays dead and its run fails with the reason.
    ``token``: the driver's lease token, fencing the trainer's writes (the loss trace)."""
    gpus = resolve_gpus(cl.trainer_gpus, has_gpus, 1.0)
    cls = ray.remote(TrainerService).options(num_cpus=cl.trainer_cpus, num_gpus=gpus, resources=cl.trainer_resources,
                                            max_restarts=cl.max_retries, max_task_retries=-1)
    return cls.remote(plan, store_url, threads=_threads(cl.trainer_cpus), token=token)


def spectral_workers(store_url: str, cl: ClusterSpec, has_gpus: bool) -> list[Any]:
    """The spectral-worker pool; a dead worker restarts and Ray retries its (idempotent) task there,
    up to ``cluster.max_retries`` times per task — a step that keeps killing its worker fails its run."""
    gpus = resolve_gpus(cl.worker_gpus, has_gpus, 0.5)
    cls = ray.remote(SpectralService).options(num_cpus=cl.worker_cpus, num_gpus=gpus, resources=cl.worker_resources,
                                             max_restarts=-1, max_task_retries=cl.max_retries)
    return [cls.remote(store_url, threads=_threads(cl.worker_cpus)) for _ in range(cl.spectral_workers)]


def tracked_run_workers(store_url: str, plan: Any, model_ref: Any, data_ref: Any, n: int, cpus: float = 1.0,
                        gpus: float = 0.0, resources: dict | None = None, token: str | None = None) -> list[Any]:
    """The spectral-worker pool of a Tracker's run (issue 12): ``n`` TrackedRunService actors.

    ``model_ref`` / ``data_ref`` are object refs (put once, shared by the pool); a dead worker
    restarts from them (max_restarts=-1) and the Tracker re-submits its step.
    """
    from nsa_dist.pipeline.tracked import TrackedRunService

    cls = ray.remote(TrackedRunService).options(num_cpus=cpus, num_gpus=gpus, resources=resources or {},
                                               max_restarts=-1, max_task_retries=0)
    return [cls.remote(store_url, plan, model_ref, data_ref, threads=_threads(cpus), token=token) for _ in range(n)]
