"""What the Hessian products' autograd conventions cost: one H·V product with and without them.

    python benchmarks/hessian_conventions.py [--width 256] [--depth 6] [--n 1000] [--columns 4] [--reps 7]

Every loss-Hessian product runs its forward under :func:`nsa_dist.hessian._operator.autograd_conventions`
(a ``TorchFunctionMode``: ``weight_norm`` by its composite formula, an embedding's padding row held
constant), which sees every torch call of the forward.  Here the same operator's ``matmat`` is timed
with it and with a ``contextlib.nullcontext`` in its place, alternating, in one process on one torch
thread (a plain leaky-ReLU MLP of the paper's kind, float64, d = 2, MSE: the conventions change
nothing in its numbers, which the script checks).  Prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nsa_dist.hessian._operator as operator_module  # noqa: E402
from nsa_dist.hessian import hessian_operator  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--columns", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(2, a.width), torch.nn.LeakyReLU()]
    for _ in range(a.depth - 2):
        layers += [torch.nn.Linear(a.width, a.width), torch.nn.LeakyReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(a.width, 1)).double()
    X, Y = torch.rand(a.n, 2, dtype=torch.float64), torch.rand(a.n, 1, dtype=torch.float64)
    H = hessian_operator(model, X, Y, part="H")
    V = torch.randn(H.shape[0], a.columns, dtype=torch.float64)
    conventions = operator_module.autograd_conventions
    times: dict[str, list[float]] = {"with": [], "without": []}
    out = {}
    try:
        for _ in range(a.reps):
            for name in times:
                operator_module.autograd_conventions = conventions if name == "with" else contextlib.nullcontext
                t0 = time.perf_counter()
                out[name] = H.matmat(V)
                times[name].append(time.perf_counter() - t0)
    finally:
        operator_module.autograd_conventions = conventions
    diff = float((out["with"] - out["without"]).abs().max() / out["without"].abs().max())
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"MLP {a.depth}x{a.width}, N = {a.n}, P = {H.shape[0]:,}, {a.columns} columns, {a.reps} alternating reps: "
        f"median {med['with']:.4f} s with the conventions, {med['without']:.4f} s without "
        f"(min {min(times['with']):.4f} / {min(times['without']):.4f}); ratio {med['with'] / med['without']:.3f}; "
        f"products differ by {diff:.1e}"
    )


if __name__ == "__main__":
    main()
