"""Loss-Hessian top eigenvalues and traces: cost in Hessian-vector products and seconds, and error.

    python benchmarks/hessian.py [--n 1000] [--probes 30] [--dtype float64]

The NSA paper's 6×256 Leaky-ReLU net (``ModelSpec(depth=6, width=256)``, Xavier init, d = 2,
scalar output, |θ| = 264,193) on N points of the image2d target, MSE loss, at initialisation.
Exact values where affordable, all from the NTK Gram G (N×N) in this same process:

* ``Tr(I) = Tr(G)/N``, ``Tr(I²) = ‖G‖_F²/N²``, ``λ_max(I) = λ_max(G)/N`` (I and G/N share
  their nonzero spectrum);
* ``Tr(H) = Tr(I)`` exactly, because ``Tr(S) = 0`` for a piecewise-linear net under MSE;
* ``λ_max(H)``: no exact value — a short Lanczos run (k = 1, tol 1e-6) is compared with a
  long one (k = 6, tol 1e-10).

Prints one line per estimate: value, reference, relative error, products, seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nsa_dist.config import ModelSpec  # noqa: E402
from nsa_dist.data import image2d  # noqa: E402
from nsa_dist.hessian import (  # noqa: E402
    edge_of_stability,
    extreme_eigenpairs,
    hessian_parts,
    hutchinson_moments,
    hutchpp_moments,
)
from nsa_dist.models import build_model  # noqa: E402
from nsa_dist.ntk import gram  # noqa: E402

LR = 0.25  # the NSA paper's step δ


def _row(name: str, value: float, ref: float | None, products: int, seconds: float, extra: str = "") -> None:
    err = "" if ref is None else f"{abs(value - ref) / abs(ref):9.2e}"
    ref_s = "" if ref is None else f"{ref:13.6g}"
    print(f"{name:34s} {value:13.6g} {ref_s:>13s} {err:>9s} {products:7d} {seconds:8.1f}  {extra}")


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--probes", type=int, default=30)
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_grad_enabled(True)

    data = image2d(args.n, seed=0)
    X, Y = torch.from_numpy(data.X).to(dtype), torch.from_numpy(data.y).to(dtype)
    model = build_model(ModelSpec(depth=6, width=256, activation="leaky_relu"), seed=0, dtype=dtype)
    H, I, S = hessian_parts(model, X, Y, loss="mse")
    P, N = H.shape[0], args.n
    print(f"# 6x256 leaky_relu, P = {P:,}, N = {N}, {args.dtype}, torch threads = {torch.get_num_threads()}")
    print("# (Lanczos/Hutchinson on HVPs; 'gradients' = seconds of one full-batch loss gradient, same process)")

    def loss_grad() -> None:
        model.zero_grad()
        (0.5 * ((model(X) - Y) ** 2).mean()).backward()

    loss_grad()
    _, t_grad = _timed(loss_grad)  # the baseline: one full-batch gradient
    V = torch.randn(P, 16, dtype=dtype)
    for op in (H, I, S):
        _, t = _timed(lambda op=op: op.matmat(V))
        print(f"# {type(op).__name__:20s} {t / 16:.3f} s per column (block of 16) = {t / 16 / t_grad:.1f} gradients")

    G, t_gram = _timed(lambda: gram(model, X, dtype=torch.float64).numpy())  # (N, N)
    mu = np.linalg.eigvalsh(G)[::-1] / N  # nonzero spectrum of I
    tr_I, tr_I2, lam_I = float(np.trace(G)) / N, float(np.sum(G**2)) / N**2, float(mu[0])
    print(f"# exact from the NTK Gram: {t_gram:.1f} s (gram + eigvalsh)\n")
    print(f"{'estimate':34s} {'value':>13s} {'reference':>13s} {'rel.err':>9s} {'HVPs':>7s} {'seconds':>8s}")

    e, t = _timed(lambda: extreme_eigenpairs(I, 1, method="lanczos", tol=1e-6))
    _row("lambda_max(I) Lanczos k=1 tol 1e-6", float(e.evals[0]), lam_I, e.n_matvec, t)
    e, t = _timed(lambda: extreme_eigenpairs(I, 4, method="lanczos", tol=1e-10))
    _row("lambda_max(I) Lanczos k=4 tol 1e-10", float(e.evals[0]), lam_I, e.n_matvec, t)

    short, t_s = _timed(lambda: extreme_eigenpairs(H, 1, method="lanczos", tol=1e-6))
    long, t_l = _timed(lambda: extreme_eigenpairs(H, 6, method="lanczos", tol=1e-10))
    lam_H = float(long.evals[0])
    _row("lambda_max(H) Lanczos k=1 tol 1e-6", float(short.evals[0]), lam_H, short.n_matvec, t_s)
    _row(
        "lambda_max(H) Lanczos k=6 tol 1e-10",
        lam_H,
        None,
        long.n_matvec,
        t_l,
        f"(reference; top 6: {np.array2string(long.evals, precision=4)})",
    )
    print(
        f"{'':34s} lambda_max(H) / (2/delta) at delta = {LR}: {edge_of_stability(lam_H, LR):.4f}; "
        f"lambda_max(I) = {lam_I:.6g}"
    )

    for name, fn in (("Hutchinson", hutchinson_moments), ("Hutch++", hutchpp_moments)):
        m, t = _timed(lambda fn=fn: fn(I, args.probes, max_order=2, seed=1))
        _row(f"Tr(I) {name} m={args.probes}", m.trace(1), tr_I, m.n_products, t, f"± {m.stderr[0]:.3g}")
        _row(f"Tr(I^2) {name} m={args.probes}", m.trace(2), tr_I2, m.n_products, t, f"± {m.stderr[1]:.3g} (same run)")
    for name, fn in (("Hutchinson", hutchinson_moments), ("Hutch++", hutchpp_moments)):
        m, t = _timed(lambda fn=fn: fn(H, args.probes, max_order=1, seed=2))
        _row(
            f"Tr(H) {name} m={args.probes}",
            m.trace(1),
            tr_I,
            m.n_products,
            t,
            f"± {m.stderr[0]:.3g} (ref: Tr(I), as Tr(S) = 0)",
        )


if __name__ == "__main__":
    main()
