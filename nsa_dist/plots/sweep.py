"""Figures across the runs of a sweep: NSA Fig. 7a–c and any scalar against any grid field.

Each line is one grid point (e.g. depth × width); with several seeds it is the mean over them
and a shaded band of ± one standard deviation.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.plots.axes import (
    DPI,
    blank_figure,
    colors,
    energy_k,
    legend,
    readable,
    set_title,
    shared_legend,
    step_axis,
    symlog_y,
    width_axis,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from nsa_dist.client import Curve, Sweep

__all__ = [
    "SWEEP_FIGURES",
    "HESSIAN_SWEEP_FIGURES",
    "fig7a",
    "fig7b",
    "fig7c",
    "scalar_figure",
    "plot_sweep",
    "hessian_moments_figure",
    "width_convergence",
    "regimes_figure",
    "fit_slope",
    "summary_k",
]

SWEEP_FIGURES = ("fig7a_energy_y", "fig7b_train_loss", "fig7c_test_loss", "scalar_energy_y_10")
HESSIAN_SWEEP_FIGURES = (
    "hessian_moments_H",
    "hessian_moments_I",
    "hessian_moments_S",
    "hessian_width_convergence",
    "hessian_regimes",
)  # drawn for sweeps with a hessian block (width figures: a width axis)
_ALL = SWEEP_FIGURES + HESSIAN_SWEEP_FIGURES
_WIDTH = "model.width"
_STYLES = ("o-", "s--", "^:", "D-.", "v-", "P--", "X:", "*-.")  # marker and line style of the j-th line of a colour


def _figure(sweep: Sweep, label: str, what: str, ncols: int = 0, paper: str = "NSA") -> tuple[Figure, Axes]:
    fig = blank_figure((7.0 if not ncols else 4.4 * ncols, 4.6))
    seeds = "; mean ± std over seeds" if sweep.seeded else ""
    set_title(fig, f"{paper}{f' Fig. {label}' if label else ''} — {what}", f"sweep {sweep.name}{seeds}")
    return fig, (fig.subplots() if not ncols else fig.subplots(1, ncols, squeeze=False)[0])


def _lines(ax: Axes, curves: list[Curve], shift: int = 0, key: bool = True) -> None:
    """One line per grid point (mean over seeds, ± std shaded; an energy measured beyond the exact top
    with its bracket hatched) and, with ``key``, their legend (more than ~10: a colour key)."""
    cols, bracketed = colors(len(curves)), False
    for c, cv in zip(cols, curves):
        # a point with fewer than two values (a run that failed after its first step, one still at
        # its first) is a marker: a line of one point draws nothing
        few = int(np.isfinite(cv.mean).sum()) < 2
        # and up to 30 recorded steps are marked: on Fig. 7a's symlog t axis a line between t = 0 and the next
        # step filled most of the width and read as measured all along (an audit)
        marked = few or int(np.isfinite(cv.mean).sum()) <= 30
        ax.plot(cv.t + shift, cv.mean, "o-" if marked else "-", ms=4 if few else 3, lw=1.2, color=c, label=cv.label)
        if cv.n > 1:
            ax.fill_between(cv.t + shift, cv.mean - cv.std, cv.mean + cv.std, color=c, alpha=0.2, lw=0)
        if cv.bracket is not None and np.any(cv.bracket[1] > cv.bracket[0]):  # measured beyond the exact top
            ax.fill_between(
                cv.t + shift,
                cv.bracket[0],
                cv.bracket[1],
                facecolor="none",
                edgecolor=c,
                hatch="////",
                lw=0,
                alpha=0.6,
                label="bracket (quadrature)" if not bracketed else None,
            )
            bracketed = True
    ax.grid(alpha=0.3, which="both")
    if key:
        legend(ax, family=("grid point", [cv.label for cv in curves], cols))


def summary_k(sweep: Sweep, k: int = 10) -> int:
    """The k of the summary E(φ, k) across a sweep: ``k`` capped by the eigenpairs every run stores
    and kept below every run's N (at k = N every E is 1)."""
    return max(1, min(k, sweep.smallest_k(), sweep.smallest_n() - 1))


def fig7a(sweep: Sweep, k: int | None = None) -> Figure:
    """E_t(y, k) along t per grid point.  Default k: the paper's fraction of N (k = 400 of N = 10⁴)
    of the smallest N of the sweep, below it and capped at the smallest K (:func:`axes.energy_k`);
    a given ``k`` is capped at the smallest K."""
    k = energy_k(sweep.smallest_n(), sweep.smallest_k(), k)
    fig, ax = _figure(sweep, "7a", f"label energy $E_t(y, {k})$")
    _lines(ax, sweep.curves("energy_y", k))
    ax.set(xlabel="step t", ylabel=f"$E_t(y, {k})$", ylim=(-0.02, 1.02))
    step_axis(ax)
    return fig


def fig7b(sweep: Sweep) -> Figure:
    """Training loss L(θ_t) of every step per grid point (log-log against t + 1)."""
    fig, ax = _figure(sweep, "7b", "training loss")
    _lines(ax, sweep.curves("loss"), shift=1)
    ax.set(xlabel="step t + 1", ylabel=r"$L(\theta_t)$", xscale="log", yscale="log")
    return fig


def fig7c(sweep: Sweep) -> Figure:
    """Test loss (the run's loss at the test points: (1/M) Σ ½‖f_t(x_j) − y_j‖² for L2) at the recorded
    steps per grid point (log-log against t + 1)."""
    fig, ax = _figure(sweep, "7c", "test loss")
    _lines(ax, sweep.curves("loss_test"), shift=1)
    ax.set(xlabel="step t + 1", ylabel=r"$L_{test}(\theta_t)$", xscale="log", yscale="log")
    return fig


def _series(
    sweep: Sweep, df, x: str, line: str | None
) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray, list[str]]]:
    """[(label, xs, mean, std, notes)] of ``df["value"]`` (:meth:`Sweep.scalar`) against field ``x``:
    one line per value of ``line`` and of every other field the sweep varies, so that a mean is
    over the seeds of one grid point only, never pooled over a field that is not drawn.  The mean
    and std are over every run of the point (NaN when one of them has no value, NaN); ``notes``
    names, per x, the steps t of its values where they are not the frame's last step (a run that
    failed or is still running), else "" ."""
    rest = [f for f in sweep.fields if f not in (x, line)]
    by = ([line] if line else []) + rest
    groups = [((), df)] if not by else list(df.groupby(by, sort=True, dropna=False))
    last = df["step"].max() if "step" in df and len(df) else None
    out = []
    for lv, sub in groups:
        lv = lv if isinstance(lv, tuple) else (lv,)
        label = ", ".join(f"{f.split('.')[-1]}={v}" for f, v in zip(by, lv)) or "all"
        xs, means, stds, notes = [], [], [], []
        for xv, pt in sub.groupby(x, sort=True, dropna=False):
            v = pt["value"].to_numpy(np.float64)
            xs.append(xv)
            means.append(v.mean() if len(v) else np.nan)
            stds.append(v.std() if len(v) else np.nan)
            steps = sorted(set(pt["step"].tolist())) if last is not None else []
            notes.append("" if steps in ([], [last]) else "t = " + ", ".join(str(t) for t in steps))
        out.append((label, np.asarray(xs), np.asarray(means), np.asarray(stds), notes))
    return out


def scalar_figure(
    sweep: Sweep, name: str, x: str, line: str | None = None, k: int | None = None, step: int | None = None
) -> Figure:
    """Quantity ``name`` at ``step`` (default the last) against grid field ``x``, one line per
    value of field ``line`` and of each other field the sweep varies (a mean is never pooled over
    a field); error bars ± std over seeds (mean and std over every seed: NaN where one has no
    value, NaN).  At the last step, a point whose runs end earlier (failed, still running) is
    marked with the t of its value.

    Raises:
        ValueError: ``x`` or ``line`` is not a field the sweep varies (they are listed).
    """
    for f in (x, line):
        if f is not None and f not in sweep.fields:
            raise ValueError(f"{f!r} is not a field sweep {sweep.name!r} varies; its fields: {', '.join(sweep.fields)}")
    df = sweep.scalar(name, k, step)
    what = f"{name}" + (f"(k={k})" if k else "") + (f" at t = {step}" if step is not None else " at the last step")
    fig, ax = _figure(sweep, "", what + " across the sweep (a summary, no figure of the paper)")
    series = _series(sweep, df, x, line)
    cols, labels = colors(len(series)), [label if label != "all" else name for label, *_ in series]
    for c, label, (_, xs, mean, std, notes) in zip(cols, labels, series):
        ax.errorbar(xs, mean, yerr=std, fmt="o-", ms=4, capsize=3, color=c, label=label)
        for xv, yv, note in zip(xs, mean, notes):
            if note and np.isfinite(yv):
                ax.annotate(note, (xv, yv), textcoords="offset points", xytext=(4, 4), fontsize=7, color=c)
    ax.set(xlabel=x, ylabel=what)
    xs_all = np.concatenate([np.asarray(xs) for _, xs, *_ in series]) if series else np.array([])
    if xs_all.dtype.kind in "iu" or (xs_all.dtype.kind == "f" and np.all(xs_all == np.round(xs_all))):
        ax.set_xticks(np.unique(xs_all))  # an integer field (depth, width): its values, not 2.0, 2.2, …
    ax.grid(alpha=0.3)
    legend(ax, family=(line or name, labels, cols))
    return fig


# --------------------------------------------------------------------------- the Hessian paper


def hessian_moments_figure(sweep: Sweep, part: str = "S") -> Figure:
    """Tr(A^k), k = 1..4, of A = ``part`` ("H", "I", "S", "I_exact", "I_limit") along t per grid
    point: mean ± std over the seeds (symlog y: Tr(S^k) changes sign)."""
    one_step = all(len(c.t) == 1 for c in sweep.curves(f"hessian_{part}", 1))
    what = f"moments Tr$({part}^k)$" + (
        f" at t = {sweep.curves(f'hessian_{part}', 1)[0].t[0]:d}, per grid point" if one_step else " along training"
    )
    fig, axes = _figure(sweep, "1", what, ncols=4, paper="Hessian paper")
    for k, ax in enumerate(axes, start=1):
        curves = sweep.curves(f"hessian_{part}", k)
        if one_step:  # one analysed step (e.g. initialisation): each grid point's seeds and their mean ± std
            _points(ax, sweep, curves, f"hessian_{part}", k)
        else:
            _lines(ax, curves, key=k == 1)  # one key for the four panels
            for line in ax.lines:
                line.set_marker("o")
                line.set_markersize(3)
            ax.set(xlabel="step t")
            step_axis(ax)
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_title(f"Tr$({part}^{k})$")
        symlog_y(ax, np.concatenate([c.mean for c in curves]))
        if k > 1 and ax.get_legend():
            ax.get_legend().remove()
    shared_legend(fig, axes[0])
    return fig


def _points(ax: Axes, sweep: Sweep, curves: list[Curve], name: str, k: int) -> None:
    """One column per grid point: every seed's value (dots) and the mean ± std (error bar)."""
    df = sweep.scalar(name, k, step=int(curves[0].t[0]))
    for x, (c, cv) in enumerate(zip(colors(len(curves)), curves)):
        sub = df
        for f, v in cv.key.items():  # a field this point's spec does not set is None in the key, NaN in df
            sub = sub[sub[f].isna()] if v is None else sub[sub[f] == v]
        ax.plot(np.full(len(sub), x) + np.linspace(-0.15, 0.15, len(sub)), sub["value"], ".", color=c, alpha=0.6)
        ax.errorbar([x], cv.mean, yerr=cv.std, fmt="o", ms=6, capsize=4, color=c, label=cv.label)
    ax.set_xticks(
        range(len(curves)), [", ".join(str(v) for v in cv.key.values()) for cv in curves], rotation=20, fontsize=8
    )
    ax.grid(alpha=0.3)
    legend(ax)


def fit_slope(x: np.ndarray, y: np.ndarray) -> float:
    """The least-squares slope of log y against log x over the finite, positive pairs (NaN with < 2)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    return float(np.polyfit(np.log(x[ok]), np.log(y[ok]), 1)[0]) if ok.sum() >= 2 else float("nan")


def _by_width(sweep: Sweep, name: str, k: int | None, step: int | None, line: str | None):
    """[(label, widths, mean, std)] of quantity ``name`` over ``model.width`` (seeds pooled), one
    line per value of ``line`` and of each other field the sweep varies."""
    df = sweep.scalar(name, k, step)
    return [
        (label, np.asarray(w, np.float64), mean, std) for label, w, mean, std, _ in _series(sweep, df, _WIDTH, line)
    ]


def width_convergence(sweep: Sweep, step: int = 0, orders: tuple[int, ...] = (1, 2)) -> Figure:
    """Relative error of the measured Tr(I^k) against its Θ∞ limit over ``model.width`` at ``step``
    (default initialisation), log-log, mean ± std over seeds, with the fitted slope (the
    fluctuations of the NTK are O(1/√w): slope ≈ −1/2)."""
    if _WIDTH not in sweep.fields:
        raise ValueError(f"sweep {sweep.name!r} does not vary {_WIDTH} (its fields: {', '.join(sweep.fields)})")
    fig, ax = _figure(sweep, "", f"width convergence of I to its limit at t = {step}", paper="Hessian paper")
    skipped: list[str] = []  # grid points without a limit of I (regime: active, a factory model): not drawn
    for c, k in zip(colors(len(orders)), orders):
        # one colour per order; the lines of one order (one per value of each other field the sweep
        # varies) told apart by their marker and line style, so that each legend entry names one line
        for j, (lab, w, mean, std) in enumerate(_by_width(sweep, "hessian_I_error", k, step, None)):
            if not np.isfinite(np.asarray(mean, np.float64)).any():  # no limit there (the active regime)
                skipped.append(lab)
                continue
            slope = fit_slope(w, mean)
            ax.errorbar(
                w,
                mean,
                yerr=std,
                fmt=_STYLES[j % len(_STYLES)],
                ms=4,
                capsize=3,
                color=c,
                label=f"|Tr(I^{k}) − limit| / limit{'' if lab == 'all' else f' ({lab})'}: slope {slope:+.2f}",
            )
    if len(ax.lines):  # anchored at the first drawn point of the first line, over the widths drawn
        w = np.asarray(ax.lines[0].get_xdata(), np.float64)
        y = np.asarray(ax.lines[0].get_ydata(), np.float64)
        ok = np.isfinite(w) & np.isfinite(y) & (w > 0) & (y > 0)
        if ok.any():
            w, y0 = w[ok], y[ok][0]
            ax.plot(w, y0 * np.sqrt(w[0] / w), "k:", lw=1, label=r"$\propto w^{-1/2}$")
    ax.set(xlabel="width w", ylabel="relative error", yscale="log")
    width_axis(ax, [w for line in ax.lines for w in np.asarray(line.get_xdata(), np.float64)])
    ax.grid(alpha=0.3, which="both")
    if skipped:
        ax.text(
            0.01,
            0.01,
            f"not drawn, no limit of I there: {', '.join(sorted(set(skipped)))}",
            transform=ax.transAxes,
            fontsize=7,
            va="bottom",
        )
    legend(ax)
    return fig


def regimes_figure(sweep: Sweep, step: int = 0) -> Figure:
    """The consequences of Proposition 4 over ``model.width`` at ``step``: Tr(S²)/Tr(I²) (grows ~w
    in the active regime, bounded in the NTK regime), ‖S‖_op (→ 0 in the NTK regime, not vanishing in
    the active one) and ‖S‖_F (finite at initialisation); one line per ``model.regime`` when the sweep
    varies it.  The norms are of the Hessian the paper compares: the stored loss Hessian in the NTK
    regime, w times it in the active regime ("the scaling of the learning rate essentially multiplies
    the whole Hessian by w": drawn as stored, an active ‖S‖_op that should not vanish fell like
    w^(-1/2), an audit) — the ratio is the same either way."""
    if _WIDTH not in sweep.fields:
        raise ValueError(f"sweep {sweep.name!r} does not vary {_WIDTH} (its fields: {', '.join(sweep.fields)})")
    line = "model.regime" if "model.regime" in sweep.fields else None
    fig, axes = _figure(sweep, "", f"NTK vs active regime over width at t = {step}", ncols=3, paper="Hessian paper")
    panels = (
        ("hessian_S_ratio", "Tr(S²) / Tr(I²)"),
        ("hessian_S_op", r"$\Vert S\Vert_{op}$ (active: of $w\,H$)"),
        ("hessian_S_fro", r"$\Vert S\Vert_F$ (active: of $w\,H$)"),
    )
    for ax, (name, label) in zip(axes, panels):
        df = sweep.scalar(name, None, step)
        if name != "hessian_S_ratio":  # the active regime's lr × w: the paper's Hessian is w·H
            df = sweep.as_the_paper_scales(df)
        series = [(lb, np.asarray(w, np.float64), m, sd) for lb, w, m, sd, _ in _series(sweep, df, _WIDTH, line)]
        for c, (lv, w, mean, std) in zip(colors(len(series)), series):
            ax.errorbar(
                w,
                mean,
                yerr=std,
                fmt="o-",
                ms=4,
                capsize=3,
                color=c,
                label=f"{lv}: slope {fit_slope(w, mean):+.2f}",
            )
        ax.set(xlabel="width w", title=label, yscale="log")
        width_axis(ax, [w for _lv, ws, _m, _s in series for w in ws])
        ax.grid(alpha=0.3, which="both")
        legend(ax, below=True)
    return fig


def plot_sweep(
    sweep: Sweep, out_dir: str | Path, *, figures: Iterable[str] | None = None, k: int | None = None
) -> list[Path]:
    """Write ``<out_dir>/<name>.png`` for the sweep figures (default all of :data:`SWEEP_FIGURES` and
    :data:`HESSIAN_SWEEP_FIGURES`).

    "fig7a_energy_y" is E_t(y, k) at ``k`` (default the paper's fraction of N, :func:`fig7a`).
    "scalar_energy_y_10" is the final E(y, 10) (:func:`summary_k`: below N) against the first varied
    field, one line per value of the second (if any).  "hessian_moments_<A>": Tr(A^k) along t (mean ± std over seeds);
    "hessian_width_convergence" and "hessian_regimes": against ``model.width`` at initialisation.
    Figures a sweep cannot draw (no test points: 7c; no Hessian block; no width axis) are skipped,
    with a warning saying why for Fig. 7c and for each figure named in ``figures``.  What a sweep can
    draw is decided from every finished run: a figure some grid points record (a variant with test
    points or a ``hessian:`` block) is drawn from those, with a warning naming the points it leaves out.
    """
    names = list(_ALL if figures is None else figures)
    bad = [n for n in names if n not in _ALL]
    if bad:
        raise ValueError(f"unknown sweep figure(s) {', '.join(bad)}; allowed: {', '.join(_ALL)}")
    if not sweep.groups():
        raise ValueError(f"sweep {sweep.name!r} has no run with a finished recorded step: nothing to plot")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    missing = sweep.unfinished_points()
    if missing:  # never a grid point silently absent from every figure
        said = "; ".join(", ".join(f"{f.split('.')[-1]}={v}" for f, v in p.items()) or "all" for p in missing)
        logging.getLogger("nsa_dist.plots").warning(
            "sweep %r: %d grid point(s) without a finished recorded step left out of every figure: %s",
            sweep.name,
            len(missing),
            said,
        )
    from nsa_dist.client import records

    # what the sweep can draw, from every finished run: a grid point (a variant) without test points
    # or without a hessian: block neither hides the figure from the others nor breaks it
    runs = [sweep.run(rid) for _, ids in sweep.groups() for rid in ids]
    hess = any(records(r, "hessian_H") for r in runs)
    wide = hess and _WIDTH in sweep.fields
    limits = wide and any(
        records(r, "hessian_I_limit") and np.isfinite(r.hessian.moments("I_limit")["estimate"]).any() for r in runs
    )
    draw = {
        "hessian_moments_H": lambda: hessian_moments_figure(sweep, "H") if hess else None,
        "hessian_moments_I": lambda: hessian_moments_figure(sweep, "I") if hess else None,
        "hessian_moments_S": lambda: hessian_moments_figure(sweep, "S") if hess else None,
        "hessian_width_convergence": lambda: width_convergence(sweep) if limits else None,
        "hessian_regimes": lambda: (
            regimes_figure(sweep) if wide and any(records(r, "hessian_S_op") for r in runs) else None
        ),
        "fig7a_energy_y": lambda: fig7a(sweep, k),
        "fig7b_train_loss": lambda: fig7b(sweep),
        "fig7c_test_loss": lambda: fig7c(sweep) if any(records(r, "loss_test") for r in runs) else None,
        "scalar_energy_y_10": lambda: (
            scalar_figure(
                sweep,
                "energy_y",
                sweep.fields[0],
                sweep.fields[1] if len(sweep.fields) > 1 else None,
                k=summary_k(sweep),
            )
            if sweep.fields
            else None
        ),
    }
    over = (
        "its runs record no Hessian (the spec's hessian block)"
        if not hess
        else f"it does not vary {_WIDTH}"
        if not wide
        else None
    )
    why = {
        **dict.fromkeys(HESSIAN_SWEEP_FIGURES, over),
        "hessian_width_convergence": over or "its runs record no Θ∞ limit of Tr(I^k)",
        "hessian_regimes": over or "its runs record no ‖S‖_op",
        "fig7c_test_loss": "its runs have no test points (data.n_test)",
        "scalar_energy_y_10": "it varies no field",
    }
    reads = {
        **{f"hessian_moments_{p}": f"hessian_{p}" for p in "HIS"},
        "hessian_width_convergence": "hessian_I_limit",
        "hessian_regimes": "hessian_S_op",
        "fig7c_test_loss": "loss_test",
    }
    written = []
    for name in names:
        fig = draw[name]()
        if fig is not None:
            path = out / f"{name}.png"
            readable(fig).savefig(path, dpi=DPI)
            written.append(path)
            lacking = sweep.lacking(reads[name]) if name in reads else []
            if lacking:  # never a grid point silently absent from a figure
                said = "; ".join(", ".join(f"{f.split('.')[-1]}={v}" for f, v in p.items()) or "all" for p in lacking)
                logging.getLogger("nsa_dist.plots").warning(
                    "sweep %r: %s leaves out %d grid point(s) whose runs do not record %s: %s",
                    sweep.name,
                    name,
                    len(lacking),
                    reads[name],
                    said,
                )
        elif figures is not None or name == "fig7c_test_loss":
            logging.getLogger("nsa_dist.plots").warning("sweep %r: %s not drawn: %s", sweep.name, name, why[name])
    return written
