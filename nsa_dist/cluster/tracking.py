"""The Tracker's :class:`~nsa_dist.pipeline.pool.AnalysisPool` on Ray actors.

Checkpoints go to the object store once (``ray.put``), their refs to idle workers through the
:class:`~nsa_dist.cluster.pool.DispatchQueue` the sweep coordinator's runs use too (the rest wait
in order); the driver fetches only the short summaries.  Ray restarts a dead worker and retries its step.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import ray
from ray.exceptions import RayActorError

from nsa_dist.cluster.actors import tracked_run_workers
from nsa_dist.cluster.pool import Analysis, DispatchQueue, RayAnalysisPool, task_cause
from nsa_dist.cluster.runtime import connect
from nsa_dist.errors import AnalysisError
from nsa_dist.pipeline.notes import replay_notes
from nsa_dist.pipeline.pool import raise_failure

__all__ = ["RayTrackerPool"]

log = logging.getLogger(__name__)


class RayTrackerPool:
    """``workers`` TrackedRunService actors analysing one tracked run.

    Args:
        address: "local" (embedded Ray), "auto" (the running cluster / Ray Job) or "ray://HOST:PORT";
            an already initialised Ray is used as it is.
        store_url, plan, model, data: what each worker builds its analyzer and writer from.
        workers, cpus, gpus: pool size and resources per worker.
        max_retries: Ray's retries of a step whose worker died.
        token: the Tracker's lease token, fencing the workers' writes.

    Raises:
        TypeError: the model cannot be pickled for the workers.
        RuntimeError: the workers could not start (the model's class not importable there).
    """

    def __init__(
        self,
        address: str,
        store_url: str,
        plan: Any,
        model: Any,
        data: Any,
        *,
        workers: int = 1,
        cpus: float = 1.0,
        gpus: float = 0.0,
        max_retries: int = 3,
        token: str | None = None,
    ) -> None:
        if not ray.is_initialized():
            connect(None if address == "local" else address)
        try:
            model_ref = ray.put(model)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(
                f"the model ({type(model).__qualname__}) cannot be pickled for the Ray spectral workers "
                f"({exc}); define its class in an importable module (shipped to the workers with the "
                "job's runtime_env) or analyse in this process with cluster=None"
            ) from exc
        data_ref = ray.put(data)
        actors = tracked_run_workers(store_url, plan, model_ref, data_ref, workers, cpus, gpus, max_retries, token)
        try:
            self.pids = ray.get([w.pid.remote() for w in actors])
        except RayActorError as exc:
            raise RuntimeError(
                f"the Ray spectral workers could not start: {task_cause(exc)} — the model's class and "
                "nsa_dist must be importable on every worker (runtime_env py_modules / working_dir, "
                "see deploy/README.md)"
            ) from exc
        self.queue = DispatchQueue(RayAnalysisPool(actors, self.pids), _checkpoint, probe=True)
        self._refs = (model_ref, data_ref)  # held for the pool's life: a restarted worker rebuilds from them
        self.max_retries, self.run = max_retries, plan.run_id
        self._held: list[dict] = []  # summaries returned beside a failed step, for the next wait
        self._failed: list[tuple[int, Analysis, BaseException]] = []  # failed steps not raised yet, by step

    @property
    def running(self) -> dict[Any, Analysis]:
        """The steps sent to a worker (task ref -> its analysis)."""
        return self.queue.running

    @property
    def inflight(self) -> list[Any]:
        """The steps handed over and not yet returned: running, queued, and finished or failed
        beside a failure raised earlier (held for the next :meth:`wait`)."""
        return [*self.queue.running.values(), *self.queue.queued, *self._held, *(f[1] for f in self._failed)]

    @property
    def resubmitted(self) -> int:
        """Steps Ray ran again on a restarted worker."""
        return self.queue.resubmitted

    def submit(self, ck: Any) -> None:
        """Hand checkpoint ``ck`` to an idle worker, or queue it; returns at once."""
        self.queue.put(Analysis(self.run, ck.index, ray.put(ck), ck.step))

    def wait(self, block: bool) -> list[dict]:
        """Summaries of finished steps (at least one if ``block`` and any is in flight).

        Every step Ray returned at once is taken; when some failed, the earliest failed step is
        raised and the rest — finished summaries and later failures — are held for the next calls
        (counted in :attr:`inflight`), so a failure never drops a step finished beside it (as
        :class:`~nsa_dist.pipeline.pool.ThreadAnalysisPool`).

        Raises:
            AnalysisError: a step's analysis failed (the worker's exception chained as its cause),
                or its worker died more than ``max_retries`` times.
            LeaseLost: another writer took the run over.
        """
        self.queue.dispatch()  # a worker freed by a failed step takes the next queued one
        if not self._held and not self._failed:
            if not self.queue.running:
                return []
            for ref in self.queue.ready(block):
                a, summary, exc = self.queue.take(ref)
                if exc is None:
                    replay_notes(self.run, summary.get("notes"), log)
                    self._held.append(summary)
                else:  # its worker idle again: the steps queued behind it still run (or fail)
                    self.queue.release(a)
                    self._failed.append((a.step, a, exc))
            self._failed.sort(key=lambda f: f[0])
        if self._failed:
            _, a, exc = self._failed.pop(0)
            self.queue.dispatch()
            if isinstance(exc, RayActorError):
                raise AnalysisError(
                    f"run {self.run!r}: the analysis of recorded step {a.step} failed: its spectral "
                    f"worker died {_times(self.max_retries + 1)} (max_retries={self.max_retries})",
                    a.step,
                ) from exc
            raise_failure(self.run, a.step, task_cause(exc))  # the analysis's own error, unwrapped
        out, self._held = sorted(self._held, key=lambda s: s["index"]), []
        self.queue.dispatch()
        return out

    def close(self) -> None:
        self.queue.pool.close()
        self.queue.running.clear()
        self.queue.queued.clear()


def _times(n: int) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"


def _checkpoint(a: Analysis) -> tuple:
    """A tracked step's ``analyze_and_write`` arguments: its checkpoint (the workers hold the rest)."""
    return (a.ckpt,)
