"""A store opened by a ``pathlib.Path``, and a run written by another schema of nsa-dist.

Was (found by the spec/CLI trial): ``Client(Path(...))`` raised "TypeError: argument of type
'PosixPath' is not iterable"; a run whose own ``schema_version`` is another was read by
``Client``, ``nsa ls``, ``nsa show`` and ``nsa verify`` as if it were this one's layout."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import zarr
from conftest import finished_run, small_run_spec

from nsa_dist import Client
from nsa_dist.cli import main as nsa
from nsa_dist.errors import StoreError


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return finished_run(tmp_path_factory, small_run_spec("schema"), "schema")


def test_a_client_takes_a_path(run):
    url, rid = run
    a, b = Client(pathlib.Path(url)).run(rid), Client(url).run(rid)
    np.testing.assert_array_equal(a.eigenvalues, b.eigenvalues)


def test_a_run_of_another_schema_is_refused_by_every_reader(run, tmp_path, capsys):
    import shutil

    url, rid = run
    other = str(tmp_path / "other.zarr")
    shutil.copytree(url, other)
    g = zarr.open_group(f"{other}/runs/{rid}", mode="r+")
    g.attrs["schema_version"] = 99
    with pytest.raises(StoreError, match="store schema 99; this nsa-dist reads schema 1"):
        Client(other).run(rid).eigenvalues
    assert nsa(["show", rid, "--store", other]) == 2
    assert "schema 99" in capsys.readouterr().err
    assert nsa(["ls", "--store", other]) in (0, 1)
    out = capsys.readouterr()
    assert "schema 99" in out.out + out.err, out


def test_verify_names_a_run_of_another_schema(run, tmp_path, capsys):
    import shutil

    url, rid = run
    other = str(tmp_path / "other.zarr")
    shutil.copytree(url, other)
    zarr.open_group(f"{other}/runs/{rid}", mode="r+").attrs["schema_version"] = 99
    code = nsa(["verify", other])
    out = capsys.readouterr()
    assert code != 0 and "schema 99" in out.out + out.err, (code, out)
