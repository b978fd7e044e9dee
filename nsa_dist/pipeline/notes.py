"""The ``nsa_dist`` log's notes of an analysis that runs in another process, carried back with its result.

A sweep's and a Tracker's analyses run in Ray actors, whose output Ray does not forward
(``log_to_driver=False``: Ray's own worker chatter would bury the progress lines).  Their notes —
a quadrature bracket wider than 0.02 and what it is made of, a model that couples samples —
were lost there, while ``nsa run`` showed the same lines in-process.  An actor's service records
them during the call (:func:`recorded_notes`) and returns them in its summary; the driver logs
them again under the run's name (:func:`replay_notes`), where ``nsa sweep`` shows them as
``[nsa]`` lines.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator

__all__ = ["recorded_notes", "replay_notes"]

_LOG = "nsa_dist"


class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.notes: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.notes.append((record.levelno, record.getMessage()))
        except Exception:  # noqa: BLE001 - a note never costs the step
            self.handleError(record)


@contextlib.contextmanager
def recorded_notes(on: bool = True) -> Iterator[list[tuple[int, str]]]:
    """``(level, message)`` of the ``nsa_dist`` log's INFO records and above emitted inside the
    block (the list fills as they come); ``on=False``: an empty list, the log untouched (an
    in-process service, whose records reach the caller's handlers directly)."""
    if not on:
        yield []
        return
    log, rec = logging.getLogger(_LOG), _Recorder()
    level = log.level
    log.addHandler(rec)
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
    try:
        yield rec.notes
    finally:
        log.removeHandler(rec)
        log.setLevel(level)


def replay_notes(run: str, notes: Iterable[tuple[int, str]] | None, logger: logging.Logger) -> None:
    """Log an analysis's recorded ``notes`` again, each as "run RUN: message" at its level."""
    for level, message in notes or ():
        logger.log(int(level), "run %s: %s", run, message)
