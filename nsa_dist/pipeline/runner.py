"""One experiment end to end on this machine: train, analyse each recorded step, write the store.

The three parts stay separate plain classes (Trainer, SpectralAnalyzer, RunWriter) so the Ray
layer can place them on different workers; this module is the single-process composition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nsa_dist.config import ExperimentSpec
from nsa_dist.pipeline.budget import check_fits
from nsa_dist.pipeline.checkpoint import Checkpoint, TrainerState
from nsa_dist.pipeline.materials import RunMaterials
from nsa_dist.pipeline.session import (
    PreparedRun,
    RunSession,
    finish_run,
    pin_layout,
    post_run_complete,
    prepare_run,
)
from nsa_dist.pipeline.spectral import SpectralAnalyzer
from nsa_dist.pipeline.trainer import Trainer, TrainingDiverged
from nsa_dist.store import SpectrumStore, Status

__all__ = ["PreparedRun", "RunOutcome", "finish_run", "pin_layout", "prepare_run", "run_experiment"]


@dataclass(frozen=True)
class RunOutcome:
    run_id: str
    status: str
    reason: str | None = None
    steps_computed: int = 0


def run_experiment(
    spec: ExperimentSpec,
    store: SpectrumStore | str,
    *,
    on_step: Callable[[Checkpoint, dict], None] | None = None,
    on_update: Callable[[int, float], None] | None = None,
    on_prepared: Callable[[PreparedRun], None] | None = None,
    wait: float | None = 0.0,
    key: str | None = None,
) -> RunOutcome:
    """Train ``spec`` and record its spectra in ``store`` (a :class:`SpectrumStore`, or its URL,
    opened once the run's memory estimate passed); resumes a run already there.

    Holds the run's writer lease throughout (taken before the run is created): a run another
    live process writes is refused at once (``wait=0``, :class:`~nsa_dist.store.LeaseHeld`
    naming it) or waited for (``wait`` seconds, None: for ever).  Finished steps are skipped,
    training restarts from the last stored checkpoint, a diverging run is marked failed (with
    the step and the reason) keeping every earlier step.  Every write is fenced by the lease: a
    writer whose lease another took over (it was paused longer than the lease's ttl) raises
    :class:`~nsa_dist.store.LeaseLost` without writing anything more.

    Raises:
        ResourceError: the run's estimated memory exceeds this machine (:func:`check_fits`),
            refused before its data is loaded or its model built.
    """
    check_fits(spec, gang_in_process=True)  # before the data is loaded, the model built or the store opened
    store = SpectrumStore(store) if isinstance(store, str) else store
    torch.manual_seed(spec.seed)  # the global RNG a factory network's own randomness (dropout) draws from
    # key: run_id(spec) if the caller has it; the gang layouts' members live in this process
    with RunSession.open(spec, store, wait=wait, key=key, gang_in_process=True) as session:
        try:
            return _run(session, on_step, on_update, on_prepared)
        finally:  # a notebook looping over specs holds no finished run's data or network
            RunMaterials.forget(session.run_id)


def _run(session: RunSession, on_step, on_update, on_prepared) -> RunOutcome:
    """Train and analyse the steps still to do; the session's end sets the status (done, or how
    the run stopped)."""
    if on_prepared:
        on_prepared(session.prepared)
    plan, data, rid = session.plan, session.data, session.run_id
    trainer, analyzer = Trainer(plan, data), SpectralAnalyzer(plan, data)  # each a copy of the run's network
    if session.complete():  # also a run killed between its last step and its preservation array: finished here
        if post_run_complete(session.writer, plan.spec):
            # finished before: left as it is — rewriting its post-run arrays again lost them to a kill
            # between an array's re-creation and its data (a `done` run with `preservation` missing)
            session.ended = True
        return RunOutcome(rid, Status.DONE)
    resume = session.writer.resume_index()
    if resume is not None:
        trainer.load_state(TrainerState(**session.writer.state_at(resume)))
    trainer.on_update = on_update
    session.start()
    computed = 0
    try:
        for ck in trainer.train_until(plan.spec.steps):
            session.writer.write_trace(ck.trace_start, ck.loss_trace)
            if session.done[ck.index]:
                continue
            result = analyzer.analyze(ck)
            session.commit(ck, result)
            computed += 1
            if on_step:
                on_step(ck, result)
    except TrainingDiverged as exc:  # failed at its step, every earlier step kept
        return RunOutcome(rid, Status.FAILED, session.fail(exc), computed)
    return RunOutcome(rid, Status.DONE, None, computed)
