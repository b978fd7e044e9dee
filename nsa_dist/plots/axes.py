"""Shared figure machinery: an Agg figure, learning-rate decay lines, which k / i / t to draw.

Figures are plain :class:`matplotlib.figure.Figure` objects on an Agg canvas: no pyplot, so
plotting never switches the backend or touches the figure registry of a caller's session.
A public module: the CLI, ``export`` and ``serve`` draw with the same :data:`DPI`, :func:`ks`,
:func:`energy_k` and :func:`gd_note`.

Every figure keeps the same rules, so that it reads right with the defaults: its title fits its
width (:func:`set_title`: smaller, then wrapped), a legend holds at most :data:`MAX_LEGEND` entries
(:func:`legend`: a family of lines becomes a colour key, other entries a selection), a curve flat to
rounding is drawn flat (:func:`keep_flat`, applied whenever the figure is drawn), a symlog axis
puts ±linthresh and 0 a decade apart (:func:`symlog_y`), and δ_t is drawn as the schedule's steps
(:func:`lr_steps`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.config import DataName, LossName

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from nsa_dist.client import Run

__all__ = [
    "picture_data",
    "picture_down",
    "KS",
    "DPI",
    "PAPER_K_FRACTION",
    "MAX_LEGEND",
    "TITLE_PT",
    "FLAT_SPAN",
    "FLAT_PAD",
    "energy_k",
    "PlotOptions",
    "PaperFigure",
    "blank_figure",
    "new_figure",
    "fit_text",
    "set_title",
    "title_of",
    "ks",
    "gd_note",
    "density_on_log_axis",
    "density_note",
    "DENSITY_FLOOR",
    "add_gd_note",
    "add_top_note",
    "footnote",
    "FOOTNOTE_PT",
    "LEGEND_OUTSIDE",
    "shared_legend",
    "width_axis",
    "step_axis",
    "some_steps",
    "colors",
    "decay_steps",
    "decay_lines",
    "time_axis",
    "lr_steps",
    "legend",
    "family_label",
    "symlog_y",
    "keep_flat",
]

KS = (1, 2, 5, 10, 20, 50, 100, 200, 400, 1000, 2000, 4000, 10000)  # k (or i) drawn, as in NSA Fig. 3
DPI = 110
PAPER_K_FRACTION = 400 / 10_000  # NSA Fig. 7a reads E_t(y, k) at k = 400 of N = 10⁴


def energy_k(n: int, k_stored: int, requested: int | None = None) -> int:
    """The k at which a single-k energy figure (NSA Fig. 7a) reads E_t(φ, k) by default.

    The paper's fraction of N (400 of 10⁴), at least 1, capped by the eigenpairs stored
    (``k_stored``) and kept below N: at k = N every E is 1 and the curve says nothing.
    An explicit ``requested`` k is drawn as given: an integer in 1..``k_stored``, else a ValueError
    (it was clamped: k = −3 and 0 drew E_t(y, 1), k = 100 of 8 stored drew k = 8 — an audit).

    >>> energy_k(10_000, 10_000), energy_k(1000, 100), energy_k(20, 20), energy_k(50, 50, requested=50)
    (400, 40, 1, 50)
    """
    if requested is not None:
        if isinstance(requested, (bool, np.bool_)) or not isinstance(requested, (int, np.integer)):
            raise ValueError(f"k={requested!r}: give an integer k in 1..{int(k_stored)}")
        if not 1 <= requested <= k_stored:
            raise ValueError(
                f"k={requested}: E_t(y, k) is stored for k in 1..{int(k_stored)} (the fewest eigenpairs a run "
                f"keeps; spectrum.k: all or spectrum.energy: quadrature measures every k up to N)"
            )
        return int(requested)
    return max(1, min(round(PAPER_K_FRACTION * n), int(k_stored), int(n) - 1))


MAX_LEGEND = 10  # entries a legend holds; a family of more lines gets a colour key, other entries are thinned
TITLE_PT = (11.0, 9.0)  # a figure title's font size: the largest in this range that fits its width, then wrapped
FLAT_SPAN = 1e-6  # a linear y range narrower than this fraction of the values' size is rounding: drawn flat
FLAT_PAD = 0.05  # … with this fraction of the size (or of 1 at 0) above and below


class PaperFigure:
    """Marker base for the figures of this package; see :func:`_figure_class`."""


@functools.cache
def _figure_class():
    """A :class:`matplotlib.figure.Figure` that applies :func:`keep_flat` to its axes whenever it is
    drawn (``savefig``, ``canvas.draw``): the y-limits are settled on the final data, whoever drew it."""
    from matplotlib.figure import Figure

    class _PaperFigure(PaperFigure, Figure):
        def draw(self, renderer):  # noqa: D102 — Figure.draw, after the flat-range rule
            for ax in self.axes:
                keep_flat(ax)
            return super().draw(renderer)

    return _PaperFigure


def blank_figure(figsize: tuple[float, float], images: bool = False) -> Figure:
    """An empty :class:`PaperFigure` of ``figsize`` inches on its own Agg canvas, laid out by matplotlib's
    "constrained" engine, or its "compressed" one for ``images`` (panels of a fixed aspect, whose
    labels "constrained" can push past the edge)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = _figure_class()(figsize=figsize, layout="compressed" if images else "constrained")
    FigureCanvasAgg(fig)
    return fig


def _words(text: str) -> list[str]:
    """``text`` split at the spaces outside ``$…$`` (a mathtext span is never broken)."""
    words, cur, math = [], "", False
    for ch in text:
        if ch == "$":
            math = not math
        if ch == " " and not math:
            words.append(cur)
            cur = ""
        else:
            cur += ch
    return words + [cur]


def _text_width(fig: Figure, text: str, pt: float) -> float:
    """Rendered width of ``text`` at ``pt`` points on ``fig``'s canvas, in pixels."""
    from matplotlib import cbook
    from matplotlib.font_manager import FontProperties

    renderer = fig.canvas.get_renderer()
    return renderer.get_text_width_height_descent(text, FontProperties(size=pt), ismath=cbook.is_math_text(text))[0]


def _greedy(fig: Figure, words: list[str], width: float, pt: float) -> list[str]:
    """``words`` filled into lines of at most ``width`` pixels (a word wider than that stands alone)."""
    lines, cur = [], ""
    for w in words:
        trial = f"{cur} {w}" if cur else w
        if cur and _text_width(fig, trial, pt) > width:
            lines.append(cur)
            cur = w
        else:
            cur = trial
    return lines + [cur]


def fit_text(fig: Figure, text: str, width: float, sizes: tuple[float, float] = TITLE_PT) -> tuple[str, float]:
    """(``text`` wrapped, font size) so that every line is at most ``width`` pixels wide on ``fig``.

    The largest size from ``sizes[0]`` down to ``sizes[1]`` (half points) at which ``text`` fits on one
    line; else the text is wrapped at the smallest size, at spaces outside ``$…$``, into as few lines
    as fit, of balanced lengths (no word left alone on the last line).
    """
    pt = sizes[0]
    while pt >= sizes[1]:
        if _text_width(fig, text, pt) <= width:
            return text, pt
        pt -= 0.5
    pt, words = sizes[1], _words(text)
    n = len(_greedy(fig, words, width, pt))
    lo, hi = width / n, width  # the narrowest width that still takes n lines balances them
    for _ in range(12):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if len(_greedy(fig, words, mid, pt)) <= n else (mid, hi)
    return "\n".join(_greedy(fig, words, hi, pt)), pt


def set_title(fig: Figure, head: str, sub: str) -> None:
    """The figure's title: ``head`` (what it shows, fitted to the width by :func:`fit_text`) over ``sub``
    (the run or sweep, wrapped at the title's size where it is wider: a failed run's says why) — every
    line inside the canvas; :func:`title_of` reads ``head`` back."""
    width = 0.96 * fig.bbox.width
    text, pt = fit_text(fig, head, width)
    # wrapped only where it would leave the canvas (a failed run's reason): a line that fits stays whole
    lines = _greedy(fig, _words(sub), width, pt) if _text_width(fig, sub, pt) > fig.bbox.width else [sub]
    fig.suptitle("\n".join([text, *lines]), fontsize=pt)
    fig._nsa_title = (head, len(lines))  # type: ignore[attr-defined]  (title_of)


def title_of(fig: Figure) -> str:
    """The title line of a figure of this package as set (:func:`set_title`), its wrapping undone.

    >>> fig = blank_figure((3, 2))
    >>> set_title(fig, "NSA Fig. 3e — a title far too long for a figure this narrow", "run r")
    >>> "\\n" in fig.get_suptitle(), title_of(fig)
    (True, 'NSA Fig. 3e — a title far too long for a figure this narrow')
    """
    n_sub = getattr(fig, "_nsa_title", (None, 1))[1]  # the run's line(s) under it: a failed run's can wrap
    return " ".join(fig.get_suptitle().split("\n")[:-n_sub])


def readable(fig: Figure) -> Figure:
    """The last pass before a figure is saved: a data line with one finite point gets a marker (it drew
    nothing: a one-step run, the one good step of a failed run — an audit found such panels empty), and a
    linear x axis whose lines all sit at integers (steps t, indices i) no more than 10 apart gets integer
    ticks (it was ticked 0.5, 1.5, …), centred on a single one."""
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        xs: list[np.ndarray] = []
        for line in ax.get_lines():
            if line.get_transform() != ax.transData:  # axhline / axvline: axes coordinates
                continue
            try:
                x, y = (np.asarray(v, dtype=np.float64).ravel() for v in line.get_data())
            except (TypeError, ValueError):  # dates, categories
                xs = []
                break
            ok = np.isfinite(x) & np.isfinite(y) if x.shape == y.shape else np.isfinite(x)
            if ok.sum() == 1 and line.get_marker() in (None, "", " ", "None", "none"):
                line.set_marker("o")
                line.set_markersize(max(4.0, line.get_linewidth() * 3))
            xs.append(x[ok])
        x = np.concatenate(xs) if xs else np.zeros(0)
        if ax.get_xscale() != "linear" or not x.size or not np.all(x == np.round(x)):
            continue
        lo, hi = float(x.min()), float(x.max())
        if hi - lo <= 10:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if hi == lo:
                ax.set_xlim(lo - 1, hi + 1)
    return fig


def _unfinished(run: Run) -> str:
    """ " (FAILED at t = 5: training diverged: loss is nan …)" for a run that did not finish, so that
    every figure of it says so (an audit: only the loss figure did; the others ended their lines at
    the last good step, or drew the one step there was, without a word); "" for a finished run."""
    status = str(getattr(run, "status", "done") or "done")
    if status == "done":
        return ""
    at = getattr(run, "failed_step", None)
    why = " ".join(str(getattr(run, "reason", "") or "").split())
    why = why if len(why) <= 50 else why.split(" (")[0]  # the cause, not its advice in brackets
    why = why if len(why) <= 50 else why[:49] + "…"
    why = why.replace("$", r"\$")  # a store's string: never mathtext (an unbalanced $ failed the figure's draw)
    where = f" at t = {at}" if at is not None and status == "failed" else ""
    return f" ({status.upper()}{where}{': ' + why if why else ''})"


def new_figure(
    run: Run,
    label: str,
    what: str,
    nrows: int = 1,
    ncols: int = 1,
    panel: tuple[float, float] = (6.4, 4.4),
    paper: str = "NSA",
    images: bool = False,
    note: str = "",
) -> tuple[Figure, np.ndarray]:
    """A constrained-layout Agg figure and its (nrows, ncols) axes, titled "<paper> Fig. <label> — <what>"
    when ``label`` is a figure number of the paper ("2a", "3"), "<paper> App. X — <what>" /
    "<paper> Eqs. 4–5 — <what>" for an appendix or equations, else "<paper>, <label> — <what>" for the
    statement of the paper a figure draws ("Theorem 1", "Proposition 4") or "" for none.  A title too
    wide for the figure is set smaller, then wrapped (:func:`set_title`); ``images``: panels of a fixed
    aspect (:func:`blank_figure`); ``note``: said after the run on the line below the title."""
    fig = blank_figure((panel[0] * ncols, panel[1] * nrows), images=images)
    if label[:1].isdigit():
        ref = f" Fig. {label}"
    elif label.startswith(("App.", "Eqs.")):  # an appendix or equations: no figure number
        ref = f" {label}"
    else:
        ref = f", {label}" if label else ""
    sub = f"run {run.id}" + _unfinished(run)
    if paper == "NSA" and label not in _FULL_KERNEL and getattr(run, "Ko", 1) > 1:  # Figs. 1e, 2c-d say theirs
        sub += f" — G_t: the N×N Gram Σ_a J_a J_aᵀ traced over its {run.Ko} outputs"
    sub += f" — {note}" if note else ""
    set_title(fig, f"{paper}{ref} — {what}", sub)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


_FULL_KERNEL = ("1e", "2c", "2d")  # the NSA figures whose λ are the full NK×NK kernel's (GD's stability)


def ks(K: int, chosen: tuple[int, ...] | None = None, where: str = "") -> list[int]:
    """The k (or eigenvector indices i) of ``chosen`` (default :data:`KS`) that are ≤ K.

    With ``where`` (a figure), a chosen k beyond K is left out with one warning naming it: a figure
    whose k stop below the run's (Fig. 2d's top K on the quadrature route, Fig. 3e's M test points);
    a k the run never measured is refused before (:meth:`PlotOptions.check_ks`).
    """
    rows = [k for k in (chosen or KS) if k <= K]
    if where and chosen and len(rows) < len(chosen):
        left = ", ".join(str(k) for k in chosen if k > K)
        logging.getLogger("nsa_dist.plots").warning(
            "%s: k = %s not drawn (this figure stops at k = %d)", where, left, K
        )
    return rows


@dataclass(frozen=True)
class PlotOptions:
    """What the user chose for a run's figures (``nsa plot --step … --pair … --k …``).

    Attributes:
        steps: steps of the at-a-step figures (Figs. 1a–c, 4a–d, 6, energy_against_k); None: each figure's own.
        pair: (t1, t2) of Fig. 7d, E_{t1}(v_i^{t2}, k); None: the stored / default pair.
        ks: the k (rows i) drawn in Figs. 2b, 2d, 3a–e and 7d; None: :data:`KS`.
    """

    steps: tuple[int, ...] | None = None
    pair: tuple[int, int] | None = None
    ks: tuple[int, ...] | None = None

    def check_steps(self, run: Run) -> None:
        """ValueError naming the finished steps when a chosen step is not one of them."""
        have = set(int(t) for t in run.steps)
        bad = [t for t in dict.fromkeys((self.steps or ()) + (self.pair or ())) if t not in have]  # each once
        if bad:
            raise ValueError(
                f"step(s) {bad} are not finished recorded steps of run {run.id!r}; "
                f"finished: {sorted(have)[:30]}{' …' if len(have) > 30 else ''}"
            )

    def check_ks(self, run: Run) -> None:
        """ValueError naming the k, the run and what it measured when a chosen k is outside 1..k_max
        (:attr:`nsa_dist.client.Run.k_max`: N, or the K eigenpairs kept on the exact route)."""
        top, n = run.k_max, run.N
        bad = [k for k in self.ks or () if not 1 <= k <= top]
        if bad:
            why = (
                f"every k up to N = {n}"
                if top >= n
                else f"the {top} eigenpairs it kept, spectrum.k; spectrum.k: all (layout local) or "
                f"spectrum.energy: quadrature measures every k up to N = {n}"
            )
            raise ValueError(f"k={', '.join(map(str, bad))}: run {run.id!r} measured k = 1..{top} only ({why})")


def unknown_rate_lines(run: Run, zero_hidden: bool = False) -> tuple[list[str], bool]:
    """Where δ_t is unknown (NaN: not given, parameter groups with different rates, or a Tracker's update
    that was not GD at the rate given) and, with ``zero_hidden`` (a log axis), where δ_t = 0 is not drawn:
    the lines of Figs. 2c–2d's note (none: every δ_t known and drawn), and whether that is every step."""
    lr = np.asarray(run.lr, np.float64)
    unknown = int((~np.isfinite(lr)).sum())
    zeros = int((lr == 0).sum()) if zero_hidden else 0  # δ_t = 0 (a warmup from 0): 0 on a log axis is not drawn
    lines = []
    if unknown:
        lines.append(
            ("δ_t unknown at every step" if unknown == lr.size else f"δ_t unknown at {unknown} of {lr.size} steps")
            + " (not given, parameter groups with different rates,\nor updates that were not GD at the rate given)"
        )
    if zeros:
        lines.append(f"δ_t = 0 at {zeros} of {lr.size} steps (0 on the log axis: not drawn)")
    return lines, bool(lines) and unknown + zeros == lr.size


def gd_note(run: Run) -> str | None:
    """A note for figures of GD formulas (s_i, δλ/N, 2N/λ_max; NSA §4) on a run that is not plain GD."""
    o = run.spec.optimizer
    name = o.name.value if hasattr(o.name, "value") else str(o.name)
    if LossName(run.spec.loss) is LossName.NCE and name == "gd" and o.momentum == 0:
        return (
            "note: 2N/λ_max, s_i and δλ/N are formulas of GD on the L2 loss (NSA §4); for NCE the "
            "residual's Jacobian is D = diag(σ'(h)) ≤ 1/4, so linearised GD is stable below "
            "2N/λ_max(D^½GD^½), which is at least 2N/(λ_max·max σ') ≥ 8N/λ_max (sufficient bounds, not the threshold)"
        )
    if LossName(run.spec.loss) is LossName.CROSS_ENTROPY and name == "gd" and o.momentum == 0:
        return (
            "note: 2N/λ_max, s_i and δλ/N are formulas of GD on the L2 loss (NSA §4); for cross-entropy "
            "the residual's Jacobian is HC = diag p − ppᵀ (eigenvalues ≤ ½), so linearised GD is stable "
            "below 2N/λ_max(HC^½ G HC^½) ≥ 4N/λ_max (a sufficient bound, not the threshold): shown for "
            "reference only"
        )
    if name == "gd" and o.momentum == 0:
        return None
    what = {
        "gd": "GD",
        "sgd": f"minibatch SGD (batch {o.batch_size})",
        "adam": "Adam",
        "custom": "a training loop of its own (a Tracker's: its update rule is not known)",
    }.get(name, f"optimizer {name!r}")
    if o.momentum > 0:
        what += f" with momentum {o.momentum:g}"
    return (
        f"note: δλ/N, s_i and 2N/λ_max are formulas of full-batch GD without momentum (NSA §4); "
        f"this run uses {what}, so they are shown for reference only"
    )


DENSITY_FLOOR = 1e-8  # of a density curve's peak: the lowest value a log axis draws


def density_on_log_axis(dens: np.ndarray) -> tuple[np.ndarray, int]:
    """A spectral density for a log y axis: values at or below ``DENSITY_FLOOR`` of its peak (0
    between the quadrature's nodes) as NaN — gaps — and how many (they were drawn at 1e-8, as if
    measured there)."""
    d = np.array(dens, dtype=np.float64)
    ok = np.isfinite(d)
    peak = float(d[ok].max()) if ok.any() else 0.0
    low = ok & (d <= DENSITY_FLOOR * peak)
    d[low] = np.nan
    return d, int(low.sum())


def density_note(hidden: int, total: int) -> str:
    """What :func:`density_on_log_axis` left out, said ("" when nothing)."""
    if not hidden:
        return ""
    return (
        f"log axis: {hidden} of {total} grid values at or below 10⁻⁸ of their curve's peak (the density "
        "between the quadrature's nodes, 0 or rounding) are not drawn: gaps"
    )


def nonpositive_note(values: np.ndarray, index: np.ndarray, top: float) -> str:
    """What a log axis leaves out of eigenvalue curves: ``values`` (rows drawn × ``index``, the i of
    each column) at or below 0 — rounding of a G whose rank is below N, or the bracket's lower end —
    said with where and how small, "" when there are none (matplotlib and the page drop them as gaps)."""
    v = np.asarray(values, np.float64).reshape(-1, len(index))
    bad = np.isfinite(v) & (v <= 0)
    if not bad.any():
        return ""
    i = np.asarray(index)[np.nonzero(bad)[1]]
    at = f"i = {i.min()}" if i.min() == i.max() else f"i = {i.min()}…{i.max()}"
    lo, hi = float(v[bad].min()), float(v[bad].max())
    size = f"{lo:.2g}" if lo == hi else f"{lo:.2g} to {hi:.2g}"
    return f"log axis: {int(bad.sum())} value(s) λ_i ≤ 0 not drawn ({at}: {size}, against λ_1 = {top:.4g})"


def add_gd_note(fig: Figure, run: Run) -> None:
    """Write :func:`gd_note` at the bottom of ``fig`` when it applies."""
    note = gd_note(run)
    if note:
        footnote(fig, note, color="crimson")


def add_top_note(fig: Figure, run: Run) -> None:
    """On the quadrature route, say under the axes of a figure drawn from eigenvectors that it stops at the
    exact top K (the figure was cut at i, k ≤ K without a word, while Figs. 2a–b, 3 said so; audit Y): one
    or two lines in a small font, laid out below the axes (never over the x label)."""
    if getattr(run, "energy_route", "exact") != "quadrature":
        return
    K = int(run.shape("eigenvalues")[1])
    footnote(
        fig,
        f"quadrature route: the eigenvectors are its exact top {K} (spectrum.quadrature.top), so i and k stop "
        f"at {K} here; Figs. 2a–b, 3 bracket every k to N",
    )


FOOTNOTE_PT = 6.5  # a footnote's font size: one or two lines under the axes


def footnote(fig: Figure, text: str, color: str = "0.35") -> None:
    """``text`` under the axes of ``fig`` as its supxlabel, small and wrapped to the figure's width at draw
    time, so that the layout engine keeps the axes above it and it stays inside the figure.  A figure's
    second note goes on the line below the first (two notes placed apart overlapped), in crimson when
    either is a warning."""
    old = fig._supxlabel.get_text() if getattr(fig, "_supxlabel", None) is not None else ""
    warn = color == "crimson" or bool(old and fig._supxlabel.get_color() == "crimson")
    joined = "\n".join(t for t in (old, text) if t)
    fig.supxlabel(joined, fontsize=FOOTNOTE_PT, color="crimson" if warn else color, wrap=True)


def some_steps(S: int, most: int = 6) -> np.ndarray:
    """Up to ``most`` evenly spread indices into the S recorded steps, first and last included."""
    return np.unique(np.linspace(0, S - 1, min(S, most)).round().astype(int))


def colors(n: int) -> np.ndarray:
    """(n, 4) RGBA along viridis, dark (small k, early t) to yellow-green."""
    from matplotlib import colormaps

    return colormaps["viridis"](np.linspace(0.0, 0.9, max(n, 1)))


def decay_steps(run: Run, t_max: float) -> np.ndarray:
    """Steps in (0, t_max] where δ_t is decayed: multiples of ``spec.schedule.every`` (none if decay = 1)."""
    s = run.spec.schedule
    if s.every is None or s.decay == 1.0:
        return np.zeros(0, dtype=np.int64)
    return np.arange(s.every, int(t_max) + 1, s.every)


def decay_lines(ax: Axes, run: Run, t_max: float, shift: int = 0) -> None:
    """Dashed vertical lines at the learning-rate decays (drawn at t + shift); one legend entry."""
    for j, t in enumerate(decay_steps(run, t_max)):
        ax.axvline(t + shift, color="0.45", ls="--", lw=0.9, label="δ decay" if j == 0 else None)


def time_axis(
    ax: Axes,
    run: Run,
    ylabel: str,
    *,
    logy: bool = False,
    legend: bool = True,
    family: tuple[str, list[str], np.ndarray] | None = None,
) -> None:
    """Decay lines, "step t" and ``ylabel`` labels, optional log y, legend of a time plot (``family``:
    see :func:`legend`)."""
    decay_lines(ax, run, float(run.steps[-1]))
    ax.set_xlabel("step t")
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if legend:
        _legend(ax, family=family)


def lr_steps(run: Run, t_end: int) -> tuple[np.ndarray, np.ndarray]:
    """(t, δ_t) at step 0, at every decay in (0, t_end] and at ``t_end``: the schedule's learning rate,
    piecewise constant, to draw with ``drawstyle="steps-post"`` (δ_t holds from one decay to the next).

    The schedule is the spec's only where it is the learning rate the run stored at its finished
    steps (``run.lr``); otherwise — a Tracker run, whose δ_t is the user's (its spec holds the default
    schedule) — the stored δ_t at the finished steps up to ``t_end``, held from one to the next."""
    stored = np.asarray(run.lr, np.float64)
    spec = np.array([run.spec.lr_at(int(s)) for s in run.steps], np.float64)
    ok = np.isfinite(stored)
    # no δ_t known (groups at different rates: NaN stored) is no evidence for the spec's schedule
    if not ok.any() or not np.allclose(spec[ok], stored[ok], rtol=1e-9, atol=0.0):
        keep = np.asarray(run.steps) <= t_end
        return np.asarray(run.steps, np.int64)[keep], stored[keep]
    t = np.unique(np.concatenate([[0], decay_steps(run, t_end), [t_end]])).astype(np.int64)
    return t, np.array([run.spec.lr_at(int(s)) for s in t], np.float64)


def family_label(name: str, value: object) -> str:
    """The legend label of one line of a family ("k = 10"); :func:`legend`'s colour key shows the value."""
    return f"{name} = {value}"


def legend(
    ax: Axes,
    *,
    family: tuple[str, list[str], np.ndarray] | None = None,
    most: int = MAX_LEGEND,
    fontsize: float = 8,
    below: bool = False,
    **kw,
) -> None:
    """A legend of at most ``most`` entries (about 10), never one that buries the plot: outside the axes, to
    their right (:data:`LEGEND_OUTSIDE`; the layout engine makes room for it), so it hides no data — inside,
    even at matplotlib's "best" place, it covered points of Figs. 2b, 3a, 3c and the Hessian moments.
    ``below``: under the axes' x label instead (:func:`_below`), for a panel of a row, whose legend at
    its right took the next panel's room (the regimes figure's three panels were squeezed to a third
    of their width).

    ``family`` = (name, labels, colours) names a family of lines (the k of Fig. 3, the steps of App. F,
    the grid points of a sweep) by their labels and colours: when the legend would hold more than
    ``most`` entries, the family leaves it for a colour key beside the axes (one band per line, ticked
    with its label less a leading "<name> = ").  Other entries beyond ``most`` are thinned to an even
    selection (first and last kept) and the legend's title says how many are shown.
    """
    handles, labels = ax.get_legend_handles_labels()
    if not labels:
        return
    if len(labels) > most and family is not None:
        name, own, cols = family
        keep = [j for j, lb in enumerate(labels) if lb not in set(own)]
        handles, labels = [handles[j] for j in keep], [labels[j] for j in keep]
        _color_key(ax, name, [lb.removeprefix(f"{name} = ") for lb in own], cols)
    title = None
    if len(labels) > most:
        pick = some_steps(len(labels), most)
        title = f"{len(pick)} of {len(labels)} entries shown"
        handles, labels = [handles[j] for j in pick], [labels[j] for j in pick]
    if labels:
        for key, value in (_below(ax) if below else LEGEND_OUTSIDE).items():
            kw.setdefault(key, value)
        ax.legend(
            handles,
            labels,
            fontsize=fontsize,
            title=title,
            title_fontsize=fontsize,
            # one column at the axes' right: two squeezed a one-panel figure to a strip (Fig. 7a of a
            # sweep of 10 grid points: the legend was wider than the plot); ≤ 10 rows fit its height
            ncol=2 if below and len(labels) > 3 else 1,
            **kw,
        )


def _below(ax: Axes) -> dict:
    """Legend placement under ``ax``: centred, its top 3.2 font sizes below the axes (the tick labels and
    the x label stand there), in points so that it clears them at any panel height."""
    import matplotlib
    from matplotlib.transforms import offset_copy

    drop = 3.2 * float(matplotlib.rcParams["font.size"])
    return {
        "loc": "upper center",
        "bbox_to_anchor": (0.5, 0.0),
        "bbox_transform": offset_copy(ax.transAxes, fig=ax.figure, y=-drop, units="points"),
        "borderaxespad": 0.0,
    }


def shared_legend(fig: Figure, ax: Axes) -> None:
    """Move ``ax``'s legend (the one key of a row of panels) under the whole figure, centred, in as many
    columns as fit: at ``ax``'s right it took the next panel's place (the Hessian moments' first panel
    left a gap as wide as itself).  A colour key (more lines than a legend holds) stays where it is."""
    old = ax.get_legend()
    if old is None:
        return
    handles, labels = old.legend_handles, [t.get_text() for t in old.get_texts()]
    title = old.get_title().get_text() or None
    old.remove()
    fig.legend(
        handles,
        labels,
        loc="outside lower center",
        ncol=max(1, min(len(labels), 4)),
        fontsize=8,
        title=title,
        title_fontsize=8,
    )


def step_axis(ax: Axes) -> None:
    """A symlog x axis of training steps t ≥ 0 (linear below t = 1, so t = 0 is drawn), starting at 0
    when t = 0 is drawn: its margin below 0 put a "−5×10⁻²" tick over the 0 of a short run (curves
    that start later keep the default limits: from 0 they filled the last 2 % of the axis)."""
    ax.set_xscale("symlog", linthresh=1.0)
    lo = ax.dataLim.intervalx[0]
    if np.isfinite(lo) and lo <= 0:
        ax.set_xlim(left=0.0)


def width_axis(ax: Axes, widths) -> None:
    """A log x axis of network widths ticked at the widths drawn, as plain integers: matplotlib's own
    ticks on a log axis spanning one or two decades label the minor ticks too ("2×10¹ 4×10¹ 6×10¹ 10²"),
    and they overlapped on the regimes and width-convergence figures.  At most 6 labels (an even
    selection, first and last kept: 12 widths 4..8192 overlapped in a 4-inch panel at 8)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    w = np.unique(np.asarray(widths, np.float64))
    w = w[np.isfinite(w) & (w > 0)]
    if not len(w):
        return
    ax.set_xscale("log")
    shown = w[some_steps(len(w), 6)] if len(w) > 6 else w
    ax.xaxis.set_major_locator(FixedLocator(shown))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


LEGEND_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0}
_legend = legend  # for time_axis, whose ``legend`` argument hides the function


def _color_key(ax: Axes, name: str, values: list[str], cols: np.ndarray) -> None:
    """A discrete colour bar beside ``ax``: one band of ``cols[j]`` per value, ticked with the values."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import BoundaryNorm, ListedColormap

    n = len(values)
    sm = ScalarMappable(BoundaryNorm(np.arange(n + 1) - 0.5, n), ListedColormap(cols[:n]))
    bar = ax.figure.colorbar(sm, ax=ax, ticks=np.arange(n), pad=0.01, fraction=0.05, aspect=30)
    bar.ax.set_yticklabels(values, fontsize=7)
    bar.set_label(name, fontsize=8)


def symlog_y(ax: Axes, values: np.ndarray) -> None:
    """A symlog y axis for values of either sign: linear within ±linthresh, a power of ten three
    decades below the largest |value|, so the labels ±linthresh and 0 stand a decade apart and
    never overlap."""
    v = np.abs(np.asarray(values, np.float64))
    v = v[np.isfinite(v) & (v > 0)]
    top = float(v.max()) if len(v) else 1.0
    ax.set_yscale("symlog", linthresh=10.0 ** np.floor(np.log10(top) - 3), linscale=1.0)
    # a margin in the scale's own coordinates: the autoscaled limits sat on the outermost seed's dot and
    # error bar, cut in half by the frame (an audit)
    lo, hi = ax.dataLim.intervaly
    if np.isfinite(lo) and np.isfinite(hi) and hi > lo:
        tr = ax.yaxis.get_transform()
        a, b = tr.transform([lo, hi])
        pad = 0.06 * (b - a)
        ax.set_ylim(*tr.inverted().transform([a - pad, b + pad]))


def keep_flat(ax: Axes) -> None:
    """A flat curve drawn flat: when the data on a linear, autoscaled y axis span less than
    :data:`FLAT_SPAN` of their size (E ≡ 1 ± 1e-15), the y-limits are the value ± :data:`FLAT_PAD` of
    it instead of rounding noise stretched over the whole height."""
    if ax.get_yscale() != "linear" or not ax.get_autoscaley_on() or hasattr(ax, "_colorbar"):
        return
    lo, hi = ax.dataLim.intervaly
    if not (np.isfinite(lo) and np.isfinite(hi)) or hi < lo:
        return
    size = max(abs(lo), abs(hi))
    if hi - lo <= FLAT_SPAN * size or size == 0.0:
        mid, pad = 0.5 * (lo + hi), FLAT_PAD * (size or 1.0)
        ax.set_ylim(mid - pad, mid + pad, auto=None)  # autoscale stays on: more data later rescales


def picture_data(run: Run) -> bool:
    """Whether ``run``'s 2-D inputs are a picture's coordinates (``image2d``, ``density2d``): the
    picture's row i sits at x₂ = i/(H − 1), its top row at x₂ = 0 (:func:`nsa_dist.data.image2d.image_function`),
    so a figure over (x₁, x₂) shows the picture upright only with x₂ growing downwards, as an
    image's rows do (:func:`picture_down`); other 2-D data keep x₂ upwards."""
    try:
        name = run.spec.data.name
    except AttributeError:
        return False
    try:
        return DataName(name) in (DataName.IMAGE2D, DataName.DENSITY2D)
    except ValueError:
        return False


def picture_down(ax: Axes) -> None:
    """Draw x₂ downwards on ``ax`` (and say so in its label): a picture's data upright."""
    if not ax.yaxis_inverted():
        ax.invert_yaxis()
    ax.set_ylabel("$x_2$ (down: the picture's rows)")
