"""``make demo``: the quickstart as a small depth × width sweep on the embedded default.

Runs ``examples/demo_sweep.yaml`` — the NSA paper's Leaky-ReLU net and GD schedule scaled to
N = 1000 points of the 2-D image target, at depths {2, 6} × widths {64, 256}, the 6×256 run
being ``examples/quickstart.yaml`` — on an embedded local Ray into ``./nsa-results.zarr``,
writes the paper's figures for the 6×256 run to ``demo-out/``, and prints — as measured,
whatever they turn out to be — its E_t(y, k) at the first and last recorded steps for
k = 1, 5, 10, 20, 50 and the kernel–target alignment, then the sweep's final E(y, 10) and loss
per depth and width.  Re-running skips finished work.
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


def sweep_table(runs) -> str:
    """Final E(y, 10), alignment and loss of every run of the sweep (NSA Fig. 7a–b in numbers)."""
    rows = [f"{'depth × width':16s}{'E(y, 10) last':>16s}{'alignment':>12s}{'loss last':>12s}"]
    for run in sorted(runs, key=lambda r: (r.spec.model.depth, r.spec.model.width)):
        if len(run.steps):
            rows.append(
                f"{f'{run.spec.model.depth} × {run.spec.model.width}':16s}"
                f"{run.energy('y', 10)[0]:16.4f}{run.alignment['raw'][-1]:12.4f}{run.train_loss[-1]:12.5f}"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nsa_dist.demo", description=__doc__.splitlines()[0])
    p.add_argument("--sweep", type=Path, default=Path("examples/demo_sweep.yaml"))
    p.add_argument("--store", default="nsa-results.zarr")
    p.add_argument("--out", type=Path, default=Path("demo-out"))
    args = p.parse_args(argv)
    from nsa_dist.cli import main as nsa
    from nsa_dist.client import Client
    from nsa_dist.pipeline import run_id
    from nsa_dist.specfile import load_sweep

    rc = nsa(["sweep", str(args.sweep), "--store", args.store])
    if rc not in (0, 1):
        return rc
    specs = load_sweep(args.sweep).expand()
    client = Client(args.store)
    runs = [client.run(run_id(s)) for s in specs]
    main_run = max(runs, key=lambda r: (r.spec.model.depth, r.spec.model.width))
    if nsa(["plot", main_run.id, "--store", args.store, "--out", str(args.out)]) != 0:
        return 2
    print(f"\nquickstart run {main_run.id} ({main_run.status}); figures in {args.out}/\n")
    print(summary(main_run))
    print(f"\nsweep {load_sweep(args.sweep).name}: the last recorded step of each run\n")
    print(sweep_table(runs))
    return rc


if __name__ == "__main__":
    sys.exit(main())
