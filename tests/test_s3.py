"""Real object stores (issue 9): a run written to, killed in, resumed from and read back from an
S3 API server on loopback (moto's server mode, a separate process).  The two-node sweep whose
nodes meet only in S3 is test_multinode's (one job on the session's cluster).  Endpoint and keys
come from the standard AWS_* variables.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from conftest import killed_after_step

from nsa_dist.cli import main as nsa  # noqa: E402
from nsa_dist.client import Client  # noqa: E402
from nsa_dist.config import ExperimentSpec  # noqa: E402
from nsa_dist.errors import MissingDependencyError, StoreError  # noqa: E402
from nsa_dist.pipeline import run_experiment, run_id  # noqa: E402
from nsa_dist.store import SpectrumStore  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SPEC = dict(
    name="s3run",
    data={"n": 24, "n_test": 8},
    model={"depth": 2, "width": 8},
    steps=40,
    record={"every": 10},
    spectrum={"k": 6, "test_points": True},
)


@pytest.fixture(scope="module")
def s3_env(s3_server):
    """The session's moto S3 server (conftest.s3_server), its AWS_* variables set in this process."""
    saved = {k: os.environ.get(k) for k in s3_server}
    os.environ.update(s3_server)
    try:
        yield s3_server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _bucket(env: dict) -> str:
    import boto3

    name = f"nsa-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket=name)
    return name


def test_a_missing_filesystem_package_names_the_extra():
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(MissingDependencyError, match=r"needs the gcsfs package: pip install 'nsa-dist\[gcs\]'"):
        SpectrumStore("gs://some-bucket/s.zarr")


def test_a_bucket_prefix_holding_other_objects_is_refused(s3_env):
    import boto3

    bucket = _bucket(s3_env)
    boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"]).put_object(
        Bucket=bucket, Key="data/notes.txt", Body=b"x"
    )
    with pytest.raises(StoreError, match="holds objects but is not an nsa-dist spectrum store"):
        SpectrumStore(f"s3://{bucket}/data")


def _datasets_in_s3(env: dict, tmp_path: Path) -> tuple[dict, dict, str]:
    """A PNG, MNIST IDX files and CIFAR-10 batches written locally and uploaded to a new bucket:
    (local paths, their s3:// URLs, the bucket) by dataset name."""
    import s3fs
    from test_job_data import write_datasets

    local = write_datasets(tmp_path / "data")
    bucket = _bucket(env)
    s3fs.S3FileSystem(endpoint_url=env["AWS_ENDPOINT_URL"]).put(
        str(tmp_path / "data") + "/", f"{bucket}/sets/", recursive=True
    )
    return local, {name: f"s3://{bucket}/sets/{p.name}" for name, p in local.items()}, bucket


def test_data_in_s3_load_as_the_local_files_do(s3_env, tmp_path):
    """image2d PNG, MNIST IDX (raw and gz) and CIFAR pickle batches read through ``data.path: s3://…``
    give the arrays the local files give; a missing object, a prefix given as an image and a
    pickle naming a callable are refused in one line naming the URL."""
    import pickle

    import s3fs

    from nsa_dist.config import DataSpec
    from nsa_dist.data import load_dataset

    local, remote, bucket = _datasets_in_s3(s3_env, tmp_path)
    fs = s3fs.S3FileSystem(endpoint_url=s3_env["AWS_ENDPOINT_URL"])
    for name, n_test in (("image2d", 4), ("mnist", 3), ("cifar10", 2)):
        got = load_dataset(DataSpec(name=name, path=remote[name], n=20, n_test=n_test), seed=1)
        want = load_dataset(DataSpec(name=name, path=str(local[name]), n=20, n_test=n_test), seed=1)
        for a in ("X", "y", "X_test", "y_test"):
            np.testing.assert_array_equal(getattr(got, a), getattr(want, a), err_msg=f"{name}.{a}")

    absent = f"s3://{bucket}/sets/absent.png"
    with pytest.raises(FileNotFoundError) as exc:
        load_dataset(DataSpec(name="image2d", path=absent, n=4))
    assert (
        str(exc.value)
        == f"image2d: {absent!r} does not exist (expected an image file (PNG, JPEG, TIFF …) or a .npy array)"
    )
    with pytest.raises(ValueError, match=f"image2d: {remote['mnist']!r} is a directory"):
        load_dataset(DataSpec(name="image2d", path=remote["mnist"], n=4))
    with pytest.raises(FileNotFoundError, match=r"\['train-labels-idx1-ubyte'\] not found in 's3://"):
        fs.rm(f"{bucket}/sets/mnist/train-labels-idx1-ubyte")
        load_dataset(DataSpec(name="mnist", path=remote["mnist"], n=4))

    import operator

    class Evil:  # a callable with a stable pickled name (print is Ray's safe_print once Ray is imported)
        def __reduce__(self):
            return (operator.add, (1, 2))

    fs.pipe(f"{bucket}/sets/cifar-10-batches-py/data_batch_2", pickle.dumps({b"data": Evil(), b"labels": []}))
    with pytest.raises(ValueError, match=r"data_batch_2' is not a pickled dict .*refused _operator.add"):
        load_dataset(DataSpec(name="cifar10", path=remote["cifar10"], n=4))


def test_a_run_trains_on_data_read_from_s3(s3_env, tmp_path):
    """A plain ``run_experiment`` whose ``data.path`` is an s3:// URL; the store records the URL."""
    _, remote, _ = _datasets_in_s3(s3_env, tmp_path)
    spec = ExperimentSpec(
        name="s3data",
        data={"name": "image2d", "path": remote["image2d"], "n": 16},
        model={"depth": 2, "width": 8},
        steps=4,
        record={"every": 2},
        spectrum={"k": 4},
    )
    out = run_experiment(spec, SpectrumStore(str(tmp_path / "s.zarr")))
    assert out.status == "done"
    run = Client(str(tmp_path / "s.zarr")).run(run_id(spec))
    assert run.spec.data.path == remote["image2d"] and np.isfinite(run.eigenvalues).all()


@pytest.mark.slow
def test_s3_run_killed_resumed_and_read_back(s3_env, tmp_path, capsys):
    spec = ExperimentSpec(**SPEC)
    rid = run_id(spec)
    local = str(tmp_path / "a.zarr")
    run_experiment(spec, SpectrumStore(local))
    url = f"s3://{_bucket(s3_env)}/stores/s.zarr"
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    env = {**os.environ, **s3_env, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "nsa_dist.cli", "run", str(path), "--store", url, "--plain"]
    killed_after_step(cmd[3:], 1, env)  # stopped once two steps are written (a 0.2 s poller raced it)
    assert int(Client(url).run(rid).array("done").sum()) == 2
    assert Client(url).run(rid).status == "interrupted"
    assert nsa(cmd[3:]) == 0  # the same command resumes it (in this process: the kill is what is tested)
    a, b = Client(local).run(rid), Client(url).run(rid)
    assert b.status == "done" and b.steps.tolist() == [0, 10, 20, 30, 39]
    assert sorted(a.array_names()) == sorted(b.array_names())
    for name in a.array_names():
        np.testing.assert_array_equal(a.array(name), b.array(name), err_msg=f"{name} differs between local and s3")
    assert nsa(["verify", url]) == 0 and "no damage found" in capsys.readouterr().out
