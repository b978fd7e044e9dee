"""Adversarial trial of the gang layouts (block_rows, matrix_free) and their Ray side.

Each gang layout must store what ``layout: local`` stores for the same spec and seed (float64),
and a dead actor must give one error that names it, never a wrong number or a lost finished step.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
import torch
import zarr

from nsa_dist.client import Client
from nsa_dist.cluster.resources import check_resources
from nsa_dist.config import ClusterSpec, ExperimentSpec, SweepSpec
from nsa_dist.data import load_dataset
from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run, run_experiment, run_id
from nsa_dist.store import SpectrumStore

EXACT = 1e-10  # relative, float64
HESS = {"probes": 4, "top_k": 2, "rayleigh_k": 2, "density_probes": 2, "lanczos_steps": 4, "density_grid": 10}
# Hutch++ estimates on matrix_free (‖G‖_F² and what divides by it), and what needs the whole G (NaN on a gang)
ESTIMATED = ("gram_sq_frobenius", "alignment", "alignment_centered", "hessian_moments_I_exact", "hessian_I_eigenvalues")


def _with_layout(base: dict, layout: str, workers: int) -> ExperimentSpec:
    return ExperimentSpec.model_validate(
        {**base, "spectrum": {**base["spectrum"], "layout": layout, "workers": workers}}
    )


def _step_arrays(spec: ExperimentSpec) -> dict:
    data = load_dataset(spec.data, seed=spec.seed)
    plan = plan_run(spec, data)
    ck = list(Trainer(plan, data).train_until(3))[1]  # step 2: a trained state
    return SpectralAnalyzer(plan, data).analyze(ck).arrays()


def _differences(got: dict, ref: dict, skip: tuple[str, ...] = ()) -> list[str]:
    """What differs between two steps' arrays (relative to the reference's largest entry)."""
    out = []
    for name, r in ref.items():
        if name in skip:
            continue
        if name == "step_notes":  # the same reasons, but for the arrays a gang leaves to estimates
            mine, theirs = ({k: v for k, v in json.loads(n or "{}").items() if k not in skip} for n in (got[name], r))
            if mine != theirs:
                out.append(f"{name}: {mine!r} != {theirs!r}")
            continue
        if isinstance(r, str):
            if got.get(name) != r:
                out.append(f"{name}: {got.get(name)!r} != {r!r}")
            continue
        a, b = np.asarray(got[name], dtype=np.float64), np.asarray(r, dtype=np.float64)
        if a.shape != b.shape:
            out.append(f"{name}: shape {a.shape} != {b.shape}")
        elif not np.array_equal(np.isnan(a), np.isnan(b)):
            out.append(f"{name}: {int(np.isnan(a).sum())} NaN where local has {int(np.isnan(b).sum())}")
        elif np.isfinite(b).any():
            err = np.nanmax(np.abs(a - b)) / max(np.nanmax(np.abs(b)), 1e-300)
            if err > EXACT:
                out.append(f"{name}: differs by {err:.3e} relative")
    return out


# ---------------------------------------------------------------------- in process
@pytest.mark.parametrize("layout", ["block_rows", "matrix_free"])
def test_gang_with_more_members_than_points_equals_local(layout):
    """Finding 1: a gang of 4 members, 6 training points and 3 test points (and the Hessian over
    the same shards).  Before the fix the test spectrum was stored as NaN ("need 1 <= workers <=
    N") where local stores numbers, and a train set smaller than the gang failed the step."""
    base = {
        "name": "few",
        "data": {"n": 6, "n_test": 3},
        "model": {"depth": 2, "width": 8},
        "steps": 4,
        "record": {"every": 2},
        "spectrum": {"dtype": "float64", "k": 5, "test_points": True},
        "hessian": HESS,
    }
    ref = _step_arrays(_with_layout(base, "local", 1))
    for W in (4, 7):
        got = _step_arrays(_with_layout(base, layout, W))
        diff = _differences(got, ref, skip=ESTIMATED)
        assert not diff, f"{layout} on {W} workers vs local: " + "; ".join(diff)
        for name in ("eigenvalues_test", "energy_f_test", "eigenvalues", "hessian_moments"):
            assert np.isfinite(np.asarray(got[name], dtype=float)).all(), (layout, W, name, got[name])


def test_check_resources_counts_every_concurrent_trainer():
    """Finding 3: the cluster-totals check counted one trainer whatever ``trainers`` said: three
    concurrent runs' trainers of 2 CPUs beside 1 worker and a gang of 2 (9 CPUs) passed a 6-CPU
    cluster's totals."""
    cl = ClusterSpec(spectral_workers=1, worker_cpus=1, trainer_cpus=2)
    check_resources(cl, False, {"CPU": 9.0}, gang_members=2, trainers=3)  # exactly enough
    with pytest.raises(ValueError, match="CPU: needs 9, cluster has 6") as e:
        check_resources(cl, False, {"CPU": 6.0}, gang_members=2, trainers=3)
    # the message names what is counted and the knob that lowers the runs at once (a new user's
    # trial fixed the same error with max_concurrent_runs, which it did not name)
    assert "3 runs at once, a trainer each, 1 spectral worker(s), 2 gang member(s)" in str(e.value), e.value
    assert "cluster.max_concurrent_runs" in str(e.value), e.value


# ---------------------------------------------------------------------- on Ray
def _run_group(url: str, rid: str):
    return zarr.open_group(url, mode="r")[f"runs/{rid}"]


@pytest.mark.slow  # one Ray sweep of two runs (~25 s on 2 cores)
def test_gang_sweep_stores_local_numbers_and_a_dead_trainer_is_named(local_ray, tmp_path):
    """One sweep, two runs sharing one block_rows gang of 3 (N = 47, not a multiple of 3; 10
    outputs; 2 test points, fewer than the members).

    Run ``good``: every float array read back with zarr equals a ``layout: local`` run of the same
    spec.  Run ``victim``: its trainer is killed until Ray's restarts are spent (finding 2): the run
    fails naming its trainer — before the fix it said "a spectral-gang member died 2 times" and
    replaced the healthy gang twice — and the steps finished before stay stored."""
    from nsa_dist.cluster import SweepCoordinator

    base = {
        "name": "gt",
        "data": {"name": "digits", "n": 47, "n_test": 2, "target": "onehot"},
        "model": {"depth": 2, "width": 6},
        "steps": 40,
        "record": {"every": 4},
        "spectrum": {"dtype": "float64", "k": 9, "test_points": True, "layout": "block_rows", "workers": 3},
    }
    sweep = SweepSpec(
        name="gt",
        base=base,
        variants=[{"steps": 9}, {"steps": 40}],
        cluster={"spectral_workers": 1, "worker_cpus": 1, "max_retries": 1, "max_concurrent_runs": 2},
    )
    url = str(tmp_path / "s.zarr")
    coord = SweepCoordinator(sweep, url)
    good, victim = sorted(coord.runs.values(), key=lambda r: r.spec.steps)
    killed: list[int] = []

    def chaos(progress):  # kill the victim's trainer each time it is back, once it has a finished step
        if victim.trainer is None or victim.progress.status != "running" or victim.progress.done < 1:
            return
        if len(killed) < 3:
            try:
                pid = local_ray.get(victim.trainer.pid.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - dead for good (restarts spent)
                return
            if pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    coord.on_event = chaos
    out = {o.run_id: o for o in coord.run()}
    g_out, v_out = out[good.progress.run_id], out[victim.progress.run_id]
    assert g_out.status == "done", g_out
    assert v_out.status == "failed", v_out
    assert "trainer kept dying" in (v_out.reason or ""), f"killed {len(killed)} trainers; reason: {v_out.reason!r}"
    assert coord.replaced_gangs == 0, f"{coord.replaced_gangs} healthy gangs replaced for a dead trainer"
    kept = _run_group(url, victim.progress.run_id)["done"][:]
    assert kept.sum() >= 1, f"the victim's finished steps were lost: done = {kept}"

    # the good run against layout: local, read with zarr directly
    spec = next(s for s in sweep.expand() if run_id(s) == good.progress.run_id)
    local = _with_layout(spec.model_dump(mode="json"), "local", 1)
    ref_url = str(tmp_path / "ref.zarr")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the trainer actor: float32 sums in thread order (θ 4.9e-8 off outside xdist)
    try:
        assert run_experiment(local, SpectrumStore(ref_url)).status == "done"
    finally:
        torch.set_num_threads(threads)
    ga, gb = _run_group(url, run_id(spec)), _run_group(ref_url, run_id(local))
    assert ga["done"][:].all()
    names = [n for n in gb.array_keys() if np.asarray(gb[n][:]).dtype.kind == "f"]
    assert {"eigenvalues", "energy_y", "eigenvalues_test", "energy_f_test"} <= set(names), names
    diffs = []
    for name in names:
        a, b = np.asarray(ga[name][:], dtype=float), np.asarray(gb[name][:], dtype=float)
        if a.shape != b.shape:
            diffs.append(f"{name}: shape {a.shape} != {b.shape}")
        elif not np.array_equal(np.isnan(a), np.isnan(b)):
            diffs.append(f"{name}: {int(np.isnan(a).sum())} NaN on the gang, {int(np.isnan(b).sum())} local")
        elif np.isfinite(b).any():
            err = np.nanmax(np.abs(a - b)) / max(np.nanmax(np.abs(b)), 1e-300)
            if err > 1e-9:
                diffs.append(f"{name}: differs by {err:.3e} relative")
    assert not diffs, "block_rows on Ray vs local: " + "; ".join(diffs)


@pytest.mark.slow  # a Ray gang of 2 members (a few seconds)
def test_a_members_own_error_reaches_the_driver_as_in_process(local_ray):
    """Finding 4: on Ray a member's own error (here the KeyError of a key it does not hold) came
    back as Ray's ``RayTaskError(KeyError)``, which the step's diagnostics take for an
    infrastructure failure (re-raised: the run fails) where an in-process gang's same KeyError is
    a diagnostic's NaN with its reason.  A dead member stays Ray's error, and is the gang's."""
    from nsa_dist.cluster.gang import RayGang
    from nsa_dist.pipeline.diagnostics import is_infrastructure
    from nsa_dist.pipeline.layout import LocalGang, each
    from nsa_dist.pipeline.member import SpectralShard

    local = LocalGang([SpectralShard(), SpectralShard()])
    with pytest.raises(KeyError) as in_process:
        local.get([m.tiles_matmat("nothing", np.zeros(3)) for m in each(local)])
    assert not is_infrastructure(in_process.value)
    gang = RayGang(2, cpus=1)
    try:
        with pytest.raises(KeyError, match="holds nothing under 'nothing'") as on_ray:
            gang.members.get([m.tiles_matmat("nothing", np.zeros(3)) for m in each(gang.members)])
        assert not is_infrastructure(on_ray.value), (
            f"on Ray the member's KeyError arrives as {type(on_ray.value).__mro__[:3]}: taken for Ray's failure"
        )
        local_ray.kill(gang.actors[1], no_restart=True)
        # ray.kill returns before the actor is gone: a call may still be answered (a CI run got the
        # pids), so ask until the death is seen (30 s)
        deadline, died = time.monotonic() + 30, None
        while died is None and time.monotonic() < deadline:
            try:
                gang.members.get([m.pid() for m in each(gang.members)])
                time.sleep(0.2)
            except local_ray.exceptions.RayActorError as e:
                died = e
        assert died is not None, "the killed member still answered after 30 s"
        assert is_infrastructure(died) and gang.member_died(died)
    finally:
        gang.shutdown()


def _small_sweep(name: str, workers: int, n: int = 300) -> SweepSpec:
    base = {
        "name": name,
        "data": {"n": n, "n_test": 0},
        "model": {"depth": 2, "width": 8},
        "steps": 3,
        "record": {"every": 2},
        "spectrum": {"dtype": "float64", "k": 5, "layout": "block_rows", "workers": workers},
    }
    return SweepSpec(name=name, base=base, cluster={"spectral_workers": 1, "worker_cpus": 1})


@pytest.mark.slow  # the embedded Ray; no actor is started
def test_a_refused_sweep_gives_its_runs_back(local_ray, tmp_path):
    """Finding 5: a sweep refused before it starts (here its gang of 9 does not fit the 6-CPU
    cluster) kept its runs' writer leases for the rest of the process: the corrected sweep in the
    same Python session was refused with "is being written by another process" — its own pid."""
    from nsa_dist.cluster import SweepCoordinator
    from nsa_dist.store import LeaseHeld

    url = str(tmp_path / "s.zarr")
    with pytest.raises(ValueError, match="CPU: needs 11, cluster has 6"):
        SweepCoordinator(_small_sweep("refused", 9), url).run()
    # its runs read pending with why (audit Q: "pending 0/7" and no word, as if queued)
    for row in Client(url).runs().to_dict("records"):
        assert row["status"] == "pending" and "not started" in row["reason"], row
        assert "CPU: needs 11, cluster has 6" in row["reason"], row
    try:
        again = SweepCoordinator(_small_sweep("refused", 9), url)  # e.g. with a corrected cluster block
    except LeaseHeld as exc:
        pytest.fail(f"the refused sweep still holds its runs: {exc}")
    again.close()


@pytest.mark.slow  # the embedded Ray; no actor is started
def test_a_gang_that_only_fits_one_member_per_machine_is_refused_on_one_node(local_ray, tmp_path, monkeypatch):
    """Finding 6: on a one-node Ray (an embedded ``nsa sweep``) every gang member's tiles share this
    machine, but the sweep weighed one member's: W = 4 members needing twice the machine together
    were started (at full size: killed for memory step after step, the run failing as "a
    spectral-gang member died").  The machine's size is set between one member's need and the
    gang's, so that nothing large is allocated if the check is missing."""
    from nsa_dist.cluster import SweepCoordinator
    from nsa_dist.errors import ResourceError
    from nsa_dist.pipeline import layout as layout_mod
    from nsa_dist.pipeline.budget import footprint

    sweep = _small_sweep("onenode", 4, n=1500)
    (spec,) = sweep.expand()
    one, gang = footprint(spec).total, footprint(spec, True).total
    assert gang > 1.5 * one, (one, gang)  # the gang needs much more than one member
    monkeypatch.setattr(layout_mod, "_machine_bytes", lambda: (one + gang) / 2)
    url = str(tmp_path / "s.zarr")
    coord = SweepCoordinator(sweep, url)  # one member fits: accepted here
    with pytest.raises(
        ResourceError, match=r"gang of 4 spectral workers \(block_rows\) all run on this Ray cluster's one"
    ):
        outcome = coord.run()
        pytest.fail(f"the sweep ran: {outcome}")
    monkeypatch.undo()
    SweepCoordinator(sweep, url).close()  # and its runs were given back
