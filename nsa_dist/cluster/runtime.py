"""Connecting to Ray: an embedded local cluster by default, or an existing one."""

from __future__ import annotations

import os
from typing import Any

import ray

__all__ = ["connect", "cluster_has_gpus", "auth_headers"]


def connect(address: str | None = None, *, num_cpus: int | None = None, resources: dict[str, float] | None = None,
            namespace: str = "nsa-dist") -> dict:
    """Start or join Ray.  ``address=None`` → an embedded local Ray; "auto" or "HOST:PORT" → join.

    ``num_cpus`` and ``resources`` (custom resources) size only an embedded Ray: on one machine
    every custom resource a sweep asks for is this machine's.

    Token authentication (``RAY_AUTH_MODE=token``, default for local clusters from Ray 2.59) is
    left to Ray: a joined cluster reads ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH`` from the
    environment.  Returns ``ray.cluster_resources()``.
    """
    if not ray.is_initialized():
        kw: dict[str, Any] = {"namespace": namespace, "log_to_driver": False}
        if address in (None, "local"):
            kw.update(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, resources=resources)
            ray.init(**kw)
        elif address == "auto" and os.environ.get("RAY_ADDRESS"):
            ray.init(**kw)  # inside a Ray Job: the job manager's RAY_ADDRESS names the cluster
        else:
            ray.init(address=address, **kw)
    return ray.cluster_resources()


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


def auth_headers() -> dict[str, str] | None:
    """Bearer header for the Ray Jobs / dashboard API when ``RAY_AUTH_TOKEN`` (or its file) is set."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if not token and path and os.path.isfile(path):
        token = open(path).read().strip()
    return {"Authorization": f"Bearer {token}"} if token else None
