"""A panel of line figures: what most of a run's and a sweep's figures are.

A :class:`Curves` panel reads a list of :class:`Series` per figure (worker thread: the store reads
go through the client's readers, nothing is recomputed here) and draws each as a line with
optional markers and ± error bars (document thread).  Its legend sits right of the plot, so
that no number of entries covers the curves; its widgets (``controls``) redraw it when changed.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from bokeh.core.properties import field
from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, Div, Legend, LegendItem, MultiChoice, Select

from nsa_dist.serve._live import PALETTE, Panel, Waiting, new_figure, positive

if TYPE_CHECKING:
    from bokeh.model import Model

__all__ = [
    "Series",
    "Plot",
    "Curves",
    "Picked",
    "stairs",
    "hline",
    "color",
    "step_options",
    "first_middle_last",
    "spread",
    "chosen",
    "need",
    "LAST",
    "step_select",
    "last_options",
]


@dataclass(frozen=True)
class Series:
    """One curve: y against x, its legend label, colour, dash ("solid", "dashed", "dotted",
    "dashdot"), markers at the points, ± ``err`` bars and a shaded ``band`` = (lo, hi) (None: none),
    drawn at ``band_x`` when given (a staircase band has its own x, :func:`nsa_dist.plots.brackets.band_polygon`)."""

    x: Any
    y: Any
    label: str
    color: str = PALETTE[0]
    dash: str = "solid"
    markers: bool = True
    err: Any = None
    band: Any = None
    band_x: Any = None
    line: bool = True  # False: the markers alone (recorded values on a line drawn by another series)


@dataclass(frozen=True)
class Plot:
    """One figure of a panel: its axis labels and scales, an optional title and size."""

    x: str
    y: str
    x_log: bool = False
    y_log: bool = False
    title: str = ""
    width: int = 620
    height: int = 330


def color(j: int) -> str:
    """The j-th colour of the pages' palette (cycling)."""
    return PALETTE[j % len(PALETTE)]


def stairs(t: Any, v: Any) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of a piecewise-constant value ``v`` that holds from each recorded step to the next
    (a learning rate between recordings is the last recorded one, not a slope)."""
    t, v = np.asarray(t, np.float64), np.asarray(v, np.float64)
    if len(t) < 2:
        return t, v
    return np.repeat(t, 2)[1:], np.repeat(v, 2)[:-1]


def hline(x: Any, value: float, label: str, col: str = "#7f7f7f", dash: str = "dashed") -> Series:
    """A horizontal reference line at ``value`` over the range of ``x``."""
    x = np.asarray(x, np.float64)
    ends = [float(np.nanmin(x)), float(np.nanmax(x))] if x.size and np.isfinite(x).any() else [0.0, 1.0]
    return Series(np.asarray(ends), np.full(2, float(value)), label, col, dash, markers=False)


def _columns(series: Sequence[Series], plot: Plot) -> dict[str, dict[str, list[Any]]]:
    """The three sources of one figure (lines, markers, error bars) from its series."""
    lines: dict[str, list[Any]] = {"xs": [], "ys": [], "color": [], "dash": [], "label": []}
    dots: dict[str, list[Any]] = {"x": [], "y": [], "color": []}
    bars: dict[str, list[Any]] = {"x0": [], "y0": [], "x1": [], "y1": [], "color": []}
    bands: dict[str, list[Any]] = {"xs": [], "ys": [], "color": []}
    fx = positive if plot.x_log else (lambda a: np.asarray(a, np.float64))
    fy = positive if plot.y_log else (lambda a: np.asarray(a, np.float64))
    for s in series:
        x, y = fx(s.x), fy(s.y)
        if s.line:
            lines["xs"].append(x)
            lines["ys"].append(y)
            lines["color"].append(s.color)
            lines["dash"].append(s.dash)
            lines["label"].append(s.label)
        if s.markers:
            dots["x"] += x.tolist()
            dots["y"] += y.tolist()
            dots["color"] += [s.color] * len(x)
        if s.err is not None:
            raw, e = np.asarray(s.y, np.float64), np.abs(np.asarray(s.err, np.float64))
            ok = np.isfinite(raw) & np.isfinite(e)
            bars["x0"] += x[ok].tolist()
            bars["x1"] += x[ok].tolist()
            bars["y0"] += fy(raw[ok] - e[ok]).tolist()
            bars["y1"] += fy(raw[ok] + e[ok]).tolist()
            bars["color"] += [s.color] * int(ok.sum())
        if s.band is not None:
            bx = x if s.band_x is None else fx(s.band_x)
            lo, hi = fy(s.band[0]), fy(s.band[1])
            ok = np.isfinite(lo) & np.isfinite(hi) & np.isfinite(bx)
            bands["xs"].append(np.concatenate([bx[ok], bx[ok][::-1]]))
            bands["ys"].append(np.concatenate([lo[ok], hi[ok][::-1]]))
            bands["color"].append(s.color)
    return {"lines": lines, "dots": dots, "bars": bars, "bands": bands}


def flat_interval(series: Sequence[Series], plot: Plot) -> float | None:
    """The least y-interval a linear axis shows for these curves: a curve flat to rounding (e.g.
    E(y, N) ≡ 1 ± 1e-15) is drawn flat over ±5 % of its value, as ``nsa plot`` does
    (:func:`nsa_dist.plots.axes.keep_flat`), instead of autoscaling the noise; None otherwise."""
    from nsa_dist.plots.axes import FLAT_PAD, FLAT_SPAN

    if plot.y_log:
        return None
    ys = [np.asarray(s.y, np.float64).ravel() for s in series]
    y = np.concatenate(ys) if ys else np.zeros(0)
    y = y[np.isfinite(y)]
    if not y.size:
        return None
    scale = float(np.max(np.abs(y)))
    if float(y.max() - y.min()) > FLAT_SPAN * scale:
        return None
    return 2 * FLAT_PAD * (scale or 1.0)


class Curves(Panel):
    """A titled block of line figures (``plots``) drawn from :meth:`series`, with ``controls``.

    Subclasses set ``title``, ``plots`` and ``figures`` (the names of ``nsa plot``'s figures it
    draws: :data:`nsa_dist.plots.registry.FIGURES` / the sweep figures) and implement
    :meth:`series`; ``note`` (HTML-escaped here) is shown under the title when not empty, in
    ``note_color`` (red: a caveat on what the figure shows; grey: how it was measured).
    """

    plots: tuple[Plot, ...] = ()
    figures: tuple[str, ...] = ()
    css = ""
    note_color = "#b00020"
    ncols = 3  # figures per row

    def __init__(self, run: Any = None, controls: Sequence[Model] = (), plots: tuple[Plot, ...] | None = None) -> None:
        self.controls = list(controls)
        self.plots = plots if plots is not None else type(self).plots
        self.note = Div(text="", visible=False, styles={"color": self.note_color, "max-width": "900px"})
        self.sources: list[dict[str, ColumnDataSource]] = []
        figs = []
        for p in self.plots:
            src = {
                "lines": ColumnDataSource({"xs": [], "ys": [], "color": [], "dash": [], "label": []}),
                "dots": ColumnDataSource({"x": [], "y": [], "color": []}),
                "bars": ColumnDataSource({"x0": [], "y0": [], "x1": [], "y1": [], "color": []}),
                "bands": ColumnDataSource({"xs": [], "ys": [], "color": []}),
            }
            fig = new_figure(
                p.title,
                p.x,
                p.y,
                x_log=p.x_log,
                y_log=p.y_log,
                width=p.width,
                height=p.height,
                css_classes=["nsa-plot"] + ([self.css] if self.css else []),
            )
            fig.patches("xs", "ys", source=src["bands"], fill_color="color", fill_alpha=0.2, line_alpha=0)
            lines = fig.multi_line(
                "xs", "ys", source=src["lines"], line_color="color", line_dash="dash", line_width=1.6
            )
            fig.segment("x0", "y0", "x1", "y1", source=src["bars"], line_color="color", line_width=1.2)
            fig.scatter("x", "y", source=src["dots"], color="color", size=4)
            fig.add_layout(
                Legend(
                    items=[LegendItem(label=field("label"), renderers=[lines])],
                    label_text_font_size="8pt",
                    spacing=0,
                    padding=4,
                ),
                "right",
            )
            self.sources.append(src)
            figs.append(fig)
        self.figs = figs
        rows = [row(*figs[i : i + self.ncols]) for i in range(0, len(figs), self.ncols)]
        body = column(*([row(*self.controls)] if self.controls else []), self.note, *rows)
        super().__init__(body)

    def series(self, run: Any) -> list[list[Series]]:
        """The curves of each figure (worker thread)."""
        raise NotImplementedError

    def note_text(self, run: Any) -> str:
        """A plain-text note shown under the title ("" for none)."""
        return ""

    def choices(self, run: Any) -> list[tuple[Model, list[Any]]]:
        """(widget, its options now) for the controls whose options follow the run (new steps)."""
        return []

    def read(self, run: Any) -> dict[str, Any]:
        curves = self.series(run)
        return {
            "note": self.note_text(run),
            "choices": self.choices(run),
            "plots": [_columns(s, p) for s, p in zip(curves, self.plots)],
            "flat": [flat_interval(s, p) for s, p in zip(curves, self.plots)],
        }

    def show(self, data: dict[str, Any]) -> None:
        self.note.text, self.note.visible = html.escape(data["note"]), bool(data["note"])
        for w, options in data["choices"]:
            if list(w.options) != options:
                w.options = options
        for src, cols in zip(self.sources, data["plots"]):
            for name, s in src.items():
                if any(len(v) for v in cols[name].values()) or any(len(v) for v in s.data.values()):
                    s.data = cols[name]  # an empty source left empty sends nothing to the browser
        for fig, least in zip(self.figs, data.get("flat", [])):
            if fig.y_range.min_interval != least:
                fig.y_range.min_interval = least


def step_options(steps: Any) -> list[str]:
    """The recorded steps as a chooser's options."""
    return [str(int(t)) for t in steps]


def first_middle_last(steps: Any) -> list[str]:
    """The default steps of an at-a-step figure: the first, the middle and the last recorded."""
    s = step_options(steps)
    return list(dict.fromkeys([s[0], s[len(s) // 2], s[-1]])) if s else []


LAST = "last"  # a step chooser's value that follows a live run's newest step


def last_options(steps: Any) -> list[Any]:
    """A one-step chooser's options: "the last" (following new steps), then each finished step."""
    return [(LAST, "the last")] + step_options(steps)


def step_select(title: str, steps: Any, width: int = 160) -> Select:
    """A chooser of one step, on "the last" until the user picks one."""
    return Select(title=title, value=LAST, options=last_options(steps), width=width)


def chosen(widget: Model, steps: Any, default: Callable[[Any], list[str]] = first_middle_last) -> list[int]:
    """The steps picked in ``widget`` (a MultiChoice or Select) that are finished, else the default."""
    have = set(step_options(steps))
    value = widget.value if isinstance(widget.value, list) else [widget.value]
    picked = [v for v in value if v in have] or default(steps)
    return sorted(int(v) for v in picked)


def need(steps: Any, what: str) -> None:
    """:class:`Waiting` (a note on the page, not an error) while ``steps`` is empty."""
    if not len(steps):
        raise Waiting(f"waiting for the run's first finished {what}")


def spread(most: int) -> Callable[[Any], list[str]]:
    """A default choice of steps: up to ``most`` spread over them, the first and the last included."""
    from nsa_dist.plots.axes import some_steps

    return lambda steps: step_options(np.asarray(steps)[some_steps(len(steps), most)]) if len(steps) else []


class Picked(Curves):
    """A figure drawn at the steps picked in :attr:`pick` (a MultiChoice over :meth:`steps_of`, its
    options following the run) — until the user picks, :meth:`default` of them, which follows a
    live run's new steps; ``before``: widgets shown ahead of the picker."""

    pick_title = "steps t"
    default_text = "first, middle and last"

    def __init__(self, run: Any, before: Sequence[Model] = (), plots: tuple[Plot, ...] | None = None) -> None:
        steps = self.steps_of(run)
        self.pick = MultiChoice(
            title=self.pick_title,
            value=[],
            options=step_options(steps),
            width=330,
            placeholder=f"default: the {self.default_text}",
        )
        super().__init__(run, [*before, self.pick], plots)

    def steps_of(self, run: Any) -> Any:
        """The steps one can pick (default: the finished recorded steps)."""
        return run.steps

    def default(self, steps: Any) -> list[str]:
        """The steps drawn when none of the picked ones is finished (default: first, middle, last)."""
        return first_middle_last(steps)

    def choices(self, run: Any) -> list[tuple[Model, list[Any]]]:
        return [(self.pick, step_options(self.steps_of(run)))]

    def picked(self, run: Any) -> list[int]:
        """The steps to draw now."""
        return chosen(self.pick, self.steps_of(run), self.default)
