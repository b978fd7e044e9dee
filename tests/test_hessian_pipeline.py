"""Hessian measurements recorded along training: store, client, plots, against dense float64 references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import functional_call, hessian
from torch.nn.utils import vector_to_parameters

from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.models import build_model
from nsa_dist.pipeline import run_experiment
from nsa_dist.plots import plot_run
from nsa_dist.store import SpectrumStore

# P = 25 parameters: 60 probes make Hutch++'s sketch span R^P, so its moments are exact
SPEC = dict(name="hess", data={"n": 24}, model={"depth": 2, "width": 6}, steps=16, record={"every": 5},
            spectrum={"k": 8, "images": []},
            hessian={"every": 2, "probes": 60, "rayleigh_k": 4, "top_k": 3, "density_grid": 64, "lanczos_steps": 24})


def _dense_parts(model, X, y):
    """Dense H (P, P) of C = (1/2N) Σ (f − y)² and its Gauss–Newton part I = Jᵀ J / N."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    names, shapes = list(params), [p.shape for p in params.values()]
    flat = torch.cat([p.reshape(-1) for p in params.values()])

    def unflat(v):
        out, o = {}, 0
        for n, s in zip(names, shapes):
            k = int(np.prod(s))
            out[n] = v[o:o + k].view(s)
            o += k
        return out

    loss = lambda v: 0.5 * ((functional_call(model, unflat(v), (X,)) - y) ** 2).mean()  # noqa: E731
    H = hessian(loss)(flat)
    J = torch.func.jacrev(lambda v: functional_call(model, unflat(v), (X,)))(flat)  # (N, P)
    I = J.T @ J / X.shape[0]
    return H.numpy(), I.numpy(), (H - I).numpy()


@pytest.fixture(scope="module")
def hess_run(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("h") / "s.zarr")
    spec = ExperimentSpec(**SPEC)
    out = run_experiment(spec, SpectrumStore(url))
    assert out.status == "done"
    return Client(url).run(out.run_id), spec


def test_recorded_hessian_quantities_match_dense_references(hess_run):
    run, spec = hess_run
    assert run.steps.tolist() == [0, 5, 10, 15]
    assert run.hessian_steps.tolist() == [0, 10, 15]
    data = load_dataset(spec.data, seed=spec.seed)
    model = build_model(spec.model, seed=spec.seed).double()
    X, y = torch.tensor(data.X, dtype=torch.float32).double(), torch.tensor(data.y)
    for j, t in enumerate(run.hessian_steps):
        i = int(np.flatnonzero(run.steps == t)[0])
        vector_to_parameters(torch.tensor(run.g["theta"][i], dtype=torch.float64), model.parameters())
        H, I, S = _dense_parts(model, X, y)
        for part, A in (("H", H), ("I", I), ("S", S)):
            ref = [np.trace(np.linalg.matrix_power(A, k)) for k in range(1, 5)]
            np.testing.assert_allclose(run.hessian_moments(part)["estimate"][j], ref, rtol=1e-8, atol=1e-10,
                                       err_msg=f"Tr({part}^k) at t={t}")
        np.testing.assert_allclose(run.hessian_moments("I_exact")["estimate"][j],
                                   [np.trace(np.linalg.matrix_power(I, k)) for k in range(1, 5)], rtol=1e-8)
        assert abs(np.trace(S)) < 1e-10 * np.abs(S).sum(), "Tr(S) = 0 for a piecewise-linear net with MSE"
        evals = {p: np.sort(np.linalg.eigvalsh(A))[::-1] for p, A in (("H", H), ("I", I), ("S", S))}
        for part in "HIS":
            np.testing.assert_allclose(run.hessian_top(part)[j], evals[part][:3], rtol=1e-7, atol=1e-10)
        R = run.hessian_rayleigh(int(t))
        np.testing.assert_allclose(R["I"][0], evals["I"][:4], rtol=1e-7, atol=1e-10)  # vᵀIv = λ(I) on I's eigvecs
        exact = np.linalg.norm(I @ S) / (np.linalg.norm(I) * np.linalg.norm(S))
        o = run.hessian_orthogonality
        assert abs(o["value"][j] - exact) <= 4 * o["stderr"][j] + 1e-12, (o["value"][j], exact, o["stderr"][j])
        grid, dens = run.hessian_density(int(t))
        assert abs(np.trapezoid(dens, grid) - 1) < 0.05
    np.testing.assert_allclose(run.edge_of_stability(), run.hessian_top("H")[:, 0] * run.lr[[0, 2, 3]] / 2)


def test_hessian_figures_and_unrecorded_steps(hess_run, tmp_path):
    run, _ = hess_run
    names = ["hessian_moments", "hessian_orthogonality", "hessian_fig2_rayleigh", "hessian_edge_of_stability",
             "hessian_density"]
    paths = plot_run(run, tmp_path, figures=names)
    assert [p.stem for p in paths] == names and all(p.stat().st_size > 10_000 for p in paths)
    with pytest.raises(KeyError, match="not a finished recorded step"):
        run.hessian_density(7)


def test_hessian_spec_errors():
    with pytest.raises(ValueError, match=r"hessian.steps \[7\] are not recorded steps"):
        ExperimentSpec(**{**SPEC, "hessian": {"steps": [0, 7]}})
    with pytest.raises(ValueError, match="probes"):
        ExperimentSpec(**{**SPEC, "hessian": {"probes": 0}})
    spec = ExperimentSpec(**{k: v for k, v in SPEC.items() if k != "hessian"})
    assert spec.hessian is None
