"""A sweep read as a researcher compares one (audit U): runs shared by two sweeps, a sweep re-run in
part or with another base under its name, failed runs and runs of another N in its tables and figures."""

from __future__ import annotations

import numpy as np
import pytest

from nsa_dist.client import Client
from nsa_dist.config import SweepSpec
from nsa_dist.errors import StoreError
from nsa_dist.pipeline import run_experiment, run_id
from nsa_dist.plots.sweep import fig7a
from nsa_dist.store import SpectrumStore

BASE = {
    "data": {"n": 24},
    "model": {"depth": 2, "width": 8},
    "steps": 6,
    "record": {"every": 3},
    "spectrum": {"k": 24, "images": []},
}


def _sweep(store: SpectrumStore, name: str, **kw) -> list[str]:
    """Run every run of the sweep in this process and record it as the coordinator does."""
    sweep = SweepSpec(name=name, **{"base": BASE, **kw})
    ids = []
    for spec in sweep.expand():
        run_experiment(spec, store)
        ids.append(run_id(spec))
    store.record_sweep(sweep.name, sweep.model_dump(mode="json"), ids)
    return ids


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("sr") / "s.zarr")
    store = SpectrumStore(url)
    _sweep(store, "grid", grid={"model.depth": [2, 3], "seed": [0, 1]})
    _sweep(store, "grid", grid={"model.depth": [2], "seed": [0]})  # a part of it re-run under its name
    _sweep(store, "lr", grid={"schedule.lr": [0.1, 5000.0]})  # 5000 diverges after its first step
    _sweep(store, "sizes", grid={"data.n": [16, 24]})
    return url


def test_a_sweep_re_run_in_part_keeps_its_other_runs(url):
    """Re-running part of a grid under the sweep's name replaced its record: the other runs were no
    longer in the sweep (7 finished runs of 11, audit U)."""
    c = Client(url)
    runs = c.runs(sweep="grid")
    assert len(runs) == 4 and sorted(runs["model.depth"].tolist()) == [2, 2, 3, 3], runs[["id", "model.depth"]]
    sweep = c.sweep("grid")
    assert sweep.fields == ["model.depth"] and sweep.seeded  # the fields its runs differ in, seeds pooled
    assert [len(ids) for _, ids in sweep.groups()] == [2, 2]


def test_a_run_in_two_sweeps_is_named_in_both(url):
    """The run of depth 2, seed 0 of "grid" has the spec of the one grid point of the part re-run, and
    a run in two records was shown under whichever was read last, even in runs(sweep=…)."""
    store = SpectrumStore(url)
    (shared,) = [r for r in store.sweeps()["grid"] if "depth-2" in r and "seed-0" in r]
    store.record_sweep("other", {"name": "other", "base": BASE, "grid": {"seed": [0]}}, [shared])
    c = Client(url)
    assert set(c.runs(sweep="grid")["sweep"]) == {"grid"} and set(c.runs(sweep="other")["sweep"]) == {"other"}
    assert c.runs().set_index("id")["sweep"][shared] == "grid, other"


def test_failed_runs_give_nan_at_a_step_they_did_not_reach_and_are_drawn(url, tmp_path):
    """scalar(q, step=t) raised for the whole sweep when a failed run lacked step t; Fig. 7a drew a grid
    point with one finished step as a line of one point (nothing) under a label not saying it failed."""
    sweep = Client(url).sweep("lr")
    df = sweep.scalar("energy_y", k=1, step=3)
    failed = df[df["status"] == "failed"]
    assert len(df) == 2 and len(failed) == 1 and np.isnan(failed["value"]).all(), df
    assert np.isfinite(df[df["status"] == "done"]["value"]).all(), df
    labels = [cv.label for cv in sweep.curves("energy_y", 1)]
    assert any(label.endswith("(failed)") for label in labels), labels
    fig = fig7a(sweep, k=1)
    (line,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label().endswith("(failed)")]
    assert line.get_marker() == "o" and np.isfinite(line.get_ydata()).sum() == 1


def test_an_energy_k_beyond_some_runs_n_leaves_them_out_and_says_so(url):
    """k = 20 of a sweep over N = 16 and 24 raised "k=20 outside 1..16" naming no run: the N = 24
    runs could not be read through the sweep."""
    sweep = Client(url).sweep("sizes")
    (curve,) = sweep.curves("energy_y", 20)
    assert curve.key == {"data.n": 24} and np.isfinite(curve.mean).all()
    assert sweep.lacking("energy_y", 20) == [{"data.n": 16}]
    assert sweep.scalar("energy_y", k=20)["data.n"].tolist() == [24]
    # beyond every run: one error naming the sweep and the largest k it has (was "this run measured …",
    # naming no run, and lacking() said [] — as if none lacked it)
    for read in (lambda: sweep.curves("energy_y", 30), lambda: sweep.scalar("energy_y", k=30)):
        with pytest.raises(
            ValueError, match=r"k=30: no finished run of sweep 'sizes' has energy_y at k = 30 \(the largest"
        ):
            read()
    assert sweep.lacking("energy_y", 30) == [{"data.n": 16}, {"data.n": 24}]


def test_a_sweep_name_given_as_a_run_says_it_is_a_sweep(url):
    with pytest.raises(StoreError, match=r"'grid' is a sweep: `nsa plot --sweep grid`"):
        Client(url).run("grid")


def test_runs_recorded_by_two_versions_stay_one_grid_point(url):
    """A seed of a grid point recorded by an earlier nsa-dist (its stored spec without spectrum.energy /
    quadrature, which 0d09aaf resumes as the same run) split each point in two: its fields grew by 9
    spectrum.* columns and the seeds were no longer pooled (a review's repro)."""
    import zarr

    (old,) = [r for r in SpectrumStore(url).sweeps()["grid"] if "depth-3" in r and "seed-1" in r]
    g = zarr.open_group(url, mode="r+")[f"runs/{old}"]
    spec = dict(g.attrs["spec"])
    spec["spectrum"] = {k: v for k, v in spec["spectrum"].items() if k not in ("energy", "quadrature")}
    g.attrs["spec"] = spec
    sweep = Client(url).sweep("grid")
    assert sweep.fields == ["model.depth"], sweep.fields
    assert [len(ids) for _, ids in sweep.groups()] == [2, 2]


def test_a_block_that_became_non_empty_is_a_field_not_a_crash():
    """model.kwargs {} in one submission and {hidden: 8} in the next: the empty dict was a column value
    and groups() raised "unhashable type: 'dict'" (a review's repro)."""
    from nsa_dist.client._frames import flatten_spec
    from nsa_dist.client._sweep import _hashable

    assert flatten_spec({"model": {"kwargs": {}}}) == {"model.kwargs": None}
    assert _hashable(({"depth": 2},)) == '[{"depth": 2}]'


def test_a_step_no_run_recorded_is_an_error_not_nan(url):
    """NaN is for the runs that stopped before a step; a step no run of the sweep recorded (4 of
    0, 3, 5) gave NaN for every run with status done and no word (a review's repro)."""
    with pytest.raises(KeyError, match=r"step 4 is no finished step of 'lambda_max' in any run of sweep 'lr'"):
        Client(url).sweep("lr").scalar("lambda_max", step=4)
