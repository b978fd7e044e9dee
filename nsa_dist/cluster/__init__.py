"""Distribution over Ray — the only package that imports ``ray``.

* :class:`SweepCoordinator` — trainer actors + a spectral-worker pool for the runs of a sweep.
* :func:`distributed_top_eigenpairs` — a Gram split into block rows over workers, Lanczos on their sum.
* :func:`connect` — an embedded local Ray, or join a cluster.
* :mod:`nsa_dist.cluster.jobs` — ``nsa submit / status / logs / cancel`` through the Ray Jobs SDK.
"""

from nsa_dist.cluster.coordinator import RunProgress, SweepCoordinator
from nsa_dist.cluster.distributed import DistributedGram, distributed_top_eigenpairs
from nsa_dist.cluster.runtime import connect

__all__ = ["DistributedGram", "RunProgress", "SweepCoordinator", "connect", "distributed_top_eigenpairs"]
