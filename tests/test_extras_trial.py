"""Adversarial trial of what a run measures around each recorded step besides the spectrum: the
analysis pool's summaries, a diverged run's loss trace, and the per-step extras recomputed in
float64 from the stored θ_t."""

from __future__ import annotations

import pickle
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.errors import AnalysisError
from nsa_dist.pipeline import Trainer, TrainingDiverged, plan_run
from nsa_dist.pipeline.pool import ThreadAnalysisPool


class _Service:
    """A stand-in for TrackedRunService: step ``bad`` raises, the others return their summary.
    Every analysis waits for ``go`` so that all of them finish before the first ``wait``."""

    def __init__(self, bad: int) -> None:
        self.spec = SimpleNamespace(name="pool-trial")
        self.bad, self.go = bad, threading.Event()

    def analyze_and_write(self, ck):
        self.go.wait(10)
        if ck.step == self.bad:
            raise RuntimeError(f"analysis of step {ck.step} broke")
        return {"index": ck.step, "step": ck.step}


@pytest.mark.parametrize("bad", [0, 5, 19])
def test_thread_pool_keeps_the_finished_steps_beside_a_failed_one(bad):
    """A failed step and finished ones returned by the same wait: the failure is raised and every
    finished step's summary still comes out of the next waits (before: those iterated before the
    failure in the `done` set were popped and dropped)."""
    import concurrent.futures as cf

    lost_runs = []
    for trial in range(4):  # the `done` set's order is by hash: several trials
        service = _Service(bad)
        pool = ThreadAnalysisPool(service)
        steps = list(range(20))
        for t in steps:
            pool.submit(SimpleNamespace(step=t))
        service.go.set()
        cf.wait(list(pool.inflight), timeout=30)  # every analysis finished
        with pytest.raises(AnalysisError, match=f"recorded step {bad} failed"):
            pool.wait(False)
        got = []
        while pool.inflight:
            got += [s["step"] for s in pool.wait(True)]
        pool.close()
        lost = sorted(set(steps) - {bad} - set(got))
        if lost:
            lost_runs.append((trial, lost))
    assert not lost_runs, f"finished steps whose summaries were dropped (trial, steps): {lost_runs}"


def test_thread_pool_reports_the_earliest_failed_step_first():
    import concurrent.futures as cf

    class Two(_Service):
        def analyze_and_write(self, ck):
            self.go.wait(10)
            if ck.step in (3, 7):
                raise RuntimeError(f"step {ck.step} broke")
            return {"index": ck.step, "step": ck.step}

    service = Two(bad=-1)
    pool = ThreadAnalysisPool(service)
    for t in range(10):
        pool.submit(SimpleNamespace(step=t))
    service.go.set()
    cf.wait(list(pool.inflight), timeout=30)
    failed = []
    got = []
    while pool.inflight:
        try:
            got += [s["step"] for s in pool.wait(True)]
        except AnalysisError as exc:
            failed.append(exc.step)
    pool.close()
    assert failed == [3, 7], f"failures raised in the order {failed}, expected [3, 7]"
    assert sorted(got) == [0, 1, 2, 4, 5, 6, 8, 9], f"summaries returned: {sorted(got)}"


# ----------------------------------------------------------------------------- a diverged run's trace
DIVERGE = dict(
    name="boom",
    data={"n": 40, "n_test": 8},
    model={"depth": 2, "width": 12},
    schedule={"lr": 30.0},
    steps=60,
    record={"steps": [0, 50]},
    spectrum={"k": 6},
)


def test_diverged_trainer_hands_out_the_losses_since_the_last_checkpoint():
    """lr = 30 diverges a few steps after recorded step 0: the losses of the steps after the last
    checkpoint (not in any checkpoint's loss_trace) and the non-finite one come with the error, as
    the optimizer saw them (on_update), so that the run's loss curve reaches the diverged step."""
    spec = ExperimentSpec(**DIVERGE)
    data = load_dataset(spec.data, seed=spec.seed)
    trainer = Trainer(plan_run(spec, data), data)
    seen: dict[int, float] = {}
    trainer.on_update = lambda step, value: seen.__setitem__(step - 1, value)  # value: L(θ_{step−1})
    handed: dict[int, float] = {}
    with pytest.raises(TrainingDiverged) as info:
        for ck in trainer.train_until(spec.steps):
            handed.update({ck.trace_start + i: v for i, v in enumerate(ck.loss_trace)})
    exc = info.value
    assert 1 < exc.step < 50, f"diverged at step {exc.step}: pick another lr for this test"
    trace = getattr(exc, "loss_trace", None)
    start = getattr(exc, "trace_start", None)
    assert trace is not None and start is not None, "TrainingDiverged carries no loss trace"
    covered = set(handed) | set(range(start, start + len(trace)))
    missing = sorted(set(range(exc.step + 1)) - covered)
    assert not missing, f"steps whose loss no checkpoint nor the error hands out: {missing} (diverged at {exc.step})"
    assert start + len(trace) - 1 == exc.step, f"trace covers {start}..{start + len(trace) - 1}, diverged at {exc.step}"
    assert not np.isfinite(trace[-1]) and trace[-1] == exc.loss or np.isnan(exc.loss), (trace[-1], exc.loss)
    ref = np.array([seen[t] for t in range(start, exc.step)])
    np.testing.assert_array_equal(trace[:-1], ref, err_msg="losses before the diverged step vs the optimizer's")
    again = pickle.loads(pickle.dumps(exc))  # Ray ships it from the trainer actor to the coordinator
    assert again.step == exc.step and again.trace_start == start
    np.testing.assert_array_equal(again.loss_trace, trace)
    assert str(again) == str(exc)


def test_training_diverged_without_a_trace_still_pickles():
    exc = TrainingDiverged(4, float("nan"))
    again = pickle.loads(pickle.dumps(exc))
    assert (again.step, again.trace_start, again.loss_trace.shape) == (4, 4, (0,))
    assert "diverged at step 4" in str(again)


def test_a_diverged_runs_stored_loss_curve_reaches_the_step_it_diverged_at(tmp_path):
    """Through the product: the run fails at its step, and its stored loss_trace holds every
    step's loss up to that one (before: only the steps of the last checkpoint, NaN after it)."""
    from nsa_dist.client import Client
    from nsa_dist.pipeline import run_experiment
    from nsa_dist.store import SpectrumStore

    spec = ExperimentSpec(**DIVERGE)
    out = run_experiment(spec, SpectrumStore(str(tmp_path / "s")))
    assert out.status == "failed", out
    run = Client(str(tmp_path / "s")).run(out.run_id)
    trace = run.loss_trace
    diverged = run.failed_step
    assert diverged is not None and 1 < diverged < spec.steps, f"failed at {diverged}"
    finite = np.isfinite(trace)
    missing = np.flatnonzero(~finite[:diverged])
    assert finite[:diverged].all(), f"steps before {diverged} without a stored loss: {missing}"
    assert not finite[diverged], f"step {diverged}'s loss {trace[diverged]} should be the non-finite one"
    from nsa_dist.plots.dynamics import loss

    fig = loss(run)  # a log axis draws no inf: the figure marks where training diverged
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert any(f"diverged at t = {diverged}" in s for s in labels), labels
