"""Runs as data (xarray / pandas, plain xarray.open_zarr) and the cross-run sweep figures, on a tiny sweep."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib.pyplot import imread

from nsa_dist.cli import main
from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec, SweepSpec
from nsa_dist.pipeline import run_experiment, run_id
from nsa_dist.plots.sweep import SWEEP_FIGURES, plot_sweep, scalar_figure
from nsa_dist.store import SpectrumStore

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2 depths × 2 seeds sweep, recorded as the coordinator records one, plus a run outside it."""
    url = str(tmp_path_factory.mktemp("sw") / "s.zarr")
    store = SpectrumStore(url)
    sweep = SweepSpec(
        name="sw",
        base={
            "data": {"n": 32, "n_test": 16},
            "model": {"width": 8},
            "steps": 12,
            "record": {"every": 4},
            "spectrum": {"k": 12, "images": [1]},
        },
        grid={"model.depth": [2, 3], "seed": [0, 1]},
    )
    ids = []
    for spec in sweep.expand():
        assert run_experiment(spec, store).status == "done"
        ids.append(run_id(spec))
    store.record_sweep(sweep.name, sweep.model_dump(mode="json"), ids)
    lone = sweep.expand()[0].model_copy(update={"name": "lone", "steps": 5})
    assert run_experiment(lone, store).status == "done"
    two = SweepSpec(
        name="sw2",
        base={"data": {"n": 24}, "steps": 4, "record": {"every": 2}, "spectrum": {"k": 8, "store_eigenvectors": False}},
        grid={"model.depth": [2, 3], "model.width": [4, 8]},
    )
    ids = []
    for spec in two.expand():
        assert run_experiment(spec, store).status == "done"
        ids.append(run_id(spec))
    store.record_sweep(two.name, two.model_dump(mode="json"), ids)
    return url


def test_plain_xarray_opens_a_run(store_url: str) -> None:
    run = Client(store_url).run("lone")
    ds = xr.open_zarr(store_url, group=f"runs/{run.id}", consolidated=False)
    assert ds["f"].dims == ("step", "point") and ds["energy_y"].dims == ("step", "k")
    assert ds["eigenvectors"].dims == ("step", "point", "k") and ds["X"].dims == ("point", "input")
    assert ds["f_test"].dims == ("step", "test_point") and ds["loss_trace"].dims == ("train_step",)
    assert ds["eigvec_images"].dims == ("step", "image", "pixel_y", "pixel_x")
    np.testing.assert_array_equal(ds["eigenvalues"].values, run.g["eigenvalues"][:])


def test_run_to_xarray(store_url: str) -> None:
    run = Client(store_url).run("lone")
    ds = run.to_xarray()
    np.testing.assert_array_equal(ds["step"].values, run.steps)
    np.testing.assert_array_equal(ds["k"].values, np.arange(1, 13))
    np.testing.assert_array_equal(ds["energy_y"].sel(k=10).values, run.energy("y", 10, step=None)[0])
    np.testing.assert_array_equal(ds["loss_test"].values, run.test_loss)
    assert "theta" not in ds and "theta" in run.to_xarray(state=True)
    assert json.loads(ds.attrs["spec"])["name"] == "lone" and ds.attrs["run_id"] == run.id


def test_runs_frame(store_url: str) -> None:
    c = Client(store_url)
    df = c.runs()
    assert len(df) == 9 and {"id", "sweep", "status", "model.depth", "schedule.lr", "seed"} <= set(df.columns)
    assert df.set_index("name")["sweep"].isna()["lone"]
    assert (df["status"] == "done").all() and (df["steps_done"] == df["steps_total"]).all()
    sw = c.runs(sweep="sw")
    assert sorted(sw["model.depth"].tolist()) == [2, 2, 3, 3] and set(sw["sweep"]) == {"sw"}
    assert len(c.runs(sweep="sw", model__depth=3, seed=1)) == 1
    with pytest.raises(KeyError, match="no sweep 'nope'.*sweeps: sw"):
        c.runs(sweep="nope")
    with pytest.raises(KeyError, match="no column 'model.deep'"):
        c.runs(model__deep=3)


def test_sweep_curves_are_means_over_seeds(store_url: str) -> None:
    c = Client(store_url)
    s = c.sweep("sw")
    assert s.fields == ["model.depth"] and s.seeded
    curves = s.curves("energy_y", k=5)
    assert [cv.key for cv in curves] == [{"model.depth": 2}, {"model.depth": 3}] and all(cv.n == 2 for cv in curves)
    for cv in curves:
        runs = [c.run(r) for r in c.runs(sweep="sw", model__depth=cv.key["model.depth"])["id"]]
        E = np.stack([r.energy("y", 5, step=None)[0] for r in runs])  # (2, S)
        np.testing.assert_allclose(cv.mean, E.mean(0))
        np.testing.assert_allclose(cv.std, E.std(0))
        np.testing.assert_array_equal(cv.t, runs[0].steps)
    test = s.curves("loss_test")[0]
    assert np.isfinite(test.mean).all() and test.t.tolist() == [0, 4, 8, 11]
    df = s.scalar("energy_y", k=10)
    one = df[(df["model.depth"] == 3) & (df["seed"] == 1)]
    assert one["value"].item() == pytest.approx(c.run(one["id"].item()).energy("y", 10)[0])


def _readable(p: Path) -> None:
    img = imread(p)
    assert img.ndim == 3 and min(img.shape[:2]) >= 200 and img[..., :3].std() > 0.01, p


def test_sweep_figures(store_url: str, tmp_path: Path) -> None:
    s = Client(store_url).sweep("sw")
    out = plot_sweep(s, tmp_path)
    assert [p.stem for p in out] == list(SWEEP_FIGURES)
    for p in out:
        _readable(p)
    fig = scalar_figure(s, "loss_test", "model.depth")
    assert fig.axes[0].get_xlabel() == "model.depth"
    with pytest.raises(ValueError, match="'model.width' is not a field sweep 'sw' varies; its fields: model.depth"):
        scalar_figure(s, "loss_test", "model.width")
    with pytest.raises(ValueError, match="unknown sweep figure"):
        plot_sweep(s, tmp_path, figures=["fig7z"])


def test_scalar_against_one_field_with_a_line_per_other(store_url: str) -> None:
    c = Client(store_url)
    s = c.sweep("sw2")
    assert s.fields == ["model.depth", "model.width"] and not s.seeded
    ax = scalar_figure(s, "energy_y", "model.depth", line="model.width", k=5).axes[0]
    lines = {cont.get_label(): cont.lines[0] for cont in ax.containers}  # one errorbar line per width
    assert sorted(lines) == ["width=4", "width=8"], sorted(lines)
    for w, ln in ((4, lines["width=4"]), (8, lines["width=8"])):
        want = [
            c.run(c.runs(sweep="sw2", model__depth=d, model__width=w)["id"].item()).energy("y", 5)[0] for d in (2, 3)
        ]
        np.testing.assert_array_equal(ln.get_xdata(), [2, 3])
        np.testing.assert_allclose(ln.get_ydata(), want, rtol=1e-12)


def test_any_stored_per_step_array_is_a_sweep_quantity(store_url: str) -> None:
    c = Client(store_url)
    s = c.sweep("sw2")
    df = s.scalar("eigenvalues", k=2)  # λ_2 at the last step: not one of the named quantities
    one = df[(df["model.depth"] == 3) & (df["model.width"] == 8)]
    run = c.run(one["id"].item())
    assert one["value"].item() == run.eigenvalues[-1, 1]
    t, v = s.curves("gram_sq_frobenius", k=1)[0].t, s.curves("gram_sq_frobenius", k=1)[0].mean
    assert t.tolist() == [0, 2, 3] and len(v) == 3 and (v > 0).all()
    with pytest.raises(
        ValueError, match="unknown quantity 'nope'.*or a stored per-step array of this run: .*eigenvalues"
    ):
        s.scalar("nope")
    with pytest.raises(ValueError, match="'eigenvalues' has 8 values per step: give k in 1..8, got 9"):
        s.scalar("eigenvalues", k=9)


def test_cli_plot_sweep_and_ls(store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert (
        main(
            [
                "plot",
                "--sweep",
                "sw",
                "--out",
                str(tmp_path),
                "--store",
                store_url,
                "--scalar",
                "lambda_max",
                "--x",
                "model.depth",
            ]
        )
        == 0
    )
    written = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in written) == sorted(
        [f"{n}.png" for n in SWEEP_FIGURES] + ["scalar_lambda_max.png"]
    )
    assert main(["ls", "--store", store_url]) == 0
    assert "lone" in capsys.readouterr().out
    assert main(["plot", "--sweep", "nope", "--out", str(tmp_path), "--store", store_url]) == 2


def test_cli_plot_run_at_chosen_steps(store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert (
        main(
            [
                "plot",
                "lone",
                "--out",
                str(tmp_path),
                "--store",
                store_url,
                "--step",
                "0",
                "4",
                "--k",
                "1",
                "3",
                "--figures",
                "fig4a_residual_projections",
                "fig3a_energy_y",
            ]
        )
        == 0
    )
    assert sorted(Path(p).name for p in capsys.readouterr().out.split()) == [
        "fig3a_energy_y.png",
        "fig4a_residual_projections.png",
    ]
    assert main(["plot", "lone", "--out", str(tmp_path), "--store", store_url, "--step", "3"]) == 2
    assert "step(s) [3] are not finished recorded steps" in capsys.readouterr().err
    assert main(["plot", "--out", str(tmp_path), "--store", store_url]) == 2
    assert "give either a RUN or --sweep NAME" in capsys.readouterr().err


def test_sweep_figure_titles(store_url: str) -> None:
    """NSA Fig. 7a–c by their numbers; the scalar summary claims no figure of the paper."""
    from nsa_dist.plots.axes import title_of as first  # the title line, unwrapped
    from nsa_dist.plots.sweep import fig7a, fig7b, fig7c

    s = Client(store_url).sweep("sw")
    assert first(fig7a(s, 10)) == "NSA Fig. 7a — label energy $E_t(y, 10)$"
    assert first(fig7b(s)) == "NSA Fig. 7b — training loss"
    assert first(fig7c(s)) == "NSA Fig. 7c — test loss"
    t = first(scalar_figure(s, "loss_test", "model.depth"))
    assert t.startswith("NSA — ") and "no figure of the paper" in t and "Fig." not in t, t


def test_run_reads_and_views_are_the_stored_arrays_at_the_finished_steps(store_url: str) -> None:
    """run.per_step / index_of / row are the stored arrays at the finished steps; run.images and
    run.kernel return the stored rows; a run without a Hessian block says so by name."""
    from nsa_dist.errors import StoreError

    run = Client(store_url).run("lone")
    assert run.steps.tolist() == [0, 4] and run.finished.tolist() == [0, 1]
    np.testing.assert_array_equal(run.per_step("eigenvalues"), run.array("eigenvalues")[run.finished])
    np.testing.assert_array_equal(run.rows("lr", np.array([1])), run.lr[1:])
    i = run.index_of(4)
    assert i == 1
    with pytest.raises(KeyError, match=r"step 3 is not a finished recorded step of run .*finished: \[0, 4\]"):
        run.index_of(3)
    im = run.images.at(4)
    assert run.images.indices.tolist() == [1] and im["indices"].tolist() == [1]
    for name in ("eigvec_images", "eigvec_fourier", "residual_image", "residual_fourier"):
        np.testing.assert_array_equal(im[name], run.array(name)[i], err_msg=name)
    np.testing.assert_array_equal(run.kernel.residual_projections(4), run.row("projections_residual", i))
    assert run.dimension_names("eigenvalues") == ("step", "k")
    assert not run.has("hessian_steps")
    with pytest.raises(StoreError, match="has no array 'hessian_steps'"):
        run.hessian.steps


def test_sweep_opens_from_the_store_alone(store_url: str) -> None:
    from nsa_dist.client import Sweep, flatten_spec

    c = Client(store_url)
    s = Sweep(c.store, "sw")
    assert s.runs.equals(c.sweep("sw").runs) and s.fields == ["model.depth"]
    rid = s.runs["id"][0]
    assert s.run(rid).id == rid
    with pytest.raises(KeyError, match="no sweep 'nope'"):
        Sweep(c.store, "nope")
    assert flatten_spec({"model": {"depth": 6}, "grid": [1, 2], "extra": {}}) == {
        "model.depth": 6,
        "grid": (1, 2),
        "extra": None,  # an empty block is no value (a dict is no pandas key)
    }


def test_image_and_preservation_rows_are_coordinates(store_url: str) -> None:
    """`image` and `preservation_row` had no coordinates (the i sat in image_indices and in an
    attribute): eigvec_images.sel(image=10) was impossible (audit U)."""
    run = Client(store_url).run("lone")
    ds = run.to_xarray()
    np.testing.assert_array_equal(ds["image"].values, run.array("image_indices"))
    np.testing.assert_array_equal(ds["eigvec_images"].sel(image=1).values, ds["eigvec_images"].isel(image=0).values)
    np.testing.assert_array_equal(ds["preservation_row"].values, run.array_attrs("preservation")["rows"])


def test_runs_counts_keep_one_dtype_whatever_the_progress(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """steps_done / steps_total / last_step are nullable integers: a run with no finished step
    (last_step None) beside a finished one made the column float (7.0 in a table), and its dtype
    depended on how far the runs had got."""
    url = str(tmp_path / "p.zarr")
    store = SpectrumStore(url)
    spec = SweepSpec(
        name="p",
        base={
            "data": {"n": 16},
            "model": {"depth": 2, "width": 4},
            "steps": 3,
            "record": {"every": 3},
            "spectrum": {"k": 4, "images": []},
        },
        grid={"seed": [0]},
    )
    one = spec.expand()[0]
    out = run_experiment(one, store)
    assert out.status == "done"
    c = Client(url)
    alone = c.runs()
    store.writer("started-0001", store.run_attrs(out.run_id)["spec"], store.dims(out.run_id))  # no step yet
    both = c.runs()
    for df in (alone, both):
        assert {str(df[col].dtype) for col in ("steps_done", "steps_total", "last_step")} == {"Int64"}, df.dtypes
    row = both.set_index("id").loc["started-0001"]
    assert row["steps_done"] == 0 and row["last_step"] is pd.NA, row
    assert both.set_index("id").loc[out.run_id, "last_step"] == 2
    assert main(["ls", "--store", url]) == 0
    listed = capsys.readouterr().out
    assert "<NA>" not in listed and ".0" not in listed, listed


def test_cli_ls_show_export_of_a_sweep(store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`nsa ls/show/export --sweep NAME`: a sweep's runs with its grid fields, its last measurements,
    every run's TensorBoard folder — each command took one run or the whole store only."""
    c = Client(store_url)
    sw = c.runs(sweep="sw")
    assert main(["ls", "--store", store_url, "--sweep", "sw"]) == 0
    out = capsys.readouterr().out
    assert all(rid in out for rid in sw["id"]) and "lone" not in out and "sweep sw" in out, out
    assert "model.depth" in out and "seed" in out, out
    assert main(["ls", "--store", store_url]) == 0  # the whole store: which sweep each run is in
    out = capsys.readouterr().out
    assert "sweep" in out.splitlines()[1] + out.splitlines()[2] and "sw2" in out, out
    assert main(["show", "--store", store_url, "--sweep", "sw"]) == 0
    out = capsys.readouterr().out
    assert "4 runs: 4 done" in out and '"model.depth": [2, 3]' in out and "E(y, 10)" in out, out
    sweep = c.sweep("sw")
    e = sweep.scalar("energy_y", k=10).set_index("id")["value"]
    assert all(f"{v:.4g}" in out for v in e), (e, out)  # each run's E(y, 10) at its last step
    assert main(["show", "--store", store_url]) == 2
    assert "give either a RUN or --sweep NAME" in capsys.readouterr().err
    pytest.importorskip("tensorboard")
    assert main(["export", "--store", store_url, "--sweep", "sw2", "--tensorboard", str(tmp_path / "tb")]) == 0
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == sorted(c.runs(sweep="sw2")["id"])
    assert main(["export", "--store", store_url, "--sweep", "nope", "--tensorboard", str(tmp_path / "tb")]) == 2
    assert "no sweep 'nope'" in capsys.readouterr().err


def test_a_damaged_run_never_hides_its_sweeps_other_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A review's repros: `nsa show --sweep` ended in one error for the whole sweep when one run's
    energy array was unreadable, and a run whose metadata was unreadable (no spec) made every spec
    field "varied" (56 columns in `nsa ls --sweep`)."""
    url = str(tmp_path / "d.zarr")
    store = SpectrumStore(url)
    sweep = SweepSpec(
        name="sw",
        base={
            "data": {"n": 20},
            "model": {"width": 6},
            "steps": 4,
            "record": {"every": 2},
            "spectrum": {"k": 5, "images": []},
        },
        grid={"model.depth": [2, 3]},
    )
    ids = [run_experiment(s, store).run_id for s in sweep.expand()]
    store.record_sweep("sw", sweep.model_dump(mode="json"), ids)
    (Path(url) / "runs" / ids[1] / "energy_y" / "zarr.json").write_text("{not json")
    assert main(["show", "--store", url, "--sweep", "sw"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 3}
    assert "unreadable" in rows[ids[1]] and "unreadable" not in rows[ids[0]], out
    (Path(url) / "runs" / ids[1] / "zarr.json").write_text("{not json")
    assert Client(url).sweep("sw").fields == ["model.depth"]
    assert main(["ls", "--store", url, "--sweep", "sw"]) == 0
    assert "data.n" not in capsys.readouterr().out


def test_grid_points_whose_runs_were_never_created_are_unfinished(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture
) -> None:
    """A sweep driver stopped after recording the sweep and creating one of its runs: the other
    grid point has no run in the store, and `unfinished_points` / `nsa plot --sweep` / `nsa show
    --sweep` left it out silently (a review's finding) — a figure of one depth with no word of the other."""
    url = str(tmp_path / "u.zarr")
    store = SpectrumStore(url)
    sweep = SweepSpec(
        name="sw",
        base={"data": {"n": 16}, "model": {"width": 4}, "steps": 2, "record": {"every": 2}, "spectrum": {"k": 4}},
        grid={"model.depth": [2, 3]},
    )
    first, second = sweep.expand()
    assert run_experiment(first, store).status == "done"
    store.record_sweep("sw", sweep.model_dump(mode="json"), [run_id(first), run_id(second)])
    sw = Client(url).sweep("sw")
    assert sw.not_created() == [run_id(second)]
    assert sw.unfinished_points() == [{"model.depth": 3}], sw.unfinished_points()
    assert [key for key, _ in sw.groups()] == [{"model.depth": 2}]
    with caplog.at_level("WARNING", logger="nsa_dist.plots"):
        plot_sweep(sw, tmp_path / "figs", figures=["fig7a_energy_y"])
    assert "depth=3" in caplog.text, caplog.text
    assert main(["show", "--store", url, "--sweep", "sw"]) == 0
    out = capsys.readouterr().out
    assert "1 runs: 1 done; 1 not created yet" in out and "model.depth" in out and "3" in out, out


def test_show_sweep_gives_each_runs_loss_at_the_step_it_names(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`nsa show --sweep`'s "loss" was the last finite training loss — an SGD run's last minibatch
    (0.0998 beside step 11's L(θ) 0.271), a diverged run's 4.8·10¹² at a later step beside step 4's
    17.8 (an audit) — under the heading "each finished run at its last step"."""
    url = str(tmp_path / "l.zarr")
    store = SpectrumStore(url)
    sweep = SweepSpec(
        name="sw",
        base={
            "data": {"n": 24},
            "model": {"width": 6, "depth": 2},
            "optimizer": {"name": "sgd", "batch_size": 4},
            "steps": 6,
            "record": {"steps": [0, 3]},
            "spectrum": {"k": 4, "images": []},
        },
        grid={"schedule.lr": [0.05, 0.2]},
    )
    ids = [run_experiment(s, store).run_id for s in sweep.expand()]
    store.record_sweep("sw", sweep.model_dump(mode="json"), ids)
    assert main(["show", "--store", url, "--sweep", "sw"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line.split("│") for line in out.splitlines() if line.count("│") > 3}
    for rid in ids:
        run = Client(url).run(rid)
        last = int(rows[rid][-4])
        at = run.train_loss[list(run.steps).index(last)]
        assert last == run.steps[-1] and float(rows[rid][-3]) == pytest.approx(at, rel=1e-4), (rid, at, out)
        assert not np.isclose(run.loss_trace[last], at, rtol=1e-3), "the minibatch loss must differ for the test to see"


def test_every_short_or_k_like_axis_of_to_xarray_has_its_coordinate(tmp_path: Path) -> None:
    """``ds.gram_change.sel(k_gram_change=1)`` gave i = 2's v_iᵀdG v_i (3.86 against 2.70) and
    ``ds.reconstructions.sel(reconstruction=1)`` the second reconstruction (k = 12): those axes had no
    coordinate, so ``sel`` took the label for a 0-based position (an audit)."""
    spec = ExperimentSpec(
        name="axes",
        data={"n": 48, "n_test": 8},
        model={"depth": 3, "width": 16},
        steps=15,
        record={"every": 5},
        spectrum={"k": 12, "images": [], "gram_change_k": 4, "store_eigenvectors": [5, 14]},
    )
    url = str(tmp_path / "x.zarr")
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run("axes")
    ds = run.to_xarray()
    t = int(run.eigenvector_steps[0])
    gc = run.kernel.gram_change()
    got = ds.gram_change.sel(step=t, k_gram_change=1)
    assert float(got.sel(measured_first_order="measured")) == gc["measured"][0][0], (got.values, gc)
    assert float(got.sel(measured_first_order="first_order")) == gc["first_order"][0][0], (got.values, gc)
    ks = list(run.g["reconstruction_k"][:])
    np.testing.assert_array_equal(
        ds.reconstructions.sel(reconstruction=ks[0]).values, ds.reconstructions.values[:, 0], err_msg=f"k = {ks[0]}"
    )
    np.testing.assert_array_equal(ds.predicted_step.values, run.g["steps"][:])
    bare = {d for d in ds.dims if d not in ds.coords}
    assert bare <= {"point", "test_point", "input", "output", "pixel_y", "pixel_x", "freq_y", "freq_x"}, bare


def test_app_f_on_a_run_that_did_not_measure_it_says_how_to(store_url: str) -> None:
    """``run.kernel.gram_change()`` said "has no array 'gram_change' — it has: …" (a README walk-through)."""
    from nsa_dist.errors import StoreError

    with pytest.raises(StoreError, match=r"did not measure App. F's dG_t: .*spectrum.gram_change_k"):
        Client(store_url).run("lone").kernel.gram_change()
