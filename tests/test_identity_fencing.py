"""Nothing silently mixed (issue 18): a run is tied to the data it was created from, and a writer
that lost its lease (paused longer than its ttl) writes nothing more.

Real stores on disk, real ``nsa run`` processes paused with SIGSTOP; nothing mocked.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import wait_stopped
from PIL import Image

from nsa_dist.cli import main as nsa
from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.errors import StoreError
from nsa_dist.pipeline import plan_run, prepare_run, run_experiment, run_id
from nsa_dist.pipeline.services import SpectralService, TrainerService
from nsa_dist.store import LeaseLost, SpectrumStore

REPO = Path(__file__).resolve().parents[1]
TINY = dict(
    name="ident",
    data={"n": 32, "n_test": 8},
    model={"depth": 2, "width": 16},
    steps=30,
    record={"every": 10},
    spectrum={"k": 8, "test_points": True},
)
SLOW = {**TINY, "name": "fenced", "steps": 90}  # 10 recorded steps
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _png(path: Path, seed: int) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, (24, 24), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def _files(url: str) -> dict[str, tuple[int, str]]:
    """Every file of the store: relative path → (mtime_ns, sha1 of its bytes).  A ``.partial``
    file is not a key (a put in progress, renamed into place or removed; readers never see it)."""
    root = Path(url)
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha1(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.endswith(".partial")
    }


def _arrays(url: str, rid: str) -> dict[str, np.ndarray]:
    run = Client(url).run(rid)
    return {name: run.array(name) for name in run.array_names()}


def _assert_same_arrays(a_url: str, b_url: str, rid: str) -> None:
    a, b = _arrays(a_url, rid), _arrays(b_url, rid)
    assert sorted(a) == sorted(b), f"only in a {sorted(set(a) - set(b))}, only in b {sorted(set(b) - set(a))}"
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=f"array {name!r} differs from the uninterrupted run")


def _stopped_outside_the_run_lock(proc: subprocess.Popen, url: str, rid: str) -> None:
    """``proc``, stopped, is stopped again where need be until it is stopped at an instant its lease
    heartbeat does not hold the run's lock (``leases/<run id>/lock``).  A writer stopped inside it
    blocks every takeover (test_a_run_lock_held_by_a_stopped_process), and its heartbeat holds it
    for milliseconds, not microseconds, while the main thread keeps the GIL: 15 of 300 random
    SIGSTOPs of a process whose main thread ran Python landed inside (ttl 1 s, beats every 0.33 s)."""
    import fcntl

    for _ in range(100):
        wait_stopped(proc)
        fd = os.open(Path(url) / "leases" / rid / "lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return
        except BlockingIOError:  # stopped inside: let the beat finish, stop again
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.01)
            os.kill(proc.pid, signal.SIGSTOP)
        finally:
            os.close(fd)
    raise AssertionError("the writer was stopped holding its run's lock 100 times")


# --------------------------------------------------------------------------- data identity
def test_a_run_records_its_data_fingerprint_and_shows_it(tmp_path, capsys):
    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(**TINY)
    rid = run_experiment(spec, SpectrumStore(url)).run_id
    fp = load_dataset(spec.data, seed=spec.seed).fingerprint()
    assert fp.startswith("sha256:") and len(fp) == len("sha256:") + 32
    assert SpectrumStore(url).run_attrs(rid)["data_fingerprint"] == fp
    assert Client(url).run(rid).data_fingerprint == fp
    assert Client(url).runs().loc[0, "data_fingerprint"] == fp
    capsys.readouterr()
    assert nsa(["show", rid, "--store", url]) == 0
    assert fp in capsys.readouterr().out


def test_a_data_file_replaced_at_the_same_path_is_refused_on_resume(tmp_path, capsys):
    """Run to a partial state, replace the PNG at the same path, run the same spec again: refused in
    one line naming the file and both fingerprints; the run's stored data untouched."""
    png = _png(tmp_path / "target.png", seed=1)
    spec_d = {**SLOW, "name": "swap", "data": {"name": "image2d", "path": str(png), "n": 32, "n_test": 8}}
    spec = ExperimentSpec(**spec_d)
    url = str(tmp_path / "s.zarr")

    def stop_after_two(ck, result):
        if ck.index == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(spec, SpectrumStore(url), on_step=stop_after_two)
    rid = run_id(spec)
    old = load_dataset(spec.data, seed=spec.seed).fingerprint()
    before = _files(url)
    _png(png, seed=2)  # another image, same path
    new = load_dataset(spec.data, seed=spec.seed).fingerprint()
    assert new != old
    path = tmp_path / "swap.yaml"
    path.write_text(yaml.safe_dump(spec_d))
    capsys.readouterr()
    assert nsa(["run", str(path), "--store", url, "--plain"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"data.path {str(png)!r}" in err and old in err and new in err and "change the spec's `name`" in err, err
    after = _files(url)
    assert {k: v for k, v in after.items() if not k.startswith("leases/")} == {
        k: v for k, v in before.items() if not k.startswith("leases/")
    }, "the refused run wrote into the store"
    lease = f"leases/{rid}/zarr.json"
    assert lease in before and after.get(lease, (0, ""))[1] == before[lease][1], (
        "the refused re-run left its own lease: the run's last sign of life would name the refused process"
    )
    run = Client(url).run(rid)
    assert len(run.steps) == 2 and run.data_fingerprint == old


def test_cluster_workers_refuse_data_that_differs_from_the_run(tmp_path):
    """Each node loads the data itself: a worker whose copy differs refuses before writing."""
    png = _png(tmp_path / "target.png", seed=1)
    spec = ExperimentSpec(
        **{**TINY, "name": "nodes", "data": {"name": "image2d", "path": str(png), "n": 32, "n_test": 8}}
    )
    url = str(tmp_path / "s.zarr")
    run_experiment(spec, SpectrumStore(url))
    plan = plan_run(spec, load_dataset(spec.data))  # the driver's plan, made before the file changed
    _png(png, seed=2)
    trainer = TrainerService(plan, url)
    with pytest.raises(StoreError, match=r"was created from other data: data\.path .*target\.png"):
        trainer.checkpoint(0)  # its first call (raised by its constructor, it killed the Ray actor)


# --------------------------------------------------------------------------- fencing
_PAUSING_WRITER = """
import json, os, signal, sys
from nsa_dist.config import ExperimentSpec
from nsa_dist.errors import NSAError
from nsa_dist.pipeline import run_experiment
from nsa_dist.store import SpectrumStore

def pause(ck, result):  # as Ctrl-Z would, at a known instant: after recorded step index 1
    if ck.index == 1:
        os.kill(os.getpid(), signal.SIGSTOP)

try:
    out = run_experiment(ExperimentSpec(**json.loads(sys.argv[1])), SpectrumStore(sys.argv[2]), on_step=pause)
except NSAError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
print(out.status)
"""


def _take_over_paused(tmp_path: Path, spec_d: dict, cmd: list[str], pause) -> tuple[subprocess.Popen, str]:
    """Writer A (``cmd``, lease ttl 1 s) paused by ``pause``; writer B (this process) takes the run
    over and finishes it; returns A (still paused) and the store."""
    url = str(tmp_path / "b.zarr")
    proc = subprocess.Popen(
        cmd + [url], env={**ENV, "NSA_LEASE_TTL": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        pause(proc, url)
        _stopped_outside_the_run_lock(proc, url, run_id(ExperimentSpec(**spec_d)))
        out = run_experiment(ExperimentSpec(**spec_d), SpectrumStore(url), wait=30)  # takes over once A's ttl is out
        assert out.status == "done" and out.steps_computed < 10, out
    except BaseException:
        proc.kill()
        raise
    return proc, url


@pytest.mark.slow
def test_a_paused_writer_that_lost_its_lease_writes_nothing_more(tmp_path):
    spec = ExperimentSpec(**SLOW)
    rid = run_id(spec)
    ref = str(tmp_path / "ref.zarr")
    run_experiment(spec, SpectrumStore(ref))
    cmd = [sys.executable, "-c", _PAUSING_WRITER, json.dumps(SLOW)]
    proc, url = _take_over_paused(tmp_path, SLOW, cmd, lambda p, u: wait_stopped(p))
    finished = _files(url)
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, f"the paused writer did not stop: rc {proc.returncode}, {out} {err}"
    line = err.strip()
    assert len(line.splitlines()) == 1, err
    assert "lost its lease" in line and f"pid {os.getpid()}" in line and "took the run over" in line, line
    assert _files(url) == finished, "the writer wrote into the store after losing its lease"
    assert SpectrumStore(url).lease_info(rid).pid == os.getpid()
    assert Client(url).run(rid).status == "done"
    _assert_same_arrays(ref, url, rid)


@pytest.mark.slow
def test_nsa_run_stopped_beyond_its_ttl_exits_with_one_line_and_the_run_ends_as_uninterrupted(tmp_path):
    """The Ctrl-Z case from outside: ``nsa run`` SIGSTOPped after a few steps, taken over, resumed."""
    spec = ExperimentSpec(**SLOW)
    rid = run_id(spec)
    ref = str(tmp_path / "ref.zarr")
    run_experiment(spec, SpectrumStore(ref))
    path = tmp_path / "fenced.yaml"
    path.write_text(yaml.safe_dump(SLOW))

    def pause(proc, url):
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                if Client(url).run(rid).array("done").sum() >= 2:
                    os.kill(proc.pid, signal.SIGSTOP)
                    return
            except (StoreError, KeyError, ValueError, FileNotFoundError):
                pass
            time.sleep(0.01)
        raise AssertionError(f"nsa run ended or stalled before two steps: {proc.stderr.read()}")

    cmd = [sys.executable, "-m", "nsa_dist.cli", "run", "--plain", str(path), "--store"]
    proc, url = _take_over_paused(tmp_path, SLOW, cmd, pause)
    finished = {k: v[1] for k, v in _files(url).items()}
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, f"rc {proc.returncode}: {out} {err}"
    lines = err.strip().splitlines()  # the layout line it printed when it started, then one error line
    assert lines[-1].startswith("nsa run: error: ") and not any("error" in ln for ln in lines[:-1]), err
    assert f"pid {os.getpid()}" in lines[-1] and "took the run over" in lines[-1], err
    # what it may have been writing when paused is byte-identical; status, done flags, lease untouched
    assert {k: v[1] for k, v in _files(url).items()} == finished
    assert Client(url).run(rid).status == "done"
    _assert_same_arrays(ref, url, rid)


def test_a_put_made_before_a_takeover_never_lands_after_it(tmp_path):
    """The instant between a writer's check and its put (where a paused writer put a stale
    ``loss_trace`` chunk back over its successor's, CI run of 1aab64a): writer A has checked,
    encoded and written its bytes; its lease expires (A paused), B takes the run over; A's put
    and A's delete then land nothing, and A's later writes are refused."""
    from nsa_dist.store.fencing import RunFence

    spec = ExperimentSpec(**TINY)
    url = str(tmp_path / "w.zarr")
    store = SpectrumStore(url)
    rid = run_id(spec)
    a = store.lease([rid], ttl=1.0).acquire()
    writer = prepare_run(spec, store, a.token).writer
    writer.write_trace(0, np.arange(5, dtype=np.float64))
    chunk = Path(url) / "runs" / rid / "loss_trace" / "c" / "0"
    fence = RunFence(Path(url), rid, a.token, url)
    staged = fence.stage(chunk, b"stale bytes")  # A's put, past every check, not yet in place
    a._stop.set()  # A's heartbeat stops, as in a paused process; its lease expires
    a._thread.join()  # a beat already past its wait may still stamp a heartbeat later than the set
    time.sleep(1.1)
    b = store.lease([rid], wait=0).acquire()  # B takes the run over (and revokes A's write folder)
    try:
        before = {k: v for k, v in _files(url).items() if not k.startswith("leases/")}
        with pytest.raises(LeaseLost, match=rf"pid {os.getpid()}, since .* took the run over"):
            staged.land()
        with pytest.raises(LeaseLost, match="took the run over"):
            fence.delete(chunk)
        with pytest.raises(LeaseLost, match="took the run over"):
            writer.write_trace(5, np.full(3, 7.0))
        after = {k: v for k, v in _files(url).items() if not k.startswith("leases/")}
        assert after == before, f"changed after the takeover: {sorted(set(after.items()) ^ set(before.items()))}"
        assert not list(Path(url).rglob("*.partial")), "a refused put left its staged file"
        np.testing.assert_array_equal(
            Client(url).run(rid).array("loss_trace")[:8], np.r_[np.arange(5.0), np.full(3, np.nan)]
        )
        B = prepare_run(spec, store, b.token).writer  # the new holder writes as usual
        B.write_trace(5, np.full(3, 7.0))
        np.testing.assert_array_equal(Client(url).run(rid).array("loss_trace")[:8], np.r_[np.arange(5.0), [7.0] * 3])
    finally:
        b.release()


def test_a_run_lock_held_by_a_stopped_process_is_one_error_naming_it(tmp_path):
    """A writer stopped inside its microseconds under the lock blocks the takeover: the waiter
    gets one line naming the stopped pid, not a hang."""
    from nsa_dist.store.locks import LockTimeout, file_lock

    lock = tmp_path / "leases" / "r" / "lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import os, signal, sys; from pathlib import Path; from nsa_dist.store.locks import file_lock\n"
                f"with file_lock(Path({str(lock)!r}), 5.0, 'x'):\n"
                "    os.kill(os.getpid(), signal.SIGSTOP)\n"
            ),
        ],
        env=ENV,
    )
    try:
        wait_stopped(holder)
        t0 = time.time()
        with pytest.raises(LockTimeout, match=rf"held by process {holder.pid} for over 1 s .*stopped"):
            with file_lock(lock, 1.0, "run 'r'"):
                pass
        assert time.time() - t0 < 30
        os.kill(holder.pid, signal.SIGCONT)
        assert holder.wait(60) == 0
        with file_lock(lock, 1.0, "run 'r'"):  # let go by the holder: free again
            pass
    finally:
        holder.kill()


def test_cluster_workers_are_fenced_by_the_drivers_lease(tmp_path):
    """The plain services a Ray worker runs check the driver's token before writing."""
    spec = ExperimentSpec(**TINY)
    url = str(tmp_path / "s.zarr")
    store = SpectrumStore(url)
    rid = run_id(spec)
    with store.lease([rid]) as lease:
        plan = prepare_run(spec, store, lease.token).plan
        trainer = TrainerService(plan, url, token=lease.token)
        ck = trainer.checkpoint(0)
        worker = SpectralService(url)
        worker.analyze_and_write(plan, ck, token=lease.token)
        assert SpectrumStore(url).reader(rid).done.tolist() == [True, False, False, False]
        now = time.time()
        store.write_lease(
            rid,
            {
                "host": "node-7.elsewhere",
                "pid": 4242,
                "since": now,
                "heartbeat": now,
                "ttl": 30.0,
                "token": "theirs",
                "released": False,
            },
        )
        before = _files(url)
        with pytest.raises(LeaseLost, match="host node-7.elsewhere, pid 4242, since .* took the run over"):
            trainer.checkpoint(1)
        with pytest.raises(LeaseLost, match="took the run over"):
            worker.analyze_and_write(plan, ck, token=lease.token)
        assert _files(url) == before
    assert SpectrumStore(url).lease_info(rid).token == "theirs", "releasing overwrote the new writer's lease"


def test_a_tracker_whose_lease_is_taken_over_stops_without_writing(tmp_path):
    from nsa_dist import Tracker
    from nsa_dist.models import build_model

    spec = ExperimentSpec(**TINY)
    data = load_dataset(spec.data, seed=spec.seed)
    model = build_model(spec.model, seed=spec.seed)
    url = str(tmp_path / "t.zarr")
    store = SpectrumStore(url)
    tr = Tracker(
        url,
        "tracked",
        model,
        data.X,
        data.y,
        steps=30,
        record={"every": 10},
        spectrum={"k": 8},
        optimizer="gd",
        max_inflight=1,
    )
    X, y = torch.as_tensor(data.X, dtype=torch.float32), torch.as_tensor(data.y, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before: dict = {}
    with pytest.raises(LeaseLost, match="host node-7.elsewhere, pid 4242, since .* took the run over"):
        with tr:
            for t in range(30):
                if t == 12:  # steps 0 and 10 analysed and written; then another writer takes the run
                    deadline = time.time() + 120
                    while store.reader("tracked").done.sum() < 2 and time.time() < deadline:
                        time.sleep(0.05)
                    now = time.time()
                    store.write_lease(
                        "tracked",
                        {
                            "host": "node-7.elsewhere",
                            "pid": 4242,
                            "since": now,
                            "heartbeat": now,
                            "ttl": 600.0,
                            "token": "theirs",
                            "released": False,
                        },
                    )
                    before = _files(url)
                opt.zero_grad()
                loss = 0.5 * ((model(X) - y) ** 2).mean()
                if tr.due(t):
                    tr.record(t, lr=0.1, loss=loss.item())
                else:
                    tr.log(t, loss.item())
                loss.backward()
                opt.step()
    assert before and _files(url) == before, "the Tracker wrote after losing its lease"
    assert store.lease_info("tracked").token == "theirs"
