"""Spectral workers on Ray, for the sweep coordinator and the Tracker alike.

``ray.util.ActorPool``'s idle set hands out one analysis per worker; Ray restarts a killed worker
and retries its analysis there (``max_restarts`` / ``max_task_retries``, set in
:mod:`~nsa_dist.cluster.actors`), so ``ray.get`` raises ``RayActorError`` only once those are spent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.util import ActorPool

if TYPE_CHECKING:
    from nsa_dist.cluster.gang import RayGang

__all__ = ["Analysis", "RayAnalysisPool", "task_cause"]


@dataclass
class Analysis:
    """One recorded step out for analysis."""

    run: str
    index: int  # recorded-step index
    ckpt: Any  # object ref of its Checkpoint
    step: int | None = None  # training step, where known when it is sent
    attempts: int = 0  # recomputes after its gang broke
    worker: Any = None  # the spectral worker running it
    gang: RayGang | None = None  # the step's gang (distributed layouts)
    pids: tuple[Any, Any] | None = None  # the worker's pid last seen before it, a ref of its pid after it


def task_cause(exc: BaseException) -> BaseException:
    """The exception a Ray task raised (``RayTaskError.cause``: TrainingDiverged, LeaseLost, …), else ``exc``."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class RayAnalysisPool:
    """Spectral-worker actors (``analyze_and_write``, ``pid``), one analysis each at a time."""

    def __init__(self, workers: list[Any], pids: list[int] = ()) -> None:
        self.workers, self._idle = workers, ActorPool(workers)
        self._pid = {id(w): p for w, p in zip(workers, pids)}  # worker -> its process when last seen

    def has_free(self) -> bool:
        return self._idle.has_free()

    def send(self, a: Analysis, *args: Any, probe: bool = False) -> Any:
        """Start ``analyze_and_write(*args)`` for ``a`` on an idle worker; its ref.  ``probe``: fill ``a.pids``.

        The process before is the one last seen (a ``pid`` call sent now could itself be re-run
        by Ray after a kill and report the new process)."""
        a.worker = w = self._idle.pop_idle()
        ref = w.analyze_and_write.remote(*args)
        a.pids = (self._pid.get(id(w)), w.pid.remote()) if probe else None
        return ref

    def release(self, a: Analysis) -> bool:
        """``a`` is over: its worker is idle again.  Whether ``a`` ran on a process Ray restarted
        since the worker was last seen (if probed): a kill during ``a`` made Ray run it again."""
        w, a.worker = a.worker, None
        self._idle.push(w)
        if a.pids is None:
            return False
        before, after = a.pids[0], ray.get(a.pids[1])
        self._pid[id(w)] = after
        return before is not None and after != before

    def close(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
