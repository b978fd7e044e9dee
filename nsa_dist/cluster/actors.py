"""The one place plain classes become Ray actors (``ray.remote(Cls).options(...)``)."""

from __future__ import annotations

import math
from typing import Any

import ray

from nsa_dist.config import ClusterSpec
from nsa_dist.ntk.blocks import GramBlockRow
from nsa_dist.pipeline.services import SpectralService, TrainerService

__all__ = ["trainer_actor", "spectral_workers", "gram_row_actor", "resolve_gpus"]


def resolve_gpus(value: float | str, has_gpus: bool, auto: float) -> float:
    return (auto if has_gpus else 0.0) if value == "auto" else float(value)


def _threads(cpus: float) -> int:
    return max(1, int(math.floor(cpus)) or 1)


def trainer_actor(spec: dict, store_url: str, cl: ClusterSpec, has_gpus: bool) -> Any:
    """A restartable trainer: killed, it comes back and resumes from the store (max_restarts=-1)."""
    gpus = resolve_gpus(cl.trainer_gpus, has_gpus, 1.0)
    cls = ray.remote(TrainerService).options(num_cpus=cl.trainer_cpus, num_gpus=gpus, resources=cl.trainer_resources,
                                            max_restarts=-1, max_task_retries=-1)
    return cls.remote(spec, store_url, threads=_threads(cl.trainer_cpus))


def spectral_workers(store_url: str, cl: ClusterSpec, has_gpus: bool) -> list[Any]:
    """The spectral-worker pool; a dead worker restarts, its task is re-submitted by the coordinator."""
    gpus = resolve_gpus(cl.worker_gpus, has_gpus, 0.5)
    cls = ray.remote(SpectralService).options(num_cpus=cl.worker_cpus, num_gpus=gpus, resources=cl.worker_resources,
                                             max_restarts=-1, max_task_retries=0)
    return [cls.remote(store_url, threads=_threads(cl.worker_cpus)) for _ in range(cl.spectral_workers)]


class _GramBlockRowFromRefs(GramBlockRow):
    """GramBlockRow whose per-block features arrive as object refs (fetched once, zero-copy numpy)."""

    def __init__(self, refs: list, I: int, device: str = "cpu") -> None:
        super().__init__(ray.get(refs), I, device)

    def peak_rss(self) -> int:
        """This worker process's peak resident memory (bytes, Linux VmHWM)."""
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def gram_row_actor(num_cpus: float = 1.0, num_gpus: float = 0.0, resources: dict | None = None) -> Any:
    """The actor class holding one block row of a distributed Gram."""
    return ray.remote(_GramBlockRowFromRefs).options(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {})
