"""Bounds before allocation (issue 18, item 3): absurd specs and inputs are refused from their sizes.

The absurd cases run through ``nsa`` in one child process that reports its peak resident memory
after each case: every one must be refused with a short message naming its cause, and the
process must never have held more than ``PEAK_MB`` (before, these reached 4.5–5.3 GB or a
358 MB message).  The child's address space is capped so a regression fails instead of
swapping the machine.
"""

from __future__ import annotations

import gzip
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from pydantic import ValidationError

from nsa_dist.config import MAX_RECORDED_STEPS, ExperimentSpec, ModelSpec, RecordSpec, SweepSpec
from nsa_dist.data._formats import IDX_IMAGES, read_idx
from nsa_dist.errors import ResourceError
from nsa_dist.models import build_model
from nsa_dist.ntk.blocks import feature_width
from nsa_dist.pipeline.budget import check_fits, fc_sizes, footprint
from nsa_dist.specfile import SpecError, load_spec, load_sweep

REPO = Path(__file__).resolve().parents[1]
PEAK_MB = 1024  # what a refused spec may cost the process, torch and all (~300 MB here)
TINY = {
    "data": {"n": 16},
    "model": {"depth": 2, "width": 8},
    "steps": 4,
    "record": {"every": 2},
    "spectrum": {"k": 4, "images": []},
}

CHILD = r"""
import contextlib, io, json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # a regression fails here, not in the machine's swap
from nsa_dist.cli import main
def peak_mb():  # this program's own peak (VmHWM); ru_maxrss would carry the forking parent's over exec
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(argv)
    except BaseException as exc:  # what escaped nsa's handler (e.g. MemoryError)
        rc = f"raised {type(exc).__name__}"
    out.append({"rc": rc, "err": err.getvalue()[-20000:], "chars": len(err.getvalue()),
                "peak_mb": peak_mb()})
print(json.dumps(out))
"""


def _write(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec))
    return path


def _laughs(levels: int) -> str:
    """A YAML 'billion laughs': each level a list of nine aliases of the level below (9**levels values)."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines)


def _idx_bomb(d: Path) -> None:
    """MNIST files whose images header announces 10 images while the gzip stream inflates to 2 GiB:
    128 gzip members of 16 MiB of zeros each (a gzip reader reads every member), ~2 MB on disk."""
    zeros = gzip.compress(bytes(16 << 20), compresslevel=9)
    with open(d / "train-images-idx3-ubyte.gz", "wb") as f:
        f.write(gzip.compress(struct.pack(">IIII", IDX_IMAGES, 10, 28, 28) + bytes(10 * 28 * 28)))
        for _ in range(128):
            f.write(zeros)
    with gzip.open(d / "train-labels-idx1-ubyte.gz", "wb") as f:
        f.write(struct.pack(">II", 2049, 10) + bytes(range(10)))


def test_absurd_specs_and_inputs_are_refused_at_bounded_memory(tmp_path):
    mnist = tmp_path / "mnist"
    mnist.mkdir()
    _idx_bomb(mnist)
    assert (mnist / "train-images-idx3-ubyte.gz").stat().st_size < 4 << 20
    big = "\n".join([_laughs(5), "steps: *l4"])  # 9**5 values: under the alias bound, an invalid steps (and l0..l4)
    cases = {  # name: (argv, what the message must say)
        "record": (
            ["run", str(_write(tmp_path / "record.yaml", {**TINY, "steps": 10**12, "record": {"every": 10}}))],
            "record.every=10 with steps=1000000000000 records 100,000,000,001 steps",
        ),
        "depth": (
            ["run", str(_write(tmp_path / "depth.yaml", {**TINY, "model": {"depth": 10**6, "width": 8}}))],
            "model.depth",
        ),
        "width": (
            ["run", str(_write(tmp_path / "width.yaml", {**TINY, "model": {"depth": 3, "width": 10**7}}))],
            "parameters (P = 100,000,",
        ),
        "gram": (["run", str(_write(tmp_path / "gram.yaml", {**TINY, "data": {"n": 10**7}}))], "G (local layout)"),
        "sweep_gram": (  # the sweep's memory check: before the store, Ray or any model
            [
                "sweep",
                str(_write(tmp_path / "sweep_gram.yaml", {"name": "big", "base": {**TINY, "data": {"n": 10**7}}})),
                "--plain",
            ],
            "G (local layout)",
        ),
        "seed": (["run", str(_write(tmp_path / "seed.yaml", {**TINY, "seed": 10**30}))], "seed: Input should be less"),
        "laughs": (
            ["run", str(_write_text(tmp_path / "laughs.yaml", _laughs(9) + "\nsteps: *l8"))],
            "expands to more than 1,000,000 values",
        ),
        "message": (
            ["run", str(_write_text(tmp_path / "message.yaml", big))],
            "steps: Input should be a valid integer",
        ),
        "grid": (
            [
                "sweep",
                str(
                    _write(
                        tmp_path / "grid.yaml",
                        {
                            "name": "huge",
                            "base": TINY,
                            "grid": {
                                "seed": list(range(10)),
                                "model.width": list(range(1, 11)),
                                "model.depth": list(range(2, 12)),
                                "schedule.lr": [0.1 * i for i in range(1, 11)],
                                "steps": list(range(10, 20)),
                                "data.n": list(range(20, 30)),
                            },
                        },
                    )
                ),
                "--plain",
            ],
            "the sweep has 1,000,000 runs",
        ),
        "idx": (
            [
                "run",
                str(_write(tmp_path / "idx.yaml", {**TINY, "data": {"name": "mnist", "path": str(mnist), "n": 5}})),
            ],
            "holds more than the 7,840 data bytes its header announces",
        ),
    }
    argv = [[*a, "--store", str(tmp_path / f"{name}.zarr")] for name, (a, _) in cases.items()]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = dict(zip(cases, json.loads(proc.stdout.strip().splitlines()[-1])))
    for name, (_, want) in cases.items():
        r = results[name]
        assert r["rc"] == 2 and want in r["err"], (name, r)
        lines = r["err"].strip().splitlines()  # a spec file's problems: a header and one line each
        assert r["chars"] < 3000 and len(lines) <= (8 if name == "message" else 2), (name, r["chars"], lines[:20])
        assert r["peak_mb"] < PEAK_MB, f"{name}: peak {r['peak_mb']:.0f} MB (≥ {PEAK_MB} MB) before refusing"
        assert not (tmp_path / f"{name}.zarr").exists() or name == "idx", f"{name}: a store was created"


def _write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- the recording schedule


def test_schedule_is_counted_by_arithmetic_and_matches_its_list():
    rng = np.random.default_rng(0)
    for total, every in zip(rng.integers(1, 500, 300), rng.integers(1, 60, 300)):
        r = RecordSpec(every=int(every))
        want = sorted(set(range(0, int(total), int(every))) | {0, int(total) - 1})
        assert r.schedule(int(total)) == want and r.count(int(total)) == len(want), (total, every)
    for total, points in zip(rng.integers(1, 10**6, 50), rng.integers(2, 50, 50)):
        r = RecordSpec(log_points=int(points))
        assert len(r.schedule(int(total))) <= r.count(int(total))
    assert RecordSpec(every=1).count(MAX_RECORDED_STEPS) == MAX_RECORDED_STEPS  # the bound itself is accepted
    with pytest.raises(ValueError, match=r"record.every=1 with steps=1000001 records 1,000,001 steps"):
        RecordSpec(every=1).schedule(MAX_RECORDED_STEPS + 1)
    with pytest.raises(ValidationError, match=r"record.log_points=10000000 .* more than 1,000,000"):
        ExperimentSpec(steps=100, record={"log_points": 10**7})  # geomspace would build 10**7 points


# --------------------------------------------------------------------------- sweeps


def test_a_sweep_is_counted_before_it_is_expanded_and_the_limit_is_raised_explicitly(tmp_path):
    raw = {"name": "s", "base": TINY, "grid": {"seed": [0, 1, 2]}, "variants": [{}, {"model.width": 4}]}
    assert SweepSpec.model_validate(raw).size == 6
    with pytest.raises(ValidationError, match=r"the sweep has 6 runs \(3 seed × 2 variants\), more than the limit 5"):
        SweepSpec.model_validate(raw, context={"max_runs": 5})
    assert len(SweepSpec.model_validate(raw, context={"max_runs": 6}).expand()) == 6
    path = _write(tmp_path / "s.yaml", raw)
    with pytest.raises(SpecError, match="--max-runs N"):
        load_sweep(path, max_runs=5)
    assert load_sweep(path).size == 6
    from nsa_dist.cli import main

    assert main(["sweep", str(path), "--max-runs", "5", "--store", str(tmp_path / "x.zarr")]) == 2
    assert not (tmp_path / "x.zarr").exists()


# --------------------------------------------------------------------------- the memory estimate


@pytest.mark.parametrize(
    "model",
    [
        dict(depth=1, width=5),
        dict(depth=2, width=7),
        dict(depth=6, width=256),
        dict(depth=4, width=9, residual=True),
        dict(depth=3, width=6, init="ntk"),
    ],
)
def test_closed_form_parameter_count_and_feature_width_match_the_built_net(model):
    m = ModelSpec(input_dim=3, output_dim=2, **model)
    net = build_model(m)
    assert fc_sizes(m) == (sum(p.numel() for p in net.parameters()), feature_width(net, torch.zeros(2, 3)))


def test_the_memory_estimate_refuses_past_the_machine_and_past_an_auto_budget(monkeypatch):
    import nsa_dist.pipeline.layout as layout_mod

    spec = ExperimentSpec(**TINY)
    fp = check_fits(spec)  # a tiny run fits
    assert fp.P == fc_sizes(spec.model)[0] and fp.total > 0
    monkeypatch.setattr(layout_mod, "_machine_bytes", lambda: fp.total / 2)
    with pytest.raises(ResourceError, match=r"run 'run' needs ~.* GB on one worker \(.*\), more than this machine's"):
        check_fits(spec)
    monkeypatch.undo()
    n = 2000
    G = footprint(ExperimentSpec(**{**TINY, "data": {"n": n}, "spectrum": {"k": 4, "layout": "matrix_free"}})).parts
    tight = {**TINY, "data": {"n": n}, "spectrum": {"k": 4, "layout": "auto", "memory_budget_gb": 1e-9}}
    with pytest.raises(
        ResourceError,
        match=r"its Gram needs ~.* per worker even as matrix_free, more than "
        r"spectrum.memory_budget_gb=1e-09",
    ):
        check_fits(ExperimentSpec(**tight))
    assert G["G (matrix_free layout)"] > 1e-9 * 1e9
    roomy = {**tight, "spectrum": {**tight["spectrum"], "memory_budget_gb": 100.0}}
    assert check_fits(ExperimentSpec(**roomy)).layout.value == "local"


def test_a_dense_reduction_counts_its_own_temporaries():
    """The dense eigensolver's temporaries beside G and V (Audit B: a k: all run's peak was 1.3× the
    estimate; `nsa run` at N = 8,000 measured 2.09 GB above the process against 1.64 GB counted)
    are N² numbers where G is reduced whole — k: all on the exact route, a top-k above N/3 — and
    nothing where Lanczos or the quadrature route takes the top."""
    n = 3000

    def parts(**spectrum):
        return footprint(ExperimentSpec(**{**TINY, "data": {"n": n}, "spectrum": spectrum})).parts

    key = "dense eigensolver (transient)"
    assert parts(k="all")[key] == 8.0 * n * n
    assert parts(k="all", dtype="float32")[key] == 4.0 * n * n
    assert parts(k=1200)[key] == 8.0 * n * n  # k > N/3: auto reduces G whole
    for lean in (parts(k=100), parts(k="all", energy="quadrature"), parts(k=100, layout="block_rows", workers=2)):
        assert key not in lean, lean


@pytest.mark.parametrize("layout", ["local", "block_rows", "matrix_free"])
def test_a_budget_over_an_explicit_layout_is_said_not_ignored(layout, caplog):
    """``memory_budget_gb`` with a layout set (not ``auto``): a Gram whose part exceeds the budget runs as
    set — a refusal would orphan a run recorded with it, every way out changing its id (a review) —
    but says so once, naming the layout, its part, the budget and the way out (Audit B: not a word)."""
    import logging

    from nsa_dist.pipeline import budget as budget_mod

    budget_mod._WARNED.clear()
    n = 2000
    spectrum = {"k": 4, "layout": layout, "workers": 2}
    part = footprint(ExperimentSpec(**{**TINY, "data": {"n": n}, "spectrum": spectrum}))
    G = next(v for key, v in part.parts.items() if key.startswith("G "))
    tight = ExperimentSpec(**{**TINY, "data": {"n": n}, "spectrum": {**spectrum, "memory_budget_gb": 0.5 * G / 1e9}})
    with caplog.at_level(logging.WARNING, logger="nsa_dist"):
        assert check_fits(tight).layout.value == layout
        assert check_fits(tight).layout.value == layout  # the plan's second check: said once
    said = [r.getMessage() for r in caplog.records if "memory_budget_gb" in r.getMessage()]
    assert len(said) == 1, said
    assert f"per worker as {layout}, more than spectrum.memory_budget_gb=" in said[0], said
    assert "layout 'auto' chooses one within the budget" in said[0], said
    caplog.clear()
    roomy = ExperimentSpec(**{**TINY, "data": {"n": n}, "spectrum": {**spectrum, "memory_budget_gb": 2 * G / 1e9}})
    with caplog.at_level(logging.WARNING, logger="nsa_dist"):
        assert check_fits(roomy).layout.value == layout
    assert not [r for r in caplog.records if "memory_budget_gb" in r.getMessage()]


def test_nsa_run_counts_every_gang_member_it_holds_and_the_feature_pass(monkeypatch, tmp_path):
    """``nsa run`` on a distributed layout keeps the W members of its in-process gang in one process:
    the estimate counts W parts of G there (one per process on a Ray gang), and the feature pass's
    transient chunk.  A run that fits one member per process but not W in one is refused by
    run_experiment before its data is loaded, naming the gang and the way out."""
    import nsa_dist.pipeline.layout as layout_mod
    from nsa_dist.pipeline import run_experiment

    raw = {
        **TINY,
        "data": {"n": 6000},
        "model": {"depth": 3, "width": 64},
        "spectrum": {"k": 4, "layout": "matrix_free", "workers": 3, "images": []},
    }
    spec = ExperimentSpec(**raw)
    one, here = footprint(spec), footprint(spec, gang_in_process=True)
    G = one.parts["G (matrix_free layout)"]
    assert here.parts["gang members in this process (W = 3: 2 × their own part more)"] == 2 * G, here.parts
    # and each member's product temporaries (capped: CHUNK_BYTES each)
    from nsa_dist.ntk.shards import CHUNK_BYTES

    assert here.parts["matrix_free products (transient)"] == 3 * one.parts["matrix_free products (transient)"]
    assert one.parts["matrix_free products (transient)"] == CHUNK_BYTES
    assert here.total - one.total == pytest.approx(2 * G + 2 * CHUNK_BYTES)
    # the feature pass: one range of N/W = 2000 points, its features and the forward activations
    P, width = fc_sizes(spec.model)
    outs = (spec.model.depth - 1) * spec.model.width + spec.model.output_dim
    assert one.parts["feature pass (transient)"] == 2000 * (width + outs) * 8
    assert "gang" not in " ".join(footprint(ExperimentSpec(**TINY), gang_in_process=True).parts)  # local: no gang

    monkeypatch.setattr(layout_mod, "_machine_bytes", lambda: (one.total + here.total) / 2)
    check_fits(spec)  # one member per process (a Ray gang) fits
    with pytest.raises(
        ResourceError,
        match=r"^run 'run' needs ~.* GB in this process \(.*gang members in this process \(W = 3: 2 × their own "
        r"part more\).*\), more than this machine's .*; its gang's members all live in this process \(nsa run\): "
        r"run it with `nsa sweep` on a Ray cluster of several machines",
    ):
        run_experiment(spec, str(tmp_path / "s.zarr"))
    assert not (tmp_path / "s.zarr").exists()  # refused before the store was opened

    # block_rows: the members share one copy of the block features (LocalGang hands the values
    # themselves), so only the tiles are counted W times; its feature pass ends before any tile exists
    tiles_spec = ExperimentSpec(**{**raw, "spectrum": {**raw["spectrum"], "layout": "block_rows"}})
    one, here = footprint(tiles_spec), footprint(tiles_spec, gang_in_process=True)
    feats = 6000 * width * 8
    tiles = one.parts["G (block_rows layout)"] - feats
    assert here.total - one.total == pytest.approx(2 * tiles) and "feature pass (transient)" not in one.parts
    monkeypatch.setattr(layout_mod, "_machine_bytes", lambda: (one.total + here.total) / 2)
    with pytest.raises(ResourceError, match=r"in this process .*; use spectrum.layout 'matrix_free' \(a member holds"):
        run_experiment(tiles_spec, str(tmp_path / "t.zarr"))


def test_nsa_run_under_layout_auto_picks_what_fits_its_in_process_gang(monkeypatch, tmp_path):
    """``layout: auto`` weighs the gang as ``nsa run`` holds it: one member's tiles fit the budget
    but the 3 members' tiles in one process do not fit the machine, so ``nsa run`` takes
    ``matrix_free`` (every point's features, 14 MB here) and runs, where it used to take
    ``block_rows`` and then refuse itself; a Ray gang (one member per process) still takes
    ``block_rows``."""
    import nsa_dist.pipeline.layout as layout_mod
    from nsa_dist.client import Client
    from nsa_dist.pipeline import run_experiment, run_id

    raw = {
        **TINY,
        "data": {"n": 6000},
        "model": {"depth": 3, "width": 64},
        "spectrum": {"k": 4, "layout": "auto", "workers": 3, "images": []},
    }
    spec = ExperimentSpec(**raw)
    width = fc_sizes(spec.model)[1]
    member = layout_mod.layout_bytes(spec, 6000, width)[layout_mod.Layout.BLOCK_ROWS]
    monkeypatch.setattr(layout_mod, "_machine_bytes", lambda: 2.1 * member)  # the budget: 1.05 members' tiles
    assert footprint(spec).layout.value == "block_rows"  # a Ray gang: one member per process
    fp = check_fits(spec, gang_in_process=True)
    assert fp.layout.value == "matrix_free", fp
    url = str(tmp_path / "s.zarr")
    assert run_experiment(spec, url).status == "done"
    run = Client(url).run(run_id(spec))
    assert run.attrs["layout"] == "matrix_free", run.attrs["layout_reason"]
    assert "in this process as the tiles of its 3 gang members" in run.attrs["layout_reason"]


def test_the_plan_is_checked_with_its_measured_width_and_the_recorded_layout(monkeypatch, tmp_path):
    """The check before the data is loaded knows only the spec; once planned, the run is checked
    again with what the plan knows, before its group is created: (1) a run recorded as
    ``block_rows`` by a Ray gang, resumed by ``nsa run`` (all members in one process), is refused
    with the gang's advice — its layout is the recorded one, not what auto would pick now;
    (2) a Tracker whose network couples samples (batch norm in train mode) runs ``local``, which
    its spec (no feature width, no coupling) cannot tell."""
    import nsa_dist.pipeline.layout as layout_mod
    from nsa_dist import Tracker
    from nsa_dist.pipeline import prepare_run, run_experiment
    from nsa_dist.store import SpectrumStore

    raw = {
        **TINY,
        "data": {"n": 6000},
        "model": {"depth": 3, "width": 64},
        "spectrum": {"k": 4, "layout": "auto", "workers": 3, "images": []},
    }
    spec = ExperimentSpec(**raw)
    member = layout_mod.layout_bytes(spec, 6000, fc_sizes(spec.model)[1])[layout_mod.Layout.BLOCK_ROWS]
    monkeypatch.setattr(layout_mod, "_machine_bytes", lambda: 2.1 * member)
    url = str(tmp_path / "r.zarr")
    made = prepare_run(spec, SpectrumStore(url))  # as a sweep's driver makes it: one member per process
    assert made.plan.layout.layout.value == "block_rows"
    for _ in range(2):  # refused, and the lease given back: the second try is refused the same way
        with pytest.raises(
            ResourceError, match=r"G \(block_rows layout\).*in this process|in this process.*block_rows"
        ):
            run_experiment(spec, url)
    assert SpectrumStore(url).reader(made.plan.run_id).attrs["layout"] == "block_rows"

    net = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    X, y = torch.randn(3000, 2), torch.randn(3000)
    monkeypatch.setattr(layout_mod, "_machine_bytes", lambda: 1e8)  # G whole: 3000² · 16 · 1.1 = 0.16 GB
    with pytest.raises(ResourceError, match=r"G \(local layout\)"):
        Tracker(
            str(tmp_path / "t.zarr"),
            "bn",
            net,
            X,
            y,
            steps=4,
            record={"every": 2},
            spectrum={"k": 4, "images": [], "layout": "auto", "workers": 2},
        )


FEATURE_PASS = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[2])
from _measure import measured
from nsa_dist.config import ModelSpec
from nsa_dist.models import build_model
from nsa_dist.ntk.blocks import block_features
torch.set_num_threads(1)
m = ModelSpec(**json.loads(sys.argv[1]))
net, x = build_model(m, seed=0), torch.randn(20000, m.input_dim)
with measured() as r:
    f = block_features(net, x, [(0, 20000)], dtype=torch.float32)
print(json.dumps({"peak": r["peak_bytes"], "kept": sum(A.nbytes + D.nbytes for A, D in f[0])}))
"""


@pytest.mark.parametrize("model", [dict(depth=4, width=128), dict(depth=3, width=200, activation="tanh")])
def test_the_feature_pass_estimate_is_below_what_the_pass_takes(model):
    """The module's estimates are lower ones (a refused run would certainly not fit): a 20,000-point
    range passed in chunks of ROW_CHUNK = 16,384 takes more above its kept features than the
    transient part counts (measured: 1.6–4.4×), and the kept features are the matrix_free G part."""
    spec = ExperimentSpec(
        **{
            **TINY,
            "data": {"n": 20000},
            "model": {"activation": "leaky_relu", **model},
            "spectrum": {"k": 4, "layout": "matrix_free", "workers": 1, "dtype": "float32", "images": []},
        }
    )
    m, parts = spec.model, footprint(spec).parts
    out = subprocess.run(
        [sys.executable, "-c", FEATURE_PASS, json.dumps(m.model_dump(mode="json")), str(REPO / "benchmarks")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kept"] == parts["G (matrix_free layout)"], (got, parts)
    transient = got["peak"] - got["kept"]
    assert parts["feature pass (transient)"] <= transient, (parts["feature pass (transient)"], transient)
    print(f"feature pass: estimated {parts['feature pass (transient)'] / 1e6:.1f} MB, took {transient / 1e6:.1f} MB")


@pytest.mark.parametrize("n_test, momentum", [(24, 0.0), (80, 0.0), (24, 0.9)])
def test_the_test_point_gram_is_counted_as_the_analyzer_allocates_it(n_test, momentum):
    """With ``spectrum.test_points`` the analyzer keeps a buffer for the test Gram beside the train
    Gram's, from step to step; where App. E is measured (GD without momentum on the L2 loss) it
    first assembles the (M, N) cross kernel in it at t0.  The estimate is the largest buffer the
    analyzer asks for: M·max(M, N)·itemsize (M < N and M > N), M·M with momentum (no App. E)."""
    from nsa_dist.data import load_dataset
    from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run

    raw = {
        **TINY,
        "data": {"n": 48, "n_test": n_test},
        "optimizer": {"name": "gd", "momentum": momentum},
        "spectrum": {"k": 4, "images": [], "test_points": True},
    }
    spec = ExperimentSpec(**raw)
    parts = footprint(spec).parts
    data = load_dataset(spec.data, seed=0)
    plan = plan_run(spec, data)
    analyzer, asked = SpectralAnalyzer(plan, data), {}
    empty = analyzer._workspace.empty

    def record(name, shape, dtype=torch.float64, column_major=False):
        buf = empty(name, shape, dtype, column_major)
        asked[name] = max(asked.get(name, 0), buf.nbytes)
        return buf

    analyzer._workspace.empty = record
    for ck in Trainer(plan, data).train_until(4):
        analyzer.analyze(ck)
    cols = max(n_test, 48) if momentum == 0 else n_test
    assert asked["gram.test"] == parts["test-point Gram"] == n_test * cols * 8, (asked, parts)
    assert parts["test eigenvectors"] == 8 * n_test * 4
    assert "test-point Gram" not in footprint(ExperimentSpec(**{**raw, "spectrum": {"k": 4, "images": []}})).parts


def test_the_test_points_on_the_quadrature_route_and_on_an_in_process_gang():
    """k: all on the quadrature route keeps quadrature.top test eigenvectors, not M; a gang's test
    Gram counts what it needs beyond G, W members' worth where they share this process."""
    import nsa_dist.pipeline.layout as layout_mod

    kall = {**TINY, "data": {"n": 100_000, "n_test": 100_000}}
    kall["spectrum"] = {"k": "all", "layout": "matrix_free", "workers": 4, "test_points": True, "images": []}
    parts = footprint(ExperimentSpec(**kall)).parts
    assert parts["test eigenvectors"] == 8 * 100_000 * 100, parts  # quadrature.top = 100 (M·M would be 80 GB)
    for layout in ("block_rows", "matrix_free"):
        raw = {**TINY, "data": {"n": 1000, "n_test": 4000}}
        raw["spectrum"] = {"k": 4, "layout": layout, "workers": 4, "test_points": True, "images": []}
        spec = ExperimentSpec(**raw)
        width = fc_sizes(spec.model)[1]
        for in_process in (False, True):
            held = {}
            for n in (1000, 4000):
                one = layout_mod.layout_bytes(spec, n, width)[layout_mod.Layout(layout)]
                shared = n * width * 8 if layout == "block_rows" else 0
                held[n] = 4 * (one - shared) + shared if in_process else one
            got = footprint(spec, gang_in_process=in_process).parts["test-point Gram"]
            assert got == pytest.approx(held[4000] - held[1000]), (layout, in_process, got, held)


def test_a_tracker_whose_analysis_cannot_fit_is_refused_before_the_store_is_touched(tmp_path):
    """The Tracker counts as ``nsa run`` does (its spec records the network's P): a kernel past this
    machine is one ResourceError naming the parts, and no store is created."""
    from nsa_dist import Tracker

    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    X, y = torch.randn(300_000, 2), torch.randn(300_000)
    url = tmp_path / "t.zarr"
    with pytest.raises(
        ResourceError, match=r"^run 'big' needs ~.* GB on one worker \(G \(local layout\) .*\), more than"
    ):
        Tracker(str(url), "big", net, X, y, steps=4, record={"every": 2}, spectrum={"k": 4, "images": []})
    assert not url.exists()
    fp = footprint(
        ExperimentSpec.model_validate(
            {
                **TINY,
                "data": {"name": "arrays", "n": 10, "path": "sha1:0"},
                "model": {"factory": "m:f", "source": "tracker", "input_dim": 2, "kwargs": {"n_params": 33}},
            }
        )
    )
    assert fp.P == 33 and fp.parts["parameters (P = 33)"] == 4.0 * 33 * 4 and fp.parts["data"] == 16.0 * 10 * 2


# --------------------------------------------------------------------------- inputs


def test_an_idx_header_that_the_gzip_cannot_hold_is_refused_before_reading(tmp_path):
    p = tmp_path / "train-images-idx3-ubyte.gz"
    p.write_bytes(gzip.compress(struct.pack(">IIII", IDX_IMAGES, 6_000_000, 28, 28) + bytes(100)))
    with pytest.raises(ValueError, match=r"need 4,704,000,000 data bytes, more than a .*-byte gzip file can inflate"):
        read_idx(p, IDX_IMAGES)
    q = tmp_path / "plain-idx3-ubyte"
    q.write_bytes(struct.pack(">IIII", IDX_IMAGES, 3, 2, 2) + bytes(13))  # one byte more than 3·2·2
    with pytest.raises(ValueError, match=r"header dims \(3, 2, 2\) need 12 data bytes, the file holds 13"):
        read_idx(q, IDX_IMAGES)


def test_validation_messages_are_bounded(tmp_path):
    bad = {**TINY, "record": {"steps": [-1] * 5000}, **{f"x{i}": i for i in range(50)}}
    with pytest.raises(SpecError) as e:
        load_spec(_write(tmp_path / "bad.yaml", bad))
    msg = str(e.value)
    assert len(msg) < 5000 and "… and" in msg and "more problems" in msg, msg[:6000]
