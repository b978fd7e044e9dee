"""The resources module: one sum, one placement check."""

from __future__ import annotations

import pytest

from nsa_dist.config import ClusterSpec
from nsa_dist.cluster.resources import check_resources, resource_demand, threads, trainer_bundle, worker_bundle


@pytest.mark.parametrize("has_gpus", [False, True])
def test_the_demand_is_the_sum_of_the_actors_bundles(has_gpus):
    """One sum: what the embedded Ray is sized with equals the bundles the actors are placed with."""
    cl = ClusterSpec(spectral_workers=3, worker_cpus=0.5, trainer_cpus=2.0, worker_resources={"big": 1.0},
                     trainer_resources={"head": 0.5})
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
