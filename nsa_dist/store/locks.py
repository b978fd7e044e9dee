"""A run's lock file on a local store: the one place where "check the lease, then write" is atomic.

:func:`file_lock` takes an exclusive ``flock`` on a file, polling with a deadline so that a
holder that never lets go (a process stopped with Ctrl-Z inside its few microseconds under the
lock) becomes one clear error naming it instead of a hang.  ``flock`` locks belong to an open file
description, so two threads of one process exclude each other as two processes do, and the
kernel drops the lock of a process that dies; on Linux it also holds across NFS clients.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from nsa_dist.errors import StoreError

__all__ = ["LockTimeout", "file_lock", "lock_holder"]

_POLL = (0.0002, 0.005)  # seconds between tries while another process holds the lock: first, at most
_LOCAL: dict[str, threading.Lock] = {}  # one per lock file: this process's threads queue here, not by polling
_LOCAL_GUARD = threading.Lock()


class LockTimeout(StoreError):
    """A run's lock file stayed held longer than its deadline (its holder is stopped or hung)."""


def lock_holder(path: Path) -> int | None:
    """The pid holding a ``flock`` on ``path`` (from /proc/locks), or None when unknown."""
    try:
        ino = path.stat().st_ino
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF" (a blocked waiter's: "1: -> FLOCK …")
            if len(parts) >= 6 and parts[1] == "FLOCK" and int(parts[5].rsplit(":", 1)[1]) == ino:
                return int(parts[4])
    except (OSError, ValueError, IndexError):
        return None
    return None


@contextmanager
def file_lock(path: Path, timeout: float, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created, with its folder, if absent) for the block.

    Args:
        path: the lock file.
        timeout: seconds to wait for another holder to let go.
        what: what the lock guards, for the error (e.g. "run 'abc' in '/data/s.zarr'").

    Raises:
        LockTimeout: the lock stayed held for ``timeout`` seconds (one line naming the holder's
            pid where the system tells it).
    """
    deadline = time.monotonic() + timeout

    def timed_out(who: str) -> LockTimeout:
        return LockTimeout(
            f"{what}: its lock {path} has been held by {who} for over {timeout:.0f} s — a writer "
            "stopped (Ctrl-Z, SIGSTOP) or hung inside a write; resume or end it, then retry"
        )

    with _LOCAL_GUARD:
        local = _LOCAL.setdefault(str(path), threading.Lock())
    if not local.acquire(timeout=timeout):
        raise timed_out("another thread of this process")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            pause = _POLL[0]
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        pid = lock_holder(path)
                        raise timed_out(f"process {pid}" if pid is not None else "another process") from None
                    time.sleep(pause)
                    pause = min(2 * pause, _POLL[1])
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock
    finally:
        local.release()
