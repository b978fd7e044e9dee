"""Edge cases of the NTK paths and the Tracker: 0-dim parameters, a trainable set changed during a
tracked run, and ops whose torch.func ``vmap`` batching is silently wrong (cdist, PReLU).

Every kernel is compared with a float64 reference from plain ``torch.autograd`` (one gradient per
output of the full-batch forward — no torch.func)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from nsa_dist import Tracker
from nsa_dist.ntk import gram, ntk_operator


def _reference(model: nn.Module, X: torch.Tensor, full: bool = False) -> torch.Tensor:
    """G from the Jacobian of the full-batch forward, one autograd.grad per output."""
    out = model(X)
    out = out.reshape(len(X), -1)
    ps = [p for p in model.parameters() if p.requires_grad]
    K = out.shape[1]
    rows = [
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(out[i, a], ps, retain_graph=True)])
        for i in range(len(X))
        for a in range(K)
    ]
    J = torch.stack(rows).view(len(X), K, -1)
    return torch.einsum("iap,jbp->iajb", J, J) if full else torch.einsum("iap,jap->ij", J, J)


def _close(G: torch.Tensor, R: torch.Tensor, tol: float = 1e-10) -> None:
    err = float((G - R).abs().max() / R.abs().max())
    assert err < tol, f"relative error {err:.3e}"


class _Temp(nn.Module):  # a learnable scalar temperature: a 0-dim parameter
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 2)
        self.t = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x) / self.t


class _RBF(nn.Module):  # distances to learnable centres (torch.cdist)
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 4)
        self.c = nn.Parameter(torch.randn(5, 4))
        self.o = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.exp(-(torch.cdist(torch.tanh(self.l(x)), self.c) ** 2)))


class _BNRBF(_RBF):  # the same, coupling samples (train-mode batch norm): the batch route
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.exp(-(torch.cdist(self.bn(torch.tanh(self.l(x))), self.c) ** 2)))


def _prelu(bn: bool = False) -> nn.Module:
    mid = [nn.BatchNorm1d(8)] if bn else []
    return nn.Sequential(nn.Linear(3, 8), *mid, nn.PReLU(), nn.Linear(8, 2)).double()


@pytest.fixture
def X() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(10, 3, dtype=torch.float64)


# ---------------------------------------------------------------- 1. 0-dim parameters
@pytest.mark.parametrize("kernel", ["trace", "full"])
def test_ntk_operator_with_a_scalar_parameter(X, kernel):
    torch.manual_seed(1)
    m = _Temp().double()
    op = ntk_operator(m, X[:5], kernel=kernel)
    R = _reference(m, X[:5], full=kernel == "full")
    _close(op.to_dense(), R.reshape(op.shape))


# ---------------------------------------------------------------- 2. trainable set changed mid-run
def test_tracker_stops_recording_when_the_trainable_set_changes(tmp_path):
    """A run's NTK is over the trainable set it was created with: unfreezing mid-run ends the
    recording (``interrupted``, the reason naming the parameters, the recorded steps kept) while the
    user's training goes on (was: a ValueError at every later record, ending the user's loop)."""
    from nsa_dist.client import Client

    torch.manual_seed(0)
    X, y = torch.randn(16, 3), torch.randn(16, 2)
    m = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    m[0].requires_grad_(False)
    tr = Tracker(str(tmp_path / "u.zarr"), "u", m, X, y, steps=3, record={"every": 1}, spectrum={"k": 2, "images": []})
    tr.record(0, lr=0.05)
    m[0].requires_grad_(True)  # unfrozen mid-run
    tr.record(1, lr=0.05)  # no raise: the recording stops, training goes on
    assert tr.stopped and re.search(r"requires_grad changed.*0\.weight \(unfrozen\), 0\.bias", tr.stopped), tr.stopped
    assert not tr.due(2)
    tr.close()
    run = Client(str(tmp_path / "u.zarr")).run("u")
    assert run.status == "interrupted" and run.g["done"][:].tolist() == [True, False, False], (run.status, run.reason)


# ---------------------------------------------------------------- 3. ops vmap gets wrong
@pytest.mark.parametrize("method", ["auto", "jacobian"])
def test_cdist_head_exact(X, method):
    torch.manual_seed(2)
    m = _RBF().double()
    _close(gram(m, X, method=method), _reference(m, X))
    _close(gram(m, X, method=method, kernel="full").reshape(20, 20), _reference(m, X, full=True).reshape(20, 20))


def test_prelu_as_many_points_as_outputs(X):
    torch.manual_seed(3)
    m = _prelu()
    _close(gram(m, X[:2]), _reference(m, X[:2]))
    _close(gram(m, X[:2], method="jacobian"), _reference(m, X[:2]))


def test_prelu_jacobian_blocks_of_two(X):
    torch.manual_seed(4)
    m = _prelu()
    _close(gram(m, X, method="jacobian", block_size=2), _reference(m, X))
    _close(gram(m, X, X[:4], method="jacobian", block_size=2), _reference_cross(m, X, X[:4]))


def _reference_cross(m: nn.Module, X1: torch.Tensor, X2: torch.Tensor) -> torch.Tensor:
    """Per-sample model: the cross kernel is the block of the joint one."""
    G = _reference(m, torch.cat([X1, X2]))
    return G[: len(X1), len(X1) :]


@pytest.mark.parametrize("make", [_BNRBF, lambda: _prelu(bn=True)], ids=["cdist", "prelu"])
def test_batch_route_exact(X, make):
    torch.manual_seed(5)
    m = make().double().train()
    for n, block in ((2, None), (10, 2)):
        Xn = X[:n]
        _close(gram(m, Xn, method="batch", block_size=block), _reference(m, Xn))
