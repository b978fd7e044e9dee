"""Shared figure machinery: an Agg figure, learning-rate decay lines, which k / i / t to draw.

Figures are plain :class:`matplotlib.figure.Figure` objects on an Agg canvas: no pyplot, so
plotting never switches the backend or touches the figure registry of a caller's session.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from nsa_dist.client import Run

KS = (1, 2, 5, 10, 20, 50, 100, 200, 400, 1000, 2000, 4000, 10000)  # k (or i) drawn, as in NSA Fig. 3
DPI = 110


def new_figure(run: "Run", label: str, what: str, nrows: int = 1, ncols: int = 1,
               panel: tuple[float, float] = (6.4, 4.4), paper: str = "NSA") -> tuple["Figure", np.ndarray]:
    """A constrained-layout Agg figure titled "<paper> Fig. <label> — <what>" and its (nrows, ncols) axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(panel[0] * ncols, panel[1] * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(f"{paper} Fig. {label} — {what}\nrun {run.id}", fontsize=11)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def ks(K: int) -> list[int]:
    """The k (or eigenvector indices i) of :data:`KS` that are ≤ K."""
    return [k for k in KS if k <= K]


def some_steps(S: int, most: int = 6) -> np.ndarray:
    """Up to ``most`` evenly spread indices into the S recorded steps, first and last included."""
    return np.unique(np.linspace(0, S - 1, min(S, most)).round().astype(int))


def colors(n: int) -> np.ndarray:
    """(n, 4) RGBA along viridis, dark (small k, early t) to yellow-green."""
    from matplotlib import colormaps

    return colormaps["viridis"](np.linspace(0.0, 0.9, max(n, 1)))


def decay_steps(run: "Run", t_max: float) -> np.ndarray:
    """Steps in (0, t_max] where δ_t is decayed: multiples of ``spec.schedule.every`` (none if decay = 1)."""
    s = run.spec.schedule
    if s.every is None or s.decay == 1.0:
        return np.zeros(0, dtype=np.int64)
    return np.arange(s.every, int(t_max) + 1, s.every)


def decay_lines(ax: "Axes", run: "Run", t_max: float, shift: int = 0) -> None:
    """Dashed vertical lines at the learning-rate decays (drawn at t + shift); one legend entry."""
    for j, t in enumerate(decay_steps(run, t_max)):
        ax.axvline(t + shift, color="0.45", ls="--", lw=0.9, label="δ decay" if j == 0 else None)


def time_axis(ax: "Axes", run: "Run", ylabel: str, *, logy: bool = False, legend: bool = True) -> None:
    """Decay lines, "step t" and ``ylabel`` labels, optional log y, legend of a time plot."""
    decay_lines(ax, run, float(run.steps[-1]))
    ax.set_xlabel("step t")
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8, ncol=2 if len(ax.get_legend_handles_labels()[1]) > 6 else 1)
