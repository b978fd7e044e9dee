"""The quadrature route's value inside each bracket does not hang on one ulp.  λ_k's estimate is a node
of the rules, and E(φ, k)'s value was the rules' weight at and above it: one ulp moved a whole node's
weight in or out, so the same run on 1 and on 2 BLAS threads stored curve_energy_y 0.045 apart (and a
gang layout against local 0.07; an audit), each inside its bracket, with status done."""

from __future__ import annotations

import numpy as np
import torch

from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec
from nsa_dist.pipeline import run_experiment
from nsa_dist.store import SpectrumStore

SPEC = {
    "name": "qt",
    "data": {"name": "digits", "n": 96, "target": "onehot"},
    "model": {"depth": 2, "width": 12},
    "loss": "cross_entropy",
    "steps": 2,
    "record": {"every": 1},
    "spectrum": {
        "dtype": "float64",
        "k": "all",
        "energy": "quadrature",
        "images": [],
        "quadrature": {"top": 4, "lanczos_steps": 8},
    },
}
CURVES = ("curve_energy_y", "curve_energy_residual", "curve_energy_f")


def test_the_same_run_on_one_and_two_threads_stores_the_same_values(tmp_path) -> None:
    before = torch.get_num_threads()
    out = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            url = str(tmp_path / f"t{threads}.zarr")
            assert run_experiment(ExperimentSpec.model_validate(SPEC), SpectrumStore(url)).status == "done"
            run = Client(url).run("qt")
            out[threads] = {n: np.asarray(run.g[n][...], np.float64) for n in CURVES}
    finally:
        torch.set_num_threads(before)
    for name in CURVES:
        diff = float(np.nanmax(np.abs(out[1][name] - out[2][name])))
        assert diff < 1e-9, f"{name}: the values on 1 and 2 threads differ by {diff:.3g}"
