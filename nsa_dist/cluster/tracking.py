"""The Tracker's spectral-worker pool on Ray: asynchronous, bounded, re-submitting a dead worker's step.

Checkpoints go to the object store once (``ray.put``) and their refs to the least-busy worker;
the driver fetches only the short summaries.  A worker that dies (RayActorError) is restarted by
Ray (``max_restarts=-1``) and the step is sent again, up to ``max_retries`` times.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from nsa_dist.cluster.actors import tracked_run_workers
from nsa_dist.cluster.runtime import connect
from nsa_dist.errors import AnalysisError
from nsa_dist.pipeline.tracked import analysis_error
from nsa_dist.store import LeaseLost

__all__ = ["RayTrackerPool"]


def _cause(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class RayTrackerPool:
    """``workers`` TrackedRunService actors analysing one tracked run.

    Args:
        address: "local" (embedded Ray), "auto" (the running cluster / Ray Job) or "ray://HOST:PORT";
            an already initialised Ray is used as it is.
        store_url, plan, model, data: what each worker builds its analyzer and writer from.
        workers, cpus, gpus: pool size and resources per worker.
        max_retries: re-submissions of a step whose worker died.
        token: the Tracker's lease token, fencing the workers' writes.

    Raises:
        TypeError: the model cannot be pickled for the workers.
    """

    def __init__(self, address: str, store_url: str, plan: Any, model: Any, data: Any, *, workers: int = 1,
                 cpus: float = 1.0, gpus: float = 0.0, max_retries: int = 3, token: str | None = None) -> None:
        if not ray.is_initialized():
            connect(None if address == "local" else address)
        try:
            model_ref = ray.put(model)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(f"the model ({type(model).__qualname__}) cannot be pickled for the Ray spectral workers "
                            f"({exc}); define its class in an importable module (shipped to the workers with the "
                            "job's runtime_env) or analyse in this process with cluster=None") from exc
        data_ref = ray.put(data)
        self.workers = tracked_run_workers(store_url, plan, model_ref, data_ref, workers, cpus, gpus, token=token)
        self._refs = (model_ref, data_ref)  # held for the pool's life: a restarted worker rebuilds from them
        self.max_retries = max_retries
        self.run = plan.run_id
        self.inflight: dict[Any, tuple[Any, int, int, Any]] = {}  # task ref -> (ckpt ref, step, attempts, worker)
        self.resubmitted = 0
        try:
            self.pids = ray.get([w.pid.remote() for w in self.workers])
        except RayActorError as exc:
            raise RuntimeError(f"the Ray spectral workers could not start: {_cause(exc)} — the model's class and "
                               "nsa_dist must be importable on every worker (runtime_env py_modules / working_dir, "
                               "see deploy/README.md)") from exc

    def _least_busy(self) -> Any:
        load = {id(w): 0 for w in self.workers}
        for _, _, _, w in self.inflight.values():
            load[id(w)] += 1
        return min(self.workers, key=lambda w: load[id(w)])

    def _send(self, ck_ref: Any, step: int, attempts: int) -> None:
        w = self._least_busy()
        self.inflight[w.analyze_and_write.remote(ck_ref)] = (ck_ref, step, attempts, w)

    def submit(self, ck: Any) -> None:
        """Hand checkpoint ``ck`` to a worker; returns at once."""
        self._send(ray.put(ck), ck.step, 0)

    def wait(self, block: bool) -> list[dict]:
        """Summaries of finished steps (at least one if ``block`` and any is in flight).

        Raises:
            AnalysisError: a step's analysis failed (the worker's exception chained as its cause),
                or its worker died more than ``max_retries`` times.
        """
        if not self.inflight:
            return []
        ready, _ = ray.wait(list(self.inflight), num_returns=1 if block else len(self.inflight),
                            timeout=None if block else 0)
        out = []
        for ref in ready:
            ck_ref, step, attempts, worker = self.inflight.pop(ref)
            try:
                out.append(ray.get(ref))
            except RayActorError as exc:
                if attempts >= self.max_retries:
                    raise AnalysisError(f"run {self.run!r}: the analysis of recorded step {step} failed: its "
                                        f"spectral worker died {attempts + 1} times", step) from exc
                self._await_restart(worker)
                self.resubmitted += 1
                self._send(ck_ref, step, attempts + 1)
            except Exception as exc:  # noqa: BLE001 - the analysis's own error, unwrapped from Ray's wrapper
                cause = _cause(exc)
                if isinstance(cause, LeaseLost):  # not the analysis's failure: another writer has the run
                    raise cause from None
                raise analysis_error(self.run, step, cause) from cause
        return out

    @staticmethod
    def _await_restart(worker: Any, timeout: float = 120.0) -> None:
        """Block until Ray has restarted a dead worker (tasks sent before that fail at once)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                ray.get(worker.pid.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return
            except (RayActorError, GetTimeoutError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a spectral worker did not restart within {timeout:.0f} s") from None
                time.sleep(0.2)

    def close(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers, self.inflight = [], {}
