"""The figures' layout in display coordinates: a legend hides no data point of its axes, a footnote (the
quadrature route's bracket caption, the eigenvector figures' top-K note) takes at most a fifth of the
figure's height, and no text runs past the figure's edge."""

from __future__ import annotations

import numpy as np
import pytest

from nsa_dist.client import Client, Run
from nsa_dist.config import ExperimentSpec
from nsa_dist.pipeline import run_experiment
from nsa_dist.plots import make_figure
from nsa_dist.store import SpectrumStore

# figures with a legend over the data or a footnote squeezing the axes before the legends moved outside
# and the quadrature footnotes were shortened
LEGENDS = ("fig2b_eigenvalues_t", "fig3a_energy_y", "fig3b_energy_f", "fig3c_energy_residual", "fig2d_lr_eigen")
FOOTNOTES = (
    "fig2a_eigenvalues",
    "fig2b_eigenvalues_t",
    "fig3a_energy_y",
    "fig3c_energy_residual",
    "fig3d_energy_df",
    "energy_against_k",
    "fig4a_residual_projections",
    "fig7d_preservation",
    "eqs45_constant_gram",
)


@pytest.fixture(scope="module")
def quad(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A run on the quadrature route (top 6 exact, N = 120), lr halved at t = 3: bands, notes, legends."""
    url = str(tmp_path_factory.mktemp("layout") / "q.zarr")
    spec = ExperimentSpec.model_validate(
        {
            "name": "q",
            "data": {"n": 120},
            "model": {"depth": 2, "width": 16},
            "steps": 6,
            "record": {"every": 2},
            "schedule": {"decay": 0.5, "every": 3},
            "spectrum": {
                "k": "all",
                "energy": "quadrature",
                "images": [],
                "quadrature": {"top": 6, "lanczos_steps": 8, "probes": 4, "curve_points": 12, "block_size": 4},
            },
        }
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    return Client(url).run("q")


def points_under_legends(fig) -> list[str]:
    """Each axes' data points (its lines' vertices, via their transform: ax.transData for data lines)
    that fall inside the window extent of that axes' legend."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    out = []
    for i, ax in enumerate(fig.axes):
        leg = ax.get_legend()
        if leg is None or not leg.get_visible():
            continue
        box = leg.get_window_extent(r)
        for ln in ax.get_lines():
            xy = np.column_stack([ln.get_xdata(orig=False), ln.get_ydata(orig=False)]).astype(np.float64)
            if not len(xy):
                continue
            d = ln.get_transform().transform(xy)
            d = d[np.isfinite(d).all(axis=1)]
            inside = (d[:, 0] >= box.x0) & (d[:, 0] <= box.x1) & (d[:, 1] >= box.y0) & (d[:, 1] <= box.y1)
            if inside.any():
                out.append(f"axes {i}: {int(inside.sum())} point(s) of {ln.get_label()!r} under the legend {box}")
    return out


def text_problems(fig, most: float = 0.2) -> list[str]:
    """Figure texts (footnotes, the suptitle) taller than ``most`` of the figure or past its edge, and any
    axes' text past the edge."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    W, H = fig.bbox.width, fig.bbox.height
    out = []
    texts = [(t, True) for t in fig.texts] + [(t, False) for ax in fig.axes for t in ax.texts]
    texts += [(t, False) for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    for t, own in texts:
        if not t.get_visible() or not t.get_text():
            continue
        b = t.get_window_extent(r)
        what = repr(t.get_text()[:50])
        if own and t is not fig._suptitle and b.height > most * H:
            out.append(f"{what} is {b.height / H:.0%} of the figure's height")
        if b.x0 < -0.5 or b.y0 < -0.5 or b.x1 > W + 0.5 or b.y1 > H + 0.5:
            out.append(f"{what} at [{b.x0:.0f}, {b.y0:.0f}, {b.x1:.0f}, {b.y1:.0f}] outside {W:.0f}×{H:.0f}")
    return out


@pytest.mark.parametrize("name", LEGENDS)
def test_a_legend_hides_no_data_point(quad: Run, name: str) -> None:
    fig = make_figure(quad, name)
    assert fig is not None and fig.axes[0].get_legend() is not None, name
    assert not points_under_legends(fig), (name, points_under_legends(fig))


@pytest.mark.parametrize("name", FOOTNOTES)
def test_a_footnote_is_small_and_inside(quad: Run, name: str) -> None:
    fig = make_figure(quad, name)
    assert fig is not None, name
    notes = [t for t in fig.texts if t.get_text().startswith("quadrature route")]
    assert notes, (name, [t.get_text()[:40] for t in fig.texts])  # the note is still there, saying the route
    assert not text_problems(fig), (name, text_problems(fig))


def test_the_checks_see_a_legend_over_data_and_a_tall_footnote() -> None:
    from nsa_dist.plots.axes import blank_figure

    fig = blank_figure((4, 3))
    ax = fig.subplots()
    ax.plot(*np.meshgrid(np.linspace(0, 1, 9), np.linspace(0, 1, 9)), "o", color="C0")  # points everywhere
    ax.plot([], [], "o", label="under")
    ax.legend(loc="upper right")
    fig.supxlabel("\n".join(["a footnote line"] * 12), fontsize=7)
    assert points_under_legends(fig)
    assert any("height" in p for p in text_problems(fig))


def test_a_figures_notes_go_one_under_the_other():
    """The GD-formula note, the density note and App. F's kink note were placed at the figure's
    bottom-left corner apart from the bracket caption: two of them overlapped on one figure (a
    quadrature run trained with Adam).  Every note is now a line of the one footnote."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from nsa_dist.plots.axes import footnote

    fig = Figure(figsize=(6, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1])
    ax.set_xlabel("step t")
    footnote(fig, "quadrature route: k ≤ 8 exact; shaded band = bracket")
    footnote(fig, "δ_t and 2N/λ_max are formulas of full-batch GD; this run used Adam", color="crimson")
    fig.canvas.draw()
    assert fig.get_supxlabel().split("\n") == [
        "quadrature route: k ≤ 8 exact; shaded band = bracket",
        "δ_t and 2N/λ_max are formulas of full-batch GD; this run used Adam",
    ]
    assert fig._supxlabel.get_color() == "crimson"  # a warning among the notes: the footnote says so
    r = fig.canvas.get_renderer()
    note, label = fig._supxlabel.get_window_extent(r), ax.xaxis.label.get_window_extent(r)
    assert note.y1 <= label.y0 + 1, (note, label)  # under the x label, never over it


@pytest.mark.parametrize(
    "optimizer, says",
    [({"name": "gd"}, r"-(\delta_t/N) G_t \bar m_t"), ({"name": "adam"}, r"J_t \Delta\theta_t")],
    ids=["gd", "adam"],
)
def test_fig3d_says_which_differential_it_draws(tmp_path, optimizer: dict, says: str) -> None:
    """Fig. 3d's title gave the paper's −(δ_t/N) G_t m̄_t for every run; an Adam run's d f̄_t is
    J_t Δθ_t of the update made (84× off that formula, an audit of the papers' quantities)."""
    url = str(tmp_path / "o.zarr")
    spec = ExperimentSpec.model_validate(
        {
            "name": "o",
            "data": {"n": 16},
            "model": {"depth": 2, "width": 8},
            "steps": 2,
            "optimizer": optimizer,
            "record": {"every": 1},
            "spectrum": {"k": 4, "images": []},
        }  # fmt: skip
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    fig = make_figure(Client(url).run("o"), "fig3d_energy_df")
    titles = [t.get_text() for t in fig.texts] + [fig._suptitle.get_text() if fig._suptitle else ""]
    titles += [ax.get_title() for ax in fig.axes]
    assert any(says in t for t in titles), titles
    assert not text_problems(fig), text_problems(fig)
