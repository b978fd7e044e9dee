"""Schedules the runs of a sweep over a Ray cluster: trainer actors, a spectral-worker pool.

Data flow per run: ``trainer.checkpoint(i)`` → a Checkpoint in the object store (numpy,
zero-copy) → ``worker.analyze_and_write(run, spec, ckpt_ref)`` → chunks of step i in the store.
The coordinator never fetches checkpoints; it only hands object refs on, keeps at most
``max_inflight`` checkpoints of a run waiting, records run status in the store and re-submits
a (run, step) whose worker died.  Re-running a sweep skips finished steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import ray
from ray.exceptions import RayActorError, RayTaskError

from nsa_dist.config import ClusterSpec, ExperimentSpec, SweepSpec
from nsa_dist.cluster.actors import resolve_gpus, spectral_workers, trainer_actor
from nsa_dist.cluster.runtime import cluster_has_gpus
from nsa_dist.pipeline import RunOutcome, TrainingDiverged, finish_run, prepare_run, spec_json
from nsa_dist.store import RunWriter, SpectrumStore, Status

__all__ = ["SweepCoordinator", "RunProgress", "check_resources"]


def check_resources(cl: ClusterSpec, has_gpus: bool, available: dict[str, float]) -> None:
    """Raise ValueError unless the cluster holds the worker pool plus one trainer.

    Ray would otherwise queue the actors forever (e.g. two 0.5-GPU workers and a 1-GPU trainer
    on a one-GPU machine, or a custom resource no node has).
    """
    need: dict[str, float] = {"CPU": cl.spectral_workers * cl.worker_cpus + cl.trainer_cpus,
                              "GPU": cl.spectral_workers * resolve_gpus(cl.worker_gpus, has_gpus, 0.5)
                              + resolve_gpus(cl.trainer_gpus, has_gpus, 1.0)}
    for key, v in cl.worker_resources.items():
        need[key] = need.get(key, 0.0) + cl.spectral_workers * v
    for key, v in cl.trainer_resources.items():
        need[key] = need.get(key, 0.0) + v
    short = {k: (v, available.get(k, 0.0)) for k, v in need.items() if v > available.get(k, 0.0) + 1e-9}
    if short:
        what = "; ".join(f"{k}: needs {v:g}, cluster has {a:g}" for k, (v, a) in short.items())
        raise ValueError(f"the sweep's cluster block does not fit this Ray cluster ({what}); lower "
                         "cluster.spectral_workers / worker_cpus / worker_gpus / trainer_cpus / trainer_gpus or "
                         "the *_resources, or add nodes")


@dataclass
class RunProgress:
    """What the progress table shows for one run."""

    run_id: str
    total: int
    done: int = 0
    step: int | None = None
    loss: float | None = None
    lambda_max: float | None = None
    status: str = Status.PENDING
    reason: str | None = None


@dataclass
class _Run:
    spec: ExperimentSpec
    spec_dict: dict
    writer: RunWriter
    done: np.ndarray
    progress: RunProgress
    trainer: Any = None
    next_index: int = 0
    pending: Any = None  # ObjectRef of the checkpoint being trained towards
    pending_index: int = -1
    inflight: dict = field(default_factory=dict)  # analysis ref -> (index, ckpt ref, attempts, worker)
    diverged: TrainingDiverged | None = None  # set once training diverged: drain, then fail


def _cause(exc: BaseException) -> BaseException:
    """The user exception inside a RayTaskError (e.g. TrainingDiverged), else exc itself."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class SweepCoordinator:
    """Runs every run of ``sweep`` to completion on the connected Ray cluster.

    Args:
        sweep: the sweep (its ``cluster`` block sets workers, resources and in-flight bound).
        store_url: a store every node can reach (local path on one machine, ``s3://…`` on many).
        on_event: called with the list of RunProgress after every change (progress display).
    """

    def __init__(self, sweep: SweepSpec, store_url: str,
                 on_event: Callable[[list[RunProgress]], None] | None = None) -> None:
        self.sweep, self.store_url, self.cl = sweep, store_url, sweep.cluster
        self.on_event = on_event or (lambda runs: None)
        self.store = SpectrumStore(store_url)
        self.runs: dict[str, _Run] = {}
        for spec in sweep.expand():
            prep = prepare_run(spec, self.store)
            done = prep.writer.done()
            prog = RunProgress(prep.run_id, len(done), int(done.sum()))
            self.runs[prep.run_id] = _Run(spec, spec_json(spec), prep.writer, done, prog)
        self.store.record_sweep(sweep.name, sweep.model_dump(mode="json"), list(self.runs))
        self.workers: list[Any] = []
        self._rr = 0
        self.resubmitted = 0  # (run, step) analyses re-sent after their worker died

    # ------------------------------------------------------------------ main loop
    def run(self, poll: float = 0.5) -> list[RunOutcome]:
        """Schedule until every run is done or failed; returns one outcome per run."""
        has_gpus = cluster_has_gpus()
        todo = [r for r in self.runs.values() if not self._skip_if_finished(r)]
        if todo:
            check_resources(self.cl, has_gpus, ray.cluster_resources())
            self.workers = spectral_workers(self.store_url, self.cl, has_gpus)
        limit = self.cl.max_concurrent_runs or len(todo)
        active: list[_Run] = []
        try:
            while todo or active:
                while todo and len(active) < limit:
                    r = todo.pop(0)
                    r.trainer = trainer_actor(r.spec_dict, self.store_url, self.cl, has_gpus)
                    r.writer.set_status(Status.RUNNING)
                    r.progress.status = Status.RUNNING
                    active.append(r)
                for r in active:
                    self._request_checkpoints(r)
                self._wait_and_handle(active, poll)
                for r in [r for r in active if r.progress.status in (Status.DONE, Status.FAILED)]:
                    active.remove(r)
                    if r.trainer is not None:
                        ray.kill(r.trainer, no_restart=True)
                        r.trainer = None
                self.on_event(self.progress())
        finally:
            for r in active:
                if r.trainer is not None:
                    ray.kill(r.trainer, no_restart=True)
                r.writer.set_status(Status.PENDING, "sweep interrupted; re-run to resume")
            for w in self.workers:
                ray.kill(w, no_restart=True)
        return [RunOutcome(r.progress.run_id, r.progress.status, r.progress.reason) for r in self.runs.values()]

    def progress(self) -> list[RunProgress]:
        return [r.progress for r in self.runs.values()]

    def _skip_if_finished(self, r: _Run) -> bool:
        if r.done.all():
            if r.writer.g.attrs.get("status") != Status.DONE:
                finish_run(r.writer, r.spec)
            r.progress.status = Status.DONE
            return True
        return False

    def _request_checkpoints(self, r: _Run) -> None:
        while (r.pending is None and len(r.inflight) < self.cl.max_inflight and r.progress.status == Status.RUNNING
               and r.diverged is None):
            while r.next_index < len(r.done) and r.done[r.next_index]:
                r.next_index += 1
            if r.next_index >= len(r.done):
                return
            r.pending, r.pending_index = r.trainer.checkpoint.remote(r.next_index), r.next_index
            r.next_index += 1

    def _submit(self, r: _Run, index: int, ck_ref: Any, attempts: int) -> None:
        worker = self.workers[self._rr % len(self.workers)]
        self._rr += 1
        ref = worker.analyze_and_write.remote(r.progress.run_id, r.spec_dict, ck_ref)
        r.inflight[ref] = (index, ck_ref, attempts, worker)
        self.resubmitted += attempts > 0

    def _wait_and_handle(self, active: list[_Run], poll: float) -> None:
        owner: dict[Any, tuple[_Run, str]] = {}
        for r in active:
            if r.pending is not None:
                owner[r.pending] = (r, "ckpt")
            for ref in r.inflight:
                owner[ref] = (r, "analysis")
        if not owner:
            time.sleep(poll / 10)
            return
        ready, _ = ray.wait(list(owner), num_returns=1, timeout=poll)
        for ref in ready:
            r, kind = owner[ref]
            if kind == "ckpt":  # hand the ref on without fetching the data here
                index, r.pending = r.pending_index, None
                self._submit(r, index, ref, 0)
            else:
                self._analysis_done(r, ref)

    def _analysis_done(self, r: _Run, ref: Any) -> None:
        index, ck_ref, attempts, _ = r.inflight.pop(ref)
        try:
            summary = ray.get(ref)
        except RayTaskError as exc:  # the checkpoint or the analysis raised
            cause = _cause(exc)
            if isinstance(cause, TrainingDiverged):  # keep the earlier steps still being analysed
                r.diverged, r.pending = cause, None
                self._finish_diverged(r)
            else:  # incl. a trainer that cannot be restarted (its constructor raised)
                self._fail(r, cause)
            return
        except RayActorError:  # the spectral worker died: recompute this (run, step) elsewhere
            if attempts < self.cl.max_retries:
                self._submit(r, index, ck_ref, attempts + 1)
                return
            self._fail(r, RuntimeError(f"step index {index}: spectral worker died {attempts + 1} times"))
            return
        r.done[index] = True
        p = r.progress
        p.done = int(r.done.sum())
        if p.step is None or summary["step"] >= p.step:  # analyses may finish out of order
            p.step, p.loss, p.lambda_max = summary["step"], summary["loss"], summary["lambda_max"]
        if r.diverged is not None:
            self._finish_diverged(r)
        elif r.done.all() and not r.inflight:
            finish_run(r.writer, r.spec)
            p.status = Status.DONE

    def _finish_diverged(self, r: _Run) -> None:
        """Once the analyses in flight before the divergence are written, mark the run failed."""
        if not r.inflight:
            self._fail(r, r.diverged)

    def _fail(self, r: _Run, exc: BaseException) -> None:
        step = exc.step if isinstance(exc, TrainingDiverged) else None
        reason = str(exc) if isinstance(exc, TrainingDiverged) else f"{type(exc).__name__}: {exc}"
        r.writer.set_status(Status.FAILED, reason, step)
        r.progress.status, r.progress.reason = Status.FAILED, reason
        for ref in list(r.inflight):
            ray.cancel(ref)
        r.inflight.clear()
        r.pending = None
