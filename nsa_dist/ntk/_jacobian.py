"""NTK by Jacobian contraction with torch.func, for any module (private).

Two Jacobians:

* per-sample (:func:`jacobian_fn`): ``J_i = ∂f(x_i)/∂θ`` point by point (``vmap(jacrev)``), for
  models whose outputs for one point depend on that point alone.  Where ``vmap`` has no batching
  rule (recurrent layers) the same numbers come from one reverse pass per point and output.
* full-batch (:func:`batch_jacobian_gram`): ``J = ∂f(X)/∂θ`` of the forward over the whole batch,
  for models that couple samples (batch norm in train mode): the kernel of the batch forward,
  ``G = J Jᵀ``, row chunks of J from one forward and batched reverse passes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import jacrev, vjp, vmap

from nsa_dist.ntk import inputs
from nsa_dist.ntk.inputs import as_2d, trainable_params
from nsa_dist.ntk.state import call

__all__ = ["jacobian_fn", "jacobian_gram", "batch_jacobian_gram"]

# Autograd nodes whose torch.func batching is silently wrong (torch 2.13, no error raised, so the
# except-fallback never fires): cdist's backward under vmap(jacrev) / vmap(vjp) is off by 1e-2..4e-2
# relative, PReLU's kernel backward (PreluKernelBackward0) by up to 1e-1 when a chunk has as many
# points as outputs.  A model whose forward graph holds one of these (substring of the node's class
# name) is differentiated by plain reverse passes, one per point and output / cotangent: exact.
_VMAP_UNSAFE = ("Cdist", "Prelu")


def _graph_nodes(out: torch.Tensor) -> set[str]:
    """Class names of the autograd nodes that ``out`` was computed through."""
    names: set[str] = set()
    seen: set[int] = set()
    stack = [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        names.add(type(fn).__name__)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return names


def vmap_unsafe(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    rest: dict[str, torch.Tensor],
    xb: torch.Tensor,
) -> bool:
    """Whether one plain autograd forward of ``model`` at ``xb`` passes through an op of
    :data:`_VMAP_UNSAFE` (then torch.func's ``vmap`` must not be trusted for its Jacobian)."""
    live = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    try:
        with torch.enable_grad():
            out = call(model, {**live, **rest}, (xb,))
            out = as_2d(out, xb.shape[0])
    except Exception:  # noqa: BLE001 - the caller's own path reports it
        return False
    if not isinstance(out, torch.Tensor) or out.grad_fn is None:
        return False
    return any(bad in name for name in _graph_nodes(out) for bad in _VMAP_UNSAFE)


# Per-block Jacobians of the second input are cached while they fit in inputs.FEATURE_BYTES
# (the feature memory rule of every NTK path); past it they are recomputed for every row block
# (memory stays at two blocks).


def jacobian_fn(
    model: nn.Module, K: int, names: tuple[str, ...] | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """x (b, …) ↦ J (b, K, P_names): per-sample Jacobians of the outputs w.r.t. the trainable
    parameters ``names`` (default all), every other parameter held fixed; P_names is the
    function's ``n_params`` attribute."""
    trainable = trainable_params(model)
    names = tuple(trainable) if names is None else names
    params = {k: trainable[k].detach() for k in names}
    buffers = dict(model.named_buffers())
    frozen = {k: p.detach() for k, p in model.named_parameters() if k not in params}
    state: dict[str, bool | None] = {"vmap": None}  # None: not yet checked against _VMAP_UNSAFE

    def f_one(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return as_2d(call(model, {**p, **frozen, **buffers}, (x[None],)), 1)[0]  # (K,)

    jac = vmap(jacrev(f_one), in_dims=(None, 0))

    def by_loop(xb: torch.Tensor) -> torch.Tensor:
        """One forward and K reverse passes per point: no batching rule needed."""
        live = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        rows = []
        for i in range(xb.shape[0]):
            with torch.enable_grad():
                out = as_2d(call(model, {**live, **frozen, **buffers}, (xb[i : i + 1],)), 1)[0]  # (K,)
                for a in range(K):
                    # an output that none of these parameters reaches (a frozen encoder under no_grad): zeros
                    g = (
                        torch.autograd.grad(out[a], list(live.values()), retain_graph=a < K - 1, allow_unused=True)
                        if out.requires_grad
                        else [None] * len(live)
                    )
                    rows.append(
                        torch.cat(
                            [
                                (gi if gi is not None else torch.zeros_like(v)).reshape(-1)
                                for gi, v in zip(g, live.values())
                            ]
                        )
                    )
        return torch.stack(rows).view(xb.shape[0], K, -1)

    def J(xb: torch.Tensor) -> torch.Tensor:
        if state["vmap"] is None:
            state["vmap"] = not vmap_unsafe(model, params, {**frozen, **buffers}, xb[:1])
        if state["vmap"]:
            try:
                blocks = jac(params, xb)
                return torch.cat([blocks[k].reshape(xb.shape[0], K, -1) for k in params], dim=2)  # (b, K, P)
            except (RuntimeError, NotImplementedError, ValueError):
                state["vmap"] = False  # e.g. no vmap rule for an RNN; exact by the loop from now on
        return by_loop(xb)

    J.n_params = sum(p.numel() for p in params.values())  # type: ignore[attr-defined]
    return J


def _contract(G: torch.Tensor, J1, J2, n1: int, n2: int, block: int, sym: bool, full: bool, K: int) -> torch.Tensor:
    """``G_IJ = J_I J_Jᵀ`` for (b, K, P) Jacobian blocks given by J1(start) / J2(start)."""
    for s in range(0, n1, block):
        Ji = J1(s)  # (bi, K, P)
        bi, P = Ji.shape[0], Ji.shape[2]
        for t in range(s if sym else 0, n2, block):
            Jt = Ji if (sym and t == s) else J2(t)  # (bj, K, P)
            bj = Jt.shape[0]
            if full:
                tile = (Ji.reshape(bi * K, P) @ Jt.reshape(bj * K, P).T).view(bi, K, bj, K)
                G[s : s + bi, :, t : t + bj, :] = tile
                if sym and t != s:
                    G[t : t + bj, :, s : s + bi, :] = tile.permute(2, 3, 0, 1)
            else:
                tile = Ji.reshape(bi, K * P) @ Jt.reshape(bj, K * P).T  # Σ_a J_a J_aᵀ
                G[s : s + bi, t : t + bj] = tile
                if sym and t != s:
                    G[t : t + bj, s : s + bi] = tile.T
    return G


def _cached(fn: Callable[[int], torch.Tensor], ok: bool) -> Callable[[int], torch.Tensor]:
    cache: dict[int, torch.Tensor] = {}

    def get(t: int) -> torch.Tensor:
        if t in cache:
            return cache[t]
        out = fn(t)
        if ok:
            cache[t] = out
        return out

    return get


def _dtype(model: nn.Module) -> torch.dtype:
    return next(iter(trainable_params(model).values())).dtype


def jacobian_gram(
    model: nn.Module, x1: torch.Tensor, x2: torch.Tensor | None, K: int, full: bool, block: int
) -> torch.Tensor:
    """``G_IJ = J_I J_Jᵀ`` from per-sample Jacobians, block by block; (N1, N2) or (N1, K, N2, K)."""
    J = jacobian_fn(model, K)
    sym = x2 is None
    xs2 = x1 if sym else x2
    n1, n2 = x1.shape[0], xs2.shape[0]
    G = torch.zeros((n1, K, n2, K) if full else (n1, n2), dtype=_dtype(model), device=x1.device)
    P = sum(p.numel() for p in trainable_params(model).values())
    J2 = _cached(lambda t: J(xs2[t : t + block]), n2 * K * P * G.element_size() <= inputs.FEATURE_BYTES)
    J1 = J2 if sym else (lambda s: J(x1[s : s + block]))
    return _contract(G, J1, J2, n1, n2, block, sym, full, K)


def _batch_rows(model: nn.Module, x: torch.Tensor, K: int) -> Callable[[int, int], torch.Tensor]:
    """(start, stop) ↦ the rows of the full-batch Jacobian for points start..stop, (b, K, P):
    one forward of the whole batch, then batched reverse passes with one-hot cotangents."""
    params = {k: p.detach() for k, p in trainable_params(model).items()}
    frozen = {k: p.detach() for k, p in model.named_parameters() if k not in params}
    buffers = dict(model.named_buffers())

    # x copied inside the transform: a forward may write into its input (torch.func refuses a captured one)
    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return as_2d(call(model, {**p, **frozen, **buffers}, (x.clone(),)), x.shape[0])  # (N, K)

    try:
        out, pull = vjp(f, params)
        batched = not vmap_unsafe(model, params, {**frozen, **buffers}, x)
    except (RuntimeError, NotImplementedError, ValueError):  # torch.func has no rule for an op of the
        # forward (an autograd.Function without setup_context): the same rows by plain reverse passes
        out, pull, batched = _plain_pull(f, params)
    N = out.shape[0]

    def rows(s: int, e: int) -> torch.Tensor:
        cot = torch.zeros((e - s) * K, N, K, dtype=out.dtype, device=out.device)
        idx = torch.arange((e - s) * K, device=out.device)
        cot[idx, s + idx // K, idx % K] = 1.0
        try:
            if not batched:
                raise NotImplementedError("the forward holds an op vmap gets wrong (_VMAP_UNSAFE)")
            (g,) = vmap(pull)(cot)
            J = torch.cat([g[k].reshape((e - s) * K, -1) for k in params], dim=1)
        except (RuntimeError, NotImplementedError, ValueError):
            J = torch.stack([torch.cat([gk.reshape(-1) for gk in pull(c)[0].values()]) for c in cot])
        return J.view(e - s, K, -1)  # (b, K, P)

    return rows


def _plain_pull(
    f: Callable[[dict[str, torch.Tensor]], torch.Tensor], params: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[dict[str, torch.Tensor]]], bool]:
    """``torch.func.vjp``'s (out, pull) by one plain autograd forward: ``pull(c)`` is one reverse pass."""
    live = {k: p.clone().requires_grad_(True) for k, p in params.items()}
    with torch.enable_grad():
        out = f(live)

    def pull(c: torch.Tensor) -> tuple[dict[str, torch.Tensor]]:
        g = torch.autograd.grad(out, list(live.values()), c, retain_graph=True, allow_unused=True)
        return ({k: torch.zeros_like(p) if t is None else t for (k, p), t in zip(live.items(), g)},)

    return out.detach(), pull, False


def batch_jacobian_gram(
    model: nn.Module, x1: torch.Tensor, x2: torch.Tensor | None, K: int, full: bool, block: int
) -> torch.Tensor:
    """The kernel of the batch forward of a sample-coupling model: ``G = J Jᵀ`` with J the Jacobian
    of f(X) (all points in one forward), in row chunks of ``block`` points; x2 (when given) is
    forwarded as its own batch.  (N1, N2) traced or (N1, K, N2, K) full."""
    sym = x2 is None
    n1, n2 = x1.shape[0], (x1 if sym else x2).shape[0]
    G = torch.zeros((n1, K, n2, K) if full else (n1, n2), dtype=_dtype(model), device=x1.device)
    P = sum(p.numel() for p in trainable_params(model).values())
    r1 = _batch_rows(model, x1, K)
    r2 = r1 if sym else _batch_rows(model, x2, K)
    J2 = _cached(lambda t: r2(t, min(t + block, n2)), n2 * K * P * G.element_size() <= inputs.FEATURE_BYTES)
    J1 = J2 if sym else (lambda s: r1(s, min(s + block, n1)))
    return _contract(G, J1, J2, n1, n2, block, sym, full, K)
