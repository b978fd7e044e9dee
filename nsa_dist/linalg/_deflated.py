"""Top-k of a float32 host Gram with float32 products held to float64 accuracy (private).

A float32 G·X costs half a float64 one on the host (an (N, 32) block at N = 10⁴: 1.1–1.2 ms a
column against 2.4–2.5), but plain float32 products err by ~eps₃₂·‖G‖: 1.3e-4 for a
unit vector of the paper's Gram, 46× Lanczos's residual tolerance (1e-10·λ₁ = 2.8e-6).  The
rounding scales with the matrix rounded, so the top directions are taken out first:

    G = G' + U S Uᵀ,   G' = fl₃₂(G − U S Uᵀ) (formed in float64, rounded once),
    G x ≈ fl₃₂(G' x) + U (S (Uᵀ x))      (the low-rank part in float64),

with U (N, r) an orthonormal basis of G's top-r directions from two float32 power iterations
and S = Uᵀ G U.  The split is exact for any U and S — their quality only sets ‖G'‖ and so the
size of the float32 rounding (‖G'‖_F = 47 against ‖G‖_F = 28,723 for the paper's Gram at
r = 64; products then err by ≤ 1.9e-7, 15× under the tolerance).

The fast path proves itself on every call; it hands over to the float64 products (returns None)
when it cannot:
* before the solve, when the rounding it predicts from ‖G'‖_F (:data:`_ERR_PER_FRO` · eps₃₂ ·
  ‖G'‖_F, 3× what the paper's Gram measured on random vectors; a smooth Matérn kernel's Ritz
  vectors reached 1.6×) is not under half the tolerance — a spectrum that does not decay leaves
  nothing to deflate.  A filter of hopeless cases, not a proof: the check after the solve decides;
* after it, on a sample of the Ritz vectors (the 16 smallest and 16 spread over the rest), whose
  products are redone exactly in float64 (the float32 G converted slab by slab): every sampled
  true residual must meet the tolerance, every sampled product error must be under half of it,
  and every vector's explicit residual (from the stored products) plus the largest sampled
  product error must meet the tolerance too.  For a sampled vector that is a measurement; for
  an unsampled one it is an estimate, not a bound: the product errors of the basis vectors
  Lanczos used are rounding errors, close to independent, of the size the sample measures
  (a worst case could add up to √n of them; the sample sees that size, not the sum).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from nsa_dist.linalg._backend import HostWorkspace, TorchOps, convert, host_empty
from nsa_dist.linalg.lanczos import LanczosResult, _qr, block_lanczos

__all__ = ["DeflatedGram", "deflated_lanczos", "deflation_applies"]

log = logging.getLogger(__name__)

MIN_N = 4096  # smaller G: the products are cheap, the set-up is not
MIN_K = 256  # fewer eigenpairs: ~2k products save less than the ~0.4 s set-up (N = 10⁴)
RANK = 64  # directions taken out (r); the paper's Gram: ‖G'‖_F 47 at r = 64, 163 at r = 48
POWER = 2  # float32 power iterations for U (one: ‖G'‖_F = 104 at r = 64)
SLAB = 256  # rows of G converted to float64 at a time (20 MB at N = 10⁴)
SAMPLE = 16  # Ritz vectors checked in float64: the SAMPLE smallest and SAMPLE spread over the rest
_ERR_PER_FRO = 0.1  # predicted max product error / (eps₃₂ ‖G'‖_F); measured 0.031–0.033 (paper's Gram,
# r = 48…96, random vectors), up to 0.16 on the Ritz vectors of a Matérn-3/2 kernel (tests/test_deflated.py)
_EPS32 = float(np.finfo(np.float32).eps)


class DeflatedGram:
    """``X ↦ G X`` for a float32 G through ``fl₃₂(G' X) + U (S (Uᵀ X))``, and the exact float64 product.

    Attributes:
        G: (N, N) float32 torch CPU, the Gram itself (read, never written).
        rest: (N, N) float32, ``fl₃₂(G − U S Uᵀ)``.
        U: (N, r) float64, orthonormal.
        S: (r, r) float64, symmetric.
        rest_fro: ‖G − U S Uᵀ‖_F (of the rounded matrix).
        top: max |eig(S)|, an estimate of ‖G‖₂ from below.
        n_matvec: float32 columns of G applied to build U and S.
    """

    def __init__(
        self, G: torch.Tensor, seed: int = 0, rank: int = RANK, workspace: HostWorkspace | None = None
    ) -> None:
        N = G.shape[0]
        ops = TorchOps("cpu")
        g = torch.Generator().manual_seed(seed)
        U = torch.randn(N, rank, generator=g, dtype=torch.float32)
        for _ in range(POWER):
            U = _qr(ops, (G @ U).double()).float()
        U = _qr(ops, U.double())  # (N, r) float64, orthonormal to 1e-12 (Cholesky QR twice, checked)
        GU = (G @ U.float()).double()  # (N, r): its float32 rounding only moves S, which any value may take
        S = U.T @ GU
        self.G, self.U, self.S = G, U, (S + S.T) / 2
        self.n_matvec = (POWER + 1) * rank
        self.top = float(torch.linalg.eigvalsh(self.S).abs().max())
        shape = tuple(G.shape)  # the rest in huge pages: 40 against 51 ms a product
        self.rest = (
            workspace.empty("deflated.rest", shape, torch.float32) if workspace else host_empty(shape, torch.float32)
        )
        US, Ut = U @ self.S, U.T.contiguous()
        for i, j, b in _float64_slabs(G):
            b.addmm_(US[i:j], Ut, alpha=-1.0)
            self.rest[i:j].copy_(b)
        self.rest_fro = float(torch.linalg.vector_norm(self.rest))

    @property
    def predicted_error(self) -> float:
        """The largest product error expected for a unit vector (see :data:`_ERR_PER_FRO`)."""
        return _ERR_PER_FRO * _EPS32 * self.rest_fro

    def matmat(self, X: torch.Tensor) -> torch.Tensor:
        """≈ G X for X (N, b) float64: float32 product with the rest, float64 with U S Uᵀ."""
        return (self.rest @ X.float()).double() + self.U @ (self.S @ (self.U.T @ X))

    def exact(self, X: torch.Tensor) -> torch.Tensor:
        """G X in float64 for X (N, m) float64, G converted slab by slab (no (N, N) float64 copy)."""
        out = torch.empty((self.G.shape[0], X.shape[1]), dtype=torch.float64)
        for i, j, b in _float64_slabs(self.G):
            torch.mm(b, X, out=out[i:j])
        return out


def _float64_slabs(G: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(i, j, G[i:j] in float64)`` over row slabs of :data:`SLAB` rows, one reused buffer (no
    (N, N) float64 copy); a slab is valid until the next is yielded."""
    N = G.shape[0]
    buf = torch.empty((min(SLAB, N), N), dtype=torch.float64)
    for i in range(0, N, SLAB):
        j = min(i + SLAB, N)
        b = buf[: j - i]
        b.copy_(G[i:j])
        yield i, j, b


def deflation_applies(G: Any, k: int, backend: str) -> bool:
    """Whether :func:`deflated_lanczos` may be tried: a float32 CPU torch tensor or NumPy array,
    N ≥ :data:`MIN_N`, k ≥ :data:`MIN_K`, backend "auto" or "torch"."""
    if backend not in ("auto", "torch") or len(getattr(G, "shape", ())) != 2 or G.shape[0] < MIN_N or k < MIN_K:
        return False
    if isinstance(G, torch.Tensor):
        return G.dtype == torch.float32 and G.device.type == "cpu"
    return isinstance(G, np.ndarray) and G.dtype == np.float32


def deflated_lanczos(
    G: Any,
    k: int,
    *,
    tol: float,
    max_iter: int | None,
    seed: int,
    start: Any,
    block_size: int | None,
    workspace: HostWorkspace | None = None,
) -> LanczosResult | None:
    """Top-k of a validated float32 host G by block Lanczos on :class:`DeflatedGram` products
    (``workspace``: where the rest and Lanczos's blocks live, see :class:`HostWorkspace`).

    Returns the result with every residual an upper bound of the true one (sampled ones: the
    true residual; others: Lanczos's plus the largest sampled product error), or None when a
    check fails (logged): the caller then runs the float64 products.
    """
    G = convert(G, "torch", torch.float32, "cpu")  # detached; NumPy views copied only where torch needs it
    if not G.is_contiguous():  # G is symmetric: a column-major one is its own row-major transpose
        G = G.T if G.T.is_contiguous() else G.contiguous()
    D = DeflatedGram(G, seed, workspace=workspace)
    budget = tol * D.top
    if D.predicted_error > budget / 2:
        log.info(
            "deflated float32 products not tried: predicted error %.2e > half the tolerance %.2e "
            "(‖G − U S Uᵀ‖_F = %.3g at r = %d); float64 products",
            D.predicted_error,
            budget / 2,
            D.rest_fro,
            RANK,
        )
        return None
    # symmetry: G was checked on entry, and D.matmat is symmetric up to its float32 rounding, which
    # the check below measures (Lanczos's own test would report a rounding error as a non-symmetric G)
    res = block_lanczos(  # not converged: the float64 products run (res.converged, read below)
        D.matmat,
        G.shape[0],
        k,
        TorchOps("cpu"),
        tol=tol / 2,
        max_iter=max_iter,
        seed=seed,
        start=start,
        block_size=block_size,
        sym_rtol=float("inf"),
        workspace=workspace,
        warn=False,
    )
    scale = float(np.abs(res.evals).max())
    idx = _sample(k)
    X = res.evecs[:, idx]  # (N, m)
    GX = D.exact(X)
    true = torch.linalg.vector_norm(GX - X * torch.from_numpy(res.evals[idx]), dim=0).numpy()
    err = torch.linalg.vector_norm(D.matmat(X) - GX, dim=0).numpy()
    residuals = res.residuals + err.max()  # every vector: its explicit residual plus the sampled product error
    residuals[idx] = true
    if not res.converged or err.max() > tol * scale / 2 or residuals.max() > tol * scale:
        log.info(
            "deflated float32 products failed their check (converged %s, sampled true residual %.2e, "
            "product error %.2e, largest residual bound %.2e, against %.2e); float64 products",
            res.converged,
            true.max(),
            err.max(),
            residuals.max(),
            tol * scale,
        )
        return None
    return LanczosResult(
        res.evals, res.evecs, residuals, res.n_matvec + D.n_matvec + 2 * len(idx), res.n_restarts, True
    )


def _sample(k: int) -> np.ndarray:
    """Indices of the checked Ritz vectors: the :data:`SAMPLE` smallest and SAMPLE spread over the rest."""
    tail = np.arange(max(0, k - SAMPLE), k)
    spread = np.unique(np.linspace(0, max(0, k - SAMPLE - 1), SAMPLE).round().astype(int))
    return np.unique(np.concatenate([spread, tail]))
