"""NTK by Jacobian contraction with torch.func, for any module (private)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from nsa_dist.ntk._inputs import as_2d, trainable_params

# Per-block Jacobians of the second input are cached while they fit under this many bytes;
# past it they are recomputed for every row block (memory stays at two blocks).
_JAC_CACHE_BYTES = 2 * 2**30


def jacobian_fn(model: nn.Module, K: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """x (b, d) ↦ J (b, K, P): per-sample Jacobians of the outputs w.r.t. trainable parameters."""
    params = {k: p.detach() for k, p in trainable_params(model).items()}
    buffers = dict(model.named_buffers())
    frozen = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}

    def f_one(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return as_2d(functional_call(model, ({**p, **frozen}, buffers), (x[None],)))[0]  # (K,)

    jac = vmap(jacrev(f_one), in_dims=(None, 0))

    def J(xb: torch.Tensor) -> torch.Tensor:
        blocks = jac(params, xb)
        return torch.cat([blocks[k].reshape(xb.shape[0], K, -1) for k in params], dim=2)  # (b, K, P)

    return J


def jacobian_gram(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor | None, K: int, full: bool,
                  block: int) -> torch.Tensor:
    """``G_IJ = J_I J_Jᵀ`` block by block; (N1, N2) traced or (N1, K, N2, K) full."""
    J = jacobian_fn(model, K)
    sym = x2 is None
    xs2 = x1 if sym else x2
    n1, n2 = x1.shape[0], xs2.shape[0]
    G = torch.zeros((n1, K, n2, K) if full else (n1, n2), dtype=x1.dtype, device=x1.device)
    P = sum(p.numel() for p in trainable_params(model).values())
    cache_ok = n2 * K * P * x1.element_size() <= _JAC_CACHE_BYTES
    cache: dict[int, torch.Tensor] = {}

    def J2(t: int) -> torch.Tensor:
        if t in cache:
            return cache[t]
        out = J(xs2[t:t + block])
        if cache_ok:
            cache[t] = out
        return out

    for s in range(0, n1, block):
        J1 = J2(s) if sym else J(x1[s:s + block])  # (bi, K, P)
        bi = J1.shape[0]
        for t in range(s if sym else 0, n2, block):
            Jt = J1 if (sym and t == s) else J2(t)  # (bj, K, P)
            bj = Jt.shape[0]
            if full:
                tile = (J1.reshape(bi * K, P) @ Jt.reshape(bj * K, P).T).view(bi, K, bj, K)
                G[s:s + bi, :, t:t + bj, :] = tile
                if sym and t != s:
                    G[t:t + bj, :, s:s + bi, :] = tile.permute(2, 3, 0, 1)
            else:
                tile = J1.reshape(bi, K * P) @ Jt.reshape(bj, K * P).T  # Σ_a J_a J_aᵀ
                G[s:s + bi, t:t + bj] = tile
                if sym and t != s:
                    G[t:t + bj, s:s + bi] = tile.T
    return G
