"""Per-layer NTK: fast per-layer features where the forward proves them valid, per-sample
Jacobians for every other parameter (private).

``G = Σ_g J_g J_gᵀ`` over any partition of the parameters, so each group takes its own route
(:func:`~nsa_dist.ntk._probe.plan_forward` decides which).  One forward and one backward pass per
output a give, for every fast layer, its input ``A`` and its output gradient ``δ_a = ∂f_a/∂z``:

- Linear on (n, features) inputs: the structured factors of :mod:`._structured`,
  ``G_IJ += (Â_I Â_Jᵀ) ⊙ (D_I D_Jᵀ)`` with ``Â = [w·A, β·1]`` and ``D = [δ_1 … δ_K]``.
- Conv2d ``z = w·W ⋆ A + β·b`` (groups = 1, numeric zero padding): with the input patches at the
  L output positions, ``∂f_a/∂W = w·δ_a Uᵀ`` and ``∂f_a/∂b = β·δ_a 1`` (offset by offset from
  strided views of the padded input, see ``_conv_weight_grad``).
- Linear on (n, …, features) inputs (applied at L positions): ``∂f_a/∂W = w·Σ_p δ_{a,p} a_pᵀ``.
- Any other known layer (Conv1d/3d, grouped or padded convolutions, Embedding, LayerNorm,
  GroupNorm, eval-mode BatchNorm, RMSNorm): the per-sample gradient is the VJP of the layer
  alone at its own input, ``∂f_a/∂θ_l = vjp(θ ↦ layer(A; θ))(δ_a)``, batched over samples.
- The rest (recurrent, attention, shared weights, custom modules): per-sample Jacobians of the
  whole model with respect to those parameters only (:func:`~nsa_dist.ntk._jacobian.jacobian_fn`).

Formed gradients ``g`` (N, K, P_formed) are contracted ``G_IJ += g_I g_Jᵀ``.  Exact, and it never
forms the Jacobian of the factored Linear layers, whose weights dominate P in a CNN.
Memory: ``N·(Σ_lin (n_in + 1 + K·n_out) + K·P_formed)`` numbers, plus G.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torch.func import functional_call, vjp, vmap

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.ntk._jacobian import jacobian_fn
from nsa_dist.ntk._probe import ForwardPlan, FastLayer, plan_forward
from nsa_dist.ntk._structured import _mirror_upper, layer_passes

__all__ = ["conv_layers", "per_layer_layers", "per_layer_gram"]

# Points per forward/backward pass while the features are computed.
_FEATURE_CHUNK = 256


@dataclass(frozen=True)
class _Layer:
    """A fast layer: its trainable parameters (local names) and the route of their gradients.

    ``kind``: "factor" (Linear on 2-D inputs: factors Â, D), "conv2d" / "linear" (formed by the
    closed forms below), "local" (formed by the VJP of the layer alone).
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


def _kind(lay: FastLayer) -> str:
    m = lay.module
    if lay.factored:
        return "factor"
    if type(m).forward is nn.Conv2d.forward and m.groups == 1 and m.padding_mode == "zeros" \
            and not isinstance(m.padding, str):
        return "conv2d"
    if isinstance(m, nn.Linear) and set(lay.params) <= {"weight", "bias"}:
        return "linear"
    return "local"


def per_layer_layers(plan: ForwardPlan) -> list[_Layer]:
    """The fast layers of a plan with the route of each."""
    return [_Layer(lay.module, lay.params, lay.w, lay.b, _kind(lay), lay.clone_out) for lay in plan.layers]


def conv_layers(model: nn.Module, x_probe: torch.Tensor) -> list[_Layer]:
    """The model's fast layers when every trainable parameter takes a per-layer route, else
    UnsupportedModelError naming the first that does not (see :func:`plan_forward`)."""
    plan = plan_forward(model, x_probe)
    if plan.coupled or plan.generic:
        name = plan.generic[0] if plan.generic else next(iter(plan.routes))
        raise UnsupportedModelError(f"method='per_layer' has no per-layer formula for parameter {name!r}: "
                                    f"{plan.routes[name][1]} (use method='auto')")
    return per_layer_layers(plan)


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


def _formed_grad(lay: _Layer, A: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Per-sample gradients (b, P_l) of a formed layer from its input A and output gradient δ."""
    if lay.kind == "local":
        return _local_grad(lay, A, delta)
    m, b = lay.module, A.shape[0]
    parts = []
    if lay.kind == "conv2d":
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


def _chunk_features(model: nn.Module, layers: list[_Layer], jac, x: torch.Tensor, K: int
                    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """Factors (Â (b, n_in+1), D (b, K·n_out)) of each factored layer and the formed gradients
    M (b, K·P_formed) of the others — the fast layers' and, from ``jac`` (x ↦ (b, K, P_g)), the
    per-sample Jacobians of the remaining parameters — for one chunk of points x (b, …)."""
    b = x.shape[0]
    factors, formed = [], []
    if layers:
        acts, Z, grads = layer_passes(model, [lay.module for lay in layers], x, K, [lay.clone_out for lay in layers])
        for i, lay in enumerate(layers):
            A = acts[i]
            deltas = [g[i] if g[i] is not None else torch.zeros_like(Z[i]) for g in grads]  # K × (b, …)
            if lay.factored:
                cols = (([A * lay.w] if lay.w is not None else [])
                        + ([A.new_full((b, 1), lay.b)] if lay.b is not None else []))
                factors.append((torch.cat(cols, dim=1), torch.cat(deltas, dim=1)))  # (b, n_in+1), (b, K·n_out)
            else:
                formed.append(torch.stack([_formed_grad(lay, A, d) for d in deltas], dim=1))  # (b, K, P_l)
    if jac is not None:
        formed.append(jac(x))  # (b, K, P_generic)
    M = torch.cat(formed, dim=2).reshape(b, -1) if formed else None  # (b, K·P_formed)
    return factors, M


def _features(model: nn.Module, layers: list[_Layer], jac, x: torch.Tensor, K: int
              ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """The features of every point of x, ``_FEATURE_CHUNK`` points per forward/backward pass,
    written into preallocated (N, ·) arrays."""
    n = x.shape[0]
    factors: list[tuple[torch.Tensor, torch.Tensor]] = []
    M: torch.Tensor | None = None
    for s in range(0, n, _FEATURE_CHUNK):
        fac, Mc = _chunk_features(model, layers, jac, x[s:s + _FEATURE_CHUNK], K)
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


def per_layer_gram(model: nn.Module, layers: list[_Layer], generic: tuple[str, ...], x1: torch.Tensor,
                   x2: torch.Tensor | None, K: int, full: bool, block: int) -> torch.Tensor:
    """Exact NTK Gramian from per-layer features plus per-sample Jacobians, in (block × block) tiles.

    Args:
        model: the network; layers: its fast layers (:func:`per_layer_layers`); generic: the
            qualified names of the other trainable parameters (per-sample Jacobians).
        x1: (N1, …) points; x2: (N2, …) or None (symmetric: upper tiles computed once, mirrored).
        K: outputs; full: (N1, K, N2, K) instead of the traced (N1, N2).
        block: points per tile side.
    """
    jac = jacobian_fn(model, K, generic) if generic else None
    sym = x2 is None
    f1 = _features(model, layers, jac, x1, K)
    f2 = f1 if sym else _features(model, layers, jac, x2, K)
    n1, n2 = x1.shape[0], (x1 if sym else x2).shape[0]
    dtype = next(p.dtype for p in model.parameters() if p.requires_grad)
    G = torch.zeros((n1, K, n2, K) if full else (n1, n2), dtype=dtype, device=x1.device)
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
