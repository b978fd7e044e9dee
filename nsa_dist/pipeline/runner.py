"""One experiment end to end on this machine: train, analyse each recorded step, write the store.

The three parts stay separate plain classes (Trainer, SpectralAnalyzer, RunWriter) so the Ray
layer can place them on different workers; this module is the single-process composition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nsa_dist.config import ExperimentSpec
from nsa_dist.data import Dataset, load_dataset
from nsa_dist.metrics import spectrum_preservation
from nsa_dist.models import build_model
from nsa_dist.pipeline.budget import check_fits
from nsa_dist.pipeline.checkpoint import Checkpoint, TrainerState
from nsa_dist.pipeline.diagnostics import StepNotes
from nsa_dist.pipeline.nsa_extras import write_constant_gram
from nsa_dist.pipeline.plan import RunPlan, plan_run, run_id
from nsa_dist.pipeline.spectral import SpectralAnalyzer
from nsa_dist.pipeline.trainer import Trainer, TrainingDiverged
from nsa_dist.store import LeaseLost, RunWriter, SpectrumStore, Status

__all__ = ["PreparedRun", "RunOutcome", "finish_run", "prepare_run", "run_experiment"]


@dataclass(frozen=True)
class RunOutcome:
    run_id: str
    status: str
    reason: str | None = None
    steps_computed: int = 0


@dataclass
class PreparedRun:
    """A run whose store group exists with its static arrays written, and its plan (with the layout
    the run was created with)."""

    plan: RunPlan
    data: Dataset
    writer: RunWriter

    @property
    def run_id(self) -> str:
        return self.plan.run_id


def prepare_run(
    spec: ExperimentSpec, store: SpectrumStore, token: str | None = None, model: torch.nn.Module | None = None
) -> PreparedRun:
    """Load the data, plan the run, create (or reopen and check) the run's group.

    The run records its data's fingerprint when created; reopened with other data (a file
    replaced at the same path) it is refused (StoreError naming the data and both
    fingerprints).  The first to open the run records its layout (and why); everyone after — a
    resumed run, every Ray worker given the plan — uses the recorded one.  ``token``: the writer
    lease's token, fencing every write of the run.  ``model``: a network built from the spec that
    the caller keeps (the plan reads its sizes), else one is built for planning.
    """
    data = load_dataset(spec.data, seed=spec.seed)
    plan = plan_run(spec, data, model)
    writer = store.writer(plan.run_id, plan.spec_json, plan.dims, data_fingerprint=data.fingerprint(), token=token)
    plan = pin_layout(writer, plan)
    if not writer.static_complete():  # new, made by a process killed before this, or repaired by nsa verify
        writer.write_static(plan.static_arrays(data))
    return PreparedRun(plan, data, writer)


def pin_layout(writer: RunWriter, plan: RunPlan) -> RunPlan:
    """The plan with the run's recorded layout; the first to open the run records its own."""
    writer.set_attrs(ntk_paths=plan.ntk_paths)  # which parameter took which NTK path, and why
    stored = writer.attr("layout")
    if stored:
        return plan.with_layout(stored, writer.attr("layout_reason") or "recorded with the run")
    writer.set_attrs(layout=plan.layout.layout.value, layout_reason=plan.layout.reason, **plan.energy_attrs())
    return plan


def run_experiment(
    spec: ExperimentSpec,
    store: SpectrumStore,
    *,
    on_step: Callable[[Checkpoint, dict], None] | None = None,
    on_update: Callable[[int, float], None] | None = None,
    on_prepared: Callable[[PreparedRun], None] | None = None,
    wait: float | None = 0.0,
) -> RunOutcome:
    """Train ``spec`` and record its spectra in ``store``; resumes a run already there.

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
    check_fits(spec)  # before the data is loaded or the model built
    with store.lease([run_id(spec)], wait=wait) as lease:
        return _run_leased(spec, store, on_step, on_update, on_prepared, lease.token)


def _run_leased(spec: ExperimentSpec, store: SpectrumStore, on_step, on_update, on_prepared, token: str) -> RunOutcome:
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, seed=spec.seed)  # the analyzer's network, planned with
    run = prepare_run(spec, store, token, model)
    if on_prepared:
        on_prepared(run)
    rid, writer = run.run_id, run.writer
    trainer, analyzer = Trainer(run.plan, run.data), SpectralAnalyzer(run.plan, run.data, model)
    done = writer.done()
    if done.all():  # also a run killed between its last step and its preservation array
        finish_run(writer, spec)
        return RunOutcome(rid, Status.DONE)
    resume = writer.resume_index()
    if resume is not None:
        trainer.load_state(TrainerState(**writer.state_at(resume)))
    trainer.on_update = on_update
    writer.set_status(Status.RUNNING)
    computed = 0
    try:
        for ck in trainer.train_until(spec.steps):
            writer.write_trace(ck.trace_start, ck.loss_trace)
            if done[ck.index]:
                continue
            result = analyzer.analyze(ck)
            writer.write_step(ck.index, result, ck.state)
            computed += 1
            if on_step:
                on_step(ck, result)
    except TrainingDiverged as exc:
        writer.set_status(Status.FAILED, str(exc), exc.step)
        return RunOutcome(rid, Status.FAILED, str(exc), computed)
    except LeaseLost:  # the run is another writer's now: not a word more from this one
        raise
    except (KeyboardInterrupt, SystemExit) as exc:
        writer.set_status(Status.INTERRUPTED, f"interrupted ({type(exc).__name__}); re-run to resume")
        raise
    except Exception as exc:  # a bug or bad input that would recur: failed, finished steps kept
        writer.set_status(Status.FAILED, f"{type(exc).__name__}: {exc}")
        raise
    finish_run(writer, spec)
    return RunOutcome(rid, Status.DONE, None, computed)


def finish_run(writer: RunWriter, spec: ExperimentSpec) -> None:
    """After the last step: spectrum preservation and Eqs. 4–5's prediction, status done.

    Both are diagnostics: one that cannot be computed is left out, its reason in the run's
    ``post_run_notes`` attribute (``{array: reason}``, one log line), and the run is still done."""
    notes = StepNotes(writer.run_id, None)
    notes.guard(("preservation",), _write_preservation, writer, spec)
    notes.guard(("constant_gram_residual", "constant_gram_energy"), write_constant_gram, writer, spec)
    writer.set_attrs(post_run_notes=notes.reasons)
    writer.set_status(Status.DONE)


def _write_preservation(writer: RunWriter, spec: ExperimentSpec) -> None:
    """E_{t1}(v_i^{t2}, k) between the second and the last recorded step (NSA Fig. 7d); with a
    ``store_eigenvectors`` list, between its first and last step."""
    S = writer.dims.S
    if not spec.spectrum.store_eigenvectors or S < 2:
        return
    reader = writer.store.reader(writer.run_id)
    steps = reader.read("steps")
    i1 = 1 if S > 2 else 0
    if isinstance(spec.spectrum.store_eigenvectors, list):
        at = [i for i, t in enumerate(steps) if spec.spectrum.eigenvectors_at(int(t))]
        if len(at) < 2:
            return
        i1, S = at[0], at[-1] + 1
    V1, V2 = reader.read_step("eigenvectors", i1), reader.read_step("eigenvectors", S - 1)
    rows = sorted({i for i in spec.spectrum.images if i <= V2.shape[1]} | {1})
    P = spectrum_preservation(V1.astype(np.float64), V2.astype(np.float64), i=rows)
    writer.write_array(
        "preservation", np.asarray(P, dtype=np.float64), {"t1": int(steps[i1]), "t2": int(steps[S - 1]), "rows": rows}
    )
