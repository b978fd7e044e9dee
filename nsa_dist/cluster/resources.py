"""What a sweep's actors take, and whether a Ray cluster holds them: the one resources module.

A *bundle* is one actor's demand (``{"CPU": 1.0, "GPU": 0.5, "node2": 1.0}``).  The embedded
Ray's size (``nsa sweep``), the fit checks before any actor starts and a gang's placement group
all use the same bundles and the same sum (:func:`resource_demand`).
"""

from __future__ import annotations

import math

from nsa_dist.config import ClusterSpec

__all__ = [
    "GangUnplaceable",
    "resolve_gpus",
    "threads",
    "gang_bundle",
    "worker_bundle",
    "trainer_bundle",
    "resource_demand",
    "check_resources",
    "check_bundles_fit",
    "check_gang_fits",
]


class GangUnplaceable(RuntimeError):
    """The cluster cannot host the gang (a member bigger than every node, or not enough in all)."""


def resolve_gpus(value: float | str, has_gpus: bool, auto: float) -> float:
    """GPUs per actor: ``"auto"`` → ``auto`` on a cluster with GPUs, else 0."""
    return (auto if has_gpus else 0.0) if value == "auto" else float(value)


def threads(cpus: float) -> int:
    """Torch threads of an actor holding ``cpus`` CPUs (at least one)."""
    return max(1, int(math.floor(cpus)))


def gang_bundle(cpus: float, gpus: float, resources: dict[str, float] | None) -> dict[str, float]:
    """One actor's bundle (Ray needs a non-empty placement-group bundle: 0.01 CPU at least)."""
    b = {"CPU": cpus or 0.01, **({"GPU": gpus} if gpus else {}), **(resources or {})}
    return {k: float(v) for k, v in b.items() if v}


def worker_bundle(cl: ClusterSpec, has_gpus: bool) -> dict[str, float]:
    """A spectral worker's (and a gang member's) bundle."""
    return gang_bundle(cl.worker_cpus, resolve_gpus(cl.worker_gpus, has_gpus, 0.5), cl.worker_resources)


def trainer_bundle(cl: ClusterSpec, has_gpus: bool) -> dict[str, float]:
    """A trainer actor's bundle."""
    return gang_bundle(cl.trainer_cpus, resolve_gpus(cl.trainer_gpus, has_gpus, 1.0), cl.trainer_resources)


def resource_demand(cl: ClusterSpec, has_gpus: bool, gang_members: int = 0, trainers: int = 1) -> dict[str, float]:
    """What a sweep's actors take together: the spectral-worker pool, the step gangs' members (each a
    worker's resources) and ``trainers`` trainer actors — CPU, GPU and every custom resource.

    The one sum both the embedded Ray's size (``nsa sweep``) and the fit check use.
    """
    workers = cl.spectral_workers + gang_members
    need: dict[str, float] = {
        "CPU": workers * cl.worker_cpus + trainers * cl.trainer_cpus,
        "GPU": workers * resolve_gpus(cl.worker_gpus, has_gpus, 0.5)
        + trainers * resolve_gpus(cl.trainer_gpus, has_gpus, 1.0),
    }
    for n, extra in ((workers, cl.worker_resources), (trainers, cl.trainer_resources)):
        for key, v in extra.items():
            need[key] = need.get(key, 0.0) + n * v
    return need


def check_resources(
    cl: ClusterSpec,
    has_gpus: bool,
    available: dict[str, float],
    gang_members: int = 0,
    trainers: int = 1,
    nodes: list[dict[str, float]] | None = None,
) -> None:
    """Raise ValueError unless the cluster holds the worker pool, ``trainers`` trainers (one per run
    running at once) and the step gangs.

    Ray would otherwise queue the actors forever (e.g. two 0.5-GPU workers and a 1-GPU trainer
    on a one-GPU machine, or a custom resource no node has).  ``gang_members``: the spectral-gang
    actors of distributed layouts (each takes a worker's resources).  Given the alive ``nodes``,
    every actor (and ``trainers`` trainers) must also be placeable on some node (:func:`check_bundles_fit`).
    """
    need = resource_demand(cl, has_gpus, gang_members, max(1, trainers))
    short = {k: (v, available.get(k, 0.0)) for k, v in need.items() if v > available.get(k, 0.0) + 1e-9}
    if short:
        what = "; ".join(f"{k}: needs {v:g}, cluster has {a:g}" for k, (v, a) in short.items())
        runs = f"{max(1, trainers)} runs at once, a trainer each, " if trainers > 1 else ""
        raise ValueError(
            f"the sweep's cluster block does not fit this Ray cluster ({what}: {runs}"
            f"{cl.spectral_workers} spectral worker(s){f', {gang_members} gang member(s)' if gang_members else ''}); "
            "lower cluster.max_concurrent_runs / spectral_workers / worker_cpus / worker_gpus / trainer_cpus / "
            "trainer_gpus or the *_resources, or add nodes"
        )
    if nodes is not None:
        check_bundles_fit(
            [worker_bundle(cl, has_gpus)] * (cl.spectral_workers + gang_members)
            + [trainer_bundle(cl, has_gpus)] * max(1, trainers),
            nodes,
            "the sweep's cluster block does not fit this Ray cluster's nodes",
        )


def check_bundles_fit(bundles: list[dict[str, float]], nodes: list[dict[str, float]], what: str) -> None:
    """ValueError unless the bundles (each on one node) pack onto the nodes (first fit, largest first).

    Cluster totals are not enough: two nodes with half a GPU free each do not host a one-GPU actor.
    """
    free = [dict(n) for n in nodes]
    for b in sorted(bundles, key=lambda b: sorted(b.items()), reverse=True):
        node = next((n for n in free if all(n.get(k, 0.0) + 1e-9 >= v for k, v in b.items())), None)
        if node is None:
            raise ValueError(
                f"{what}: an actor needing {b} fits on no node once the others are placed (nodes: "
                f"{nodes}); lower the per-actor resources or add nodes"
            )
        for k, v in b.items():
            node[k] -= v


def check_gang_fits(size: int, bundle: dict[str, float], nodes: list[dict[str, float]]) -> None:
    """GangUnplaceable naming what is missing, when no packing of ``size`` bundles onto ``nodes`` exists
    (each member on one node; a first-fit check — exact for identical bundles)."""
    if not nodes:
        raise GangUnplaceable("the Ray cluster has no alive nodes to place a spectral gang on")
    too_big = [k for k, v in bundle.items() if all(n.get(k, 0.0) + 1e-9 < v for n in nodes)]
    if too_big:
        best = {k: max(n.get(k, 0.0) for n in nodes) for k in too_big}
        raise GangUnplaceable(
            f"a spectral-gang member needs {bundle}, but no node has that much "
            f"{', '.join(too_big)} (largest node: {best}); lower cluster.worker_cpus / worker_gpus "
            "/ worker_resources"
        )
    fits = sum(min(math.floor((n.get(k, 0.0) + 1e-9) / v) for k, v in bundle.items()) for n in nodes)
    if fits < size:
        total = {k: sum(n.get(k, 0.0) for n in nodes) for k in bundle}
        raise GangUnplaceable(
            f"spectrum.workers={size} gang members of {bundle} each do not fit this Ray cluster "
            f"(room for {fits}; cluster totals {total}); lower spectrum.workers or the per-worker "
            "resources, or add nodes"
        )
