"""2-D inputs that are a picture's coordinates (``image2d``, ``density2d``) are drawn upright: the
picture's row i sits at x₂ = i/(H − 1) — its top row at x₂ = 0 — so every figure over (x₁, x₂) draws
x₂ downwards, as an image's rows run.  Was: x₂ upwards, every residual / eigenvector image and the
target of Fig. 1a upside down against the picture file (found by the data trial)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import finished_run, small_run_spec

from nsa_dist import Client, Tracker
from nsa_dist.data.image2d import image_function, load_image


@pytest.fixture(scope="module")
def picture_run(tmp_path_factory):
    url, rid = finished_run(tmp_path_factory, small_run_spec("pic"), "pic")
    return Client(url).run(rid)


def test_the_pictures_top_row_is_at_x2_zero():
    img = load_image()  # the bundled picture, row 0 its top row
    H, W = img.shape
    X = np.array([[0.5, 0.0], [0.5, 1.0]])
    got = image_function(img, X)
    np.testing.assert_allclose(
        got, [img[0, (W - 1) // 2 : W // 2 + 1].mean(), img[-1, (W - 1) // 2 : W // 2 + 1].mean()]
    )


def test_serve_draws_x2_downwards_on_a_pictures_spatial_figures(picture_run):
    from nsa_dist.serve.run_page import run_panels

    panels = {type(p).__name__: p for p in run_panels(picture_run)}
    eig = panels["Eigenvectors"]
    assert eig.vecs and all(v.fig.y_range.flipped for v in eig.vecs + eig.residual[:1]), "eigenvector images"
    assert not any(f.fig.y_range.flipped for f in eig.ffts + eig.residual[1:]), "|Fourier| keeps ξ₂ upwards"
    assert all(f.y_range.flipped for f in panels["Fig1abc"].figs), "Fig. 1a-c"
    assert "down" in panels["Fig1abc"].figs[0].yaxis.axis_label


def test_other_2d_inputs_keep_x2_upwards(tmp_path):
    from nsa_dist.serve.run_page import run_panels

    torch.manual_seed(0)
    X = torch.rand(24, 2)
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with Tracker(str(tmp_path / "s.zarr"), "arr", model, X, X.sum(1), steps=1, record={"every": 1}, device="cpu") as tr:
        tr.record(0, lr=0.1)
    run = Client(str(tmp_path / "s.zarr")).run("arr")
    panels = {type(p).__name__: p for p in run_panels(run)}
    assert "Fig1abc" in panels and not any(f.y_range.flipped for f in panels["Fig1abc"].figs)


def test_the_figures_draw_x2_downwards_on_a_pictures_spatial_panels(picture_run):
    import matplotlib.pyplot as plt

    from nsa_dist.plots.images import fig4bc, fig5
    from nsa_dist.plots.inputs import fig1abc

    for make in (fig1abc, fig4bc, fig5):
        fig = make(picture_run)
        spatial = [a for a in fig.axes if a.get_xlabel() == "$x_1$"]  # not the |Fourier| panels, not colour bars
        fourier = [a for a in fig.axes if a.get_xlabel() == r"$\xi_1$"]
        assert spatial and all(a.yaxis_inverted() for a in spatial), make.__name__
        assert not any(a.yaxis_inverted() for a in fourier), make.__name__
        if make is fig1abc:  # what the top of panel (a) shows is the picture's top row (x₂ = 0)
            lo, hi = spatial[0].get_ylim()
            assert lo > hi, (lo, hi)
        plt.close(fig)


def test_other_2d_inputs_keep_x2_upwards_in_the_figures(tmp_path):
    import matplotlib.pyplot as plt

    from nsa_dist.plots.inputs import fig1abc

    torch.manual_seed(0)
    X = torch.rand(24, 2)
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with Tracker(str(tmp_path / "s.zarr"), "arr", model, X, X.sum(1), steps=1, record={"every": 1}, device="cpu") as tr:
        tr.record(0, lr=0.1)
    fig = fig1abc(Client(str(tmp_path / "s.zarr")).run("arr"))
    assert not any(a.yaxis_inverted() for a in fig.axes)
    plt.close(fig)
