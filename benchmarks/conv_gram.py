"""NTK Gramian of a small CNN (issue 12 §4): the per-layer Conv2d + Linear path against baselines.

Run: ``python benchmarks/conv_gram.py [--n 2000] [--skip-jacobian] [--skip-nngeometry]``.

The CNN: conv 3→16 (3×3) → ReLU → avg-pool 2 → conv 16→32 (3×3) → ReLU → avg-pool 2 → Linear 2048→128
→ ReLU → Linear 128→1 (P = 267,713), inputs 3×32×32, float32.  Baselines, in this same process:
torch.func Jacobian contraction (``gram(method="jacobian")``) and nngeometry's ``GramMatrix``
(when installed: ``pip install --no-deps nngeometry==0.4`` or ``make bench``).  Printed: wall
time, peak resident memory above the level at entry, speedups, and the relative difference of G.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _measure import measured  # noqa: E402

from nsa_dist.models import cnn  # noqa: E402
from nsa_dist.ntk import gram  # noqa: E402


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return cnn(in_channels=3, image_size=32, channels=(16, 32), hidden=(128,), output_dim=1)


def images(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))  # (N, C, H, W)


def _nngeometry(model: torch.nn.Module, x: torch.Tensor, batch: int) -> torch.Tensor | None:
    try:
        from nngeometry import GramMatrix
    except ImportError:
        return None
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(x), batch_size=batch, shuffle=False)
    return GramMatrix(model, loader, function=lambda xb: model(xb)).data.reshape(x.shape[0], x.shape[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--batch", type=int, default=250, help="nngeometry's loader batch")
    p.add_argument("--skip-jacobian", action="store_true")
    p.add_argument("--skip-nngeometry", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    model, x = net(), images(args.n)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; CNN P = "
        f"{sum(q.numel() for q in model.parameters()):,}, N = {args.n}, float32"
    )
    gram(model, x[:64], method="per_layer")  # warm up
    res: dict = {"N": args.n}
    with measured() as ours:
        G = gram(model, x, method="per_layer")
    res["per_layer"] = {"s": ours["seconds"], "peak_GB": ours["peak_bytes"] / 1e9}
    print(f"per-layer (ours)      {ours['seconds']:8.2f} s  peak {ours['peak_bytes'] / 1e9:6.3f} GB")
    if not args.skip_jacobian:
        with measured() as jac:
            Gj = gram(model, x, method="jacobian")
        rel = float((G.double() - Gj.double()).norm() / Gj.double().norm())
        res["jacobian"] = {
            "s": jac["seconds"],
            "peak_GB": jac["peak_bytes"] / 1e9,
            "speedup": jac["seconds"] / ours["seconds"],
            "rel_diff": rel,
        }
        print(
            f"torch.func Jacobian   {jac['seconds']:8.2f} s  peak {jac['peak_bytes'] / 1e9:6.3f} GB  "
            f"→ per-layer is {jac['seconds'] / ours['seconds']:.1f}× faster; |ΔG|/|G| = {rel:.1e}"
        )
        del Gj
    if not args.skip_nngeometry:
        with measured() as ng:
            Gn = _nngeometry(model, x, args.batch)
        if Gn is None:
            print("nngeometry            skipped (pip install --no-deps nngeometry==0.4)")
        else:
            rel = float((G.double() - Gn.double()).norm() / Gn.double().norm())
            res["nngeometry"] = {
                "s": ng["seconds"],
                "peak_GB": ng["peak_bytes"] / 1e9,
                "speedup": ng["seconds"] / ours["seconds"],
                "rel_diff": rel,
            }
            print(
                f"nngeometry GramMatrix {ng['seconds']:8.2f} s  peak {ng['peak_bytes'] / 1e9:6.3f} GB  "
                f"→ per-layer is {ng['seconds'] / ours['seconds']:.1f}× faster; |ΔG|/|G| = {rel:.1e}"
            )
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
