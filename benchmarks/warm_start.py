"""Issue 22 item 2: warm against cold Lanczos starts along the paper's own training.

    python benchmarks/warm_start.py [--k 500] [--records 0 1 10 100 1000 5000]

Trains examples/nsa_paper.yaml (N = 10⁴, float32 G, test points) and analyses each recorded step
twice, by two analyzers: one cold (``spectrum.warm_start: false``, random start blocks) and one
warm (``warm_start: true``: the previous record's eigenvectors, of the same Gram, start Lanczos).
Prints per record the spacing from the previous one, both analyzers' products with the training
and test Grams, the products saved, the times and the largest eigenvalue difference between the
two (relative to λ₁; both must agree within the solver's tolerance).  The paper records every
5,000 steps; the default records show how the saving falls with the spacing.
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
    ap.add_argument("--k", type=int, default=500)
    ap.add_argument("--records", type=int, nargs="+", default=[0, 1, 10, 100, 1000, 5000])
    a = ap.parse_args()
    records = sorted(set(a.records))
    d = yaml.safe_load((ROOT / "examples" / "nsa_paper.yaml").read_text())
    d["spectrum"].update(k=a.k, store_eigenvectors=[])
    d.update(steps=records[-1] + 1, record={"steps": records})
    analyzers = {}
    for warm in (False, True):
        d["spectrum"]["warm_start"] = warm
        spec = ExperimentSpec.model_validate(d)
        data = load_dataset(spec.data, seed=spec.seed)
        plan = plan_run(spec, data)
        analyzers["warm" if warm else "cold"] = SpectralAnalyzer(plan, data)
    previous = None
    t_train = time.perf_counter()
    for ck in Trainer(plan, data).train_until(records[-1] + 1):
        trained = time.perf_counter() - t_train
        out, secs = {}, {}
        for name, an in analyzers.items():
            t0 = time.perf_counter()
            out[name] = an.analyze(ck).arrays()
            secs[name] = time.perf_counter() - t0
        cold, warm = analyzers["cold"].n_products, analyzers["warm"].n_products
        dlam = max(
            float(np.max(np.abs(out["warm"][e] - out["cold"][e])) / float(out["cold"][e][0]))
            for e in ("eigenvalues", "eigenvalues_test")
        )
        saved = {g: f"{1 - warm[g] / cold[g]:.0%}" if cold[g] else "n/a" for g in cold}
        spacing = "—" if previous is None else ck.step - previous
        print(
            f"t = {ck.step} (spacing {spacing}, trained in {trained:.0f} s): products cold {cold} warm {warm} "
            f"saved {saved}; cold {secs['cold']:.1f} s, warm {secs['warm']:.1f} s; max |Δλ|/λ₁ {dlam:.1e}; "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        previous = ck.step
        t_train = time.perf_counter()


if __name__ == "__main__":
    main()
