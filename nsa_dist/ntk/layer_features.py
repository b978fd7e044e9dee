"""Per-layer NTK: fast per-layer features where the forward proves them valid, per-sample
Jacobians for every other parameter.

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
- Any other known layer (GroupNorm, RMSNorm, convolutions with other padding modes): the VJP of the layer
  alone at its own input,
  ``∂f_a/∂θ_l = vjp(θ ↦ layer(A; θ))(δ_a)``, batched over samples.
- The rest (recurrent, attention, shared weights, custom modules): per-sample Jacobians of the
  whole model with respect to those parameters only (:func:`~nsa_dist.ntk._jacobian.jacobian_fn`).

The formed gradients are written straight into one feature matrix M (N, K, P_formed) and
contracted ``G += M Mᵀ`` (:mod:`._contract`: column chunks, upper tiles only when symmetric).
Memory: M is held for all points while it fits in :data:`~nsa_dist.ntk.inputs.FEATURE_BYTES`;
past it the formed columns are split into groups, one forward/backward pass over the data per
group (the latest layers first: their backward pass is the shortest).  Exact, and it never forms
the Jacobian of the factored Linear layers.
"""

from __future__ import annotations

import torch
from torch import nn

from nsa_dist.ntk import inputs
from nsa_dist.ntk._attention import Projection, attention_ok, decomposed_forwards, projections
from nsa_dist.ntk._contract import add_factors, add_formed, tile_slices
from nsa_dist.ntk._formed import Layer as _Layer, kind as _kind, write_formed
from nsa_dist.ntk._jacobian import jacobian_fn
from nsa_dist.ntk._probe import ForwardPlan
from nsa_dist.ntk._structured import _mirror_upper, layer_passes

__all__ = ["per_layer_layers", "per_layer_gram"]

# Points per forward/backward pass while the features are computed.
_FEATURE_CHUNK = 128


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


def _pass(
    model: nn.Module,
    layers: list[_Layer],
    jac,
    x: torch.Tensor,
    K: int,
    M: torch.Tensor | None,
    factors: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """One forward and backward pass over a chunk of points x (b, …): the formed gradients of
    ``layers`` and, from ``jac`` (x ↦ (b, K, P_g)), the per-sample Jacobians of the generic
    parameters, written into M (b, K, P_group) in that order; the factors (Â (b, n_in+1),
    D (b, K·n_out)) of the factored layers among ``layers`` into ``factors``, in order."""
    off, f = 0, 0
    if layers:
        pairs = {
            id(lay.module.owner): (lay.module.owner,) + lay.module.pair
            for lay in layers
            if isinstance(lay.module, Projection)
        }
        with decomposed_forwards(list(pairs.values())):
            acts, Z, grads = layer_passes(
                model, [lay.module for lay in layers], x, K, [lay.clone_out for lay in layers]
            )
        for i, lay in enumerate(layers):
            A = acts[i]
            deltas = [g[i] for g in grads]  # K × (b, …) or None
            if lay.factored:
                Ahat, D = factors[f]
                f += 1
                c = 0
                if lay.w is not None:
                    torch.mul(A, lay.w, out=Ahat[:, : A.shape[1]])
                    c = A.shape[1]
                if lay.b is not None:
                    Ahat[:, c].fill_(lay.b)
                n_out = Z[i].shape[1]
                for a, d in enumerate(deltas):
                    D_a = D[:, a * n_out : (a + 1) * n_out]
                    D_a.copy_(d) if d is not None else D_a.zero_()
            else:
                write_formed(lay, A, deltas, M[:, :, off : off + lay.n_formed])
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


def _fill(
    model: nn.Module,
    layers: list[_Layer],
    jac,
    x: torch.Tensor,
    K: int,
    M: torch.Tensor | None,
    factors: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """:func:`_pass` over all points of x, ``_FEATURE_CHUNK`` at a time, into M (N, K, P_group) and
    the factor arrays (N, ·)."""
    for s in range(0, x.shape[0], _FEATURE_CHUNK):
        e = min(s + _FEATURE_CHUNK, x.shape[0])
        _pass(model, layers, jac, x[s:e], K, None if M is None else M[s:e], [(A[s:e], D[s:e]) for A, D in factors])


def _features(
    model: nn.Module, layers: list[_Layer], jac, x: torch.Tensor, K: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """All features of the points x (N, …): the factors (Â (N, n_in+1), D (N, K·n_out)) of each
    factored layer and the formed gradients M (N, K·P_formed) of the other layers then of the
    generic parameters (``jac``: x ↦ (b, K, P_generic), or None)."""
    n = x.shape[0]
    like = next(p for p in model.parameters() if p.requires_grad)
    factors = _factor_arrays(layers, n, K, like)
    n_jac = 0 if jac is None else getattr(jac, "n_params", None) or jac(x[:1]).shape[2]  # any x ↦ (b, K, P) callable
    cols = sum(lay.n_formed for lay in layers) + n_jac
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


def _column_groups(
    formed: list[_Layer], generic: dict[str, int], rows: int, itemsize: int
) -> list[tuple[list[_Layer], tuple[str, ...]]]:
    """The formed columns in g = ⌈rows·P_formed·itemsize / FEATURE_BYTES⌉ groups of about equal
    width (``rows`` = N·K rows each): (layers, generic parameter names) per group.  The generic
    parameters (name → size) come first, then the layers latest first (a group of late layers
    needs only a short backward pass); a layer or a parameter is never split."""
    units: list[tuple[_Layer | str, int]] = list(generic.items()) + [(lay, lay.n_formed) for lay in reversed(formed)]
    total = sum(c for _, c in units)
    if not total:
        return []
    n_groups = max(1, -(-rows * total * itemsize // inputs.FEATURE_BYTES))
    groups: list[tuple[list[_Layer], list[str]]] = [([], [])]
    used = 0
    for unit, cols in units:
        if used and used + cols / 2 > total / n_groups * len(groups):  # past this group's share
            groups.append(([], []))
        groups[-1][1 if isinstance(unit, str) else 0].append(unit)
        used += cols
    return [(sorted(ls, key=formed.index), tuple(names)) for ls, names in groups]


def per_layer_gram(
    model: nn.Module,
    layers: list[_Layer],
    generic: tuple[str, ...],
    x1: torch.Tensor,
    x2: torch.Tensor | None,
    K: int,
    full: bool,
    block: int,
) -> torch.Tensor:
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
        M1 = buf1[: n1 * K * cols].view(n1, K, cols)
        _fill(model, pass_layers, jac, x1, K, M1, F1 if g == 0 else [])
        M2 = M1
        if not sym:
            M2 = buf2[: n2 * K * cols].view(n2, K, cols)
            _fill(model, pass_layers, jac, x2, K, M2, F2 if g == 0 else [])
        if cols:
            add_formed(G.view(n1 * r, n2 * r), M1.view(n1 * r, -1), M2.view(n2 * r, -1), tiles, r, sym)
    del buf1, buf2
    add_factors(G, F1, F2, tiles, K, full)
    if sym:
        _mirror_upper(G, block, full)
    return G
