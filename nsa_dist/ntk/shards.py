"""Pieces of one NTK Gram held by several workers: tiles of G, or data shards of J (no Ray here).

Two ways to split ``G = J Jᵀ`` (traced over outputs) so that no process holds it whole:

* **Tiles** (layout ``block_rows``).  The points are cut into ``B`` blocks; the upper tile pairs
  ``(I, J), I ≤ J`` are dealt to ``W`` workers, balanced by size (:func:`tile_plan`).  A
  :class:`GramTiles` builds its tiles from the per-block structured features (Â_l, D_l) — each
  block's features computed once, by one worker, and shared; for models beyond Linear layers one
  pair is (formed gradients, 1), :func:`block_features` — and answers products with partial
  sums for both sides of an off-diagonal tile: ``y_I += G_IJ v_J`` and ``y_J += G_IJᵀ v_I``.  The
  sum of the workers' partial products is ``G V``; no off-diagonal tile is computed twice.
* **Data shards** (layout ``matrix_free``).  Worker s holds only its points' features and answers
  ``U_s = J_sᵀ V_s`` (a parameter-space block, reduced over shards) and ``J_s U``:
  ``G V = [J_s (Σ_s' J_s'ᵀ V_s')]_s``.  :class:`FeatureShard` uses the structured features of
  Linear-only nets, ``(J_sᵀ V)_l = Σ_i v_i D_i ⊗ Â_i``; :class:`JacobianShard` uses VJP/JVP for
  any module.  Memory per worker O(n_s · Σ_l (n_in + n_out) + P · m).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from nsa_dist.ntk._structured import _Buffers, _sym_upper, _tile
from nsa_dist.ntk.blocks import BlockFeatures, block_features, row_blocks
from nsa_dist.ntk.inputs import output_dim, prepare_inputs, prepare_model
from nsa_dist.ntk.operator import NTKOperator
from nsa_dist.ntk.route import NTKRoute

__all__ = ["TilePlan", "tile_plan", "GramTiles", "FeatureShard", "JacobianShard", "shard_features"]

_CHUNK = 2048  # points per contraction chunk of the matrix-free products …
# … and at most this many bytes of a chunk's (points × columns × outputs) temporary: at 2,048 points,
# 32 columns and 256 outputs it was 134 MB twice over, ~0.3 GB a member held above its shard's features
# whatever N (an audit: 5–12× the footprint's estimate at N = 2,000–4,000)
CHUNK_BYTES = 32 << 20


def _rows(m: int, q: int, itemsize: int) -> int:
    """Points per chunk of a product with ``m`` columns over a layer of ``q`` outputs."""
    return max(1, min(_CHUNK, CHUNK_BYTES // max(1, m * q * itemsize)))


@dataclass(frozen=True)
class TilePlan:
    """Blocks of points and the upper tile pairs each worker holds.

    Attributes:
        ranges: [start, stop) of each of the B blocks.
        pairs: per worker, its tile pairs (I, J) with I ≤ J.
        owners: per worker, the blocks whose features it computes (a contiguous run).
    """

    ranges: list[tuple[int, int]]
    pairs: list[list[tuple[int, int]]]
    owners: list[list[int]]

    @property
    def n_workers(self) -> int:
        return len(self.pairs)

    def tile_entries(self) -> list[int]:
        """Entries of G each worker stores (its memory, in elements)."""
        size = [b - a for a, b in self.ranges]
        return [sum(size[I] * size[J] for I, J in p) for p in self.pairs]


def tile_plan(n: int, n_workers: int, blocks_per_worker: int = 4) -> TilePlan:
    """Deal the upper tile pairs of an n-point Gram to ``n_workers``, balanced by stored entries.

    With B = blocks_per_worker · W blocks the gang stores (B + 1)/(2B) of G, each worker about
    (B + 1)/(2BW) of it (≈ 0.14·N² for W = 4); every tile pair is owned by exactly one worker.

    Raises:
        ValueError: n_workers < 1 or more workers than points.
    """
    if not 1 <= n_workers <= n:
        raise ValueError(f"need 1 <= workers <= N; got workers={n_workers}, N={n}")
    B = min(n, max(1, blocks_per_worker) * n_workers)
    ranges = row_blocks(n, B)
    size = [b - a for a, b in ranges]
    all_pairs = sorted(((I, J) for I in range(B) for J in range(I, B)), key=lambda p: -size[p[0]] * size[p[1]])
    load = [0] * n_workers
    pairs: list[list[tuple[int, int]]] = [[] for _ in range(n_workers)]
    for I, J in all_pairs:  # largest first onto the least loaded: within one tile of balanced
        w = int(np.argmin(load))
        pairs[w].append((I, J))
        load[w] += size[I] * size[J]
    owners = [list(range(a, b)) for a, b in row_blocks(B, n_workers)]
    return TilePlan(ranges, [sorted(p) for p in pairs], owners)


def shard_features(
    model: nn.Module,
    x: torch.Tensor,
    ranges: list[tuple[int, int]],
    dtype: torch.dtype,
    method: str | NTKRoute = "auto",
) -> list[BlockFeatures]:
    """Per-layer features (Â_l, D_l) of each range of points, as NumPy (see :func:`block_features`;
    ``method`` a method name or the run's resolved :class:`~nsa_dist.ntk.NTKRoute`)."""
    return block_features(prepare_model(model, dtype), x, ranges, dtype=dtype, method=method)


class GramTiles:
    """One worker's upper tiles of the traced NTK Gram.

    Args:
        features: block index → that block's features, for every block this worker's pairs touch.
        ranges: [start, stop) of every block (N = ranges[-1][1]).
        pairs: the tile pairs (I, J), I ≤ J, to hold.
        device: "cpu" or "cuda".
    """

    def __init__(
        self,
        features: dict[int, BlockFeatures],
        ranges: list[tuple[int, int]],
        pairs: list[tuple[int, int]],
        device: str = "cpu",
    ) -> None:
        dev = torch.device(device)
        self.ranges, self.pairs, self.N = ranges, pairs, ranges[-1][1]
        feats = {
            b: [(torch.as_tensor(A, device=dev), torch.as_tensor(D, device=dev)) for A, D in f]
            for b, f in features.items()
        }
        missing = sorted({b for p in pairs for b in p} - set(feats))
        if missing:
            raise ValueError(f"GramTiles: features of blocks {missing} were not given")
        dtype = next(iter(feats.values()))[0][0].dtype
        bufs = _Buffers(dtype, dev)
        self.tiles: list[torch.Tensor] = []
        for I, J in pairs:
            fI, fJ = feats[I], feats[J]
            T = torch.empty(fI[0][0].shape[0], fJ[0][0].shape[0], dtype=dtype, device=dev)  # (n_I, n_J)
            if I == J:  # three sub-tiles, the fourth mirrored (the single-process symmetry saving)
                _sym_upper(T, [fI], T.shape[0], bufs, accumulate=False)
                h = T.shape[0] // 2
                T[h:, :h] = T[:h, h:].T
            else:
                _tile(T, fI, fJ, bufs, accumulate=False)
            self.tiles.append(T)
        del feats, bufs
        # On a GPU the products run on CuPy views of the tiles (DLPack: zero-copy, same memory)
        # when CuPy is installed (the design card's GPU path); torch-CUDA otherwise.
        self._cp = _cupy_or_none() if dev.type == "cuda" else None
        self._cp_tiles = [self._cp.from_dlpack(T) for T in self.tiles] if self._cp is not None else None

    @property
    def backend(self) -> str:
        """What runs the products: "cupy" (on CUDA with CuPy), else "torch"."""
        return "cupy" if self._cp is not None else "torch"

    def matmat(self, V: Any) -> np.ndarray:
        """This worker's share of ``G V``: (N, m) float64 with rows of untouched blocks zero."""
        V = np.asarray(V, dtype=np.float64)
        vec = V.ndim == 1
        V2 = V[:, None] if vec else V
        if self._cp is not None:
            res = self._cupy_matmat(V2)
            return res[:, 0] if vec else res
        dev, dt = self.tiles[0].device, self.tiles[0].dtype
        Vt = torch.as_tensor(V2, device=dev).to(dt)  # (N, m)
        out = torch.zeros(V2.shape, dtype=torch.float64, device=dev)
        for (I, J), T in zip(self.pairs, self.tiles):
            (a, b), (c, d) = self.ranges[I], self.ranges[J]
            out[a:b] += (T @ Vt[c:d]).double()
            if I != J:
                out[c:d] += (T.T @ Vt[a:b]).double()
        res = out.cpu().numpy()
        return res[:, 0] if vec else res

    def _cupy_matmat(self, V: np.ndarray) -> np.ndarray:
        cp = self._cp
        Vc = cp.asarray(V).astype(self._cp_tiles[0].dtype)  # (N, m), one host-to-device copy
        out = cp.zeros(V.shape, dtype=cp.float64)
        for (I, J), T in zip(self.pairs, self._cp_tiles):
            (a, b), (c, d) = self.ranges[I], self.ranges[J]
            out[a:b] += (T @ Vc[c:d]).astype(cp.float64)
            if I != J:
                out[c:d] += (T.T @ Vc[a:b]).astype(cp.float64)
        return cp.asnumpy(out)

    def stats(self) -> dict[str, float]:
        """Exact tile reductions: ``sq_frobenius`` (off-diagonal tiles count twice) and ``trace``."""
        fro = tr = 0.0
        for (I, J), T in zip(self.pairs, self.tiles):
            s = float(torch.sum(T.double() ** 2))
            fro += s if I == J else 2 * s
            if I == J:
                tr += float(torch.diagonal(T).double().sum())
        return {"sq_frobenius": fro, "trace": tr}

    def nbytes(self) -> int:
        return sum(T.numel() * T.element_size() for T in self.tiles)


def _cupy_or_none() -> Any:
    """CuPy when it is installed and sees a GPU, else None (the torch-CUDA products are used)."""
    try:
        import cupy

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # not installed, or no usable CUDA runtime for it
        return None


class FeatureShard:
    """Matrix-free products from one data shard's structured features (Linear-only nets).

    With the traced kernel ``G = Σ_a J_a J_aᵀ`` (a over outputs) and, per layer l,
    ``∂f_a(x_i)/∂W_l = D_{i,a,l} ⊗ Â_{i,l}``:

        (J_sᵀ V)_{l,a} = Σ_{i ∈ s} v_i D_{i,a,l} Â_{i,l}ᵀ           (m, K, n_out, n_cols) per layer
        (J_s U)_i      = Σ_{l,a} D_{i,a,l}ᵀ U_{l,a} Â_{i,l}          (n_s, m)

    Args:
        features: per layer (Â (n_s, n_cols), D (n_s, K·n_out)) of the shard's points.
        K: model outputs.
        device: where the products run.
    """

    def __init__(self, features: BlockFeatures, K: int, device: str = "cpu") -> None:
        dev = torch.device(device)
        self.K = K
        self.feats = [(torch.as_tensor(A, device=dev), torch.as_tensor(D, device=dev)) for A, D in features]
        self.n = self.feats[0][0].shape[0]
        self.widths = [D.shape[1] * A.shape[1] for A, D in self.feats]  # K·n_out·n_cols per layer

    @property
    def dim(self) -> int:
        """Length of one column of ``U`` (K·Σ_l n_out·n_cols, padded)."""
        return sum(self.widths)

    def jt(self, V: Any) -> np.ndarray:
        """``J_sᵀ V`` for V (n_s, m): (m, dim) float64."""
        Vt = torch.as_tensor(np.asarray(V), device=self.feats[0][0].device).to(self.feats[0][0].dtype)
        Vt = Vt[:, None] if Vt.ndim == 1 else Vt  # (n_s, m)
        m = Vt.shape[1]
        parts = []
        for A, D in self.feats:
            U = torch.zeros(m * D.shape[1], A.shape[1], dtype=A.dtype, device=A.device)  # (m·q, c)
            b = _rows(m, D.shape[1], A.element_size())
            for s in range(0, self.n, b):
                VD = Vt[s : s + b, :, None] * D[s : s + b, None, :]  # (b, m, q)
                U += VD.reshape(VD.shape[0], -1).T @ A[s : s + b]
            parts.append(U.reshape(m, -1).double())
        return torch.cat(parts, dim=1).cpu().numpy()

    def j(self, U: Any) -> np.ndarray:
        """``J_s U`` for U (m, dim) (the reduced ``Σ_s J_sᵀ V``): (n_s, m) float64."""
        dev, dt = self.feats[0][0].device, self.feats[0][0].dtype
        Ut = torch.as_tensor(np.asarray(U), device=dev).to(dt)  # (m, dim)
        m = Ut.shape[0]
        out = torch.zeros(self.n, m, dtype=dt, device=dev)
        off = 0
        for (A, D), w in zip(self.feats, self.widths):
            q = D.shape[1]
            Ul = Ut[:, off : off + w].reshape(m * q, A.shape[1])  # (m·q, c)
            off += w
            b = _rows(m, q, A.element_size())
            for s in range(0, self.n, b):
                T = A[s : s + b] @ Ul.T  # (b, m·q)
                out[s : s + b] += torch.bmm(T.view(T.shape[0], m, q), D[s : s + b, :, None])[
                    ..., 0
                ]  # Σ_q, no (b, m, q) copy
        return out.double().cpu().numpy()


class JacobianShard:
    """Matrix-free products on one data shard for any module, by VJP (``J_sᵀ V``) and JVP (``J_s U``).

    ``U`` is laid out (m·K, P): one parameter-space row per (column, output) pair.
    """

    def __init__(self, model: nn.Module, x: torch.Tensor, dtype: torch.dtype, block: int = 256) -> None:
        model = prepare_model(model, dtype)
        x = prepare_inputs(model, x, "x", dtype)
        self.op = NTKOperator(model, x, output_dim(model, x), False, block)
        self.n = x.shape[0]
        self.K = self.op.K
        self.dim = self.K * sum(p.numel() for p in self.op._params.values())

    def jt(self, V: Any) -> np.ndarray:
        """``J_sᵀ V`` for V (n_s, m): (m, K·P) float64."""
        Vt = torch.as_tensor(np.asarray(V), dtype=self.op.dtype, device=self.op.x.device)
        Vt = Vt[:, None] if Vt.ndim == 1 else Vt
        U = self.op.jt(Vt)  # dict of (m·K, *shape)
        m = Vt.shape[1]
        return torch.cat([u.reshape(u.shape[0], -1) for u in U.values()], 1).reshape(m, -1).double().cpu().numpy()

    def j(self, U: Any) -> np.ndarray:
        """``J_s U`` for U (m, K·P): (n_s, m) float64."""
        Ut = torch.as_tensor(np.asarray(U), dtype=self.op.dtype, device=self.op.x.device)
        m = Ut.shape[0]
        rows = Ut.reshape(m * self.K, -1)
        Ud, off = {}, 0
        for k, p in self.op._params.items():
            Ud[k] = rows[:, off : off + p.numel()].reshape((m * self.K,) + p.shape)
            off += p.numel()
        return self.op.j(Ud, m).double().cpu().numpy()
