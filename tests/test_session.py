"""The run lifecycle every writer shares (pipeline/session.py): how a run opens and how each way of
stopping sets its status.  Real stores on disk, real leases; nothing mocked."""

from __future__ import annotations

import dataclasses

import pytest

from nsa_dist import Tracker
from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.errors import StoreError
from nsa_dist.models import build_model
from nsa_dist.pipeline import RunSession, TrainingDiverged, run_experiment
from nsa_dist.store import LeaseHeld, LeaseLost, SpectrumStore, Status

TINY = dict(name="life", data={"n": 16, "n_test": 4}, model={"depth": 2, "width": 8}, steps=4, record={"every": 2})


def _status(store: SpectrumStore, rid: str) -> tuple:
    a = store.group(rid).attrs.asdict()
    return a.get("status"), a.get("reason"), a.get("failed_step")


def _reopenable(store: SpectrumStore, spec: ExperimentSpec) -> bool:
    """Whether another writer can take the run's lease now (the session gave it back)."""
    try:
        RunSession.open(spec, store).release()
        return True
    except LeaseHeld:
        return False


@pytest.mark.parametrize(
    "exc, want",
    [
        (None, (Status.DONE, None, None)),
        (KeyboardInterrupt(), (Status.INTERRUPTED, "interrupted (KeyboardInterrupt); re-run to resume", None)),
        (SystemExit(143), (Status.INTERRUPTED, "interrupted (SystemExit); re-run to resume", None)),
        (ValueError("bad input"), (Status.FAILED, "ValueError: bad input", None)),
        (TrainingDiverged(3, float("nan")), (Status.FAILED, str(TrainingDiverged(3, float("nan"))), 3)),
        (LeaseLost("another writer took the run"), (Status.RUNNING, None, None)),  # not a word more
    ],
    ids=["done", "ctrl-c", "sigterm", "error", "diverged", "lease-lost"],
)
def test_each_way_of_stopping_sets_its_status_and_gives_the_lease_back(tmp_path, exc, want):
    spec = ExperimentSpec(**TINY)
    store = SpectrumStore(str(tmp_path / "s.zarr"))
    s = RunSession.open(spec, store)
    assert not _reopenable(store, spec), "an open session holds the run's lease"
    assert s.todo() == list(range(len(s.done))) and not s.complete()
    s.start()
    s.end(exc)
    got = _status(store, s.run_id)
    assert got == want, f"after {exc!r}: status {got}, expected {want}"
    assert _reopenable(store, spec), "the session did not give its lease back"


def test_an_error_before_start_leaves_the_status_and_gives_the_lease_back(tmp_path):
    spec = ExperimentSpec(**TINY)
    store = SpectrumStore(str(tmp_path / "s.zarr"))
    with pytest.raises(RuntimeError, match="workers could not start"):
        with RunSession.open(spec, store) as s:
            raise RuntimeError("workers could not start")
    assert _status(store, s.run_id) == (Status.PENDING, None, None)
    assert _reopenable(store, spec)


def test_a_run_reopened_with_other_data_is_refused_and_the_lease_handed_back(tmp_path):
    spec = ExperimentSpec(**TINY)
    store = SpectrumStore(str(tmp_path / "s.zarr"))
    RunSession.open(spec, store).release()
    data = load_dataset(spec.data, seed=spec.seed)
    other = dataclasses.replace(data, X=data.X + 1.0)
    with pytest.raises(StoreError, match="created from other data"):
        RunSession.open(spec, store, data=other)
    assert _reopenable(store, spec)


def test_a_sessions_commits_are_what_run_experiment_writes(tmp_path):
    """Steps committed through a session (as the runner does) leave the done mask and the stored
    arrays as ``run_experiment`` does; a re-run finds nothing to do."""
    spec = ExperimentSpec(**TINY)
    url = str(tmp_path / "s.zarr")
    out = run_experiment(spec, SpectrumStore(url))
    assert out.status == Status.DONE and out.steps_computed == len(spec.record_steps()), out
    s = RunSession.open(spec, SpectrumStore(url))
    try:
        assert s.complete() and s.todo() == [], s.done
    finally:
        s.release()
    assert run_experiment(spec, SpectrumStore(url)).steps_computed == 0


def test_a_tracked_run_carries_the_attrs_of_a_spec_run(tmp_path):
    """The Tracker opens its run through the same session as ``nsa run``: the layout, the NTK paths
    and the energy route are recorded with it."""
    spec = ExperimentSpec(**TINY)
    data = load_dataset(spec.data, seed=spec.seed)
    model = build_model(spec.model, seed=spec.seed)
    url = str(tmp_path / "t.zarr")
    tr = Tracker(url, "tr", model, data.X, data.y, steps=4, record={"every": 2}, spectrum={"k": 4})
    for t in range(4):
        if tr.due(t):
            tr.record(t, lr=0.05)
    tr.close()
    ref = str(tmp_path / "r.zarr")
    rid = run_experiment(spec, SpectrumStore(ref)).run_id
    tracked, spec_run = SpectrumStore(url).group("tr").attrs.asdict(), SpectrumStore(ref).group(rid).attrs.asdict()
    for name in ("layout", "layout_reason", "ntk_paths", "energy_route", "curve_bracket"):
        assert name in spec_run, f"nsa run no longer records {name!r}"
        assert tracked.get(name) is not None, f"the tracked run lacks {name!r}: {sorted(tracked)}"
    assert tracked["status"] == Status.DONE, tracked["status"]
