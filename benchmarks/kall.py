"""Issue 22 item 4: a `k: all` step's eigenvalues and projections without the N×N eigenvectors, in one process.

    python benchmarks/kall.py GRAM.npy [--phi PHI.npy] [--ref W.npy P.npy] [--noise W.npy P.npy]
                              [--routes eigvalsh,mkl,eigh,lapack,weights,syrdb-v,syrdb-n:128,stedc,dstevd,
                                        rows,first-row]

GRAM.npy: a float32 NTK Gram (e.g. of examples/nsa_paper.yaml at t = 0, N = 10⁴).  Times, in this
order, each once (the load average before and after is printed with each):

- ``eigvalsh``: torch ``eigvalsh`` in G's dtype (MKL ``?syevd``, jobz = N), the eigenvalues alone;
- ``mkl`` / ``lapack``: :func:`nsa_dist.linalg.tridiag.eig_projections` of the φ columns by
  each :class:`~nsa_dist.linalg.tridiag.Reduction` (MKL ``?syrdb`` with Q formed / SciPy
  ``?sytrd`` + ``?ormqr``), in G's dtype;
- ``eigh``: what a ``k: all`` step ran before: ``top_eigenpairs(G, "all")``, a float64 ``eigh``
  with vectors, and ``Vᵀ Φ``;
- ``weights``: :func:`~nsa_dist.linalg.tridiag.eig_weights` of Φ's first column (no Q), with its
  checks (error / tolerance);
- the parts, one at a time: ``syrdb-v`` (MKL ``?syrdb`` with Q formed, the band of the Q route),
  ``syrdb-n:KD`` (``jobz = 'N'``, band KD), and T's divide and conquer on the last T reduced:
  ``stedc`` (MKL ``dstedc``), ``dstevd`` (SciPy's), ``rows`` (the rows-only divide and conquer with
  the first row and Φ's c columns carried, :func:`~nsa_dist.linalg._mkl_stedc.rows_of_s`), ``first-row``
  (the same with the first row alone).

``--ref W P``: eigenvalues (N,) and ``Vᵀ Φ`` (N, c), descending, of the float64 ``eigh`` of the
same G: each route's max |Δλ|/λ_1, max |Δ E(φ, k)| (energies as fractions of ‖φ‖²) and max
|Δ ⟨v_i, φ⟩²|/‖φ‖² are printed.  ``--noise W P``: the same of the float64 Gram's ``eigh``,
printed against ``--ref``, as the scale of the float32 Gram's own rounding.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from nsa_dist.linalg import top_eigenpairs
from nsa_dist.linalg._mkl_stedc import first_row, rows_of_s, stedc
from nsa_dist.linalg._mkl_syrdb import syrdb_explicit, syrdb_values
from nsa_dist.linalg.tridiag import eig_projections, eig_weights


def _timed(name: str, fn):
    l0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    out = fn()
    print(f"{name}: {time.perf_counter() - t0:.1f} s (load {l0:.2f} -> {os.getloadavg()[0]:.2f})", flush=True)
    return out


def _errors(name: str, w: np.ndarray, P: np.ndarray, w_ref: np.ndarray, P_ref: np.ndarray) -> None:
    n2 = (P_ref**2).sum(axis=0)  # ‖φ‖² (c,)
    dE = np.abs(np.cumsum(P**2, 0) - np.cumsum(P_ref**2, 0)) / n2
    dp = np.abs(P**2 - P_ref**2) / n2
    print(
        f"    {name}: max |Δλ|/λ_1 {np.abs(w - w_ref).max() / w_ref[0]:.1e}, max |Δλ_i|/λ_i (λ_i > 1e-3 λ_1) "
        f"{(np.abs(w - w_ref) / np.abs(w_ref))[w_ref > 1e-3 * w_ref[0]].max():.1e}, max |ΔE(φ, k)| "
        f"{dE.max():.1e}, max |Δ⟨v_i, φ⟩²|/‖φ‖² {dp.max():.1e}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gram")
    ap.add_argument("--phi", default=None, help="(N, c) φ columns; default: 6 Gaussian columns")
    ap.add_argument("--ref", nargs=2, default=None)
    ap.add_argument("--noise", nargs=2, default=None)
    ap.add_argument("--routes", default="eigvalsh,mkl,eigh")
    a = ap.parse_args()
    G = np.load(a.gram)  # (N, N)
    N = G.shape[0]
    Phi = np.load(a.phi) if a.phi else np.random.default_rng(0).standard_normal((N, 6))  # (N, c)
    ref = (np.load(a.ref[0]), np.load(a.ref[1])) if a.ref else None
    print(f"N = {N}, {G.dtype}, c = {Phi.shape[1]}, torch threads {torch.get_num_threads()}")
    if a.noise and ref:
        _errors("float64 Gram vs float32 Gram (both float64 eigh)", np.load(a.noise[0]), np.load(a.noise[1]), *ref)
    T = None  # the last (d, e) reduced, float64
    for route in a.routes.split(","):
        if route == "weights":
            sp = _timed(f"eig_weights, one φ ({G.dtype})", lambda: eig_weights(G, Phi[:, 0]))
            print(
                f"    {sp.reduction.value} + {sp.solver.value}, one_vector {sp.one_vector}; "
                "checks (error / tolerance): " + ", ".join(f"{n} {e / t:.1e}" for n, e, t in sp.checks),
                flush=True,
            )
            if ref:
                _errors("weights", sp.evals, sp.proj, ref[0], ref[1][:, :1])
        elif route == "syrdb-v":
            A = np.array(G, order="F")
            _, d, e = _timed(f"MKL ?syrdb with Q formed ({G.dtype})", lambda: syrdb_explicit(A))
            T, A = (d.astype(np.float64), e.astype(np.float64)), None
        elif route.startswith("syrdb-n"):
            kd = int(route.split(":")[1]) if ":" in route else 128
            A = np.array(G, order="F")
            d, e = _timed(f"MKL ?syrdb jobz = N, kd = {kd} ({G.dtype})", lambda: syrdb_values(A, kd))
            T, A = (d.astype(np.float64), e.astype(np.float64)), None
        elif route in ("stedc", "dstevd", "rows", "first-row") and T is not None:
            import scipy.linalg.lapack as lapack

            fn = {
                "stedc": lambda: stedc(*T),
                "dstevd": lambda: lapack.dstevd(*T, compute_v=1),
                "rows": lambda: rows_of_s(*T, Phi),
                "first-row": lambda: first_row(*T),
            }[route]
            _timed(f"T's divide and conquer, {route} (c = {Phi.shape[1] if route == 'rows' else 0})", fn)
        elif route == "eigvalsh":
            _timed(f"torch eigvalsh ({G.dtype})", lambda: torch.linalg.eigvalsh(torch.from_numpy(G)))
        elif route in ("mkl", "lapack"):
            sp = _timed(
                f"eig_projections, reduction={route} ({G.dtype})", lambda: eig_projections(G, Phi, reduction=route)
            )
            if ref:
                _errors(route, sp.evals, sp.proj, *ref)
        elif route == "eigh":
            ep = _timed(
                "top_eigenpairs(G, 'all') (float64 eigh with vectors) + Vᵀ Φ",
                lambda: (lambda e: (e, e.evecs.T @ Phi))(top_eigenpairs(torch.from_numpy(G), "all")),
            )
            if ref:
                _errors("eigh", ep[0].evals, ep[1], *ref)
        else:
            raise SystemExit(f"unknown route {route!r}")


if __name__ == "__main__":
    main()
