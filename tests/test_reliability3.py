"""Reliability as a user meets it (third trial): damage every reader trips on is named, seen by
``nsa verify``, repaired by ``--mark`` and a re-run, bit for bit.

- An array's ``zarr.json`` that is unreadable or gone is named by every command — ``nsa export``
  included, which lists the run's arrays first — never a bare JSON error, never an array silently
  left out of the listing.
- The arrays written after a run's last step (``preservation``, ``constant_gram_*``): a damaged or
  missing chunk, or unreadable metadata, is an error naming the file (a missing chunk was read as
  zeros and drawn as NSA Fig. 7d), ``nsa verify`` lists it (it said "no damage found"), ``--mark``
  removes the array and the re-run writes it anew, equal to the undamaged run's.
- A new store's root whose creation was killed while Zarr wrote its ``zarr.json`` (only the
  temporary ``zarr.<hex>.partial`` left) is created by the next run — it was refused for ever as
  "a non-empty directory that is not an nsa-dist spectrum store".

Real stores on disk and real runs; nothing mocked.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import finished_run, small_run_spec

from nsa_dist.cli import main as nsa
from nsa_dist.client import Client
from nsa_dist.errors import StoreError
from nsa_dist.store import SpectrumStore
from nsa_dist.store.status import Status
from nsa_dist.store.verify import verify_store

TINY = small_run_spec("rel3")


@pytest.fixture(scope="module")
def undamaged(tmp_path_factory) -> tuple[str, str]:
    """(store URL, run id) of one finished run, never damaged: the reference."""
    return finished_run(tmp_path_factory, TINY, "rel3")


def _copy(undamaged: tuple[str, str], tmp_path: Path) -> tuple[str, str, Path]:
    url, rid = undamaged
    b = str(tmp_path / "b.zarr")
    shutil.copytree(url, b)
    return b, rid, Path(b) / "runs" / rid


def _assert_same_arrays(a_url: str, b_url: str, rid: str) -> None:
    a, b = Client(a_url).run(rid), Client(b_url).run(rid)
    assert sorted(a.array_names()) == sorted(b.array_names())
    for name in a.array_names():
        np.testing.assert_array_equal(a.array(name), b.array(name), err_msg=f"array {name!r} differs")


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --------------------------------------------------------------------------- array metadata
def test_an_unreadable_array_zarr_json_is_named_by_export(undamaged, tmp_path, capsys):
    b, rid, run = _copy(undamaged, tmp_path)
    (run / "energy_y" / "zarr.json").write_text("garbage{")
    assert nsa(["export", rid, "--store", b, "--tensorboard", str(tmp_path / "tb")]) == 2
    line = _one_error(capsys)
    assert f"{run}/energy_y/zarr.json is unreadable" in line, line
    assert not (tmp_path / "tb" / rid).exists()


def test_a_missing_array_zarr_json_is_listed_and_named_never_left_out(undamaged, tmp_path, capsys):
    b, rid, run = _copy(undamaged, tmp_path)
    (run / "eigenvalues" / "zarr.json").unlink()
    r = Client(b).run(rid)
    assert "eigenvalues" in r.array_names()  # listed: reading it names the damage
    with pytest.raises(StoreError, match=r"array 'eigenvalues' is missing .*eigenvalues/zarr\.json"):
        r.array("eigenvalues")
    assert nsa(["export", rid, "--store", b, "--tensorboard", str(tmp_path / "tb")]) == 2
    line = _one_error(capsys)
    assert "array 'eigenvalues' is missing" in line and "eigenvalues/zarr.json" in line, line


# --------------------------------------------------------------------------- post-run arrays
def _truncate(run: Path) -> tuple[str, str]:
    chunk = run / "preservation" / "c" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:10])
    return "preservation", "preservation/c/0/0"


def _remove(run: Path) -> tuple[str, str]:
    (run / "preservation" / "c" / "0" / "0").unlink()
    return "preservation", "preservation/c/0/0"


def _garbage_meta(run: Path) -> tuple[str, str]:
    (run / "constant_gram_energy" / "zarr.json").write_text("{")
    return "constant_gram_energy", "constant_gram_energy/zarr.json"


@pytest.mark.parametrize("damage", [_truncate, _remove, _garbage_meta], ids=["truncated", "removed", "garbage-meta"])
def test_a_damaged_post_run_array_is_named_verified_and_rewritten(undamaged, tmp_path, damage, capsys):
    b, rid, run = _copy(undamaged, tmp_path)
    name, where = damage(run)
    with pytest.raises(StoreError) as e:  # never the fill value (zeros) presented as data
        Client(b).run(rid).array(name)
    assert f"{run}/{where}" in str(e.value), str(e.value)
    assert nsa(["verify", b]) == 1
    out = capsys.readouterr().out
    assert f"{run}/{where}" in out and "no damage found" not in out, out
    assert nsa(["verify", b, "--mark"]) == 0
    assert f"{rid}: step indices [] marked not done" in capsys.readouterr().out  # no step recomputed
    assert not (run / name).exists()  # removed whole; the steps are kept
    assert Client(b).run(rid).steps.tolist() == Client(undamaged[0]).run(rid).steps.tolist()
    assert nsa(["run", "--plain", "--store", b, _spec_file(tmp_path)]) == 0
    assert "(0 recorded steps computed)" in capsys.readouterr().out
    assert nsa(["verify", b]) == 0
    _assert_same_arrays(undamaged[0], b, rid)


def _spec_file(tmp_path: Path) -> str:
    import yaml

    path = tmp_path / "rel3.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


# --------------------------------------------------------------------------- store creation
def test_a_store_whose_root_zarr_json_write_was_killed_is_created_by_the_next_run(undamaged, tmp_path, capsys):
    store = tmp_path / "new.zarr"
    store.mkdir()  # what a SIGKILL inside zarr's atomic write of the root zarr.json leaves
    (store / "zarr.0123456789abcdef0123456789abcdef.partial").write_bytes(b'{"zarr_for')
    assert nsa(["run", "--plain", "--store", str(store), _spec_file(tmp_path)]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in store.iterdir()) == ["leases", "runs", "zarr.json"]
    _assert_same_arrays(undamaged[0], str(store), undamaged[1])
    foreign = tmp_path / "foreign"  # anything else beside such a file: still not a store, refused
    foreign.mkdir()
    (foreign / "zarr.0123456789abcdef0123456789abcdef.partial").write_bytes(b"")
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not an nsa-dist spectrum store"):
        SpectrumStore(str(foreign))
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt", "zarr.0123456789abcdef0123456789abcdef.partial"]


# --------------------------------------------------------------------------- a run's own metadata
def test_a_run_whose_zarr_json_is_gone_is_listed_damaged_and_named_never_hidden(undamaged, tmp_path, capsys):
    b, rid, run = _copy(undamaged, tmp_path)
    (run / "zarr.json").unlink()  # its arrays and every recorded step are still there
    rows = Client(b).runs()
    assert rows["id"].tolist() == [rid] and rows["status"].tolist() == ["damaged"], rows[["id", "status"]]
    assert f"{run}/zarr.json is missing" in rows["reason"].iloc[0]
    with pytest.raises(StoreError, match=rf"{rid}.*{run}/zarr\.json is missing"):
        Client(b).run(rid)
    assert nsa(["show", rid, "--store", b]) == 2
    assert f"{run}/zarr.json is missing" in _one_error(capsys)
    assert nsa(["verify", b]) == 1  # not "0 run(s), no damage found"
    out = capsys.readouterr().out
    assert f"{run}/zarr.json" in out and "1 damaged piece(s) in 1 of 1 run(s)" in out, out
    assert nsa(["verify", b, "--mark"]) == 2  # damaged metadata is not repaired: nothing deleted
    assert sorted(p.name for p in run.iterdir()) == sorted(
        p.name for p in (Path(undamaged[0]) / "runs" / rid).iterdir() if p.name != "zarr.json"
    )


# --------------------------------------------------------------------------- the done flags
def test_a_lost_done_flag_is_damage_and_its_step_recomputed(undamaged, tmp_path, capsys):
    """A finished run whose ``done`` chunk of one step is gone hid that step from every reader
    (``nsa show``: 3/4 steps; ``nsa ls``: 4/4) while ``nsa verify`` said "no damage found"."""
    b, rid, run = _copy(undamaged, tmp_path)
    (run / "done" / "c" / "1").unlink()
    assert Client(b).run(rid).steps.tolist() != Client(undamaged[0]).run(rid).steps.tolist()
    assert nsa(["verify", b]) == 1
    out = capsys.readouterr().out
    assert f"{run}/done/c/1" in out and "done flag" in out and "no damage found" not in out, out
    assert nsa(["verify", b, "--mark"]) == 0
    assert f"{rid}: step indices [1] marked not done" in capsys.readouterr().out
    assert nsa(["run", "--plain", "--store", b, _spec_file(tmp_path)]) == 0
    assert "(1 recorded steps computed)" in capsys.readouterr().out
    assert nsa(["verify", b]) == 0
    _assert_same_arrays(undamaged[0], b, rid)


def test_a_missing_done_flag_of_a_step_not_yet_recorded_is_not_damage(undamaged, tmp_path, capsys):
    b, rid, run = _copy(undamaged, tmp_path)
    for i in (2, 3):  # a run stopped after its second step: the later flags were never written
        (run / "done" / "c" / str(i)).unlink()
    assert nsa(["verify", b]) == 1  # the run says it finished: its flags must all be there
    assert "2 damaged piece(s)" in capsys.readouterr().out
    s = SpectrumStore(b)  # the same run as one stopped after its second step: nothing damaged
    with s.lease([rid]) as lease:
        s.reopen(rid, token=lease.token).set_status(Status.PENDING, "stopped by hand")
    assert verify_store(s) == [], "a step not yet recorded has no flag: not damage"


@pytest.mark.parametrize("chunk", ["steps/c/0", "y_test/c/0"])
def test_a_missing_static_chunk_is_damage_named_verified_and_rewritten(undamaged, tmp_path, chunk, capsys):
    """A chunk of an array written whole at the run's creation, deleted: the readers gave its fill
    value as data (``steps`` all 0: every step at t = 0) and ``nsa verify`` said "no damage found"."""
    b, rid, run = _copy(undamaged, tmp_path)
    (run / chunk).unlink()
    name = chunk.split("/")[0]
    with pytest.raises(StoreError, match="is missing") as e:
        Client(b).run(rid).array(name)
    assert f"{run}/{chunk}" in str(e.value), str(e.value)
    assert nsa(["verify", b]) == 1
    out = capsys.readouterr().out
    assert f"{run}/{chunk}" in out and "no damage found" not in out, out
    assert nsa(["verify", b, "--mark"]) == 0
    capsys.readouterr()
    assert nsa(["run", "--plain", "--store", b, _spec_file(tmp_path)]) == 0, capsys.readouterr().err
    assert nsa(["verify", b]) == 0
    _assert_same_arrays(undamaged[0], b, rid)


def test_a_tracker_recording_sparsely_is_not_damaged(tmp_path):
    """A Tracker writes the loss trace only around the steps it notes: recording t = 0 and
    199,999 of 200,000 leaves chunks 1 and 2 of ``loss_trace`` unwritten, NaN by their fill value —
    no damage (a first version of the static-chunk check called the finished run damaged)."""
    import torch

    from nsa_dist import Tracker
    from nsa_dist.store.verify import verify_store

    url, T = str(tmp_path / "t.zarr"), 200_000
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    X, y = torch.randn(16, 2, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    with Tracker(url, "sparse", net, X, y, steps=T, record={"steps": [0, T - 1]}, spectrum={"k": 4}) as tr:
        tr.record(0, lr=0.1)
        tr.record(T - 1, lr=0.1)
    run = Client(url).run("sparse")
    assert run.status == "done" and run.steps.tolist() == [0, T - 1]
    trace = run.loss_trace
    assert np.isfinite(trace[[0, T - 1]]).all() and np.isnan(trace[70_000:130_000]).all()
    assert verify_store(SpectrumStore(url)) == []
