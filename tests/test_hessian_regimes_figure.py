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
