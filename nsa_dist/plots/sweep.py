"""Figures across the runs of a sweep: NSA Fig. 7a–c and any scalar against any grid field.

Each line is one grid point (e.g. depth × width); with several seeds it is the mean over them
and a shaded band of ± one standard deviation.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import numpy as np

from nsa_dist.plots._axes import DPI, colors

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from nsa_dist.sweep_view import Curve, Sweep

__all__ = ["SWEEP_FIGURES", "fig7a", "fig7b", "fig7c", "scalar_figure", "plot_sweep"]

SWEEP_FIGURES = ("fig7a_energy_y", "fig7b_train_loss", "fig7c_test_loss", "scalar_energy_y_10")


def _figure(sweep: "Sweep", label: str, what: str) -> tuple["Figure", "Axes"]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    seeds = "; mean ± std over seeds" if sweep.seeded else ""
    fig.suptitle(f"NSA Fig. {label} — {what}\nsweep {sweep.name}{seeds}", fontsize=11)
    return fig, fig.subplots()


def _lines(ax: "Axes", curves: list["Curve"], shift: int = 0) -> None:
    for c, cv in zip(colors(len(curves)), curves):
        ax.plot(cv.t + shift, cv.mean, "-", lw=1.2, color=c, label=cv.label)
        if cv.n > 1:
            ax.fill_between(cv.t + shift, cv.mean - cv.std, cv.mean + cv.std, color=c, alpha=0.2, lw=0)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, ncol=2 if len(curves) > 6 else 1)


def fig7a(sweep: "Sweep", k: int = 400) -> "Figure":
    """E_t(y, k) along t per grid point (the paper: k = 400; capped at the smallest K of the sweep)."""
    k = min(k, sweep.smallest_k())
    fig, ax = _figure(sweep, "7a", f"label energy $E_t(y, {k})$")
    _lines(ax, sweep.curves("energy_y", k))
    ax.set(xlabel="step t", ylabel=f"$E_t(y, {k})$", xscale="symlog", ylim=(-0.02, 1.02))
    return fig


def fig7b(sweep: "Sweep") -> "Figure":
    """Training loss L(θ_t) of every step per grid point (log-log against t + 1)."""
    fig, ax = _figure(sweep, "7b", "training loss")
    _lines(ax, sweep.curves("loss"), shift=1)
    ax.set(xlabel="step t + 1", ylabel=r"$L(\theta_t)$", xscale="log", yscale="log")
    return fig


def fig7c(sweep: "Sweep") -> "Figure":
    """Test loss (the run's loss at the test points: (1/M) Σ ½‖f_t(x_j) − y_j‖² for L2) at the recorded
    steps per grid point (log-log against t + 1)."""
    fig, ax = _figure(sweep, "7c", "test loss")
    _lines(ax, sweep.curves("loss_test"), shift=1)
    ax.set(xlabel="step t + 1", ylabel=r"$L_{test}(\theta_t)$", xscale="log", yscale="log")
    return fig


def scalar_figure(sweep: "Sweep", name: str, x: str, line: str | None = None, k: int | None = None,
                  step: int | None = None) -> "Figure":
    """Quantity ``name`` at ``step`` (default the last) against grid field ``x``, one line per
    value of field ``line``; error bars ± std over seeds.

    Raises:
        ValueError: ``x`` or ``line`` is not a field the sweep varies (they are listed).
    """
    for f in (x, line):
        if f is not None and f not in sweep.fields:
            raise ValueError(f"{f!r} is not a field sweep {sweep.name!r} varies; its fields: {', '.join(sweep.fields)}")
    df = sweep.scalar(name, k, step)
    what = f"{name}" + (f"(k={k})" if k else "") + (f" at t = {step}" if step is not None else " at the last step")
    fig, ax = _figure(sweep, "7 (summary)", what)
    groups = [(None, df)] if line is None else list(df.groupby(line, sort=True))
    for c, (lv, sub) in zip(colors(len(groups)), groups):
        g = sub.groupby(x, sort=True)["value"]
        mean, std = g.mean(), g.std(ddof=0).fillna(0.0)
        ax.errorbar(mean.index.to_numpy(), mean.to_numpy(), yerr=std.to_numpy(), fmt="o-", ms=4, capsize=3, color=c,
                    label=f"{line.split('.')[-1]}={lv}" if line else name)
    ax.set(xlabel=x, ylabel=what)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_sweep(sweep: "Sweep", out_dir: str | Path, *, figures: Iterable[str] | None = None, k: int = 400) -> list[Path]:
    """Write ``<out_dir>/<name>.png`` for the sweep figures (default all of :data:`SWEEP_FIGURES`).

    "scalar_energy_y_10" is the final E(y, 10) against the first varied field, one line per value
    of the second (if any).  Figures a sweep cannot draw (no test points: 7c) are skipped.
    """
    names = list(SWEEP_FIGURES if figures is None else figures)
    bad = [n for n in names if n not in SWEEP_FIGURES]
    if bad:
        raise ValueError(f"unknown sweep figure(s) {', '.join(bad)}; allowed: {', '.join(SWEEP_FIGURES)}")
    if not sweep.groups():
        raise ValueError(f"sweep {sweep.name!r} has no run with a finished recorded step: nothing to plot")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    first = sweep.run(sweep.groups()[0][1][0])
    draw = {"fig7a_energy_y": lambda: fig7a(sweep, k), "fig7b_train_loss": lambda: fig7b(sweep),
            "fig7c_test_loss": lambda: fig7c(sweep) if first.has("loss_test") else None,
            "scalar_energy_y_10": lambda: scalar_figure(sweep, "energy_y", sweep.fields[0],
                                                        sweep.fields[1] if len(sweep.fields) > 1 else None,
                                                        k=min(10, sweep.smallest_k())) if sweep.fields else None}
    written = []
    for name in names:
        fig = draw[name]()
        if fig is not None:
            path = out / f"{name}.png"
            fig.savefig(path, dpi=DPI)
            written.append(path)
    return written
