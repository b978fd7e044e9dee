"""Words that are true (issue 18): a data path that is a directory or a FIFO is called so; a
constant target is refused at load time; a run whose creation was interrupted is reported as
such and repaired by a plain re-run; readers of a run being created are told so; status tables
print no ``nan``.

Real files, FIFOs, stores and ``nsa run`` processes; nothing mocked.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import stopping_cli, wait_stopped
from PIL import Image

from nsa_dist.cli import main as nsa
from nsa_dist.client import Client
from nsa_dist.config import DataSpec, ExperimentSpec
from nsa_dist.data import cifar10, load_dataset, mnist
from nsa_dist.errors import StoreError
from nsa_dist.pipeline import run_experiment, run_id
from nsa_dist.store import SpectrumStore

REPO = Path(__file__).resolve().parents[1]
TINY = dict(
    name="words",
    data={"n": 32, "n_test": 8},
    model={"depth": 2, "width": 16},
    steps=30,
    record={"every": 10},
    spectrum={"k": 8, "test_points": True},
)
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _run_cli(tmp_path: Path, spec: dict, url: str, capsys) -> tuple[int, str]:
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    capsys.readouterr()
    rc = nsa(["run", str(path), "--store", url, "--plain"])
    return rc, capsys.readouterr().err.strip()


# --------------------------------------------------------------------------- data paths
def test_a_directory_or_fifo_given_as_an_image_is_called_so(tmp_path, capsys):
    folder = tmp_path / "pictures.png"
    folder.mkdir()
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    url = str(tmp_path / "s.zarr")
    rc, err = _run_cli(
        tmp_path, {**TINY, "data": {"name": "image2d", "path": str(folder), "n": 32, "n_test": 8}}, url, capsys
    )
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"{str(folder)!r} is a directory, expected an image file (PNG, JPEG, TIFF …) or a .npy array" in err, err
    rc, err = _run_cli(
        tmp_path, {**TINY, "data": {"name": "image2d", "path": str(fifo), "n": 32, "n_test": 8}}, url, capsys
    )
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"{str(fifo)!r} is not a regular file (it is a FIFO)" in err, err  # and it did not block reading it
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dataset(DataSpec(name="image2d", path=str(tmp_path / "absent.png"), n=4))


def test_mnist_and_cifar_paths_that_are_not_what_they_should_be(tmp_path):
    a_file = tmp_path / "mnist"
    a_file.write_text("not a directory")
    with pytest.raises(ValueError, match=f"mnist: {str(a_file)!r} is not a directory"):
        mnist(4, path=a_file)
    idx = tmp_path / "idx"
    (idx / "train-images-idx3-ubyte").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte' is a directory"):
        mnist(4, path=idx)
    batches = tmp_path / "cifar-10-batches-py"
    batches.mkdir()
    for i in range(1, 6):
        (batches / f"data_batch_{i}").write_bytes(b"")
    os.unlink(batches / "data_batch_3")
    os.mkfifo(batches / "data_batch_3")
    with pytest.raises(ValueError, match=r"data_batch_3' is not a regular file \(it is a FIFO\)"):
        cifar10(4, path=batches)


# --------------------------------------------------------------------------- constant target
def test_a_constant_image_target_is_refused_at_load_time(tmp_path, capsys):
    flat = tmp_path / "flat.png"
    Image.fromarray(np.full((16, 16), 128, np.uint8)).save(flat)
    url = str(tmp_path / "s.zarr")
    rc, err = _run_cli(
        tmp_path, {**TINY, "data": {"name": "image2d", "path": str(flat), "n": 32, "n_test": 8}}, url, capsys
    )
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"data.path {str(flat)!r}: every training target y is 0" in err and "E(y, k)" in err, err
    assert not Path(url, "runs").exists() or not SpectrumStore(url).run_ids(), "a run was created for it"


def test_another_constant_target_is_warned_about(tmp_path, caplog):
    import logging
    import pickle

    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    rng = np.random.default_rng(0)
    for i in range(1, 6):  # every image of class 3
        batch = {b"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8), b"labels": [3, 3]}
        (d / f"data_batch_{i}").write_bytes(pickle.dumps(batch))
    with caplog.at_level(logging.WARNING, logger="nsa_dist.data.registry"):
        data = load_dataset(DataSpec(name="cifar10", path=str(d), n=4))
    assert np.all(data.y == 3)
    assert f"data.path {str(d)!r}: every training target y equals 3.0" in caplog.text, caplog.text


# --------------------------------------------------------------------------- interrupted creation
def _stop_inside_creation(spec_path: Path, url: str, rid: str) -> subprocess.Popen:
    """An ``nsa run`` stopped after its run's group exists and before its creation ends: it stops
    itself just before it creates the run's "steps" array, so neither "steps" nor "done" (which
    every reader needs) is made.  (Stopped from outside at a polled instant, it could be past both
    on a loaded machine, and the reader then rightly saw a run with no finished steps.)"""
    cmd = stopping_cli("nsa_dist.store.zarr_store:RunWriter._create", "args[1].name == 'steps'")
    cmd += ["run", "--plain", str(spec_path), "--store", url]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_stopped(proc)
    run = Path(url) / "runs" / rid
    assert SpectrumStore(url, mode="r").run_attrs(rid).get("creating"), "the writer stopped outside creation"
    assert not (run / "steps").exists() and not (run / "done").exists(), sorted(p.name for p in run.iterdir())
    return proc


@pytest.mark.slow
def test_an_interrupted_creation_is_reported_as_such_and_repaired_by_a_rerun(tmp_path, capsys):
    spec = ExperimentSpec(**TINY)
    rid = run_id(spec)
    ref, url = str(tmp_path / "ref.zarr"), str(tmp_path / "s.zarr")
    run_experiment(spec, SpectrumStore(ref))
    path = tmp_path / "words.yaml"
    path.write_text(yaml.safe_dump(TINY))
    proc = _stop_inside_creation(path, url, rid)
    try:  # its writer is alive: a reader polling now is told the run is being created
        with pytest.raises(StoreError) as e:
            Client(url).run(rid).steps
        assert "is still being created" in str(e.value) and "corrupt" not in str(e.value), e.value
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    with pytest.raises(StoreError) as e:
        Client(url).run(rid).steps
    assert "its creation was interrupted" in str(e.value) and "re-run it" in str(e.value), e.value
    assert "corrupt" not in str(e.value), e.value
    capsys.readouterr()
    assert nsa(["verify", url]) == 0
    out = capsys.readouterr().out
    assert f"{rid}: (run metadata): its creation was interrupted" in out and "re-run it" in out, out
    assert "damaged piece" not in out and "no damage found" in out, out
    assert nsa(["verify", url, "--mark"]) == 0
    out = capsys.readouterr().out
    assert "delete" not in out and "restore" not in out, out
    rc, err = _run_cli(tmp_path, TINY, url, capsys)
    assert rc == 0, err
    assert Client(url).run(rid).status == "done"
    for name in Client(ref).run(rid).array_names():
        np.testing.assert_array_equal(Client(url).run(rid).array(name), Client(ref).run(rid).array(name), err_msg=name)


# --------------------------------------------------------------------------- status tables
def test_status_tables_print_no_nan_for_runs_without_a_reason(tmp_path, capsys):
    url = str(tmp_path / "s.zarr")
    run_experiment(ExperimentSpec(**TINY), SpectrumStore(url))

    def stop(ck, result):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # a second run with a reason beside the done one's None
        run_experiment(ExperimentSpec(**{**TINY, "name": "stopped"}), SpectrumStore(url), on_step=stop)
    capsys.readouterr()
    assert nsa(["status", "--store", url]) == 0
    out = capsys.readouterr().out
    assert "done" in out and "interrupted" in out, out
    assert "nan" not in out.lower(), out
    assert nsa(["ls", "--store", url]) == 0
    assert "nan" not in capsys.readouterr().out.lower()
