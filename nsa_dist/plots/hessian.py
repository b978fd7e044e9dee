"""The loss Hessian H = I + S along training (the Hessian paper, Jacot et al.)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.plots._axes import colors, new_figure, some_steps, time_axis

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from nsa_dist.client import Run

_PAPER = "Hessian paper"


def moments(run: "Run") -> "Figure":
    """Tr(A^k), k = 1..4, for A = H, I, S along t with ±1 standard error, the exact Tr(I^k) and
    the infinite-width prediction of Tr(I^k) from Θ∞ (NTK-parametrised FC runs)."""
    fig, axes = new_figure(run, "1", "moments Tr(A^k) of H = I + S", 1, 4, panel=(4.2, 4.0), paper=_PAPER)
    t = run.hessian_steps
    exact = run.hessian_moments("I_exact")["estimate"]
    for k, ax in enumerate(axes[0]):
        for part, c in zip("HIS", colors(3)):
            m = run.hessian_moments(part)
            ax.errorbar(t, m["estimate"][:, k], yerr=m["stderr"][:, k], fmt="o-", ms=3, color=c, capsize=2,
                        label=f"{part} (Hutch++)")
        ax.plot(t, exact[:, k], "k--", lw=1, label="I exact (NTK Gram)")
        if run.has("hessian_I_limit_moments"):
            lim = run.hessian_moments("I_limit")["estimate"][:, k]
            if np.isfinite(lim).any():
                ax.plot(t, lim, ":", color="C3", lw=1.6, label=r"I limit ($\Theta_\infty$, kernel PCA)")
        ax.set_title(f"Tr(A^{k + 1})", fontsize=10)
        ax.set_yscale("symlog", linthresh=1e-3 * max(1e-12, float(np.nanmax(np.abs(exact[:, k])))))
        time_axis(ax, run, "trace" if k == 0 else "", legend=k == 0)
    return fig


def orthogonality(run: "Run") -> "Figure":
    """‖IS‖_F / (‖I‖_F ‖S‖_F) along t: I and S become orthogonal as training converges."""
    fig, ax = new_figure(run, "2", "orthogonality of I and S", paper=_PAPER)
    ax, o = ax[0, 0], run.hessian_orthogonality
    ax.errorbar(run.hessian_steps, o["value"], yerr=o["stderr"], fmt="o-", ms=3, capsize=2,
                label=r"$\Vert IS\Vert_F / (\Vert I\Vert_F\Vert S\Vert_F)$")
    time_axis(ax, run, "normalised ‖IS‖_F")
    return fig


def rayleigh(run: "Run") -> "Figure":
    """Fig. 2: vᵀIv and vᵀSv over the top eigenvectors of I (left) and of S (right), at the last analysed step."""
    step = int(run.hessian_steps[-1])
    R = run.hessian_rayleigh(step)
    fig, axes = new_figure(run, "2", f"Rayleigh quotients at t = {step}", 1, 2, paper=_PAPER)
    for ax, key, name in ((axes[0, 0], "I", "I"), (axes[0, 1], "S", "S")):
        i = np.arange(1, R[key].shape[1] + 1)
        ax.plot(i, R[key][0], "o-", ms=3, label=r"$v^T I v$")
        ax.plot(i, R[key][1], "s-", ms=3, label=r"$v^T S v$")
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set(xlabel=f"eigenvector i of {name}", ylabel="Rayleigh quotient", title=f"along eigenvectors of {name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def edge_of_stability(run: "Run") -> "Figure":
    """λ_max(H)·δ_t / 2 along t against 1 (GD on the local quadratic is stable below 1)."""
    fig, ax = new_figure(run, "—", "edge of stability λ_max(H)·δ/2", paper=_PAPER)
    ax = ax[0, 0]
    ax.plot(run.hessian_steps, run.edge_of_stability(), "o-", ms=3, label=r"$\lambda_{max}(H)\,\delta_t / 2$")
    ax.axhline(1.0, color="C3", ls="--", label="1 (edge of stability)")
    time_axis(ax, run, r"$\lambda_{max}(H)\,\delta_t / 2$")
    return fig


def density(run: "Run") -> "Figure":
    """SLQ spectral density of H at a few analysed steps (log y)."""
    fig, ax = new_figure(run, "1", "spectral density of H (stochastic Lanczos quadrature)", paper=_PAPER)
    ax, steps = ax[0, 0], run.hessian_steps
    pick = some_steps(len(steps), 4)
    for j, c in zip(pick, colors(len(pick))):
        grid, dens = run.hessian_density(int(steps[j]))
        ax.plot(grid, np.clip(dens, 1e-8, None), color=c, label=f"t = {steps[j]}")
    ax.set(xlabel="eigenvalue of H", ylabel="density", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def I_spectrum(run: "Run") -> "Figure":
    """The spectrum of I (outside its null space) measured at a few analysed steps beside the kernel
    PCA of Θ∞ (the paper's limit, weighted by HC) on the same axes."""
    fig, ax = new_figure(run, "—", "eigenvalues of I: measured vs the Θ∞ limit", paper=_PAPER)
    ax, steps = ax[0, 0], run.hessian_steps
    mu, lim = run.hessian_I_eigenvalues(), run.hessian_I_eigenvalues(limit=True)
    pick = some_steps(len(steps), 3)
    i = np.arange(1, mu.shape[1] + 1)
    drawn = None
    for j, c in zip(pick, colors(len(pick))):
        ax.plot(i, np.clip(mu[j], 1e-16, None), "o-", ms=2.5, lw=1, color=c, label=f"measured, t = {steps[j]}")
        if np.isfinite(lim[j]).any() and (drawn is None or not np.allclose(lim[j], drawn)):  # MSE: one limit for all t
            same = np.allclose(lim[pick], lim[j])
            ax.plot(i, np.clip(lim[j], 1e-16, None), "--", lw=1.2, color="k" if same else c,
                    label="limit (Θ∞ kernel PCA)" if same else f"limit (Θ∞), t = {steps[j]}")
            drawn = lim[j]
    ax.set(xlabel="index i", ylabel=r"$\lambda_i(I)$", xscale="log", yscale="log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return fig


def additivity(run: "Run") -> "Figure":
    """Theorem 1: the gap Tr(H^k) − Tr(I^k) − Tr(S^k) relative to Tr(H^k), k = 1..4, ± its standard error."""
    fig, axes = new_figure(run, "—", "additivity: (Tr H^k − Tr I^k − Tr S^k) / Tr H^k", 1, 4, panel=(4.2, 4.0),
                           paper=_PAPER)
    t, g = run.hessian_steps, run.hessian_additivity()
    H = run.hessian_moments("H")["estimate"]
    for k, ax in enumerate(axes[0]):
        with np.errstate(all="ignore"):
            rel, se = g["estimate"][:, k] / np.abs(H[:, k]), g["stderr"][:, k] / np.abs(H[:, k])
        ax.errorbar(t, rel, yerr=se, fmt="o-", ms=3, capsize=2, label="gap / |Tr(H^k)|")
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_title(f"k = {k + 1}", fontsize=10)
        time_axis(ax, run, "relative gap" if k == 0 else "", legend=k == 0)
    return fig


def trace_S(run: "Run") -> "Figure":
    """Tr(S) two independent ways: ∇Cᵀ·G (per-point traces of the model Hessian) and Hutch++ on S."""
    fig, ax = new_figure(run, "—", r"Tr(S) = ∇Cᵀ·G against Hutch++", paper=_PAPER)
    ax, t, tr = ax[0, 0], run.hessian_steps, run.hessian_trace_S()
    ax.errorbar(t, tr["G"], yerr=tr["G_stderr"], fmt="o-", ms=3, capsize=2, label=r"$\nabla C^T G$ (probes)")
    ax.errorbar(t, tr["hutchpp"], yerr=tr["hutchpp_stderr"], fmt="s--", ms=3, capsize=2, label="Hutch++ on S")
    ax.axhline(0, color="0.5", lw=0.8)
    time_axis(ax, run, "Tr(S)")
    return fig


def S_norms(run: "Run") -> "Figure":
    """‖S‖_op (Lanczos) beside the bounds Tr(S^k)^{1/k}, k = 2 (‖S‖_F) and 4: the paper's
    consequence 2 (‖S‖_op → 0 with width while ‖S‖_F stays finite)."""
    fig, ax = new_figure(run, "—", r"‖S‖_op ≤ Tr(S⁴)^{1/4} ≤ ‖S‖_F", paper=_PAPER)
    ax, t, n = ax[0, 0], run.hessian_steps, run.hessian_S_norms()
    ax.plot(t, n["op"], "o-", ms=3, label=r"$\Vert S\Vert_{op}$")
    ax.plot(t, n["k4"], "s--", ms=3, label=r"Tr$(S^4)^{1/4}$")
    ax.plot(t, n["k2"], "^--", ms=3, label=r"$\Vert S\Vert_F$ = Tr$(S^2)^{1/2}$")
    ax.set_yscale("log")
    time_axis(ax, run, "norm of S")
    return fig
