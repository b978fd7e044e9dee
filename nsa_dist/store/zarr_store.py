"""The Zarr v3 spectrum store: one group per run under ``runs/`` (layout: docs/store.md)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import zarr

from nsa_dist.errors import StoreError
from nsa_dist.store.schema import SCHEMA_VERSION, ArraySpec, RunDims, dimension_names, run_arrays

__all__ = ["SpectrumStore", "RunWriter", "Status", "open_zarr_group"]


class Status:
    PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"


def open_zarr_group(url: str, mode: str) -> zarr.Group:
    """A Zarr group at a local path or an fsspec URL (``memory://``, ``s3://``, ``gs://`` …)."""
    try:
        if "://" in url and not url.startswith("file://"):
            from zarr.storage import FsspecStore

            store = FsspecStore.from_url(url, read_only=mode == "r")
            return zarr.open_group(store=store, mode=mode)
        return zarr.open_group(url.removeprefix("file://"), mode=mode)
    except FileNotFoundError as exc:
        raise StoreError(f"no spectrum store at {url!r} (run `nsa run SPEC.yaml --store {url}` first)") from exc


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [f"{prefix[:-1]}: {a!r} → {b!r}"]


class SpectrumStore:
    """A store of runs.  ``mode="a"`` creates it if missing; ``"r"`` reads an existing one."""

    def __init__(self, url: str, mode: str = "a") -> None:
        self.url = url
        self.root = open_zarr_group(url, mode)
        if mode == "r":
            if "runs" not in self.root:
                raise StoreError(f"{url!r} is not an nsa-dist spectrum store (it has no 'runs' group)")
        else:
            if "runs" not in self.root:
                self.root.create_group("runs")
                self.root.attrs["nsa_dist_schema"] = SCHEMA_VERSION
        self.runs = self.root["runs"]

    def record_sweep(self, name: str, spec: dict, run_ids: list[str]) -> None:
        """Note a sweep and its runs under ``sweeps/<name>`` (re-submitting it updates the record)."""
        sweeps = self.root["sweeps"] if "sweeps" in self.root else self.root.create_group("sweeps")
        g = sweeps[name] if name in sweeps else sweeps.create_group(name)
        g.attrs.update({"spec": spec, "run_ids": run_ids, "updated": time.time()})

    def sweeps(self) -> dict[str, list[str]]:
        """Sweep name → its run ids."""
        if "sweeps" not in self.root:
            return {}
        return {k: list(self.root["sweeps"][k].attrs.get("run_ids", [])) for k in self.root["sweeps"].group_keys()}

    def run_ids(self) -> list[str]:
        return sorted(self.runs.group_keys())

    def group(self, run_id: str) -> zarr.Group:
        if run_id not in self.runs:
            known = ", ".join(self.run_ids()[:10]) or "none"
            raise StoreError(f"no run {run_id!r} in {self.url!r} (runs: {known})")
        return self.runs[run_id]

    def writer(self, run_id: str, spec: dict, dims: RunDims, *, create: bool = True) -> "RunWriter":
        """Create run ``run_id``, or reopen it for resuming after checking spec, schema and arrays.

        ``create=False`` (cluster workers): the run must exist already — if it does not, this
        node does not see the store the coordinator created it in.
        """
        if run_id not in self.runs and not create:
            raise StoreError(f"run {run_id!r} is not in {self.url!r} as seen from this node: the store must be "
                             "shared storage that every node reaches (s3://…, gs://…, a shared filesystem path)")
        if run_id in self.runs:
            g = self.runs[run_id]
            version = g.attrs.get("schema_version")
            if version != SCHEMA_VERSION:
                raise StoreError(f"run {run_id!r} in {self.url!r} has store schema {version}, this nsa-dist "
                                 f"writes {SCHEMA_VERSION}; use a new store or run name")
            diff = _diff(g.attrs.get("spec"), spec)
            if diff:
                raise StoreError(f"run {run_id!r} exists in {self.url!r} with a different spec ("
                                 + "; ".join(diff[:5]) + "); refusing to overwrite — use another name")
            w = RunWriter(g, dims)
            w.check()
            return w
        g = self.runs.create_group(run_id)
        for a in run_arrays(dims):
            g.create_array(a.name, shape=a.shape, chunks=a.chunks, dtype=a.dtype, fill_value=a.fill,
                           dimension_names=a.dims)
        g.attrs.update({"schema_version": SCHEMA_VERSION, "spec": spec, "dims": dims.to_json(),
                        "status": Status.PENDING, "reason": None, "failed_step": None,
                        "created": time.time(), "updated": time.time()})
        return RunWriter(g, dims)


class RunWriter:
    """Writes one run's arrays: static data once, then each recorded step's chunks.

    ``write_step`` writes the step's arrays and its resume state, then sets ``done[i]`` last:
    a step counts as recorded only once everything it holds is on disk.
    """

    def __init__(self, group: zarr.Group, dims: RunDims) -> None:
        self.g, self.dims = group, dims
        self.specs: dict[str, ArraySpec] = {a.name: a for a in run_arrays(dims)}

    def check(self) -> None:
        """StoreError naming the first array that is missing or has the wrong shape/dtype."""
        for name, a in self.specs.items():
            if name not in self.g:
                raise StoreError(f"corrupt run {self.g.path!r}: array {name!r} is missing")
            arr = self.g[name]
            if tuple(arr.shape) != a.shape or np.dtype(arr.dtype) != np.dtype(a.dtype):
                raise StoreError(f"corrupt run {self.g.path!r}: array {name!r} is {arr.dtype}{tuple(arr.shape)}, "
                                 f"expected {a.dtype}{a.shape}")

    def set_status(self, status: str, reason: str | None = None, failed_step: int | None = None) -> None:
        self.g.attrs.update({"status": status, "reason": reason, "failed_step": failed_step, "updated": time.time()})

    def set_attrs(self, **attrs: Any) -> None:
        """Run attributes other than the status (e.g. the analysis layout chosen and why)."""
        self.g.attrs.update(attrs)

    def attr(self, name: str, default: Any = None) -> Any:
        """One run attribute (e.g. the layout recorded when the run was created)."""
        return self.g.attrs.get(name, default)

    def write_static(self, arrays: dict[str, np.ndarray]) -> None:
        for name, value in arrays.items():
            if self.specs[name].shape and np.size(value):
                self.g[name][...] = np.asarray(value)

    def done(self) -> np.ndarray:
        return np.asarray(self.g["done"][:], dtype=bool)

    def write_step(self, index: int, result: dict[str, Any], state: Any) -> None:
        """Everything of recorded step ``index``: results, θ/optimizer/RNG state, then the done flag."""
        for name, value in result.items():
            if name in self.specs:
                self.g[name][index] = np.asarray(value)
        self.g["theta"][index] = state.theta
        if self.dims.n_slots:
            self.g["opt_slots"][index] = state.slots
        self.g["rng_state"][index] = state.rng
        self.g["done"][index] = True

    def write_trace(self, start: int, values: np.ndarray) -> None:
        if len(values):
            self.g["loss_trace"][start:start + len(values)] = values

    def resume_index(self, before: int | None = None) -> int | None:
        """The recorded step to resume from: the last of the unbroken run of finished steps from 0
        (steps can finish out of order on a cluster), only indices < ``before`` when given."""
        done = self.done()
        if before is not None:
            done = done[:before]
        missing = np.flatnonzero(~done)
        last = (int(missing[0]) if len(missing) else len(done)) - 1
        return last if last >= 0 else None

    def state_at(self, i: int) -> dict[str, Any]:
        """The resume state stored with recorded step ``i``: step, theta, slots, rng."""
        slots = self.g["opt_slots"][i] if self.dims.n_slots else np.zeros((0, self.dims.P), np.float32)
        return {"step": int(self.g["steps"][i]), "theta": self.g["theta"][i], "slots": slots,
                "rng": self.g["rng_state"][i]}

    def write_array(self, name: str, value: np.ndarray, attrs: dict | None = None) -> None:
        """A post-run array (e.g. spectrum preservation), replaced if present."""
        self.g.create_array(name, shape=value.shape, dtype=value.dtype, overwrite=True,
                            dimension_names=dimension_names(name, value.ndim))[...] = value
        if attrs:
            self.g[name].attrs.update(attrs)
