"""Distribution benchmarks (issue 4 §9).  Run: ``python benchmarks/sweep.py [--parts ac]``.

(a) sweep throughput with 1 vs 2 spectral workers on the embedded local Ray (ratio);
(c) object-store cost of one checkpoint of the paper's net (P = 264,193, N = 10,000).
(The former (b), a Gram as block rows on 2 workers vs one process, is ``benchmarks/layouts.py`` (a):
the ``block_rows`` layout on a gang.)
Every ratio is against a baseline measured in this same process.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nsa_dist.cluster import SweepCoordinator, connect  # noqa: E402
from nsa_dist.config import SweepSpec  # noqa: E402


def part_a(n_runs: int = 2) -> dict:
    """Wall time of the same analysis-bound sweep (N=1500, full spectrum every 2 steps) with 1 and 2 workers.

    Runs go one at a time (max_concurrent_runs=1) so on 2 cores the trainer's thread leaves room
    for the workers: the measurement is of how the pool scales, not of core oversubscription.
    """
    base = {
        "data": {"n": 1500},
        "model": {"depth": 4, "width": 128},
        "steps": 20,
        "record": {"every": 2},
        "spectrum": {"k": "all", "images": []},
    }
    out = {}
    for workers in (1, 2):
        sweep = SweepSpec(
            name=f"tp{workers}",
            base=base,
            grid={"seed": list(range(n_runs))},
            cluster={"spectral_workers": workers, "max_inflight": 4, "trainer_cpus": 0.5, "max_concurrent_runs": 1},
        )
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            outcomes = SweepCoordinator(sweep, str(Path(d) / "s.zarr")).run()
            out[workers] = time.perf_counter() - t0
            assert all(o.status == "done" for o in outcomes)
    steps = n_runs * 11
    return {
        "runs": n_runs,
        "recorded_steps": steps,
        "seconds_1_worker": out[1],
        "seconds_2_workers": out[2],
        "steps_per_s_1": steps / out[1],
        "steps_per_s_2": steps / out[2],
        "speedup_2_vs_1": out[1] / out[2],
    }


def part_c(reps: int = 20) -> dict:
    import ray

    from nsa_dist.config import ExperimentSpec
    from nsa_dist.data import load_dataset
    from nsa_dist.pipeline import Trainer, plan_run

    spec = ExperimentSpec(data={"n": 10_000, "n_test": 10_000}, steps=2, record={"every": 1})
    data = load_dataset(spec.data)
    ck = next(Trainer(plan_run(spec, data), data).train_until(1))
    nbytes = sum(v.nbytes for v in vars(ck).values() if isinstance(v, np.ndarray))
    nbytes += sum(v.nbytes for v in vars(ck.state).values() if isinstance(v, np.ndarray))

    @ray.remote(num_cpus=0.1)
    class Sink:
        def take(self, ck) -> int:
            return int(ck.theta.shape[0]) if ck is not None else 0

    sink = Sink.remote()
    ray.get(sink.take.remote(None))
    ray.get(sink.take.remote(ray.put(ck)))  # warm up: the worker imports nsa_dist on first use
    t0 = time.perf_counter()
    for _ in range(reps):
        ray.get(sink.take.remote(None))
    empty = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        ray.get(sink.take.remote(ray.put(ck)))
    full = (time.perf_counter() - t0) / reps
    return {
        "checkpoint_MB": nbytes / 1e6,
        "call_ms_empty": empty * 1e3,
        "call_ms_with_checkpoint": full * 1e3,
        "transfer_ms_per_checkpoint": (full - empty) * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="ac")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    connect(num_cpus=4)
    results = {}
    for part in args.parts:
        results[part] = {"a": part_a, "c": part_c}[part]()
        print(f"({part})", json.dumps(results[part], indent=1, default=float), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    main()
