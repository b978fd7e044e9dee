"""The Tracker as researchers use it, against an independent float64 recomputation of each step."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from nsa_dist import Client, Tracker

T = 6


def _mlp(seed: int = 0, drop: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(3, 8), nn.Tanh()]
    if drop:
        layers.append(nn.Dropout(drop))
    return nn.Sequential(*layers, nn.Linear(8, 1))


def _data(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, generator=g), torch.randn(n, generator=g)


def _reference(model: nn.Module, X: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """θ, f and J of ``model`` (its modes as they are) in float64."""
    m = copy.deepcopy(model).double()
    params = {k: v.detach() for k, v in m.named_parameters()}
    J = jacrev(lambda p: functional_call(m, p, (X.double(),)).reshape(-1))(params)
    J = torch.cat([j.reshape(X.shape[0], -1) for j in J.values()], 1)
    with torch.no_grad():
        f = m(X.double()).reshape(-1)
    theta = torch.nn.utils.parameters_to_vector(m.parameters()).detach()
    return theta.numpy(), f.numpy(), J.numpy()


def test_update_of_a_step_is_measured_in_the_modes_of_that_step(tmp_path):
    """A dropout net recorded in eval mode and trained in train mode: Δf_t = f(θ_{t+1}) − f(θ_t) in
    step t's (eval) modes, not a dropout-noised forward of whatever mode the loop is in at t + 1."""
    X, y = _data()
    model = _mlp(drop=0.3).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    url = str(tmp_path / "s.zarr")
    tr = Tracker(url, "modes", model, X, y, steps=T, record={"every": 1}, spectrum={"k": 4}, device="cpu")
    snaps = {}
    for t in range(T):
        model.train()
        if tr.due(t):
            model.eval()
            snaps[t] = copy.deepcopy(model)
            tr.record(t, lr=0.1)
            model.train()
        opt.zero_grad()
        (0.5 * ((model(X).squeeze(-1) - y) ** 2).mean()).backward()
        opt.step()
    assert model.training  # the loop's own mode is left alone
    model.eval()
    tr.close()
    snaps[T] = copy.deepcopy(model)
    run = Client(url).run("modes")
    g, steps = run.g, [int(s) for s in run.g["steps"][:]]
    assert steps == list(range(T))
    for i, t in enumerate(steps):
        th, f, J = _reference(snaps[t], X)
        th1, f1, _ = _reference(snaps[t + 1], X)
        np.testing.assert_allclose(g["f"][i].reshape(-1), f, atol=1e-5)
        np.testing.assert_allclose(g["df"][i].reshape(-1), f1 - f, atol=1e-5)
        np.testing.assert_allclose(g["df_pred"][i].reshape(-1), J @ (th1 - th), atol=1e-5)
        ev = np.sort(np.linalg.eigvalsh(J @ J.T))[::-1][:4]
        np.testing.assert_allclose(g["eigenvalues"][i][:4], ev, rtol=1e-4)


def test_crash_in_the_loop_keeps_the_last_recorded_step(tmp_path):
    """``record(t)`` returned, then the loop raised before step t + 1: step t (θ_t taken whole) is
    stored, its update NaN, the run ``interrupted``, and a reopened Tracker resumes from t."""
    X, y = _data()
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    url = str(tmp_path / "s.zarr")
    snaps = {}
    with pytest.raises(RuntimeError, match="user crash"):
        with Tracker(url, "crash", model, X, y, steps=T, record={"every": 2}, spectrum={"k": 4}, device="cpu") as tr:
            for t in range(T):
                opt.zero_grad()
                loss = 0.5 * ((model(X).squeeze(-1) - y) ** 2).mean()
                if tr.due(t):
                    snaps[t] = copy.deepcopy(model)
                    tr.record(t, lr=0.05, loss=loss.item())
                if t == 2:
                    raise RuntimeError("user crash")
                loss.backward()
                opt.step()
    run = Client(url).run("crash")
    assert run.status == "interrupted"
    assert [int(s) for s in run.steps] == [0, 2]
    th, f, J = _reference(snaps[2], X)
    np.testing.assert_array_equal(run.g["theta"][1], th.astype(np.float32))
    np.testing.assert_allclose(run.g["f"][1].reshape(-1), f, atol=1e-5)
    np.testing.assert_allclose(run.g["eigenvalues"][1][:4], np.sort(np.linalg.eigvalsh(J @ J.T))[::-1][:4], rtol=1e-4)
    assert np.isnan(run.g["df"][1]).all()
    assert np.isfinite(run.g["df"][0]).all()
    model = _mlp()
    again = Tracker(url, "crash", model, X, y, steps=T, record={"every": 2}, spectrum={"k": 4}, device="cpu")
    assert again.resume_step == 2
    np.testing.assert_array_equal(again.theta_at(2), th.astype(np.float32))
    # the loop restarts from the stored state (a model passing step 2 anywhere else would stop the recording)
    torch.nn.utils.vector_to_parameters(torch.as_tensor(again.theta_at(2)), model.parameters())
    assert not again.due(2) and again.due(4) and again.stopped is None
    again.close()


def test_a_closed_tracker_refuses_losses_it_would_not_write(tmp_path):
    X, y = _data()
    url = str(tmp_path / "s.zarr")
    tr = Tracker(url, "closed", _mlp(), X, y, steps=T, record={"every": 2}, spectrum={"k": 4}, device="cpu")
    tr.record(0, lr=0.1)
    tr.close()
    with pytest.raises(ValueError, match="closed"):
        tr.log(3, 1.0)
    with pytest.raises(ValueError, match="closed"):
        tr.record(2, lr=0.1)
