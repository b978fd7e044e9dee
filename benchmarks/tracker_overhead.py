"""The Tracker's cost to a training loop (issue 12 §4): record every 100 steps, analysis on workers.

Run: ``python benchmarks/tracker_overhead.py [--steps 1000] [--every 100] [--cluster local|none]``.

The same loop — minibatch SGD on a small CNN, 3×32×32 inputs, N analysed points — runs twice in
this process: without tracking (the baseline) and with a Tracker whose analyses run on a Ray
spectral-worker pool (``--cluster local``) or a background thread (``--cluster none``).  Printed:
the loop's wall time both ways, the overhead ratio, and the time spent inside the Tracker's calls
(``due``/``record``/``log``: the snapshot θ_t, f_t and the hand-over), which is what training waits
for when the workers have CPUs of their own.  On a machine whose cores the workers share with
the loop, the wall-time overhead also contains the analyses' competition for those cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nsa_dist import Tracker  # noqa: E402
from nsa_dist.models import cnn  # noqa: E402


def _setup(n: int):
    torch.manual_seed(0)
    model = cnn(in_channels=3, image_size=32, channels=(16, 32), hidden=(128,), output_dim=1)
    X = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    y = torch.randn(n, generator=torch.Generator().manual_seed(2))
    return model, X, y


def loop(model, X, y, steps: int, batch: int, tr: Tracker | None) -> tuple[float, float]:
    """(wall seconds of the loop, seconds inside the Tracker's calls)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(3)
    in_tracker = 0.0
    t0 = time.perf_counter()
    for t in range(steps):
        idx = torch.randint(0, X.shape[0], (batch,), generator=gen)
        opt.zero_grad()
        loss = ((model(X[idx]) - y[idx]) ** 2).mean()
        if tr is not None:
            s = time.perf_counter()
            if tr.due(t):
                tr.record(t, lr=0.01, loss=loss.item())
            in_tracker += time.perf_counter() - s
        loss.backward()
        opt.step()
    if tr is not None:
        s = time.perf_counter()
        tr.close()
        in_tracker += time.perf_counter() - s
    return time.perf_counter() - t0, in_tracker


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--n", type=int, default=256, help="points the spectra are measured at")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--k", type=int, default=50)
    p.add_argument("--cluster", default="local", help="local (an embedded Ray) | none (a background thread)")
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.steps} SGD steps, batch "
        f"{args.batch}, record every {args.every} at N = {args.n} (k = {args.k}), cluster = {args.cluster}"
    )
    model, X, y = _setup(args.n)
    loop(model, X, y, 20, args.batch, None)  # warm up
    model, X, y = _setup(args.n)
    base, _ = loop(model, X, y, args.steps, args.batch, None)
    model, X, y = _setup(args.n)
    with tempfile.TemporaryDirectory() as d:
        tr = Tracker(
            f"{d}/s.zarr",
            "bench",
            model,
            X,
            y,
            steps=args.steps,
            record={"every": args.every},
            spectrum={"k": args.k, "dtype": "float32"},
            cluster=None if args.cluster == "none" else args.cluster,
            workers=args.workers,
            max_inflight=2,
        )
        tracked, inside = loop(model, X, y, args.steps, args.batch, tr)
        n_rec = int(tr.writer.done().sum())
    print(f"loop without tracking  {base:8.2f} s")
    print(f"loop with the Tracker  {tracked:8.2f} s  ({n_rec} steps recorded; close() included)")
    print(f"  wall-time overhead   {100 * (tracked - base) / base:7.1f} %")
    print(
        f"  inside Tracker calls {inside:8.2f} s = {100 * inside / base:.1f} % of the untracked loop "
        f"(blocked on a full queue {tr.blocked}×)"
    )


if __name__ == "__main__":
    main()
