"""Round 4 of "nothing lost, never a wrong number" (audit K): a missing ``loss_trace`` chunk of an
``nsa run`` run is damage, an unreadable ``done`` chunk is named and repaired by recomputing its steps,
and a finished run re-run is left as it is (its post-run arrays were rewritten, and a kill between an
array's re-creation and its data lost it)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np
import pytest
import yaml
import zarr

from nsa_dist.cli import main as nsa

SPEC = {
    "name": "e",
    "data": {"name": "image2d", "n": 48},
    "model": {"depth": 2, "width": 12},
    "steps": 30,
    "record": {"every": 10},
    "spectrum": {"k": 4, "images": []},
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path, str]:
    """(spec file, a finished store, its run id)."""
    root = tmp_path_factory.mktemp("rel4")
    spec = root / "e.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    store = root / "ref.zarr"
    assert nsa(["run", str(spec), "--store", str(store), "--plain"]) == 0
    (rid,) = [d for d in os.listdir(store / "runs") if d != "zarr.json"]
    return spec, store, rid


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _same(a: Path, b: Path, rid: str) -> None:
    ga, gb = zarr.open_group(str(a), mode="r")["runs"][rid], zarr.open_group(str(b), mode="r")["runs"][rid]
    for name in ga.array_keys():
        x, y = np.asarray(ga[name][...]), np.asarray(gb[name][...])
        assert np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"), f"{name} differs from the reference"


def test_a_missing_loss_trace_chunk_is_damage_and_a_rerun_restores_it(finished, tmp_path, capsys):
    spec, ref, rid = finished
    s = _copy(ref, tmp_path / "s.zarr")
    (chunk,) = glob.glob(str(s / "runs" / rid / "loss_trace" / "c" / "0"))
    os.remove(chunk)
    assert nsa(["verify", str(s)]) == 1
    assert "loss_trace: chunk missing (the losses of steps the run trained)" in capsys.readouterr().out
    assert nsa(["export", rid, "--tensorboard", str(tmp_path / "tb"), "--store", str(s)]) != 0  # not 300 points dropped
    assert "loss_trace" in capsys.readouterr().err
    assert nsa(["verify", str(s), "--mark"]) == 0
    assert nsa(["run", str(spec), "--store", str(s), "--plain"]) == 0
    assert nsa(["verify", str(s)]) == 0
    _same(ref, s, rid)


def test_an_unreadable_done_chunk_is_named_and_its_steps_recomputed(finished, tmp_path, capsys):
    spec, ref, rid = finished
    s = _copy(ref, tmp_path / "s.zarr")
    (s / "runs" / rid / "done" / "c" / "2").write_bytes(os.urandom(40))
    assert nsa(["run", str(spec), "--store", str(s), "--plain"]) == 2
    err = capsys.readouterr().err
    assert f"run {rid!r}: array 'done'" in err and f"nsa verify {s} --mark" in err, err
    assert nsa(["verify", str(s)]) == 1
    out = capsys.readouterr().out
    assert "done step 20 (index 2): unreadable chunk" in out and "(run metadata)" not in out, out
    assert nsa(["verify", str(s), "--mark"]) == 0
    assert nsa(["run", str(spec), "--store", str(s), "--plain"]) == 0
    assert nsa(["verify", str(s)]) == 0
    _same(ref, s, rid)


def test_a_finished_run_rerun_is_left_as_it_is(finished, tmp_path):
    spec, ref, rid = finished
    s = _copy(ref, tmp_path / "s.zarr")
    files = {p: p.read_bytes() for p in (s / "runs" / rid).rglob("*") if p.is_file()}
    assert nsa(["run", str(spec), "--store", str(s), "--plain"]) == 0
    changed = [str(p.relative_to(s)) for p, b in files.items() if not p.exists() or p.read_bytes() != b]
    assert not changed, f"a re-run of the finished run rewrote {changed}"


def test_a_finished_run_missing_a_post_run_array_is_finished_again(finished, tmp_path):
    """A `done` run whose `preservation` is gone (the kill this guards against, or an older nsa-dist's
    run) is finished again by a re-run; a whole one is left as it is (above)."""
    import shutil

    spec, ref, rid = finished
    s = _copy(ref, tmp_path / "s.zarr")
    shutil.rmtree(s / "runs" / rid / "preservation")
    assert nsa(["run", str(spec), "--store", str(s), "--plain"]) == 0
    _same(ref, s, rid)
    assert (s / "runs" / rid / "preservation").is_dir()
