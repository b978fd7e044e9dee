"""J·Δθ (the first-order prediction Δf_t = J_t Δθ_t) on models with an op that has no forward-mode AD.

PyTorch's fused weight-norm kernel (``parametrizations.weight_norm``) and a custom
``autograd.Function`` written without ``jvp`` have no forward-mode rule.  The prediction was
taken by forward mode only, so a Tracker on such a model stored df_pred, E(df_pred, k) and the
first-order error NaN at every step (audit O); it now falls back to reverse mode (the vjp of the
vjp), checked here in float64 against J from ``torch.func.jacrev`` times Δθ.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import dense_jacobian
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.utils import parameters_to_vector

from nsa_dist import Tracker
from nsa_dist.client import Client
from nsa_dist.ntk import jacobian_vector_product

# jacrev of the reference batches weight norm's backward without a batching rule (a slower fallback)
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


class _Cube(torch.autograd.Function):
    """x³ with a backward in torch ops (so twice differentiable) and no jvp: no forward mode."""

    @staticmethod
    def forward(x):
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


class _OnceCube(_Cube):
    """The same, with a backward that cannot be differentiated again."""

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


class CubeNet(nn.Module):
    def __init__(self, cube: type[torch.autograd.Function] = _Cube, d: int = 3, out: int = 2) -> None:
        super().__init__()
        self.cube, self.a, self.b = cube, nn.Linear(d, 6), nn.Linear(6, out)

    def forward(self, x):
        return self.b(self.cube.apply(torch.tanh(self.a(x))))


def _weight_norm_net() -> nn.Module:
    return nn.Sequential(
        nn.utils.parametrizations.weight_norm(nn.Linear(3, 6)),
        nn.Tanh(),
        nn.utils.parametrizations.weight_norm(nn.Linear(6, 1)),
    )


def _models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"weight_norm": _weight_norm_net().double(), "custom_function": CubeNet().double()}


def test_j_dtheta_without_forward_mode_equals_the_dense_jacobian():
    x = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for name, model in _models().items():
        P = sum(p.numel() for p in model.parameters())
        dtheta = torch.randn(P, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        try:  # the premise: forward mode has no rule here
            torch.func.jvp(
                lambda p, model=model: torch.func.functional_call(model, p, (x,)),
                ({k: v.detach() for k, v in model.named_parameters()},),
                ({k: torch.ones_like(v) for k, v in model.named_parameters()},),
            )
            raise AssertionError(f"{name}: forward mode ran, the test needs a model it cannot run")
        except NotImplementedError:
            pass
        got = jacobian_vector_product(model, x, dtheta).reshape(-1)
        want = dense_jacobian(model, x) @ dtheta
        err = (torch.linalg.norm(got - want) / torch.linalg.norm(want)).item()
        assert err < 1e-12, f"{name}: J·dθ differs from jacrev's by {err:.2e} relative"


def test_a_tracker_on_a_weight_norm_model_predicts_the_update(tmp_path):
    torch.manual_seed(0)
    model = _weight_norm_net().double()
    X = torch.rand(20, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y = torch.sin(3 * X.sum(1, keepdim=True))
    url = str(tmp_path / "t.zarr")
    tr = Tracker(url, "wn", model, X, y, steps=6, record={"every": 2}, spectrum={"k": 4}, hessian=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    thetas = {}
    for t in range(6):
        if tr.due(t):
            thetas[t] = parameters_to_vector(model.parameters()).detach().clone()
            tr.record(t, lr=0.1)
        opt.zero_grad()
        (0.5 * ((model(X) - y) ** 2).mean()).backward()
        opt.step()
        if t in thetas:  # (θ_t, Δθ_t = θ_{t+1} − θ_t)
            thetas[t] = (thetas[t], parameters_to_vector(model.parameters()).detach().clone() - thetas[t])
    tr.close()
    run = Client(url).run("wn")
    assert run.status == "done", run.reason
    notes = run.per_step("step_notes")
    assert all("df_pred" not in n for n in notes), notes
    for i, t in enumerate(run.steps.tolist()):
        theta, dtheta = thetas[t]
        ref = _weight_norm_net().double()
        torch.nn.utils.vector_to_parameters(theta, ref.parameters())
        want = (dense_jacobian(ref, X) @ dtheta).numpy()
        got = np.asarray(run.outputs(int(t), "df_pred")).reshape(-1)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < 1e-6, f"step {t}: stored df_pred differs from J·Δθ by {err:.2e} relative"
        assert np.isfinite(run.first_order["error"][i]), run.first_order


def test_a_backward_that_cannot_be_differentiated_again_is_refused_not_guessed():
    """A custom Function without jvp whose backward is @once_differentiable: torch.func differentiated
    its backward as a constant and the vjp of the vjp gave J·dθ 50 % off without an error (a review's
    repro); the fallback is checked by a central difference and refused (NaN with its reason)."""
    from nsa_dist.errors import ModelForwardError

    torch.manual_seed(0)
    model, x = CubeNet(_OnceCube, d=2, out=1).double(), torch.randn(5, 2, dtype=torch.float64)
    dtheta = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    with pytest.raises(ModelForwardError, match="cannot be differentiated again"):
        jacobian_vector_product(model, x, dtheta)
