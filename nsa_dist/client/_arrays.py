"""One run's stored arrays as of its finished steps: the layer every view of a run reads through.

A recorded step is finished when its ``done`` flag is set; :class:`RunArrays` keeps the storage
indices of the finished steps (``finished``, S entries into the schedule) and reads per-step
arrays at exactly those, checked (a damaged chunk is a StoreError naming it, never a NaN).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from nsa_dist.config import ExperimentSpec
from nsa_dist.errors import StoreError
from nsa_dist.store import RunDims, SpectrumStore

__all__ = ["RunArrays"]


class RunArrays:
    """A run's identity, status and checked array reads at its finished recorded steps.

    Attributes:
        id: the run id.
        spec: the validated :class:`~nsa_dist.config.ExperimentSpec` it was created from.
        status, reason: the lease-aware status ("running", "done", "failed", …) and why.
        failed_step: the step a failed run stopped at (None otherwise).
        attrs: the run group's attributes (spec, dims, …) as a dict.
        finished: (S,) int64 storage indices (into :attr:`schedule`) of the finished steps.

    Raises:
        StoreError: the run has no ``spec`` attribute (a corrupt run).
    """

    def __init__(self, store: SpectrumStore, run_id: str) -> None:
        self.id = run_id
        self._r = store.reader(run_id)
        if "spec" not in self._r.attrs:
            raise StoreError(f"corrupt run {run_id!r}: {self._r.path}/zarr.json has no 'spec' attribute")
        self.spec = ExperimentSpec.model_validate(self._r.attrs["spec"], context={"stored": True})
        self._set_state()

    def refresh(self) -> RunArrays:
        """Re-read the status and the set of finished steps (for watching a live run)."""
        self._r.refresh()
        self._set_state()
        return self

    def _set_state(self) -> None:
        attrs = self._r.attrs
        self.status, self.reason = self._r.status()
        self.failed_step = attrs.get("failed_step")
        self.attrs: dict[str, Any] = dict(attrs)
        self.finished = np.flatnonzero(self._r.done)

    # ------------------------------------------------------------------ metadata
    @property
    def g(self) -> Any:
        """The run's Zarr group, read-only (prefer the typed properties: their reads are checked)."""
        return self._r.g

    def has(self, name: str) -> bool:
        """Whether the run holds array ``name``."""
        return self._r.has(name)

    def array_names(self) -> list[str]:
        """The names of every array the run holds, sorted."""
        return self._r.names()

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of array ``name`` (all S recorded steps)."""
        return self._r.shape(name)

    def dimension_names(self, name: str) -> tuple[str, ...]:
        """The named axes of array ``name`` (Zarr v3 ``dimension_names``; per-step arrays start with "step")."""
        return self._r.dimension_names(name)

    def array_attrs(self, name: str) -> dict[str, Any]:
        """The attributes stored with array ``name``."""
        return self._r.array_attrs(name)

    @property
    def dims(self) -> RunDims:
        """The sizes the run's arrays were created with (N, K, P, S, …)."""
        return RunDims.from_json(self.attrs["dims"])

    # ------------------------------------------------------------------ data
    def array(self, name: str) -> np.ndarray:
        """A whole stored array (every recorded step, finished or not: unfinished steps are NaN)."""
        return self._r.read(name)

    @property
    def schedule(self) -> np.ndarray:
        """(S_all,) every step that will be recorded."""
        return self.array("steps")

    @property
    def steps(self) -> np.ndarray:
        """(S,) the finished recorded steps t."""
        return self.schedule[self.finished]

    @property
    def eigenvector_mask(self) -> np.ndarray:
        """(S,) bool along :attr:`steps`: which finished steps hold eigenvectors, as the run stored
        it (its ``eigenvector_steps`` array, written from the run's plan when it was created).

        Every reader asks this, never the spec's schedule.  Only a run written before that array
        existed falls back to the spec's ``spectrum.store_eigenvectors`` (the rule it was written by)."""
        if not self.has("eigenvectors"):
            return np.zeros(len(self.finished), dtype=bool)
        if self.has("eigenvector_steps"):
            return np.asarray(self.array("eigenvector_steps"), dtype=bool)[self.finished]
        return np.array([self.spec.spectrum.eigenvectors_at(int(t)) for t in self.steps], dtype=bool)

    @property
    def eigenvector_steps(self) -> np.ndarray:
        """(Se,) the finished steps whose eigenvectors are stored (:attr:`eigenvector_mask`)."""
        return np.asarray(self.steps[self.eigenvector_mask], dtype=np.int64)

    def stores_eigenvectors(self, step: int) -> bool:
        """Whether finished recorded step ``step`` holds eigenvectors (:attr:`eigenvector_mask`)."""
        if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
            raise KeyError(f"step={step!r} is not a recorded step t (one integer; run.steps lists them)")
        return bool(np.any(self.eigenvector_steps == int(step)))

    def per_step(self, name: str) -> np.ndarray:
        """(S, …) per-step array ``name`` at the finished steps (rows in the order of :attr:`steps`)."""
        return self.rows(name, self.finished)

    @property
    def notes(self) -> dict[int, dict[str, str]]:
        """Why some diagnostics are NaN, by finished step t: ``{t: {array name: reason}}`` (only the
        steps with a note; a diagnostic that could not be computed is stored as NaN and the run goes
        on).  Runs written before notes existed have none."""
        if not self.has("step_notes"):
            return {}
        out = {}
        for t, text in zip(self.steps.tolist(), self.per_step("step_notes").tolist()):
            if text:
                out[int(t)] = json.loads(text)
        return out

    def rows(self, name: str, idx: np.ndarray) -> np.ndarray:
        """(len(idx), …) per-step array ``name`` at storage indices ``idx`` (into :attr:`schedule`), checked."""
        return self._r.read_steps(name, idx)

    def row(self, name: str, i: int) -> np.ndarray:
        """Per-step array ``name`` at storage index ``i`` (into :attr:`schedule`), checked."""
        return self._r.read_step(name, i)

    def index_of(self, step: int) -> int:
        """The storage index (into :attr:`schedule`) of finished recorded step ``step``.

        Raises:
            KeyError: ``step`` is not a finished recorded step (the finished ones are named).
        """
        if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
            # an array compared element-wise picked its first match (outputs(run.steps) gave step 0's),
            # False matched step 0, 10.0 matched step 10 (an audit): one integer step, or this error
            raise KeyError(f"step={step!r} is not a recorded step t (one integer; run.steps lists them)")
        steps = self.steps
        where = np.flatnonzero(steps == step)
        if not len(where):
            raise KeyError(
                f"step {step} is not a finished recorded step of run {self.id!r}; "
                f"finished: {steps.tolist()[:20]}{' …' if len(steps) > 20 else ''}"
            )
        return int(self.finished[where[0]])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.id!r}, status={str(getattr(self.status, 'value', self.status))!r}, "
            f"steps={len(self.finished)}/{len(self.schedule)})"
        )


def flag(value: Any, name: str) -> bool:
    """``value`` as a reader's True/False option ``name``: a bool (numpy's too), else TypeError naming it —
    ``limit="no"`` read as True, ``state=0.0`` as False (Audit A2's cosmetic rest)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} must be True or False")
    return bool(value)
