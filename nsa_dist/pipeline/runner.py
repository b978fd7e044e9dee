"""One experiment end to end on this machine: train, analyse each recorded step, write the store.

The three parts stay separate plain classes (Trainer, SpectralAnalyzer, RunWriter) so the Ray
layer can place them on different workers; this module is the single-process composition.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from nsa_dist.config import ExperimentSpec
from nsa_dist.data import Dataset, load_dataset
from nsa_dist.metrics import reconstruction_ks, spectrum_preservation
from nsa_dist.pipeline.budget import check_fits
from nsa_dist.pipeline.nsa_extras import constant_gram_applies, gram_change_size, write_constant_gram
from nsa_dist.pipeline.checkpoint import Checkpoint, TrainerState
from nsa_dist.pipeline.hessian_step import hessian_dims, hessian_eig_count
from nsa_dist.pipeline.step_extras import full_kernel_size, per_class_size
from nsa_dist.pipeline.spectral import SpectralAnalyzer, spectrum_size
from nsa_dist.pipeline.trainer import Trainer, TrainingDiverged
from nsa_dist.store import LeaseLost, RunDims, RunWriter, SpectrumStore, Status

__all__ = ["PreparedRun", "RunOutcome", "finish_run", "prepare_run", "run_experiment", "run_id", "run_dims",
           "spec_json", "step_plan", "hessian_flags"]


def spec_json(spec: ExperimentSpec) -> dict:
    """The spec as plain JSON (enums as their values)."""
    return json.loads(spec.model_dump_json())


def run_id(spec: ExperimentSpec) -> str:
    """Stable id: the run name and a hash of the whole spec (same spec → same id)."""
    digest = hashlib.sha1(json.dumps(spec_json(spec), sort_keys=True).encode()).hexdigest()[:10]
    return f"{spec.name}-{digest}"


def run_dims(spec: ExperimentSpec, data: Dataset, trainer: Trainer, analyzer: SpectralAnalyzer) -> RunDims:
    K = spectrum_size(spec, data.n)
    M = int(data.X_test.shape[0])
    imgs = analyzer.images
    return RunDims(N=data.n, M=M, d=int(data.X.shape[1]), Ko=spec.model.output_dim, P=trainer.n_params,
                   S=len(trainer.record), T=spec.steps, K=K,
                   Kt=min(K, M) if spec.spectrum.test_points and M else 0,
                   nI=len(imgs.indices) if imgs else 0, R=spec.spectrum.image_size if imgs else 0,
                   F=spec.spectrum.fourier_size if imgs else 0, n_slots=len(trainer.slot_names),
                   L=int(trainer.gen.get_state().numel()), store_eigenvectors=bool(spec.spectrum.store_eigenvectors),
                   hessian=spec.hessian is not None, **dict(zip(("Hk", "Hr", "Hg"), hessian_dims(spec, trainer.n_params))),
                   Kf=full_kernel_size(spec, data.n), Kc=per_class_size(spec, data.n), **hessian_flags(spec),
                   HI=hessian_eig_count(spec, data.n), Kg=gram_change_size(spec, K),
                   Cg=constant_gram_applies(spec))


def hessian_flags(spec: ExperimentSpec) -> dict[str, bool]:
    """RunDims' Hm / Ho / Ha / Ht: whether the Hessian moment / orthogonality / additivity /
    trace-by-G arrays exist (the switches of the spec's hessian block)."""
    h = spec.hessian
    if h is None:
        return {"Hm": True, "Ho": True, "Ha": True, "Ht": True}
    return {"Hm": bool(h.moments), "Ho": bool(h.orthogonality), "Ha": bool(h.additivity), "Ht": bool(h.trace_G)}


def step_plan(spec: ExperimentSpec, record: list[int], hessian_indices: set[int], K: int) -> dict[str, np.ndarray]:
    """The static arrays that say which recorded steps write what: steps, eigenvector_steps (with
    Fig. 4d's reconstruction_k of the K eigenpairs kept), hessian_steps (those the run's arrays include)."""
    out = {"steps": np.asarray(record, dtype=np.int64)}
    if spec.spectrum.store_eigenvectors:
        out["eigenvector_steps"] = np.array([spec.spectrum.eigenvectors_at(int(t)) for t in record], dtype=bool)
        out["reconstruction_k"] = np.asarray(reconstruction_ks(K), dtype=np.int64)  # Fig. 4d's k
    if spec.hessian is not None:
        out["hessian_steps"] = np.isin(np.arange(len(record)), sorted(hessian_indices))
    return out


@dataclass(frozen=True)
class RunOutcome:
    run_id: str
    status: str
    reason: str | None = None
    steps_computed: int = 0


@dataclass
class PreparedRun:
    """A run whose store group exists with its static arrays written."""

    run_id: str
    spec: ExperimentSpec
    data: Dataset
    trainer: Trainer
    analyzer: SpectralAnalyzer
    writer: RunWriter


def prepare_run(spec: ExperimentSpec, store: SpectrumStore, token: str | None = None) -> PreparedRun:
    """Load the data, build trainer and analyzer, create (or reopen and check) the run's group.

    The run records its data's fingerprint when created; reopened with other data (a file
    replaced at the same path) it is refused (StoreError naming the data and both
    fingerprints).  ``token``: the writer lease's token, fencing every write of the run.
    """
    data = load_dataset(spec.data, seed=spec.seed)
    trainer = Trainer(spec, data)
    analyzer = SpectralAnalyzer(spec, data)
    rid = run_id(spec)
    writer = store.writer(rid, spec_json(spec), run_dims(spec, data, trainer, analyzer),
                          data_fingerprint=data.fingerprint(), token=token)
    pin_layout(writer, analyzer)
    if not writer.static_complete():  # new, made by a process killed before this, or repaired by nsa verify
        static = {"X": data.X, "y": data.y, "X_test": data.X_test, "y_test": data.y_test,
                  "image_indices": np.asarray(analyzer.images.indices if analyzer.images else [], dtype=np.int64),
                  **step_plan(spec, trainer.record, analyzer.hessian.indices, analyzer.K)}
        writer.write_static(static)
    return PreparedRun(rid, spec, data, trainer, analyzer, writer)


def pin_layout(writer: RunWriter, analyzer: SpectralAnalyzer) -> None:
    """Resolve the run's layout once: the first to open the run records its choice (and why),
    everyone after — a resumed run, every Ray worker — uses the recorded one."""
    writer.set_attrs(ntk_paths=analyzer.ntk_paths)  # which parameter took which NTK path, and why
    stored = writer.attr("layout")
    if stored:
        analyzer.pin_layout(stored, writer.attr("layout_reason") or "recorded with the run")
    else:
        writer.set_attrs(layout=analyzer.layout.layout.value, layout_reason=analyzer.layout.reason)


def run_experiment(spec: ExperimentSpec, store: SpectrumStore, *,
                   on_step: Callable[[Checkpoint, dict], None] | None = None,
                   on_update: Callable[[int, float], None] | None = None,
                   on_prepared: Callable[[PreparedRun], None] | None = None,
                   wait: float | None = 0.0) -> RunOutcome:
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


def _run_leased(spec: ExperimentSpec, store: SpectrumStore, on_step, on_update, on_prepared,
                token: str) -> RunOutcome:
    torch.manual_seed(spec.seed)
    run = prepare_run(spec, store, token)
    if on_prepared:
        on_prepared(run)
    rid, trainer, analyzer, writer = run.run_id, run.trainer, run.analyzer, run.writer
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
    """After the last step: spectrum preservation, status done."""
    _write_preservation(writer, spec)
    write_constant_gram(writer, spec)
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
    writer.write_array("preservation", np.asarray(P, dtype=np.float64),
                       {"t1": int(steps[i1]), "t2": int(steps[S - 1]), "rows": rows})
