"""Issue 8 benchmarks: one step's analysis with G held whole vs spread over a gang of Ray workers.

    python benchmarks/layouts.py a [--n 30000]     # block_rows on 2 and 4 workers vs local
    python benchmarks/layouts.py b [--n 60000]     # block_rows on 4 workers where G alone is 14.4 GB
    python benchmarks/layouts.py c [--n 200000]    # matrix_free on 2 workers; equality check at --n-check
    python benchmarks/layouts.py d [--n 20000] [--probes 16]  # Hessian over 2 data shards vs 1

Every analysis is the full step of a run of the NSA paper's 6x256 Leaky-ReLU net on image2d
(float32 G, top-k eigenpairs, every metric the store records; no images or test points):
``SpectralAnalyzer.analyze`` on a checkpoint at t = 0.  ``local`` runs in a fresh process (its
peak RSS is the process's); a gang is a RayGang of SpectralShard actors (1 CPU each) whose peak
RSS each member reports, driven from this process.  Results go to bench-out/layouts-<part>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench-out"


def _spec(n: int, k: int, layout: str, workers: int, hessian: bool = False, probes: int = 16) -> dict:
    spec = {
        "name": f"bench{n}",
        "data": {"name": "image2d", "n": n},
        "model": {"depth": 6, "width": 256},
        "steps": 1,
        "record": {"steps": [0]},
        "spectrum": {
            "k": k,
            "dtype": "float32",
            "layout": layout,
            "workers": workers,
            "images": [],
            "frobenius_probes": 16,
        },
    }
    if hessian:
        spec["hessian"] = {
            "probes": probes,
            "orthogonality": False,
            "rayleigh_k": 0,
            "top_k": 1,
            "density": False,
            "eig_tol": 1e-8,
        }
    return spec


def _rss_self() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def _analyze(spec_dict: dict, pool=None) -> tuple[dict, float, object]:
    import torch

    from nsa_dist.config import ExperimentSpec
    from nsa_dist.data import load_dataset
    from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run

    torch.set_num_threads(1)
    spec = ExperimentSpec.model_validate(spec_dict)
    data = load_dataset(spec.data, seed=spec.seed)
    plan = plan_run(spec, data)
    ck = next(iter(Trainer(plan, data).train_until(1)))
    an = SpectralAnalyzer(plan, data)
    t0 = time.perf_counter()
    out = an.analyze(ck, pool).arrays()
    return out, time.perf_counter() - t0, an


def _local_child(spec_json: str, out_path: str) -> None:
    """Run one local analysis in this (fresh) process; write its time, peak RSS and results."""
    out, seconds, _ = _analyze(json.loads(spec_json))
    np.savez(
        out_path,
        seconds=seconds,
        peak=_rss_self(),
        **{k: np.asarray(v) for k, v in out.items() if k in ("eigenvalues", "energy_y", "gram_sq_frobenius")},
    )


def local(spec: dict) -> dict:
    path = str(OUT / "local-child.npz")
    subprocess.run([sys.executable, __file__, "_child", json.dumps(spec), path], check=True)
    r = np.load(path)
    return {
        "seconds": float(r["seconds"]),
        "peak_GB": float(r["peak"]) / 1e9,
        "eigenvalues": r["eigenvalues"],
        "energy_y": r["energy_y"],
        "fro": r["gram_sq_frobenius"],
    }


def gang(spec: dict, workers: int) -> dict:
    import ray

    from nsa_dist.cluster import connect
    from nsa_dist.cluster.gang import RayGang

    connect(num_cpus=workers + 1)
    g = RayGang(workers, cpus=1, threads=1)
    try:
        out, seconds, an = _analyze(spec, g.members)
        peaks = g.peak_rss()
    finally:
        g.shutdown()
        ray.shutdown()
    return {
        "seconds": seconds,
        "parts_s": dict(an.timings),
        "worker_peak_GB": [p / 1e9 for p in peaks],
        "driver_peak_GB": _rss_self() / 1e9,
        "layout": an.plan.layout.layout.value,
        "eigenvalues": out["eigenvalues"],
        "energy_y": out["energy_y"],
        "fro": out["gram_sq_frobenius"],
        "out": out,
    }


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def part_a(n: int, k: int) -> dict:
    ref = local(_spec(n, k, "local", 1))
    res = {"N": n, "k": k, "local_s": ref["seconds"], "local_peak_GB": ref["peak_GB"]}
    for W in (2, 4):
        g = gang(_spec(n, k, "block_rows", W), W)
        res[f"W{W}"] = {
            "seconds": g["seconds"],
            "ratio_to_local": g["seconds"] / ref["seconds"],
            "worker_peak_GB": g["worker_peak_GB"],
            "driver_peak_GB": g["driver_peak_GB"],
            "peak_target_GB": 0.6 / W * ref["peak_GB"] + 0.5,
            "eigenvalue_rel_diff": _rel(g["eigenvalues"], ref["eigenvalues"]),
            "energy_y_max_diff": float(np.max(np.abs(g["energy_y"] - ref["energy_y"]))),
        }
    return res


def part_b(n: int, k: int) -> dict:
    g = gang(_spec(n, k, "block_rows", 4), 4)
    return {
        "N": n,
        "k": k,
        "G_GB_float32": n * n * 4 / 1e9,
        "seconds": g["seconds"],
        "parts_s": g["parts_s"],
        "worker_peak_GB": g["worker_peak_GB"],
        "driver_peak_GB": g["driver_peak_GB"],
        "lambda_max": float(g["eigenvalues"][0]),
    }


def part_c(n: int, k: int, n_check: int) -> dict:
    g = gang(_spec(n, k, "matrix_free", 2), 2)
    res = {
        "N": n,
        "k": k,
        "seconds": g["seconds"],
        "parts_s": g["parts_s"],
        "worker_peak_GB": g["worker_peak_GB"],
        "driver_peak_GB": g["driver_peak_GB"],
        "fro_estimate": [float(x) for x in g["fro"]],
    }
    mf = gang(_spec(n_check, k, "matrix_free", 2), 2)
    br = gang(_spec(n_check, k, "block_rows", 2), 2)
    res["check_N"] = n_check
    res["check_eigenvalue_rel_diff_vs_block_rows"] = _rel(mf["eigenvalues"], br["eigenvalues"])
    res["check_fro_estimate_vs_exact"] = {
        "estimate": float(mf["fro"][0]),
        "stderr": float(mf["fro"][1]),
        "exact": float(br["fro"][0]),
    }
    return res


def part_d(n: int, probes: int) -> dict:
    spec1 = _spec(n, 10, "matrix_free", 1, hessian=True, probes=probes)
    spec2 = _spec(n, 10, "matrix_free", 2, hessian=True, probes=probes)
    one, two = gang(spec1, 1), gang(spec2, 2)
    h1, h2 = one["out"], two["out"]
    return {
        "N": n,
        "probes": probes,
        "one_worker_s": one["seconds"],
        "one_worker_parts_s": one["parts_s"],
        "two_workers_parts_s": two["parts_s"],
        "two_workers_s": two["seconds"],
        "time_ratio_2_over_1": two["seconds"] / one["seconds"],
        "lambda_max_H": float(h1["hessian_top"][0, 0]),
        "lambda_max_rel_diff": _rel(h2["hessian_top"], h1["hessian_top"]),
        "moments_rel_diff": _rel(h2["hessian_moments"], h1["hessian_moments"]),
    }


def main() -> None:
    if sys.argv[1:2] == ["_child"]:
        _local_child(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices="abcd")
    ap.add_argument("--n", type=int)
    ap.add_argument("--k", type=int)
    ap.add_argument("--n-check", type=int, default=20_000)
    ap.add_argument("--probes", type=int, default=16, help="(d) Hutch++ probes of the Hessian moments")
    a = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.part == "a":
        res = part_a(a.n or 30_000, a.k or 100)
    elif a.part == "b":
        res = part_b(a.n or 60_000, a.k or 100)
    elif a.part == "c":
        res = part_c(a.n or 200_000, a.k or 20, a.n_check)
    else:
        res = part_d(a.n or 20_000, a.probes)
    text = json.dumps(res, indent=1, default=float)
    (OUT / f"layouts-{a.part}.json").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
