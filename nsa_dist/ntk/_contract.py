"""``G += M₁ M₂ᵀ`` for formed per-sample gradients, plus the structured factors' share (private).

The formed part of the per-layer NTK is a plain product of feature matrices M (N, K·P) whose
rows are per-sample gradients.  Two things make it run near the machine's GEMM rate:

- **column chunks**: ``G_IJ += M_I[:, c] M_J[:, c]ᵀ`` over chunks c of ``_COLUMNS`` columns.
  MKL's sgemm on (512 × 271,824)·(271,824 × 512) runs at ~55 % of its 16k-column rate on this
  project's CPU (the packed panels of a very long K fall out of cache);
- **symmetry**: only the tiles I ≤ J of a symmetric G, and a diagonal tile as three of its 2×2
  sub-tiles (the fourth is the mirror of one), recursively down to 256-point sub-tiles: ≈ 0.53
  of the full product's flops at 4 tiles of 512 points instead of 0.625.

The lower tiles are filled afterwards by :func:`~nsa_dist.ntk._structured._mirror_upper`.
"""

from __future__ import annotations

import torch

__all__ = ["tile_slices", "add_formed", "add_factors"]

# Columns of M per GEMM call (see the module docstring).
_COLUMNS = 16384
# Smallest diagonal sub-tile side (points): below it a split saves less than the smaller GEMMs cost.
_MIN_SUB = 256


def tile_slices(n1: int, n2: int, block: int, sym: bool) -> list[tuple[slice, slice]]:
    """The (point) tiles of G to compute: all of them, or I ≤ J when symmetric."""
    tiles = []
    for s in range(0, n1, block):
        for t in range(s, n2, block) if sym else range(0, n2, block):
            tiles.append((slice(s, min(s + block, n1)), slice(t, min(t + block, n2))))
    return tiles


def _sub_tiles(i: slice, j: slice, sym: bool) -> list[tuple[slice, slice]]:
    """A diagonal tile of a symmetric G as its upper 2×2 sub-tiles, recursively down to
    ``_MIN_SUB`` points (the lower sub-tile mirrors the upper one); any other tile whole."""
    if not (sym and i == j) or i.stop - i.start < 2 * _MIN_SUB:
        return [(i, j)] if not (sym and i == j and i.stop - i.start >= 2) else _halves(i)
    h = i.start + (i.stop - i.start) // 2
    lo, hi = slice(i.start, h), slice(h, i.stop)
    return _sub_tiles(lo, lo, sym) + [(lo, hi)] + _sub_tiles(hi, hi, sym)


def _halves(i: slice) -> list[tuple[slice, slice]]:
    h = i.start + (i.stop - i.start) // 2
    lo, hi = slice(i.start, h), slice(h, i.stop)
    return [(lo, lo), (lo, hi), (hi, hi)]


def add_formed(
    G2: torch.Tensor, M1: torch.Tensor, M2: torch.Tensor, tiles: list[tuple[slice, slice]], rows: int, sym: bool
) -> None:
    """``G2[I, J] += M1[I] M2[J]ᵀ`` on the given tiles, column chunk by column chunk.

    Args:
        G2: (N1·r, N2·r) view of G — r = ``rows`` rows of M per point (K for the full kernel, else 1).
        M1: (N1·r, C) and M2: (N2·r, C) formed features (M2 is M1 when symmetric).
        tiles: point tiles from :func:`tile_slices`; sym: split diagonal tiles (upper parts only).
    """
    parts = [
        (slice(a.start * rows, a.stop * rows), slice(b.start * rows, b.stop * rows))
        for i, j in tiles
        for a, b in _sub_tiles(i, j, sym)
    ]
    C = M1.shape[1]
    for c in range(0, C, _COLUMNS):
        A1, A2 = M1[:, c : c + _COLUMNS], M2[:, c : c + _COLUMNS]  # (R1, kc), (R2, kc)
        for a, b in parts:
            G2[a, b].addmm_(A1[a], A2[b].T)


def add_factors(G: torch.Tensor, F1: list, F2: list, tiles: list[tuple[slice, slice]], K: int, full: bool) -> None:
    """``G[I, J] += Σ_l (Â_I Â_Jᵀ) ⊙ (D_I D_Jᵀ)`` for structured factors (Â (N, n_in+1), D (N, K·n_out)),
    traced (N1, N2) or full (N1, K, N2, K)."""
    for i, j in tiles:
        bi, bj = i.stop - i.start, j.stop - j.start
        for (A1, D1), (A2, D2) in zip(F1, F2):
            AA = A1[i] @ A2[j].T  # (bi, bj)
            if full:
                DD = D1[i].reshape(bi * K, -1) @ D2[j].reshape(bj * K, -1).T  # (bi K, bj K)
                G[i, :, j, :].addcmul_(AA[:, None, :, None], DD.view(bi, K, bj, K))
            else:
                G[i, j].addcmul_(AA, D1[i] @ D2[j].T)  # (bi, bj)
