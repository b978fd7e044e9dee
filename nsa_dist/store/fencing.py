"""A fenced writer's Zarr store on a local path: every write lands only while its lease holds.

A :class:`~nsa_dist.store.zarr_store.RunWriter` given a lease token opens its run through
:class:`FencedLocalStore`.  Each key it puts is first written whole to a ``.partial`` file beside
its place (the encoding and the bytes: the slow part, outside any lock); then, under the run's lock
file (:func:`~nsa_dist.store.lease.run_lock`), the lease is read and — only if it still carries the
writer's token — the file is renamed into place.  Lease takeovers write the lease under the same
lock, so a writer paused anywhere (before, inside or after its check) either lands its write
before the takeover, or finds the new token and raises
:class:`~nsa_dist.store.lease.LeaseLost`, deleting its ``.partial`` file.  Zarr's own
read-modify-write of a chunk (a trace chunk, a group's attributes) is safe the same way: its
stale read can only be written back while the writer still holds the run.

Object stores have no lock file; their writers keep the check before each write
(:meth:`RunWriter.fence`), which leaves the instant between the check and the put.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from zarr.core.buffer import Buffer
from zarr.storage import LocalStore

from nsa_dist.store.lease import lease_lost, lock_timeout, parse_lease
from nsa_dist.store.locks import file_lock

__all__ = ["FencedLocalStore", "RunFence"]


@dataclass(frozen=True)
class RunFence:
    """The lease check of one run's writer on a local store, and its fenced file operations.

    Attributes:
        root: the store's directory.
        run_id: the run.
        token: the writer's lease token.
        url: the store URL (for the error).
    """

    root: Path
    run_id: str
    token: str
    url: str

    @property
    def lock_path(self) -> Path:
        return self.root / "leases" / self.run_id / "lock"

    def check(self) -> None:
        """LeaseLost unless the lease on disk carries the token (the caller holds the lock)."""
        try:
            raw: bytes | None = (self.root / "leases" / self.run_id / "zarr.json").read_bytes()
        except FileNotFoundError:
            raw = None
        info = parse_lease(raw)
        if info is None or info.token != self.token:
            raise lease_lost(self.url, self.run_id, info)

    def commit(self, action: Callable[[], None]) -> None:
        """Run ``action`` under the run's lock, only while the lease carries the token."""
        with file_lock(self.lock_path, lock_timeout(), f"run {self.run_id!r} in {self.url!r}"):
            self.check()
            action()

    def put(self, path: Path, data: bytes | memoryview, exclusive: bool = False) -> None:
        """Write ``data`` at ``path``: whole to a ``.partial`` file, then renamed under the fence.

        Raises:
            LeaseLost: the lease was taken over (nothing written; the ``.partial`` file removed).
            FileExistsError: ``exclusive`` and ``path`` exists.
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.partial")
        try:
            with tmp.open("wb") as f:
                f.write(data)

            def land() -> None:
                if exclusive and path.exists():
                    raise FileExistsError(path)
                tmp.replace(path)

            self.commit(land)
        finally:
            tmp.unlink(missing_ok=True)

    def delete(self, path: Path) -> None:
        """Remove the file or folder ``path`` under the fence (absent: nothing happens)."""
        self.commit(lambda: shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True))


class FencedLocalStore(LocalStore):
    """A :class:`zarr.storage.LocalStore` whose puts and deletes go through a :class:`RunFence`.

    Built with :meth:`for_run`; a copy Zarr makes (``with_read_only``) has no fence and is
    read-only in practice.
    """

    fence: RunFence | None = None

    @classmethod
    def for_run(cls, root: Path, run_id: str, token: str, url: str) -> "FencedLocalStore":
        store = cls(root)
        store.fence = RunFence(root, run_id, token, url)
        return store

    async def _set(self, key: str, value: Buffer, exclusive: bool = False) -> None:
        if self.fence is None:
            return await super()._set(key, value, exclusive=exclusive)
        if not self._is_open:
            await self._open()
        self._check_writable()
        await asyncio.to_thread(self.fence.put, self.root / key, value.as_buffer_like(), exclusive)

    def set_sync(self, key: str, value: Buffer) -> None:
        if self.fence is None:
            return super().set_sync(key, value)
        self._check_writable()
        self.fence.put(self.root / key, value.as_buffer_like())

    async def delete(self, key: str) -> None:
        if self.fence is None:
            return await super().delete(key)
        self._check_writable()
        await asyncio.to_thread(self.fence.delete, self.root / key)

    async def delete_dir(self, prefix: str) -> None:
        if self.fence is None:
            return await super().delete_dir(prefix)
        self._check_writable()
        await asyncio.to_thread(self.fence.delete, self.root / prefix)

    def delete_sync(self, key: str) -> None:
        if self.fence is None:
            return super().delete_sync(key)
        self._check_writable()
        self.fence.delete(self.root / key)

    async def clear(self) -> None:
        if self.fence is not None:
            raise PermissionError("a fenced run writer never clears the store")
        await super().clear()

    async def move(self, dest_root: Path | str) -> None:
        if self.fence is not None:
            raise PermissionError("a fenced run writer never moves the store")
        await super().move(dest_root)
