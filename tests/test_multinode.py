"""A two-node Ray cluster on loopback (the session's, conftest.two_node_cluster), a sweep submitted
with ``nsa submit`` (Ray Jobs) into an s3:// store on the session's loopback S3 server, the store
checked.

Custom resources pin trainers to the head node and spectral workers to the second node, so the
sweep only finishes if work lands on both — and the nodes meet only in S3 (and in the job's
shipped working directory).  One job serves both claims, so the cluster starts one sweep, not two.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml

from nsa_dist.client import Client

BIN = Path(sys.executable).parent


@pytest.mark.slow
def test_submit_sweep_to_two_node_cluster_whose_nodes_meet_only_in_s3(two_node_cluster, tmp_path, monkeypatch):
    """Its runs read an image2d PNG, MNIST IDX files and CIFAR pickle batches that exist only in
    the submitting directory: ``nsa submit`` ships them with the job (a relative path keeps its
    place, an absolute one moves into the job's working_dir) and every node reads them there.
    Trainers (head) and spectral workers (second node) write one s3:// store."""
    import boto3
    from test_job_data import write_datasets

    address, env = two_node_cluster
    for k, v in env.items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)  # this process reads the store the nodes wrote
    bucket = f"nsa-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket=bucket)
    local = write_datasets(tmp_path / "data", n=40)
    base = {
        "model": {"depth": 2, "width": 8},
        "steps": 12,
        "record": {"every": 4},
        "spectrum": {"k": 6, "images": []},
        "schedule": {"lr": 1e-4},
    }  # λ_max(NTK) of raw 784 / 1024-pixel inputs is in the thousands
    sweep = {
        "name": "multinode",
        "base": {**base, "data": {"n": 32}},
        "variants": [
            {"data": {"name": "image2d", "path": "data/face.png", "n": 32}},
            {
                "data": {
                    "name": "mnist",
                    "path": "data/mnist",
                    "n": 32,
                    "n_test": 4,
                    "pool": True,
                    "target": "one_vs_rest",
                }
            },
            {"data": {"name": "cifar10", "path": str(local["cifar10"]), "n": 32, "n_test": 4, "target": "one_vs_rest"}},
        ],
        "cluster": {
            "spectral_workers": 2,
            "worker_cpus": 0.5,
            "trainer_cpus": 0.3,  # 3 trainers on a 1-CPU head
            "trainer_resources": {"head_node": 1},
            "worker_resources": {"worker_node": 1},
        },
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    store = f"s3://{bucket}/sweeps/s.zarr"
    nsa = [str(BIN / "nsa")]
    out = subprocess.run(
        nsa
        + [
            "submit",
            "sweep.yaml",
            "--address",
            address,
            "--store",
            str(store),
            "--wait",
            "--job-id",
            "nsa-multinode-test",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "SUCCEEDED" in out.stdout and "3/3 runs done" in out.stdout
    runs = Client(str(store)).runs()
    paths = {}
    for rid in runs["id"]:
        run = Client(str(store)).run(rid)
        assert run.status == "done" and run.steps.tolist() == [0, 4, 8, 11]
        assert np.isfinite(run.eigenvalues).all()
        paths[run.spec.data.name.value] = run.spec.data.path
    moved = paths.pop("cifar10")  # an escaping path travels in a folder named by its files' digest
    assert paths == {"image2d": "data/face.png", "mnist": "data/mnist"}
    assert re.fullmatch(r"_nsa_data/[0-9a-f]{16}/cifar-10-batches-py", moved), moved
    st = subprocess.run(
        nsa + ["status", "nsa-multinode-test", "--address", address],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert st.returncode == 0 and "SUCCEEDED" in st.stdout
    lg = subprocess.run(
        nsa + ["logs", "nsa-multinode-test", "--address", address], env=env, capture_output=True, text=True, timeout=60
    )
    assert "runs done" in lg.stdout
    # a long sweep, cancelled while it runs
    long = {
        "name": "tocancel",
        "base": {**base, "data": {"n": 32}, "steps": 100000, "record": {"every": 50000}},
        "grid": {"model.width": [8, 16]},
        "cluster": sweep["cluster"],
    }
    path.write_text(yaml.safe_dump(long))
    sub = subprocess.run(
        nsa
        + [
            "submit",
            str(path),
            "--address",
            address,
            "--store",
            str(tmp_path / "c.zarr"),
            "--job-id",
            "nsa-cancel-test",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sub.returncode == 0, sub.stderr[-2000:]
    cancel = subprocess.run(
        nsa + ["cancel", "nsa-cancel-test", "--address", address], env=env, capture_output=True, text=True, timeout=60
    )
    assert cancel.returncode == 0 and "stopping" in cancel.stdout, cancel.stdout + cancel.stderr
    from nsa_dist.cluster import jobs

    deadline = time.time() + 300  # a stop at 5–10× load
    while jobs.status(address, "nsa-cancel-test")[0]["status"] != "STOPPED" and time.time() < deadline:
        time.sleep(1)
    assert jobs.status(address, "nsa-cancel-test")[0]["status"] == "STOPPED"
    # the same --job-id again: one line saying it is taken (the dashboard's HTTP 500 traceback, cut
    # off before its cause, was the error)
    again = subprocess.run(
        nsa
        + ["submit", str(path), "--address", address, "--store", str(tmp_path / "c.zarr")]
        + ["--job-id", "nsa-cancel-test"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1, again.stderr[-2000:]
    assert "job id 'nsa-cancel-test' is taken on" in again.stderr and "another --job-id" in again.stderr, again.stderr
    from ray.util.state import list_actors

    nodes: dict[str, set] = {}
    for a in list_actors(address=address, limit=1000, raise_on_missing_output=False):
        if a.node_id:  # an actor of the cancelled job that was never placed has no node to tell
            nodes.setdefault(a.class_name, set()).add(a.node_id)
    trainers = nodes.get("TrainerService", set())
    workers = nodes.get("SpectralService", set())
    assert trainers and workers and not trainers & workers, nodes
