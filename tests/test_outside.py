"""One line for every outside failure (issue 18, item 4): stores, disks, dashboards, signals.

Each failure is provoked for real — a moto S3 server on loopback (tests/test_s3.py's), one that
checks credentials, a closed port, a plain HTTP server that is not S3 nor Ray, a full or
read-only tmpfs — and ``nsa`` runs as its own process, so what it prints up to its exit
(including what the interpreter prints while collecting a failed store's coroutines) is checked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from conftest import moto_server
from test_s3 import _bucket, s3_env  # noqa: F401  (the session's loopback moto server, its AWS_* variables set)

from nsa_dist.cli import main as nsa
from nsa_dist.client import Client
from nsa_dist.store.keys import Keys

REPO = Path(__file__).resolve().parents[1]
TINY = {
    "data": {"n": 16},
    "model": {"depth": 2, "width": 8},
    "steps": 4,
    "record": {"every": 2},
    "spectrum": {"k": 4, "images": []},
}
LONG = {**TINY, "data": {"n": 48}, "steps": 200_000, "record": {"every": 2_000}}  # ~1 s between its 101 steps


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clis(
    calls: list[tuple[list[str], dict | None]], cwd: Path, timeout: float = 180
) -> list[subprocess.CompletedProcess]:
    """``nsa ARGS`` for every (args, env) of ``calls``, each its own process, all at once (they are
    independent, and each spends its first seconds importing on a core of its own)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "nsa_dist.cli", *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        )
        for args, env in calls
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _error_line(proc: subprocess.CompletedProcess | str, cmd: str) -> str:
    """The process's one error line (progress lines ``[nsa] …`` aside); fails on anything more."""
    err = proc if isinstance(proc, str) else proc.stderr
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("[nsa] ")]
    assert len(lines) == 1 and lines[0].startswith(f"nsa {cmd}: "), f"{len(lines)} lines:\n{err[-4000:]}"
    return lines[0]


def _spec(tmp_path: Path, spec: dict, name: str = "spec.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(spec))
    return p


# --------------------------------------------------------------------------- a plain HTTP server on loopback


class _Recorder(BaseHTTPRequestHandler):
    """Answers every request like a static web server (404 + HTML; ``server.status``: that HTTP
    status instead), or like a Ray dashboard that
    wants a token (``server.ray_token`` set); records each request's path and headers."""

    def _answer(self) -> None:
        self.server.seen.append((self.command, self.path, dict(self.headers)))
        token = getattr(self.server, "ray_token", None)
        if token is None:
            code = getattr(self.server, "status", 404)
            page = f"<!DOCTYPE html><html><body><h1>{code} {HTTPStatus(code).phrase}</h1></body></html>"
            self._send(code, "text/html", page.encode())
        elif self.path == "/api/authentication_mode":
            self._send(200, "application/json", json.dumps({"authentication_mode": "token"}).encode())
        elif self.headers.get("Authorization") != f"Bearer {token}":
            self._send(401, "text/plain", b"Unauthorized: Missing authentication token")
        elif self.path == "/api/version":
            import ray

            self._send(
                200,
                "application/json",
                json.dumps(
                    {"version": "4", "ray_version": ray.__version__, "ray_commit": "x", "session_name": "s"}
                ).encode(),
            )
        else:
            self._send(200, "application/json", b"[]")

    def _send(self, code: int, ctype: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def web():
    """A plain HTTP server (not S3, not Ray) on 127.0.0.1 in a thread; ``.seen`` lists its requests."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


# --------------------------------------------------------------------------- S3


@pytest.fixture(scope="module")
def s3_checking_keys():
    """A second moto server that checks credentials: the AWS_* variables that reach it with wrong keys."""
    with moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as (env, _):
        yield {**env, "AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG0", "AWS_SECRET_ACCESS_KEY": "not-the-secret"}


@pytest.mark.slow
@pytest.mark.parametrize("cmd", ["ls", "run"])
def test_s3_faults_are_one_line_naming_store_endpoint_and_cause(cmd, s3_env, s3_checking_keys, web, tmp_path):
    url = f"s3://nsa-missing-{uuid.uuid4().hex[:8]}/s.zarr"
    bucket = url.split("/")[2]
    args = ["ls", "--store", url] if cmd == "ls" else ["run", str(_spec(tmp_path, TINY)), "--store", url, "--plain"]
    dead = f"http://127.0.0.1:{_closed_port()}"
    plain = f"http://127.0.0.1:{web.server_address[1]}"
    cases = {  # endpoint environment: what the line must say
        "bucket missing": ({**s3_env}, f"bucket {bucket!r} does not exist"),
        "unreachable": ({**s3_env, "AWS_ENDPOINT_URL": dead}, "cannot reach the endpoint (Connection refused)"),
        "not S3": ({**s3_env, "AWS_ENDPOINT_URL": plain}, "with HTTP 404 from 'BaseHTTP/"),
        "wrong keys": (s3_checking_keys, "access denied"),
    }
    results = _clis([(args, env) for env, _ in cases.values()], tmp_path)
    for (what, (env, cause)), result in zip(cases.items(), results):
        line = _error_line(result, cmd)
        assert f"store {url} (endpoint {env['AWS_ENDPOINT_URL']}): " in line and cause in line, (what, line)
    assert not (tmp_path / "s.zarr").exists()


@pytest.mark.slow
def test_an_s3_endpoint_gone_mid_run_is_one_line(tmp_path, monkeypatch):
    with moto_server() as (env, server):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        url = f"s3://{_bucket(env)}/s.zarr"
        proc = _start(["run", str(_spec(tmp_path, LONG)), "--store", url, "--plain"], tmp_path, env)
        _wait_for_line(proc, r"^\[nsa\] step ")  # a recorded step is in the bucket
        server.kill()  # the endpoint goes away while the run writes
        server.wait()
        err = _finish(proc)
    assert proc.returncode == 2, err[-3000:]
    line = _error_line(err, "run")
    assert f"store {url} (endpoint {env['AWS_ENDPOINT_URL']}): cannot reach the endpoint" in line, line


def test_a_failing_s3_endpoint_is_tried_twice_per_request_unless_the_user_set_retries(web, tmp_path, monkeypatch):
    """The store's S3 client tries a failing request twice (botocore's default 5 tries with
    backoff, under s3fs's own 5, left a researcher waiting through minutes of retries against a
    dead endpoint before the one line, which names the endpoint: test_s3_faults_… and
    test_an_s3_endpoint_gone_mid_run_…); the user's own setting (``AWS_MAX_ATTEMPTS``, or
    ``max_attempts`` in the AWS profile) is kept.  Counted at a server that answers every
    request HTTP 500."""
    import s3fs

    web.status = 500
    endpoint = f"http://127.0.0.1:{web.server_address[1]}"
    for k, v in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "absent"),
    }.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_ENDPOINT_URL_S3", "AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "aws-config").write_text("[default]\nmax_attempts = 3\n")
    url = f"s3://nsa-{uuid.uuid4().hex[:8]}/s.zarr"
    for attempts, setting in (
        (2, None),
        (3, ("AWS_MAX_ATTEMPTS", "3")),
        (3, ("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))),
    ):
        monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
        if setting:
            monkeypatch.setenv(*setting)
        s3fs.S3FileSystem.clear_instance_cache()  # a client of its own for each setting
        web.seen.clear()
        with pytest.raises(OSError, match="Internal Server Error"):
            Keys(url).get("zarr.json")  # one read: one request, tried `attempts` times
        assert [(m, p) for m, p, _ in web.seen] == [("HEAD", f"{url[4:]}/zarr.json")] * attempts, (setting, web.seen)


# --------------------------------------------------------------------------- local disks


@pytest.fixture()
def tmpfs(tmp_path):
    """Mount a tiny tmpfs (64 KiB; ``ro``: read-only) under tmp_path; skips where mounting is not allowed."""
    mounted = []

    def mount(name: str, ro: bool = False) -> Path:
        d = tmp_path / name
        d.mkdir()
        opts = "size=64k" + (",ro" if ro else "")
        if subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True).returncode:
            pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", str(d)], check=False)


@pytest.mark.slow
def test_a_full_or_read_only_disk_is_one_line_naming_the_store(tmpfs, tmp_path):
    spec = _spec(tmp_path, {**TINY, "data": {"n": 64}, "spectrum": {"k": 32, "images": []}})
    full, ro = tmpfs("full") / "s.zarr", tmpfs("ro", ro=True) / "s.zarr"
    on_full, on_ro = _clis(
        [(["run", str(spec), "--store", str(store), "--plain"], None) for store in (full, ro)], tmp_path
    )
    line = _error_line(on_full, "run")
    assert line.startswith(f"nsa run: error: store {full}: disk full") and "No space left on device" in line, line
    line = _error_line(on_ro, "run")
    assert line == f"nsa run: error: store {ro}: read-only filesystem at {ro} (Read-only file system)", line


def test_a_store_path_under_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")  # works without root: the store's parent is a file
    store = tmp_path / "file" / "s.zarr"
    assert nsa(["run", str(_spec(tmp_path, TINY)), "--store", str(store), "--plain"]) == 2
    line = _error_line(capsys.readouterr().err, "run")
    assert line == (
        f"nsa run: error: store {store}: a parent of the path is not a directory at {store} (Not a directory)"
    )


# --------------------------------------------------------------------------- Ray dashboards


@pytest.mark.slow
def test_a_non_ray_server_gets_one_line_and_never_the_token(web, tmp_path):
    address = f"http://127.0.0.1:{web.server_address[1]}"
    token = {"RAY_AUTH_TOKEN": "the-secret-token"}
    sweep = _spec(tmp_path, {"name": "s", "base": TINY})
    calls = [
        (["status", "--address", address], token),
        (["submit", str(sweep), "--address", address, "--store", str(tmp_path / "s.zarr")], token),
    ]
    for (args, _), result in zip(calls, _clis(calls, tmp_path, timeout=120)):
        line = _error_line(result, args[0])
        assert f"{address} is not a Ray dashboard: GET /api/authentication_mode answered HTTP 404" in line, line
        assert "Not Found" in line, line
    assert web.seen and all("the-secret-token" not in json.dumps(h) for _, _, h in web.seen), web.seen


def test_the_token_goes_to_a_server_that_answered_as_a_ray_dashboard(web, capsys, monkeypatch):
    web.ray_token = "the-secret-token"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "the-secret-token")
    assert nsa(["status", "--address", f"http://127.0.0.1:{web.server_address[1]}"]) == 0, capsys.readouterr().err
    first, *rest = web.seen
    assert first[1] == "/api/authentication_mode" and "Authorization" not in first[2], first
    assert rest and all(h.get("Authorization") == "Bearer the-secret-token" for _, _, h in rest), rest


def test_a_stopped_server_or_an_address_without_scheme_is_one_line(tmp_path, capsys):
    port = _closed_port()
    sweep = _spec(tmp_path, {"name": "s", "base": TINY})
    assert nsa(["submit", str(sweep), "--address", f"http://127.0.0.1:{port}", "--store", str(tmp_path / "s")]) == 2
    line = _error_line(capsys.readouterr().err, "submit")
    assert f"no Ray cluster answers at http://127.0.0.1:{port} (" in line and "Connection refused" in line, line
    assert nsa(["status", "--address", f"127.0.0.1:{port}"]) == 2  # Ray would try it as a GCS address for 35 s
    line = _error_line(capsys.readouterr().err, "status")
    assert f"address '127.0.0.1:{port}' is not a Ray dashboard URL" in line and "http://HOST:8265" in line, line


def test_the_gcs_port_given_as_the_dashboard_is_one_line_without_its_bytes(local_ray, capsys):
    """``ray start`` prints the GCS address (host:6379); given as --address, its gRPC bytes reached
    the terminal as 'BadStatusLine: \\x00\\x00\\x18…' (exit 1, a new user's trial)."""
    address = "http://" + local_ray.get_runtime_context().gcs_address
    assert nsa(["status", "--address", address]) == 2
    line = _error_line(capsys.readouterr().err, "status")
    assert f"{address} is not a Ray dashboard: what answers there does not speak HTTP" in line, line
    assert "GCS port" in line and "8265" in line and line.isprintable(), repr(line)


def test_a_token_file_that_is_not_there_is_named(web, capsys, monkeypatch):
    web.ray_token = "the-secret-token"
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/nonexistent/token")
    address = f"http://127.0.0.1:{web.server_address[1]}"
    assert nsa(["status", "--address", address]) == 2
    line = _error_line(capsys.readouterr().err, "status")
    assert "RAY_AUTH_TOKEN_PATH names '/nonexistent/token', which is not a file" in line, line


# --------------------------------------------------------------------------- --debug


def test_debug_shows_the_traceback_and_otherwise_one_line(tmp_path, capsys, monkeypatch):
    args = ["ls", "--store", str(tmp_path / "none.zarr")]
    assert nsa(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and _error_line(err, "ls").endswith("first)")
    for argv, env in ((["--debug", *args], None), ([*args, "--debug"], None), (args, "1")):
        if env:
            monkeypatch.setenv("NSA_DEBUG", env)
        assert nsa(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and "StoreError" in err, err[-2000:]
        assert err.strip().splitlines()[-1].startswith("nsa ls: error: no spectrum store at"), err[-2000:]
    monkeypatch.delenv("NSA_DEBUG")
    assert "NSA_DEBUG" not in os.environ  # --debug does not leak into the caller's environment


# --------------------------------------------------------------------------- SIGTERM


def _start(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """``nsa ARGS`` started as its own process, stdout and stderr piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "nsa_dist.cli", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )


def _wait_for_line(proc: subprocess.Popen, pattern: str) -> None:
    """Read the process's stdout until a line matches ``pattern`` (a regex); fail if it ends first."""
    import re

    for line in proc.stdout:
        if re.search(pattern, line):
            return
    proc.wait()
    raise AssertionError(f"the process ended (rc {proc.returncode}) before {pattern!r}: {proc.stderr.read()[-3000:]}")


def _finish(proc: subprocess.Popen) -> str:
    """Its stderr once it has exited."""
    try:
        return proc.communicate(timeout=300)[1]
    finally:
        proc.kill()


@pytest.mark.slow
def test_sigterm_of_nsa_run_ends_like_ctrl_c(tmp_path):
    url = str(tmp_path / "s.zarr")
    proc = _start(["run", str(_spec(tmp_path, LONG)), "--store", url, "--plain"], tmp_path)
    _wait_for_line(proc, r"^\[nsa\] step ")
    proc.send_signal(signal.SIGTERM)
    err = _finish(proc)
    assert proc.returncode == 143, err[-3000:]
    assert _error_line(err, "run") == "nsa run: terminated (SIGTERM); re-run the same command to resume"
    run = Client(url).run(Client(url).runs()["id"].iloc[0])
    assert run.status == "interrupted", (run.status, run.reason)


@pytest.mark.slow
def test_sigterm_of_nsa_sweep_ends_like_ctrl_c_without_a_ray_dump(tmp_path):
    url = str(tmp_path / "s.zarr")
    sweep = _spec(tmp_path, {"name": "sig", "base": LONG, "grid": {"seed": [0, 1]}, "cluster": {"spectral_workers": 1}})
    proc = _start(["sweep", str(sweep), "--store", url, "--plain"], tmp_path)
    _wait_for_line(proc, r": running [1-9][0-9]*/")  # a run has recorded a step
    proc.send_signal(signal.SIGTERM)
    err = _finish(proc)
    assert proc.returncode == 143, err[-3000:]
    assert "SIGTERM received" not in err and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "nsa sweep: terminated (SIGTERM); re-run the same command to resume", err
    assert sorted(Client(url).runs()["status"]) == ["interrupted", "interrupted"]
