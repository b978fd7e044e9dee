"""Store metadata damaged by hand (an audit): a run whose ``done`` array was deleted read as a finished
run with no step — the client gave ``steps == []``, ``nsa show`` "recorded 0/16 steps", ``nsa export``
"0 spectra", ``nsa plot`` "wait for a step", each with exit 0; garbage in a run's ``spec`` attribute."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import finished_run, small_run_spec

from nsa_dist.cli import main
from nsa_dist.client import Client
from nsa_dist.errors import StoreError


def test_a_deleted_done_array_is_damage_named_by_every_reader(tmp_path_factory, tmp_path, capsys) -> None:
    url, rid = finished_run(tmp_path_factory, small_run_spec("gone"), "gone")
    other, _ = finished_run(tmp_path_factory, small_run_spec("kept"), "gone", store="b.zarr")
    shutil.rmtree(Path(url) / "runs" / rid / "done")
    with pytest.raises(StoreError, match=r"array 'done' is missing"):
        Client(url).run(rid)
    for argv in (["show", rid], ["plot", rid, "--out", str(tmp_path / "f")]):
        assert main([*argv, "--store", url]) != 0, argv
        assert "array 'done' is missing" in capsys.readouterr().err, argv
    assert main(["verify", url]) == 1
    assert "done" in capsys.readouterr().out
    assert Client(url).runs().set_index("id").loc[rid, "status"] == "damaged"  # `nsa ls` said done 4/4
    assert len(Client(other).run("kept").steps) == 4  # a store without the damage reads as before


def test_garbage_in_a_runs_spec_attribute_is_damage_of_that_run_only(tmp_path_factory, capsys) -> None:
    """``spec: "garbage{"`` in one run's zarr.json: ``nsa verify`` stopped with an AttributeError for the
    whole store (the other runs never checked), ``nsa show`` and the client raised AttributeError /
    a bare pydantic error naming neither run nor file."""
    import json

    from nsa_dist.config import ExperimentSpec
    from nsa_dist.pipeline import run_experiment
    from nsa_dist.store import SpectrumStore

    url, rid = finished_run(tmp_path_factory, small_run_spec("bad"), "garbage")
    good = run_experiment(ExperimentSpec(**small_run_spec("good")), SpectrumStore(url)).run_id
    meta = Path(url) / "runs" / rid / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["spec"] = "garbage{"
    meta.write_text(json.dumps(doc))
    with pytest.raises(StoreError, match=r"its metadata's spec .* is not a spec but a str"):
        Client(url).run(rid)
    assert main(["show", rid, "--store", url]) == 2
    assert "is not a spec" in capsys.readouterr().err
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert rid in out and "1 damaged piece(s) in 1 of 2 run(s)" in out, out
    assert len(Client(url).run(good).steps) == 4
    listed = Client(url).runs().set_index("id")["status"]
    assert listed[rid] == "damaged" and listed[good] == "done", listed


def test_an_array_whose_metadata_shape_was_edited_is_named_by_verify(tmp_path_factory, capsys) -> None:
    """eigenvalues/zarr.json's shape edited: every reader called it damage and sent the user to
    ``nsa verify --mark``, which found no damage (exit 0) and marked nothing — a circle."""
    import json

    url, rid = finished_run(tmp_path_factory, small_run_spec("shape"), "shape")
    meta = Path(url) / "runs" / rid / "eigenvalues" / "zarr.json"
    doc = json.loads(meta.read_text())
    want = list(doc["shape"])
    doc["shape"] = [1, *want[1:]]
    meta.write_text(json.dumps(doc))
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert f"array 'eigenvalues''s metadata says shape {tuple([1, *want[1:]])}, the run's dims say {tuple(want)}" in out


def test_a_damaged_chunk_leaves_every_figure_that_does_not_read_it(tmp_path_factory, tmp_path, capsys) -> None:
    """One truncated eigenvalues chunk stopped `nsa plot` at the first figure reading it: 2 of ~20
    figures written, the undamaged rest (which `nsa serve` still draws) never."""
    url, rid = finished_run(tmp_path_factory, small_run_spec("chunk"), "chunk")
    chunk = Path(url) / "runs" / rid / "eigenvalues" / "c" / "1" / "0"
    chunk.write_bytes(chunk.read_bytes()[:3])
    assert main(["plot", rid, "--out", str(tmp_path / "f"), "--store", url]) == 2
    err = capsys.readouterr().err
    assert "not drawn (" in err and "fig2a_eigenvalues" in err and "eigenvalues/c/1/0" in err, err
    drawn = {p.name for p in (tmp_path / "f").iterdir()}
    assert {"loss.png", "fig7d_preservation.png"} <= drawn and "fig2a_eigenvalues.png" not in drawn, drawn


def test_a_damaged_store_root_says_how_to_write_it_anew_and_that_works(tmp_path_factory, capsys) -> None:
    """The store's own zarr.json garbled: every command said it was unreadable and nothing more, every
    intact run out of reach.  The error now gives the file's content; written back, the runs read."""
    import re

    url, rid = finished_run(tmp_path_factory, small_run_spec("root"), "root")
    (Path(url) / "zarr.json").write_text("garbage")
    assert main(["ls", "--store", url]) == 2
    err = capsys.readouterr().err
    assert "the store's own metadata" in err, err
    (Path(url) / "zarr.json").write_text(re.search(r"write it anew as (\{.*\})", err).group(1))
    assert main(["ls", "--store", url]) == 0
    assert rid in capsys.readouterr().out and len(Client(url).run(rid).steps) == 4


def _arrays(url: str, rid: str) -> dict:
    import zarr

    g = zarr.open_group(url, mode="r")[f"runs/{rid}"]
    return {name: np.asarray(a[...]) for name, a in g.arrays()}


def test_a_status_attribute_that_is_no_status_is_damage_and_mark_sets_it_pending(tmp_path_factory, capsys) -> None:
    """``status: 12345`` in a run's zarr.json was listed as it was (``12345`` in `nsa ls`), `nsa
    verify` found no damage (an audit): now damaged, named, and ``--mark`` makes the run resumable."""
    import json

    from nsa_dist.config import ExperimentSpec
    from nsa_dist.pipeline import run_experiment
    from nsa_dist.store import SpectrumStore

    spec = small_run_spec("odd")
    url, rid = finished_run(tmp_path_factory, spec, "odd")
    before = _arrays(url, rid)
    meta = Path(url) / "runs" / rid / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["status"] = 12345
    meta.write_text(json.dumps(doc))
    # and a chunk of step index 1 gone: named with it (verify returned the status alone, and --mark kept the
    # missing chunk's step done — a review)
    (Path(url) / "runs" / rid / "eigenvalues" / "c" / "1" / "0").unlink()
    row = Client(url).runs().set_index("id").loc[rid]
    assert row["status"] == "damaged" and "12345" in row["reason"], row
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert "its status attribute holds 12345" in out and "--mark" in out, out
    assert "eigenvalues step" in out and "2 damaged piece(s)" in out, out
    assert main(["verify", url, "--mark"]) == 0
    capsys.readouterr()
    assert Client(url).runs().set_index("id").loc[rid, "status"] == "pending"
    again = run_experiment(ExperimentSpec(**spec), SpectrumStore(url))
    assert again.status == "done" and again.steps_computed == 1, again
    assert main(["verify", url]) == 0
    after = _arrays(url, rid)
    assert set(after) == set(before)
    for name, a in before.items():
        np.testing.assert_array_equal(after[name], a, err_msg=name)


@pytest.mark.parametrize("gone", ["done", "eigenvalues", "loss_trace", "steps"])
def test_an_array_folder_deleted_by_hand_is_made_anew_by_mark_and_recomputed_bitwise(
    tmp_path_factory, gone, capsys
) -> None:
    """A run's array folder deleted: ``nsa verify --mark`` refused it as "damaged metadata (restore it,
    or delete the run and re-run)" — the run's other arrays lost with it (an audit).  Now --mark makes
    it anew and the re-run recomputes what it held, to the same bytes."""
    from nsa_dist.config import ExperimentSpec
    from nsa_dist.pipeline import run_experiment
    from nsa_dist.store import SpectrumStore

    spec = small_run_spec(f"gone-{gone.replace('_', '-')}")
    url, rid = finished_run(tmp_path_factory, spec, "gone")
    before = _arrays(url, rid)
    shutil.rmtree(Path(url) / "runs" / rid / gone)
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert f"array {gone!r} is missing (its folder is gone); --mark makes it anew" in out, out
    assert "cannot be repaired" not in out, out
    assert main(["verify", url, "--mark"]) == 0, capsys.readouterr()
    capsys.readouterr()
    again = run_experiment(ExperimentSpec(**spec), SpectrumStore(url))
    assert again.status == "done", again
    assert again.steps_computed == (0 if gone == "steps" else 4), again
    assert main(["verify", url]) == 0, capsys.readouterr().out
    after = _arrays(url, rid)
    assert set(after) == set(before)
    for name, a in before.items():
        np.testing.assert_array_equal(after[name], a, err_msg=name)
