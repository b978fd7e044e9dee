"""A run's status: the one enum every writer sets and every reader compares against."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["STORED_STATUSES", "Status"]


class Status(StrEnum):
    """A run's status, stored as its string value in the run's attributes (``status``).

    ``running`` is shown only while its writer's lease is fresh; a run whose writer stopped
    without saying so shows ``interrupted`` (re-run to resume, see
    :func:`~nsa_dist.store.lease.effective_status`).  ``damaged`` is never stored: it is what a
    summary shows for a run whose metadata cannot be read.
    """

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    DAMAGED = "damaged"


STORED_STATUSES = tuple(s.value for s in Status if s is not Status.DAMAGED)  # what a writer ever stores
