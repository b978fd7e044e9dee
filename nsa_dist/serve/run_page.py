"""The page at ``/run?id=RUN``: one run's figures, redrawn while its writer adds steps.

A header says the status and the finished steps; below it one tab per paper — the NSA paper
(Figs. 1a–e, 2a–d, 3a–e, 4a–d, 5–7d, Eqs. 4–5 with App. E, App. F, the loss) and, for a run
with a ``hessian:`` block, the Hessian paper (Figs. 1 and 3, Theorem 1, Proposition 4, the
spectra of I and H) — each figure titled with its number in the paper and drawn from the same
reads as ``nsa plot`` draws it, the predictions beside the measurements.  A panel whose read fails
(a damaged chunk) shows the error naming the file; the others go on.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from nsa_dist.client import Run
from nsa_dist.errors import StoreError

if TYPE_CHECKING:
    from nsa_dist.serve._live import Panel, Shared
    from nsa_dist.store import SpectrumStore

__all__ = ["UNKNOWN_RUN", "RunPages", "open_run", "page_html", "parse_choices", "run_panels", "run_sections"]

_Needs = Callable[[Run], bool]
_REDRAW_S = 2.0  # a live run's tab is rebuilt at most this often (a browser redraws ~25 figures)


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
    """The run ``?id=`` names, looked up among the runs the store lists only — its id, its name
    when one run has it, or a unique id prefix (as :meth:`nsa_dist.client.Client.run`) — never as a
    path (``..`` names no listed run).

    Raises:
        LookupError: :data:`UNKNOWN_RUN` (the same words for every id not listed, so the page tells
            nothing of what exists outside the store), or the listed ids an ambiguous name or prefix matches.
    """
    ids = store.run_ids()
    hits = [rid] if rid in ids else [r for r in ids if rid and r.startswith(rid)]
    if len(hits) != 1 and rid:  # a run's id is its name and a hash: its name is a prefix of it
        named = [r for r in hits or ids if _spec_name(store, r) == rid]
        hits = named if named else hits
    if not hits:
        raise LookupError(UNKNOWN_RUN)
    if len(hits) > 1:
        raise LookupError(f"{len(hits)} runs match: {', '.join(hits[:10])}; give the full id")
    return Run(store, hits[0])


def _spec_name(store: SpectrumStore, rid: str) -> str | None:
    """Run ``rid``'s spec name, or None for a run whose attributes cannot be read."""
    try:
        spec = store.run_attrs(rid).get("spec")
        return spec.get("name") if isinstance(spec, dict) else None
    except Exception:  # noqa: BLE001 — a damaged run is never matched by name
        return None


class _Snapshot:
    """A run as of one refresh, shared by every viewer of it (never refreshed: the next refresh is
    a new snapshot): the run, what a redraw depends on (and its short token), and the header's text."""

    def __init__(self, run: Run) -> None:
        self.run, self.seen, self.header = run, _seen(run), header_text(run)
        self.token = hashlib.sha1(repr(self.seen).encode()).hexdigest()[:16]


class _Built:
    """One tab of a run's page at one state of the run, for one choice of its widgets: its JSON
    answer, serialized once and sent as is to every viewer of that tab."""

    def __init__(self, token: str, body: bytes, began: float, took: float) -> None:
        self.token, self.body, self.began, self.took = token, body, began, took


_STATIC_S = 30.0
_ALL_RUNS = '<a href="./">all runs</a>'
_MAX_CHOICES = 4096  # characters of a request's widget choices (JSON); longer: ignored
_CHOICE_KEY = re.compile(r"\d{1,3}\.(\d{1,3}|s)")


def parse_choices(text: str | None) -> dict[str, Any]:
    """The widget choices of a request (``{"PANEL.WIDGET": value}``, ``PANEL.s``: the eigenvector
    slider), canonical; anything else (not JSON, other keys, other value types) is dropped — a
    page built for them is the page without them."""
    if not text or len(text) > _MAX_CHOICES:
        return {}
    if _depth(text) > 2:
        raise ValueError("c: widget choices are a flat JSON object (of strings, numbers, lists of strings)")
    try:
        got = json.loads(text)
    except ValueError:
        return {}
    if not isinstance(got, dict):
        return {}
    ok = lambda v: isinstance(v, (str, int, float)) and not isinstance(v, bool)  # noqa: E731
    return {
        k: v
        for k, v in sorted(got.items())
        if isinstance(k, str)
        and _CHOICE_KEY.fullmatch(k)
        and (ok(v) or (isinstance(v, list) and len(v) <= 1000 and all(isinstance(x, str) for x in v)))
    }


def _depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` in JSON ``text`` (its strings skipped), read without parsing."""
    deepest = depth = 0
    for ch in re.sub(r'"(?:[^"\\]|\\.)*"', '""', text):
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


_MAX_BUILT = 64  # tab builds kept (each a whole tab's JSON) ...
_MAX_BUILT_BYTES = 64 << 20  # ... and their bytes in all: the least recently asked go first


class RunPages:
    """The figures of ``/run?id=RUN``, built once per state of the run and shared by its viewers.

    A run's page is a static HTML page (:func:`page_html`) whose script asks :meth:`answer` (the
    ``/run/data`` request) for the open tab, every refresh interval, saying which state it shows.
    The answer is the run's header (every refresh) and, when the run's finished steps or status
    changed, the tab's Bokeh models as a ``json_item`` per panel — built, serialized and cached
    once per state and (run, tab, widget choices), each panel once per state and choice of its
    own widgets, whatever the number of viewers: thirty viewers of a live run cost one build per
    state, not thirty (a Bokeh server session per viewer built its own ~1,400 models, 1.3 s of
    CPU each, and serialized them again for each).

    A viewer never waits for a rebuild while a tab was built before: it gets the last build at
    once, and the rebuild of the new state runs in the background (one at a time per tab, at most
    every :data:`_REDRAW_S` and never more than half the time: a build waits twice the last one's
    duration after it); the next poll brings it.  Builds not asked for in ``keep_s`` are dropped.
    """

    def __init__(self, store: SpectrumStore, refresh_s: float, shared: Shared, keep_s: float = 60.0) -> None:
        self.store, self.refresh_s, self.shared, self.keep_s = store, refresh_s, shared, keep_s
        self._lock = threading.Lock()
        self._built: dict[tuple[Any, ...], tuple[_Built, float]] = {}  # key → (its last build, last asked)
        self._building: dict[tuple[Any, ...], Future] = {}
        self._pruned = time.monotonic()
        # (run, tab, panel) → its widgets' options and its eigenvector slider's positions (0: none)
        self._widgets: dict[tuple[Any, ...], tuple[list[Any], int]] = {}
        self._static: dict[tuple[Any, ...], tuple[float, str | None]] = {}  # (run, state) → (checked, damage)
        # the panels' modules and Bokeh's embedding, imported now: not in the first viewer's wait
        import bokeh.embed  # noqa: F401

        _sections()

    def static_damage(self, snap: _Snapshot) -> str | None:
        """:func:`static_damage` of ``snap``'s run, listed again at each new state of the run and
        at least every :data:`_STATIC_S` (a listing per array: on an object store, requests)."""
        key, now = (snap.run.id, snap.seen), time.monotonic()
        with self._lock:
            last = self._static.get(key)
        if last is not None and now - last[0] < _STATIC_S:
            return last[1]
        damage = static_damage(snap.run)
        with self._lock:
            self._static = {k: v for k, v in self._static.items() if now - v[0] < _STATIC_S}
            self._static[key] = (now, damage)
        return damage

    def snapshot(self, rid: str) -> _Snapshot:
        return self.shared.get(("run", rid), lambda: _Snapshot(Run(self.store, rid)), self.refresh_s)

    def answer(self, arg: str, tab: int, choices: dict[str, Any], have: str = "") -> bytes:
        """The JSON answer of ``/run/data`` (worker thread): ``{"message": HTML}`` for an id the
        store does not list, else ``{"page": {"seen", "items"}, "id", "header", "tabs", "tab"}`` —
        ``items`` (a ``json_item`` per panel) null when the viewer's ``have`` is already the
        newest build's ``seen``."""
        try:
            rid = self.shared.get(("open", arg), lambda: open_run(self.store, arg).id, self.refresh_s)
            snap = self.snapshot(rid)
        except LookupError as exc:  # an id the store does not list: a fixed message, nothing of the filesystem
            self.shared.drop(("open", arg))  # made-up ids hold no cache entry (nor push real ones out)
            return _json({"message": f'{_ALL_RUNS}<p class="nsa-damaged"><b>{html.escape(str(exc))}</b></p>'})
        except Exception as exc:  # noqa: BLE001 — a listed run that cannot be read: the page's message
            why = html.escape(str(exc))
            return _json({"message": f'{_ALL_RUNS}<p class="nsa-damaged"><b>cannot open this run:</b> {why}</p>'})
        try:
            sections = _section_classes(snap.run)
            damage = self.static_damage(snap)
            if damage:
                raise StoreError(damage)
        except Exception as exc:  # noqa: BLE001 — metadata that cannot be read: the page's message
            why = html.escape(f"{type(exc).__name__}: {exc}")
            return _json({"message": f'{_ALL_RUNS}<p class="nsa-damaged"><b>cannot show this run:</b> {why}</p>'})
        papers = list(sections)
        tab = min(max(int(tab), 0), max(len(papers) - 1, 0))
        head = {"id": rid, "header": snap.header, "tabs": papers, "tab": tab}
        if not papers:
            return _json({"page": {"seen": snap.token, "items": None}, **head})
        choices = self.valid(rid, tab, len(list(sections.values())[tab]), choices)
        built = self.built((rid, tab, json.dumps(choices, sort_keys=True)), snap, choices)
        if built.token == have:
            return _json({"page": {"seen": have, "items": None}, **head})
        return b'{"page": ' + built.body + b", " + _json(head)[1:]

    def valid(self, rid: str, tab: int, panels: int, choices: dict[str, Any]) -> dict[str, Any]:
        """``choices`` less those of panels or widgets the tab does not have and values not among a
        widget's options (as its last build had them): a build is keyed by what it shows, so that
        made-up choices reuse the default build instead of each storing one of their own."""
        out = {}
        for k, v in choices.items():
            i, j = k.split(".", 1)
            if int(i) >= panels:
                continue
            known = self._widgets.get((rid, tab, int(i)))
            if known is not None:
                options, slider = known
                if j == "s":
                    if not isinstance(v, int) or not 0 <= v < slider - 1:
                        continue
                elif int(j) >= len(options):
                    continue
                elif options[int(j)] is not None:
                    allowed = options[int(j)]
                    if not all(x in allowed for x in (v if isinstance(v, list) else [v])):
                        continue
            out[k] = v
        return out

    def __len__(self) -> int:
        """The tab builds held."""
        with self._lock:
            return len(self._built)

    def built(self, key: tuple[Any, ...], snap: _Snapshot, choices: dict[str, Any]) -> _Built:
        """The newest build of ``key`` (waiting for one only when there is none), a rebuild of
        ``snap``'s state started in the background when it is newer and due."""
        now = time.monotonic()
        with self._lock:
            if now - self._pruned > self.keep_s / 4:
                self._pruned = now
                self._built = {k: e for k, e in self._built.items() if now - e[1] < self.keep_s}
            last = self._built.get(key)
            if last is not None:
                self._built[key] = (last[0], now)
            running = self._building.get(key)
            stale = last is None or last[0].token != snap.token
            due = last is None or now >= last[0].began + max(self.refresh_s, _REDRAW_S, 2 * last[0].took)
            if running is None and stale and due:
                running = self._building[key] = Future()
                mine = True
            else:
                mine = False
        if mine:
            if last is None:
                self._build(key, snap, choices, running)  # the first viewer of this tab: built here
            else:
                threading.Thread(target=self._build, args=(key, snap, choices, running), daemon=True).start()
        if last is None:
            assert running is not None
            return running.result()
        return last[0]

    def _build(self, key: tuple[Any, ...], snap: _Snapshot, choices: dict[str, Any], done: Future) -> None:
        began = time.monotonic()
        try:
            body, token = self._item(snap, key[1], choices)
            built = _Built(token, body, began, time.monotonic() - began)
            with self._lock:
                self._built[key] = (built, time.monotonic())
                order = sorted(self._built, key=lambda k: self._built[k][1])
                size = sum(len(e[0].body) for e in self._built.values())
                while order and (len(self._built) > _MAX_BUILT or size > _MAX_BUILT_BYTES):
                    k = order.pop(0)
                    if k != key:
                        size -= len(self._built.pop(k)[0].body)
            done.set_result(built)
        except BaseException as exc:  # noqa: BLE001 — every waiter gets it, raised
            done.set_exception(exc)
        finally:
            with self._lock:
                self._building.pop(key, None)

    def _item(self, snap: _Snapshot, tab: int, choices: dict[str, Any]) -> tuple[bytes, str]:
        """Tab ``tab``'s panels at ``snap`` with ``choices`` applied: the state it shows and a
        ``json_item`` per panel, each built once per state and choice of its own widgets (another
        value of one panel's widget rebuilds that panel only)."""
        self.shared.reads["build"] = self.shared.reads.get("build", 0) + 1  # (the tests count the builds)
        parts, whole = [], True
        for i, cls in enumerate(list(_section_classes(snap.run).values())[tab]):
            mine = {k.split(".", 1)[1]: v for k, v in choices.items() if k.split(".", 1)[0] == str(i)}
            key = ("item", snap.run.id, snap.seen, tab, i, json.dumps(mine, sort_keys=True))
            got, ok = self.shared.get(key, lambda c=cls, i=i, m=mine: self._panel(c, tab, i, snap, m), float("inf"))
            if not ok:  # a panel showing an error is read again at the next build (a repair shows)
                self.shared.drop(key)
                whole = False
            parts.append(got)
        token = snap.token if whole else snap.token + "!"  # another token: the page takes the repaired build
        return b'{"seen":' + _json(token) + b',"items":[' + b",".join(parts) + b"]}", token

    def _panel(self, cls: Any, tab: int, i: int, snap: _Snapshot, mine: dict[str, Any]) -> tuple[bytes, bool]:
        """Panel ``cls`` (the ``i``-th of tab ``tab``) at ``snap`` with its widgets' values ``mine``,
        as a serialized ``json_item``, and whether it shows its data (not an error); its widgets
        send their new values to the page's script.  A panel that cannot even be made (damaged
        metadata) is a box with the error, the tab's other panels go on."""
        from bokeh.embed import json_item
        from bokeh.models import Div

        try:
            return self._made(cls, tab, i, snap, mine)
        except Exception as exc:  # noqa: BLE001 — shown in the panel's place
            why = html.escape(f"{type(exc).__name__}: {exc}")
            name = html.escape(getattr(cls, "title", cls.__name__))
            div = Div(text=f'<h3>{name}</h3><p class="nsa-damaged"><b>cannot show this:</b> {why}</p>')
            return _json(json_item(div)), False

    def _made(self, cls: Any, tab: int, i: int, snap: _Snapshot, mine: dict[str, Any]) -> tuple[bytes, bool]:
        from bokeh.embed import json_item
        from bokeh.models import CustomJS

        from nsa_dist.serve._eigvec_panel import Eigenvectors

        p = cls(snap.run)
        controls = list(getattr(p, "controls", []))
        self._widgets[(snap.run.id, tab, i)] = (
            [_options(w) for w in controls],
            len(p.steps) if isinstance(p, Eigenvectors) else 0,
        )
        for j, w in enumerate(getattr(p, "controls", [])):
            if str(j) in mine:
                try:
                    w.value = mine[str(j)]
                except (ValueError, TypeError):
                    pass  # not a value of this widget: its default
            w.js_on_change("value", CustomJS(code=f"window.nsaChoose('{i}.{j}', cb_obj.value)"))
        p.update(self._data(p, snap))
        if isinstance(p, Eigenvectors):
            _slide(p, snap.run, mine.get("s"))
            p.slider.js_on_change("value", CustomJS(code=f"window.nsaChoose('{i}.s', cb_obj.value)"))
        return _json(json_item(p.layout)), not getattr(getattr(p, "error", None), "visible", False)

    def _data(self, p: Panel, snap: _Snapshot) -> Any:
        key = ("panel", snap.run.id, snap.seen, p.state())
        return p.own(self.shared.get(key, lambda: _read(p, snap.run, True), self.refresh_s))


def _options(w: Any) -> list[Any] | None:
    """The values widget ``w`` takes (its options' values), None: any (numbers, free text)."""
    opts = getattr(w, "options", None)
    if not isinstance(opts, (list, tuple)):
        return None
    return [o[0] if isinstance(o, (list, tuple)) else o for o in opts]


def _slide(p: Any, run: Run, index: Any) -> None:
    """Eigenvector panel ``p`` at the stored step of slider position ``index`` (an earlier one
    than the newest it shows by default)."""
    if not isinstance(index, int) or not p.steps or not 0 <= index < len(p.steps) - 1:
        return
    try:
        got = p.at(run, p.steps[index])
    except Exception as exc:  # noqa: BLE001 — shown on the page
        p.update(exc)
        return
    p.slider.value = index
    p.draw(got)


def _json(obj: Any) -> bytes:
    """``obj`` as compact JSON, ``<``, ``>`` and ``&`` written as escapes (inert in any HTML context)."""
    text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


def page_html(refresh_s: float, title: str = "nsa — run") -> str:
    """The HTML of ``/run``: BokehJS from the server, a header, the tab buttons and the figures'
    box, and the script that fills them from ``/run/data`` — no store string in it (the run's id
    is read from the page's own address; the answers' HTML is escaped by the server, and the
    figures are data)."""
    from bokeh.resources import Resources

    scripts = "".join(
        f'<script src="{html.escape(src)}"></script>'
        for src in Resources(mode="server", root_url="./", components=["bokeh", "bokeh-widgets"]).js_files
    )
    page = _PAGE.replace("{title}", html.escape(title)).replace("{scripts}", scripts)
    return page.replace("REFRESH_MS", str(max(100, int(refresh_s * 1000))))


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>{scripts}
<style>
body { font-family: sans-serif; margin: 8px 16px; }
.nsa-tabs button { font-size: 14px; padding: 6px 14px; margin-right: 4px; border: 1px solid #ccc;
  background: #f4f4f4; cursor: pointer; }
.nsa-tabs button.nsa-active { background: #fff; border-bottom-color: #fff; font-weight: bold; }
</style></head>
<body><div class="nsa-header" id="nsa-header"><i>loading…</i></div>
<div class="nsa-tabs" id="nsa-tabs"></div><div id="nsa-box"></div>
<script>
(function () {
  "use strict";
  const q = new URLSearchParams(location.search);
  const id = q.get("id") || "";
  const head = document.getElementById("nsa-header");
  const tabsEl = document.getElementById("nsa-tabs");
  const box = document.getElementById("nsa-box");
  let tab = 0, choices = {}, have = "", views = [], busy = false, again = false, gen = 0, names = "";
  function showTabs(papers) {
    const key = JSON.stringify([papers, tab]);
    if (key === names) return;
    names = key;
    tabsEl.textContent = "";
    papers.forEach(function (paper, i) {
      const b = document.createElement("button");
      b.textContent = paper;
      if (i === tab) b.className = "nsa-active";
      b.onclick = function () { if (i !== tab) { tab = i; choices = {}; changed(); } };
      tabsEl.appendChild(b);
    });
  }
  function changed() { gen += 1; have = ""; names = ""; poll(); }
  window.nsaChoose = function (key, value) { choices[key] = value; gen += 1; have = ""; poll(); };
  async function poll() {
    if (busy) { again = true; return; }
    busy = true;
    const my = gen;
    try {
      const u = "run/data?" + new URLSearchParams({id: id, tab: String(tab), c: JSON.stringify(choices), have: have});
      const r = await fetch(u, {credentials: "same-origin", cache: "no-store"});
      if (!r.ok) { head.textContent = "nsa serve answered " + r.status + " " + r.statusText; return; }
      const got = await r.json();
      if (my !== gen) return;
      if (got.message !== undefined) {
        head.innerHTML = got.message;  // escaped by the server
        tabsEl.textContent = ""; box.textContent = ""; return;
      }
      document.title = "nsa — " + got.id;
      head.innerHTML = got.header;  // every store string escaped by the server
      tab = got.tab;
      showTabs(got.tabs);
      if (got.page && got.page.items && got.page.seen !== have) {
        // the new figures are drawn out of sight and then take the old ones' place, all at once
        const fresh = document.createElement("div"), made = [];
        fresh.style.cssText = "position: absolute; left: -30000px; top: 0; visibility: hidden; width: " +
          box.clientWidth + "px";
        document.body.appendChild(fresh);
        for (const item of got.page.items) {
          const el = document.createElement("div");
          fresh.appendChild(el);
          made.push(await Bokeh.embed.embed_item(item, el));
        }
        if (my !== gen) { for (const v of made) v.clear(); fresh.remove(); return; }  // another tab or choice since
        for (const v of views) v.clear();
        box.textContent = "";
        fresh.style.cssText = "";
        box.appendChild(fresh);
        views = made;
        have = got.page.seen;
      }
    } catch (e) {
      head.textContent = "nsa serve: " + e;
    } finally {
      busy = false;
      if (again) { again = false; poll(); }
    }
  }
  poll();
  setInterval(poll, REFRESH_MS);
})();
</script></body></html>
"""


def _seen(run: Run) -> tuple[bytes, str, str, str]:
    """What a redraw depends on: the finished steps, the status (and why), and when the run was
    created and its status last written — a run deleted and recorded anew under the same id (a
    Tracker's name) with as many steps finished is another state, never the old figures."""
    made = repr((run.attrs.get("created"), run.attrs.get("updated")))
    return run.finished.tobytes(), str(run.status), str(run.reason), made


def static_damage(run: Run) -> str | None:
    """The first chunk missing from a static array of ``run``, named (None: there is none):
    :meth:`~nsa_dist.store.reader.RunReader.static_damage` — ``steps`` read as its fill value would
    draw every step at t = 0 — so the page shows this instead."""
    try:
        return run._r.static_damage()  # the run's checked reader (nsa_dist.store.RunReader)
    except StoreError:
        return None  # damaged metadata: the panels that read the array name it


def _read(p: Panel, run: Run, shareable: bool = False) -> Any:
    """The panel's data, or what it shows instead (an error, or a note while no step is finished);
    ``shareable``: as :meth:`Panel.shareable` gives it."""
    from nsa_dist.serve._live import Waiting

    if not len(run.steps):
        return Waiting("waiting for the run's first finished recorded step")
    return p.shareable(run) if shareable else p.guarded(run)
