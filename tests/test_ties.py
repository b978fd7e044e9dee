"""Products at ties and kinks take the backward's derivative in every mode.

An audit (session 30): with zero biases and the origin among the points (the 2-D image task's coordinate
grid holds it), pre-activations are exactly 0 and two branches tie.  There PyTorch 2.13's forward-mode
rules are not the transposes of the backward — PReLU's slope 1 at 0 against its weight, fmax and clamp
with tensor bounds the other branch's tangent, atan2 at (0, 0) and nan_to_num of a masked softmax row a
NaN tangent — and the forward-mode products disagreed with `gram` (reverse mode, exact): the operator's G
0.08 off and not symmetric, I 0.03–0.05 off JᵀJ/N, ``jacobian_vector_product`` 0.19 off J·t, NaN in
H, I, S and the operator, status done.  The reference is per-sample reverse-mode autograd.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.hessian import hessian_parts
from nsa_dist.ntk import gram, jacobian_vector_product, ntk_operator

F64 = torch.float64


class _Tie(nn.Module):
    """Two zero-bias branches u, v (equal, 0, at the origin) joined by ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b, self.o = nn.Linear(2, 4), nn.Linear(2, 4), nn.Linear(4, 1)
        if how == "prelu":
            self.act = nn.PReLU(4, init=0.2)
        nn.init.zeros_(self.a.bias)
        nn.init.zeros_(self.b.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, v = self.a(x), self.b(x)
        if self.how == "prelu":
            h = self.act(u) + v
        elif self.how == "fmax":
            h = torch.fmax(u, v)
        elif self.how == "clamp":
            h = torch.clamp(u, min=v)
        elif self.how == "atan2":
            h = torch.atan2(u, v)
        else:  # a softmax over the positive scores, a row with none made 0
            h = torch.softmax(u.masked_fill(u <= 0, float("-inf")), -1).nan_to_num(0.0) * v + v
        return self.o(h)


def _grid(dtype: torch.dtype) -> torch.Tensor:
    g = torch.linspace(-1, 1, 3, dtype=dtype)
    return torch.cartesian_prod(g, g)  # 9 points, the origin among them


def _jacobian(model: nn.Module, X: torch.Tensor) -> torch.Tensor:
    ps = [p for p in model.parameters() if p.requires_grad]
    rows = [
        torch.cat([t.reshape(-1) for t in torch.autograd.grad(model(X[i : i + 1]).sum(), ps)]) for i in range(len(X))
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("how", ["prelu", "fmax", "clamp", "atan2", "masked-softmax"])
def test_forward_mode_products_take_the_backwards_derivative_at_ties(how: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = _Tie(how).to(dtype)
    X = _grid(dtype)
    N, tol = X.shape[0], 1e-12 if dtype == F64 else 1e-5
    J = _jacobian(model, X)
    assert J.isfinite().all(), "the reference J is not finite"
    G = J @ J.T
    scale = float(G.abs().max())
    got = {
        "gram": gram(model, X, dtype=dtype),
        "operator": ntk_operator(model, X, dtype=dtype).matmat(torch.eye(N, dtype=dtype)),
    }
    for name, Gx in got.items():
        err = float((Gx - G).abs().max()) / scale
        assert err < tol, f"{how}: {name}'s G is {err:.3g} of max|G| off J Jᵀ (reverse mode)"
    t = torch.randn(J.shape[1], dtype=dtype)
    jt = jacobian_vector_product(model, X, t).reshape(-1)
    err = float((jt - J @ t).abs().max() / (J @ t).abs().max())
    assert err < tol, f"{how}: J·dθ is {err:.3g} (relative) off J t"
    Y = torch.randn(N, 1, dtype=dtype)
    H, I, S = (op.matmat(torch.eye(J.shape[1], dtype=dtype)) for op in hessian_parts(model, X, Y, dtype=dtype))
    for name, M in (("H", H), ("I", I), ("S", S)):
        assert M.isfinite().all(), f"{how}: {name} holds {int((~M.isfinite()).sum())} non-finite entries"
    Iref = J.T @ J / N
    err = float((I - Iref).abs().max() / Iref.abs().max())
    assert err < tol, f"{how}: I is {err:.3g} of max|I| off JᵀJ/N"
    h = float(H.abs().max())
    assert float((H - H.T).abs().max()) < tol * h, f"{how}: H is not symmetric"
    assert float((H - I - S).abs().max()) < tol * h, f"{how}: H ≠ I + S"


class _LpPool(nn.Module):
    """lp_pool (a square root) over windows that are all zero at the origin, after a relu."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(2, 6), nn.Linear(3, 1)
        nn.init.zeros_(self.a.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.nn.functional.lp_pool1d(torch.relu(self.a(x)).unsqueeze(1), 2, 2).squeeze(1))


def test_a_forward_mode_nan_is_named_not_blamed_on_hooks() -> None:
    """Forward mode's 0·∞ at sqrt(0) (reverse mode stays finite through the relu's where): the adjoint test
    cannot tell, and said "a gradient hook … or a custom autograd.Function" (an audit) — it now names the NaN."""
    torch.manual_seed(0)
    with pytest.raises(UnsupportedModelError, match="by forward mode is NaN") as e:
        gram(_LpPool().double(), _grid(F64))
    assert "register_hook" not in str(e.value), str(e.value)


def test_the_composites_keep_the_ops_values() -> None:
    """Inside ties_as_backward every rewritten op returns torch's own value — NaN bounds of clamp and a
    16-bit nan_to_num with an out-of-range replacement included (a review: the where composite returned x
    for a NaN bound, and full_like raised on 1e6 in float16)."""
    from nsa_dist.ntk.state import ties_as_backward

    x = torch.tensor([0.2, -3.0, 0.0, float("nan")], dtype=F64)
    nanb = torch.full_like(x, float("nan"))
    w = torch.tensor([0.25], dtype=F64)
    cases = [
        (torch.clamp, (x,), {"min": nanb}),
        (torch.clamp, (x,), {"min": torch.zeros_like(x), "max": torch.ones_like(x)}),
        (torch.clamp, (x,), {"max": torch.zeros_like(x)}),
        (torch.fmax, (x, torch.zeros_like(x)), {}),
        (torch.atan2, (torch.tensor([0.0, -0.0, 1.0], dtype=F64), torch.tensor([-0.0, 0.0, 0.0], dtype=F64)), {}),
        (torch.nan_to_num, (torch.tensor([float("nan"), float("inf"), 1.0], dtype=torch.float16),), {"nan": 1e6}),
        (torch.nan_to_num, (torch.tensor([float("-inf"), 2.0], dtype=F64),), {}),
        (torch.nn.functional.prelu, (x.reshape(1, 4, 1),), {"weight": w}),
    ]
    for op, args, kwargs in cases:
        want = op(*args, **kwargs)
        with ties_as_backward():
            got = op(*args, **kwargs)
        assert got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan()), (op.__name__, got, want)
        assert torch.equal(got[~got.isnan()], want[~want.isnan()]), (op.__name__, got, want)
