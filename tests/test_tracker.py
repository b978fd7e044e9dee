"""The Tracker (issue 12 §1): a user's loop records the same arrays as ``nsa run``, in-process and on Ray."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from nsa_dist import Client, Tracker
from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.errors import NonFiniteError, ShapeError, StoreError
from nsa_dist.models import build_model, cnn
from nsa_dist.pipeline import run_experiment, run_id
from nsa_dist.store import SpectrumStore
from conftest import local_ray_fixture

SPECTRUM = {"k": 10, "images": [1, 2], "image_size": 6, "fourier_size": 5}
SPEC = ExperimentSpec(name="eq", data={"n": 40}, model={"depth": 3, "width": 16}, steps=24, record={"every": 6},
                      spectrum=SPECTRUM)
COMPARE = ("theta", "f", "df", "df_pred", "f_test", "eigenvalues", "eigenvectors", "energy_y", "energy_f",
           "energy_residual", "energy_df", "energy_df_pred", "first_order_error", "first_order_cos", "alignment",
           "loss", "lr", "done")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``nsa run`` of SPEC (GD, image2d), the arrays every tracker run must reproduce."""
    url = str(tmp_path_factory.mktemp("ref") / "ref.zarr")
    assert run_experiment(SPEC, SpectrumStore(url)).status == "done"
    return Client(url).run(run_id(SPEC))


def _gd_loop(tr: Tracker, model, X, y, steps: int, lr: float, stop: int | None = None) -> None:
    """The user's own loop: full-batch GD on L = (1/N) Σ ½(f − y)², as nsa's trainer does."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    X, y = torch.as_tensor(X, dtype=torch.float32), torch.as_tensor(y, dtype=torch.float32)
    for t in range(steps if stop is None else stop):
        opt.zero_grad()
        loss = 0.5 * ((model(X) - y) ** 2).reshape(X.shape[0], -1).sum(1).mean()
        if tr.due(t):
            tr.record(t, lr=lr, loss=loss.item())
        else:
            tr.log(t, loss.item())
        loss.backward()
        opt.step()


def _assert_same(ref, run, names=COMPARE) -> None:
    for name in names:
        a, b = ref.g[name][:], run.g[name][:]
        assert a.shape == b.shape, f"{name}: shape {b.shape} != {a.shape}"
        if not np.array_equal(a, b, equal_nan=True):
            diff = np.nanmax(np.abs(a.astype(np.float64) - b.astype(np.float64)))
            raise AssertionError(f"{name}: tracker differs from nsa run by up to {diff:.3e}")


def _tracker(url: str, name: str = "eq", model=None, **kw) -> tuple[Tracker, torch.nn.Module, object]:
    data = load_dataset(SPEC.data, seed=SPEC.seed)
    model = model if model is not None else build_model(SPEC.model, seed=SPEC.seed)
    args = dict(steps=SPEC.steps, record={"every": 6}, spectrum=SPECTRUM, optimizer="gd")
    return Tracker(url, name, model, data.X, data.y, **{**args, **kw}), model, data


# ---------------------------------------------------------------------- in-process
def test_in_process_tracker_records_what_nsa_run_records(tmp_path, reference):
    url = str(tmp_path / "t.zarr")
    tr, model, data = _tracker(url, max_inflight=1)
    _gd_loop(tr, model, data.X, data.y, SPEC.steps, SPEC.schedule.lr)
    tr.close()
    run = Client(url).run("eq")
    assert run.status == "done"
    _assert_same(reference, run)
    np.testing.assert_array_equal(run.g["loss_trace"][:], reference.g["loss_trace"][:])
    assert tr.max_seen_inflight <= 1
    assert Client(url).runs()["id"].tolist() == ["eq"]


def test_custom_optimizer_uses_the_jacobian_of_the_update(tmp_path, reference):
    """optimizer='custom' predicts Δf by J_t Δθ_t: for GD it matches the closed form to rounding."""
    url = str(tmp_path / "t.zarr")
    tr, model, data = _tracker(url, optimizer="custom")
    _gd_loop(tr, model, data.X, data.y, SPEC.steps, SPEC.schedule.lr)
    tr.close()
    run = Client(url).run("eq")
    _assert_same(reference, run, ("theta", "f", "df", "eigenvalues", "energy_y"))
    a, b = reference.g["df_pred"][:], run.g["df_pred"][:]
    rel = np.linalg.norm(a - b) / np.linalg.norm(a)
    assert rel < 1e-3, f"J·Δθ vs −δ/N·G·m: relative difference {rel:.2e}"


def test_reopened_tracker_continues_the_run(tmp_path, reference):
    url = str(tmp_path / "t.zarr")
    tr, model, data = _tracker(url)
    _gd_loop(tr, model, data.X, data.y, SPEC.steps, SPEC.schedule.lr, stop=13)  # records 0, 6, 12 (12 pending)
    tr.close()
    assert Client(url).run("eq").status == "pending"
    assert list(np.flatnonzero(Client(url).run("eq").g["done"][:])) == [0, 1, 2]
    # a new process: the user restores θ at the tracker's resume step and trains on
    model2 = build_model(SPEC.model, seed=123)
    tr2, _, _ = _tracker(url, model=model2)
    t0 = tr2.resume_step
    assert t0 == 12
    torch.nn.utils.vector_to_parameters(torch.as_tensor(tr2.theta_at(t0)), model2.parameters())
    opt = torch.optim.SGD(model2.parameters(), lr=SPEC.schedule.lr)
    X, y = torch.as_tensor(data.X, dtype=torch.float32), torch.as_tensor(data.y, dtype=torch.float32)
    for t in range(t0, SPEC.steps):
        opt.zero_grad()
        loss = 0.5 * ((model2(X) - y) ** 2).mean()
        if tr2.due(t):
            tr2.record(t, lr=SPEC.schedule.lr)
        loss.backward()
        opt.step()
    tr2.close()
    run = Client(url).run("eq")
    assert run.status == "done"
    _assert_same(reference, run, ("theta", "f", "eigenvalues", "energy_y", "loss", "done"))


def test_clear_errors(tmp_path):
    url = str(tmp_path / "t.zarr")
    data = load_dataset(SPEC.data, seed=0)
    model = build_model(SPEC.model, seed=0)
    kw = dict(steps=10, record={"every": 5}, spectrum={"k": 5})
    with pytest.raises(ShapeError, match=r"y must have shape \(40,\)"):
        Tracker(url, "e", model, data.X, data.y[:30], **kw)
    with pytest.raises(ShapeError, match=r"X must have shape"):
        Tracker(url, "e", model, data.X[:, 0], data.y, **kw)
    with pytest.raises(ShapeError, match=r"must map \(n, …\) inputs to \(n,\) or \(n, K\)"):
        Tracker(url, "e", torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Unflatten(1, (3, 1))),
                data.X, data.y, **kw)
    with pytest.raises(ShapeError, match="X_test, y_test"):
        Tracker(url, "e", model, data.X, data.y, np.zeros((3, 5)), np.zeros(3), **kw)
    Tracker(url, "e", model, data.X, data.y, **kw).close()
    with pytest.raises(StoreError, match="different spec"):
        Tracker(url, "e", model, data.X, data.y + 1.0, **kw)  # same name, other data
    with pytest.raises(StoreError, match="different spec"):
        Tracker(url, "e", build_model(SPEC.model.model_copy(update={"width": 8}), seed=0), data.X, data.y, **kw)


def test_nan_loss_fails_the_run_and_keeps_recorded_steps(tmp_path):
    url = str(tmp_path / "t.zarr")
    tr, model, data = _tracker(url)
    _gd_loop(tr, model, data.X, data.y, SPEC.steps, SPEC.schedule.lr, stop=7)  # records 0 and 6 (6 pending)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    with pytest.raises(NonFiniteError, match="marked failed.*2 steps recorded"):
        tr.record(12, lr=0.1, loss=float("nan"))
    run = Client(url).run("eq")
    assert run.status == "failed" and run.g["done"][:2].all() and not run.g["done"][2]
    assert run.failed_step == 12 and "loss is nan" in run.reason
    assert np.isfinite(run.g["eigenvalues"][:2]).all()
    assert np.isnan(run.g["first_order_error"][1])  # step 6's update was never seen: its first-order metrics are NaN


def test_image_inputs_with_a_cnn(tmp_path):
    """(N, C, H, W) inputs, K = 3 outputs, a user's Adam loop; G_t = the per-layer NTK of the stored θ_t."""
    from nsa_dist.ntk import gram

    torch.manual_seed(0)
    X, y = torch.randn(24, 2, 8, 8), torch.randn(24, 3)
    model = cnn(in_channels=2, image_size=8, channels=(3,), hidden=(8,), output_dim=3)
    url = str(tmp_path / "t.zarr")
    tr = Tracker(url, "cnn", model, X, y, X[:5], y[:5], steps=6, record={"every": 3}, spectrum={"k": "all"})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for t in range(6):
        if tr.due(t):
            tr.record(t, lr=1e-2)
        opt.zero_grad()
        ((model(X) - y) ** 2).mean().backward()
        opt.step()
    tr.close()
    run = Client(url).run("cnn")
    assert run.status == "done" and run.g["X"].shape == (24, 128) and run.g["f_test"].shape == (3, 5, 3)
    check = cnn(in_channels=2, image_size=8, channels=(3,), hidden=(8,), output_dim=3).double()
    torch.nn.utils.vector_to_parameters(torch.as_tensor(run.g["theta"][2], dtype=torch.float64), check.parameters())
    evals = np.linalg.eigvalsh(gram(check, X.double(), method="jacobian").numpy())[::-1]
    np.testing.assert_allclose(run.g["eigenvalues"][2], evals, rtol=1e-4, atol=1e-6 * evals[0])
    assert np.isfinite(run.g["first_order_error"][:2]).all()


# ---------------------------------------------------------------------- local Ray
local_ray = local_ray_fixture(num_cpus=3)


@pytest.mark.slow
def test_ray_tracker_records_what_nsa_run_records_and_does_not_block(local_ray, tmp_path, reference):
    url = str(tmp_path / "t.zarr")
    tr, model, data = _tracker(url, cluster="auto", workers=2, max_inflight=2)
    opt = torch.optim.SGD(model.parameters(), lr=SPEC.schedule.lr)
    X, y = torch.as_tensor(data.X, dtype=torch.float32), torch.as_tensor(data.y, dtype=torch.float32)
    queued_after_return = []
    for t in range(SPEC.steps):
        opt.zero_grad()
        loss = 0.5 * ((model(X) - y) ** 2).mean()
        if tr.due(t):
            tr.record(t, lr=SPEC.schedule.lr, loss=loss.item())
        loss.backward()
        opt.step()
        if t % 6 == 1:  # the step recorded at t − 1 was handed over on this step's due(); training goes on
            queued_after_return.append(tr.inflight)
    tr.close()
    run = Client(url).run("eq")
    assert run.status == "done"
    _assert_same(reference, run)
    assert tr.max_seen_inflight <= 2, f"queue bound exceeded: {tr.max_seen_inflight} in flight"
    assert max(queued_after_return) >= 1, "training never ran while an analysis was in flight"


@pytest.mark.slow
def test_killed_ray_worker_step_is_recomputed(local_ray, tmp_path, reference):
    url = str(tmp_path / "t.zarr")
    tr, model, data = _tracker(url, cluster="auto", workers=1, max_inflight=2)
    (pid,) = tr.pool.pids
    opt = torch.optim.SGD(model.parameters(), lr=SPEC.schedule.lr)
    X, y = torch.as_tensor(data.X, dtype=torch.float32), torch.as_tensor(data.y, dtype=torch.float32)
    killed = False
    for t in range(SPEC.steps):
        opt.zero_grad()
        loss = 0.5 * ((model(X) - y) ** 2).mean()
        if tr.due(t):
            tr.record(t, lr=SPEC.schedule.lr)
        loss.backward()
        opt.step()
        if t == 7 and not killed:  # step 6 was just handed over on due(7)
            assert tr.inflight >= 1
            os.kill(pid, signal.SIGKILL)
            killed = True
    tr.close()
    assert tr.resubmitted >= 1, "the dead worker's step was not re-sent"
    run = Client(url).run("eq")
    assert run.status == "done"
    _assert_same(reference, run)


def test_lightning_callback_is_optional():
    import importlib.util

    import nsa_dist.lightning as nl

    if importlib.util.find_spec("lightning") or importlib.util.find_spec("pytorch_lightning"):
        assert hasattr(nl, "SpectrumCallback")
    else:
        from nsa_dist.errors import MissingDependencyError

        with pytest.raises(MissingDependencyError, match="pip install lightning"):
            nl.SpectrumCallback  # noqa: B018


def test_cli_and_figures_read_a_tracked_run(tmp_path):
    """``nsa ls/show/plot`` treat a tracked run like any other."""
    import subprocess
    import sys
    from pathlib import Path

    url = str(tmp_path / "t.zarr")
    tr, model, data = _tracker(url, name="cli")
    _gd_loop(tr, model, data.X, data.y, SPEC.steps, SPEC.schedule.lr)
    tr.close()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    nsa = [sys.executable, "-m", "nsa_dist.cli"]
    r = subprocess.run(nsa + ["ls", "--store", url], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "cli" in r.stdout and "done" in r.stdout, r.stderr
    r = subprocess.run(nsa + ["show", "cli", "--store", url], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "FCNet" in r.stdout and "λ_max" in r.stdout, r.stderr
    r = subprocess.run(nsa + ["plot", "cli", "--store", url, "--out", str(tmp_path / "figs")], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0 and list((tmp_path / "figs").glob("*.png")), r.stderr


def test_unpicklable_model_is_refused_with_a_clear_error(tmp_path):
    import threading

    model = build_model(SPEC.model, seed=0)
    model.lock = threading.Lock()  # e.g. a module holding a lock or an open file
    with pytest.raises(TypeError, match="cannot be copied or pickled.*keep unpicklable state"):
        _tracker(str(tmp_path / "t.zarr"), model=model)


def test_cross_entropy_tracker_records_what_nsa_run_records(tmp_path):
    """loss='cross_entropy': the user's CE loop records nsa run's arrays (loss, m_t, the Hessian of CE)."""
    spec = ExperimentSpec(name="ce", loss="cross_entropy", data={"name": "digits", "n": 10, "target": "onehot"},
                          model={"depth": 2, "width": 4}, steps=7, record={"every": 3}, schedule={"lr": 0.5},
                          spectrum={"k": 6, "images": []},
                          hessian={"probes": 4, "rayleigh_k": 0, "top_k": 0, "density": False, "additivity": False})
    ref_url, url = str(tmp_path / "ref.zarr"), str(tmp_path / "t.zarr")
    assert run_experiment(spec, SpectrumStore(ref_url)).status == "done"
    ref = Client(ref_url).run(run_id(spec))
    data = load_dataset(spec.data, seed=spec.seed)
    model = build_model(spec.model, seed=spec.seed)
    tr = Tracker(url, "ce", model, data.X, data.y, steps=7, record={"every": 3}, spectrum={"k": 6, "images": []},
                 hessian=spec.hessian.model_dump(), optimizer="gd", loss="cross_entropy")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    X, y = torch.as_tensor(data.X, dtype=torch.float32), torch.as_tensor(data.y, dtype=torch.float32)
    for t in range(7):
        opt.zero_grad()
        loss = -(y * torch.log_softmax(model(X), -1)).sum(1).mean()
        if tr.due(t):
            tr.record(t, lr=0.5, loss=loss.item())
        else:
            tr.log(t, loss.item())
        loss.backward()
        opt.step()
    tr.close()
    run = Client(url).run("ce")
    assert run.status == "done" and run.spec.loss.value == "cross_entropy"
    for name in ("theta", "f", "loss", "energy_residual", "hessian_moments_I_exact", "hessian_trace_S_G"):
        np.testing.assert_allclose(run.g[name][:], ref.g[name][:], rtol=1e-5, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(run.residual(0), ref.residual(0), rtol=1e-6)
    with pytest.raises(ValueError, match="loss='hinge' is not one of"):
        Tracker(str(tmp_path / "x.zarr"), "x", model, data.X, data.y, steps=3, loss="hinge")
