"""What every page shares: reads off the server's event loop and shared by its sessions, a panel
that shows damage instead of crashing, and the figure defaults.

Store reads are blocking (Zarr's ``sync``), so a page never reads on Tornado's event loop: a page
is built in a worker thread before its session starts (:func:`prepared`), and a periodic callback
hands its re-read to a worker thread (``run_in_executor``) without the document lock, and applies
the result to the document on the next tick, with the lock (Bokeh's pattern for slow updates).
The reads go through :class:`Shared`: one read per key (a run's state, a panel's data at a
run's state and the panel's choices, the run table) per refresh interval, whatever the number of
sessions watching — thirty viewers of a live run cost one run's reads, not thirty.  A session
destroyed while its read was in flight drops the result (its document is gone).  A read that
raises becomes the panel's message — a damaged chunk's :class:`~nsa_dist.errors.StoreError`
names the array, the step and the file.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from bokeh.document import without_document_lock
from bokeh.layouts import column
from bokeh.models import Div
from bokeh.plotting import figure

if TYPE_CHECKING:
    from bokeh.document import Document
    from bokeh.model import Model

__all__ = [
    "Panel",
    "Shared",
    "Waiting",
    "alive",
    "every",
    "new_figure",
    "off_loop",
    "positive",
    "prepared",
    "query_arg",
    "request_args",
    "PALETTE",
]

# Category10, written out: bokeh.palettes builds every palette at import
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


class Shared:
    """Reads shared by every session of a server: :meth:`get` returns the result of the last
    ``read`` for ``key`` begun less than ``max_age`` seconds ago (or still running: the callers
    wait for it), and otherwise runs ``read`` once, in the calling thread, for every caller.

    Entries not asked for in ``keep_s`` seconds are dropped, so that the cache holds the current
    state of what is being watched and nothing older.  ``reads`` counts the reads per key's first
    element ("run", "panel", "table", …).  Thread-safe; called from worker threads only (a read
    blocks).
    """

    def __init__(self, keep_s: float = 60.0, max_entries: int = 2048) -> None:
        self.keep_s, self.max_entries = keep_s, max_entries
        self.reads: dict[str, int] = {}
        self._lock = threading.Lock()
        self._entries: dict[Any, tuple[float, float, Future]] = {}  # key → (begun, last asked, result)
        self._pruned = time.monotonic()

    def get(self, key: tuple[Any, ...], read: Callable[[], Any], max_age: float) -> Any:
        with self._lock:
            now = time.monotonic()
            if now - self._pruned > self.keep_s / 4:
                self._pruned = now
                self._entries = {k: e for k, e in self._entries.items() if not e[2].done() or now - e[1] < self.keep_s}
            entry = self._entries.get(key)
            mine = entry is None or (entry[2].done() and now - entry[0] >= max_age)
            if mine:
                entry = (now, now, Future())
                self.reads[key[0]] = self.reads.get(key[0], 0) + 1
            else:
                entry = (entry[0], now, entry[2])
            self._entries[key] = entry
            if len(self._entries) > self.max_entries:  # a hard bound: the least recently asked go first
                done = sorted((e[1], i, k) for i, (k, e) in enumerate(self._entries.items()) if e[2].done())
                for _, _, k in done[: len(self._entries) - self.max_entries * 3 // 4]:
                    del self._entries[k]
        future = entry[2]
        if mine:
            try:
                future.set_result(read())
            except BaseException as exc:  # noqa: BLE001 — every caller gets it, raised
                future.set_exception(exc)
        return future.result()

    def drop(self, key: tuple[Any, ...]) -> None:
        """Forget ``key``'s result (the next :meth:`get` reads it again)."""
        with self._lock:
            self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)

    def latest(self, key: tuple[Any, ...]) -> Any:
        """The result of the last finished read of ``key`` (None: none, or it raised)."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None or not entry[2].done() or entry[2].exception() is not None:
            return None
        return entry[2].result()


def alive(doc: Document) -> bool:
    """Whether ``doc``'s session still lives (Bokeh destroys a closed page's document: a change to
    it after that raises, so a read that comes back late is dropped)."""
    return getattr(doc, "_session_context", None) is not None


def prepared(build: Callable[[dict[str, str]], Callable[[Document], None]]) -> Callable[[Document], None]:
    """A Bokeh app function for a page whose ``build(args)`` (a worker thread: the store reads and
    the models) returns what attaches it to a session's document (the event loop: no reads).

    The server's application runs ``build`` before the session's document is made (its
    ``on_session_created`` hook, see :mod:`nsa_dist.serve._server`) and leaves the result on
    the session context; without it (an app run directly), ``build`` runs here.
    """

    def app(doc: Document) -> None:
        ctx = doc.session_context
        attach = getattr(ctx, "_nsa_attach", None) if ctx is not None else None
        if attach is None:
            attach = build(request_args(doc))
        attach(doc)

    app.build = build  # type: ignore[attr-defined]
    return app


def request_args(doc_or_ctx: Any) -> dict[str, str]:
    """The page's query arguments (the first value of each), from a document or a session context."""
    ctx = getattr(doc_or_ctx, "session_context", doc_or_ctx)
    request = getattr(ctx, "request", None) if ctx is not None else None
    out = {}
    for name, values in (request.arguments or {}).items() if request is not None else ():
        if values:
            v = values[0]
            out[name] = v.decode(errors="replace") if isinstance(v, bytes) else str(v)  # (refused before: 400)
    return out


def off_loop(
    doc: Document, read: Callable[[], Any], apply: Callable[[Any], None], lock: threading.Lock | None = None
) -> None:
    """Once, soon: ``read()`` in a worker thread (under ``lock``), then ``apply(result)`` on the
    document — a widget's redraw, without blocking the event loop on its read."""

    @without_document_lock
    async def go() -> None:
        await _read_then_apply(doc, read, apply, lock)

    if alive(doc):
        doc.add_next_tick_callback(go)


def every(
    doc: Document,
    period_s: float,
    read: Callable[[], Any],
    apply: Callable[[Any], None],
    lock: threading.Lock | None = None,
) -> None:
    """Every ``period_s``: ``read()`` in a worker thread, then ``apply(result)`` on the document.

    A tick is skipped while the previous read is still running; ``lock`` serialises the reads
    with the page's other readers (a slider's).  ``read`` returns whatever ``apply`` takes:
    exceptions are the reader's business (see :meth:`Panel.guarded`).  Once the session is
    destroyed, no read starts and none is applied.
    """
    busy = threading.Event()

    @without_document_lock
    async def tick() -> None:
        if busy.is_set() or not alive(doc):
            return
        busy.set()
        try:
            await _read_then_apply(doc, read, apply, lock)
        finally:
            busy.clear()

    doc.add_periodic_callback(tick, int(period_s * 1000))


async def _read_then_apply(
    doc: Document, read: Callable[[], Any], apply: Callable[[Any], None], lock: threading.Lock | None
) -> None:
    """``read()`` in a worker thread (under ``lock``), then ``apply(result)`` on the document's next
    tick — neither once the session is destroyed (an error of a read it outlived is dropped)."""

    def locked() -> Any:
        if lock is None:
            return read()
        with lock:
            return read()

    def applied(result: Any) -> None:
        if alive(doc):
            apply(result)

    try:
        result = await asyncio.get_running_loop().run_in_executor(None, locked)
    except Exception:
        if alive(doc):
            raise
        return  # the session was destroyed during the read (its models' values with it)
    if alive(doc):  # same thread as the session's destruction, no await between: no race
        doc.add_next_tick_callback(partial(applied, result))


def query_arg(doc: Document, name: str) -> str | None:
    """The page's query argument ``name`` (``/run?id=…``), or None."""
    values = doc.session_context.request.arguments.get(name) if doc.session_context else None
    if not values:
        return None
    v = values[0]
    return v.decode() if isinstance(v, bytes) else str(v)


def new_figure(
    title: str,
    x: str,
    y: str,
    *,
    x_log: bool = False,
    y_log: bool = False,
    width: int = 520,
    height: int = 300,
    **kw: Any,
) -> figure:
    """A figure with the pages' sizes and tools (pan, box zoom, wheel zoom, reset, save, hover)."""
    fig = figure(
        title=title,
        width=width,
        height=height,
        x_axis_type="log" if x_log else "linear",
        y_axis_type="log" if y_log else "linear",
        tools="pan,box_zoom,wheel_zoom,reset,save",
        **kw,
    )
    fig.xaxis.axis_label, fig.yaxis.axis_label = x, y
    return fig


def positive(a: np.ndarray) -> np.ndarray:
    """``a`` as float64 with values ≤ 0 (and non-finite ones) as NaN: a log axis cannot draw them."""
    a = np.asarray(a, np.float64)
    return np.where(np.isfinite(a) & (a > 0), a, np.nan)


class Waiting(Exception):
    """A panel's data is not there yet (a live run has not reached the step it needs): a note in
    place of the figures, not an error."""


class Panel:
    """One block of a page: a title, its figures (``body``) and a message shown instead of them
    when reading their data failed.

    Subclasses set ``title`` and ``body`` and implement :meth:`read` (worker thread: store reads
    only) and :meth:`show` (document thread: no store reads).
    """

    title = ""

    def __init__(self, body: Model) -> None:
        self.body = body
        self.error = Div(
            text="",
            visible=False,
            css_classes=["nsa-damaged"],
            styles={"color": "#b00020", "max-width": "1000px", "white-space": "normal"},
        )
        self.waiting = Div(text="", visible=False, css_classes=["nsa-waiting"], styles={"color": "#555555"})
        self.layout = column(
            Div(text=f"<h3>{_escape(self.title)}</h3>"), self.error, self.waiting, body, css_classes=["nsa-panel"]
        )

    # attributes :meth:`read` sets for :meth:`show` (its output, not what it depends on)
    outputs: tuple[str, ...] = ("pair", "k")

    def read(self, run: Any) -> Any:
        raise NotImplementedError

    def state(self) -> tuple[Any, ...]:
        """What :meth:`read` depends on besides the run: the panel's class, its plain attributes
        (set from the run when it was made) and its widgets' values — two panels with the same
        state read the same data from the same run, so the sessions share one read."""
        plain = tuple(
            sorted(
                (k, v)
                for k, v in vars(self).items()
                if isinstance(v, (bool, int, float, str)) and k not in self.outputs
            )
        )
        widgets = tuple(_frozen(w.value) for w in getattr(self, "controls", []))
        return (type(self).__name__, plain, widgets)

    def show(self, data: Any) -> None:
        raise NotImplementedError

    def shareable(self, run: Any) -> Any:
        """:meth:`guarded`, with this panel's widgets in the result (a chooser whose options follow
        the run) named by attribute instead: another session's panel of the same :meth:`state`
        shows it (:meth:`own`), with its own widgets."""
        data = self.guarded(run)
        if isinstance(data, dict) and data.get("choices"):
            names = {id(v): k for k, v in vars(self).items()}
            data = {**data, "choices": [(names.get(id(w), w), options) for w, options in data["choices"]]}
        return data

    def own(self, data: Any) -> Any:
        """``data`` from :meth:`shareable` (of any panel of the same state), with this panel's widgets."""
        if isinstance(data, dict) and data.get("choices"):
            data = {
                **data,
                "choices": [(getattr(self, w) if isinstance(w, str) else w, options) for w, options in data["choices"]],
            }
        return data

    def guarded(self, run: Any) -> Any:
        """:meth:`read`, with a failure returned (as the exception) instead of raised."""
        try:
            return self.read(run)
        except Exception as exc:  # noqa: BLE001 — shown on the page, never a dead session
            return exc

    def update(self, data: Any) -> None:
        """Show ``data`` — or, if it is an exception, its message in place of the figures."""
        if isinstance(data, Waiting):
            self.waiting.text = f"<i>{_escape(str(data))}</i>"
            self.error.visible, self.waiting.visible, self.body.visible = False, True, False
            return
        if isinstance(data, BaseException):
            self.error.text = f"<b>cannot show this ({type(data).__name__}):</b> {_escape(str(data))}"
            self.error.visible, self.waiting.visible, self.body.visible = True, False, False
            return
        self.error.visible, self.waiting.visible, self.body.visible = False, False, True
        self.show(data)


def _frozen(value: Any) -> Any:
    """A widget's value, hashable (a MultiChoice's list as a tuple)."""
    return tuple(value) if isinstance(value, list) else value


def _escape(text: str) -> str:
    import html

    return html.escape(text)
