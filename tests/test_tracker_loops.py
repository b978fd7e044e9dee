"""The Tracker in loops people write (audit T, session 30).

It holds the data it was given as of the call: a loop that changes its arrays afterwards
(an in-place shuffle for minibatches, label noise, augmentation) does not change what is measured.

An audit (session 30): the Tracker kept views of the caller's float64 arrays (numpy's default), and an
in-place shuffle moved a run's data under it — E(y, k) 0.33 off, f 0.86 off at later steps, status done,
while the store's X and y held the originals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from nsa_dist import Client, Tracker


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_the_tracker_measures_the_data_as_given(tmp_path, dtype: torch.dtype) -> None:  # noqa: ANN001
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((20, 3)), rng.standard_normal((20, 1))
    Xc, yc = X.copy(), y.copy()  # the loop's own arrays
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(dtype)
    url = str(tmp_path / "s.zarr")
    tr = Tracker(url, "r", model, Xc, yc, steps=2, record={"steps": [0, 1]}, spectrum={"k": "all"}, device="cpu")
    tr.record(0, lr=0.1)
    perm = rng.permutation(20)
    Xc[:], yc[:] = Xc[perm], yc[perm]  # shuffled in place for the next epoch's minibatches
    tr.due(1)
    tr.record(1, lr=0.1)  # no update made: θ_1 = θ_0
    tr.close()
    g = Client(url).run("r").g
    md = model.double()
    p = {k: v.detach() for k, v in md.named_parameters()}
    fx = lambda q: functional_call(md, q, (torch.as_tensor(X),)).reshape(-1)  # noqa: E731
    J = torch.cat([v.reshape(20, -1) for v in jacrev(fx)(p).values()], 1).numpy()
    U = np.linalg.eigh(J @ J.T)[1][:, ::-1]
    f, yy = fx(p).detach().numpy(), y.reshape(-1)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for step in (0, 1):
        for name, phi in (("y", yy), ("residual", f - yy)):
            want = np.cumsum((U.T @ phi) ** 2) / (phi @ phi)
            off = np.abs(np.asarray(g[f"energy_{name}"][step]) - want).max()
            assert off < tol, f"step {step}: E({name}, k) {off:.3g} off the data as given"
        off = np.abs(np.asarray(g["f"][step]).reshape(-1) - f).max() / np.abs(f).max()
        assert off < 1e-6, f"step {step}: f {off:.3g} (relative; stored in float32) off f(X) at the data as given"


class _Annealed(nn.Module):
    """An output scale kept as a plain attribute, annealed by the loop (a temperature)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.scale = nn.Linear(3, 8), nn.Linear(8, 1), 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.l2(torch.tanh(self.l1(x)))


def _annealed_run(url: str, model: nn.Module, anneal) -> tuple[Tracker, object]:  # noqa: ANN001
    """Four recorded GD steps of ``model`` with ``anneal(model, t)`` called before each; (tracker, run)."""
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(20, 3, generator=g), torch.randn(20, 1, generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = Tracker(url, "r", model, X, y, steps=4, record={"every": 1}, spectrum={"k": "all"}, device="cpu")
    for t in range(4):
        anneal(model, t)
        if tr.due(t):
            tr.record(t, lr=opt)
        opt.zero_grad()
        (0.5 * ((model(X) - y) ** 2).mean()).backward()
        opt.step()
    tr.close()
    return tr, Client(url).run("r")


def test_state_outside_parameters_and_buffers_stops_the_recording(tmp_path) -> None:  # noqa: ANN001
    """The analysis runs on a copy made when the Tracker was created, which follows the parameters and
    buffers only: an annealed attribute stored λ₁ 35.9 for 224.7, status done (an audit).  The recording now
    stops with the reason at the first step where the model and such a copy differ; the steps before stay."""
    torch.manual_seed(0)
    tr, run = _annealed_run(str(tmp_path / "s.zarr"), _Annealed(), lambda m, t: setattr(m, "scale", 1.0 + 0.5 * t))
    assert run.status == "interrupted" and "state outside them changed" in run.reason, (run.status, run.reason)
    assert list(np.asarray(run.g["done"][:]).astype(int)) == [1, 0, 0, 0]
    assert tr.stopped is not None and "step 1" in tr.stopped


@pytest.mark.parametrize("lr", [None, [{"lr": 0.1}]], ids=["none", "param-groups"])
def test_a_learning_rate_of_another_kind_is_named(tmp_path, lr) -> None:  # noqa: ANN001
    """record(t, lr=None) or lr=opt.param_groups met float()'s own TypeError; the step stays recordable."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    X, y = torch.randn(10, 3), torch.randn(10, 1)
    tr = Tracker(str(tmp_path / "s.zarr"), "r", model, X, y, steps=2, record={"every": 1}, spectrum={"k": 2})
    with pytest.raises(TypeError, match=r"lr must be the learning rate of update t .* got (NoneType|list)"):
        tr.record(0, lr=lr)
    tr.record(0, lr=0.1)
    tr.close()


class _EmaScaled(nn.Module):
    """An output scale kept in a non-persistent buffer, moved by the loop (an EMA)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 8), nn.Linear(8, 1)
        self.register_buffer("scale", torch.ones(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.l2(torch.tanh(self.l1(x)))


def test_a_non_persistent_buffer_the_loop_moves_is_followed(tmp_path) -> None:  # noqa: ANN001
    """Buffers outside state_dict are buffers all the same: the twin check took them from state_dict and
    stopped such a run at step 0 (a review)."""
    torch.manual_seed(0)
    _, run = _annealed_run(str(tmp_path / "s.zarr"), _EmaScaled(), lambda m, t: m.scale.fill_(1.0 + 0.5 * t))
    assert run.status == "done" and np.asarray(run.g["done"][:]).all(), (run.status, run.reason)


def test_a_second_tracker_on_a_run_of_this_process_says_so(tmp_path) -> None:  # noqa: ANN001
    """The lease refusal named "another process" with this process's own pid (an audit)."""
    from nsa_dist.store.lease import LeaseHeld

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    X, y = torch.randn(10, 3), torch.randn(10, 1)
    kw = dict(steps=2, record={"every": 1}, spectrum={"k": 2})
    url = str(tmp_path / "s.zarr")
    with Tracker(url, "r", model, X, y, **kw):
        with pytest.raises(LeaseHeld, match=r"by this same process .* close that one first"):
            Tracker(url, "r", model, X, y, **kw)
