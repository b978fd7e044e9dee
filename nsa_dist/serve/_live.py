"""What every page shares: reads off the server's event loop, a panel that shows damage instead of
crashing, and the figure defaults.

Store reads are blocking (Zarr's ``sync``), so a page never reads on Tornado's event loop: a
periodic callback hands the read to a worker thread (``run_in_executor``) without the document
lock, and applies the result to the document on the next tick, with the lock (Bokeh's pattern for
slow updates).  A read that raises becomes the panel's message — a damaged chunk's
:class:`~nsa_dist.errors.StoreError` names the array, the step and the file.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
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

__all__ = ["Panel", "Waiting", "every", "new_figure", "positive", "query_arg", "PALETTE"]

# Category10, written out: bokeh.palettes builds every palette at import
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")


def every(doc: Document, period_s: float, read: Callable[[], Any], apply: Callable[[Any], None],
          lock: threading.Lock | None = None) -> None:
    """Every ``period_s``: ``read()`` in a worker thread, then ``apply(result)`` on the document.

    A tick is skipped while the previous read is still running; ``lock`` serialises the reads
    with the page's other readers (a slider's).  ``read`` returns whatever ``apply`` takes:
    exceptions are the reader's business (see :meth:`Panel.guarded`).
    """
    busy = threading.Event()

    def locked() -> Any:
        if lock is None:
            return read()
        with lock:
            return read()

    @without_document_lock
    async def tick() -> None:
        if busy.is_set():
            return
        busy.set()
        try:
            result = await asyncio.get_running_loop().run_in_executor(None, locked)
        finally:
            busy.clear()
        doc.add_next_tick_callback(partial(apply, result))

    doc.add_periodic_callback(tick, int(period_s * 1000))


def query_arg(doc: Document, name: str) -> str | None:
    """The page's query argument ``name`` (``/run?id=…``), or None."""
    values = doc.session_context.request.arguments.get(name) if doc.session_context else None
    if not values:
        return None
    v = values[0]
    return v.decode() if isinstance(v, bytes) else str(v)


def new_figure(title: str, x: str, y: str, *, x_log: bool = False, y_log: bool = False, width: int = 520,
               height: int = 300, **kw: Any) -> figure:
    """A figure with the pages' sizes and tools (pan, box zoom, wheel zoom, reset, save, hover)."""
    fig = figure(title=title, width=width, height=height, x_axis_type="log" if x_log else "linear",
                 y_axis_type="log" if y_log else "linear", tools="pan,box_zoom,wheel_zoom,reset,save", **kw)
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
        self.error = Div(text="", visible=False, css_classes=["nsa-damaged"],
                         styles={"color": "#b00020", "max-width": "1000px", "white-space": "normal"})
        self.waiting = Div(text="", visible=False, css_classes=["nsa-waiting"], styles={"color": "#555555"})
        self.layout = column(Div(text=f"<h3>{_escape(self.title)}</h3>"), self.error, self.waiting, body,
                             css_classes=["nsa-panel"])

    def read(self, run: Any) -> Any:
        raise NotImplementedError

    def show(self, data: Any) -> None:
        raise NotImplementedError

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


def _escape(text: str) -> str:
    import html

    return html.escape(text)
