"""Issue 22 item 4: one recorded `k: all` step of examples/nsa_paper.yaml (N = 10⁴, float32, test points,
no stored eigenvectors) by several routes in one process, ``SpectralAnalyzer.timings`` of each:

- ``off``: ``route="eigenpairs"`` (two float64 eighs with vectors);
- ``q``: ``route="tridiagonal", solver="lapack"``: both halves with Q formed (MKL ``?syrdb``) and
  SciPy's ``dstevd`` on T (main before the one-vector route);
- ``on``: the defaults (``"auto"``) — the test half's one φ without Q (``eig_weights``), MKL ``dstedc``.

(the routes are :class:`~nsa_dist.pipeline.SpectralAnalyzer`'s ``route`` and ``solver`` arguments,
passed to :func:`nsa_dist.linalg.step_spectrum`.)

    python benchmarks/kall_step.py [--n 10000] [--order q,on]

The run records steps 0 and 1 (the spec's schedule otherwise): step 1 needs no eigenvectors
(App. E's prediction is at index 0 only), so it is the step the paper repeats 119 times.  Prints
each part's seconds, the load average, and the largest differences of the stored arrays.
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
from nsa_dist.linalg._mkl_stedc import first_row_ready, stedc_ready
from nsa_dist.linalg._mkl_syrdb import first_column_ready, syrdb_ready
from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--order", default="q,on")
    a = ap.parse_args()
    raw = yaml.safe_load((Path(__file__).parents[1] / "examples" / "nsa_paper.yaml").read_text())
    raw["data"].update(n=a.n, n_test=a.n)
    raw.update(steps=2, record={"steps": [0, 1]})
    raw["spectrum"]["store_eigenvectors"] = False
    spec = ExperimentSpec.model_validate(raw)
    data = load_dataset(spec.data, seed=spec.seed)
    plan = plan_run(spec, data)
    ck = list(Trainer(plan, data).train_until(2))[-1]
    print(f"N = {a.n}, step {ck.step} (index {ck.index}), k: {spec.spectrum.k}, {spec.spectrum.dtype}")
    t0 = time.perf_counter()  # the MKL routines' probes run once per process, not per step: out of the timing
    ready = [
        syrdb_ready(np.dtype(np.float32)),
        first_column_ready(np.dtype(np.float32)),
        stedc_ready(),
        first_row_ready(),
    ]
    print(f"probes (once per process): {time.perf_counter() - t0:.1f} s, passed {ready}", flush=True)
    out = {}
    routes = {  # the analyzer's spectrum route and T's divide and conquer (linalg.step_spectrum)
        "off": {"route": "eigenpairs"},
        "q": {"route": "tridiagonal", "solver": "lapack"},
        "on": {"route": "auto", "solver": "auto"},
    }
    for which in a.order.split(","):
        an = SpectralAnalyzer(plan, data, **routes[which])
        l0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        out[which] = an.analyze(ck).arrays()
        total = time.perf_counter() - t0
        parts = " + ".join(f"{k} {v:.1f}" for k, v in an.timings.items())
        print(
            f"route {which}: {total:.1f} s = {parts} (load {l0:.2f} -> {os.getloadavg()[0]:.2f}), "
            f"routes {an.eig_route}",
            flush=True,
        )
        del an
    names = list(out)
    for other in names[:-1]:
        on, off = out[names[-1]], out[other]
        print(f"  {names[-1]} vs {other}:")
        for key in sorted(set(on) & set(off) - {"loss", "lr"}):
            x, y = np.asarray(on[key], np.float64), np.asarray(off[key], np.float64)
            if x.size and x.shape == y.shape:
                scale = max(float(np.nanmax(np.abs(y))), 1e-300)
                print(f"    {key}: max |Δ| / max |value| = {float(np.nanmax(np.abs(x - y))) / scale:.1e}")


if __name__ == "__main__":
    main()
