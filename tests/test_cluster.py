"""The Ray layer: plain service classes in-process first, then a local Ray cluster (STYLE 12)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec, SweepSpec
from nsa_dist.data import load_dataset
from nsa_dist.pipeline import plan_run, prepare_run, run_experiment, run_id
from nsa_dist.pipeline.services import SpectralService, TrainerService
from nsa_dist.store import SpectrumStore

BASE = dict(
    data={"n": 40},
    model={"depth": 3, "width": 16},
    steps=24,
    record={"every": 6},
    spectrum={"k": 10, "images": [1, 2], "image_size": 6, "fourier_size": 5},
)
COMPARE = ("theta", "f", "df", "eigenvalues", "energy_y", "energy_residual", "first_order_error", "loss", "loss_trace")


def _reference(tmp_path, spec: ExperimentSpec, expect: str = "done") -> Client:
    url = str(tmp_path / f"ref-{spec.name}.zarr")
    assert run_experiment(spec, SpectrumStore(url)).status == expect
    return Client(url)


def _assert_same_run(a: Client, b: Client, rid: str, finished: bool = True) -> None:
    ra, rb = a.run(rid), b.run(rid)
    assert np.all(rb.g["done"][:]) and (rb.status == "done" or not finished)
    for name in COMPARE:
        np.testing.assert_array_equal(ra.g[name][:], rb.g[name][:], err_msg=name)


# ---------------------------------------------------------------------- in-process plain classes
def test_services_in_process_match_single_process_run(tmp_path):
    spec = ExperimentSpec(name="svc", **BASE)
    url = str(tmp_path / "s.zarr")
    plan = prepare_run(spec, SpectrumStore(url)).plan
    trainer, worker = TrainerService(plan, url), SpectralService(url)
    rid = run_id(spec)
    for i in range(5):
        summary = worker.analyze_and_write(plan, trainer.checkpoint(i))
        assert summary["index"] == i
    again = trainer.checkpoint(2)  # idempotent: asked for a step already passed, it replays from the store
    assert again.step == 12
    _assert_same_run(_reference(tmp_path, spec), Client(url), rid, finished=False)
    np.testing.assert_array_equal(again.theta, Client(url).run(rid).g["theta"][2])


def test_trainer_service_resumes_from_store_after_restart(tmp_path):
    spec = ExperimentSpec(name="restart", **{**BASE, "optimizer": {"name": "adam"}, "schedule": {"lr": 0.01}})
    url = str(tmp_path / "s.zarr")
    plan = prepare_run(spec, SpectrumStore(url)).plan
    rid, worker = run_id(spec), SpectralService(url)
    t1 = TrainerService(plan, url)
    for i in range(3):
        worker.analyze_and_write(plan, t1.checkpoint(i))
    t2 = TrainerService(plan, url)  # a "restarted" trainer: starts at the last stored step
    assert t2.step() == 12
    for i in range(3, 5):
        worker.analyze_and_write(plan, t2.checkpoint(i))
    _assert_same_run(_reference(tmp_path, spec), Client(url), rid, finished=False)


# ---------------------------------------------------------------------- local Ray
def _sweep(name: str, **kw) -> SweepSpec:
    return SweepSpec(name=name, base={**BASE, **kw.pop("base", {})}, **kw)


# a sweep on Ray equal to the single-process runs, array by array, and its restart: test_bit_identical


@pytest.mark.slow
def test_killed_trainer_and_worker_processes_recover(local_ray, tmp_path):
    from nsa_dist.cluster import SweepCoordinator

    sweep = _sweep(
        "faults", base={"steps": 60, "record": {"every": 4}}, cluster={"spectral_workers": 2, "max_inflight": 1}
    )
    url = str(tmp_path / "s.zarr")
    coord = SweepCoordinator(sweep, url)
    (run,) = coord.runs.values()
    killed: dict[str, int] = {}

    def chaos(progress):
        (p,) = progress
        if p.done >= 2 and "trainer" not in killed and run.trainer is not None:
            killed["trainer"] = local_ray.get(run.trainer.pid.remote())
            os.kill(killed["trainer"], signal.SIGKILL)
        elif p.done >= 5 and "worker" not in killed and run.inflight:
            worker = next(iter(run.inflight.values())).worker
            killed["worker"] = local_ray.get(worker.pid.remote())
            os.kill(killed["worker"], signal.SIGKILL)
        elif "worker" in killed and "worker_again" not in killed and run.inflight:
            # a worker is killed again, possibly while Ray restarts it: Ray's task retries must absorb
            # both deaths (issue 9: each failed call used to count as one death and fail the run)
            worker = next(iter(run.inflight.values())).worker
            try:
                killed["worker_again"] = local_ray.get(worker.pid.remote(), timeout=60)
                os.kill(killed["worker_again"], signal.SIGKILL)
            except Exception:  # noqa: BLE001 - still restarting: try again at the next event
                pass
        elif "trainer" in killed and "trainer_after" not in killed and run.trainer is not None:
            killed["trainer_after"] = local_ray.get(run.trainer.pid.remote())

    coord.on_event = chaos
    (outcome,) = coord.run()
    assert outcome.status == "done", outcome
    assert {"trainer", "worker", "worker_again"} <= set(killed), killed
    assert killed["trainer_after"] != killed["trainer"], "the trainer actor was not restarted"
    spec = sweep.expand()[0]
    _assert_same_run(_reference(tmp_path, spec), Client(url), run_id(spec))


@pytest.mark.slow
def test_diverging_run_fails_while_others_finish(local_ray, tmp_path):
    from nsa_dist.cluster import SweepCoordinator

    sweep = _sweep("mixed", variants=[{"schedule.lr": 0.1}, {"schedule.lr": 40.0}], cluster={"spectral_workers": 1})
    url = str(tmp_path / "s.zarr")
    good, bad = SweepCoordinator(sweep, url).run()
    assert good.status == "done"
    assert bad.status == "failed" and "diverged at step" in bad.reason
    run = Client(url).run(bad.run_id)
    assert run.status == "failed" and run.failed_step is not None
    assert np.all(run.steps < run.failed_step) and np.isfinite(run.eigenvalues).all()
    # fails the same way in one process
    single = _reference(tmp_path, sweep.expand()[1], expect="failed").run(bad.run_id)
    assert single.status == "failed" and single.failed_step == run.failed_step
    assert run.steps.tolist() == single.steps.tolist(), "steps analysed before the divergence were lost"


@pytest.mark.slow
def test_hessian_measurements_through_the_ray_pipeline(local_ray, tmp_path):
    from nsa_dist.cluster import SweepCoordinator

    hess = {"every": 2, "probes": 8, "rayleigh_k": 3, "top_k": 2, "density_grid": 32, "lanczos_steps": 10}
    sweep = _sweep("hess", base={"model": {"depth": 2, "width": 6}, "hessian": hess}, cluster={"spectral_workers": 1})
    url = str(tmp_path / "s.zarr")
    (outcome,) = SweepCoordinator(sweep, url).run()
    assert outcome.status == "done"
    spec = sweep.expand()[0]
    ref, got = _reference(tmp_path, spec).run(outcome.run_id), Client(url).run(outcome.run_id)
    for name in (
        "hessian_moments",
        "hessian_moments_I_exact",
        "hessian_top",
        "hessian_orthogonality",
        "hessian_rayleigh",
        "hessian_density",
    ):
        np.testing.assert_array_equal(ref.g[name][:], got.g[name][:], err_msg=name)
    assert got.hessian.steps.tolist() == [0, 12, 23]


def test_auth_token_from_environment_or_file(tmp_path, monkeypatch):
    from nsa_dist.cluster.runtime import auth_headers

    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    assert auth_headers() is None
    (tmp_path / "tok").write_text("s3cret\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "tok"))
    assert auth_headers() == {"Authorization": "Bearer s3cret"}
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert auth_headers() == {"Authorization": "Bearer from-env"}


def test_workers_refuse_a_store_without_the_run(tmp_path):
    from nsa_dist.errors import StoreError

    spec = ExperimentSpec(name="nowhere", **BASE)
    trainer = TrainerService(plan_run(spec, load_dataset(spec.data)), str(tmp_path / "other.zarr"))
    with pytest.raises(StoreError, match="shared storage that every node reaches"):  # at its first call: an
        trainer.checkpoint(0)  # error in an actor's constructor kills the actor, its cause lost to the driver


def test_cluster_block_must_fit_the_cluster():
    from nsa_dist.cluster.resources import check_resources
    from nsa_dist.config import ClusterSpec

    check_resources(ClusterSpec(), False, {"CPU": 3.0})
    with pytest.raises(ValueError, match="GPU: needs 2, cluster has 1"):
        check_resources(ClusterSpec(), True, {"CPU": 8.0, "GPU": 1.0})  # 2 x 0.5-GPU workers + a 1-GPU trainer
    with pytest.raises(ValueError, match="node2: needs 2, cluster has 0"):
        check_resources(ClusterSpec(worker_resources={"node2": 1}), False, {"CPU": 8.0})


def test_actors_must_fit_on_nodes_not_only_in_cluster_totals():
    from nsa_dist.cluster.resources import check_bundles_fit

    half = [{"CPU": 4.0, "GPU": 0.5}, {"CPU": 4.0, "GPU": 0.5}]  # one GPU in total, half on each node
    check_bundles_fit([{"CPU": 1.0, "GPU": 0.5}] * 2, half, "x")
    with pytest.raises(ValueError, match=r"needing \{'CPU': 1.0, 'GPU': 1.0\} fits on no node"):
        check_bundles_fit([{"CPU": 1.0, "GPU": 1.0}], half, "x")


@pytest.mark.slow
def test_trainer_crash_loop_fails_its_run_and_the_sweep_finishes(local_ray, tmp_path):
    from nsa_dist.cluster import SweepCoordinator

    sweep = _sweep(
        "crashloop",
        variants=[{"seed": 0}, {"seed": 1}],
        base={"steps": 60, "record": {"every": 4}},
        cluster={"spectral_workers": 1, "max_retries": 1, "max_concurrent_runs": 2},
    )
    url = str(tmp_path / "s.zarr")
    coord = SweepCoordinator(sweep, url)
    victim = list(coord.runs.values())[1]
    killed: list[int] = []

    def chaos(progress):  # kill the trainer of run 2 each time it is back, at most 3 times
        if victim.trainer is not None and victim.progress.status == "running" and len(killed) < 3:
            try:
                pid = local_ray.get(victim.trainer.pid.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - dead for good (restarts spent)
                return
            if pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    coord.on_event = chaos
    good, bad = coord.run()
    assert good.status == "done", good
    assert bad.status == "failed" and ("kept dying" in bad.reason or "ActorDied" in bad.reason), bad
    assert len(killed) >= 2


@pytest.mark.slow
def test_sweep_that_cannot_be_placed_fails_fast(local_ray, tmp_path):
    from nsa_dist.cluster import SweepCoordinator

    sweep = _sweep("nogpu", cluster={"worker_gpus": 1})
    with pytest.raises(ValueError, match="GPU: needs 2, cluster has 0"):
        SweepCoordinator(sweep, str(tmp_path / "s.zarr")).run()


@pytest.mark.slow
def test_a_sweep_whose_lease_is_taken_over_stops_and_writes_nothing_more(local_ray, tmp_path):
    """Issue 18: another driver takes the run over mid-sweep (this one was paused beyond its ttl);
    the trainer's and workers' writes are fenced by this driver's token: run() raises LeaseLost,
    the status is left to the new owner and its lease is not overwritten."""
    import time

    from nsa_dist.cluster import SweepCoordinator
    from nsa_dist.store import LeaseLost

    sweep = _sweep(
        "fenced", base={"steps": 60, "record": {"every": 4}}, cluster={"spectral_workers": 1, "max_inflight": 1}
    )
    url = str(tmp_path / "s.zarr")
    coord = SweepCoordinator(sweep, url)
    (rid,) = coord.runs
    store = SpectrumStore(url)
    at_swap: list[int] = []

    def take_over(progress):
        (p,) = progress
        if p.done >= 2 and not at_swap:
            now = time.time()
            store.write_lease(
                rid,
                {
                    "host": "node-7.elsewhere",
                    "pid": 4242,
                    "since": now,
                    "heartbeat": now,
                    "ttl": 600.0,
                    "token": "theirs",
                    "released": False,
                },
            )
            at_swap.append(int(store.reader(rid).done.sum()))

    coord.on_event = take_over
    with pytest.raises(LeaseLost, match="host node-7.elsewhere, pid 4242, since .* took the run over"):
        coord.run()
    info = store.lease_info(rid)
    assert info.token == "theirs" and not info.released, "the fenced driver released the new owner's lease"
    r = store.reader(rid)
    assert r.attrs["status"] == "running", "the fenced driver wrote a status after losing the run"
    assert at_swap and r.done.sum() <= at_swap[0] + 1, (at_swap, int(r.done.sum()))  # at most the step in flight


def test_a_trainer_that_cannot_start_says_why_and_is_not_restarted_for_it(local_ray, tmp_path) -> None:
    """The data file replaced while a sweep ran (an audit): each later run's trainer raised RunRefused in
    its constructor, which killed the actor — the runs failed as "its trainer kept dying (after
    cluster.max_retries=3 restarts): ActorDiedError", the cause only in 143 lines of Ray tracebacks.
    The constructor's error is now the first call's, which the coordinator stores as the run's reason."""
    import ray

    from nsa_dist.cluster.actors import trainer_actor
    from nsa_dist.cluster.pool import task_cause
    from nsa_dist.config import ClusterSpec
    from nsa_dist.pipeline.session import RunSession
    from nsa_dist.store import RunRefused

    img = tmp_path / "img.npy"
    np.save(img, np.random.default_rng(0).random((20, 30)))
    spec = ExperimentSpec(
        name="chg",
        data={"name": "image2d", "n": 16, "path": str(img)},
        model={"depth": 2, "width": 4},
        steps=4,
        spectrum={"k": 4, "images": []},
    )
    url = str(tmp_path / "s.zarr")
    session = RunSession.open(spec, SpectrumStore(url))
    trainer = None
    try:
        np.save(img, np.random.default_rng(1).random((20, 30)))  # replaced before the trainer loads it
        trainer = trainer_actor(session.prepared.plan, url, ClusterSpec(), False, session.lease.token)
        with pytest.raises(ray.exceptions.RayError) as got:
            ray.get(trainer.checkpoint.remote(0), timeout=120)
        cause = task_cause(got.value)
        assert isinstance(cause, RunRefused), f"{type(got.value).__name__}: {str(got.value)[:600]}"
        assert "now loads as sha256:" in str(cause) and "the run was opened on" in str(cause), str(cause)
        assert ray.get(trainer.pid.remote(), timeout=60) > 0  # alive: no restart spent on what cannot change
    finally:
        if trainer is not None:
            ray.kill(trainer)
        session.lease.release()
