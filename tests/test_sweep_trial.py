"""A researcher's trial of sweep analysis: every aggregate the client, the figures and the CLI give
is checked against numbers computed here from the runs' arrays read straight out of the zarr store
(``runs/<id>/…`` and each run's recorded ``spec``), never through the client."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from nsa_dist.cli import main
from nsa_dist.client import Client
from nsa_dist.config import SweepSpec
from nsa_dist.pipeline import run_experiment, run_id
from nsa_dist.plots.sweep import fig7a, fig7b, fig7c, scalar_figure
from nsa_dist.store import SpectrumStore

BASE = {
    "data": {"n": 16, "n_test": 8},
    "model": {"depth": 2, "width": 8},
    "steps": 6,
    "record": {"every": 2},
    "spectrum": {"k": 6},
}
LRS = [0.1, 0.1000000001, 50.0]  # two floats a hair apart, and one that diverges at step 3
# the legend says which runs failed
LABELS = ["lr=0.1 (2 seeds)", "lr=0.1000000001 (2 seeds)", "lr=50.0 (2 seeds, 2 failed)"]
K = 3


def _record(store: SpectrumStore, sweep: SweepSpec) -> list[str]:
    ids = []
    for spec in sweep.expand():
        run_experiment(spec, store)  # lr = 50 fails (diverged): it stays in the sweep, as in a real one
        ids.append(run_id(spec))
    store.record_sweep(sweep.name, sweep.model_dump(mode="json"), ids)
    return ids


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Sweeps "lr" (3 lr × 2 seeds), "dw" (depth × width × lr, one seed), "nest" (a grid over
    whole ``model`` blocks × 2 seeds) and "dup" (width [4, 4.0] × 2 seeds: four runs, two
    experiments), as the coordinator records them."""
    url = str(tmp_path_factory.mktemp("trial") / "s.zarr")
    store = SpectrumStore(url)
    _record(store, SweepSpec(name="lr", base=BASE, grid={"schedule.lr": LRS, "seed": [0, 1]}))
    small = {**BASE, "data": {"n": 12}, "steps": 3, "record": {"every": 1}, "spectrum": {"k": 4}}
    grid = {"model.depth": [2, 3], "model.width": [4, 6], "schedule.lr": [0.05, 0.2]}
    _record(store, SweepSpec(name="dw", base=small, grid=grid))
    models = [{"depth": 2, "width": 4}, {"depth": 3, "width": 6}]
    _record(store, SweepSpec(name="nest", base=small, grid={"model": models, "seed": [0, 1]}))
    # "dup" as a store written before SweepSpec.expand ran one experiment once: the runs of width 4
    # and of width 4.0 (two names, one spec) both in the sweep
    dup = SweepSpec(name="dup", base=small, grid={"model.width": [4, 4.0], "seed": [0, 1]})
    ids = [
        i
        for w in (4, 4.0)
        for i in _record(store, dup.model_copy(update={"grid": {"model.width": [w], "seed": [0, 1]}}))
    ]
    store.record_sweep("dup", dup.model_dump(mode="json"), ids)
    return url


# ------------------------------------------------------------------ the direct reading of the store
def _direct(url: str, rid: str) -> dict:
    """One run as the store holds it: its spec, its finished recorded steps and arrays there."""
    g = zarr.open_group(f"{url}/runs/{rid}", mode="r")
    done = np.asarray(g["done"][:], bool)
    if g.attrs["status"] == "done":
        done[:] = True
    return {
        "spec": dict(g.attrs["spec"]),
        "status": g.attrs["status"],
        "t": np.asarray(g["steps"][:])[done],
        "energy_y": np.asarray(g["energy_y"][:], np.float64)[done],
        "loss_test": np.asarray(g["loss_test"][:], np.float64)[done] if "loss_test" in g else None,
        "loss_trace": np.asarray(g["loss_trace"][:], np.float64),
        "theta": g["theta"],
    }


def _sweep_ids(url: str, name: str) -> list[str]:
    return list(zarr.open_group(f"{url}/sweeps/{name}", mode="r").attrs["run_ids"])


def _get(spec: dict, dotted: str):
    for part in dotted.split("."):
        spec = spec[part]
    return spec


def _point_runs(url: str, name: str, key: dict) -> list[dict]:
    """The runs of grid point ``key`` of sweep ``name``, found by their recorded specs."""
    runs = [_direct(url, rid) for rid in _sweep_ids(url, name)]
    return [r for r in runs if all(_get(r["spec"], f) == v for f, v in key.items())]


def _stats(values: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    V = np.stack(values)
    return V.mean(0), V.std(0)


def _same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0, equal_nan=True, err_msg=what)


# ------------------------------------------------------------------ what was found right
def test_frame_rows_name_the_run_they_hold(url: str) -> None:
    """Each row's parameters are its own run's recorded spec, and that run's θ has the size of a
    network of that depth and width (a mislabelled grid point would show here)."""
    c = Client(url)
    for name in ("lr", "dw", "nest", "dup"):
        df = c.runs(sweep=name)
        assert sorted(df["id"]) == sorted(_sweep_ids(url, name)), name
        for row in df.to_dict("records"):
            d = _direct(url, row["id"])
            for col in ("model.depth", "model.width", "schedule.lr", "seed"):
                assert row[col] == _get(d["spec"], col), f"{row['id']}: {col} {row[col]!r} vs {_get(d['spec'], col)!r}"
            depth, width = row["model.depth"], row["model.width"]
            P = (2 * width + width) + (depth - 2) * (width * width + width) + (width + 1)  # input 2, output 1
            assert d["theta"].shape[1] == P, f"{row['id']}: θ has {d['theta'].shape[1]} values, depth×width says {P}"
            assert row["status"] == d["status"] and row["steps_done"] == len(d["t"]), row["id"]
        xs = c.run(df["id"][0]).to_xarray()
        np.testing.assert_array_equal(xs["step"].values, _direct(url, df["id"][0])["t"])


def test_curves_are_the_means_of_the_stored_arrays(url: str) -> None:
    """Sweep.curves against numpy over the arrays read from zarr: energy_y (with its bracket),
    the loss trace and the test loss; the two lr a hair apart stay two grid points, labelled apart."""
    s = Client(url).sweep("lr")
    assert s.fields == ["schedule.lr"] and s.seeded
    energy, loss, test = s.curves("energy_y", K), s.curves("loss"), s.curves("loss_test")
    assert [cv.key for cv in energy] == [{"schedule.lr": lr} for lr in LRS]
    assert [cv.label for cv in energy] == LABELS
    for cv, lc, tc in zip(energy, loss, test):
        runs = _point_runs(url, "lr", cv.key)
        assert cv.n == len(runs) == 2, cv.key
        t = runs[0]["t"]
        for r in runs[1:]:
            t = np.intersect1d(t, r["t"])
        _same(cv.t, t, f"{cv.label}: steps")
        E = [r["energy_y"][np.searchsorted(r["t"], t), K - 1] for r in runs]
        mean, std = _stats(E)
        _same(cv.mean, mean, f"{cv.label}: mean E(y, {K})")
        _same(cv.std, std, f"{cv.label}: std E(y, {K})")
        _same(cv.lo, np.min(E, 0), f"{cv.label}: min")
        _same(cv.hi, np.max(E, 0), f"{cv.label}: max")
        _same(cv.bracket[0], mean, f"{cv.label}: exact route: a point bracket")
        _same(cv.bracket[1], mean, f"{cv.label}: exact route: a point bracket")
        _same(lc.mean, _stats([r["loss_trace"] for r in runs])[0], f"{cv.label}: loss mean")
        _same(tc.mean, _stats([r["loss_test"][np.searchsorted(r["t"], t)] for r in runs])[0], f"{cv.label}: test")
    # lr = 50 diverged at t = 3: its loss there is the non-finite one the optimizer saw, nothing after
    assert np.isfinite(loss[2].mean[:3]).all() and not np.isfinite(loss[2].mean[3]), loss[2].mean[:5]
    assert np.isnan(loss[2].mean[4:]).all(), loss[2].mean[:5]


def test_fig7_lines_sit_at_their_grid_points(url: str) -> None:
    """Fig. 7a–c: each line's legend names the grid point whose mean it draws, at x = t (7a) or t + 1."""
    s = Client(url).sweep("lr")
    for fig, name, k, shift in (
        (fig7a(s, K), "energy_y", K, 0),
        (fig7b(s), "loss", None, 1),
        (fig7c(s), "loss_test", None, 1),
    ):
        ax = fig.axes[0]
        lines = [ln for ln in ax.lines if not ln.get_label().startswith("_")]
        assert [ln.get_label() for ln in lines] == LABELS, name
        for ln, lr in zip(lines, LRS):
            runs = _point_runs(url, "lr", {"schedule.lr": lr})
            if name == "loss":
                want_t, want = np.arange(len(runs[0]["loss_trace"])), _stats([r["loss_trace"] for r in runs])[0]
            else:
                want_t = runs[0]["t"] if lr != 50.0 else runs[0]["t"][:2]
                rows = [r[name][: len(want_t)] for r in runs]
                want = _stats([v[:, k - 1] if k else v for v in rows])[0]
            _same(np.asarray(ln.get_xdata(), np.float64), want_t + shift, f"{name} {ln.get_label()}: x")
            _same(np.asarray(ln.get_ydata(), np.float64), want, f"{name} {ln.get_label()}: y")
    assert fig7b(s).axes[0].get_yscale() == "log"


def test_cli_sweep_commands_on_bad_input(url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    store = SpectrumStore(url)
    empty = SweepSpec(name="empty", base=BASE, grid={"seed": [5]})
    store.record_sweep("empty", empty.model_dump(mode="json"), [run_id(s) for s in empty.expand()])  # not started
    out = str(tmp_path / "o")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nbase: {data: {n: 16}, steps: 2}\ngrid: {model.nope: [1, 2]}\n")
    empty_grid = tmp_path / "empty.yaml"
    empty_grid.write_text("name: e\nbase: {data: {n: 16}, steps: 2}\ngrid: {seed: []}\n")
    cases = [
        (["sweep", str(bad)], "model.nope: Extra inputs are not permitted"),
        (["sweep", str(empty_grid)], "grid.seed is an empty list"),
        (["sweep", str(tmp_path / "none.yaml")], "does not exist"),
        (["plot", "--sweep", "nope", "--out", out], "no sweep 'nope'"),
        (["plot", "--sweep", "empty", "--out", out], "has no run with a finished recorded step"),
        (
            ["plot", "--sweep", "lr", "--out", out, "--scalar", "loss", "--x", "model.nope"],
            "'model.nope' is not a field",
        ),
        (["plot", "--sweep", "lr", "--out", out, "--scalar", "nope", "--x", "schedule.lr"], "unknown quantity 'nope'"),
        (["plot", "--sweep", "lr", "--out", out, "--scalar", "loss"], "--scalar needs --x FIELD"),
        (["plot", "--sweep", "lr", "--out", out, "--k", "2000"], "--k 2000: the sweep's runs store E(φ, k) for k ≤"),
        (["show", "lr"], "run ids start with 'lr'"),
        (["show", "nope"], "no run 'nope'"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        rc = main([*argv, "--store", url])
        err = capsys.readouterr().err
        assert rc == 2 and message in err, f"{argv}: rc {rc}, stderr {err!r}"
    assert not list(Path(out).glob("*.png")), "a refused command wrote figures first"
    try:
        assert Client(url).sweep("empty").curves("loss") == []
        rc = main(["plot", "--sweep", "lr", "--out", out, "--store", url])
        assert rc == 0 and sorted(p.name for p in Path(out).glob("*.png")) == sorted(
            ["fig7a_energy_y.png", "fig7b_train_loss.png", "fig7c_test_loss.png", "scalar_energy_y_10.png"]
        )
    finally:
        shutil.rmtree(Path(url) / "sweeps" / "empty")


# ------------------------------------------------------------------ what was wrong, and is fixed
def test_fields_that_every_block_sets_alike_vary_nothing() -> None:
    """Variants that each replace the whole spectrum block, alike but for the layout, listed
    spectrum.k and spectrum.images as grid fields (a new user's trial); a field set alike by every
    point is left out, while one that some points leave to the base still varies."""
    from nsa_dist.client import varied_fields

    same = {"k": 12, "images": [1, 2]}
    layouts = [{**same, "layout": "local"}, {**same, "layout": "block_rows", "workers": 2}]
    assert varied_fields({"variants": [{"spectrum": b} for b in layouts]}) == ["spectrum.layout", "spectrum.workers"]
    grid = {"model": [{"depth": 2, "width": 4}, {"depth": 3, "width": 4}], "seed": [0, 1]}
    assert varied_fields({"grid": grid}) == ["model.depth", "seed"]
    hess = {"top_k": 2}  # the first variant keeps the base's (no) hessian block: hessian.top_k varies
    variants = [{"model.width": 2}, {"model.width": 3, "hessian": hess}, {"model.width": 6, "hessian": hess}]
    assert varied_fields({"variants": variants}) == ["model.width", "hessian.top_k"]
    assert varied_fields({"grid": {"model": [{"depth": 2, "width": 4}]}}) == ["model.depth", "model.width"]


def test_a_grid_over_whole_blocks_keeps_its_points_apart(url: str) -> None:
    """grid: {model: [{depth: 2, width: 4}, {depth: 3, width: 6}]} — before, the sweep varied no
    column ("model" is no column of the frame) and Sweep.curves pooled both networks into one
    mean of 4 runs labelled "all"."""
    s = Client(url).sweep("nest")
    assert s.fields == ["model.depth", "model.width"], s.fields
    curves = s.curves("energy_y", 2)
    assert [(cv.key, cv.n) for cv in curves] == [
        ({"model.depth": 2, "model.width": 4}, 2),
        ({"model.depth": 3, "model.width": 6}, 2),
    ], [(cv.key, cv.n) for cv in curves]
    for cv in curves:
        runs = _point_runs(url, "nest", cv.key)
        _same(cv.mean, _stats([r["energy_y"][:, 1] for r in runs])[0], cv.label)


def test_a_seed_run_twice_under_two_names_counts_once(url: str) -> None:
    """grid {model.width: [4, 4.0], seed: [0, 1]} makes four runs ("width-4", "width-4.0") of two
    experiments; before, the point was "width=4 (4 seeds)", each seed counted twice."""
    s = Client(url).sweep("dup")
    assert len(s.runs) == 4 and sorted(s.runs["seed"]) == [0, 0, 1, 1], s.runs[["id", "seed"]]
    (cv,) = s.curves("energy_y", 2)
    assert (cv.n, cv.label) == (2, "width=4 (2 seeds)"), (cv.n, cv.label)
    by_seed = {r["spec"]["seed"]: r for r in _point_runs(url, "dup", {"model.width": 4})}
    _same(cv.mean, _stats([by_seed[0]["energy_y"][:, 1], by_seed[1]["energy_y"][:, 1]])[0], cv.label)
    assert sorted(s.scalar("energy_y", 2)["seed"]) == [0, 1]
    # and a sweep expanded now runs each experiment once (the runs above were made twice)
    grid = {"model.width": [4, 4.0], "seed": [0, 1]}
    again = SweepSpec(name="dup", base={**BASE, "data": {"n": 12}, "steps": 3}, grid=grid).expand()
    assert [r.name for r in again] == ["dup__width-4__seed-0", "dup__width-4__seed-1"], [r.name for r in again]


def test_scalar_figure_never_pools_a_field_it_does_not_draw(url: str) -> None:
    """depth × width × lr against depth, a line per width: before, each point was the mean of the
    two lr (and its error bar their spread, under "± std over seeds" of a sweep with no seeds)."""
    s = Client(url).sweep("dw")
    ax = scalar_figure(s, "energy_y", "model.depth", line="model.width", k=2).axes[0]
    lines = {cont.get_label(): cont.lines[0] for cont in ax.containers}
    assert list(ax.get_xticks()) == [2, 3], ax.get_xticks()  # an integer field's values (2.0, 2.2, … before)
    want_labels = sorted(f"width={w}, lr={lr}" for w in (4, 6) for lr in (0.05, 0.2))
    assert sorted(lines) == want_labels, sorted(lines)
    for w in (4, 6):
        for lr in (0.05, 0.2):
            ln = lines[f"width={w}, lr={lr}"]
            want = [
                _point_runs(url, "dw", {"model.depth": d, "model.width": w, "schedule.lr": lr})[0]["energy_y"][-1, 1]
                for d in (2, 3)
            ]
            _same(np.asarray(ln.get_xdata(), np.float64), np.array([2.0, 3.0]), f"width={w}, lr={lr}: x")
            _same(np.asarray(ln.get_ydata(), np.float64), np.array(want), f"width={w}, lr={lr}: E(y, 2) at the end")
    # nsa serve's sweep summary draws the same points: it pooled the lr too
    from nsa_dist.serve.sweep_page import _by

    served = {ser.label: ser for ser in _by(s.scalar("energy_y", 2), "model.depth", "model.width", (s, 2, {}))}
    assert sorted(served) == want_labels, sorted(served)
    for label, ln in lines.items():
        _same(np.asarray(served[label].y, np.float64), np.asarray(ln.get_ydata(), np.float64), f"served {label}")


@pytest.fixture()
def partial_url(url: str, tmp_path: Path) -> str:
    """A copy of the store where, at lr = 0.1, seed 1 is still running (trained to t = 2, recorded
    t = 0, 2) and seed 0 has no E(y, K) at t = 2; at lr = 0.1000000001 seed 1 has not
    recorded a step yet."""
    copy = str(tmp_path / "partial.zarr")
    shutil.copytree(url, copy)
    point = lambda lr, seed: next(  # noqa: E731
        rid
        for rid in _sweep_ids(copy, "lr")
        if _direct(copy, rid)["spec"]["schedule"]["lr"] == lr and _direct(copy, rid)["spec"]["seed"] == seed
    )
    g = zarr.open_group(f"{copy}/runs/{point(0.1, 1)}", mode="r+")
    g.attrs["status"] = "failed"  # a run that is not "done" is read by its done flags
    g["done"][:] = np.array([True, True, False, False])
    trace = g["loss_trace"][:]
    trace[3:] = np.nan
    g["loss_trace"][:] = trace
    g = zarr.open_group(f"{copy}/runs/{point(0.1, 0)}", mode="r+")
    E = g["energy_y"][:]
    E[1, K - 1] = np.nan  # only this k: a row all fill value is a chunk zarr does not write
    g["energy_y"][:] = E
    g = zarr.open_group(f"{copy}/runs/{point(0.1000000001, 1)}", mode="r+")
    g.attrs["status"] = "failed"
    g["done"][:] = False
    return copy


def test_a_mean_over_seeds_never_mixes_seeds_or_steps(partial_url: str) -> None:
    """Before, the mean was np.nanmean: where one seed had no value (not trained yet, diverged,
    a diagnostic it could not compute) the "mean of 2 seeds" was the other seed's value alone, with
    std 0.  Now it is NaN there and Curve.count says how many runs have a value."""
    s = Client(partial_url).sweep("lr")
    loss = s.curves("loss")[0]
    runs = _point_runs(partial_url, "lr", {"schedule.lr": 0.1})
    trace = np.stack([r["loss_trace"] for r in runs])
    _same(loss.mean[:3], trace[:, :3].mean(0), "loss where both seeds trained")
    assert np.isnan(loss.mean[3:]).all() and np.isnan(loss.std[3:]).all(), (
        f"loss 'mean of {loss.n} seeds' where seed 1 is not trained yet: {loss.mean[3:]}, std {loss.std[3:]} "
        f"(seed 0 alone: {trace[0, 3:]})"
    )
    assert loss.n == 2 and loss.count.tolist() == [2, 2, 2, 1, 1, 1], loss.count
    E = s.curves("energy_y", K)[0]
    _same(E.t, np.array([0, 2]), "the steps both seeds recorded")  # never a step only one of them has
    assert np.isfinite(E.mean[0]) and np.isnan(E.mean[1]), (
        f"E(y, {K}) 'mean of 2 seeds' at t = 2 where seed 0 has none: {E.mean[1]} (seed 1 alone)"
    )
    assert E.count.tolist() == [2, 1], E.count
    one = s.curves("loss")[1]  # seed 1 has no finished step: the point's label says so
    assert (one.n, one.total, one.label) == (1, 2, "lr=0.1000000001 (1 of 2 seeds)"), (one.n, one.total, one.label)
    df = s.scalar("loss_test").set_index("id")
    for rid, r in ((rid, _direct(partial_url, rid)) for rid in df.index):
        ok = np.flatnonzero(np.isfinite(r["loss_test"]))
        assert df.loc[rid, "step"] == r["t"][ok[-1]], f"{rid}: value from t = {df.loc[rid, 'step']}"
        _same(np.array([df.loc[rid, "value"]]), r["loss_test"][ok[-1:]], rid)


def test_scalar_figure_marks_a_point_whose_runs_ended_early(url: str) -> None:
    """The test loss "at the last step" against lr: lr = 50 diverged at t = 3, so its value is the
    one at t = 2, which the figure drew before as if it were the last step's like the others."""
    s = Client(url).sweep("lr")
    ax = scalar_figure(s, "loss_test", "schedule.lr").axes[0]
    (cont,) = ax.containers
    want = [
        _stats([r["loss_test"][-1 if lr != 50.0 else 1] for r in _point_runs(url, "lr", {"schedule.lr": lr})])[0]
        for lr in LRS
    ]
    _same(np.asarray(cont.lines[0].get_ydata(), np.float64), np.array(want), "test loss per lr")
    notes = [(t.get_text(), t.xy[0]) for t in ax.texts]
    assert notes == [("t = 2", 50.0)], f"the lr = 50 point (t = 2, the others t = 5) is marked {notes}"
    df = s.scalar("loss_test")
    assert sorted(set(df.loc[df["schedule.lr"] == 50.0, "step"])) == [2], df
    assert set(df.loc[df["schedule.lr"] != 50.0, "step"]) == {5}, df


# ------------------------------------------------------------------ a real sweep on the embedded Ray
@pytest.mark.slow
def test_a_sweep_on_ray_read_while_running_and_after_a_grid_point_is_added(local_ray, tmp_path: Path) -> None:
    """The coordinator's sweep, read while it runs (a partial sweep), then resumed with one more
    width: the finished runs are kept, the new point is added, and every curve is the numpy mean
    of its runs' stored arrays with its label naming its point."""
    from nsa_dist.cluster import SweepCoordinator

    base = {**BASE, "steps": 8, "record": {"every": 2}}
    url = str(tmp_path / "ray.zarr")
    seen: list[str] = []

    def during(progress) -> None:  # a researcher reading the sweep while it runs
        if len(seen) < 3 and any(p.done for p in progress) and not all(p.status == "done" for p in progress):
            for cv in Client(url).sweep("dwr").curves("loss_test"):
                assert cv.n <= cv.total and np.all(cv.count <= cv.n), (cv.label, cv.count)
                assert cv.label.endswith(f"({cv.n} of {cv.total} seeds)") or cv.n == cv.total, cv.label
                seen.append(cv.label)

    one = SweepSpec(name="dwr", base=base, grid={"model.width": [4], "seed": [0, 1]}, cluster={"spectral_workers": 1})
    assert [o.status for o in SweepCoordinator(one, url, on_event=during).run()] == ["done"] * 2
    assert seen, "the sweep was never read while running"
    first = {rid: zarr.open_group(f"{url}/runs/{rid}", mode="r")["theta"][:] for rid in _sweep_ids(url, "dwr")}
    two = one.model_copy(update={"grid": {"model.width": [4, 8], "seed": [0, 1]}})
    assert [o.status for o in SweepCoordinator(two, url).run()] == ["done"] * 4
    ids = _sweep_ids(url, "dwr")
    assert set(first) <= set(ids) and len(ids) == 4, ids
    for rid, theta in first.items():  # resumed, not recomputed
        np.testing.assert_array_equal(zarr.open_group(f"{url}/runs/{rid}", mode="r")["theta"][:], theta)
    s = Client(url).sweep("dwr")
    curves = s.curves("energy_y", K)
    assert [cv.label for cv in curves] == ["width=4 (2 seeds)", "width=8 (2 seeds)"]
    for cv in curves:
        runs = _point_runs(url, "dwr", cv.key)
        assert len(runs) == 2 and {r["spec"]["seed"] for r in runs} == {0, 1}, cv.key
        _same(cv.mean, _stats([r["energy_y"][:, K - 1] for r in runs])[0], cv.label)
        _same(cv.std, _stats([r["energy_y"][:, K - 1] for r in runs])[1], cv.label)


def test_a_grid_point_without_a_finished_step_is_named_not_silently_left_out(url, tmp_path, caplog) -> None:
    """Both seeds of lr = 0.1 not started: the point vanished from Sweep.curves and every figure
    without a word."""
    import logging

    from nsa_dist.plots import plot_sweep

    copy = str(tmp_path / "c.zarr")
    shutil.copytree(url, copy)
    for rid in _sweep_ids(copy, "lr"):
        if _direct(copy, rid)["spec"]["schedule"]["lr"] == 0.1:
            g = zarr.open_group(f"{copy}/runs/{rid}", mode="r+")
            g.attrs["status"] = "pending"
            g["done"][:] = np.zeros(g["done"].shape, bool)
    s = Client(copy).sweep("lr")
    assert s.unfinished_points() == [{"schedule.lr": 0.1}], s.unfinished_points()
    assert {c.key["schedule.lr"] for c in s.curves("loss")} == {x for x in LRS if x != 0.1}
    with caplog.at_level(logging.WARNING, logger="nsa_dist.plots"):
        plot_sweep(s, tmp_path / "figs", figures=["fig7b_train_loss"])
    said = [r.getMessage() for r in caplog.records if "without a finished recorded step" in r.getMessage()]
    assert said and "lr=0.1" in said[0], [r.getMessage() for r in caplog.records]
