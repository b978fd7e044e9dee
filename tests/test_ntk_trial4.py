"""A fourth adversarial trial of the NTK's fast routes: proofs that held only vacuously at θ_0
(a zero-initialised readout), an attention mask passed for some batches only, embeddings whose
forward renormalises their weight, reentrant activation checkpointing, and the caller's global
modes (``torch.inference_mode``, ``parametrize.cached()``, ``torch.autocast``).

Every kernel is compared with a float64 reference from plain ``torch.autograd``: one gradient per
output of the full-batch forward (the kernel of the batch forward, as :func:`nsa_dist.ntk.gram`
defines it), on a deep copy of the model as it was given."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch import nn

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.ntk import (
    explain_method,
    gram,
    jacobian_vector_product,
    ntk_operator,
    resolve_route,
    sample_coupling,
)
from nsa_dist.ntk.blocks import block_features

D = torch.float64


def _reference(model: nn.Module, X: torch.Tensor, full: bool = False) -> torch.Tensor:
    """G of the full-batch forward from plain autograd, on a copy (the model is left as it is)."""
    m = copy.deepcopy(model)
    ps = [p for p in m.parameters() if p.requires_grad]
    out = m(X.clone()).reshape(len(X), -1)
    rows = [
        torch.cat(
            [
                (g if g is not None else torch.zeros_like(p)).reshape(-1)
                for g, p in zip(torch.autograd.grad(out[i, a], ps, retain_graph=True, allow_unused=True), ps)
            ]
        )
        for i in range(len(X))
        for a in range(out.shape[1])
    ]
    J = torch.stack(rows).view(len(X), out.shape[1], -1)
    return torch.einsum("iap,jbp->iajb", J, J) if full else torch.einsum("iap,jap->ij", J, J)


def _err(G: torch.Tensor, R: torch.Tensor) -> float:
    return float((torch.as_tensor(G) - R).abs().max() / R.abs().max())


def _blocks_gram(model: nn.Module, X: torch.Tensor, method) -> torch.Tensor:
    """G assembled from the block features of two ranges of points (the gang layouts' pieces)."""
    n = len(X)
    feats = block_features(model, X, [(0, n // 3), (n // 3, n)], method=method)
    pairs = zip(*[[(torch.as_tensor(A), torch.as_tensor(B)) for A, B in f] for f in feats], strict=True)
    return sum(
        (A @ A.T) * (B @ B.T) for A, B in ((torch.cat([a for a, _ in p]), torch.cat([b for _, b in p])) for p in pairs)
    )


def _routes(routes: dict) -> str:
    return "; ".join(f"{k}: {p} ({w[:60]})" for k, (p, w) in routes.items())


# ------------------------------------------------ 1. a zero-initialised readout at θ_0
class _CentredPastFour(nn.Module):
    """Centres its features over the batch, in batches of more than 4 points only (the probe's 4
    points never show it; the window of the first 64 does)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(4, 6, dtype=D), nn.Linear(6, 2, dtype=D)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.head(h - h.mean(0) if x.shape[0] > 4 else h)


class _SortDispatch(nn.Module):
    """An expert applied to the points in router order, then unsorted."""

    def __init__(self) -> None:
        super().__init__()
        self.r, self.e, self.head = nn.Linear(4, 1, dtype=D), nn.Linear(4, 8, dtype=D), nn.Linear(8, 2, dtype=D)

    def forward(self, x):
        perm = self.r(x).squeeze(-1).argsort()
        return self.head(torch.tanh(self.e(x[perm]))[perm.argsort()])


class _TransposedAxis(nn.Module):
    """Points (n, 4·3), tested with n = 4: a Linear on ``h.transpose(0, 1)``, whose leading axis has
    the batch's length but runs over positions."""

    def __init__(self) -> None:
        super().__init__()
        self.mix, self.inp, self.head = nn.Linear(3, 3, dtype=D), nn.Linear(3, 3, dtype=D), nn.Linear(3, 1, dtype=D)

    def forward(self, x):
        h = torch.tanh(self.inp(x.view(x.shape[0], 4, 3)))
        h = torch.tanh(self.mix(h.transpose(0, 1))).transpose(0, 1)
        return self.head(h).mean(1).squeeze(-1)


ZERO_HEAD = {
    "centred past four points": (_CentredPastFour, 12, "a.weight", "batch"),
    "sort and dispatch": (_SortDispatch, 12, "e.weight", "jacobian"),
    "transposed axis of the batch's length": (_TransposedAxis, 4, "mix.weight", "jacobian"),
}


@pytest.mark.parametrize("case", list(ZERO_HEAD))
def test_a_route_resolved_behind_a_zero_readout_holds_after_training(case):
    """A run resolves its route once, at θ_0 (pipeline/plan.py).  Behind a zero-initialised
    readout every layer's output gradient is zero and the outputs constant, so the probe's row and
    batch-size proofs held for any forward: the route took the per-layer formulas for these layers,
    and every Gram once the readout had trained was wrong (0.84, 0.89 and 0.058 of max |G|)."""
    make, n, layer, path = ZERO_HEAD[case]
    torch.manual_seed(0)
    model = make()
    nn.init.zeros_(model.head.weight)
    X = torch.randn(n, 12 if make is _TransposedAxis else 4, dtype=D)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    route = resolve_route(model, X)  # the run's one probe, at θ_0
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters()), "the probe changed a parameter"
    assert route.routes[layer][0] == path, f"{case}: {layer} took {route.routes[layer]}; {_routes(route.routes)}"
    err0 = _err(gram(model, X, method=route), _reference(model, X))
    assert err0 < 1e-12, f"{case}: Gram at θ_0 off by {err0:.3e}"
    with torch.no_grad():  # training moves the readout off zero
        model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=torch.Generator().manual_seed(1)))
    err = _err(gram(model, X, method=route), _reference(model, X))
    assert err < 1e-12, f"{case}: Gram with the route of θ_0 off by {err:.3e} after training; {_routes(route.routes)}"


def test_sample_coupling_is_found_behind_a_zero_readout():
    """The trainer and the Hessian operators ask ``sample_coupling`` (the trainer splits the batch
    into chunks when it says None): behind a zero readout it said None for a batch-centring forward."""
    torch.manual_seed(0)
    model = _CentredPastFour()
    nn.init.zeros_(model.head.weight)
    why = sample_coupling(model, torch.randn(12, 4, dtype=D))
    assert why is not None and "batch" in why, f"sample_coupling said {why!r}"
    assert not model.head.weight.any(), "the probe left the readout changed"


# ------------------------------------------------ 2. an attention mask passed for some batches only
class _PadAware(nn.Module):
    """Token ids with padding 0: the padding mask is passed only when the batch holds padding (a
    common shortcut for the fused kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 6, padding_idx=0, dtype=D)
        self.att = nn.MultiheadAttention(6, 2, batch_first=True, dtype=D)
        self.head = nn.Linear(6, 1, dtype=D)

    def forward(self, ids):
        t = self.emb(ids)
        pad = ids == 0
        o = self.att(t, t, t, key_padding_mask=pad if pad.any() else None, need_weights=False)[0]
        keep = (~pad).unsqueeze(-1).to(o.dtype)
        return self.head((o * keep).sum(1) / keep.sum(1)).squeeze(-1)


def test_an_attention_mask_the_probe_points_did_not_need_is_not_dropped():
    """The probe points hold no padding, so the attention was proven unmasked self-attention; the
    feature passes ran the decomposition without the mask the later points' batches pass: 0.45 off.
    A feature pass now hands a masked call to the exact route."""
    torch.manual_seed(0)
    model = _PadAware()
    ids = torch.randint(1, 7, (10, 5), generator=torch.Generator().manual_seed(2))
    ids[6:, 3:] = 0
    route = resolve_route(model, ids)
    assert route.routes["att.in_proj_weight"][0] == "per_layer", _routes(route.routes)
    R = _reference(model, ids)
    for what, G in (
        ("gram", gram(model, ids)),
        ("gram with the route", gram(model, ids, method=route)),
        ("block features", _blocks_gram(model, ids, route)),
    ):
        err = _err(G, R)
        assert err < 1e-12, f"{what}: off by {err:.3e}"
    # batches without padding keep the fast route, exactly
    clean = ids[:6]
    assert _err(gram(model, clean, method=route), _reference(model, clean)) < 1e-12


# ------------------------------------------------ 3. an embedding with max_norm
def test_a_max_norm_embedding_is_left_as_it_was():
    """``nn.Embedding(max_norm=…)`` renormalises the rows it looks up in place at every forward:
    a Gram, the operator and a first-order prediction each rewrote the user's embedding (by 1.68),
    though a measurement never changes the model.  The kernel is the one of the forward as torch
    runs it (the renormalised rows; the renormalisation is not differentiated)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(9, 4, max_norm=0.5), nn.Flatten(), nn.Linear(12, 2)).double()
    ids = torch.tensor([[0, 1, 2], [3, 0, 0], [4, 5, 6], [1, 1, 0], [2, 3, 4]])
    w0 = model[0].weight.detach().clone()
    R = _reference(model, ids)
    P = sum(p.numel() for p in model.parameters())
    results = {
        "gram": lambda: gram(model, ids),
        "operator": lambda: ntk_operator(model, ids).to_dense(),
        "jacobian_vector_product": lambda: jacobian_vector_product(model, ids, torch.ones(P, dtype=D)),
    }
    for what, run in results.items():
        out = run()
        moved = float((model[0].weight - w0).abs().max())
        assert moved == 0.0, f"{what} changed the embedding's weight by {moved:.3e}"
        if what != "jacobian_vector_product":
            err = _err(out, R)
            assert err < 1e-12, f"{what}: off by {err:.3e}"


# ------------------------------------------------ 4. activation checkpointing
class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.a, self.b, self.head = nn.Linear(4, 5, dtype=D), nn.Linear(5, 5, dtype=D), nn.Linear(5, 2, dtype=D)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = checkpoint.checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=self.reentrant)
        return self.head(h)


def test_reentrant_checkpointing_is_refused_by_name_and_the_other_kind_is_exact():
    """``use_reentrant=True`` checkpoints run their backward only under ``.backward()``: the probe
    called the model coupled ("its forward fails on repeated points") and the batch route failed
    with torch.func's "autograd.Function … must override setup_context"."""
    torch.manual_seed(0)
    X = torch.randn(6, 4, dtype=D)
    with pytest.raises(UnsupportedModelError, match="use_reentrant=True"):
        gram(_Checkpointed(reentrant=True), X)
    with pytest.raises(UnsupportedModelError, match="use_reentrant=True"):
        ntk_operator(_Checkpointed(reentrant=True), X)
    model = _Checkpointed(reentrant=False)
    method, routes = explain_method(model, X)
    assert method.value == "structured", _routes(routes)
    R = _reference(model, X)
    assert _err(gram(model, X), R) < 1e-12
    assert _err(ntk_operator(model, X).to_dense(), R) < 1e-12


# ------------------------------------------------ 5. torch.inference_mode
def test_points_made_in_inference_mode_and_calls_inside_it():
    """An evaluation loop runs under ``torch.inference_mode()``, and points made there are
    inference tensors: the probe's version counters and any recorded forward refused them ("Inference
    tensors do not track version counter") — on the per-layer and attention routes, not the
    structured one — and inside inference mode every route failed, ``torch.enable_grad()`` or not."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular"), nn.Tanh(), nn.Flatten(), nn.Linear(75, 2)
    ).double()
    X = torch.randn(6, 2, 5, 5, dtype=D)
    R = _reference(model, X)
    with torch.inference_mode():
        Xi = X.clone()
    assert Xi.is_inference()
    assert _err(gram(model, Xi), R) < 1e-12
    with torch.inference_mode():
        G = gram(model, X)
        op = ntk_operator(model, Xi)
        O = op.to_dense()
        coupled = sample_coupling(model, Xi)
    assert _err(G, R) < 1e-12
    assert _err(O, R) < 1e-12
    assert coupled is None
    att = _PadAware()
    ids = torch.randint(1, 7, (6, 5), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ids_i = ids.clone()
        G = gram(att, ids_i)
    assert _err(G, _reference(att, ids)) < 1e-12


def test_a_lazy_network_not_yet_run_is_probed():
    """The zero-readout guard reads every parameter before the probe's forwards: a LazyLinear not
    yet run holds an uninitialised parameter, which the probe's first forward sets."""
    torch.manual_seed(0)
    X = torch.randn(6, 4, dtype=D)
    model = nn.Sequential(nn.LazyLinear(5), nn.Tanh(), nn.LazyLinear(2)).double()
    assert resolve_route(model, X).method.value == "structured"
    assert sample_coupling(nn.Sequential(nn.LazyLinear(5), nn.Tanh(), nn.LazyLinear(2)).double(), X) is None
    assert _err(gram(model, X), _reference(model, X)) < 1e-12


# ------------------------------------------------ 6. parametrize.cached()
def test_parametrized_weights_inside_parametrize_cached():
    """PyTorch's docs advise ``parametrize.cached()`` around evaluation: each parametrized weight is
    computed once from its original and reused.  The torch.func paths swap the original for their
    own tensor and read the cached weight, so they differentiated nothing through it: the Gram of a
    weight_norm / orthogonal network was 0.32 off (every route, the operator too), silently."""
    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    parametrizations.weight_norm(model[0])
    parametrizations.orthogonal(model[2])
    X = torch.randn(6, 4, dtype=D)
    R = _reference(model, X)
    with parametrize.cached():
        model(X)  # the caller's own forward fills the cache
        results = {
            "gram": gram(model, X),
            "gram jacobian": gram(model, X, method="jacobian"),
            "gram full": gram(model, X, kernel="full").diagonal(dim1=1, dim2=3).sum(-1),
            "operator": ntk_operator(model, X).to_dense(),
        }
        assert parametrize._cache_enabled, "the caller's caching was switched off"
    for what, G in results.items():
        err = _err(G, R)
        assert err < 1e-12, f"{what} inside parametrize.cached(): off by {err:.3e}"


# ------------------------------------------------ 7. torch.autocast
def test_a_float32_kernel_inside_an_autocast_region_is_computed_in_float32():
    """An evaluation loop under ``torch.autocast("cpu", torch.bfloat16)``: the Gram of a float32
    network came out in float32 but computed in bfloat16 (forward, backward and the kernel's own
    products), 1.5e-3 off where float32 gives 1e-7; ``dtype`` says the default is the model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
    X = torch.randn(50, 4)
    R = _reference(copy.deepcopy(model).double(), X.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        results = {
            "gram": gram(model, X),
            "gram jacobian": gram(model, X, method="jacobian"),
            "operator": ntk_operator(model, X).to_dense(),
        }
        assert torch.is_autocast_enabled("cpu"), "the caller's autocast was switched off"
    for what, G in results.items():
        assert G.dtype == torch.float32, f"{what}: {G.dtype}"
        err = float((torch.as_tensor(G).double() - R).norm() / R.norm())
        assert err < 1e-5, f"{what} under autocast: off by {err:.3e} (float32 gives ~1e-7)"
