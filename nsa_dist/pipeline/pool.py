"""Where a tracked run's checkpoints are analysed: one interface and its in-thread implementation (no Ray).

The Tracker hands each recorded checkpoint to an :class:`AnalysisPool` and trains on;
:class:`ThreadAnalysisPool` analyses in a background thread, ``nsa_dist.cluster.tracking.RayTrackerPool``
on Ray actors.  Both fail alike (:func:`raise_failure`).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Collection
from typing import Any, NoReturn, Protocol

from nsa_dist.errors import AnalysisError, NSAError
from nsa_dist.pipeline.checkpoint import Checkpoint
from nsa_dist.store import LeaseLost

__all__ = ["AnalysisPool", "ThreadAnalysisPool", "analysis_error", "raise_failure"]


class AnalysisPool(Protocol):
    """A run's asynchronous analysis.  ``inflight``: the steps handed over and not yet returned by
    ``wait`` (its length bounds the queue); ``resubmitted``: steps computed again after their worker died."""

    inflight: Collection[Any]
    resubmitted: int

    def submit(self, ck: Checkpoint) -> None:
        """Hand checkpoint ``ck`` over; returns at once."""

    def wait(self, block: bool) -> list[dict[str, Any]]:
        """Summaries of finished steps (at least one if ``block`` and any is in flight).

        Raises:
            AnalysisError, LeaseLost: as :func:`raise_failure`.
        """

    def close(self) -> None: ...


def analysis_error(run: str, step: int | None, exc: BaseException) -> AnalysisError:
    """The one error a Tracker raises for a failed analysis: run, step and the cause's first line
    (an NTK error names the module there); chain ``exc`` as its ``__cause__`` when raising."""
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    if isinstance(exc, NSAError) and lines:  # nsa-dist's own words already name the module and the cause
        cause = lines[0]
    else:
        cause = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return AnalysisError(f"run {run!r}: the analysis of recorded step {step} failed: {cause}", step)


def raise_failure(run: str, step: int | None, exc: BaseException) -> NoReturn:
    """Raises ``exc`` if it is LeaseLost (not the analysis's failure: another writer has the run),
    else the step's AnalysisError chained to ``exc``."""
    if isinstance(exc, LeaseLost):
        raise exc from None
    raise analysis_error(run, step, exc) from exc


class ThreadAnalysisPool:
    """An :class:`AnalysisPool` on one background thread (torch releases the GIL in its kernels).

    Args:
        service: analyses and writes each checkpoint (``TrackedRunService``: ``analyze_and_write``, ``spec``).
    """

    def __init__(self, service: Any) -> None:
        self.service = service
        self.exe = cf.ThreadPoolExecutor(1, thread_name_prefix="nsa-tracker")
        self.inflight: dict[cf.Future, int] = {}  # future -> its step
        self.resubmitted = 0  # a thread does not die on its own

    def submit(self, ck: Checkpoint) -> None:
        self.inflight[self.exe.submit(self.service.analyze_and_write, ck)] = ck.step

    def wait(self, block: bool) -> list[dict[str, Any]]:
        if not self.inflight:
            return []
        done, _ = cf.wait(list(self.inflight), timeout=None if block else 0, return_when=cf.FIRST_COMPLETED)
        failed = sorted((self.inflight[f], i, f) for i, f in enumerate(done) if f.exception() is not None)
        if failed:  # only the failed step leaves: the finished ones beside it are returned by the next call
            step, _, fut = failed[0]
            del self.inflight[fut]
            raise_failure(self.service.spec.name, step, fut.exception())
        out = []
        for fut in sorted(done, key=self.inflight.__getitem__):
            self.inflight.pop(fut)
            out.append(fut.result())
        return out

    def close(self) -> None:
        self.exe.shutdown(wait=True)
