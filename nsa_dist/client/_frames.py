"""Runs as data: one run as an :class:`xarray.Dataset`, a store's runs as a :class:`pandas.DataFrame`.

xarray and pandas are imported when called, so ``import nsa_dist`` does not pull them in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from nsa_dist.config import spec_as_today
from nsa_dist.errors import NSAError
from nsa_dist.store import run_summaries
from nsa_dist.store.schema import AXIS_LABELS, STATE_ARRAYS

if TYPE_CHECKING:
    import pandas
    import xarray

    from nsa_dist.client._arrays import RunArrays
    from nsa_dist.store import RunSummary, SpectrumStore

__all__ = ["run_to_xarray", "runs_frame", "flatten_spec"]


class NotFoundError(NSAError, KeyError):
    """A sweep or a column the store does not have: a KeyError whose message reads as written
    (``str()`` of a plain KeyError quotes it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


_ONE_BASED = (
    "k",
    "k_full",
    "k_test",
    "k_class",
    "k_gram_change",
    "hessian_k",
    "hessian_top_k",
    "hessian_I_k",
    "moment",
)


def run_to_xarray(run: RunArrays, *, state: bool = False) -> xarray.Dataset:
    """The finished recorded steps of ``run`` (a :class:`~nsa_dist.client.Run`) with named dimensions.

    Per-step arrays (first dim "step") keep only the finished steps; coordinate ``step`` holds
    t, ``k``-like coordinates run 1..K (``moment``: the order k of Tr(A^k), 1..4; ``hessian_part``:
    "H", "I", "S"), ``curve`` is the quadrature route's k (``curve_k``;
    ``curve_test``: ``curve_k_test``), ``image`` the drawn eigenvectors' i (``image_indices``:
    ``ds.eigvec_images.sel(image=10)``), ``reconstruction`` the k of Fig. 4d's reconstructions
    (``reconstruction_k``), ``predicted_step`` every recorded step t (App. E's prediction made at
    t0), ``preservation_row`` Fig. 7d's rows i, ``train_step`` 0..T−1; two- to three-entry axes of
    named quantities by their names (``gram_change``'s "measured" / "first_order", …).  Attributes: the run id, status
    and spec (JSON string).  The resume state is left out unless ``state``.

    Returns:
        xarray.Dataset; e.g. ``ds.energy_y.sel(k=10)`` is E_t(y, 10) along t.
    """
    import json

    import xarray as xr

    variables: dict[str, Any] = {}
    for name in run.array_names():
        if name in ("steps", "done") or (name in STATE_ARRAYS and not state):
            continue
        dims = run.dimension_names(name)
        if name == "hessian_steps":
            data = run.array(name)[run.finished]
        elif dims and dims[0] == "step":
            data = run.per_step(name)
        else:
            data = run.array(name)
        variables[name] = xr.Variable(dims, np.asarray(data), attrs=run.array_attrs(name))
    ds = xr.Dataset(variables)
    coords: dict[str, Any] = {"step": ("step", run.steps)}
    for d in _ONE_BASED:
        if d in ds.dims:
            coords[d] = (d, np.arange(1, ds.sizes[d] + 1))
    for d, names in AXIS_LABELS.items():  # named quantities, as the TensorBoard export's tags name them
        if ds.sizes.get(d) == len(names):
            coords[d] = (d, np.array(names))
    if "train_step" in ds.dims:
        coords["train_step"] = ("train_step", np.arange(ds.sizes["train_step"]))
    if "predicted_step" in ds.dims:  # App. E's prediction at t0 of every recorded step, finished or not
        coords["predicted_step"] = ("predicted_step", np.asarray(run.array("steps"), np.int64))
    for axis, grid in (
        ("curve", "curve_k"),
        ("curve_test", "curve_k_test"),
        ("image", "image_indices"),
        ("reconstruction", "reconstruction_k"),
    ):
        if axis in ds.dims and grid in ds:  # the quadrature route's k: ds.curve_energy_y.sel(curve=400)
            coords[axis] = (axis, np.asarray(ds[grid].values, np.int64))  # image: the eigenvector's i
    rows = ds["preservation"].attrs.get("rows") if "preservation" in ds else None
    if rows is not None and len(rows) == ds.sizes.get("preservation_row", -1):  # Fig. 7d's rows i
        coords["preservation_row"] = ("preservation_row", np.asarray(rows, np.int64))
    ds = ds.assign_coords(coords)
    ds.attrs.update({"run_id": run.id, "status": str(run.status), "spec": json.dumps(run.attrs["spec"])})
    return ds


def flatten_spec(d: dict, prefix: str = "") -> dict[str, Any]:
    """A nested spec dict as dotted columns: {"model": {"depth": 6}} → {"model.depth": 6}; lists
    become tuples (hashable columns)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten_spec(v, key + "."))
        else:  # an empty block is no value (a dict is no pandas key: a sweep's groups raised on it)
            out[key] = tuple(v) if isinstance(v, list) else (None if isinstance(v, dict) else v)
    return out


def _run_row(summary: RunSummary, sweep: str | None) -> dict[str, Any]:
    """One run's row; a damaged run has status "damaged" and the error (naming the file) as its
    reason, so that it never hides the others, and keeps the spec fields that were readable."""
    row = {
        "id": summary.id,
        "sweep": sweep,
        "status": summary.status,
        "reason": summary.reason,
        "steps_done": summary.steps_done,
        "steps_total": summary.steps_total,
        "last_step": summary.last_step,
    }
    # as today's nsa-dist reads it: a run recorded before a field existed has its default there, so
    # runs of one grid point recorded by two versions do not differ in it (a sweep split them)
    raw = summary.spec if isinstance(summary.spec, dict) else {}
    spec = (spec_as_today(raw) if summary.status != "damaged" else None) or raw  # a damaged run: what was read
    flat = flatten_spec(spec)
    if (spec.get("data") or {}).get("name") == "arrays":  # a Tracker's run: the user's loop set its rates
        # and its optimizer's settings; the spec holds defaults there (the run's `lr` array has δ_t)
        flat = {k: None if k.startswith(_SET_BY_THE_LOOP) and k != "optimizer.name" else v for k, v in flat.items()}
    return {**row, "data_fingerprint": summary.data_fingerprint, **flat}


_SET_BY_THE_LOOP = ("schedule.", "optimizer.")
_COUNTS = ("steps_done", "steps_total", "last_step")


def runs_frame(store: SpectrumStore, sweep: str | None = None, **where: Any) -> pandas.DataFrame:
    """One row per run: id, sweep (with ``sweep``: that one; else the sweeps it is in, ", "-joined
    when several), status, reason, steps_done, steps_total, last_step,
    data_fingerprint (of the data the run was created from), then every spec field flattened to a
    dotted column ("model.depth", "schedule.lr", …).

    Args:
        store: the spectrum store.
        sweep: only the runs of this sweep (``sweeps/<name>`` of the store).
        where: equality filters on columns, dots written as "__" (``model__depth=6``).

    Raises:
        KeyError: an unknown sweep (the known ones are named), or a filter on a missing column.
    """
    import pandas as pd

    sweeps = store.sweeps()
    if sweep is not None and sweep not in sweeps:
        raise NotFoundError(f"no sweep {sweep!r} in {store.url!r} (sweeps: {', '.join(sorted(sweeps)) or 'none'})")
    member: dict[str, list[str]] = {}  # a run may be in several sweeps (the same spec in two grids)
    for name, ids in sweeps.items():
        for rid in ids:
            member.setdefault(rid, []).append(name)
    names = {rid: sweep if sweep is not None else ", ".join(sorted(set(n))) for rid, n in member.items()}
    known = store.run_ids()
    # a run of the sweep not created yet is left out
    ids = [rid for rid in sweeps[sweep] if rid in set(known)] if sweep is not None else known
    rows = [_run_row(s, names.get(s.id)) for s in run_summaries(store, ids)]
    df = pd.DataFrame(
        rows,
        columns=None
        if rows
        else ["id", "sweep", "status", "reason", "steps_done", "steps_total", "last_step", "data_fingerprint"],
    )
    # counts as pandas' nullable integers: a run not started yet (None) keeps the column integral,
    # so its dtype does not depend on how far the runs have got (it was int, float or object)
    df = df.astype({c: "Int64" for c in _COUNTS})
    for key, value in where.items():
        col = key.replace("__", ".")
        if col not in df.columns:
            raise NotFoundError(f"no column {col!r} to filter on; columns: {', '.join(df.columns)}")
        missing = value is None or (isinstance(value, float) and np.isnan(value))
        # None / NaN: the runs whose spec leaves the field unset (== never matched them: a review)
        kept = df[df[col].isna()] if missing else df[df[col] == value]
        if (
            not len(kept) and len(df) and not missing
        ):  # '3' for 3, 'Done' for 'done' matched nothing, silently (an audit)
            near = sorted({repr(v) for v in df[col] if str(v).lower() == str(value).lower()})
            if near:
                raise ValueError(f"{key}={value!r} matches no run; column {col!r} holds {', '.join(near)}")
        df = kept
    return df.reset_index(drop=True)
