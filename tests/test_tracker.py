"""The Tracker (issue 12 §1): a user's loop records the same arrays as ``nsa run``, in-process and on Ray."""

from __future__ import annotations

import copy
import os
import signal
import time

import numpy as np
import pytest
import torch

from nsa_dist import Client, Tracker
from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.errors import (
    AnalysisError,
    ModelForwardError,
    NonFiniteError,
    ShapeError,
    StoreError,
    UnsupportedModelError,
)
from nsa_dist.models import build_model, cnn
from nsa_dist.pipeline import run_experiment, run_id
from nsa_dist.store import SpectrumStore

SPECTRUM = {"k": 10, "images": [1, 2], "image_size": 6, "fourier_size": 5}
SPEC = ExperimentSpec(
    name="eq", data={"n": 40}, model={"depth": 3, "width": 16}, steps=24, record={"every": 6}, spectrum=SPECTRUM
)
COMPARE = (
    "theta",
    "f",
    "df",
    "df_pred",
    "f_test",
    "eigenvalues",
    "eigenvectors",
    "energy_y",
    "energy_f",
    "energy_residual",
    "energy_df",
    "energy_df_pred",
    "first_order_error",
    "first_order_cos",
    "alignment",
    "loss",
    "lr",
    "done",
)


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
class _Column(torch.nn.Module):
    """The reference network with a one-column output, (n, 1), as a final ``nn.Linear(…, 1)`` gives."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x).unsqueeze(1)


def test_one_column_output_records_what_nsa_run_records(tmp_path, reference):
    """A model with (n, 1) outputs and y of shape (N, 1) — the most common regression net — is
    measured as the scalar function it is: the same arrays as ``nsa run`` of the (n,) network."""
    url = str(tmp_path / "c.zarr")
    data = load_dataset(SPEC.data, seed=SPEC.seed)
    model = _Column(build_model(SPEC.model, seed=SPEC.seed))
    y = data.y.reshape(-1, 1)
    tr = Tracker(
        url,
        "eq",
        model,
        data.X,
        y,
        steps=SPEC.steps,
        record={"every": 6},
        spectrum=SPECTRUM,
        optimizer="gd",
        max_inflight=1,
    )
    _gd_loop(tr, model, data.X, y, SPEC.steps, SPEC.schedule.lr)
    tr.close()
    run = Client(url).run("eq")
    assert run.status == "done"
    _assert_same(reference, run)
    with pytest.raises(ShapeError, match=r"\(40,\) or \(40, 1\)"):
        Tracker(str(tmp_path / "bad.zarr"), "b", model, data.X, data.y[:-1], steps=4)


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
    rows = Client(url).runs()
    assert rows["id"].tolist() == ["eq"]
    # the loop set the rates: the spec's placeholder schedule and optimizer settings are no column
    # values to filter on (a tracked Adam run at lr 1e-3 was listed, and matched, as schedule.lr 0.25)
    assert rows["schedule.lr"].isna().all() and rows["optimizer.betas"].isna().all(), rows.iloc[0].to_dict()
    assert rows["optimizer.name"].tolist() == ["gd"] and rows["data.name"].tolist() == ["arrays"]


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
    two = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    labels = (data.y > 0).astype(np.int64)  # integer classes for a 2-output cross-entropy network
    with pytest.raises(ShapeError, match=r"got \(40,\) — class labels\? one-hot them first: .*one_hot\(labels, 2\)"):
        Tracker(url, "e", two, data.X, labels, loss="cross_entropy", **kw)
    with pytest.raises(ShapeError, match=r"must map \(n, …\) inputs to \(n,\) or \(n, K\)"):
        Tracker(
            url, "e", torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Unflatten(1, (3, 1))), data.X, data.y, **kw
        )
    with pytest.raises(ShapeError, match="X_test, y_test"):
        Tracker(url, "e", model, data.X, data.y, np.zeros((3, 5)), np.zeros(3), **kw)
    # test points are checked as the training points are (NaN in X_test stored NaN test spectra
    # and a note blaming the learning rate; inf in y_test an inf test loss, without a word)
    Xt, yt = data.X[:5].copy(), data.y[:5].copy()
    Xt[3, 1], yt[2] = np.nan, np.inf
    with pytest.raises(NonFiniteError, match=r"X_test holds 1 NaN/inf entries \(the first in point 3\)"):
        Tracker(url, "e", model, data.X, data.y, Xt, data.y[:5], **kw)
    with pytest.raises(NonFiniteError, match=r"y_test holds 1 NaN/inf entries \(the first in point 2\)"):
        Tracker(url, "e", model, data.X, data.y, data.X[:5], yt, **kw)
    # float64 inputs finite only in float64 (an audit: "x holds 1 NaN/inf entries … lower the learning rate")
    big = np.asarray(data.X, np.float64).copy()
    big[7, 0] = 1e39
    said = r"X is torch.float64 and 1 of its entries overflow the model's torch.float32 \(the first in point 7"
    with pytest.raises(NonFiniteError, match=said):
        Tracker(url, "e", model, big, data.y, **kw)
    with pytest.raises(NonFiniteError, match=said.replace("X is", "X_test is").replace("point 7", "point 2")):
        Tracker(url, "e", model, data.X, data.y, big[5:10], data.y[:5], **kw)
    # integer features (a uint8 pixel CSV) for a float network: torch's "mat1 and mat2 must have the same dtype"
    pixels = (data.X * 255).astype(np.uint8)
    with pytest.raises(TypeError, match=r"X is torch.uint8: integer inputs are kept as token ids.*pass X.float\(\)"):
        Tracker(url, "e", model, pixels, data.y, **kw)
    assert not SpectrumStore(url).has_run("e")
    # a fresh module with dropout (train mode) ending in Linear(·, 1): named as the user's model names
    # it ('2'), not through the (n, 1) → (n,) wrapper ('model.2')
    drop = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    with pytest.raises(UnsupportedModelError, match=r"dropout in train mode: '2'\)"):
        Tracker(url, "e", drop, data.X, data.y, **kw)
    Tracker(url, "e", model, data.X, data.y, **kw).close()
    with pytest.raises(StoreError, match=r"'e' .* was recorded from other arrays: X, y, X_test, y_test hash to sha1:"):
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
    assert "step 6's update Δθ_t is not known" in run.notes[6]["first_order_error"], run.notes  # and say why


def test_a_nan_loss_given_to_log_fails_the_run_at_its_step(tmp_path):
    """log(7, nan) and log(8, nan) were taken silently, the failure said at the next record (step 9)."""
    url = str(tmp_path / "t.zarr")
    tr, model, data = _tracker(url)
    _gd_loop(tr, model, data.X, data.y, SPEC.steps, SPEC.schedule.lr, stop=8)  # records 0 and 6
    with torch.no_grad():
        next(model.parameters())[0].fill_(float("nan"))  # the update diverged
    with pytest.raises(
        NonFiniteError, match=r"loss is nan at step 8, with non-finite parameters .*; the run is marked"
    ):
        tr.log(8, float("nan"))
    run = Client(url).run("eq")
    assert run.status == "failed" and run.failed_step == 8 and run.g["done"][:2].all(), (run.status, run.failed_step)
    assert np.isnan(run.g["loss_trace"][8]) and np.isfinite(run.g["loss_trace"][:8]).all()
    with pytest.raises(ValueError, match=r"this Tracker is closed \(it ended the run at step 8: loss is nan"):
        tr.log(9, 0.1)  # the loop goes on: the error says why the Tracker closed


def test_an_interrupted_loop_keeps_the_losses_logged_after_its_last_record(tmp_path):
    """An exception at step 13 of a loop recording every 5 and logging every step: the losses of steps
    11 and 12 (logged after the record of 10) were NaN in the stored loss curve (an audit); the
    interrupt at interpreter exit takes the same path."""
    url = str(tmp_path / "t.zarr")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    X = torch.randn(32, 3, generator=torch.Generator().manual_seed(1))
    y = torch.sin(X.sum(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = {}
    with pytest.raises(RuntimeError, match="a crash at 13"):
        with Tracker(url, "r", model, X, y, steps=30, record={"every": 5}, spectrum={"k": 4}, device="cpu") as tr:
            for t in range(30):
                if t == 13:
                    raise RuntimeError("a crash at 13")
                loss = 0.5 * ((model(X).squeeze(-1) - y) ** 2).mean()
                if tr.due(t):
                    tr.record(t, lr=0.1)
                opt.zero_grad()
                loss.backward()
                opt.step()
                tr.log(t, loss.item())
                logged[t] = loss.item()
    run = Client(url).run("r")
    trace = np.asarray(run.loss_trace)
    assert run.status == "interrupted" and list(run.steps) == [0, 5, 10], (run.status, run.steps)
    np.testing.assert_array_equal(trace[:13], [logged[t] for t in range(13)], err_msg="logged losses lost")
    assert np.isnan(trace[13:]).all()


def test_a_skipped_non_finite_batch_leaves_the_run_going(tmp_path):
    """A loop that skips a batch whose loss is NaN (θ untouched) lost its run: log() failed it ("training
    diverged") and every later call raised "this Tracker is closed" into the loop (an audit).  With finite
    parameters the NaN stays in the loss curve and the run goes on."""
    url = str(tmp_path / "t.zarr")
    tr, model, data = _tracker(url)
    opt = torch.optim.SGD(model.parameters(), lr=SPEC.schedule.lr)
    X, y = torch.as_tensor(data.X, dtype=torch.float32), torch.as_tensor(data.y, dtype=torch.float32)
    for t in range(SPEC.steps):
        opt.zero_grad()
        loss = 0.5 * ((model(X) - y) ** 2).reshape(X.shape[0], -1).sum(1).mean() * (float("nan") if t == 3 else 1.0)
        if tr.due(t):
            tr.record(t, lr=SPEC.schedule.lr, loss=loss.item())
        else:
            tr.log(t, loss.item())
        if torch.isfinite(loss):
            loss.backward()
            opt.step()
    tr.close()
    run = Client(url).run("eq")
    assert run.status == "done" and run.g["done"][:].all(), (run.status, run.g["done"][:])
    trace = np.asarray(run.g["loss_trace"][:])
    assert np.isnan(trace[3]) and np.isfinite(np.delete(trace, 3)).all(), trace


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


def _until_analysing(tr, timeout: float = 120.0) -> bool:
    """True once the Tracker's Ray worker is running an analysis (sent, not finished); False when
    every step handed over came back first (a test process descheduled for as long as an analysis
    takes sees none running)."""
    import ray

    deadline = time.time() + timeout
    while time.time() < deadline:
        tr._collect(False)  # takes finished summaries; the pool hands queued steps to its idle worker
        refs = list(tr.pool.running)
        if refs and not ray.wait(refs, timeout=0)[0]:
            return True
        if not tr.inflight:
            return False
        time.sleep(0.005)
    raise AssertionError(f"the analyses handed over neither ran nor came back in {timeout:.0f} s")


def _train_killing_once(tr, model, data, killed: list[int]) -> None:
    """SPEC's GD loop under ``tr``, then ``close()``; once, at t = 7, 13 or 19 (step t − 1 was just handed
    over on due(t)), SIGKILL the Ray worker while it analyses a step (not while idle), the step it ran
    appended to ``killed`` (kept when a later call raises)."""
    (pid,) = tr.pool.pids
    opt = torch.optim.SGD(model.parameters(), lr=SPEC.schedule.lr)
    X, y = torch.as_tensor(data.X, dtype=torch.float32), torch.as_tensor(data.y, dtype=torch.float32)
    for t in range(SPEC.steps):
        opt.zero_grad()
        loss = 0.5 * ((model(X) - y) ** 2).mean()
        if tr.due(t):
            tr.record(t, lr=SPEC.schedule.lr)
        loss.backward()
        opt.step()
        if t in (7, 13, 19) and not killed:
            assert tr.inflight >= 1
            if _until_analysing(tr):
                killed += [a.step for a in tr.pool.running.values()]  # one worker: the step it runs
                os.kill(pid, signal.SIGKILL)
    tr.close()


@pytest.mark.slow
def test_killed_ray_worker_step_is_recomputed(local_ray, tmp_path, reference):
    url = str(tmp_path / "t.zarr")
    tr, model, data = _tracker(url, cluster="auto", workers=1, max_inflight=2)
    killed: list[int] = []
    _train_killing_once(tr, model, data, killed)
    assert killed, "no analysis of steps 6, 12, 18 was caught running on the Ray worker: none killed"
    assert tr.resubmitted >= 1, "the dead worker's step was not re-sent"
    run = Client(url).run("eq")
    assert run.status == "done"
    _assert_same(reference, run)


@pytest.mark.slow
def test_ray_worker_that_dies_past_max_retries_fails_its_step_with_the_cause(local_ray, tmp_path):
    """``max_retries=0``: one kill of the worker mid-analysis fails that step's analysis.  The loop gets
    one AnalysisError naming the death and the budget (the pool's release of a dead worker's step
    raised Ray's raw RayActorError from its pid probe before), and the run is failed with it."""
    url = str(tmp_path / "t.zarr")
    tr, model, data = _tracker(url, cluster="auto", workers=1, max_inflight=2, max_retries=0)
    killed: list[int] = []
    with pytest.raises(AnalysisError) as err:
        _train_killing_once(tr, model, data, killed)
    assert killed, "no analysis of steps 6, 12, 18 was caught running on the Ray worker: none killed"
    msg = str(err.value)
    assert "spectral worker died once (max_retries=0)" in msg and f"recorded step {killed[0]}" in msg, msg
    run = Client(url).run("eq")
    assert run.status == "failed" and "died once" in (run.reason or ""), (run.status, run.reason)


def test_tracker_refuses_a_negative_max_retries(tmp_path):
    with pytest.raises(ValueError, match="max_retries must be an integer >= 0, got -1"):
        _tracker(str(tmp_path / "t.zarr"), max_retries=-1)


def test_lightning_callback_is_optional():
    import importlib.util

    import nsa_dist.lightning as nl

    if importlib.util.find_spec("lightning") or importlib.util.find_spec("pytorch_lightning"):
        assert hasattr(nl, "SpectrumCallback")
    else:
        from nsa_dist.errors import MissingDependencyError

        with pytest.raises(MissingDependencyError, match="pip install lightning"):
            nl.SpectrumCallback  # noqa: B018


def test_cli_and_figures_read_a_tracked_run(tmp_path, capsys):
    """``nsa ls/show/plot`` treat a tracked run like any other."""
    from nsa_dist.cli import main as nsa

    url = str(tmp_path / "t.zarr")
    tr, model, data = _tracker(url, name="cli")
    _gd_loop(tr, model, data.X, data.y, SPEC.steps, SPEC.schedule.lr)
    tr.close()
    capsys.readouterr()
    assert nsa(["ls", "--store", url]) == 0
    r = capsys.readouterr()
    assert "cli" in r.out and "done" in r.out, r.err
    assert nsa(["show", "cli", "--store", url]) == 0
    r = capsys.readouterr()
    assert "FCNet" in r.out and "λ_max" in r.out, r.err
    assert nsa(["plot", "cli", "--store", url, "--out", str(tmp_path / "figs")]) == 0, capsys.readouterr().err
    assert list((tmp_path / "figs").glob("*.png"))


def test_unpicklable_model_is_refused_with_a_clear_error(tmp_path):
    import threading

    model = build_model(SPEC.model, seed=0)
    model.lock = threading.Lock()  # e.g. a module holding a lock or an open file
    with pytest.raises(TypeError, match="cannot be copied or pickled.*keep unpicklable state"):
        _tracker(str(tmp_path / "t.zarr"), model=model)


def test_cross_entropy_tracker_records_what_nsa_run_records(tmp_path):
    """loss='cross_entropy': the user's CE loop records nsa run's arrays (loss, m_t, the Hessian of CE)."""
    spec = ExperimentSpec(
        name="ce",
        loss="cross_entropy",
        data={"name": "digits", "n": 10, "target": "onehot"},
        model={"depth": 2, "width": 4},
        steps=7,
        record={"every": 3},
        schedule={"lr": 0.5},
        spectrum={"k": 6, "images": []},
        hessian={"probes": 4, "rayleigh_k": 0, "top_k": 0, "density": False, "additivity": False},
    )
    ref_url, url = str(tmp_path / "ref.zarr"), str(tmp_path / "t.zarr")
    assert run_experiment(spec, SpectrumStore(ref_url)).status == "done"
    ref = Client(ref_url).run(run_id(spec))
    data = load_dataset(spec.data, seed=spec.seed)
    model = build_model(spec.model, seed=spec.seed)
    tr = Tracker(
        url,
        "ce",
        model,
        data.X,
        data.y,
        steps=7,
        record={"every": 3},
        spectrum={"k": 6, "images": []},
        hessian=spec.hessian.model_dump(),
        optimizer="gd",
        loss="cross_entropy",
    )
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


# ---------------------------------------------------------------------- issue 17: the model as it is at step t
class Scaled(torch.nn.Module):
    """An MLP scaled by a buffer the user's loop changes, and by 3× that in eval mode: θ_t alone
    does not fix its kernel, its buffers and mode at t do (G ∝ scale²)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        s = self.scale if self.training else 3.0 * self.scale
        return s * self.net(x).squeeze(-1)


class Flaky(torch.nn.Module):
    """Runs in the user's float32 loop; its forward raises on the analysis's float64 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x):
        if x.dtype == torch.float64:
            raise ValueError("Flaky.forward refuses float64 inputs\n(a second line of detail)")
        return self.lin(x).squeeze(-1)


SEEN_DTYPES: list[torch.dtype] = []  # TokenNet's inputs (outside the module: measurements put its state back)


class TokenNet(torch.nn.Module):
    """Embedding of (n, T) token ids; refuses anything but integer ids, as nn.Embedding does."""

    def __init__(self, vocab: int = 10, T: int = 5) -> None:
        super().__init__()
        self.emb, self.lin = torch.nn.Embedding(vocab, 4), torch.nn.Linear(4 * T, 1)

    def forward(self, x):
        SEEN_DTYPES.append(x.dtype)
        if x.dtype != torch.long:
            raise TypeError(f"TokenNet takes int64 token ids, got {x.dtype}")
        return self.lin(self.emb(x).flatten(1)).squeeze(-1)


class FailsWhenMarked(torch.nn.Module):
    """Its float64 (analysis) forward raises where its buffer ``bad`` is set, and elsewhere waits
    until the file ``gate`` exists: one recorded step fails while an earlier one is still being
    analysed, however loaded the machine (a forward slowed by a fixed sleep could have ended first)."""

    def __init__(self, gate: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)
        self.register_buffer("bad", torch.zeros(()))
        self.gate = gate

    def forward(self, x):
        if x.dtype == torch.float64:
            if bool(self.bad):
                raise ValueError("this step's analysis fails")
            end = time.monotonic() + 300
            while not os.path.exists(self.gate) and time.monotonic() < end:
                time.sleep(0.01)
        return self.lin(x).squeeze(-1)


def _bn_cnn(**bn) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3),
        torch.nn.BatchNorm2d(3, **bn),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(3 * 16, 1),
        torch.nn.Flatten(0),
    )


def _state(model) -> tuple[dict, dict]:
    return ({k: b.clone() for k, b in model.named_buffers()}, {k: m.training for k, m in model.named_modules()})


def _assert_state(model, state, what: str) -> None:
    bufs, modes = state
    for k, b in model.named_buffers():
        assert torch.equal(b, bufs[k]), f"{what} changed the user's buffer {k}: {bufs[k]} -> {b}"
    assert {k: m.training for k, m in model.named_modules()} == modes, f"{what} changed the user's modes"


def _loop(
    tr: Tracker,
    model,
    X,
    y,
    steps: int,
    *,
    lr: float = 0.05,
    train: bool = True,
    record_eval: bool = False,
    after_step=None,
) -> dict[int, torch.nn.Module]:
    """A user's SGD loop (the model in train mode unless ``train`` is False); at each recorded step t
    the Tracker gets the model as it is — optionally switched to eval mode around record(t) — and a
    copy of it (θ_t, buffers_t, mode_t) is kept as the reference.  record() must leave the model as it was."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train(train)
    copies = {}
    for t in range(steps):
        opt.zero_grad()
        loss = ((model(X) - y) ** 2).mean()
        if tr.due(t):
            if record_eval:
                model.eval()
            copies[t] = copy.deepcopy(model)
            before = _state(model)
            tr.record(t, lr=lr)
            _assert_state(model, before, f"record({t})")
            model.train(train)
        else:
            tr.log(t, loss.item())
        loss.backward()  # the Tracker's forwards since this step's forward must not break its backward
        opt.step()
        if after_step is not None:
            after_step(model)
    return copies


def _assert_spectra(run, copies: dict, X, rtol: float) -> None:
    """The stored eigenvalues of each recorded step = those of gram() on the model as it was at record(t)."""
    from nsa_dist.ntk import gram

    for i, t in enumerate(sorted(copies)):
        ref = np.linalg.eigvalsh(gram(copies[t], X, dtype=torch.float64).numpy())[::-1]
        got = run.g["eigenvalues"][i]
        err = np.abs(got - ref).max() / ref[0]
        assert err <= rtol, (
            f"step {t}: stored λ differ from gram() at θ_t, buffers_t, mode_t by {err:.2e} (λ₁ "
            f"{got[0]:.6g} vs {ref[0]:.6g})"
        )


def test_buffers_and_modes_of_step_t_are_analysed(tmp_path):
    """Built in eval mode, trained in train mode with a buffer the loop changes: the analysis of step t
    uses the buffers and modes the model had at record(t), not those at construction."""
    torch.manual_seed(0)
    X, y = torch.randn(16, 3), torch.randn(16)
    model = Scaled().eval()
    url = str(tmp_path / "t.zarr")
    tr = Tracker(url, "s", model, X, y, steps=20, record={"steps": [0, 10, 19]}, spectrum={"k": "all", "images": []})
    copies = _loop(tr, model, X, y, 20, after_step=lambda m: m.scale.mul_(1.1))
    tr.close()
    run = Client(url).run("s")
    assert run.status == "done" and all(copies[t].training for t in copies)
    _assert_spectra(run, copies, X, rtol=1e-9)
    assert np.isfinite(run.g["first_order_error"][:2]).all()  # J·Δθ at θ_t, buffers_t, mode_t


def test_batchnorm_running_statistics_of_step_t_are_analysed(tmp_path):
    """A BatchNorm CNN built in train mode, trained in train mode and recorded in eval mode: step t is
    analysed with the running statistics of step t (and the Tracker's own forwards never advance them)."""
    torch.manual_seed(0)
    X, y = torch.randn(16, 2, 6, 6), torch.randn(16)
    model = _bn_cnn()
    url = str(tmp_path / "t.zarr")
    tr = Tracker(url, "bn", model, X, y, steps=20, record={"steps": [0, 10, 19]}, spectrum={"k": "all", "images": []})
    copies = _loop(tr, model, X, y, 20, record_eval=True)
    tr.close()
    assert int(model[1].num_batches_tracked) == 20, "the Tracker's forwards advanced the running statistics"
    assert not torch.equal(copies[0][1].running_mean, copies[19][1].running_mean)
    run = Client(url).run("bn")
    assert run.status == "done"
    _assert_spectra(run, copies, X, rtol=1e-9)


def test_batchnorm_in_train_mode_is_analysed_in_train_mode(tmp_path):
    """Built in eval mode, trained and recorded in train mode: step t's kernel is that of the batch
    forward in train mode (batch statistics), and record() leaves the running statistics alone."""
    torch.manual_seed(0)
    X, y = torch.randn(16, 2, 6, 6), torch.randn(16)
    model = _bn_cnn().eval()
    url = str(tmp_path / "t.zarr")
    tr = Tracker(url, "bnt", model, X, y, steps=20, record={"steps": [0, 10, 19]}, spectrum={"k": "all", "images": []})
    copies = _loop(tr, model, X, y, 20)
    tr.close()
    assert int(model[1].num_batches_tracked) == 20
    run = Client(url).run("bnt")
    assert run.status == "done"
    _assert_spectra(run, copies, X, rtol=1e-9)


def test_second_record_of_a_step_is_refused(tmp_path):
    torch.manual_seed(0)
    X, y = torch.randn(12, 3), torch.randn(12)
    model = Scaled()
    url = str(tmp_path / "t.zarr")
    kw = dict(steps=6, record={"steps": [0, 3]}, spectrum={"k": 4, "images": []})
    tr = Tracker(url, "r", model, X, y, **kw)
    theta0 = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    tr.record(0, lr=0.1)
    assert tr.due(0) is False  # a loop that tests due() records each step once
    with pytest.raises(ValueError, match=r"^step 0 was already recorded \(by this Tracker\)"):
        tr.record(0, lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ((model(X) - y) ** 2).mean().backward()
    opt.step()  # θ_1 ≠ θ_0, and the loop (wrongly) records step 0 again
    with pytest.raises(ValueError, match=r"^step 0 was already recorded"):
        tr.record(0, lr=0.5)
    assert tr.due(1) is False and tr.due(3) is True
    tr.close()
    run = Client(url).run("r")
    assert run.g["done"][0] and not run.g["done"][1:].any()
    np.testing.assert_array_equal(run.g["theta"][0], theta0.numpy())
    assert run.g["lr"][0] == 0.1
    tr2 = Tracker(url, "r", model, X, y, **kw)  # a new session: step 0 is in the store
    with pytest.raises(ValueError, match=r"^step 0 was already recorded \(in the store"):
        tr2.record(0, lr=0.1)
    tr2.close()
    np.testing.assert_array_equal(Client(url).run("r").g["theta"][0], theta0.numpy())


def test_analysis_error_surfaces_at_the_next_call(tmp_path):
    """A step whose analysis fails: one AnalysisError naming the step and the cause at the next Tracker
    call (here log()), the original exception chained, the run failed; later calls repeat it."""
    import concurrent.futures as cf

    torch.manual_seed(0)
    X, y = torch.randn(12, 3), torch.randn(12)
    model = Flaky()
    url = str(tmp_path / "t.zarr")
    tr = Tracker(url, "f", model, X, y, steps=10, record={"every": 5}, spectrum={"k": 4, "images": []})
    tr.record(0, lr=0.1)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)  # update 0
    assert tr.due(1) is False  # hands step 0 to the analysis
    cf.wait(list(tr.pool.inflight))  # ... which has failed by now
    with pytest.raises(AnalysisError) as info:
        tr.log(1, 0.5)
    err = info.value
    assert (
        str(err)
        == (
            "run 'f': the analysis of recorded step 0 failed: computing the NTK of Flaky failed in "
            "module '<root>' (Flaky): ValueError: Flaky.forward refuses float64 inputs"
        )
        and err.step == 0
    )
    root = err.__cause__
    while root.__cause__ is not None:
        root = root.__cause__
    assert isinstance(root, ValueError) and "(a second line of detail)" in str(root)
    run = Client(url).run("f")
    assert run.status == "failed" and run.reason == str(err) and run.failed_step == 0
    for call in (lambda: tr.due(2), lambda: tr.log(2, 0.1), lambda: tr.record(5, lr=0.1)):
        with pytest.raises(AnalysisError, match="recorded step 0 failed"):
            call()
    tr.close()  # already failed: nothing more to raise, the status stays
    assert Client(url).run("f").status == "failed"


def test_analysis_error_surfaces_before_close_in_a_loop(tmp_path):
    """In a plain loop the failure of step 0 reaches the loop no later than the next hand-over (max_inflight=1)."""
    torch.manual_seed(0)
    X, y = torch.randn(12, 3), torch.randn(12)
    model = Flaky()
    url = str(tmp_path / "t.zarr")
    tr = Tracker(url, "f", model, X, y, steps=10, record={"every": 3}, spectrum={"k": 4, "images": []}, max_inflight=1)
    with pytest.raises(
        AnalysisError,
        match=r"^run 'f': the analysis of recorded step 0 failed: computing the NTK "
        r"of Flaky failed in module '<root>' \(Flaky\): ValueError: Flaky",
    ):
        _loop(tr, model, X, y, 10)
    assert Client(url).run("f").status == "failed"
    tr.close()


def test_float64_model_through_the_tracker(tmp_path):
    """A float64 model with float64 points: fed float64, analysed from its float64 θ_t, exact to 1e-10."""
    torch.manual_seed(0)
    X, y = torch.randn(20, 3, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
    model = Scaled().double()
    url = str(tmp_path / "t.zarr")
    tr = Tracker(url, "d", model, X, y, steps=8, record={"steps": [0, 4, 7]}, spectrum={"k": "all", "images": []})
    copies = _loop(tr, model, X, y, 8)
    tr.close()
    run = Client(url).run("d")
    assert run.status == "done"
    _assert_spectra(run, copies, X, rtol=1e-10)
    assert np.isfinite(run.g["first_order_error"][:2]).all()
    np.testing.assert_allclose(run.g["f"][0], copies[0](X).detach().numpy(), rtol=1e-6)


def test_integer_token_ids_reach_the_model_as_integers(tmp_path):
    """(N, T) int64 ids stay integers from the user to every forward (the Tracker's and the analysis
    copy's inputs); the store's X holds them exactly (as float64)."""
    torch.manual_seed(0)
    ids, y = torch.randint(0, 10, (12, 5)), torch.randn(12)
    model = TokenNet()
    SEEN_DTYPES.clear()
    url = str(tmp_path / "t.zarr")
    with pytest.raises(KeyboardInterrupt):  # leave before the analysis (the NTK core's part) runs
        with Tracker(
            url, "tok", model, ids, y, ids[:3], y[:3], steps=4, record={"every": 2}, spectrum={"k": 4, "images": []}
        ) as tr:
            tr.record(0, lr=0.1)
            assert tr.pool.service.analyzer.X.dtype == torch.int64
            assert tr.pool.service.analyzer.X_test.dtype == torch.int64
            raise KeyboardInterrupt
    assert SEEN_DTYPES and set(SEEN_DTYPES) == {torch.int64}, SEEN_DTYPES
    np.testing.assert_array_equal(Client(url).run("tok").g["X"][:], ids.numpy().astype(np.float64))
    with pytest.raises(TypeError, match="both be floating points or both integer ids"):
        Tracker(str(tmp_path / "u.zarr"), "u", TokenNet(), ids, y, ids[:3].float(), y[:3], steps=4)


def test_integer_token_ids_end_to_end(tmp_path):
    torch.manual_seed(0)
    ids, y = torch.randint(0, 10, (12, 5)), torch.randn(12)
    model = TokenNet()
    url = str(tmp_path / "t.zarr")
    tr = Tracker(url, "tok", model, ids, y, steps=4, record={"every": 2}, spectrum={"k": "all", "images": []})
    copies = _loop(tr, model, ids, y, 4)
    tr.close()
    run = Client(url).run("tok")
    assert run.status == "done"
    _assert_spectra(run, copies, ids, rtol=1e-9)


def test_couples_samples():
    from nsa_dist.tracker import couples_samples

    torch.manual_seed(0)
    X = torch.randn(6, 2, 6, 6)
    bn = _bn_cnn()
    before = _state(bn)
    assert couples_samples(bn, X) is True  # train mode: batch statistics
    _assert_state(bn, before, "couples_samples")
    assert couples_samples(bn.eval(), X) is False  # eval: running statistics, per point
    assert couples_samples(_bn_cnn(track_running_stats=False).eval(), X) is True  # no running statistics
    mlp = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    x = torch.randn(6, 3)
    assert couples_samples(mlp.eval(), x) is False
    rng = torch.get_rng_state()
    assert couples_samples(mlp.train(), x) is False  # random forward: no verdict
    assert torch.equal(torch.get_rng_state(), rng), "couples_samples consumed the user's RNG"
    bn1 = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    assert couples_samples(bn1, torch.randn(2, 3)) is True  # halves of one point cannot even be normalised


def test_tracker_logs_once_that_the_model_couples_samples(tmp_path, caplog):
    torch.manual_seed(0)
    X, y = torch.randn(12, 2, 6, 6), torch.randn(12)
    for name, model, said in (("c", _bn_cnn(track_running_stats=False).eval(), 1), ("p", _bn_cnn().eval(), 0)):
        caplog.clear()
        url = str(tmp_path / f"{name}.zarr")
        tr = Tracker(url, name, model, X, y, steps=6, record={"every": 2}, spectrum={"k": 4, "images": []})
        with caplog.at_level("INFO", logger="nsa_dist"):
            _loop(tr, model, X, y, 6, train=False)
            tr.close()
        lines = [
            r.getMessage()
            for r in caplog.records
            if "couples samples" in r.getMessage() and r.getMessage().startswith("run '")
        ]
        assert len(lines) == said, lines
        if said:
            assert f"run '{name}': at step 0" in lines[0] and "batch statistics in '1'" in lines[0]


@pytest.mark.slow
def test_ray_tracker_analyses_step_state_and_reports_errors(local_ray, tmp_path):
    """The Ray pool: step t's buffers and modes reach the worker's copy; a worker's analysis error is one
    AnalysisError naming the step, its cause chained."""
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test's model classes, to the workers
    try:
        torch.manual_seed(0)
        X, y = torch.randn(16, 3), torch.randn(16)
        model = Scaled().eval()
        url = str(tmp_path / "t.zarr")
        tr = Tracker(
            url,
            "s",
            model,
            X,
            y,
            steps=12,
            record={"steps": [0, 6, 11]},
            spectrum={"k": "all", "images": []},
            cluster="auto",
            workers=1,
        )
        copies = _loop(tr, model, X, y, 12, after_step=lambda m: m.scale.mul_(1.1))
        tr.close()
        run = Client(url).run("s")
        assert run.status == "done"
        _assert_spectra(run, copies, X, rtol=1e-9)

        tr = Tracker(
            url,
            "f",
            Flaky(),
            X,
            y,
            steps=10,
            record={"every": 3},
            spectrum={"k": 4, "images": []},
            cluster="auto",
            workers=1,
            max_inflight=1,
        )
        with pytest.raises(
            AnalysisError,
            match=r"^run 'f': the analysis of recorded step 0 failed: computing the NTK of "
            r"Flaky failed in module '<root>' \(Flaky\): ValueError: "
            r"Flaky.forward refuses float64 inputs$",
        ) as info:
            _loop(tr, tr.model, X, y, 10)
        # its words name the ValueError
        assert isinstance(info.value.__cause__, ModelForwardError) and info.value.step == 0
        assert Client(url).run("f").status == "failed" and Client(url).run("f").failed_step == 0
        tr.close()

        # a failed step with another queued behind it on the one worker: the error, not a hang
        # (the failed step's worker was never handed back, so the queued step waited for ever)
        tr = Tracker(
            url,
            "g",
            Flaky(),
            X,
            y,
            steps=10,
            record={"every": 3},
            spectrum={"k": 4, "images": []},
            cluster="auto",
            workers=1,
            max_inflight=3,
        )
        # raised in the loop, or at the latest at close (whose step-9 submit waits on the one worker)
        # — on a slow machine step 0 may still be running when the loop ends
        with pytest.raises(AnalysisError, match=r"^run 'g': the analysis of recorded step 0 failed"):
            _loop(tr, tr.model, X, y, 10)
            tr.close()
        assert Client(url).run("g").status == "failed" and Client(url).run("g").failed_step == 0
        tr.close()  # closed already: nothing more
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.mark.slow
def test_ray_tracker_keeps_a_step_finished_beside_a_failed_one(local_ray, tmp_path):
    """Two steps returned by one Ray wait, one failed: the failure is raised and the finished step's
    summary is still taken — marked done, its notes replayed (was: taken from the pool and dropped)."""
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        torch.manual_seed(0)
        X, y = torch.randn(16, 3), torch.randn(16)
        model = FailsWhenMarked(str(tmp_path / "go"))
        url = str(tmp_path / "t.zarr")
        kw = dict(record={"steps": [0, 1, 9]}, spectrum={"k": 4, "images": []}, workers=2, max_inflight=3)
        tr = Tracker(url, "b", model, X, y, steps=10, cluster="auto", **kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for t in range(3):  # step 0 handed over at t = 1, step 1 (marked) at t = 2: both in flight
            if t == 1:
                model.bad.fill_(1.0)
            if tr.due(t):
                tr.record(t, lr=0.05)
            opt.zero_grad()
            ((model(X) - y) ** 2).mean().backward()
            opt.step()
        running = tr.tracked.pool.queue.running
        assert len(running) == 2, f"{len(running)} steps in flight, expected 2: the test needs both out at once"
        (tmp_path / "go").touch()  # step 0's analysis may go on now
        deadline = time.monotonic() + 120
        while len(local_ray.wait(list(running), num_returns=2, timeout=0)[0]) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        with pytest.raises(AnalysisError, match=r"recorded step 1 failed"):
            tr.due(3)
        run = Client(url).run("b")
        assert run.status == "failed" and run.failed_step == 1, (run.status, run.failed_step)
        assert run.g["done"][:].tolist() == [True, False, False], run.g["done"][:]
        taken = [s["index"] for s in tr.tracked.finished]  # its summary taken (its notes replayed) too
        assert taken == [0], f"summaries taken by the driver: {taken}"
        tr.close()
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


class _CachingNet(torch.nn.Module):
    """A forward hook caching an activation (a bound method) and a buffer the loop updates from it."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(2, 6), torch.nn.Linear(6, 1)
        self.register_buffer("center", torch.zeros(6))
        self.cache: dict = {}
        self.l1.register_forward_hook(self._keep)

    def _keep(self, module, inputs, out):
        self.cache["h"] = out.detach()

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x) - self.center))


def test_a_loop_that_reads_its_activation_cache_trains_alike_with_the_tracker(tmp_path):
    """An audit: after record(t) the user's cache held the TEST points' activations (the
    Tracker's f_test forward), so a loop updating a buffer from it trained differently."""
    data = load_dataset(SPEC.data, seed=0)
    X, y = torch.as_tensor(data.X, dtype=torch.float32), torch.as_tensor(data.y, dtype=torch.float32)
    X_test = np.random.default_rng(0).standard_normal((7, 2))

    def train(track: bool) -> tuple[list[float], torch.Tensor]:
        torch.manual_seed(0)
        model = _CachingNet()
        tr = (
            Tracker(
                str(tmp_path / "c.zarr"),
                f"c{int(track)}",
                model,
                data.X,
                data.y,
                X_test,
                np.zeros(7),
                steps=6,
                record={"every": 2},
                spectrum={"k": 4},
            )
            if track
            else None
        )
        opt, losses = torch.optim.SGD(model.parameters(), lr=0.1), []
        for t in range(6):
            opt.zero_grad()
            loss = 0.5 * ((model(X) - y) ** 2).mean()
            if tr is not None and tr.due(t):
                tr.record(t, lr=0.1, loss=loss.item())
            assert model.cache["h"].shape == (X.shape[0], 6), "the cache holds the loop's own forward"
            model.center.mul_(0.5).add_(0.5 * model.cache["h"].mean(0))  # the loop reads its cache
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if tr is not None:
            tr.close()
            assert Client(str(tmp_path / "c.zarr")).run("c1").status == "done"
        return losses, torch.nn.utils.parameters_to_vector(model.parameters()).detach()

    (plain, th0), (tracked, th1) = train(False), train(True)
    assert plain == tracked and torch.equal(th0, th1), (plain, tracked)


def test_df_of_a_batch_norm_net_recorded_in_eval_and_trained_in_train_mode_keeps_step_ts_statistics(tmp_path):
    """Δf_t is f(θ_{t+1}) − f(θ_t) with step t's running statistics: the training forward's update of
    them is no change J_t Δθ_t predicts (the stored first-order error was 0.32 at step 6, against
    0.0012 with step t's statistics)."""
    torch.manual_seed(3)
    X = torch.randn(24, 3)
    y = torch.sin(X.sum(1))
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    url = str(tmp_path / "bn.zarr")
    model.eval()
    tr = Tracker(url, "bn", model, X, y, steps=7, record={"every": 3}, spectrum={"k": 4})
    want = {}
    for t in range(7):
        model.eval()  # recorded in eval mode (running statistics) ...
        if tr.due(t):
            at_t = copy.deepcopy(model)
            tr.record(t, lr=0.1)
        model.train()  # ... trained in train mode (batch statistics, which move the running ones)
        opt.zero_grad()
        (0.5 * ((model(X).squeeze(-1) - y) ** 2).mean()).backward()
        opt.step()
        if t % 3 == 0:
            with torch.no_grad():
                f_t = at_t(X).squeeze(-1)
                at_t.load_state_dict({**model.state_dict(), **{k: v for k, v in at_t.named_buffers()}})
                want[t] = (at_t(X).squeeze(-1) - f_t).numpy()  # θ_{t+1} with step t's buffers
    tr.close()
    run = Client(url).run("bn")
    assert run.status == "done"
    for i, t in enumerate(run.g["steps"][:]):
        got, ref = run.g["df"][i].astype(np.float64), want[int(t)].astype(np.float64)
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < 1e-5, f"step {t}: stored Δf is {err:.3g} of its size from f(θ_t+1) − f(θ_t) at step t's statistics"


_UNCLOSED = """
import sys, torch
from nsa_dist import Tracker
torch.manual_seed(0)
X = torch.randn(32, 3)
y = X.sum(1)
model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
tr = Tracker(sys.argv[1], "r", model, X, y, steps=31, record={"every": 3}, spectrum={"k": 4}, max_inflight=2)
for t in range(31):
    L = 0.5 * ((model(X).squeeze(-1) - y) ** 2).mean()
    if tr.due(t):
        tr.record(t, lr=0.1, loss=L.item())
    else:
        tr.log(t, L.item())
    if t == 25:
        if sys.argv[2] == "raise":
            raise RuntimeError("a bug in the loop")
        if sys.argv[2] == "sigterm":  # as torchrun stops every rank when one dies
            import os, signal
            os.kill(os.getpid(), signal.SIGTERM)
            continue
        break  # the script ends without close()
    opt.zero_grad()
    L.backward()
    opt.step()
"""


@pytest.mark.parametrize("how", ["raise", "end", "sigterm"])
def test_a_script_ending_without_close_keeps_every_recorded_step(tmp_path, how):
    """No ``with``: an uncaught exception (or a script that never calls ``close()``) lost the steps in
    flight — their analyses, run as the interpreter shut down, failed with "cannot schedule new
    futures after shutdown" — and the pending one; 6 of 9 recorded steps were kept.  SIGTERM killed
    the process on the spot (the steps in flight lost, the status left ``running``: torchrun's way of
    stopping rank 0 when another rank dies); it now ends the loop as an exception, exit status 143."""
    import subprocess
    import sys

    script = tmp_path / "loop.py"
    script.write_text(_UNCLOSED)
    url = str(tmp_path / "t.zarr")
    out = subprocess.run([sys.executable, str(script), url, how], capture_output=True, text=True, timeout=300)
    assert out.returncode == {"raise": 1, "end": 0, "sigterm": 143}[how], (out.returncode, out.stderr[-2000:])
    run = Client(url).run("r")
    assert run.status == "interrupted" and run.g["done"][:9].all() and not run.g["done"][9:].any(), (
        run.status,
        run.g["done"][:],
        out.stderr[-2000:],
    )
    why = {
        "raise": "an uncaught RuntimeError (a bug in the loop)",
        "end": "the process exited",
        "sigterm": "the process was sent SIGTERM",
    }[how]
    assert why in run.reason and "before Tracker.close()" in run.reason, run.reason


_FORKS_AND_SIGNALS = """
import os, signal, sys, torch
from torch.utils.data import DataLoader, TensorDataset
from nsa_dist import Tracker
from nsa_dist.pipeline import tracked_run

url, how = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
X = torch.randn(32, 3)
y = torch.sin(X.sum(1))
model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if how == "sigterm-in-close":  # the signal lands while close() waits for the steps out
    drain = tracked_run.TrackedRun.drain
    def once(self):
        if self.inflight and not getattr(tracked_run, "sent", False):
            tracked_run.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return drain(self)
    tracked_run.TrackedRun.drain = once
if how == "sigterm-in-submit":  # … while a record waits for a free slot (the analysis behind): that step was lost
    from nsa_dist.pipeline import tracked
    slow = tracked.TrackedRunService.analyze_and_write
    tracked.TrackedRunService.analyze_and_write = lambda self, ck: (__import__("time").sleep(0.5), slow(self, ck))[1]
    collect = tracked_run.TrackedRun.collect
    def blocked(self, block):
        if block and self.unsent is not None and not getattr(tracked_run, "sent", False):
            tracked_run.sent = True
            print("waiting with step", self.unsent.step, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        return collect(self, block)
    tracked_run.TrackedRun.collect = blocked
loader = DataLoader(TensorDataset(X, y), batch_size=32, num_workers=1 if how == "workers" else 0)
try:
    with Tracker(
        url, "r", model, X, y, steps=12, record={"every": 3}, spectrum={"k": 4}, device="cpu", max_inflight=1
    ) as tr:
        t = 0
        while t < 12:
            for xb, yb in loader:  # a forked worker per epoch, which exits at the epoch's end
                loss = 0.5 * ((model(xb).squeeze(-1) - yb) ** 2).mean()
                if tr.due(t):
                    tr.record(t, lr=0.1)
                opt.zero_grad()
                loss.backward()
                opt.step()
                tr.log(t, loss.item())
                t += 1
except SystemExit as e:  # as pytest and IPython catch it: the process goes on
    print("caught", e.code)
from nsa_dist import Client
run = Client(url).run("r")
print("status", run.status, "|", run.reason, "|", bool(run.g["done"][:].all()), run.g["done"][:].astype(int).tolist())
again = Tracker(url, "r", model, X, y, steps=12, record={"every": 3}, spectrum={"k": 4}, device="cpu")
again.close()  # this process may open the run again: the lease was given back
"""


@pytest.mark.parametrize("how", ["workers", "sigterm-in-close", "sigterm-in-submit"])
def test_forked_workers_and_a_sigterm_in_close_keep_the_run(tmp_path, how):
    """A DataLoader's forked worker exiting at an epoch's end ran the interpreter's exit hook on its copy
    of the parent's open run: status interrupted, the writer's folder removed, the parent's next write
    LeaseLost — every step lost (a review).  A SIGTERM while close() waited for the steps out left the
    status running and the lease held (the same process could not reopen the run)."""
    import subprocess
    import sys

    script = tmp_path / "loop.py"
    script.write_text(_FORKS_AND_SIGNALS)
    url = str(tmp_path / "t.zarr")
    out = subprocess.run([sys.executable, str(script), url, how], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    if how == "workers":
        assert "status done | None | True" in out.stdout, out.stdout
    elif how == "sigterm-in-submit":  # the step whose submission waited is analysed, the run interrupted
        waited = int(out.stdout.split("waiting with step ")[1].split()[0])
        done = eval(out.stdout.split("status interrupted |")[1].splitlines()[0].rsplit("| ", 1)[1].split(" ", 1)[1])
        assert done[waited // 3] == 1 and all(done[: waited // 3]), out.stdout
    else:
        assert "caught 143" in out.stdout, out.stdout
        assert "status interrupted | the process was sent SIGTERM" in out.stdout and "| True" in out.stdout, out.stdout
    if how != "sigterm-in-submit":  # reopened by the same process and closed, all steps there
        assert Client(url).run("r").status == "done"
