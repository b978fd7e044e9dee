"""Block rows of the structured NTK Gram from per-block features (for distributed assembly).

``block_features`` computes, once, the structured features (Â_l, D_l) of every block of points;
a :class:`GramBlockRow` holds one block row G[I, :] built from them and answers ``G[I, :] V``.
The sum (concatenation) of the block rows' products is ``G V`` — the matvec of a distributed
Lanczos.  Knows nothing of Ray: the cluster layer ships the features through its object store.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from nsa_dist.ntk._inputs import output_dim, prepare_inputs
from nsa_dist.ntk._structured import _Buffers, _chunk_features, _tile, linear_layers

__all__ = ["BlockFeatures", "GramBlockRow", "block_features", "row_blocks"]

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


class GramBlockRow:
    """G[I, :] of the traced NTK Gram, built from the features of every block.

    Args:
        features: per block J, per layer (Â_J, D_J) — the output of :func:`block_features`.
        I: which block's row to hold.
        device: "cpu" or "cuda" (the block row and the products then live on the GPU).
        tile: column tile width when assembling.
    """

    def __init__(self, features: list[BlockFeatures], I: int, device: str = "cpu", tile: int = 1024) -> None:
        dev = torch.device(device)
        fI = [(torch.as_tensor(A, device=dev), torch.as_tensor(D, device=dev)) for A, D in features[I]]
        n_I = fI[0][0].shape[0]
        N = sum(f[0][0].shape[0] for f in features)
        self.G = torch.empty(n_I, N, dtype=fI[0][0].dtype, device=dev)  # (n_I, N)
        bufs = _Buffers(self.G.dtype, dev)
        col = 0
        for fJ in features:
            tJ = [(torch.as_tensor(A, device=dev), torch.as_tensor(D, device=dev)) for A, D in fJ]
            nJ = tJ[0][0].shape[0]
            for s in range(0, nJ, tile):
                part = [(A[s:s + tile], D[s:s + tile]) for A, D in tJ]
                _tile(self.G[:, col + s:col + s + part[0][0].shape[0]], fI, part, bufs, accumulate=False)
            col += nJ
        self.shape = tuple(self.G.shape)

    def matmat(self, V: Any) -> np.ndarray:
        """G[I, :] V for V (N, m) → (n_I, m) numpy (computed on the block row's device)."""
        Vt = torch.as_tensor(np.asarray(V), dtype=self.G.dtype, device=self.G.device)
        return (self.G @ Vt).cpu().numpy()

    def nbytes(self) -> int:
        return self.G.numel() * self.G.element_size()
