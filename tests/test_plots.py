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
from nsa_dist.store import SpectrumStore

# figures a 2-D run with test points, images and eigenvectors has, and those a digits run lacks
NEEDS_EXTRAS = ("fig1abc_target_output_points", "fig3e_energy_f_test",
                "fig4bc_residual_fourier", "fig6_eigenvectors_early",
                "fig5_eigenvectors", "fig7d_preservation", "fig4d_reconstructions", "appF_gram_change")


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One store with a 2-D run (test points, lr halved at t = 20) and a digits run (d = 64, no eigenvectors)."""
    url = str(tmp_path_factory.mktemp("plots") / "s.zarr")
    store = SpectrumStore(url)
    tiny = ExperimentSpec(name="tiny", data={"n": 64, "n_test": 32}, model={"depth": 3, "width": 32}, steps=40,
                          record={"every": 10}, schedule={"decay": 0.5, "every": 20},
                          spectrum={"k": 20, "test_points": True, "gram_change_k": 3})
    digits = ExperimentSpec(name="digits", data={"name": "digits", "n": 32}, model={"depth": 2, "width": 16},
                            steps=6, record={"every": 5}, spectrum={"k": 10, "store_eigenvectors": False})
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


def test_digits_run_skips_what_it_lacks(store_url: str, tmp_path: Path) -> None:
    run = Client(store_url).run("digits")
    for name in NEEDS_EXTRAS:
        assert make_figure(run, name) is None, name
    # Fig. 4a needs no stored eigenvectors: ⟨v_i, m_t⟩² is stored at every step
    t = int(run.steps[-1])
    p, m = residual_projections(run, t), run.residual(t).reshape(run.N, -1)
    np.testing.assert_allclose(np.cumsum(p) / np.sum(m**2), run.energy("residual")[-1], rtol=1e-4, atol=1e-6)
    assert make_figure(run, "fig4a_residual_projections") is not None
    some = ("fig2a_eigenvalues", "fig3d_energy_df", "loss")
    out = plot_run(run, tmp_path, figures=NEEDS_EXTRAS + some)
    assert [p.name for p in out] == [f"{n}.png" for n in some]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in out)


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
    assert [a.get_title() for a in fig.axes if a.get_title().startswith("residual")] == \
        ["residual $m_t$, t = 10", "residual $m_t$, t = 30"]
    labels = make_figure(tiny, "fig3a_energy_y", opts).axes[0].get_legend_handles_labels()[1]
    assert [lb for lb in labels if lb.startswith("k =")] == ["k = 1", "k = 3", "k = 7"]
    ax = make_figure(tiny, "fig7d_preservation", opts).axes[0]
    assert ax.get_title() == "$t_1$ = 10, $t_2$ = 30" and ax.get_legend_handles_labels()[1] == ["i = 1", "i = 3", "i = 7"]
    P, _, _, _ = tiny.spectrum_preservation(10, 30, [3])
    np.testing.assert_allclose(ax.get_lines()[1].get_ydata(), P[0])
    assert "t = 10" in make_figure(tiny, "fig6_eigenvectors_early", opts).get_suptitle()
    assert "t = 30" in make_figure(tiny, "fig1abc_target_output_points", opts).axes[1].get_title()
    with pytest.raises(ValueError, match=r"step\(s\) \[11\] are not finished recorded steps.*finished: \[0, 10, 20, 30, 39\]"):
        plot_run(tiny, tmp_path, opts=PlotOptions(steps=(11,)))


def test_fig1abc_shows_target_and_output(tiny: Run) -> None:
    fig = make_figure(tiny, "fig1abc_target_output_points")
    panels = {ax.get_title()[:3]: ax for ax in fig.axes if ax.get_title().startswith("(")}
    assert sorted(panels) == ["(a)", "(b)", "(c)"]
    np.testing.assert_allclose(panels["(a)"].collections[0].get_array(), tiny.y)
    np.testing.assert_allclose(panels["(b)"].collections[0].get_array(), tiny.outputs(int(tiny.steps[-1])))
    np.testing.assert_allclose(panels["(c)"].collections[0].get_offsets(), tiny.X)


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
    assert "Adam" in gd_note(SimpleNamespace(spec=adam)) and "formulas of full-batch GD" in gd_note(SimpleNamespace(spec=adam))
