"""Issue 22: one recorded step of examples/nsa_paper.yaml, timed by part, for comparing two
checkouts of nsa-dist run one after the other (each in its own process).

    python benchmarks/step_parts.py [--k 500] [--steps 2] [--repeat 2] [--save A.npz] [--compare B.npz]

Trains to the recorded steps t = 0 … steps − 1 (k: 500, float32, test points, no stored
eigenvectors), analyses each ``repeat`` times and prints ``SpectralAnalyzer.timings`` with the
load average.  ``--save`` writes the last analysis' arrays; ``--compare`` prints the max relative
difference of every array against a file saved by another checkout (the stored quantities must
agree within the solver's tolerance).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import yaml

from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", default="500")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--save")
    ap.add_argument("--compare")
    a = ap.parse_args()
    d = yaml.safe_load((ROOT / "examples" / "nsa_paper.yaml").read_text())
    d["spectrum"].update(k=a.k if a.k == "all" else int(a.k), store_eigenvectors=[])
    d.update(steps=a.steps, record={"steps": list(range(a.steps))})
    spec = ExperimentSpec.model_validate(d)
    data = load_dataset(spec.data, seed=spec.seed)
    plan = plan_run(spec, data)
    an = SpectralAnalyzer(plan, data)
    saved: dict[str, np.ndarray] = {}
    for ck in Trainer(plan, data).train_until(a.steps):
        for _ in range(a.repeat):
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            arrays = an.analyze(ck).arrays()
            parts = " + ".join(f"{k} {v:.2f}" for k, v in an.timings.items())
            print(
                f"t = {ck.step}: {time.perf_counter() - t0:.2f} s = {parts}; products {an.n_products}; "
                f"load {load:.1f} -> {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        saved.update(
            {
                f"t{ck.step}/{name}": np.asarray(v, dtype=np.float64)
                for name, v in arrays.items()
                if np.asarray(v).dtype.kind in "fiub"
            }
        )
    if a.save:
        np.savez(a.save, **saved)
    if a.compare:
        other = np.load(a.compare)
        for name in sorted(set(saved) & set(other.files)):
            x, y = saved[name], other[name]
            if x.shape != y.shape:
                print(f"{name}: shape {x.shape} vs {y.shape}")
                continue
            ok = np.isfinite(x) & np.isfinite(y)
            scale = np.abs(y[ok]).max() if ok.any() else 0.0
            diff = np.abs(x[ok] - y[ok]).max() / scale if ok.any() and scale > 0 else 0.0
            print(f"{name}: max |Δ| / max |value| = {diff:.1e}")


if __name__ == "__main__":
    main()
