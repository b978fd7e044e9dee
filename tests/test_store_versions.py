"""A run recorded by an earlier nsa-dist, reopened by this one (audit X): its stored spec lacks the
fields added since (they were absent from the JSON, and entered the run id's hash)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import zarr

from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec
from nsa_dist.pipeline import run_experiment, run_id
from nsa_dist.store import SpectrumStore

SPEC = ExperimentSpec(
    name="old",
    data={"n": 20},
    model={"depth": 2, "width": 6},
    steps=7,
    record={"every": 3},
    spectrum={"k": 5, "images": []},
)


def _as_recorded_before(url: str, rid: str, as_id: str | None = None) -> str:
    """The run's stored spec without the fields added on 2026-12-03/04 (``spectrum.energy``,
    ``spectrum.quadrature``), as the nsa-dist of 2026-12-02 wrote it — under ``as_id``, its id then."""
    g = zarr.open_group(url, mode="r+")[f"runs/{rid}"]
    spec = dict(g.attrs["spec"])
    spec["spectrum"] = {k: v for k, v in spec["spectrum"].items() if k not in ("energy", "quadrature")}
    g.attrs["spec"] = spec
    if as_id is None:
        return rid
    os.rename(Path(url) / "runs" / rid, Path(url) / "runs" / as_id)
    return as_id


@pytest.mark.parametrize("same_id", [True, False], ids=["same-id", "earlier-id"])
def test_a_run_recorded_before_fields_were_added_is_resumed_not_started_again(tmp_path, same_id):
    """Same id (a default added to the hash-neutral fields): the resume was refused, "different spec
    (spectrum.quadrature.phi_width: None → 0.0)". Another id (fields that entered the hash): the run
    was started again from step 0 under a new id, the old one "interrupted … re-run to resume" for
    ever.  Both are resumed now: the killed run's last step is computed, the earlier ones kept."""
    url = str(tmp_path / "s.zarr")
    rid = run_id(SPEC)
    assert run_experiment(SPEC, SpectrumStore(url)).status == "done"
    g = zarr.open_group(url, mode="r+")[f"runs/{rid}"]
    del g.attrs["data_meta"]  # kept since 2026-12-06
    before = np.asarray(g["eigenvalues"][:])
    g["done"][-1] = False  # killed before its last recorded step was stored
    g.attrs["status"] = "running"
    old = _as_recorded_before(url, rid, None if same_id else "old-0123456789")
    out = run_experiment(SPEC, SpectrumStore(url))
    assert out.status == "done" and out.run_id == old and out.steps_computed == 1, out
    assert Client(url).store.run_ids() == [old]
    np.testing.assert_array_equal(Client(url).run(old).eigenvalues, before)  # the same steps, recomputed alike
    assert Client(url).run(old).data_meta["source"] == "image2d"  # the loader's constants, kept now


def test_a_spec_that_differs_is_still_refused(tmp_path):
    url = str(tmp_path / "s.zarr")
    rid = run_id(SPEC)
    assert run_experiment(SPEC, SpectrumStore(url)).status == "done"
    g = zarr.open_group(url, mode="r+")[f"runs/{rid}"]
    spec = dict(g.attrs["spec"])
    spec["spectrum"] = {**spec["spectrum"], "k": 4}
    g.attrs["spec"] = spec
    with pytest.raises(Exception, match=r"different spec \(spectrum\.k: 4 → 5\)"):
        run_experiment(SPEC, SpectrumStore(url))


def test_an_array_added_since_the_run_was_recorded_is_not_damage(tmp_path, capsys):
    """A run recorded before step_notes existed: nsa verify called it damaged metadata and advised
    deleting the run's folder (audit X: every run of a store of 2026-12-02); reading it said
    "missing …; run nsa verify".  It is an older layout, which reopening completes."""
    import shutil

    from nsa_dist.cli import main as nsa

    url = str(tmp_path / "s.zarr")
    rid = run_id(SPEC)
    assert run_experiment(SPEC, SpectrumStore(url)).status == "done"
    shutil.rmtree(Path(url) / "runs" / rid / "step_notes")
    capsys.readouterr()
    assert nsa(["verify", url]) == 1  # a run created today has step_notes: its loss is damage (a review's repro)
    assert "step_notes" in capsys.readouterr().out
    zarr.open_group(url, mode="r+")[f"runs/{rid}"].attrs["created"] = 1.7e9  # recorded in 2023, before it
    assert nsa(["verify", url]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "recorded by an earlier nsa-dist, before that array existed" in out and "delete" not in out, out
    with pytest.raises(Exception, match="recorded by an earlier nsa-dist, before that array existed"):
        Client(url).run(rid).per_step("step_notes")
    assert run_experiment(SPEC, SpectrumStore(url)).steps_computed == 0  # reopened: the array made, nothing recomputed
    assert (Client(url).run(rid).per_step("step_notes") == "").all()


# a run with every array added to schema 1 since: test points (loss_test), images (reconstruction_images), a Hessian
EVERY_ADDED = ExperimentSpec(
    name="older",
    data={"n": 20, "n_test": 6},
    model={"depth": 2, "width": 6},
    steps=7,
    record={"every": 3},
    spectrum={"k": 5, "images": [1]},
    hessian={"probes": 2, "rayleigh_k": 0, "top_k": 1, "density": False},
)
# what today's schema has and the runs of e6faf4d (2026-11-29), the first commit of schema 1, lack
NOT_IN_E6FAF4D = {
    "gram_sq_frobenius",
    "loss_test",
    "projections_residual",
    "eigenvector_steps",
    "hessian_additivity",
    "hessian_I_limit_moments",
    "hessian_G",
    "hessian_G_stderr",
    "hessian_trace_S_G",
    "hessian_S_op",
    "hessian_S_limit",
    "reconstruction_k",
    "reconstructions",
    "reconstruction_images",
    "step_notes",
}


def test_every_array_added_since_a_run_was_recorded_is_an_older_layout_not_damage(tmp_path, capsys):
    """Runs recorded by the commits of 2026-11-29 … 2026-12-03 (e6faf4d on) lack more arrays than
    step_notes and eigenvector_steps — gram_sq_frobenius, loss_test, projections_residual, Fig. 4d's
    reconstructions, the Hessian paper's predictions: nsa verify called each such run damaged
    metadata and advised deleting its folder.  Each is an older layout for a run created before the
    array was added, damage for a run created after; resuming the run makes them (NaN at the steps
    recorded before) and goes on with the arrays it was created with."""
    import shutil

    from nsa_dist.cli import main as nsa
    from nsa_dist.store.schema import ADDED_ARRAYS
    from nsa_dist.store.verify import verify_run

    url = str(tmp_path / "s.zarr")
    rid = run_id(EVERY_ADDED)
    assert run_experiment(EVERY_ADDED, SpectrumStore(url)).status == "done"
    g = zarr.open_group(url, mode="r+")[f"runs/{rid}"]
    assert NOT_IN_E6FAF4D <= set(g.array_keys()), sorted(NOT_IN_E6FAF4D - set(g.array_keys()))
    for name in NOT_IN_E6FAF4D:  # as the earliest runs of schema 1 were stored
        shutil.rmtree(Path(url) / "runs" / rid / name)
    for name in ("constant_gram_f_test", "constant_gram_residual", "constant_gram_energy"):  # App. E, since
        shutil.rmtree(Path(url) / "runs" / rid / name, ignore_errors=True)
    g.attrs["dims"] = {k: v for k, v in g.attrs["dims"].items() if k != "constant_gram"}  # not a field then

    def verdicts(created: float) -> tuple[set[str], set[str]]:
        g.attrs["created"] = created
        found = verify_run(SpectrumStore(url), rid)
        return {d.array for d in found if d.unfinished}, {d.array for d in found if not d.unfinished}

    older, damaged = verdicts(g.attrs["created"])  # created today: every loss is damage
    assert not older and damaged == NOT_IN_E6FAF4D, (older, damaged)
    with pytest.raises(Exception, match=r"array 'loss_test' is missing .*nsa verify"):
        Client(url).run(rid).per_step("loss_test")
    g.attrs["created"] = 1795995669.0  # by e6faf4d
    capsys.readouterr()
    assert nsa(["verify", url]) == 0, capsys.readouterr()  # each said older layout, none damage
    out = capsys.readouterr().out
    assert "delete" not in out and all(f"array {n!r}: it was recorded by an earlier" in out for n in NOT_IN_E6FAF4D), (
        out
    )
    added = ADDED_ARRAYS["hessian_G"]  # a run created as the Hessian paper's predictions were added
    for created in (added - 1, added):  # before: those and later ones are older; at it: those are there
        older, damaged = verdicts(created)
        assert older == {n for n in NOT_IN_E6FAF4D if created < ADDED_ARRAYS[n]}, (created, older)
        assert damaged == {n for n in NOT_IN_E6FAF4D if ADDED_ARRAYS[n] <= created}, (created, damaged)
    with pytest.raises(Exception, match="corrupt run .* is missing"):  # not made silently over damage either
        SpectrumStore(url).reopen(rid).check()

    g.attrs["created"] = 1795995669.0
    g["done"][-1] = False  # killed before its last recorded step was stored
    g.attrs["status"] = "running"
    for name in NOT_IN_E6FAF4D:
        with pytest.raises(Exception, match="recorded by an earlier nsa-dist, before that array existed"):
            Client(url).run(rid).array(name)
    # resumed: the arrays made (NaN at the steps recorded before), the last step computed, App. E's
    # constant-Gram arrays not begun half way (today's plan has them: the resume was refused as corrupt)
    assert run_experiment(EVERY_ADDED, SpectrumStore(url)).steps_computed == 1
    assert "constant_gram_f_test" not in zarr.open_group(url, mode="r")[f"runs/{rid}"]
    assert NOT_IN_E6FAF4D <= set(zarr.open_group(url, mode="r")[f"runs/{rid}"].array_keys())
    assert nsa(["verify", url]) == 0 and verify_run(SpectrumStore(url), rid) == [], capsys.readouterr()
    run = Client(url).run(rid)
    assert run.status == "done" and run.steps.tolist() == [0, 3, 6], run.steps
    assert np.isnan(run.per_step("loss_test")[:2]).all() and np.isfinite(run.per_step("loss_test")[2])
    assert (
        np.isnan(run.per_step("gram_sq_frobenius")[:2]).all()
        and np.isfinite(run.per_step("gram_sq_frobenius")[2]).all()
    )
    assert (run.per_step("step_notes")[:2] == "").all()
