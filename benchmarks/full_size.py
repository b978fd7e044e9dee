"""Issue 19: the full-size MNIST and CIFAR-10 recipes, end to end on a gang (block_rows).

    python benchmarks/full_size.py mnist   [--steps 2] [--k 100] [--workers 4]
    python benchmarks/full_size.py cifar10 [--steps 2] [--k 100] [--workers 4]   [--n 2000: a smoke run]

Writes the full-size stand-in files (``nsa_dist.data.standins``: 60,000 + 10,000 IDX digits;
five 10,000-image CIFAR pickle batches + the test batch) under bench-out/data unless they are
there, then takes the first run of ``examples/mnist_full.yaml`` / ``examples/cifar10_full.yaml``
as written — data through the real loaders at N = 60,000 (d = 784) / N = 50,000 (the CNN
factory on RGB 32×32) — with ``steps`` full-batch GD steps, every one recorded, and analyses each
recorded step with G_t as ``block_rows`` tiles on a RayGang of ``workers`` SpectralShard actors
(one torch thread each), exactly as a sweep's spectral worker drives its step gang.  Records the
load time, each step's analysis time by part, each gang member's peak RSS and the driver's.
Results: bench-out/full-size-<dataset>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
OUT = ROOT / "bench-out"

from _measure import peak_rss  # noqa: E402

RECIPES = {"mnist": ("mnist_full.yaml", "mnist"), "cifar10": ("cifar10_full.yaml", "cifar-10-batches-py")}


def _data_dir(dataset: str) -> Path:
    from nsa_dist.data.standins import cifar10_standin, mnist_standin

    d = OUT / "data" / RECIPES[dataset][1]
    marker = d / ".complete"
    if not marker.exists():
        t0 = time.perf_counter()
        (mnist_standin if dataset == "mnist" else cifar10_standin)(d)
        marker.write_text(f"{time.perf_counter() - t0:.1f} s\n")
    return d


def run(dataset: str, steps: int, k: int | None, workers: int, n: int | None = None) -> dict:
    import ray
    import torch

    from nsa_dist.cluster import connect
    from nsa_dist.cluster.gang import RayGang
    from nsa_dist.config import ExperimentSpec
    from nsa_dist.data import load_dataset
    from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run
    from nsa_dist.specfile import load_sweep

    torch.set_num_threads(2)
    sweep = load_sweep(ROOT / "examples" / RECIPES[dataset][0])
    first = sweep.expand()[0].model_dump(mode="json")
    first["data"]["path"] = str(_data_dir(dataset))
    if n:
        first["data"]["n"] = n
    first.update(steps=steps, record={"steps": list(range(steps))})
    first["spectrum"].update(workers=workers, **({"k": k} if k else {}))
    spec = ExperimentSpec.model_validate(first)
    t0 = time.perf_counter()
    data = load_dataset(spec.data, seed=spec.seed)
    load_s = time.perf_counter() - t0
    connect(num_cpus=workers + 1)
    gang = RayGang(workers, cpus=1, threads=1)
    res: dict = {
        "dataset": dataset,
        "N": data.n,
        "d": int(data.X.shape[1]),
        "workers": workers,
        "k": spec.spectrum.k,
        "model": first["model"],
        "load_s": load_s,
        "steps": [],
    }
    try:
        plan = plan_run(spec, data)
        an = SpectralAnalyzer(plan, data)
        res["layout"], res["ntk_method"] = an.plan.layout.layout.value, an.plan.ntk_method
        for ck in Trainer(plan, data).train_until(steps):
            t1 = time.perf_counter()
            out = an.analyze(ck, gang.members).arrays()
            res["steps"].append(
                {
                    "t": int(ck.step),
                    "seconds": time.perf_counter() - t1,
                    "parts_s": dict(an.timings),
                    "loss": float(ck.loss),
                    "lambda_max": float(out["eigenvalues"][0]),
                    "lambda_k": float(out["eigenvalues"][-1]),
                    "energy_y_k": float(out["energy_y"][-1]),
                }
            )
            print(json.dumps(res["steps"][-1], default=float), flush=True)
        res["worker_peak_GB"] = [p / 1e9 for p in gang.peak_rss()]
        res["driver_peak_GB"] = peak_rss() / 1e9
    finally:
        gang.shutdown()
        ray.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dataset", choices=sorted(RECIPES))
    ap.add_argument("--steps", type=int, default=2, help="steps t = 0 … steps − 1 of the run, every one recorded")
    ap.add_argument("--k", type=int, help="top-k eigenpairs (default: the recipe's)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--n", type=int, help="training points (default: the recipe's full size; smaller for a smoke run)")
    a = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = run(a.dataset, a.steps, a.k, a.workers, a.n)
    text = json.dumps(res, indent=1, default=float)
    (OUT / f"full-size-{a.dataset}.json").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
