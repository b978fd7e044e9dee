"""Nothing lost, nothing stale, nothing raced (issue 9): the typed step contract, crash-safe
creation, writer leases and interrupted status, checksummed chunks, ``nsa verify``.

Real stores on disk, real ``nsa run`` processes killed with SIGKILL; nothing mocked.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import stopping_cli, wait_stopped

from nsa_dist.cli import main as nsa
from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec
from nsa_dist.errors import StoreError
from nsa_dist.pipeline import SpectralAnalyzer, Trainer, prepare_run, run_experiment, run_id
from nsa_dist.store import HessianStep, LeaseHeld, SpectrumStore, StepResult, run_arrays, step_specs

REPO = Path(__file__).resolve().parents[1]
TINY = dict(
    name="safe",
    data={"n": 32, "n_test": 8},
    model={"depth": 2, "width": 16},
    steps=30,
    record={"every": 10},
    spectrum={"k": 8, "test_points": True},
)
SLOW = {**TINY, "name": "slowsafe", "steps": 90, "record": {"every": 10}}  # 10 recorded steps
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
CMD = [sys.executable, "-m", "nsa_dist.cli", "run", "--plain"]


def _all_arrays(url: str, rid: str) -> dict[str, np.ndarray]:
    run = Client(url).run(rid)
    return {name: run.array(name) for name in run.array_names()}


def _assert_same_arrays(a_url: str, b_url: str, rid: str) -> None:
    a, b = _all_arrays(a_url, rid), _all_arrays(b_url, rid)
    assert sorted(a) == sorted(b), (
        f"arrays differ: only in a {sorted(set(a) - set(b))}, only in b {sorted(set(b) - set(a))}"
    )
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=f"array {name!r} differs from the uninterrupted run")


def _spec_file(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _wait_for(cond, what: str, proc: subprocess.Popen | None = None, timeout: float = 120.0, poll: float = 0.001):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the process ended (rc {proc.returncode}) before {what}: {out}")
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def _n_done(url: str, rid: str) -> int:
    try:
        return int(Client(url).run(rid).array("done").sum())
    except (StoreError, KeyError, ValueError, FileNotFoundError):
        return 0


# --------------------------------------------------------------------------- the step contract
def test_step_record_refuses_absent_unexpected_and_misshaped_arrays_before_writing(tmp_path):
    spec = ExperimentSpec(**TINY)
    store = SpectrumStore(str(tmp_path / "s.zarr"))
    run = prepare_run(spec, store)
    ck = next(iter(Trainer(run.plan, run.data).train_until(1)))
    result = SpectralAnalyzer(run.plan, run.data).analyze(ck)
    assert not run.plan.has("hessian_products")
    bad = dataclasses.replace(
        result,
        gram=dataclasses.replace(result.gram, energy_y=None),  # not computed
        hessian=HessianStep(hessian_products=3),
    )  # a part this run does not have
    with pytest.raises(StoreError) as e:
        run.writer.write_step(0, bad, ck.state)
    msg = str(e.value)
    assert "unknown key(s) hessian_products" in msg and "missing key(s) energy_y" in msg and "step index 0" in msg, msg
    short = dataclasses.replace(result, gram=dataclasses.replace(result.gram, eigenvalues=result.gram.eigenvalues[:3]))
    with pytest.raises(StoreError, match=r"eigenvalues has shape \(3,\), the store holds \(8,\)"):
        run.writer.write_step(0, short, ck.state)
    with pytest.raises(StoreError, match="eigenvalues has dtype <U1"):
        run.writer.write_step(
            0, StepResult.from_arrays({**result.arrays(), "eigenvalues": np.array(["x"] * 8)}), ck.state
        )
    reader = store.reader(run.run_id)
    written = {
        n: sorted(reader.present_chunks(n))
        for n in reader.names()
        if reader.specs[n].per_step and reader.present_chunks(n)
    }
    assert written == {}, f"a refused step wrote chunks: {written}"
    run.writer.write_step(0, result, ck.state)
    assert store.reader(run.run_id).done.tolist()[:2] == [True, False]
    # the contract is derived from run_arrays: every per-step array but the resume state and done
    # (index 0 also writes the arrays of the first recorded step: App. E's constant_gram_f_test)
    per_step = {
        a.name for a in run_arrays(run.writer.dims) if a.per_step and a.at in ("every", "eigenvectors", "first")
    }
    assert set(result.arrays()) == per_step - {"theta", "opt_slots", "rng_state", "done"}
    assert set(result.arrays()) == set(step_specs(run.writer.dims, eigenvectors=True, hessian=False, first=True))
    assert "constant_gram_f_test" in result.arrays()
    later = set(step_specs(run.writer.dims, eigenvectors=True, hessian=False))
    assert later == set(result.arrays()) - {"constant_gram_f_test"}


def test_k_larger_than_n_is_a_logged_clamp(tmp_path, caplog):
    spec = ExperimentSpec(**{**TINY, "name": "bigk", "steps": 2, "record": {"every": 1}, "spectrum": {"k": 100}})
    with caplog.at_level(logging.WARNING, logger="nsa_dist"):
        out = run_experiment(spec, SpectrumStore(str(tmp_path / "s.zarr")))
    assert "spectrum.k=100 is larger than the 32 training points" in caplog.text
    assert Client(str(tmp_path / "s.zarr")).run(out.run_id).eigenvalues.shape == (2, 32)
    # a spec without spectrum.k: the default's clamp is noted (INFO) and called the default, not a warning
    caplog.clear()
    spec = ExperimentSpec(**{**TINY, "name": "defaultk", "steps": 2, "record": {"every": 1}, "spectrum": {}})
    with caplog.at_level(logging.INFO, logger="nsa_dist"):
        run_experiment(spec, SpectrumStore(str(tmp_path / "s.zarr")))
    said = [r for r in caplog.records if "is larger than the 32 training points" in r.getMessage()]
    assert [(r.levelno, r.getMessage().split(":")[1].strip()[:32]) for r in said] == [
        (logging.INFO, "spectrum.k=100 (the default) is ")
    ], [(r.levelname, r.getMessage()) for r in said]


# --------------------------------------------------------------------------- store roots
def test_a_non_store_directory_or_foreign_schema_is_refused(tmp_path, capsys):
    d = tmp_path / "photos"
    d.mkdir()
    (d / "holiday.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(StoreError, match="non-empty directory that is not an nsa-dist spectrum store"):
        SpectrumStore(str(d))
    assert sorted(os.listdir(d)) == ["holiday.jpg"]
    rc = nsa(["run", str(_spec_file(tmp_path, TINY)), "--store", str(d), "--plain"])
    err = capsys.readouterr().err
    assert rc == 2 and "not an nsa-dist spectrum store" in err and len(err.strip().splitlines()) == 1, err
    other = tmp_path / "other.zarr"
    SpectrumStore(str(other))
    meta = json.loads((other / "zarr.json").read_text())
    meta["attributes"]["nsa_dist_schema"] = 999
    (other / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="schema 999"):
        SpectrumStore(str(other))
    with pytest.raises(StoreError, match="schema 999"):
        Client(str(other))


def test_nsa_status_without_a_cluster_is_one_line(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = nsa(["status", "--address", f"http://127.0.0.1:{port}"])
    err = capsys.readouterr().err
    assert rc == 2 and "no Ray cluster answers at" in err and len(err.strip().splitlines()) == 1, err


# --------------------------------------------------------------------------- leases
def test_a_fresh_lease_refuses_a_second_writer_and_an_expired_one_is_taken_over(tmp_path):
    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(**TINY)
    rid = run_id(spec)
    store = SpectrumStore(url)
    now = time.time()
    other = {
        "host": "node-7.elsewhere",
        "pid": 4242,
        "since": now - 60,
        "heartbeat": now,
        "ttl": 30.0,
        "token": "theirs",
        "released": False,
    }
    store.write_lease(rid, other)
    with pytest.raises(LeaseHeld) as e:
        run_experiment(spec, store)
    assert "host node-7.elsewhere, pid 4242, since" in str(e.value)
    assert not store.has_run(rid), "the refused writer created the run"
    store.write_lease(rid, {**other, "heartbeat": now - 31})  # no heartbeat for longer than its ttl
    assert run_experiment(spec, store).status == "done"
    info = store.lease_info(rid)
    assert info.pid == os.getpid() and info.released


def test_a_running_status_under_an_expired_lease_reads_interrupted(tmp_path, capsys):
    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(**TINY)
    out = run_experiment(spec, SpectrumStore(url))
    store = SpectrumStore(url)
    w = store.writer(out.run_id, store.run_attrs(out.run_id)["spec"], store.dims(out.run_id))
    w.set_status("running")
    now = time.time()
    lease = {
        "host": "node-7.elsewhere",
        "pid": 4242,
        "since": now - 600,
        "heartbeat": now,
        "ttl": 30.0,
        "token": "t",
        "released": False,
    }
    store.write_lease(out.run_id, lease)
    assert Client(url).run(out.run_id).status == "running"
    store.write_lease(out.run_id, {**lease, "heartbeat": now - 120})
    run = Client(url).run(out.run_id)
    assert run.status == "interrupted" and "last sign of life" in run.reason and "re-run to resume" in run.reason
    assert Client(url).runs().loc[0, "status"] == "interrupted"
    assert nsa(["status", "--store", url]) == 0
    assert "interrupted" in capsys.readouterr().out


@pytest.mark.slow
def test_two_concurrent_writers_one_computes_the_other_refuses(tmp_path):
    path = _spec_file(tmp_path, TINY)
    url = str(tmp_path / "s.zarr")
    # whichever takes the run stops itself once its first step is written, so the other surely
    # meets it live (started together, a lagging one could find the run finished and exit 0);
    # a ttl far beyond the test keeps the stopped holder's lease fresh however loaded the machine
    env = {**ENV, "NSA_LEASE_TTL": "600"}
    cmd = stopping_cli("nsa_dist.store.zarr_store:RunWriter.write_step", "args[1] == 0", after=True)
    cmd += CMD[3:] + [str(path), "--store", url]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    deadline = time.time() + 300
    while not any(p.poll() is not None for p in procs) and time.time() < deadline:
        time.sleep(0.05)
    ended = [p for p in procs if p.poll() is not None]
    assert len(ended) == 1, f"expected one writer to refuse while the other holds the run: {[p.poll() for p in procs]}"
    (loser,), (winner,) = ended, [p for p in procs if p is not ended[0]]
    wait_stopped(winner)
    out, err = loser.communicate()
    assert loser.returncode == 2, f"rc {loser.returncode}: {out} {err}"
    assert f"pid {winner.pid}" in err and "being written by another process" in err, err
    os.kill(winner.pid, signal.SIGCONT)
    out, err = winner.communicate(timeout=300)
    assert winner.returncode == 0, f"rc {winner.returncode}: {out} {err}"
    rid = run_id(ExperimentSpec(**TINY))
    run = Client(url).run(rid)
    assert run.status == "done" and len(run.steps) == 4
    # a writer asked to wait starts once the lease is released
    store = SpectrumStore(url)
    lease = store.lease([rid]).acquire()
    proc = subprocess.Popen(
        CMD + [str(path), "--store", url, "--wait"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    time.sleep(3)
    assert proc.poll() is None, f"the waiting writer did not wait: {proc.stdout.read()}"
    lease.release()
    assert proc.wait(timeout=120) == 0, proc.stdout.read()


# --------------------------------------------------------------------------- kills at many instants
@pytest.mark.slow
def test_kill_at_many_instants_including_creation_resumes_bit_identical(tmp_path):
    spec = ExperimentSpec(**SLOW)
    rid = run_id(spec)
    a, b = str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")
    run_experiment(spec, SpectrumStore(a))
    path = _spec_file(tmp_path, SLOW)
    step = "nsa_dist.store.zarr_store:RunWriter.write_step"
    kills = [  # each writer stops itself at its point, then is killed (a poller raced the writer)
        ("inside run creation", "nsa_dist.store.zarr_store:RunWriter._create", "args[1].name == 'steps'", False),
        ("two steps are done", step, "args[1] == 1", True),
        ("six steps are done", step, "args[1] == 5", True),
        ("the last step is done (before preservation)", "nsa_dist.pipeline.session:_write_preservation", "True", False),
    ]
    for i, (what, target, when, after) in enumerate(kills):
        cmd = stopping_cli(target, when, after) + ["run", "--plain", str(path), "--store", b]
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_stopped(proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"not killed when {what}"
        if i == 0:
            assert SpectrumStore(b).run_attrs(rid).get("creating") is True, "the kill landed outside run creation"
            run = Client(b).run(rid)  # it read `pending`, no reason (audit K)
            assert run.status == "interrupted" and "creation was interrupted" in run.reason, (run.status, run.reason)
            listed = Client(b).runs().set_index("id").loc[rid]
            assert listed["status"] == "interrupted" and "creation was interrupted" in listed["reason"], listed
            continue
        assert _n_done(b, rid) == (2, 6, 10)[i - 1], f"{_n_done(b, rid)} steps done when killed as {what}"
        run = Client(b).run(rid)  # its writer is dead: the run shows interrupted, not running
        assert run.status == "interrupted" and "re-run to resume" in run.reason, (run.status, run.reason)
    assert nsa(["run", "--plain", str(path), "--store", b]) == 0  # the resume need not be a process of its own
    assert Client(b).run(rid).status == "done"
    assert Client(b).run(rid).has("preservation")
    _assert_same_arrays(a, b, rid)


def test_a_kill_after_the_last_step_still_writes_preservation(tmp_path):
    spec = ExperimentSpec(**TINY)
    url = str(tmp_path / "s.zarr")

    def stop_at_last(ck, result):
        if ck.index == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(spec, SpectrumStore(url), on_step=stop_at_last)
    run = Client(url).run(run_id(spec))
    assert len(run.steps) == 4 and not run.has("preservation") and run.status == "interrupted"
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run(run_id(spec))
    assert run.status == "done" and run.has("preservation")


# --------------------------------------------------------------------------- damage
def _chunk(url: str, rid: str, array: str, key: str) -> Path:
    return Path(url) / "runs" / rid / array / key


def test_damaged_chunks_are_named_found_by_verify_and_recomputed(tmp_path, capsys):
    spec = ExperimentSpec(**TINY)
    a, b = str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")
    rid = run_experiment(spec, SpectrumStore(a)).run_id
    shutil.copytree(a, b)
    corrupt = _chunk(b, rid, "eigenvalues", "c/2/0")
    raw = bytearray(corrupt.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(raw))
    _chunk(b, rid, "f", "c/1/0").unlink()  # a lost chunk of a done step
    trace = _chunk(b, rid, "loss_trace", "c/0")
    trace.write_bytes(trace.read_bytes()[:-3])  # a truncated chunk of a static array
    run = Client(b).run(rid)
    with pytest.raises(StoreError) as e:
        run.eigenvalues
    msg = str(e.value)
    assert "array 'eigenvalues' at step 20 (index 2) is damaged" in msg and str(corrupt) in msg, msg
    with pytest.raises(StoreError, match=r"array 'f' at step 10 \(index 1\) is damaged: chunk .*f/c/1/0 is missing"):
        run.outputs(10)
    np.testing.assert_array_equal(run.train_loss, Client(a).run(rid).train_loss)  # the rest reads fine
    assert nsa(["verify", b]) == 1
    out = capsys.readouterr().out
    assert "eigenvalues step 20 (index 2)" in out and "f step 10 (index 1)" in out and "3 damaged piece(s)" in out, out
    assert "loss_trace: unreadable chunk" in out and str(trace) in out, out
    with pytest.raises(StoreError, match=r"array 'loss_trace' is damaged \(.*loss_trace/c/0: "):
        run.loss_trace
    with SpectrumStore(b).lease([rid]):  # a live writer holds the run: the repair goes through a writer, so waits
        assert nsa(["verify", b, "--mark"]) == 2
    err = capsys.readouterr().err
    assert "being written by this same process" in err and len(err.strip().splitlines()) == 1, err
    assert Client(b).run(rid).steps.tolist() == [0, 10, 20, 29], "a refused repair changed the run"
    assert nsa(["verify", b, "--mark"]) == 0
    assert "step indices [1, 2] marked not done" in capsys.readouterr().out
    assert Client(b).run(rid).steps.tolist() == [0, 29]
    assert run_experiment(spec, SpectrumStore(b)).steps_computed == 2
    assert nsa(["verify", b]) == 0
    _assert_same_arrays(a, b, rid)


def test_a_damaged_run_never_hides_the_others(tmp_path, capsys):
    url = str(tmp_path / "s.zarr")
    good = run_experiment(ExperimentSpec(**TINY), SpectrumStore(url)).run_id
    bad = run_experiment(ExperimentSpec(**{**TINY, "name": "bad", "steps": 11}), SpectrumStore(url)).run_id
    meta = Path(url) / "runs" / bad / "zarr.json"
    meta.write_text(meta.read_text()[:50])  # truncated
    df = Client(url).runs().set_index("id")
    assert df.loc[good, "status"] == "done"
    assert df.loc[bad, "status"] == "damaged" and str(meta) in df.loc[bad, "reason"], df.loc[bad, "reason"]
    with pytest.raises(StoreError, match=f"{meta}.* is unreadable"):
        Client(url).run(bad)
    capsys.readouterr()
    assert nsa(["ls", "--store", url]) == 0
    listing = capsys.readouterr().out
    assert "damaged" in listing and "done" in listing, listing
    with pytest.raises(StoreError, match=f"{meta}.* is unreadable"):
        run_experiment(ExperimentSpec(**{**TINY, "name": "bad", "steps": 11}), SpectrumStore(url))
    damage = Client(url).verify()
    assert [d.run_id for d in damage] == [bad] and str(meta) in damage[0].path


def test_a_run_with_one_damaged_chunk_keeps_what_is_readable_in_its_row(tmp_path, capsys):
    """The last step's λ_max chunk flipped: the run's row was "damaged 0/0" with N, L×W, loss and
    λ_max blank, though its spec and every other step are intact; it keeps them, and names the file."""
    from nsa_dist.store import run_summaries

    url = str(tmp_path / "s.zarr")
    rid = run_experiment(ExperimentSpec(**TINY), SpectrumStore(url)).run_id
    total = len(Client(url).run(rid).steps)
    chunk = Path(url) / "runs" / rid / "eigenvalues" / "c" / str(total - 1) / "0"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    (row,) = run_summaries(SpectrumStore(url, mode="r"))
    assert row.status == "damaged" and str(chunk) in row.reason, (row.status, row.reason)
    assert (row.steps_done, row.steps_total) == (total, total), (row.steps_done, row.steps_total)
    assert row.spec["model"]["width"] == TINY["model"]["width"] and np.isfinite(row.loss), row
    assert np.isnan(row.lambda_max), row.lambda_max  # the damaged value is not made up
    capsys.readouterr()
    assert nsa(["ls", "--store", url]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if rid in ln)
    assert (
        "damaged" in line
        and f"{total}/{total}" in line
        and f"{TINY['model']['depth']}×{TINY['model']['width']}" in line
    ), line


def test_no_chunk_exceeds_the_object_store_bound_at_mnist_scale():
    from nsa_dist.store import RunDims
    from nsa_dist.store.schema import CHUNK_BYTES

    D = RunDims(
        N=60000,
        M=10000,
        d=784,
        Ko=10,
        P=10_000_000,
        S=50,
        T=600000,
        K=1000,
        k_test=1000,
        n_images=0,
        image_size=0,
        fourier_size=0,
        n_slots=2,
        rng_bytes=16,
        store_eigenvectors=True,
        k_full=500,
    )
    too_big = {}
    for a in run_arrays(D):
        if a.per_step:
            assert a.chunks[0] == 1, f"{a.name}: a chunk spans several steps {a.chunks}"
            nbytes = int(np.prod(a.chunks)) * np.dtype(a.dtype).itemsize
            if nbytes > CHUNK_BYTES:
                too_big[a.name] = (a.chunks, nbytes)
    assert not too_big, f"per-step chunks above {CHUNK_BYTES} bytes: {too_big}"
    specs = {a.name: a for a in run_arrays(D)}
    assert specs["eigenvectors"].chunks == (1, 60000, 34)  # along k: one eigenvector is one 8 MiB chunk's column
    assert specs["theta"].chunks == (1, 2097152) and specs["loss"].chunks == (1,)


@pytest.mark.slow
def test_a_killed_sweep_driver_leaves_nothing_a_resubmission_cannot_resume(tmp_path, local_ray):
    """SIGKILL the ``nsa sweep`` process (the coordinator, owner of the embedded Ray) mid-sweep:
    its runs read interrupted, and the same command again finishes them bit-identical (the
    resubmission runs in this process, on the session's embedded Ray: what is tested is what the
    killed driver left in the store, not a second Ray start)."""
    from nsa_dist.config import SweepSpec

    base = {**{k: v for k, v in SLOW.items() if k != "name"}, "steps": 50}  # 6 recorded steps a run
    sweep = {
        "name": "killsweep",
        "base": base,
        "grid": {"model.width": [8, 16]},
        "cluster": {"spectral_workers": 1, "max_inflight": 1},
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    url = str(tmp_path / "s.zarr")
    rids = [run_id(s) for s in SweepSpec.model_validate(sweep).expand()]
    cmd = [sys.executable, "-m", "nsa_dist.cli", "sweep", str(path), "--store", url, "--plain"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: sum(_n_done(url, r) for r in rids) >= 3, "three recorded steps", proc, timeout=240, poll=0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = [Client(url).run(r) for r in rids]
    assert any(r.status != "done" for r in partial), "the sweep finished before the kill"
    for r in partial:
        assert r.status in ("done", "interrupted", "pending"), (r.id, r.status, r.reason)
    assert nsa(["sweep", str(path), "--store", url, "--plain"]) == 0
    for spec in SweepSpec.model_validate(sweep).expand():
        ref = str(tmp_path / f"ref-{run_id(spec)}.zarr")
        run_experiment(spec, SpectrumStore(ref))
        assert Client(url).run(run_id(spec)).status == "done"
        _assert_same_arrays(ref, url, run_id(spec))


def test_writers_opening_one_new_store_at_once_all_open_it(tmp_path):
    """Six writers (threads) opening the same new store together, local or an object store: each
    opens it.  One's zarr.json being written made another's "non-empty directory / holds objects
    but is not a store" check refuse (local: 21 of 600 opens before; memory://: 27 of 300); a
    foreign non-empty directory is still refused."""
    import threading
    import uuid

    from nsa_dist.store import SpectrumStore

    errors: list[str] = []
    urls = [str(tmp_path / f"s{r}.zarr") for r in range(30)]
    urls += [f"memory://new-{uuid.uuid4().hex}/s.zarr" for _ in range(100)]  # object store: 3-27 of 300 before
    for r, url in enumerate(urls):
        start = threading.Barrier(6)

        def open_it(url: str, start: threading.Barrier, r: int) -> None:
            start.wait()
            try:
                SpectrumStore(url)
            except Exception as exc:  # noqa: BLE001 - every refusal is collected and shown
                errors.append(f"round {r}: {exc!r}")

        threads = [threading.Thread(target=open_it, args=(url, start, r)) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, f"{len(errors)} of {6 * len(urls)} opens refused: {errors[:3]}"
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match=r"is a non-empty directory that is not an nsa-dist spectrum store"):
        SpectrumStore(str(tmp_path / "foreign"))
