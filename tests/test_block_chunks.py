"""``block_features`` over a range longer than ``ROW_CHUNK`` passes it in chunks (a matrix_free shard's
memory is one chunk's activations): the features equal those of one pass, on every route."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from nsa_dist.ntk import blocks
from nsa_dist.ntk.blocks import block_features

F64 = torch.float64


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


class _ConvNet(nn.Module):  # per-layer route (convolutions) and a LayerNorm
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv1d(1, 4, 3, padding=1), nn.LayerNorm(12), nn.Linear(12, 1)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.conv(x.unsqueeze(1))).flatten(1)[:, :12])).squeeze(-1)


class _Recurrent(nn.Module):  # per-sample Jacobians (a GRU)
    def __init__(self) -> None:
        super().__init__()
        self.gru, self.head = nn.GRU(1, 5, batch_first=True), nn.Linear(5, 1)

    def forward(self, x):
        return self.head(self.gru(x.unsqueeze(-1))[0][:, -1]).squeeze(-1)


@pytest.mark.parametrize(
    "make, d", [(_mlp, 3), (_ConvNet, 6), (_Recurrent, 4)], ids=["structured", "per_layer", "jacobian"]
)
def test_chunked_features_equal_one_pass(make, d, monkeypatch):
    torch.manual_seed(0)
    model = make().to(F64)
    x = torch.randn(23, d, dtype=F64)
    ranges = [(0, 11), (11, 23)]
    whole = block_features(model, x, ranges, dtype=F64)
    monkeypatch.setattr(blocks, "ROW_CHUNK", 4)  # 11 and 12 points: 3 chunks each, the last short
    chunked = block_features(model, x, ranges, dtype=F64)
    for r, (w, c) in enumerate(zip(whole, chunked, strict=True)):
        assert len(w) == len(c), (r, len(w), len(c))
        for j, ((Aw, Dw), (Ac, Dc)) in enumerate(zip(w, c, strict=True)):
            assert Aw.shape == Ac.shape and Dw.shape == Dc.shape, (r, j, Aw.shape, Ac.shape, Dw.shape, Dc.shape)
            err = max(np.abs(Aw - Ac).max(), np.abs(Dw - Dc).max()) / max(np.abs(Aw).max(), np.abs(Dw).max(), 1e-300)
            assert err < 1e-13, f"range {r}, pair {j}: chunked features differ by {err:.3g} (relative)"


@pytest.mark.parametrize("cap", [1, 3 * 16 * 8, 10**9], ids=["one-point", "three-points", "whole"])
def test_shard_products_in_byte_capped_chunks_equal_j_and_jt(cap, monkeypatch):
    """A matrix_free shard's products J_s U and J_sᵀ V run in chunks of at most ``CHUNK_BYTES`` of
    (points × columns × outputs) — 134 MB twice over at 2,048 points before (an audit) — and equal
    the dense float64 Jacobian's, however small the chunks."""
    from torch.func import functional_call, jacrev

    from nsa_dist.ntk import shards

    torch.manual_seed(0)
    model, x = _mlp().to(F64), torch.randn(13, 3, dtype=F64)
    monkeypatch.setattr(shards, "CHUNK_BYTES", cap)
    shard = shards.FeatureShard(block_features(model, x, [(0, 13)], dtype=F64)[0], K=2)
    params = {k: v.detach() for k, v in model.named_parameters()}
    J = torch.cat([j.reshape(26, -1) for j in jacrev(lambda p: functional_call(model, p, (x,)))(params).values()], 1)
    G = (J @ J.T).reshape(13, 2, 13, 2).diagonal(dim1=1, dim2=3).sum(-1)  # Σ_a J_a J_aᵀ
    V = np.random.default_rng(1).standard_normal((13, 3))
    GV = shard.j(shard.jt(V))
    err = np.abs(GV - G.numpy() @ V).max() / np.abs(G.numpy() @ V).max()
    assert err < 1e-13, f"J_s J_sᵀ V differs from the dense traced Gram's product by {err:.3g} (relative)"
