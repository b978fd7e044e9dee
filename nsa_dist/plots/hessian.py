"""The loss Hessian H = I + S along training (the Hessian paper, Jacot et al.).

Titles follow the paper: its figure number where it has the figure (Fig. 1: the moments of I and
S along training; Fig. 3: the mutual orthogonality of I and S), else the statement drawn
(Theorem 1, Proposition 4 and its consequences, the kernel PCA of I).  :data:`TITLES` is the
table the figures use (and the test checks against the paper).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.plots.axes import (
    colors,
    density_note,
    density_on_log_axis,
    family_label,
    footnote,
    legend,
    new_figure,
    some_steps,
    symlog_y,
    time_axis,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from nsa_dist.client import Run

_PAPER = "Hessian paper"
TITLES: dict[str, str] = {  # figure function → the paper's figure number or statement
    "moments": "1",
    "orthogonality": "3",
    "rayleigh": "3",
    "trace_S": "Proposition 4",
    "S_norms": "Proposition 4, consequence 2",
    "additivity": "Theorem 1",
    "I_spectrum": "§ the matrix I (kernel PCA of Θ∞)",
    "density": "§ the matrix I (a few large eigenvalues, a bulk)",
    "edge_of_stability": "",  # not in the paper: GD's stability bound on λ_max(H)
}


def moments(run: Run) -> Figure:
    """Fig. 1: Tr(A^k), k = 1..4, for A = H, I, S along t with ±1 standard error, the exact Tr(I^k),
    the infinite-width prediction of Tr(I^k) from Θ∞ and the limits of S: E[Tr S_t] (MSE GD) in
    the k = 1 panel, Tr(S²) = ∇CᵀΥ̃∇C in the k = 2 panel (NTK-parametrised FC runs)."""
    fig, axes = new_figure(
        run, TITLES["moments"], r"moments Tr$(A^k)$ of H = I + S", 1, 4, panel=(4.2, 4.0), paper=_PAPER
    )
    S_lim = run.hessian.S_limit() if run.has("hessian_S_limit") else None
    t = run.hessian.steps
    exact = run.hessian.moments("I_exact")["estimate"]
    for k, ax in enumerate(axes[0]):
        for part, c in zip("HIS", colors(3)):
            m = run.hessian.moments(part)
            ax.errorbar(
                t,
                m["estimate"][:, k],
                yerr=m["stderr"][:, k],
                fmt="o-",
                ms=3,
                color=c,
                capsize=2,
                label=f"{part} (Hutch++, ±1 s.e.)",
            )
        # markers on every line: a run with one analysed step draws points, not lines of one point
        ax.plot(t, exact[:, k], "kx--", ms=5, lw=1, label="I exact (NTK Gram)")
        if run.has("hessian_I_limit_moments"):
            lim = run.hessian.moments("I_limit")["estimate"][:, k]
            if np.isfinite(lim).any():
                ax.plot(t, lim, "d:", ms=4, color="C3", lw=1.6, label=r"I limit ($\Theta_\infty$, kernel PCA)")
        if S_lim is not None and k < 2:
            pred = S_lim["trace_S" if k == 0 else "trace_S2"]
            if np.isfinite(pred).any():
                label = r"S limit: E[Tr $S_t$] (MSE GD)" if k == 0 else r"S limit: $\nabla C^T\tilde\Upsilon\nabla C$"
                ax.plot(t, pred, "v-.", ms=4, color="C2", lw=1.6, label=label)
                legend(ax, fontsize=7)
        ax.set_title(f"Tr$(A^{{{k + 1}}})$", fontsize=10)
        symlog_y(ax, np.concatenate([ln.get_ydata() for ln in ax.get_lines()]))
        time_axis(ax, run, "trace" if k == 0 else "", legend=k == 0)
    return fig


def orthogonality(run: Run) -> Figure:
    """Fig. 3: ‖IS‖_F / (‖I‖_F ‖S‖_F) along t, the mutual orthogonality of I and S."""
    fig, ax = new_figure(run, TITLES["orthogonality"], "orthogonality of I and S", paper=_PAPER)
    ax, o = ax[0, 0], run.hessian.orthogonality
    ax.errorbar(
        run.hessian.steps,
        o["value"],
        yerr=o["stderr"],
        fmt="o-",
        ms=3,
        capsize=2,
        label=r"$\Vert IS\Vert_F / (\Vert I\Vert_F\Vert S\Vert_F)$",
    )
    time_axis(ax, run, r"normalised $\Vert IS\Vert_F$")
    return fig


def rayleigh(run: Run) -> Figure:
    """Fig. 3: vᵀIv and vᵀSv over the top eigenvectors of I (left) and of S (right), at the last analysed step."""
    step = int(run.hessian.steps[-1])
    R = run.hessian.rayleigh(step)
    fig, axes = new_figure(run, TITLES["rayleigh"], f"Rayleigh quotients at t = {step}", 1, 2, paper=_PAPER)
    for ax, key, name in ((axes[0, 0], "I", "I"), (axes[0, 1], "S", "S")):
        i = np.arange(1, R[key].shape[1] + 1)
        ax.plot(i, R[key][0], "o-", ms=3, label=r"$v^T I v$")
        ax.plot(i, R[key][1], "s-", ms=3, label=r"$v^T S v$")
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set(xlabel=f"eigenvector i of {name}", ylabel="Rayleigh quotient", title=f"along eigenvectors of {name}")
        ax.grid(alpha=0.3)
        legend(ax)
    return fig


def edge_of_stability(run: Run) -> Figure:
    """λ_max(H)·δ_t / 2 along t against 1 (GD on the local quadratic is stable below 1)."""
    fig, ax = new_figure(
        run,
        TITLES["edge_of_stability"],
        r"edge of stability $\lambda_{max}(H)\cdot\delta/2$ (not a paper figure)",
        paper=_PAPER,
    )
    ax = ax[0, 0]
    ax.plot(run.hessian.steps, run.hessian.edge_of_stability(), "o-", ms=3, label=r"$\lambda_{max}(H)\,\delta_t / 2$")
    ax.axhline(1.0, color="C3", ls="--", label="1 (edge of stability)")
    time_axis(ax, run, r"$\lambda_{max}(H)\,\delta_t / 2$")
    return fig


def density(run: Run) -> Figure:
    """SLQ spectral density of H at a few analysed steps (log y)."""
    fig, ax = new_figure(run, TITLES["density"], "spectral density of H (stochastic Lanczos quadrature)", paper=_PAPER)
    ax, steps = ax[0, 0], run.hessian.steps
    pick = some_steps(len(steps), 4)
    hidden = total = 0
    for j, c in zip(pick, colors(len(pick))):
        grid, dens = run.hessian.density(int(steps[j]))
        drawn, low = density_on_log_axis(dens)
        hidden, total = hidden + low, total + len(drawn)
        ax.plot(grid, drawn, color=c, label=family_label("t", steps[j]))
    ax.set(xlabel="eigenvalue of H", ylabel="density", yscale="log")
    ax.grid(alpha=0.3)
    legend(ax)
    if hidden:
        footnote(fig, density_note(hidden, total))
    return fig


def I_spectrum(run: Run) -> Figure:
    """The spectrum of I (outside its null space) measured at a few analysed steps beside the kernel
    PCA of Θ∞ (the paper's limit, weighted by HC) on the same axes."""
    fig, ax = new_figure(run, TITLES["I_spectrum"], "eigenvalues of I: measured vs the Θ∞ limit", paper=_PAPER)
    ax, steps = ax[0, 0], run.hessian.steps
    mu, lim = run.hessian.I_eigenvalues(), run.hessian.I_eigenvalues(limit=True)
    pick = some_steps(len(steps), 3)
    i = np.arange(1, mu.shape[1] + 1)
    drawn, null = None, 0
    for j, c in zip(pick, colors(len(pick))):
        # I's null space (N·K > rank) holds eigenvalues at rounding of either sign: not drawn (they
        # were clipped to 10⁻¹⁶ and drawn as values — an audit); the footnote counts them
        floor = 4 * mu.shape[1] * np.finfo(np.float64).eps * np.nanmax(np.abs(mu[j]), initial=0.0)
        shown = np.where(mu[j] > floor, mu[j], np.nan)
        null = max(null, int(np.sum(np.isfinite(mu[j]) & ~(mu[j] > floor))))
        ax.plot(i, shown, "o-", ms=2.5, lw=1, color=c, label=f"measured, t = {steps[j]}")
        if np.isfinite(lim[j]).any() and (drawn is None or not np.allclose(lim[j], drawn)):  # MSE: one limit for all t
            same = np.allclose(lim[pick], lim[j])
            ax.plot(
                i,
                np.where(lim[j] > 0, lim[j], np.nan),
                "--",
                lw=1.2,
                color="k" if same else c,
                label="limit (Θ∞ kernel PCA)" if same else f"limit (Θ∞), t = {steps[j]}",
            )
            drawn = lim[j]
    ax.set(xlabel="index i", ylabel=r"$\lambda_i(I)$", xscale="log", yscale="log")
    ax.grid(alpha=0.3, which="both")
    legend(ax)
    if null:
        said = f"up to {null} of the {mu.shape[1]} eigenvalues are I's null space (rounding, ≤ 4·n·eps·λ_1)"
        footnote(fig, said + ": not drawn")
    return fig


def additivity(run: Run) -> Figure:
    """Theorem 1: the gap Tr(H^k) − Tr(I^k) − Tr(S^k) relative to Tr(H^k), k = 1..4, ± its standard error."""
    fig, axes = new_figure(
        run,
        TITLES["additivity"],
        r"additivity: (Tr $H^k$ − Tr $I^k$ − Tr $S^k$) / Tr $H^k$",
        1,
        4,
        panel=(4.2, 4.0),
        paper=_PAPER,
    )
    t, g = run.hessian.steps, run.hessian.additivity()
    H = run.hessian.moments("H")["estimate"]
    for k, ax in enumerate(axes[0]):
        with np.errstate(all="ignore"):
            rel, se = g["estimate"][:, k] / np.abs(H[:, k]), g["stderr"][:, k] / np.abs(H[:, k])
        ax.errorbar(t, rel, yerr=se, fmt="o-", ms=3, capsize=2, label=r"gap / |Tr$(H^k)$|")
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_title(f"k = {k + 1}", fontsize=10)
        time_axis(ax, run, "relative gap" if k == 0 else "", legend=k == 0)
        if ax.get_yscale() == "linear":  # gaps clustered away from 0 read as "+1.2e-3" above the axis (Audit V)
            ax.ticklabel_format(axis="y", useOffset=False)
    return fig


def trace_S(run: Run) -> Figure:
    """Proposition 4: Tr(S) two independent ways, ∇Cᵀ·G (per-point traces of the model Hessian) and
    Hutch++ on S, with their standard errors, beside the limits: E[Tr S] at initialisation
    (MSE: K Tr(Φ̃)/N, a marker at t = 0) and E[Tr S_t] along GD (MSE, Theorem 1)."""
    fig, ax = new_figure(run, TITLES["trace_S"], r"Tr(S) = ∇Cᵀ·G against Hutch++ and the limits", paper=_PAPER)
    ax, t, tr = ax[0, 0], run.hessian.steps, run.hessian.trace_S()
    ax.errorbar(t, tr["G"], yerr=tr["G_stderr"], fmt="o-", ms=3, capsize=2, label=r"$\nabla C^T G$ (probes)")
    ax.errorbar(t, tr["hutchpp"], yerr=tr["hutchpp_stderr"], fmt="s--", ms=3, capsize=2, label="Hutch++ on S")
    if run.has("hessian_S_limit"):
        lim = run.hessian.S_limit()
        if np.isfinite(lim["trace_S"]).any():
            ax.plot(t, lim["trace_S"], "-.", color="C2", lw=1.6, label=r"limit E[Tr $S_t$] (MSE GD)")
        if np.isfinite(lim["trace_S_init"]).any():
            ax.plot(
                [0],  # at initialisation, whichever step the Hessian was first analysed at
                [lim["trace_S_init"][0]],
                "*",
                color="C3",
                ms=11,
                label=r"limit E[Tr S] at init = K Tr$(\tilde\Phi)$/N",
            )
    ax.axhline(0, color="0.5", lw=0.8)
    time_axis(ax, run, "Tr(S)")
    return fig


def S_norms(run: Run) -> Figure:
    """‖S‖_op (Lanczos) beside the bounds Tr(S^k)^{1/k}, k = 2 (‖S‖_F) and 4: the paper's
    consequence 2 (‖S‖_op → 0 with width while ‖S‖_F stays finite)."""
    fig, ax = new_figure(
        run, TITLES["S_norms"], r"$\Vert S\Vert_{op}$ ≤ Tr$(S^4)^{1/4}$ ≤ $\Vert S\Vert_F$", paper=_PAPER
    )
    ax, t, n = ax[0, 0], run.hessian.steps, run.hessian.S_norms()
    ax.plot(t, n["op"], "o-", ms=3, label=r"$\Vert S\Vert_{op}$")
    ax.errorbar(
        t, n["k4"], yerr=n["k4_stderr"], fmt="s--", ms=3, capsize=2, label=r"Tr$(S^4)^{1/4}$ (Hutch++, ±1 s.e.)"
    )
    ax.errorbar(
        t,
        n["k2"],
        yerr=n["k2_stderr"],
        fmt="^--",
        ms=3,
        capsize=2,
        label=r"$\Vert S\Vert_F$ = Tr$(S^2)^{1/2}$ (±1 s.e.)",
    )
    if run.has("hessian_S_limit") and np.isfinite(run.hessian.S_limit()["trace_S2"]).any():
        ax.plot(
            t,
            np.sqrt(np.clip(run.hessian.S_limit()["trace_S2"], 0, None)),
            ":",
            color="C2",
            lw=1.6,
            label=r"limit $(\nabla C^T\tilde\Upsilon\nabla C)^{1/2}$",
        )
    ax.set_yscale("log")
    time_axis(ax, run, "norm of S")
    return fig
