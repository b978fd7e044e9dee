"""``k: all`` on the quadrature route at gang scale: one recorded step, every process's memory by phase.

    python benchmarks/kall_scale.py block_rows [--n 60000] [--workers 4]    # MNIST stand-in, 784 inputs
    python benchmarks/kall_scale.py matrix_free [--n 200000] [--workers 2]  # the paper's 6x256 net, image2d
        [--top 100] [--lanczos-steps 60] [--probes 24] [--block-size 16] [--until quadrature]

``block_rows``: the first run of ``examples/mnist_full.yaml`` (784-256-1 Leaky-ReLU MLP, structured
NTK, float32 G) on the full-size MNIST stand-in files (written under bench-out/data by
``benchmarks/full_size.py``'s helper unless there), G_t as ``block_rows`` tiles on a RayGang of
``--workers`` SpectralShard actors.  ``matrix_free``: the NSA paper's 6x256 net on the 2-D image
target (``benchmarks/layouts.py``'s spec), G_t never formed, products J (Jᵀ V) on the gang.
Both with ``spectrum.k: all, energy: quadrature`` (the top ``--top`` exactly, brackets beyond at the
log grid's k), no stored eigenvectors and no images, recording step t = 0 only.

Measured per process (this driver, which also trains, and each gang member): VmHWM at the end
and RSS sampled every ``--sample`` seconds, attributed to the phase running then — ``train``, the
analyzer's parts (``gram``: features/tiles, ``eigenpairs``: the exact top, ``quadrature``,
``metrics``) and ``setup`` (between them).  Also: :func:`~nsa_dist.pipeline.budget.check_fits`'s
per-worker estimate, the products with G by part, the load average, and the curves' brackets.
Results: bench-out/kall-scale-<layout>-<N>.json.

``--until eigenpairs`` stops after the exact top (the analyzer's quadrature and metrics not run);
``--until products`` builds G (features / tiles) and times ``--reps`` products of one
(N, ``--block-size``) block, the quadrature's unit of work: cheaper memory and cost runs at a size
whose whole step does not fit the time at hand.  ``--in-process``: no Ray; the members run in the
driver's process (the analyzer's LocalGang, as ``nsa run`` runs a gang layout), so its one RSS
holds every member's share.  ``--k K``: the top-K route instead of ``k: all`` (the step of
``benchmarks/layouts.py`` c, for comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
OUT = ROOT / "bench-out"

from _measure import peak_rss  # noqa: E402

from nsa_dist.pipeline.producers import StepCost  # noqa: E402

PHIS = ("y", "f", "residual", "df", "df_pred")


class _Phases:
    """The phase running now, by name, for the RSS sampler."""

    def __init__(self) -> None:
        self.now = "setup"
        self.spans: list[tuple[str, float, float]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before, t0 = self.now, time.perf_counter()
        self.now = name
        try:
            yield
        finally:
            self.now = before
            self.spans.append((name, t0, time.perf_counter()))


class _PhasedCost(StepCost):
    """The analyzer's cost record, also telling the sampler which part runs (the timings are unchanged)."""

    phases: _Phases = None  # set after construction

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        with self.phases.phase(part), super().timed(part):
            yield


_KEYS = ("VmRSS", "RssAnon", "RssShmem")  # resident: all, private (heap), shared memory (Ray's object store)


def _rss(pid: int) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return {k: int(v.split()[0]) * 1024 for k, v in (ln.split(":", 1) for ln in fh) if k in _KEYS}
    except OSError:
        return {}


class _Sampler(threading.Thread):
    """Every ``dt`` s: each named process's RSS (all, anonymous, shared memory), kept as the maximum
    per (process, phase) — ``peak``, ``anon`` and ``shmem``.  A Ray process's RSS counts the pages of
    the object store (shared memory) it has mapped, which a process's private memory does not."""

    def __init__(self, phases: _Phases, dt: float) -> None:
        super().__init__(daemon=True)
        self.phases, self.dt, self.pids = phases, dt, {"driver": os.getpid()}
        self.peak: dict[str, dict[str, int]] = {}
        self.anon: dict[str, dict[str, int]] = {}
        self.shmem: dict[str, dict[str, int]] = {}
        self.load: dict[str, float] = {}
        self.partial: Path | None = None  # where the peaks so far are written every 30 s (bytes)
        self._halt = threading.Event()

    def run(self) -> None:
        last = time.monotonic()
        while not self._halt.is_set():
            ph = self.phases.now
            if self.partial is not None and time.monotonic() - last > 30:  # a run cut short keeps what it saw
                last = time.monotonic()
                self.partial.write_text(
                    json.dumps({"phase_now": ph, "peak_GB": self.peak, "load": self.load}, indent=1)
                )
            for name, pid in list(self.pids.items()):
                r = _rss(pid)
                for key, table in (("VmRSS", self.peak), ("RssAnon", self.anon), ("RssShmem", self.shmem)):
                    d = table.setdefault(name, {})
                    d[ph] = max(d.get(ph, 0), r.get(key, 0))
            self.load[ph] = max(self.load.get(ph, 0.0), os.getloadavg()[0])
            self._halt.wait(self.dt)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def _spec(layout: str, a: argparse.Namespace) -> dict:
    q = {"top": a.top, "lanczos_steps": a.lanczos_steps, "probes": a.probes, "block_size": a.block_size}
    if layout == "block_rows":
        from full_size import _data_dir

        from nsa_dist.specfile import load_sweep

        spec = load_sweep(ROOT / "examples" / "mnist_full.yaml").expand()[0].model_dump(mode="json")
        spec["data"].update(path=str(_data_dir("mnist")), n=a.n)
    else:
        spec = {
            "name": f"kall{a.n}",
            "data": {"name": "image2d", "n": a.n},
            "model": {"depth": 6, "width": 256},
        }
    spec.update(steps=1, record={"steps": [0]})
    route = {"k": "all", "energy": "quadrature", "quadrature": q} if a.k is None else {"k": a.k}
    spec.setdefault("spectrum", {}).update(
        **route,
        dtype="float32",
        layout=layout,
        workers=a.workers,
        images=[],
        store_eigenvectors=False,
        frobenius_probes=16,
    )
    return spec


def _curves(out: dict, ks: np.ndarray, top: int) -> dict:
    lo, hi = np.asarray(out["curve_eigenvalue_lower"]), np.asarray(out["curve_eigenvalue_upper"])
    res: dict = {
        "k_reported": int(ks.size),
        "k_min": int(ks.min()),
        "k_max": int(ks.max()),
        "k_beyond_top": int((ks > top).sum()),
        "lambda_bracket_finite": bool(np.isfinite(lo).all() and np.isfinite(hi).all()),
        "lambda_1": float(np.asarray(out["curve_eigenvalue"])[0]),
        "lambda_at": {
            int(k): [float(lo[i]), float(np.asarray(out["curve_eigenvalue"])[i]), float(hi[i])]
            for i, k in enumerate(ks)
            if i in {0, int(np.searchsorted(ks, top)), ks.size // 2, ks.size - 1}
        },
    }
    for p in PHIS:
        lo, hi = np.asarray(out[f"curve_energy_{p}_lower"]), np.asarray(out[f"curve_energy_{p}_upper"])
        w = hi - lo
        if not np.isfinite(w).all():
            res[f"E_{p}"] = "not finite"
            continue
        i = int(np.argmax(w))
        res[f"E_{p}"] = {
            "largest_width": float(w.max()),
            "at_k": int(ks[i]),
            "median_width_beyond_top": float(np.median(w[ks > top])) if (ks > top).any() else 0.0,
            "E_at_top": float(np.asarray(out[f"curve_energy_{p}"])[min(int(np.searchsorted(ks, top)), ks.size - 1)]),
        }
    return res


def run(layout: str, a: argparse.Namespace) -> dict:
    import ray
    import torch

    from nsa_dist.cluster import connect
    from nsa_dist.cluster.gang import RayGang
    from nsa_dist.config import ExperimentSpec
    from nsa_dist.data import load_dataset
    from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run
    from nsa_dist.pipeline.budget import check_fits
    from nsa_dist.pipeline.layout import layout_budget

    torch.set_num_threads(a.threads)
    spec = ExperimentSpec.model_validate(_spec(layout, a))
    fp = check_fits(spec, gang_in_process=a.in_process)  # in process: the W members' parts in one
    phases = _Phases()
    sampler = _Sampler(phases, a.sample)
    sampler.partial = OUT / f"kall-scale-{layout}-{a.n}.partial.json"
    sampler.start()
    res: dict = {
        "layout": layout,
        "N": spec.data.n,
        "workers": a.workers,
        "model": spec.model.model_dump(mode="json"),
        "quadrature": spec.spectrum.quadrature.model_dump(mode="json"),
        "check_fits_per_worker_GB": fp.total / 1e9,
        "check_fits_parts_GB": {k: v / 1e9 for k, v in fp.parts.items()},
        "check_fits_layout": fp.layout.value,
        "layout_budget_GB": layout_budget(spec) / 1e9,
        "load_start": os.getloadavg(),
    }
    print(f"check_fits: {fp.layout.value}, ~{fp.total / 1e9:.2f} GB per worker ({fp.describe()})", flush=True)
    gang = None
    if not a.in_process:
        connect(num_cpus=a.workers + 1)
        gang = RayGang(a.workers, cpus=1, threads=1)
        for i, pid in enumerate(gang.member_pids):
            sampler.pids[f"member{i}"] = pid
    members = gang.members if gang is not None else None  # None: the analyzer's in-process LocalGang
    try:
        with phases.phase("load"):
            t0 = time.perf_counter()
            data = load_dataset(spec.data, seed=spec.seed)
            res["load_s"] = time.perf_counter() - t0
        plan = plan_run(spec, data)
        with phases.phase("train"):
            t0 = time.perf_counter()
            ck = next(iter(Trainer(plan, data).train_until(1)))
            res["train_s"] = time.perf_counter() - t0
        an = SpectralAnalyzer(plan, data)
        an.cost = _PhasedCost()
        an.cost.phases = phases
        res["layout_used"], res["ntk_method"] = an.plan.layout.layout.value, an.plan.ntk_method
        print(f"trained; analysing step {ck.step} as {res['layout_used']} (load {os.getloadavg()[0]:.2f})", flush=True)
        t0 = time.perf_counter()
        with phases.phase("analysis"):
            if a.until == "eigenpairs":
                _until_eigenpairs(an, ck, members)
                out = None
            elif a.until == "products":
                res["products"] = _products(an, ck, members, a.block_size, a.reps, sampler.pids)
                out = None
            else:
                out = an.analyze(ck, members).arrays()
        res["step_s"] = time.perf_counter() - t0
        res["parts_s"] = dict(an.timings)
        res["n_products"] = dict(an.cost.n_products)
        res["member_peak_GB"] = [p / 1e9 for p in gang.peak_rss()] if gang is not None else []
    finally:
        sampler.stop()
        if gang is not None:
            gang.shutdown()
            ray.shutdown()
    res["driver_peak_GB"] = peak_rss() / 1e9
    res["load_end"] = os.getloadavg()
    res["sampled_peak_GB_by_phase"] = {
        proc: {ph: v / 1e9 for ph, v in d.items()} for proc, d in sorted(sampler.peak.items())
    }
    for key, table in (("anon", sampler.anon), ("shmem", sampler.shmem)):
        res[f"sampled_{key}_GB_by_phase"] = {
            proc: {ph: v / 1e9 for ph, v in d.items()} for proc, d in sorted(table.items())
        }
    res["load_max_by_phase"] = sampler.load
    res["until"], res["in_process"] = a.until, a.in_process
    if out is not None and "curve_eigenvalue" in out:
        res["curves"] = _curves(out, plan.curve_k(), spec.spectrum.quadrature.top)
    budget = res["layout_budget_GB"]
    res["over_layout_budget"] = [
        name
        for name, peak in [("driver", res["driver_peak_GB"])]
        + [(f"member{i}", p) for i, p in enumerate(res["member_peak_GB"])]
        if peak > budget
    ]
    return res


def _until_eigenpairs(an, ck, gang) -> None:
    """The analysis' G and exact top only (what :meth:`SpectralAnalyzer.analyze` does first)."""
    import torch
    from torch.nn.utils import vector_to_parameters

    from nsa_dist.pipeline import producers as P
    from nsa_dist.pipeline.diagnostics import StepNotes

    p = next(an.model.parameters())
    vector_to_parameters(torch.as_tensor(ck.theta, dtype=p.dtype, device=an.device), an.model.parameters())
    an.cost.timings = {}
    with an.cost.timed("gram"):
        G = P.step_gram(an, "train", ck.theta, gang)
    try:
        P.step_context(an, ck, G, StepNotes(an.plan.run_id, ck.step))
    finally:
        G.close()


def _products(an, ck, gang, width: int, reps: int, pids: dict[str, int]) -> dict:
    """G's features (tiles) and ``reps`` products of an (N, ``width``) float64 block, timed one by one;
    after each, every process's resident memory (GB: all, anonymous, shared), to see it grow or not."""
    import torch
    from torch.nn.utils import vector_to_parameters

    from nsa_dist.pipeline import producers as P

    p = next(an.model.parameters())
    vector_to_parameters(torch.as_tensor(ck.theta, dtype=p.dtype, device=an.device), an.model.parameters())
    an.cost.timings = {}
    with an.cost.timed("gram"):
        G = P.step_gram(an, "train", ck.theta, gang)
    rng = np.random.default_rng(0)
    seconds, after = [], []
    try:
        with an.cost.timed("products"):
            for _ in range(reps):
                X = rng.standard_normal((G.shape[0], width))
                t0 = time.perf_counter()
                G.matmat(X)
                seconds.append(time.perf_counter() - t0)
                snap = {name: _rss(pid) for name, pid in pids.items()}
                after.append({name: [round(r.get(k, 0) / 1e9, 3) for k in _KEYS] for name, r in snap.items()})
    finally:
        G.close()
    return {
        "width": width,
        "seconds": seconds,
        "per_column_s": float(np.median(seconds)) / width,
        "rss_after_each_GB [VmRSS, RssAnon, RssShmem]": after,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("layout", choices=("block_rows", "matrix_free"))
    ap.add_argument("--n", type=int)
    ap.add_argument("--workers", type=int)
    ap.add_argument("--k", type=int, help="the top-k route instead of k: all (layouts.py's step, for comparison)")
    ap.add_argument("--top", type=int, default=100, help="quadrature.top: exact top eigenpairs")
    ap.add_argument("--lanczos-steps", type=int, default=60)
    ap.add_argument("--probes", type=int, default=24)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the driver (trainer + analyzer)")
    ap.add_argument("--sample", type=float, default=0.5, help="seconds between RSS samples")
    ap.add_argument("--until", choices=("all", "eigenpairs", "products"), default="all")
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="no Ray: the gang's members run in this process (the analyzer's LocalGang, as `nsa run` has them)",
    )
    ap.add_argument("--reps", type=int, default=3, help="--until products: products of one (N, block-size) block")
    a = ap.parse_args()
    a.n = a.n or (60_000 if a.layout == "block_rows" else 200_000)
    a.workers = a.workers or (4 if a.layout == "block_rows" else 2)
    OUT.mkdir(exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = run(a.layout, a)
    text = json.dumps(res, indent=1, default=float)
    suffix = f"-k{a.k}" if a.k else ""
    suffix += ("" if a.until == "all" else f"-{a.until}") + ("-in-process" if a.in_process else "")
    (OUT / f"kall-scale-{a.layout}-{a.n}{suffix}.json").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
