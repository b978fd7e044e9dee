"""Per-block features of the NTK (for distributed assembly, see :mod:`nsa_dist.ntk.shards`).

``block_features`` computes, once, the per-layer features (Â_l, D_l) of every block of points;
tiles or data shards of G are built from them.  Knows nothing of Ray: the cluster layer ships
the features through its object store.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from nsa_dist.config import NTKMethod
from nsa_dist.errors import UnsupportedModelError
from nsa_dist.ntk._jacobian import jacobian_fn
from nsa_dist.ntk._probe import ForwardPlan, refuse_false_gradients
from nsa_dist.ntk._structured import Unproven, _chunk_features, structured_layers
from nsa_dist.ntk.blame import blame
from nsa_dist.ntk.gram import route_of
from nsa_dist.ntk.inputs import autograd_on, output_dim, prepare_inputs, trainable_params
from nsa_dist.ntk.layer_features import _features, per_layer_layers
from nsa_dist.ntk.route import NTKRoute
from nsa_dist.ntk.state import preserved, refuse_state_writes

__all__ = ["BlockFeatures", "block_features", "feature_width", "row_blocks"]

BlockFeatures = list[tuple[np.ndarray, np.ndarray]]  # per layer: Â (b, n_cols), D (b, K·n_out)


def row_blocks(n: int, n_parts: int) -> list[tuple[int, int]]:
    """Split 0..n into ``n_parts`` contiguous [start, stop) ranges of near-equal size."""
    if not 1 <= n_parts <= n:
        raise ValueError(f"need 1 <= n_parts <= n, got n_parts={n_parts}, n={n}")
    edges = np.linspace(0, n, n_parts + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


@autograd_on
def block_features(
    model: nn.Module,
    x: torch.Tensor,
    ranges: list[tuple[int, int]],
    dtype: torch.dtype | None = None,
    method: str | NTKMethod | NTKRoute = "auto",
) -> list[BlockFeatures]:
    """Per-layer features of each range of points, as numpy arrays (traced kernel).

    For every model whose points do not interact, ``G_IJ = Σ_l (Â_{l,I} Â_{l,J}ᵀ) ⊙ (D_{l,I} D_{l,J}ᵀ)``
    over the returned pairs: the structured factors of the factored Linear layers and, for every
    other parameter (convolutions, norms, attention, …: the per-layer formed gradients or
    per-sample Jacobians, :mod:`.layer_features`), one pair ``(M, 1)`` with M (b, K·P_formed) — so tiles and
    data shards built from factors serve any such model, exactly (``method`` as in ``gram``: a
    resolved :class:`~nsa_dist.ntk.NTKRoute` is taken without probing the forward pass).

    Raises:
        UnsupportedModelError: the model couples samples (batch norm in train mode, …): its kernel
            is that of the whole batch's forward, which no split of the points reproduces; or a
            forced ``method`` the model is outside of.
    """
    if dtype is not None:
        model = model.to(dtype)  # caller passes a copy when it must keep its model
    x = prepare_inputs(model, x, "x", dtype)
    with blame(model):
        # as gram: no in-place state, no parameter registered by a forward or held outside its module, on
        # every point of these ranges (a gang's members together check all of them)
        lo, hi = min(a for a, _ in ranges), max(b for _, b in ranges)
        refuse_state_writes(model, x[lo:hi] if hi > lo else x[:2])
    K = output_dim(model, x)
    with preserved(model), blame(model):
        plan, m = route_of(model, x, method)
        # autograd's gradients the derivative on these ranges' points (after the probe's own errors)
        refuse_false_gradients(model, x[:0], x[lo:hi], offset=lo)
        if m is NTKMethod.BATCH:
            raise UnsupportedModelError(
                "a gang layout (block_rows, matrix_free) splits the points among its members, but "
                + next(iter(plan.routes.values()))[1]
                + "; use layout 'local'"
            )
        try:
            if m is NTKMethod.STRUCTURED:
                layers = structured_layers(plan)
                return [
                    _in_row_chunks(
                        a,
                        b,
                        lambda lo, hi: [
                            (A.cpu().numpy(), D.reshape(hi - lo, -1).cpu().numpy())
                            for A, D in _chunk_features(model, layers, x[lo:hi], K)
                        ],
                    )
                    for a, b in ranges
                ]
            return _formed_blocks(model, plan if m is NTKMethod.PER_LAYER else None, x, ranges, K)
        except Unproven:  # a feature pass saw an in-place change the probe did not: per-sample Jacobians
            return _formed_blocks(model, None, x, ranges, K)


ROW_CHUNK = 16384
"""Points per forward/backward pass of :func:`block_features`: a range longer than this (a
``matrix_free`` shard of N/W points) is passed in chunks, its features written into arrays of the
whole range, so the pass's activations and gradients are those of one chunk, not of the shard (at
N = 200,000 on 2 workers one pass over a 100,000-point shard peaked at 2.6–2.8 GB to keep 1.05 GB of
features).  The points do not interact (the route proved it), so each row's features are the same;
a range of at most this many points is passed whole, as before."""


def _in_row_chunks(a: int, b: int, features: Callable[[int, int], BlockFeatures]) -> BlockFeatures:
    """``features(a, b)``, computed over [a, b) in chunks of at most :data:`ROW_CHUNK` rows."""
    if b - a <= ROW_CHUNK:
        return features(a, b)
    out: BlockFeatures | None = None
    for lo in range(a, b, ROW_CHUNK):
        hi = min(b, lo + ROW_CHUNK)
        part = features(lo, hi)
        if out is None:
            out = [
                (np.empty((b - a, *A.shape[1:]), A.dtype), np.empty((b - a, *D.shape[1:]), D.dtype)) for A, D in part
            ]
        for (A_out, D_out), (A, D) in zip(out, part, strict=True):
            A_out[lo - a : hi - a], D_out[lo - a : hi - a] = A, D
    assert out is not None
    return out


def _rows(like: np.ndarray, n: int) -> np.ndarray:
    return np.empty((n, *like.shape[1:]), like.dtype)


def _formed_blocks(
    model: nn.Module, plan: ForwardPlan | None, x: torch.Tensor, ranges: list[tuple[int, int]], K: int
) -> list[BlockFeatures]:
    """Per-layer features (``plan``) or, with None, every parameter's per-sample Jacobian as ``(M, 1)``."""
    layers = per_layer_layers(plan) if plan is not None else []
    generic = plan.generic if plan is not None else tuple(trainable_params(model))
    jac = jacobian_fn(model, K, generic) if generic else None

    def features(lo: int, hi: int) -> BlockFeatures:
        factors, M = _features(model, layers, jac, x[lo:hi], K)
        feats = [(A.cpu().numpy(), D.reshape(hi - lo, -1).cpu().numpy()) for A, D in factors]
        if M is not None:
            Mn = M.cpu().numpy()
            feats.append((Mn, np.ones((hi - lo, 1), dtype=Mn.dtype)))
        return feats

    return [_in_row_chunks(a, b, features) for a, b in ranges]


def feature_width(model: nn.Module, x: torch.Tensor, method: str | NTKMethod | NTKRoute = "auto") -> int:
    """Numbers per point of :func:`block_features` (Σ over its pairs of the two widths), from two points."""
    features = block_features(model, x[:2], [(0, min(2, len(x)))], method=method)[0]
    return sum(A.shape[1] + D.shape[1] for A, D in features)
