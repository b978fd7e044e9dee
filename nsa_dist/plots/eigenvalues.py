"""The spectrum of G_t: λ_i^t over i (NSA Fig. 2a) and along t (2b), flow speed (2c), δ_t λ_i^t / N (2d)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.plots.axes import (
    PlotOptions,
    add_gd_note,
    colors,
    family_label,
    ks,
    legend,
    new_figure,
    nonpositive_note,
    some_steps,
    time_axis,
    unknown_rate_lines,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from nsa_dist.client import Run


def fig2a(run: Run) -> Figure:
    """λ_i^t against i for up to six recorded t (log-log; λ ≤ 0 are left out): every i the run
    measured, the bracket as a band where it is not a point (the quadrature route beyond its top)."""
    from nsa_dist.plots.brackets import add_bracket_caption, draw_bracketed

    fig, ax = new_figure(run, "2a", "eigenvalues of $G_t$ for different t")
    ax, curve, t = ax[0, 0], run.curve("eigenvalue"), run.steps
    idx = some_steps(len(t))
    drawn = False
    for c, j in zip(colors(len(idx)), idx):
        drawn |= draw_bracketed(ax, curve, j, c, f"t = {t[j]}", logy=True)
    ax.set(xscale="log", yscale="log", xlabel="index i", ylabel=r"eigenvalue $\lambda_i^t$")
    ax.grid(alpha=0.3, which="both")
    legend(ax)
    top = float(np.nanmax(curve.value[idx, 0])) if np.isfinite(curve.value[idx, 0]).any() else float("nan")
    add_bracket_caption(fig, run, drawn, nonpositive_note(curve.value[idx], curve.k, top))
    return fig


def fig2b(run: Run, opts: PlotOptions = PlotOptions()) -> Figure:
    """Individual eigenvalues λ_i^t along t for i in 1, 2, 5, 10, … ≤ the largest i measured (log y),
    each with its bracket as a band where it is not a point."""
    from nsa_dist.plots.brackets import _positive_floor, add_bracket_caption, draw_bracketed_along_t

    fig, ax = new_figure(run, "2b", "individual eigenvalues along t")
    ax, curve = ax[0, 0], run.curve("eigenvalue")
    rows = ks(int(curve.k[-1]), opts.ks, f"Fig. 2b of run {run.id!r}")
    cols, labels = colors(len(rows)), [rf"$\lambda_{{{i}}}^t$" for i in rows]
    drawn, drawn_values = False, []
    for c, i, label in zip(cols, rows, labels):
        value, lower, upper = curve.at(i)
        drawn_values.append(value)
        if np.any(upper > lower):  # a log axis: a lower bound ≤ 0 is drawn at half the smallest positive
            # value or bound (the band runs off the bottom); a positive lower bound is drawn where it is,
            # never raised (a band narrower than the stored bracket)
            floor = _positive_floor(value, lower)
            lower = np.where(np.isnan(lower) | (lower > 0), lower, floor)
        drawn |= draw_bracketed_along_t(ax, run.steps, value, lower, upper, c, label)
    time_axis(ax, run, r"eigenvalue $\lambda_i^t$", logy=True, family=("i", labels, cols))
    top = float(np.nanmax(curve.value[:, 0])) if np.isfinite(curve.value[:, 0]).any() else float("nan")
    add_bracket_caption(fig, run, drawn, nonpositive_note(np.array(drawn_values).T, np.asarray(rows), top))
    return fig


def _full_kernel(run: Run) -> str:
    """Which λ_i^t GD's formulas take for Ko > 1: the full (N·Ko)×(N·Ko) kernel's, not Figs. 2a-b's
    output-traced Gram's (one symbol named both: λ_1 9,004 in Fig. 2a, 1,825 behind Fig. 2c)."""
    return r", $\lambda_i^t$ of the full $NK{\times}NK$ kernel" if run.Ko > 1 else ""


def fig2c(run: Run) -> Figure:
    """Information-flow speed s_i^t = 1 − |1 − δ_t λ_i^t / N| along t for the top 8 eigenvectors."""
    fig, ax = new_figure(run, "2c", "information flow speed of the top eigenvectors" + _full_kernel(run))
    ax, s = ax[0, 0], run.flow_speed()  # (S, K)
    top = min(8, s.shape[1])
    for c, i in zip(colors(top), range(1, top + 1)):
        ax.plot(run.steps, s[:, i - 1], "o-", ms=3, color=c, label=f"i = {i}")
    time_axis(ax, run, r"$s_i^t = 1 - |1 - \delta_t \lambda_i^t / N|$")
    _unknown_rates(ax, run, (-0.02, 1.02))
    add_gd_note(fig, run)
    return fig


def _unknown_rates(ax: Axes, run: Run, empty_ylim: tuple[float, float], zero_hidden: bool = False) -> None:
    """Say where δ_t is unknown (NaN: parameter groups with different rates, or a Tracker's update that
    was not GD at the rate given) — the lines stop there; with no known δ_t the panel was blank on a
    broken axis (−0.04 … 0.04, an audit): it says so on a sane one."""
    lines, every = unknown_rate_lines(run, zero_hidden)
    if not lines:
        return
    ax.text(0.5, 0.5 if every else 0.03, "\n".join(lines), transform=ax.transAxes, ha="center",
            va="center" if every else "bottom", fontsize=8, color="0.3",
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})  # fmt: skip
    if every:
        ax.set_ylim(*empty_ylim)
        steps = np.asarray(run.steps, np.float64)
        if steps.size:
            lo, hi = float(steps.min()), float(steps.max())
            ax.set_xlim(lo - 1, hi + 1) if hi == lo else ax.set_xlim(lo, hi)


def fig2d(run: Run, opts: PlotOptions = PlotOptions()) -> Figure:
    """δ_t λ_i^t / N along t for i in 1, 2, 5, 10, … ≤ K, with the stability limit 2 (log y)."""
    fig, ax = new_figure(run, "2d", r"$\delta_t \lambda_i^t / N$ along t" + _full_kernel(run))
    ax, p = ax[0, 0], run.lr_eigen_product()  # (S, K)
    rows = ks(p.shape[1], opts.ks, f"Fig. 2d of run {run.id!r}")
    cols, labels = colors(len(rows)), [family_label("i", i) for i in rows]
    for c, i, label in zip(cols, rows, labels):
        ax.plot(run.steps, p[:, i - 1], "o-", ms=3, color=c, label=label)
    ax.axhline(2.0, color="crimson", ls=":", lw=1.2, label="2 (stability limit)")
    time_axis(ax, run, r"$\delta_t \lambda_i^t / N$", logy=True, family=("i", labels, cols))
    _unknown_rates(ax, run, (1e-3, 10.0), zero_hidden=True)
    add_gd_note(fig, run)
    return fig
