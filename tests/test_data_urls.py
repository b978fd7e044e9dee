"""A data path that cannot be opened is one line naming it and the cause, whatever its scheme: a
local path, ``file://``, an unknown scheme, and ``s3://`` without credentials, with refused keys,
to a missing bucket or object, or to an endpoint that does not answer — each provoked for real
(moto S3 servers on loopback, a closed port) and run through ``nsa run``, which checks the data
before it starts anything.
"""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path

import pytest
import yaml
from conftest import free_port, moto_server

from nsa_dist.cli import main as nsa


def _nsa_run(data_path: str, tmp_path: Path, capsys) -> str:
    """``nsa run`` of a tiny image2d spec reading ``data_path``: its one stderr line (rc 2 checked)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "urls",
                "data": {"name": "image2d", "path": data_path, "n": 4},
                "model": {"depth": 2, "width": 4},
                "steps": 2,
            }
        )
    )
    capsys.readouterr()
    rc = nsa(["run", str(spec), "--store", str(tmp_path / "s.zarr"), "--plain"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, f"rc {rc}, stderr {err}"
    assert not (tmp_path / "s.zarr").exists(), "a store was made for a run whose data cannot be read"
    return err[0]


def _assert_names(line: str, url: str, cause: str) -> None:
    assert "image2d" in line and repr(url) in line and cause in line, (
        f"expected the URL {url!r} and {cause!r} in: {line}"
    )
    assert "unexpected" not in line and "Traceback" not in line, line


def test_local_and_file_urls_and_unknown_schemes_name_the_path(tmp_path, capsys):
    missing = str(tmp_path / "absent.png")
    cases = {
        missing: "does not exist (expected an image file (PNG, JPEG, TIFF …) or a .npy array)",
        f"file://{missing}": "does not exist (expected an image file (PNG, JPEG, TIFF …) or a .npy array)",
        "nosuch://bucket/face.png": "unknown scheme nosuch:// (fsspec: Protocol not known: nosuch)",
    }
    (tmp_path / "dir.png").mkdir()
    cases[str(tmp_path / "dir.png")] = "is a directory, expected an image file (PNG, JPEG, TIFF …) or a .npy array"
    if importlib.util.find_spec("gcsfs") is None:
        cases["gs://bucket/face.png"] = "needs the gcsfs package: pip install 'nsa-dist[gcs]'"
    for url, cause in cases.items():
        _assert_names(_nsa_run(url, tmp_path, capsys), url, cause)


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The session's moto server, its AWS_* variables set here (no profile, no instance metadata),
    and s3fs's instance cache emptied around the test: a filesystem made without keys must not be
    reused by a later test that has them (the cache key is the options, not the environment)."""
    s3fs = pytest.importorskip("s3fs")
    for k, v in {
        **s3_server,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": "/nonexistent/config",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    s3fs.S3FileSystem.clear_instance_cache()
    yield s3_server
    s3fs.S3FileSystem.clear_instance_cache()


def test_s3_data_paths_name_the_url_and_the_cause(s3, tmp_path, capsys, monkeypatch):
    from test_s3 import _bucket

    bucket = _bucket(s3)
    endpoint = s3["AWS_ENDPOINT_URL"]
    key = f"s3://{bucket}/absent/face.png"
    _assert_names(
        _nsa_run(key, tmp_path, capsys),
        key,
        "does not exist (expected an image file (PNG, JPEG, TIFF …) or a .npy array)",
    )
    gone = f"s3://nsa-missing-{uuid.uuid4().hex[:8]}/face.png"
    _assert_names(_nsa_run(gone, tmp_path, capsys), gone, f"bucket {gone.split('/')[2]!r} does not exist")

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    _assert_names(_nsa_run(key, tmp_path, capsys), key, f"(endpoint {dead}): cannot reach the endpoint")

    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    _assert_names(_nsa_run(key, tmp_path, capsys), key, f"(endpoint {endpoint}): no credentials found")


def test_s3_data_path_with_refused_keys(tmp_path, capsys, monkeypatch):
    """A server that checks credentials (moto with INITIAL_NO_AUTH_ACTION_COUNT=0) and wrong keys."""
    s3fs = pytest.importorskip("s3fs")
    with moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as (env, _):
        for k, v in {
            **env,
            "AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG0",
            "AWS_SECRET_ACCESS_KEY": "not-the-secret",
            "AWS_EC2_METADATA_DISABLED": "true",
        }.items():
            monkeypatch.setenv(k, v)
        s3fs.S3FileSystem.clear_instance_cache()
        try:
            url = "s3://some-bucket/face.png"
            _assert_names(_nsa_run(url, tmp_path, capsys), url, f"(endpoint {env['AWS_ENDPOINT_URL']}): access denied")
        finally:
            s3fs.S3FileSystem.clear_instance_cache()
