"""Curves with their brackets: E_t(φ, k) and λ_i^t against k on a log axis (NSA Figs. 2a, 3 and 7a at
any N), the bracket drawn as a shaded band so that no curve looks sharper than it was measured.

A run measured on the exact route (the whole G_t on one process) has lower = upper = value: no
band.  On the quadrature route the top k are exact and every other k lies in a bracket
(:attr:`nsa_dist.client.Run.curve_bracket` says how it is guaranteed; a caption under the figure
repeats it).  Between two measured k the band is the monotone bracket of the two neighbours
(:func:`band_polygon`), a staircase, never the straight line between the bounds — at a k that was not
measured, E_t(φ, k) is only known to lie between lower(k_a) and upper(k_b).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.plots.axes import (
    FOOTNOTE_PT,
    PlotOptions,
    colors,
    family_label,
    footnote,
    legend,
    new_figure,
    some_steps,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from nsa_dist.client import BracketedCurve, Run

__all__ = ["band_polygon", "draw_bracketed", "bracket_caption", "add_bracket_caption", "energy_against_k", "BAND_ALPHA"]

BAND_ALPHA = 0.22


def band_polygon(
    k: np.ndarray, lower: np.ndarray, upper: np.ndarray, increasing: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, lo, hi) of the band of a curve measured at the integers ``k`` (ascending) with bounds
    ``lower`` ≤ ``upper``, for ``fill_between``.

    At a measured k the band spans [lower, upper]; across a gap k_a < k < k_b (integers that were not
    measured) it spans the monotone bracket [lower(k_a), upper(k_b)] of a non-decreasing curve
    (``increasing``; an energy) or [lower(k_b), upper(k_a)] of a non-increasing one (eigenvalues).
    Consecutive integers are joined directly (there is no k between them).

    >>> x, lo, hi = band_polygon(np.array([1, 2, 10]), np.array([.1, .2, .5]), np.array([.1, .2, .9]))
    >>> x.tolist(), lo.tolist(), hi.tolist()
    ([1.0, 2.0, 2.0, 10.0, 10.0], [0.1, 0.2, 0.2, 0.2, 0.5], [0.1, 0.2, 0.9, 0.9, 0.9])
    """
    k = np.asarray(k, np.float64)
    lower, upper = np.asarray(lower, np.float64), np.asarray(upper, np.float64)
    xs, los, his = [k[:1]], [lower[:1]], [upper[:1]]
    for j in range(1, len(k)):
        if k[j] - k[j - 1] > 1:
            lo = lower[j - 1] if increasing else lower[j]
            hi = upper[j] if increasing else upper[j - 1]
            xs.append(k[[j - 1, j]])
            los.append(np.array([lo, lo]))
            his.append(np.array([hi, hi]))
        xs.append(k[j : j + 1])
        los.append(lower[j : j + 1])
        his.append(upper[j : j + 1])
    return np.concatenate(xs), np.concatenate(los), np.concatenate(his)


def _positive_floor(*arrays: np.ndarray) -> float:
    """Half the smallest positive finite value of ``arrays`` (1e-300 when there is none)."""
    v = np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])
    v = v[np.isfinite(v) & (v > 0)]
    return float(v.min()) / 2 if len(v) else 1e-300


def draw_bracketed(ax: Axes, curve: BracketedCurve, j: int, color, label: str | None, logy: bool = False) -> bool:
    """Draw row ``j`` (a step) of ``curve`` against k: the value as a line (markers at the k beyond
    the exact part) and, where the bracket is not a point, its band.  On a log y axis a lower bound
    ≤ 0 is drawn at the axis floor (the band runs off the bottom, never cut short).  Returns whether
    a band was drawn."""
    k, v, lo, hi = curve.k, curve.value[j], curve.lower[j], curve.upper[j]
    ok = np.isfinite(v)
    if logy:
        v = np.where(v > 0, v, np.nan)
    ax.plot(k[ok], v[ok], "-", lw=1.2, color=color, label=label)
    beyond = ok & ~curve.exact
    if beyond.any():
        ax.plot(k[beyond], v[beyond], "o", ms=2.5, color=color)
    if curve.degenerate:
        return False
    okb = np.isfinite(lo) & np.isfinite(hi)
    x, blo, bhi = band_polygon(k[okb], lo[okb], hi[okb], curve.increasing)
    if not np.any(bhi > blo):
        return False
    if logy:
        floor = _positive_floor(curve.value[j], curve.lower[j])
        blo, bhi = np.maximum(blo, floor), np.maximum(bhi, floor)
    ax.fill_between(x, blo, bhi, color=color, alpha=BAND_ALPHA, lw=0)
    return True


def draw_bracketed_along_t(
    ax: Axes,
    steps: np.ndarray,
    value: np.ndarray,
    lower: np.ndarray,
    upper: np.ndarray,
    color,
    label: str | None,
    ls: str = "o-",
) -> bool:
    """E_t(φ, k) (or λ_k^t) along t at one k with its bracket as a band where it is not a point;
    returns whether a band was drawn."""
    ax.plot(steps, value, ls, ms=3, color=color, label=label)
    ok = np.isfinite(lower) & np.isfinite(upper)
    if not np.any(upper[ok] > lower[ok]):
        return False
    ax.fill_between(np.asarray(steps)[ok], lower[ok], upper[ok], color=color, alpha=BAND_ALPHA, lw=0)
    return True


def bracket_caption(run: Run, drawn: bool = True, phi: str = "y") -> str:
    """The caption under a figure of bracketed curves of E_t(``phi``, k) (and λ_k, for "y"): the route
    and how the band is guaranteed — of the test points' Gram (M × M, its own eigenpairs) for
    ``phi="f_test"`` (Fig. 3e was captioned with the training curve's N, cluster ranges and route)."""
    test = phi == "f_test"
    top = int(run.shape("eigenvalues_test" if test else "eigenvalues")[1])
    n, n_name, gram = (int(run.shape("X_test")[0]), "M", "the test points' G_t") if test else (run.N, "N", "G_t")
    try:
        curve = run.curve(f"energy_{phi}")
    except KeyError:  # no such curve stored
        curve = None
    route = curve.route if curve is not None else run.energy_route
    if route == "exact":
        which = f"every k = 1..{n_name} = {n}" if top >= n else f"k = 1..{top} (the eigenpairs kept)"
        mixed = curve.inexact_ranges() if curve is not None else ""
        if mixed:
            return (
                f"exact route: {which} from the eigendecomposition of {gram} (no bracket to draw) except "
                f"E at k {mixed}: inside a cluster of eigenvalues within rounding (G's null space"
                + (", or below a float32 G's rounding" if run.spec.spectrum.dtype == "float32" else "")
                # a band only where a k drawn falls there (Fig. 3a's k = 1 … 400 said "shaded band" of 333..399
                # with none drawn: an audit)
                + ("), shaded band" if drawn else "; no band in this figure)")
            )
        return f"exact route: {which} from the eigendecomposition of {gram} (no bracket to draw)"
    conf = run.attrs.get("curve_confidence")
    head = (
        f"quadrature route: k ≤ {top} exact; shaded band = bracket"
        + (f" at confidence {float(conf):g}" if conf is not None else "")
        + ("" if drawn else " (every bracket drawn here is a point)")
    )
    if conf is None:  # a run that names no confidence: its own sentence, whatever it says
        return f"{head} — {run.curve_bracket}"
    # the run's sentence (Run.curve_bracket) fills half a figure: its gist here, the rest one call away
    return f"{head} — λ_k's bracket beyond k = {top} is statistical, E(φ, k)'s provable given it (Run.curve_bracket)"


def add_bracket_caption(fig: Figure, run: Run, drawn: bool = True, more: str = "", phi: str = "y") -> None:
    """Write :func:`bracket_caption` (then ``more``, a sentence of the figure's own) under the axes
    of ``fig`` (laid out with them, wrapped to the width)."""
    import textwrap

    from nsa_dist.plots.axes import _text_width

    text = bracket_caption(run, drawn, phi) + (f"; {more}" if more else "")
    pt, width = FOOTNOTE_PT, 0.96 * fig.bbox.width
    # the characters per line from the font size, narrowed until the widest line fits (axes.fit_text
    # measures every trial line: seconds on a sentence this long)
    chars = max(20, int(width / (0.5 * pt * fig.dpi / 72)))
    for _ in range(8):
        lines = textwrap.wrap(text, chars)
        if max(_text_width(fig, ln, pt) for ln in lines) <= width:
            break
        chars = int(chars * 0.9)
    footnote(fig, "\n".join(lines), color="0.25")


_PHI_TEX = {
    "y": r"\bar y",
    "f": r"\bar f_t",
    "residual": r"\bar m_t",
    "df_pred": r"d\bar f_t",
    "df": r"d\tilde f_t",
    "f_test": r"\bar f_t^{test}",
}


def energy_against_k(run: Run, opts: PlotOptions = PlotOptions()) -> Figure:
    """E_t(φ, k) against k (log x) at up to four recorded steps (``opts.steps`` choose), one panel
    per φ the run stores (y, f, residual, df_pred), the bracket as a band; the k the run measured:
    1..K on the exact route (every k with ``spectrum.k: all``), the exact top part and the log grid
    to N on the quadrature route."""
    phis = [p for p in ("y", "f", "residual", "df_pred") if run.has(f"energy_{p}")]
    ncols = 2 if len(phis) > 1 else 1
    nrows = (len(phis) + ncols - 1) // ncols
    fig, axes = new_figure(
        run,
        "",
        "relative energy $E_t(\\phi, k)$ against k, with its bracket",
        nrows=nrows,
        ncols=ncols,
        panel=(5.2, 3.8),
    )
    steps = run.steps
    chosen = sorted(set(opts.steps)) if opts.steps else [int(steps[j]) for j in some_steps(len(steps), 4)]
    cols, labels = colors(len(chosen)), [family_label("t", t) for t in chosen]
    pos = {int(t): j for j, t in enumerate(steps)}
    drawn = False
    for n, phi in enumerate(phis):
        ax = axes[n // ncols, n % ncols]
        curve = run.curve(f"energy_{phi}")
        for c, t, label in zip(cols, chosen, labels):
            drawn |= draw_bracketed(ax, curve, pos[t], c, label if n == 0 else None)
        ax.set(xscale="log", xlabel="k", ylabel=rf"$E_t({_PHI_TEX[phi]}, k)$", ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3, which="both")
        if curve.route == "quadrature":
            ax.axvline(int(run.shape("eigenvalues")[1]), color="0.5", ls=":", lw=0.9)
    for n in range(len(phis), nrows * ncols):
        axes[n // ncols, n % ncols].set_axis_off()
    legend(axes[0, 0], family=("t", labels, cols))
    add_bracket_caption(fig, run, drawn)
    return fig
