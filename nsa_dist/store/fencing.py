"""A fenced writer's Zarr store on a local path: a put lands only while its writer holds the run.

A :class:`~nsa_dist.store.zarr_store.RunWriter` given a lease token opens its run through
:class:`FencedLocalStore`.  Each key it puts is first written whole into the writer's own write
folder ``leases/<run id>/w-<token>`` (:func:`~nsa_dist.store.lease.write_folder`: made when the
lease was taken, before the lease named this writer), then renamed into its place.  A writer that
takes the run over renames every other writer's folder away before it writes anything
(:func:`~nsa_dist.store.lease.revoke_others`), so a paused writer that wakes up — whatever it
checked or read before — finds its file gone and raises
:class:`~nsa_dist.store.lease.LeaseLost`: the rename *is* the check, atomic in the filesystem,
and no lock is held while a writer can be stopped.  Zarr's own read-modify-write of a chunk or of
a group's attributes is safe the same way: its stale read can only be written back while the
writer still holds the run.  A delete moves the key into the write folder first (same rule).

Object stores have no rename; their writers keep the check before each write
(:meth:`RunWriter.fence`), which leaves the instant between the check and the put.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from zarr.core.buffer import Buffer
from zarr.storage import LocalStore

from nsa_dist.errors import StoreError
from nsa_dist.store.lease import LeaseLost, lease_lost, lease_on_disk

__all__ = ["FencedLocalStore", "RunFence", "Staged"]


@dataclass(frozen=True)
class Staged:
    """A key's bytes written whole into the write folder, not yet in place (:meth:`RunFence.stage`)."""

    fence: RunFence
    tmp: Path
    path: Path
    exclusive: bool = False

    def land(self) -> None:
        """Rename the bytes into place.

        Raises:
            LeaseLost: the write folder was revoked (another writer took the run over): nothing
                lands.
            FileExistsError: ``exclusive`` and the key exists.
        """
        try:
            self.fence.check_inside(self.path)  # before mkdir: nothing is made through a link
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.exclusive and self.path.exists():
                raise FileExistsError(self.path)
            self.tmp.rename(self.path)
        except FileNotFoundError:
            if not self.fence.folder.is_dir():
                raise self.fence.lost() from None
            raise
        finally:
            self.tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class RunFence:
    """One run's writer on a local store: its write folder and its fenced file operations.

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
    def folder(self) -> Path:
        """``leases/<run id>/w-<token>`` (:func:`~nsa_dist.store.lease.write_folder`)."""
        return self.root / "leases" / self.run_id / f"w-{self.token}"

    def lost(self) -> Exception:
        """The LeaseLost of this writer, naming whoever holds the run now."""
        info = lease_on_disk(self.root, self.run_id)
        if info is not None and info.token == self.token:  # ours, yet the folder is gone: removed by hand
            return LeaseLost(
                f"run {self.run_id!r} in {self.url!r}: this writer's write folder {self.folder} is "
                "gone although its lease is still held (removed from outside?); stopped without "
                "writing anything more — re-run to resume"
            )
        return lease_lost(self.url, self.run_id, info)

    def stage(self, path: Path, data: bytes | memoryview, exclusive: bool = False) -> Staged:
        """Write ``data`` for ``path`` whole into the write folder (nothing in place yet).

        Raises:
            LeaseLost: the write folder is gone (revoked).
        """
        tmp = self.folder / f"{uuid.uuid4().hex}.partial"
        try:
            with tmp.open("xb") as f:
                f.write(data)
        except FileNotFoundError:
            raise self.lost() from None
        return Staged(self, tmp, path, exclusive)

    def put(self, path: Path, data: bytes | memoryview, exclusive: bool = False) -> None:
        """:meth:`stage` then :meth:`Staged.land`."""
        self.stage(path, data, exclusive).land()

    def linked_folder(self, path: Path) -> Path | None:
        """The first folder between the store's directory and ``path`` that is a symbolic link, or None."""
        rel = path.relative_to(self.root)
        return next(
            (
                above
                for above in (self.root.joinpath(*rel.parts[:n]) for n in range(1, len(rel.parts)))
                if above.is_symlink()
            ),
            None,
        )

    def check_inside(self, path: Path) -> None:
        """Refuse a key whose folders within the store include a symbolic link or whose place is a
        directory: a put or delete would act outside the store, or fail half way.

        Raises:
            StoreError: naming the entry and ``nsa verify --mark`` (which removes it).
        """
        above = self.linked_folder(path)
        if above is not None:
            raise StoreError(
                f"refusing to write {path}: {above} is a symbolic link (to {os.readlink(above)}) "
                f"and would be written through; run `nsa verify {self.url} --mark` to remove it"
            )
        if path.is_dir() and not path.is_symlink():
            raise StoreError(
                f"refusing to write {path}: it is a directory where a chunk file belongs; run "
                f"`nsa verify {self.url} --mark` to remove it"
            )

    def delete(self, path: Path) -> None:
        """Remove the file, folder or symbolic link ``path`` by moving it into the write folder
        first (absent: nothing happens).  A symbolic link is removed itself, never followed, and
        nothing is removed through a linked folder above ``path``.

        Raises:
            LeaseLost: the write folder was revoked (nothing removed).
            StoreError: a folder above ``path`` is a symbolic link (nothing removed).
        """
        if not os.path.lexists(path):
            return
        above = self.linked_folder(path)
        if above is not None:
            raise StoreError(f"refusing to delete {path} through the symbolic link {above}")
        trash = self.folder / f"{uuid.uuid4().hex}.deleted"
        try:
            path.rename(trash)
        except FileNotFoundError:
            if not self.folder.is_dir():
                raise self.lost() from None
            return  # the key went away meanwhile
        shutil.rmtree(trash) if trash.is_dir() and not trash.is_symlink() else trash.unlink(missing_ok=True)


class FencedLocalStore(LocalStore):
    """A :class:`zarr.storage.LocalStore` whose puts and deletes go through a :class:`RunFence`.

    Built with :meth:`for_run`; a copy Zarr makes (``with_read_only``) has no fence and is
    read-only in practice.
    """

    fence: RunFence | None = None

    @classmethod
    def for_run(cls, root: Path, run_id: str, token: str, url: str) -> FencedLocalStore:
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
