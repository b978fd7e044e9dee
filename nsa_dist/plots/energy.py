"""Relative energy E_t(φ, k) = Σ_{i≤k} ⟨v_i^t, φ⟩² / ‖φ‖² along t for several k (NSA Fig. 3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.config import LossName
from nsa_dist.plots.axes import PlotOptions, colors, family_label, ks, new_figure, time_axis

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from nsa_dist.client import Run

_PHI_TEX = {
    "y": r"\bar y",
    "f": r"\bar f_t",
    "residual": r"\bar m_t",
    "df_pred": r"d\bar f_t",
    "df": r"d\tilde f_t",
    "f_test": r"\bar f_t^{test}",
}
_WHAT = {
    "y": r"relative energy of the labels $\bar y$ in the top k eigenvectors of $G_t$",
    "f": r"relative energy of the network output $\bar f_t$",
    "residual": r"relative energy of the residual $\bar m_t$",
    "df_pred": r"relative energy of the differential $d\bar f_t = -(\delta_t/N) G_t \bar m_t$",
    "f_test": r"relative energy of the network output at the test points (Gramian at the test points)",
}
_LABEL = {"y": "3a", "f": "3b", "residual": "3c", "df_pred": "3d", "f_test": "3e"}


def _curves(
    ax: Axes, run: Run, phi: str, ls: str = "o-", labels: bool = True, chosen: tuple[int, ...] | None = None
) -> tuple[str, list[str], np.ndarray, bool]:
    """One line per k in ``chosen`` (default 1, 2, 5, 10, …) ≤ the largest k the run measured for
    this φ (its K, or N with every k measured), each with its bracket as a band where the bracket is
    not a point; returns the family (name, labels, colours) for :func:`axes.legend` and whether a
    band was drawn."""
    from nsa_dist.plots.brackets import draw_bracketed_along_t

    curve = run.curve(f"energy_{phi}")
    rows = ks(int(curve.k[-1]), chosen, f"Fig. {_LABEL.get(phi, '3d')} of run {run.id!r} (φ = {phi})")
    cols = colors(len(rows))
    drawn = False
    for c, k in zip(cols, rows):
        value, lower, upper = curve.at(k)
        drawn |= draw_bracketed_along_t(
            ax, run.steps, value, lower, upper, c, family_label("k", k) if labels else None, ls
        )
    return "k", [family_label("k", k) for k in rows], cols, drawn


def _df_pred_what(run: Run) -> str:
    """Fig. 3d's title: what the run's first-order differential is (``predicted_update``) — the paper's
    −(δ_t/N) G_t m̄_t only for full-batch GD of one output; the title said so for every run, where an
    Adam run's was J_t Δθ_t, 84× off that formula (an audit)."""
    o = run.spec.optimizer
    name = o.name.value if hasattr(o.name, "value") else str(o.name)
    if name != "gd" or run.Ko != 1:
        return r"relative energy of the first-order differential $d\bar f_t = J_t \Delta\theta_t$ of the update made"
    formula = r"-(\delta_t/N) G_t \bar m_t" + (r" - \delta_t \mu J_t b_{t-1}" if o.momentum > 0 else "")
    unknown = r" (a step with no one δ_t: $J_t \Delta\theta_t$)" if np.isnan(run.lr).any() else ""
    return rf"relative energy of the differential $d\bar f_t = {formula}${unknown}"


def energy_figure(run: Run, phi: str, opts: PlotOptions = PlotOptions()) -> Figure:
    """E_t(φ, k) along t: φ = y (Fig. 3a), f (3b), residual (3c), f_test (3e),
    df_pred (3d; the real df = f_{t+1} − f_t drawn dashed in the same colours)."""
    what = _WHAT[phi]
    if phi == "y" and LossName(run.spec.loss) is LossName.NCE:  # the energy of the centred log-density (spectral.py)
        what = (
            r"relative energy of the centred log-density $\bar y - \mathrm{mean}(\bar y)$ (NCE) in the top k "
            r"eigenvectors of $G_t$"
        )
    if phi == "df_pred":
        what = _df_pred_what(run)
    fig, ax = new_figure(run, _LABEL[phi], what)
    ax = ax[0, 0]
    *family, drawn = _curves(ax, run, phi, chosen=opts.ks)
    if phi == "df_pred":
        drawn |= _curves(ax, run, "df", ls="--", labels=False, chosen=opts.ks)[3]
        ax.plot([], [], "k-", label=r"first order $d\bar f_t$")  # legend entries for the two line styles
        ax.plot([], [], "k--", label=r"real $d\tilde f_t = f_{t+1} - f_t$")
    time_axis(ax, run, rf"$E_t({_PHI_TEX[phi]}, k)$", family=tuple(family))
    from nsa_dist.plots.brackets import add_bracket_caption

    add_bracket_caption(fig, run, drawn, phi=phi)  # the route, on both (the exact one: no band, and why)
    return fig
