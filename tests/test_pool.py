"""The analysis pools and the resources module: plain parts first, then the Ray pool on a local Ray (STYLE 12)."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from nsa_dist.cluster.resources import check_resources, resource_demand, threads, trainer_bundle, worker_bundle
from nsa_dist.config import ClusterSpec


@pytest.mark.parametrize("has_gpus", [False, True])
def test_the_demand_is_the_sum_of_the_actors_bundles(has_gpus):
    """One sum: what the embedded Ray is sized with equals the bundles the actors are placed with."""
    cl = ClusterSpec(
        spectral_workers=3,
        worker_cpus=0.5,
        trainer_cpus=2.0,
        worker_resources={"big": 1.0},
        trainer_resources={"head": 0.5},
    )
    need = resource_demand(cl, has_gpus, gang_members=2, trainers=2)
    actors = [worker_bundle(cl, has_gpus)] * (3 + 2) + [trainer_bundle(cl, has_gpus)] * 2
    total = {k: sum(b.get(k, 0.0) for b in actors) for k in need}
    assert total == pytest.approx(need), (total, need)
    assert (need["GPU"] > 0) == has_gpus and threads(0.5) == 1 and threads(2.0) == 2


def test_cluster_totals_that_fit_are_refused_when_an_actor_fits_on_no_node():
    cl = ClusterSpec(spectral_workers=1, worker_cpus=1.0, trainer_cpus=3.0)
    nodes = [{"CPU": 2.0}, {"CPU": 2.0}]  # 4 CPUs in all, but no node holds the 3-CPU trainer
    check_resources(cl, False, {"CPU": 4.0})
    with pytest.raises(ValueError, match=r"an actor needing \{'CPU': 3.0\} fits on no node"):
        check_resources(cl, False, {"CPU": 4.0}, nodes=nodes)
    check_resources(cl, False, {"CPU": 5.0}, nodes=[{"CPU": 3.0}, {"CPU": 2.0}])


# ---------------------------------------------------------------------- local Ray (conftest's shared one)


class Gated:
    """A worker whose analysis waits until a file exists and returns the process that ran it."""

    def pid(self) -> int:
        return os.getpid()

    def analyze_and_write(self, gate: str) -> int:
        while not os.path.exists(gate):
            time.sleep(0.02)
        return os.getpid()


@pytest.mark.slow
def test_ray_pool_gives_one_analysis_per_worker_and_ray_retries_a_killed_one(local_ray, tmp_path):
    from ray import cloudpickle

    from nsa_dist.cluster.pool import Analysis, RayAnalysisPool

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test's worker class, to the workers
    try:
        worker = local_ray.remote(Gated).options(num_cpus=0.5, max_restarts=-1, max_task_retries=1).remote()
        before = local_ray.get(worker.pid.remote())
        pool = RayAnalysisPool([worker], [before])
        gate = tmp_path / "gate"
        a = Analysis("r", 0, None)
        ref = pool.send(a, str(gate), probe=True)
        assert not pool.has_free() and a.worker is worker and a.pids[0] == before
        os.kill(before, signal.SIGKILL)  # mid-analysis: Ray restarts the worker and runs the analysis again
        gate.touch()
        assert local_ray.get(ref, timeout=120) != before
        assert pool.release(a) is True and pool.has_free() and a.worker is None
        b = Analysis("r", 1, None)
        ran_in = local_ray.get(pool.send(b, str(gate), probe=True), timeout=60)
        assert ran_in == b.pids[0] and ran_in != before  # the restarted process, as last seen
        assert pool.release(b) is False
        pool.close()
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
