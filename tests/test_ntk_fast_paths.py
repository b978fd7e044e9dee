"""The per-layer path's closed forms (grouped convolution, eval BatchNorm, LayerNorm, Embedding,
Linear at positions, self-attention projections) and its column groups, against float64 jacrev —
each asserting the route it must take, so a closed form cannot silently become the VJP fallback."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close_rel, dense_ntk
from torch import nn

from nsa_dist.ntk import explain_method, gram, inputs
from nsa_dist.ntk._probe import plan_forward
from nsa_dist.ntk.layer_features import _column_groups, per_layer_layers

F64 = torch.float64


class Mixed(nn.Module):
    """Every closed form once: grouped/strided Conv2d, eval BatchNorm2d, Conv1d + BatchNorm1d on
    (n, C) features, Embedding with padding_idx, LayerNorm without bias at positions, a Linear at
    positions, an unmasked self-attention, a factored head."""

    def __init__(self, K=2):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, stride=2, padding=1, groups=2)
        self.bn = nn.BatchNorm2d(4)
        self.conv1d = nn.Conv1d(4, 3, 2, dilation=2, bias=False)
        self.bn1d = nn.BatchNorm1d(3 * 2)
        self.emb = nn.Embedding(7, 6, padding_idx=0)
        self.ln = nn.LayerNorm(6, bias=False)
        self.att = nn.MultiheadAttention(6, 2, batch_first=True)
        self.pos = nn.Linear(6, 6)
        self.head = nn.Linear(6 + 6, K)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.3, 0.3)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn1d.running_mean.uniform_(-0.3, 0.3)
            self.bn1d.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)
        self.eval()

    def forward(self, x):  # x (n, 2·4·4 + 5): an image and 5 token ids, flattened
        img, ids = x[:, :32].reshape(-1, 2, 4, 4), x[:, 32:].long()
        h = torch.tanh(self.bn(self.conv(img)))  # (n, 4, 2, 2)
        h = self.conv1d(h.flatten(2))  # (n, 3, 2)
        h = torch.tanh(self.bn1d(h.flatten(1)))  # (n, 6)
        t = self.ln(self.emb(ids))  # (n, 5, 6)
        t = t + self.att(t, t, t, need_weights=False)[0]
        t = torch.tanh(self.pos(t)).mean(1)  # (n, 6)
        return self.head(torch.cat([h, t], dim=1))


def _points(n):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 7, (n, 5), generator=g)
    ids[0, :2] = 0  # padding tokens
    return torch.cat([torch.randn(n, 32, generator=g, dtype=F64), ids.to(F64)], dim=1)


def test_every_closed_form_takes_its_route_and_matches_jacrev():
    torch.manual_seed(0)
    model, x = Mixed().double(), _points(7)
    method, routes = explain_method(model, x)
    assert method.value == "per_layer" and {p for p, _ in routes.values()} == {"per_layer", "structured"}, routes
    names = {m: n for n, m in model.named_modules()}
    kinds = {
        names[lay.module] if lay.module in names else "att." + lay.module.names[0]: lay.kind
        for lay in per_layer_layers(plan_forward(model, x))
    }
    assert kinds == {
        "conv": "conv",
        "bn": "bn",
        "conv1d": "conv",
        "bn1d": "bn",
        "emb": "emb",
        "ln": "ln",
        "att.in_proj_weight": "linear",
        "att.out_proj.weight": "linear",
        "pos": "linear",
        "head": "factor",
    }, kinds
    for full in (False, True):
        assert_close_rel(
            gram(model, x, kernel="full" if full else "trace", block_size=3),
            dense_ntk(model, x, full=full),
            1e-10,
            f"mixed model ({'full' if full else 'trace'})",
        )
    x2 = _points(4)[1:]
    assert_close_rel(gram(model, x, x2), dense_ntk(model, x, x2), 1e-10, "mixed model, cross kernel")


@pytest.mark.parametrize("kernel", ["trace", "full"])
def test_column_groups_give_the_same_kernel(monkeypatch, kernel):
    """Formed columns over FEATURE_BYTES are split into groups, one pass each: same G."""
    torch.manual_seed(1)
    model, x = Mixed(K=2).double(), _points(6)
    formed = [lay for lay in per_layer_layers(plan_forward(model, x)) if not lay.factored]
    P = sum(lay.n_formed for lay in formed)
    monkeypatch.setattr(inputs, "FEATURE_BYTES", (6 + 3) * 2 * P * 8 / 3)  # about a third of M (x and x2)
    groups = _column_groups(formed, {}, (6 + 3) * 2, 8)
    assert len(groups) >= 3, groups
    assert sorted((id(lay) for ls, _ in groups for lay in ls)) == sorted(id(lay) for lay in formed)  # each once
    full = kernel == "full"
    assert_close_rel(
        gram(model, x, kernel=kernel, block_size=4),
        dense_ntk(model, x, full=full),
        1e-10,
        f"column groups, symmetric {kernel}",
    )
    x2 = _points(3)
    assert_close_rel(
        gram(model, x, x2, kernel=kernel), dense_ntk(model, x, x2, full=full), 1e-10, f"column groups, cross {kernel}"
    )


def test_generic_parameters_in_their_own_group(monkeypatch):
    """Parameters on the per-sample Jacobian path (a tied weight) with a budget that splits M."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(2, 2, 3, padding=1)
            self.c2 = nn.Conv2d(2, 3, 3, padding=1)
            self.fc = nn.Linear(3 * 4 * 4, 1)

        def forward(self, x):
            return self.fc(torch.tanh(self.c2(torch.tanh(self.c(torch.tanh(self.c(x)))))).flatten(1)).squeeze(-1)

    model, x = Tied().double(), torch.randn(5, 2, 4, 4, dtype=F64)
    _, routes = explain_method(model, x)
    assert routes["c.weight"][0] == "jacobian" and routes["c2.weight"][0] == "per_layer", routes
    gen = {"c.weight": 36, "c.bias": 2}
    monkeypatch.setattr(inputs, "FEATURE_BYTES", 5 * 40 * 8)  # about a quarter of M: the tied weight alone
    formed = [lay for lay in per_layer_layers(plan_forward(model, x)) if not lay.factored]
    groups = _column_groups(formed, gen, 5, 8)
    assert [(len(ls), names) for ls, names in groups] == [(0, ("c.weight",)), (0, ("c.bias",)), (1, ())], groups
    assert_close_rel(gram(model, x), dense_ntk(model, x), 1e-10, "tied conv, column groups")
    assert_close_rel(
        gram(model, x, x[:2] + 1, kernel="full"),
        dense_ntk(model, x, x[:2] + 1, full=True),
        1e-10,
        "tied conv, column groups, cross full",
    )


def test_wide_strided_convolution_matches_jacrev():
    """The grouped convolution_backward with many channels per sample, stride and padding."""
    torch.manual_seed(4)
    model = nn.Sequential(
        nn.Conv2d(64, 3, 3, stride=2, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(3, 2, 2),
        nn.Flatten(),
        nn.Linear(2, 2),
    ).double()
    x = torch.randn(4, 64, 4, 4, dtype=F64)
    assert [lay.kind for lay in per_layer_layers(plan_forward(model, x))] == ["conv", "conv", "factor"]
    for full in (False, True):
        assert_close_rel(
            gram(model, x, kernel="full" if full else "trace"),
            dense_ntk(model, x, full=full),
            1e-10,
            f"wide conv ({'full' if full else 'trace'})",
        )


@pytest.mark.parametrize("kernel", ["trace", "full"])
def test_contraction_in_column_chunks_and_uneven_tiles(monkeypatch, kernel):
    """G += M_I[:, c] M_J[:, c]ᵀ over many column chunks, odd tile sizes, diagonal tiles split
    recursively down to sub-tiles of one point."""
    from nsa_dist.ntk import _contract

    monkeypatch.setattr(_contract, "_COLUMNS", 7)
    monkeypatch.setattr(_contract, "_MIN_SUB", 1)
    torch.manual_seed(5)
    model, x = Mixed(K=2).double(), _points(9)
    full = kernel == "full"
    for block in (1, 2, 5, 9):
        assert_close_rel(
            gram(model, x, kernel=kernel, block_size=block),
            dense_ntk(model, x, full=full),
            1e-10,
            f"column chunks of 7, block {block}, {kernel}",
        )
    x2 = _points(4)
    assert_close_rel(
        gram(model, x, x2, kernel=kernel, block_size=2),
        dense_ntk(model, x, x2, full=full),
        1e-10,
        f"column chunks of 7, cross {kernel}",
    )


def test_attention_with_an_instance_forward_is_left_alone():
    """A forward set on the instance (here a call-counting wrapper with the same output) is not
    the standard forward: the generic path, and the user's wrapper is still there afterwards."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = nn.MultiheadAttention(4, 2, batch_first=True)
            self.calls = 0
            std = self.att.forward

            def counted(*a, **k):
                self.calls += 1
                return std(*a, **k)

            self.att.forward = counted
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            return self.head(self.att(x, x, x)[0].mean(1)).squeeze(-1)

    torch.manual_seed(6)
    model, x = Net().double(), torch.randn(5, 3, 4, dtype=F64)
    wrapper = model.att.forward
    _, routes = explain_method(model, x)
    assert routes["att.in_proj_weight"][0] == "jacobian" and routes["att.out_proj.weight"][0] == "jacobian", routes
    assert_close_rel(gram(model, x), dense_ntk(model, x), 1e-10, "attention with an instance forward")
    assert model.att.forward is wrapper
    before = model.calls
    model(x)
    assert model.calls == before + 1


def test_features_and_tile_keep_their_contract():
    """``_features`` / ``_tile`` (used by the distributed layouts): Σ of tiles = the kernel, with
    jacobian_fn's Jacobians or any plain x ↦ (b, K, P) callable for the generic parameters."""
    from nsa_dist.ntk._jacobian import jacobian_fn
    from nsa_dist.ntk.layer_features import _features, _tile

    torch.manual_seed(7)
    model, x = Mixed(K=2).double(), _points(6)
    plan = plan_forward(model, x)
    layers = per_layer_layers(plan)
    names = ("att.in_proj_weight", "att.in_proj_bias")  # pretend generic: drop the projections' layers
    layers = [lay for lay in layers if getattr(lay.module, "names", (None,))[0] != "in_proj_weight"]
    assert len(layers) == len(per_layer_layers(plan)) - 1
    J = jacobian_fn(model, 2, names)
    for jac in (J, lambda xb: J(xb)):  # the second has no n_params attribute
        f = _features(model, layers, jac, x, 2)
        for full in (False, True):
            G = _tile(f, f, slice(0, 6), slice(0, 6), 2, full)
            assert_close_rel(
                G, dense_ntk(model, x, full=full), 1e-10, f"_features/_tile ({'full' if full else 'trace'})"
            )
