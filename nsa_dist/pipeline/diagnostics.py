"""A diagnostic never ends the run it observes (STYLE 21).

Only training itself can fail a run.  Every other per-step quantity — a prediction, a theory
curve, an extra — is a *diagnostic*: when it cannot be computed at a step (an overflow, a
singular system, a layer forward-mode AD cannot pass) its arrays are stored as NaN, the reason
goes into the step's ``step_notes`` (JSON ``{array: reason}``), one line is logged, and the step
and the run go on.

What is *not* a diagnostic's own failure is re-raised, so that the machinery that handles it
still does: an interrupt, running out of memory, a lost writer lease, and Ray's errors (a dead
gang member's step is recomputed elsewhere by the coordinator, not stored as NaN).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from nsa_dist.store import LeaseLost

__all__ = ["StepNotes", "is_infrastructure"]

log = logging.getLogger("nsa_dist.diagnostics")
T = TypeVar("T")


def is_infrastructure(exc: BaseException) -> bool:
    """Whether ``exc`` belongs to the run's machinery rather than to a diagnostic's numerics:
    not an ``Exception`` (interrupts), MemoryError, a lost lease, or any of Ray's errors."""
    if not isinstance(exc, Exception) or isinstance(exc, (MemoryError, LeaseLost)):
        return True
    return any(c.__module__.split(".")[0] == "ray" for c in type(exc).__mro__)


class StepNotes:
    """Why some of one step's arrays are NaN: ``{array name: reason}``, each logged once.

    >>> notes = StepNotes("run-1", step=0)
    >>> notes.guard(("ratio",), lambda: 1 / 0) is None
    True
    >>> notes.reasons
    {'ratio': 'ZeroDivisionError: division by zero'}
    """

    def __init__(self, run_id: str, step: int | None) -> None:
        """``step``: the training step analysed; None for what is computed after the run."""
        self.run_id, self.step = run_id, step
        self.reasons: dict[str, str] = {}

    def note(self, names: Iterable[str], reason: str, quiet: bool = False) -> None:
        """Record that ``names`` are NaN at this step because of ``reason`` (one log line; none with
        ``quiet``: a reason of the whole run, logged at its first step only)."""
        names = [n for n in names if n not in self.reasons]
        if not names:
            return
        reason = " ".join(str(reason).split())[:500]
        where = f"step {self.step}" if self.step is not None else "after the last step"
        if not quiet:
            log.warning("run %s %s: %s not computed (NaN): %s", self.run_id, where, ", ".join(names), reason)
        self.reasons.update({n: reason for n in names})

    def guard(self, names: Iterable[str], fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """``fn(*args, **kwargs)``, or None with ``names`` noted when it raises a diagnostic's error."""
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - sorted by is_infrastructure
            if is_infrastructure(exc):
                raise
            self.note(names, f"{type(exc).__name__}: {exc}")
            return None

    def json(self) -> str:
        """The ``step_notes`` value: "" when nothing was noted."""
        return json.dumps(self.reasons, sort_keys=True, ensure_ascii=False) if self.reasons else ""
