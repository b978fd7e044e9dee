"""Shared figure machinery: an Agg figure, learning-rate decay lines, which k / i / t to draw.

Figures are plain :class:`matplotlib.figure.Figure` objects on an Agg canvas: no pyplot, so
plotting never switches the backend or touches the figure registry of a caller's session.
A public module: the CLI, ``export`` and ``serve`` draw with the same :data:`DPI`, :func:`ks`
and :func:`gd_note`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.config import LossName

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from nsa_dist.client import Run

__all__ = ["KS", "DPI", "PAPER_K_FRACTION", "energy_k", "PlotOptions", "new_figure", "ks", "gd_note", "add_gd_note", "some_steps", "colors", "decay_steps",
           "decay_lines", "time_axis"]

KS = (1, 2, 5, 10, 20, 50, 100, 200, 400, 1000, 2000, 4000, 10000)  # k (or i) drawn, as in NSA Fig. 3
DPI = 110
PAPER_K_FRACTION = 400 / 10_000  # NSA Fig. 7a reads E_t(y, k) at k = 400 of N = 10⁴


def energy_k(n: int, k_stored: int, requested: int | None = None) -> int:
    """The k at which a single-k energy figure (NSA Fig. 7a) reads E_t(φ, k) by default.

    The paper's fraction of N (400 of 10⁴), at least 1, capped by the eigenpairs stored
    (``k_stored``) and kept below N: at k = N every E is 1 and the curve says nothing.
    An explicit ``requested`` k is only capped by what is stored.

    >>> energy_k(10_000, 10_000), energy_k(1000, 100), energy_k(20, 20), energy_k(50, 50, requested=50)
    (400, 40, 1, 50)
    """
    if requested is not None:
        return max(1, min(int(requested), int(k_stored)))
    return max(1, min(round(PAPER_K_FRACTION * n), int(k_stored), int(n) - 1))


def new_figure(run: "Run", label: str, what: str, nrows: int = 1, ncols: int = 1,
               panel: tuple[float, float] = (6.4, 4.4), paper: str = "NSA") -> tuple["Figure", np.ndarray]:
    """A constrained-layout Agg figure and its (nrows, ncols) axes, titled "<paper> Fig. <label> — <what>"
    when ``label`` is a figure number of the paper ("2a", "3"), "<paper> App. X — <what>" /
    "<paper> Eqs. 4–5 — <what>" for an appendix or equations, else "<paper>, <label> — <what>" for the
    statement of the paper a figure draws ("Theorem 1", "Proposition 4") or "" for none."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(panel[0] * ncols, panel[1] * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    if label[:1].isdigit():
        ref = f" Fig. {label}"
    elif label.startswith(("App.", "Eqs.")):  # an appendix or equations: no figure number
        ref = f" {label}"
    else:
        ref = f", {label}" if label else ""
    fig.suptitle(f"{paper}{ref} — {what}\nrun {run.id}", fontsize=11)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def ks(K: int, chosen: "tuple[int, ...] | None" = None) -> list[int]:
    """The k (or eigenvector indices i) of ``chosen`` (default :data:`KS`) that are ≤ K."""
    return [k for k in (chosen or KS) if k <= K]


@dataclass(frozen=True)
class PlotOptions:
    """What the user chose for a run's figures (``nsa plot --step … --pair … --k …``).

    Attributes:
        steps: recorded steps for the at-a-step figures (Figs. 1b, 4a–c, 6); None: the figure's default.
        pair: (t1, t2) of Fig. 7d, E_{t1}(v_i^{t2}, k); None: the stored / default pair.
        ks: the k (rows i) drawn in Figs. 2b, 2d, 3a–e and 7d; None: :data:`KS`.
    """

    steps: tuple[int, ...] | None = None
    pair: tuple[int, int] | None = None
    ks: tuple[int, ...] | None = None

    def check_steps(self, run: "Run") -> None:
        """ValueError naming the finished steps when a chosen step is not one of them."""
        have = set(int(t) for t in run.steps)
        bad = [t for t in (self.steps or ()) + (self.pair or ()) if t not in have]
        if bad:
            raise ValueError(f"step(s) {bad} are not finished recorded steps of run {run.id!r}; "
                             f"finished: {sorted(have)[:30]}{' …' if len(have) > 30 else ''}")


def gd_note(run: "Run") -> str | None:
    """A note for figures of GD formulas (s_i, δλ/N, 2N/λ_max; NSA §4) on a run that is not plain GD."""
    o = run.spec.optimizer
    name = o.name.value if hasattr(o.name, "value") else str(o.name)
    if LossName(run.spec.loss) is LossName.NCE and name == "gd" and o.momentum == 0:
        return ("note: 2N/λ_max, s_i and δλ/N are formulas of GD on the L2 loss (NSA §4); for NCE the "
                "residual's Jacobian is diag(σ'(h)) ≤ 1/4, so GD's bound is 2N/(λ_max·max σ') ≥ 8N/λ_max")
    if name == "gd" and o.momentum == 0:
        return None
    what = {"sgd": f"minibatch SGD (batch {o.batch_size})", "adam": "Adam"}.get(name, "GD")
    if o.momentum > 0:
        what += f" with momentum {o.momentum:g}"
    return (f"note: δλ/N, s_i and 2N/λ_max are formulas of full-batch GD without momentum (NSA §4); "
            f"this run uses {what}, so they are shown for reference only")


def add_gd_note(fig: "Figure", run: "Run") -> None:
    """Write :func:`gd_note` at the bottom of ``fig`` when it applies."""
    note = gd_note(run)
    if note:
        fig.text(0.01, 0.005, note, fontsize=7, color="crimson", ha="left", va="bottom", wrap=True)


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
