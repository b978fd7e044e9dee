"""One step's G beyond one worker: block_rows and matrix_free equal local (float64), in-process and on Ray."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from torch.nn.utils import parameters_to_vector

from nsa_dist.config import ExperimentSpec, Layout
from nsa_dist.data import load_dataset
from nsa_dist.hessian import hessian_parts
from nsa_dist.models import build_model
from nsa_dist.ntk import gram
from nsa_dist.ntk.shards import tile_plan
from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run, run_experiment, run_id
from nsa_dist.pipeline.layout import LocalGang, ShardedCurvature, ShardedGram, choose_layout, layout_bytes
from nsa_dist.pipeline.member import SpectralShard
from nsa_dist.pipeline.services import SpectralService
from nsa_dist.store import SpectrumStore

HESS = {"probes": 8, "top_k": 2, "rayleigh_k": 2, "density_probes": 2, "lanczos_steps": 6, "density_grid": 20}
BASE = {
    "name": "lay",
    "data": {"n": 97, "n_test": 23},
    "model": {"depth": 3, "width": 16},
    "steps": 4,
    "record": {"every": 2},
    "spectrum": {
        "dtype": "float64",
        "k": 12,
        "test_points": True,
        "images": [1, 2, 5],
        "image_size": 6,
        "fourier_size": 5,
    },
}
ONEHOT = {
    **BASE,
    "data": {"name": "digits", "n": 61, "n_test": 11, "target": "onehot"},
    "spectrum": {**BASE["spectrum"], "images": []},
}
EXACT = 1e-10  # relative, float64


def _spec(base: dict, layout: str, workers: int, **extra) -> ExperimentSpec:
    return ExperimentSpec.model_validate(
        {**base, **extra, "spectrum": {**base["spectrum"], "layout": layout, "workers": workers}}
    )


def _notes(step_notes: str, estimated: tuple[str, ...]) -> dict:
    """The step's notes but those of arrays a gang leaves to estimates (checked on their own)."""
    return {k: v for k, v in (json.loads(step_notes) if step_notes else {}).items() if k not in estimated}


def _assert_results_equal(got: dict, ref: dict, what: str, estimated: tuple[str, ...] = ()) -> None:
    """Every array of ``ref`` equal in ``got`` to EXACT relative (by its largest entry); names what differs."""
    assert set(got) == set(ref), f"{what}: keys differ: {set(got) ^ set(ref)}"
    for name, r in ref.items():
        if isinstance(r, str):  # step_notes: the same diagnostics noted (or none) in every layout
            assert _notes(got[name], estimated) == _notes(r, estimated), f"{what}: {name} {got[name]!r} != {r!r}"
            continue
        a, b = np.asarray(got[name], dtype=np.float64), np.asarray(r, dtype=np.float64)
        assert a.shape == b.shape, f"{what}: {name} shape {a.shape} != {b.shape}"
        if name in estimated:
            continue
        assert np.array_equal(np.isnan(a), np.isnan(b)), f"{what}: {name} NaN pattern differs"
        if not np.isfinite(b).any():
            continue
        err = np.nanmax(np.abs(a - b)) / max(np.nanmax(np.abs(b)), 1e-300)
        assert err <= EXACT, f"{what}: {name} differs by {err:.3e} relative (max |Δ| over max |ref|)"


def _analyses(base: dict, layouts: list[tuple[str, int]], hessian: bool = True) -> dict:
    extra = {"hessian": HESS} if hessian else {}
    out = {}
    for layout, W in layouts:
        spec = _spec(base, layout, W, **extra)
        data = load_dataset(spec.data, seed=spec.seed)
        plan = plan_run(spec, data)
        ck = list(Trainer(plan, data).train_until(3))[1]  # step 2: a trained state
        out[(layout, W)] = SpectralAnalyzer(plan, data).analyze(ck).arrays()
    return out


def test_tile_plan_owns_every_pair_once_and_balances():
    for n, W in [(97, 2), (97, 3), (1000, 4), (10, 5)]:
        plan = tile_plan(n, W)
        B = len(plan.ranges)
        pairs = [p for ps in plan.pairs for p in ps]
        assert sorted(pairs) == [(I, J) for I in range(B) for J in range(I, B)], (n, W)
        assert sorted(b for o in plan.owners for b in o) == list(range(B))
        entries = plan.tile_entries()
        biggest = max((b - a) ** 2 for a, b in plan.ranges)
        assert max(entries) - min(entries) <= biggest, (n, W, entries)
        assert sum(entries) < n * n  # the symmetry saving: about (B + 1) / (2B) of G


@pytest.mark.slow  # five Hessian steps at N = 97 in float64: ~30 s on 2 cores
@pytest.mark.parametrize("base", [BASE, ONEHOT], ids=["scalar", "onehot-K10"])
def test_block_rows_and_matrix_free_equal_local_in_process(base):
    res = _analyses(
        base,
        [("local", 1), ("block_rows", 2), ("block_rows", 3), ("matrix_free", 2), ("matrix_free", 3)],
        hessian=base is BASE,
    )
    ref = res.pop(("local", 1))
    ref_fro = ref["gram_sq_frobenius"]
    assert ref_fro[1] == 0.0
    for (layout, W), got in res.items():
        what = f"{layout} on {W} workers"
        if layout == "block_rows":
            _assert_results_equal(got, ref, what, estimated=("hessian_moments_I_exact", "hessian_I_eigenvalues"))
        else:  # ‖G‖_F² and what the centred alignment divides by are Hutch++ estimates
            _assert_results_equal(
                got,
                ref,
                what,
                estimated=(
                    "gram_sq_frobenius",
                    "alignment",
                    "alignment_centered",
                    "hessian_moments_I_exact",
                    "hessian_I_eigenvalues",
                ),
            )
            est, se = got["gram_sq_frobenius"]
            assert 0 < se and abs(est - ref_fro[0]) <= 4 * se + 1e-9 * ref_fro[0], (what, est, se, ref_fro[0])
            for name in ("alignment", "alignment_centered"):
                assert abs(got[name] - ref[name]) <= 1e-2 * abs(ref[name]), (what, name, got[name], ref[name])
        if "hessian_moments_I_exact" in got:  # block_rows: Tr(G)/N, ‖G‖_F²/N² from the tiles; the rest needs G whole
            exact, want = got["hessian_moments_I_exact"], ref["hessian_moments_I_exact"]
            if layout == "block_rows" and base is BASE:
                np.testing.assert_allclose(exact[:2], want[:2], rtol=1e-9, err_msg=what)
                assert np.isnan(exact[2:]).all(), (what, exact)
            else:
                assert np.isnan(exact).all(), (what, exact)
            assert np.isnan(got["hessian_I_eigenvalues"]).all(), what
            notes = json.loads(got["step_notes"])  # NaN, never without its reason
            assert "never" in notes.get("hessian_I_eigenvalues", ""), (what, notes)
            if np.isnan(exact).all():
                assert "never" in notes.get("hessian_moments_I_exact", ""), (what, notes)


CNN8 = {"factory": "nsa_dist.models:cnn", "kwargs": {"in_channels": 1, "image_size": 8, "channels": [3], "hidden": [8]}}
RESNET = {"factory": "user_models:inplace_resnet", "kwargs": {"channels": 2}}
TIED = {"factory": "user_models:tied_mlp", "kwargs": {"d": 64, "width": 6}}


@pytest.mark.parametrize("model", [CNN8, RESNET, TIED], ids=["cnn-factory", "inplace-bn-resnet", "tied-weights"])
def test_gang_layouts_of_a_per_layer_model_equal_local(model):
    """block_rows tiles and matrix_free shards built from per-layer features (convolutions, eval-mode
    BN, in-place ReLU, a residual sum, a weight shared by two layers: its per-sample Jacobian) give
    the local step's numbers (float64)."""
    base = {
        **BASE,
        "data": {"name": "digits", "n": 53, "n_test": 9},
        "model": model,
        "spectrum": {**BASE["spectrum"], "images": []},
    }
    res = _analyses(base, [("local", 1), ("block_rows", 3), ("matrix_free", 2)], hessian=False)
    ref = res.pop(("local", 1))
    for (layout, W), got in res.items():
        est = () if layout == "block_rows" else ("gram_sq_frobenius", "alignment", "alignment_centered")
        _assert_results_equal(got, ref, f"{layout} on {W} workers", estimated=est)
    spec = _spec(base, "block_rows", 2)
    data = load_dataset(spec.data, seed=spec.seed)
    model_ = build_model(spec.model, seed=spec.seed)
    theta = parameters_to_vector(model_.parameters()).detach().numpy()
    gang = LocalGang([SpectralShard() for _ in range(2)])
    op = ShardedGram(gang, plan_run(spec, data), theta, "train", data.n, np.float64)
    assert type(gang.members[0]._held[op.key]).__name__ == "FeatureShard"  # not the per-product Jacobian map
    op.close()


def test_the_hessian_of_a_model_with_frozen_parameters_on_a_gang_equals_local():
    """The gang's curvature operators were sized by every parameter (P of the plan) while the members'
    differentiate the trainable ones: "operator of shape (513, 513) got a block of shape (576, 8)",
    every Hessian quantity NaN on block_rows / matrix_free (audit H)."""
    base = {
        **BASE,
        "data": {"name": "image2d", "n": 24, "n_test": 4},
        "model": {"factory": "user_models:frozen_first", "kwargs": {"width": 6}},
        "spectrum": {**BASE["spectrum"], "images": []},
    }
    res = _analyses(base, [("local", 1), ("block_rows", 2)])
    ref, got = res[("local", 1)], res[("block_rows", 2)]
    limits = {"hessian_I_limit_eigenvalues", "hessian_I_limit_moments", "hessian_S_limit"}  # a factory net: no limit
    assert set(json.loads(got["step_notes"])) == {"hessian_I_eigenvalues"} | limits, got["step_notes"]  # I's: G whole
    for name in ("hessian_top", "hessian_S_op", "hessian_moments"):
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-10, atol=1e-14, err_msg=name)


@pytest.mark.parametrize("layout", ["block_rows", "matrix_free"])
def test_no_process_forms_the_gram_on_a_gang(layout, monkeypatch):
    """Every metric of a distributed step without the N×N G: forming it anywhere fails the step."""
    import nsa_dist.hessian.moments as moments
    import nsa_dist.pipeline.spectral as spectral

    def refuse(*args, **kwargs):
        raise AssertionError(f"layout {layout}: the whole Gram was formed")

    monkeypatch.setattr(spectral, "gram", refuse)
    monkeypatch.setattr(moments, "gram", refuse)
    spec = _spec(BASE, layout, 2, hessian=HESS)
    data = load_dataset(spec.data, seed=spec.seed)
    plan = plan_run(spec, data)
    ck = list(Trainer(plan, data).train_until(3))[1]
    out = SpectralAnalyzer(plan, data).analyze(ck).arrays()
    assert np.isfinite(out["eigenvalues"]).all() and np.isfinite(out["energy_f_test"]).all()
    assert np.isfinite(out["hessian_moments"]).all() and np.isfinite(out["df_pred"]).all()


def test_matrix_free_with_jacobian_shards_equals_dense():
    spec = ExperimentSpec.model_validate(
        {**BASE, "spectrum": {**BASE["spectrum"], "layout": "matrix_free", "workers": 3, "ntk_method": "jacobian"}}
    )
    data = load_dataset(spec.data)
    model = build_model(spec.model, seed=spec.seed)
    theta = parameters_to_vector(model.parameters()).detach().numpy()
    G = gram(model, torch.as_tensor(data.X, dtype=torch.float32), dtype=torch.float64).numpy()
    V = np.random.default_rng(1).standard_normal((G.shape[0], 4))
    gang = LocalGang([SpectralShard() for _ in range(3)])
    op = ShardedGram(gang, plan_run(spec, data), theta, "train", G.shape[0], np.float64)
    assert type(gang.members[0]._held[op.key]).__name__ == "JacobianShard"
    err = np.abs(op.matmat(V) - G @ V).max() / np.abs(G @ V).max()
    assert err <= EXACT, f"J(JᵀV) over Jacobian shards differs from G V by {err:.3e}"
    op.close()
    assert not gang.members[0]._held


def test_sharded_hessian_products_equal_local():
    spec = _spec(BASE, "matrix_free", 3, hessian=HESS)
    data = load_dataset(spec.data)
    model = build_model(spec.model, seed=spec.seed)
    theta = parameters_to_vector(model.parameters()).detach().numpy()
    P = theta.size
    local = hessian_parts(model, torch.as_tensor(data.X, dtype=torch.float32), data.y, dtype=torch.float64)
    curv = ShardedCurvature(LocalGang([SpectralShard() for _ in range(3)]), plan_run(spec, data), theta, data.n, P)
    V = np.random.default_rng(2).standard_normal((P, 3))
    for name, ref in zip("HIS", local):
        want = ref.matmat(V)
        err = np.abs(curv.part(name).matmat(V) - want).max() / np.abs(want).max()
        assert err <= EXACT, f"Σ_s (n_s/N) {name}_s V differs from {name} V by {err:.3e}"


def test_layout_validation_and_auto_choice(tmp_path):
    with pytest.raises(ValidationError, match="energy='exact' with k='all'.*needs spectrum.layout='local'"):
        _spec({**BASE, "spectrum": {**BASE["spectrum"], "k": "all", "energy": "exact"}}, "block_rows", 2)
    with pytest.raises(ValidationError, match="eig_method='dense' needs layout='local'"):
        _spec({**BASE, "spectrum": {**BASE["spectrum"], "eig_method": "dense"}}, "matrix_free", 2)
    big = 8 * 97 * 97  # bytes of a float64 G at N = 97
    cases = [(1.0, 2, Layout.LOCAL), (1.2 * big / 1e9, 2, Layout.BLOCK_ROWS), (0.2 * big / 1e9, 2, Layout.MATRIX_FREE)]
    for budget, W, want in cases:
        spec = ExperimentSpec.model_validate(
            {**BASE, "spectrum": {**BASE["spectrum"], "layout": "auto", "workers": W, "memory_budget_gb": budget}}
        )
        choice = choose_layout(spec, 97, 2 * (3 + 17 + 17))
        assert choice.layout is want, (budget, choice)
        assert "budget" in choice.reason
    tight = ExperimentSpec.model_validate(
        {**BASE, "spectrum": {**BASE["spectrum"], "layout": "auto", "workers": 2, "memory_budget_gb": 1.2 * big / 1e9}}
    )
    assert choose_layout(tight, 97, 97 * 97).layout is Layout.MATRIX_FREE  # features as wide as G: no tiles
    # nsa run's in-process gang: the W members' tiles add up in one process (the block features are
    # one shared copy), so a budget that holds one member's tiles but not W of them means matrix_free
    W, feats = 4, 97 * 74 * 8
    one = ExperimentSpec.model_validate({**BASE, "spectrum": {**BASE["spectrum"], "layout": "auto", "workers": W}})
    member = layout_bytes(one, 97, 74)[Layout.BLOCK_ROWS]
    held = W * (member - feats) + feats
    for budget, in_process, want in [
        (1.1 * member, False, "block_rows"),
        (1.1 * member, True, "matrix_free"),
        (1.1 * held, True, "block_rows"),
    ]:
        spec = ExperimentSpec.model_validate(
            {**BASE, "spectrum": {**BASE["spectrum"], "layout": "auto", "workers": W, "memory_budget_gb": budget / 1e9}}
        )
        choice = choose_layout(spec, 97, 74, in_process=in_process)
        assert choice.layout.value == want, (budget, in_process, member, held, choice)
        assert ("in this process as the tiles of its 4 gang members" in choice.reason) == in_process, choice.reason
    with pytest.raises(ValueError, match="block_rows.*couples samples.*'local'"):
        choose_layout(_spec(BASE, "block_rows", 2), 97, 74, coupled="batch norm in train mode")
    with pytest.raises(ValueError) as said:  # the route's "the kernel of the batch forward" not said twice
        choose_layout(
            _spec(BASE, "block_rows", 2),
            97,
            74,
            coupled="the model couples samples (x): the kernel of the batch forward",
        )
    assert str(said.value).count("batch") == 1 + str(said.value).count("batch norm"), said.value
    # the route's own reason already says it: said once ("couples samples (the model couples samples (…" before)
    route_reason = (
        "the model couples samples (batch statistics in 'bn' (BatchNorm2d, train mode)): the kernel of the batch"
    )
    for lay in ("local", "auto"):
        reason = choose_layout(_spec(BASE, lay, 2), 97, 0, coupled=route_reason).reason
        assert reason == f"{route_reason}: the whole batch on one worker", reason
    # a run: its measured feature width (96 floats per point, padded) against G at N = 400
    spec = ExperimentSpec.model_validate(
        {
            **BASE,
            "data": {"n": 400, "n_test": 23},
            "steps": 2,
            "record": {"every": 1},
            "spectrum": {
                **BASE["spectrum"],
                "layout": "auto",
                "workers": 2,
                "memory_budget_gb": 0.9 * 8 * 400 * 400 / 1e9,  # the 2 members' tiles in one process fit
            },
        }
    )
    url = str(tmp_path / "s.zarr")
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    attrs = SpectrumStore(url).group(run_id(spec)).attrs
    assert attrs["layout"] == "block_rows" and "in this process as the tiles of its 2" in attrs["layout_reason"], attrs


def test_auto_layout_is_resolved_once_and_used_by_every_worker(tmp_path, monkeypatch):
    import nsa_dist.pipeline.layout as layout_mod
    from nsa_dist.pipeline import prepare_run

    spec = ExperimentSpec.model_validate(
        {**BASE, "steps": 2, "record": {"every": 1}, "spectrum": {**BASE["spectrum"], "layout": "auto", "workers": 2}}
    )  # no budget: this machine's memory decides
    url = str(tmp_path / "s.zarr")
    prep = prepare_run(spec, SpectrumStore(url))
    assert prep.plan.layout.layout is Layout.LOCAL, prep.plan.layout
    monkeypatch.setattr(layout_mod, "_machine_bytes", lambda: 1e3)  # a node with next to no memory
    assert plan_run(spec, prep.data).layout.layout is Layout.MATRIX_FREE  # what it alone would pick
    analyzer, _ = SpectralService(url)._run(prep.plan)
    assert analyzer.plan.layout.layout is Layout.LOCAL and not analyzer.distributed, analyzer.plan.layout
    # a resume too, on a node where auto would not pick local but the recorded local run still fits
    from nsa_dist.pipeline.budget import footprint

    whole = footprint(spec, layout=Layout.LOCAL).total
    monkeypatch.setattr(
        layout_mod, "_machine_bytes", lambda: 1.05 * whole
    )  # half of it below G, the whole run within it
    assert plan_run(spec, prep.data).layout.layout is not Layout.LOCAL
    assert prepare_run(spec, SpectrumStore(url)).plan.layout.layout is Layout.LOCAL


def test_nsa_run_matrix_free_records_the_same_run_as_local(tmp_path):
    from nsa_dist.client import Client

    urls = {}
    for layout in ("local", "matrix_free"):
        spec = _spec(BASE, layout, 2)
        urls[layout] = str(tmp_path / f"{layout}.zarr")
        assert run_experiment(spec, SpectrumStore(urls[layout])).status == "done"
    ra, rb = (Client(urls[k]).run("lay") for k in ("local", "matrix_free"))
    np.testing.assert_allclose(rb.eigenvalues, ra.eigenvalues, rtol=EXACT)
    np.testing.assert_allclose(rb.energy("y"), ra.energy("y"), rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(rb.g["theta"][:], ra.g["theta"][:])


# ---------------------------------------------------------------------- on a local Ray cluster
def _sweep(name: str, layout: str, workers: int, **cluster):
    from nsa_dist.config import SweepSpec

    base = {
        **BASE,
        "steps": 7,
        "record": {"every": 3},
        "hessian": {**HESS, "every": 2},  # steps 0, 3, 6; H at 0, 6
        "spectrum": {**BASE["spectrum"], "layout": layout, "workers": workers},
    }
    return SweepSpec(name=name, base=base, cluster={"spectral_workers": 1, "worker_cpus": 1, **cluster})


def _assert_matches_single_process(tmp_path, url: str, spec: ExperimentSpec) -> None:
    from nsa_dist.client import Client

    ref_url = str(tmp_path / "ref.zarr")
    assert run_experiment(spec, SpectrumStore(ref_url)).status == "done"
    ra, rb = Client(ref_url).run(run_id(spec)), Client(url).run(run_id(spec))
    assert rb.status == "done" and rb.g["done"][:].all()
    for name in (
        "eigenvalues",
        "energy_y",
        "energy_residual",
        "energy_df_pred",
        "df_pred",
        "alignment",
        "alignment_centered",
        "gram_sq_frobenius",
        "eigenvalues_test",
        "energy_f_test",
        "hessian_moments",
        "hessian_top",
        "hessian_density",
        "theta",
        "loss",
    ):
        np.testing.assert_allclose(rb.g[name][:], ra.g[name][:], rtol=EXACT, atol=1e-13, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["block_rows", "matrix_free"])
def test_killed_gang_member_recomputes_the_step_on_a_fresh_gang(local_ray, tmp_path, layout):
    """A sweep on Ray equals the single-process run although a gang member is killed twice."""
    from nsa_dist.cluster import SweepCoordinator

    sweep = _sweep(f"gangkill-{layout}", layout, 2)
    url = str(tmp_path / "s.zarr")
    coord = SweepCoordinator(sweep, url)
    (run,) = coord.runs.values()
    killed: list[int] = []

    def chaos(progress):
        lent = [a.gang for a in run.inflight.values() if a.gang is not None]
        if lent and len(killed) < 2 and progress[0].done >= len(killed):  # twice, at different steps
            pid = lent[0].member_pids[len(killed) % 2]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    coord.on_event = chaos
    (outcome,) = coord.run()
    assert outcome.status == "done", outcome
    assert len(killed) == 2 and coord.replaced_gangs >= 1 and coord.resubmitted >= 1, (killed, coord.resubmitted)
    _assert_matches_single_process(tmp_path, url, sweep.expand()[0])


@pytest.mark.slow
def test_gang_too_large_fails_fast(local_ray, tmp_path):
    from nsa_dist.cluster import SweepCoordinator
    from nsa_dist.cluster.gang import GangUnplaceable, RayGang

    with pytest.raises(GangUnplaceable, match="no node has that much CPU"):
        RayGang(2, cpus=64)
    with pytest.raises(GangUnplaceable, match="spectrum.workers=9 gang members"):
        RayGang(9, cpus=1)
    with pytest.raises(ValueError, match="CPU: needs 11, cluster has 6"):  # 1 worker + 9 members + 1 trainer
        SweepCoordinator(_sweep("huge", "block_rows", 9), str(tmp_path / "s.zarr")).run()


def test_a_batch_method_asked_for_is_named_not_taken_for_a_coupling():
    """An audit: ``ntk_method: batch`` with a gang layout said "the model couples samples (Linear used once;
    proven on the probe points)" — the probe had proven the points independent; the setting is the cause."""
    data = load_dataset(_spec(BASE, "local", 1).data, seed=0)
    batch = {**BASE, "spectrum": {**BASE["spectrum"], "ntk_method": "batch"}}
    for layout in ("block_rows", "matrix_free"):
        spec = _spec(batch, layout, 2)
        with pytest.raises(ValueError, match="ntk_method='batch' computes the kernel of the whole batch") as e:
            plan_run(spec, data)
        assert "couples samples" not in str(e.value), e.value
    plan = plan_run(_spec(batch, "auto", 1), data)
    reason = plan.layout.reason
    assert plan.layout.layout is Layout.LOCAL and reason.startswith("spectrum.ntk_method='batch'"), plan.layout
