"""Products of every order take as constants what plain autograd does — a tensor read through ``.data``,
a ``torch.no_grad()`` block — and ops torch.func cannot batch go to plain autograd.

An audit (session 30): ``gram`` and I were right on such models, but H and S came from nested torch.func
transforms (forward over reverse, or reverse over reverse), where ``.data`` dropped the inner level only —
a model scaling by ``self.a.bias.data[0]`` got an H 0.49 off and not symmetric, S ~100 % off; a
straight-through estimator written with ``.data`` an H 4.1 off, status done.  The references here are
plain autograd's double backward (``.data`` detached at every order) and central differences of G.

App. F's first-order kernel change is the other way round: G's values move with θ through a ``.data``
read or a no_grad block, so its derivative goes through them (only J takes them as constants).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import nsa_dist.hessian._operator as hop
from nsa_dist.hessian import hessian_parts, output_hessian_traces
from nsa_dist.hessian._probes import rademacher
from nsa_dist.ntk.kernel_change import gram_change
from tests.conftest import dense_ntk, flat_model

F64 = torch.float64


class _DataScale(nn.Module):
    """An activation scaled by a parameter read through ``.data`` (a constant to autograd)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.tanh(self.a(x)) * self.a.bias.data[0])


class _DataSTE(nn.Module):
    """A straight-through estimator written with ``.data`` (round forward, identity backward) plus a
    smooth term of the detached activation."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(3, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * 3
        return self.o(torch.sin(h - h.data + torch.round(h.data) + 0.3 * h.data**2))


def _hess(scalar: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(scalar, params, create_graph=True)])
    rows = []
    for gi in g:
        parts = torch.autograd.grad(gi, params, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if t is None else t).reshape(-1) for p, t in zip(params, parts)]))
    return torch.stack(rows)


def _reference(model: nn.Module, X: torch.Tensor, Y: torch.Tensor) -> dict[str, torch.Tensor]:
    params = list(model.parameters())
    F = model(X)
    H = _hess(0.5 * ((F - Y) ** 2).sum() / X.shape[0], params)
    S = _hess((F * (F - Y).detach()).sum() / X.shape[0], params)
    return {"H": H, "I": H - S, "S": S}


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("make", [_DataScale, _DataSTE], ids=["data-scale", "data-ste"])
def test_hessian_parts_take_a_data_read_as_a_constant(make, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = make().double()
    X, Y = torch.randn(6, 3, dtype=F64), torch.randn(6, 2, dtype=F64)
    if mode == "reverse":  # as where an op of the model has no forward-mode rule: reverse over reverse
        monkeypatch.setattr(hop.LossCurvatureOperator, "_forward_mode", lambda self, product: None)
    ref = _reference(model, X, Y)
    for name, op in zip("HIS", hessian_parts(model, X, Y, loss="mse", dtype=F64)):
        got = op.matmat(torch.eye(op.shape[0], dtype=F64))
        scale = float(ref["H"].abs().max())
        err = float((got - ref[name]).abs().max()) / scale
        assert err < 1e-12, f"{name} ({mode} mode) is {err:.2g} of max|H| off plain autograd's double backward"
        asym = float((got - got.T).abs().max()) / scale
        assert asym < 1e-12, f"{name} ({mode} mode) is not symmetric: {asym:.2g} of max|H|"


def test_output_hessian_traces_take_a_data_read_as_a_constant() -> None:
    """Forward over forward (the Hessian paper's per-output traces) under the same convention."""
    torch.manual_seed(1)
    model = _DataScale().double()
    X = torch.randn(5, 3, dtype=F64)
    Z = torch.as_tensor(output_hessian_traces(model, X, 4, dtype=F64, seed=0).per_probe)  # (m, N, K): uᵀ∇²f u
    params = list(model.parameters())
    P = sum(p.numel() for p in params)  # the same probes, by double backward
    U = torch.as_tensor(rademacher(np.random.default_rng(0), P, 4), dtype=F64)
    F = model(X)
    want = torch.zeros_like(Z)
    for j in range(4):
        for i in range(X.shape[0]):
            for k in range(F.shape[1]):
                want[j, i, k] = U[:, j] @ _hess(F[i, k], params) @ U[:, j]
    err = float((Z - want).abs().max() / want.abs().max())
    assert err < 1e-12, f"uᵀ∇²f u {err:.2g} (relative) off plain autograd's double backward"


class _NoGradNorm(nn.Module):
    """A weight normalised by its norm taken under ``torch.no_grad()`` (a constant to autograd)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(3, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            n = self.a.weight.norm()
        return self.o(torch.tanh(x @ (self.a.weight / n).T + self.a.bias))


@pytest.mark.parametrize("make", [_DataScale, _NoGradNorm], ids=["data-scale", "no-grad-norm"])
def test_gram_change_first_order_is_the_derivative_of_gs_values(make) -> None:  # noqa: ANN001
    """App. F's first order against a central difference of G along Δθ.  G's J takes a ``.data`` read or
    a no_grad block as a constant, but its values change with θ through them: the first order took the
    no_grad norm as a constant at both levels (0.23 where G's derivative was −0.033, status done), and
    with ``.data`` the two modes it compared disagreed and nothing was measured."""
    torch.manual_seed(2)
    model = make().double()
    X = torch.randn(7, 3, dtype=F64)
    theta, _ = flat_model(model)
    dtheta = 0.02 * torch.randn_like(theta)

    def gram_at(v: torch.Tensor) -> np.ndarray:
        torch.nn.utils.vector_to_parameters(v, model.parameters())
        return dense_ntk(model, X).numpy()

    def central(eps: float) -> np.ndarray:
        return (gram_at(theta + eps * dtheta) - gram_at(theta - eps * dtheta)) / (2 * eps)

    dG = (4 * central(5e-3) - central(1e-2)) / 3
    V = np.linalg.eigh(gram_at(theta))[1][:, ::-1][:, :3]
    got = gram_change(model, X, theta.numpy(), dtheta.numpy(), V, F64)
    want = np.diag(V.T @ dG @ V)
    err = np.abs(got["gram_change"][1] - want).max() / np.abs(want).max()
    assert err < 1e-6, f"first-order diag {got['gram_change'][1]} vs the dense derivative {want} ({err:.2g} apart)"


def test_an_op_without_a_batching_rule_takes_plain_autograd_for_the_hessian() -> None:
    """An eval-mode RReLU (a deterministic leaky ReLU) runs ``aten::rrelu_with_noise``, which vmap has no
    rule for: ``gram`` measured it, the Hessian failed with vmap's message (an audit) — it now takes the
    plain-autograd products, as for a Function torch.func cannot transform."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 6), nn.RReLU(), nn.Linear(6, 2)).double().eval()
    X, Y = torch.randn(8, 5, dtype=F64), torch.randn(8, 2, dtype=F64)
    ref = _reference(model, X, Y)
    for name, op in zip("HIS", hessian_parts(model, X, Y, loss="mse", dtype=F64)):
        got = op.matmat(torch.eye(op.shape[0], dtype=F64))
        err = float((got - ref[name]).abs().max()) / float(ref["H"].abs().max())
        assert err < 1e-12, f"{name} of an eval-mode RReLU net is {err:.2g} of max|H| off double backward"
