"""``nsa export --tensorboard`` is atomic: a full disk, a damaged chunk or Ctrl-C leaves nothing in
the export folder, says so in one line naming the folder (or the chunk), and the next export
into the same folder succeeds.

Real stores and real event files; the full disk is a real small tmpfs where one can be mounted
(root), and everywhere an ``ENOSPC`` raised by the event-file writer's own write.
"""

from __future__ import annotations

import errno
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import finished_run, small_run_spec

from nsa_dist.cli import main as nsa

TINY = small_run_spec("exp")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[str, str]:
    """(store URL, run id) of one finished small run."""
    return finished_run(tmp_path_factory, TINY, "export", "s.zarr")


def _export(url: str, rid: str, logdir: Path) -> int:
    return nsa(["export", rid, "--tensorboard", str(logdir), "--store", url])


def _leftovers(logdir: Path) -> list[str]:
    return sorted(str(p.relative_to(logdir)) for p in logdir.rglob("*")) if logdir.exists() else []


def _assert_complete(logdir: Path, rid: str) -> None:
    """The export in ``logdir`` is one event file TensorBoard's reader reads to the end."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    left = _leftovers(logdir)
    events = [p for p in left if p.startswith(f"{rid}/events.out.tfevents.")]
    assert len(events) == 1 and set(left) - set(events) == {rid, f"{rid}/nsa-export.json"}, left
    acc = EventAccumulator(str(logdir / rid), size_guidance={"tensors": 0, "histograms": 0})
    acc.Reload()
    assert len(acc.Tensors("loss/train")) == TINY["steps"], len(acc.Tensors("loss/train"))
    assert [h.step for h in acc.Histograms("spectrum/eigenvalues")] == [0, 10, 20, 29]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, f"{len(err)} lines on stderr: {err}"
    return err[0]


def _fail_writes_after(monkeypatch, n: int, exc: BaseException) -> None:
    """The event-file writer writes ``n`` records, then raises ``exc`` (as a full disk would)."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    real, calls = RecordWriter.write, []

    def write(self, data):
        calls.append(1)
        if len(calls) > n:
            raise exc
        return real(self, data)

    monkeypatch.setattr(RecordWriter, "write", write)


def test_an_enospc_while_writing_leaves_nothing_and_names_the_export_folder(recorded, tmp_path, monkeypatch, capsys):
    url, rid = recorded
    logdir = tmp_path / "tb"
    _fail_writes_after(monkeypatch, 50, OSError(errno.ENOSPC, "No space left on device"))
    assert _export(url, rid, logdir) == 2
    line = _one_error_line(capsys)
    assert f"export folder {logdir / rid}" in line and "disk full" in line, line
    assert f"store {url}" not in line, f"the store is blamed for the export folder's disk: {line}"
    assert _leftovers(logdir) == [], f"a failed export left {_leftovers(logdir)}"
    monkeypatch.undo()
    assert _export(url, rid, logdir) == 0, capsys.readouterr().err
    _assert_complete(logdir, rid)


def test_ctrl_c_while_writing_leaves_nothing(recorded, tmp_path, monkeypatch, capsys):
    url, rid = recorded
    logdir = tmp_path / "tb"
    logdir.mkdir()
    (logdir / "other_run").mkdir()  # what a log directory already holds is untouched
    _fail_writes_after(monkeypatch, 20, KeyboardInterrupt())
    assert _export(url, rid, logdir) == 130
    assert "interrupted (Ctrl-C)" in _one_error_line(capsys)
    assert _leftovers(logdir) == ["other_run"], _leftovers(logdir)
    monkeypatch.undo()
    assert _export(url, rid, logdir) == 0
    shutil.rmtree(logdir / "other_run")
    _assert_complete(logdir, rid)


def test_a_damaged_chunk_leaves_nothing_and_names_the_chunk(recorded, tmp_path, capsys):
    url, rid = recorded
    damaged = str(tmp_path / "d.zarr")
    shutil.copytree(url, damaged)
    chunk = Path(damaged) / "runs" / rid / "eigenvalues" / "c" / "2" / "0"
    good = chunk.read_bytes()
    chunk.write_bytes(good[: len(good) // 2])
    logdir = tmp_path / "tb"
    assert _export(damaged, rid, logdir) == 2
    line = _one_error_line(capsys)
    assert str(chunk) in line and "damaged" in line, line
    assert _leftovers(logdir) == [], f"a failed export left {_leftovers(logdir)}"
    chunk.write_bytes(good)
    assert _export(damaged, rid, logdir) == 0
    _assert_complete(logdir, rid)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 24 KiB tmpfs (a real full disk for the export), unmounted after; skipped where mounting is
    not allowed (not root)."""
    where = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24k", "tmpfs", str(where)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def test_a_real_full_disk_leaves_nothing_and_the_next_export_succeeds(recorded, small_tmpfs, capsys):
    url, rid = recorded
    logdir = small_tmpfs / "tb"
    assert _export(url, rid, logdir) == 2
    line = _one_error_line(capsys)
    assert f"export folder {logdir / rid}" in line and "disk full" in line, line
    assert _leftovers(logdir) == [], f"a failed export left {_leftovers(logdir)}"
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_tmpfs)], check=True)
    assert _export(url, rid, logdir) == 0, capsys.readouterr().err
    _assert_complete(logdir, rid)
