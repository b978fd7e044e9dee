"""NTK Gramians of the models people bring (issue 17): a torchvision-style ResNet and a token Transformer.

Run: ``python benchmarks/ntk_models.py [--parts ab] [--n-resnet 2000] [--n-small 500] [--n-transformer 1000]
[--batch 250 500] [--jacobian-cached] [--skip-jacobian] [--skip-nngeometry] [--one-group] [--threads T]
[--repeat R] [--json FILE]``.

(a) ResNet-20-style network on 3×32×32 inputs, float32: stem conv 3→16 + BatchNorm + ReLU, three
    stages of 3 BasicBlocks (16 / 32 / 64 channels; stride-2 downsampling by a 1×1 conv + BatchNorm
    shortcut), global average pool, Linear 64→1 (P = 271,889).  BasicBlocks as torchvision writes
    them: BatchNorm in eval mode with non-trivial running statistics, ``ReLU(inplace=True)``,
    ``out += identity``.  ``gram(model, X)`` (default method; the routes are printed from
    ``explain_method``) against, in this same process, ``gram(method="jacobian")`` (torch.func
    per-sample Jacobians contracted block by block) and nngeometry 0.4's ``GramMatrix`` at each
    loader batch of ``--batch`` (``pip install --no-deps nngeometry==0.4``, as ``make bench``
    does).  ``--jacobian-cached`` adds the jacobian method with its 2 GiB Jacobian-cache limit
    lifted (J = 2.03 GiB at N = 2000 is just above it, so the method as shipped recomputes the
    column blocks' Jacobians for every row block); ``--one-group`` adds the default method with
    the same limit lifted (its feature matrix M in one group, one pass).  ``--n-small`` also runs default vs jacobian
    at a smaller N (``0`` skips it).
(b) Token Transformer classifier: Embedding(100, 64), 2 ``TransformerEncoderLayer`` (4 heads,
    feed-forward 128, batch_first, dropout 0, eval mode), mean pool over 16 tokens, Linear 64→3;
    the traced kernel (Σ_a ∇f_a·∇f_a), int64 token ids, float32: default vs ``method="jacobian"``.

Printed per method: wall time (the minimum of ``--repeat`` calls), peak resident memory above the level at
entry, entries of G per
second (N² / time), its time over the default method's, the relative Frobenius difference of G
against the default method's, and the 1-minute load average of the machine before the call.  Exactness once
more in float64
at N = 64: default vs jacobian.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _measure import measured  # noqa: E402

from nsa_dist.ntk import (  # noqa: E402
    explain_method,
    gram,
    inputs,  # noqa: E402  (the feature memory rule, for the --jacobian-cached variant)
)

# torch.func has no vmap rule for CPU flash attention and falls back to a loop (both methods' Jacobians).
warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: BatchNorm, ReLU(inplace=True), ``out += identity``; a 1×1 conv +
    BatchNorm shortcut where the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """ResNet-(6·blocks+2) for 32×32 images (He et al. 2016, §4.2) with projection shortcuts."""

    def __init__(self, blocks: int = 3, widths: tuple[int, ...] = (16, 32, 64), outputs: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        layers, c = [], widths[0]
        for s, w in enumerate(widths):
            for b in range(blocks):
                layers.append(BasicBlock(c, w, 2 if (b == 0 and s > 0) else 1))
                c = w
        self.layers = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(self.relu(self.bn1(self.conv1(x))))  # (n, 64, 8, 8)
        return self.fc(self.avgpool(h).flatten(1)).squeeze(-1)  # (n,)


def resnet() -> nn.Module:
    torch.manual_seed(0)
    m = ResNet()
    with torch.no_grad():  # non-trivial BatchNorm affine parameters and running statistics
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.3, 0.3)
                mod.running_mean.uniform_(-0.2, 0.2)
                mod.running_var.uniform_(0.5, 2.0)
    return m.eval()


def images(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))  # (N, C, H, W)


class TokenTransformer(nn.Module):
    """Embedding → TransformerEncoder layers → mean over tokens → Linear head."""

    def __init__(self, vocab: int = 100, d: int = 64, heads: int = 4, ff: int = 128, depth: int = 2, outputs: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.enc = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True) for _ in range(depth)
        )
        self.head = nn.Linear(d, outputs)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids (n, T) int64
        h = self.emb(ids)  # (n, T, d)
        for layer in self.enc:
            h = layer(h)
        return self.head(h.mean(1))  # (n, K)


def transformer() -> nn.Module:
    torch.manual_seed(0)
    return TokenTransformer().eval()


def tokens(n: int, vocab: int = 100, length: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(1))  # (N, T)


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def _rel(G: torch.Tensor, R: torch.Tensor) -> float:
    return float((G.double() - R.double()).norm() / R.double().norm())


def routes(model: nn.Module, x: torch.Tensor) -> dict:
    """The default method and, per path, the parameter count and the module kinds that took it."""
    method, r = explain_method(model, x)
    params = dict(model.named_parameters())
    kinds = {name: type(model.get_submodule(name.rpartition(".")[0])).__name__ for name in r}
    out: dict = {"method": method.value, "paths": {}}
    for name, (path, why) in r.items():
        d = out["paths"].setdefault(path, {"params": 0, "tensors": 0, "modules": set(), "reasons": set()})
        d["params"] += params[name].numel()
        d["tensors"] += 1
        d["modules"].add(kinds[name])
        if path == "jacobian":
            d["reasons"].add(why)
    for d in out["paths"].values():
        d["modules"], d["reasons"] = sorted(d["modules"]), sorted(d["reasons"])
    print(f"  default method: {out['method']}")
    for path, d in out["paths"].items():
        print(f"    {path:10s} {d['params']:>8,} parameters in {d['tensors']:>3} tensors  ({', '.join(d['modules'])})")
        if path == "jacobian":
            print(f"               why: {'; '.join(d['reasons'])}")
    return out


REPEAT = 1  # calls per method; the minimum time is reported (--repeat)
ONE_GROUP = False  # also the default method with its feature matrix in one group (--one-group)


def _run(
    label: str, fn, n: int, ref: torch.Tensor | None = None, base_s: float | None = None
) -> tuple[torch.Tensor, dict]:
    load = _load()
    times, peaks = [], []
    for _ in range(REPEAT):
        G = None
        with measured() as m:
            G = fn()
        times.append(m["seconds"])
        peaks.append(m["peak_bytes"])
    best = min(times)
    res = {
        "s": best,
        "s_all": times,
        "peak_GB": max(peaks) / 1e9,
        "entries_per_s": n * n / best,
        "load_before": load,
        "load_after": _load(),
    }
    line = (
        f"  {label:24s} {best:8.2f} s  peak {res['peak_GB']:6.3f} GB  "
        f"{res['entries_per_s']:10.3g} entries/s  load {load[0]:.1f}"
        + (f"  (min of {', '.join(f'{t:.2f}' for t in times)})" if REPEAT > 1 else "")
    )
    if ref is not None:
        res["rel_diff"] = _rel(G, ref)
        res["time_over_default"] = best / base_s
        line += f"  time / default's: {res['time_over_default']:.2f}; |ΔG|/|G| = {res['rel_diff']:.1e}"
    print(line, flush=True)
    return G, res


def _outputs(model: nn.Module, x: torch.Tensor) -> int:
    with torch.no_grad():
        out = model(x[:2])
    return 1 if out.ndim == 1 else out.shape[1]


def _nngeometry(model: nn.Module, x: torch.Tensor, batch: int) -> torch.Tensor:
    from nngeometry import GramMatrix
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(x), batch_size=batch, shuffle=False)
    n = x.shape[0]
    return GramMatrix(model, loader, function=lambda xb: model(xb)).data.reshape(n, n)  # K = 1


def _jacobian_cached(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``gram(method="jacobian")`` with its cache limit lifted: every block's Jacobian computed once."""
    old, inputs.FEATURE_BYTES = inputs.FEATURE_BYTES, float("inf")
    try:
        return gram(model, x, method="jacobian")
    finally:
        inputs.FEATURE_BYTES = old


def _one_group(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The default method with the feature memory rule lifted: M (N, K·P_formed) in one group."""
    old, inputs.FEATURE_BYTES = inputs.FEATURE_BYTES, float("inf")
    try:
        return gram(model, x)
    finally:
        inputs.FEATURE_BYTES = old


def exact64(model: nn.Module, x: torch.Tensor) -> float:
    """|G_default − G_jacobian| / |G_jacobian| in float64."""
    G = gram(model, x, dtype=torch.float64)
    R = gram(model, x, method="jacobian", dtype=torch.float64)
    return _rel(G, R)


def compare(
    model: nn.Module,
    x: torch.Tensor,
    skip_jacobian: bool,
    nng_batches: tuple[int, ...] = (),
    jacobian_cached: bool = False,
) -> dict:
    """Default gram vs jacobian (and nngeometry at each loader batch of nng_batches; the jacobian
    method with J held in memory when jacobian_cached and J exceeds its cache limit) at the points
    x, in this process."""
    n = x.shape[0]
    res: dict = {"N": n}
    G, res["default"] = _run("default (ours)", lambda: gram(model, x), n)
    base = res["default"]["s"]
    M_bytes = n * _outputs(model, x) * sum(p.numel() for p in model.parameters()) * 4
    if ONE_GROUP and M_bytes > inputs.FEATURE_BYTES:
        _, res["default_one_group"] = _run("default, M in one group", lambda: _one_group(model, x), n, G, base)
    if not skip_jacobian:
        J_bytes = n * _outputs(model, x) * sum(p.numel() for p in model.parameters()) * 4
        res["J_bytes"], res["J_cache_bytes"] = J_bytes, inputs.FEATURE_BYTES
        if J_bytes > inputs.FEATURE_BYTES:
            print(
                f"  (J = {J_bytes / 2**30:.3f} GiB > the feature memory rule's "
                f"{inputs.FEATURE_BYTES / 2**30:.0f} GiB: column blocks' Jacobians recomputed per row block)"
            )
        Gj, res["jacobian"] = _run("torch.func Jacobian", lambda: gram(model, x, method="jacobian"), n, G, base)
        del Gj
        if jacobian_cached and J_bytes > inputs.FEATURE_BYTES:
            Gj, res["jacobian_cached"] = _run("Jacobian, J cached", lambda: _jacobian_cached(model, x), n, G, base)
            del Gj
    for batch in nng_batches:
        key = f"nngeometry_batch{batch}"
        try:
            import nngeometry  # noqa: F401
        except ImportError:
            res[key] = "skipped: pip install --no-deps nngeometry==0.4 (or make bench)"
            print(f"  nngeometry {res[key]}")
            break
        try:
            _, res[key] = _run(f"nngeometry (batch {batch})", lambda: _nngeometry(model, x, batch), n, G, base)
        except Exception as e:  # report what nngeometry says, precisely
            res[key] = f"failed: {type(e).__name__}: {e}"
            print(f"  nngeometry {res[key]}")
    return res


def part_a(n: int, n_small: int, skip_jacobian: bool, nng_batches: tuple[int, ...], jacobian_cached: bool) -> dict:
    model = resnet()
    P = sum(p.numel() for p in model.parameters())
    print(f"(a) ResNet-20 (BasicBlocks, eval BatchNorm, ReLU(inplace=True), out += identity), P = {P:,}, float32")
    x = images(n)
    out: dict = {"P": P, "routes": routes(model, x)}
    out["exact_float64_N64"] = exact64(model, images(64))
    print(f"  float64, N = 64: |G_default − G_jacobian| / |G_jacobian| = {out['exact_float64_N64']:.1e}")
    gram(model, x[:64])  # warm up
    if n_small:
        print(f"  N = {n_small}:")
        out["small"] = compare(model, x[:n_small], skip_jacobian)
    print(f"  N = {n}:")
    out["full"] = compare(model, x, skip_jacobian, nng_batches, jacobian_cached)
    return out


def part_b(n: int, skip_jacobian: bool) -> dict:
    model = transformer()
    P = sum(p.numel() for p in model.parameters())
    print(
        f"(b) Token Transformer (Embedding, 2 TransformerEncoderLayer, mean pool, Linear → 3), P = {P:,}, "
        f"traced kernel, float32"
    )
    x = tokens(n)
    out: dict = {"P": P, "routes": routes(model, x)}
    out["exact_float64_N64"] = exact64(model, tokens(64))
    print(f"  float64, N = 64: |G_default − G_jacobian| / |G_jacobian| = {out['exact_float64_N64']:.1e}")
    gram(model, x[:64])  # warm up
    print(f"  N = {n}:")
    out["full"] = compare(model, x, skip_jacobian)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="ab")
    p.add_argument("--n-resnet", type=int, default=2000)
    p.add_argument("--n-small", type=int, default=500, help="(a) also at this N (0: skip)")
    p.add_argument("--n-transformer", type=int, default=1000)
    p.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[250, 500],
        help="nngeometry's loader batch sizes (its time and memory trade against each other)",
    )
    p.add_argument("--skip-jacobian", action="store_true")
    p.add_argument("--skip-nngeometry", action="store_true")
    p.add_argument(
        "--jacobian-cached",
        action="store_true",
        help="(a) also the jacobian method with J held in memory where it exceeds its cache limit",
    )
    p.add_argument(
        "--one-group",
        action="store_true",
        help="also the default method with the feature memory rule lifted (M in one group)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default torch's; 1 gives figures robust to other jobs on shared cores)",
    )
    p.add_argument("--repeat", type=int, default=1, help="calls per method (the minimum time is reported)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    global REPEAT, ONE_GROUP
    REPEAT, ONE_GROUP = max(1, args.repeat), args.one_group
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {_load()}")
    results: dict = {}
    if "a" in args.parts:
        results["a"] = part_a(
            args.n_resnet,
            args.n_small,
            args.skip_jacobian,
            () if args.skip_nngeometry else tuple(args.batch),
            args.jacobian_cached,
        )
    if "b" in args.parts:
        results["b"] = part_b(args.n_transformer, args.skip_jacobian)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    main()
