"""Issue 22: top-k vs its GEMM bound, and k: all with vs without the N×N eigenvectors, in one process.

    python benchmarks/topk.py GRAM.npy [--k 500] [--n-all 4000]

GRAM.npy: a float32 NTK Gram (e.g. of examples/nsa_paper.yaml at t = 0, N = 10⁴).  Prints
(a) the float32 GEMM time of the solver's product count (the bound) and of 736 columns, the
top-k time, products, max residual / λ_max and the eigenvalue error against ``--ref`` if given;
(b) on the leading n-all × n-all block: scipy ``eigh`` (evd, with vectors, float64, today's
``k: all``) vs :func:`nsa_dist.linalg.tridiag.eig_projections` of 6 φ vectors, time ratio and
max differences.  Timings: min over ``--repeat``; the load average is printed.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import scipy.linalg as sl
import torch
from _measure import best_of as _best

from nsa_dist.linalg import top_eigenpairs
from nsa_dist.linalg.tridiag import eig_projections


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gram")
    ap.add_argument("--k", type=int, default=500)
    ap.add_argument("--n-all", type=int, default=4000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--ref", default=None, help="reference eigenvalues (.npy) of the top k")
    a = ap.parse_args()
    G = torch.from_numpy(np.load(a.gram))  # (N, N) float32
    N = G.shape[0]
    print(f"N = {N}, k = {a.k}, load average {os.getloadavg()}")
    t_topk, ep = _best(lambda: top_eigenpairs(G, a.k), a.repeat)
    V = torch.randn(N, ep.n_matvec)
    t_bound, _ = _best(lambda: G @ V, a.repeat)
    t_736, _ = _best(lambda: G @ V[:, :736], a.repeat) if ep.n_matvec >= 736 else (float("nan"), None)
    print(
        f"(a) top-{a.k}: {t_topk:.2f} s, {ep.n_matvec} products, max residual/λ_max "
        f"{ep.max_residual / ep.evals[0]:.1e}; fp32 GEMM of those products {t_bound:.2f} s "
        f"(ratio {t_topk / t_bound:.2f}), of 736 columns {t_736:.2f} s (ratio {t_topk / t_736:.2f})"
    )
    if a.ref:
        ref = np.load(a.ref)
        print(f"    max |Δλ|/λ vs reference: {np.max(np.abs(ep.evals - ref) / np.abs(ref)):.1e}")
    n = a.n_all
    Gs = G[:n, :n].double().numpy()
    Phi = np.random.default_rng(0).standard_normal((n, 6))
    t_eigh, (w, Vf) = _best(lambda: sl.eigh(Gs, driver="evd", check_finite=False), 1)
    t_proj, sp = _best(lambda: eig_projections(Gs, Phi, indices=(0, 1, 2, 3, 4, 5, 9, 99, 499, 999)), 1)
    w, Vf = w[::-1], Vf[:, ::-1]
    print(
        f"(b) k: all at n = {n}: eigh with vectors {t_eigh:.1f} s, eigenvalues + projections {t_proj:.1f} s "
        f"(ratio {t_eigh / t_proj:.2f}); max |Δλ|/λ_max {np.abs(sp.evals - w).max() / w[0]:.1e}, "
        f"max |Δ E(φ, k)| "
        f"{np.abs(np.cumsum(sp.proj**2, 0) - np.cumsum((Vf.T @ Phi) ** 2, 0)).max() / (Phi**2).sum(0).min():.1e}"
    )


if __name__ == "__main__":
    main()
