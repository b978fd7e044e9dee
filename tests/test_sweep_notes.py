"""A sweep's runs show the same log lines as ``nsa run``: their analyses run in Ray actors, whose
output Ray does not forward, so the notes travel back with each step's summary
(:mod:`nsa_dist.pipeline.notes`)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import yaml

from nsa_dist.pipeline.notes import recorded_notes, replay_notes

QUAD = {
    "data": {"name": "image2d", "n": 300},
    "model": {"depth": 3, "width": 32},
    "steps": 10,
    "record": {"steps": [0, 9]},
    "spectrum": {"k": "all", "energy": "quadrature", "quadrature": {"top": 16, "lanczos_steps": 30, "probes": 8}},
}


def test_recorded_notes_keep_info_and_above_and_put_the_log_back():
    log = logging.getLogger("nsa_dist.some.module")
    root = logging.getLogger("nsa_dist")
    before = (root.level, list(root.handlers))
    with recorded_notes() as notes:
        log.debug("not this")
        log.info("step %d: a note", 3)
        log.warning("a warning")
    log.info("after the block")
    assert notes == [(logging.INFO, "step 3: a note"), (logging.WARNING, "a warning")]
    assert (root.level, list(root.handlers)) == before
    with recorded_notes(on=False) as off:
        log.warning("in-process: the caller's handlers show it")
    assert off == [] and (root.level, list(root.handlers)) == before


def test_replay_notes_names_the_run(caplog):
    caplog.set_level(logging.INFO, logger="nsa_dist")
    replay_notes("r-1", [(logging.INFO, "step 3: a note"), (logging.WARNING, "w")], logging.getLogger("nsa_dist.x"))
    replay_notes("r-1", None, logging.getLogger("nsa_dist.x"))
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "run r-1: step 3: a note"),
        (logging.WARNING, "run r-1: w"),
    ]


@pytest.mark.slow
def test_nsa_sweep_shows_a_workers_bracket_line(tmp_path):
    """Before: the widest-bracket line of docs/curves.md never reached the console of a sweep."""
    sweep = {"name": "qn", "base": QUAD, "variants": [{"seed": 0}], "cluster": {"spectral_workers": 1}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    proc = subprocess.run(
        [sys.executable, "-m", "nsa_dist.cli", "sweep", str(path), "--store", str(tmp_path / "s.zarr"), "--plain"],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, f"nsa sweep failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}\n{proc.stdout}"
    lines = [ln for ln in proc.stderr.splitlines() if "bracket is widest at k = " in ln]
    assert lines, proc.stderr[-3000:]
    assert all(ln.startswith("[nsa] run ") and ": step " in ln for ln in lines), lines
    assert any(": step 0: E(residual, k)'s bracket is widest at k = " in ln for ln in lines), lines
    assert len(lines) == len(set(lines)), lines  # no line twice
