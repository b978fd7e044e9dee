"""Spectral workers on Ray, and the one queue that hands them checkpoints, for the sweep
coordinator and the Tracker alike.

``ray.util.ActorPool``'s idle set hands out one analysis per worker; Ray restarts a killed worker
and retries its analysis there (``max_restarts`` / ``max_task_retries``, set in
:mod:`~nsa_dist.cluster.actors`), so ``ray.get`` raises ``RayActorError`` only once those are spent.
:class:`DispatchQueue` keeps one run's checkpoints in order until a worker (and whatever else a
step needs, e.g. a gang) is free, hands back each finished analysis, and sends again at the front
of the queue a step whose borrowed state broke — the one retry Ray has no primitive for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError
from ray.util import ActorPool

if TYPE_CHECKING:
    from nsa_dist.cluster.gang import RayGang

__all__ = ["Analysis", "DispatchQueue", "RayAnalysisPool", "task_cause"]


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
        try:
            after = ray.get(a.pids[1])
        except RayActorError:  # the worker is dead for good (its restarts spent): the caller's error says so
            return False
        before = a.pids[0]
        self._pid[id(w)] = after
        return before is not None and after != before

    def close(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []


def _lend_nothing(a: Analysis) -> bool:
    return True


def _nothing_lent(a: Analysis, broken: bool) -> None:
    return None


class DispatchQueue:
    """One run's checkpoints on their way through a :class:`RayAnalysisPool` (which several
    queues may share): queued in order, sent to idle workers, handed back when finished.

    A worker killed mid-analysis is restarted by Ray and the analysis run there again; with
    ``probe`` the queue sees that happen (the worker's process changed) and counts the step in
    ``resubmitted``.  A step whose other borrowed state broke (a gang member died) is put back at
    the front by :meth:`retry`, at most ``max_retries`` times, and counted there too.

    Args:
        pool: the idle workers.
        args: the ``analyze_and_write`` arguments of an analysis (the run's plan, the checkpoint's
            ref, its gang, the lease token: whatever the workers take).
        lend: called with the next analysis before it is sent; gives it what else it needs (sets
            ``a.gang``) and returns True, or returns False to keep it queued for now.
        give_back: ``(a, broken)``, once ``a`` is over: takes back what ``lend`` gave (``broken``:
            it cannot be used again).
        max_retries: how often :meth:`retry` puts one step back.
        probe: whether to watch for Ray's re-runs (a ``pid`` call per analysis).
    """

    def __init__(
        self,
        pool: RayAnalysisPool,
        args: Callable[[Analysis], tuple],
        *,
        lend: Callable[[Analysis], bool] = _lend_nothing,
        give_back: Callable[[Analysis, bool], None] = _nothing_lent,
        max_retries: int = 0,
        probe: bool = False,
    ) -> None:
        self.pool, self.args, self.lend, self.give_back = pool, args, lend, give_back
        self.max_retries, self.probe = max_retries, probe
        self.queued: list[Analysis] = []  # waiting for a worker (and whatever lend gives)
        self.running: dict[Any, Analysis] = {}  # analysis ref -> its record
        self.resubmitted = 0  # steps run again: by Ray on a restarted worker (seen if probed), or by retry

    def __len__(self) -> int:
        """The steps handed over and not yet handed back: running and queued."""
        return len(self.running) + len(self.queued)

    def put(self, a: Analysis) -> None:
        """Queue ``a`` behind the others and send what can be sent."""
        self.queued.append(a)
        self.dispatch()

    def dispatch(self) -> None:
        """Send queued analyses, in order, while a worker is idle and ``lend`` agrees."""
        while self.queued and self.pool.has_free() and self.lend(self.queued[0]):
            a = self.queued.pop(0)
            self.running[self.pool.send(a, *self.args(a), probe=self.probe)] = a

    def ready(self, block: bool) -> list[Any]:
        """The refs of finished analyses: at least one if ``block`` (and any runs), else those
        finished now."""
        if not self.running:
            return []
        n = len(self.running)
        return ray.wait(list(self.running), num_returns=1 if block else n, timeout=None if block else 0)[0]

    def take(self, ref: Any) -> tuple[Analysis, Any, BaseException | None]:
        """The finished analysis of ``ref``: ``(a, its summary, None)`` with its worker idle again,
        or ``(a, None, the error ray.get raised)`` with its worker (and what ``lend`` gave) still
        held, for the caller to :meth:`release` or :meth:`retry`."""
        a = self.running.pop(ref)
        try:
            summary = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - the caller judges the analysis's or Ray's error
            return a, None, exc
        self.resubmitted += self.release(a)
        return a, summary, None

    def release(self, a: Analysis, broken: bool = False) -> bool:
        """``a`` is over: its worker idle again, what ``lend`` gave taken back.  Whether Ray ran
        ``a`` again on a restarted worker (when probed)."""
        rerun = self.pool.release(a)
        self.give_back(a, broken)
        return rerun

    def retry(self, a: Analysis) -> bool:
        """``a``'s borrowed state broke: give it back broken and, unless ``a`` was put back
        ``max_retries`` times already, queue ``a`` first and send; whether it was put back."""
        self.release(a, broken=True)
        if a.attempts >= self.max_retries:
            return False
        a.attempts += 1
        self.queued.insert(0, a)
        self.resubmitted += 1
        self.dispatch()
        return True

    def cancel(self) -> None:
        """Cancel the running analyses (their workers idle again) and forget the queued ones."""
        for ref, a in list(self.running.items()):
            ray.cancel(ref)
            self.release(a)
        self.running.clear()
        self.queued.clear()
