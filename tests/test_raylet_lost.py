"""A sweep whose Ray raylet dies under it: its runs are *interrupted* (not failed), the command
says so in one line naming the raylet (no Ray dump on the console), the finished steps are kept,
and running the same command again resumes to ``done`` with the arrays of an uninterrupted run.

Real ``nsa sweep`` processes on their own embedded Ray; the raylet killed is the one started by
that process (found among its own children), never another Ray on this machine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import yaml

from nsa_dist.client import Client
from nsa_dist.config import SweepSpec
from nsa_dist.pipeline import run_experiment, run_id
from nsa_dist.store import SpectrumStore

# parameters of 40 kB+ (a checkpoint Ray keeps in the raylet's object store, not inline), and
# enough recorded steps that the raylet is killed with most of the run still ahead
SWEEP = {
    "name": "raylet",
    "base": {
        "data": {"n": 40},
        "model": {"depth": 3, "width": 96},
        "steps": 160,
        "record": {"every": 10},
        "spectrum": {"k": 10},
    },
    "cluster": {"spectral_workers": 1, "max_inflight": 1},
}
COMPARE = ("theta", "f", "df", "eigenvalues", "energy_y", "energy_residual", "first_order_error", "loss", "loss_trace")


def _own_raylet(proc: subprocess.Popen) -> psutil.Process | None:
    """The raylet that ``proc``'s embedded Ray started (a child of ``proc``), if it is up."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for k in kids:
        try:
            if os.path.basename(k.cmdline()[0]) == "raylet":
                return k
        except (psutil.NoSuchProcess, psutil.AccessDenied, IndexError):
            continue
    return None


def _done(store: str, rid: str) -> int:
    try:
        return int(np.sum(Client(store).run(rid).g["done"][:]))
    except Exception:  # noqa: BLE001 - the run is not created yet, or its metadata is being written
        return 0


def _sweep(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_killed_raylet_interrupts_the_sweep_in_one_line_and_a_rerun_resumes_bit_identical(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(SWEEP))
    store = str(tmp_path / "s.zarr")
    (spec,) = SweepSpec.model_validate(SWEEP).expand()
    rid = run_id(spec)
    cmd = [sys.executable, "-m", "nsa_dist.cli", "sweep", str(path), "--store", store, "--plain"]

    proc = _sweep(cmd)
    deadline, raylet, before = time.monotonic() + 400, None, 0
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            raylet = raylet or _own_raylet(proc)
            before = _done(store, rid)
            if raylet is not None and before >= 3:
                break
            time.sleep(0.5)
        assert proc.poll() is None and raylet is not None and before >= 3, (
            f"the sweep never got 3 steps done with its raylet up (rc {proc.poll()}, {before} done)"
        )
        os.kill(raylet.pid, signal.SIGKILL)  # this sweep's raylet only
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

    said = [line for line in err.splitlines() if line.startswith("nsa sweep:")]
    assert proc.returncode == 75, f"rc {proc.returncode}\nstderr:\n{err[-3000:]}\nstdout:\n{out[-3000:]}"
    assert (
        len(said) == 1
        and "interrupted" in said[0]
        and "raylet" in said[0]
        and f"pid {raylet.pid}" in said[0]
        and f"`nsa sweep {path} --store {store} --plain`" in said[0]
    ), err
    assert "Raylet is terminated" not in out + err and "marked dead" not in out + err, (
        f"Ray's dump reached the console:\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    )
    assert "Traceback" not in err, err
    ray_logs = [line for line in err.splitlines() if re.match(r"\[\d{4}-\d\d-\d\d [^]]*\] \S+\.cc:\d+:", line)]
    assert not ray_logs, f"Ray's C++ log lines reached the console: {ray_logs}"
    run = Client(store).run(rid)
    kept = int(np.sum(run.g["done"][:]))
    assert run.status == "interrupted" and "raylet" in (run.reason or ""), (run.status, run.reason)
    assert before <= kept < run.g["done"].shape[0], f"{kept} steps done after the kill, {before} before"

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, f"the re-run failed (rc {again.returncode}):\n{again.stderr[-3000:]}"
    run = Client(store).run(rid)
    assert run.status == "done" and np.all(run.g["done"][:]), (
        run.status,
        run.reason,
        run.attrs.get("status"),
        int(np.sum(run.g["done"][:])),
        again.stdout[-2000:],
        again.stderr[-2000:],
    )

    ref_url = str(tmp_path / "ref.zarr")
    assert run_experiment(spec, SpectrumStore(ref_url)).status == "done"
    ref = Client(ref_url).run(rid)
    for name in COMPARE:
        a, b = ref.g[name][:], run.g[name][:]
        assert np.array_equal(a, b, equal_nan=True), (
            f"{name}: the resumed run differs from the uninterrupted one by up to {np.nanmax(np.abs(a - b)):.3e}"
        )
