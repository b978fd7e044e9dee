"""Figures of the NSA paper from a recorded run: ``plot_run(Client(url).run(id), "figs/")``.

matplotlib is imported only when a figure is drawn, on an Agg canvas (no pyplot, no backend switch).

Owns: the paper's figures of a stored run or sweep and the shared figure machinery (the public
:mod:`nsa_dist.plots.axes`: DPI, which k / i / t to draw, the GD-formula note).
May import: the readers (``client``, ``sweep_view``), :mod:`nsa_dist.config` (enums), NumPy and
matplotlib — never the store's writer, the pipeline, the numerics or Ray.
"""

from nsa_dist.plots.axes import PlotOptions
from nsa_dist.plots.projections import residual_projections
from nsa_dist.plots.registry import FIGURES, make_figure, plot_run
from nsa_dist.plots.sweep import SWEEP_FIGURES, plot_sweep, scalar_figure

__all__ = [
    "FIGURES",
    "SWEEP_FIGURES",
    "PlotOptions",
    "make_figure",
    "plot_run",
    "plot_sweep",
    "residual_projections",
    "scalar_figure",
]
