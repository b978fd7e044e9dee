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


class Refusing:
    """A worker whose analysis raises while a file exists (the state it borrowed is broken)."""

    def pid(self) -> int:
        return os.getpid()

    def analyze_and_write(self, gate: str, broken: str) -> int:
        while not os.path.exists(gate):
            time.sleep(0.02)
        if os.path.exists(broken):
            raise RuntimeError("the borrowed state is broken")
        return os.getpid()


@pytest.mark.slow
def test_dispatch_queue_recomputes_a_killed_workers_step_and_retries_a_broken_one(local_ray, tmp_path):
    """The one queue of the sweep coordinator and the Tracker's Ray pool: steps go out in order while
    a worker is idle and ``lend`` agrees; a worker killed mid-step is restarted by Ray and the step
    handed back from the new process (counted as resubmitted, seen by the probe); a step whose
    borrowed state broke is put back first at most ``max_retries`` times, the state given back broken."""
    from ray import cloudpickle

    from nsa_dist.cluster.pool import Analysis, DispatchQueue, RayAnalysisPool

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        worker = local_ray.remote(Refusing).options(num_cpus=0.5, max_restarts=-1, max_task_retries=1).remote()
        before = local_ray.get(worker.pid.remote())
        gate, broken = tmp_path / "gate", tmp_path / "broken"
        free, returned = ["state"], []  # what lend hands out (a gang, in the coordinator)

        def lend(a: Analysis) -> bool:
            if not free:
                return False
            a.gang = free.pop()
            return True

        def give_back(a: Analysis, is_broken: bool) -> None:
            returned.append((a.index, is_broken))
            free.append(a.gang)
            a.gang = None

        q = DispatchQueue(
            RayAnalysisPool([worker], [before]),
            lambda a: (str(gate), str(broken)),
            lend=lend,
            give_back=give_back,
            max_retries=1,
            probe=True,
        )
        for i in range(2):
            q.put(Analysis("r", i, None))
        assert [a.index for a in q.running.values()] == [0] and [a.index for a in q.queued] == [1] and len(q) == 2
        os.kill(before, signal.SIGKILL)  # mid-step 0: Ray restarts the worker and runs step 0 again there
        gate.touch()
        (ref,) = q.ready(block=True)
        a, ran_in, exc = q.take(ref)
        assert (a.index, exc) == (0, None) and ran_in != before, (a.index, exc, ran_in, before)
        assert q.resubmitted == 1 and returned == [(0, False)] and a.worker is None
        broken.touch()  # before step 1 is sent: the gate is open, so it may run at once
        q.dispatch()
        (ref,) = q.ready(block=True)
        a, summary, exc = q.take(ref)
        assert a.index == 1 and summary is None and "the borrowed state is broken" in str(exc), exc
        assert q.retry(a) is True and a.attempts == 1 and q.resubmitted == 2  # sent again at once
        assert [x.index for x in q.running.values()] == [1] and returned[-1] == (1, True)
        (ref,) = q.ready(block=True)
        a, _, exc = q.take(ref)
        assert exc is not None and q.retry(a) is False, exc  # max_retries spent: the caller fails the step
        assert returned[-1] == (1, True) and len(q) == 0 and q.resubmitted == 2 and free == ["state"]
        q.pool.close()
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
