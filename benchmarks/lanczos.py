"""Top-k Lanczos vs full ``eigh`` on an NTK-like Gramian, in one process.

    python benchmarks/lanczos.py [N] [k]        # default N = 5000, k = 100

Builds ``G = Q diag(λ) Qᵀ`` with Haar-random Q and ``λ_i = i⁻²`` (the power-law decay of NTK
spectra), times every full dense ``eigh`` available (NumPy, SciPy ``evd``, torch) and takes the
fastest as the baseline, then times ``top_eigenpairs(G, k, "lanczos")`` (best of 3) and ARPACK.
Prints the speed ratio (target ≥ 10×), the max relative eigenvalue error against the baseline
(target ≤ 1e-8), the max residual ``‖G v − λ v‖ / λ_max`` (target ≤ 1e-6) and the matvec count.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import scipy.linalg as sl
import torch
from _measure import best_of as _timed  # noqa: E402  (the benchmarks directory is on sys.path)

from nsa_dist.linalg import top_eigenpairs


def make_gram(N: int = 5000, decay: float = 2.0, seed: int = 0) -> np.ndarray:
    """(N, N) float64 PSD ``Q diag(i^-decay) Qᵀ``, Q Haar-random (QR of a Gaussian matrix)."""
    rng = np.random.default_rng(seed)
    Q, R = np.linalg.qr(rng.standard_normal((N, N)))
    Q *= np.sign(np.diag(R))  # Haar measure
    lam = np.arange(1, N + 1, dtype=np.float64) ** -decay
    G = (Q * lam) @ Q.T
    return (G + G.T) / 2


def _baselines(G: np.ndarray) -> dict[str, tuple[float, np.ndarray]]:
    """Seconds and descending eigenvalues of each full dense eigh."""
    runs = {
        "numpy.linalg.eigh": lambda: np.linalg.eigh(G)[0],
        "scipy.linalg.eigh(driver='evd')": lambda: sl.eigh(G, driver="evd", check_finite=False)[0],
        "torch.linalg.eigh": lambda: torch.linalg.eigh(torch.from_numpy(G))[0].numpy(),
    }
    out = {}
    for name, f in runs.items():
        t, w = _timed(f)
        out[name] = (t, np.sort(w)[::-1])
    return out


def _accuracy(G: np.ndarray, evals: np.ndarray, evecs: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max relative eigenvalue error vs ref, max ‖G v − λ v‖ / λ_max)."""
    k = len(evals)
    rel = float(np.max(np.abs(evals - ref[:k]) / np.abs(ref[:k])))
    res = float(np.linalg.norm(G @ evecs - evecs * evals, axis=0).max() / abs(ref[0]))
    return rel, res


def run(G: np.ndarray | None = None, k: int = 100) -> dict:
    """Time full eigh vs top-k Lanczos (and ARPACK) on G (default: :func:`make_gram` with N = 5000).

    Returns:
        dict with N, k, the baseline's name and seconds, every eigh's seconds, and per solver
        ("lanczos", "arpack"): seconds, speedup vs the baseline, max relative eigenvalue error,
        max residual / λ_max, matvecs.
    """
    G = make_gram() if G is None else np.asarray(G, dtype=np.float64)
    eighs = _baselines(G)
    base = min(eighs, key=lambda name: eighs[name][0])
    t_base, ref = eighs[base]
    out: dict[str, Any] = {
        "N": G.shape[0],
        "k": k,
        "baseline": base,
        "t_baseline_s": t_base,
        "t_eigh_s": {name: t for name, (t, _) in eighs.items()},
    }
    for method, repeat in (("lanczos", 3), ("arpack", 1)):
        t, ep = _timed(lambda method=method: top_eigenpairs(G, k, method), repeat)
        rel, res = _accuracy(G, ep.evals, ep.evecs, ref)
        out[method] = {
            "t_s": t,
            "speedup": t_base / t,
            "max_rel_eval_err": rel,
            "max_residual_rel": res,
            "n_matvec": ep.n_matvec,
        }
    return out


def _print(r: dict) -> None:
    print(f"N = {r['N']}, k = {r['k']}, {torch.get_num_threads()} threads")
    for name, t in r["t_eigh_s"].items():
        print(f"  full {name:34s} {t:8.2f} s{'   <- baseline (fastest)' if name == r['baseline'] else ''}")
    for method in ("lanczos", "arpack"):
        m = r[method]
        print(
            f"  top-{r['k']} {method:8s} {m['t_s']:8.3f} s   speedup {m['speedup']:6.1f}x   "
            f"max rel eval err {m['max_rel_eval_err']:.1e}   max residual/λ_max {m['max_residual_rel']:.1e}   "
            f"matvecs {m['n_matvec']}"
        )
    lz = r["lanczos"]
    ok = lz["speedup"] >= 10 and lz["max_rel_eval_err"] <= 1e-8 and lz["max_residual_rel"] <= 1e-6
    print(f"targets (speedup ≥ 10x, eval err ≤ 1e-8, residual ≤ 1e-6): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    _print(run(make_gram(N), k))
