"""Connecting to Ray: an embedded local cluster by default, or an existing one."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import ray

from nsa_dist.errors import OutsideError

__all__ = ["connect", "cluster_has_gpus", "alive_nodes", "auth_headers"]


def connect(address: str | None = None, *, num_cpus: int | None = None, resources: dict[str, float] | None = None,
            namespace: str = "nsa-dist") -> dict:
    """Start or join Ray.  ``address=None`` → an embedded local Ray; "auto" or "HOST:PORT" → join.

    ``num_cpus`` and ``resources`` (custom resources) size only an embedded Ray: on one machine
    every custom resource a sweep asks for is this machine's.

    Token authentication (``RAY_AUTH_MODE=token``, default for local clusters from Ray 2.59) is
    left to Ray: a joined cluster reads ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH`` from the
    environment.  A SIGTERM handler the caller installed (``nsa``: SIGTERM unwinds like Ctrl-C)
    is put back after ``ray.init``, which replaces it: with Ray's handlers in place a SIGTERM of
    the driver ended in a C++ stack dump ("SIGTERM received") and SIGABRT, rc 134, instead of
    the caller's clean-up.  Returns ``ray.cluster_resources()``.
    """
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    try:
        _init(address, num_cpus, resources, namespace)
    finally:
        if callable(handler):
            signal.signal(signal.SIGTERM, handler)
    return ray.cluster_resources()


def _init(address: str | None, num_cpus: int | None, resources: dict[str, float] | None, namespace: str) -> None:
    if not ray.is_initialized():
        kw: dict[str, Any] = {"namespace": namespace, "log_to_driver": False}
        if address in (None, "local"):
            kw.update(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, resources=resources)
            _start_embedded(kw)
        elif address == "auto" and os.environ.get("RAY_ADDRESS"):
            ray.init(**kw)  # inside a Ray Job: the job manager's RAY_ADDRESS names the cluster
        else:
            ray.init(address=address, **kw)


EMBEDDED_TRIES = 3  # Ray waits a fixed 30 s for its raylet to register: under load, start it again


def _start_embedded(kw: dict[str, Any], tries: int = EMBEDDED_TRIES, pause: float = 5.0) -> None:
    """``ray.init`` of an embedded Ray, started again when it times out during startup (Ray's own
    wait for the raylet is a fixed 30 s, which a machine at load ~10 can miss); after ``tries``
    one :class:`~nsa_dist.errors.OutsideError` line says so and what to try."""
    for attempt in range(1, tries + 1):
        try:
            ray.init(**kw)
            return
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for this
            if "timed out during startup" not in str(exc):
                raise
            ray.shutdown()
            if attempt == tries:
                load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
                raise OutsideError(
                    f"the embedded Ray did not start in {tries} tries: its raylet did not register within Ray's "
                    f"30 s (load average {load} on {os.cpu_count()} cores); run again when the machine is "
                    "quieter, or start Ray yourself (`ray start --head`) and pass --address auto") from exc
            time.sleep(pause * attempt)


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


def alive_nodes() -> list[dict[str, float]]:
    """The resources of each alive node of the connected cluster."""
    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]


def auth_headers() -> dict[str, str] | None:
    """Bearer header for the Ray Jobs / dashboard API when ``RAY_AUTH_TOKEN`` (or its file) is set."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if not token and path and os.path.isfile(path):
        token = open(path).read().strip()
    return {"Authorization": f"Bearer {token}"} if token else None
