"""Bracket widths of the quadrature route of ``k: all`` against the exact curves, at several steps of training.

Three commands, sharing a cache directory so that the expensive parts run once:

``prepare``: trains the NSA paper's net (6×256 leaky ReLU, Xavier, the 2-D image task, GD at lr 0.25)
and at each ``--steps`` writes the step's checkpoint, its Gram (float32, as the pipeline's float32
route forms it; ``--gram-dtype float64``: as the default float64 route does), the exact spectrum
(float64 ``eigh`` of that G), the top ``--keep`` eigenvectors and the exact E(φ, k) of every φ (y,
f, residual, df, df_pred ∝ G·residual) at every k.

``widths``: calls :func:`nsa_dist.linalg.quadrature.spectral_curves` on a cached G with the given
knobs and prints, per φ, the largest E-bracket width (and its k), whether every exact value lies in
its bracket, and the wall time.

``floor``: what the exact route itself leaves undetermined at a step: E(φ, k) from a float32 ``eigh``
of the stored float32 G (the exact route with ``spectrum.dtype: float32``) against the float64
``eigh`` of ``prepare``, at every reported k, and the width the brackets' rounding model needs to
hold every value such a reduction may return (δ = 4·eps₃₂·‖G‖_F; eigenvectors of eigenvalues within
2δ of each other in any basis).

``routes``: one recorded step's time and peak memory (``_measure.measured``) of the pipeline's exact
and quadrature routes (``SpectralAnalyzer``, ``layout: local``) at each cached step.

    python benchmarks/kall_width.py prepare --n 10000 --steps 0,100,1000 --dir /tmp/kw
    python benchmarks/kall_width.py widths --dir /tmp/kw --step 100 [--top 100 --lanczos-steps 60 ...]
    python benchmarks/kall_width.py floor --dir /tmp/kw --step 100
    python benchmarks/kall_width.py routes --dir /tmp/kw
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _measure import measured  # noqa: E402

PHIS = ("y", "f", "residual", "df", "df_pred")


def _spec(n: int, steps: list[int], energy: str = "quadrature", **quad):
    from nsa_dist.config import ExperimentSpec

    return ExperimentSpec.model_validate(
        {
            "name": "width",
            "seed": 0,
            "data": {"name": "image2d", "n": n, "n_test": 16},
            "model": {"depth": 6, "width": 256, "activation": "leaky_relu", "init": "xavier"},
            "schedule": {"lr": 0.25},
            "steps": max(steps) + 1,
            "record": {"steps": steps},
            "spectrum": {
                "k": "all",
                "energy": energy,
                "layout": "local",
                "dtype": "float32",
                "store_eigenvectors": False,
                "images": [],
                "quadrature": {"curve_points": 100, **quad},
            },
        }
    )


def prepare(a: argparse.Namespace) -> None:
    import torch
    from torch.nn.utils import vector_to_parameters

    from nsa_dist.data import load_dataset
    from nsa_dist.models import build_model
    from nsa_dist.ntk import gram
    from nsa_dist.pipeline import Trainer, plan_run

    steps = [int(s) for s in a.steps.split(",")]
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    spec = _spec(a.n, steps)
    data = load_dataset(spec.data, seed=0)
    X = torch.as_tensor(np.asarray(data.X), dtype=torch.float32)
    y = np.asarray(data.y, np.float64).reshape(-1)
    t0 = time.perf_counter()
    for ck in Trainer(plan_run(spec, data), data).train_until(max(steps) + 1):
        if ck.step not in steps:
            continue
        print(f"step {ck.step}: loss {ck.loss:.4g}, trained {time.perf_counter() - t0:.0f} s", flush=True)
        model = build_model(spec.model, seed=0)
        vector_to_parameters(torch.as_tensor(ck.theta, dtype=torch.float32), model.parameters())
        G = gram(model, X, dtype=getattr(torch, a.gram_dtype))
        np.save(d / f"G_{ck.step}.npy", G.numpy())
        t = time.perf_counter()
        w, V = np.linalg.eigh(G.numpy().astype(np.float64))
        w, V = w[::-1].copy(), V[:, ::-1].copy()
        f = np.asarray(ck.f, np.float64).reshape(-1)
        r = f - y
        phis = {"y": y, "f": f, "residual": r, "df": np.asarray(ck.df, np.float64).reshape(-1)}
        phis["df_pred"] = G.double().numpy() @ r
        E = {n: np.cumsum((V.T @ p) ** 2) / np.sum(p**2) for n, p in phis.items()}
        np.savez(
            d / f"exact_{ck.step}.npz",
            w=w,
            V=V[:, : a.keep],
            eigh_seconds=time.perf_counter() - t,
            **{f"E_{n}": e for n, e in E.items()},
            **{f"phi_{n}": p for n, p in phis.items()},
        )
        with open(d / f"ck_{ck.step}.pkl", "wb") as fh:
            pickle.dump(ck, fh)
        print(f"  eigh {time.perf_counter() - t:.0f} s, λ_1 {w[0]:.4g}, λ_N {w[-1]:.3g}", flush=True)
        del G, V


def widths(a: argparse.Namespace) -> None:
    import torch

    from nsa_dist.linalg.quadrature import curve_ks, describe_width, spectral_curves

    d = Path(a.dir)
    G = torch.from_numpy(np.load(d / f"G_{a.step}.npy"))
    if a.dtype == "float64":
        G = G.double()
    z = np.load(d / f"exact_{a.step}.npz")
    w, V = z["w"], z["V"]
    N, K = G.shape[0], a.top
    phis = {n: z[f"phi_{n}"] for n in PHIS}
    ks = curve_ks(N, a.points)
    kw = {}
    if a.phi_steps is not None:
        kw["phi_steps"] = a.phi_steps
    if a.phi_width is not None:
        kw["phi_width"] = a.phi_width
    t = time.perf_counter()
    c = spectral_curves(
        G,
        w[:K],
        V[:, :K],
        phis,
        ks,
        lanczos_steps=a.lanczos_steps,
        probes=a.probes,
        block_size=a.block_size,
        seed=a.seed,
        **kw,
    )
    sec = time.perf_counter() - t
    lam = w[ks - 1]
    e = c.eigenvalue
    tol = 1e-9 * w[0]
    ok_l = ((lam >= e.lower - tol) & (lam <= e.upper + tol)).sum()
    print(
        f"N {N} step {a.step} {a.dtype} top {K} m {a.lanczos_steps} probes {a.probes} b {a.block_size} "
        f"{kw}: {sec:.1f} s, {c.n_products} products, load {os.getloadavg()[0]:.1f}; notes {c.notes}"
    )
    out = (lam < e.lower - tol) | (lam > e.upper + tol)
    print(
        f"  λ_k inside {ok_l}/{ks.size} (a statistical bracket, pointwise confidence 0.95)"
        + "".join(
            f"; k = {k}: {lo:.4g} ≤ {x:.4g} ≤ {hi:.4g}?"
            for k, lo, x, hi in zip(ks[out], e.lower[out], lam[out], e.upper[out], strict=True)
        )
    )
    for n in PHIS:
        b, x = c.energy[n], z[f"E_{n}"][ks - 1]
        wd = b.upper - b.lower
        ok = ((x >= b.lower - 1e-9) & (x <= b.upper + 1e-9)).sum()
        i = int(np.argmax(wd))
        print(
            f"  E({n:8s}) inside {ok}/{ks.size}; largest width {wd.max():.4f} at k = {ks[i]} "
            f"(E = {x[i]:.3f}); median beyond top {np.median(wd[ks > K]):.4f}; |value − exact| ≤ "
            f"{np.abs(b.value - x).max():.4f}",
            flush=True,
        )
        if wd.max() > 0.02:
            print(f"    {describe_width(n, c)}")


def floor(a: argparse.Namespace) -> None:
    import torch

    from nsa_dist.linalg.quadrature import curve_ks

    d = Path(a.dir)
    G = torch.from_numpy(np.load(d / f"G_{a.step}.npy"))
    z = np.load(d / f"exact_{a.step}.npz")
    w = z["w"]
    N = w.size
    ks = curve_ks(N, a.points)
    fro = float(torch.linalg.matrix_norm(G.double()))
    delta = 4.0 * float(np.finfo(np.float32).eps) * fro
    t = time.perf_counter()
    w32, V32 = torch.linalg.eigh(G)  # the exact route's float32 reduction
    sec = time.perf_counter() - t
    w32, V32 = w32.flip(0).double().numpy(), V32.flip(1)
    print(
        f"N {N} step {a.step}: float32 eigh {sec:.1f} s (load {os.getloadavg()[0]:.1f}); λ_1 {w[0]:.6g}; "
        f"δ = 4·eps₃₂·‖G‖_F = {delta:.3g}; #λ > δ (float64 eigh) {(w > delta).sum()}; "
        f"max |λ32 − λ64| {np.abs(w32 - w).max():.3g}"
    )
    desc = -w
    for n in PHIS:
        p = z[f"phi_{n}"]
        E32 = np.cumsum((V32.T @ torch.from_numpy(p.astype(np.float32))).double().numpy() ** 2) / np.sum(p**2)
        E64 = z[f"E_{n}"]
        diff = np.abs(E32 - E64)[ks - 1]
        i = int(np.argmax(diff))
        # the narrowest bracket holding every value of a reduction within δ, where eigenvectors of
        # eigenvalues within 2δ of λ_k may rotate into each other (the route's cluster model): E
        # between the energies before and after that cluster (exact where k ends it)
        lo_n = np.searchsorted(desc, -(w[ks - 1] + 2 * delta), side="left")  # #{λ_i > λ_k + 2δ}
        hi_n = np.searchsorted(desc, -(w[ks - 1] - 2 * delta), side="right")  # #{λ_i ≥ λ_k − 2δ}
        lo = np.where(ks < hi_n, np.where(lo_n > 0, E64[np.maximum(lo_n, 1) - 1], 0.0), E64[ks - 1])
        hi = E64[np.minimum(hi_n, N) - 1]
        wd = hi - lo
        j = int(np.argmax(wd))
        print(
            f"  E({n:8s}) float32 − float64 exact: largest {diff.max():.4f} at k = {ks[i]} (λ_k {w[ks[i] - 1]:.3g}); "
            f"model floor width: largest {wd.max():.4f} at k = {ks[j]} (E64 {E64[ks[j] - 1]:.3f})",
            flush=True,
        )


def limits(a: argparse.Namespace) -> None:
    """The narrowest E-brackets a λ_k bracket of a given absolute half-width allows, from the exact
    spectrum: the energy of φ over the eigenvalues within ±(Δ + δ) of λ_k, largest over the reported
    k beyond ``--top``.  δ = N·eps₆₄·λ_1 is the rounding the route's brackets allow the exact route
    (a float64 G); Δ = λ_{top+1}·(π/2m)² models what m Lanczos steps of the deflated G resolve at the
    spectrum's lower edge (a degree-m polynomial's resolution there) — a model, with no statistical
    margin and no loss at the quadrature nodes, so a lower bound of what the route can reach."""
    from nsa_dist.linalg.quadrature import curve_ks

    z = np.load(Path(a.dir) / f"exact_{a.step}.npz")
    w = z["w"]
    N, K = w.size, a.top
    ks = curve_ks(N, a.points)
    ks = ks[ks > K]
    desc = -w
    delta = N * float(np.finfo(np.float64).eps) * float(w[0])

    def widest(E: np.ndarray, half: float) -> tuple[float, int]:
        E0 = np.concatenate([[0.0], E])
        lo = np.searchsorted(desc, -(w[ks - 1] + half), side="left")  # #{λ_i > λ_k + half}
        hi = np.searchsorted(desc, -(w[ks - 1] - half), side="right")  # #{λ_i ≥ λ_k − half}
        wd = E0[hi] - E0[lo]
        j = int(np.argmax(wd))
        return float(wd[j]), int(ks[j])

    print(f"N {N} step {a.step} top {K}: λ_1 {w[0]:.4g}, λ_(top+1) {w[K]:.3g}, δ = N·eps₆₄·λ_1 = {delta:.3g}")
    for n in a.phis.split(","):
        E = z[f"E_{n}"]
        row = [f"perfect count {widest(E, delta)[0]:.3f}@{widest(E, delta)[1]}"]
        for m in (int(x) for x in a.steps.split(",")):
            res = float(w[K]) * (math.pi / (2 * m)) ** 2
            wd, k = widest(E, res + delta)
            row.append(f"m {m} (Δ {res:.1e}) {wd:.3f}@{k}")
        print(f"  E({n:8s}) narrowest largest width: " + "; ".join(row), flush=True)
    if a.drivers:  # how far two float64 LAPACK reductions of the stored G fall apart, against δ
        import scipy.linalg as sl

        G = np.load(Path(a.dir) / f"G_{a.step}.npy").astype(np.float64)
        for drv in a.drivers.split(","):
            t = time.perf_counter()
            w2, V2 = sl.eigh(G, driver=drv)
            w2, V2 = w2[::-1], V2[:, ::-1]
            parts = [f"eigh driver {drv} ({time.perf_counter() - t:.0f} s): max |λ − λ_evd| {np.abs(w2 - w).max():.3g}"]
            for n in a.phis.split(","):
                p = z[f"phi_{n}"]
                E2 = np.cumsum((V2.T @ p) ** 2) / np.sum(p**2)
                d = np.abs(E2 - z[f"E_{n}"])[ks - 1]
                parts.append(f"max |E({n}) − E_evd| {d.max():.2g} at k = {ks[int(np.argmax(d))]}")
            print("  " + "; ".join(parts), flush=True)


def routes(a: argparse.Namespace) -> None:
    from nsa_dist.data import load_dataset
    from nsa_dist.pipeline import SpectralAnalyzer, plan_run

    d = Path(a.dir)
    steps = sorted(int(p.stem.split("_")[1]) for p in d.glob("ck_*.pkl"))
    quad = {"top": a.top, "lanczos_steps": a.lanczos_steps, "probes": a.probes, "block_size": a.block_size}
    if a.phi_steps is not None:
        quad.update(phi_steps=a.phi_steps, phi_width=a.phi_width or 0.0)
    for s in steps:
        with open(d / f"ck_{s}.pkl", "rb") as fh:
            ck = pickle.load(fh)
        z = np.load(d / f"exact_{s}.npz")
        N = z["w"].size
        for route in a.which.split(","):
            spec = _spec(N, steps, route, **quad)
            data = load_dataset(spec.data, seed=0)
            an = SpectralAnalyzer(plan_run(spec, data), data)
            with measured() as m:
                out = an.analyze(ck).arrays()
            line = (
                f"step {s} {route:10s} {m['seconds']:7.1f} s  peak {m['peak_bytes'] / 1e9:5.2f} GB  load "
                f"{os.getloadavg()[0]:.1f}  parts " + ", ".join(f"{k} {v:.1f}" for k, v in an.timings.items())
            )
            if route == "quadrature":
                ks = an.plan.curve_k() if hasattr(an, "plan") else None
                ks = ks if ks is not None else plan_run(spec, data).curve_k()
                parts = []
                for n in PHIS:
                    x = z[f"E_{n}"][ks - 1]
                    lo, hi = out[f"curve_energy_{n}_lower"], out[f"curve_energy_{n}_upper"]
                    ok = ((x >= lo - 1e-6) & (x <= hi + 1e-6)).sum()
                    wd = hi - lo
                    parts.append(f"{n} {wd.max():.3f}@{ks[int(np.argmax(wd))]} ({ok}/{ks.size})")
                line += "\n    widths: " + "; ".join(parts)
            print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--steps", default="0,100,1000")
    p.add_argument("--keep", type=int, default=1000)
    p.add_argument("--gram-dtype", default="float32", help="float64: G formed as the default float64 route forms it")
    p.add_argument("--dir", required=True)
    for name in ("widths", "routes"):
        q = sub.add_parser(name)
        q.add_argument("--dir", required=True)
        q.add_argument("--top", type=int, default=100)
        q.add_argument("--lanczos-steps", type=int, default=60)
        q.add_argument("--probes", type=int, default=24)
        q.add_argument("--block-size", type=int, default=16)
        q.add_argument("--phi-steps", type=int, default=None)
        q.add_argument("--phi-width", type=float, default=None)
    w = sub.choices["widths"]
    w.add_argument("--step", type=int, required=True)
    w.add_argument("--dtype", default="float32")
    w.add_argument("--points", type=int, default=100)
    w.add_argument("--seed", type=int, default=0)
    sub.choices["routes"].add_argument("--which", default="exact,quadrature")
    f = sub.add_parser("floor")
    f.add_argument("--dir", required=True)
    f.add_argument("--step", type=int, required=True)
    f.add_argument("--points", type=int, default=100)
    lim = sub.add_parser("limits")
    lim.add_argument("--dir", required=True)
    lim.add_argument("--step", type=int, required=True)
    lim.add_argument("--top", type=int, default=1000)
    lim.add_argument("--points", type=int, default=100)
    lim.add_argument("--steps", default="120,240,480,960,1920", help="Lanczos steps m modelled")
    lim.add_argument("--phis", default="y,residual")
    lim.add_argument("--drivers", default="", help="e.g. evr,ev: also reduce G with these scipy eigh drivers")
    a = ap.parse_args()
    {"prepare": prepare, "widths": widths, "routes": routes, "floor": floor, "limits": limits}[a.cmd](a)


if __name__ == "__main__":
    main()
