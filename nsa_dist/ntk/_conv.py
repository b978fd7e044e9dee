"""Per-layer NTK for networks of Conv2d and Linear layers (private).

One forward and one backward pass per output a give, for every layer, its input ``A`` and its
output gradient ``δ_a = ∂f_a/∂z``; the per-sample parameter gradients follow layer by layer:

- Conv2d ``z = w·W ⋆ A + β·b`` (groups = 1, zero padding): with ``U = unfold(A)`` (C_in·k_h·k_w, L)
  the input patches at the L output positions and ``δ_a`` (C_out, L),
  ``∂f_a/∂W = w·δ_a Uᵀ`` (C_out, C_in·k_h·k_w) and ``∂f_a/∂b = β·δ_a 1`` (computed offset by
  offset from strided views of the padded input, see ``_conv_weight_grad``).  A convolution has few
  parameters, so these gradients ``g`` (N, K, P_l) are formed and contracted, ``G_IJ += g_I g_Jᵀ``.
- Linear on (n, features) inputs: the structured factors of :mod:`._structured`,
  ``G_IJ += (Â_I Â_Jᵀ) ⊙ (D_I D_Jᵀ)`` with ``Â = [w·A, β·1]`` and ``D = [δ_1 … δ_K]``.
- Linear on (n, …, features) inputs (applied at L positions): ``∂f_a/∂W = w·Σ_p δ_{a,p} a_pᵀ``,
  formed like a convolution's.

Exact (no approximation), and it never forms the N×P Jacobian of the Linear layers, whose
weights dominate P in a CNN.  Memory: the features of all N points,
``N·(Σ_lin (n_in + 1 + K·n_out) + K·P_formed)`` numbers, plus G.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.ntk._structured import _mirror_upper, input_ranks, layer_passes

__all__ = ["conv_layers", "per_layer_gram"]

# Points per forward/backward pass while the features are computed.
_FEATURE_CHUNK = 256


@dataclass(frozen=True)
class _Layer:
    """A Conv2d or Linear layer with the scales of its trainable parameters (None: frozen/absent).

    ``factored``: a Linear on 2-D inputs, contracted through its factors Â, D; otherwise its
    per-sample gradients are formed.
    """

    module: nn.Module
    w: float | None
    b: float | None
    factored: bool


def conv_layers(model: nn.Module, x_probe: torch.Tensor) -> list[_Layer]:
    """The model's Conv2d / Linear layers, or UnsupportedModelError saying why the path does not apply.

    The path needs: every trainable parameter in an ``nn.Conv2d`` (groups = 1, zero padding) or
    an ``nn.Linear``; each such layer called once per forward; no batch statistics.
    """
    owner = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    for name, p in model.named_parameters():
        mod = owner[id(p)]
        if p.requires_grad and not isinstance(mod, (nn.Linear, nn.Conv2d)):
            raise UnsupportedModelError(
                f"method='per_layer' needs every trainable parameter in an nn.Conv2d or nn.Linear layer; "
                f"parameter {name!r} belongs to {type(mod).__name__} (use method='jacobian' or 'auto')")
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and (mod.training or not mod.track_running_stats):
            raise UnsupportedModelError(f"method='per_layer' cannot handle {type(mod).__name__} ({name!r}) "
                                        "using batch statistics, which mixes samples; use method='jacobian'")
        if isinstance(mod, nn.Conv2d) and (mod.groups != 1 or mod.padding_mode != "zeros"
                                           or isinstance(mod.padding, str)):
            raise UnsupportedModelError(f"method='per_layer' handles Conv2d with groups=1 and numeric zero "
                                        f"padding; {name!r} is {mod} (use method='jacobian')")
    mods = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))
            and (m.weight.requires_grad or (m.bias is not None and m.bias.requires_grad))]
    ndims = _probe_calls(model, mods, x_probe)
    return [_Layer(m, getattr(m, "weight_scale", 1.0) if m.weight.requires_grad else None,
                   getattr(m, "bias_scale", 1.0) if m.bias is not None and m.bias.requires_grad else None,
                   isinstance(m, nn.Linear) and nd == 2)
            for m, nd in zip(mods, ndims)]


def _probe_calls(model: nn.Module, mods: list[nn.Module], x: torch.Tensor) -> list[int]:
    """The input rank each layer sees; UnsupportedModelError unless each is called exactly once."""
    ranks = input_ranks(model, mods, x)
    for m, seen in zip(mods, ranks):
        if len(seen) != 1:
            raise UnsupportedModelError(f"method='per_layer' needs each layer used once per forward; {m} is called "
                                        f"{len(seen)} times (use method='jacobian')")
    return [seen[0] for seen in ranks]


def _conv_weight_grad(m: nn.Conv2d, A: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
    """Per-sample ∂f/∂W of a convolution, (b, C_in·O·k_h·k_w) in (C_in, O, k_h, k_w) order.

    For each kernel offset (i, j) the input pixels it meets form a strided view V_ij (b, C_in, L) of
    the padded input; ``∂f/∂W[:, :, i, j] = δ V_ijᵀ``.  Nine small batched products instead of
    one ``unfold``: the same numbers without building the (b, C_in·k², L) patch matrix, 2–2.5×
    faster on CPU (``im2col`` dominated the profile).  The order of the entries is irrelevant to
    G, which only takes inner products of gradients.
    """
    (ph, pw), (sh, sw), (dh, dw), (kh, kw) = m.padding, m.stride, m.dilation, m.kernel_size
    b, Ho, Wo = A.shape[0], dz.shape[2], dz.shape[3]  # dz: δ (b, O, Ho, Wo)
    L = Ho * Wo
    xp = F.pad(A, (pw, pw, ph, ph)) if ph or pw else A  # (b, C_in, H + 2p, W + 2p)
    dT = dz.reshape(b, dz.shape[1], L).transpose(1, 2)  # (b, L, O)
    out = []
    for i in range(kh):
        for j in range(kw):
            V = xp[:, :, i * dh:i * dh + sh * (Ho - 1) + 1:sh, j * dw:j * dw + sw * (Wo - 1) + 1:sw]  # (b, C_in, Ho, Wo)
            out.append(torch.bmm(V.reshape(b, V.shape[1], L), dT))  # (b, C_in, O)
    return torch.stack(out, dim=-1).reshape(b, -1)


def _formed_grad(lay: _Layer, A: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Per-sample gradients (b, P_l) of a formed layer from its input A and output gradient δ."""
    m, b = lay.module, A.shape[0]
    parts = []
    if isinstance(m, nn.Conv2d):
        if lay.w is not None:
            parts.append(_conv_weight_grad(m, A, delta) * lay.w)  # (b, C_out·C_in k k)
        dz = delta.reshape(b, delta.shape[1], -1)  # (b, C_out, L)
    else:  # Linear at L positions
        dz = delta.reshape(b, -1, delta.shape[-1]).transpose(1, 2)  # (b, n_out, L)
        if lay.w is not None:
            parts.append((torch.bmm(dz, A.reshape(b, -1, A.shape[-1])) * lay.w).reshape(b, -1))  # (b, n_out·n_in)
    if lay.b is not None:
        parts.append(dz.sum(-1) * lay.b)  # (b, C_out)
    return torch.cat(parts, dim=1)


def _chunk_features(model: nn.Module, layers: list[_Layer], x: torch.Tensor, K: int
                    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """Factors (Â (b, n_in+1), D (b, K·n_out)) of each factored layer and the formed gradients
    M (b, K·P_formed) of the others, for one chunk of points x (b, …)."""
    acts, Z, grads = layer_passes(model, [lay.module for lay in layers], x, K)
    b = x.shape[0]
    factors, formed = [], []
    for i, lay in enumerate(layers):
        A = acts[i]
        deltas = [g[i] if g[i] is not None else torch.zeros_like(Z[i]) for g in grads]  # K × (b, …)
        if lay.factored:
            cols = ([A * lay.w] if lay.w is not None else []) + ([A.new_full((b, 1), lay.b)] if lay.b is not None else [])
            factors.append((torch.cat(cols, dim=1), torch.cat(deltas, dim=1)))  # (b, n_in+1), (b, K·n_out)
        else:
            formed.append(torch.stack([_formed_grad(lay, A, d) for d in deltas], dim=1))  # (b, K, P_l)
    M = torch.cat(formed, dim=2).reshape(b, -1) if formed else None  # (b, K·P_formed)
    return factors, M


def _features(model: nn.Module, layers: list[_Layer], x: torch.Tensor, K: int
              ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """The features of every point of x, ``_FEATURE_CHUNK`` points per forward/backward pass,
    written into preallocated (N, ·) arrays."""
    n = x.shape[0]
    factors: list[tuple[torch.Tensor, torch.Tensor]] = []
    M: torch.Tensor | None = None
    for s in range(0, n, _FEATURE_CHUNK):
        fac, Mc = _chunk_features(model, layers, x[s:s + _FEATURE_CHUNK], K)
        if s == 0:
            factors = [(A.new_empty((n,) + A.shape[1:]), D.new_empty((n,) + D.shape[1:])) for A, D in fac]
            M = Mc.new_empty((n,) + Mc.shape[1:]) if Mc is not None else None
        for (A_all, D_all), (A, D) in zip(factors, fac):
            A_all[s:s + A.shape[0]], D_all[s:s + D.shape[0]] = A, D
        if M is not None:
            M[s:s + Mc.shape[0]] = Mc
    return factors, M


def _tile(fi: tuple, fj: tuple, i: slice, j: slice, K: int, full: bool) -> torch.Tensor:
    """Σ_l of layer l's share of G[i, j]: (bi, bj) traced or (bi, K, bj, K) full."""
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


def per_layer_gram(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor | None, K: int, full: bool,
                   block: int) -> torch.Tensor:
    """Exact NTK Gramian of a Conv2d/Linear network from per-layer features, in (block × block) tiles.

    Args:
        model: a network :func:`conv_layers` accepts.
        x1: (N1, …) points; x2: (N2, …) or None (symmetric: upper tiles computed once, mirrored).
        K: outputs; full: (N1, K, N2, K) instead of the traced (N1, N2).
        block: points per tile side.
    """
    layers = conv_layers(model, x1[:2])
    sym = x2 is None
    f1 = _features(model, layers, x1, K)
    f2 = f1 if sym else _features(model, layers, x2, K)
    n1, n2 = x1.shape[0], (x1 if sym else x2).shape[0]
    G = torch.zeros((n1, K, n2, K) if full else (n1, n2), dtype=x1.dtype, device=x1.device)
    for s in range(0, n1, block):
        i = slice(s, min(s + block, n1))
        for t in (range(s, n2, block) if sym else range(0, n2, block)):
            j = slice(t, min(t + block, n2))
            if full:
                G[i, :, j, :] = _tile(f1, f2, i, j, K, full)
            else:
                G[i, j] = _tile(f1, f2, i, j, K, full)
    if sym:
        _mirror_upper(G, block, full)
    return G
