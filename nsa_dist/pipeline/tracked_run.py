"""A tracked run as its writer sees it: the steps to record, the checkpoints out for analysis, the
loss trace, the end.

The Tracker makes the checkpoints (:mod:`~nsa_dist.pipeline.snapshot`); :class:`TrackedRun` opens
the run, says which steps are still to record, hands the checkpoints to the run's
:class:`~nsa_dist.pipeline.pool.AnalysisPool` — at most ``max_inflight`` out, so the user's loop
waits only when the analysis falls behind — notes each finished step in the
run's :class:`~nsa_dist.pipeline.session.RunSession`, writes the loop's losses, and ends the run
through the session: ``done`` (or ``pending`` with steps missing) at close, ``failed`` with the
first failed analysis or a non-finite loss, ``interrupted`` by an exception in the loop, and
nothing at all once the lease was lost.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable

import numpy as np
from torch import nn

from nsa_dist.config import ExperimentSpec
from nsa_dist.data import Dataset
from nsa_dist.errors import AnalysisError, NonFiniteError
from nsa_dist.pipeline.budget import check_fits
from nsa_dist.pipeline.checkpoint import Checkpoint
from nsa_dist.pipeline.pool import AnalysisPool
from nsa_dist.pipeline.session import RunSession
from nsa_dist.store import LeaseLost, SpectrumStore, Status

__all__ = ["TrackedRun"]


class TrackedRun:
    """One tracked run's steps to record, its analyses in flight and its end.

    Args:
        session: the run, opened (and started) under the Tracker's lease.
        pool: where its checkpoints are analysed.
        max_inflight: checkpoints out for analysis before :meth:`submit` waits.
        update: ``(ck, step)`` → checkpoint ``ck`` with its update, the model being at ``step`` now
            (:meth:`~nsa_dist.pipeline.snapshot.StepSnapshots.with_update`).
        moved: ``ck`` → whether the model's parameters are no longer θ_t of ``ck``
            (:meth:`~nsa_dist.pipeline.snapshot.StepSnapshots.moved`); default: always.

    Attributes:
        schedule, index: the recorded steps, and each one's recorded-step index.
        recorded: the steps this Tracker took (a step is recorded once).
        pending: the last checkpoint taken, held until the model's next step gives its update.
        trace: losses of the loop's updates not yet written (step -> loss).
        failure: the first failed analysis, raised again at every later call.
        closed: no more checkpoints are taken (closed, failed or the lease lost).
        finished: the summaries of the steps analysed, in the order they came back.
        blocked, max_seen_inflight: how often :meth:`submit` waited for a free slot; the most steps out at once.
    """

    def __init__(
        self,
        session: RunSession,
        pool: AnalysisPool,
        max_inflight: int,
        update: Callable[[Checkpoint, int], Checkpoint],
        moved: Callable[[Checkpoint], bool] | None = None,
    ) -> None:
        self.session, self.pool, self.max_inflight, self.update = session, pool, max_inflight, update
        self.moved = moved or (lambda ck: True)
        self.schedule = session.spec.record_steps()
        self.index = {t: i for i, t in enumerate(self.schedule)}  # step -> recorded-step index
        self.recorded: set[int] = set()  # steps taken by this Tracker
        self.seen = -1  # the latest step the loop has been at (advance): a recorded step comes no earlier
        self.pending: Checkpoint | None = None
        self.waited: int | None = None  # the pending step asked of at its step + 1 before the model moved
        self.said_log = False  # the warning that a log(t + 1) could not settle update t, once
        self.trace: dict[int, float] = {}
        self.failure: AnalysisError | None = None
        self.closed = False
        self.why_closed = ""  # why it closed by itself (a diverged run), for the errors of later calls
        self.finished: list[dict] = []
        self.blocked = 0
        self.max_seen_inflight = 0
        self.unsent: Checkpoint | None = None  # a checkpoint with its update, waiting for a free slot
        self.pid = os.getpid()  # a forked child (a DataLoader worker) has this object too: not its run
        _ended_with_the_process(self)

    @classmethod
    def open(
        cls,
        spec: ExperimentSpec,
        store: str | SpectrumStore,
        data: Dataset,
        model: nn.Module,
        pool: Callable[[RunSession], AnalysisPool],
        max_inflight: int,
        update: Callable[[Checkpoint, int], Checkpoint],
        moved: Callable[[Checkpoint], bool] | None = None,
    ) -> TrackedRun:
        """Open the run on the caller's data and network (its lease taken, the run created or
        reopened as ``nsa run`` does), start its analysis ``pool(session)``, status ``running``;
        the other arguments as the class's.

        Raises:
            ResourceError: the analysis would not fit this machine (:func:`~nsa_dist.pipeline.budget.check_fits`;
                its members all in one process), before the store is opened.
            LeaseHeld, StoreError: as :meth:`RunSession.open`.
            whatever ``pool`` raises (the status stays as it was, the lease is given back).
        """
        check_fits(spec, gang_in_process=True)
        store = store if isinstance(store, SpectrumStore) else SpectrumStore(store)
        session = RunSession.open(spec, store, data=data, model=model, hint="reopen to continue", gang_in_process=True)
        try:
            workers = pool(session)
        except BaseException as exc:
            session.end(exc)  # not started: the status stays, the lease is given back
            raise
        if not cls.finished_before(session):  # a finished run stays `done`: the Tracker leaves it (leave_finished)
            session.start()
        return cls(session, workers, max_inflight, update, moved)

    def due(self, step: int) -> bool:
        """Whether ``step`` is a recorded step neither in the store nor taken by this Tracker."""
        i = self.index.get(step)
        return i is not None and not self.session.done[i] and step not in self.recorded

    def recordable(self, step: int) -> int:
        """The recorded-step index of ``step``, which this Tracker may record now.

        Raises:
            ValueError: closed, ``step`` not in the schedule, or recorded before (by this Tracker or
                in the store).
        """
        if self.closed:
            raise ValueError("this Tracker is closed" + self.why_closed)
        if step not in self.index:
            raise ValueError(
                f"step {step} is not a recorded step of this run (schedule: {self.schedule[:8]}"
                f"{' …' if len(self.schedule) > 8 else ''}); test tr.due(step) first"
            )
        if step < self.seen:
            raise ValueError(
                f"step {step} comes before step {self.seen}, where the loop already was: a step is recorded at "
                f"θ_t before update t, in the loop's order (out of order, θ of another step would be stored as "
                f"step {step}'s)"
            )
        if step in self.recorded or self.session.done[self.index[step]]:
            when = "by this Tracker" if step in self.recorded else "in the store, before this Tracker was opened"
            raise ValueError(
                f"step {step} was already recorded ({when}); a step is recorded once, at θ_t before "
                "update t — test tr.due(step) first"
            )
        return self.index[step]

    @property
    def inflight(self) -> int:
        return len(self.pool.inflight)

    def check(self) -> None:
        """Raise a failed analysis at the call after it happened (not only at close), and take
        the summaries of steps finished meanwhile."""
        if self.failure is not None:
            raise AnalysisError(str(self.failure), self.failure.step) from self.failure.__cause__
        if not self.closed and self.inflight:
            self.collect(block=False)

    def advance(self, step: int, seen: bool = True, wait: bool = False, after: bool = False) -> None:
        """The loop is at ``step``: once past the pending checkpoint's step, submit it — with its
        update if the model is at its step + 1, else with NaN ones.  ``seen``: the loop has been at
        ``step`` (``record`` / ``log``; ``due`` may be asked of a step ahead).

        ``wait``: at step + 1 with the model not moved since θ_t (no parameter written in place, none
        changed), keep the checkpoint pending — the loop asks of step t + 1 (``due(t + 1)``, a loss
        logged as ``log(t + 1, …)``) before it makes update t: submitted then, Δθ_t and Δf_t were
        stored as exactly 0 (0.13–0.16 in truth, an audit), with status done.  The wait is settled by
        the next call at step t + 1 that finds the model moved — unless that call may come after the
        loop's update t + 1 as well (``after``: ``log(t + 1, …)``, which a loop may make after
        ``opt.step()``), where θ may already be θ_{t+2}: update t is then stored NaN with a note, never
        that difference (a loop that calls no ``due`` between its records and logs after the step, or
        a skipped step — GradScaler's, micro-batches counted as steps — that made a wait: log(t + 1)
        took θ_{t+2} − θ_t, 0.05–0.12 off; reviews' findings)."""
        if seen:
            self.seen = max(self.seen, step)
        ck = self.pending
        if ck is None or step == ck.step:
            return
        if step == ck.step + 1 and not self.moved(ck):
            if wait:
                self.waited = ck.index
                return
        elif step == ck.step + 1 and after:  # θ may be past update t + 1 already: update t is not known
            if not self.said_log:
                self.said_log = True
                _log.warning(
                    "run %r: the update of recorded step %d is stored as NaN (with the step's note): the first "
                    "call after record(%d) was log(%d), which may come after update %d as well — call "
                    "tr.due(step) at every step (as the README's loop does) to have each recorded update",
                    self.session.spec.name,
                    ck.step,
                    ck.step,
                    step,
                    step,
                )
            step = -1
        ck = self.update(ck, step)
        self.unsent, self.pending = ck, None  # one statement: a signal finds the step in one of the two
        self.submit(ck)

    def submit(self, ck: Checkpoint) -> None:
        """Hand ``ck`` to the pool once fewer than ``max_inflight`` steps are out (the losses noted
        so far are written first).  Until the pool has it, ``ck`` is :attr:`unsent`: a Ctrl-C or
        SIGTERM while this waits for a free slot lost the step (a review), :meth:`interrupt` sends it."""
        self.unsent = ck
        self.collect(block=False)
        while self.inflight >= self.max_inflight:
            self.blocked += 1
            self.collect(block=True)
        self.flush_trace()
        self.pool.submit(ck)
        self.unsent = None
        self.max_seen_inflight = max(self.max_seen_inflight, self.inflight)

    def collect(self, block: bool) -> None:
        """Note the steps the pool finished (wait for one if ``block``); a failure ends the run.

        Raises:
            AnalysisError: a step's analysis failed (the run is marked failed, see :meth:`abort`).
            LeaseLost: another writer took the run over (nothing more is written).
        """
        try:
            self._take(self.pool.wait(block))
        except LeaseLost:  # another writer has the run: not a word more from this one
            self.stop_lost()
            raise
        except AnalysisError as exc:
            self.abort(exc)
            raise
        except Exception as exc:  # our own bookkeeping failed: the steps out still finish and are kept
            self.pending = None
            self._settle()
            self.flush_trace()
            self.session.fail(exc)
            self._end()
            raise

    def _take(self, summaries: list[dict]) -> None:
        for s in summaries:
            self.session.mark_done(s["index"])
            self.finished.append(s)

    def drain(self) -> None:
        """Wait for every step out for analysis."""
        while self.inflight:
            self.collect(block=True)

    def abort(self, exc: AnalysisError) -> None:
        """After a failed analysis: let the other queued steps finish (what they store is kept), mark
        the run failed with the error's message and step, and close; later calls raise it again."""
        self.failure, self.pending = exc, None
        self._settle()
        self.flush_trace()
        self.session.fail(exc)  # its message and step
        self._end()

    def _settle(self) -> None:
        """Let every step out for analysis finish (what they store is kept), noting those that did; a
        later failure is not the one reported.  (Released unsettled, a step's write met a fence that was
        gone: Audit TW.)"""
        while self.inflight:
            try:
                self._take(self.pool.wait(True))
            except Exception:  # noqa: BLE001 - the first failure is the one reported
                pass

    @staticmethod
    def finished_before(session: RunSession) -> bool:
        """Whether the run was finished when opened: every step stored and status ``done`` (a run whose
        steps are all stored but whose writer was killed before ``close()`` is finished by this one)."""
        return session.complete() and session.writer.attr("status") == Status.DONE

    def leave_finished(self) -> None:
        """The run was finished when opened: close without a word written (its status stays ``done``,
        nothing is recorded) and give the lease back."""
        self.closed = True
        self.pool.close()
        self.session.ended = True
        self.session.release()
        _OPEN.discard(self)

    def stop_lost(self) -> None:
        """The lease was taken over: close without writing (no status, no released lease)."""
        self.closed = True
        self.pending = None
        self.session.release()

    def flush_trace(self) -> None:
        """Write the losses noted so far (those of steps 0 … T − 1)."""
        for t, v in sorted(self.trace.items()):
            if 0 <= t < self.session.spec.steps:
                self.session.writer.write_trace(t, np.asarray([v], np.float64))
        self.trace.clear()

    def diverged(self, step: int, why: str) -> NonFiniteError:
        """The loop's loss is not finite at ``step``: wait for every queued step (nothing recorded is
        lost), mark the run failed and close; the error to raise."""
        self.pending = None
        self.drain()
        self.flush_trace()
        self.session.fail(f"training diverged: {why}", step)
        self.why_closed = f" (it ended the run at step {step}: {why})"
        self._end()
        return NonFiniteError(
            f"run {self.session.spec.name!r}: {why}; the run is marked failed, the "
            f"{int(self.session.done.sum())} steps recorded before it are kept"
        )

    def close(self) -> None:
        """Submit the pending checkpoint (with its update if it is of the last step T − 1), wait for
        every analysis; status ``done`` when every recorded step is in the store, else ``pending``
        saying how many are missing.  Nothing once closed.

        Raises:
            AnalysisError: a recorded step's analysis failed (the run is marked failed).
        """
        if self.closed:
            return
        try:
            if self.pending is not None:
                T = self.session.spec.steps
                last = self.pending.step == T - 1
                # the loop ended before making update T − 1 (θ still θ_{T−1}): its update is not known (NaN,
                # with the step's note), not a Δθ of 0
                made = last and self.moved(self.pending)
                self.advance(T if made else -1)
            self.drain()
            self.flush_trace()
        except (KeyboardInterrupt, SystemExit) as exc:  # Ctrl-C or SIGTERM while the steps out finish
            self.interrupt(type(exc))  # they finish (a second SIGTERM kills), then status interrupted
            raise
        finally:
            self.closed = True
            self.pool.close()
        try:
            done = self.session.done
            missing = int((~done).sum())
            if missing:
                self.session.pause(
                    f"closed with {missing} of {len(done)} recorded steps "
                    "missing; reopen the Tracker with this name to continue",
                )
            else:
                self.session.finish()
        finally:
            self.session.release()

    def exit(self, exc_type: type[BaseException] | None) -> None:
        """The Tracker's ``with`` block ended: normally (:meth:`close`), by a lost lease
        (:meth:`stop_lost`) or by another exception (:meth:`interrupt`, unless closed)."""
        if exc_type is None:
            self.close()
        elif issubclass(exc_type, LeaseLost):
            self.stop_lost()
        elif not self.closed:
            self.interrupt(exc_type)

    def interrupt(self, cause: type[BaseException] | None, reason: str | None = None) -> None:
        """The loop raised ``cause`` (or the recording stops for ``reason``): analyse the last recorded
        step too (θ_t was taken whole at ``record(t)``; its update, never seen, is NaN), wait for the
        steps out, then status ``interrupted`` — unless a step's analysis failed meanwhile: the run is
        then ``failed`` with that step (:meth:`abort`) and the loop's own error is the one raised (a
        second status write after the lease was given back read as LeaseLost, hiding both)."""
        if reason is None and cause is not None and issubclass(cause, TerminatedWhileRecording):
            reason = "the process was sent SIGTERM; every recorded step analysed is kept — reopen to continue"
        try:
            if self.unsent is not None and self.failure is None:  # its wait for a slot was interrupted
                ck, self.unsent = self.unsent, None
                self.pool.submit(ck)
            if self.pending is not None:
                self.advance(-1)  # -1 is no step + 1: the update is NaN
            self.drain()
            self.flush_trace()  # the losses logged after the last record (up to every − 1 of them were lost)
        except AnalysisError:  # abort() marked the run failed and ended the session
            pass
        finally:
            self.closed = True
            try:
                self.pool.close()  # waits for the analyses out: a third Ctrl-C here left the status running
            finally:
                if not self.session.ended:
                    if self.failure is not None:  # abort() was cut short before it said so: the run failed
                        self.session.fail(self.failure)
                    else:
                        self.session.interrupt(reason, cause=cause)
                    self.session.release()

    def _end(self) -> None:
        self.closed = True
        self.pool.close()
        self.session.release()


# ---------------------------------------------------------------------- a process that ends unclosed
_OPEN: weakref.WeakSet[TrackedRun] = weakref.WeakSet()  # the runs of this process not yet closed
_HOOKED = threading.Lock()
_REGISTERED = False
_log = logging.getLogger("nsa_dist")


def _ended_with_the_process(run: TrackedRun) -> None:
    """Have ``run`` interrupted if the process exits with it still open (an uncaught exception outside
    a ``with`` block, a script that never calls ``close()``).  The hook runs as threading shuts down,
    before the thread pools and Zarr's own stop (an ``atexit`` hook runs after them: the analyses of
    the steps out then failed with "cannot schedule new futures after shutdown", and the run lost
    every recorded step still in flight)."""
    global _REGISTERED
    with _HOOKED:
        if not _REGISTERED:
            register = getattr(threading, "_register_atexit", None)  # what concurrent.futures uses
            (register or atexit.register)(_interrupt_open_runs)
            os.register_at_fork(after_in_child=_forget_in_child)
            _REGISTERED = True
        _OPEN.add(run)
        _SIGTERM_SEEN.clear()  # a SIGTERM before this run (caught by the program) is not why it ends
        _exit_on_sigterm()


def _ours(run: TrackedRun) -> bool:
    """Whether ``run`` is this process's open run (not a forked child's copy of its parent's)."""
    return not run.closed and run.pid == os.getpid()


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker, multiprocessing's fork) leaves its parent's runs alone: at
    its exit the interpreter's hook interrupted them (status ``interrupted``, the writer's folder gone,
    the parent's next write LeaseLost — every step of a ``with Tracker`` loop lost at the first epoch's
    end), and a SIGTERM to it (``DataLoader`` stopping its workers) did the same."""
    global _SIGTERM_INSTALLED
    _OPEN.clear()
    _SIGTERM_INSTALLED = False  # a run the child opens itself gets the handler again
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # forked from a thread other than the main one: not the child's main thread
        pass


class TerminatedWhileRecording(SystemExit):
    """SIGTERM while a Tracker's run was open: raised in the main thread, so the ``with`` block, a
    Lightning ``on_exception`` or the interpreter's exit interrupts the run with its steps in flight
    finished (the default action killed the process on the spot: under ``torchrun`` — which sends it
    to every rank when one dies — rank 0's steps out for analysis were lost and the status stayed
    ``running``).  Exit status 143, as a process ended by the signal reports it to a shell."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def _exit_on_sigterm() -> None:
    """Install the SIGTERM handler from the main thread where the process has the default action (a
    handler of the program's own, Ray's, Lightning's, is left alone) — once per process: after it has
    fired, SIGTERM keeps its default action (a program that catches the SystemExit — pytest, IPython —
    is not kept alive by a handler installed again at its next run)."""
    global _SIGTERM_INSTALLED
    if _SIGTERM_INSTALLED or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
        _SIGTERM_INSTALLED = True
        _end_the_shell_after_sigterm()


_SHELLS: weakref.WeakSet = weakref.WeakSet()  # the IPython shells told to end after a SIGTERM


def _end_the_shell_after_sigterm() -> None:
    """In an IPython shell (a Jupyter kernel, ``ipython``): after the cell a SIGTERM landed in, end
    the process as SIGTERM asks.  IPython catches a cell's SystemExit and goes on, so the kernel
    outlived every SIGTERM (a scheduler's stop, papermill's), with a run opened outside a ``with``
    block left open, and the next SIGTERM — the handler was spent — killed it with steps in flight
    (an audit).  After that cell, the runs still open finish their recorded steps and end
    ``interrupted``, then SIGTERM's default action ends the kernel.  IPython is never imported here."""
    get = getattr(sys.modules.get("IPython"), "get_ipython", None)
    shell = get() if callable(get) else None
    events = getattr(shell, "events", None)
    if events is None or shell in _SHELLS:
        return
    try:
        events.register("post_execute", _after_a_cell)
        _SHELLS.add(shell)
    except Exception as exc:  # noqa: BLE001 — an IPython without the event: the SystemExit alone, as before
        _log.debug("no post_execute event in this IPython (%s)", exc)


def _after_a_cell() -> None:
    if not _SIGTERM_SEEN or threading.current_thread() is not threading.main_thread():
        return  # (a subshell's cell, off the main thread: the next main-thread cell ends it — signal.signal needs it)
    _log.warning("the process was sent SIGTERM: its Tracker runs are ended (their recorded steps kept); ending it")
    _interrupt_open_runs()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


_SIGTERM_INSTALLED = False
_SIGTERM_SEEN: list[int] = []


def _on_sigterm(signum: int, frame: object) -> None:
    """With a run of this process open: unwind the main thread (:class:`TerminatedWhileRecording`); a
    second SIGTERM (or one with no run open) takes the default action, at once."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if any(_ours(r) for r in list(_OPEN)):
        _SIGTERM_SEEN.append(signum)
        raise TerminatedWhileRecording()
    os.kill(os.getpid(), signal.SIGTERM)


def _interrupt_open_runs() -> None:
    """Every run still open: its recorded steps finished, then status ``interrupted`` saying why."""
    error = getattr(sys, "last_value", None)  # set when the main thread ended on an uncaught exception
    for run in list(_OPEN):
        if not _ours(run):  # closed, or a forked child's copy of its parent's run
            continue
        name = run.session.spec.name
        why = (
            "the process was sent SIGTERM"
            if _SIGTERM_SEEN
            else f"the process ended on an uncaught {type(error).__name__} ({error})"
            if error is not None
            else "the process exited"
        )
        _log.warning("run %r: %s before Tracker.close(): finishing the recorded steps, then interrupted", name, why)
        try:
            run.interrupt(
                type(error) if error is not None else None,
                f"{why} before Tracker.close(); every recorded step analysed is kept — reopen to continue",
            )
        except Exception as exc:  # noqa: BLE001 - the process is ending: say it, do not mask the user's error
            _log.warning("run %r: could not be ended at exit (%s: %s)", name, type(exc).__name__, exc)
