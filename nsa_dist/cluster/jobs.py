"""``nsa submit / status / logs / cancel``: sweeps as Ray Jobs on a real cluster (Ray Jobs SDK).

The job runs ``services/sweep_job.py`` (a thin wrapper of ``nsa sweep --address auto``) with a
runtime_env that ships the ``nsa_dist`` package, the sweep file and its local data files (up to
``job_data.SHIP_LIMIT_BYTES``; see :mod:`nsa_dist.cluster.job_data`), so the cluster needs only
nsa-dist's dependencies installed (the image in deploy/docker).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from nsa_dist.cluster.job_data import prepare_job_data
from nsa_dist.cluster.runtime import auth_headers
from nsa_dist.errors import OutsideError

__all__ = ["submit", "status", "logs", "cancel", "job_client", "probe"]

_SERVICES = Path(__file__).resolve().parents[2] / "services"


PROBE_TIMEOUT = 5.0  # seconds a dashboard has to answer the unauthenticated probe


def job_client(address: str) -> Any:
    """A Ray Jobs client for ``address``, made only after :func:`probe` saw a Ray dashboard there;
    the token (``RAY_AUTH_TOKEN``) goes only to a dashboard that said it wants one."""
    mode = probe(address)
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if mode == "token" and not os.environ.get("RAY_AUTH_TOKEN") and path and not os.path.isfile(path):
        raise OutsideError(  # said as "got none" before, the file left unnamed
            f"the Ray dashboard at {address} wants a token, and RAY_AUTH_TOKEN_PATH names {path!r}, which is "
            "not a file: point it at the file holding the cluster's token, or set RAY_AUTH_TOKEN"
        )
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address, headers=auth_headers() if mode == "token" else None)


def probe(address: str) -> str:
    """Ask ``address``, without credentials, whether it is a Ray dashboard; its authentication mode.

    ``GET /api/authentication_mode`` is public on a Ray dashboard and answers
    ``{"authentication_mode": "token" | "disabled"}``; a dashboard without it must answer
    ``GET /api/version`` with ``{"ray_version": …}`` (or refuse it as Ray's token check does).

    Raises:
        OutsideError: ``address`` is not an http(s) URL, nothing answers there, or what answers
            is not a Ray dashboard — the line names the address and what answered.
    """
    if address.split("://", 1)[0] not in ("http", "https") or "://" not in address:
        raise OutsideError(
            f"address {address!r} is not a Ray dashboard URL: nsa submit / status / logs / cancel "
            "talk to the dashboard over HTTP — give http://HOST:8265 (--address or $RAY_ADDRESS)"
        )
    base = address.rstrip("/")
    status, server, body = _ask(base, "/api/authentication_mode")
    found = _json(body) if status == 200 else None
    if isinstance(found, dict) and "authentication_mode" in found:
        return str(found["authentication_mode"])
    v_status, v_server, v_body = _ask(base, "/api/version")
    version = _json(v_body) if v_status == 200 else None
    if isinstance(version, dict) and "ray_version" in version:
        return "disabled"
    if v_status in (401, 403) and v_body.startswith((b"Unauthorized", b"Forbidden")) and status == 404:
        return "token"
    what = f"HTTP {status}" + (f" from {server}" if server else "") + (f": {_snippet(body)}" if body else "")
    raise OutsideError(
        f"{address} is not a Ray dashboard: GET /api/authentication_mode answered {what} (check "
        "--address / $RAY_ADDRESS: the dashboard listens on port 8265 of the head node)"
    )


def _ask(base: str, path: str) -> tuple[int, str, bytes]:
    """(HTTP status, Server header, the first 64 KB of the body) of ``GET base+path``, no credentials."""
    import http.client
    import urllib.error
    import urllib.request

    req = urllib.request.Request(base + path, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=PROBE_TIMEOUT) as r:
            return r.status, r.headers.get("Server", ""), r.read(1 << 16)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Server", "") if exc.headers else "", exc.read(1 << 16)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise OutsideError(
            f"no Ray cluster answers at {base} ({reason}); start one, or pass --address / "
            "$RAY_ADDRESS (`nsa status --store PATH` shows a store's runs without a cluster)"
        ) from None
    except http.client.HTTPException as exc:  # a server that speaks no HTTP (its bytes are not shown)
        raise OutsideError(
            f"{base} is not a Ray dashboard: what answers there does not speak HTTP ({type(exc).__name__}) — "
            "is it the cluster's GCS port (the address `ray start` prints)? The dashboard listens on port "
            "8265 of the head node: give http://HOST:8265 (--address or $RAY_ADDRESS)"
        ) from None


def _json(body: bytes) -> Any:
    import json

    try:
        return json.loads(body)
    except ValueError:
        return None


def _snippet(body: bytes) -> str:
    text = " ".join(body.decode("utf-8", "replace").split())
    return repr(text[:80] + ("…" if len(text) > 80 else ""))


def sweep_options(max_runs: int | None = None, wait_writers: float | None = 0.0) -> str:
    """The options the job's ``nsa sweep`` gets from ``nsa submit`` (a leading space, or "")."""
    extra = f" --max-runs {int(max_runs)}" if max_runs else ""
    if wait_writers is None:
        extra += " --wait"
    elif wait_writers > 0:
        extra += f" --wait {float(wait_writers)!r}"
    return extra


def submit(
    sweep_file: str | Path,
    address: str,
    store_url: str,
    *,
    job_id: str | None = None,
    pip: list[str] | None = None,
    max_runs: int | None = None,
    wait_writers: float | None = 0.0,
) -> str:
    """Submit a sweep; returns the job id.  ``store_url`` must be reachable from every node.

    A local store path is made absolute (the job runs in a temporary directory of the cluster):
    it only works when that path is shared storage, as on a one-machine cluster.  ``max_runs``
    raises the sweep's run limit here and in the job.  ``wait_writers``: how long the job's sweep
    waits for another live writer of one of its runs (``nsa sweep --wait``; None: until it ends,
    0: refuse the run).
    """
    from nsa_dist.specfile import load_sweep

    load_sweep(sweep_file, max_runs=max_runs)  # fail here, not on the cluster, on a bad file
    extra = sweep_options(max_runs, wait_writers)
    if "://" not in store_url:
        store_url = os.path.abspath(store_url)
    runtime_env: dict[str, Any] = {"py_modules": [str(Path(__file__).parent.parent)]}  # nsa_dist/
    if pip:
        runtime_env["pip"] = pip
    if os.environ.get("NSA_DEBUG"):
        runtime_env["env_vars"] = {"NSA_DEBUG": "1"}
    work = Path(tempfile.mkdtemp(prefix="nsa-submit-"))
    try:
        # the sweep as the job sees it, its local data files copied into work (or refused: too big)
        (work / "sweep.yaml").write_text(
            yaml.safe_dump(prepare_job_data(sweep_file, work, max_runs=max_runs), sort_keys=False)
        )
        if _SERVICES.is_dir():  # a source checkout: the services/ entry point
            shutil.copytree(_SERVICES, work / "services", ignore=shutil.ignore_patterns("__pycache__"))
            entry = f"python services/sweep_job.py sweep.yaml --store {shlex.quote(store_url)}{extra}"
        else:  # an installed package: the same command without the wrapper
            entry = (
                f"python -m nsa_dist.cli sweep sweep.yaml --address auto --plain "
                f"--store {shlex.quote(store_url)}{extra}"
            )
        runtime_env["working_dir"] = str(work)
        with _answered(address):
            client = job_client(address)
            if job_id is not None:
                _refuse_taken(client, address, job_id)
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


def _refuse_taken(client: Any, address: str, job_id: str) -> None:
    """OutsideError when the cluster already has a job ``job_id`` (its dashboard answered a second
    submission with HTTP 500 and its own traceback, cut off before the cause)."""
    try:
        info = client.get_job_info(job_id)
    except RuntimeError:  # no such job: the id is free
        return
    state = getattr(info.status, "value", info.status)
    raise OutsideError(
        f"job id {job_id!r} is taken on {address} (a job {state} there); give another --job-id, or none "
        "to let Ray name the job"
    )


def status(address: str, job_id: str | None = None) -> list[dict]:
    """One job's status, or every job's, as dicts (id, status, entrypoint, message)."""
    with _answered(address):
        client = job_client(address)
        jobs = [client.get_job_info(job_id)] if job_id else client.list_jobs()
    return [
        {
            "id": j.submission_id or j.job_id,
            "status": str(j.status.value if hasattr(j.status, "value") else j.status),
            "entrypoint": j.entrypoint,
            "message": j.message or "",
        }
        for j in jobs
    ]


def logs(address: str, job_id: str) -> str:
    with _answered(address):
        return job_client(address).get_job_logs(job_id)


def cancel(address: str, job_id: str) -> bool:
    with _answered(address):
        return bool(job_client(address).stop_job(job_id))


@contextlib.contextmanager
def _answered(address: str) -> Iterator[None]:
    """What the dashboard answered (after :func:`probe`), as one OutsideError naming the address:
    the Ray client raises RuntimeError("Request failed with status code …"), connection errors and
    Ray's AuthenticationError (a missing or wrong token, told as which variable to set)."""
    from ray.exceptions import AuthenticationError

    try:
        yield
    except OutsideError:
        raise
    except AuthenticationError as exc:
        if str(getattr(exc, "message", "")).startswith("Authentication failed"):  # HTTP 403
            raise OutsideError(
                f"the Ray dashboard at {address} refused the token (HTTP 403): RAY_AUTH_TOKEN (or the "
                "file named by RAY_AUTH_TOKEN_PATH) does not hold the cluster's token"
            ) from exc
        raise OutsideError(
            f"the Ray dashboard at {address} wants a token (its token authentication is on) and got "
            "none: set RAY_AUTH_TOKEN to the cluster's token, or RAY_AUTH_TOKEN_PATH to a file "
            "holding it (`ray start` keeps its token in ~/.ray/auth_token on the head)"
        ) from exc
    except (RuntimeError, OSError) as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        if any(ln.startswith("Traceback (most recent call last)") for ln in lines):  # the server's own
            # traceback: its first line and its last (the cause), not the frames between
            text = f"{lines[0].split('Traceback')[0].strip()} … {lines[-1]}"
        else:
            text = " ".join(lines)
        raise OutsideError(f"the Ray dashboard at {address} answered: {text[:500]}") from exc
