"""The quadrature route of ``k: all`` against the exact route: one recorded step's time and peak memory,
and the brackets against the exact curves.

Trains the NSA paper's kind of net (leaky ReLU, Xavier; ``--depth`` × ``--width``) on the 2-D image
task for ``--steps`` GD updates, then analyses the last recorded step twice in one process with
``layout: local``: ``energy: exact`` (every eigenpair, the tridiagonal route) and ``energy:
quadrature`` (the top ``quadrature.top`` exactly, brackets beyond).  Each analysis is measured by
:func:`benchmarks._measure.measured` (wall seconds, peak RSS above the level at entry); prints the
ratio, the analyzer's parts, and for every φ the largest bracket width and whether every exact value
lies in its bracket (and λ_k's).

    python benchmarks/energy_quadrature.py [--n 10000] [--depth 6] [--width 256] [--steps 200]
        [--dtype float32] [--top 100] [--lanczos-steps 60] [--probes 24] [--block-size 16]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _measure import measured  # noqa: E402

from nsa_dist.config import ExperimentSpec  # noqa: E402
from nsa_dist.data import load_dataset  # noqa: E402
from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run  # noqa: E402

PHIS = ("y", "f", "residual", "df", "df_pred")


def _spec(a: argparse.Namespace, energy: str) -> ExperimentSpec:
    return ExperimentSpec.model_validate(
        {
            "name": "bench",
            "seed": 0,
            "data": {"name": "image2d", "n": a.n, "n_test": 16},
            "model": {"depth": a.depth, "width": a.width, "activation": "leaky_relu", "init": "xavier"},
            "schedule": {"lr": 0.25},
            "steps": a.steps,
            "record": {"steps": [0, a.steps - 1]},
            "spectrum": {
                "k": "all",
                "energy": energy,
                "layout": "local",
                "dtype": a.dtype,
                "store_eigenvectors": False,
                "images": [],
                "quadrature": {
                    "top": a.top,
                    "lanczos_steps": a.lanczos_steps,
                    "probes": a.probes,
                    "block_size": a.block_size,
                    "curve_points": 100,
                },
            },
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--top", type=int, default=100)
    ap.add_argument("--lanczos-steps", type=int, default=60)
    ap.add_argument("--probes", type=int, default=24)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--exact-cache",
        default="",
        help="an .npz of the exact route's arrays: read when it exists "
        "(the exact analysis is then not repeated), else written",
    )
    a = ap.parse_args()
    spec_q, spec_x = _spec(a, "quadrature"), _spec(a, "exact")
    data = load_dataset(spec_q.data, seed=0)
    plan_q, plan_x = plan_run(spec_q, data), plan_run(spec_x, data)
    ck = list(Trainer(plan_x, data).train_until(a.steps))[-1]
    print(
        f"N = {a.n}, {a.depth}×{a.width} net, step {ck.step}, loss {ck.loss:.4g}, {a.dtype}, load "
        f"{os.getloadavg()[0]:.1f}",
        flush=True,
    )
    res = {}
    cache = Path(a.exact_cache) if a.exact_cache else None
    if cache is not None and cache.exists():
        z = np.load(cache)
        res["exact"] = (
            {"seconds": float(z["seconds"]), "peak_bytes": float(z["peak_bytes"])},
            {k: z[k] for k in z.files},
            {},
        )
        print(
            f"exact      {res['exact'][0]['seconds']:7.1f} s  peak {res['exact'][0]['peak_bytes'] / 1e9:6.2f} GB "
            f"(from {cache})"
        )
    for name, plan in (("quadrature", plan_q), ("exact", plan_x)):
        if name in res:
            continue
        an = SpectralAnalyzer(plan, data)
        with measured() as m:
            out = an.analyze(ck).arrays()
        res[name] = (m, out, dict(an.timings))
        print(
            f"{name:10s} {m['seconds']:7.1f} s  peak {m['peak_bytes'] / 1e9:6.2f} GB  parts "
            + ", ".join(f"{k} {v:.1f}" for k, v in an.timings.items())
            + f"  load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    (mq, q, _), (mx, x, _) = res["quadrature"], res["exact"]
    if cache is not None and not cache.exists():
        np.savez(
            cache,
            seconds=mx["seconds"],
            peak_bytes=mx["peak_bytes"],
            eigenvalues=x["eigenvalues"],
            **{f"energy_{p}": x[f"energy_{p}"] for p in PHIS},
        )
    print(
        f"ratio exact/quadrature: time {mx['seconds'] / mq['seconds']:.2f}×, peak memory "
        f"{mx['peak_bytes'] / max(mq['peak_bytes'], 1):.2f}×"
    )
    ks = plan_q.curve_k()
    lam = np.asarray(x["eigenvalues"])[ks - 1]
    tol = 1e-6 * lam[0] if a.dtype == "float32" else 1e-9 * lam[0]
    inside = (q["curve_eigenvalue_lower"] - tol <= lam) & (lam <= q["curve_eigenvalue_upper"] + tol)
    pos = lam > 1e-9 * lam[0]  # below: G's numerical null space
    rel = (q["curve_eigenvalue_upper"] - q["curve_eigenvalue_lower"])[pos] / lam[pos]
    print(
        f"λ_k: {inside.sum()}/{ks.size} inside their brackets; largest relative width {rel.max():.3g} at "
        f"k = {ks[pos][np.argmax(rel)]} (λ_k > 1e-9·λ_1: k ≤ {ks[pos].max()})"
    )
    for p in PHIS:
        E = np.asarray(x[f"energy_{p}"])[ks - 1]
        lo, hi, v = q[f"curve_energy_{p}_lower"], q[f"curve_energy_{p}_upper"], q[f"curve_energy_{p}"]
        if not np.isfinite(E).all():
            print(f"E({p}): not finite on the exact route")
            continue
        ok = (lo - 1e-6 <= E) & (E <= hi + 1e-6)
        wd = hi - lo
        i = int(np.argmax(wd))
        print(
            f"E({p:8s}): {ok.sum()}/{ks.size} inside; largest width {wd.max():.4f} at k = {ks[i]} (E = {E[i]:.3f}); "
            f"median width beyond top {np.median(wd[ks > a.top]):.4f}; largest |value − exact| "
            f"{np.abs(v - E).max():.4f}"
        )


if __name__ == "__main__":
    main()
