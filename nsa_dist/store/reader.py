"""Checked reads of a run, and ``verify``: damage is an error naming the array, the step and the
file — never a NaN presented as data.

A recorded step is ``done`` only after every chunk it writes is stored, so a done step whose
chunk is missing, or whose chunk fails its CRC32C checksum / zstd frame, is damage.
:func:`verify_store` lists it; :func:`mark_damaged` deletes the damaged chunks and marks their
steps not done, so that a re-run recomputes exactly those steps and keeps everything else.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from nsa_dist.errors import StoreError
from nsa_dist.store.schema import ArraySpec, RunDims, dimension_names, run_arrays

if TYPE_CHECKING:
    import zarr

    from nsa_dist.store.zarr_store import SpectrumStore

__all__ = ["RunReader", "Damage", "verify_store", "mark_damaged"]

_META = (ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError)


class RunReader:
    """Read access to one run: attributes, array metadata and checked array reads."""

    def __init__(self, store: "SpectrumStore", run_id: str) -> None:
        self.store, self.id = store, run_id
        self.path = store.run_path(run_id)
        self.refresh()

    def refresh(self) -> "RunReader":
        """Re-read the attributes and the finished steps (a live run moves on)."""
        self.g = self.store.group(self.id)
        self.attrs: dict[str, Any] = self.g.attrs.asdict()
        self._arrays: dict[str, Any] = {}
        self._chunks: dict[str, set[str]] = {}
        self._static: dict[str, np.ndarray] = {}
        dims = self.attrs.get("dims")
        try:
            self.dims = RunDims.from_json(dims) if dims else None
        except TypeError:
            self.dims = None
        self.specs: dict[str, ArraySpec] = {a.name: a for a in run_arrays(self.dims)} if self.dims else {}
        self.done = np.asarray(self.read("done"), bool) if self.has("done") else np.zeros(0, bool)
        return self

    # ------------------------------------------------------------------ metadata
    def status(self) -> tuple[str | None, str | None]:
        """(status, reason), lease-aware (see :func:`~nsa_dist.store.lease.effective_status`)."""
        return self.store.run_status(self.id, self.attrs)

    def names(self) -> list[str]:
        return sorted(self.g.array_keys())

    def has(self, name: str) -> bool:
        try:
            return name in self.g
        except _META:
            return True  # present but unreadable: reading it names the file

    def array(self, name: str) -> "zarr.Array":
        if name not in self._arrays:
            if not self.has(name):
                raise StoreError(self._absent(name))
            try:
                self._arrays[name] = self.g[name]
            except _META as exc:
                raise StoreError(f"run {self.id!r}: {self.path}/{name}/zarr.json is unreadable "
                                 f"({type(exc).__name__}: {exc})") from exc
        return self._arrays[name]

    def _absent(self, name: str) -> str:
        """Why array ``name`` is not there, truly: still being made, creation interrupted, not part
        of this run, or missing (damage)."""
        if self.attrs.get("creating"):
            if self.store.creation_live(self.id):
                return (f"run {self.id!r} is still being created (array {name!r} is not made yet); read it again "
                        "in a moment")
            return (f"run {self.id!r}: its creation was interrupted before array {name!r} was made; re-run it "
                    "(nsa run / nsa sweep) to finish creating it")
        if name in self.specs:
            return (f"run {self.id!r}: array {name!r} is missing ({self.path}/{name}/zarr.json); run `nsa verify "
                    f"{self.store.url}`")
        return f"run {self.id!r} has no array {name!r} (not recorded for this spec)"

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
        """Keys (relative to the array) of the chunks stored for ``name`` (one listing, cached)."""
        if name not in self._chunks:
            prefix = f"runs/{self.id}/{name}/"
            self._chunks[name] = {k.removeprefix(prefix) for k in self.store._list_prefix(prefix)} - {"zarr.json"}
        return self._chunks[name]

    def missing_chunks(self, name: str, idx: np.ndarray) -> dict[int, list[str]]:
        """Step index → chunk keys of a done step that should be stored but are not."""
        want = self.expected(name)
        rows = [int(i) for i in idx if i < len(want) and want[i]]
        if not rows:
            return {}
        arr, present, out = self.array(name), self.present_chunks(name), {}
        for i in rows:
            miss = [k for k in (arr.metadata.encode_chunk_key(c) for c in self.step_chunks(name, i)) if k not in present]
            if miss:
                out[i] = miss
        return out

    def _check_present(self, name: str, idx: np.ndarray) -> None:
        miss = self.missing_chunks(name, idx)
        if miss:
            i, keys = next(iter(miss.items()))
            raise StoreError(f"run {self.id!r}: array {name!r} at {self.step_of(i)} is damaged: chunk "
                             f"{self.path}/{name}/{keys[0]} is missing though the step is marked done"
                             f"{f' ({len(miss)} steps affected)' if len(miss) > 1 else ''}; run `nsa verify "
                             f"{self.store.url} --mark` and re-run to recompute it")

    def _damage_error(self, name: str, i: int | None, exc: BaseException) -> StoreError:
        arr = self.array(name)
        chunks = self.step_chunks(name, i) if i is not None else list(_grid(arr))
        bad = next((c for c in chunks if _decode_ok(arr, _selection(arr, c))), chunks[0] if chunks else ())
        where = f" at {self.step_of(i)}" if i is not None else ""
        return StoreError(f"run {self.id!r}: array {name!r}{where} is damaged ({self.chunk_path(name, bad)}: "
                          f"{type(exc).__name__}: {exc}); run `nsa verify {self.store.url} --mark` and re-run to "
                          "recompute it")


def _grid(arr: Any) -> Any:
    """Every chunk coordinate of an array."""
    return itertools.product(*[range(math.ceil(s / c)) for s, c in zip(arr.shape, arr.chunks)])


def _selection(arr: Any, coords: tuple[int, ...]) -> tuple[slice, ...]:
    """The index region of one chunk."""
    return tuple(slice(j * c, min((j + 1) * c, s)) for j, c, s in zip(coords, arr.chunks, arr.shape))


# --------------------------------------------------------------------------- verify
@dataclass(frozen=True)
class Damage:
    """One damaged piece of a store: the run, the array ('' for the run's own metadata), the
    recorded step index (None: not a per-step chunk), the file and what is wrong."""

    run_id: str
    array: str
    index: int | None
    step: int | None
    path: str
    problem: str
    key: str | None = None  # the chunk's store key (to delete), None for metadata
    unfinished: bool = False  # not damage: a creation interrupted before its arrays were made (a re-run ends it)

    def __str__(self) -> str:
        at = f" step {self.step} (index {self.index})" if self.index is not None else ""
        return f"{self.run_id}: {self.array or '(run metadata)'}{at}: {self.problem} — {self.path}"


def _decode_ok(arr: Any, sel: tuple) -> str | None:
    try:
        arr[sel]
        return None
    except Exception as exc:  # noqa: BLE001
        return f"unreadable chunk ({type(exc).__name__}: {exc})"


def verify_run(store: "SpectrumStore", run_id: str) -> list[Damage]:
    """Every damaged chunk or metadata file of one run."""
    try:
        r = store.reader(run_id)
    except StoreError as exc:
        return [Damage(run_id, "", None, None, f"{store.run_path(run_id)}/zarr.json", str(exc))]
    if r.attrs.get("creating"):  # no step can be recorded yet: nothing to check, nothing damaged
        if store.creation_live(run_id):
            return []
        return [Damage(run_id, "", None, None, f"{r.path}/zarr.json", "its creation was interrupted (its writer "
                       "stopped before making every array); re-run it (nsa run / nsa sweep) to finish creating it",
                       unfinished=True)]
    out: list[Damage] = []
    steps = None
    for name, a in r.specs.items():
        try:
            arr = r.array(name)
        except StoreError as exc:
            out.append(Damage(run_id, name, None, None, f"{r.path}/{name}/zarr.json", str(exc)))
            continue
        if not a.per_step:
            for c in _grid(arr):
                problem = _decode_ok(arr, _selection(arr, c))
                if problem:
                    key = arr.metadata.encode_chunk_key(c)
                    out.append(Damage(run_id, name, None, None, f"{r.path}/{name}/{key}", problem,
                                      f"runs/{run_id}/{name}/{key}"))
            if name == "steps" and not any(d.array == "steps" for d in out):
                steps = r.read("steps")
            continue
        want = r.expected(name) if name != "done" else np.ones(len(r.done), bool)
        present = r.present_chunks(name)
        for i in np.flatnonzero(want):
            for c in r.step_chunks(name, int(i)):
                key = arr.metadata.encode_chunk_key(c)
                if key not in present:
                    if name != "done":
                        out.append(Damage(run_id, name, int(i), None, f"{r.path}/{name}/{key}",
                                          "chunk missing (the step is marked done)", None))
                    continue
                problem = _decode_ok(arr, _selection(arr, c))
                if problem:
                    out.append(Damage(run_id, name, int(i), None, f"{r.path}/{name}/{key}", problem,
                                      f"runs/{run_id}/{name}/{key}"))
    if steps is not None:
        out = [Damage(d.run_id, d.array, d.index, int(steps[d.index]) if d.index is not None else None, d.path,
                      d.problem, d.key) for d in out]
    return out


def verify_store(store: "SpectrumStore", run_ids: list[str] | None = None) -> list[Damage]:
    """Every damaged piece of every run (or of ``run_ids``), and one ``unfinished`` entry for each
    run whose creation was interrupted (not damage: a plain re-run finishes it)."""
    return [d for rid in (run_ids if run_ids is not None else store.run_ids()) for d in verify_run(store, rid)]


def mark_damaged(store: "SpectrumStore", damage: list[Damage]) -> dict[str, list[int]]:
    """Delete the damaged chunks and mark their steps not done (a re-run recomputes them).

    A damaged static array is deleted chunk-wise and the run's static arrays are rewritten on the
    next run; a damaged ``loss_trace`` chunk makes the re-run train again from before it.  Damaged
    metadata (a zarr.json) cannot be repaired here: StoreError naming it.  A run whose creation
    was interrupted (``unfinished``) is left as it is: a plain re-run finishes it.  Returns run →
    the step indices marked not done.
    """
    damage = [d for d in damage if not d.unfinished]
    meta = [d for d in damage if d.key is None and d.index is None]
    if meta:
        raise StoreError("cannot repair damaged metadata (restore it, or delete the run and re-run): "
                         + "; ".join(f"{d.path}" for d in meta))
    marked: dict[str, list[int]] = {}
    for rid in sorted({d.run_id for d in damage}):
        ds = [d for d in damage if d.run_id == rid]
        g = store.group(rid)
        steps = np.asarray(g["steps"][:]) if not any(d.array == "steps" for d in ds) else None
        idx = {d.index for d in ds if d.index is not None}
        static = {d.array for d in ds if d.index is None and d.array != "loss_trace"}
        for d in ds:
            if d.key is not None:
                store._delete(d.key)
        for d in ds:
            if d.array == "loss_trace" and d.key is not None and steps is not None:
                start = int(d.key.rsplit("/", 1)[-1]) * g["loss_trace"].chunks[0]
                later = np.flatnonzero(steps > start)  # resume from a checkpoint at or before the chunk
                idx |= {int(later[0])} if len(later) else set()
        done = np.asarray(g["done"][:], bool)
        for i in sorted(idx):
            g["done"][i] = False
        g.attrs.update({"static_complete": not static and bool(g.attrs.get("static_complete", True)),
                        "status": "pending", "reason": f"{len(idx)} damaged step(s) marked for recompute by nsa verify; "
                                                       "re-run to resume"})
        marked[rid] = sorted(i for i in idx if i < len(done))
    return marked
