"""``nsa sweep`` on the embedded Ray, as a user runs it: the Ray it starts holds every actor the
coordinator will ask for — step gangs of distributed layouts included."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import yaml

from nsa_dist.client import Client
from nsa_dist.cluster.resources import resource_demand
from nsa_dist.config import ClusterSpec, SweepSpec
from nsa_dist.pipeline import run_id

BASE = {
    "name": "gangs",
    "data": {"n": 40, "n_test": 8},
    "model": {"depth": 2, "width": 8},
    "steps": 2,
    "record": {"every": 2},
    "spectrum": {"dtype": "float64", "k": 6},
}
VARIANTS = [
    {"spectrum.layout": "local"},
    {"spectrum.layout": "block_rows", "spectrum.workers": 2},
    {"spectrum.layout": "block_rows", "spectrum.workers": 3},
    {"spectrum.layout": "matrix_free", "spectrum.workers": 2},
]


def test_resource_demand_counts_gangs_and_every_trainer():
    cl = ClusterSpec(spectral_workers=3, worker_cpus=0.5, trainer_cpus=1.0, worker_resources={"big": 1.0})
    need = resource_demand(cl, False, gang_members=2 + 3, trainers=4)
    assert need["CPU"] == pytest.approx((3 + 5) * 0.5 + 4 * 1.0), need
    assert need["big"] == pytest.approx(8.0) and need["GPU"] == 0.0, need


@pytest.mark.slow
def test_nsa_sweep_runs_distributed_layout_variants_on_the_embedded_ray(tmp_path):
    """Variants local, block_rows ×2, block_rows ×3 and matrix_free ×2 with three 0.5-CPU workers:
    refused before ("needs 4.5, cluster has …"); now every run finishes, and the layouts agree."""
    sweep = {
        "name": "gangs",
        "base": {k: v for k, v in BASE.items() if k != "name"},
        "variants": VARIANTS,
        "cluster": {"spectral_workers": 3, "worker_cpus": 0.5, "trainer_cpus": 1.0},
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    store = str(tmp_path / "s.zarr")
    proc = subprocess.run(
        [sys.executable, "-m", "nsa_dist.cli", "sweep", str(path), "--store", store, "--plain"],
        capture_output=True,
        text=True,
        timeout=540,
    )  # 33 s in CI; 300 s ran out under load 9
    assert proc.returncode == 0, f"nsa sweep failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}\n{proc.stdout}"
    client = Client(store)
    evals = {}
    for spec in SweepSpec.model_validate(sweep).expand():
        run = client.run(run_id(spec))
        assert run.status == "done", f"{spec.spectrum.layout} ×{spec.spectrum.workers}: {run.status}"
        evals[(spec.spectrum.layout.value, spec.spectrum.workers)] = run.eigenvalues
    ref = next(ev for (layout, _), ev in evals.items() if layout == "local")
    for key, ev in evals.items():
        err = np.nanmax(np.abs(ev - ref)) / np.nanmax(np.abs(ref))
        assert err < 1e-8, f"layout {key}: eigenvalues differ from local by {err:.2e} (relative)"
