"""Projections on the eigenvectors of G_t: of the residual (NSA Fig. 4a), of later eigenvectors (7d)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.plots.axes import PlotOptions, add_top_note, colors, family_label, ks, legend, new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from nsa_dist.client import Run


def residual_projections(run: Run, step: int) -> np.ndarray:
    """⟨v_i^t, m_t⟩² for i = 1..K (K,), summed over outputs when the network has several.

    Read from ``projections_residual`` when stored, else computed from the stored eigenvectors.
    """
    if run.has("projections_residual"):
        return run.kernel.residual_projections(step)
    V = run.eigenvectors(step)  # (N, K)
    m = run.residual(step).reshape(V.shape[0], -1)  # (N, Ko)
    return ((V.T @ m) ** 2).sum(axis=1)  # (K,)


def fig4a(run: Run, opts: PlotOptions = PlotOptions()) -> Figure:
    """⟨v_i^t, m_t⟩² against i at the chosen steps (default: the first and the last recorded; log y)."""
    fig, ax = new_figure(run, "4a", "spectral projections of the residual")
    ax, steps = ax[0, 0], run.steps
    chosen = sorted(set(opts.steps)) if opts.steps else sorted({int(steps[0]), int(steps[-1])})
    cols, labels = colors(len(chosen)), [family_label("t", t) for t in chosen]
    rank = None
    for c, t, label in zip(cols, chosen, labels):
        p = residual_projections(run, t)
        i = np.arange(1, len(p) + 1)
        if len(p) <= _JOINED:
            ax.plot(i, np.where(p > 0, p, np.nan), "o-", ms=3, color=c, label=label)
        else:  # hundreds of points joined drew a solid band: the points, and their mean per bin of i
            ax.plot(i, np.where(p > 0, p, np.nan), "o", ms=1.8, alpha=0.35, mec="none", color=c)
            centre, mean = _binned_mean(p)
            ax.plot(centre, np.where(mean > 0, mean, np.nan), "-", lw=2.2, color=c, label=label)
        r = run.numerical_rank(t, among_stored=True)
        rank = r if rank is None else min(rank, r)
        if r < len(p):
            ax.axvline(r + 0.5, color=c, ls=":", lw=1)
    if rank is not None and rank < len(p):  # beyond it: rounding's eigenvalues, one basis of many
        ax.axvspan(rank + 0.5, len(p) + 0.5, color="0.92", zorder=0, label="beyond $G_t$'s numerical rank")
    ax.set(yscale="log", xlabel="index i", ylabel=r"$\langle v_i^t, m_t\rangle^2$")
    ax.grid(alpha=0.3, which="both")
    if rank is not None and len(p) > _JOINED:
        ax.plot([], [], "o", ms=3, color="0.4", alpha=0.6, label="each i (points)")
        ax.plot([], [], "-", lw=2.2, color="0.4", label=f"mean over {_BINS} bins of i (lines)")
    legend(ax, family=("t", labels, cols))
    add_top_note(fig, run)
    return fig


_JOINED = 60  # Fig. 4a joins its points up to this many indices; beyond, points and binned means
_BINS = 40


def _binned_mean(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mean of ``p`` over :data:`_BINS` runs of consecutive indices i (1-based), at each run's
    middle index: the energy per eigenvector along the spectrum, where the points scatter over
    decades from one i to the next."""
    edges = np.linspace(0, len(p), _BINS + 1).round().astype(int)
    centre = np.array([(a + b + 1) / 2 for a, b in zip(edges[:-1], edges[1:]) if b > a])
    mean = np.array([p[a:b].mean() for a, b in zip(edges[:-1], edges[1:]) if b > a])
    return centre, mean


def fig7d(run: Run, opts: PlotOptions = PlotOptions()) -> Figure:
    """E_{t1}(v_i^{t2}, k) against k (log x) for rows i: is v_i^{t2} in the top-k spectrum of G_{t1}?

    Default: the pair and rows stored when the run finished; ``opts.pair`` / ``opts.ks`` choose
    (t1, t2) and the rows i (computed from the stored eigenvectors).
    """
    if opts.pair or opts.ks:
        t1, t2 = opts.pair or (None, None)
        rows = ks(int(run.shape("eigenvectors")[2]), opts.ks, f"Fig. 7d of run {run.id!r}") if opts.ks else None
        P, t1, t2, rows = run.spectrum_preservation(t1, t2, rows)
    else:
        P, t1, t2, rows = run.spectrum_preservation()  # (rows, K)
    fig, ax = new_figure(
        run, "7d", r"spectrum preservation: relative energy of $v_i^{t_2}$ in the spectrum of $G_{t_1}$"
    )
    ax = ax[0, 0]
    k = np.arange(1, P.shape[1] + 1)
    cols = colors(len(rows))
    for c, i, E in zip(cols, rows, P):
        ax.plot(k, E, "o-", ms=2.5, color=c, label=family_label("i", i))
    ax.set(
        xscale="log",
        xlabel="k (top eigenvectors of $G_{t_1}$)",
        ylim=(-0.02, 1.02),
        ylabel=rf"$E_{{{t1}}}(v_i^{{{t2}}}, k)$",
    )
    ax.set_title(f"$t_1$ = {t1}, $t_2$ = {t2}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    legend(ax, family=("i", [family_label("i", i) for i in rows], cols))
    add_top_note(fig, run)
    return fig
