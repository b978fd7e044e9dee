"""The ``nsa`` command: run experiments and query the spectrum store.

    nsa run SPEC.yaml [--store PATH]     train + record spectra (resumes a run already stored)
    nsa ls [--store PATH] [--sweep NAME] the runs in a store (a sweep's: its grid fields as columns)
    nsa show RUN [--store PATH]          one run's status and headline measurements
    nsa show --sweep NAME                a sweep's grid, and each run's loss and E(y, k) at its last step
    nsa plot RUN --out DIR               the NSA paper's figures as PNGs (--step, --pair, --k)
    nsa plot --sweep NAME --out DIR      Fig. 7a–c across a sweep's runs (--scalar Q --x FIELD [--line FIELD])
    nsa sweep SWEEP.yaml [--address A]   a sweep on an embedded local Ray (or a cluster); --max-runs N
    nsa submit SWEEP.yaml --address http://HEAD:8265 --store URL     as a Ray Job
    nsa status [JOB] / nsa logs JOB / nsa cancel JOB                   (--address, $RAY_ADDRESS)
    nsa status --store PATH              the runs' status (running only while a writer is alive)
    nsa verify [STORE] [--mark]          list damaged steps; --mark: forget them so a re-run recomputes them
    nsa serve [STORE] [--port P]         a read-only web view of the store at http://127.0.0.1:P/, live
    nsa export RUN --tensorboard DIR     a run's scalars and spectra as TensorBoard event files
    nsa export --sweep NAME --tensorboard DIR    every run of a sweep, one folder each
The store defaults to $NSA_STORE or ./nsa-results.zarr (a path or an fsspec URL).
Every failure is one line on stderr (`_one_line`); --debug or NSA_DEBUG=1 adds the traceback.
`nsa run` and `nsa sweep` show the ``nsa_dist`` log's INFO records on stderr as "[nsa] …" lines.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from nsa_dist.client import Client
    from nsa_dist.store import SpectrumStore
    from nsa_dist.store.verify import Damage

__all__ = ["main"]

DEFAULT_STORE = "nsa-results.zarr"


def _store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        type=_store_path,
        default=os.environ.get("NSA_STORE") or DEFAULT_STORE,
        help=_STORE_HELP,
    )


def _store_positional(p: argparse.ArgumentParser) -> None:
    """The store as the command's optional first argument (``nsa verify [STORE]``, ``nsa serve [STORE]``)."""
    p.add_argument(
        "store", nargs="?", type=_store_path, default=os.environ.get("NSA_STORE") or DEFAULT_STORE, help=_STORE_HELP
    )
    # the other commands' --store too (`nsa verify --store X` was "unrecognized arguments: --store")
    p.add_argument("--store", dest="store_option", type=_store_path, default=None, help="the same as STORE")


_STORE_HELP = "spectrum store path or URL (default: $NSA_STORE or ./nsa-results.zarr)"
_RUN_HELP = "the run's id or name (`nsa ls` lists them)"


def _count(least: int, most: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [least, most], else a usage error naming the range."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < least or (most is not None and v > most):
            allowed = f"{least}..{most}" if most is not None else f">= {least}"
            raise argparse.ArgumentTypeError(f"{v} is out of range (allowed: {allowed})")
        return v

    return parse


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not np.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{text} seconds: give a finite number >= 0 (or no number: wait for ever)")
    return v


def _store_path(text: str) -> str:
    """An argparse type: a store path or URL, never empty ('' was the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the store path is empty; give a path or URL (or unset an empty $NSA_STORE)")
    return text


def _wait_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wait",
        type=_seconds,
        nargs="?",
        const=-1.0,
        default=0.0,
        metavar="SECONDS",
        help="if another live process writes the run, wait for it (for ever, or SECONDS) instead of refusing",
    )


def _wait_seconds(value: float) -> float | None:
    return None if value < 0 else value


def _with_parents(common: argparse.ArgumentParser) -> type[argparse.ArgumentParser]:
    """An ArgumentParser class whose instances all inherit ``common``'s arguments."""

    class Parser(argparse.ArgumentParser):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, parents=[common], **kw)

    return Parser


def _max_runs_arg(p: argparse.ArgumentParser) -> None:
    from nsa_dist.config import MAX_SWEEP_RUNS

    p.add_argument(
        "--max-runs",
        type=_count(1),
        default=None,
        metavar="N",
        help=f"accept a sweep of up to N runs (default {MAX_SWEEP_RUNS}; counted before expanding the grid)",
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nsa", description="Measure NTK spectra during training (nsa-dist).")
    p.add_argument("--debug", action="store_true", help="show the traceback of a failure (also NSA_DEBUG=1)")
    common = argparse.ArgumentParser(add_help=False)  # the same flag after the command (`nsa run X --debug`)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_with_parents(common))

    def command(name: str, hlp: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=hlp, description=hlp)  # `nsa run --help` says what it does, too

    r = command("run", "train one experiment and record its spectra")
    r.add_argument("spec", type=Path, help="the experiment's spec file (YAML; examples/ has some)")
    _store_arg(r)
    r.add_argument("--plain", action="store_true", help="log lines instead of a progress bar")
    _wait_arg(r)
    ls = command("ls", "list the runs in a store")
    _store_arg(ls)
    ls.add_argument("--sweep", default=None, metavar="NAME", help="only this sweep's runs, its grid fields as columns")
    s = command("show", "one run's status and measurements, or a sweep's runs")
    s.add_argument("run", nargs="?", default=None, help=_RUN_HELP + " (none with --sweep)")
    _store_arg(s)
    s.add_argument("--sweep", default=None, metavar="NAME", help="the sweep's grid and each run's last measurements")
    pl = command("plot", "write the paper's figures for a run, or across a sweep's runs")
    pl.add_argument("run", nargs="?", default=None, help=_RUN_HELP + " (none with --sweep)")
    pl.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder to write the figures (PNG) into")
    pl.add_argument("--figures", nargs="+", default=None, help="only these figure names")
    pl.add_argument(
        "--step",
        type=int,
        nargs="+",
        default=None,
        help="recorded steps of the at-a-step figures: 1a-c and 4d (the last chosen), 4a, 4b-c, "
        "6 (the first chosen) and energy_against_k (the paper: 20000 599999)",
    )
    pl.add_argument(
        "--pair",
        type=int,
        nargs=2,
        default=None,
        metavar=("T1", "T2"),
        help="Fig. 7d: E_T1(v_i^T2, k) (the paper: 20000 599999)",
    )
    pl.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=None,
        help="the k (rows i) drawn in Figs. 2b, 2d, 3, 7d; with --sweep: Fig. 7a's k (default 4%% of "
        "the smallest N, as the paper's 400 of 10^4, below N)",
    )
    pl.add_argument("--sweep", default=None, help="draw Fig. 7a-c across the runs of this sweep")
    pl.add_argument("--scalar", default=None, help="with --sweep: also this quantity at the last step vs --x")
    pl.add_argument("--x", default=None, help="with --scalar: the grid field on the x axis (e.g. model.depth)")
    pl.add_argument("--line", default=None, help="with --scalar: one line per value of this grid field")
    _store_arg(pl)
    sw = command("sweep", "run a sweep (grid of experiments) on Ray")
    sw.add_argument("sweep", type=Path, help="the sweep's spec file (YAML: a base experiment and a grid)")
    _store_arg(sw)
    sw.add_argument("--address", default=None, help="Ray address to join (default: start an embedded local Ray)")
    sw.add_argument("--plain", action="store_true", help="log lines instead of a live table")
    _wait_arg(sw)
    _max_runs_arg(sw)
    sm = command("submit", "submit a sweep to a Ray cluster as a Ray Job")
    sm.add_argument("sweep", type=Path, help="the sweep's spec file (YAML: a base experiment and a grid)")
    sm.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS"),
        required=not os.environ.get("RAY_ADDRESS"),
        help="Ray dashboard address, e.g. http://HEAD:8265 (or $RAY_ADDRESS)",
    )
    _store_arg(sm)
    sm.add_argument("--job-id", default=None, help="the Ray Job's id (default: Ray makes one, printed)")
    sm.add_argument(
        "--pip",
        action="append",
        default=None,
        metavar="REQ",
        help="a pip requirement the job needs on the cluster (its runtime_env's pip; repeatable)",
    )
    sm.add_argument("--wait", action="store_true", help="wait for the job and print its logs")
    sm.add_argument(
        "--wait-for-writers",
        type=_seconds,
        nargs="?",
        const=-1.0,
        default=0.0,
        metavar="SECONDS",
        help="the job's sweep waits (for ever, or SECONDS) for another live process writing one of its runs "
        "instead of refusing it (nsa sweep --wait)",
    )
    _max_runs_arg(sm)
    for name, hlp in (
        ("status", "job status (all jobs without JOB), or the runs of --store"),
        ("logs", "a job's logs"),
        ("cancel", "stop a job"),
    ):
        q = command(name, hlp)
        q.add_argument(
            "job",
            nargs="?" if name == "status" else None,
            help="the Ray Job's id (as `nsa submit` printed it)"
            + (" (default: every job)" if name == "status" else ""),
        )
        q.add_argument(
            "--address",
            default=os.environ.get("RAY_ADDRESS", "http://127.0.0.1:8265"),
            help="Ray dashboard address, e.g. http://HEAD:8265 (default: $RAY_ADDRESS or http://127.0.0.1:8265)",
        )
        if name == "status":
            q.add_argument(
                "--store", type=_store_path, default=None, help="show the runs of this store instead of Ray jobs"
            )
    v = command("verify", "check every chunk of a store; --mark forgets damaged steps for a re-run")
    _store_positional(v)
    v.add_argument(
        "--mark",
        "--repair",
        action="store_true",
        dest="mark",
        help="delete the damaged chunks and mark their steps not done (a re-run recomputes them)",
    )
    se = command("serve", "a read-only web view of a store (runs, a run's figures, a sweep's), live")
    _store_positional(se)
    se.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    se.add_argument("--port", type=_count(0, 65535), default=5006, help="port (0: any free one; default 5006)")
    se.add_argument("--allow-remote", action="store_true", help="consent to listen on a non-loopback --host")
    se.add_argument(
        "--token",
        default=os.environ.get("NSA_SERVE_TOKEN"),
        help="secret every request must carry (needed with --allow-remote; or $NSA_SERVE_TOKEN)",
    )
    se.add_argument("--refresh", type=float, default=2.0, metavar="SECONDS", help="re-read the store this often")
    ex = command("export", "export a run's (or a sweep's runs') per-step scalars and spectra (TensorBoard event files)")
    ex.add_argument("run", nargs="?", default=None, help=_RUN_HELP + " (none with --sweep)")
    ex.add_argument("--tensorboard", type=Path, required=True, metavar="DIR", help="log directory to write")
    _store_arg(ex)
    ex.add_argument("--sweep", default=None, metavar="NAME", help="every run of this sweep, each in DIR/<run id>")
    p.set_defaults(_commands=sub.choices)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one ``nsa`` command; every failure ends as one line on stderr (``--debug``: and its traceback).

    Returns:
        0 on success, 1 when a run failed or an unexpected error occurred, 2 on a refused input
        or an outside failure, 130 on Ctrl-C and 143 on SIGTERM, 75 when this machine's Ray
        raylet stopped under a sweep (all three leave resumable runs).
    """
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # after the command: said by its own parser (its usage); before it: by the top level's
        words = list(sys.argv[1:] if argv is None else argv)
        before = words.index(extra[0]) < words.index(args.cmd) if extra[0] in words and args.cmd in words else False
        (parser if before else args._commands[args.cmd]).error(f"unrecognized arguments: {' '.join(extra)}")
    del args._commands
    if getattr(args, "store_option", None) is not None:  # `nsa verify --store X`, `nsa serve --store X`
        default = _store_path(os.environ.get("NSA_STORE") or DEFAULT_STORE)
        if args.store not in (default, args.store_option):
            parser.error(f"nsa {args.cmd}: two stores given ({args.store!r} and --store {args.store_option!r})")
        args.store = args.store_option
    args.argv = argv
    saved_debug = os.environ.get("NSA_DEBUG")
    debug = args.debug or bool(saved_debug)
    if debug:
        os.environ["NSA_DEBUG"] = "1"  # also for a submitted job's environment
    handler = _catch_sigterm()
    _SIGTERM_SEEN.clear()
    unlog = _log_to_stderr() if args.cmd in ("run", "sweep") else None
    try:
        with _signals_deferred():  # the heavy imports every command makes, where a signal cannot land safely
            import torch  # noqa: F401

            import nsa_dist.client  # noqa: F401
        return {
            "run": _cmd_run,
            "ls": _cmd_ls,
            "show": _cmd_show,
            "plot": _cmd_plot,
            "sweep": _cmd_sweep,
            "submit": _cmd_submit,
            "status": _cmd_status,
            "logs": _cmd_logs,
            "cancel": _cmd_cancel,
            "verify": _cmd_verify,
            "serve": _cmd_serve,
            "export": _cmd_export,
        }[args.cmd](args)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - every failure is reported here, once
        line, rc = _one_line(exc, args)
        if debug:
            import traceback

            traceback.print_exc()
        elif argv is None:  # the process's own command: a failed store leaves coroutines and tasks that
            _quiet_at_exit()  # complain when collected at exit — not news after this line
        print(f"nsa {args.cmd}: {line}", file=sys.stderr, flush=True)
        return rc
    finally:
        if unlog is not None:
            unlog()
        if handler is not _NOT_INSTALLED:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if handler is None else handler)
        if saved_debug is None:
            os.environ.pop("NSA_DEBUG", None)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Ctrl-C and SIGTERM held back while torch is imported, then delivered: a KeyboardInterrupt
    raised inside its import left torch half-initialised, and the handler's own imports then crashed
    (37–55 lines, once a segmentation fault) — an audit's Ctrl-C in an `nsa` command's first 3 s.
    The signal is noted by a handler that only notes it (blocking it with a signal mask did not
    hold: torch's import unblocks it), and sent again after the block, where it is the one line of
    every failure."""
    held: list[int] = []
    kinds = (signal.SIGINT, signal.SIGTERM)
    try:
        before = {k: signal.signal(k, lambda sig, _frame: held.append(sig)) for k in kinds}
    except ValueError:  # not the main thread: signals go to it anyway
        yield
        return
    try:
        yield
    finally:
        for k, h in before.items():
            signal.signal(k, h)
        if held:
            os.kill(os.getpid(), held[0])  # to the handler in place again (Python runs it before the next line)


class _LogLine(logging.Handler):
    """Writes a record as "[nsa] message" to the current ``sys.stderr`` (a progress bar's redirect
    included); a record's traceback is left out (one line a record)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"[nsa] {_flat(record.getMessage())}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - a log line never ends the command
            self.handleError(record)


def _log_to_stderr() -> Callable[[], None]:
    """Show the ``nsa_dist`` logger's INFO records and above on stderr as "[nsa] …" lines while a
    command runs (the pipeline's notes: a wide quadrature bracket, a model that couples samples);
    nothing is added where a handler already prints to the console (no line twice).  Returns the
    call that puts the logger back."""
    log = logging.getLogger("nsa_dist")
    consoles = (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
    node: logging.Logger | None = log
    while node is not None:  # the handlers a record reaches: this logger's, then its parents'
        if any(getattr(h, "stream", None) in consoles for h in node.handlers):
            return lambda: None
        node = node.parent if node.propagate else None
    line, level = _LogLine(logging.INFO), log.level
    log.addHandler(line)
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)

    def restore() -> None:
        log.removeHandler(line)
        log.setLevel(level)

    return restore


def _quiet_at_exit() -> None:
    """Silence what the interpreter reports while collecting a failed store's leftovers at exit:
    "Exception ignored in <coroutine …>" (sys.unraisablehook), asyncio's "Task was destroyed
    but it is pending!" (the "asyncio" logger) and "coroutine … was never awaited" (a Ctrl-C or
    SIGTERM that lands inside a store call, between making its coroutine and running it)."""
    import logging
    import warnings

    sys.unraisablehook = lambda unraisable: None
    logging.getLogger("asyncio").disabled = True
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt: the same clean-up runs
    (a run is marked interrupted, Ray is shut down) and the command exits with 143."""


_SIGTERM_SEEN: list[int] = []  # Ray re-raises a KeyboardInterrupt subclass as a plain one: remember the signal


def _raise_terminated(signum: int, frame: object) -> None:
    _SIGTERM_SEEN.append(signum)
    raise Terminated()


_NOT_INSTALLED = object()


def _catch_sigterm() -> object:
    """Install the SIGTERM → :class:`Terminated` handler; the previous handler (``_NOT_INSTALLED``
    outside the main thread, where Python cannot install one)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return _NOT_INSTALLED
    return signal.signal(signal.SIGTERM, _raise_terminated)


def _one_line(exc: BaseException, args: argparse.Namespace) -> tuple[str, int]:
    """The one place that turns a failure into a line and an exit status.

    Outside failures first (a store's endpoint, keys, bucket or disk, named with the store URL
    and the endpoint), then nsa-dist's own refusals and the builtin errors of bad input, then
    anything else as an unexpected error pointing to ``--debug``.
    """
    from nsa_dist.errors import NSAError, StoreError
    from nsa_dist.specfile import SpecError
    from nsa_dist.store import describe_fault

    sigterm = isinstance(exc, Terminated) or (isinstance(exc, KeyboardInterrupt) and _SIGTERM_SEEN)
    if isinstance(exc, KeyboardInterrupt) and args.cmd == "serve":  # a reader: nothing to resume
        return ("stopped (SIGTERM)", 143) if sigterm else ("stopped (Ctrl-C)", 130)
    if sigterm:
        return "terminated (SIGTERM); re-run the same command to resume", 143
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (Ctrl-C); re-run the same command to resume", 130
    lost = getattr(sys.modules.get("nsa_dist.cluster.runtime"), "RayletLost", None)  # never imports Ray
    if lost is not None and isinstance(exc, lost):  # the runs are interrupted, not failed (EX_TEMPFAIL)
        again = " ".join(["nsa", *map(shlex.quote, getattr(args, "argv", None) or sys.argv[1:])])
        return f"interrupted: {_flat(str(exc))}; re-run `{again}` to resume", 75
    store = getattr(args, "store", None)
    fault = describe_fault(exc, store) if isinstance(store, str) else None
    if fault:
        return f"error: {fault}", 2
    if isinstance(exc, SpecError):
        return f"error: {exc}", 2  # one line per problem in the file
    local = _local_store(store)
    if local is not None and isinstance(exc, StoreError) and str(exc).startswith("no spectrum store at"):
        if local.is_file() or (local.is_dir() and any(local.iterdir())):  # `nsa run --store` refuses it too
            kind = "a file" if local.is_file() else "a directory with other files"
            how = (
                f"`nsa {args.cmd} STORE`"
                if args.cmd in ("verify", "serve")  # these take the store as their argument
                else "--store PATH"
            )
            return (
                f"error: {store!r} is {kind}, not a spectrum store (it has no zarr.json); give the store's "
                f"path with {how} (or $NSA_STORE), or a new path to `nsa run SPEC.yaml --store`"
            ), 2
    if local is not None and isinstance(exc, OSError) and exc.filename and _within(Path(exc.filename), local):
        return f"error: {_store_os_error(store, exc)}", 2
    if isinstance(exc, (NSAError, OSError, KeyError, ValueError)):
        return f"error: {_flat(str(exc))}", 2
    return (
        f"error: {type(exc).__name__}: {_flat(str(exc))} (unexpected; --debug or NSA_DEBUG=1 shows the traceback)"
    ), 1


def _local_store(store: object) -> Path | None:
    """The folder of a local store (a path or ``file://``); None for an object store or no store."""
    if not isinstance(store, str) or ("://" in store and not store.startswith("file://")):
        return None
    return Path(store.removeprefix("file://"))


def _within(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or inside it."""
    path, folder = Path(os.path.abspath(path)), Path(os.path.abspath(folder))
    return path == folder or folder in path.parents


def _store_os_error(store: str, exc: OSError) -> str:
    """A system error under a local store's folder, naming the store, the file and the cause."""
    what = exc.strerror or type(exc).__name__
    where = f"store {store!r}: {what} for {exc.filename!r}"
    parent = Path(os.path.abspath(exc.filename)).parent
    if isinstance(exc, FileNotFoundError) and parent.is_dir():  # the folder is there: it takes no new entries
        return (
            f"{where}, though {str(parent)!r} exists: that file system takes no new folders; give --store "
            "a path in a writable folder"
        )
    if isinstance(exc, PermissionError) or getattr(exc, "errno", None) == 30:  # EROFS
        return f"{where}; give --store a path this user can write (or fix the folder's permissions)"
    return f"{where}; check the path and the disk, or give --store another path"


def _flat(text: str, limit: int = 2000) -> str:
    """A message on one line, at most ``limit`` characters."""
    line = "; ".join(part.strip() for part in text.splitlines() if part.strip())
    return line if len(line) <= limit else line[: limit - 1] + "…"


# ---------------------------------------------------------------------------- run
def _cmd_run(args: argparse.Namespace) -> int:
    from nsa_dist.pipeline import run_experiment
    from nsa_dist.specfile import check_data, load_spec
    from nsa_dist.store import Status

    spec = load_spec(args.spec)
    _check_device([spec], args.spec)
    _check_factories([spec])
    check_data([spec], args.spec)  # a missing data file is said now, not after the store and the model
    rid = _stored_id(spec, args.store)
    fancy = sys.stderr.isatty() and not args.plain
    progress = _RichProgress(spec.steps, rid) if fancy else _LogProgress(spec.steps, rid)
    with progress:
        out = run_experiment(  # its memory check comes before the store (a URL here) is opened
            spec,
            args.store,
            on_step=progress.on_step,
            on_update=progress.on_update,
            on_prepared=progress.prepared,
            wait=_wait_seconds(args.wait),
            key=rid,  # the run id is computed once per command
        )
    if out.status == Status.FAILED:
        print(f"run {out.run_id} FAILED: {out.reason} (earlier steps are kept in {args.store})", file=sys.stderr)
        return 1
    print(f"run {out.run_id} done ({out.steps_computed} recorded steps computed) → {args.store}")
    return 0


def _stored_id(spec: Any, store: str) -> str:
    """The id the spec's run has in ``store`` (an earlier nsa-dist's run of it is resumed under its own
    id: :func:`~nsa_dist.pipeline.session.stored_run_id`), without creating the store."""
    from nsa_dist.pipeline import run_id
    from nsa_dist.pipeline.session import stored_run_id
    from nsa_dist.store import SpectrumStore

    try:
        return stored_run_id(SpectrumStore(store, mode="r"), spec)
    except Exception:  # noqa: BLE001 - no store yet (or unreadable: the run says why): the spec's own id
        return run_id(spec)


def _check_device(specs: list, source: Path) -> None:
    """Refuse ``device: cuda`` where torch sees no GPU, before any store is touched (it failed at the
    first step as torch's "AssertionError: Torch not compiled with CUDA enabled", exit 1)."""
    from nsa_dist.specfile import SpecError

    cuda = [s.name for s in specs if s.device == "cuda"]
    if cuda:
        import torch

        if not torch.cuda.is_available():
            raise SpecError(
                f"{source}: device: cuda (run{'s' if len(cuda) > 1 else ''} {', '.join(map(repr, cuda[:3]))}"
                f"{' …' if len(cuda) > 3 else ''}) but torch sees no CUDA GPU on this machine "
                f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'not compiled in'}); use device: auto "
                "(CUDA when there is one) or cpu"
            )


def _check_factories(specs: list) -> None:
    """Import every ``model.factory`` before any store is touched (a missing module left a new, empty
    store behind its one-line error)."""
    from nsa_dist.models import resolve_factory

    for path in dict.fromkeys(s.model.factory for s in specs if getattr(s.model, "source", None) == "factory"):
        resolve_factory(path)


def _print_prepared(run) -> None:
    """The run's layout, and where a run the store already holds goes on from (a re-run said only
    "N steps", and resumed silently)."""
    lay = run.plan.layout
    workers = f" on {run.plan.spec.spectrum.workers} workers" if run.plan.distributed else ""
    print(f"[nsa] spectrum layout: {lay.layout.value}{workers} ({lay.reason})", file=sys.stderr, flush=True)
    done = run.writer.done()
    if not done.any():
        return
    stored = f"{int(done.sum())} of {len(done)} recorded steps already stored"
    if done.all():
        print(f"[nsa] run {run.run_id}: {stored}: nothing to compute", file=sys.stderr, flush=True)
        return
    i = run.writer.resume_index()
    start = "step 0 (no stored state to start from)" if i is None else f"step {int(run.plan.record[i])}"
    print(f"[nsa] run {run.run_id}: {stored}; training resumes from {start}", file=sys.stderr, flush=True)


class _LogProgress:
    """Plain log lines: one per recorded step.  The run's line comes once it is prepared (its data
    loaded, its layout chosen): a refusal before that is the only line, not one after "N steps"."""

    def __init__(self, total: int, rid: str) -> None:
        self.total, self.rid, self.t0 = total, rid, time.perf_counter()

    def __enter__(self) -> _LogProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def prepared(self, run) -> None:
        self.start()
        _print_prepared(run)

    def start(self) -> None:
        print(f"[nsa] run {self.rid}: {self.total} steps", flush=True)

    def on_update(self, step: int, loss: float) -> None:
        pass

    def on_step(self, ck, result) -> None:
        print(
            f"[nsa] step {ck.step:>8}/{self.total}  loss {ck.loss:.5g}  λ_max {result.lambda_max:.5g}  "
            f"E(y,{result.summary_k}) {result.energy_y_at(10):.3f}  ({time.perf_counter() - self.t0:.1f} s)",
            flush=True,
        )


class _RichProgress(_LogProgress):
    """A rich progress bar over training steps showing loss and λ_max."""

    bar = None

    def start(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  λ_max {task.fields[lam]}"),
            TimeRemainingColumn(),
        )
        self.bar.__enter__()
        self.task = self.bar.add_task(self.rid, total=self.total, loss="-", lam="-")

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def on_update(self, step: int, loss: float) -> None:
        self.bar.update(self.task, completed=step, loss=f"{loss:.4g}")

    def on_step(self, ck, result) -> None:
        self.bar.update(self.task, lam=f"{result.lambda_max:.4g}")


# ---------------------------------------------------------------------------- queries
def _cmd_ls(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from nsa_dist.client import Client

    client = Client(args.store)
    if args.sweep is not None:  # the sweep's runs, told apart by the fields its grid varies
        sweep = client.sweep(args.sweep)  # KeyError naming the known sweeps
        runs, fields = sweep.runs, [*sweep.fields, *(["seed"] if sweep.seeded else [])]
        title = f"sweep {_esc(args.sweep)} in {_esc(args.store)}"
    else:
        runs, fields = client.runs(), []
        title = f"runs in {_esc(args.store)}"
    in_sweeps = args.sweep is None and bool(len(runs)) and runs["sweep"].notna().any()
    t = Table(title=title)
    # the id whole, whatever the width (piped output is 80 columns): it is what the other commands take
    idw = max([2] + [len(str(i)) for i in runs["id"]]) if len(runs) else 2
    t.add_column("id", no_wrap=True, min_width=idw)
    t.add_column("status")
    t.add_column("recorded")
    t.add_column("last step")
    shown = fields or ["data", "N", "L×W", "optimizer", "lr"]
    for col in [*(["sweep"] if in_sweeps else []), *shown, "note"]:
        t.add_column(_esc(col))
    for r in runs.to_dict("records"):
        note = _text(r.get("reason")) if r["status"] in ("interrupted", "failed", "damaged") else ""
        if fields:
            what = [_cell(r.get(f)) for f in fields]
        else:
            lr = _recorded_lr(client, r) if r.get("data.name") == "arrays" else _lr(_first_lr(r))
            what = [
                _text(r.get("data.name")),
                _int(r.get("data.n")),
                _net(r),
                _text(r.get("optimizer.name")),
                lr,
            ]
        progress = [r["id"], r["status"], f"{_int(r['steps_done'])}/{_int(r['steps_total'])}", _int(r["last_step"])]
        t.add_row(*map(_esc, (*progress, *([_text(r.get("sweep"))] if in_sweeps else []), *what, note)))
    con = Console()
    if not con.is_terminal:  # piped: as wide as the columns need, not the 80 of no terminal
        con = Console(width=max(con.width, idw + 100))
    con.print(t if len(runs) else f"no runs in {_esc(args.store)}" + (f"'s sweep {args.sweep}" if args.sweep else ""))
    return 0


def _cell(value: object) -> str:
    """A spec field's value in a table: an integer without ".0", a float as %g, else its text."""
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, float, np.integer, np.floating)):
        v = float(value)
        return _int(v) if not np.isfinite(v) or v.is_integer() else f"{v:g}"
    return _text(value)


def _esc(value: object) -> str:
    """A string from a store, a spec or a path as Rich shows it literally: never read as markup
    (a run that failed with "[/data/x]" in its reason must not break the table that lists it)."""
    from rich.markup import escape

    return escape(str(value))


def _text(value: object) -> str:
    """A DataFrame cell as text: "" for a missing value (pandas reads a None among strings as NaN)."""
    # pandas' NA (a nullable integer column's missing cell) by its type's name: no pandas import here
    missing = value is None or type(value).__name__ == "NAType" or (isinstance(value, float) and np.isnan(value))
    return "" if missing else str(value)


def _int(value: object) -> str:
    """A count as an integer ("39", never "39.0": pandas makes a column float when another run's
    cell is missing); "-" when missing."""
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return _text(value) or "-"
    return "-" if np.isnan(v) else (str(int(v)) if v.is_integer() else f"{v:g}")


def _recorded_lr(client: Client, row: dict) -> str:
    """A Tracker run's learning rate as recorded at its last finished step (its spec holds none)."""
    try:
        lr = client.run(row["id"]).lr
    except Exception:  # noqa: BLE001 - a damaged run still lists
        return "-"
    return _lr(lr[-1]) if len(lr) else "-"


def _first_lr(row: dict) -> object:
    """The learning rate of a spec run's first update: schedule.lr, times the width in the active
    regime (the run's δ_0, as ``Run.lr`` stores it)."""
    lr = row.get("schedule.lr")
    if row.get("model.regime") == "active":
        try:
            return float(lr) * float(row.get("model.width"))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return lr
    return lr


def _lr(value: object) -> str:
    try:
        return f"{float(value):g}"
    except (TypeError, ValueError):
        return "-"


def _print_notes(con: Console, notes: dict[object, dict[str, str]], most: int = 5) -> None:
    """The diagnostics stored as NaN, with their reasons: one line per step and reason."""
    lines = [
        f"{f't = {t}' if isinstance(t, int) else t}: "
        f"{', '.join(sorted(n for n, r in by.items() if r == reason))} NaN — {reason}"
        for t, by in notes.items()
        for reason in dict.fromkeys(by.values())
    ]
    if lines:
        con.print(f"[yellow]diagnostics not computed at {len(notes)} step(s):[/]")
        for line in lines[:most]:
            con.print("  " + _esc(line), soft_wrap=True)
        if len(lines) > most:
            con.print(f"  … {len(lines) - most} more (Run.notes has them all)")


def _net(r: dict) -> str:
    """The L×W column of ``nsa ls``: depth × width of the built-in network, else the factory's name
    (a factory or Tracker model has no depth or width: the column read "-×-", a walk-through)."""
    factory = r.get("model.factory")
    if isinstance(factory, str) and factory:
        return factory.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
    return f"{_int(r.get('model.depth'))}×{_int(r.get('model.width'))}"


def _cmd_show(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from nsa_dist.client import Client
    from nsa_dist.config import LossName

    if (args.run is None) == (args.sweep is None):
        raise ValueError("give either a RUN or --sweep NAME")
    if args.sweep is not None:
        return _show_sweep(args)
    run = Client(args.store).run(args.run)
    con = Console()
    con.print(
        f"[bold]{_esc(run.id)}[/]  status: {_esc(run.status)}" + (f"  ({_esc(run.reason)})" if run.reason else "")
    )
    s = run.spec
    if hasattr(s.model, "factory"):  # a user-defined network (factory or Tracker)
        net = f"{s.model.factory}({', '.join(f'{k}={v}' for k, v in s.model.kwargs.items())})"
    else:
        net = f"{s.model.depth}×{s.model.width} {s.model.activation.value}"
    lr = "lr per step" if s.data.name.value == "arrays" else f"lr={s.schedule.lr}"
    if getattr(s.model, "regime", "ntk") == "active":  # the update's δ is lr · width (ExperimentSpec.lr_at)
        lr += f"×{s.model.width} (active regime: δ={s.lr_at(0):g})"
    con.print(
        _esc(f"data {s.data.name.value} N={s.data.n}  model {net}  {s.optimizer.name.value} {lr}  steps={s.steps}")
    )
    con.print(_esc(f"data fingerprint {run.data_fingerprint or '(not recorded: a run made before fingerprints)'}"))
    if run.attrs.get("layout"):
        con.print(_esc(f"spectrum layout {run.attrs['layout']} ({run.attrs.get('layout_reason')})"))
    if run.has("eigenvalues"):
        from nsa_dist._show import curves_line

        con.print(_esc(curves_line(run)))
    steps = run.steps
    con.print(f"recorded {len(steps)}/{len(run.schedule)} steps")
    if not len(steps):
        return 0
    cols = sorted({0, len(steps) - 1})
    t = Table()
    t.add_column("quantity")
    for i in cols:
        t.add_column(f"t = {steps[i]}", justify="right")
    E = run.energy("y")
    t.add_row("loss", *(f"{run.train_loss[i]:.5g}" for i in cols))
    t.add_row("λ_max" + (" (traced G)" if run.Ko > 1 else ""), *(f"{run.eigenvalues[i, 0]:.5g}" for i in cols))
    if run.Ko > 1:
        t.add_row("λ_max (full NK×NK kernel)", *(f"{run.lambda_max[i]:.5g}" for i in cols))
    bound = "2N/λ_max vs δ" + ("" if LossName(run.spec.loss) is LossName.L2 else " (L2's GD bound)")
    t.add_row(bound, *(f"{run.stability_bound()[i]:.4g} vs {run.lr[i]:.4g}" for i in cols))
    if run.has("loss_test"):
        t.add_row("test loss", *(f"{run.test_loss[i]:.5g}" for i in cols))
    for k in (1, 5, 10, 20, 50):
        if k <= E.shape[1]:
            t.add_row(f"E(y, {k})", *(f"{E[i, k - 1]:.4g}" for i in cols))
    if run.energy_route == "quadrature":
        widths = run.bracket_widths(("y", "residual"))
        for phi, rows in widths.groupby("phi", sort=False):
            at = {int(r.step): r for r in rows.itertuples()}
            t.add_row(f"E({phi}, k) bracket, widest", *(_widest(at.get(int(steps[i]))) for i in cols))
    t.add_row("alignment", *(f"{run.alignment['raw'][i]:.4g}" for i in cols))
    t.add_row("first-order error", *(f"{run.first_order['error'][i]:.4g}" for i in cols))
    con.print(t)
    from nsa_dist._show import hessian_table

    ht = hessian_table(run)
    if ht is not None:
        con.print(ht)
    _print_notes(
        con,
        {**run.notes, **({"after the run": run.attrs["post_run_notes"]} if run.attrs.get("post_run_notes") else {})},
    )
    from nsa_dist.plots.axes import gd_note

    if gd_note(run):
        con.print(f"[red]{gd_note(run)}[/]")
    return 0


def _show_sweep(args: argparse.Namespace) -> int:
    """``nsa show --sweep NAME``: the grid, how many runs are where, and each finished run's loss
    and E(y, k) at its last step (k = 10, or the largest every run has when that is smaller)."""
    import json

    from rich.console import Console
    from rich.table import Table

    from nsa_dist.client import Client

    sweep = Client(args.store).sweep(args.sweep)  # KeyError naming the known sweeps
    con = Console()
    if not con.is_terminal:  # piped: as wide as the columns need (ids whole), as `nsa ls`
        con = Console(width=max(con.width, 160))
    recorded = sweep.store.sweep_spec(args.sweep)
    counts = sweep.runs["status"].value_counts()
    uncreated = sweep.not_created()
    con.print(
        f"[bold]sweep {_esc(args.sweep)}[/]  {len(sweep.runs)} runs"
        + (": " + _esc(", ".join(f"{n} {status}" for status, n in counts.items())) if len(sweep.runs) else "")
        + (f"; {len(uncreated)} not created yet" if uncreated else "")
    )
    con.print(_esc(f"grid {json.dumps(recorded.get('grid') or {})}" + ("" if sweep.seeded else "  (one seed)")))
    if recorded.get("variants"):
        con.print(_esc(f"variants {json.dumps(recorded['variants'])}"))
    extra = [f for f in sweep.fields if f not in (recorded.get("grid") or {})]
    if extra:
        con.print(_esc(f"its runs also differ in {', '.join(extra)} (a re-submission with another base)"))
    unfinished = sweep.unfinished_points()
    if unfinished:
        con.print(_esc(f"{len(unfinished)} grid point(s) without a finished step: {unfinished[:5]}"))
    finished = sweep.runs[sweep.runs["steps_done"].fillna(0) > 0]
    if not len(finished):
        return 0
    try:
        k = min(10, sweep.smallest_k())
    except Exception:  # noqa: BLE001 - a run that cannot be read: E(y, 10), and that run says why
        k = 10
    fields = [*sweep.fields, *(["seed"] if sweep.seeded else [])]
    t = Table(title=f"each finished run at its last step (E(y, {k}): k = {k})")
    for col in ["id", *fields, "status", "last step", "loss", f"E(y, {k})"]:
        t.add_column(_esc(col), no_wrap=col == "id")
    for row in finished.to_dict("records"):  # one run at a time: a damaged one never hides the others
        run, last = sweep.run(row["id"]), row["last_step"]
        loss, energy = (_value_at(run, name, kk, last) for name, kk in (("loss_recorded", None), ("energy_y", k)))
        t.add_row(
            *map(
                _esc,
                (
                    row["id"],
                    *(_cell(row.get(f)) for f in fields),
                    _text(row["status"]),
                    _int(row["last_step"]),
                    loss if isinstance(loss, str) else f"{loss:.5g}",
                    energy if isinstance(energy, str) else f"{energy:.4g}",
                ),
            )
        )
    con.print(t)
    return 0


def _value_at(run: Any, name: str, k: int | None, step: Any) -> float | str:
    """Quantity ``name`` of a run at recorded step ``step`` (the row's "last step": its last finite
    value was shown, and "loss" the training loss of any later step — a minibatch's, or a diverged
    run's 4.8·10¹² beside step 4's 17.8: an audit); "-" where it has none, or "unreadable (<why>)"
    where the run's array cannot be read (a damaged chunk: ``nsa verify`` names it)."""
    from nsa_dist.client import quantity

    try:
        t, v = quantity(run, name, k)
    except (KeyError, IndexError):  # not recorded, or no column k (a run with fewer eigenpairs)
        return "-"
    except Exception as e:  # noqa: BLE001 - one run's damage is told in its row
        return f"unreadable ({type(e).__name__})"
    at = np.flatnonzero(np.asarray(t) == step) if step is not None and step == step else []
    return float(v[at[0]]) if len(at) else "-"


def _widest(row: Any) -> str:
    """ "0.086 at k = 1,417": a step's widest E bracket (a row of ``Run.bracket_widths``; "—" when not measured)."""
    if row is None or not np.isfinite(row.width):
        return "—"
    return f"{row.width:.3f} at k = {row.k:,}"


def _cmd_plot(args: argparse.Namespace) -> int:
    from nsa_dist.client import Client
    from nsa_dist.errors import NSAError, OutsideError
    from nsa_dist.plots import PlotOptions, plot_run

    if (args.run is None) == (args.sweep is None):
        raise ValueError("give either a RUN or --sweep NAME")
    given = [f"--{name}" for name in ("scalar", "x", "line") if getattr(args, name) is not None]
    if given and args.sweep is None:
        raise ValueError(f"{'/'.join(given)}: only with --sweep NAME (across a sweep's runs), not with a RUN")
    if args.sweep is not None:  # what a sweep's figures do not take is refused, not silently dropped
        run_only = [f"--{name}" for name in ("step", "pair") if getattr(args, name) is not None]
        if run_only:
            raise ValueError(
                f"{'/'.join(run_only)}: only with a RUN (its at-a-step figures); --sweep NAME draws every "
                "run's whole schedule"
            )
        if args.k is not None and len(args.k) > 1:
            raise ValueError(f"--k with --sweep takes one k (Fig. 7a's), got {len(args.k)}: {args.k}")
        if args.scalar is None and (args.x is not None or args.line is not None):
            raise ValueError("--x / --line: only with --scalar QUANTITY (the scalar figure they lay out)")
    if args.sweep is not None:
        return _plot_sweep(args)
    opts = PlotOptions(
        steps=tuple(args.step) if args.step else None,
        pair=tuple(args.pair) if args.pair else None,
        ks=tuple(args.k) if args.k else None,
    )
    run = Client(args.store).run(args.run)
    try:
        paths = plot_run(run, args.out, figures=args.figures, opts=opts)
    except OSError as exc:  # the folder, read-only or full: one line naming it, as `nsa export` says it
        if isinstance(exc, NSAError) or not str(exc.filename or "").startswith(str(args.out)):
            raise
        from nsa_dist._faults import outside_cause

        cause = outside_cause(exc, str(args.out)) or f"{type(exc).__name__}: {exc.strerror or exc}"
        raise OutsideError(f"cannot write the figures folder {args.out}: {cause}") from exc
    for p in paths:
        print(p)
    return 0


def _plot_sweep(args: argparse.Namespace) -> int:
    from nsa_dist.client import Client
    from nsa_dist.plots import plot_sweep, scalar_figure
    from nsa_dist.plots.axes import DPI, energy_k, readable

    sweep = Client(args.store).sweep(args.sweep)
    k = args.k[0] if args.k else None  # Fig. 7a: default the paper's fraction of N (plots.axes.energy_k)
    if (
        k is not None
        and not (args.scalar or "").startswith("hessian_")
        and len(sweep.groups())
        and k > sweep.smallest_k()
    ):
        raise ValueError(  # a k above what every run stores was drawn as E_t(y, K): a flat line at 1
            f"--k {k}: the sweep's runs store E(φ, k) for k ≤ {sweep.smallest_k()} (the fewest eigenpairs a run "
            f"of sweep {args.sweep!r} keeps, of N ≥ {sweep.smallest_n()}); give a k in 1..{sweep.smallest_k()}"
        )
    fig = None
    if args.scalar:  # the scalar figure is made (its fields and quantity checked) before any figure is written
        if not args.x:
            raise ValueError("--scalar needs --x FIELD (one of the sweep's fields: " + ", ".join(sweep.fields) + ")")
        if args.scalar.startswith("hessian_"):  # k: the moment order of Tr(A^k)
            kk = args.k[0] if args.k else None
        else:
            kk = energy_k(sweep.smallest_n(), sweep.smallest_k(), k)
        fig = scalar_figure(
            sweep, args.scalar, args.x, args.line, k=kk if args.scalar.startswith(("energy_", "hessian_")) else None
        )
    hessian_k = (args.scalar or "").startswith("hessian_")  # --k: Tr(A^k)'s order there, not Fig. 7a's k
    paths = plot_sweep(sweep, args.out, figures=args.figures, k=None if hessian_k else k)
    if fig is not None:
        path = args.out / f"scalar_{args.scalar}.png"
        readable(fig).savefig(path, dpi=DPI)
        paths.append(path)
    for p in paths:
        print(p)
    return 0


# ---------------------------------------------------------------------------- Ray
def _base_name_unused(sweep: Any) -> None:
    """Say that a base's own name names no run (a spec copied into ``base:`` keeps its name; the runs are
    named ``<sweep name>__<field>-<value>…``: it was dropped without a word, an audit)."""
    own = sweep.base.get("name")
    if own is not None and own != sweep.name:
        print(
            f"[nsa] sweep {sweep.name}: base.name {own!r} names no run — the runs are named "
            f"{sweep.name}__<field>-<value>… (the sweep's name)",
            file=sys.stderr,
            flush=True,
        )


def _cmd_sweep(args: argparse.Namespace) -> int:
    from nsa_dist.cluster import SweepCoordinator, connect
    from nsa_dist.cluster.runtime import RAYLET_GRACE, RayletLost, core_worker_console_to_log, raylet_lost
    from nsa_dist.specfile import check_data, load_sweep

    sweep = load_sweep(args.sweep, max_runs=args.max_runs)
    specs = sweep.expand()
    _base_name_unused(sweep)
    if len(specs) < sweep.size:  # grid values that are one experiment ([8, 8], [8, 8.0]) run once: said
        print(
            f"[nsa] sweep {sweep.name}: {sweep.size} grid points are {len(specs)} distinct experiments; each runs once",
            file=sys.stderr,
            flush=True,
        )
    if args.address is None:  # the embedded Ray runs on this machine (a cluster's nodes may have GPUs)
        _check_device(specs, args.sweep)
    _check_factories(specs)  # this process is the sweep's driver: it builds the models too
    check_data(specs, args.sweep)  # before Ray starts (≈ 9 s for the embedded one)
    table = _SweepTable(sweep.name, plain=args.plain or not sys.stderr.isatty())
    coordinator = SweepCoordinator(sweep, args.store, on_event=table.update, wait=_wait_seconds(args.wait))
    try:  # the embedded Ray holds every actor at once, step gangs included (threads are set per actor)
        need = coordinator.demand()
        custom = {k: v for k, v in need.items() if k not in ("CPU", "GPU") and v > 0}
        connect(
            args.address, num_cpus=max(os.cpu_count() or 1, int(np.ceil(need["CPU"] - 1e-9))), resources=custom or None
        )
    except BaseException:
        coordinator.close()
        raise
    restore = core_worker_console_to_log()  # Ray's C++ lines to its log folder, ours to the console
    try:
        for rid, (layout, reason) in coordinator.layouts().items():
            print(f"[nsa] {rid}: spectrum layout {layout} ({reason})", file=sys.stderr, flush=True)
        with table:
            outcomes = coordinator.run()
    except RayletLost:
        raise  # Ray's shutdown at exit writes more C++ lines about the lost node: they stay in the log
    except BaseException as exc:
        restore()
        # e.g. a bare ConnectionResetError
        cause = raylet_lost(grace=RAYLET_GRACE) if isinstance(exc, Exception) else None
        if cause is not None:
            raise RayletLost(cause) from exc
        raise
    restore()
    failed = [o for o in outcomes if o.status != "done"]
    for o in outcomes:
        print(f"{o.run_id}: {o.status}" + (f" ({o.reason})" if o.reason else ""))
    print(f"sweep {sweep.name}: {len(outcomes) - len(failed)}/{len(outcomes)} runs done → {args.store}")
    return 1 if failed else 0


class _SweepTable:
    """A rich live table of the sweep's runs (step, loss, λ_max, status); log lines when not a TTY."""

    def __init__(self, name: str, plain: bool) -> None:
        self.name, self.plain = name, plain
        self._last: dict[str, tuple] = {}

    def __enter__(self) -> _SweepTable:
        if not self.plain:
            from rich.live import Live

            self.live = Live(refresh_per_second=4)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.plain:
            self.live.__exit__(*exc)

    def update(self, runs: list) -> None:
        if self.plain:
            for r in runs:
                key = (r.done, r.status)
                if self._last.get(r.run_id) != key:
                    self._last[r.run_id] = key
                    if r.step is None and r.total and r.done == r.total:  # skipped: nothing computed now
                        print(f"[nsa] {r.run_id}: {r.status} {r.done}/{r.total} (already in the store)", flush=True)
                        continue
                    lam = f"{r.lambda_max:.5g}" if r.lambda_max is not None else "-"
                    step = r.step if r.step is not None else "-"
                    loss = f"{r.loss:.5g}" if r.loss is not None else "-"
                    print(
                        f"[nsa] {r.run_id}: {r.status} {r.done}/{r.total} step {step} loss {loss} λ_max {lam}",
                        flush=True,
                    )
            return
        from rich.table import Table

        t = Table(title=f"sweep {_esc(self.name)}")
        for col in ("run", "recorded", "step", "loss", "λ_max", "status"):
            t.add_column(col)
        for r in runs:
            t.add_row(
                _esc(r.run_id),
                f"{r.done}/{r.total}",
                str(r.step if r.step is not None else "-"),
                f"{r.loss:.4g}" if r.loss is not None else "-",
                f"{r.lambda_max:.4g}" if r.lambda_max is not None else "-",
                _esc(r.status),
            )
        self.live.update(t)


def _cmd_submit(args: argparse.Namespace) -> int:
    from nsa_dist.cluster import jobs

    job = jobs.submit(
        args.sweep,
        args.address,
        args.store,
        job_id=args.job_id,
        pip=args.pip,
        max_runs=args.max_runs,
        wait_writers=_wait_seconds(args.wait_for_writers),
    )
    print(f"submitted job {job} to {args.address}")
    if args.wait:
        return _wait_job(args.address, job)
    return 0


def _wait_job(address: str, job: str, poll: float = 2.0) -> int:
    from nsa_dist.cluster import jobs

    while True:
        st = jobs.status(address, job)[0]["status"]
        if st in ("SUCCEEDED", "FAILED", "STOPPED"):
            print(jobs.logs(address, job))
            print(f"job {job}: {st}")
            return 0 if st == "SUCCEEDED" else 1
        time.sleep(poll)


def _cmd_status(args: argparse.Namespace) -> int:
    if args.store is not None and args.job is not None:
        raise ValueError(f"give a JOB ({args.job!r}: a Ray Job's status) or --store (its runs' status), not both")
    if args.store is not None:
        return _store_status(args.store)
    from nsa_dist.cluster import jobs

    found = jobs.status(args.address, args.job)
    if not found:  # an empty listing read as a failed query (an audit)
        print(f"no jobs on the cluster at {args.address or os.environ.get('RAY_ADDRESS', '')}".rstrip())
    for j in found:
        print(
            f"{j['id']}  {j['status']:<10} {j['entrypoint']}  {_job_message(j['message'], whole=args.job is not None)}"
        )
    return 0


def _job_message(message: str, whole: bool) -> str:
    """Ray's message of a job: whole for one job; in the listing its first line (a failed job's
    message holds up to 20,000 characters of its log tail: 78 lines for 16 jobs, audit Q)."""
    lines = [ln for ln in str(message).splitlines() if ln.strip()]
    if whole or len(lines) <= 1:
        return "\n".join(lines)
    # the log tail's last line is the job's own one-line cause (nsa's "error: …"; an audit: the listing
    # showed only Ray's "entrypoint command failed with exit code 2")
    return f"{lines[0][:120]} … {lines[-1].strip()[:200]} (nsa status JOB, nsa logs JOB)"


def _store_status(url: str) -> int:
    from nsa_dist.client import Client

    runs = Client(url).runs()
    if not len(runs):
        print(f"no runs in {url}")
    records = runs.to_dict("records")
    wide = max((len(str(r["id"])) for r in records), default=0)  # ids of every length in one column
    for r in records:
        reason = _text(r.get("reason"))
        print(
            f"{str(r['id']):<{wide}}  {str(r['status']):<11} {_int(r['steps_done'])}/{_int(r['steps_total'])}"
            + (f"  ({reason})" if reason else "")
        )
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from nsa_dist.store import SpectrumStore, mark_damaged, verify_store

    store = SpectrumStore(args.store, mode="r")
    found = verify_store(store)
    n = len(store.run_ids())
    for d in (d for d in found if d.unfinished):  # not damage: a plain re-run finishes the creation
        print(str(d))
    damage = [d for d in found if not d.unfinished]
    if not damage:
        print(f"{args.store}: {n} run(s), no damage found")
        return 0
    for d in damage:
        print(str(d))
    print(f"{args.store}: {len(damage)} damaged piece(s) in {len({d.run_id for d in damage})} of {n} run(s)")
    if not args.mark:
        for line in _verify_advice(store, damage):
            print(line)
        return 1
    for rid, idx in mark_damaged(SpectrumStore(args.store), damage).items():
        if idx is None:  # its folder was a symbolic link to nothing: removed
            print(f"{rid}: removed (its folder linked to nothing); re-run it (nsa run / nsa sweep) to recompute it")
            continue
        print(f"{rid}: step indices {idx} marked not done; re-run it (nsa run / nsa sweep) to recompute them")
    return 0


def _verify_advice(store: SpectrumStore, damage: list[Damage]) -> list[str]:
    """What to do about the damage: `nsa verify STORE --mark` for chunks; damaged metadata (a
    zarr.json), which --mark refuses, restored from a copy or its run deleted and re-run."""
    metadata = [d for d in damage if d.metadata]
    runs, out = sorted({store.run_path(d.run_id) for d in metadata}), []
    if runs:
        out.append(
            "damaged metadata (a zarr.json) cannot be repaired by --mark: restore the file from a copy, or "
            f"delete the run's folder ({', '.join(runs[:3])}{' …' if len(runs) > 3 else ''}) and re-run it"
        )
    if len(metadata) < len(damage):
        mark = f"nsa verify {shlex.quote(store.url)} --mark"
        out.append(
            f"run `{mark}` to forget the damaged steps, then re-run to recompute them"
            + (" (once the metadata is restored or its run deleted)" if runs else "")
        )
    return out


def _cmd_serve(args: argparse.Namespace) -> int:
    from nsa_dist.serve import ServeOptions, serve

    opts = ServeOptions(
        args.store,
        host=args.host,
        port=args.port,
        token=args.token,
        allow_remote=args.allow_remote,
        refresh_s=args.refresh,
    )
    serve(opts, announce=lambda url: print(f"nsa serve: {args.store} at {url} (read-only; Ctrl-C stops)", flush=True))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from nsa_dist.client import Client
    from nsa_dist.errors import NSAError
    from nsa_dist.export import export_tensorboard

    if (args.run is None) == (args.sweep is None):
        raise ValueError("give either a RUN or --sweep NAME")
    client = Client(args.store)
    if args.sweep is None:
        runs = [client.run(args.run)]
    else:  # every run of the sweep with a finished step, each into its own DIR/<run id>
        sweep = client.sweep(args.sweep)  # KeyError naming the known sweeps
        runs = [sweep.run(rid) for rid in sweep.runs["id"][sweep.runs["steps_done"].fillna(0) > 0]]
        if not runs:
            raise ValueError(f"sweep {args.sweep!r} has no run with a finished step yet: nothing to export")
    failed = []
    for run in runs:
        try:
            out = export_tensorboard(run, args.tensorboard)
        except Exception as exc:  # noqa: BLE001 - one run's failure is told, the sweep's others still go
            if args.sweep is None:
                raise
            failed.append(run.id)
            print(f"{run.id}: not exported: {exc}", file=sys.stderr)
            continue
        print(
            f"{run.id}: {out.scalars} scalar points in {len(out.tags)} tags and {out.spectra} spectra "
            + ("exported already (the same finished steps): kept in" if out.kept else "written to")
            + f" {out.logdir} (tensorboard --logdir {args.tensorboard})"
        )
    if failed:
        raise NSAError(f"{len(failed)} of {len(runs)} runs of sweep {args.sweep!r} not exported: {', '.join(failed)}")
    return 0


def _cmd_logs(args: argparse.Namespace) -> int:
    from nsa_dist.cluster import jobs

    print(jobs.logs(args.address, args.job))
    return 0


def _cmd_cancel(args: argparse.Namespace) -> int:
    from nsa_dist.cluster import jobs

    print(f"job {args.job}: {'stopping' if jobs.cancel(args.address, args.job) else 'was not running'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
