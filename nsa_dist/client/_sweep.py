"""The runs of one sweep read together: per-run quantities along t, aggregated over seeds (NSA Fig. 7a–c).

``Client(url).sweep("nsa_fig7").curves("energy_y", k=400)`` gives one curve per grid point
(depth × width), the mean over the seeds with its spread; ``.scalar("energy_y", k=10)`` gives
one value per run next to its grid fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from nsa_dist.client._frames import flatten_spec, runs_frame
from nsa_dist.client._run import Run
from nsa_dist.config import SweepSpec, spec_as_today
from nsa_dist.store import run_arrays

if TYPE_CHECKING:
    import pandas

    from nsa_dist.store import SpectrumStore

__all__ = ["Sweep", "Curve", "QUANTITIES", "quantity", "records", "varied_fields"]

QUANTITIES = (
    "loss",
    "loss_recorded",
    "loss_test",
    "lambda_max",
    "stability_bound",
    "alignment",
    "first_order_error",
    "first_order_cos",
    "energy_y",
    "energy_f",
    "energy_residual",
    "energy_df",
    "energy_df_pred",
    "energy_f_test",
    # the Hessian paper, at the analysed steps; k: the moment order 1..4 where named
    "hessian_H",
    "hessian_I",
    "hessian_S",
    "hessian_I_exact",
    "hessian_I_limit",
    "hessian_gap",
    "hessian_I_error",
    "hessian_S_ratio",
    "hessian_S_op",
    "hessian_S_fro",
    "hessian_I_fro",
    "hessian_orthogonality",
    "hessian_trace_S_G",
)
_HESSIAN_K = (
    "hessian_H",
    "hessian_I",
    "hessian_S",
    "hessian_I_exact",
    "hessian_I_limit",
    "hessian_gap",
    "hessian_I_error",
)  # Tr(A^k): need k


def _hessian_quantity(run: Run, name: str, k: int | None) -> np.ndarray:
    """The Hessian quantities of :data:`QUANTITIES` along ``run.hessian.steps``."""
    h = run.hessian
    if name in _HESSIAN_K:
        if k is None or not 1 <= k <= 4:
            raise ValueError(f"quantity {name!r} needs k, the moment order 1..4 (Tr(A^k)), got k={k!r}")
        if name == "hessian_gap":
            return h.additivity()["estimate"][:, k - 1]
        if name == "hessian_I_error":  # |Tr(I^k) − its Θ∞ limit| / limit
            exact, lim = (h.moments(p)["estimate"][:, k - 1] for p in ("I_exact", "I_limit"))
            with np.errstate(all="ignore"):
                return np.abs(exact - lim) / np.abs(lim)
        return h.moments(name.removeprefix("hessian_"))["estimate"][:, k - 1]
    if name == "hessian_S_ratio":  # Tr(S²) / Tr(I²): ~w in the active regime, bounded in the NTK regime
        with np.errstate(all="ignore"):
            return h.moments("S")["estimate"][:, 1] / h.moments("I")["estimate"][:, 1]
    if name == "hessian_S_op":
        return h.S_norms()["op"]
    if name == "hessian_S_fro":
        return h.S_norms()["k2"]
    if name == "hessian_I_fro":
        return np.sqrt(np.clip(h.moments("I")["estimate"][:, 1], 0, None))
    if name == "hessian_orthogonality":
        return h.orthogonality["value"]
    return h.trace_S()["G"]


_NEEDS = {
    "loss": ("loss_trace",),
    "loss_recorded": ("loss",),
    "lambda_max": ("eigenvalues",),
    "stability_bound": ("eigenvalues",),
    "hessian_I_exact": ("hessian_moments_I_exact",),
    "hessian_I_limit": ("hessian_I_limit_moments",),
    "hessian_I_error": ("hessian_moments_I_exact", "hessian_I_limit_moments"),
    "hessian_gap": ("hessian_additivity",),
    "hessian_S_op": ("hessian_S_op",),
    "hessian_orthogonality": ("hessian_orthogonality",),
    "hessian_trace_S_G": ("hessian_trace_S_G",),
}  # the stored arrays a quantity of QUANTITIES reads (default: "hessian_moments", or its own name)


def records(run: Run, name: str) -> bool:
    """Whether ``run``'s spec records quantity ``name`` (see :func:`quantity`): the arrays it reads are
    part of the run's schema (a run without test points records no "loss_test", one without a
    ``hessian:`` block no "hessian_…").  An array of the schema that is missing is damage, not
    "not recorded": reading it is the error naming it."""
    hessian = name.startswith("hessian_") and name in QUANTITIES
    needs = _NEEDS.get(name, ("hessian_moments",) if hessian else (name,))
    schema = {a.name for a in run_arrays(run.dims)}
    return all(n in schema for n in needs)


def _stores(run: Run, name: str) -> bool:
    """Whether ``name`` is a per-step array of ``run``'s schema."""
    return any(a.name == name and a.per_step for a in run_arrays(run.dims))


def _none_if_nan(v: Any) -> Any:
    """A grid field's value as a key: NaN (a field a run's spec does not set, e.g. ``hessian.every``
    of a variant without a ``hessian:`` block) as None, so that two runs of one point are one key."""
    return None if isinstance(v, float) and np.isnan(v) else v


def quantity(run: Run, name: str, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(t, value) of quantity ``name`` along a run.

    "loss": L(θ_t) of every training step (t = 0..T−1, NaN not yet trained); "loss_recorded",
    "loss_test", "lambda_max", "stability_bound", "alignment", "first_order_error",
    "first_order_cos": at the finished recorded steps; "energy_<φ>": E_t(φ, k) (k required);
    "hessian_<…>" at the analysed Hessian steps: Tr(A^k) of "hessian_H" / "_I" / "_S" (Hutch++),
    "_I_exact", "_I_limit" (Θ∞), "hessian_gap" (Theorem 1), "hessian_I_error" (|exact − limit| /
    limit) with k the order 1..4; "hessian_S_ratio" = Tr(S²)/Tr(I²), "hessian_S_op", "hessian_S_fro",
    "hessian_I_fro", "hessian_orthogonality", "hessian_trace_S_G" (∇Cᵀ·G).

    Raises:
        ValueError: an unknown name (the allowed are listed) or an energy without k.
    """
    if k is not None and (isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer))):
        # True was read as k = 1, 2.0 failed deep in NumPy (an audit): one integer k, or this error
        raise ValueError(f"quantity {name!r}: k must be an integer, got k={k!r}")
    if name not in QUANTITIES:
        return run.steps, _stored_scalar(run, name, k)
    if k is not None and not (name.startswith("energy_") or name in _HESSIAN_K):
        raise ValueError(
            f"quantity {name!r} takes no k (got k={k!r}): k is the k of the energy_<φ> quantities, the "
            f"moment order of {', '.join(_HESSIAN_K)}, or the column of a stored (S, n) array"
        )
    if name.startswith("hessian_"):
        return run.hessian.steps, np.asarray(_hessian_quantity(run, name, k), np.float64)
    if name == "loss":
        trace = run.loss_trace
        return np.arange(len(trace)), trace
    t = run.steps
    if name.startswith("energy_"):
        if k is None:
            raise ValueError(f"quantity {name!r} needs k (E_t(φ, k))")
        return t, run.energy(name.removeprefix("energy_"), k, step=None)[0]
    values = {
        "loss_recorded": lambda: run.train_loss,
        "loss_test": lambda: run.test_loss,
        "lambda_max": lambda: run.lambda_max,
        "stability_bound": lambda: run.stability_bound(),
        "alignment": lambda: run.alignment["raw"],
        "first_order_error": lambda: run.first_order["error"],
        "first_order_cos": lambda: run.first_order["cos"],
    }[name]()
    return t, np.asarray(values, np.float64)


def _stored_scalar(run: Run, name: str, k: int | None) -> np.ndarray:
    """Any other per-step array the run stores, as one value per finished step: an (S,) array as
    it is, an (S, n) one at column k (1-based, e.g. ``eigenvalues`` k = 2 is λ_2)."""
    per_step = {a.name: a for a in run_arrays(run.dims) if a.per_step and a.dtype.startswith("float")}
    spec = per_step.get(name)
    if spec is None or len(spec.shape) > 2:
        scalars = sorted(n for n, a in per_step.items() if len(a.shape) <= 2)
        raise ValueError(
            f"unknown quantity {name!r}; allowed: {', '.join(QUANTITIES)}, or a stored per-step "
            f"array of this run: {', '.join(scalars)}"
        )
    values = run.per_step(name).astype(np.float64)
    if values.ndim == 1:
        if k is not None:
            raise ValueError(f"quantity {name!r} has one value per step and takes no k (got k={k!r})")
        return values
    n = values.shape[1]
    if k is None or not 1 <= k <= n:
        raise ValueError(f"quantity {name!r} has {n} values per step: give k in 1..{n}, got {k!r}")
    return values[:, k - 1]


def _hashable(v: Any) -> Any:
    """``v`` as a key: a list or dict value (a grid over blocks, a tuple of them) as its JSON text."""
    try:
        hash(v)
        return v
    except TypeError:
        import json

        return json.dumps(v, sort_keys=True, default=str)


def _differ(runs: pandas.DataFrame, column: str) -> bool:
    """Whether the runs hold more than one value in ``column`` (None and NaN one value)."""
    if column not in runs.columns or column in _NOT_VARIED:
        return False
    return len({repr(_none_if_nan(v)) for v in runs[column]}) > 1


# a run's own columns (runs_frame), not a spec field a grid point is told apart by; a sweep names
# each of its runs apart, and the seed is pooled
_NOT_VARIED = ("id", "sweep", "status", "reason", "steps_done", "steps_total", "last_step", "data_fingerprint", "name")


def _beyond(run: Run, name: str, k: int | None) -> bool:
    """Whether ``run`` has no column ``k`` of quantity ``name`` (E_t(φ, k) beyond its N or its stored
    eigenpairs, λ_k of a stored (S, n) array with n < k)."""
    if k is None:
        return False
    if name.startswith("energy_"):
        return k > run.k_max
    if name not in QUANTITIES:
        spec = {a.name: a for a in run_arrays(run.dims) if a.per_step}.get(name)
        return spec is not None and len(spec.shape) == 2 and k > spec.shape[1]
    return False


def varied_fields(spec: dict[str, Any]) -> list[str]:
    """The dotted spec fields a recorded sweep spec varies (its grid's, then its variants'), seed included.

    A path whose values are groups of fields (``grid: {model: [{depth: 2, width: 4}, …]}``) stands
    for the dotted fields those values set ("model.depth", "model.width"): the columns of
    :func:`~nsa_dist.client.runs_frame` that tell its grid points apart.  A field that every one
    of two or more such groups sets to the same value varies nothing and is left out (variants
    that each replace the whole ``spectrum`` block, alike but for its layout, vary the layout)."""
    values: dict[str, list[Any]] = {}
    grid, variants = spec.get("grid", {}), spec.get("variants", [])
    for path, vals in grid.items():
        values.setdefault(path, []).extend(vals)
    for variant in variants:
        for path, value in variant.items():
            values.setdefault(path, []).append(value)
    out: list[str] = []
    for path, vals in values.items():
        nested = [flatten_spec(v, path + ".") for v in vals if isinstance(v, dict) and v]
        in_variants = sum(path in v for v in variants)
        everywhere = in_variants == 0 if path in grid else in_variants == len(variants)  # no point keeps the base's
        alike = everywhere and len(nested) == len(vals) > 1  # every value a group: a field all set alike is fixed
        for f in dict.fromkeys(f for d in nested for f in d):
            if not (alike and all(f in d and d[f] == nested[0][f] for d in nested)):
                out.append(f)
        if len(nested) < len(vals):
            out.append(path)
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class Curve:
    """One grid point of a sweep along t: the mean over its n runs (seeds) and the spread.

    The statistics are over all n runs at every t: where a run has no value (NaN: diverged, not
    trained yet, a diagnostic it could not compute) the mean, std, min and max there are NaN —
    never the mean of the runs left, which would mix seeds (a diverged seed dropped from the mean of
    a large learning rate) or steps (a seed still running).  :attr:`count` says how many runs have
    a value at each t.

    Attributes:
        key: grid field → value of this point (seed excluded).
        t: (T,) steps common to all its runs.
        mean, std, lo, hi: (T,) mean, standard deviation (the population one, ddof 0: 0 for one
            run), min and max over the n runs; NaN where any of them has no value (NaN); an infinite
            value stays in (mean ±inf).
        n: number of runs averaged: the seeds with a finished step (a seed run twice under two
            names counts once).
        bracket: (lower, upper), (T,) each, that contain the exact mean of an energy E_t(φ, k)
            (the means of the runs' brackets; lower = upper = mean where every run measured it
            exactly), None for other quantities.
        count: (T,) the number of runs with a value (not NaN) at each t (None: all n).
        total: the seeds of this grid point in the sweep, with or without a finished step (None: n).
    """

    key: dict[str, Any]
    t: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    n: int
    bracket: tuple[np.ndarray, np.ndarray] | None = None
    count: np.ndarray | None = None
    total: int | None = None
    failed: int = 0

    @property
    def label(self) -> str:
        """ "width=8, depth=2 (3 seeds)"; "(2 of 3 seeds)" when some runs of the point have no
        finished step yet; ", 2 failed" when runs of it failed (their curves end where they did)."""
        name = ", ".join(f"{f.split('.')[-1]}={v}" for f, v in self.key.items()) or "all"
        total = self.n if self.total is None else self.total
        failed = f", {self.failed} failed" if self.failed else ""
        if total > self.n:
            return name + f" ({self.n} of {total} seeds{failed})"
        if self.n > 1:
            return name + f" ({self.n} seeds{failed})"
        return name + (" (failed)" if self.failed else "")


class Sweep:
    """A recorded sweep: its runs (:attr:`runs`, a DataFrame), the fields it varies and the seeds.

    Attributes:
        store: the spectrum store it was read from.
        name: the sweep's name.
        fields: the dotted spec fields the grid / variants vary, seed excluded (e.g. model.depth).
        seeded: True when the sweep varies ``seed`` (curves are means over seeds).

    Raises:
        KeyError: no sweep ``name`` in the store (the known ones are named).
    """

    def __init__(self, store: SpectrumStore, name: str) -> None:
        self.store, self.name = store, name
        self.runs: pandas.DataFrame = runs_frame(store, sweep=name)  # KeyError naming the known sweeps
        varied = varied_fields(store.sweep_spec(name))
        # a damaged run's spec (unreadable: empty) differs from every other in every field: not counted
        readable = self.runs[self.runs["status"] != "damaged"] if len(self.runs) else self.runs
        self.seeded = "seed" in varied or _differ(readable, "seed")
        # the grid's fields, and any other spec field its runs differ in: a sweep re-submitted under
        # its name keeps its earlier runs (store.record_sweep), whose grid or base may have been another
        differing = [c for c in readable.columns if c not in varied and c != "seed" and _differ(readable, c)]
        self.fields = [f for f in [*varied, *differing] if f != "seed" and f in self.runs.columns]

    def run(self, run_id: str) -> Run:
        """One run of the sweep by its id (a value of ``runs["id"]``)."""
        return Run(self.store, run_id)

    def _finished(self) -> list[dict[str, Any]]:
        """The rows of the runs with a finished step, one per grid point and seed, in the sweep's
        order: two runs of one point with the same seed are one experiment under two names (a grid
        of width [8, 8.0] or lr [1, 1.0] names two runs of the same spec), counted once — the one
        with the most finished steps."""
        rows = self.runs[self.runs["steps_done"] > 0].to_dict("records")
        best: dict[tuple, dict[str, Any]] = {}
        for row in rows:
            one = (self._key(row), row.get("seed"))
            if one not in best or row["steps_done"] > best[one]["steps_done"]:
                best[one] = row
        keep = {row["id"] for row in best.values()}
        return [row for row in rows if row["id"] in keep]

    def _key(self, row: dict[str, Any]) -> tuple:
        return tuple(_hashable(_none_if_nan(row[f])) for f in self.fields)

    def groups(self) -> list[tuple[dict[str, Any], list[str]]]:
        """(grid point, run ids) for each point of the grid, seeds pooled (each seed once), in the
        sweep's order."""
        out: dict[tuple, tuple[dict[str, Any], list[str]]] = {}
        for row in self._finished():
            key = self._key(row)
            out.setdefault(key, (dict(zip(self.fields, key)), []))[1].append(row["id"])
        return list(out.values())

    def unfinished_points(self) -> list[dict[str, Any]]:
        """The grid points none of whose runs has a finished recorded step yet (not started, not
        created in the store yet, or failed before their first): :meth:`groups`, :meth:`curves` and
        the figures leave them out, and ``nsa plot --sweep`` / ``nsa show --sweep`` say which."""
        done = {self._key(row) for row in self._finished()}
        out: dict[tuple, dict[str, Any]] = {}
        for row in [*self.runs.to_dict("records"), *self._planned()]:
            key = self._key(row)
            if key not in done:
                out.setdefault(key, dict(zip(self.fields, key)))
        return list(out.values())

    def not_created(self) -> list[str]:
        """The run ids the sweep names that the store has no run of yet (a sweep whose driver
        stopped before creating them): they are not in :attr:`runs`; their grid points are in
        :meth:`unfinished_points`."""
        have = set(self.runs["id"]) if len(self.runs) else set()
        return [rid for rid in self.store.sweeps()[self.name] if rid not in have]

    def _planned(self) -> list[dict[str, Any]]:
        """The flattened specs of the recorded sweep spec's grid (today's reading of it), as rows
        keyed like :attr:`runs`: a grid point whose runs were never created has no row there, and
        was left out of :meth:`unfinished_points` silently.  [] for a recorded spec that no longer
        reads as a sweep (an older nsa-dist's)."""
        if not self.not_created():
            return []
        try:
            specs = SweepSpec.model_validate(self.store.sweep_spec(self.name)).expand()
        except Exception:  # noqa: BLE001 - another version's sweep spec: its created runs' rows only
            return []
        return [flatten_spec(spec_as_today(s.model_dump(mode="json")) or {}) for s in specs]

    def curves(self, name: str, k: int | None = None) -> list[Curve]:
        """One :class:`Curve` of quantity ``name`` (see :func:`quantity`) per grid point; an energy
        E_t(φ, k) carries the bracket of its mean (:attr:`Curve.bracket`).  The mean is over every
        run of the point at every t: NaN where one of them has no value (:attr:`Curve.count` says
        how many have).  A grid point whose spec does not record ``name`` while others do (a variant
        without test points or without a ``hessian:`` block) has no curve (:meth:`lacking` names them)."""
        totals: dict[tuple, set] = {}
        for row in self.runs.to_dict("records"):  # the seeds of each point, with or without a finished step
            totals.setdefault(self._key(row), set()).add(row.get("seed"))
        curves, skip = [], self._not_recording(name, k)
        status = dict(zip(self.runs["id"], self.runs["status"]))
        for key, ids in self.groups():
            if skip.intersection(ids):  # its spec records no such quantity: :meth:`lacking`
                continue
            runs = [self.run(rid) for rid in ids]
            series = [quantity(r, name, k) for r in runs]
            t = series[0][0]
            for ti, _ in series[1:]:
                t = np.intersect1d(t, ti)
            at = [np.searchsorted(ti, t) for ti, _ in series]
            V = np.stack([v[j] for j, (_, v) in zip(at, series)])  # (n, T)
            bracket = None
            if name.startswith("energy_") and k is not None:
                b = [r.energy(name.removeprefix("energy_"), k, step=None) for r in runs]
                lo = np.stack([bi[1][j] for j, bi in zip(at, b)])
                hi = np.stack([bi[2][j] for j, bi in zip(at, b)])
                bracket = (lo.mean(0), hi.mean(0))  # the mean of exact values lies between the means of the bounds
            ok = ~np.isnan(V)
            W = np.where(ok.all(0), V, np.nan)  # a t where a run has no value has no mean over the runs
            with np.errstate(all="ignore"):
                curves.append(
                    Curve(
                        dict(key),
                        t,
                        W.mean(0),
                        W.std(0),
                        W.min(0),
                        W.max(0),
                        len(ids),
                        bracket,
                        ok.sum(0),
                        max(len(totals.get(tuple(key.values()), ())), len(ids)),
                        sum(status.get(rid) == "failed" for rid in ids),
                    )
                )
        return curves

    def scalar(self, name: str, k: int | None = None, step: int | None = None) -> pandas.DataFrame:
        """One row per finished run (each seed of a grid point once): id, the grid fields, seed,
        ``value`` = quantity ``name`` at ``step`` (default: each run's last step with a finite
        value — its last finished recorded step; "loss": its last trained step), ``step`` = the t
        of that value (runs that failed or are still running end earlier than the others: their t
        says so; at a given ``step`` they did not reach, ``value`` is NaN) and the run's ``status``.
        Runs whose spec does not record ``name`` (or whose N is below ``k``) while others do have no
        row (:meth:`lacking`)."""
        import pandas as pd

        rows, skip, reached = [], self._not_recording(name, k), False
        for row in self._finished():
            if row["id"] in skip:  # its spec records no such quantity: :meth:`lacking`
                continue
            t, v = quantity(self.run(row["id"]), name, k)
            if step is None:
                ok = np.flatnonzero(np.isfinite(v))
                value = float(v[ok[-1]]) if len(ok) else float("nan")
                at = int(t[ok[-1]]) if len(ok) else (int(t[-1]) if len(t) else -1)
            else:
                if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
                    # 2.0 matched step 2, an array failed in NumPy's broadcast (a review): one integer step
                    raise KeyError(f"step={step!r} is not a recorded step t (one integer, or None for each run's last)")
                where = np.flatnonzero(t == step)  # none: the run failed or is still running before it
                value, at, reached = (
                    (float(v[where[0]]) if len(where) else float("nan")),
                    int(step),
                    reached or len(where),
                )
            rows.append(
                {
                    "id": row["id"],
                    **{f: row[f] for f in self.fields},
                    "seed": row.get("seed"),
                    "value": value,
                    "step": at,
                    "status": row.get("status"),
                }
            )
        if step is not None and rows and not reached:  # no run has it: a step the sweep does not record
            recorded = sorted({int(t) for r in rows for t in quantity(self.run(r["id"]), name, k)[0]})
            raise KeyError(
                f"step {step} is no finished step of {name!r} in any run of sweep {self.name!r} (recorded: "
                f"{recorded[:12]}{' …' if len(recorded) > 12 else ''})"
            )
        return pd.DataFrame(rows, columns=["id", *self.fields, "seed", "value", "step", "status"])

    def as_the_paper_scales(self, df: pandas.DataFrame) -> pandas.DataFrame:
        """``df`` (:meth:`scalar` of a Hessian eigenvalue or norm, of the first power in H) with the
        values of ``model.regime: active`` runs multiplied by their width w: the Hessian paper's
        active regime scales the learning rate by w, which "essentially multiplies the whole Hessian
        by w", and compares that (its ‖S‖_op does not vanish), while the store holds the loss
        Hessian itself (docs/store.md)."""
        if "model.regime" not in self.runs.columns or not len(df):
            return df
        regime = self.runs.set_index("id")["model.regime"].reindex(df["id"])
        width = self.runs.set_index("id")["model.width"].reindex(df["id"]).astype(float).to_numpy()
        active = regime.eq("active").to_numpy()
        return df.assign(value=np.where(active, df["value"].to_numpy(np.float64) * width, df["value"]))

    def lacking(self, name: str, k: int | None = None) -> list[dict[str, Any]]:
        """The grid points (with a finished step) whose runs' spec does not record quantity ``name``
        (:func:`records`: no test points for "loss_test", no ``hessian:`` block for "hessian_…"), or
        that have no column ``k`` of it (an E_t(φ, k) beyond their N or their stored eigenpairs):
        :meth:`curves`, :meth:`scalar` and the sweep figures leave them out, and ``nsa plot --sweep``
        says which."""
        skip, ids = self._lacking_ids(name, k)
        if ids and name not in QUANTITIES and not any(_stores(self.run(r), name) for r in ids):
            # an unknown name "lacked" at every grid point (an audit): say it is unknown
            _stored_scalar(self.run(ids[0]), name, k)  # ValueError: unknown quantity, the allowed listed
        return [key for key, ids in self.groups() if skip.intersection(ids)]

    def _lacking_ids(self, name: str, k: int | None) -> tuple[set[str], list[str]]:
        ids = [rid for _, group in self.groups() for rid in group]
        return {rid for rid in ids if not records(self.run(rid), name) or _beyond(self.run(rid), name, k)}, ids

    def _not_recording(self, name: str, k: int | None = None) -> set[str]:
        """The ids of the finished runs whose spec does not record ``name`` (at ``k``) — none when no
        run of the sweep records it (reading it then is the error saying so, never an empty answer);
        a ``k`` beyond every run's columns is that error here, naming the sweep (the run's own said
        "this run", not which).

        Raises:
            ValueError: no finished run of the sweep has column ``k`` of ``name``."""
        skip, ids = self._lacking_ids(name, k)
        energy = name.startswith("energy_")  # another array's own error names its range (k in 1..n)
        if energy and ids and len(skip) == len(ids) and k is not None and any(records(self.run(r), name) for r in ids):
            largest = max(self.run(r).k_max for r in ids)
            most = f" (the largest any run has: k = {largest})"
            raise ValueError(
                f"k={k}: no finished run of sweep {self.name!r} has {name} at k = {k}{most}; "
                "spectrum.k: all or spectrum.energy: quadrature measures every k up to N"
            )
        return set() if len(skip) == len(ids) else skip

    def smallest_k(self) -> int:
        """The largest k at which every finished run has E_t(φ, k): the smallest :attr:`Run.k_max`
        (the eigenpairs kept, or N for a run that measured every k)."""
        return min(self.run(rid).k_max for _, ids in self.groups() for rid in ids)

    def smallest_n(self) -> int:
        """The smallest number of training points N of a finished run (a k < it is a k below every run's N)."""
        return min(self.run(rid).N for _, ids in self.groups() for rid in ids)

    def __repr__(self) -> str:
        return f"Sweep({self.name!r}, runs={len(self.runs)}, fields={self.fields}, seeded={self.seeded})"
