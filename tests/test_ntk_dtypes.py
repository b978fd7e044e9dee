"""The adjoint test on models computing in several floats, and on Python Functions with a forward-mode rule.

An audit (session 29) found wrong kernels with status done: a float32 model's gap was excused by a float64
copy that did not run the model's own gradients (a hook acting on float32 gradients only: 0.65 off; a
Function the forward takes for float32 tensors only: 0.10 off; a bf16 autocast region's hook: 4.2 off);
16-bit models were not tested at all (a 3× hook: 0.65 off); a Function whose jvp is as wrong as its backward
passed the comparison of the two (0.48–0.59 off, a straight-through estimator 0.031); a float32 Function with
no forward mode and a 1.01× backward passed the difference's float32 allowance (0.0105 off).  And a correct
float64 model with a bf16 round trip was refused for a hook it did not have.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.ntk import gram, ntk_operator


def _reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """J Jᵀ in float64 by jacrev of a float64 copy (``model`` holds the true derivative)."""
    model = model.double()
    p = {n: t.detach() for n, t in model.named_parameters()}
    n = x.shape[0]
    jac = jacrev(lambda q: functional_call(model, q, (x.double(),)).reshape(n, -1))(p)
    J = torch.cat([j.reshape(n, j.shape[1], -1) for j in jac.values()], 2)
    return torch.einsum("iap,jap->ij", J, J)


def _off(G: torch.Tensor, ref: torch.Tensor) -> float:
    return float((G.double() - ref).abs().max() / ref.abs().max())


class _Tanh15(torch.autograd.Function):
    """tanh with a 1.5× backward, new style, no forward-mode rule."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        (y,) = ctx.saved_tensors
        return 1.5 * g * (1 - y * y)


class _Tanh101(_Tanh15):
    """The same with a 1.01× backward."""

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        (y,) = ctx.saved_tensors
        return 1.01 * g * (1 - y * y)


class _Sin3(torch.autograd.Function):
    """sin whose jvp and backward are both 3× the derivative (``round``: a straight-through estimator)."""

    @staticmethod
    def forward(x: torch.Tensor, kind: str) -> torch.Tensor:
        return torch.sin(x) if kind == "sin3" else torch.round(4 * x) / 4

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
        x, ctx.kind = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        (x,) = ctx.saved_tensors
        return (3 * g * torch.cos(x) if ctx.kind == "sin3" else g), None

    @staticmethod
    def jvp(ctx, t: torch.Tensor, _: None) -> torch.Tensor:  # noqa: ANN001
        (x,) = ctx.saved_tensors
        return 3 * t * torch.cos(x) if ctx.kind == "sin3" else t


class Net(nn.Module):
    """3 → 16 → 16 → 2 with one of the audit's alterations at the first hidden layer (``how``), or none."""

    def __init__(self, how: str = "") -> None:
        super().__init__()
        self.how = how
        self.l1, self.l2, self.l3 = nn.Linear(3, 16), nn.Linear(16, 16), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, how = self.l1(x), self.how
        if how == "dispatch":  # a "fused" kernel for float32 tensors only
            h = _Tanh15.apply(h) if h.dtype == torch.float32 else torch.tanh(h)
        elif how == "nojvp101":
            h = _Tanh101.apply(h)
        elif how == "nojvp15":
            h = _Tanh15.apply(h)
        elif how in ("sin3", "ste"):
            h = _Sin3.apply(h, how)
        elif how in ("bf16trip", "f16trip"):
            h = torch.tanh(h).to(torch.bfloat16 if how == "bf16trip" else torch.float16).to(x.dtype)
        else:
            h = torch.tanh(h)
        if how == "hook32" and h.requires_grad:
            h.register_hook(lambda g: 3 * g if g.dtype == torch.float32 else g)
        if how == "hook3" and h.requires_grad:
            h.register_hook(lambda g: 3 * g)
        if how.startswith("autocast"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.l2(h)
            if how == "autocast_hook" and h.requires_grad:
                h.register_hook(lambda g: 3 * g if g.dtype == torch.bfloat16 else g)
            return self.l3(torch.tanh(h.to(x.dtype)))
        return self.l3(torch.tanh(self.l2(h)))


def _pair(how: str, dtype: torch.dtype, n: int = 16, seed: int = 0) -> tuple[Net, torch.Tensor, torch.Tensor]:
    """(the model, its points, the float64 reference of the same weights with tanh: the true derivative of
    the models measured against it)."""
    torch.manual_seed(seed)
    model = Net(how).to(dtype)
    x = torch.randn(n, 3).to(dtype)
    ref = Net().double()
    ref.load_state_dict(model.state_dict())
    return model, x, _reference(ref, x)


@pytest.mark.parametrize(
    ("how", "dtype"),
    [
        ("dispatch", torch.float32),
        ("hook32", torch.float32),
        ("autocast_hook", torch.float32),
        ("hook3", torch.bfloat16),
        ("hook3", torch.float16),
        ("nojvp101", torch.float32),
        ("nojvp15", torch.bfloat16),
        ("nojvp15", torch.float16),
        ("sin3", torch.bfloat16),
        ("sin3", torch.float16),
        ("sin3", torch.float64),
        ("sin3", torch.float32),
        ("ste", torch.float64),
    ],
)
def test_gradients_other_than_the_derivative_are_refused_in_every_float(how: str, dtype: torch.dtype) -> None:
    model, x, _ = _pair(how, dtype)
    with pytest.raises(UnsupportedModelError, match="not the derivative"):
        gram(model, x)
    with pytest.raises(UnsupportedModelError, match="not the derivative"):
        ntk_operator(model, x)


@pytest.mark.parametrize(
    ("how", "dtype", "allowed"),
    [
        ("", torch.bfloat16, 1e-2),
        ("", torch.float16, 2e-3),
        ("autocast", torch.float32, 1e-2),
        ("bf16trip", torch.float64, 1e-2),
        ("bf16trip", torch.float32, 1e-2),
        ("f16trip", torch.float64, 2e-3),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_true_derivative_in_a_coarser_float_is_measured(
    how: str, dtype: torch.dtype, allowed: float, seed: int
) -> None:
    """Within the coarse float's rounding of the float64 reference (the bf16 round trip in a float64 net was
    refused on 4 of 4 seeds: its gap 1.1–4.7·10⁻⁴ against float64's allowance)."""
    model, x, ref = _pair(how, dtype, n=8, seed=seed)
    err = _off(gram(model, x), ref)
    assert err < allowed, f"{how} {dtype}: {err:.2g} off the float64 reference (allowed {allowed:g})"


def test_a_c_level_profiler_is_left_running() -> None:
    """The chunk screen watches C calls with a profile function; under cProfile (Python < 3.12 sets it as the
    profile function) it replaced it, failed to call it on, and the user's profiling stopped for the rest of
    the run (a review).  Now a profiler it cannot call on is left in place, and every chunk is tested."""
    import cProfile
    import sys

    model, x, ref = _pair("", torch.float64, n=40)
    prof = cProfile.Profile()
    before = sys.getprofile()
    prof.enable()
    try:
        within = sys.getprofile()
        G = gram(model, x)
        after = sys.getprofile()
    finally:
        prof.disable()
    assert after is within, f"the profile function was {within!r} before gram and {after!r} after"
    assert sys.getprofile() is before
    assert _off(G, ref) < 1e-12


class _SoftmaxIn32(nn.Module):
    """A float64 attention whose softmax takes its scores in float32 (``dtype=`` of the op, not a cast)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qk, self.head = nn.Embedding(11, 8), nn.Linear(8, 16), nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        q, k = self.qk(x).chunk(2, -1)
        a = torch.softmax(torch.einsum("btd,bsd->bts", q, k) / 8**0.5, -1, dtype=torch.float32).to(x.dtype)
        return self.head(a @ x)[:, -1]


def test_an_ops_own_float32_dtype_in_a_float64_model_is_not_a_hook() -> None:
    """The re-run with the casts undone kept ``softmax(…, dtype=torch.float32)``, stayed coarse, and the model
    was refused as holding a gradient hook (a gap of 5·10⁻⁹ against float64's 10⁻⁹: an audit)."""
    torch.manual_seed(0)
    model, ids = _SoftmaxIn32().double(), torch.randint(0, 11, (6, 5))
    p = {n: t.detach() for n, t in model.named_parameters()}
    jac = jacrev(lambda q: functional_call(model, q, (ids,)))(p)
    J = torch.cat([j.reshape(6, 4, -1) for j in jac.values()], 2)
    ref = torch.einsum("iap,jap->ij", J, J)
    assert _off(gram(model, ids), ref) < 1e-6


def test_a_deep_bf16_net_without_hooks_is_measured() -> None:
    """A 16-bit model whose graph holds no Python Function is judged by its own forward mode: the float64
    copy is no twin of a chaotic deep bf16 net (30 tanh layers, gain 2: its gradients 1 apart from the
    copy's) and refused it (the second review)."""
    import math

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 64), nn.Tanh()]
    for _ in range(29):
        lin = nn.Linear(64, 64)
        nn.init.normal_(lin.weight, std=2 / math.sqrt(64))
        layers += [lin, nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(64, 1)).to(torch.bfloat16)
    G = gram(model, (3 * torch.randn(32, 16)).to(torch.bfloat16))
    assert G.shape == (32, 32) and bool(torch.isfinite(G).all())


class _AutocastMiddle(nn.Module):
    """A float32 net with a bf16 autocast region in the middle."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 64), nn.Linear(64, 64), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.tanh(self.b(h))
        return self.c(h.float())


def test_a_per_sample_route_refusing_a_16_bit_region_says_its_rounding_may_be_the_cause() -> None:
    """bf16 rounding changes with the batch's size, so the per-sample routes' batch comparisons read a
    float32 net's autocast region as "the forward decides something over its whole batch" (an audit):
    the refusal now names the bf16 computations; `auto` measures the batch forward's kernel."""
    torch.manual_seed(0)
    model, x = _AutocastMiddle(), torch.randn(40, 4)
    for method in ("structured", "per_layer"):
        with pytest.raises(UnsupportedModelError, match="rounding of its bfloat16 computations") as e:
            gram(model, x, method=method)
        assert "use method='auto'" in str(e.value), str(e.value)
    twin = copy.deepcopy(nn.Sequential(model.a, nn.Tanh(), model.b, nn.Tanh(), model.c))  # no autocast
    off = _off(gram(model, x), _reference(twin, x))
    assert off < 1e-2, f"auto's kernel of the bf16-autocast net is {off:.2g} off the float64 reference"
    plain = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 1))  # a true coupling in float32: no such note
    with pytest.raises(UnsupportedModelError, match="batch statistics") as e:
        gram(plain, x, method="structured")
    assert "bfloat16" not in str(e.value), str(e.value)
