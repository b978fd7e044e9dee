"""The RunPlan: built once per run, sized without a Trainer, the same for every role."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from nsa_dist.config import ExperimentSpec, Layout
from nsa_dist.data import Dataset, load_dataset
from nsa_dist.pipeline import RunPlan, SpectralAnalyzer, Trainer, plan_run, prepare_run, run_id
from nsa_dist.store import SpectrumStore

SPEC = dict(
    name="plan",
    seed=3,
    data={"name": "image2d", "n": 48, "n_test": 12},
    model={"depth": 3, "width": 16},
    steps=6,
    record={"every": 2},
    optimizer={"name": "adam"},
    schedule={"lr": 0.01},
    spectrum={"k": 8, "dtype": "float64", "test_points": True, "store_eigenvectors": True, "images": [1, 2]},
    hessian={"top_k": 3, "rayleigh_k": 2, "density": False},
)


def test_preparing_a_run_builds_no_trainer_and_no_analyzer(tmp_path, monkeypatch):
    """The store is sized from the plan alone (the sweep driver used to build both per run)."""

    def refuse(self, *a, **k):
        raise AssertionError(f"{type(self).__name__} was built to prepare a run")

    monkeypatch.setattr(Trainer, "__init__", refuse)
    monkeypatch.setattr(SpectralAnalyzer, "__init__", refuse)
    spec = ExperimentSpec(**SPEC)
    prep = prepare_run(spec, SpectrumStore(str(tmp_path / "s.zarr")))
    assert prep.run_id == run_id(spec) and prep.plan.dims == SpectrumStore(str(tmp_path / "s.zarr")).dims(prep.run_id)


def test_the_plan_holds_what_the_roles_would_compute(tmp_path):
    spec = ExperimentSpec(**SPEC)
    data = load_dataset(spec.data, seed=spec.seed)
    plan = plan_run(spec, data)
    trainer = Trainer(plan, data)
    d = plan.dims
    assert (d.N, d.M, d.d, d.K, d.k_test, d.S, d.T) == (48, 12, 2, 8, 8, len(spec.record_steps()), 6), d
    assert list(plan.record) == trainer.record == spec.record_steps()
    assert d.P == trainer.n_params and d.n_slots == len(trainer.slot_names) == 2
    assert d.rng_bytes == trainer.gen.get_state().numel()
    assert plan.image_indices == (1, 2) and d.n_images == 2
    assert plan.hessian_indices == frozenset(spec.hessian.indices(spec.record_steps()))
    assert plan.layout.layout is Layout.LOCAL and not plan.distributed and plan.torch_dtype is torch.float64
    static = plan.static_arrays(data)
    assert static["steps"].tolist() == spec.record_steps() and static["X"].shape == (48, 2)
    assert static["hessian_steps"].dtype == bool and len(static["hessian_steps"]) == d.S


def test_the_plan_crosses_process_boundaries_by_value():
    spec = ExperimentSpec(**SPEC)
    plan = plan_run(spec, load_dataset(spec.data, seed=spec.seed))
    back = pickle.loads(pickle.dumps(plan))
    assert back == plan and isinstance(back, RunPlan)
    assert len(pickle.dumps(plan)) < 20_000  # no arrays, no network: it travels with every gang call


def test_a_pinned_layout_replaces_the_planned_one():
    spec = ExperimentSpec(**SPEC)
    plan = plan_run(spec, load_dataset(spec.data, seed=spec.seed))
    pinned = plan.with_layout("block_rows", "recorded with the run")
    assert pinned.distributed and pinned.layout.reason == "recorded with the run"
    assert plan.layout.layout is Layout.LOCAL  # frozen: the original is unchanged
    with pytest.raises(ValueError):
        plan.with_layout("tiles", "no such layout")


def test_a_tracked_run_is_planned_from_the_users_network():
    from nsa_dist.pipeline.tracked import tracked_spec

    net = torch.nn.Sequential(torch.nn.Linear(3, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    X = np.random.default_rng(0).standard_normal((20, 3))
    data = Dataset(X, X[:, :2], X[5:10], X[5:10, :2])
    spec = tracked_spec(
        "mine",
        net,
        data,
        2,
        steps=4,
        record={"every": 1},
        spectrum={"k": 5},
        hessian=None,
        optimizer="custom",
        seed=0,
        device="cpu",
    )
    plan = plan_run(spec, data, net)
    assert plan.run_id == "mine" and plan.dims.n_slots == 0 and plan.dims.rng_bytes == 1
    assert plan.dims.P == sum(p.numel() for p in net.parameters()) and plan.dims.Ko == 2


def test_step_results_and_sizes_read_back_by_their_stored_names():
    """A step read back by array name lands in its records; a name no record has is refused by
    name; sizes stored under the old short names (Kt, Hm, …) read as the named fields."""
    from nsa_dist.store import RunDims, StepResult

    r = StepResult.from_arrays({"eigenvalues": np.ones(3), "loss_test": 0.5, "hessian_products": 7})
    assert r.gram.eigenvalues.tolist() == [1.0] * 3 and r.extras.loss_test == 0.5
    assert r.hessian.hessian_products == 7 and r.images is None
    assert set(r.arrays()) == {"eigenvalues", "loss_test", "hessian_products"}
    with pytest.raises(ValueError, match="not arrays of a step result: energy_yy"):
        StepResult.from_arrays({"energy_yy": np.ones(3)})
    old = dict(
        N=4,
        M=0,
        d=2,
        Ko=1,
        P=9,
        S=2,
        T=4,
        K=3,
        Kt=0,
        nI=0,
        R=0,
        F=0,
        n_slots=0,
        L=1,
        store_eigenvectors=False,
        hessian=True,
        Hk=2,
        Hm=False,
        Cg=True,
    )
    D = RunDims.from_json(old)
    assert (D.hessian_top_k, D.hessian_moments, D.constant_gram, D.rng_bytes) == (2, False, True, 1)
    assert RunDims.from_json(D.to_json()) == D


def test_chosen_images_beyond_the_kept_eigenpairs_are_named_once(caplog) -> None:
    """spectrum.images beyond K (a gang layout's quadrature.top, chosen by layout: auto) are not drawn,
    and the run says so once (a new user's trial: [1, 50, 150] stored image 1 only, silently); the
    default list, meant as "those ≤ K", says nothing."""
    import logging

    base = {"data": {"n": 200}, "model": {"depth": 2, "width": 8}, "steps": 2}
    spectrum = {"k": "all", "layout": "auto", "memory_budget_gb": 0.0001, "workers": 2, "quadrature": {"top": 10}}
    spec = ExperimentSpec.model_validate({**base, "name": "img", "spectrum": {**spectrum, "images": [1, 50, 150]}})
    with caplog.at_level(logging.WARNING, logger="nsa_dist"):
        for _ in range(2):
            plan = plan_run(spec, load_dataset(spec.data, seed=0))
    assert plan.K == 10 and plan.dims.n_images == 1
    said = [r.getMessage() for r in caplog.records if "spectrum.images" in r.getMessage()]
    assert len(said) == 1 and "[50, 150]" in said[0] and "K = 10" in said[0], said
    caplog.clear()
    quiet = ExperimentSpec.model_validate({**base, "name": "img2", "spectrum": spectrum})
    with caplog.at_level(logging.WARNING, logger="nsa_dist"):
        plan_run(quiet, load_dataset(quiet.data, seed=0))
    assert not [r for r in caplog.records if "spectrum.images" in r.getMessage()]
