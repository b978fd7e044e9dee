"""One line per run, read concurrently: what a table of hundreds of runs needs and nothing more.

:func:`run_summaries` reads, for every run at once (one ``asyncio.gather`` on Zarr's own event
loop), the run's ``zarr.json`` (status, spec, sizes), its lease, the ``steps``, the ``done`` flags
(one chunk per recorded step, so only for a run not ``done``: a finished run has them all) and the
loss and λ_max of its last finished step — two chunks.  Opening each run through
:class:`~nsa_dist.store.reader.RunReader` instead makes a dozen blocking round trips per run, ~6 ms
each on a local disk (``benchmarks/serve_table.py`` measures both).  A run whose quick read fails
is read again through the checked reader, whose error names the damaged file; that error becomes
the row's ``reason`` with status ``"damaged"``, so one damaged run never hides the others.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from zarr.core.array import AsyncArray
from zarr.core.sync import sync
from zarr.storage import StorePath

from nsa_dist.errors import StoreError
from nsa_dist.store.lease import effective_status, parse_lease
from nsa_dist.store.reader import RunReader
from nsa_dist.store.runs import RunIndex
from nsa_dist.store.schema import SCHEMA_VERSION, RunDims, run_arrays
from nsa_dist.store.status import Status

__all__ = ["RunSummary", "run_summaries"]


@dataclass(frozen=True)
class RunSummary:
    """A run as one table row.

    Attributes:
        id: the run id.
        status, reason: lease-aware (``"damaged"`` and the error naming the file when unreadable).
        steps_done, steps_total: finished (None: not read) and scheduled recorded steps.
        last_step: t of the last finished recorded step (None before the first).
        loss: L(θ_t) at ``last_step`` (NaN before the first step).
        lambda_max: λ_max of the kernel that sets GD's stability at ``last_step`` (the full kernel's
            for Ko > 1 outputs, as :attr:`nsa_dist.client.Run.lambda_max`; NaN when not stored).
        spec: the run's spec as stored (JSON); data_fingerprint as stored.
    """

    id: str
    status: str | None
    reason: str | None
    steps_done: int | None = 0
    steps_total: int = 0
    last_step: int | None = None
    loss: float = float("nan")
    lambda_max: float = float("nan")
    spec: dict[str, Any] = field(default_factory=dict)
    data_fingerprint: str | None = None


def run_summaries(store: RunIndex, run_ids: list[str] | None = None, *, steps: bool = True) -> list[RunSummary]:
    """A :class:`RunSummary` of each run (default: every run of the store), in the order given.

    Args:
        store: the spectrum store (opened read-only or not: nothing is written).
        run_ids: the runs to read; ids that are not runs of the store become ``damaged`` rows.
        steps: also read the step columns (``steps_done``, ``last_step``, ``loss``, ``lambda_max``:
            S + 2 chunks a run); False reads the run's ``zarr.json`` and lease only — ~20 times
            fewer reads — and leaves ``steps_done`` None and ``steps_total`` as scheduled.

    Returns:
        One summary per id.
    """
    ids = store.run_ids() if run_ids is None else list(run_ids)

    async def gather() -> list[RunSummary | BaseException]:
        return await asyncio.gather(*(_quick(store, rid, steps) for rid in ids), return_exceptions=True)

    out = []
    for rid, got in zip(ids, sync(gather())):
        out.append(got if isinstance(got, RunSummary) else _checked(store, rid, got, steps))
    return out


async def _quick(store: RunIndex, rid: str, steps_too: bool) -> RunSummary:
    """The unchecked concurrent read; any failure is re-read by :func:`_checked`."""
    meta, lease = await asyncio.gather(
        store.keys.get_async(f"runs/{rid}/zarr.json"), store.keys.get_async(f"leases/{rid}/zarr.json")
    )
    if meta is None:
        raise StoreError(f"no run {rid!r} in {store.url!r}")
    attrs = json.loads(meta).get("attributes", {})
    if attrs.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:  # :func:`_checked`'s reader names it
        raise StoreError(f"run {rid!r}: store schema {attrs.get('schema_version')}")
    status, reason = effective_status(
        attrs.get("status"), attrs.get("reason"), parse_lease(lease), creating=bool(attrs.get("creating"))
    )
    base = dict(
        id=rid,
        status=status,
        reason=reason,
        spec=attrs.get("spec") or {},
        data_fingerprint=attrs.get("data_fingerprint"),
    )
    if not isinstance(base["spec"], dict):  # :func:`_checked`'s reader names it (was listed as a run, blank)
        raise StoreError(f"run {rid!r}: its spec attribute is not a spec")
    if attrs.get("creating"):
        return RunSummary(**base)  # no array need exist yet
    dims = RunDims.from_json(attrs["dims"])
    if not steps_too:
        return RunSummary(**base, steps_done=None, steps_total=dims.S)
    open_ = lambda name: AsyncArray.open(StorePath(store.keys.zarr, f"runs/{rid}/{name}"), zarr_format=3)  # noqa: E731
    steps = await (await open_("steps")).getitem(slice(None))
    if status == Status.DONE:  # a finished run has every step done (nsa verify --mark makes it pending first)
        if await store.keys.get_async(f"runs/{rid}/done/zarr.json") is None:  # deleted: "done 16/16" was listed
            raise StoreError(f"run {rid!r}: its array 'done' is missing")
        idx = np.arange(len(steps))
    else:  # one chunk per recorded step: read only for runs still in progress
        idx = np.flatnonzero(np.asarray(await (await open_("done")).getitem(slice(None)), bool))
    if not len(idx):
        return RunSummary(**base, steps_total=len(steps))
    last = int(idx[-1])
    lam_name = _lambda_array(dims)
    loss_a = await open_("loss")
    loss = await loss_a.getitem(last)
    lam = np.nan
    if lam_name is not None:
        lam = await (await open_(lam_name)).getitem((last, 0))
    return RunSummary(
        **base,
        steps_done=len(idx),
        steps_total=len(steps),
        last_step=int(steps[last]),
        loss=float(loss),
        lambda_max=float(lam),
    )


def _lambda_array(dims: RunDims) -> str | None:
    """The array whose first column is the stability λ_max (:attr:`nsa_dist.client.Run.lambda_max`):
    the full kernel's eigenvalues for Ko > 1 outputs, G_t's for one; None when not stored."""
    names = {a.name for a in run_arrays(dims)}
    if "eigenvalues_full" in names:
        return "eigenvalues_full"
    return "eigenvalues" if dims.Ko == 1 and "eigenvalues" in names else None


def _checked(store: RunIndex, rid: str, quick_error: BaseException, steps_too: bool) -> RunSummary:
    """The row of a run whose quick read failed: the checked reader's error names the file, and
    what it read before the damage stays in the row (spec, sizes, progress; one damaged chunk of the
    last step's λ_max left a row of blanks, "damaged 0/0", for a run whose other steps are intact)."""
    row: dict[str, Any] = dict(id=rid, status=Status.DAMAGED, reason=None)
    try:
        r = RunReader(store, rid)
        row.update(spec=r.attrs.get("spec") or {}, data_fingerprint=r.attrs.get("data_fingerprint"))
        row["status"], row["reason"] = r.status()
        row["steps_total"] = r.dims.S if r.dims else 0
        if not steps_too:
            return RunSummary(**{**row, "steps_done": None})
        steps = r.read("steps")
        idx = np.flatnonzero(r.done)
        row.update(steps_total=len(steps), steps_done=len(idx))
        if len(idx):
            last = int(idx[-1])
            row["last_step"] = int(steps[last])
            row["loss"] = float(r.read_step("loss", last))
            lam_name = _lambda_array(r.dims) if r.dims else None
            row["lambda_max"] = float(r.read_step(lam_name, last)[0]) if lam_name else float("nan")
        return RunSummary(**row)
    except StoreError as exc:
        return RunSummary(**{**row, "status": Status.DAMAGED, "reason": str(exc)})
    except Exception:  # noqa: BLE001 — the checked reader found nothing: report what the quick read met
        why = f"run {rid!r}: {type(quick_error).__name__}: {quick_error}"
        return RunSummary(**{**row, "status": Status.DAMAGED, "reason": why})
