"""The Hessian paper's regimes figure draws the Hessian the paper compares: in the active regime
(output / √w, learning rate × w) "the scaling of the learning rate essentially multiplies the whole
Hessian by w", so its ‖S‖_op and ‖S‖_F are w times the stored loss Hessian's.  Drawn as stored, an
active ‖S‖_op the paper says should not vanish fell like w^(-1/2) (an audit of the paper's quantities)."""

from __future__ import annotations

import numpy as np

from nsa_dist.client import Client
from nsa_dist.config import SweepSpec
from nsa_dist.pipeline import run_experiment, run_id
from nsa_dist.plots.sweep import regimes_figure
from nsa_dist.store import SpectrumStore


def test_active_norms_are_of_w_times_the_loss_hessian(tmp_path) -> None:
    url = str(tmp_path / "r.zarr")
    store = SpectrumStore(url)
    sweep = SweepSpec(
        name="reg",
        base={
            "data": {"n": 8},
            "model": {"depth": 2, "activation": "softplus", "init": "ntk"},
            "steps": 1,
            "record": {"steps": [0]},
            "spectrum": {"k": 4, "images": [], "dtype": "float64"},
            "hessian": {"probes": 4, "rayleigh_k": 0, "top_k": 1, "density": False, "additivity": False},
        },
        grid={"model.width": [4, 16], "model.regime": ["ntk", "active"]},
    )
    ids = [run_experiment(s, store).run_id for s in sweep.expand()]
    assert ids == [run_id(s) for s in sweep.expand()]
    store.record_sweep("reg", sweep.model_dump(mode="json"), ids)
    sw = Client(url).sweep("reg")
    fig = regimes_figure(sw)
    for ax, name in zip(fig.axes[1:3], ("hessian_S_op", "hessian_S_fro")):
        stored = sw.scalar(name, None, 0).set_index(["model.regime", "model.width"])["value"]
        drawn = {c.get_label().split(":")[0]: c.lines[0].get_ydata() for c in ax.containers}
        np.testing.assert_allclose(drawn["regime=ntk"], [stored["ntk", 4], stored["ntk", 16]], rtol=1e-12)
        np.testing.assert_allclose(
            drawn["regime=active"], [4 * stored["active", 4], 16 * stored["active", 16]], rtol=1e-12, err_msg=name
        )
    ratio = fig.axes[0]
    assert all(np.isfinite(c.lines[0].get_ydata()).all() for c in ratio.containers)
    # the browser's sweep page draws the same numbers
    from nsa_dist.serve.sweep_page import Regimes

    panels = Regimes(sw).series((sw, 10, {}))
    for series, name in zip(panels[1:3], ("hessian_S_op", "hessian_S_fro")):
        stored = sw.scalar(name, None, 0).set_index(["model.regime", "model.width"])["value"]
        got = {s.label.split(":")[0]: np.asarray(s.y) for s in series}
        np.testing.assert_allclose(
            got["regime=active"], [4 * stored["active", 4], 16 * stored["active", 16]], rtol=1e-12
        )
        np.testing.assert_allclose(got["regime=ntk"], [stored["ntk", 4], stored["ntk", 16]], rtol=1e-12)


def test_width_axes_and_legends_leave_the_panels_readable(tmp_path) -> None:
    """A walk-through: the log width axis labelled its minor ticks ("2×10¹ 4×10¹ 6×10¹", overlapping),
    the regimes figure's legends at each panel's right squeezed the three panels to a third of their
    width, and the moments figure's one legend took the second panel's place.  Now the width axis is
    ticked at the widths, the regimes legends stand under their panels and the moments legend under
    the figure, none over a panel."""
    from nsa_dist.plots.sweep import hessian_moments_figure, width_convergence

    url = str(tmp_path / "w.zarr")
    store = SpectrumStore(url)
    sweep = SweepSpec(
        name="wid",
        base={
            "data": {"n": 6},
            "model": {"depth": 2, "activation": "softplus", "init": "ntk"},
            "steps": 2,
            "record": {"steps": [0, 1]},
            "spectrum": {"k": 3, "images": [], "dtype": "float64"},
            "hessian": {"probes": 2, "rayleigh_k": 0, "top_k": 1, "density": False, "additivity": False},
        },
        grid={"model.width": [4, 8, 16, 32]},
    )
    ids = [run_experiment(s, store).run_id for s in sweep.expand()]
    store.record_sweep("wid", sweep.model_dump(mode="json"), ids)
    sw = Client(url).sweep("wid")
    for fig in (regimes_figure(sw), width_convergence(sw, orders=(1,))):
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        for ax in fig.axes:
            major = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
            minor = [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()]
            assert major == ["4", "8", "16", "32"] and not minor, (major, minor)
    fig = regimes_figure(sw)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    for ax in fig.axes:
        leg, box = ax.get_legend(), ax.get_window_extent(r)
        assert leg is not None and leg.get_window_extent(r).y1 < box.y0, "a regimes legend not under its panel"
        label = ax.xaxis.label.get_window_extent(r)
        assert leg.get_window_extent(r).y1 <= label.y0 + 0.5, "a regimes legend over the x label"
    fig = hessian_moments_figure(sw, "S")
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    assert all(ax.get_legend() is None for ax in fig.axes) and len(fig.legends) == 1
    key = fig.legends[0].get_window_extent(r)
    assert all(key.y1 < ax.get_window_extent(r).y0 for ax in fig.axes), "the moments legend over a panel"
