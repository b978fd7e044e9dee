"""Figures of the NSA paper from a recorded run: ``plot_run(Client(url).run(id), "figs/")``.

matplotlib is imported only when a figure is drawn, on an Agg canvas (no pyplot, no backend switch).
"""

from nsa_dist.plots.projections import residual_projections
from nsa_dist.plots.registry import FIGURES, make_figure, plot_run

__all__ = ["FIGURES", "make_figure", "plot_run", "residual_projections"]
