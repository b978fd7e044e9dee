"""Shared fixtures: float64 reference machinery for the NTK tests, and the processes a test session
starts once: one embedded Ray, one moto S3 server on loopback, one two-node Ray cluster on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.func import functional_call, jacrev

BIN = Path(sys.executable).parent
if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on a 2-core machine: one thread each (and in every process a test starts).  Two
    # OpenMP threads on a core another process keeps busy wait at every barrier for a descheduled
    # sibling — a 6 s in-process layout test took 75 s that way, under load 4.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
LOCAL_RAY_CPUS = 6  # the embedded Ray every module's Ray tests share ("cluster has 6" in their messages)


def dense_jacobian(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """J (n·K, P) of the whole batch by ``torch.func.jacrev`` — the reference every fast path meets."""
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    rest = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}
    out = model(x)
    nk = out.numel()
    J = jacrev(lambda p: functional_call(model, {**p, **rest}, (x,)))(params)
    return torch.cat([j.reshape(nk, -1) for j in J.values()], dim=1)


def rotated_gram(lam, seed: int):
    """(G, Q): the symmetric G = Q diag(lam) Qᵀ with a random orthogonal Q (NumPy, float64) — a Gram of a
    chosen spectrum whose eigenvectors are no coordinate axes."""
    import numpy as np

    N = lam.size
    Q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((N, N)))
    G = (Q * lam) @ Q.T
    return (G + G.T) / 2, Q


def flat_model(model: torch.nn.Module):
    """(θ flat, f(v, X)): the model's parameters as one vector and the network as a function of it
    (for dense ``torch.func.hessian`` / ``jacrev`` references over all parameters)."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    names, shapes = list(params), [p.shape for p in params.values()]
    flat = torch.cat([p.reshape(-1) for p in params.values()])

    def unflat(v):
        out, o = {}, 0
        for n, s in zip(names, shapes):
            k = s.numel()
            out[n] = v[o : o + k].view(s)
            o += k
        return out

    return flat, (lambda v, X: functional_call(model, unflat(v), (X,)))


def dense_ntk(model: torch.nn.Module, x1: torch.Tensor, x2: torch.Tensor | None = None, full: bool = False):
    """Reference kernel: traced (n1, n2) or full (n1, K, n2, K) from dense Jacobians."""
    J1 = dense_jacobian(model, x1)
    J2 = J1 if x2 is None else dense_jacobian(model, x2)
    n1, n2 = x1.shape[0], (x1 if x2 is None else x2).shape[0]
    K = J1.shape[0] // n1
    Gf = (J1 @ J2.T).reshape(n1, K, n2, K)
    return Gf if full else Gf.diagonal(dim1=1, dim2=3).sum(-1)


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    """Relative Frobenius error ≤ rtol; on failure name the worst entries and by how much."""
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).norm() / expected.norm().clamp_min(1e-300)
    if not err <= rtol:
        diff = (actual - expected).abs().flatten()
        worst = diff.topk(min(5, diff.numel()))
        idx = [tuple(int(i) for i in torch.unravel_index(j, actual.shape)) for j in worst.indices]
        rows = ", ".join(f"{i}: {float(actual[i]):.6g} vs {float(expected[i]):.6g}" for i in idx)
        raise AssertionError(f"{what}: relative error {float(err):.3e} > {rtol:.1e}; worst entries {rows}")


def small_run_spec(name: str) -> dict:
    """A finished run in seconds with every array a reader or a repair touches (test points, 3 recorded steps)."""
    return dict(
        name=name,
        data={"n": 32, "n_test": 8},
        model={"depth": 2, "width": 16},
        steps=30,
        record={"every": 10},
        spectrum={"k": 8, "test_points": True},
    )


def finished_run(tmp_path_factory, spec: dict, folder: str, store: str = "a.zarr") -> tuple[str, str]:
    """(store URL, run id) of ``spec`` run to the end in a new store under ``folder``."""
    from nsa_dist.config import ExperimentSpec
    from nsa_dist.pipeline import run_experiment
    from nsa_dist.store import SpectrumStore

    url = str(tmp_path_factory.mktemp(folder) / store)
    out = run_experiment(ExperimentSpec(**spec), SpectrumStore(url))
    assert out.status == "done", out
    return url, out.run_id


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports on 127.0.0.1 that were free a moment ago.  They are bound together, so no
    two are alike: asked one at a time, the kernel handed the same port out twice (a two-node
    cluster's ``ray start`` failed on --dashboard-port and --runtime-env-agent-port both 41731)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            socks.append(socket.socket())
            socks[-1].bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for more than one, :func:`free_ports`)."""
    return free_ports(1)[0]


# ---------------------------------------------------------------------- a process stopped at a point
_SELF_STOP = """\
import importlib, os, signal, sys
module, _, path = {target!r}.partition(":")
owner = importlib.import_module(module)
*outer, attr = path.split(".")
for name in outer:
    owner = getattr(owner, name)
inner = getattr(owner, attr)
def stopping(*args, **kwargs):
    hit = {when}
    if hit and not {after!r}:
        os.kill(os.getpid(), signal.SIGSTOP)
    out = inner(*args, **kwargs)
    if hit and {after!r}:
        os.kill(os.getpid(), signal.SIGSTOP)
    return out
setattr(owner, attr, stopping)
from nsa_dist.cli import main
sys.exit(main(sys.argv[1:]))
"""


def stopping_cli(target: str, when: str = "True", after: bool = False) -> list[str]:
    """The argv of ``nsa`` (before its own arguments) in a process that stops itself (SIGSTOP) at
    one point: at the call of ``target`` ("module:function" or "module:Class.method") for which
    ``when`` (a Python expression over ``args`` and ``kwargs``) is true — before it, or after it
    returned with ``after``.  Everything else is the real CLI.

    A test that kills or pauses a writer "when N steps are done" stops it here, then signals it
    (:func:`wait_stopped`): a writer stopped from outside at a polled instant raced the poller,
    and on a loaded machine it had already gone on (a CI failure of test_true_words, 2026-12-05)."""
    return [sys.executable, "-c", _SELF_STOP.format(target=target, when=when, after=after)]


def wait_stopped(proc: subprocess.Popen, timeout: float = 300.0) -> None:
    """Return once ``proc`` is stopped (state T); AssertionError (with its output) if it ends first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"the process ended (rc {proc.returncode}) before it stopped: {out}{err}")
        if Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
            return
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"the process did not stop within {timeout:.0f} s")


def killed_after_step(args: list[str], index: int, env: dict) -> None:
    """``nsa *args`` stopped once its writer wrote recorded step ``index``, then SIGKILLed."""
    argv = stopping_cli("nsa_dist.store.zarr_store:RunWriter.write_step", f"args[1] == {index}", after=True)
    proc = subprocess.Popen(argv + args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_stopped(proc)
    proc.kill()
    proc.wait()
    assert proc.returncode == -9, proc.returncode


# ---------------------------------------------------------------------- processes started once
_LOCAL_RAY, _TWO_NODE = "local_ray", "two_node_cluster"


_SLOW = [
    line.strip()
    for line in (Path(__file__).parent / "slow.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(session, config, items) -> None:
    """The tests tests/slow.txt names are marked ``slow`` (``make test`` leaves them to ``make test-all``,
    which CI runs); then modules using the session's embedded Ray run after all others, then those using the two-node
    cluster: each is started when its first module starts and stopped at the end of the session, so
    neither sits idle on the cores while unrelated tests run (the order within a module is kept).

    Under ``make test``'s ``-n 2`` both workers follow this order, so each starts the embedded Ray
    when it reaches its first Ray test, and no other test runs after it in that worker.  Grouping
    was tried and measured (2026-12-05, full suite, quiet 2-core machine): tests dealt one by one
    925 s; each module one unit, so its fixtures are built once, 933 s; every Ray module on one
    worker 962 s, with two tests that assert no Ray was started failing behind it.  (The
    ``xdist_group`` marks this hook set before did nothing: xdist 3.8 writes the group into
    ``item._nodeid``, which pytest 9's node ids no longer read.)"""

    for item in items:
        if any(item.nodeid == s or item.nodeid.startswith((s + "::", s + "[")) for s in _SLOW):
            item.add_marker(pytest.mark.slow)

    def rank(item) -> int:
        names = modules.get(item.nodeid.split("::")[0], set())
        return 2 if _TWO_NODE in names else 1 if _LOCAL_RAY in names else 0

    modules: dict[str, set] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], set()).update(getattr(item, "fixturenames", ()))
    items.sort(key=rank)  # stable: the order within each group is pytest's


@pytest.fixture(scope="session")
def local_ray():
    """One embedded Ray with ``LOCAL_RAY_CPUS`` CPUs for every test that needs a local cluster (STYLE 12)."""
    ray = pytest.importorskip("ray")
    from nsa_dist.cluster import connect

    connect(num_cpus=LOCAL_RAY_CPUS)
    yield ray
    ray.shutdown()


@contextlib.contextmanager
def moto_server(server_env: dict | None = None) -> Iterator[tuple[dict, subprocess.Popen]]:
    """A moto S3 server on 127.0.0.1 (its own process; ``server_env``: its extra environment, e.g.
    ``INITIAL_NO_AUTH_ACTION_COUNT=0`` to check credentials); yields (the AWS_* variables that
    reach it, the process)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(server_env or {})},
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    try:
        deadline = time.time() + 180  # 60 s were within reach of a machine at 5–10× load
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.2)
        yield env, proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict]:
    """One moto S3 server for the session (tests make their own uuid-named buckets): its AWS_* variables."""
    pytest.importorskip("moto")
    with moto_server() as (env, _):
        yield env


def kill_cluster(marks: list[str]) -> None:
    """Stop exactly the processes whose command line holds one of ``marks``, and their children
    (``ray stop`` would stop every Ray on the machine; agents rename themselves, so children are
    found through their parents); then remove the marks that are folders (the nodes' ``--temp-dir``s:
    6 MB of session logs each, left in /tmp by every run of the suite before)."""
    import psutil

    procs = set()
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(m in part for part in (p.info["cmdline"] or []) for m in marks):
                procs |= {p, *p.children(recursive=True)}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(procs), timeout=10)
    for m in marks:
        if os.path.isdir(m):
            shutil.rmtree(m, ignore_errors=True)


@pytest.fixture(scope="session")
def two_node_cluster(s3_server: dict) -> Iterator[tuple[str, dict]]:
    """A two-node Ray cluster on loopback, started once for every multi-node test: a head (1 CPU,
    custom resource ``head_node``: 4, the dashboard) and a second node (1 CPU, ``worker_node``: 4).
    Its nodes start with the session S3 server's AWS_* variables, so sweeps on it can write to
    s3:// stores.  Yields (the dashboard address, the environment its nodes and ``nsa`` run in).
    Token auth is disabled on loopback only."""
    pytest.importorskip("ray")
    # the nodes run `python` from this environment (a real cluster has nsa-dist's deps in its image)
    env = {
        **os.environ,
        **s3_server,
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    common = ["--node-ip-address=127.0.0.1", "--disable-usage-stats"]
    flags = ("dashboard-agent-listen", "dashboard-agent-grpc", "runtime-env-agent", "metrics-export")
    flags += ("ray-client-server",)  # the head's only
    # two tries, each on fresh ports and folders: a port taken between free_ports() and ray's bind
    # (other tests' processes start on this machine too) fails `ray start`
    for attempt in (1, 2):
        # one temp dir per node: nodes sharing one would garbage-collect each other's runtime envs
        temp_dir, temp_dir2 = (tempfile.mkdtemp(prefix="nsa-ray-", dir="/tmp") for _ in range(2))
        port, dash, *spare = free_ports(2 + 5 + 4)  # every port of both nodes distinct
        head = [str(BIN / "ray"), "start", "--head", f"--port={port}", "--num-cpus=1"]
        head += ["--resources", json.dumps({"head_node": 4}), "--include-dashboard=true"]
        head += ["--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--temp-dir={temp_dir}", *common]
        head += [f"--{flag}-port={spare.pop()}" for flag in flags]
        node = [str(BIN / "ray"), "start", f"--address=127.0.0.1:{port}", "--num-cpus=1"]
        node += ["--resources", json.dumps({"worker_node": 4}), f"--temp-dir={temp_dir2}", *common]
        node += [f"--{flag}-port={spare.pop()}" for flag in flags[:4]]
        done = subprocess.run(head, env=env, capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            done = subprocess.run(node, env=env, capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            break
        kill_cluster([temp_dir, temp_dir2, f"127.0.0.1:{port}", f":{port}"])
        if attempt == 2:
            said = (done.stdout + done.stderr)[-2000:]
            pytest.fail(f"the two-node cluster did not start, twice; `ray start` said: {said}")
    try:
        yield f"http://127.0.0.1:{dash}", env
    finally:
        kill_cluster([temp_dir, temp_dir2, f"127.0.0.1:{port}", f":{port}"])
