"""Connecting to Ray: an embedded local cluster by default, or an existing one."""

from __future__ import annotations

import atexit
import io
import os
import signal
import sys
import threading
import time
from typing import Any

import ray

from nsa_dist.errors import OutsideError

__all__ = [
    "RAYLET_GRACE",
    "RayletLost",
    "connect",
    "core_worker_console_to_log",
    "cluster_has_gpus",
    "alive_nodes",
    "auth_headers",
    "raylet_lost",
]


RAYLET_GRACE = 2.0  # seconds an error waits for a dying raylet's exit status (raylet_lost's grace)


class RayletLost(OutsideError):
    """Ray's raylet on this machine (the node process every actor and object of the sweep lives
    in) stopped under a running sweep — or the embedded Ray's GCS did: the runs it drove are
    *interrupted* — their finished steps kept, resumable by re-running — not failed.  The message
    names the cause in one line (``cause``: what :func:`raylet_lost` found)."""

    def __init__(self, cause: str, runs: str = "") -> None:
        self.cause, self.runs = cause, runs
        super().__init__(f"Ray's {cause}" + (f"; {runs}" if runs else ""))


def connect(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    resources: dict[str, float] | None = None,
    namespace: str = "nsa-dist",
) -> dict:
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
    _route_raylet_reports()
    return ray.cluster_resources()


def _init(address: str | None, num_cpus: int | None, resources: dict[str, float] | None, namespace: str) -> None:
    if not ray.is_initialized():
        kw: dict[str, Any] = {"namespace": namespace, "log_to_driver": False}
        if address in (None, "local"):
            # address "local": Ray's own default joins the cluster RAY_ADDRESS or its last `ray start`
            # names (an audit: `nsa sweep` met another session's head and failed "num_cpus must not be
            # provided"); the embedded Ray is this process's own
            kw.update(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False)
            kw.update(resources=resources)
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
                    "quieter, or start Ray yourself (`ray start --head`) and pass --address auto"
                ) from exc
            time.sleep(pause * attempt)


def raylet_lost(ask_cluster: bool = False, grace: float = 0.0) -> str | None:
    """What stopped, in a few words ("raylet on this machine stopped (pid 4242, killed by SIGKILL;
    its log: …/raylet.out)"); None while this machine's raylet runs.

    An embedded Ray's raylet and GCS are this process's children: their exit status says at once
    — cheap enough to ask at every turn of the coordinator's loop.  For a joined cluster (no child
    to look at), ``ask_cluster`` asks the GCS whether this node is alive (after a Ray error only:
    one round trip).

    ``grace``: seconds to keep asking before answering None — for an error that may be the
    raylet's death seen early: a dying process closes its sockets before it can be reaped, so the
    driver's "connection reset" can come while its exit status is not there yet (once in CI: the
    run was marked with the generic interrupt reason, and a moment later the CLI found the raylet
    dead)."""
    deadline = time.monotonic() + (grace if ray.is_initialized() else 0.0)
    while True:
        cause = _raylet_lost(ask_cluster)
        if cause is not None or time.monotonic() >= deadline:
            return cause
        time.sleep(0.1)


def _raylet_lost(ask_cluster: bool) -> str | None:
    node = getattr(ray._private.worker, "_global_node", None)
    procs = getattr(node, "all_processes", None) or {}
    for kind, name in (
        (ray._private.ray_constants.PROCESS_TYPE_RAYLET, "raylet"),
        (ray._private.ray_constants.PROCESS_TYPE_GCS_SERVER, "GCS server"),
    ):
        info = procs.get(kind)
        rc = info[0].process.poll() if info else None
        if rc is None:
            continue
        how = f"killed by {_signal_name(-rc)}" if rc < 0 else f"exited with status {rc}"
        try:
            log = f"; its log: {os.path.join(node.get_logs_dir_path(), kind + '.out')}"
        except Exception:  # noqa: BLE001 - the log's place is a courtesy
            log = ""
        return f"{name} on this machine stopped (pid {info[0].process.pid}, {how}{log})"
    if procs.get(ray._private.ray_constants.PROCESS_TYPE_RAYLET) or not ask_cluster or not ray.is_initialized():
        return None
    try:
        me = ray.get_runtime_context().get_node_id()
        alive = {n.get("NodeID"): n.get("Alive") for n in ray.nodes()}
    except Exception as exc:  # noqa: BLE001 - the GCS itself is gone: that is the answer
        return f"GCS cannot be reached from this machine ({type(exc).__name__})"
    return None if alive.get(me) else f"raylet on this machine stopped (node {me[:12]} is marked dead by the cluster)"


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


# What Ray publishes to the driver when a raylet dies: the "Last 20 lines of the Raylet logs" dump
# (once per agent) and the GCS's "marked dead" notice.  nsa names the cause in one line instead.
_RAYLET_REPORTS = ("Raylet is terminated", "has been marked dead because the detector has missed too many heartbeats")


def _route_raylet_reports() -> None:
    """Send Ray's console reports of a dead raylet to ``nsa-driver-reports.log`` in Ray's session
    log folder (next to ``raylet.out``) instead of stdout; every other report is printed as Ray
    prints it.  Ray prints them from its error-listener thread through the module function
    ``ray._private.worker.print_to_stdstream``, with no setting to turn them off."""
    worker = ray._private.worker
    show = worker.print_to_stdstream
    if getattr(show, "nsa_routed", False):
        return

    def routed(data: dict, ignore_prefix: bool) -> None:
        text = "\n".join(str(line) for line in data.get("lines", []))
        if data.get("pid") != "raylet" or not any(m in text for m in _RAYLET_REPORTS):
            return show(data, ignore_prefix)
        try:
            path = os.path.join(worker._global_node.get_logs_dir_path(), "nsa-driver-reports.log")
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
        except Exception:  # noqa: BLE001 - a report not kept is no reason to print it
            pass

    routed.nsa_routed = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = routed


def quiet_ray_at_exit() -> None:
    """After this machine's raylet is lost: what Ray's own shutdown writes to stderr at exit (its
    C++ core worker's "Failed to push error to driver" for the tasks that died with the node) goes
    to ``nsa-driver-reports.log`` in Ray's session log folder instead.  Registered after
    ``ray.init`` registered its shutdown, so it runs first; the command's own line is out by then."""
    try:
        path = os.path.join(ray._private.worker._global_node.get_logs_dir_path(), "nsa-driver-reports.log")
    except Exception:  # noqa: BLE001 - no session folder: leave stderr alone
        return

    def redirect() -> None:
        try:
            sys.stderr.flush()
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(fd, 2)
            os.close(fd)
        except OSError:
            pass

    atexit.register(redirect)


def core_worker_console_to_log():
    """For a command-line process on Ray: from now on, what Ray's C++ core worker writes to this
    process's stderr (file descriptor 2: its ERROR lines such as "Failed to push error to driver",
    printed from its own threads whenever a node it talks to dies) goes to ``nsa-driver-reports.log``
    in Ray's session log folder, while Python's ``sys.stderr`` — the command's own lines, warnings,
    progress — stays on the console (a duplicate of the original descriptor).  Without it such a
    line could reach the console between a raylet's death and the command noticing it, around the
    one line that names the cause.

    Returns the function that puts fd 2 and ``sys.stderr`` back (call it unless the raylet is
    lost: then Ray's shutdown at exit writes more of the same).  Does nothing (returns a no-op)
    when ``sys.stderr`` is not file descriptor 2 (captured, a notebook) or Ray has no log folder.
    """
    try:
        if sys.stderr.fileno() != 2:
            return lambda: None
        path = os.path.join(ray._private.worker._global_node.get_logs_dir_path(), "nsa-driver-reports.log")
        log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return lambda: None
    original = sys.stderr
    original.flush()
    console = os.dup(2)
    os.dup2(log, 2)
    os.close(log)
    sys.stderr = open(  # noqa: SIM115 - lives until restore()
        console, "w", buffering=1, encoding=original.encoding, errors=original.errors or "backslashreplace"
    )

    def restore() -> None:
        if sys.stderr.closed:
            return
        sys.stderr.flush()
        os.dup2(console, 2)
        sys.stderr.close()
        sys.stderr = original

    return restore


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
