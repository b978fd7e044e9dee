"""Issue 22: a top-k with deflated float32 products against the float64 products, alternating in one process.

    python benchmarks/topk_products.py [GRAM.npy] [--k 500] [--repeat 3]

GRAM.npy: a float32 Gram (N, N); without it, the float32 NTK Gram of examples/nsa_paper.yaml at
t = 0 (N = 10⁴) is computed first.  Each round runs :func:`~nsa_dist.linalg.top_eigenpairs` on
the same float32 G twice: the route it takes now (``products == "deflated-float32"``) and the
float64 products (the route switched off by raising ``MIN_K``), and prints both times, their
ratio, the products, the max residual, the eigenvalue difference between the routes, and the
GEMM bound of each route's products (the time of that many columns of G·X in its precision, in
(N, b) blocks as Lanczos applies them, b = 48 since issue 22's sixth pass).  The load average is printed
with each round.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

import nsa_dist.linalg._deflated as deflated
from nsa_dist.linalg import top_eigenpairs
from nsa_dist.linalg._backend import host_empty

BLOCK = 48  # Lanczos's block for a large dense G (nsa_dist.linalg.eigenpairs._block_size)


def _paper_gram() -> torch.Tensor:
    from pathlib import Path

    import yaml

    from nsa_dist.config import ExperimentSpec
    from nsa_dist.data import load_dataset
    from nsa_dist.models import build_model
    from nsa_dist.ntk import gram
    from nsa_dist.pipeline.model_state import model_inputs

    root = Path(__file__).resolve().parents[1]
    spec = ExperimentSpec.model_validate(yaml.safe_load((root / "examples" / "nsa_paper.yaml").read_text()))
    data = load_dataset(spec.data, seed=spec.seed)
    model = build_model(spec.model, seed=spec.seed)
    return gram(model, model_inputs(data.X, model, torch.device("cpu")), dtype=torch.float32)


def _gemm_bound(G: torch.Tensor, columns: int) -> float:
    """Seconds for ``columns`` columns of G·X in G's precision, in Lanczos's (N, BLOCK) blocks."""
    X = torch.randn(G.shape[0], BLOCK, dtype=G.dtype)
    G @ X
    t = time.perf_counter()
    for _ in range(-(-columns // BLOCK)):
        G @ X
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gram", nargs="?")
    ap.add_argument("--k", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    G = torch.from_numpy(np.load(a.gram)) if a.gram else _paper_gram()
    G = host_empty(tuple(G.shape), torch.float32).copy_(G)  # as the analyzer's would be: NumPy's pages
    min_k = deflated.MIN_K
    print(f"N = {G.shape[0]}, k = {a.k}")
    top_eigenpairs(G, a.k)  # warm-up: threads, MKL, first allocations
    for r in range(a.repeat):
        out = {}
        for name, mk in (("deflated", min_k), ("float64", 10**9)):
            deflated.MIN_K = mk
            load = os.getloadavg()[0]
            t = time.perf_counter()
            ep = top_eigenpairs(G, a.k)
            out[name] = (time.perf_counter() - t, ep, load)
        deflated.MIN_K = min_k
        (td, d, ld), (tf, f, lf) = out["deflated"], out["float64"]
        print(
            f"round {r + 1}: deflated {td:.2f} s ({d.products}, {d.n_matvec} products, max residual "
            f"{d.max_residual / d.evals[0]:.1e}·λ₁, load {ld:.1f}) | float64 {tf:.2f} s ({f.n_matvec} products, "
            f"{f.max_residual / f.evals[0]:.1e}·λ₁, load {lf:.1f}) | ratio {td / tf:.2f} | "
            f"max |Δλ|/λ₁ {np.abs(d.evals - f.evals).max() / f.evals[0]:.1e}",
            flush=True,
        )
    G64 = G.double()
    print(
        f"GEMM bound of the products: float32 {_gemm_bound(G, d.n_matvec):.2f} s ({d.n_matvec} columns), "
        f"float64 {_gemm_bound(G64, f.n_matvec):.2f} s ({f.n_matvec} columns); load {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
