"""A Tracker never writes into a finished run, and records in the loop's order (audit K: a reopened
finished run's loss curve was overwritten by another loop's losses, a NaN loss marked it failed; steps
recorded out of order stored θ of one step as another's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr
from torch import nn

from nsa_dist import Tracker

torch.manual_seed(0)
X = torch.randn(32, 2)
Y = X[:, 0].sin()


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(0))


def _loop(url: str, model: nn.Module, lr: float, nan_at: int | None = None) -> Tracker:
    tr = Tracker(url, "r", model, X, Y, steps=20, record={"every": 10}, spectrum={"k": 3, "images": []})
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for t in range(20):
        if tr.due(t):
            tr.record(t, lr=lr)
        opt.zero_grad()
        loss = 0.5 * ((model(X) - Y) ** 2).mean()
        loss.backward()
        opt.step()
        tr.log(t, float("nan") if t == nan_at else loss.item())
    tr.close()
    return tr


def test_a_finished_run_reopened_is_left_as_it_is(tmp_path):
    url = str(tmp_path / "s.zarr")
    _loop(url, _net(1), 0.1)
    run = zarr.open_group(url, mode="r")["runs/r"]
    before = {name: run[name][...].copy() for name in ("loss_trace", "loss", "theta", "eigenvalues")}
    attrs = dict(run.attrs)
    again = _loop(url, _net(7), 0.3)  # another network under the same name: it records nothing
    _loop(url, _net(1), 0.1, nan_at=5)  # a NaN loss: not this finished run's failure
    run = zarr.open_group(url, mode="r")["runs/r"]
    for name, was in before.items():
        np.testing.assert_array_equal(run[name][...], was, err_msg=f"{name} of the finished run changed")
    assert run.attrs["status"] == "done" and run.attrs.get("reason") == attrs.get("reason"), dict(run.attrs)
    assert again.finished and not again.due(0)


def test_steps_are_recorded_in_the_loops_order(tmp_path):
    model = _net(1)
    tr = Tracker(str(tmp_path / "s.zarr"), "o", model, X, Y, steps=40, record={"every": 10}, spectrum={"k": 3})
    tr.record(20, lr=0.1)
    with pytest.raises(ValueError, match=r"step 10 comes before step 20, where the loop already was"):
        tr.record(10, lr=0.1)
    tr.log(25, 0.1)
    with pytest.raises(ValueError, match=r"step 20 comes before step 25|step 20 was already recorded"):
        tr.record(20, lr=0.1)
    tr.record(30, lr=0.1)
    with pytest.raises(ValueError, match=r"step 0 comes before step 30"):
        tr.record(0, lr=0.1)
    tr.close()


def test_a_learning_rate_stored_nan_says_why_in_the_step_notes(tmp_path):
    """Under optimizer='gd' an Adam loop's δ_t is stored NaN: it was said in the log only (audit K)."""
    from nsa_dist.client import Client

    model = _net(1)
    url = str(tmp_path / "s.zarr")
    tr = Tracker(url, "a", model, X, Y, steps=4, record={"every": 2}, spectrum={"k": 3}, optimizer="gd")
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for t in range(4):
        if tr.due(t):
            tr.record(t, lr=0.05)
        opt.zero_grad()
        (0.5 * ((model(X) - Y) ** 2).mean()).backward()
        opt.step()
    tr.close()
    run = Client(url).run("a")
    assert np.isnan(run.per_step("lr")[0])
    assert "not full-batch gradient descent" in run.notes[0]["lr"], run.notes


def test_a_loop_that_asks_due_of_the_next_step_records_every_step(tmp_path):
    """``due(t + 1)`` as a look-ahead before ``record(t)`` is no step the loop passed (review: it
    recorded nothing, saying the loop went back)."""
    from nsa_dist.client import Client

    model = _net(1)
    url = str(tmp_path / "s.zarr")
    tr = Tracker(url, "l", model, X, Y, steps=20, record={"every": 5}, spectrum={"k": 3})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in range(20):
        tr.due(t + 1)
        if tr.due(t):
            tr.record(t, lr=0.1)
        opt.zero_grad()
        (0.5 * ((model(X) - Y) ** 2).mean()).backward()
        opt.step()
    tr.close()
    run = Client(url).run("l")
    assert run.status == "done" and len(run.steps) == 5, (run.status, run.steps)


def test_a_run_whose_steps_are_all_stored_but_not_finished_is_finished_by_a_reopened_tracker(tmp_path):
    """Killed between its last step and close(): every step stored, status not done.  A reopened
    Tracker took it for a finished run and left it unfinished for ever (review)."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    url = str(tmp_path / "s.zarr")
    script = textwrap.dedent(
        f"""
        import os, time, torch, torch.nn as nn, zarr
        from nsa_dist import Tracker
        torch.manual_seed(0); X = torch.randn(32, 2); Y = X[:, 0].sin()
        torch.manual_seed(1); model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(0))
        tr = Tracker({url!r}, "r", model, X, Y, steps=20, record={{"every": 10}}, spectrum={{"k": 3, "images": []}})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for t in range(20):
            if tr.due(t): tr.record(t, lr=0.1)
            opt.zero_grad(); loss = 0.5 * ((model(X) - Y) ** 2).mean(); loss.backward(); opt.step()
            tr.log(t, loss.item())
        tr.due(20)
        for _ in range(240):
            if zarr.open_group({url!r}, mode="r")["runs/r/done"][...].all(): break
            time.sleep(0.5)
        os._exit(0)
        """
    )
    repo = Path(__file__).resolve().parents[1]
    env = {**__import__("os").environ, "PYTHONPATH": str(repo)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=600)
    run = zarr.open_group(url, mode="r")["runs/r"]
    assert run["done"][...].all() and run.attrs["status"] != "done", dict(run.attrs)
    tr = Tracker(url, "r", _net(1), X, Y, steps=20, record={"every": 10}, spectrum={"k": 3, "images": []})
    assert not tr.finished
    tr.close()
    run = zarr.open_group(url, mode="r")["runs/r"]
    assert run.attrs["status"] == "done" and "preservation" in run, dict(run.attrs)


def _resumed(url: str, late: int, lrs: list[float]) -> zarr.Group:
    """Steps 0, 1, 2 recorded, the process stops; another process reopens the run, restores θ from
    theta_at(s) and runs its loop from step s + ``late`` to 6 at the rates ``lrs``; the stored run."""
    kw = dict(steps=6, record={"every": 1}, spectrum={"k": 3, "images": []})

    def loop(tr: Tracker, model: nn.Module, start: int, stop: int) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for t in range(start, stop):
            for group in opt.param_groups:
                group["lr"] = lrs[t]
            if tr.due(t):
                tr.record(t, lr=opt)
            opt.zero_grad()
            (0.5 * ((model(X) - Y) ** 2).mean()).backward()
            opt.step()
        tr.close()

    first = _net(1)
    loop(Tracker(url, "r", first, X, Y, **kw), first, 0, 3)
    model = _net(9)
    tr = Tracker(url, "r", model, X, Y, **kw)
    s = tr.resume_step
    torch.nn.utils.vector_to_parameters(torch.as_tensor(tr.theta_at(s)), model.parameters())
    loop(tr, model, s + late, 6)
    return zarr.open_group(url, mode="r")["runs/r"]


def test_a_loop_resumed_one_step_late_is_stopped_not_recorded(tmp_path):
    """Reopened, θ restored from theta_at(s), the loop started at s + 1: every later step was stored with the
    step before's θ (bit for bit), status done (an audit, session 30).  The recording now stops there."""
    run = _resumed(str(tmp_path / "s.zarr"), 1, [0.1] * 6)
    assert run.attrs["status"] == "interrupted" and "stored θ_2 bit for bit" in run.attrs["reason"], dict(run.attrs)
    assert list(run["done"][:].astype(int)) == [1, 1, 1, 0, 0, 0]


def test_a_resume_whose_first_update_changes_nothing_goes_on(tmp_path):
    """A correct resume from step s whose update s changes nothing (a learning rate 0 there: a warmup restart,
    a skipped AMP step) holds θ_s at step s + 1 too: the loop passed step s, so it is not one step late (the
    check stopped it: a review)."""
    run = _resumed(str(tmp_path / "s.zarr"), 0, [0.1, 0.1, 0.0, 0.1, 0.1, 0.1])
    assert run.attrs["status"] == "done" and run["done"][:].all(), (run.attrs["status"], run.attrs.get("reason"))


def _f64_tracker(url: str, model: nn.Module) -> Tracker:
    return Tracker(
        url, "f64", model, X.double(), Y.double(), steps=20, record={"every": 5}, spectrum={"k": 3, "images": []}
    )


def _f64_loop(url: str, model: nn.Module, stop: int | None = None, start: int = 0) -> Tracker:
    """A float64 GD loop recorded every 5 steps; ``stop``: the loop ends there, its Tracker closed (paused)."""
    X64, Y64 = X.double(), Y.double()
    tr = _f64_tracker(url, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in range(start, stop or 20):
        if tr.due(t):
            tr.record(t, lr=0.1)
        opt.zero_grad()
        (0.5 * ((model(X64) - Y64) ** 2).mean()).backward()
        opt.step()
    tr.close()
    return tr


def _resume(url: str) -> nn.Module:
    """The documented resume: a new network set to ``theta_at(resume_step)``, its loop from there."""
    from torch.nn.utils import vector_to_parameters

    model = _net(3).double()
    tr = _f64_tracker(url, model)
    step, theta = tr.resume_step, tr.theta_at(tr.resume_step)
    vector_to_parameters(torch.as_tensor(theta, dtype=torch.float64), model.parameters())
    tr.close()
    _f64_loop(url, model, start=step)
    return model


def test_a_float64_models_resume_state_is_its_theta_exactly(tmp_path):
    """θ_t of a float64 model was stored in float32: ``theta_at`` handed back θ_t rounded to 6·10⁻⁸ (the
    resumed loop left the recorded trajectory) and a reader's kernel at the stored θ_t was another
    network's.  Now the resume state is in the model's dtype, and the resumed run is the uninterrupted one."""
    url, whole = str(tmp_path / "s.zarr"), str(tmp_path / "w.zarr")
    _f64_loop(url, _net(3).double(), stop=12)  # recorded 0, 5, 10; paused
    assert zarr.open_group(url, mode="r")["runs/f64"]["theta"].dtype == np.float64
    _resume(url)
    _f64_loop(whole, _net(3).double())
    run, ref = (zarr.open_group(u, mode="r")["runs/f64"] for u in (url, whole))
    assert run.attrs["status"] == "done", dict(run.attrs)
    for name in ("theta", "eigenvalues"):
        np.testing.assert_array_equal(
            run[name][:], ref[name][:], err_msg=f"{name}: the resumed run left the trajectory"
        )


def test_a_float64_run_recorded_with_float32_state_resumes_in_it(tmp_path):
    """A run the nsa-dist before this wrote (float32 θ, no ``state_dtype`` in its sizes) goes on in its own
    arrays, not refused as corrupt."""
    url = str(tmp_path / "s.zarr")
    _f64_loop(url, _net(3).double(), stop=12)
    g = zarr.open_group(url, mode="r+")["runs/f64"]
    dims = dict(g.attrs["dims"])
    del dims["state_dtype"]
    g.attrs["dims"] = dims
    for name in ("theta", "opt_slots"):
        arr = g[name]
        old, attrs, chunks, names = arr[...], dict(arr.attrs), arr.chunks, arr.metadata.dimension_names
        del g[name]
        new = g.create_array(
            name, shape=old.shape, dtype="float32", chunks=chunks, fill_value=np.nan, dimension_names=names
        )
        new[...] = old.astype(np.float32)
        new.attrs.update(attrs)
    _resume(url)
    g = zarr.open_group(url, mode="r")["runs/f64"]
    assert g.attrs["status"] == "done" and g["theta"].dtype == np.float32, (dict(g.attrs), g["theta"].dtype)
