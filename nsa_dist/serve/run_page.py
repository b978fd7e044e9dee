"""The page at ``/run?id=RUN``: one run's figures, redrawn while its writer adds steps.

A header says the status and the finished steps; below it one panel per figure the run has data
for — eigenvalues along t, the energy heat map, the first-order accuracy, the loss, the Hessian
moments with their error bars and the eigenvectors with a step slider.  A panel whose read fails
(a damaged chunk) shows the error naming the file; the others go on.
"""

from __future__ import annotations

import html
import threading
from typing import TYPE_CHECKING, Any

from nsa_dist.client import Client, Run

if TYPE_CHECKING:
    from bokeh.document import Document

    from nsa_dist.serve._live import Panel
    from nsa_dist.store import SpectrumStore

__all__ = ["run_page", "run_panels"]


def run_panels(run: Run) -> list["Panel"]:
    """The panels run ``run`` has data for, in page order."""
    from nsa_dist.serve._eigvec_panel import Eigenvectors
    from nsa_dist.serve._run_panels import Eigenvalues, EnergyMap, FirstOrder, HessianMoments, Loss

    out: list[Panel] = [Eigenvalues(run)]
    if any(run.has(f"energy_{p}") for p in EnergyMap.PHIS):
        out.append(EnergyMap(run))
    if run.has("first_order_error"):
        out.append(FirstOrder(run))
    out.append(Loss(run))
    if run.has("hessian_moments"):
        out.append(HessianMoments(run))
    if run.has("eigvec_images") or run.has("eigenvectors"):
        out.append(Eigenvectors(run))
    return out


def header_text(run: Run) -> str:
    """The run's id, status (and why), and finished / scheduled recorded steps."""
    t = run.steps
    last = f", last t = {int(t[-1])}" if len(t) else ""
    why = f" — {html.escape(str(run.reason))}" if run.reason else ""
    return (f'<a href="./">all runs</a><h2>run {html.escape(run.id)}</h2>'
            f'<p>status <b>{html.escape(str(run.status))}</b>{why}<br>'
            f'<span class="nsa-steps">steps done: {len(t)}/{len(run.schedule)}</span>{last}</p>')


def run_page(store: "SpectrumStore", refresh_s: float) -> Any:
    """The Bokeh app function of ``/run``."""

    def app(doc: "Document") -> None:
        from bokeh.layouts import column
        from bokeh.models import Div

        from nsa_dist.serve._live import every, query_arg

        rid = query_arg(doc, "id") or ""
        try:
            run = Run(store, rid) if store.has_run(rid) else Client.of(store).run(rid)  # a prefix or a name
        except Exception as exc:  # noqa: BLE001 — a missing or unreadable run is the page's message
            doc.add_root(Div(text=f'<a href="./">all runs</a><p class="nsa-damaged"><b>cannot open run '
                                  f'{html.escape(rid)}:</b> {html.escape(str(exc))}</p>'))
            return
        lock = threading.Lock()
        header = Div(text=header_text(run), css_classes=["nsa-header"])
        panels = run_panels(run)
        for p in panels:
            p.update(p.guarded(run))
        doc.title = f"nsa — {run.id}"
        doc.add_root(column(header, *(p.layout for p in panels)))
        _wire_choices(panels, run, lock)

        def read() -> tuple[str, list[Any]] | BaseException:
            try:
                run.refresh()
            except Exception as exc:  # noqa: BLE001
                return exc
            return header_text(run), [p.guarded(run) for p in panels]

        def apply(got: tuple[str, list[Any]] | BaseException) -> None:
            if isinstance(got, BaseException):
                header.text = f"<p class='nsa-damaged'><b>cannot re-read run {html.escape(run.id)}:</b> {html.escape(str(got))}</p>"
                return
            header.text = got[0]
            for p, data in zip(panels, got[1]):
                p.update(data)

        every(doc, refresh_s, read, apply, lock)

    return app


def _wire_choices(panels: list["Panel"], run: Run, lock: threading.Lock) -> None:
    """A chooser (φ, A, the step slider) redraws its panel at once (a small read, under ``lock``)."""
    from nsa_dist.serve._eigvec_panel import Eigenvectors

    for p in panels:
        def redraw(attr: str, old: Any, new: Any, p: "Panel" = p) -> None:
            with lock:
                p.update(p.guarded(run))

        for name in ("phi", "part"):
            if hasattr(p, name):
                getattr(p, name).on_change("value", redraw)
        if isinstance(p, Eigenvectors):
            def slide(attr: str, old: Any, new: Any, p: Eigenvectors = p) -> None:
                if not p.steps:
                    return
                with lock:
                    try:
                        data = p.at(run, p.steps[min(int(new), len(p.steps) - 1)])
                    except Exception as exc:  # noqa: BLE001
                        p.update(exc)
                        return
                p.draw(data)

            p.slider.on_change("value", slide)
