"""Data that travels (issue 19): a spec's data files are checked when it is read, before any Ray
starts; ``nsa submit`` copies a sweep's local data files into the job's working_dir (relative
paths keep their place, others move and the job's sweep says so) or refuses, in one line, data
too big to travel.  Real files in the real formats; the submitted job itself is in
tests/test_multinode.py, remote (s3://) data in tests/test_s3.py.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from test_data import cifar_batch, idx_bytes, mnist_images, write

from nsa_dist.cli import main as nsa
from nsa_dist.cluster.job_data import SHIPPED_DIR, prepare_job_data
from nsa_dist.config import DataSpec, SweepSpec
from nsa_dist.data import load_dataset
from nsa_dist.data.mnist import TEST_FILES, TRAIN_FILES
from nsa_dist.data.registry import data_files
from nsa_dist.pipeline import run_id
from nsa_dist.specfile import SpecError, load_sweep

MODEL = {"depth": 2, "width": 8}


def write_datasets(root: Path, n: int = 40) -> dict[str, Path]:
    """A PNG, an MNIST directory (train raw, test gzipped) and a CIFAR-10 directory under ``root``,
    each with n training images (and a few test images) in the real formats."""
    root.mkdir(parents=True, exist_ok=True)
    png = root / "face.png"
    yy, xx = np.mgrid[0:24, 0:32]
    Image.fromarray(((xx * 7 + yy * 3) % 256).astype(np.uint8)).save(png)
    mn = root / "mnist"
    mn.mkdir()
    labels = np.arange(n, dtype=np.uint8) % 10
    write(mn / TRAIN_FILES[0], idx_bytes(mnist_images(labels, 0, 1), 2051), gz=False)
    write(mn / TRAIN_FILES[1], idx_bytes(labels, 2049), gz=False)
    write(mn / TEST_FILES[0], idx_bytes(mnist_images(labels[:8], 100, 2), 2051), gz=True)
    write(mn / TEST_FILES[1], idx_bytes(labels[:8], 2049), gz=True)
    cf = root / "cifar-10-batches-py"
    cf.mkdir()
    per = -(-n // 5)
    for b in range(5):
        with open(cf / f"data_batch_{b + 1}", "wb") as f:
            pickle.dump(cifar_batch(np.arange(per) % 10, per * b, "labels", b), f)
    with open(cf / "test_batch", "wb") as f:
        pickle.dump(cifar_batch(np.arange(8) % 10, 200, "labels", 9), f)
    return {"image2d": png, "mnist": mn, "cifar10": cf}


def _sweep(paths: dict[str, str], n: int = 16, n_test: int = 0) -> dict:
    return {
        "name": "travel",
        "base": {"model": MODEL, "steps": 4, "record": {"every": 2}, "spectrum": {"k": 4}},
        "variants": [{"data": {"name": name, "path": p, "n": n, "n_test": n_test}} for name, p in paths.items()],
    }


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --------------------------------------------------------------------------- checked when read
def test_a_missing_data_file_is_said_before_ray_starts(in_tmp, capsys):
    import ray

    write_datasets(in_tmp / "data")
    (in_tmp / "data" / "mnist" / TRAIN_FILES[1]).unlink()
    path = in_tmp / "sweep.yaml"
    path.write_text(yaml.safe_dump(_sweep({"image2d": "data/face.png", "mnist": "data/mnist"})))
    capsys.readouterr()
    rc = nsa(["sweep", str(path), "--store", str(in_tmp / "s.zarr"), "--plain"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"{path}: run 'travel__data-" in err and "['train-labels-idx1-ubyte'] not found in 'data/mnist'" in err
    assert not ray.is_initialized(), "Ray was started for a sweep whose data are missing"
    assert not (in_tmp / "s.zarr").exists()


def test_data_files_lists_what_the_loader_reads_and_nothing_else(in_tmp):
    d = write_datasets(in_tmp / "data")
    names = lambda files: sorted(Path(f).name for f in files)  # noqa: E731
    assert names(data_files(DataSpec(name="mnist", path=str(d["mnist"])))) == sorted(TRAIN_FILES)
    assert names(data_files(DataSpec(name="mnist", path=str(d["mnist"]), n_test=2))) == sorted(
        [*TRAIN_FILES, *(f"{t}.gz" for t in TEST_FILES)]
    )
    assert names(data_files(DataSpec(name="cifar10", path=str(d["cifar10"]), n_test=1))) == sorted(
        [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    )
    assert data_files(DataSpec(name="image2d", path="data/face.png")) == [Path("data/face.png")]
    assert data_files(DataSpec(name="digits")) == []
    (d["cifar10"] / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match="test_batch"):
        data_files(DataSpec(name="cifar10", path=str(d["cifar10"]), n_test=1))


# --------------------------------------------------------------------------- shipped with a job
def test_relative_data_keep_their_place_and_run_ids(in_tmp):
    d = write_datasets(in_tmp / "data")
    sweep = _sweep({k: f"data/{p.name}" for k, p in d.items()})
    (in_tmp / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    work = in_tmp / "work"
    work.mkdir()
    job = prepare_job_data("sweep.yaml", work)
    mine = load_sweep("sweep.yaml").expand()
    theirs = SweepSpec.model_validate(job).expand()
    assert [run_id(r) for r in theirs] == [run_id(r) for r in mine]  # same specs: the same run ids
    assert (work / "data/face.png").read_bytes() == d["image2d"].read_bytes()
    assert sorted(p.name for p in (work / "data/mnist").iterdir()) == sorted(TRAIN_FILES)  # n_test = 0: no test files
    assert len(list((work / "data/cifar-10-batches-py").iterdir())) == 5


def test_a_moved_file_keeps_its_name_and_run_id_whatever_its_place_in_the_sweep(in_tmp):
    """An absolute data path travelled as ``_nsa_data/<its position>/face.png``: a second job whose sweep
    put another file first named the same file ``_nsa_data/1/face.png`` — another run id, the run
    computed again — and a different ``face.png`` at position 0 clashed with the stored run (an audit).
    The folder is now the files' content digest."""
    faces = []
    for i, folder in enumerate(("a", "b")):
        (in_tmp / folder).mkdir()
        yy, xx = np.mgrid[0:24, 0:32]
        Image.fromarray(((xx * (7 + i) + yy * 3) % 256).astype(np.uint8)).save(in_tmp / folder / "face.png")
        faces.append(str(in_tmp / folder / "face.png"))

    def job_ids(paths: list[str], name: str) -> list[str]:
        sweep = {**_sweep({}), "variants": [{"data": {"name": "image2d", "path": p, "n": 16}} for p in paths]}
        (in_tmp / f"{name}.yaml").write_text(yaml.safe_dump(sweep))
        work = in_tmp / f"work-{name}"
        work.mkdir()
        return [run_id(r) for r in SweepSpec.model_validate(prepare_job_data(f"{name}.yaml", work)).expand()]

    alone = job_ids([faces[0]], "one")
    behind = job_ids([faces[1], faces[0]], "two")
    assert behind[1] == alone[0], (alone, behind)  # the same file: the same run
    assert behind[0] != alone[0]  # another file of the same name: another run


def test_absolute_and_escaping_data_move_and_the_job_sweep_says_where(in_tmp):
    d = write_datasets(in_tmp / "elsewhere")
    (in_tmp / "here").mkdir()
    sweep = _sweep({"image2d": str(d["image2d"]), "mnist": "../elsewhere/mnist"}, n_test=4)
    (in_tmp / "here" / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    work = in_tmp / "work"
    work.mkdir()
    os.chdir(in_tmp / "here")
    job = prepare_job_data("sweep.yaml", work)
    paths = [r.data.path for r in SweepSpec.model_validate(job).expand()]
    face = hashlib.sha256(d["image2d"].read_bytes() + b"\0").hexdigest()[:16]
    assert paths[0] == f"{SHIPPED_DIR}/{face}/face.png", paths
    assert re.fullmatch(rf"{SHIPPED_DIR}/[0-9a-f]{{16}}/mnist", paths[1]) and paths[1].split("/")[1] != face, paths
    os.chdir(work)  # where the job runs: the moved data load as the originals did
    for r, orig in zip(SweepSpec.model_validate(job).expand(), load_sweep(in_tmp / "here" / "sweep.yaml").expand()):
        os.chdir(in_tmp / "here")
        want = load_dataset(orig.data)
        os.chdir(work)
        got = load_dataset(r.data)
        np.testing.assert_array_equal(got.X, want.X)
        np.testing.assert_array_equal(got.X_test, want.X_test)


def test_data_too_big_to_travel_is_refused_in_one_line(in_tmp):
    d = write_datasets(in_tmp / "data")
    (in_tmp / "sweep.yaml").write_text(yaml.safe_dump(_sweep({"cifar10": "data/cifar-10-batches-py"})))
    work = in_tmp / "work"
    work.mkdir()
    size = (d["cifar10"] / "data_batch_1").stat().st_size
    with pytest.raises(SpecError) as exc:
        prepare_job_data("sweep.yaml", work, limit=4 * size)
    msg = str(exc.value)
    assert len(msg.splitlines()) == 1 and "s3://" in msg and "data_batch_" in msg and "MiB" in msg, msg
    assert not any(work.iterdir()), "data were copied before the refusal"


def test_a_missing_data_file_refuses_the_submission(in_tmp):
    (in_tmp / "sweep.yaml").write_text(yaml.safe_dump(_sweep({"image2d": "data/absent.png"})))
    with pytest.raises(SpecError, match=r"'data/absent.png' does not exist"):
        prepare_job_data("sweep.yaml", in_tmp)


def test_nsa_submit_refuses_data_over_the_limit_before_connecting(in_tmp, capsys):
    from nsa_dist.cluster.job_data import SHIP_LIMIT_BYTES

    big = in_tmp / "big.png"
    with open(big, "wb") as f:  # sparse: a regular file of the size, no bytes written
        f.truncate(SHIP_LIMIT_BYTES + 1)
    (in_tmp / "sweep.yaml").write_text(yaml.safe_dump(_sweep({"image2d": "big.png"})))
    capsys.readouterr()
    rc = nsa(["submit", "sweep.yaml", "--address", "http://127.0.0.1:9", "--store", str(in_tmp / "s.zarr")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"(largest {str(big)!r}, 100.0 MiB)" in err and "over the 100 MiB" in err and "s3://" in err, err


def test_a_file_url_is_read_where_the_run_runs_and_not_shipped(in_tmp):
    d = write_datasets(in_tmp / "data")
    url = f"file://{d['mnist']}"
    sweep = _sweep({"mnist": url, "image2d": f"file://{d['image2d']}"}, n_test=2)
    (in_tmp / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    work = in_tmp / "work"
    work.mkdir()
    job = prepare_job_data("sweep.yaml", work)
    assert [r.data.path for r in SweepSpec.model_validate(job).expand()] == [url, f"file://{d['image2d']}"]
    assert not any(work.iterdir())
    got = load_dataset(DataSpec(name="mnist", path=url, n=8, n_test=2))
    want = load_dataset(DataSpec(name="mnist", path=str(d["mnist"]), n=8, n_test=2))
    np.testing.assert_array_equal(got.X_test, want.X_test)
    with pytest.raises(FileNotFoundError, match=r"'file://.*/absent.png' does not exist"):
        load_dataset(DataSpec(name="image2d", path=f"file://{in_tmp}/absent.png", n=4))
