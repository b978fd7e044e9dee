"""The Zarr v3 spectrum store: one group per run under ``runs/`` (layout: docs/store.md).

Only ``nsa_dist.store`` touches Zarr.  A run is created crash-safely: its group is written with
all of its attributes in one write (``creating: true``), then its arrays; a process killed in
between leaves a run that the next writer finishes creating.  Chunks are zstd-compressed with
a CRC32C checksum, so a damaged chunk is an error naming the array, never a silent NaN.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec

from nsa_dist.errors import StoreError
from nsa_dist.store.fencing import FencedLocalStore, RunFence
from nsa_dist.store.keys import METADATA_ERRORS, Keys
from nsa_dist.store.lease import Lease, RunRefused, check_holder, write_lease
from nsa_dist.store.reader import RunReader
from nsa_dist.store.records import StepResult
from nsa_dist.store.runs import RunIndex
from nsa_dist.store.schema import (
    SCHEMA_VERSION,
    STATE_ARRAYS,
    ArraySpec,
    RunDims,
    StepRecord,
    added_since,
    dimension_names,
    run_arrays,
)
from nsa_dist.store.status import Status

__all__ = ["SpectrumStore", "RunWriter", "CODECS"]


def CODECS() -> list:
    """The codecs of every chunk: zstd, then a CRC32C checksum of the compressed bytes."""
    return [ZstdCodec(level=3), Crc32cCodec()]


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [f"{prefix[:-1]}: {a!r} → {b!r}"]


# --------------------------------------------------------------------------- the store
class SpectrumStore(RunIndex):
    """A store of runs.  ``mode="a"`` creates it if missing; ``"r"`` reads an existing one.

    Refuses a non-empty directory (or bucket prefix) that is not an nsa-dist store, and a store
    of another schema version.  Reading its runs is :class:`~nsa_dist.store.runs.RunIndex`'s;
    its raw keys are :attr:`keys` (:class:`~nsa_dist.store.keys.Keys`).
    """

    def __init__(self, url: str, mode: str = "a") -> None:
        super().__init__(Keys(url, read_only=mode == "r"))
        if not self.read_only:
            self._create_root()
        self.root = self.keys.open_group("r" if self.read_only else "r+")
        self._check_root()
        self.runs = self.root["runs"]

    # ------------------------------------------------------------------ root
    def _create_root(self) -> None:
        if self.keys.exists("zarr.json"):
            return
        path = self.keys.path
        if self.keys.local and path.exists() and (not path.is_dir() or any(path.iterdir())):
            if self._made_meanwhile():
                return
            if not (path.is_dir() and not path.is_symlink() and _drop_root_leftovers(path)):
                raise StoreError(
                    f"{self.url!r} is a non-empty {'directory' if path.is_dir() else 'file'} that is not an "
                    "nsa-dist spectrum store (it has no zarr.json): refusing to write into it — give a new or "
                    "an existing store path"
                )
        if not self.keys.local and self.keys.list_prefix("") and not self._made_meanwhile():
            raise StoreError(
                f"{self.url!r} holds objects but is not an nsa-dist spectrum store (no zarr.json): "
                "refusing to write into it"
            )
        try:
            zarr.create_group(store=self.keys.zarr, attributes={"nsa_dist_schema": SCHEMA_VERSION})
        except zarr.errors.ContainsGroupError:  # a second writer opening the new store made it first
            pass

    def _made_meanwhile(self, within: float = 0.5) -> bool:
        """Whether another writer opening the same new store made it since the first look: its
        zarr.json appears within ``within`` seconds (measured: 6 threads opening one new path,
        100 rounds, 21 of 600 opens were refused as a foreign directory while the first one's
        zarr.json was being written; a foreign directory is refused ``within`` later)."""
        deadline = time.monotonic() + within
        while not self.keys.exists("zarr.json"):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def _check_root(self) -> None:
        attrs = self.root.attrs.asdict()
        version = attrs.get("nsa_dist_schema")
        has_runs = self.keys.exists("runs/zarr.json")
        if version is None and not has_runs:
            foreign = [k for k in self.keys.list_dir("") if k != "zarr.json"]
            if self.read_only or foreign or attrs:
                raise StoreError(
                    f"{self.url!r} is not an nsa-dist spectrum store (its zarr.json has no "
                    "'nsa_dist_schema' and it has no 'runs' group)"
                )
        if version is not None and version != SCHEMA_VERSION:
            raise StoreError(
                f"{self.url!r} is an nsa-dist store of schema {version}; this nsa-dist reads and writes "
                f"schema {SCHEMA_VERSION}"
            )
        if self.read_only:
            if not has_runs:
                raise StoreError(f"{self.url!r} is not an nsa-dist spectrum store (it has no 'runs' group)")
            return
        if version is None:
            self.root.attrs["nsa_dist_schema"] = SCHEMA_VERSION
        for name in ("runs", "leases"):  # a root made by a process killed before these
            if not self.keys.exists(f"{name}/zarr.json"):
                try:
                    self.root.create_group(name)
                except zarr.errors.ContainsGroupError:  # a second writer opening a new store made it first
                    pass

    # ------------------------------------------------------------------ sweeps
    def record_sweep(self, name: str, spec: dict, run_ids: list[str]) -> None:
        """Note a sweep and its runs under ``sweeps/<name>``.  Re-submitting it records its spec and
        adds its new runs after the earlier ones, which stay (a part of the grid re-run under the
        sweep's name dropped the rest from it: 7 finished runs of 11 no longer in their sweep)."""
        sweeps = self.root["sweeps"] if "sweeps" in self.root else self.root.create_group("sweeps")
        g = sweeps[name] if name in sweeps else sweeps.create_group(name)
        earlier = [r for r in g.attrs.get("run_ids", []) if isinstance(r, str)]
        run_ids = earlier + [r for r in run_ids if r not in set(earlier)]
        g.attrs.update({"spec": spec, "run_ids": run_ids, "updated": time.time()})

    def sweeps(self) -> dict[str, list[str]]:
        """Sweep name → its run ids."""
        return {k: list(v.get("run_ids", [])) for k, v in self._sweep_attrs().items()}

    def sweep_spec(self, name: str) -> dict:
        """The sweep's spec as recorded (JSON)."""
        attrs = self._sweep_attrs()
        if name not in attrs:
            raise KeyError(f"no sweep {name!r} in {self.url!r} (sweeps: {', '.join(sorted(attrs)) or 'none'})")
        return dict(attrs[name].get("spec", {}))

    def _sweep_attrs(self) -> dict[str, dict]:
        if not self.keys.exists("sweeps/zarr.json"):
            return {}
        out = {}
        for k in self.keys.list_dir("sweeps"):
            meta = self.keys.get_json(f"sweeps/{k}/zarr.json")
            if meta is not None:
                out[k] = meta.get("attributes", {})
        return out

    # ------------------------------------------------------------------ runs
    def reader(self, run_id: str) -> RunReader:
        """The run's checked reader."""
        return RunReader(self, run_id)

    def writer(
        self,
        run_id: str,
        spec: dict,
        dims: RunDims,
        *,
        create: bool = True,
        data_fingerprint: str | None = None,
        token: str | None = None,
        normalize: Callable[[dict], dict | None] | None = None,
    ) -> RunWriter:
        """Create run ``run_id``, or reopen it for resuming after checking spec, data, schema and arrays.

        A run half made by a killed process (``creating`` still set) is finished here.
        ``create=False`` (cluster workers): the run must exist already — if it does not, this
        node does not see the store the coordinator created it in.

        Args:
            data_fingerprint: :meth:`Dataset.fingerprint` of the data loaded for this run: recorded
                when the run is created, compared when it is reopened.
            token: the writer lease's token; every write is fenced by it (:func:`check_holder`).
            normalize: the stored spec as this nsa-dist writes one (fields added since it was stored
                at their defaults; None: it does not read as a spec now), compared with ``spec``
                instead of the stored JSON as it is — a run recorded before a field existed is the
                same run (its resume was refused: "spectrum.quadrature.phi_width: None → 0.0").

        Raises:
            StoreError: another spec or schema, a missing / mis-shaped array, or data whose
                fingerprint differs from the run's (one line naming the data and both fingerprints).
            LeaseLost: ``token`` no longer holds the run's lease.
        """
        if not self.has_run(run_id):
            if not create:
                raise StoreError(
                    f"run {run_id!r} is not in {self.url!r} as seen from this node: the store must be "
                    "shared storage that every node reaches (s3://…, gs://…, a shared filesystem path)"
                )
            now = time.time()
            g = self.runs.create_group(
                run_id,
                attributes={
                    "schema_version": SCHEMA_VERSION,
                    "spec": spec,
                    "dims": dims.to_json(),
                    "status": Status.PENDING,
                    "reason": None,
                    "failed_step": None,
                    "created": now,
                    "updated": now,
                    "creating": True,
                    "data_fingerprint": data_fingerprint,
                },
            )
            w = RunWriter(self, run_id, g, dims, token=token)
            w.finish_creation()
            return w
        g = self.group(run_id)
        attrs = g.attrs.asdict()
        version = attrs.get("schema_version")
        if version != SCHEMA_VERSION:
            raise RunRefused(
                f"run {run_id!r} in {self.url!r} has store schema {version}, this nsa-dist "
                f"writes {SCHEMA_VERSION}; use a new store or run name"
            )
        diff = _diff(attrs.get("spec"), spec)
        if diff and normalize is not None and isinstance(attrs.get("spec"), dict):
            today = normalize(attrs["spec"])
            diff = _diff(today, spec) if today is not None else diff
        was, now = (str(((d or {}).get("data") or {}).get("path")) for d in (attrs.get("spec"), spec))
        if len(diff) == 1 and was != now and was.startswith("sha1:") and now.startswith("sha1:"):
            raise RunRefused(  # a Tracker's: its data path is the digest of the arrays it was handed
                f"run {run_id!r} in {self.url!r} was recorded from other arrays: X, y, X_test, y_test hash to "
                f"{now} now, the run's to {was}; refusing to mix them — hand the Tracker the run's data, "
                "or use another name"
            )
        if diff:
            raise RunRefused(
                f"run {run_id!r} exists in {self.url!r} with a different spec ("
                + "; ".join(diff[:5])
                + "); refusing to overwrite — use another name"
            )
        self._check_data(run_id, spec, attrs.get("data_fingerprint"), data_fingerprint)
        if isinstance(attrs.get("dims"), dict):  # a run recorded before a switch existed keeps it off
            dims = dims.as_recorded(attrs["dims"])
        w = RunWriter(self, run_id, g, dims, token=token)
        if data_fingerprint and not attrs.get("data_fingerprint"):  # a run made before fingerprints
            w.set_attrs(data_fingerprint=data_fingerprint)
        if attrs.get("creating"):
            w.finish_creation()
        else:
            w.check()
        return w

    def reopen(self, run_id: str, *, token: str | None = None) -> RunWriter:
        """The writer of existing run ``run_id`` as it is stored (its own sizes; nothing compared),
        for repairs such as :func:`~nsa_dist.store.verify.mark_damaged`.

        Args:
            token: the lease token that fences every write.

        Raises:
            StoreError: no such run, or its zarr.json is unreadable or has no sizes.
        """
        return RunWriter(self, run_id, self.group(run_id), self.dims(run_id), token=token)

    def _check_data(self, run_id: str, spec: dict, stored: str | None, loaded: str | None) -> None:
        """StoreError unless the data loaded now is the data the run was created with."""
        if not stored or not loaded or stored == loaded:
            return
        data = (spec or {}).get("data") or {}
        what = f"data.path {data['path']!r}" if data.get("path") else f"the {data.get('name', '?')} data"
        raise RunRefused(
            f"run {run_id!r} in {self.url!r} was created from other data: {what} now loads as "
            f"{loaded}, the run holds {stored}; refusing to mix them — start a new run (change the "
            f"spec's `name`) or delete this one ({self.run_path(run_id)})"
        )

    # ------------------------------------------------------------------ leases
    def lease(self, run_ids: list[str], *, wait: float | None = 0.0, ttl: float | None = None) -> Lease:
        """This process's leases on ``run_ids`` (use as a context manager, or ``.acquire()``)."""
        return Lease(self.keys, run_ids, wait=wait, ttl=ttl)

    def write_lease(self, run_id: str, attrs: dict[str, Any]) -> None:
        """Write the lease group's metadata in one put (readers never see it half written)."""
        write_lease(self.keys, run_id, attrs)


_REASON_CHARS = 600  # a status reason is one line: what `nsa ls / show / status` print

_ROOT_LEFTOVER = re.compile(r"zarr\.[0-9a-f]{32}\.partial")  # zarr.json's temporary file (LocalStore's atomic write)


def _drop_root_leftovers(path: Path) -> bool:
    """Remove what a process killed while writing a new store's root ``zarr.json`` leaves — a
    directory holding nothing but that file's temporary ``zarr.<hex>.partial`` (Zarr's LocalStore
    writes a file there, then renames it) — and say whether it did: the directory is then empty,
    a new store, not a foreign one.  A directory with anything else is left as it is.  Called only
    after no ``zarr.json`` appeared for a while (a live writer's rename takes microseconds)."""
    try:
        entries = list(path.iterdir())
    except OSError:
        return False
    if not entries or not all(e.is_file() and not e.is_symlink() and _ROOT_LEFTOVER.fullmatch(e.name) for e in entries):
        return False
    for e in entries:
        e.unlink(missing_ok=True)
    return True


# --------------------------------------------------------------------------- one run's writer
class RunWriter:
    """Writes one run's arrays: static data once, then each recorded step's chunks.

    ``write_step`` checks the step's result against the schema (:class:`StepRecord`), writes
    its arrays and its resume state, then sets ``done[i]`` last: a step counts as recorded only
    once everything it holds is stored.  With a lease ``token`` every write is fenced: it is
    made only while the run's lease still carries the token, and ``done[i]`` is committed only
    after checking again (:class:`~nsa_dist.store.lease.LeaseLost` otherwise).  On a local store
    each put is also a rename out of the writer's revocable write folder (:mod:`.fencing`): a
    writer paused between a check and its put cannot land a stale chunk over its successor's.
    """

    def __init__(
        self, store: SpectrumStore, run_id: str, group: zarr.Group, dims: RunDims, token: str | None = None
    ) -> None:
        self._fence: RunFence | None = None
        if token is not None and store.keys.local and not store.keys.read_only:
            fenced = FencedLocalStore.for_run(store.keys.path, run_id, token, store.url)
            group, self._fence = zarr.open_group(store=fenced, path=f"runs/{run_id}", mode="r+"), fenced.fence
        self.store, self.run_id, self.g, self.dims, self.token = store, run_id, group, dims, token
        self.specs: dict[str, ArraySpec] = {a.name: a for a in run_arrays(dims)}
        self._lock = threading.Lock()
        self._masks: dict[str, np.ndarray] | None = None

    @property
    def path(self) -> str:
        return self.store.run_path(self.run_id)

    def _create(self, a: ArraySpec, overwrite: bool = False) -> None:
        self.g.create_array(
            a.name,
            shape=a.shape,
            chunks=a.chunks,
            dtype=a.dtype,
            fill_value=a.fill,
            dimension_names=a.dims,
            compressors=CODECS(),
            config={"write_empty_chunks": True},
            overwrite=overwrite,
        )

    def _array_ok(self, a: ArraySpec) -> bool:
        try:
            arr = self.g[a.name]
        except (KeyError, *METADATA_ERRORS):
            return False
        return tuple(arr.shape) == a.shape and np.dtype(arr.dtype) == np.dtype(a.dtype)

    def fence(self) -> None:
        """LeaseLost unless this writer (given a token) still holds the run's lease."""
        if self.token is not None:
            check_holder(self.store.keys, self.run_id, self.token)

    def finish_creation(self) -> None:
        """Create every array that is missing or unreadable (no step can be recorded yet), then
        clear ``creating``."""
        self.fence()
        for a in self.specs.values():
            if not self._array_ok(a):
                self._create(a, overwrite=True)
        self.set_attrs(creating=False)

    def check(self) -> None:
        """StoreError naming the first array that is missing or has the wrong shape/dtype; an array
        added to the schema after the run was created (none of its folder there) is made now."""
        created = self.attr("created")
        for name, a in self.specs.items():
            try:
                present = name in self.g
                arr = self.g[name] if present else None
            except METADATA_ERRORS as exc:
                raise StoreError(
                    f"corrupt run {self.run_id!r}: {self.path}/{name}/zarr.json is unreadable "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            if arr is None:
                if added_since(name, created) and not self.store.keys.list_dir(f"runs/{self.run_id}/{name}"):
                    # recorded before it existed: made now
                    self._create(a)
                    if a.per_step:  # the steps already done noted nothing: their chunks are written, not missing
                        for i in np.flatnonzero(self.done()):
                            self._out(name)[int(i)] = a.fill
                    else:
                        self.set_attrs(static_complete=False)
                    continue
                raise StoreError(f"corrupt run {self.run_id!r}: array {name!r} is missing")
            if tuple(arr.shape) != a.shape or np.dtype(arr.dtype) != np.dtype(a.dtype):
                raise StoreError(
                    f"corrupt run {self.run_id!r}: array {name!r} is {arr.dtype}{tuple(arr.shape)}, "
                    f"expected {a.dtype}{a.shape}"
                )

    # ------------------------------------------------------------------ attributes
    def attrs(self) -> dict[str, Any]:
        return self.g.attrs.asdict()

    def set_status(self, status: Status, reason: str | None = None, failed_step: int | None = None) -> None:
        """The run's status, with its reason as one line of at most ``_REASON_CHARS`` (a Ray
        out-of-memory report was stored whole: 105 lines in ``nsa status``)."""
        if reason is not None:
            reason = " ".join(str(reason).split())
            reason = reason if len(reason) <= _REASON_CHARS else reason[: _REASON_CHARS - 1] + "…"
        self.set_attrs(status=status, reason=reason, failed_step=failed_step, updated=time.time())

    def status(self) -> tuple[str | None, str | None]:
        """(status, reason) as readers see it (lease-aware)."""
        return self.store.run_status(self.run_id, self.attrs())

    def set_attrs(self, **attrs: Any) -> None:
        """Run attributes other than the status (e.g. the analysis layout chosen and why)."""
        self.fence()
        with self._lock:
            self.g.attrs.update(attrs)

    # ------------------------------------------------------------------ static arrays
    def static_names(self) -> list[str]:
        return [a.name for a in self.specs.values() if not a.per_step and a.name != "loss_trace"]

    def static_complete(self) -> bool:
        """Whether every static array was written (a run made by a process killed before is not)."""
        return bool(self.attrs().get("static_complete", False))

    def attr(self, name: str, default: Any = None) -> Any:
        """One run attribute (e.g. the layout recorded when the run was created)."""
        return self.g.attrs.get(name, default)

    def write_static(self, arrays: dict[str, np.ndarray]) -> None:
        """The run's static arrays (all of :meth:`static_names`; unknown names are refused)."""
        unknown = sorted(set(arrays) - set(self.static_names()))
        missing = sorted(set(self.static_names()) - set(arrays))
        if unknown or missing:
            raise StoreError(
                f"run {self.run_id!r}: static arrays do not match the store schema ("
                + "; ".join(
                    p
                    for p in (unknown and f"unknown {', '.join(unknown)}", missing and f"missing {', '.join(missing)}")
                    if p
                )
                + ")"
            )
        self.fence()
        for name, value in arrays.items():
            v = np.asarray(value)
            if tuple(v.shape) != self.specs[name].shape:
                raise StoreError(
                    f"run {self.run_id!r}: static array {name!r} has shape {v.shape}, the store holds "
                    f"{self.specs[name].shape}"
                )
            if v.size:
                self._out(name)[...] = v
        self._masks = None
        self.set_attrs(static_complete=True)

    def _mask(self, at: str) -> np.ndarray:
        if self._masks is None:
            S = self.dims.S
            read = lambda n: np.asarray(self.g[n][:], bool) if n in self.specs else np.zeros(S, bool)  # noqa: E731
            self._masks = {
                "every": np.ones(S, bool),
                "eigenvectors": read("eigenvector_steps"),
                "hessian": read("hessian_steps"),
                "first": np.arange(S) == 0,
            }
        return self._masks[at]

    def _out(self, name: str) -> zarr.Array:
        """Array ``name`` opened for writing with ``write_empty_chunks`` (an opened array does not
        keep the option it was created with): a step's chunk that is all fill value (NaN) is still
        written, so a missing chunk always means damage."""
        return self.g[name].with_config({"write_empty_chunks": True})

    # ------------------------------------------------------------------ steps
    def done(self) -> np.ndarray:
        """The recorded steps' done flags.

        Raises:
            StoreError: a chunk of them is unreadable (named, with the way out): a codec's own
                "Stored and computed checksum do not match" named no run, array or file.
        """
        try:
            return np.asarray(self.g["done"][:], dtype=bool)
        except Exception as exc:  # noqa: BLE001 — a damaged chunk: said with the run and the file
            raise StoreError(
                f"run {self.run_id!r}: array 'done' (the recorded steps' done flags) is damaged under "
                f"{self.store.url}/runs/{self.run_id}/done ({type(exc).__name__}: {exc}); run `nsa verify "
                f"{self.store.url} --mark` (its steps are then recomputed by a re-run)"
            ) from exc

    def write_step(self, index: int, result: StepResult, state: Any) -> None:
        """Everything of recorded step ``index``: results, θ/optimizer/RNG state, then the done flag.

        The result's arrays are checked first (:class:`StepRecord`): one missing for this step,
        present though this step does not write it, or mis-shaped is a StoreError naming it, and
        nothing of the step is written.
        """
        rec = StepRecord.build(
            self.dims,
            index,
            result.arrays(),
            eigenvectors=bool(self._mask("eigenvectors")[index]),
            hessian=bool(self._mask("hessian")[index]),
            where=f"run {self.run_id!r} ",
        )
        theta = np.asarray(state.theta)
        if theta.shape != (self.dims.P,):
            raise StoreError(
                f"run {self.run_id!r} step index {index}: theta has shape {theta.shape}, the store "
                f"holds ({self.dims.P},) (nothing of this step was written)"
            )
        self.fence()
        for name, value in rec.values.items():
            self._out(name)[index] = value
        self._out("theta")[index] = theta
        if self.dims.n_slots:
            self._out("opt_slots")[index] = state.slots
        self._out("rng_state")[index] = state.rng
        self.fence()  # commit: the step counts only if this writer still held the run throughout
        self._out("done")[index] = True

    def mark_not_done(self, indices: list[int]) -> None:
        """Forget recorded steps (their data is damaged): a re-run recomputes them."""
        self.fence()
        for i in indices:
            self._out("done")[i] = False

    def forget_steps(self, indices: list[int], chunk_keys: list[str], *, static_damaged: bool, reason: str) -> None:
        """Repair damage so that a re-run recomputes it: the run becomes ``pending`` (and, when
        ``static_damaged``, its static arrays to be rewritten), recorded steps ``indices`` not
        done, and then the damaged chunks ``chunk_keys`` (store keys under this run) are deleted.

        Raises:
            StoreError: a key outside this run (nothing written).
            LeaseLost: this writer's token no longer holds the run (nothing more written).
        """
        outside = [k for k in chunk_keys if not k.startswith(f"runs/{self.run_id}/")]
        if outside:
            raise StoreError(f"run {self.run_id!r}: refusing to delete keys of another run: {', '.join(outside)}")
        self.set_attrs(static_complete=not static_damaged and bool(self.attr("static_complete", True)))
        self.set_status(Status.PENDING, reason)
        flags = [k for k in chunk_keys if k.startswith(f"runs/{self.run_id}/done/")]
        for key in flags:  # an unreadable chunk of the done flags first: marking steps in it would read it
            self._delete(key)
        self.mark_not_done(indices)
        for key in chunk_keys:
            if key not in flags:
                self._delete(key)

    def _delete(self, key: str) -> None:
        """Delete store key ``key`` of this run (fenced), and every key under it when it names a folder."""
        self.fence()
        if self._fence is not None:
            self._fence.delete(self.store.keys.path / key)
        else:  # an object store
            for k in [key, *self.store.keys.list_prefix(f"{key}/")]:
                self.store.keys.delete(k)

    def write_trace(self, start: int, values: np.ndarray) -> None:
        """``loss_trace[start:start + len(values)] = values``, as whole chunks: they are read and
        merged before the fence, so only their encoding and write follow it.  (Zarr's own
        read-modify-write after the fence left a paused writer that had already read a chunk free to
        put it back, stale, over the next writer's: seen as a changed ``loss_trace/c/0`` in
        tests/test_identity_fencing.py.  On a local store the fenced store closes that window — a
        put lands only by a rename out of the writer's write folder, which a successor revokes; on
        an object store the window is the put itself.)"""
        if len(values):
            arr = self._out("loss_trace")
            c = arr.chunks[0]
            lo, hi = start // c * c, min(arr.shape[0], -(-(start + len(values)) // c) * c)
            block = arr[lo:hi]  # (hi − lo,) the chunks the values fall in
            block[start - lo : start - lo + len(values)] = values
            self.fence()
            arr[lo:hi] = block

    def resume_index(self, before: int | None = None) -> int | None:
        """The recorded step to resume from: the last of the unbroken run of finished steps from 0
        (steps can finish out of order on a cluster), only indices < ``before`` when given."""
        done = self.done()
        if before is not None:
            done = done[:before]
        missing = np.flatnonzero(~done)
        last = (int(missing[0]) if len(missing) else len(done)) - 1
        return last if last >= 0 else None

    def read_step(self, name: str, i: int) -> np.ndarray:
        """Array ``name`` at recorded step ``i`` (checked: a damaged chunk is a StoreError)."""
        return self.store.reader(self.run_id).read_step(name, i)

    def state_at(self, i: int) -> dict[str, Any]:
        """The resume state stored with recorded step ``i``: step, theta, slots, rng."""
        r = self.store.reader(self.run_id)
        slots = r.read_step("opt_slots", i) if self.dims.n_slots else np.zeros((0, self.dims.P), np.float32)
        return {
            "step": int(r.read("steps")[i]),
            "theta": r.read_step("theta", i),
            "slots": slots,
            "rng": r.read_step("rng_state", i),
        }

    def has(self, name: str) -> bool:
        return name in self.g

    def write_array(self, name: str, value: np.ndarray, attrs: dict | None = None) -> None:
        """A post-run array (e.g. spectrum preservation), replaced if present."""
        if name in self.specs or name in STATE_ARRAYS:
            raise StoreError(f"run {self.run_id!r}: {name!r} is a schema array; write it with write_step/write_static")
        self.fence()
        self.g.create_array(
            name,
            shape=value.shape,
            dtype=value.dtype,
            overwrite=True,
            compressors=CODECS(),
            dimension_names=dimension_names(name, value.ndim),
            attributes=dict(attrs or {}),
            config={"write_empty_chunks": True},  # every chunk stored: a missing one is damage
        )[...] = value
