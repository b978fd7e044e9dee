"""Figures of the NSA paper from a recorded run: ``plot_run(Client(url).run(id), "figs/")``.

matplotlib is imported only when a figure is drawn, on an Agg canvas (no pyplot, no backend switch).
"""

from nsa_dist.plots.axes import PlotOptions
from nsa_dist.plots.projections import residual_projections
from nsa_dist.plots.registry import FIGURES, make_figure, plot_run
from nsa_dist.plots.sweep import SWEEP_FIGURES, plot_sweep, scalar_figure

__all__ = ["FIGURES", "SWEEP_FIGURES", "PlotOptions", "make_figure", "plot_run", "plot_sweep", "residual_projections",
           "scalar_figure"]
