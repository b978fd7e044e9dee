"""A step over more points than CHUNK_POINTS runs in pieces (bounded activations) and takes the
same step: the loss is a mean over points, so the pieces' weighted gradients sum to the whole's."""

from __future__ import annotations

import numpy as np
import pytest

import nsa_dist.pipeline.producers as spectral_mod
import nsa_dist.pipeline.trainer as trainer_mod
from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run

BASE = {
    "name": "pieces",
    "data": {"n": 50, "n_test": 6},
    "model": {"depth": 3, "width": 12},
    "steps": 5,
    "record": {"steps": [0, 2, 4]},
    "spectrum": {"k": 6, "images": [], "dtype": "float64"},
}
CASES = {
    "gd-mse": BASE,
    "sgd-batch-45": {**BASE, "optimizer": {"name": "sgd", "batch_size": 45, "momentum": 0.9}},
    "adam-cross-entropy": {
        **BASE,
        "data": {"name": "digits", "n": 50, "target": "onehot"},
        "model": {"depth": 2, "width": 12, "output_dim": 10},
        "loss": "cross_entropy",
        "optimizer": {"name": "adam"},
        "schedule": {"lr": 0.01},
    },
    "nce": {**BASE, "data": {"name": "gaussian_mixture", "n": 50}, "loss": "nce"},
}


def _record(spec: ExperimentSpec) -> tuple[list, Trainer]:
    data = load_dataset(spec.data, seed=spec.seed)
    plan = plan_run(spec, data)
    trainer, an = Trainer(plan, data), SpectralAnalyzer(plan, data)
    return [(ck, an.analyze(ck).arrays()) for ck in trainer.train_until(spec.steps)], trainer


@pytest.mark.parametrize("case", sorted(CASES))
def test_pieces_take_the_same_steps_as_the_whole_batch(case, monkeypatch):
    spec = ExperimentSpec.model_validate(CASES[case])
    whole, t_whole = _record(spec)
    assert t_whole._chunk is None  # 50 points: one piece
    monkeypatch.setattr(trainer_mod, "CHUNK_POINTS", 16)
    monkeypatch.setattr(spectral_mod, "CHUNK_POINTS", 16)
    pieces, t_pieces = _record(spec)
    assert t_pieces._chunk == 16 and len(t_pieces._pieces(None)) == 4
    for (ck_a, out_a), (ck_b, out_b) in zip(whole, pieces):
        for name in ("theta", "f", "df", "f_test"):
            a, b = getattr(ck_a, name), getattr(ck_b, name)
            assert a.shape == b.shape, (case, name)
            if not a.size:
                continue
            err = np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30)
            assert err < 1e-5, f"{case}: {name} at t = {ck_a.step} differs by {err:.2e} relative in pieces"
        assert ck_b.loss == pytest.approx(ck_a.loss, rel=1e-5), case
        for name in ("eigenvalues", "df_pred", "energy_y"):
            a, b = np.asarray(out_a[name], np.float64), np.asarray(out_b[name], np.float64)
            err = np.nanmax(np.abs(a - b)) / np.nanmax(np.abs(a))
            assert err < 1e-4, f"{case}: {name} at t = {ck_a.step} differs by {err:.2e} relative in pieces"


def test_a_model_that_couples_samples_takes_its_batch_whole(monkeypatch):
    monkeypatch.setattr(trainer_mod, "CHUNK_POINTS", 16)
    spec = ExperimentSpec.model_validate(
        {
            **BASE,
            "data": {"name": "digits", "n": 40},
            "model": {"factory": "user_models:inplace_resnet", "kwargs": {"channels": 2, "eval_bn": False}},
            "spectrum": {**BASE["spectrum"], "k": 4},
        }
    )
    data = load_dataset(spec.data, seed=spec.seed)
    trainer = Trainer(plan_run(spec, data), data)
    assert trainer._chunk is None and trainer._pieces(None) == [(None, 1.0)]
