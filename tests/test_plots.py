"""nsa_dist.plots on tiny recorded runs: every figure is written as a readable PNG, missing data skips."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.pyplot import imread

from nsa_dist.client import Client, Run
from nsa_dist.config import ExperimentSpec
from nsa_dist.pipeline import run_experiment
from nsa_dist.plots import FIGURES, make_figure, plot_run, residual_projections
from nsa_dist.plots.axes import PlotOptions, readable
from nsa_dist.store import SpectrumStore

# figures a 2-D run with test points, images and eigenvectors has, and those a digits run lacks
NEEDS_EXTRAS = (
    "fig1abc_target_output_points",
    "fig3e_energy_f_test",
    "fig4bc_residual_fourier",
    "fig6_eigenvectors_early",
    "fig5_eigenvectors",
    "fig7d_preservation",
    "fig4d_reconstructions",
    "appF_gram_change",
)


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One store with a 2-D run (test points, lr halved at t = 20) and a digits run (d = 64, no eigenvectors)."""
    url = str(tmp_path_factory.mktemp("plots") / "s.zarr")
    store = SpectrumStore(url)
    tiny = ExperimentSpec(
        name="tiny",
        data={"n": 64, "n_test": 32},
        model={"depth": 3, "width": 32},
        steps=40,
        record={"every": 10},
        schedule={"decay": 0.5, "every": 20},
        spectrum={"k": 20, "test_points": True, "gram_change_k": 3},
    )
    digits = ExperimentSpec(
        name="digits",
        data={"name": "digits", "n": 32},
        model={"depth": 2, "width": 16},
        steps=6,
        record={"every": 5},
        spectrum={"k": 10, "store_eigenvectors": False},
    )
    for spec in (tiny, digits):
        assert run_experiment(spec, store).status == "done"
    return url


@pytest.fixture(scope="module")
def tiny(store_url: str) -> Run:
    return Client(store_url).run("tiny")


@pytest.fixture(scope="module")
def written(tiny: Run, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return plot_run(tiny, tmp_path_factory.mktemp("figs") / "nested")


def test_every_figure_written_and_readable(written: list[Path]) -> None:
    nsa_figures = [f for f in FIGURES if not f.startswith("hessian_")]  # this run records no Hessian
    assert [p.stem for p in written] == nsa_figures
    for p in written:
        assert p.suffix == ".png" and p.stat().st_size > 1000, p
        img = imread(p)
        assert img.ndim == 3 and img.shape[2] in (3, 4) and min(img.shape[:2]) >= 200, (p.name, img.shape)
        assert img[..., :3].std() > 0.01, f"{p.name} is blank"


def test_fourier_panels_start_their_log_scale_at_the_sampling_noise(tiny: Run) -> None:
    """|m̂_t| was drawn on a linear scale: at small N one bright pixel (the mean) on speckle as bright
    as the signal.  Now a log scale from the sampling standard error ‖φ‖₂/N (the residual's from the
    stored outputs; 1/N for a unit eigenvector), black below it."""
    from matplotlib.colors import LogNorm

    from nsa_dist.plots import PlotOptions

    n = tiny.y.shape[0]
    fig = make_figure(tiny, "fig4bc_residual_fourier", PlotOptions(steps=(10, 30)))
    fourier = [a for a in fig.axes if a.get_title().startswith(r"$|\hat m_t|$")]
    assert len(fourier) == 2
    for ax, t in zip(fourier, (10, 30)):
        m = np.asarray(tiny.outputs(t), np.float64).reshape(-1) - np.asarray(tiny.y, np.float64).reshape(-1)
        floor = np.linalg.norm(m) / n
        (im,) = ax.get_images()
        stored = np.asarray(tiny.images.at(t)["residual_fourier"], np.float64).T
        assert isinstance(im.norm, LogNorm) and np.isclose(im.norm.vmin, floor, rtol=1e-6), (t, im.norm.vmin, floor)
        assert np.isclose(im.norm.vmax, max(stored.max(), 10 * floor))
        np.testing.assert_array_equal(np.asarray(im.get_array()), np.clip(stored, im.norm.vmin, None))
    fig = make_figure(tiny, "fig5_eigenvectors")
    norms = {a.get_images()[0].norm.vmin for a in fig.axes if a.get_title().startswith(r"$|\hat v")}
    assert norms == {1.0 / n}, norms
    assert "1/N" in fig.get_suptitle()


def test_decay_lines_at_the_schedule(tiny: Run) -> None:
    fig = make_figure(tiny, "fig1e_lr_stability")
    ax = fig.axes[0]
    decays = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert [float(ln.get_xdata()[0]) for ln in decays] == [20.0]  # decay every 20, last step 39
    assert ax.get_yscale() == "log" and ax.get_xlabel() and ax.get_ylabel() and "1e" in fig.get_suptitle()
    assert "δ decay" in ax.get_legend_handles_labels()[1]


def test_energy_k_and_log_axes(tiny: Run) -> None:
    labels = make_figure(tiny, "fig3a_energy_y").axes[0].get_legend_handles_labels()[1]
    assert [lb for lb in labels if lb.startswith("k =")] == ["k = 1", "k = 2", "k = 5", "k = 10", "k = 20"]
    ax = make_figure(tiny, "fig2a_eigenvalues").axes[0]
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    assert make_figure(tiny, "fig7d_preservation").axes[0].get_xscale() == "log"


def test_residual_projections_sum_to_the_energy(tiny: Run) -> None:
    """Σ_{i≤k} ⟨v_i, m⟩² / ‖m‖² is the stored E_t(m_t, k)."""
    t = int(tiny.steps[-1])
    p = residual_projections(tiny, t)  # (K,)
    m = tiny.residual(t)
    np.testing.assert_allclose(np.cumsum(p) / (m @ m), tiny.energy("residual")[-1], rtol=1e-4, atol=1e-6)


def test_digits_run_skips_what_it_lacks(store_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = Client(store_url).run("digits")
    for name in NEEDS_EXTRAS:
        assert make_figure(run, name) is None, name
    # Fig. 4a needs no stored eigenvectors: ⟨v_i, m_t⟩² is stored at every step
    t = int(run.steps[-1])
    p, m = residual_projections(run, t), run.residual(t).reshape(run.N, -1)
    np.testing.assert_allclose(np.cumsum(p) / np.sum(m**2), run.energy("residual")[-1], rtol=1e-4, atol=1e-6)
    assert make_figure(run, "fig4a_residual_projections") is not None
    some = ("fig2a_eigenvalues", "fig3d_energy_df", "loss")
    with caplog.at_level("WARNING", logger="nsa_dist"):
        out = plot_run(run, tmp_path, figures=NEEDS_EXTRAS + some)
    assert [p.name for p in out] == [f"{n}.png" for n in some]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in out)
    # named and not drawn: said (it printed nothing and exited 0, the folder empty)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("not drawn:")]
    assert len(said) == 1 and all(n in said[0] for n in NEEDS_EXTRAS), said
    with pytest.raises(ValueError, match=r"no figure drawn: run 'digits.*' has no data for " + NEEDS_EXTRAS[0]):
        plot_run(run, tmp_path / "none", figures=NEEDS_EXTRAS)


def test_figures_subset(tiny: Run, tmp_path: Path) -> None:
    out = plot_run(tiny, tmp_path, figures=["loss", "fig1d_first_order"])
    assert [p.name for p in out] == ["loss.png", "fig1d_first_order.png"]
    assert plot_run(tiny, tmp_path / "one", figures="fig2c_flow_speed")[0].name == "fig2c_flow_speed.png"


def test_unknown_figure_lists_the_allowed(tiny: Run, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fig9z.*allowed: fig1abc_target_output_points, fig1d_first_order, .*loss"):
        plot_run(tiny, tmp_path, figures=["loss", "fig9z"])
    assert not tmp_path.joinpath("loss.png").exists()


def test_run_without_finished_step(store_url: str, tmp_path: Path) -> None:
    url = str(tmp_path / "empty.zarr")
    shutil.copytree(store_url, url)
    run_id = Client(url).run("tiny").id
    SpectrumStore(url).group(run_id)["done"][:] = False
    with pytest.raises(ValueError, match="no finished recorded step"):
        plot_run(Client(url).run(run_id), tmp_path / "figs")
    assert not (tmp_path / "figs").exists()


def test_import_does_not_load_matplotlib() -> None:
    code = "import sys, nsa_dist.plots; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


# ---------------------------------------------------------------- issue 11: chosen steps, pair, k list, Figs. 1a–c, 6
def test_chosen_steps_pair_and_k(tiny: Run, tmp_path: Path) -> None:
    from nsa_dist.plots import PlotOptions

    opts = PlotOptions(steps=(10, 30), pair=(10, 30), ks=(1, 3, 7))
    labels = make_figure(tiny, "fig4a_residual_projections", opts).axes[0].get_legend_handles_labels()[1]
    assert labels == ["t = 10", "t = 30"]
    fig = make_figure(tiny, "fig4bc_residual_fourier", opts)
    assert [a.get_title() for a in fig.axes if a.get_title().startswith("residual")] == [
        "residual $m_t$, t = 10",
        "residual $m_t$, t = 30",
    ]
    labels = make_figure(tiny, "fig3a_energy_y", opts).axes[0].get_legend_handles_labels()[1]
    assert [lb for lb in labels if lb.startswith("k =")] == ["k = 1", "k = 3", "k = 7"]
    ax = make_figure(tiny, "fig7d_preservation", opts).axes[0]
    assert ax.get_title() == "$t_1$ = 10, $t_2$ = 30"
    assert ax.get_legend_handles_labels()[1] == ["i = 1", "i = 3", "i = 7"]
    P, _, _, _ = tiny.spectrum_preservation(10, 30, [3])
    np.testing.assert_allclose(ax.get_lines()[1].get_ydata(), P[0])
    assert "t = 10" in make_figure(tiny, "fig6_eigenvectors_early", opts).get_suptitle()
    assert "t = 30" in make_figure(tiny, "fig1abc_target_output_points", opts).axes[1].get_title()
    with pytest.raises(
        ValueError, match=r"step\(s\) \[11\] are not finished recorded steps.*finished: \[0, 10, 20, 30, 39\]"
    ):
        plot_run(tiny, tmp_path, opts=PlotOptions(steps=(11,)))
    with pytest.raises(
        ValueError, match=r"step\(s\) \[11, 12\] are not"
    ):  # each once ([11, 12, 11, 12]: a walk-through)
        plot_run(tiny, tmp_path, opts=PlotOptions(steps=(11, 12), pair=(11, 12)))


def test_fig1abc_shows_target_and_output(tiny: Run) -> None:
    fig = make_figure(tiny, "fig1abc_target_output_points")
    panels = {ax.get_title()[:3]: ax for ax in fig.axes if ax.get_title().startswith("(")}
    assert sorted(panels) == ["(a)", "(b)", "(c)"]
    np.testing.assert_allclose(panels["(a)"].collections[0].get_array(), tiny.y)
    np.testing.assert_allclose(panels["(b)"].collections[0].get_array(), tiny.outputs(int(tiny.steps[-1])))
    # the points over the picture's own coordinates (the loader's standardisation undone): [0, 1]², as Figs. 4–6
    m = tiny.data_meta
    picture = np.asarray(tiny.X) * np.asarray(m["x_std"]) + np.asarray(m["x_mean"])
    np.testing.assert_allclose(panels["(c)"].collections[0].get_offsets(), picture)
    assert picture.min() >= -1e-9 and picture.max() <= 1 + 1e-9, (picture.min(), picture.max())


def test_fig4a_many_indices_draws_points_and_their_binned_means(tiny: Run, monkeypatch) -> None:
    """Past a few dozen indices Fig. 4a's joined points drew a solid band across decades (an audit
    looked at it: unreadable at K = 400): each ⟨v_i, m_t⟩² is a point, and a line joins their means
    over runs of consecutive i."""
    from nsa_dist.plots import projections
    from nsa_dist.plots.projections import residual_projections

    monkeypatch.setattr(projections, "_JOINED", 5)
    monkeypatch.setattr(projections, "_BINS", 4)
    ax = make_figure(tiny, "fig4a_residual_projections").axes[0]
    t = int(tiny.steps[-1])
    p = residual_projections(tiny, t)
    assert len(p) == 20
    lines = [ln for ln in ax.get_lines() if len(ln.get_xdata()) and ln.get_transform() == ax.transData]
    points = [ln for ln in lines if ln.get_linestyle() == "None" and len(ln.get_xdata()) == 20]
    means = [ln for ln in lines if ln.get_label() == f"t = {t}"]
    assert len(points) == 2 and len(means) == 1, [(ln.get_label(), ln.get_linestyle()) for ln in lines]
    np.testing.assert_allclose(np.asarray(points[1].get_ydata(), float), np.where(p > 0, p, np.nan))
    np.testing.assert_allclose(means[0].get_xdata(), [3.0, 8.0, 13.0, 18.0])
    np.testing.assert_allclose(means[0].get_ydata(), p.reshape(4, 5).mean(axis=1), rtol=1e-12)
    labels = ax.get_legend_handles_labels()[1]
    assert "each i (points)" in labels and "mean over 4 bins of i (lines)" in labels, labels


def test_fig1abc_tells_nce_data_from_noise_points(nce_run: Run, tiny: Run) -> None:
    """An NCE run's training points are data samples (first, N // (1 + ν)) and noise samples: panel
    (c) draws them apart and says how many of each (drawn alike, they were one cloud)."""
    fig = make_figure(nce_run, "fig1abc_target_output_points")
    c = next(ax for ax in fig.axes if ax.get_title().startswith("(c)"))
    assert "20 data, 20 noise" in c.get_title(), c.get_title()
    m = nce_run.data_meta
    X = np.asarray(nce_run.X, np.float64)
    picture = X * np.asarray(m["x_std"]) + np.asarray(m["x_mean"]) if m.get("x_std") is not None else X
    by_label = {col.get_label(): col.get_offsets() for col in c.collections}
    np.testing.assert_allclose(by_label["data (p)"], picture[:20])
    np.testing.assert_allclose(by_label["noise (q)"], picture[20:])
    c = next(ax for ax in make_figure(tiny, "fig1abc_target_output_points").axes if ax.get_title().startswith("(c)"))
    assert len(c.collections) == 1 and "noise" not in c.get_title()  # an L2 run's points: one kind


def test_gd_formula_note() -> None:
    from types import SimpleNamespace

    from nsa_dist.plots.axes import gd_note

    gd = ExperimentSpec()
    assert gd_note(SimpleNamespace(spec=gd)) is None
    mom = ExperimentSpec(optimizer={"name": "gd", "momentum": 0.9})
    assert "GD with momentum 0.9" in gd_note(SimpleNamespace(spec=mom))
    nce = ExperimentSpec(loss="nce", data={"name": "density2d", "n": 64})
    assert "8N/λ_max" in gd_note(SimpleNamespace(spec=nce))
    adam = ExperimentSpec(data={"n": 64}, optimizer={"name": "adam", "batch_size": 16})
    note = gd_note(SimpleNamespace(spec=adam))
    assert "Adam" in note and "formulas of full-batch GD" in note, note
    custom = SimpleNamespace(loss="l2", optimizer=SimpleNamespace(name="custom", momentum=0.0, batch_size=None))
    note = gd_note(SimpleNamespace(spec=custom))  # a Tracker's own loop was said to "use GD"
    assert "training loop of its own" in note and "uses GD" not in note, note


# ---------------------------------------------------------------- right by default: every figure readable
@pytest.fixture(scope="module")
def sweep_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A sweep of N = 10 points, 2 widths × 2 seeds, whose runs record every Hessian quantity (limits of
    I and S, density, Rayleigh, additivity) and test points: every sweep figure and Hessian figure."""
    from nsa_dist.config import SweepSpec
    from nsa_dist.pipeline import run_id

    url = str(tmp_path_factory.mktemp("sweep") / "s.zarr")
    store = SpectrumStore(url)
    sweep = SweepSpec(
        name="hw",
        base={
            "data": {"n": 10, "n_test": 4},
            "steps": 4,
            "record": {"every": 2},
            "model": {"depth": 2, "init": "ntk", "activation": "atan"},
            "schedule": {"lr": 0.5},
            "spectrum": {"k": "all", "images": []},
            "hessian": {"every": 2, "probes": 8, "rayleigh_k": 3, "top_k": 1, "density_grid": 32, "lanczos_steps": 8},
        },
        grid={"model.width": [3, 6], "seed": [0, 1]},
    )
    ids = []
    for spec in sweep.expand():
        assert run_experiment(spec, store).status == "done"
        ids.append(run_id(spec))
    store.record_sweep(sweep.name, sweep.model_dump(mode="json"), ids)
    return url


@pytest.fixture(scope="module")
def nce_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A small NCE run on 2-D density data with test points and eigenvector images."""
    url = str(tmp_path_factory.mktemp("nce") / "s.zarr")
    spec = ExperimentSpec(
        name="nce",
        loss="nce",
        data={"name": "density2d", "n": 40, "n_test": 12},
        model={"depth": 2, "width": 16},
        steps=10,
        record={"every": 5},
        schedule={"lr": 1.0},
        spectrum={"k": 12, "images": [1, 2], "test_points": True},
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    return Client(url).run("nce")


def _drawn_ticklabels(axis) -> list:
    """The major tick labels an axis draws (its locator's ticks inside the view, with text)."""
    lo, hi = sorted(axis.get_view_interval())
    return [
        lb
        for loc, lb in zip(axis.get_majorticklocs(), axis.get_majorticklabels())
        if lo - 1e-12 * (abs(lo) + abs(hi)) <= loc <= hi + 1e-12 * (abs(lo) + abs(hi)) and lb.get_text()
    ]


def layout_problems(fig) -> list[str]:
    """What of ``fig``'s text lies outside its canvas (suptitle, figure texts, axes titles, axis labels
    and tick labels, legends), legends of more than ~10 entries and overlapping tick labels — each
    named with its text and pixel box."""
    from nsa_dist.plots.axes import MAX_LEGEND

    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    W, H = fig.bbox.width, fig.bbox.height
    items = [(f"figure text {t.get_text()[:60]!r}", t) for t in fig.texts]
    for i, ax in enumerate(fig.axes):
        if not ax.axison:
            continue
        items += [(f"axes {i} title {t.get_text()[:40]!r}", t) for t in (ax.title, ax._left_title, ax._right_title)]
        items += [
            (f"axes {i} {n} axis (label {a.label.get_text()[:30]!r})", a) for n, a in (("x", ax.xaxis), ("y", ax.yaxis))
        ]
        if ax.get_legend() is not None:
            items.append((f"axes {i} legend", ax.get_legend()))
    out = []
    for what, a in items:
        if not a.get_visible() or (hasattr(a, "get_text") and not a.get_text()):
            continue
        b = a.get_window_extent(r) if hasattr(a, "get_text") else a.get_tightbbox(r)
        if b is not None and (b.x0 < -0.5 or b.y0 < -0.5 or b.x1 > W + 0.5 or b.y1 > H + 0.5):
            out.append(f"{what} at [{b.x0:.0f}, {b.y0:.0f}, {b.x1:.0f}, {b.y1:.0f}] outside {W:.0f}×{H:.0f}")
    for i, ax in enumerate(fig.axes):
        legend = ax.get_legend()
        if legend is not None and len(legend.texts) > MAX_LEGEND:
            out.append(f"axes {i} legend has {len(legend.texts)} entries > {MAX_LEGEND}")
        if not ax.axison:
            continue
        for n, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            boxes = [(lb.get_window_extent(r), lb.get_text()) for lb in _drawn_ticklabels(axis)]
            boxes.sort(key=lambda bt: bt[0].x0 if n == "x" else bt[0].y0)
            for (b1, t1), (b2, t2) in zip(boxes, boxes[1:]):
                if b1.overlaps(b2) and (b1.x1 - b2.x0 > 1 if n == "x" else b1.y1 - b2.y0 > 1):
                    out.append(f"axes {i} {n} tick labels {t1!r} and {t2!r} overlap")
    return out


def test_layout_problems_sees_what_is_outside() -> None:
    """The check itself: a title wider than its figure, a legend of 12 entries, labels drawn on each other."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3, 2))
    FigureCanvasAgg(fig)
    fig.suptitle("a title far wider than a figure three inches wide can show")
    ax = fig.subplots()
    for j in range(12):
        ax.plot([0, 1], [j, j], label=f"line {j}")
    ax.legend()
    ax.set_yticks([0, 0.01], ["label", "another"])
    got = layout_problems(fig)
    assert any("figure text 'a title far" in p for p in got), got
    assert any("12 entries" in p for p in got), got
    assert any("'label' and 'another' overlap" in p for p in got), got


_IMAGES = ("fig1abc_target_output_points", "fig4bc_residual_fourier", "fig5_eigenvectors", "fig6_eigenvectors_early")
_OPTS = (
    "fig2b_eigenvalues_t",
    "fig2d_lr_eigen",
    "fig3a_energy_y",
    "fig3d_energy_df",
    "fig4a_residual_projections",
    "fig4bc_residual_fourier",
    "eqs45_constant_gram",
    "fig7d_preservation",
)  # what follows --k / --step


def _every_figure(tiny: Run, nce: Run, sweep_url: str):
    """(where, name, figure) for every figure ``nsa plot`` and ``nsa plot --sweep`` draw: each run
    figure of the 2-D run (App. E/F, Eqs. 4–5, images), again with 20 k and every recorded step
    chosen, the NCE run's (its image figures are the 2-D run's code), a Hessian run's Hessian
    figures, and every sweep figure."""
    from nsa_dist.plots import PlotOptions
    from nsa_dist.plots.sweep import (
        _ALL,
        fig7a,
        fig7b,
        fig7c,
        hessian_moments_figure,
        regimes_figure,
        scalar_figure,
        width_convergence,
    )

    sweep = Client(sweep_url).sweep("hw")
    hess = sweep.run(sweep.groups()[0][1][0])
    many = PlotOptions(steps=tuple(int(t) for t in tiny.steps), ks=tuple(range(1, 21)))
    for where, run, names, opts in (
        ("2-D run", tiny, FIGURES, None),
        ("2-D run, 20 k", tiny, _OPTS, many),
        ("NCE run", nce, [n for n in FIGURES if n not in _IMAGES], None),
        ("Hessian run", hess, [n for n in FIGURES if n.startswith("hessian_")], None),
    ):
        for name in names:
            fig = make_figure(run, name, opts)
            if fig is not None:
                yield where, name, fig
    sweep_figs = {
        "fig7a_energy_y": fig7a(sweep),
        "fig7b_train_loss": fig7b(sweep),
        "fig7c_test_loss": fig7c(sweep),
        "scalar_energy_y_10": scalar_figure(sweep, "energy_y", "model.width", k=2),
        "hessian_width_convergence": width_convergence(sweep),
        "hessian_regimes": regimes_figure(sweep),
    }
    sweep_figs.update({f"hessian_moments_{p}": hessian_moments_figure(sweep, p) for p in "HIS"})
    assert set(sweep_figs) == set(_ALL), set(_ALL) ^ set(sweep_figs)
    for name, fig in sweep_figs.items():
        yield f"sweep {sweep.name}", name, fig


@pytest.mark.slow  # about 60 figures drawn: 15 s on a free core
def test_every_figure_keeps_its_text_inside_and_its_legends_short(tiny: Run, nce_run: Run, sweep_url: str) -> None:
    """Every figure ``nsa plot`` and ``nsa plot --sweep`` draw — NSA, NCE, App. E/F, Eqs. 4–5, the
    Hessian paper's, the sweep's — has every title, label, tick label and legend inside its canvas,
    no legend of more than ~10 entries and no tick labels drawn on each other."""
    drawn, bad = set(), []
    for where, name, fig in _every_figure(tiny, nce_run, sweep_url):
        drawn.add(name)
        bad += [f"{where} {name}: {p}" for p in layout_problems(fig)]
    assert drawn >= set(FIGURES), f"figures not drawn by any run: {sorted(set(FIGURES) - drawn)}"
    assert not bad, "\n".join(bad)


def test_fig7a_default_k_is_the_papers_fraction_of_n_below_n(sweep_url: str, tmp_path: Path) -> None:
    """On a sweep of N = 10 the default k is not min(400, K) = N (where every E is 1) but 400/10⁴ of N,
    at least 1 and below N; an explicit k is kept; ``nsa plot --sweep --scalar energy_y`` takes the
    same default (it needed --k before)."""
    from nsa_dist.cli import main
    from nsa_dist.plots.axes import energy_k, title_of
    from nsa_dist.plots.sweep import fig7a, plot_sweep

    sweep = Client(sweep_url).sweep("hw")
    n, K = sweep.smallest_n(), sweep.smallest_k()
    assert (n, K) == (10, 10), (n, K)
    k = energy_k(n, K)
    assert 1 <= k < n, k
    fig = fig7a(sweep)
    assert title_of(fig) == f"NSA Fig. 7a — label energy $E_t(y, {k})$", title_of(fig)
    curve = sweep.curves("energy_y", k)[0]
    np.testing.assert_allclose(fig.axes[0].get_lines()[0].get_ydata(), curve.mean)
    assert curve.mean.max() < 1 - 1e-3, f"E_t(y, {k}) is {curve.mean}: the default k draws a saturated curve"
    assert f"E_t(y, {n - 1})" in title_of(fig7a(sweep, n - 1))
    assert [p.stem for p in plot_sweep(sweep, tmp_path / "a", figures=["fig7a_energy_y"])] == ["fig7a_energy_y"]
    assert (
        main(
            [
                "plot",
                "--sweep",
                "hw",
                "--out",
                str(tmp_path / "b"),
                "--store",
                sweep_url,
                "--figures",
                "fig7a_energy_y",
                "--scalar",
                "energy_y",
                "--x",
                "model.width",
            ]
        )
        == 0
    )
    assert (tmp_path / "b" / "fig7a_energy_y.png").stat().st_size > 1000  # --scalar energy_y: k by default too
    assert (tmp_path / "b" / "scalar_energy_y.png").stat().st_size > 1000


def test_a_flat_curve_is_drawn_flat(sweep_url: str) -> None:
    """E(y, N) ≡ 1 (all of y in the N eigenvectors) drawn against the width: y-limits of a visible
    width around 1, not its rounding noise autoscaled to the axes' height; the same for any line flat
    to 3e-15 (which matplotlib alone would stretch over the whole height; it widens only spans ≤ 1e-15)."""
    from nsa_dist.plots.axes import FLAT_PAD, blank_figure
    from nsa_dist.plots.sweep import scalar_figure

    sweep = Client(sweep_url).sweep("hw")
    ax = scalar_figure(sweep, "energy_y", "model.width", k=sweep.smallest_n()).axes[0]
    ax.figure.canvas.draw()
    y = ax.get_lines()[0].get_ydata()
    np.testing.assert_allclose(y, 1.0, atol=1e-5)
    lo, hi = ax.get_ylim()
    assert lo < 1 < hi and hi - lo >= 2 * FLAT_PAD * 0.99, (lo, hi, y - 1)
    fig = blank_figure((4, 3))
    ax = fig.subplots()
    ax.plot([0, 1, 2, 3], 1 + np.array([0, 1e-15, -2e-15, 1e-15]))
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    assert (lo, hi) == pytest.approx((1 - FLAT_PAD, 1 + FLAT_PAD)), f"noise of 3e-15 drawn over y in [{lo}, {hi}]"
    ax.plot([0, 3], [1, 1.5])  # a real change keeps matplotlib's limits
    fig.canvas.draw()
    assert ax.get_ylim()[1] >= 1.5


def test_lr_is_drawn_as_steps_of_the_schedule(tiny: Run) -> None:
    """δ_t is piecewise constant (halved at t = 20): drawn as steps with corners at the decays, its
    values the recorded δ_t at the recorded steps, not a slope between recorded steps."""
    ax = make_figure(tiny, "fig1e_lr_stability").axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    lr = lines[r"$\delta_t$"]
    assert lr.get_drawstyle() == "steps-post", lr.get_drawstyle()
    np.testing.assert_array_equal(lr.get_xdata(), [0, 20, 39])
    np.testing.assert_allclose(lr.get_ydata(), [0.25, 0.125, 0.125])
    t, y = lr.get_xdata(), lr.get_ydata()
    at = [y[np.searchsorted(t, s, side="right") - 1] for s in tiny.steps]  # the step function at the recorded steps
    np.testing.assert_allclose(at, tiny.lr, rtol=1e-6, err_msg="δ_t drawn vs recorded")
    marks = [ln for ln in ax.get_lines() if ln.get_marker() == "o" and ln.get_color() == lr.get_color()]
    assert len(marks) == 1 and np.allclose(marks[0].get_ydata(), tiny.lr), "recorded δ_t as markers"


def test_fig4d_at_the_last_stored_step_unless_asked(tiny: Run) -> None:
    """Fig. 4d defaults to the last eigenvector step; with steps chosen (``--step 10 30``, as the README's
    paper command ``--step 20000 599999``) it shows the last chosen one, as the paper shows the end."""
    from nsa_dist.plots import PlotOptions
    from nsa_dist.plots.axes import title_of

    last = int(tiny.eigenvector_steps[-1])
    assert last == int(tiny.steps[-1]) == 39
    for opts, t in ((PlotOptions(), last), (PlotOptions(steps=(10, 30)), 30), (PlotOptions(steps=(20,)), 20)):
        fig = make_figure(tiny, "fig4d_reconstructions", opts)
        assert title_of(fig).endswith(f"t = {t}"), (opts, title_of(fig))
        img = fig.axes[0].get_images()[0].get_array()
        np.testing.assert_allclose(img, tiny.kernel.reconstructions(t)["images"][0], err_msg=f"t = {t}")


def test_fig7a_on_the_exact_route_has_a_point_bracket_and_no_hatch(sweep_url: str) -> None:
    """A sweep measured exactly (k: all, local): each grid point's mean E_t(y, k) carries the bracket
    lower = upper = mean, and Fig. 7a hatches nothing (the quadrature route's bracket would be hatched)."""
    from nsa_dist.plots.sweep import fig7a

    sweep = Client(sweep_url).sweep("hw")
    for cv in sweep.curves("energy_y", 2):
        assert cv.bracket is not None
        np.testing.assert_array_equal(cv.bracket[0], cv.mean)
        np.testing.assert_array_equal(cv.bracket[1], cv.mean)
    fig = fig7a(sweep, 2)
    assert not [c for c in fig.axes[0].collections if c.get_hatch()], "a hatched bracket on the exact route"
    assert "bracket (quadrature)" not in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_eigenvalues_a_log_axis_leaves_out_are_said(tmp_path: Path) -> None:
    """A G whose rank is below N = 24 (at most 13 parameters) stores its null space's λ at rounding
    level, some ≤ 0: Figs. 2a/2b (here and on the page) left them out as gaps without a word; each now
    says how many, at which i, how small."""
    from nsa_dist.serve._nsa_panels import Fig2a, Fig2b

    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(
        name="rank13",  # at most 13 parameters
        data={"n": 24},
        model={"depth": 1, "width": 3},
        steps=4,
        record={"every": 2},
        spectrum={"k": "all", "images": []},
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run("rank13")
    lam = np.asarray(run.eigenvalues, np.float64)
    assert (np.abs(lam[:, 13:]) < 1e-12 * lam[:, :1]).all(), lam  # the null space: rounding only
    drawn = np.arange(len(run.steps))  # ≤ 6 steps: Fig. 2a draws every one
    bad = lam[drawn] <= 0
    assert bad.any(), "no λ ≤ 0 to leave out: the run did not test what it should"
    i = np.nonzero(bad)[1] + 1
    said = f"log axis: {int(bad.sum())} value(s) λ_i ≤ 0 not drawn (i = {i.min()}…{i.max()}: "
    fig = make_figure(run, "fig2a_eigenvalues")
    assert said in fig._supxlabel.get_text().replace("\n", " "), fig._supxlabel.get_text()
    panel = Fig2a(run)
    assert said in panel.note_text(run), panel.note_text(run)
    rows = [k for k in (1, 2, 5, 10, 20) if k <= 24]  # Fig. 2b's i: 1, 2, 5, 10, 20, … ≤ N
    bad_b = lam[:, np.array(rows) - 1] <= 0
    fig = make_figure(run, "fig2b_eigenvalues_t")
    text = fig._supxlabel.get_text().replace("\n", " ")
    if bad_b.any():
        assert f"log axis: {int(bad_b.sum())} value(s) λ_i ≤ 0 not drawn (i = 20" in text, text
        assert f"log axis: {int(bad_b.sum())} value(s)" in Fig2b(run).note_text(run)
    else:
        assert "log axis" not in text and "log axis" not in Fig2b(run).note_text(run), text


def test_the_limit_at_initialisation_is_drawn_at_step_0(tmp_path: Path) -> None:
    """E[Tr S] at initialisation was drawn at the first analysed step (t = 4 here), as if it were
    that step's prediction, by `nsa plot` and on the page."""
    from nsa_dist.serve._hessian_panels import TraceS

    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(
        name="late",
        data={"n": 16},
        model={"depth": 2, "width": 8, "init": "ntk", "regime": "ntk", "activation": "tanh"},
        steps=8,
        record={"every": 2},
        spectrum={"k": 4, "images": []},
        hessian={"steps": [4, 6], "probes": 2, "rayleigh_k": 2, "top_k": 1},
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run("late")
    h0 = float(run.hessian.S_limit()["trace_S_init"][0])
    assert list(run.hessian.steps) == [4, 6] and np.isfinite(h0), (run.hessian.steps, h0)
    ax = make_figure(run, "hessian_trace_S").axes[0]
    (star,) = [ln for ln in ax.get_lines() if "at init" in ln.get_label()]
    assert list(star.get_xdata()) == [0] and list(star.get_ydata()) == [h0], (star.get_xdata(), star.get_ydata())
    (series,) = TraceS(run).series(run)
    (mark,) = [s for s in series if "at init" in s.label]
    assert list(mark.x) == [0] and list(mark.y) == [h0], (mark.x, mark.y)


def test_a_failed_runs_figures_say_so_and_draw_its_single_step(tmp_path: Path) -> None:
    """A run that diverged after one recorded step: only its loss figure said so, and the time plots
    drew its one step as nothing (a line of one point) on ticks 0.5 apart (an audit)."""
    from nsa_dist.plots.axes import title_of

    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(
        name="boom",
        data={"n": 48},
        model={"depth": 2, "width": 16},
        optimizer={"name": "gd"},
        schedule={"lr": 40.0},  # diverges within the first recorded interval
        steps=40,
        record={"every": 20},
        spectrum={"k": 5, "images": []},
    )
    out = run_experiment(spec, SpectrumStore(url))
    run = Client(url).run("boom")
    assert out.status == "failed" and len(run.steps) == 1, (out.status, run.steps)
    seen = 0
    for name in ("fig2b_eigenvalues_t", "fig3a_energy_y", "fig1d_first_order"):
        fig = make_figure(run, name, PlotOptions())
        readable(fig)
        lines = fig.get_suptitle().split("\n")
        assert "FAILED at t =" in " ".join(lines[1:]) and "diverged" in fig.get_suptitle(), fig.get_suptitle()
        assert "FAILED" not in title_of(fig), title_of(fig)  # the figure's own title is read back whole
        fig.canvas.draw()
        for ax in fig.axes:
            for line in ax.get_lines():
                x, y = (np.asarray(v, np.float64) for v in line.get_data())
                if line.get_transform() == ax.transData and (np.isfinite(x) & np.isfinite(y)).sum() == 1:
                    assert line.get_marker() not in ("None", "", None), f"{name}: a one-point line drawn as nothing"
                    seen += 1
            ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
            if ax.get_xscale() == "linear" and ax.get_lines():
                assert all(float(t).is_integer() for t in ticks), f"{name}: step ticks {ticks}"
    assert seen, "no one-point line was checked"


def test_a_reason_with_a_dollar_sign_is_drawn_as_text() -> None:
    """The reason under a failed run's title comes from the store (a user's exception message): one
    unbalanced $ made matplotlib parse mathtext and the figure's draw fail."""
    from types import SimpleNamespace

    from nsa_dist.plots.axes import new_figure

    run = SimpleNamespace(id="r", status="failed", failed_step=3, reason="the loader raised: cost $5 is odd", Ko=1)
    fig, _ = new_figure(run, "2b", "individual eigenvalues along t")
    fig.canvas.draw()  # raised ValueError (mathtext) before the escape
    assert "cost \\$5" in fig.get_suptitle(), fig.get_suptitle()
