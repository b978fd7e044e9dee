"""One store contract, three stores (issue 23): a local path, ``memory://`` and S3 (a moto server on
loopback, one per module).  :class:`StoreContract` says what a spectrum store promises — creating and
reopening runs, steps written and read back with ``done`` set last, resuming, leases and fencing,
damage found, named and repaired through the writer, raw keys — and each subclass names a store.

Steps are written straight through :class:`RunWriter` with small made-up results of the schema's
shapes (:func:`_write_step`): the contract is the store's, not the analysis's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import numpy as np
import pytest

from nsa_dist.errors import StoreError
from nsa_dist.pipeline.checkpoint import TrainerState
from nsa_dist.store import (
    Keys,
    Lease,
    LeaseHeld,
    LeaseLost,
    RunDims,
    RunWriter,
    SpectrumStore,
    Status,
    StepResult,
    mark_damaged,
    run_arrays,
    run_summaries,
    step_specs,
    verify_store,
)

DIMS = RunDims(
    N=4,
    M=2,
    d=3,
    Ko=1,
    P=5,
    S=4,
    T=40,
    K=2,
    k_test=0,
    n_images=0,
    image_size=0,
    fourier_size=0,
    n_slots=1,
    rng_bytes=2,
    store_eigenvectors=False,
)
SPEC = {"name": "contract", "steps": 40}
RID = "contract-0001"
STEPS = np.arange(DIMS.S) * 10  # the recorded training steps t


def _value(index: int) -> float:
    return 10.0 * index + 0.5


def _write_step(w: RunWriter, index: int) -> None:
    """Recorded step ``index``: every array the schema asks of it, filled with :func:`_value`."""
    specs = step_specs(w.dims, eigenvectors=False, hessian=False, first=index == 0)
    result = {n: np.full(a.shape[1:], _value(index)).astype(a.dtype) for n, a in specs.items()}
    state = TrainerState(
        int(STEPS[index]),
        np.full(w.dims.P, _value(index), np.float32),
        np.full((w.dims.n_slots, w.dims.P), -_value(index), np.float32),
        np.full(w.dims.rng_bytes, index, np.uint8),
    )
    w.write_step(index, StepResult.from_arrays(result), state)


def _new_run(store: SpectrumStore) -> RunWriter:
    """Create run RID and write its static arrays."""
    w = store.writer(RID, SPEC, DIMS)
    static = {a.name: np.zeros(a.shape, a.dtype) for a in run_arrays(DIMS) if a.name in w.static_names()}
    w.write_static({**static, "steps": STEPS})
    return w


def _run(store: SpectrumStore, token: str | None = None, steps: tuple[int, ...] = ()) -> RunWriter:
    """The writer of run RID (copied from the template) after writing recorded steps ``steps``."""
    w = store.reopen(RID, token=token)
    for i in steps:
        _write_step(w, i)
    return w


def _copy(src: str, dst: str) -> None:
    """Every key of store ``src`` into ``dst`` (runs are made once per store kind: creating one
    makes ~100 requests to an object store)."""
    a, b = Keys(src, read_only=True), Keys(dst)
    for key in a.list_prefix(""):
        b.set(key, a.get(key))


def _other_writer_takes_over(store: SpectrumStore, ours: Lease) -> None:
    """Another host's writer holds the run's lease now (fresh, another token), as after this
    writer (holding ``ours``) was paused beyond its ttl: ours beats no more first.  A beat still
    running would put our lease back over theirs on an object store, which has no lock around a
    beat's read-then-put (against moto a beat's read-to-put takes ~28 ms: a takeover lands inside
    one of ttl=3's 1 s beats about once in 35, and was put back 4 times in 30 under 0.1 s beats)."""
    ours._stop.set()
    if ours._thread is not None:
        ours._thread.join()
    now = time.time()
    store.write_lease(
        RID,
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


class StoreContract:
    """What every spectrum store promises; a subclass gives ``new_url``: a factory of new store URLs."""

    @pytest.fixture(scope="class")
    @classmethod
    def new_url(cls) -> Callable[[], str]:
        raise NotImplementedError

    @pytest.fixture
    def url(self, new_url) -> str:
        """A new, empty store."""
        return new_url()

    @pytest.fixture(scope="class")
    @classmethod
    def template(cls, new_url) -> str:
        """A store holding run RID with its static arrays and no recorded step."""
        url = new_url()
        _new_run(SpectrumStore(url))
        return url

    @pytest.fixture
    def run_url(self, new_url, template) -> str:
        """A new store holding a copy of the template's run."""
        url = new_url()
        _copy(template, url)
        return url

    # ------------------------------------------------------------------ raw keys
    def test_raw_keys_round_trip_list_and_delete(self, url):
        keys = Keys(url)
        assert keys.get("a/b/x") is None and not keys.exists("a/b/x") and keys.get_json("a/zarr.json") is None
        keys.set("a/b/x", b"\x00\x01")
        keys.set("a/b/y", b"yy")
        keys.set_group("a", {"k": [1, 2]})
        assert keys.get("a/b/x") == b"\x00\x01" and keys.exists("a/b/y")
        assert keys.get_json("a/zarr.json")["attributes"] == {"k": [1, 2]}
        assert sorted(keys.list_dir("a")) == ["b", "zarr.json"]
        assert sorted(keys.list_prefix("a/")) == ["a/b/x", "a/b/y", "a/zarr.json"]
        keys.delete("a/b/x")
        assert not keys.exists("a/b/x") and sorted(keys.list_prefix("a/b/")) == ["a/b/y"]
        keys.set("a/bad.json", b"{not json")
        with pytest.raises(StoreError, match=r"a/bad.json is unreadable"):
            keys.get_json("a/bad.json")

    # ------------------------------------------------------------------ opening
    def test_a_missing_store_is_one_error_and_a_foreign_one_is_refused(self, url):
        with pytest.raises(StoreError, match="no spectrum store at"):
            SpectrumStore(url, mode="r")
        Keys(url).set("notes.txt", b"not a store")
        with pytest.raises(StoreError, match="not an nsa-dist spectrum store"):
            SpectrumStore(url)
        assert Keys(url).list_prefix("") == ["notes.txt"], "the refused store wrote into the foreign prefix"

    def test_runs_are_created_listed_and_reopened_only_with_their_spec(self, url):
        store = SpectrumStore(url)
        assert store.run_ids() == [] and not store.has_run(RID)
        _new_run(store)
        again = SpectrumStore(url, mode="r")
        assert again.run_ids() == [RID] and again.has_run(RID) and again.dims(RID) == DIMS
        attrs = again.run_attrs(RID)
        assert attrs["spec"] == SPEC and attrs["status"] == Status.PENDING and attrs["creating"] is False
        assert again.run_status(RID) == (Status.PENDING, None)
        np.testing.assert_array_equal(again.reader(RID).read("steps"), STEPS)
        with pytest.raises(StoreError, match=r"with a different spec \(steps: 40 → 41\)"):
            SpectrumStore(url).writer(RID, {**SPEC, "steps": 41}, DIMS)
        with pytest.raises(StoreError, match=f"no run 'nope' in .*runs: {RID}"):
            again.reader("nope")
        store.record_sweep("sw", {"grid": {"a": [1]}}, [RID])
        assert SpectrumStore(url, mode="r").sweeps() == {"sw": [RID]}
        assert SpectrumStore(url, mode="r").sweep_spec("sw") == {"grid": {"a": [1]}}

    def test_a_run_whose_creation_was_interrupted_is_finished_by_the_next_writer(self, run_url):
        store = SpectrumStore(run_url)
        store.group(RID).attrs["creating"] = True  # its writer was killed while making the arrays
        store.keys.delete(f"runs/{RID}/loss/zarr.json")
        status, reason = store.run_status(RID)
        assert status == "interrupted" and reason.startswith("its creation was interrupted"), (status, reason)
        with pytest.raises(StoreError, match="its creation was interrupted before array 'loss' was made"):
            store.reader(RID).read("loss")
        (found,) = verify_store(store)
        assert found.unfinished and "creation was interrupted" in found.problem
        assert mark_damaged(store, [found]) == {}, "an interrupted creation is not damage"
        w = store.writer(RID, SPEC, DIMS)
        _write_step(w, 0)
        assert not w.attrs()["creating"] and store.reader(RID).read_step("loss", 0) == _value(0)

    # ------------------------------------------------------------------ steps
    def test_steps_are_read_back_and_resume_from_the_unbroken_prefix(self, run_url):
        w = _run(SpectrumStore(run_url), steps=(0, 1, 3))  # step 2 not recorded (e.g. still on a worker)
        r = SpectrumStore(run_url, mode="r").reader(RID)
        assert r.done.tolist() == [True, True, False, True]
        assert r.read_step("loss", 3) == _value(3)
        np.testing.assert_array_equal(r.read_steps("f", np.array([0, 1])), np.full((2, DIMS.N), [[0.5], [10.5]]))
        assert w.resume_index() == 1 and w.resume_index(before=1) == 0
        state = w.state_at(1)
        assert state["step"] == 10 and state["theta"].tolist() == [10.5] * DIMS.P
        assert state["slots"].tolist() == [[-10.5] * DIMS.P] and state["rng"].tolist() == [1, 1]
        (row,) = run_summaries(SpectrumStore(run_url, mode="r"))
        assert (row.id, row.steps_done, row.steps_total, row.last_step, row.loss) == (RID, 3, 4, 30, _value(3))

    def test_a_step_that_does_not_match_the_schema_writes_nothing(self, run_url):
        store = SpectrumStore(run_url)
        w = _run(store)
        specs = step_specs(DIMS, eigenvectors=False, hessian=False, first=True)
        bad = {n: np.zeros(a.shape[1:], a.dtype) for n, a in specs.items() if n != "loss"}
        state = TrainerState(0, np.zeros(DIMS.P, np.float32), np.zeros((1, DIMS.P), np.float32), np.zeros(2, np.uint8))
        with pytest.raises(StoreError, match=r"missing key\(s\) loss .*nothing of this step was written"):
            w.write_step(0, StepResult.from_arrays(bad), state)
        r = store.reader(RID)
        written = {n: r.present_chunks(n) for n in r.names() if r.specs[n].per_step and r.present_chunks(n)}
        assert written == {} and not r.done.any()

    # ------------------------------------------------------------------ leases
    def test_a_lease_refuses_a_second_writer_and_a_running_run_without_one_reads_interrupted(self, run_url):
        store = SpectrumStore(run_url)
        w = _run(store)
        with store.lease([RID], ttl=30.0) as lease:
            assert store.lease_info(RID).token == lease.token and store.creation_live(RID)
            with pytest.raises(LeaseHeld, match=f"run '{RID}' .* is being written by this same process") as e:
                SpectrumStore(run_url).lease([RID], ttl=30.0).acquire()
            assert "(--wait; for a job, nsa submit --wait-for-writers)" in str(e.value), e.value  # audit Q
            w.set_status(Status.RUNNING)
            assert SpectrumStore(run_url, mode="r").run_status(RID) == (Status.RUNNING, None)
        status, reason = SpectrumStore(run_url, mode="r").run_status(RID)
        assert status == Status.INTERRUPTED and "re-run to resume" in reason
        assert store.lease_info(RID).released
        with store.lease([RID], ttl=30.0) as again:  # a released lease is taken at once
            assert store.lease_info(RID).token == again.token

    def test_a_writer_whose_lease_was_taken_over_writes_nothing_more(self, run_url):
        store = SpectrumStore(run_url)
        with store.lease([RID], ttl=30.0) as lease:
            w = _run(store, token=lease.token, steps=(0,))
            _other_writer_takes_over(store, lease)
            with pytest.raises(LeaseLost, match="host node-7.elsewhere, pid 4242, since .* took the run over"):
                _write_step(w, 1)
            with pytest.raises(LeaseLost):
                w.set_status(Status.DONE)
        assert store.lease_info(RID).token == "theirs", "releasing overwrote the other writer's lease"
        r = store.reader(RID)
        assert r.done.tolist() == [True, False, False, False] and r.present_chunks("loss") == {"c/0"}
        assert r.attrs["status"] == Status.PENDING

    # ------------------------------------------------------------------ damage
    def test_damaged_chunks_are_named_and_repaired_through_the_writer(self, run_url):
        store = SpectrumStore(run_url)
        _run(store, steps=(0, 1, 2))
        chunk = f"runs/{RID}/eigenvalues/c/1/0"
        raw = bytearray(store.keys.get(chunk))
        raw[len(raw) // 2] ^= 0xFF
        store.keys.set(chunk, bytes(raw))  # fails its CRC32C checksum
        store.keys.delete(f"runs/{RID}/f/c/2/0")  # a lost chunk of a done step
        r = SpectrumStore(run_url, mode="r").reader(RID)
        with pytest.raises(
            StoreError, match=r"array 'eigenvalues' at step 10 \(index 1\) is damaged .*eigenvalues/c/1/0"
        ):
            r.read_steps("eigenvalues", np.arange(3))
        with pytest.raises(
            StoreError, match=r"array 'f' at step 20 \(index 2\) is damaged: chunk .*f/c/2/0 is missing"
        ):
            r.read_step("f", 2)
        assert r.read_step("loss", 2) == _value(2), "the rest reads fine"
        damage = verify_store(SpectrumStore(run_url, mode="r"))
        assert sorted((d.array, d.index, d.step) for d in damage) == [("eigenvalues", 1, 10), ("f", 2, 20)]
        assert mark_damaged(store, damage) == {RID: [1, 2]}
        r = store.reader(RID)
        assert r.done.tolist() == [True, False, False, False] and not store.keys.exists(chunk)
        assert r.attrs["status"] == Status.PENDING and "2 damaged step(s)" in r.attrs["reason"]
        assert store.lease_info(RID).released, "the repair kept the run's lease"
        assert verify_store(store) == [], "steps not done are not damage"
        w = store.writer(RID, SPEC, DIMS)
        assert w.resume_index() == 0
        for i in (1, 2):
            _write_step(w, i)
        r = store.reader(RID)
        assert r.read_steps("eigenvalues", np.arange(3))[:, 0].tolist() == [0.5, 10.5, 20.5]
        assert r.read_step("f", 2).tolist() == [20.5] * DIMS.N

    def test_a_repair_waits_for_no_live_writer_and_is_fenced(self, run_url):
        store = SpectrumStore(run_url)
        _run(store, steps=(0, 1))
        store.keys.delete(f"runs/{RID}/loss/c/1")
        damage = verify_store(store)
        assert [(d.array, d.index) for d in damage] == [("loss", 1)]
        with store.lease([RID], ttl=30.0) as lease:
            with pytest.raises(LeaseHeld, match="being written by this same process"):
                mark_damaged(SpectrumStore(run_url), damage)
            assert store.reader(RID).done.tolist()[:2] == [True, True], "a refused repair changed the run"
            w = store.reopen(RID, token=lease.token)
            with pytest.raises(StoreError, match="refusing to delete keys of another run: runs/other/loss/c/1"):
                w.forget_steps([1], ["runs/other/loss/c/1"], static_damaged=False, reason="x")
            _other_writer_takes_over(store, lease)
            with pytest.raises(LeaseLost):
                w.forget_steps([1], [], static_damaged=False, reason="x")
        assert store.reader(RID).done.tolist()[:2] == [True, True]
        store.write_lease(
            RID, {"host": "h", "pid": 1, "since": 0.0, "heartbeat": 0.0, "ttl": 1.0, "token": "old", "released": True}
        )
        assert mark_damaged(store, damage) == {RID: [1]}

    def test_damaged_metadata_is_named_and_not_repaired(self, run_url):
        store = SpectrumStore(run_url)
        _run(store, steps=(0,))
        store.keys.set(f"runs/{RID}/loss/zarr.json", b"{truncated")
        (d,) = verify_store(SpectrumStore(run_url, mode="r"))
        assert d.array == "loss" and d.path.endswith("loss/zarr.json") and "unreadable" in d.problem
        with pytest.raises(StoreError, match=r"cannot repair damaged metadata .*loss/zarr.json"):
            mark_damaged(store, [d])


class TestLocalStore(StoreContract):
    @pytest.fixture(scope="class")
    @classmethod
    def new_url(cls, tmp_path_factory) -> Callable[[], str]:
        return lambda: str(tmp_path_factory.mktemp("store") / "s.zarr")


class TestMemoryStore(StoreContract):
    @pytest.fixture(scope="class")
    @classmethod
    def new_url(cls) -> Callable[[], str]:
        return lambda: f"memory://nsa-{uuid.uuid4().hex[:8]}/s.zarr"


@pytest.fixture(scope="module")
def s3_bucket(s3_server):
    """A bucket of its own on the session's moto S3 server on loopback (conftest.s3_server), with
    the AWS_* variables that reach it set for the module."""
    pytest.importorskip("s3fs")
    import boto3

    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.items():
            mp.setenv(k, v)
        name = f"nsa-contract-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=s3_server["AWS_ENDPOINT_URL"]).create_bucket(Bucket=name)
        yield name


class TestS3Store(StoreContract):
    @pytest.fixture(scope="class")
    @classmethod
    def new_url(cls, s3_bucket) -> Callable[[], str]:
        return lambda: f"s3://{s3_bucket}/{uuid.uuid4().hex[:8]}.zarr"


def test_a_misspelt_run_name_is_found_among_many_runs():
    """With 28 runs, `nsa show quikstart` listed the first ten ids and never the run meant."""
    from nsa_dist.store.runs import no_such_run

    ids = [f"run{i:02d}-0123456789" for i in range(26)] + ["quickstart-596f17d55e", "demo__depth-6-1234567890"]
    msg = str(no_such_run("quikstart", "s.zarr", ids))
    assert msg.startswith("no run 'quikstart' in 's.zarr' (runs: quickstart-596f17d55e, run00-"), msg
    assert "… (28 in all)" in msg and msg.endswith("did you mean 'quickstart-596f17d55e'?"), msg
    assert (
        str(no_such_run("zz", "s.zarr", ids[:2]))
        == "no run 'zz' in 's.zarr' (runs: run00-0123456789, run01-0123456789)"
    )


def test_a_status_reason_is_one_line(tmp_path):
    """A reason of many lines (Ray's out-of-memory report) is stored as one line, capped."""
    from nsa_dist.store.zarr_store import _REASON_CHARS

    w = SpectrumStore(str(tmp_path / "s.zarr")).writer(RID, SPEC, DIMS)
    w.set_status(Status.FAILED, "Task was killed due to low memory.\n\nMemory on the node:\n" + "x " * 2000, 3)
    status, reason = w.status()
    assert "\n" not in reason and len(reason) == _REASON_CHARS and reason.endswith("…"), reason[:200]
    assert reason.startswith("Task was killed due to low memory. Memory on the node: x x"), reason[:200]
