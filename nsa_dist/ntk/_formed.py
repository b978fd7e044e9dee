"""Per-sample gradients of one layer from its input and output gradient, in closed form (private).

The formulas of :mod:`nsa_dist.ntk.layer_features`'s docstring; every route writes the gradients of all
samples of a chunk and every model output into its columns of the feature matrix M at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vjp, vmap

from nsa_dist.ntk._probe import FastLayer
from nsa_dist.ntk.state import call

__all__ = ["Layer", "kind", "write_formed"]

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@dataclass(frozen=True)
class Layer:
    """A fast layer: its trainable parameters (local names) and the route of their gradients.

    ``kind``: "factor" (Linear on 2-D inputs: factors Â, D), "conv" (Conv1d/2d/3d), "bn" (eval
    BatchNorm), "ln" (LayerNorm), "emb" (Embedding), "linear" (Linear at L positions) — formed by
    the closed forms of :mod:`.layer_features` — or "local" (formed by the VJP of the layer alone).
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


def kind(lay: FastLayer) -> str:
    m = lay.module
    if lay.factored:
        return "factor"
    if (
        any(type(m).forward is c.forward for c in _CONVS)
        and m.padding_mode == "zeros"
        and not isinstance(m.padding, str)
    ):
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


def _conv_weight_grad(m: nn.Module, A: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
    """Per-sample ∂f/∂W of a convolution, (b, C_out·C_in/g·∏k) in the weight's own order.

    One ``convolution_backward`` of a convolution whose groups are the batch's samples (times the
    layer's own groups): input (1, b·C_in, …), output gradient (1, b·C_out, …), so its "weight
    gradient" (b·C_out, C_in/g, k…) holds every sample's gradient.  On the ResNet of
    benchmarks/ntk_models.py (128 points, 3–64 channels) 3.2× faster in all than offset-wise
    batched products of strided views and 11× faster than ``unfold`` (CPU ``im2col``) + ``bmm``.
    """
    b, C, O = A.shape[0], A.shape[1], dz.shape[1]
    w_shape = (b * O, C // m.groups) + tuple(m.kernel_size)
    _, gw, _ = torch.ops.aten.convolution_backward(
        dz.reshape((1, b * O) + dz.shape[2:]),
        A.reshape((1, b * C) + A.shape[2:]),
        A.new_empty(w_shape),
        None,
        list(m.stride),
        list(m.padding),
        list(m.dilation),
        False,
        [0] * len(m.stride),
        b * m.groups,
        [False, True, False],
    )
    return gw.view(b, -1)


def _local_grad(lay: Layer, A: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Per-sample gradients (b, P_l) of a layer as the VJP of the layer alone at its own input:
    ``vjp(θ_l ↦ layer(a_i; θ_l))(δ_i)`` for every sample i (vmapped)."""
    m = lay.module
    p0 = {n: getattr(m, n).detach() for n in lay.params}

    def one(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        _, pull = vjp(lambda p: call(m, p, (a[None],)), p0)
        (g,) = pull(d[None])
        return torch.cat([g[n].reshape(-1) for n in lay.params])  # (P_l,)

    return vmap(one)(A, delta)


def _scaled_into(dst: torch.Tensor, g: torch.Tensor, scale: float) -> None:
    """dst = scale·g (a plain copy for the usual scale 1)."""
    if scale == 1.0:
        dst.copy_(g)
    else:
        torch.mul(g, scale, out=dst)


def write_formed(lay: Layer, A: torch.Tensor, deltas: list[torch.Tensor | None], out: torch.Tensor) -> None:
    """Per-sample gradients of a formed layer into out (b, K, P_l), from its input A (b, …) and
    the output gradients δ_a (b, …) of each model output a (None: f_a does not depend on it)."""
    m, b = lay.module, A.shape[0]
    red = tuple(range(2, A.ndim))  # positions (conv, batch norm)
    if lay.kind == "bn":
        xhat = F.batch_norm(A, m.running_mean, m.running_var, None, None, False, 0.0, m.eps)  # (b, C, …) in one pass
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
