"""The on-disk size of a run of ``examples/nsa_paper.yaml`` (issue 11: the paper's k in the store).

    python benchmarks/store_size.py [--spec examples/nsa_paper.yaml]

The paper's run (600k GD steps at N = 10,000) needs a GPU; its store does not.  This creates the
run's group with the real schema (``prepare_run``: the spec's data, net and recording schedule)
and writes every recorded step through the ordinary ``RunWriter.write_step`` with values of the
right shape — random numbers, which compress no better than real spectra do, so the figure is an
upper bound of what the run writes — and only the eigenvector chunks the spec's
``store_eigenvectors`` schedule asks for.  Prints the measured bytes on disk: static arrays,
per recorded step, eigenvectors, in all, and what storing eigenvectors at every step would add.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    from nsa_dist.pipeline import prepare_run
    from nsa_dist.pipeline.checkpoint import TrainerState
    from nsa_dist.specfile import load_spec
    from nsa_dist.store import SpectrumStore, StepResult, run_arrays

    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default=str(ROOT / "examples" / "nsa_paper.yaml"))
    a = ap.parse_args()
    spec = load_spec(a.spec)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        url = Path(tmp) / "paper.zarr"
        t0 = time.perf_counter()
        prep = prepare_run(spec, SpectrumStore(str(url)))
        static = _du(url)
        dims, writer = prep.writer.dims, prep.writer
        skip = {"done", "theta", "opt_slots", "rng_state"}  # the writer stores these from the state
        per_step = [s for s in run_arrays(dims) if s.per_step and s.name not in skip]
        record = prep.plan.record
        S = len(record)
        for i in range(S):
            res = {
                s.name: rng.standard_normal(s.shape[1:]).astype(s.dtype)
                for s in per_step
                if s.name != "eigenvectors" or spec.spectrum.eigenvectors_at(int(record[i]))
            }
            writer.write_step(i, StepResult.from_arrays(res), _state(dims, rng, TrainerState, record[i]))
        total = _du(url)
        ev_dir = url / "runs" / prep.run_id / "eigenvectors"
        ev_total = _du(ev_dir) if ev_dir.exists() else 0
        res = {
            "spec": a.spec,
            "N": dims.N,
            "K": dims.K,
            "P": dims.P,
            "recorded_steps": S,
            "static_GB": static / 1e9,
            "eigenvectors_GB": ev_total / 1e9,
            "per_step_MB": (total - static - ev_total) / len(record) / 1e6,
            "total_GB": total / 1e9,
            "eigenvectors_every_step_GB": (total - ev_total) / 1e9 + len(record) * dims.N * dims.K * 4 / 1e9,
            "seconds": time.perf_counter() - t0,
        }
    print(json.dumps(res, indent=1))


def _state(dims, rng, TrainerState, step):
    return TrainerState(
        step=int(step),
        theta=rng.standard_normal(dims.P).astype(np.float32),
        slots=np.zeros((dims.n_slots, dims.P), np.float32),
        rng=np.zeros(dims.rng_bytes, np.uint8),
    )


if __name__ == "__main__":
    main()
