"""2-D data: residual (NSA Figs. 4b–c) and eigenvectors (Fig. 5) as images on [0, 1]² with |Fourier|."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.plots.axes import PlotOptions, new_figure, picture_data, picture_down

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from nsa_dist.client import Run


def _image(ax: Axes, img: np.ndarray, title: str, bar: bool = True, down: bool = False) -> None:
    """(R, R) values on [0, 1]² (row = x₂), diverging colours centred at 0; ``down``: x₂ drawn
    downwards (a picture's data, :func:`~nsa_dist.plots.axes.picture_data`: upright)."""
    v = float(np.nanmax(np.abs(img))) or 1.0
    im = ax.imshow(img, origin="lower", extent=(0, 1, 0, 1), cmap="RdBu_r", vmin=-v, vmax=v)
    ax.set(title=title, xlabel="$x_1$", ylabel="$x_2$")
    if down:
        picture_down(ax)
    if bar:
        ax.figure.colorbar(im, ax=ax, shrink=0.85)


def _fourier(ax: Axes, F: np.ndarray, limit: float, title: str, bar: bool = True) -> None:
    """|φ̂| (F, F) with axis 0 = ξ₁, drawn with ξ₁ horizontal on [−limit, limit]²."""
    im = ax.imshow(F.T, origin="lower", extent=(-limit, limit, -limit, limit), cmap="magma")
    ax.set(title=title, xlabel=r"$\xi_1$", ylabel=r"$\xi_2$")
    if bar:
        ax.figure.colorbar(im, ax=ax, shrink=0.85)


def fig4bc(run: Run, opts: PlotOptions = PlotOptions()) -> Figure:
    """The residual m_t and its |Fourier| at the chosen steps (default: the second recorded and the last)."""
    steps, limit = run.steps, run.spec.spectrum.fourier_limit
    chosen = sorted(set(opts.steps)) if opts.steps else sorted({int(steps[1 if len(steps) > 2 else 0]), int(steps[-1])})
    fig, ax = new_figure(
        run, "4b–c", "residual and its Fourier transform", nrows=len(chosen), ncols=2, panel=(4.4, 3.8), images=True
    )
    for row, t in zip(ax, chosen):
        im = run.images.at(t)
        _image(row[0], im["residual_image"], f"residual $m_t$, t = {t}", down=picture_data(run))
        _fourier(row[1], im["residual_fourier"], limit, rf"$|\hat m_t|$, t = {t}")
    return fig


def fig5(run: Run, opts: PlotOptions = PlotOptions(), *, label: str = "5", step: int | None = None) -> Figure:
    """Eigenvectors v_i of G_t at ``step`` (default the last) as images, each above its |Fourier|, six per line."""
    t, limit = int(run.steps[-1]) if step is None else step, run.spec.spectrum.fourier_limit
    im = run.images.at(t)
    idx = [int(i) for i in im["indices"]]
    ncols = min(6, len(idx))
    lines = -(-len(idx) // ncols)
    fig, ax = new_figure(
        run,
        label,
        f"eigenvectors of $G_t$ and their Fourier transforms, t = {t}",
        nrows=2 * lines,
        ncols=ncols,
        panel=(2.3, 2.3),
        images=True,
    )
    for a in ax.ravel():
        a.set_axis_off()
    for j, i in enumerate(idx):
        top, bottom = ax[2 * (j // ncols), j % ncols], ax[2 * (j // ncols) + 1, j % ncols]
        top.set_axis_on()
        bottom.set_axis_on()
        _image(top, im["eigvec_images"][j], f"$v_{{{i}}}$", bar=False, down=picture_data(run))
        _fourier(bottom, im["eigvec_fourier"][j], limit, rf"$|\hat v_{{{i}}}|$", bar=False)
        for a in (top, bottom):
            a.tick_params(labelsize=6)
            a.xaxis.label.set_size(7)
            a.yaxis.label.set_size(7)
    return fig


def fig6(run: Run, opts: PlotOptions = PlotOptions()) -> Figure:
    """NSA Fig. 6: the eigenvector images and |Fourier| at an early step — the first chosen step
    (the paper: t = 20,000), default the second recorded step."""
    steps = run.steps
    t = opts.steps[0] if opts.steps else int(steps[1 if len(steps) > 1 else 0])
    return fig5(run, label="6", step=int(t))
