"""The Tracker in a real Jupyter kernel (ipykernel, driven by jupyter_client as a notebook front end
is).  IPython catches a cell's SystemExit and goes on: a SIGTERM to a kernel with a run open (a
scheduler's stop, papermill's) ended the cell and left the kernel alive — a run opened outside a
``with`` block stayed open, and a second SIGTERM, the handler spent, killed the kernel with steps in
flight (Audit I).  Now the cell ends, every run still open finishes its recorded steps and ends
``interrupted``, and the kernel ends as SIGTERM asks."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ipykernel")
jupyter_client = pytest.importorskip("jupyter_client")

SETUP = """
import os, signal, threading, time, torch
from nsa_dist import Tracker
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
X, y = torch.rand(32, 2, dtype=torch.float64), torch.rand(32, dtype=torch.float64)
opt = torch.optim.SGD(model.parameters(), lr=0.05)

def train(tr, t0, t1, kill_at=None):
    for t in range(t0, t1):
        loss = 0.5 * ((model(X).squeeze(-1) - y) ** 2).mean()
        if tr.due(t):
            tr.record(t, lr=opt, loss=loss.item())
        else:
            tr.log(t, loss.item())
        opt.zero_grad(); loss.backward(); opt.step()
        if t == kill_at:
            os.kill(os.getpid(), signal.SIGTERM)
"""


def _kernel(tmp_path: Path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.kernel_spec.argv[0] = sys.executable  # this interpreter, whatever the kernelspec says
    km.start_kernel(env=env, cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    return km, kc


def _run(km, kc, code: str, timeout: float = 120) -> dict:
    """Execute ``code``; its reply's content, or {"status": "dead"} when the kernel ends before replying."""
    import queue

    msg_id = kc.execute(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_shell_msg(timeout=0.2)
        except queue.Empty:
            if not km.is_alive():
                return {"status": "dead"}
            continue
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg["content"]
    raise AssertionError(f"no reply to {code[:60]!r} in {timeout} s, the kernel alive")


def _ends(km, within: float = 60.0) -> int | None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and km.is_alive():
        time.sleep(0.2)
    return None if km.is_alive() else km.provisioner.process.returncode


@pytest.mark.parametrize("opened", ["with", "open"])
def test_sigterm_ends_the_kernel_after_the_run_is_interrupted_with_its_steps(tmp_path: Path, opened: str) -> None:
    from nsa_dist.client import Client

    store = tmp_path / "s.zarr"
    km, kc = _kernel(tmp_path)
    try:
        assert _run(km, kc, SETUP)["status"] == "ok"
        make = f'Tracker("{store}", "a", model, X, y, steps=20, record={{"every": 2}}, spectrum={{"k": 8}})'
        if opened == "with":  # SIGTERM inside the with block's loop, at t = 6
            reply = _run(km, kc, f"with {make} as tr:\n    train(tr, 0, 20, kill_at=6)")
        else:  # the run opened in one cell, its steps in another, SIGTERM while an unrelated cell runs
            assert _run(km, kc, f"tr = {make}\ntrain(tr, 0, 7)")["status"] == "ok"
            reply = _run(km, kc, "threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()\ntime.sleep(30)")
        code = _ends(km)
        assert code is not None, f"the kernel outlived SIGTERM (cell reply {reply.get('status')}, {reply.get('ename')})"
        assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), code
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
    run = Client(str(store)).run("a")
    assert run.status == "interrupted", (run.status, run.reason)
    assert "SIGTERM" in run.reason, run.reason
    assert [int(t) for t in run.steps] == [0, 2, 4, 6], run.steps  # every step recorded before the signal
    assert run.eigenvalues.shape == (4, 8)
