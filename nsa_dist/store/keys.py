"""Opening a store URL, and the raw key operations on it: the one module under the Zarr API.

A store URL is a local path (or ``file://``), ``memory://…`` or an fsspec object-store URL
(``s3://``, ``gs://``; endpoint and keys from the standard environment variables, see
:func:`nsa_dist._fsspec.storage_options`).  :class:`Keys` holds the opened Zarr store and does
what Zarr's group and array API has no call for: listing a prefix, deleting one key, reading
and writing bytes, JSON and a group's ``zarr.json`` in one put (leases, the run index, repairs).
Every other module of the store reaches the keys through it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.group import GroupMetadata
from zarr.core.sync import sync

from nsa_dist._fsspec import EXTRAS, require_extra, storage_options
from nsa_dist.errors import StoreError
from nsa_dist.store.schema import SCHEMA_VERSION

__all__ = ["Keys", "METADATA_ERRORS", "is_local", "open_zarr_group"]

# what zarr raises on a zarr.json that is not valid metadata (truncated, edited, of another format)
METADATA_ERRORS = (ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError)


def is_local(url: str) -> bool:
    """Whether ``url`` is a local path (plain or ``file://``) rather than an fsspec URL."""
    return "://" not in url or url.startswith("file://")


def _no_store(url: str) -> str:
    return f"no spectrum store at {url!r} (run `nsa run SPEC.yaml --store {url}` first)"


class Keys:
    """The keys of one store URL, opened once.

    Args:
        url: a local path, ``file://…``, ``memory://…``, ``s3://bucket/prefix``, ``gs://…``.
        read_only: open without write access (writes raise).

    Raises:
        MissingDependencyError: the URL's filesystem package (s3fs, gcsfs) is not installed; the
            message names the extra.
        StoreError: fsspec cannot open the URL.
    """

    def __init__(self, url: str | os.PathLike, read_only: bool = False) -> None:
        url = os.fspath(url)  # a pathlib.Path too ("argument of type 'PosixPath' is not iterable" before)
        self.url, self.read_only, self.local = url, read_only, is_local(url)
        if self.local:
            from zarr.storage import LocalStore

            self.zarr: Any = LocalStore(url.removeprefix("file://"), read_only=read_only)
            return
        protocol = require_extra(url, "the store")
        from zarr.storage import FsspecStore

        try:
            self.zarr = FsspecStore.from_url(
                url, read_only=read_only, storage_options=storage_options(protocol) or None
            )
        except (ValueError, ImportError) as exc:
            raise StoreError(f"cannot open the store {url!r}: {exc}") from exc

    @property
    def path(self) -> Path:
        """The local directory (only for a local store)."""
        return Path(self.url.removeprefix("file://"))

    # ------------------------------------------------------------------ bytes
    def exists(self, key: str) -> bool:
        return bool(sync(self.zarr.exists(key)))

    def get(self, key: str) -> bytes | None:
        """The bytes stored at ``key``; None when absent."""
        return sync(self.get_async(key))

    async def get_async(self, key: str) -> bytes | None:
        """:meth:`get` on Zarr's event loop (for concurrent reads, e.g. ``asyncio.gather``)."""
        buf = await self.zarr.get(key, prototype=default_buffer_prototype())
        return None if buf is None else buf.to_bytes()

    def set(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` in one put (a reader sees the old bytes or the new, never half)."""
        sync(self.zarr.set(key, default_buffer_prototype().buffer.from_bytes(data)))

    def delete(self, key: str) -> None:
        """Remove ``key`` (absent already: nothing happens)."""
        sync(self.zarr.delete(key))

    def list_dir(self, prefix: str) -> list[str]:
        """The names directly under ``prefix`` (``""``: the root)."""
        return _collect(self.zarr.list_dir(prefix))

    def list_prefix(self, prefix: str) -> list[str]:
        """Every key under ``prefix``, at any depth."""
        return _collect(self.zarr.list_prefix(prefix))

    # ------------------------------------------------------------------ JSON and groups
    def get_json(self, key: str) -> dict[str, Any] | None:
        """The JSON document at ``key``; None when absent.

        Raises:
            StoreError: the bytes are not JSON (one line naming the file).
        """
        raw = self.get(key)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise StoreError(f"{self.url}/{key} is unreadable ({exc})") from exc

    @staticmethod
    def group_json(attrs: dict[str, Any]) -> bytes:
        """The bytes of a group's ``zarr.json`` with ``attrs``."""
        return GroupMetadata(attributes=attrs).to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes()

    def set_group(self, path: str, attrs: dict[str, Any]) -> None:
        """Write the group ``path``'s ``zarr.json`` with ``attrs`` in one put (readers never see it
        half written; a group already there is replaced)."""
        self.set(f"{path}/zarr.json", self.group_json(attrs))

    def open_group(self, mode: str, path: str = "") -> zarr.Group:
        """The Zarr group at ``path`` (``mode`` as :func:`zarr.open_group`).

        Raises:
            StoreError: there is no store (or, for an object store, its bucket or endpoint is
                wrong: chained to the fsspec error), or its ``zarr.json`` is unreadable.
        """
        if mode == "r" and not path and self.local and not self.path.exists():
            raise StoreError(_no_store(self.url))
        try:
            return zarr.open_group(store=self.zarr, path=path, mode=mode)
        except FileNotFoundError as exc:
            self._check_bucket()  # a missing bucket or a wrong endpoint is not "no store"
            raise StoreError(_no_store(self.url)) from exc
        except METADATA_ERRORS as exc:
            where = f"{self.url.rstrip('/')}/{path + '/' if path else ''}zarr.json"
            fix = (
                ""
                if path
                else "; it is the store's own metadata, not a run's (the runs are under runs/): restore it from a "
                'copy, or write it anew as {"zarr_format": 3, "node_type": "group", "attributes": '
                f'{{"nsa_dist_schema": {SCHEMA_VERSION}}}}}'
            )
            raise StoreError(f"{where} is unreadable ({type(exc).__name__}: {exc}){fix}") from exc

    def _check_bucket(self) -> None:
        """For a remote store that was not found: list its bucket, so that a missing bucket or an
        endpoint that is not the object store surfaces as the fsspec error it is (a StoreError
        chained to it; ``store.faults.describe_fault`` names the cause)."""
        fs = getattr(self.zarr, "fs", None)
        if self.url.split("://", 1)[0] not in EXTRAS or fs is None or not hasattr(fs, "_ls"):
            return  # local paths and memory:// have no bucket
        bucket = self.url.split("://", 1)[1].split("/", 1)[0]
        try:
            sync(fs._ls(bucket, refresh=True))
        except (OSError, ValueError) as exc:
            raise StoreError(f"cannot list the bucket of {self.url!r} ({type(exc).__name__}: {exc})") from exc


def open_zarr_group(url: str, mode: str) -> zarr.Group:
    """A Zarr group at a local path or an fsspec URL (``memory://``, ``s3://``, ``gs://`` …).

    Raises:
        StoreError: as :meth:`Keys.open_group`.
    """
    return Keys(url, read_only=mode == "r").open_group(mode)


def _collect(it: Any) -> list:
    async def run() -> list:
        return [x async for x in it]

    return sync(run())
