"""Training dynamics along t: first-order accuracy (NSA Fig. 1d), δ_t vs its bound (1e), the loss."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.plots.axes import add_gd_note, decay_lines, legend, lr_steps, new_figure, time_axis

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from nsa_dist.client import Run


def fig1d(run: Run) -> Figure:
    """error_t = ‖df̃_t − df̄_t‖ / ‖df̃_t‖ and cos α_t along t; df̄_t = −(δ_t/N) G_t m_t (NSA Eq. 3)."""
    fig, ax = new_figure(run, "1d", "accuracy of the first-order dynamics")
    ax, t, fo = ax[0, 0], run.steps, run.first_order
    ax.plot(
        t, fo["error"], "o-", ms=3, label=r"$error_t = \Vert d\tilde f_t - d\bar f_t\Vert \,/\, \Vert d\tilde f_t\Vert$"
    )
    ax.plot(t, fo["cos"], "s-", ms=3, label=r"$\cos\alpha_t$ (angle of $d\tilde f_t$, $d\bar f_t$)")
    time_axis(ax, run, "value")
    return fig


def fig1e(run: Run) -> Figure:
    """Learning rate δ_t and its stability bound 2N / λ_max^t along t (log y).  δ_t is the schedule's,
    piecewise constant between its decays, so it is drawn as steps (markers: the recorded values)."""
    fig, ax = new_figure(run, "1e", "learning rate and its stability bound")
    ax, t = ax[0, 0], run.steps
    ts, lr = lr_steps(run, int(t[-1]))
    (line,) = ax.plot(ts, lr, "-", drawstyle="steps-post", label=r"$\delta_t$")
    ax.plot(t, run.lr, "o", ms=3, color=line.get_color())
    kernel = r" (full $NK{\times}NK$ kernel)" if run.Ko > 1 else ""
    ax.plot(t, run.stability_bound(), "s-", ms=3, label=r"$2N / \lambda_{max}^t$" + kernel)
    time_axis(ax, run, "learning rate", logy=True)
    add_gd_note(fig, run)
    return fig


def loss(run: Run) -> Figure:
    """L(θ_t) of every training step (log-log, against t + 1) with the recorded steps as markers."""
    fig, ax = new_figure(run, "7b (this run)", "training loss")
    ax, trace = ax[0, 0], run.loss_trace  # (T,), NaN where not trained yet
    t = np.arange(len(trace)) + 1
    ax.plot(t, trace, lw=1.0, label=r"$L(\theta_t)$, every step")
    ax.plot(run.steps + 1, run.train_loss, "o", ms=4, label="recorded steps")
    at = run.failed_step
    if at is not None and 0 <= at < len(trace) and not np.isfinite(trace[at]) and "diverged" in (run.reason or ""):
        # a log axis draws no inf or NaN: the step where training diverged is marked instead
        ax.axvline(at + 1, color="C3", ls="--", lw=1.0, label=f"diverged at t = {at} (loss = {trace[at]:g})")
    decay_lines(ax, run, float(len(trace) - 1), shift=1)
    ax.set(xscale="log", yscale="log", xlabel="step t + 1", ylabel=r"loss $L(\theta_t)$")
    ax.grid(alpha=0.3)
    legend(ax)
    return fig
