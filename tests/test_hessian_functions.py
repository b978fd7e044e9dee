"""Second derivatives through a custom ``autograd.Function`` are differentiations of its backward: a
backward written on a detached input (as a NumPy, C++ or CUDA-extension backward is) has a correct
gradient and a wrong Hessian — symmetric, so the operators' symmetry check passed, and H and S came
back 0.25–1.4 of max|H| off with status done (an audit).  The Hessian operators now difference the
gradients once where the forward runs such a Function: a wrong one is refused by name, a right one
is measured (float64 against a dense double-backward Hessian of the plain-op network)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.hessian import hessian_parts

F64 = torch.float64


class CubeDetached(torch.autograd.Function):  # old style; its backward's own derivative is lost
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x.detach() ** 2 * g


class Cube(torch.autograd.Function):  # old style, a differentiable backward
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


class CubeNew(torch.autograd.Function):  # new style (torch.func runs it), a differentiable backward
    generate_vmap_rule = True

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


class CubeNoVmap(CubeNew):  # new style without a vmap rule: torch.func's vmap refuses it
    generate_vmap_rule = False


class CubeNewDetached(CubeNew):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x.detach() ** 2 * g


class Net(nn.Module):
    def __init__(self, cube=None) -> None:
        super().__init__()
        self.a, self.b, self.cube = nn.Linear(3, 5), nn.Linear(5, 2), cube

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h**3 if self.cube is None else self.cube.apply(h))


def _dense(op) -> torch.Tensor:  # noqa: ANN001
    return op.matmat(torch.eye(op.shape[0], dtype=op.dtype))


def _reference(net: nn.Module, X: torch.Tensor, Y: torch.Tensor) -> dict[str, torch.Tensor]:
    """H, I, S of the plain-op twin by double backward (MSE: C = (1/2N) Σ ‖f − y‖²)."""
    twin = Net().double()
    twin.load_state_dict(net.state_dict())
    params = list(twin.parameters())

    def hess(scalar: torch.Tensor) -> torch.Tensor:
        g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(scalar, params, create_graph=True)])
        rows = []
        for gi in g:
            parts = torch.autograd.grad(gi, params, retain_graph=True, allow_unused=True)
            rows.append(
                torch.cat([(torch.zeros_like(p) if t is None else t).reshape(-1) for p, t in zip(params, parts)])
            )
        return torch.stack(rows)

    F = twin(X)
    H = hess(0.5 * ((F - Y) ** 2).sum() / X.shape[0])
    S = hess((F * (F - Y).detach()).sum() / X.shape[0])
    return {"H": H, "I": H - S, "S": S}


def _data(dtype: torch.dtype = F64):
    torch.manual_seed(0)
    return torch.randn(12, 3, dtype=dtype), torch.randn(12, 2, dtype=dtype)


@pytest.mark.parametrize("cube", [CubeDetached, CubeNewDetached], ids=["old-style", "new-style"])
def test_a_backward_without_its_own_derivative_is_refused_for_H_and_S(cube) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    net = Net(cube).double()
    X, Y = _data()
    H, I, S = hessian_parts(net, X, Y)
    ref = _reference(net, X, Y)
    for op in (H, S):
        with pytest.raises(UnsupportedModelError, match=rf"autograd\.Function {cube.__name__}.*second derivatives"):
            _dense(op)
    # I is made of first derivatives, which the Function gives right: measured
    got = _dense(I)
    err = float((got - ref["I"]).abs().max() / ref["I"].abs().max())
    assert err < 1e-12, f"I off by {err:.3g} of max|I|"


@pytest.mark.parametrize("cube", [Cube, CubeNew, CubeNoVmap], ids=["old-style", "new-style", "no-vmap-rule"])
def test_a_differentiable_backward_is_measured(cube) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    net = Net(cube).double()
    X, Y = _data()
    ref = _reference(net, X, Y)
    for part, op in zip("HIS", hessian_parts(net, X, Y)):
        got = _dense(op)
        err = float((got - ref[part]).abs().max() / ref[part].abs().max())
        assert err < 1e-12, f"{part} off by {err:.3g} of max|{part}| (reference: the plain-op network)"


def test_a_float32_differentiable_function_is_not_refused() -> None:
    """The difference runs in the model's float32: its rounding is allowed (no false refusal)."""
    torch.manual_seed(0)
    net = Net(Cube)
    X, Y = _data(torch.float32)
    ref = _reference(net, X.double(), Y.double())
    H = _dense(hessian_parts(net, X, Y)[0]).double()
    err = float((H - ref["H"]).abs().max() / ref["H"].abs().max())
    assert err < 1e-4, f"float32 H off by {err:.3g} of max|H|"


class SwishDetached(torch.autograd.Function):  # old style, backward on a detached input
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x = x.detach()
        s = torch.sigmoid(x)
        return g * s * (1 + x * (1 - s))


class Float32Only(torch.autograd.Function):  # a kernel for float32 only (as a CUDA extension may be)
    @staticmethod
    def forward(ctx, x):
        if x.dtype != torch.float32:
            raise TypeError("this kernel is float32 only")
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x.detach() ** 2 * g


class SideBranch(nn.Module):
    """A tanh net with a side branch through the Function, weighted by ``s``."""

    def __init__(self, fn, s: float) -> None:  # noqa: ANN001
        super().__init__()
        self.a, self.b, self.c, self.d, self.fn, self.s = (
            nn.Linear(3, 8),
            nn.Linear(8, 2),
            nn.Linear(3, 4),
            nn.Linear(4, 2),
            fn,
            s,
        )

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + self.s * self.d(self.fn.apply(self.c(x)))


def test_a_float32_model_is_differenced_in_float64() -> None:
    """A wrong second derivative on a side branch (1.5 % of the product) passed the float32 difference's
    3·10⁻² tolerance (a review): the check runs on a float64 twin of the parameters and points."""
    torch.manual_seed(0)
    net = SideBranch(SwishDetached, 0.1)
    X, Y = _data(torch.float32)
    H = hessian_parts(net, X, Y)[0]
    with pytest.raises(UnsupportedModelError, match=r"autograd\.Function SwishDetached"):
        _dense(H)
    # a Function that runs in float32 only is checked in float32: a large error is still refused there
    net = Net(Float32Only)
    H = hessian_parts(net, X, Y)[0]
    with pytest.raises(UnsupportedModelError, match=r"autograd\.Function Float32Only"):
        _dense(H)


class FusedSoftplus(torch.autograd.Function):  # a fused kernel: a right gradient, a backward not differentiable
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.nn.functional.softplus(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.sigmoid(x.detach())


class Dispatching(nn.Module):
    """A library's dispatch: the fused Function for float32, plain ops for float64."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x)
        return self.b(FusedSoftplus.apply(h) if h.dtype == torch.float32 else torch.nn.functional.softplus(h))


def test_a_float64_twin_that_runs_other_ops_leaves_the_check_to_the_models_dtype() -> None:
    """The twin ran the plain ops and settled, and a Hessian 0.135 of max|H| off was measured (a review)."""
    torch.manual_seed(0)
    X, Y = _data(torch.float32)
    H = hessian_parts(Dispatching(), X, Y)[0]
    with pytest.raises(UnsupportedModelError, match=r"autograd\.Function FusedSoftplus"):
        _dense(H)


class FlaggedCube(Net):
    """The Function on flagged points only (x₀ = 3: the last points), the plain cube on the others."""

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(torch.where(x[:, :1] > 2.5, self.cube.apply(h), h**3))


def test_a_function_used_by_later_points_only_is_checked_there() -> None:
    """The second-order check differenced the first 16 points: a Function without its own derivative used by
    later points only put H 0.36 and S 0.50 off, status done (an audit).  Now every point, a chunk at a time."""
    torch.manual_seed(0)
    net = FlaggedCube(CubeDetached).double()
    X, Y = torch.randn(40, 3, dtype=F64), torch.randn(40, 2, dtype=F64)
    X[:, 0] = X[:, 0].clamp(max=2.0)
    X[30:, 0] = 3.0
    H, I, S = hessian_parts(net, X, Y)
    for op in (H, S):
        with pytest.raises(UnsupportedModelError, match=r"CubeDetached.*second derivatives.*points 16–39"):
            _dense(op)
    torch.manual_seed(0)
    good = FlaggedCube(Cube).double()
    ref = _reference(good, X, Y)
    for part, op in zip("HIS", hessian_parts(good, X, Y)):
        err = float((_dense(op) - ref[part]).abs().max() / ref[part].abs().max())
        assert err < 1e-12, f"{part} off by {err:.3g} of max|{part}|"
