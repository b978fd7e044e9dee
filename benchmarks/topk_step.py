"""Issue 22: one recorded step of examples/nsa_paper.yaml at k = 500 with test points, in one
process: before = Lanczos's tall QR by LAPACK and the symmetry check of G in 4096-tiles; after =
Cholesky QR twice and 512-tiles.

    python benchmarks/topk_step.py [--k 500] [--steps 2]

Each recorded step t = 0 … steps − 1 is analysed by both routes, alternately (before first), and
``SpectralAnalyzer.timings`` printed per part with the load average; the stored eigenvalues and
energies of the two routes are compared (max relative difference).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import yaml

import nsa_dist.linalg._inputs as inputs
import nsa_dist.linalg.lanczos as lanczos
from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run

ROOT = Path(__file__).resolve().parents[1]
COMPARED = (
    "eigenvalues",
    "eigenvalues_test",
    "energy_y",
    "energy_f",
    "energy_residual",
    "energy_df",
    "energy_df_pred",
    "energy_f_test",
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=500)
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args()
    d = yaml.safe_load((ROOT / "examples" / "nsa_paper.yaml").read_text())
    d["spectrum"].update(k=a.k, store_eigenvectors=[])
    d.update(steps=a.steps, record={"steps": list(range(a.steps))})
    spec = ExperimentSpec.model_validate(d)
    data = load_dataset(spec.data, seed=spec.seed)
    plan = plan_run(spec, data)
    an = SpectralAnalyzer(plan, data)
    cholesky_qr2, asymmetry = lanczos._cholesky_qr2, inputs._asymmetry
    for ck in Trainer(plan, data).train_until(a.steps):
        out = {}
        for route in ("before", "after"):
            lanczos._cholesky_qr2 = cholesky_qr2 if route == "after" else (lambda ops, A: None)
            inputs._asymmetry = (
                asymmetry if route == "after" else (lambda G, tile: asymmetry(G, 4096 if tile == 512 else tile))
            )
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            out[route] = an.analyze(ck).arrays()
            parts = " + ".join(f"{k} {v:.1f}" for k, v in an.timings.items())
            print(
                f"t = {ck.step} {route}: {time.perf_counter() - t0:.1f} s = {parts}; products {an.n_products}; "
                f"load {load:.1f} -> {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        diffs = {
            name: float(
                np.max(
                    np.abs(out["after"][name] - out["before"][name]) / np.maximum(np.abs(out["before"][name]), 1e-300)
                )
            )
            for name in COMPARED
            if name in out["before"]
        }
        print(
            f"t = {ck.step} max relative difference after vs before: "
            + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()),
            flush=True,
        )
    lanczos._cholesky_qr2, inputs._asymmetry = cholesky_qr2, asymmetry


if __name__ == "__main__":
    main()
