"""Every damage ``nsa verify`` sees, ``verify --mark`` repairs, and every damage a reader trips on,
``verify`` sees: chunks of the wrong kind — a directory, a symbolic link (to a file, or a folder
linked to outside the store), a FIFO, a device — are reported by verify and by the readers alike,
removed by ``--mark`` (a link itself, never what it points to), and a re-run ends bit-identical
to the undamaged run without writing anything outside the store.  A run's or an array's folder
that is a link is replaced by a real folder holding a copy of its target (the target untouched),
or, linked to nothing, the run is recomputed from scratch.

Real stores on disk and real re-runs; nothing mocked.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
from conftest import finished_run, small_run_spec

from nsa_dist.cli import main as nsa
from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec
from nsa_dist.errors import StoreError
from nsa_dist.pipeline import run_experiment
from nsa_dist.store import SpectrumStore

TINY = small_run_spec("repair")


@pytest.fixture(scope="module")
def undamaged(tmp_path_factory) -> tuple[str, str]:
    """(store URL, run id) of one finished run, never damaged: the reference."""
    return finished_run(tmp_path_factory, TINY, "repair")


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (links not followed): its content hash."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _dir_chunk(run: Path, outside: Path) -> tuple[Path, str]:
    chunk = run / "eigenvalues" / "c" / "2" / "0"
    chunk.unlink()
    chunk.mkdir()
    (chunk / "stray").write_bytes(b"x")
    return chunk, "a directory where a chunk file belongs"


def _static_dir_chunk(run: Path, outside: Path) -> tuple[Path, str]:
    chunk = run / "loss_trace" / "c" / "0"
    chunk.unlink()
    chunk.mkdir()
    return chunk, "a directory where a chunk file belongs"


def _linked_folder(run: Path, outside: Path) -> tuple[Path, str]:
    folder = run / "f" / "c" / "1"
    shutil.copytree(folder, outside / "c1")  # the right bytes, outside the store: still refused
    shutil.rmtree(folder)
    folder.symlink_to(outside / "c1")
    return folder, "a symbolic link"


def _linked_file(run: Path, outside: Path) -> tuple[Path, str]:
    chunk = run / "eigenvalues_test" / "c" / "1" / "0"
    shutil.copy(chunk, outside / "chunk")
    chunk.unlink()
    chunk.symlink_to(outside / "chunk")
    return chunk, "a symbolic link"


def _fifo(run: Path, outside: Path) -> tuple[Path, str]:
    chunk = run / "f" / "c" / "3" / "0"
    chunk.unlink()
    os.mkfifo(chunk)
    return chunk, "a FIFO"


def _device(run: Path, outside: Path) -> tuple[Path, str]:
    chunk = run / "eigenvalues" / "c" / "1" / "0"
    chunk.unlink()
    try:
        os.mknod(chunk, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
    except PermissionError:
        pytest.skip("making a device file needs root")
    return chunk, "a character device"


def _damaged_copy(undamaged: tuple[str, str], tmp_path: Path, damage) -> tuple[str, Path, tuple[Path, str]]:
    """(a copy of the undamaged store, a folder outside it, what ``damage`` did to the copy's run)."""
    a, rid = undamaged
    b = str(tmp_path / "b.zarr")
    shutil.copytree(a, b)
    outside = tmp_path / "outside"
    outside.mkdir()
    return b, outside, damage(Path(b) / "runs" / rid, outside)


@pytest.mark.parametrize(
    "damage",
    [_dir_chunk, _static_dir_chunk, _linked_folder, _linked_file, _fifo, _device],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_chunk_of_the_wrong_kind_is_seen_removed_and_recomputed_bit_identical(undamaged, tmp_path, damage, capsys):
    (a, rid), b, outside, (entry, kind) = undamaged, *_damaged_copy(undamaged, tmp_path, damage)
    before_outside = _tree(outside)

    damage_found = Client(b).verify()
    assert [d.path for d in damage_found if not d.unfinished] and all(
        d.path == str(entry) and kind in d.problem for d in damage_found
    ), [str(d) for d in damage_found]
    run = Client(b).run(rid)
    name = entry.relative_to(Path(b) / "runs" / rid).parts[0]
    with pytest.raises(StoreError) as e:  # the readers refuse what verify names, never read through it
        run.array(name)
    assert str(entry) in str(e.value) and kind in str(e.value), str(e.value)

    assert nsa(["verify", b]) == 1
    assert str(entry) in capsys.readouterr().out
    assert nsa(["verify", b, "--mark"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert not os.path.lexists(entry) or (entry.is_dir() and not entry.is_symlink() and name == "f"), (
        f"--mark left {entry} ({os.lstat(entry)})"
    )
    out = run_experiment(ExperimentSpec(**TINY), SpectrumStore(b))
    assert out.status == "done", out
    assert nsa(["verify", b]) == 0, capsys.readouterr().out
    assert _tree(outside) == before_outside, "the re-run wrote outside the store"
    assert not [p for p in Path(b).rglob("*") if p.is_symlink()], "a link is left in the store"
    ref, got = Client(a).run(rid), Client(b).run(rid)
    assert ref.array_names() == got.array_names()
    for arr in ref.array_names():
        x, y = ref.array(arr), got.array(arr)
        np.testing.assert_array_equal(y, x, err_msg=f"array {arr!r} differs from the undamaged run after the repair")


def test_a_fenced_writer_never_writes_or_deletes_through_a_linked_folder(undamaged, tmp_path):
    """Even before ``verify --mark``: a re-run into a run with a linked chunk folder is refused
    (one line naming the link), and nothing outside the store changes."""
    b, outside, (folder, _) = _damaged_copy(undamaged, tmp_path, _linked_folder)
    rid = undamaged[1]
    before = _tree(outside)
    from nsa_dist.store.fencing import RunFence

    fence = RunFence(Path(b), rid, "t", b)
    with pytest.raises(StoreError, match=f"{folder} is a symbolic link"):
        fence.check_inside(folder / "0")
    with pytest.raises(StoreError, match="through the symbolic link"):
        fence.delete(folder / "0")
    assert _tree(outside) == before


def _link_folder(store: Path, rid: str, folder: str, where: str, tmp_path: Path) -> tuple[Path, Path]:
    """Replace run ``rid``'s ``folder`` ('' for the run's own) by a symbolic link: to a copy outside
    the store ("outside"), the same with one done step's chunk missing ("outside-damaged"), to a
    copy elsewhere inside the store's directory ("inside"), or to nothing ("dangling").
    ("outside-damaged": one chunk missing, one a FIFO — never opened by the copy.)
    Returns (the link, its target)."""
    link = store / "runs" / rid / folder if folder else store / "runs" / rid
    target = (store / "stash" if where == "inside" else tmp_path / "outside") / (folder or rid)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(link, target)
    if where == "outside-damaged":  # eigenvalues at recorded step index 2 missing, at index 1 a FIFO
        (target / "c" / "2" / "0").unlink()
        (target / "c" / "1" / "0").unlink()
        os.mkfifo(target / "c" / "1" / "0")
    shutil.rmtree(link)
    if where == "dangling":
        shutil.rmtree(target)
    link.symlink_to(target)
    return link, target


@pytest.mark.parametrize(
    ("folder", "where"),
    [
        ("", "outside"),
        ("eigenvalues", "outside-damaged"),
        ("eigenvalues", "inside"),
        ("", "dangling"),
        ("eigenvalues", "dangling"),
        ("loss_trace", "dangling"),
    ],
    ids=lambda v: v or "run",
)
def test_a_linked_run_or_array_folder_is_replaced_by_a_copy_and_recomputed_bit_identical(
    undamaged, tmp_path, folder, where, capsys
):
    """A run's or an array's folder that is a symbolic link holds metadata: readers refuse it,
    ``verify`` names it, ``--mark`` replaces it by a real folder holding a copy of the target
    (never written through: the target is untouched) — or, linked to nothing, removes the run /
    recreates the array and marks the run for recomputation from scratch — and a re-run ends
    bit-identical to the undamaged run."""
    a, rid = undamaged
    b = Path(tmp_path / "b.zarr")
    shutil.copytree(a, b)
    link, target = _link_folder(b, rid, folder, where, tmp_path)
    before = _tree(target)
    with pytest.raises(StoreError, match=rid if (where, folder) == ("dangling", "") else f"{link} is a symbolic link"):
        Client(str(b)).run(rid).array(folder or "eigenvalues")  # a run linked to nothing is no run
    damage = Client(str(b)).verify()
    assert len(damage) == 1 and damage[0].link and damage[0].path == str(link), [str(d) for d in damage]
    capsys.readouterr()
    assert nsa(["verify", str(b), "--mark"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    steps = len(Client(a).run(rid).g["done"][:])
    want = (
        ("removed" if not folder else f"step indices {list(range(steps))}")
        if where == "dangling"
        else f"step indices {[1, 2] if where == 'outside-damaged' else []}"
    )  # a copy recovers all it holds
    assert f"{rid}: {want} " in out, out
    assert not link.is_symlink() and (link.is_dir() or (where, folder) == ("dangling", "")), f"--mark left {link}"
    assert _tree(target) == before, "the link's target changed"
    if where != "dangling":
        status = Client(str(b)).run(rid).status
        assert status == "pending", status

    assert run_experiment(ExperimentSpec(**TINY), SpectrumStore(str(b))).status == "done"
    assert nsa(["verify", str(b)]) == 0, capsys.readouterr().out
    assert _tree(target) == before, "the re-run wrote to the link's target"
    assert not [p for p in b.rglob("*") if p.is_symlink()], "a link is left in the store"
    ref, got = Client(a).run(rid), Client(str(b)).run(rid)
    assert ref.array_names() == got.array_names()
    for arr in ref.array_names():
        np.testing.assert_array_equal(
            got.array(arr), ref.array(arr), err_msg=f"array {arr!r} differs from the undamaged run after the repair"
        )
