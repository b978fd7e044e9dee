"""Checked reads of a run: damage is an error naming the array, the step and the file — never a
NaN presented as data.

A recorded step is ``done`` only after every chunk it writes is stored, so a done step whose
chunk is missing, or whose chunk fails its CRC32C checksum / zstd frame, is damage
(:mod:`nsa_dist.store.verify` lists it and has it repaired).
"""

from __future__ import annotations

import asyncio
import difflib
import itertools
import json
import math
import os
import stat
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from zarr.core.sync import sync

from nsa_dist.errors import StoreError
from nsa_dist.store.keys import METADATA_ERRORS
from nsa_dist.store.runs import RunIndex
from nsa_dist.store.schema import SCHEMA_VERSION, ArraySpec, RunDims, added_since, dimension_names, run_arrays

if TYPE_CHECKING:
    import zarr

__all__ = ["RunReader", "chunk_grid", "chunk_problem", "chunk_selection", "covering", "scan_array_folder"]


class RunReader:
    """Read access to one run: attributes, array metadata and checked array reads."""

    def __init__(self, store: RunIndex, run_id: str, *, tolerant: bool = False) -> None:
        """``tolerant`` (for ``nsa verify``): a damaged chunk of ``done`` reads as "not done" (its steps
        are recomputed once marked) instead of raising — every other reader names it and stops."""
        self.store, self.id, self.tolerant = store, run_id, tolerant
        self.path = store.run_path(run_id)
        self.refresh()

    def refresh(self) -> RunReader:
        """Re-read the attributes and the finished steps (a live run moves on)."""
        self._refuse_link(
            os.path.join(self.store.keys.path, "runs", self.id) if self.store.keys.local else None, "the run's folder"
        )
        self.g = self.store.group(self.id)
        self.attrs: dict[str, Any] = self.g.attrs.asdict()
        version = self.attrs.get("schema_version")
        if version is not None and version != SCHEMA_VERSION:  # another nsa-dist's layout: never read as ours
            raise StoreError(
                f"run {self.id!r} in {self.store.url!r} has store schema {version}; this nsa-dist reads schema "
                f"{SCHEMA_VERSION} (its arrays may mean other things): read it with the nsa-dist that wrote it"
            )
        spec = self.attrs.get("spec")
        if spec is not None and not isinstance(spec, dict):  # was an AttributeError deep in a reader (verify:
            # for the whole store), a bare pydantic error in the client, naming neither run nor file (an audit)
            raise StoreError(
                f"run {self.id!r}: its metadata's spec ({self.path}/zarr.json, attribute 'spec') is not a spec "
                f"but a {type(spec).__name__}: restore the file from a copy, or delete the run's folder and re-run it"
            )
        self._arrays: dict[str, Any] = {}
        self._chunks: dict[str, set[str]] = {}
        self._wrong: dict[str, dict[str, str]] = {}
        self._static: dict[str, np.ndarray] = {}
        dims = self.attrs.get("dims")
        try:
            self.dims = RunDims.from_json(dims) if dims else None
        except TypeError:
            self.dims = None
        self.specs: dict[str, ArraySpec] = {a.name: a for a in run_arrays(self.dims)} if self.dims else {}
        if self.has("done") or self.attrs.get("creating") or self.tolerant:
            self.done = self._read_done() if self.has("done") else np.zeros(0, bool)  # still being created
        else:  # a run whose `done` was deleted read as one with no finished step, silently (an audit)
            raise StoreError(self._absent("done"))
        return self

    def _read_done(self) -> np.ndarray:
        try:
            return np.asarray(self.read("done"), bool)
        except StoreError:
            if not self.tolerant:
                raise
        arr, out = self.array("done"), np.zeros(self.array("done").shape, bool)
        step = arr.chunks[0]
        for lo in range(0, out.shape[0], step):
            try:
                out[lo : lo + step] = np.asarray(arr[lo : lo + step], bool)
            except Exception:  # noqa: BLE001 — a damaged chunk: its steps are not known to be done
                pass
        return out

    # ------------------------------------------------------------------ metadata
    def status(self) -> tuple[str | None, str | None]:
        """(status, reason), lease-aware (see :func:`~nsa_dist.store.lease.effective_status`)."""
        return self.store.run_status(self.id, self.attrs)

    def names(self) -> list[str]:
        """The run's arrays: every folder under the run holding an array's ``zarr.json``, and also
        every folder whose ``zarr.json`` is unreadable or (for an array of the schema) missing —
        reading one of those is then the StoreError naming the file, never an array silently
        left out of a listing (an export, ``to_xarray``)."""
        prefix = f"runs/{self.id}"
        keys = self.store.keys
        children = [k for k in keys.list_dir(prefix) if k != "zarr.json" and not k.endswith(".partial")]

        async def metas() -> list[bytes | None]:
            return list(await asyncio.gather(*(keys.get_async(f"{prefix}/{k}/zarr.json") for k in children)))

        out = []
        for name, raw in zip(children, sync(metas())):
            if raw is None:
                if name in self.specs:  # the array's folder is there, its metadata is not: damage
                    out.append(name)
                continue
            try:
                meta = json.loads(raw)
            except ValueError:
                out.append(name)  # unreadable: array() names the file
                continue
            if not isinstance(meta, dict) or meta.get("node_type") != "group":
                out.append(name)
        return sorted(out)

    def has(self, name: str) -> bool:
        try:
            return name in self.g
        except METADATA_ERRORS:
            return True  # present but unreadable: reading it names the file

    def array(self, name: str) -> zarr.Array:
        if name not in self._arrays:
            self._refuse_link(self._folder(name) if self.store.keys.local else None, f"array {name!r}'s folder")
            if not self.has(name):
                raise StoreError(self._absent(name))
            try:
                self._arrays[name] = self.g[name]
            except METADATA_ERRORS as exc:
                raise StoreError(
                    f"run {self.id!r}: {self.path}/{name}/zarr.json is unreadable ({type(exc).__name__}: {exc})"
                ) from exc
        return self._arrays[name]

    def _refuse_link(self, folder: str | None, what: str) -> None:
        """StoreError when ``folder`` (a local run's or array's folder) is a symbolic link: it holds
        metadata that readers do not follow; ``nsa verify --mark`` replaces it by a copy."""
        if folder is not None and os.path.islink(folder):
            raise StoreError(
                f"run {self.id!r}: {folder} is a symbolic link (to {os.readlink(folder)}), not "
                f"{what}: readers do not follow it; `nsa verify --mark` replaces it by a real folder "
                "holding a copy of what it points to (never written through), and a re-run recomputes "
                "what the copy lacks"
            )

    def _absent(self, name: str) -> str:
        """Why array ``name`` is not there, truly: still being made, creation interrupted, not part
        of this run, or missing (damage)."""
        if self.attrs.get("creating"):
            if self.store.creation_live(self.id):
                return (
                    f"run {self.id!r} is still being created (array {name!r} is not made yet); read it again "
                    "in a moment"
                )
            return (
                f"run {self.id!r}: its creation was interrupted before array {name!r} was made; re-run it "
                "(nsa run / nsa sweep) to finish creating it"
            )
        if added_since(name, self.attrs.get("created")) and not self.store.keys.list_dir(f"runs/{self.id}/{name}"):
            return (
                f"run {self.id!r} has no array {name!r}: it was recorded by an earlier nsa-dist, before that "
                "array existed (not damage; its other arrays read as they were) — re-running the run adds it"
            )
        if name in self.specs:
            return (
                f"run {self.id!r}: array {name!r} is missing ({self.path}/{name}/zarr.json); run `nsa verify "
                f"{self.store.url}`"
            )
        names = sorted(self.specs)
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        said = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        listed = ", ".join(names[:60]) + (f", … ({len(names)} in all)" if len(names) > 60 else "")
        return f"run {self.id!r} has no array {name!r}{said} — it has: {listed}"

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.array(name).shape)

    def dimension_names(self, name: str) -> tuple[str, ...]:
        """The array's Zarr v3 ``dimension_names``, else the schema's (stores written before)."""
        arr = self.array(name)
        dims = getattr(arr.metadata, "dimension_names", None)
        return tuple(dims) if dims and all(dims) else dimension_names(name, arr.ndim)

    def array_attrs(self, name: str) -> dict[str, Any]:
        return self.array(name).attrs.asdict()

    # ------------------------------------------------------------------ data
    def chunk_path(self, name: str, coords: tuple[int, ...]) -> str:
        return f"{self.path}/{name}/{self.array(name).metadata.encode_chunk_key(coords)}"

    def read(self, name: str) -> np.ndarray:
        """The whole array; a damaged chunk is a StoreError naming it (static arrays are cached
        until :meth:`refresh`)."""
        if name in self._static:
            return self._static[name].copy()
        arr = self.array(name)
        a = self.specs.get(name)
        self._check_kinds(name)
        if a is None and self.specs:
            self._check_whole(name, arr)
        elif a is not None and not a.per_step:
            missing = self.missing_static(name)
            if missing is not None:
                raise StoreError(missing)
        try:
            value = arr[...]
            if a is not None and not a.per_step and name != "loss_trace":
                self._static[name] = value
                return value.copy()
            return value
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001 — a codec error: find and name the chunk
            raise self._damage_error(name, None, exc) from exc

    def read_step(self, name: str, i: int) -> np.ndarray:
        return self.read_steps(name, np.asarray([i]))[0]

    def read_steps(self, name: str, idx: np.ndarray) -> np.ndarray:
        """Array ``name`` at recorded step indices ``idx``: StoreError naming the array, step and
        chunk when a done step's chunk is missing or damaged."""
        arr = self.array(name)
        idx = np.asarray(idx, dtype=np.int64)
        if not len(idx):
            return np.zeros((0,) + tuple(arr.shape[1:]), dtype=arr.dtype)
        self._check_present(name, idx)
        try:
            return arr.oindex[idx]
        except Exception as exc:  # noqa: BLE001
            for i in idx:
                try:
                    arr[int(i)]
                except Exception as exc_i:  # noqa: BLE001
                    raise self._damage_error(name, int(i), exc_i) from exc_i
            raise self._damage_error(name, None, exc) from exc

    def step_of(self, i: int) -> str:
        try:
            return f"step {int(self.read('steps')[i])} (index {i})"
        except Exception:  # noqa: BLE001
            return f"step index {i}"

    def expected(self, name: str) -> np.ndarray:
        """Bool (S,): the done steps that must hold chunks of per-step array ``name``."""
        a = self.specs.get(name)
        if a is None or not a.per_step or name == "done" or not len(self.done):
            return np.zeros(len(self.done), bool)
        if a.at == "every":
            return self.done.copy()
        if a.at == "first":
            return self.done & (np.arange(len(self.done)) == 0)
        mask_name = {"eigenvectors": "eigenvector_steps", "hessian": "hessian_steps"}[a.at]
        if not self.has(mask_name):
            return np.zeros(len(self.done), bool)
        return self.done & np.asarray(self.read(mask_name), bool)

    def step_chunks(self, name: str, i: int) -> list[tuple[int, ...]]:
        """The chunk coordinates of row ``i`` of a per-step array."""
        arr = self.array(name)
        grid = [range(math.ceil(s / c)) for s, c in zip(arr.shape[1:], arr.chunks[1:])]
        return [(i,) + rest for rest in itertools.product(*grid)]

    def present_chunks(self, name: str) -> set[str]:
        """Keys (relative to the array) of the chunks stored for ``name`` (one listing, cached):
        on a local store only regular files reached without a symbolic link (:meth:`wrong_kinds`)."""
        if name not in self._chunks:
            if self.store.keys.local:
                self._chunks[name], self._wrong[name] = scan_array_folder(self._folder(name), self.array(name).ndim)
            else:
                prefix = f"runs/{self.id}/{name}/"
                self._chunks[name] = {k.removeprefix(prefix) for k in self.store.keys.list_prefix(prefix)}
                self._wrong[name] = {}
            self._chunks[name] -= {"zarr.json"}
        return self._chunks[name]

    def wrong_kinds(self, name: str) -> dict[str, str]:
        """Entries of array ``name``'s folder (keys relative to the array) that are not what a
        chunk is, and what they are: a symbolic link (to a file or a folder, inside the store or
        out), a device, FIFO or socket, a directory where a chunk file belongs.  Readers read
        none of them and ``nsa verify`` reports and removes them (empty on an object store)."""
        self.present_chunks(name)
        return self._wrong[name]

    def _folder(self, name: str) -> str:
        return os.path.join(self.store.keys.path, "runs", self.id, name)

    def missing_chunks(self, name: str, idx: np.ndarray) -> dict[int, list[str]]:
        """Step index → chunk keys of a done step that should be stored but are not."""
        want = self.expected(name)
        rows = [int(i) for i in idx if i < len(want) and want[i]]
        if not rows:
            return {}
        arr, present, out = self.array(name), self.present_chunks(name), {}
        for i in rows:
            keys = (arr.metadata.encode_chunk_key(c) for c in self.step_chunks(name, i))
            miss = [k for k in keys if k not in present]
            if miss:
                out[i] = miss
        return out

    def _check_present(self, name: str, idx: np.ndarray) -> None:
        miss = self.missing_chunks(name, idx)
        if miss:
            i, keys = next(iter(miss.items()))
            hit = covering(self.wrong_kinds(name), keys[0])
            what = (
                f"{self.path}/{name}/{hit} is {self.wrong_kinds(name)[hit]}"
                if hit is not None
                else f"chunk {self.path}/{name}/{keys[0]} is missing though the step is marked done"
            )
            raise StoreError(
                f"run {self.id!r}: array {name!r} at {self.step_of(i)} is damaged: {what}"
                f"{f' ({len(miss)} steps affected)' if len(miss) > 1 else ''}; run `nsa verify "
                f"{self.store.url} --mark` and re-run to recompute it"
            )

    def missing_static(self, name: str) -> str | None:
        """The error naming the first chunk missing from static array ``name`` (``steps``,
        ``curve_k``, ``hessian_steps``, ``y_test`` …: written whole, every chunk, when the run is
        created), or None when none is.  Read as its fill value such a chunk was wrong numbers:
        ``steps`` all 0 put every point at t = 0, ``curve_k`` all 0 every curve under k = 0.
        ``loss_trace`` is one only up to the training a spec run went through (:meth:`_trace_trained`):
        a Tracker writes only the chunks its logged and recorded steps fall in (recording t = 0 and
        199,999 leaves chunks 1 and 2 unwritten), and its fill value NaN reads as what it is, no loss
        noted."""
        keys = self.missing_static_keys(name)
        if not keys:
            return None
        return (
            f"run {self.id!r}: array {name!r} is damaged: chunk {self.path}/{name}/{keys[0]} is missing "
            f"(read as its fill value it would be wrong numbers); run `nsa verify {self.store.url} "
            "--mark` and re-run to write it anew"
        )

    def missing_static_keys(self, name: str) -> list[str]:
        """The chunk keys (relative to the array) :meth:`missing_static` names, in grid order."""
        if not self.attrs.get("static_complete", False) or not self.has(name):
            return []  # still being created
        trained = self._trace_trained() if name == "loss_trace" else None
        if trained == 0:
            return []
        arr = self.array(name)
        if not arr.size:
            return []
        present = self.present_chunks(name)
        grid = chunk_grid(arr)
        if trained is not None:  # the chunks holding the losses of steps 0 … trained − 1
            grid = [c for c in grid if c[0] * arr.chunks[0] < trained]
        keys = (arr.metadata.encode_chunk_key(c) for c in grid)
        return [k for k in keys if k not in present]

    def _trace_trained(self) -> int:
        """How many training steps' losses a run trained by nsa-dist has written for certain: those
        of steps 0 … t of its last finished recorded step t (the trainer writes each recorded step's
        losses, its own update's included, before the step is analysed); 0 for a Tracker's run (it
        writes what its loop logged) and for a run whose spec names no model (not the pipeline's).
        A missing ``loss_trace`` chunk of an ``nsa run`` run read as NaN: verify found no damage, an
        export dropped 300 of 817 points without a word (audit K)."""
        spec = self.attrs.get("spec") or {}
        model = spec.get("model")
        if not isinstance(model, dict) or model.get("source") == "tracker" or not self.done.any():
            return 0
        try:
            steps = self.read("steps")
        except StoreError:  # damaged itself: named as such; the losses are checked once it is rewritten
            return 0
        return int(steps[int(np.flatnonzero(self.done)[-1])]) + 1

    def static_damage(self) -> str | None:
        """:meth:`missing_static` of the first static array of the run's schema that has one."""
        for name, a in self.specs.items():
            if not a.per_step:
                missing = self.missing_static(name)
                if missing is not None:
                    return missing
        return None

    def _check_whole(self, name: str, arr: zarr.Array) -> None:
        """StoreError naming the first chunk missing from array ``name``, one written whole after the
        run's last step (``preservation``, ``constant_gram_*``): every chunk of it is stored, so a
        missing one is damage — never its fill value presented as data."""
        present = self.present_chunks(name)
        for c in chunk_grid(arr):
            key = arr.metadata.encode_chunk_key(c)
            if key not in present:
                raise StoreError(
                    f"run {self.id!r}: array {name!r} is damaged: chunk {self.path}/{name}/{key} is missing; "
                    f"run `nsa verify {self.store.url} --mark` and re-run to write it anew"
                )

    def _check_kinds(self, name: str) -> None:
        """StoreError naming the first entry of the wrong kind in array ``name``'s folder."""
        wrong = self.wrong_kinds(name)
        if wrong:
            key = min(wrong)
            raise StoreError(
                f"run {self.id!r}: array {name!r} is damaged: {self.path}/{name}/{key} is {wrong[key]}; "
                f"run `nsa verify {self.store.url} --mark` and re-run to recompute it"
            )

    def _damage_error(self, name: str, i: int | None, exc: BaseException) -> StoreError:
        arr = self.array(name)
        chunks = self.step_chunks(name, i) if i is not None else list(chunk_grid(arr))
        bad = next((c for c in chunks if chunk_problem(arr, chunk_selection(arr, c))), chunks[0] if chunks else ())
        where = f" at {self.step_of(i)}" if i is not None else ""
        return StoreError(
            f"run {self.id!r}: array {name!r}{where} is damaged ({self.chunk_path(name, bad)}: "
            f"{type(exc).__name__}: {exc}); run `nsa verify {self.store.url} --mark` and re-run to "
            "recompute it"
        )


def chunk_grid(arr: zarr.Array) -> Iterator[tuple[int, ...]]:
    """Every chunk coordinate of an array."""
    return itertools.product(*[range(math.ceil(s / c)) for s, c in zip(arr.shape, arr.chunks)])


def chunk_selection(arr: zarr.Array, coords: tuple[int, ...]) -> tuple[slice, ...]:
    """The index region of one chunk."""
    return tuple(slice(j * c, min((j + 1) * c, s)) for j, c, s in zip(coords, arr.chunks, arr.shape))


def chunk_problem(arr: zarr.Array, sel: tuple[slice, ...]) -> str | None:
    """Why the region ``sel`` of ``arr`` cannot be decoded (a checksum or frame error), or None."""
    try:
        arr[sel]
        return None
    except Exception as exc:  # noqa: BLE001
        return f"unreadable chunk ({type(exc).__name__}: {exc})"


def covering(wrong: dict[str, str], key: str) -> str | None:
    """The entry of ``wrong`` that is ``key`` or a folder above it, or None."""
    parts = key.split("/")
    return next((k for k in ("/".join(parts[:n]) for n in range(1, len(parts) + 1)) if k in wrong), None)


def _kind(mode: int) -> str:
    for test, what in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def scan_array_folder(folder: str, ndim: int) -> tuple[set[str], dict[str, str]]:
    """(the chunk files, the entries of the wrong kind) of a local array folder, keys relative to it.

    A chunk is a regular file reached without a symbolic link.  Of the wrong kind: a symbolic
    link anywhere (never followed: a folder linked to outside the store is not read, and its
    removal removes only the link), a device, FIFO or socket, and a directory where a chunk file
    belongs (``c/<one index per axis>``).
    """
    files: set[str] = set()
    wrong: dict[str, str] = {}

    def walk(path: str, rel: str) -> None:
        try:
            entries = list(os.scandir(path))
        except FileNotFoundError:
            return
        for e in entries:
            key = rel + e.name
            if e.is_symlink():
                wrong[key] = f"a symbolic link (to {os.readlink(e.path)}), not a chunk file"
            elif e.is_dir(follow_symlinks=False):
                parts = key.split("/")
                if parts[0] == "c" and len(parts) == ndim + 1:
                    wrong[key] = "a directory where a chunk file belongs"
                else:
                    walk(e.path, key + "/")
            elif e.is_file(follow_symlinks=False):
                files.add(key)
            else:
                wrong[key] = f"{_kind(e.stat(follow_symlinks=False).st_mode)}, not a chunk file"

    walk(folder, "")
    return files, wrong
