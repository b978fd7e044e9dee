"""The resolved NTK route: a run probes its network's forward pass once (``plan_run``), and every
Gram of the run — training, test, App. E's cross kernel, the gang's block features — is computed on
the plan's route without probing again, to the same numbers as a Gram that probes."""

from __future__ import annotations

import importlib
import pickle

import numpy as np
import pytest
import torch

from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.ntk import NTKMethod, NTKRoute, gram, resolve_route
from nsa_dist.ntk.blocks import block_features
from nsa_dist.ntk.kernel_change import cross_gram_times
from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run


@pytest.fixture
def probes(monkeypatch) -> list[int]:
    """Counts the forward-pass probes (:func:`nsa_dist.ntk._probe.plan_forward`, through the one
    name every NTK route decision calls it by), each call passed through unchanged."""
    calls: list[int] = []
    gram_module = importlib.import_module("nsa_dist.ntk.gram")  # the module (the package's `gram` is the function)
    real = gram_module.plan_forward

    def counted(model, x):
        calls.append(int(x.shape[0]))
        return real(model, x)

    monkeypatch.setattr(gram_module, "plan_forward", counted)
    return calls


def _spec(layout: str) -> ExperimentSpec:
    return ExperimentSpec.model_validate(
        {
            "name": f"route-{layout}",
            "seed": 0,
            "data": {"name": "image2d", "n": 48, "n_test": 20},
            "model": {"depth": 2, "width": 32},
            "steps": 4,
            "record": {"steps": [0, 1, 2, 3]},
            "spectrum": {
                "k": 8,
                "dtype": "float64",
                "test_points": True,
                "store_eigenvectors": [0, 2],
                "layout": layout,
                "workers": 2,
            },
        }
    )


@pytest.mark.parametrize("layout", ["local", "block_rows", "matrix_free"])
def test_one_probe_per_run(layout: str, probes: list[int]) -> None:
    """plan_run probes once; the trainer and the analyzer (its in-process gang included) over four
    recorded steps — training and test Grams, App. E's cross kernel at t0, stored eigenvectors —
    never again."""
    spec = _spec(layout)
    data = load_dataset(spec.data, seed=0)
    plan = plan_run(spec, data)
    assert len(probes) == 1, f"plan_run probed the forward pass {len(probes)} times"
    assert plan.layout.layout.value == layout and plan.ntk_route.method is NTKMethod.STRUCTURED
    an = SpectralAnalyzer(plan, data)
    results = [an.analyze(ck).arrays() for ck in Trainer(plan, data).train_until(spec.steps)]
    assert len(results) == 4 and "eigenvalues_test" in results[0] and "constant_gram_f_test" in results[0]
    assert plan.eigenvector_steps == (True, False, True, False)  # the plan's mask, as the store keeps it
    assert plan.static_arrays(data)["eigenvector_steps"].tolist() == list(plan.eigenvector_steps)
    assert [("eigenvectors" in r) for r in results] == list(plan.eigenvector_steps)
    assert len(probes) == 1, f"{len(probes) - 1} more probes over the run's 4 recorded steps (one per run expected)"


class _Unknown(torch.nn.Module):
    """A layer with no per-layer formula: its parameter takes per-sample Jacobians."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w)


class _OwnLinear(torch.nn.Linear):
    """A Linear of another class (same parameter names)."""


def _models() -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    conv = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 1)
    )
    bn = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)).train()
    x3 = torch.randn(10, 3)
    return {
        "structured": (mlp, x3),
        "per_layer": (conv, torch.randn(10, 1, 6, 6)),
        "jacobian": (_Unknown(), x3),
        "batch": (bn, x3),
    }


@pytest.mark.parametrize("name", ["structured", "per_layer", "jacobian", "batch"])
def test_route_given_gram_equals_probing_gram(name: str, probes: list[int]) -> None:
    """gram given the resolved route (also after a round trip through pickle, as a plan crosses Ray,
    and on the float64 copy the analysis makes) is bit for bit the probing gram, with no probe;
    so are the test Gram and the cross kernel at other points."""
    model, x = _models()[name]
    route = pickle.loads(pickle.dumps(resolve_route(model, x[:4])))
    assert route.method.value == name and len(probes) == 1
    xt = x[:7] + 0.1
    for dtype in (None, torch.float64):
        for a, b in ((x, None), (xt, None), (xt, x)):
            probes.clear()
            want = gram(model, a, b, dtype=dtype)
            assert len(probes) == 1
            got = gram(model, a, b, method=route, dtype=dtype)
            assert len(probes) == 1, "gram given a resolved route probed the forward pass"
            assert torch.equal(got, want), f"{name}: max |Δ| = {float((got - want).abs().max()):.2e}"
    if name != "batch":  # a coupling network has no block features (its kernel is the whole batch's)
        want = block_features(model, x, [(0, 5), (5, 10)], dtype=torch.float64)
        probes.clear()
        got = block_features(model, x, [(0, 5), (5, 10)], dtype=torch.float64, method=route)
        assert not probes
        for fw, fg in zip(want, got):
            assert all(np.array_equal(a, b) and np.array_equal(c, d) for (a, c), (b, d) in zip(fw, fg))
    V = np.random.default_rng(0).standard_normal((x.shape[0], 3))
    np.testing.assert_array_equal(
        cross_gram_times(model, xt, x, V, torch.float64, route), cross_gram_times(model, xt, x, V, torch.float64)
    )


def test_route_of_another_network_is_refused() -> None:
    """A route bound to a network it was not resolved for: one ValueError naming what differs."""
    models = _models()
    mlp, x = models["structured"]
    route = resolve_route(mlp, x)
    assert isinstance(route, NTKRoute) and route.layers and not route.coupled
    other = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2), torch.nn.Tanh())
    with pytest.raises(ValueError, match="resolved for another network"):
        gram(models["jacobian"][0], x, method=route)
    renamed = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), _OwnLinear(16, 2))
    with pytest.raises(ValueError, match=r"module '2' is a _OwnLinear, the route's a Linear"):
        gram(renamed, x, method=route)
    np.testing.assert_array_equal(gram(other, x, method=route).numpy(), gram(other, x).numpy())


def test_route_probed_in_other_modes_is_not_taken(probes: list[int]) -> None:
    """A route resolved with batch norm in eval mode (per-sample paths) handed a network since put in
    train mode (batch statistics couple the samples): gram probes again with the asked-for method
    and computes the batch kernel, the probing gram's numbers; back in eval mode the route holds."""
    torch.manual_seed(0)
    bn = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)).eval()
    x = torch.randn(10, 3)
    route = resolve_route(bn, x[:4])
    assert route.method is not NTKMethod.BATCH and route.asked is NTKMethod.AUTO
    bn.train()
    probes.clear()
    got = gram(bn, x, method=route, dtype=torch.float64)
    assert len(probes) == 1, "a route probed in eval mode was taken in train mode"
    np.testing.assert_array_equal(got.numpy(), gram(bn, x, dtype=torch.float64).numpy())
    assert resolve_route(bn, x[:4]).method is NTKMethod.BATCH
    bn.eval()
    probes.clear()
    np.testing.assert_array_equal(
        gram(bn, x, method=route, dtype=torch.float64).numpy(), gram(bn, x, dtype=torch.float64).numpy()
    )
    assert len(probes) == 1  # the probing call's only
