"""Per-block structured features of the NTK (for distributed assembly, see :mod:`nsa_dist.ntk.shards`).

``block_features`` computes, once, the structured features (Â_l, D_l) of every block of points;
tiles or data shards of G are built from them.  Knows nothing of Ray: the cluster layer ships
the features through its object store.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from nsa_dist.ntk._inputs import output_dim, prepare_inputs
from nsa_dist.ntk._structured import _chunk_features, linear_layers

__all__ = ["BlockFeatures", "block_features", "row_blocks"]

BlockFeatures = list[tuple[np.ndarray, np.ndarray]]  # per layer: Â (b, n_cols), D (b, K·n_out)


def row_blocks(n: int, n_parts: int) -> list[tuple[int, int]]:
    """Split 0..n into ``n_parts`` contiguous [start, stop) ranges of near-equal size."""
    if not 1 <= n_parts <= n:
        raise ValueError(f"need 1 <= n_parts <= n, got n_parts={n_parts}, n={n}")
    edges = np.linspace(0, n, n_parts + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def block_features(model: nn.Module, x: torch.Tensor, ranges: list[tuple[int, int]],
                   dtype: torch.dtype | None = None) -> list[BlockFeatures]:
    """Structured features of each range of points, as numpy arrays (traced kernel).

    Raises:
        UnsupportedModelError: the model is not built of Linear layers (see ``method="structured"``).
    """
    if dtype is not None:
        model = model.to(dtype)  # caller passes a copy when it must keep its model
    x = prepare_inputs(model, x, "x", dtype)
    K = output_dim(model, x)
    layers = linear_layers(model, x[:2])
    out = []
    for a, b in ranges:
        feats = _chunk_features(model, layers, x[a:b], K)
        out.append([(A.cpu().numpy(), D.reshape(b - a, -1).cpu().numpy()) for A, D in feats])
    return out
