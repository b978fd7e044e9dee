"""``make demo``: the quickstart experiment end to end on the embedded default.

Runs ``examples/quickstart.yaml`` (the NSA paper's 6×256 Leaky-ReLU net and GD schedule,
scaled to N = 1000 points of the 2-D image target) into ``./nsa-results.zarr``, writes the
paper's figures to ``demo-out/``, and prints — as measured, whatever they turn out to be —
E_t(y, k) at the first and last recorded steps for k = 1, 5, 10, 20, 50 and the kernel–target
alignment.  Re-running resumes / skips finished work.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

KS = (1, 5, 10, 20, 50)


def summary(run) -> str:
    """The demo's closing table: E_t(y, k) and the alignment at the first and last recorded step."""
    steps, E, A = run.steps, run.energy("y"), run.alignment["raw"]
    rows = [f"{'':28s}{'t = ' + str(steps[0]):>14s}{'t = ' + str(steps[-1]):>14s}"]
    for k in KS:
        if k <= E.shape[1]:
            rows.append(f"{f'E_t(y, {k})':28s}{E[0, k - 1]:14.4f}{E[-1, k - 1]:14.4f}")
    rows.append(f"{'alignment yᵀGy/(‖G‖_F‖y‖²)':28s}{A[0]:14.4f}{A[-1]:14.4f}")
    rows.append(f"{'train loss':28s}{run.train_loss[0]:14.5f}{run.train_loss[-1]:14.5f}")
    rows.append(f"{'λ_max':28s}{run.eigenvalues[0, 0]:14.5g}{run.eigenvalues[-1, 0]:14.5g}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nsa_dist.demo", description=__doc__.splitlines()[0])
    p.add_argument("--spec", type=Path, default=Path("examples/quickstart.yaml"))
    p.add_argument("--store", default="nsa-results.zarr")
    p.add_argument("--out", type=Path, default=Path("demo-out"))
    args = p.parse_args(argv)
    from nsa_dist.cli import main as nsa
    from nsa_dist.client import Client
    from nsa_dist.pipeline import run_id
    from nsa_dist.specfile import load_spec

    rc = nsa(["run", str(args.spec), "--store", args.store])
    if rc not in (0, 1):
        return rc
    rid = run_id(load_spec(args.spec))
    run = Client(args.store).run(rid)
    if nsa(["plot", rid, "--store", args.store, "--out", str(args.out)]) != 0:
        return 2
    print(f"\nquickstart run {rid} ({run.status}); figures in {args.out}/\n")
    print(summary(run))
    return rc


if __name__ == "__main__":
    sys.exit(main())
