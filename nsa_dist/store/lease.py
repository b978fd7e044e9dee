"""Writer leases: one process drives a run at a time, and a dead one is seen as dead.

A lease is the small group ``leases/<run id>`` of the store whose attributes name the writer
(host, pid, since) and its last heartbeat.  The holder refreshes it from a background thread
every ``ttl / 3`` seconds; a lease whose heartbeat is older than its ``ttl`` is *expired*, and
a run whose stored status says ``running`` under an expired (or released) lease is shown as
``interrupted`` (see :func:`effective_status`).  Acquiring works on any store (local paths and
object stores alike): write the lease with a random token, wait ``settle`` seconds, read it
back — whoever's token is there holds it; the other refuses naming the holder.  A lease
whose writer ran on this host and whose pid is gone is expired at once.

The token is also a *fencing token*: a writer given it (``RunWriter(token=…)``) reads the lease
back before each write and before committing a step (``done[i]``), and a writer whose lease was
taken over — it was paused (Ctrl-Z, SIGSTOP, a VM freeze) or cut off longer than the ttl —
raises :class:`LeaseLost` instead of writing anything more (:func:`check_holder`).  A heartbeat
alone cannot do this: the paused writer's first act on waking may be a write, not a beat.

A check before a write still leaves the instant between the two: a writer paused right after
its check wakes up holding bytes it then writes over its successor's.  On a local store a
writer's puts therefore land by a rename *out of its own write folder* ``leases/<run id>/w-<token>``
(:mod:`.fencing`), made before its lease was written; a writer that takes the run over renames
every other writer's folder away (:func:`revoke_others`) before it writes anything, so a stale
rename finds no source and fails — the filesystem makes the check and the put one step, and no
lock is held while a writer may be stopped.  The lease's own read-then-write (take, renew,
release) runs under the run's lock file ``leases/<run id>/lock`` (:func:`run_lock`), held for a
read and a rename.  Object stores have neither: there the window stays (docs/design-notes.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nsa_dist.errors import StoreError
from nsa_dist.store.keys import Keys
from nsa_dist.store.locks import file_lock
from nsa_dist.store.status import STORED_STATUSES, Status

__all__ = [
    "Lease",
    "LeaseHeld",
    "LeaseInfo",
    "LeaseLost",
    "check_holder",
    "default_ttl",
    "effective_status",
    "lease_lost",
    "lease_on_disk",
    "lock_timeout",
    "parse_lease",
    "read_lease",
    "revoke_others",
    "run_lock",
    "write_folder",
    "write_lease",
]

INTERRUPTED_HINT = "re-run to resume"


def default_ttl() -> float:
    """Seconds without a heartbeat after which a lease expires ($NSA_LEASE_TTL, default 30)."""
    return float(os.environ.get("NSA_LEASE_TTL", "30"))


class LeaseHeld(StoreError):
    """Another live writer holds the run's lease."""


class LeaseLost(StoreError):
    """This writer's lease was taken over by another writer: it must not write anything more."""


class RunRefused(StoreError):
    """The run was refused before anything of it was written (e.g. its data changed): the lease
    this process took for it is handed back to the writer it replaced, so the run's "last sign of
    life" still names that writer, not the refused process."""


def read_lease(keys: Keys, run_id: str) -> LeaseInfo | None:
    """The run's lease as last written, or None (absent or torn)."""
    return parse_lease(keys.get(f"leases/{run_id}/zarr.json"))


def lock_timeout() -> float:
    """Seconds to wait for a run's lock file: it is held for microseconds to milliseconds, so
    longer means a stopped holder (at least 10 s, and two ttls)."""
    return max(10.0, 2 * default_ttl())


def run_lock(keys: Keys, run_id: str) -> AbstractContextManager[None]:
    """The run's lock ``leases/<run id>/lock`` on a local store (a no-op on object stores).

    Raises:
        LockTimeout: held by another process for :func:`lock_timeout` seconds (one line).
    """
    if not keys.local:
        return nullcontext()
    return file_lock(keys.path / "leases" / run_id / "lock", lock_timeout(), f"run {run_id!r} in {keys.url!r}")


def _leases_group(keys: Keys) -> None:
    if not keys.exists("leases/zarr.json"):  # a store made before leases
        keys.set_group("leases", {})


def _put_lease(keys: Keys, run_id: str, attrs: dict[str, Any]) -> None:
    _leases_group(keys)
    keys.set_group(f"leases/{run_id}", attrs)


@contextmanager
def _staged(keys: Keys, run_id: str, attrs: dict[str, Any]) -> Iterator[Callable[[], None]]:
    """The lease ``attrs`` made ready to land: on a local store written whole to a ``.partial``
    file beside its place before the run's lock is taken, so that landing it under the lock is
    one rename (the lock is held for microseconds: a writer stopped by Ctrl-Z is unlikely to be
    stopped inside it).  Elsewhere landing is the put.  Yields the function that lands it."""
    if not keys.local:
        yield lambda: _put_lease(keys, run_id, attrs)
        return
    _leases_group(keys)
    final = keys.path / "leases" / run_id / "zarr.json"
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"zarr.json.{uuid.uuid4().hex}.partial")
    tmp.write_bytes(Keys.group_json(attrs))
    try:
        yield lambda: tmp.replace(final)
    finally:
        tmp.unlink(missing_ok=True)


def write_folder(keys: Keys, run_id: str, token: str) -> Path:
    """The local write folder of the writer holding ``token``: its puts are renamed out of it."""
    return keys.path / "leases" / run_id / f"w-{token}"


def revoke_others(keys: Keys, run_id: str, token: str) -> None:
    """Rename every write folder of ``run_id`` but ``token``'s away and delete it (local store): a
    writer that lost the run can land nothing more, even a put it had already checked."""
    if not keys.local:
        return
    for folder in (keys.path / "leases" / run_id).glob("w-*"):
        if folder.name != f"w-{token}":
            gone = folder.with_name(f"revoked-{uuid.uuid4().hex}")
            try:
                folder.rename(gone)
            except FileNotFoundError:  # revoked by another taker at the same time
                continue
            shutil.rmtree(gone, ignore_errors=True)


def lease_on_disk(root: Path, run_id: str) -> LeaseInfo | None:
    """The lease of a local store at ``root``, read straight from its file (None: absent or torn)."""
    try:
        return parse_lease((root / "leases" / run_id / "zarr.json").read_bytes())
    except FileNotFoundError:
        return None


def _current(keys: Keys, run_id: str) -> LeaseInfo | None:
    """:func:`read_lease`, read straight from the file on a local store (inside the run's lock)."""
    return lease_on_disk(keys.path, run_id) if keys.local else read_lease(keys, run_id)


def write_lease(keys: Keys, run_id: str, attrs: dict[str, Any]) -> None:
    """Write the lease group ``leases/<run id>`` in one put (readers never see it half written),
    under the run's lock; on a local store the writers of other tokens are revoked."""
    token = str(attrs.get("token", ""))
    with _staged(keys, run_id, attrs) as land, run_lock(keys, run_id):
        if keys.local and token:
            write_folder(keys, run_id, token).mkdir(parents=True, exist_ok=True)
        land()
    revoke_others(keys, run_id, token)


def lease_lost(url: str, run_id: str, info: LeaseInfo | None) -> LeaseLost:
    """The one-line error of a writer whose lease ``info`` (None: removed) no longer carries its token."""
    who = f"{info.who()} took the run over" if info is not None else f"its lease leases/{run_id} was removed"
    return LeaseLost(
        f"run {run_id!r} in {url!r}: this writer (host {socket.gethostname()}, pid {os.getpid()}) "
        f"lost its lease — {who} (this writer was paused or cut off longer than the lease's ttl); "
        "stopped without writing anything more, the other writer finishes the run"
    )


def check_holder(keys: Keys, run_id: str, token: str) -> None:
    """Fencing: return only if the run's lease still carries ``token``.

    Raises:
        LeaseLost: another writer took the run over (named: host, pid, since when) or the lease
            was removed; one line, saying that this writer stopped without writing more.
    """
    info = read_lease(keys, run_id)
    if info is None or info.token != token:
        raise lease_lost(keys.url, run_id, info)


@dataclass(frozen=True)
class LeaseInfo:
    """What a lease says about its writer."""

    host: str
    pid: int
    since: float
    heartbeat: float
    ttl: float
    token: str
    released: bool = False

    @classmethod
    def from_attrs(cls, a: dict[str, Any]) -> LeaseInfo:
        return cls(
            str(a.get("host", "?")),
            int(a.get("pid", -1)),
            float(a.get("since", 0.0)),
            float(a.get("heartbeat", 0.0)),
            float(a.get("ttl", default_ttl())),
            str(a.get("token", "")),
            bool(a.get("released", False)),
        )

    def fresh(self, now: float | None = None) -> bool:
        """Held and heard from within its ttl — and, when the writer is on this host, alive (a
        killed local writer's lease is taken over at once, without waiting for the ttl)."""
        if self.released or (now if now is not None else time.time()) - self.heartbeat >= self.ttl:
            return False
        return self.host != socket.gethostname() or process_alive(self.pid)

    def who(self) -> str:
        return f"host {self.host}, pid {self.pid}, since {_iso(self.since)}"


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` on this host is alive (another user's process counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def parse_lease(raw: bytes | None) -> LeaseInfo | None:
    """The lease in a lease group's ``zarr.json`` bytes; None when absent or torn (as good as none)."""
    if raw is None:
        return None
    try:
        return LeaseInfo.from_attrs(json.loads(raw).get("attributes", {}))
    except (ValueError, AttributeError):
        return None


def effective_status(
    status: str | None, reason: str | None, lease: LeaseInfo | None, now: float | None = None, *, creating: bool = False
) -> tuple[str | None, str | None]:
    """(status, reason) as it is: ``running`` only while its writer's lease is fresh, else
    ``interrupted`` with the last sign of life; a run still marked ``creating`` whose writer holds
    no fresh lease is ``interrupted`` too (its creation was: it read ``pending``, no reason)."""
    if status is not None and status not in STORED_STATUSES:  # shown as it was: '12345' in `nsa ls` (an audit)
        return Status.DAMAGED, f"its status attribute holds {status!r}, no status: run `nsa verify` on the store"
    if creating and not (lease is not None and lease.fresh(now)):
        return Status.INTERRUPTED, f"its creation was interrupted; {INTERRUPTED_HINT}"
    if status != Status.RUNNING or (lease is not None and lease.fresh(now)):
        return status, reason
    if lease is None:
        return Status.INTERRUPTED, f"no writer holds this run; {INTERRUPTED_HINT}"
    return Status.INTERRUPTED, (
        f"last sign of life {_iso(lease.heartbeat)} from host {lease.host} pid {lease.pid}; {INTERRUPTED_HINT}"
    )


class Lease:
    """This process's leases on ``run_ids`` of a store, refreshed until :meth:`release`.

    Args:
        keys: the store's keys (``SpectrumStore.keys``).
        run_ids: the runs to hold (a sweep holds all of its runs).
        wait: seconds to wait for another writer's lease to be released or to expire (0: refuse
            at once with :class:`LeaseHeld`; ``None``: wait for ever).
        ttl: lease lifetime without a heartbeat (default $NSA_LEASE_TTL or 30 s).
    """

    def __init__(
        self,
        keys: Keys,
        run_ids: list[str],
        *,
        wait: float | None = 0.0,
        ttl: float | None = None,
        settle: float | None = None,
    ) -> None:
        self.keys, self.run_ids = keys, list(run_ids)
        self.ttl = float(ttl if ttl is not None else default_ttl())
        self.settle = settle if settle is not None else min(0.5, self.ttl / 10)
        self.wait = wait
        self.token = uuid.uuid4().hex
        self.host, self.pid, self.since = socket.gethostname(), os.getpid(), time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.lost: list[str] = []  # runs whose lease another writer took over while we held it
        self.replaced: dict[str, LeaseInfo] = {}  # the stale lease each of ours replaced, by run

    # ------------------------------------------------------------------ acquire / release
    def acquire(self) -> Lease:
        """Take every lease (refusing or waiting as asked), then start the heartbeat thread.

        All leases are written first and read back after one ``settle`` wait, so a sweep of many
        runs waits once, not once per run.
        """
        deadline = None if self.wait is None else time.time() + self.wait
        pending, taken = list(self.run_ids), []
        try:
            while pending:
                held = self._try(pending, taken)
                if not held:
                    break
                if deadline is not None and time.time() >= deadline:
                    raise self._refusal(*held[0])
                for rid in taken:  # keep the leases already taken fresh while waiting for the rest
                    self._put_if_ours(rid)
                time.sleep(min(1.0, max(0.05, min(o.ttl if o else 1.0 for _, o in held) / 4)))
                pending = [rid for rid, _ in held]
        except BaseException:
            for rid in taken:
                self._put_if_ours(rid, released=True)
            raise
        for rid in taken:  # before this process writes anything: no earlier writer can land a put
            revoke_others(self.keys, rid, self.token)
        self._thread = threading.Thread(target=self._beat, name="nsa-lease", daemon=True)
        self._thread.start()
        return self

    def _try(self, pending: list[str], taken: list[str]) -> list[tuple[str, LeaseInfo | None]]:
        """Write our lease where none is held, wait, read back: the (run, holder) pairs not ours."""
        held, written = [], []
        for rid in pending:
            with _staged(self.keys, rid, self._attrs()) as land, run_lock(self.keys, rid):
                other = _current(self.keys, rid)  # on a local store: read and write as one step
                if other is None or other.token == self.token or not other.fresh():
                    if other is not None and other.token != self.token:
                        self.replaced[rid] = other
                    if self.keys.local:  # made before the lease names us: never after a successor revoked it
                        write_folder(self.keys, rid, self.token).mkdir(parents=True, exist_ok=True)
                    land()
                    written.append(rid)
                else:
                    held.append((rid, other))
        if written:
            time.sleep(self.settle)  # a writer racing us has written by now: whose token stayed?
        for rid in written:
            now = read_lease(self.keys, rid)
            if now is not None and now.token == self.token:
                taken.append(rid)
            else:
                held.append((rid, now))
        return held

    def _refusal(self, rid: str, other: LeaseInfo | None) -> LeaseHeld:
        if other is None:
            return LeaseHeld(f"run {rid!r} in {self.keys.url!r}: its lease vanished while taking it; retry")
        waited = bool(self.wait)  # None (for ever) never gets here
        # a holder in this very process was called "another process" with this process's pid (an audit)
        ours = other.host == self.host and other.pid == self.pid
        who = (
            f"this same process (pid {self.pid}, since {_iso(other.since)}: another Tracker, run or store object of "
            "it holds the run — close that one first, tracker.close() or leave its `with` block"
            if ours
            else f"another process ({other.who()}"
        )
        return LeaseHeld(
            f"run {rid!r} in {self.keys.url!r} is being written by {who}; "
            f"last heartbeat {time.time() - other.heartbeat:.1f} s ago): refusing to write it twice — "
            + (
                f"the wait of {self.wait:g} s ran out; wait longer (--wait SECONDS, or --wait alone: until it ends; "
                "for a job, nsa submit --wait-for-writers) or use another store"
                if waited
                else "wait for it (--wait; for a job, nsa submit --wait-for-writers) or use another store"
            )
        )

    def _attrs(self, released: bool = False) -> dict[str, Any]:
        """Our lease, heard from now."""
        return {
            "host": self.host,
            "pid": self.pid,
            "since": self.since,
            "heartbeat": time.time(),
            "ttl": self.ttl,
            "token": self.token,
            "released": released,
        }

    def _put_if_ours(self, rid: str, released: bool = False) -> None:
        """Renew (or release) our lease of ``rid`` unless another writer took it over: the check
        and the put as one step under the run's lock on a local store."""
        with _staged(self.keys, rid, self._attrs(released)) as land, run_lock(self.keys, rid):
            if self._still_ours(rid):
                land()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            self.refresh()

    def refresh(self) -> None:
        """Renew every lease still ours (one that another writer took over is given up)."""
        with self._lock:
            for rid in [r for r in self.run_ids if r not in self.lost]:
                try:
                    self._put_if_ours(rid)
                except Exception:  # noqa: BLE001 — a flaky store: try again at the next beat
                    pass

    def _still_ours(self, rid: str) -> bool:
        info = _current(self.keys, rid)
        if info is not None and info.token != self.token:
            self.lost.append(rid)
            return False
        return True

    def release(self, run_ids: list[str] | None = None) -> None:
        """Give up the leases (all, or these runs); the heartbeat stops with the last."""
        with self._lock:
            for rid in run_ids if run_ids is not None else list(self.run_ids):
                if rid in self.run_ids:
                    self.run_ids.remove(rid)
                    if rid not in self.lost:  # never release another's lease
                        self._put_if_ours(rid, released=True)
                    if self.keys.local:
                        shutil.rmtree(write_folder(self.keys, rid, self.token), ignore_errors=True)
        if not self.run_ids:
            self._stop.set()

    def __enter__(self) -> Lease:
        return self.acquire()

    def hand_back(self) -> None:
        """Give each lease back to the writer ours replaced (as it was: stale or released), where
        it is still ours; then stop as :meth:`release` does."""
        with self._lock:
            for rid, prev in self.replaced.items():
                if rid in self.run_ids and rid not in self.lost:
                    with _staged(self.keys, rid, dataclasses.asdict(prev)) as land, run_lock(self.keys, rid):
                        if self._still_ours(rid):
                            land()
                    self.lost.append(rid)  # not ours any more: release() must not overwrite it
        self.release()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if isinstance(exc, RunRefused):
            self.hand_back()
        else:
            self.release()
