"""What each face says beside the stored numbers (audit L: every number matched; these were the
words around them): a cross-entropy run's GD formulas carry their caveat, Figs. 2c-d say whose λ_i^t
they take, Fig. 3e is captioned with the test Gram's route, every class is exported, and a Hessian
density's log axis says what it leaves out."""

from __future__ import annotations

import numpy as np
import pytest

from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec
from nsa_dist.pipeline import run_experiment
from nsa_dist.store import SpectrumStore

CE = {
    "name": "ce",
    "data": {"name": "digits", "n": 60, "n_test": 24, "target": "onehot"},
    "model": {"depth": 2, "width": 16, "output_dim": 10},
    "loss": "cross_entropy",
    "schedule": {"lr": 0.5},
    "steps": 4,
    "record": {"steps": [0, 3]},
    "spectrum": {"k": "all", "test_points": True, "per_class_k": 5, "images": []},
    "hessian": {"probes": 4, "rayleigh_k": 2, "top_k": 2, "density": True},
}


@pytest.fixture(scope="module")
def ce_run(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("faces") / "s.zarr")
    assert run_experiment(ExperimentSpec.model_validate(CE), SpectrumStore(url)).status == "done"
    return Client(url).run("ce")


def _texts(fig) -> str:
    return " ".join(t.get_text() for t in fig.texts) + " " + " ".join(a.get_title() for a in fig.axes)


def test_a_cross_entropy_runs_gd_formulas_carry_their_caveat_and_whose_eigenvalues(ce_run):
    from nsa_dist.plots.registry import make_figure
    from nsa_dist.serve._nsa_panels import Fig2c

    for name in ("fig1e_lr_stability", "fig2c_flow_speed", "fig2d_lr_eigen"):
        text = _texts(make_figure(ce_run, name))
        assert "formulas of GD on the L2 loss" in text and "4N/λ_max" in text, (name, text)
    assert "full $NK{\\times}NK$ kernel" in _texts(make_figure(ce_run, "fig2c_flow_speed"))
    note = Fig2c(ce_run).note_text(ce_run)
    assert note.startswith("λ_i^t here are the full (N·Ko)×(N·Ko) kernel's") and "cross-entropy" in note, note


def test_fig3e_is_captioned_with_the_test_grams_own_size(ce_run):
    from nsa_dist.plots.registry import make_figure

    text = _texts(make_figure(ce_run, "fig3e_energy_f_test"))
    assert "every k = 1..M = 24 from the eigendecomposition of the test points' G_t" in text, text
    assert "N = 60" not in text, text


def test_every_class_is_exported(ce_run, tmp_path):
    from nsa_dist.export import scalar_sources

    tags = {s.tag for s in scalar_sources(ce_run) if s.array == "eigenvalues_per_class"}
    classes = {t.split("/")[1] for t in tags}
    assert classes == {f"output_{c}" for c in range(1, 11)}, sorted(classes)


def test_a_hessian_densitys_log_axis_says_what_it_leaves_out(ce_run):
    from nsa_dist.plots.axes import density_on_log_axis
    from nsa_dist.plots.registry import make_figure
    from nsa_dist.serve._hessian_panels import Density

    step = int(ce_run.hessian.steps[0])
    dens = ce_run.hessian.density(step)[1]
    drawn, hidden = density_on_log_axis(dens)
    low = dens <= 1e-8 * dens.max()
    assert hidden == int(low.sum()) and np.isnan(drawn[low]).all(), (hidden, int(low.sum()))
    np.testing.assert_array_equal(drawn[~low], dens[~low])  # the rest drawn as stored
    fig = make_figure(ce_run, "hessian_density")
    panel = Density(ce_run)
    assert hidden > 0, "this run's density has no values below the floor: the test says nothing"
    assert "are not drawn: gaps" in _texts(fig) and "are not drawn: gaps" in panel.note_text(ce_run)
    lines = [ln.get_ydata() for ln in fig.axes[0].get_lines()]
    assert all(np.nanmin(np.asarray(y, float)) > 0 for y in lines)


def test_fig1e_says_full_kernel_in_its_legend_without_a_tab(ce_run):
    """`" (full $NK{\\times}NK$ kernel)"` was not a raw string: its legend read "NK<tab>imes NK" (audit Y)."""
    from nsa_dist.plots.registry import make_figure

    labels = [t.get_text() for t in make_figure(ce_run, "fig1e_lr_stability").axes[0].get_legend().get_texts()]
    assert any("{\\times}" in label for label in labels) and not any("\t" in label for label in labels), labels


def test_the_served_fig1e_draws_the_schedule_not_a_slope_between_recorded_steps(tmp_path):
    """δ halved at t = 6 between the recorded steps 0 and 7 was drawn from 7 on, joined to step 0 by a
    slope (audit Y: a halving at 150 drawn at 231); the page now draws the schedule, as nsa plot does."""
    from nsa_dist.serve._nsa_panels import Fig1e

    spec = {
        "name": "lr",
        "data": {"n": 16},
        "model": {"depth": 2, "width": 6},
        "steps": 10,
        "record": {"steps": [0, 7, 9]},
        "schedule": {"lr": 0.2, "decay": 0.5, "every": 6},
        "spectrum": {"k": 4, "images": []},
    }
    url = str(tmp_path / "s.zarr")
    assert run_experiment(ExperimentSpec.model_validate(spec), SpectrumStore(url)).status == "done"
    run = Client(url).run("lr")
    stairs, recorded, _ = Fig1e(run).series(run)[0]
    x, y = np.asarray(stairs.x), np.asarray(stairs.y)
    assert set(y[x < 6]) == {0.2} and set(y[x > 6]) == {0.1}, (x, y)
    assert not recorded.line and recorded.x.tolist() == [0, 7, 9]


def test_a_multi_output_runs_figures_say_which_kernel_they_draw(ce_run):
    """Figs. 2a/2b/3 of a 10-output run drew the traced N×N Gram (λ_1 15,736) beside 1e/2c/2d's full
    NK×NK kernel (λ_max 3,041) without a word on which (audit Y)."""
    from nsa_dist.plots.registry import make_figure

    for name in ("fig2a_eigenvalues", "fig3a_energy_y"):
        assert "G_t: the N×N Gram Σ_a J_a J_aᵀ traced over its 10 outputs" in _texts(make_figure(ce_run, name)), name
    assert "traced over its" not in _texts(make_figure(ce_run, "fig2c_flow_speed"))


def test_fig1e_draws_no_schedule_for_a_run_whose_rate_is_unknown(tmp_path):
    """A Tracker run with groups at different rates stores δ_t NaN: the figure drew the spec's default
    schedule (0.25), a rate the loop never used (a review's repro)."""
    import torch

    from nsa_dist import Tracker
    from nsa_dist.plots.axes import lr_steps

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    X = torch.rand(10, 2, dtype=torch.float64)
    y = X.sum(1, keepdim=True)
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1}, {"params": model[2].parameters(), "lr": 0.01}])
    url = str(tmp_path / "t.zarr")
    tr = Tracker(url, "groups", model, X, y, steps=4, record={"every": 2}, spectrum={"k": 3}, hessian=None)
    for t in range(4):
        if tr.due(t):
            tr.record(t, lr=opt)
        opt.zero_grad()
        (0.5 * ((model(X) - y) ** 2).mean()).backward()
        opt.step()
    tr.close()
    run = Client(url).run("groups")
    assert np.isnan(run.lr).all()
    t, lr = lr_steps(run, int(run.steps[-1]))
    assert np.isnan(lr).all(), (t, lr)
