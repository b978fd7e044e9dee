"""NSA Figs. 1a–c for 2-D data: the target image, the network's output image at a step, the training points."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.plots.axes import PlotOptions, new_figure, picture_data, picture_down

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from nsa_dist.client import Run


def _surface(ax: Axes, X: np.ndarray, v: np.ndarray, title: str, vmin: float, vmax: float) -> None:
    """v at the N points X (N, 2), linearly interpolated on their Delaunay triangulation."""
    im = ax.tripcolor(X[:, 0], X[:, 1], v, shading="gouraud", cmap="gray", vmin=vmin, vmax=vmax)
    ax.set(title=title, xlabel="$x_1$", ylabel="$x_2$", aspect="equal")
    ax.figure.colorbar(im, ax=ax, shrink=0.8)


def fig1abc(run: Run, opts: PlotOptions = PlotOptions()) -> Figure:
    """(a) the target y at the training points, (b) the output f_t at the last chosen step
    (default the last recorded), (c) the training points — over the picture's own coordinates where the
    loader standardised them (``data_meta``'s x_mean, x_std undone: Figs. 4–6 draw [0, 1]², this one drew
    the network's standardised inputs, [−1.8, 1.6] — an audit), else the data's."""
    X, y = run.X, run.y  # (N, 2), (N,)
    meta = getattr(run, "data_meta", None) or {}
    mean, std = meta.get("x_mean"), meta.get("x_std")
    if mean is not None and std is not None and np.shape(mean) == np.shape(std) == (np.shape(X)[1],):
        X = np.asarray(X, np.float64) * np.asarray(std, np.float64) + np.asarray(mean, np.float64)
    t = int(opts.steps[-1]) if opts.steps else int(run.steps[-1])
    f = run.outputs(t)  # (N,)
    lo, hi = float(np.min(y)), float(np.max(y))
    fig, ax = new_figure(
        run, "1a–c", "target, network output and training points", ncols=3, panel=(4.4, 4.0), images=True
    )
    _surface(ax[0, 0], X, y, "(a) target $y$", lo, hi)
    _surface(ax[0, 1], X, f, f"(b) output $f_t$, t = {t}", lo, hi)
    a, size = ax[0, 2], max(0.3, 2000 / len(X))
    nd = _nce_data_points(run, len(X))
    if nd is None:
        a.scatter(X[:, 0], X[:, 1], s=size, c="k", lw=0)
        a.set(title=f"(c) the N = {len(X)} training points", xlabel="$x_1$", ylabel="$x_2$", aspect="equal")
    else:  # NCE: the data samples and the noise samples the loss tells apart (drawn alike, they were one cloud)
        a.scatter(X[nd:, 0], X[nd:, 1], s=1.6 * size, marker="x", c="tab:orange", lw=0.6, label="noise (q)")
        a.scatter(X[:nd, 0], X[:nd, 1], s=size, c="k", lw=0, label="data (p)")
        a.set(
            title=f"(c) the N = {len(X)} training points:\n{nd} data, {len(X) - nd} noise",
            xlabel="$x_1$",
            ylabel="$x_2$",
            aspect="equal",
        )
        a.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), markerscale=2, frameon=False)
    if picture_data(run):  # the picture upright: its top row is at x₂ = 0
        for a in ax[0]:
            picture_down(a)
    return fig


def _nce_data_points(run: Run, n: int) -> int | None:
    """How many of an NCE run's ``n`` training points are data samples (the loader puts them first,
    n // (1 + ν), then the noise samples), or None for a run of another loss."""
    spec = getattr(run, "spec", None)
    loss = getattr(getattr(spec, "loss", None), "value", getattr(spec, "loss", None))
    ratio = getattr(getattr(spec, "data", None), "noise_ratio", None)
    if loss != "nce" or not isinstance(ratio, int) or ratio < 1:
        return None
    return n // (1 + ratio)
