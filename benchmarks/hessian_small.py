"""The Hessian step of a small network: H, I and S formed as dense matrices at their first product
(``linalg.Materialised``, P ≤ ``hessian_step.DENSE_P``) against products all the way.

    python benchmarks/hessian_small.py [--n 24] [--width 8] [--depth 3] [--repeats 3]

One ``HessianAnalysis.analyze`` at initialisation on ``image2d`` with the spec's default Hessian
block (probes 16, Lanczos 40, top 5, …; the infinite-width limits off: they are not products),
tanh NTK-init MLP, float64, both ways in this process, alternated; prints the median seconds
of each, their ratio, the Hessian-vector products each spent, and the largest relative
difference over every Hessian array.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nsa_dist.config import ExperimentSpec  # noqa: E402
from nsa_dist.data import load_dataset  # noqa: E402
from nsa_dist.models import build_model  # noqa: E402
from nsa_dist.pipeline import hessian_step, plan_run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec = ExperimentSpec(
        name="hessian-small",
        data={"name": "image2d", "n": a.n, "n_test": 4},
        model={"depth": a.depth, "width": a.width, "init": "ntk", "activation": "tanh"},
        steps=1,
        spectrum={"k": 4, "dtype": "float64"},
        hessian={"limit": False},
    )
    data = load_dataset(spec.data)
    plan = plan_run(spec, data)
    X, y = torch.as_tensor(data.X, dtype=torch.float64), np.asarray(data.y)
    model = build_model(spec.model, seed=0, dtype=torch.float64)
    P = sum(p.numel() for p in model.parameters())
    times: dict[int, list[float]] = {hessian_step.DENSE_P: [], 0: []}
    out: dict[int, object] = {}
    default = hessian_step.DENSE_P
    for _ in range(a.repeats):
        for dense in (default, 0):
            hessian_step.DENSE_P = dense
            h = hessian_step.HessianAnalysis(plan, X, y)
            t = time.perf_counter()
            out[dense] = h.analyze(model, step=0)
            times[dense].append(time.perf_counter() - t)
    hessian_step.DENSE_P = default
    worst, where = 0.0, ""

    def arrays(step: object) -> dict[str, object]:
        return {f.name: getattr(step, f.name) for f in fields(step) if getattr(step, f.name) is not None}

    for name, want in arrays(out[0]).items():
        got = arrays(out[default])[name]
        if name == "hessian_products" or not np.issubdtype(np.asarray(want).dtype, np.floating):
            continue
        w, g = np.asarray(want, np.float64), np.asarray(got, np.float64)
        if np.isnan(w).all():
            continue
        err = float(np.nanmax(np.abs(g - w))) / max(float(np.nanmax(np.abs(w))), 1e-300)
        if err > worst:
            worst, where = err, name
    dense_s, ops_s = statistics.median(times[default]), statistics.median(times[0])
    print(f"N = {a.n}, {a.depth}×{a.width} tanh, P = {P}, {a.repeats} repeats, 1 torch thread")
    print(f"  products all the way: {ops_s:7.2f} s  ({int(out[0].hessian_products)} Hessian-vector products)")
    print(f"  formed:               {dense_s:7.2f} s  ({int(out[default].hessian_products)} Hessian-vector products)")
    print(f"  speed-up {ops_s / dense_s:.2f}×; largest relative difference {worst:.1e} ({where})")


if __name__ == "__main__":
    main()
