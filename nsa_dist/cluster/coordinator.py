"""Schedules the runs of a sweep over a Ray cluster: trainer actors, a spectral-worker pool.

Data flow per run: ``trainer.checkpoint(i)`` → a Checkpoint in the object store (numpy,
zero-copy) → ``worker.analyze_and_write(plan, ckpt_ref)`` → chunks of step i in the store.
The coordinator never fetches checkpoints; it only hands object refs on, keeps at most
``max_inflight`` checkpoints of a run waiting, records run status in the store and re-submits
a (run, step) whose worker died.  Re-running a sweep skips finished steps.  Every write — the
driver's, its trainers' and workers' — is fenced by the driver's lease token: once another driver
took a run over, the sweep stops with :class:`~nsa_dist.store.LeaseLost` and writes nothing more.
When this machine's raylet stops (killed, out of memory, the embedded Ray gone), the sweep stops
with :class:`~nsa_dist.cluster.runtime.RayletLost`: its runs are *interrupted*, not failed (the
actors died with the raylet, not of anything in the runs), and a re-run resumes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayActorError, RayTaskError

from nsa_dist.cluster.actors import spectral_workers, trainer_actor
from nsa_dist.cluster.gang import RayGang
from nsa_dist.cluster.pool import Analysis, DispatchQueue, RayAnalysisPool, task_cause
from nsa_dist.cluster.resources import check_resources, resolve_gpus, resource_demand, threads
from nsa_dist.cluster.runtime import (
    RAYLET_GRACE,
    RayletLost,
    alive_nodes,
    cluster_has_gpus,
    quiet_ray_at_exit,
    raylet_lost,
)
from nsa_dist.config import ExperimentSpec, SweepSpec
from nsa_dist.errors import ResourceError
from nsa_dist.pipeline import RunOutcome, RunPlan, RunSession, TrainingDiverged, layout as _layout
from nsa_dist.pipeline.budget import check_fits, footprint
from nsa_dist.pipeline.notes import replay_notes
from nsa_dist.store import LeaseLost, RunWriter, SpectrumStore, Status

log = logging.getLogger(__name__)

__all__ = ["SweepCoordinator", "RunProgress"]


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
    session: RunSession  # the run opened under the driver's lease: plan, writer, steps done, statuses
    progress: RunProgress
    gang_size: int = 0  # members of this run's step gang (0: layout local, one worker holds G)
    trainer: Any = None
    next_index: int = 0
    pending: Any = None  # ObjectRef of the checkpoint being trained towards
    pending_index: int = -1
    analyses: DispatchQueue | None = None  # its checkpoints queued for / sent to a worker, once it runs
    diverged: TrainingDiverged | None = None  # set once training diverged: drain, then fail

    @property
    def spec(self) -> ExperimentSpec:
        return self.session.spec

    @property
    def plan(self) -> RunPlan:
        return self.session.plan

    @property
    def writer(self) -> RunWriter:
        return self.session.writer

    @property
    def done(self) -> np.ndarray:
        return self.session.done

    @property
    def inflight(self) -> dict[Any, Analysis]:
        """The analyses sent and not yet handed back (ref -> record)."""
        return self.analyses.running if self.analyses is not None else {}


def _from_ray(exc: BaseException) -> bool:
    """Whether ``exc`` is one of Ray's own errors (an actor or the system failed, not a run)."""
    return any(c.__module__.split(".")[0] == "ray" for c in type(exc).__mro__)


def _where(active: list[_Run]) -> str:
    """Where the runs in progress stand, for :class:`RayletLost`'s one line: the last step seen
    analysed and the recorded steps the store holds done (a worker may have written one more
    than the driver heard of)."""
    parts = []
    for r in active:
        try:
            kept = int(r.writer.done().sum())
        except Exception:  # noqa: BLE001 - the count the driver saw will do
            kept = r.progress.done
        step = r.progress.step if r.progress.step is not None else 0
        parts.append(
            f"run {r.progress.run_id} is interrupted at step {step} ({kept} of {r.progress.total} recorded steps kept)"
        )
    return "; ".join(parts)


def _gang_sizes(runs: list[_Run]) -> list[int]:
    """The distinct gang sizes the runs' layouts need (one gang of each size is kept)."""
    return sorted({r.gang_size for r in runs if r.gang_size})


class SweepCoordinator:
    """Runs every run of ``sweep`` to completion on the connected Ray cluster.

    Analyses go to idle spectral workers (``ray.util.ActorPool``'s idle set); a worker that dies
    is restarted by Ray and its task retried there (``max_restarts`` / ``max_task_retries``).
    Runs whose ``spectrum.layout`` is distributed also take a *gang* of SpectralShard actors
    (one placement group, :class:`~nsa_dist.cluster.gang.RayGang`) for each step; a gang whose
    member dies mid-step is replaced by a fresh one and the step recomputed (idempotently), at
    most ``cluster.max_retries`` times.

    Args:
        sweep: the sweep (its ``cluster`` block sets workers, resources and in-flight bound).
        store_url: a store every node can reach (local path on one machine, ``s3://…`` on many).
        on_event: called with the list of RunProgress after every change (progress display).
    """

    def __init__(
        self,
        sweep: SweepSpec,
        store_url: str,
        on_event: Callable[[list[RunProgress]], None] | None = None,
        *,
        wait: float | None = 0.0,
    ) -> None:
        self.sweep, self.store_url, self.cl = sweep, store_url, sweep.cluster
        self.on_event = on_event or (lambda runs: None)
        specs = sweep.expand()
        for spec in specs:  # every run's memory estimate, before the store is touched or any model built
            check_fits(spec)
        self.store = SpectrumStore(store_url)
        self.runs: dict[str, _Run] = {}
        # this driver holds every run's writer lease (its workers write for it) until run() ends
        self.lease, sessions = RunSession.open_all(specs, self.store, wait=wait)
        try:
            for s in sessions:
                prog = RunProgress(s.run_id, len(s.done), int(s.done.sum()))
                gang = s.spec.spectrum.workers if s.plan.distributed else 0
                self.runs[s.run_id] = _Run(s, prog, gang)
            self.store.record_sweep(sweep.name, sweep.model_dump(mode="json"), list(self.runs))
        except BaseException:
            self.lease.release()
            raise
        self.pool: RayAnalysisPool | None = None  # the spectral workers, once run() needs them
        self.gangs: dict[int, list[RayGang]] = {}  # free gangs by size
        self._gangs_out: list[RayGang] = []  # gangs lent to an analysis
        self.replaced_gangs = 0

    def _say_not_started(self, exc: BaseException) -> None:
        """Give each run still pending (none of its steps done) the reason the sweep stopped before
        it began: they read ``pending`` with no word, like runs queued (audit Q: a sweep refused for
        not fitting the cluster)."""
        why = " ".join(str(exc).split()) or type(exc).__name__
        for r in self.runs.values():
            try:
                if r.writer.attrs().get("status", Status.PENDING) == Status.PENDING and not r.done.any():
                    r.writer.set_status(
                        Status.PENDING, reason=f"not started: the sweep stopped before any run began — {why}"
                    )
            except Exception as e:  # noqa: BLE001 - the sweep's own error is the one to raise
                log.warning("run %s: its not-started reason was not stored: %s", r.session.run_id, e)

    @property
    def resubmitted(self) -> int:
        """(run, step) analyses recomputed after a gang member died."""
        return sum(r.analyses.resubmitted for r in self.runs.values() if r.analyses is not None)

    # ------------------------------------------------------------------ main loop
    def run(self, poll: float = 0.5) -> list[RunOutcome]:
        """Schedule until every run is done or failed; returns one outcome per run."""
        try:  # refused here (the cluster block does not fit, a gang cannot be placed): nothing was run,
            # and the runs' leases go back, so that a corrected sweep in this process may write them
            has_gpus = cluster_has_gpus()
            todo = [r for r in self.runs.values() if not self._skip_if_finished(r)]
            if todo:
                sizes = _gang_sizes(todo)
                check_resources(
                    self.cl,
                    has_gpus,
                    ray.cluster_resources(),
                    sum(sizes),
                    min(len(todo), self.cl.max_concurrent_runs or len(todo)),
                    alive_nodes(),
                )
                self._check_gangs_share_node(todo)
                self.pool = RayAnalysisPool(spectral_workers(self.store_url, self.cl, has_gpus))
                for size in sizes:
                    self.gangs[size] = [self._new_gang(size, has_gpus)]
        except BaseException as exc:
            if self.pool is not None:
                self.pool.close()
            for g in [g for gs in self.gangs.values() for g in gs]:
                g.shutdown()
            self.gangs.clear()
            self._say_not_started(exc)
            self.lease.release()
            raise
        self._has_gpus = has_gpus
        limit = self.cl.max_concurrent_runs or len(todo)
        active: list[_Run] = []
        interrupted = "sweep interrupted; re-run to resume"
        try:
            while todo or active:
                self._check_raylet(active)
                while todo and len(active) < limit:
                    r = todo.pop(0)
                    r.trainer = trainer_actor(r.plan, self.store_url, self.cl, has_gpus, self.lease.token)
                    r.analyses = self._queue(r)
                    r.session.start()
                    r.progress.status = Status.RUNNING
                    active.append(r)
                for r in active:
                    self._request_checkpoints(r)
                    r.analyses.dispatch()
                self._wait_and_handle(active, poll)
                for r in [r for r in active if r.progress.status in (Status.DONE, Status.FAILED)]:
                    active.remove(r)
                    if r.trainer is not None:
                        ray.kill(r.trainer, no_restart=True)
                        r.trainer = None
                self.on_event(self.progress())
        except RayletLost as exc:
            interrupted = f"interrupted: Ray's {exc.cause}; re-run to resume"
            quiet_ray_at_exit()
            raise
        except Exception as exc:  # a Ray error of a raylet gone under it is its cause's, not the runs'
            # any error while this machine's raylet is found dead is its: a killed raylet also
            # surfaced as a bare ConnectionResetError from Ray's sockets (rc 2, "Connection reset by
            # peer", instead of the interrupted line); only a Ray error asks a joined cluster
            cause = raylet_lost(ask_cluster=_from_ray(exc), grace=RAYLET_GRACE)
            if cause is None:
                raise
            interrupted = f"interrupted: Ray's {cause}; re-run to resume"
            quiet_ray_at_exit()
            raise RayletLost(cause, _where(active)) from exc
        finally:
            lost = interrupted.startswith("interrupted:")  # the actors went with the node: none to stop
            for r in active:
                if r.trainer is not None and not lost:
                    ray.kill(r.trainer, no_restart=True)
                try:
                    r.session.interrupt(interrupted)
                except LeaseLost:
                    pass  # another driver has the run: it says how it stands
            if self.pool is not None and not lost:
                self.pool.close()
            for g in [] if lost else [g for gs in self.gangs.values() for g in gs] + self._gangs_out:
                g.shutdown()
            self.lease.release()
        return [RunOutcome(r.progress.run_id, r.progress.status, r.progress.reason) for r in self.runs.values()]

    def demand(self, has_gpus: bool = False) -> dict[str, float]:
        """Resources for every actor of this sweep at once (pool, one gang per size, one trainer per
        concurrent run): what an embedded Ray is started with."""
        runs = list(self.runs.values())
        trainers = min(len(runs), self.cl.max_concurrent_runs or len(runs))
        return resource_demand(self.cl, has_gpus, sum(_gang_sizes(runs)), max(1, trainers))

    def close(self) -> None:
        """Give the runs' leases back without running (``run`` does this itself when it ends)."""
        self.lease.release()

    def layouts(self) -> dict[str, tuple[str, str]]:
        """Each run's spectrum layout and why it was chosen (resolved once, recorded with the run)."""
        return {rid: (r.writer.attr("layout"), r.writer.attr("layout_reason")) for rid, r in self.runs.items()}

    def progress(self) -> list[RunProgress]:
        return [r.progress for r in self.runs.values()]

    def _check_gangs_share_node(self, todo: list[_Run]) -> None:
        """ResourceError for a distributed run whose whole gang cannot fit this machine when it is the
        cluster's one node (an embedded ``nsa sweep``): every member's part of G is then in this
        machine's memory together — ``check_fits`` weighed one member — and the members would be
        killed for memory at the first step, step after step, ending in "a member died" only."""
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if len(nodes) != 1 or nodes[0].get("NodeID") != ray.get_runtime_context().get_node_id():
            return  # members on several machines (or a node that is not this one): one member each is weighed
        machine = _layout._machine_bytes()
        for r in todo:
            if not r.gang_size or r.gang_size < 2:
                continue
            p = r.plan
            fp = footprint(r.spec, True, layout=p.layout.layout, width=p.feature_width, P=p.dims.P)
            if fp.total > machine:
                raise ResourceError(
                    f"run {r.progress.run_id!r}: its gang of {r.gang_size} spectral workers "
                    f"({p.layout.layout.value}) all run on this Ray cluster's one node, this machine, "
                    f"and need ~{fp.total / 1e9:.3g} GB on it together ({fp.describe()}), more than its "
                    f"{machine / 1e9:.3g} GB; lower data.n, use spectrum.layout 'matrix_free', or run "
                    "on a Ray cluster of several machines"
                )

    def _new_gang(self, size: int, has_gpus: bool) -> RayGang:
        return RayGang(
            size,
            self.cl.worker_cpus,
            resolve_gpus(self.cl.worker_gpus, has_gpus, 0.5),
            self.cl.worker_resources,
            threads=threads(self.cl.worker_cpus),
        )

    def _skip_if_finished(self, r: _Run) -> bool:
        if r.done.all():
            if r.writer.attrs().get("status") != Status.DONE or not r.writer.has("preservation"):
                r.session.finish()  # also a run whose driver died between its last step and this
            r.progress.status = Status.DONE
            return True
        return False

    def _request_checkpoints(self, r: _Run) -> None:
        while (
            r.pending is None
            and len(r.analyses) < self.cl.max_inflight
            and r.progress.status == Status.RUNNING
            and r.diverged is None
        ):
            while r.next_index < len(r.done) and r.done[r.next_index]:
                r.next_index += 1
            if r.next_index >= len(r.done):
                return
            r.pending, r.pending_index = r.trainer.checkpoint.remote(r.next_index), r.next_index
            r.next_index += 1

    def _queue(self, r: _Run) -> DispatchQueue:
        """Run ``r``'s queue to the spectral workers: each step with the run's plan, a free gang
        of the run's size when its layout needs one, and the driver's lease token."""

        def lend(a: Analysis) -> bool:  # a free gang of the run's size, or wait for one
            if not r.gang_size:
                return True
            free = self.gangs.get(r.gang_size, [])
            if not free:
                return False
            a.gang = free.pop()
            self._gangs_out.append(a.gang)
            return True

        def args(a: Analysis) -> tuple:
            return r.plan, a.ckpt, a.gang.members if a.gang else None, self.lease.token

        retries = self.cl.max_retries
        return DispatchQueue(self.pool, args, lend=lend, give_back=self._give_gang_back, max_retries=retries)

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
                r.analyses.put(Analysis(r.progress.run_id, index, ref))
            else:
                self._analysis_done(r, ref)

    def _give_gang_back(self, a: Analysis, broken: bool) -> None:
        """``a``'s gang back to the free list (``broken``: a member died mid-step, so the gang's
        state is gone and a fresh gang takes its place)."""
        gang, a.gang = a.gang, None
        if gang is None:
            return
        self._gangs_out.remove(gang)
        if broken:
            size = gang.members.size
            gang.shutdown()
            gang = self._new_gang(size, self._has_gpus)
            self.replaced_gangs += 1
        self.gangs.setdefault(gang.members.size, []).append(gang)

    def _check_raylet(self, active: list[_Run], ask_cluster: bool = False) -> None:
        """Raise :class:`RayletLost` when this machine's raylet stopped (before any of its actors'
        deaths is taken for the runs' failure)."""
        cause = raylet_lost(ask_cluster)
        if cause is not None:
            raise RayletLost(cause, _where(active))

    def _analysis_done(self, r: _Run, ref: Any) -> None:
        a, summary, exc = r.analyses.take(ref)
        if exc is not None:
            self._analysis_failed(r, a, exc)
            return
        r.session.mark_done(a.index)
        p = r.progress
        replay_notes(p.run_id, summary.get("notes"), log)
        p.done = int(r.done.sum())
        if p.step is None or summary["step"] >= p.step:  # analyses may finish out of order
            p.step, p.loss, p.lambda_max = summary["step"], summary["loss"], summary["lambda_max"]
        if r.diverged is not None:
            self._finish_diverged(r)
        elif r.done.all() and not r.analyses:
            r.session.finish()
            p.status = Status.DONE

    def _analysis_failed(self, r: _Run, a: Analysis, exc: Exception) -> None:
        """Judge the error ``ray.get`` raised for ``a`` (whose worker and gang are still held)."""
        running = [x for x in self.runs.values() if x.progress.status == Status.RUNNING]
        if isinstance(exc, RayTaskError):  # the checkpoint or the analysis raised
            cause = task_cause(exc)
            if _from_ray(cause):
                self._check_raylet(running, True)
            if isinstance(cause, LeaseLost):  # another driver took the run over: stop, write nothing
                r.analyses.release(a)
                raise cause from None
            if isinstance(cause, RayActorError):
                if a.gang is not None and a.gang.member_died(cause):  # a gang member died mid-step
                    if not r.analyses.retry(a):  # the one retry Ray has no primitive for: a fresh gang recomputes
                        died = f"a spectral-gang member died {a.attempts + 1} times"
                        self._fail(r, RuntimeError(f"step index {a.index}: {died}"))
                    return
                # another actor the step needed (its trainer, restarts spent) is dead: its gang is whole
                r.analyses.release(a)
                self._fail(r, self._kept_dying(r, a, cause))
                return
            r.analyses.release(a)
            if isinstance(cause, TrainingDiverged):  # keep the earlier steps still being analysed
                r.diverged, r.pending = cause, None
                self._finish_diverged(r)
            else:  # incl. a trainer that cannot be restarted (its constructor raised)
                self._fail(r, cause)
        elif isinstance(exc, RayActorError):  # Ray's restarts and task retries are spent: the run fails
            self._check_raylet(running, True)
            r.analyses.release(a, broken=a.gang is not None)
            self._fail(r, self._kept_dying(r, a, exc))
        else:  # another of Ray's errors: the main loop asks whether the raylet is gone
            raise exc

    def _kept_dying(self, r: _Run, a: Analysis, exc: BaseException) -> RuntimeError:
        """The run's error once Ray's restarts of the actor a step needed are spent: which actor."""
        who = "its trainer" if self._trainer_dead(r) else "the spectral worker"
        return RuntimeError(
            f"step index {a.index}: {who} kept dying (after cluster.max_retries="
            f"{self.cl.max_retries} restarts): {type(exc).__name__}"
        )

    @staticmethod
    def _trainer_dead(r: _Run) -> bool:
        if r.trainer is None:
            return False
        try:
            ray.get(r.trainer.pid.remote(), timeout=30)
            return False
        except (RayActorError, ray.exceptions.GetTimeoutError):
            return True

    def _finish_diverged(self, r: _Run) -> None:
        """Once the analyses in flight before the divergence are written, mark the run failed."""
        if not r.analyses.running:
            r.analyses.queued.clear()
            self._fail(r, r.diverged)

    def _fail(self, r: _Run, exc: BaseException) -> None:
        reason = r.session.fail(exc)  # a diverged run: its message and step; else "Type: message"
        r.progress.status, r.progress.reason = Status.FAILED, reason
        r.analyses.cancel()
        r.pending = None
