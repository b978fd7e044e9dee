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


def fourier_floors(run: Run, step: int, residual: bool = True) -> tuple[float | None, float]:
    """The sampling noise of a stored |φ̂(ξ)| (Eq. 27: the mean of φ(x_i)·e^{−2πiξ·x_i} over the N
    training points): its standard error ‖φ‖₂/N (the mean over N i.i.d. points of a function φ has
    variance ≤ E|φ(x)|²/N = ‖φ‖₂²/N²).  Over F² frequencies of pure noise the largest |φ̂| is about
    √(ln F²) of it (2.7 at 41²): a value is signal where it stands well above that.

    Returns (the residual m_t's, None where the store cannot give ‖m_t‖ — an NCE run — or where
    ``residual`` is False; each unit eigenvector's, 1/N).  A linear colour scale drew the noise as
    the picture: at N = 400 the |m̂_t| panel was one bright pixel (the mean) on a field of speckle
    as bright as the signal.
    """
    n = int(np.shape(run.y)[0])
    if not residual:  # the eigenvectors' only: the residual is not read
        return None, 1.0 / n
    try:
        m = np.asarray(run.residual(step), np.float64).reshape(n, -1)[:, 0]  # the image's column (producers)
    except ValueError:
        return None, 1.0 / n
    return float(np.linalg.norm(m)) / n, 1.0 / n


def fourier_scale(F: np.ndarray, floor: float | None) -> tuple[float, float]:
    """(low, high) of a log colour scale for |φ̂|: low the noise ``floor`` (1e-3 of the largest
    where unknown), high the largest value, at least 10× low."""
    vals = np.asarray(F, np.float64)
    top = float(np.nanmax(vals)) if np.isfinite(vals).any() else 0.0
    low = floor if floor is not None and floor > 0 else (top * 1e-3 if top > 0 else 1e-3)
    return low, max(top, 10.0 * low)


def _fourier(ax: Axes, F: np.ndarray, limit: float, title: str, bar: bool = True, floor: float | None = None) -> None:
    """|φ̂| (F, F) with axis 0 = ξ₁, drawn with ξ₁ horizontal on [−limit, limit]², on a log colour
    scale from the sampling noise ``floor`` (:func:`fourier_floors`; black below it, its 3× marked
    on the colour bar)."""
    from matplotlib.colors import LogNorm

    low, high = fourier_scale(F, floor)
    shown = np.clip(np.asarray(F, np.float64), low, None)  # NaN stays NaN (drawn blank)
    im = ax.imshow(
        shown.T, origin="lower", extent=(-limit, limit, -limit, limit), cmap="magma", norm=LogNorm(low, high)
    )
    ax.set(title=title, xlabel=r"$\xi_1$", ylabel=r"$\xi_2$")
    if bar:
        cb = ax.figure.colorbar(im, ax=ax, shrink=0.85)
        if floor is not None:
            cb.set_label("black: below the sampling s.e.; line: 3 s.e.", size=7)
            if 3 * low < high:
                cb.ax.axhline(3 * low, color="white", linewidth=1.5)
        else:
            cb.set_label("log scale", size=7)


def fig4bc(run: Run, opts: PlotOptions = PlotOptions()) -> Figure:
    """The residual m_t and its |Fourier| at the chosen steps (default: the second recorded and the last)."""
    steps, limit = run.steps, run.spec.spectrum.fourier_limit
    chosen = sorted(set(opts.steps)) if opts.steps else sorted({int(steps[1 if len(steps) > 2 else 0]), int(steps[-1])})
    fig, ax = new_figure(
        run, "4b–c", "residual and its Fourier transform", nrows=len(chosen), ncols=2, panel=(4.4, 3.8), images=True
    )
    for row, t in zip(ax, chosen):
        im, (floor, _) = run.images.at(t), fourier_floors(run, t)
        _image(row[0], im["residual_image"], f"residual $m_t$, t = {t}", down=picture_data(run))
        _fourier(row[1], im["residual_fourier"], limit, rf"$|\hat m_t|$, t = {t}", floor=floor)
    return fig


def fig5(run: Run, opts: PlotOptions = PlotOptions(), *, label: str = "5", step: int | None = None) -> Figure:
    """Eigenvectors v_i of G_t at ``step`` (default the last) as images, each above its |Fourier|, six per line."""
    t, limit = int(run.steps[-1]) if step is None else step, run.spec.spectrum.fourier_limit
    im, (_, floor) = run.images.at(t), fourier_floors(run, t, residual=False)
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
        note=f"|Fourier| on a log colour scale, black below the sampling s.e. 1/N = {floor:.1e}",
    )
    for a in ax.ravel():
        a.set_axis_off()
    for j, i in enumerate(idx):
        top, bottom = ax[2 * (j // ncols), j % ncols], ax[2 * (j // ncols) + 1, j % ncols]
        top.set_axis_on()
        bottom.set_axis_on()
        _image(top, im["eigvec_images"][j], f"$v_{{{i}}}$", bar=False, down=picture_data(run))
        _fourier(bottom, im["eigvec_fourier"][j], limit, rf"$|\hat v_{{{i}}}|$", bar=False, floor=floor)
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
