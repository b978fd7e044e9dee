"""Every assumption a fast NTK route makes about a layer, broken on purpose, one model each.

The structured and per-layer routes compute a layer's per-sample gradients from its input ``A``
and its output gradient ``δ``.  That holds only when the layer's input and output carry one row
per point, its output rows reach only their own point, it reads exactly its registered
parameters and the network uses the output it computed (docs/design-notes.md, "What a fast NTK
route assumes about a layer").  Each model below breaks one of these in a way people write;
``gram()`` must equal a float64 ``torch.func.jacrev`` reference, the layer that breaks the
assumption must take the exact route (saying which assumption failed) and a layer that does not
must stay fast.  The tests name the assumption, not a model.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_rel, dense_ntk
from torch import nn
from torch.nn.utils import parametrize

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.ntk import explain_method, gram

F64 = torch.float64
FAST = ("structured", "per_layer")


class TableBias(nn.Module):
    """Tokens (n, T, d) plus a bias that a small MLP computes from a table of T coordinates, a
    trainable parameter with no sample axis, broadcast-added to every point's activations (the
    continuous position bias of a windowed attention, in miniature).  With T equal to the number
    of probe points the table's leading axis has the batch's length."""

    def __init__(self, T=5, d=3):
        super().__init__()
        self.table = nn.Parameter(torch.randn(T, 2))
        self.cpb = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, d, bias=False))
        self.inp, self.head = nn.Linear(d, d), nn.Linear(d, 1)

    def forward(self, x):  # x (n, T·d)
        h = self.inp(x.view(x.shape[0], self.table.shape[0], -1))  # (n, T, d)
        h = h + 4 * torch.sigmoid(self.cpb(self.table))  # (T, d) broadcast over the points
        return self.head(torch.tanh(h)).mean(1).squeeze(-1)


class LeadingOne(nn.Module):
    """A Linear applied to a (1, T, d) parameter, its output broadcast over the batch."""

    def __init__(self, T=3, d=4):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, T, d))
        self.pos_proj, self.inp, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 1)

    def forward(self, x):  # x (n, T·d)
        h = self.inp(x.view(x.shape[0], self.pos.shape[1], -1)) + self.pos_proj(self.pos)
        return self.head(torch.tanh(h)).sum(1).squeeze(-1)


class PositionIds(nn.Module):
    """Position embeddings looked up by ``arange(T)`` (no sample axis) added to token embeddings."""

    def __init__(self, T=5, d=4, leading_one=False):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(7, d), nn.Embedding(T, d), nn.Linear(d, 1)
        self.leading_one = leading_one

    def forward(self, x):  # x (n, T) token ids as floats
        ids = torch.arange(x.shape[1])
        h = self.tok(x.long()) + self.pos(ids[None] if self.leading_one else ids)
        return self.head(torch.tanh(h)).mean(1).squeeze(-1)


class TransposedAxis(nn.Module):
    """Points (n, T, d), tested with n = T: a Linear applied to ``x.transpose(0, 1)``, whose leading axis has
    the batch's length but runs over positions, not points."""

    def __init__(self, T=4, d=3):
        super().__init__()
        self.T = T
        self.mix, self.inp, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 1)

    def forward(self, x):  # x (n, T·d)
        h = torch.tanh(self.inp(x.view(x.shape[0], self.T, -1)))  # (n, T, d)
        h = torch.tanh(self.mix(h.transpose(0, 1))).transpose(0, 1)  # the Linear on (T, n, d)
        return self.head(h).mean(1).squeeze(-1)


class Chain(nn.Module):
    """``head(tanh(b(tanh(a(x)))))``: ``a`` is the layer the tests tamper with, ``b`` stays fast."""

    def __init__(self, d=4, conv=False):
        super().__init__()
        self.conv = conv
        if conv:
            self.a, self.b = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 3)
            self.head = nn.Linear(2 * 2 * 2, 1)
        else:
            self.a, self.b, self.head = nn.Linear(d, 6), nn.Linear(6, 5), nn.Linear(5, 1)

    def mid(self, x):
        return torch.tanh(self.a(x))

    def forward(self, x):
        if self.conv:
            x = x.view(x.shape[0], 2, 4, 4)
        h = torch.tanh(self.b(self.mid(x)))
        return self.head(h.flatten(1)).squeeze(-1)


class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).T


def _parametrized():
    m = Chain()
    m.a = nn.Linear(4, 4)
    m.b = nn.Linear(4, 5)
    parametrize.register_parametrization(m.a, "weight", Symmetric())
    return m


def _weight_norm_new():
    m = Chain()
    torch.nn.utils.parametrizations.weight_norm(m.a)
    return m


def _weight_norm_old_conv():
    m = Chain(conv=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated but still used
        torch.nn.utils.weight_norm(m.a)
    return m


def _output_hook():
    m = Chain()
    m.a.register_forward_hook(lambda mod, args, out: 2 * out + 1)
    return m


def _output_hook_same_value():
    """The hook returns a tensor equal to the output whose gradient is twice the output's."""
    m = Chain()
    m.a.register_forward_hook(lambda mod, args, out: 2 * out - out.detach())
    return m


def _pre_hook_own_parameter():
    m = Chain()
    m.a.register_forward_pre_hook(lambda mod, args: (args[0] * mod.bias.sum(),))
    return m


def _pre_hook_input():
    m = Chain()
    m.a.register_forward_pre_hook(lambda mod, args: (torch.tanh(args[0]),))
    return m


def _instance_forward():
    m = Chain()
    a = m.a
    a.forward = lambda x: F.linear(x, a.weight * 1.5, a.bias)
    return m


class InPlaceAfter(Chain):
    """The output of ``a`` multiplied in place by a trainable gate, and a slice of it zeroed,
    before the network uses it."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.rand(6) + 0.5)

    def mid(self, x):
        z = self.a(x)
        z.mul_(self.gate)
        z[:, 0] = 0.0
        return torch.tanh(z)


class CalledTwice(Chain):
    """``a`` applied to the points and again to a (T, d) table of another shape."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(3, 4))

    def mid(self, x):
        return torch.tanh(self.a(x)) + torch.tanh(self.a(self.table)).mean(0)


class FunctionalReuse(Chain):
    """``a``'s weight also used through ``F.linear`` outside the module."""

    def mid(self, x):
        return torch.tanh(self.a(x)) + 0.5 * torch.tanh(F.linear(x, self.a.weight))


class SharedTable(nn.Module):
    """One embedding table registered in two modules, only the second of which is called (tied
    input embeddings as in a T5 encoder)."""

    def __init__(self):
        super().__init__()
        self.shared, self.tok, self.head = nn.Embedding(7, 4), nn.Embedding(7, 4), nn.Linear(4, 1)
        self.tok.weight = self.shared.weight

    def forward(self, x):  # x (n, T) token ids as floats
        return self.head(torch.tanh(self.tok(x.long()))).mean(1).squeeze(-1)


def _flat(n, width, g):
    return torch.randn(n, width, generator=g, dtype=F64)


def _ids(n, T, g):
    return torch.randint(0, 7, (n, T), generator=g).to(F64)


# name → (model, points (generator ↦ x), {parameter: (route, reason starts with)}, a parameter that stays fast)
CASES = {
    "sample_axis/table_broadcast": (
        lambda: TableBias(T=5),
        lambda g: _flat(6, 15, g),
        {"cpb.0.weight": ("jacobian", "sample axis"), "cpb.2.weight": ("jacobian", "sample axis")},
        "inp.weight",
    ),
    "sample_axis/table_with_the_batch_length": (
        lambda: TableBias(T=4),
        lambda g: _flat(4, 12, g),
        {"cpb.0.weight": ("jacobian", "sample axis"), "cpb.2.weight": ("jacobian", "sample axis")},
        "inp.weight",
    ),
    "sample_axis/leading_one": (
        LeadingOne,
        lambda g: _flat(6, 12, g),
        {"pos_proj.weight": ("jacobian", "sample axis")},
        "inp.weight",
    ),
    "sample_axis/position_ids": (
        PositionIds,
        lambda g: _ids(6, 5, g),
        {"pos.weight": ("jacobian", "sample axis")},
        "tok.weight",
    ),
    "sample_axis/position_ids_leading_one": (
        lambda: PositionIds(leading_one=True),
        lambda g: _ids(6, 5, g),
        {"pos.weight": ("jacobian", "sample axis")},
        "tok.weight",
    ),
    "sample_axis/transposed_axis_of_batch_length": (
        TransposedAxis,
        lambda g: _flat(4, 12, g),
        {"mix.weight": ("jacobian", "sample axis")},
        "inp.weight",
    ),
    "reads_its_parameters/parametrization": (
        _parametrized,
        lambda g: _flat(6, 4, g),
        {"a.parametrizations.weight.original": ("jacobian", "reads its"), "a.bias": ("jacobian", "reads its")},
        "b.weight",
    ),
    "reads_its_parameters/weight_norm": (
        _weight_norm_new,
        lambda g: _flat(6, 4, g),
        {"a.parametrizations.weight.original0": ("jacobian", "reads its"), "a.bias": ("jacobian", "reads its")},
        "b.weight",
    ),
    "reads_its_parameters/weight_norm_hook_conv": (
        _weight_norm_old_conv,
        lambda g: _flat(6, 32, g),
        {"a.weight_g": ("jacobian", "reads its"), "a.weight_v": ("jacobian", "reads its")},
        "b.weight",
    ),
    "reads_its_parameters/instance_forward": (
        _instance_forward,
        lambda g: _flat(6, 4, g),
        {"a.weight": ("jacobian", "reads its")},
        "b.weight",
    ),
    "reads_its_parameters/pre_hook_uses_own_parameter": (
        _pre_hook_own_parameter,
        lambda g: _flat(6, 4, g),
        {"a.bias": ("jacobian", "called once")},
        "b.weight",
    ),
    "returns_its_output/forward_hook_replaces_output": (
        _output_hook,
        lambda g: _flat(6, 4, g),
        {"a.weight": ("jacobian", "returns its output")},
        "b.weight",
    ),
    "returns_its_output/forward_hook_same_value_other_gradient": (
        _output_hook_same_value,
        lambda g: _flat(6, 4, g),
        {"a.weight": ("jacobian", "returns its output")},
        "b.weight",
    ),
    "called_once/twice_with_different_shapes": (
        CalledTwice,
        lambda g: _flat(6, 4, g),
        {"a.weight": ("jacobian", "called once")},
        "b.weight",
    ),
    "called_once/tied_through_a_module_not_called": (
        SharedTable,
        lambda g: _ids(6, 5, g),
        {"shared.weight": ("jacobian", "called once")},
        "head.weight",
    ),
    "called_once/weight_reused_functionally": (
        FunctionalReuse,
        lambda g: _flat(6, 4, g),
        {"a.weight": ("jacobian", "called once")},
        "b.weight",
    ),
    # proven and kept fast: the formula reads the input the forward saw (after the pre-hook) and
    # differentiates the output before the in-place changes (the network gets a copy)
    "proven/pre_hook_changes_input": (
        _pre_hook_input,
        lambda g: _flat(6, 4, g),
        {"a.weight": ("structured", "")},
        "b.weight",
    ),
    "proven/output_changed_in_place": (
        InPlaceAfter,
        lambda g: _flat(6, 4, g),
        {"a.weight": ("structured", "")},
        "b.weight",
    ),
}


def _routes_text(routes):
    return "\n".join(f"  {k}: {p} — {w}" for k, (p, w) in routes.items())


@pytest.mark.parametrize("name", list(CASES))
def test_broken_assumption_takes_the_exact_route(name):
    make, points, want, fast = CASES[name]
    torch.manual_seed(0)
    model = make().double().eval()
    x = points(torch.Generator().manual_seed(1))
    _, routes = explain_method(model, x)
    G = gram(model, x)
    ref = dense_ntk(model, x)  # functional_call: the model is unchanged (weight_norm's hook cannot be deep-copied)
    err = float(((G - ref).abs().max() / ref.abs().max()).item()) if torch.isfinite(G).all() else float("inf")
    assert err <= 1e-12, f"{name}: gram is off by {err:.3e} (max relative to max |G|); routes:\n{_routes_text(routes)}"
    for pname, (path, why) in want.items():
        got_path, got_why = routes[pname]
        assert got_path == path and got_why.startswith(why), (
            f"{name}: {pname} took {got_path} ({got_why}), expected {path} ({why}…); routes:\n{_routes_text(routes)}"
        )
    assert routes[fast][0] in FAST, f"{name}: {fast} should stay fast; routes:\n{_routes_text(routes)}"


def test_cross_kernel_with_a_table_of_the_batch_length():
    """The probe sees 4 points and a 4-row table; the cross kernel's second set has another length."""
    torch.manual_seed(0)
    model = TableBias(T=4).double().eval()
    g = torch.Generator().manual_seed(2)
    x1, x2 = _flat(4, 12, g), _flat(7, 12, g)
    ref = dense_ntk(model, torch.cat([x1, x2]))[:4, 4:]
    G = gram(model, x1, x2)
    err = float(((G - ref).abs().max() / ref.abs().max()).item())
    assert err <= 1e-12, f"cross kernel off by {err:.3e}"


def _batch_reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """G = Σ_a J_a J_aᵀ of the full-batch forward by plain autograd, one output at a time (a train-mode
    BatchNorm updates its running statistics in the forward, which jacrev refuses)."""
    import copy

    m = copy.deepcopy(model).double()
    ps = [p for p in m.parameters() if p.requires_grad]
    out = m(x.double()).reshape(x.shape[0], -1)
    rows = [
        torch.cat(
            [
                (g if g is not None else torch.zeros_like(p)).reshape(-1)
                for g, p in zip(torch.autograd.grad(out[i, a], ps, retain_graph=True, allow_unused=True), ps)
            ]
        )
        for i in range(out.shape[0])
        for a in range(out.shape[1])
    ]
    J = torch.stack(rows).view(out.shape[0], out.shape[1], -1)
    return torch.einsum("iap,jap->ij", J, J)


def _conv_bn(n_out: int, flat: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3),
        nn.BatchNorm2d(3, track_running_stats=False),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(flat, n_out),
    )


def test_batch_statistics_couple_even_where_the_halves_agree():
    """A batch norm on the batch's own statistics couples the samples by construction; the probe's
    halves-against-whole comparison misses it where the probe points repeat ([a, b, a, b]: the halves
    have the batch's statistics) or the outputs are constant (a zero-initialised readout): each gave
    a silently wrong Gram on the per-layer route (0.47, and 0.028 with 128-point feature chunks)."""
    torch.manual_seed(0)
    X = torch.randn(12, 2, 5, 5)
    X[2:4] = X[0:2]
    m = _conv_bn(2, 27)
    assert_close_rel(gram(m, X, dtype=torch.float64), _batch_reference(m, X), 1e-9, "repeated probe points")
    X = torch.randn(160, 2, 4, 4)
    m = _conv_bn(1, 12)
    nn.init.zeros_(m[4].weight)
    assert explain_method(m, X)[0].value == "batch"
    assert_close_rel(gram(m, X, dtype=torch.float64), _batch_reference(m, X), 1e-9, "zero readout, N = 160")
    m = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).train()
    nn.init.zeros_(m[3].weight)
    X = torch.randn(12, 6)
    before = m[1].running_mean.clone()
    assert_close_rel(gram(m, X, dtype=torch.float64), _batch_reference(m, X), 1e-9, "train-mode BatchNorm1d")
    assert torch.equal(m[1].running_mean, before)


def test_an_embedding_that_scales_its_gradient_by_frequency_gives_the_derivatives_kernel():
    """``scale_grad_by_freq`` rescales autograd's gradient by token counts — not the function's
    derivative, which the NTK is made of (the per-layer route was off by 1.3e-2); the flag is back on
    afterwards."""

    class Emb(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(10, 4, scale_grad_by_freq=True)
            self.h = nn.Linear(4, 2)

        def forward(self, t):
            return self.h(torch.tanh(self.e(t))).mean(1)

    torch.manual_seed(0)
    ids = torch.randint(0, 10, (12, 5))
    m = Emb().double()
    plain = Emb().double()
    plain.load_state_dict(m.state_dict())
    plain.e.scale_grad_by_freq = False
    for method in ("auto", "jacobian", "batch"):
        assert_close_rel(gram(m, ids, dtype=torch.float64, method=method), dense_ntk(plain, ids), 1e-10, method)
    assert m.e.scale_grad_by_freq


def test_a_hand_written_coupling_is_found_on_repeated_probe_points():
    """``h − h.mean(0)`` couples the samples; on probe points [a, b, a, b] the halves have the batch's
    mean, so the halves-vs-whole comparison saw nothing and the per-layer route was 0.26 off.  The
    probe also moves the other points ([a, a, a, a]) and compares point 0's output and gradient."""

    class Centred(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.h = nn.Linear(5, 8), nn.Linear(8, 1)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            return self.h(h - h.mean(0, keepdim=True))

    torch.manual_seed(0)
    for zero in (False, True):
        m = Centred().double()
        if zero:
            nn.init.zeros_(m.h.weight)
        X = torch.randn(12, 5, dtype=torch.float64)
        X[2:4] = X[0:2]
        assert explain_method(m, X)[0].value == "batch", zero
        assert_close_rel(gram(m, X, dtype=torch.float64), _batch_reference(m, X), 1e-9, f"zero readout {zero}")


class _Squeezed(nn.Module):
    """Scalar regression ending in ``.squeeze()`` (the usual idiom): a one-point batch returns ()."""

    def __init__(self, recurrent: bool):
        super().__init__()
        self.recurrent = recurrent
        self.r = nn.GRU(3, 4, batch_first=True) if recurrent else nn.Linear(3, 4)
        self.n, self.h = nn.LayerNorm(4), nn.Linear(4, 1)

    def forward(self, x):
        if self.recurrent:
            z = self.r(x.view(len(x), -1, 3))[0][:, -1]
        else:
            z = self.r(x)
        return self.h(torch.tanh(self.n(z))).squeeze()


@pytest.mark.parametrize(
    "recurrent, n, method",
    [(True, 10, "auto"), (False, 10, "jacobian"), (False, 129, "auto"), (False, 1, "auto"), (True, 1, "batch")],
)
def test_a_forward_ending_in_squeeze_runs_on_every_route(recurrent, n, method):
    """The exact route runs the network on one-point batches, and the per-layer route's last feature
    chunk can hold one point (N = 129): there ``.squeeze()`` dropped the batch axis and the Gram failed
    with an IndexError from inside the library (a new user's trial)."""
    torch.manual_seed(0)
    m = _Squeezed(recurrent).double()
    X = torch.randn(n, 9 if recurrent else 3, dtype=torch.float64)
    ref = dense_ntk(m, X) if n > 1 else _batch_reference(m, X)
    assert_close_rel(gram(m, X, dtype=torch.float64, method=method), ref, 1e-10, f"{recurrent} {n} {method}")


def test_a_frozen_encoder_under_no_grad_and_layers_called_by_keyword():
    """A frozen pretrained encoder run under ``torch.no_grad()`` feeding a trainable head: its
    parameters' columns of J are zero (the exact route's autograd refused an output that does not
    require grad), and the route says why; layers called as ``layer(input=x)``: the feature pass read
    only positional inputs (IndexError).  Both against jacrev."""

    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.e, self.r, self.h = nn.Embedding(10, 4), nn.LSTM(4, 5, batch_first=True), nn.Linear(5, 2)

        def forward(self, t):
            with torch.no_grad():
                o, _ = self.r(self.e(t))
            return self.h(o[:, -1])

    class Keyword(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.b(input=torch.tanh(self.a(input=x)))

    torch.manual_seed(0)
    m, t = Frozen().double(), torch.randint(0, 10, (12, 5))
    assert_close_rel(gram(m, t, dtype=torch.float64), dense_ntk(m, t), 1e-12, "frozen encoder")
    assert "takes no part in the output's graph" in explain_method(m, t)[1]["e.weight"][1]
    m, X = Keyword().double(), torch.randn(12, 6, dtype=torch.float64)
    assert explain_method(m, X)[0].value == "structured"
    assert_close_rel(gram(m, X, dtype=torch.float64), dense_ntk(m, X), 1e-12, "layer(input=x)")


def test_an_eval_transformer_with_a_padding_mask_and_a_torchscript_layer():
    """An eval-mode ``TransformerEncoder`` with ``src_key_padding_mask`` takes PyTorch's nested-tensor
    path without grad (padded positions zeroed): the probe compared a no-grad forward with a grad one
    and called the model random; a TorchScript submodule takes no Python hooks (a raw RuntimeError).
    Both now measured, against full-batch autograd."""

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
            self.t, self.h = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True), nn.Linear(8, 1)

        def forward(self, x):
            pad = torch.zeros(x.shape[:2], dtype=torch.bool)
            pad[:, -1] = True
            return self.h(self.t(x, src_key_padding_mask=pad)).mean(1).squeeze(-1)

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the nested-tensor path's own notes
        m, X = Encoder().double().eval(), torch.randn(8, 4, 8, dtype=torch.float64)
        assert_close_rel(gram(m, X, dtype=torch.float64), _batch_reference(m, X), 1e-10, "padded encoder")
    m = nn.Sequential(torch.jit.script(nn.Linear(6, 8)), nn.Tanh(), nn.Linear(8, 2)).double()
    X = torch.randn(12, 6, dtype=torch.float64)
    assert_close_rel(gram(m, X, dtype=torch.float64), _batch_reference(m, X), 1e-12, "TorchScript layer")


def test_a_forward_that_changes_its_input_in_place_is_refused_and_the_points_are_kept():
    """``x /= 2`` on the tensor the model is given: the probe's forwards halved the caller's first
    points and then called the model random.  Now one error naming the cause, and X as it was; an
    in-place op that changes no value (a clamp within range) is measured as before."""

    class Halving(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 2)

        def forward(self, x):
            x /= 2
            return self.a(x)

    class Clamping(Halving):
        def forward(self, x):
            return self.a(x.clamp_(-1e6, 1e6))

    torch.manual_seed(0)
    X = torch.randn(12, 6, dtype=torch.float64)
    kept = X.clone()
    with pytest.raises(UnsupportedModelError, match=r"changes its input in place .*x = x\.clone\(\)"):
        gram(Halving().double(), X, dtype=torch.float64)
    assert torch.equal(X, kept), "the caller's points were changed"
    m = Clamping().double()
    assert_close_rel(gram(m, X, dtype=torch.float64), _batch_reference(m, X.clone()), 1e-12, "in-place clamp")


class _CentredScaled(nn.Module):
    """``α·(h − h.mean(0))``: couples the samples, at any output scale α."""

    def __init__(self, alpha: float = 1.0):
        super().__init__()
        self.a, self.b, self.alpha = nn.Linear(3, 16), nn.Linear(16, 2), alpha

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.alpha * self.b(h - h.mean(0, keepdim=True))


@pytest.mark.parametrize("case", ["first points one point", "outputs 1e-9 (float64)", "outputs 1e-5 (float32)"])
def test_a_coupling_is_found_behind_repeated_first_points_and_small_outputs(case):
    """A second trial's silent errors, each 0.09-0.17 relative on the per-layer route: the first four
    points one point repeated (every probe compared equal halves; the probe now takes the first
    distinct points), and outputs of scale 1e-9 / 1e-5 (the probe's comparison had an absolute floor)."""
    torch.manual_seed(0)
    dtype = torch.float32 if "float32" in case else torch.float64
    m = _CentredScaled({"first points one point": 1.0}.get(case, 1e-9 if dtype == torch.float64 else 1e-5)).to(dtype)
    X = torch.randn(12, 3, dtype=dtype)
    if case == "first points one point":
        X[:4] = X[0]
    assert explain_method(m, X)[0].value == "batch", case
    rtol = 1e-10 if dtype == torch.float64 else 1e-5
    assert_close_rel(gram(m, X, dtype=torch.float64), _batch_reference(m, X), rtol, case)


def test_points_permuted_by_their_values_are_not_proven_one_row_each():
    """Sort-and-dispatch (an expert applied to the points in router order, then unsorted): with probe
    points already in router order the probe saw the identity and proved the expert ``structured``,
    0.12 off; the probe also runs the points reversed."""

    class SortDispatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.r, self.e, self.o = nn.Linear(3, 1), nn.Linear(3, 8), nn.Linear(8, 2)

        def forward(self, x):
            perm = self.r(x).squeeze(-1).argsort()
            return self.o(torch.tanh(self.e(x[perm]))[perm.argsort()])

    torch.manual_seed(0)
    m = SortDispatch().double()
    X = torch.randn(12, 3, dtype=torch.float64)
    with torch.no_grad():
        X = X[m.r(X).squeeze(-1).argsort()]
    X[4:] = X[4:][torch.randperm(8)]
    assert explain_method(m, X)[1]["e.weight"][0] == "jacobian"
    assert_close_rel(gram(m, X, dtype=torch.float64), _batch_reference(m, X), 1e-10, "sort dispatch")


class _Cached(nn.Module):
    """A feature-cache hook (closure over the module), an activation list, a tensor attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.h = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.cache, self.acts, self.last = {}, [], None
        self.l1.register_forward_hook(lambda m, i, o: o * 2.0)  # a hook that changes the output
        self.l2.register_forward_hook(lambda m, i, o: self.cache.__setitem__("l2", o.detach()))

    def forward(self, x):
        h = torch.tanh(self.l2(torch.relu(self.l1(x))))
        self.acts.append(h.detach())
        self.last = h.detach()
        return self.h(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["own-dtype", "cast-copy"])
def test_what_a_forward_stores_inside_a_measurements_transforms_is_put_back(dtype):
    """Activations stored by a hook or a forward inside ``torch.func``'s transforms cannot be read
    afterwards ("… escaped from inside a function being vmapped"), and a float32 model measured in
    float64 (a cast copy, whose hooks write into the user's module) could not be copied again:
    the second ``gram`` raised a bare "Cannot access storage of TensorWrapper"."""
    import numpy as np

    from nsa_dist.hessian import hessian_operator
    from nsa_dist.ntk import ntk_operator

    torch.manual_seed(0)
    model, X = _Cached(), torch.randn(12, 4)
    ref = dense_ntk(_double(model), X.double())
    model(X[:3])  # the user's own forward
    P = sum(p.numel() for p in model.parameters())

    def readable():
        stored = [model.cache["l2"], model.last, *model.acts]
        wrapped = [t for t in stored if torch._C._functorch.is_functorch_wrapped_tensor(t)]
        assert not wrapped, f"{len(wrapped)} of the model's stored tensors are torch.func's: {wrapped[0]!r:.200}"
        assert all(torch.isfinite(t).all() for t in stored)  # each one can be read

    for _ in range(2):  # the second call copies the model again
        assert_close_rel(gram(model, X, dtype=dtype), ref.to(dtype), 1e-5 if dtype == torch.float32 else 1e-10)
        readable()
        op = hessian_operator(model, X, torch.zeros(12), dtype=dtype)
        op.matmat(torch.ones(P, 1, dtype=dtype))
        readable()
        ntk_operator(model, X).matmat(np.ones((12, 1)))
        readable()
    model(X[:2])  # the user's next forward stores its own tensors again
    assert model.cache["l2"].shape == (2, 8) and model.last.shape == (2, 8)


class _Rebuilt(nn.Module):
    """Activations kept in containers a forward builds anew, a deque, and a list it inserts into."""

    def __init__(self) -> None:
        super().__init__()
        import collections

        self.l1, self.h = nn.Linear(4, 8), nn.Linear(8, 1)
        self.window, self.cache, self.ring, self.front = [], {}, collections.deque(maxlen=2), []
        self.seen: dict[str, list] = {}

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        self.window = self.window[-2:] + [h.detach()]  # a new list each forward
        self.cache = {"h": h.detach()}  # a new dict each forward
        self.ring.append(h.detach())
        self.front.insert(0, h.detach())
        self.seen.setdefault("h", []).append(h.detach())  # a list inside a dict
        return self.h(h)


def test_containers_a_forward_rebuilds_are_put_back_too():
    """A reviewer's cases: a list or dict rebuilt by the forward, a deque, insert(0, …) — each left
    torch.func tensors in the user's module, and the next float64 measurement failed to copy it."""
    import collections

    torch.manual_seed(0)
    model, X = _Rebuilt(), torch.randn(10, 4)
    model(X[:3])
    model(X[:3])
    ref = dense_ntk(_double(model), X.double())
    for dtype in (torch.float32, torch.float64, torch.float64):
        assert_close_rel(
            gram(model, X, dtype=dtype, method="jacobian"), ref.to(dtype), 1e-5 if dtype == torch.float32 else 1e-10
        )
        stored = [*model.window, *model.cache.values(), *model.ring, *model.front, *model.seen["h"]]
        wrapped = [t for t in stored if torch._C._functorch.is_functorch_wrapped_tensor(t)]
        assert not wrapped, f"{len(wrapped)} of the model's {len(stored)} stored tensors are torch.func's"
    # no container changed type, and none holds one of its entry tensors twice (insert(0, …) put back by index did)
    assert isinstance(model.ring, collections.deque) and model.ring.maxlen == 2
    assert isinstance(model.window, list) and isinstance(model.cache, dict)
    for name in ("front", "window"):
        ids = [id(t) for t in getattr(model, name)]
        assert len(set(ids)) == len(ids), f"{name} holds a tensor twice"
    model(X[:2])  # and the user's next forward works on them


def _double(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model).double()


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1  # in every mode
        return self.lin(x)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_a_buffer_written_in_every_mode_is_refused_with_the_fix_for_that_mode(train):
    model = _Counting().train(train)
    with pytest.raises(UnsupportedModelError) as e:
        gram(model, torch.randn(5, 3))
    text = str(e.value)
    assert "modifies its buffer 'calls' (_Counting) in place" in text, text
    if train:
        assert "call model.eval()" in text, text
    else:  # it was in eval mode: "call model.eval()" would send the user in a circle
        assert "call model.eval()" not in text and "in eval mode already" in text and "if self.training:" in text, text
    assert float(model.calls) == 0.0, "the probe's forwards leave the counter as it was"


def _dense_loss_hessian(m: nn.Module, X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """∇²_θ of ½‖f(X) − Y‖²/N over the flattened parameters, by torch.func.hessian."""
    names, theta = zip(*[(n, p.detach()) for n, p in m.named_parameters()])

    def loss(flat):
        ps, i = {}, 0
        for n, p in zip(names, theta):
            ps[n] = flat[i : i + p.numel()].reshape(p.shape)
            i += p.numel()
        return 0.5 * ((torch.func.functional_call(m, ps, (X,)) - Y) ** 2).sum() / X.shape[0]

    return torch.func.hessian(loss)(torch.cat([p.reshape(-1) for p in theta]))


class _AutoScale(nn.Module):
    """Rescales the batch when it looks like raw [0, 255] pixels: one decision over the whole batch."""

    def __init__(self, linear: bool):
        super().__init__()
        self.linear = linear
        if linear:
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)
        else:
            self.W1 = nn.Parameter(torch.randn(8, 16) / 8**0.5)
            self.W2 = nn.Parameter(torch.randn(16, 1) / 4.0)

    def forward(self, x):
        if x.max() > 1.0:
            x = x / 255.0 * 10
        return self.b(torch.tanh(self.a(x))) if self.linear else torch.tanh(x @ self.W1) @ self.W2


@pytest.mark.parametrize("linear", [False, True])
def test_a_decision_over_the_whole_batch_takes_the_batch_forwards_kernel(linear):
    """The first 4 points raw, the other 28 in [0, 1]: every batch the probe tried held the raw probe
    points and decided alike, so the per-sample routes ran each point alone, which decides otherwise —
    gram 0.35 off (0.095 with method='jacobian'), ntk_operator with block_size=4 0.11 off and the
    Hessian operator 1.8 off, nothing said.  Now each point alone is compared with the whole batch."""
    from nsa_dist.hessian import hessian_operator
    from nsa_dist.ntk import ntk_operator

    torch.manual_seed(0)
    m = _AutoScale(linear).double()
    X = torch.rand(32, 8, dtype=torch.float64)
    X[:4] *= 255
    method, routes = explain_method(m, X)
    assert method.value == "batch", routes
    assert (
        "point 4's outputs alone differ from its outputs in the batch of all 32 points"
        in next(iter(routes.values()))[1]
    )
    want = _batch_reference(m, X)
    assert_close_rel(gram(m, X, dtype=torch.float64), want, 1e-12, "gram")
    for bs in (None, 4):
        op = ntk_operator(m, X, block_size=bs, dtype=torch.float64)
        assert_close_rel(op.matmat(torch.eye(32, dtype=torch.float64)), want, 1e-12, f"ntk_operator block {bs}")
    Y = torch.randn(32, 1, dtype=torch.float64)
    H = _dense_loss_hessian(m, X, Y)
    for bs in (None, 4):
        op = hessian_operator(m, X, Y, part="H", dtype=torch.float64, block_size=bs)
        assert_close_rel(op.matmat(torch.eye(H.shape[0], dtype=torch.float64)), H, 1e-10, f"Hessian block {bs}")
    # the same points all in range decide alike alone and together: the fast routes stay
    assert explain_method(m, X / 255)[0].value != "batch"


class _GCN(nn.Module):
    """A transductive GCN over a fixed normalised graph of all N points: Â relu(Â X W₁) W₂ — its forward
    runs on those N points only."""

    def __init__(self, n: int):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        A = (torch.rand(n, n, generator=g) < 0.2).double()
        A = ((A + A.T) > 0).double() + torch.eye(n, dtype=torch.float64)
        d = A.sum(1).rsqrt()
        self.register_buffer("A", d[:, None] * A * d[None])
        self.l1, self.l2 = nn.Linear(3, 8), nn.Linear(8, 1)

    def forward(self, x):
        return (self.A @ self.l2(torch.relu(self.A @ self.l1(x))))[:, 0]


def test_a_transductive_gcn_is_measured_on_its_whole_graph(tmp_path):
    """Every check forward ran on two (or four) points, where Â X W cannot: gram, the operators and the
    Tracker failed ("mat1 and mat2 shapes cannot be multiplied (24x24 and 2x8)"), even with
    method='batch'.  Now a forward that runs on the whole batch only is the batch forward's kernel."""
    from nsa_dist import Tracker
    from nsa_dist.client import Client
    from nsa_dist.hessian import hessian_operator
    from nsa_dist.ntk import ntk_operator

    torch.manual_seed(0)
    m = _GCN(24).double()
    X, y = torch.randn(24, 3, dtype=torch.float64), torch.randn(24, dtype=torch.float64)
    method, routes = explain_method(m, X)
    assert method.value == "batch" and "runs on the batch of all 24 points only" in routes["l1.weight"][1], routes
    want = _batch_reference(m, X)
    for how in ("auto", "batch"):
        assert_close_rel(gram(m, X, method=how, dtype=torch.float64), want, 1e-12, f"gram {how}")
    assert_close_rel(ntk_operator(m, X).matmat(torch.eye(24, dtype=torch.float64)), want, 1e-12, "ntk_operator")
    H = _dense_loss_hessian(m, X, y)
    op = hessian_operator(m, X, y[:, None], part="H", dtype=torch.float64)
    assert_close_rel(op.matmat(torch.eye(H.shape[0], dtype=torch.float64)), H, 1e-10, "the loss Hessian")
    url = str(tmp_path / "s.zarr")
    with Tracker(url, "gcn", m, X, y, steps=1, spectrum={"k": 6}, hessian={"probes": 2, "top_k": 1}) as tr:
        tr.record(0, lr=0.1)
    run = Client(url).run("gcn")
    # no update was made after record(0): Δθ_0 and what is made of it are not known (NaN, noted)
    # (and a user's net has no infinite-width limit; 2 probes leave Hutch++ one for its standard error)
    said = {q for qs in run.notes.values() for q in qs}
    assert run.status == "done" and said <= {"df", "df_pred", "energy_df", "energy_df_pred", "first_order_error",
                                            "first_order_cos", "hessian_I_limit_eigenvalues", "hessian_I_limit_moments",
                                            "hessian_S_limit", "hessian_moments_stderr"}, run.notes  # fmt: skip
    lam = torch.linalg.eigvalsh(want).flip(0)[:6].numpy()
    assert_close_rel(torch.as_tensor(run.eigenvalues[0]), torch.as_tensor(lam), 1e-9, "the Tracker's λ_1..6")
    top = float(torch.linalg.eigvalsh(H)[-1])
    assert abs(float(run.hessian.top("H")[0, 0]) - top) <= 1e-8 * abs(top), (run.hessian.top("H"), top)


def test_an_unused_parameter_is_said_to_be_unused():
    """A parameter registered on the model and never read was "a parameter of the model itself, used by
    its own forward"; its kernel columns are zero, as the Gram finds."""

    class Spare(nn.Module):
        def __init__(self):
            super().__init__()
            self.W = nn.Parameter(torch.randn(3, 4))
            self.spare = nn.Parameter(torch.randn(5))

        def forward(self, x):
            return (x @ self.W).sum(1)

    m, X = Spare().double(), torch.randn(6, 3, dtype=torch.float64)
    routes = explain_method(m, X)[1]
    assert "used by its own forward" in routes["W"][1], routes
    assert "'spare' is not used by the probe's forward" in routes["spare"][1], routes
    assert_close_rel(gram(m, X, dtype=torch.float64), dense_ntk(m, X), 1e-12, "gram with an unused parameter")


def test_an_output_near_zero_is_not_taken_for_a_batch_decision():
    """Point 7's float32 output is 2.6e-08 in the batch and 4.1e-08 alone (rounding of a batched against
    a one-row matmul): compared to its own size that is a coupling; to the outputs' scale (0.59) it is
    rounding — the fast route stays."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
    X = torch.randn(200, 16)
    with torch.no_grad():
        m[-1].bias -= m(X[7:8])[0]  # f(x_7) ≈ 0 by cancellation
    assert explain_method(m, X)[0].value == "structured", explain_method(m, X)[1]["0.weight"]


def test_a_broken_forward_is_named_as_it_is_not_as_a_coupling():
    """A forward that fails with grad only (``h.numpy()``) ran again without grad on the whole batch and
    was called "fails on the 4 probe points and runs on the batch of all 40 points only"; a forward
    broken on every input is named on two points, not after a forward of every point."""
    from nsa_dist.errors import ModelForwardError

    class Numpy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 4)

        def forward(self, x):
            h = self.a(x)
            return torch.as_tensor(h.numpy()).sum(1) + h.sum(1)

    X = torch.randn(40, 3)
    with pytest.raises((RuntimeError, ModelForwardError), match="numpy") as e:
        explain_method(Numpy(), X)
    assert "couples samples" not in str(e.value), str(e.value)

    broken = nn.Sequential(nn.Linear(5, 4), nn.Linear(3, 1))  # 4 features into a layer that takes 3
    with pytest.raises(ModelForwardError, match=r"\(2x4 and 3x1\)"):
        gram(broken, torch.randn(400, 5))
