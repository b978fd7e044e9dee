"""``nsa submit / status / logs / cancel``: sweeps as Ray Jobs on a real cluster (Ray Jobs SDK).

The job runs ``services/sweep_job.py`` (a thin wrapper of ``nsa sweep --address auto``) with a
runtime_env that ships the ``nsa_dist`` package and the sweep file, so the cluster needs only
nsa-dist's dependencies installed (the image in deploy/docker).
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from nsa_dist.cluster.runtime import auth_headers

__all__ = ["submit", "status", "logs", "cancel", "job_client"]

_SERVICES = Path(__file__).resolve().parents[2] / "services"


def job_client(address: str) -> Any:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address, headers=auth_headers())


def submit(sweep_file: str | Path, address: str, store_url: str, *, job_id: str | None = None,
           pip: list[str] | None = None, max_runs: int | None = None) -> str:
    """Submit a sweep; returns the job id.  ``store_url`` must be reachable from every node.

    A local store path is made absolute (the job runs in a temporary directory of the cluster):
    it only works when that path is shared storage, as on a one-machine cluster.  ``max_runs``
    raises the sweep's run limit here and in the job.
    """
    import nsa_dist
    from nsa_dist.specfile import load_sweep

    load_sweep(sweep_file, max_runs=max_runs)  # fail here, not on the cluster, on a bad file
    limit = f" --max-runs {int(max_runs)}" if max_runs else ""
    if "://" not in store_url:
        store_url = os.path.abspath(store_url)
    runtime_env: dict[str, Any] = {"py_modules": [str(Path(nsa_dist.__file__).parent)]}
    if pip:
        runtime_env["pip"] = pip
    if os.environ.get("NSA_DEBUG"):
        runtime_env["env_vars"] = {"NSA_DEBUG": "1"}
    work = Path(tempfile.mkdtemp(prefix="nsa-submit-"))
    try:
        shutil.copy(sweep_file, work / "sweep.yaml")
        if _SERVICES.is_dir():  # a source checkout: the services/ entry point
            shutil.copytree(_SERVICES, work / "services", ignore=shutil.ignore_patterns("__pycache__"))
            entry = f"python services/sweep_job.py sweep.yaml --store {shlex.quote(store_url)}{limit}"
        else:  # an installed package: the same command without the wrapper
            entry = (f"python -m nsa_dist.cli sweep sweep.yaml --address auto --plain "
                     f"--store {shlex.quote(store_url)}{limit}")
        runtime_env["working_dir"] = str(work)
        client = job_client(address)
        deadline = time.time() + 90
        while True:  # a freshly started head has no job agent for a few seconds
            try:
                return client.submit_job(entrypoint=entry, runtime_env=runtime_env, submission_id=job_id)
            except RuntimeError as exc:
                if "No available agent" not in str(exc) or time.time() > deadline:
                    raise
                time.sleep(2)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def status(address: str, job_id: str | None = None) -> list[dict]:
    """One job's status, or every job's, as dicts (id, status, entrypoint, message)."""
    client = job_client(address)
    jobs = [client.get_job_info(job_id)] if job_id else client.list_jobs()
    return [{"id": j.submission_id or j.job_id, "status": str(j.status.value if hasattr(j.status, "value") else j.status),
             "entrypoint": j.entrypoint, "message": j.message or ""} for j in jobs]


def logs(address: str, job_id: str) -> str:
    return job_client(address).get_job_logs(job_id)


def cancel(address: str, job_id: str) -> bool:
    return bool(job_client(address).stop_job(job_id))
