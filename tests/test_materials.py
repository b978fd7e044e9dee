"""A run's materials are loaded once per process (nsa_dist/pipeline/materials.py).

Real runs on tiny specs count the calls of ``load_dataset`` and ``build_model`` (wrapped where the
loader calls them, their only call site in the pipeline) and the renderer's Delaunay builds: one
each per process per run for ``nsa run`` (local and block_rows on an in-process gang) and for a
spectral worker analysing 3 steps in a process of its own.  The roles' networks are copies
that share no parameters, and a process keeps at most MAX_RUNS runs' materials.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch.nn.utils import parameters_to_vector

import nsa_dist.pipeline.materials as materials_mod
from nsa_dist.cli import main as nsa
from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run, prepare_run, run_experiment, run_id
from nsa_dist.pipeline.materials import MAX_RUNS, RunMaterials
from nsa_dist.pipeline.services import TrainerService
from nsa_dist.store import SpectrumStore

REPO = Path(__file__).resolve().parents[1]
TINY = dict(
    name="mat",
    data={"name": "image2d", "n": 24, "n_test": 6},
    model={"depth": 3, "width": 8},
    steps=5,
    record={"every": 2},  # 3 recorded steps: 0, 2, 4
    spectrum={"k": 6, "test_points": True, "images": [1, 2], "image_size": 6, "fourier_size": 4},
)


@pytest.fixture
def calls(monkeypatch):
    """Counts of load_dataset, build_model and EigenImages (the Delaunay) made through the loader,
    with this process's kept materials dropped first."""
    n: Counter = Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            n[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    RunMaterials.forget()
    monkeypatch.setattr(materials_mod, "load_dataset", counted("load_dataset", materials_mod.load_dataset))
    monkeypatch.setattr(materials_mod, "build_model", counted("build_model", materials_mod.build_model))
    monkeypatch.setattr(materials_mod, "EigenImages", counted("renderer", materials_mod.EigenImages))
    yield n
    RunMaterials.forget()


@pytest.mark.parametrize("layout", ["local", "block_rows"])
def test_nsa_run_loads_the_data_and_builds_the_network_once(layout, calls, tmp_path, capsys):
    spec = {**TINY, "spectrum": {**TINY["spectrum"], "layout": layout, "workers": 2}}
    path, url = tmp_path / "run.yaml", str(tmp_path / "s.zarr")
    path.write_text(yaml.safe_dump(spec))
    assert nsa(["run", str(path), "--store", url, "--plain"]) == 0, capsys.readouterr().err
    run = Client(url).run(run_id(ExperimentSpec(**spec)))
    assert run.status == "done" and len(run.steps) == 3
    assert run.g.attrs["layout"] == layout, run.g.attrs["layout_reason"]
    assert calls == {"load_dataset": 1, "build_model": 1, "renderer": 1}, (
        f"layout {layout}: {dict(calls)} for one run in one process; expected one of each"
    )


_WORKER = """
import json, pickle, sys
from collections import Counter
import nsa_dist.pipeline.materials as m
from nsa_dist.pipeline.services import SpectralService

n = Counter()
for name in ("load_dataset", "build_model", "EigenImages"):
    real = getattr(m, name)
    setattr(m, name, lambda *a, _real=real, _name=name, **k: (n.update([_name]), _real(*a, **k))[1])
plan, cks, url = pickle.load(open(sys.argv[1], "rb"))
worker = SpectralService(url)
summaries = [worker.analyze_and_write(plan, ck) for ck in cks]
print(json.dumps({"calls": dict(n), "indices": [s["index"] for s in summaries]}))
"""


def test_a_spectral_worker_loads_once_for_three_steps(tmp_path):
    """A spectral worker in a process of its own (as a Ray actor is) analyses 3 recorded steps of a
    run: one load_dataset, one build_model, one renderer; the steps equal the single-process run's."""
    spec = ExperimentSpec(**TINY)
    url, ref = str(tmp_path / "s.zarr"), str(tmp_path / "ref.zarr")
    plan = prepare_run(spec, SpectrumStore(url)).plan
    trainer = TrainerService(plan, url)
    cks = [trainer.checkpoint(i) for i in range(3)]
    (tmp_path / "job.pkl").write_bytes(pickle.dumps((plan, cks, url)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _WORKER, str(tmp_path / "job.pkl")], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["indices"] == [0, 1, 2]
    assert got["calls"] == {"load_dataset": 1, "build_model": 1, "EigenImages": 1}, got["calls"]
    assert run_experiment(spec, SpectrumStore(ref)).status == "done"
    a, b = Client(url).run(plan.run_id), Client(ref).run(plan.run_id)
    for name in ("eigenvalues", "energy_y", "eigvec_images", "theta", "eigenvalues_test"):
        np.testing.assert_array_equal(a.g[name][:], b.g[name][:], err_msg=name)


def test_trainer_and_analyzer_networks_share_no_parameters(calls):
    """Both copy the run's one built network: equal at θ_0, no storage in common; training moves
    the trainer's only, analysing a step the analyzer's only."""
    spec = ExperimentSpec(**TINY)
    data = load_dataset(spec.data, seed=spec.seed)
    plan = plan_run(spec, data)
    trainer, analyzer = Trainer(plan, data), SpectralAnalyzer(plan, data)
    proto = RunMaterials.load(plan, data=data).prototype
    nets = {"prototype": proto, "trainer": trainer.model, "analyzer": analyzer.model}
    ptrs = {k: {p.data_ptr() for p in m.parameters()} for k, m in nets.items()}
    for x, y in (("trainer", "analyzer"), ("trainer", "prototype"), ("analyzer", "prototype")):
        assert not ptrs[x] & ptrs[y], f"the {x}'s and the {y}'s networks share parameter storage"
    theta0 = parameters_to_vector(proto.parameters()).detach().clone()
    for k, m in nets.items():
        assert torch.equal(parameters_to_vector(m.parameters()).detach(), theta0), f"{k} does not start at θ_0"
    cks = list(trainer.train_until(spec.steps))
    moved = parameters_to_vector(analyzer.model.parameters()).detach()
    assert torch.equal(moved, theta0), "training moved the analyzer's network"
    analyzer.analyze(cks[-1])
    assert torch.equal(parameters_to_vector(proto.parameters()).detach(), theta0), "the prototype moved"
    assert np.array_equal(parameters_to_vector(analyzer.model.parameters()).detach().numpy(), cks[-1].theta)
    assert calls == {"build_model": 1, "renderer": 1}, dict(calls)  # the data was the test's own


def test_a_process_keeps_at_most_max_runs(calls):
    """Runs beyond MAX_RUNS drop the least recently used; a role holding dropped materials keeps them,
    and the dropped run is loaded again when asked for."""
    specs = [ExperimentSpec(**{**TINY, "name": f"keep{i}"}) for i in range(MAX_RUNS + 1)]
    first = RunMaterials.load(specs[0])
    for spec in specs[1:]:
        RunMaterials.load(spec)
    kept = RunMaterials.kept()
    assert len(kept) == MAX_RUNS and first.run_id not in kept, kept
    assert first.data.n == 24 and first.prototype is not None  # still usable by whoever holds it
    assert calls["load_dataset"] == MAX_RUNS + 1
    again = RunMaterials.load(specs[0])
    assert again is not first and calls["load_dataset"] == MAX_RUNS + 2 and RunMaterials.kept()[-1] == first.run_id


def test_a_callers_network_is_used_as_given_and_not_kept(calls):
    """A Tracker's network and arrays: nothing is loaded or built, and the materials are not kept."""
    spec = ExperimentSpec(**TINY)
    data = load_dataset(spec.data, seed=spec.seed)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1), torch.nn.Flatten(0))
    m = RunMaterials.load(spec, data=data, model=net)
    assert m.prototype is net and m.data is data and m.given
    assert RunMaterials.kept() == [] and calls == {}, dict(calls)


def test_the_loader_is_the_pipelines_one_call_site_of_each():
    """The counts above see the calls the loader makes; no other module of the pipeline makes any."""
    import ast

    sites: dict[str, list[str]] = {"load_dataset": [], "build_model": []}
    for path in sorted((REPO / "nsa_dist" / "pipeline").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in sites:
                    sites[name].append(f"{path.name}:{node.lineno}")
    for name, where in sites.items():
        assert len(where) == 1 and where[0].startswith("materials.py:"), f"{name} called at {where}"


def test_services_in_turn_write_each_to_its_own_store(calls, tmp_path):
    """A SpectralService made after another was freed (Python reuses the id of a freed object)
    writes to its own store, not to the freed service's writer kept with the run."""
    from nsa_dist.pipeline.services import SpectralService

    spec = ExperimentSpec(**TINY)
    urls = [str(tmp_path / f"s{i}.zarr") for i in range(2)]
    plans = [prepare_run(spec, SpectrumStore(u)).plan for u in urls]
    cks = [TrainerService(plans[0], urls[0]).checkpoint(i) for i in range(2)]
    for url, plan, ck in zip(urls, plans, cks):
        svc = SpectralService(url)
        svc.analyze_and_write(plan, ck)
        del svc
    for i, url in enumerate(urls):
        got = np.flatnonzero(SpectrumStore(url).reader(plans[0].run_id).read("done"))
        assert list(got) == [i], f"{url}: recorded steps written {list(got)}, expected [{i}]"


def test_an_evicted_runs_analyzer_is_freed_without_the_cyclic_collector(calls, tmp_path):
    """A worker that serves more runs than it keeps lets go of the evicted run's analyzer (its
    N×N buffers, device inputs) at once — not only when the cyclic collector happens to run."""
    import gc
    import weakref

    from nsa_dist.pipeline.services import SpectralService

    url = str(tmp_path / "s.zarr")
    specs = [ExperimentSpec(**{**TINY, "name": f"r{i}", "seed": i}) for i in range(MAX_RUNS + 1)]
    plans = [prepare_run(s, SpectrumStore(url)).plan for s in specs]
    svc = SpectralService(url)
    gc.collect()
    gc.disable()
    try:
        analyzer, _ = svc._run(plans[0])
        alive = weakref.ref(analyzer)
        del analyzer, _
        for plan in plans[1:]:
            svc._run(plan)
        assert plans[0].run_id not in RunMaterials.kept()
        assert alive() is None, "the evicted run's analyzer is still alive (a reference cycle holds it)"
    finally:
        gc.enable()


def test_run_experiment_keeps_no_materials_after_it_returns(calls, tmp_path):
    out = run_experiment(ExperimentSpec(**TINY), SpectrumStore(str(tmp_path / "s.zarr")))
    assert out.status == "done" and RunMaterials.kept() == [], RunMaterials.kept()
