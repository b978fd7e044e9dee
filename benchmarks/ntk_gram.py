"""NTK Gramian benchmarks (issue 2 §7).  Run: ``python benchmarks/ntk_gram.py [--parts abcd]``.

(a) structured vs torch.func Jacobian contraction, the paper's 6×256 Leaky-ReLU net, N=1000, float64.
(b) structured at N=10,000 float32: time / GEMM-bound time, and peak memory / (N²·4 bytes).
(c) top-100 eigenpairs of a real N=5000 NTK Gram: Lanczos vs full eigh (benchmarks/lanczos.py).
(d) side by side with nngeometry's GramMatrix at N=4000 and 10,000 float32 (needs nngeometry).
Every ratio is against a baseline run in this same process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _measure import measured  # noqa: E402

from nsa_dist.config import ModelSpec  # noqa: E402
from nsa_dist.models import build_model  # noqa: E402
from nsa_dist.ntk import gram  # noqa: E402


def paper_net(dtype: torch.dtype) -> torch.nn.Module:
    return build_model(ModelSpec(depth=6, width=256, activation="leaky_relu"), seed=0, dtype=dtype)


def inputs(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.rand(n, 2, generator=torch.Generator().manual_seed(1), dtype=dtype)


def _best_time(fn, repeats: int) -> float:
    """Minimum wall time over ``repeats`` warm calls (no heap trimming between them)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def part_a(n: int = 1000) -> dict:
    model, x = paper_net(torch.float64), inputs(n, torch.float64)
    structured = lambda: gram(model, x, method="structured")  # noqa: E731
    jacobian = lambda: gram(model, x, method="jacobian")  # noqa: E731
    structured()  # warm up (one-time BLAS buffers)
    t_s, t_j = _best_time(structured, 5), _best_time(jacobian, 2)
    with measured() as s:
        Gs = structured()
    with measured() as j:
        Gj = jacobian()
    rel = float((Gs - Gj).norm() / Gj.norm())
    return {
        "N": n,
        "structured_s": t_s,
        "jacobian_s": t_j,
        "speedup": t_j / t_s,
        "rel_diff": rel,
        "jacobian_peak_GB": j["peak_bytes"] / 1e9,
        "structured_peak_GB": s["peak_bytes"] / 1e9,
        "note": "times: min of 5 structured / 2 jacobian warm calls",
    }


def _mm_rate(m: int, k: int, n: int, reps: int = 3) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(m, n)
    torch.mm(a, b, out=out)
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b, out=out)
    return reps * 2.0 * m * k * n / (time.perf_counter() - t0)


def part_b(n: int = 10_000, repeats: int = 3) -> dict:
    model, x = paper_net(torch.float32), inputs(n, torch.float32)
    flops = sum(2.0 * n * n * (lay.in_features + lay.out_features) for lay in model.layers)
    rate_sq = max(_mm_rate(4096, 4096, 4096) for _ in range(3))
    rate_nn = max(_mm_rate(n, 256, n, reps=2) for _ in range(3))  # the shape of a hidden layer's full A·Aᵀ
    gram(model, x[:3000])  # warm up: MKL/OpenMP allocate their one-time GEMM buffers on first use
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        G = gram(model, x)
        times.append(time.perf_counter() - t0)
        del G
    with measured() as m:
        G = gram(model, x)
    assert G.shape == (n, n)
    out_bytes = n * n * 4
    s = {"seconds": min(times), "peak_bytes": m["peak_bytes"]}
    return {
        "N": n,
        "seconds": s["seconds"],
        "all_seconds": times,
        "gflop_full_products": flops / 1e9,
        "mm_rate_4096_gflops": rate_sq / 1e9,
        "mm_rate_Nx256xN_gflops": rate_nn / 1e9,
        "ratio_vs_4096_rate": s["seconds"] / (flops / rate_sq),
        "ratio_vs_Nx256xN_rate": s["seconds"] / (flops / rate_nn),
        "peak_over_output": s["peak_bytes"] / out_bytes,
    }


def part_c(n: int = 5000, k: int = 100) -> dict:
    import lanczos  # benchmarks/lanczos.py

    G = gram(paper_net(torch.float64), inputs(n, torch.float64)).numpy()
    return lanczos.run(G, k=k)


def part_d(sizes: tuple[int, ...] = (4000, 10_000), batch: int = 1000) -> dict:
    try:
        from nngeometry import GramMatrix
    except ImportError:
        return {"skipped": "nngeometry not installed: pip install --no-deps nngeometry==0.4 (or make bench)"}
    from torch.utils.data import DataLoader, TensorDataset

    out = {}
    for n in sizes:
        model, x = paper_net(torch.float32), inputs(n, torch.float32)
        gram(model, x[:3000])  # warm up
        with measured() as ours:
            G = gram(model, x)
        loader = DataLoader(TensorDataset(x), batch_size=batch, shuffle=False)
        with measured() as theirs:
            Gn = GramMatrix(model, loader, function=lambda xb: model(xb)).data  # (K, N, K, N)
        Gn = Gn.reshape(n, n)
        out[n] = {
            "ours_s": ours["seconds"],
            "nngeometry_s": theirs["seconds"],
            "speedup": theirs["seconds"] / ours["seconds"],
            "ours_peak_GB": ours["peak_bytes"] / 1e9,
            "nngeometry_peak_GB": theirs["peak_bytes"] / 1e9,
            "rel_diff": float((G - Gn).norm() / Gn.norm()),
        }
        del G, Gn
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="abcd")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = {}
    for part in args.parts:
        fn = {"a": part_a, "b": part_b, "c": part_c, "d": part_d}[part]
        results[part] = fn()
        print(f"({part})", json.dumps(results[part], indent=1, default=float))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    main()
