"""One run's life as its writer, from the lease to ``done``: the run lifecycle every role shares.

The single-process runner, the Tracker and the sweep coordinator all open a run the same way and
end it the same way; only where the checkpoints come from and where they are analysed differ:

1. :meth:`RunSession.open` takes (or waits for) the run's writer lease — unless the caller holds
   one over several runs (a sweep) and passes its token — then :func:`prepare_run`: plans the
   run on its data, creates the run or reopens it (refusing other data: the fingerprint check),
   pins the layout the run was created with and writes the static arrays.
2. :meth:`RunSession.start` sets ``running`` once the caller's workers are ready;
   :meth:`RunSession.todo` / :attr:`RunSession.done` say which recorded steps are still to do,
   :meth:`RunSession.commit` writes one step's result (or :meth:`RunSession.mark_done` notes one a
   worker wrote).
3. The end: :meth:`RunSession.end` maps how the run stopped to its status — success → ``done`` with
   the post-run arrays (:func:`finish_run`), Ctrl-C / SIGTERM → ``interrupted``, a lost lease →
   nothing (the run is another writer's now), an error → ``failed`` with its cause (and the
   step, for a diverged run) — and gives the lease back if the session took it.  Used as a
   context manager, the session ends itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from nsa_dist.config import ExperimentSpec, Layout, spec_as_today
from nsa_dist.data import Dataset
from nsa_dist.errors import AnalysisError, StoreError
from nsa_dist.metrics import spectrum_preservation
from nsa_dist.metrics.preservation import preservation_pair
from nsa_dist.pipeline.budget import check_fits
from nsa_dist.pipeline.checkpoint import Checkpoint
from nsa_dist.pipeline.diagnostics import StepNotes
from nsa_dist.pipeline.materials import RunMaterials
from nsa_dist.pipeline.nsa_extras import write_constant_gram
from nsa_dist.pipeline.plan import RunPlan, _tracked, plan_run, run_id, spec_json
from nsa_dist.pipeline.trainer import TrainingDiverged
from nsa_dist.store import Lease, LeaseLost, RunRefused, RunWriter, SpectrumStore, Status, StepResult

log = logging.getLogger(__name__)

__all__ = ["PreparedRun", "RunSession", "failure_reason", "finish_run", "pin_layout", "prepare_run"]


@dataclass
class PreparedRun:
    """A run whose store group exists with its static arrays written, and its plan (with the layout
    the run was created with)."""

    plan: RunPlan
    data: Dataset
    writer: RunWriter
    materials: RunMaterials  # the run's data and network in this process (the roles' copies come from it)

    @property
    def run_id(self) -> str:
        return self.plan.run_id


def prepare_run(
    spec: ExperimentSpec,
    store: SpectrumStore,
    token: str | None = None,
    model: torch.nn.Module | Callable[[], torch.nn.Module] | None = None,
    *,
    data: Dataset | None = None,
    key: str | None = None,
    gang_in_process: bool = False,
) -> PreparedRun:
    """Plan the run on its data, create (or reopen and check) the run's group.

    The run records its data's fingerprint when created; reopened with other data (a file
    replaced at the same path) it is refused (StoreError naming the data and both
    fingerprints).  The first to open the run records its layout (and why); everyone after — a
    resumed run, every Ray worker given the plan — uses the recorded one.  ``token``: the writer
    lease's token, fencing every write of the run.  ``model``: the caller's network (a Tracker's;
    a callable is called first thing, to build it), else the run's prototype is built once
    (:class:`~nsa_dist.pipeline.materials.RunMaterials`).  ``data``: the run's points when the
    caller has them (a Tracker's arrays), else loaded from ``spec.data`` — again, even if this
    process loaded them before: the run is checked against what is there now.  ``key``: the
    spec's run id when the caller computed it (for the lease).  ``gang_in_process``: a gang layout's
    members will all live in this process (``nsa run``, a Tracker), which ``layout: auto`` weighs
    (:func:`~nsa_dist.pipeline.layout.choose_layout`).
    """
    if callable(model) and not isinstance(model, torch.nn.Module):
        model = model()
    materials = RunMaterials.load(spec, data=data, model=model, fresh=data is None, key=key)
    plan, data = plan_run(spec, materials=materials, gang_in_process=gang_in_process), materials.data
    # the check before the data was loaded knew only the spec: now the measured feature width, the
    # built network's P and the layout the run will have (a resumed run's recorded one), before the
    # run's group is created
    check_fits(spec, gang_in_process, layout=_recorded_layout(store, plan), width=plan.feature_width, P=plan.dims.P)
    fingerprint = data.fingerprint()
    writer = store.writer(
        plan.run_id, plan.spec_json, plan.dims, data_fingerprint=fingerprint, token=token, normalize=spec_as_today
    )
    # a run recorded by an earlier nsa-dist goes on with its arrays (the switches named since off)
    plan = replace(pin_layout(writer, plan), data_fingerprint=fingerprint, dims=writer.dims)
    if not writer.static_complete() or writer.attr("data_meta") is None:
        # the loader's constants (x_mean, x_std of standardised inputs, …): X in the store is what the
        # network saw, and the images and Fourier transforms are taken in the original coordinates (a
        # run recorded before they were kept gets them when reopened: its data's fingerprint was checked)
        writer.set_attrs(data_meta=json.loads(json.dumps(data.meta, default=str)))
    if not writer.static_complete():  # new, made by a process killed before this, or repaired by nsa verify
        writer.write_static(plan.static_arrays(data))
    return PreparedRun(plan, data, writer, materials)


def stored_run_id(
    store: SpectrumStore, spec: ExperimentSpec, key: str | None = None, known: list[str] | None = None
) -> str:
    """The id ``spec``'s run has in ``store``: :func:`run_id` — or, when no run has it, the one run
    of the spec's name whose stored spec is ``spec`` as an earlier nsa-dist recorded it (fields added
    since then enter the hash: such a run was started again from step 0 under a new id, the old one
    left "interrupted … re-run to resume" for ever).  ``known``: the store's run ids, when the caller
    has listed them (a sweep's driver, once for all its runs)."""
    key = key or run_id(spec)
    if _tracked(spec) or (key in known if known is not None else store.has_run(key)):  # a Tracker's id: its name
        return key
    known = store.run_ids() if known is None else known
    want, found = spec_json(spec), []
    for rid in known:
        if not rid.startswith(f"{spec.name}-") or len(rid) != len(key):
            continue
        try:
            stored = store.reader(rid).attrs.get("spec")
        except Exception:  # noqa: BLE001 - a damaged run is none to resume here (verify and ls name it)
            continue
        if isinstance(stored, dict) and spec_as_today(stored) == want:
            found.append(rid)
    if len(found) == 1:
        log.info("run %s: its spec's run, recorded by an earlier nsa-dist under the id %s, is resumed", key, found[0])
        return found[0]
    return key


def _recorded_layout(store: SpectrumStore, plan: RunPlan) -> Layout:
    """The layout the run was created with, else (a new run, or one whose attributes cannot be
    read — the writer then names what is wrong) the plan's."""
    if store.has_run(plan.run_id):
        try:
            stored = store.reader(plan.run_id).attrs.get("layout")
        except StoreError:
            stored = None
        if stored:
            return Layout(stored)
    return plan.layout.layout


def pin_layout(writer: RunWriter, plan: RunPlan) -> RunPlan:
    """The plan with the run's recorded layout; the first to open the run records its own."""
    writer.set_attrs(ntk_paths=plan.ntk_paths)  # which parameter took which NTK path, and why
    stored = writer.attr("layout")
    if stored:
        return plan.with_layout(stored, writer.attr("layout_reason") or "recorded with the run")
    writer.set_attrs(layout=plan.layout.layout.value, layout_reason=plan.layout.reason, **plan.energy_attrs())
    return plan


def failure_reason(exc: BaseException) -> tuple[str, int | None]:
    """The ``failed`` status's reason and step for ``exc``: a diverged run's or a step analysis's
    own message and step; any other error as ``Type: message``."""
    if isinstance(exc, (TrainingDiverged, AnalysisError)):
        return str(exc), exc.step
    return f"{type(exc).__name__}: {exc}", None


@dataclass
class RunSession:
    """One run opened for writing: its plan, data and writer, the steps still to do, and its end.

    Attributes:
        prepared: the plan (with the pinned layout), the data and the writer.
        lease: the writer lease this session took (given back when it ends); None when the caller
            holds the run's lease (a sweep's driver holds all of its runs').
        hint: how to continue an unfinished run, appended to an ``interrupted`` reason.
        done: which recorded steps are in the store (kept up to date by commit / mark_done).
    """

    prepared: PreparedRun
    lease: Lease | None = None
    hint: str = "re-run to resume"
    done: np.ndarray = field(init=False)
    started: bool = field(default=False, init=False)
    ended: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.done = self.writer.done()

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(
        cls,
        spec: ExperimentSpec,
        store: SpectrumStore,
        *,
        token: str | None = None,
        wait: float | None = 0.0,
        data: Dataset | None = None,
        model: torch.nn.Module | None = None,
        hint: str = "re-run to resume",
        key: str | None = None,
        gang_in_process: bool = False,
    ) -> RunSession:
        """Take the run's lease (unless ``token``, the caller's lease, is given) and prepare the run.

        Args:
            wait: seconds to wait for another writer's lease (0: refuse at once with
                :class:`~nsa_dist.store.LeaseHeld`; None: for ever).
            data, model: as :func:`prepare_run` (a callable ``model`` is built once the lease is taken).
            hint: how to continue the run after an interruption (the ``interrupted`` reason's tail).
            key: the spec's run id when the caller computed it (a sweep's driver, for its lease).
            gang_in_process: as :func:`prepare_run`.

        Raises:
            LeaseHeld: another live process writes the run.
            StoreError: the store holds the run with another spec, schema or data (the lease taken
                is handed back as it was).
        """
        key = stored_run_id(store, spec, key)
        lease = None if token is not None else store.lease([key], wait=wait).acquire()
        try:
            prepared = prepare_run(
                spec, store, lease.token if lease else token, model, data=data, key=key, gang_in_process=gang_in_process
            )
            return cls(prepared, lease, hint)  # reads the done flags: a damaged chunk of them gives the lease back
        except BaseException as exc:
            if lease is not None:
                lease.hand_back() if isinstance(exc, RunRefused) else lease.release()
            raise

    @classmethod
    def open_all(
        cls, specs: list[ExperimentSpec], store: SpectrumStore, *, wait: float | None = 0.0
    ) -> tuple[Lease, list[RunSession]]:
        """Take one lease over every run of ``specs`` (a sweep's driver holds them all; its workers
        write with its token), then open each run under it; the caller releases the lease.

        Raises:
            LeaseHeld, StoreError: as :meth:`open` (the lease is released).
        """
        known = store.run_ids()
        keys = [stored_run_id(store, s, known=known) for s in specs]
        lease = store.lease(list(dict.fromkeys(keys)), wait=wait).acquire()
        try:
            sessions = []
            for spec, k in zip(specs, keys):
                try:
                    sessions.append(cls.open(spec, store, token=lease.token, key=k))
                except ValueError as exc:
                    if type(exc) is not ValueError or len(specs) == 1:
                        raise
                    # a refusal of one grid run's spec (a distributed layout for a coupling model): which run
                    raise ValueError(f"run {spec.name!r}: {exc}") from exc
            for s in sessions:  # the driver trains none of them: no network per run held for the sweep
                s.prepared.materials.drop_network()
            return lease, sessions
        except BaseException:
            lease.release()
            raise

    @property
    def plan(self) -> RunPlan:
        return self.prepared.plan

    @property
    def data(self) -> Dataset:
        return self.prepared.data

    @property
    def writer(self) -> RunWriter:
        return self.prepared.writer

    @property
    def spec(self) -> ExperimentSpec:
        return self.prepared.plan.spec

    @property
    def run_id(self) -> str:
        return self.prepared.run_id

    @property
    def token(self) -> str | None:
        return self.writer.token

    # ------------------------------------------------------------------ the steps
    def todo(self) -> list[int]:
        """The recorded steps' indices not in the store yet."""
        return [int(i) for i in np.flatnonzero(~self.done)]

    def complete(self) -> bool:
        """Whether every recorded step is in the store."""
        return bool(self.done.all())

    def start(self) -> None:
        """Status ``running`` (once the caller's trainer and workers are ready)."""
        self.writer.set_status(Status.RUNNING)
        self.started = True

    def commit(self, ck: Checkpoint, result: StepResult) -> None:
        """Write recorded step ``ck.index``'s result with its trainer state."""
        self.writer.write_step(ck.index, result, ck.state)
        self.done[ck.index] = True

    def mark_done(self, index: int) -> None:
        """Note recorded step ``index`` as written (by a worker, with this session's token)."""
        self.done[index] = True

    # ------------------------------------------------------------------ the end
    def finish(self) -> None:
        """Status ``done`` with the post-run arrays (:func:`finish_run`)."""
        finish_run(self.writer, self.spec)
        self.ended = True

    def fail(self, cause: BaseException | str, step: int | None = None) -> str:
        """Status ``failed`` with ``cause`` (a reason, or an exception as :func:`failure_reason`
        words it) and the step it happened at; returns the reason.  A diverged run's losses since
        its last checkpoint (:class:`TrainingDiverged`'s ``loss_trace``) are written first, so
        that its loss curve reaches the step it diverged at."""
        reason, at = (cause, step) if isinstance(cause, str) else failure_reason(cause)
        if isinstance(cause, TrainingDiverged) and len(cause.loss_trace):
            self.writer.write_trace(cause.trace_start, cause.loss_trace)
        self.writer.set_status(Status.FAILED, reason, at if step is None else step)
        self.ended = True
        return reason

    def interrupt(self, reason: str | None = None, cause: type[BaseException] | None = None) -> None:
        """Status ``interrupted``: ``reason``, or "interrupted (Cause); " and the session's hint."""
        self.writer.set_status(Status.INTERRUPTED, reason or f"interrupted ({cause.__name__}); {self.hint}")
        self.ended = True

    def pause(self, reason: str) -> None:
        """Status ``pending`` with ``reason`` (closed before every recorded step was given)."""
        self.writer.set_status(Status.PENDING, reason)
        self.ended = True

    def end(self, exc: BaseException | None = None) -> None:
        """Set the status of how the run stopped (unless already set): None → ``done`` with the
        post-run arrays; KeyboardInterrupt / SystemExit (SIGTERM) → ``interrupted``; LeaseLost →
        nothing (another writer has the run); any other error → ``failed`` with its cause.  An
        error before :meth:`start` leaves the status as it was (nothing ran).  Then give the lease
        back if this session took it."""
        try:
            if self.ended or isinstance(exc, LeaseLost) or (exc is not None and not self.started):
                return
            if exc is None:
                self.finish()
            elif isinstance(exc, (KeyboardInterrupt, SystemExit)):
                self.interrupt(cause=type(exc))
            else:
                self.fail(exc)
        finally:
            self.ended = True
            self.release()

    def release(self) -> None:
        """Give back the lease this session took (no-op when the caller holds it)."""
        if self.lease is not None:
            self.lease.release()

    def __enter__(self) -> RunSession:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.end(exc)


def finish_run(writer: RunWriter, spec: ExperimentSpec) -> None:
    """After the last step: spectrum preservation and Eqs. 4–5's prediction, status done.

    Both are diagnostics: one that cannot be computed is left out, its reason in the run's
    ``post_run_notes`` attribute (``{array: reason}``, one log line), and the run is still done."""
    notes = StepNotes(writer.run_id, None)
    notes.guard(("preservation",), _write_preservation, writer, spec)
    notes.guard(("constant_gram_residual", "constant_gram_energy"), write_constant_gram, writer, spec)
    writer.set_attrs(post_run_notes=notes.reasons)
    writer.set_status(Status.DONE)


def post_run_complete(writer: RunWriter, spec: ExperimentSpec) -> bool:
    """Whether a ``done`` run holds every post-run array :func:`finish_run` writes for it, none of them
    noted as not computed — then a re-run leaves it as it is (each array is re-created before its
    data is written: a kill in between lost it); else a re-run finishes it again (an array removed by
    ``nsa verify --mark``, a run of an older nsa-dist, a diagnostic that failed)."""
    if writer.attr("status") != Status.DONE or writer.attr("post_run_notes"):
        return False
    want = ["constant_gram_residual", "constant_gram_energy"] if writer.dims.constant_gram else []
    if spec.spectrum.store_eigenvectors and writer.dims.S >= 2:
        at = [int(i) for i in np.flatnonzero(writer.store.reader(writer.run_id).read("eigenvector_steps"))]
        if preservation_pair(at, listed=isinstance(spec.spectrum.store_eigenvectors, list)) is not None:
            want.append("preservation")
    return all(name in writer.g for name in want)


def _write_preservation(writer: RunWriter, spec: ExperimentSpec) -> None:
    """E_{t1}(v_i^{t2}, k) between the steps :func:`~nsa_dist.metrics.preservation.preservation_pair`
    picks among those the run's stored ``eigenvector_steps`` mask marks (NSA Fig. 7d: the second
    and the last recorded step; with a ``store_eigenvectors`` list, its first and last step) — the
    rule ``Run.spectrum_preservation`` reads with."""
    if not spec.spectrum.store_eigenvectors or writer.dims.S < 2:
        return
    reader = writer.store.reader(writer.run_id)
    steps = reader.read("steps")
    at = [int(i) for i in np.flatnonzero(reader.read("eigenvector_steps"))]
    pair = preservation_pair(at, listed=isinstance(spec.spectrum.store_eigenvectors, list))
    if pair is None:
        return
    i1, i2 = pair
    V1, V2 = reader.read_step("eigenvectors", i1), reader.read_step("eigenvectors", i2)
    rows = sorted({i for i in spec.spectrum.images if i <= V2.shape[1]} | {1})
    P = spectrum_preservation(V1.astype(np.float64), V2.astype(np.float64), i=rows)
    writer.write_array(
        "preservation", np.asarray(P, dtype=np.float64), {"t1": int(steps[i1]), "t2": int(steps[i2]), "rows": rows}
    )
