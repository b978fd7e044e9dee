"""Ray's token authentication on a real head (deploy/README.md, "Authentication"): a loopback head
started as deploy/ray-cluster.yaml starts one, with ``RAY_AUTH_MODE=token`` and the token in the
file named by ``RAY_AUTH_TOKEN_PATH``; ``nsa status`` against its dashboard
with no token, a wrong one and the right one (from ``RAY_AUTH_TOKEN`` and from the file named by
``RAY_AUTH_TOKEN_PATH``).  A missing or wrong token is one line saying which variable to set.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import tempfile
import time
import urllib.request

import pytest
from conftest import BIN, free_ports, kill_cluster

from nsa_dist.cli import main as nsa


@pytest.fixture(scope="module")
def token_head():
    """A one-node Ray head on loopback with token auth on: (its dashboard address, the token)."""
    pytest.importorskip("ray")
    token = secrets.token_hex(16)
    token_dir = tempfile.mkdtemp(prefix="nsa-auth-", dir="/tmp")
    with open(os.path.join(token_dir, "auth_token"), "w") as f:  # as the cluster launcher's file_mounts leave it
        f.write(token + "\n")
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": os.path.join(token_dir, "auth_token"),
        "RAY_USAGE_STATS_ENABLED": "0",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("RAY_AUTH_TOKEN", None)
    # two tries, each on fresh ports: a port taken between free_port() and ray's bind (other tests'
    # clusters start on this machine too) failed `ray start` once in a fresh-clone CI run
    for attempt in (1, 2):
        temp_dir = tempfile.mkdtemp(prefix="nsa-raytok-", dir="/tmp")
        port, dash, *spare = free_ports(2 + 5)  # all distinct
        head = [
            str(BIN / "ray"),
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=1",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--temp-dir={temp_dir}",
            "--node-ip-address=127.0.0.1",
            "--disable-usage-stats",
            *(
                f"--{flag}={spare.pop()}"
                for flag in (
                    "dashboard-agent-listen-port",
                    "dashboard-agent-grpc-port",
                    "runtime-env-agent-port",
                    "metrics-export-port",
                    "ray-client-server-port",
                )
            ),
        ]
        done = subprocess.run(head, env=env, capture_output=True, text=True, timeout=180)
        if done.returncode == 0:
            break
        kill_cluster([temp_dir, f"127.0.0.1:{port}", f":{port}"])
        if attempt == 2:
            pytest.fail(f"ray start --head failed twice; its last output: {(done.stdout + done.stderr)[-2000:]}")
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline, mode = time.time() + 120, None
        while mode is None and time.time() < deadline:
            try:
                with urllib.request.urlopen(f"{address}/api/authentication_mode", timeout=5) as r:
                    mode = json.loads(r.read())["authentication_mode"]
            except OSError:
                time.sleep(1)
        assert mode == "token", f"the head's dashboard answered authentication_mode {mode!r}"
        yield address, token
    finally:
        kill_cluster([temp_dir, token_dir, f"127.0.0.1:{port}", f":{port}"])


@pytest.mark.slow
def test_nsa_status_against_a_token_head(token_head, tmp_path, capsys, monkeypatch):
    address, token = token_head
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)

    said: list[str] = []

    def status() -> tuple[int, str]:
        capsys.readouterr()
        rc = nsa(["status", "--address", address])
        out = capsys.readouterr()
        said.append(out.out.strip())
        return rc, out.err.strip()

    rc, err = status()
    assert rc == 2 and err == (
        f"nsa status: error: the Ray dashboard at {address} wants a token (its token "
        "authentication is on) and got none: set RAY_AUTH_TOKEN to the cluster's token, or "
        "RAY_AUTH_TOKEN_PATH to a file holding it (`ray start` keeps its token in ~/.ray/auth_token on the head)"
    ), (rc, err)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "not-" + token)
    rc, err = status()
    assert (
        rc == 2
        and err.startswith(f"nsa status: error: the Ray dashboard at {address} refused the token (HTTP 403)")
        and len(err.splitlines()) == 1
    ), (rc, err)
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    assert status() == (0, ""), "the right token in RAY_AUTH_TOKEN"
    assert said[-1] == f"no jobs on the cluster at {address}", said[-1]  # an empty listing is said
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    (tmp_path / "tok").write_text(token + "\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "tok"))
    assert status() == (0, ""), "the right token in the file named by RAY_AUTH_TOKEN_PATH"
