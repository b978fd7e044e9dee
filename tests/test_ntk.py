"""Every NTK path against the dense float64 reference J Jᵀ from torch.func.jacrev."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nsa_dist.config import ModelSpec
from nsa_dist.errors import NonFiniteError, ShapeError, UnsupportedModelError
from nsa_dist.models import build_model
from nsa_dist.ntk import NTKMethod, gram, ntk_operator, resolve_method
from tests.conftest import assert_close_rel, dense_ntk

F64 = torch.float64
ACTIVATIONS = ["leaky_relu", "relu", "tanh", "erf", "softplus", "gelu"]


def _net(**kw) -> nn.Module:
    return build_model(ModelSpec(**{"width": 12, "depth": 3, **kw}), seed=3, dtype=F64)


def _x(n: int, d: int = 2) -> torch.Tensor:
    return torch.rand(n, d, dtype=F64) * 2 - 1


@pytest.mark.parametrize("depth", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("method", ["structured", "jacobian"])
def test_depths_match_dense(depth, method):
    model, x = _net(depth=depth), _x(23)
    assert_close_rel(gram(model, x, method=method, block_size=7), dense_ntk(model, x), 1e-10, f"{method} depth {depth}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("init", ["xavier", "ntk"])
def test_every_activation_and_init(activation, init):
    model, x = _net(activation=activation, init=init, bias_scale=0.3), _x(19)
    ref = dense_ntk(model, x)
    for method in ("structured", "jacobian"):
        assert_close_rel(gram(model, x, method=method, block_size=6), ref, 1e-10, f"{method} {activation} {init}")


@pytest.mark.parametrize("init", ["xavier", "ntk"])
def test_residual_net(init):
    model, x = _net(depth=5, residual=True, init=init, activation="tanh"), _x(21)
    assert model.residual
    ref = dense_ntk(model, x)
    assert_close_rel(gram(model, x, method="structured", block_size=8), ref, 1e-10, "structured residual")
    assert_close_rel(gram(model, x, method="jacobian", block_size=8), ref, 1e-10, "jacobian residual")


@pytest.mark.parametrize("method", ["structured", "jacobian"])
def test_multi_output_full_and_traced(method):
    model, x = _net(output_dim=3, activation="gelu"), _x(17, d=4 if False else 2)
    full_ref = dense_ntk(model, x, full=True)
    assert_close_rel(gram(model, x, method=method, kernel="full", block_size=5), full_ref, 1e-10, "full")
    assert_close_rel(
        gram(model, x, method=method, block_size=5), full_ref.diagonal(dim1=1, dim2=3).sum(-1), 1e-10, "trace"
    )


@pytest.mark.parametrize("method", ["structured", "jacobian"])
@pytest.mark.parametrize("kernel", ["trace", "full"])
def test_cross_gram_x2(method, kernel):
    model, x1, x2 = _net(output_dim=2, init="ntk"), _x(13), _x(9)
    ref = dense_ntk(model, torch.cat([x1, x2]), full=kernel == "full")
    ref = ref[:13, :, 13:, :] if kernel == "full" else ref[:13, 13:]
    assert_close_rel(gram(model, x1, x2, method=method, kernel=kernel, block_size=4), ref, 1e-10, "x2 != x1")


@pytest.mark.parametrize("block", [1, 3, 7, 16, 50, 1000])
def test_block_size_does_not_change_result(block):
    model, x = _net(depth=4), _x(37)
    ref = gram(model, x, method="structured", block_size=37)
    G = gram(model, x, method="structured", block_size=block)
    assert_close_rel(G, ref, 1e-13, f"block {block}")
    assert torch.equal(G, G.T), "symmetric Gram must be exactly symmetric"
    assert_close_rel(gram(model, x, method="jacobian", block_size=block), ref, 1e-12, f"jacobian block {block}")


def test_layer_groups_split_and_padding(monkeypatch):
    """Feature memory budget forcing one layer per group gives the same Gram."""
    from nsa_dist.ntk import _structured

    model, x = _net(depth=4, width=9), _x(30)
    ref = dense_ntk(model, x)
    monkeypatch.setattr(_structured, "_MIN_FEATURE_BYTES", 1.0)
    monkeypatch.setattr(_structured, "_FEATURE_FRACTION", 1e-9)
    layers = _structured.linear_layers(model, x[:2])
    assert len(_structured._layer_groups(layers, 30, 1, 8, 30 * 30 * 8)) == len(layers)
    assert_close_rel(gram(model, x, method="structured", block_size=8), ref, 1e-10, "one layer per group")


def test_float32_model_with_float64_compute_and_frozen_layers():
    model = build_model(ModelSpec(depth=3, width=10), seed=0)  # float32
    model.layers[0].weight.requires_grad_(False)
    model.layers[2].bias.requires_grad_(False)
    x = _x(15).float()
    ref = dense_ntk(build_model(ModelSpec(depth=3, width=10), seed=0, dtype=F64).requires_grad_(True), x.double())
    G = gram(model, x, dtype=F64)
    assert G.dtype == F64
    m64 = model.double()
    assert_close_rel(G, dense_ntk(m64, x.double()), 1e-10, "frozen params excluded")
    assert not torch.allclose(G, ref), "freezing parameters must change the kernel"


def test_layernorm_takes_the_per_layer_path():
    model = nn.Sequential(nn.Linear(2, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 1)).double()
    x = _x(11)
    assert resolve_method(model, x) is NTKMethod.PER_LAYER
    with pytest.raises(UnsupportedModelError, match="LayerNorm"):
        gram(model, x, method="structured")
    assert_close_rel(gram(model, x), dense_ntk(model, x), 1e-10, "auto → per_layer")


def test_weight_sharing_is_rejected_by_structured():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(3, 3)
            self.first = nn.Linear(2, 3)
            self.out = nn.Linear(3, 1)

        def forward(self, x):
            return self.out(torch.tanh(self.inner(torch.tanh(self.inner(self.first(x)))))).squeeze(-1)

    model, x = Twice().double(), _x(9)
    with pytest.raises(UnsupportedModelError, match="called 2 times"):
        gram(model, x, method="structured")
    assert resolve_method(model, x) is NTKMethod.PER_LAYER  # `inner` by Jacobians, the others per layer
    assert_close_rel(gram(model, x), dense_ntk(model, x), 1e-10, "shared weights via jacobian")


@pytest.mark.parametrize("kernel", ["trace", "full"])
def test_operator_matches_dense(kernel):
    model, x = _net(output_dim=2, activation="softplus"), _x(14)
    ref = dense_ntk(model, x, full=kernel == "full")
    op = ntk_operator(model, x, kernel=kernel, block_size=4)
    n = ref.shape[0] * (ref.shape[1] if kernel == "full" else 1)
    ref2 = ref.reshape(n, n)
    assert op.shape == (n, n)
    assert_close_rel(op.to_dense(), ref2, 1e-10, f"operator {kernel}")
    V = torch.randn(n, 3, dtype=F64)
    assert_close_rel(op.matmat(V), ref2 @ V, 1e-10, "matmat")
    v = V[:, 0].numpy()
    out = op.matvec(v)
    assert out.shape == (n,) and type(out) is type(v)
    assert_close_rel(torch.from_numpy(out), ref2 @ V[:, 0], 1e-10, "numpy matvec")


def test_bad_inputs_raise_clear_errors():
    model, x = _net(), _x(5)
    with pytest.raises(ShapeError, match=r"x1 must have shape \(n, d\)"):
        gram(model, x[0])
    with pytest.raises(ShapeError, match="same input dimension"):
        gram(model, x, _x(4, d=3))
    bad = x.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(NonFiniteError, match="x1 holds 1 NaN"):
        gram(model, bad)
    bad[2, 1] = float("inf")
    with pytest.raises(NonFiniteError, match="x2"):
        gram(model, x, bad)
    with pytest.raises(ValueError, match="method='fast' is not one of"):
        gram(model, x, method="fast")
    with pytest.raises(ValueError, match="kernel='diag'"):
        gram(model, x, kernel="diag")
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        gram(model, x, block_size=0)
    with pytest.raises(ShapeError, match=r"\(n,\) or \(n, K\)"):
        gram(nn.Sequential(nn.Linear(2, 6), nn.Unflatten(1, (2, 3))).double(), x)
    seq = nn.Linear(3, 2).double()  # (n, T, 3) → (n, T, 2): one point's outputs are all its outputs, not x2's
    with pytest.raises(ShapeError, match=r"\(n,\) or \(n, K\)"):  # (autograd's raw shape error, an audit)
        gram(seq, torch.randn(1, 4, 3, dtype=F64), torch.randn(4, 4, 3, dtype=F64))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        gram(lambda t: t, x)
    with pytest.raises(ShapeError, match="operator of shape"):
        ntk_operator(model, x).matmat(torch.zeros(4, 1, dtype=F64))


def test_conv_model_structured_forced_is_rejected():
    model = nn.Sequential(nn.Unflatten(1, (1, 4)), nn.Conv1d(1, 2, 3), nn.Flatten(), nn.Linear(4, 1)).double()
    x = _x(6, d=4)
    with pytest.raises(UnsupportedModelError, match="Conv1d"):
        gram(model, x, method="structured")
    assert_close_rel(gram(model, x), dense_ntk(model, x), 1e-10, "conv via auto")


@pytest.mark.parametrize("n,block", [(300, 16), (250, 13), (400, 24)])
def test_in_place_symmetric_path_matches_dense(n, block):
    """Features kept in G's lower tiles (one pass, no extra memory) give the exact Gram."""
    from nsa_dist.ntk import _structured

    model, x = _net(depth=3, width=5, output_dim=2), _x(n)
    layers = _structured.linear_layers(model, x[:2])
    width = sum(lay.n_cols + 2 * lay.n_out for lay in layers)
    plan = _structured._lower_slots(n, block, width)
    assert plan is not None, "this case must exercise the in-place path"
    rows = {}  # no two blocks' feature regions overlap, and none reaches the diagonal
    for I, (r0, c0) in enumerate(plan):
        for rr in range(r0, min(r0 + block, n)):
            span = range(c0, c0 + width)
            assert max(span) < r0, f"block {I} region touches column {max(span)} >= its row block start {r0}"
            assert not rows.get(rr, set()) & set(span), f"block {I} overlaps another block's features"
            rows.setdefault(rr, set()).update(span)
    G = gram(model, x, method="structured", block_size=block)
    assert_close_rel(G, dense_ntk(model, x), 1e-10, "in-place symmetric")
    assert torch.equal(G, G.T)


def test_gram_into_out_equals_a_fresh_one() -> None:
    """gram(out=...) writes the Gramian into the given buffer (structured: assembled there; other
    methods: copied) and returns it; its old contents do not leak in; a wrong buffer is named."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    x, x2 = torch.randn(40, 3, dtype=torch.float64), torch.randn(25, 3, dtype=torch.float64)
    for method in ("structured", "jacobian"):
        for b, shape in ((None, (40, 40)), (x2, (40, 25))):
            fresh = gram(mlp, x, b, method=method)
            out = torch.full(shape, float("nan"), dtype=torch.float64)
            got = gram(mlp, x, b, method=method, out=out)
            assert got is out
            torch.testing.assert_close(out, fresh, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"out must be a contiguous tensor of shape \(40, 40\), dtype torch.float64"):
        gram(mlp, x, out=torch.empty(40, 41, dtype=torch.float64))
    with pytest.raises(ValueError, match="dtype torch.float64 .* got shape \\(40, 40\\), dtype torch.float32"):
        gram(mlp, x, out=torch.empty(40, 40))
    with pytest.raises(ValueError, match="not contiguous"):
        gram(mlp, x, out=torch.empty(40, 40, dtype=torch.float64).T)
