"""Distribution over Ray — the only package that imports ``ray``.

* :class:`SweepCoordinator` — trainer actors + a spectral-worker pool for the runs of a sweep;
  a run whose Gram is too big for one worker takes a gang (``spectrum.layout: block_rows`` /
  ``matrix_free``, :class:`~nsa_dist.cluster.gang.RayGang`).
* :func:`connect` — an embedded local Ray, or join a cluster.
* :mod:`nsa_dist.cluster.jobs` — ``nsa submit / status / logs / cancel`` through the Ray Jobs SDK.

Plain classes become actors only in :mod:`~nsa_dist.cluster.actors`; what they take is summed
and checked only in :mod:`~nsa_dist.cluster.resources`.  May import ``ray``, config, errors,
data, pipeline, store, specfile and the package root — never the client, plots or serve.
"""

from nsa_dist.cluster.coordinator import RunProgress, SweepCoordinator
from nsa_dist.cluster.runtime import connect

__all__ = ["RunProgress", "SweepCoordinator", "connect"]
