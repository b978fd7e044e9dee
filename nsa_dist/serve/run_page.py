"""The page at ``/run?id=RUN``: one run's figures, redrawn while its writer adds steps.

A header says the status and the finished steps; below it one tab per paper — the NSA paper
(Figs. 1a–e, 2a–d, 3a–e, 4a–d, 5–7d, Eqs. 4–5 with App. E, App. F, the loss) and, for a run
with a ``hessian:`` block, the Hessian paper (Figs. 1 and 3, Theorem 1, Proposition 4, the
spectra of I and H) — each figure titled with its number in the paper and drawn from the same
reads as ``nsa plot`` draws it, the predictions beside the measurements.  A panel whose read fails
(a damaged chunk) shows the error naming the file; the others go on.
"""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nsa_dist.client import Run

if TYPE_CHECKING:
    from bokeh.document import Document

    from nsa_dist.serve._live import Panel, Shared
    from nsa_dist.store import SpectrumStore

__all__ = ["UNKNOWN_RUN", "open_run", "run_page", "run_panels", "run_sections"]

_Needs = Callable[[Run], bool]
_REDRAW_S = 2.0  # a live run's page redraws its figures at most this often (a browser draws ~40 of them)
# … and, with many viewers of the run, at most every _PER_VIEWER_S × viewers seconds: a redraw
# re-sends every figure's data to each session, so that the server's work per step grows with the
# viewers, and this bounds it (the header — status, steps done — still follows every refresh)
_PER_VIEWER_S = 0.25


def _has(*names: str) -> _Needs:
    return lambda run: all(run.has(n) for n in names)


def _sections() -> dict[str, list[tuple[Any, _Needs]]]:
    """Each paper's panels in page order, with what a run must store for each (as ``nsa plot``'s
    registry asks; a panel whose step has not come yet says so)."""
    from nsa_dist.serve import _eigvec_panel as im, _hessian_panels as h, _nsa_panels as n

    evals = _has("eigenvalues", "lr")
    two_d = lambda run: run.has("eigvec_images") or (run.shape("X")[1] == 2 and run.Ko == 1)  # noqa: E731
    return {
        "NSA paper": [
            (im.Fig1abc, two_d),
            (n.Fig1d, _has("first_order_error", "first_order_cos")),
            (n.Fig1e, evals),
            (n.Fig2a, _has("eigenvalues")),
            (n.Fig2b, _has("eigenvalues")),
            (n.Fig2c, evals),
            (n.Fig2d, evals),
            (n.Energy, lambda run: any(run.has(f"energy_{p}") for p in n.Energy.PHIS)),
            (n.Fig4a, lambda run: run.has("projections_residual") or run.has("eigenvectors")),
            (im.Eigenvectors, lambda run: run.has("eigvec_images") or run.has("eigenvectors")),
            (im.Fig4d, _has("reconstructions")),
            (n.Fig7d, lambda run: run.has("preservation") or run.has("eigenvectors")),
            (n.Eqs45, lambda run: run.has("constant_gram_residual") or bool(run.dims.constant_gram)),
            (n.AppF, _has("gram_change")),
            (n.Loss, _has("loss_trace")),
        ],
        "Hessian paper": [
            (h.Moments, _has("hessian_moments")),
            (h.Orthogonality, _has("hessian_orthogonality")),
            (h.Rayleigh, _has("hessian_rayleigh")),
            (h.Additivity, _has("hessian_additivity", "hessian_moments")),
            (h.TraceS, _has("hessian_trace_S_G", "hessian_moments")),
            (h.SNorms, _has("hessian_S_op", "hessian_moments")),
            (h.ISpectrum, _has("hessian_I_eigenvalues", "hessian_I_limit_eigenvalues")),
            (h.Density, _has("hessian_density")),
            (h.EdgeOfStability, _has("hessian_top")),
        ],
    }


def _section_classes(run: Run) -> dict[str, list[Any]]:
    """The panel classes run ``run`` has data for, by paper, in page order (papers without one left out)."""
    out = {paper: [cls for cls, needs in panels if needs(run)] for paper, panels in _sections().items()}
    return {paper: classes for paper, classes in out.items() if classes}


def run_sections(run: Run) -> dict[str, list[Panel]]:
    """The panels run ``run`` has data for, by paper (a tab each), in page order; papers without
    a panel are left out."""
    out = {paper: [cls(run) for cls, needs in panels if needs(run)] for paper, panels in _sections().items()}
    return {paper: panels for paper, panels in out.items() if panels}


def run_panels(run: Run) -> list[Panel]:
    """Every panel of :func:`run_sections`, in page order."""
    return [p for panels in run_sections(run).values() for p in panels]


def panel_classes() -> list[Any]:
    """Every panel class a run's page can show (for the tests: each names the ``nsa plot`` figures it draws)."""
    return [cls for panels in _sections().values() for cls, _ in panels]


def header_text(run: Run) -> str:
    """The run's id, status (and why), finished / scheduled recorded steps, and the diagnostics
    stored as NaN with why (``run.notes``), every store string HTML-escaped."""
    t = run.steps
    last = f", last t = {int(t[-1])}" if len(t) else ""
    why = f" — {html.escape(str(run.reason))}" if run.reason else ""
    return (
        f'<a href="./">all runs</a><h2>run {html.escape(run.id)}</h2>'
        f"<p>status <b>{html.escape(str(run.status))}</b>{why}<br>"
        f'<span class="nsa-steps">steps done: {len(t)}/{len(run.schedule)}</span>{last}</p>' + _notes(run)
    )


_MAX_NOTES = 20


def _notes(run: Run) -> str:
    """A folded list of the diagnostics a step could not compute (stored as NaN) and why."""
    rows = [(t, name, reason) for t, notes in sorted(run.notes.items()) for name, reason in sorted(notes.items())]
    if not rows:
        return ""
    items = "".join(
        f"<li>t = {t}, {html.escape(str(name))}: {html.escape(str(reason))}</li>"
        for t, name, reason in rows[:_MAX_NOTES]
    )
    more = f"<li>… and {len(rows) - _MAX_NOTES} more (Run.notes)</li>" if len(rows) > _MAX_NOTES else ""
    return (
        f'<details class="nsa-notes"><summary>{len(rows)} diagnostic value(s) stored as NaN, and why'
        f"</summary><ul>{items}{more}</ul></details>"
    )


UNKNOWN_RUN = "no run with this id in the store"


def open_run(store: SpectrumStore, rid: str) -> Run:
    """The run ``?id=`` names, looked up among the runs the store lists only — its id, a unique id
    prefix, or its name when one run has it — never as a path (``..`` names no listed run).

    Raises:
        LookupError: :data:`UNKNOWN_RUN` (the same words for every id not listed, so the page tells
            nothing of what exists outside the store), or the listed ids an ambiguous prefix matches.
    """
    ids = store.run_ids()
    hits = [rid] if rid in ids else [r for r in ids if rid and r.startswith(rid)]
    if not hits and rid:
        hits = [r for r in ids if _spec_name(store, r) == rid]
    if not hits:
        raise LookupError(UNKNOWN_RUN)
    if len(hits) > 1:
        raise LookupError(f"{len(hits)} runs match: {', '.join(hits[:10])}; give the full id")
    return Run(store, hits[0])


def _spec_name(store: SpectrumStore, rid: str) -> str | None:
    """Run ``rid``'s spec name, or None for a run whose attributes cannot be read."""
    try:
        return store.run_attrs(rid).get("spec", {}).get("name")
    except Exception:  # noqa: BLE001 — a damaged run is never matched by name
        return None


class _Snapshot:
    """A run as of one refresh, shared by every session watching it (never refreshed: the next
    refresh is a new snapshot): the run, what a redraw depends on, and the header's text."""

    def __init__(self, run: Run) -> None:
        self.run, self.seen, self.header = run, _seen(run), header_text(run)


def run_page(store: SpectrumStore, refresh_s: float, shared: Shared | None = None) -> Any:
    """The Bokeh app function of ``/run``: its reads go through ``shared`` — one read of a run's
    state per refresh interval, and one of each panel's data per new state and choice of the
    panel, for every session watching the run."""
    from nsa_dist.serve._live import Shared, off_loop, prepared

    shared = shared if shared is not None else Shared()
    viewers: dict[str, int] = {}  # run → its sessions now (event loop only)

    def snapshot(rid: str) -> _Snapshot:
        return shared.get(("run", rid), lambda: _Snapshot(Run(store, rid)), refresh_s)

    def data(p: Panel, snap: _Snapshot) -> Any:
        return p.own(
            shared.get(("panel", snap.run.id, snap.seen, p.state()), lambda: _read(p, snap.run, True), refresh_s)
        )

    def build(args: dict[str, str]) -> Any:
        from bokeh.layouts import column
        from bokeh.models import Div, TabPanel, Tabs

        arg = args.get("id") or ""
        try:
            rid = shared.get(("open", arg), lambda: open_run(store, arg).id, refresh_s)
            snap = snapshot(rid)
        except LookupError as exc:  # an id the store does not list: a fixed message, nothing of the filesystem
            return _message(f'<a href="./">all runs</a><p class="nsa-damaged"><b>{html.escape(str(exc))}</b></p>')
        except Exception as exc:  # noqa: BLE001 — a listed run that cannot be read: the page's message
            return _message(
                f'<a href="./">all runs</a><p class="nsa-damaged"><b>cannot open this run:</b> '
                f"{html.escape(str(exc))}</p>"
            )
        run = snap.run
        lock = threading.Lock()
        header = Div(text=snap.header, css_classes=["nsa-header"])
        # Only the open tab is built, read and redrawn (a figure is ~50 Bokeh models: building them
        # is most of a page's cost); another is built and brought up to date when opened, and
        # nothing is re-sent while the run's finished steps and status stay the same.
        classes = _section_classes(run)
        groups: list[list[Panel] | None] = [None] * len(classes)
        if classes:
            groups[0] = [cls(run) for cls in list(classes.values())[0]]
        bodies = [
            column(*(p.layout for p in groups[0])) if j == 0 else column(Div(text="<i>loading…</i>"))
            for j in range(len(classes))
        ]  # a column's children change is redrawn (a TabPanel's child is not)
        tabs = Tabs(
            tabs=[TabPanel(child=body, title=paper) for body, paper in zip(bodies, classes)], css_classes=["nsa-tabs"]
        )
        state: dict[str, Any] = {
            "snap": snap,
            "seen": snap.seen,
            "head": snap.seen,
            "stale": set(range(1, len(groups))),
            "next": 0.0,
        }
        for p in groups[0] if groups else []:
            p.update(data(p, snap))
        root = column(header, tabs)

        def read() -> tuple[str, list[tuple[Any, Any]]] | None | BaseException:
            try:
                now = snapshot(rid)
            except Exception as exc:  # noqa: BLE001
                return exc
            state["snap"] = now
            head = now.header if now.seen != state["head"] else None
            state["head"] = now.seen
            if now.seen == state["seen"] or time.monotonic() < state["next"]:
                # nothing new, or redrawn less than the redraw interval ago: the next tick brings it
                return None if head is None else (head, [])
            every_s = max(refresh_s, _REDRAW_S, _PER_VIEWER_S * viewers.get(rid, 1))
            state["seen"], state["next"] = now.seen, time.monotonic() + every_s
            active = int(tabs.active or 0)
            state["stale"] = set(range(len(groups))) - {active}
            return now.header, [(p, data(p, now)) for p in (groups[active] or [] if groups else [])]

        def apply(got: tuple[str, list[tuple[Any, Any]]] | None | BaseException) -> None:
            if got is None:
                return
            if isinstance(got, BaseException):
                header.text = (
                    f"<p class='nsa-damaged'><b>cannot re-read run {html.escape(rid)}:</b> {html.escape(str(got))}</p>"
                )
                state["seen"] = state["head"] = None
                return
            if got[0] is not None:
                header.text = got[0]
            for p, d in got[1]:
                p.update(d)

        def attach(doc: Document) -> None:
            from nsa_dist.serve._live import every

            doc.title = f"nsa — {rid}"
            doc.add_root(root)
            viewers[rid] = viewers.get(rid, 0) + 1

            def left(ctx: Any) -> None:
                viewers[rid] -= 1

            doc.on_session_destroyed(left)

            def switch(attr: str, old: Any, new: Any) -> None:
                def read_tab() -> tuple[list[Panel] | None, list[tuple[Any, Any]]]:
                    if new not in state["stale"]:
                        return None, []
                    state["stale"].discard(new)
                    made = None
                    if groups[new] is None:
                        made = [cls(state["snap"].run) for cls in list(classes.values())[new]]
                    return made, [(p, data(p, state["snap"])) for p in (made or groups[new])]

                def show_tab(got: tuple[list[Panel] | None, list[tuple[Any, Any]]]) -> None:
                    made, read = got
                    for p, d in read:
                        p.update(d)
                    if made is not None:
                        groups[new] = made
                        bodies[new].children = [p.layout for p in made]
                        _wire_choices(doc, made, state, data, lock)

                off_loop(doc, read_tab, show_tab, lock)

            tabs.on_change("active", switch)
            _wire_choices(doc, groups[0] or [] if groups else [], state, data, lock)
            every(doc, refresh_s, read, apply, lock)

        return attach

    return prepared(build)


def _message(text: str) -> Any:
    """A page that is only ``text`` (HTML)."""
    from bokeh.models import Div

    div = Div(text=text)
    return lambda doc: doc.add_root(div)


def _seen(run: Run) -> tuple[bytes, str, str]:
    """What a redraw depends on: the finished steps and the status (and why)."""
    return run.finished.tobytes(), str(run.status), str(run.reason)


def _read(p: Panel, run: Run, shareable: bool = False) -> Any:
    """The panel's data, or what it shows instead (an error, or a note while no step is finished);
    ``shareable``: as :meth:`Panel.shareable` gives it."""
    from nsa_dist.serve._live import Waiting

    if not len(run.steps):
        return Waiting("waiting for the run's first finished recorded step")
    return p.shareable(run) if shareable else p.guarded(run)


def _wire_choices(
    doc: Document, panels: list[Panel], state: dict[str, Any], data: Callable[[Panel, Any], Any], lock: threading.Lock
) -> None:
    """A chooser (φ, steps, the step slider) redraws its panel (a small read, off the event loop,
    under ``lock``, from the session's latest snapshot of the run)."""
    from nsa_dist.serve._eigvec_panel import Eigenvectors
    from nsa_dist.serve._live import off_loop

    for p in panels:

        def redraw(attr: str, old: Any, new: Any, p: Panel = p) -> None:
            off_loop(doc, lambda: data(p, state["snap"]), p.update, lock)

        for w in getattr(p, "controls", []):
            w.on_change("value", redraw)
        if isinstance(p, Eigenvectors):

            def slide(attr: str, old: Any, new: Any, p: Eigenvectors = p) -> None:
                if not p.steps:
                    return
                step = p.steps[min(int(new), len(p.steps) - 1)]

                def at() -> Any:
                    try:
                        return p.at(state["snap"].run, step)
                    except Exception as exc:  # noqa: BLE001
                        return exc

                off_loop(doc, at, lambda got: p.update(got) if isinstance(got, BaseException) else p.draw(got), lock)

            p.slider.on_change("value", slide)
