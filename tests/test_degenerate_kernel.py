"""A constant kernel (G = c·11ᵀ: every unit dead) has no centred alignment: every layout stores NaN
and says why (audit N: −8e-10 local, NaN on block_rows ×2 without a note, 0.325 on matrix_free)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run


@pytest.mark.parametrize("layout, workers", [("local", 1), ("block_rows", 2), ("block_rows", 3), ("matrix_free", 2)])
def test_a_constant_kernel_has_no_centred_alignment_in_any_layout(layout, workers):
    spec = ExperimentSpec.model_validate(
        {
            "name": "dead",
            "data": {"name": "digits", "n": 48},
            "steps": 4,
            "record": {"every": 2},
            "model": {"factory": "user_models:dead_residual"},
            "spectrum": {"dtype": "float64", "k": 8, "images": [], "layout": layout, "workers": workers},
        }
    )
    data = load_dataset(spec.data, seed=spec.seed)
    plan = plan_run(spec, data)
    ck = list(Trainer(plan, data).train_until(3))[1]
    out = SpectralAnalyzer(plan, data).analyze(ck).arrays()
    lam = np.asarray(out["eigenvalues"])
    assert lam[1] < 1e-10 * lam[0], f"not a constant kernel: λ = {lam[:3]}"
    assert np.isnan(out["alignment_centered"]), out["alignment_centered"]
    note = json.loads(str(out["step_notes"]))["alignment_centered"]
    assert "the centred Gram HGH is zero to" in note and "0/0" in note, note
    assert np.isfinite(out["alignment"])
