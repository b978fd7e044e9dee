"""Ctrl-C and SIGTERM in an `nsa` command's first seconds (an audit): a KeyboardInterrupt raised
inside torch's import left it half-initialised and the error handler's own imports crashed (37–55
lines, once a segmentation fault) where every failure is promised as one line.  The front door
(`nsa_dist/__init__.py`) now imports its names on first use, and `main` imports torch with the two
signals held back, delivered after the import."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from nsa_dist.cli import _signals_deferred


def test_a_ctrl_c_inside_the_block_arrives_after_it() -> None:
    # Python's own SIGINT handler, whatever an earlier test in this process left (a test of a command's
    # handlers that ran before it in the same pytest worker: "DID NOT RAISE KeyboardInterrupt")
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    reached = False
    try:
        with pytest.raises(KeyboardInterrupt):
            with _signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):  # Python runs a handler between bytecodes: it would have run here
                    pass
                reached = True
    finally:
        signal.signal(signal.SIGINT, old)
    assert reached


def test_a_sigterm_inside_the_block_reaches_the_handler_after_it() -> None:
    seen: list[str] = []
    old = signal.signal(signal.SIGTERM, lambda *_: seen.append("handler"))
    try:
        with _signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                pass
            seen.append("block ended")
        for _ in range(1000):
            pass
    finally:
        signal.signal(signal.SIGTERM, old)
    assert seen == ["block ended", "handler"], seen


def test_the_command_line_imports_no_torch_before_its_handlers() -> None:
    """`import nsa_dist.cli` (what the `nsa` script runs first) took 3.3 s of torch, zarr and pandas."""
    code = (
        "import sys, nsa_dist.cli, nsa_dist; print(sorted(m for m in ('torch', 'zarr', 'pandas') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    # the front door's names are still there
    code = "from nsa_dist import Client, Tracker, SweepSpec; import nsa_dist; print(nsa_dist.Run.__name__)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "Run\n"


def test_nsa_ls_names_a_tracker_or_factory_model(tmp_path, capsys) -> None:
    """`nsa ls`'s L×W column read "-×-" for a model that is not the built-in MLP (a walk-through)."""
    import torch

    from nsa_dist import Tracker
    from nsa_dist.cli import main

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1), torch.nn.Flatten(0))
    X, y = torch.randn(10, 2, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    url = str(tmp_path / "r.zarr")
    tr = Tracker(url, "tiny", m.double(), X, y, steps=1, record={"every": 1}, spectrum={"k": 2, "images": []})
    tr.record(0, lr=0.1, loss=1.0)
    tr.close()
    capsys.readouterr()
    assert main(["ls", "--store", url]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "tiny" in line)
    assert "Sequential" in row and "-×-" not in row, row
