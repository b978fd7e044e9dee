"""Loss Hessians of models torch.func cannot differentiate twice as they stand, in float64 against
dense references computed another way.

* ``nn.EmbeddingBag`` (PyTorch's own text-classification tutorial model): ``_embedding_bag`` has no
  forward-mode rule and ``_embedding_bag_backward`` no derivative, so H, I and S were refused
  (audit H).  Within products it runs composite ops (``nsa_dist.ntk._bag``); the reference here is
  the model's function written as a Python loop over its bags.
* An ``autograd.Function`` in the old style (``forward(ctx, …)``, no ``setup_context``): torch.func
  refuses to transform it at all, so H, I and S were refused with torch.func's error.  Products
  switch to plain autograd (double backward); the reference is ``torch.autograd.functional.hessian``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nsa_dist.hessian import hessian_operator
from nsa_dist.ntk._bag import embedding_bag

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
DT = torch.float64


class Bag(nn.Module):
    def __init__(self, mode: str, pad: int | None, offsets: torch.Tensor | None = None) -> None:
        super().__init__()
        self.e, self.o, self.offsets = nn.EmbeddingBag(9, 4, mode=mode, padding_idx=pad), nn.Linear(4, 3), offsets

    def forward(self, t):
        bags = self.e(t) if self.offsets is None else self.e(t.reshape(-1), self.offsets)
        return self.o(torch.tanh(bags))


def _by_loop(m: Bag, p: dict[str, torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """The model's function by hand: a Python loop over its bags."""
    W, pad = p["e.weight"], m.e.padding_idx
    if m.offsets is None:
        bags = [list(r) for r in t]
    else:
        flat, o = t.reshape(-1).tolist(), [*m.offsets.tolist(), t.numel()]
        bags = [flat[o[i] : o[i + 1]] for i in range(len(o) - 1)]
    outs = []
    for b in bags:
        b = [int(i) for i in b if pad is None or int(i) != pad]
        if not b:
            outs.append(torch.zeros(4, dtype=DT))
            continue
        R = torch.stack([W[i] for i in b])
        outs.append({"sum": R.sum(0), "mean": R.mean(0), "max": R.max(0).values}[m.e.mode])
    return torch.tanh(torch.stack(outs)) @ p["o.weight"].T + p["o.bias"]


def _dense(m: nn.Module, forward, X: torch.Tensor, Y: torch.Tensor) -> dict[str, torch.Tensor]:
    """H (autograd.functional.hessian of the MSE loss), I = JᵀJ/N, S = H − I over the flat θ."""
    names, shapes = zip(*[(k, p.shape) for k, p in m.named_parameters()])
    theta = torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    def unflat(v: torch.Tensor) -> dict[str, torch.Tensor]:
        sizes = [s.numel() for s in shapes]
        return {k: c.reshape(s) for k, c, s in zip(names, v.split(sizes), shapes)}

    f = lambda v: forward(unflat(v), X)  # noqa: E731
    N = Y.shape[0]
    H = torch.autograd.functional.hessian(lambda v: 0.5 * ((f(v) - Y) ** 2).sum() / N, theta)
    J = torch.autograd.functional.jacobian(lambda v: f(v).reshape(-1), theta)
    return {"H": H, "I": J.T @ J / N, "S": H - J.T @ J / N}


def _check(m: nn.Module, X: torch.Tensor, Y: torch.Tensor, ref: dict[str, torch.Tensor], what: str) -> None:
    for part, R in ref.items():
        A = torch.as_tensor(hessian_operator(m, X, Y, part=part).to_dense())
        err = float((A - R).abs().max() / R.abs().max())
        assert err < 1e-12, f"{what}: {part} differs from the dense reference by {err:.2e} of its largest entry"


@pytest.mark.parametrize("mode", ["mean", "sum", "max"])
@pytest.mark.parametrize("layout", ["rows", "rows-padding", "offsets-padding"])
def test_embedding_bag_hessians_equal_the_bag_loop(mode: str, layout: str) -> None:
    g = torch.Generator().manual_seed(3)
    offsets = torch.tensor([0, 4, 4, 11]) if layout == "offsets-padding" else None  # an empty bag too
    torch.manual_seed(0)
    m = Bag(mode, None if layout == "rows" else 0, offsets).to(DT)
    T = torch.randint(0, 9, (4 if offsets is not None else 8, 5), generator=g)
    if offsets is None and layout == "rows-padding":
        T[1] = 0  # a bag of padding only
    Y = torch.randn(T.shape[0], 3, generator=g, dtype=DT)
    assert torch.allclose(_by_loop(m, dict(m.named_parameters()), T), m(T), atol=1e-14, rtol=0)
    _check(m, T, Y, _dense(m, lambda p, t: _by_loop(m, p, t), T, Y), f"EmbeddingBag({mode}, {layout})")


def test_the_composite_bag_is_f_embedding_bag() -> None:
    """Every argument combination F.embedding_bag accepts: the same values (to rounding)."""
    g = torch.Generator().manual_seed(1)
    W = torch.randn(9, 4, generator=g, dtype=DT)
    T2 = torch.randint(0, 9, (6, 5), generator=g)
    T2[0] = 0
    T1, off = torch.randint(0, 9, (17,), generator=g), torch.tensor([0, 3, 3, 9, 12])
    psw = {2: torch.rand(6, 5, generator=g, dtype=DT), 1: torch.rand(17, generator=g, dtype=DT)}
    for mode in ("sum", "mean", "max"):
        for pad in (None, 0, -9):
            for last in (False, True):
                inputs = [
                    {"input": T2},
                    {"input": T1, "offsets": torch.cat([off, torch.tensor([17])]) if last else off},
                ]
                for kw in inputs:
                    kw = {**kw, "include_last_offset": last and "offsets" in kw}
                    for w in [None, *([psw[kw["input"].dim()]] if mode == "sum" else [])]:
                        want = F.embedding_bag(weight=W, mode=mode, padding_idx=pad, per_sample_weights=w, **kw)
                        got = embedding_bag(weight=W, mode=mode, padding_idx=pad, per_sample_weights=w, **kw)
                        assert torch.allclose(got, want, atol=1e-15, rtol=0), (mode, pad, last, kw["input"].dim(), w)


class _OldTanh(torch.autograd.Function):
    """tanh in the old style (forward takes ctx): torch.func cannot transform it; its backward is
    made of torch ops, so plain autograd differentiates it twice."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (1 - torch.tanh(x) ** 2)


class _OldTanhOnce(_OldTanh):
    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (1 - torch.tanh(x) ** 2)


class OldNet(nn.Module):
    def __init__(self, act: type[torch.autograd.Function] = _OldTanh) -> None:
        super().__init__()
        self.a, self.o, self.act = nn.Linear(5, 6), nn.Linear(6, 2), act

    def forward(self, x):
        return self.o(self.act.apply(self.a(x)))


def test_an_old_style_autograd_function_is_measured_by_plain_autograd() -> None:
    g = torch.Generator().manual_seed(2)
    X, Y = torch.randn(12, 5, generator=g, dtype=DT), torch.randn(12, 2, generator=g, dtype=DT)
    torch.manual_seed(0)
    m = OldNet().to(DT)

    def forward(p, x):  # the same function with torch.tanh
        return torch.tanh(x @ p["a.weight"].T + p["a.bias"]) @ p["o.weight"].T + p["o.bias"]

    assert torch.allclose(forward(dict(m.named_parameters()), X), m(X), atol=1e-15, rtol=0)
    _check(m, X, Y, _dense(m, forward, X, Y), "an old-style autograd.Function")


def test_an_old_style_function_that_cannot_be_differentiated_twice_is_refused() -> None:
    g = torch.Generator().manual_seed(2)
    X, Y = torch.randn(12, 5, generator=g, dtype=DT), torch.randn(12, 2, generator=g, dtype=DT)
    torch.manual_seed(0)
    op = hessian_operator(OldNet(_OldTanhOnce).to(DT), X, Y, part="H")
    with pytest.raises(Exception) as e:
        op.matvec(torch.ones(op.shape[0], dtype=DT))
    assert "once_differentiable" in str(e.value) or "twice" in str(e.value), str(e.value)


def test_the_last_bag_runs_to_the_inputs_end_as_pytorchs() -> None:
    """include_last_offset with offsets[-1] short of the input: PyTorch's kernel runs the last bag to
    the end ([9, 19] below); the composite stopped at the last offset ([9, 6]), a review's finding."""
    W = torch.arange(10, dtype=DT).reshape(10, 1)
    ids, offsets = torch.tensor([2, 3, 4, 6, 7, 6]), torch.tensor([0, 3, 5])
    for mode in ("sum", "mean", "max"):
        want = F.embedding_bag(ids, W, offsets, mode=mode, include_last_offset=True)
        got = embedding_bag(ids, W, offsets, mode=mode, include_last_offset=True)
        assert torch.equal(got, want), (mode, got.ravel().tolist(), want.ravel().tolist())


class _Checkpointed(nn.Module):
    """The hidden layer under non-reentrant activation checkpointing (torch.func: "don't yet support
    saved tensor hooks")."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(5, 6), nn.Linear(6, 2)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.o(checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=False))


class _Differentiates(nn.Module):
    """Outputs u(x) and ∂u/∂x₀ by torch.autograd.grad inside the forward (a physics-informed net:
    torch.func refuses its ``requires_grad_()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(5, 6), nn.Linear(6, 1)

    def forward(self, x):
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            u = self.o(torch.tanh(self.a(x)))
            du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
        return torch.cat([u, du[:, :1]], 1)


def test_models_torch_func_cannot_transform_take_plain_autograd() -> None:
    """Non-reentrant checkpointing and a forward that differentiates itself failed H, I and S with
    torch.func's error (an audit), where plain autograd differentiates them; the references are the
    same functions written without either."""
    g = torch.Generator().manual_seed(2)
    X, Y = torch.randn(12, 5, generator=g, dtype=DT), torch.randn(12, 2, generator=g, dtype=DT)
    torch.manual_seed(0)

    def plain(p, x):
        return torch.tanh(x @ p["a.weight"].T + p["a.bias"]) @ p["o.weight"].T + p["o.bias"]

    def by_hand(p, x):  # u and ∂u/∂x₀ = Σ_j o_j (1 − tanh²(a_j·x + b_j)) a_j0
        h = torch.tanh(x @ p["a.weight"].T + p["a.bias"])
        u = h @ p["o.weight"].T + p["o.bias"]
        return torch.cat([u, ((1 - h**2) * p["o.weight"][0]) @ p["a.weight"][:, :1]], 1)

    for m, forward, what in [(_Checkpointed(), plain, "checkpointed"), (_Differentiates(), by_hand, "a PINN")]:
        m = m.to(DT)
        assert torch.allclose(forward(dict(m.named_parameters()), X), m(X), atol=1e-14, rtol=0), what
        _check(m, X, Y, _dense(m, forward, X, Y), what)
