"""Per-layer NTK: fast per-layer features where the forward proves them valid, per-sample
Jacobians for every other parameter (private).

``G = Σ_g J_g J_gᵀ`` over any partition of the parameters, so each group takes its own route
(:func:`~nsa_dist.ntk._probe.plan_forward` decides which).  One forward and one backward pass per
output a give, for every fast layer, its input ``A`` and its output gradient ``δ_a = ∂f_a/∂z``:

- Linear on (n, features) inputs: the structured factors of :mod:`._structured`,
  ``G_IJ += (Â_I Â_Jᵀ) ⊙ (D_I D_Jᵀ)`` with ``Â = [w·A, β·1]`` and ``D = [δ_1 … δ_K]``.
- Conv1d/2d/3d ``z = w·W ⋆ A + β·b`` (any stride, dilation, groups; numeric zero padding):
  ``∂f_a/∂W = w·δ_a ⋆ A`` for all samples at once from one grouped ``convolution_backward``
  (the batch folded into the groups), ``∂f_a/∂b = β·Σ_pos δ_a``.
- BatchNorm in eval mode (running statistics), ``z = γ·x̂ + β`` with
  ``x̂ = (A − μ_run)/√(σ²_run + ε)``: ``∂f_a/∂γ = Σ_pos δ_a ⊙ x̂``, ``∂f_a/∂β = Σ_pos δ_a``.
- LayerNorm likewise with ``x̂`` normalised over the layer's own shape (``F.layer_norm`` of A).
- Embedding on token ids t: ``∂f_a/∂E = Σ_p e_{t_p} δ_{a,p}ᵀ`` (a scatter-add of the output
  gradients into the rows of the tokens, none into ``padding_idx``).
- Linear on (n, …, features) inputs (applied at L positions): ``∂f_a/∂W = w·Σ_p δ_{a,p} a_pᵀ``;
  the two projections of an unmasked self-attention are two such layers (:mod:`._attention`).
- Any other known layer (GroupNorm, RMSNorm, convolutions with other padding modes): the VJP of the layer alone at its own input,
  ``∂f_a/∂θ_l = vjp(θ ↦ layer(A; θ))(δ_a)``, batched over samples.
- The rest (recurrent, attention, shared weights, custom modules): per-sample Jacobians of the
  whole model with respect to those parameters only (:func:`~nsa_dist.ntk._jacobian.jacobian_fn`).

The formed gradients are written straight into one feature matrix M (N, K, P_formed) and
contracted ``G += M Mᵀ`` (:mod:`._contract`: column chunks, upper tiles only when symmetric).
Memory: M is held for all points while it fits in :data:`~nsa_dist.ntk._inputs.FEATURE_BYTES`;
past it the formed columns are split into groups, one forward/backward pass over the data per
group (the latest layers first: their backward pass is the shortest).  Exact, and it never forms
the Jacobian of the factored Linear layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torch.func import functional_call, vjp, vmap

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.ntk import _inputs
from nsa_dist.ntk._attention import Projection, attention_ok, decomposed_forwards, projections
from nsa_dist.ntk._contract import add_factors, add_formed, tile_slices
from nsa_dist.ntk._jacobian import jacobian_fn
from nsa_dist.ntk._probe import ForwardPlan, FastLayer, plan_forward
from nsa_dist.ntk._structured import _mirror_upper, layer_passes

__all__ = ["conv_layers", "per_layer_layers", "per_layer_gram"]

# Points per forward/backward pass while the features are computed.
_FEATURE_CHUNK = 128
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@dataclass(frozen=True)
class _Layer:
    """A fast layer: its trainable parameters (local names) and the route of their gradients.

    ``kind``: "factor" (Linear on 2-D inputs: factors Â, D), "conv" (Conv1d/2d/3d), "bn" (eval
    BatchNorm), "ln" (LayerNorm), "emb" (Embedding), "linear" (Linear at L positions) — formed by
    the closed forms of the module docstring — or "local" (formed by the VJP of the layer alone).
    """

    module: nn.Module
    params: tuple[str, ...]
    w: float | None
    b: float | None
    kind: str
    clone_out: bool

    @property
    def factored(self) -> bool:
        return self.kind == "factor"

    @property
    def n_formed(self) -> int:
        """Formed gradient entries per sample and output (0 for a factored layer)."""
        return 0 if self.factored else sum(getattr(self.module, n).numel() for n in self.params)


def _kind(lay: FastLayer) -> str:
    m = lay.module
    if lay.factored:
        return "factor"
    if any(type(m).forward is c.forward for c in _CONVS) and m.padding_mode == "zeros" \
            and not isinstance(m.padding, str):
        return "conv"
    if any(type(m).forward is c.forward for c in _NORMS) and not m.training and m.running_mean is not None:
        return "bn"
    if isinstance(m, nn.Linear) and set(lay.params) <= {"weight", "bias"}:
        return "linear"
    if type(m).forward is nn.LayerNorm.forward:
        return "ln"
    if type(m).forward is nn.Embedding.forward and not m.scale_grad_by_freq and m.max_norm is None:
        return "emb"
    return "local"


def per_layer_layers(plan: ForwardPlan) -> list[_Layer]:
    """The fast layers of a plan with the route of each; a self-attention module becomes its two
    projections (:class:`~nsa_dist.ntk._attention.Projection`), each a Linear at every position."""
    out = []
    for lay in plan.layers:
        if not attention_ok(lay.module):
            out.append(_Layer(lay.module, lay.params, lay.w, lay.b, _kind(lay), lay.clone_out))
            continue
        for proj in projections(lay.module):
            w, b = (n in lay.params for n in proj.names)
            params = tuple(k for k, t in zip(("weight", "bias"), (w, b)) if t)
            if params:
                out.append(_Layer(proj, params, 1.0 if w else None, 1.0 if b else None, "linear", False))
    return out


def conv_layers(model: nn.Module, x_probe: torch.Tensor) -> list[_Layer]:
    """The model's fast layers when every trainable parameter takes a per-layer route, else
    UnsupportedModelError naming the first that does not (see :func:`plan_forward`)."""
    plan = plan_forward(model, x_probe)
    if plan.coupled or plan.generic:
        name = plan.generic[0] if plan.generic else next(iter(plan.routes))
        raise UnsupportedModelError(f"method='per_layer' has no per-layer formula for parameter {name!r}: "
                                    f"{plan.routes[name][1]} (use method='auto')")
    return per_layer_layers(plan)


def _conv_weight_grad(m: nn.Module, A: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
    """Per-sample ∂f/∂W of a convolution, (b, C_out·C_in/g·∏k) in the weight's own order.

    One ``convolution_backward`` of a convolution whose groups are the batch's samples (times the
    layer's own groups): input (1, b·C_in, …), output gradient (1, b·C_out, …), so its "weight
    gradient" (b·C_out, C_in/g, k…) holds every sample's gradient.  On the ResNet of
    benchmarks/ntk_models.py (128 points, 3–64 channels) 3.2× faster in all than offset-wise
    batched products of strided views and 15× faster than ``unfold`` (CPU ``im2col``) + ``bmm``.
    """
    b, C, O = A.shape[0], A.shape[1], dz.shape[1]
    w_shape = (b * O, C // m.groups) + tuple(m.kernel_size)
    _, gw, _ = torch.ops.aten.convolution_backward(
        dz.reshape((1, b * O) + dz.shape[2:]), A.reshape((1, b * C) + A.shape[2:]), A.new_empty(w_shape), None,
        list(m.stride), list(m.padding), list(m.dilation), False, [0] * len(m.stride), b * m.groups,
        [False, True, False])
    return gw.view(b, -1)


def _local_grad(lay: _Layer, A: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Per-sample gradients (b, P_l) of a layer as the VJP of the layer alone at its own input:
    ``vjp(θ_l ↦ layer(a_i; θ_l))(δ_i)`` for every sample i (vmapped)."""
    m = lay.module
    p0 = {n: getattr(m, n).detach() for n in lay.params}

    def one(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        _, pull = vjp(lambda p: functional_call(m, p, (a[None],)), p0)
        (g,) = pull(d[None])
        return torch.cat([g[n].reshape(-1) for n in lay.params])  # (P_l,)

    return vmap(one)(A, delta)


def _scaled_into(dst: torch.Tensor, g: torch.Tensor, scale: float) -> None:
    """dst = scale·g (a plain copy for the usual scale 1)."""
    if scale == 1.0:
        dst.copy_(g)
    else:
        torch.mul(g, scale, out=dst)


def _write_formed(lay: _Layer, A: torch.Tensor, deltas: list[torch.Tensor | None], out: torch.Tensor) -> None:
    """Per-sample gradients of a formed layer into out (b, K, P_l), from its input A (b, …) and
    the output gradients δ_a (b, …) of each model output a (None: f_a does not depend on it)."""
    m, b = lay.module, A.shape[0]
    red = tuple(range(2, A.ndim))  # positions (conv, batch norm)
    if lay.kind == "bn":
        stat = (1, -1) + (1,) * (A.ndim - 2)
        xhat = (A - m.running_mean.view(stat)) * torch.rsqrt(m.running_var.view(stat) + m.eps)  # (b, C, …)
    elif lay.kind == "ln":
        red = tuple(range(1, A.ndim - len(m.normalized_shape)))  # positions
        xhat = F.layer_norm(A, m.normalized_shape, None, None, m.eps)  # (b, …, *shape)
    elif lay.kind == "emb":
        ids = A.reshape(b, -1, 1).expand(-1, -1, m.embedding_dim)  # (b, L, d)
        keep = None if m.padding_idx is None else (A.reshape(b, -1, 1) != m.padding_idx)  # (b, L, 1)
    for a, d in enumerate(deltas):
        dst = out[:, a]  # (b, P_l)
        if d is None:
            dst.zero_()
            continue
        if lay.kind == "local":
            dst.copy_(_local_grad(lay, A, d))
            continue
        c = 0
        if lay.kind == "emb":
            src = d.reshape(b, -1, m.embedding_dim)  # (b, L, d)
            dst.zero_()
            dst.view(b, m.num_embeddings, m.embedding_dim).scatter_add_(1, ids, src if keep is None else src * keep)
            continue
        if lay.kind in ("bn", "ln"):
            if "weight" in lay.params:
                gw = (d * xhat).sum(red) if red else d * xhat  # (b, C) or (b, *shape)
                c = gw[0].numel()
                dst[:, :c].copy_(gw.reshape(b, c))
            if "bias" in lay.params:
                dst[:, c:].copy_((d.sum(red) if red else d).reshape(b, -1))
            continue
        if lay.kind == "conv":
            if lay.w is not None:
                g = _conv_weight_grad(m, A, d)  # (b, C_out·C_in/g·∏k)
                c = g.shape[1]
                _scaled_into(dst[:, :c], g, lay.w)
            bias = d.sum(red)  # (b, C_out)
        else:  # Linear at L positions
            dz = d.reshape(b, -1, d.shape[-1]).transpose(1, 2)  # (b, n_out, L)
            if lay.w is not None:
                g = torch.bmm(dz, A.reshape(b, -1, A.shape[-1])).view(b, -1)  # (b, n_out·n_in)
                c = g.shape[1]
                _scaled_into(dst[:, :c], g, lay.w)
            bias = dz.sum(-1)  # (b, n_out)
        if lay.b is not None:
            _scaled_into(dst[:, c:], bias, lay.b)


def _pass(model: nn.Module, layers: list[_Layer], jac, x: torch.Tensor, K: int, M: torch.Tensor | None,
          factors: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One forward and backward pass over a chunk of points x (b, …): the formed gradients of
    ``layers`` and, from ``jac`` (x ↦ (b, K, P_g)), the per-sample Jacobians of the generic
    parameters, written into M (b, K, P_group) in that order; the factors (Â (b, n_in+1),
    D (b, K·n_out)) of the factored layers among ``layers`` into ``factors``, in order."""
    off, f = 0, 0
    if layers:
        pairs = {id(lay.module.owner): (lay.module.owner,) + lay.module.pair for lay in layers
                 if isinstance(lay.module, Projection)}
        with decomposed_forwards(list(pairs.values())):
            acts, Z, grads = layer_passes(model, [lay.module for lay in layers], x, K,
                                          [lay.clone_out for lay in layers])
        for i, lay in enumerate(layers):
            A = acts[i]
            deltas = [g[i] for g in grads]  # K × (b, …) or None
            if lay.factored:
                Ahat, D = factors[f]
                f += 1
                c = 0
                if lay.w is not None:
                    torch.mul(A, lay.w, out=Ahat[:, :A.shape[1]])
                    c = A.shape[1]
                if lay.b is not None:
                    Ahat[:, c].fill_(lay.b)
                n_out = Z[i].shape[1]
                for a, d in enumerate(deltas):
                    D[:, a * n_out:(a + 1) * n_out].copy_(d) if d is not None else D[:, a * n_out:(a + 1) * n_out].zero_()
            else:
                _write_formed(lay, A, deltas, M[:, :, off:off + lay.n_formed])
                off += lay.n_formed
    if jac is not None:
        M[:, :, off:].copy_(jac(x))  # (b, K, P_generic)


def _factor_arrays(layers: list[_Layer], n: int, K: int, like: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Empty (Â (n, n_in+1), D (n, K·n_out)) arrays for the factored layers."""
    out = []
    for lay in layers:
        if lay.factored:
            m = lay.module
            cols = (m.in_features if lay.w is not None else 0) + (lay.b is not None)
            out.append((like.new_empty(n, cols), like.new_empty(n, K * m.out_features)))
    return out


def _fill(model: nn.Module, layers: list[_Layer], jac, x: torch.Tensor, K: int, M: torch.Tensor | None,
          factors: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """:func:`_pass` over all points of x, ``_FEATURE_CHUNK`` at a time, into M (N, K, P_group) and
    the factor arrays (N, ·)."""
    for s in range(0, x.shape[0], _FEATURE_CHUNK):
        e = min(s + _FEATURE_CHUNK, x.shape[0])
        _pass(model, layers, jac, x[s:e], K, None if M is None else M[s:e], [(A[s:e], D[s:e]) for A, D in factors])


def _features(model: nn.Module, layers: list[_Layer], jac, x: torch.Tensor, K: int
              ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """All features of the points x (N, …): the factors (Â (N, n_in+1), D (N, K·n_out)) of each
    factored layer and the formed gradients M (N, K·P_formed) of the other layers then of the
    generic parameters (``jac``: x ↦ (b, K, P_generic), or None)."""
    n = x.shape[0]
    like = next(p for p in model.parameters() if p.requires_grad)
    factors = _factor_arrays(layers, n, K, like)
    cols = sum(lay.n_formed for lay in layers) + (jac.n_params if jac is not None else 0)
    M = like.new_empty(n, K, cols) if cols else None
    _fill(model, layers, jac, x, K, M, factors)
    return factors, (M.view(n, K * cols) if M is not None else None)


def _tile(fi: tuple, fj: tuple, i: slice, j: slice, K: int, full: bool) -> torch.Tensor:
    """Σ_l of layer l's share of G[i, j]: (bi, bj) traced or (bi, K, bj, K) full, from
    :func:`_features` of the two point sets."""
    (F1, M1), (F2, M2) = fi, fj
    bi, bj = i.stop - i.start, j.stop - j.start
    if M1 is not None:  # Σ_a g_a g'_aᵀ of the formed layers starts the tile (no zero fill)
        out = M1[i].reshape(bi * K, -1) @ M2[j].reshape(bj * K, -1).T if full else M1[i] @ M2[j].T
        out = out.view(bi, K, bj, K) if full else out
    else:
        ref = F1[0][0]
        out = torch.zeros((bi, K, bj, K) if full else (bi, bj), dtype=ref.dtype, device=ref.device)
    for (A1, D1), (A2, D2) in zip(F1, F2):
        AA = A1[i] @ A2[j].T  # (bi, bj)
        if full:
            DD = D1[i].reshape(bi * K, -1) @ D2[j].reshape(bj * K, -1).T  # (bi K, bj K)
            out.addcmul_(AA[:, None, :, None], DD.view(bi, K, bj, K))
        else:
            out.addcmul_(AA, D1[i] @ D2[j].T)  # (bi, bj)
    return out


def _column_groups(formed: list[_Layer], generic: dict[str, int], rows: int, itemsize: int
                   ) -> list[tuple[list[_Layer], tuple[str, ...]]]:
    """The formed columns in g = ⌈rows·P_formed·itemsize / FEATURE_BYTES⌉ groups of about equal
    width (``rows`` = N·K rows each): (layers, generic parameter names) per group.  The generic
    parameters (name → size) come first, then the layers latest first (a group of late layers
    needs only a short backward pass); a layer or a parameter is never split."""
    units: list[tuple[_Layer | str, int]] = list(generic.items()) + [(lay, lay.n_formed) for lay in reversed(formed)]
    total = sum(c for _, c in units)
    if not total:
        return []
    n_groups = max(1, -(-rows * total * itemsize // _inputs.FEATURE_BYTES))
    groups: list[tuple[list[_Layer], list[str]]] = [([], [])]
    used = 0
    for unit, cols in units:
        if used and used + cols / 2 > total / n_groups * len(groups):  # past this group's share
            groups.append(([], []))
        groups[-1][1 if isinstance(unit, str) else 0].append(unit)
        used += cols
    return [(sorted(ls, key=formed.index), tuple(names)) for ls, names in groups]


def per_layer_gram(model: nn.Module, layers: list[_Layer], generic: tuple[str, ...], x1: torch.Tensor,
                   x2: torch.Tensor | None, K: int, full: bool, block: int) -> torch.Tensor:
    """Exact NTK Gramian from per-layer features plus per-sample Jacobians, in (block × block) tiles.

    ``G = Σ_l (Â_l Â_lᵀ) ⊙ (D_l D_lᵀ) + M Mᵀ`` (factored layers; formed gradients and generic
    Jacobians M), M built group by group of columns (:func:`_column_groups`).

    Args:
        model: the network; layers: its fast layers (:func:`per_layer_layers`); generic: the
            qualified names of the other trainable parameters (per-sample Jacobians).
        x1: (N1, …) points; x2: (N2, …) or None (symmetric: upper tiles computed once, mirrored).
        K: outputs; full: (N1, K, N2, K) instead of the traced (N1, N2).
        block: points per tile side.

    Returns:
        (N1, N2) traced or (N1, K, N2, K) full, in the model's dtype.
    """
    sym = x2 is None
    n1, n2 = x1.shape[0], (x1 if sym else x2).shape[0]
    like = next(p for p in model.parameters() if p.requires_grad)
    gen = {n: model.get_parameter(n).numel() for n in generic}
    formed = [lay for lay in layers if not lay.factored]
    factored = [lay for lay in layers if lay.factored]
    G = torch.zeros((n1, K, n2, K) if full else (n1, n2), dtype=like.dtype, device=like.device)
    tiles = tile_slices(n1, n2, block, sym)
    groups = _column_groups(formed, gen, (n1 + (0 if sym else n2)) * K, like.element_size()) or [([], ())]
    width = max(sum(lay.n_formed for lay in ls) + sum(gen[n] for n in names) for ls, names in groups)
    buf1 = like.new_empty(n1 * K * width)
    buf2 = None if sym else like.new_empty(n2 * K * width)
    F1 = _factor_arrays(factored, n1, K, like)
    F2 = F1 if sym else _factor_arrays(factored, n2, K, like)
    r = K if full else 1
    for g, (ls, names) in enumerate(groups):
        pass_layers = sorted(ls + (factored if g == 0 else []), key=layers.index)
        jac = jacobian_fn(model, K, names) if names else None
        cols = sum(lay.n_formed for lay in ls) + sum(gen[n] for n in names)
        M1 = buf1[:n1 * K * cols].view(n1, K, cols)
        _fill(model, pass_layers, jac, x1, K, M1, F1 if g == 0 else [])
        M2 = M1
        if not sym:
            M2 = buf2[:n2 * K * cols].view(n2, K, cols)
            _fill(model, pass_layers, jac, x2, K, M2, F2 if g == 0 else [])
        if cols:
            add_formed(G.view(n1 * r, n2 * r), M1.view(n1 * r, -1), M2.view(n2 * r, -1), tiles, r, sym)
    del buf1, buf2
    add_factors(G, F1, F2, tiles, K, full)
    if sym:
        _mirror_upper(G, block, full)
    return G
