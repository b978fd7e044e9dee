"""The eigenvector panel of a run's page, with a slider over the steps whose eigenvectors are stored.

2-D data: the stored eigenvector images v_i^t on the input grid (NSA Figs. 5–6, ``Run.images``).
Other data: the stored eigenvectors V_t (N, K) themselves as one image, points × index
(``Run.eigenvectors``, at ``spectrum.store_eigenvectors`` steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, Div, LinearColorMapper, Slider

from nsa_dist.serve._live import Panel, new_figure

if TYPE_CHECKING:
    from nsa_dist.client import Run

__all__ = ["Eigenvectors"]

_MAX_IMAGES = 6


class Eigenvectors(Panel):
    """Eigenvector images at the stored steps, one step at a time (the slider)."""

    title = "Eigenvectors of G_t at the stored steps"

    def __init__(self, run: "Run") -> None:
        self.images = run.has("eigvec_images")
        self.steps: list[int] = []
        self.slider = Slider(title="stored step (index)", start=0, end=1, value=0, step=1, width=500, disabled=True)
        self.label = Div(text="", css_classes=["nsa-eigvec-step"])
        n = min(_MAX_IMAGES, int(run.dims.n_images)) if self.images else 1
        self.sources = [ColumnDataSource({"image": [], "dw": [], "dh": []}) for _ in range(n)]
        self.titles, self.mappers, figs = [], [], []
        for src in self.sources:
            size = 200 if self.images else 700
            fig = new_figure("", "" if self.images else "index i", "" if self.images else "point",
                             width=size, height=size if self.images else 300, match_aspect=self.images)
            mapper = LinearColorMapper(palette="RdBu11")
            fig.image(image="image", x=0, y=0, dw="dw", dh="dh", source=src, color_mapper=mapper)
            fig.grid.visible = False
            self.titles.append(fig.title)
            self.mappers.append(mapper)
            figs.append(fig)
        super().__init__(column(row(self.slider, self.label), row(*figs)))

    def stored_steps(self, run: "Run") -> list[int]:
        """The finished steps whose eigenvectors (or their images) are stored."""
        return [int(t) for t in (run.steps if self.images else run.eigenvector_steps)]

    def at(self, run: "Run", step: int) -> dict[str, Any]:
        """What the panel draws at ``step`` (worker thread)."""
        if self.images:
            im = run.images.at(step)
            return {"step": step, "images": im["eigvec_images"][:len(self.sources)], "indices": im["indices"]}
        return {"step": step, "images": run.eigenvectors(step)[None], "indices": None}

    def read(self, run: "Run") -> dict[str, Any]:
        steps = self.stored_steps(run)
        follow = not self.steps or self.slider.value >= len(self.steps) - 1  # at the newest: follow new steps
        i = len(steps) - 1 if follow else min(self.slider.value, len(steps) - 1)
        return {"steps": steps, "index": i, **(self.at(run, steps[i]) if steps else {"images": None})}

    def show(self, data: dict[str, Any]) -> None:
        self.steps = data["steps"]
        if self.steps:
            self.slider.update(end=max(len(self.steps) - 1, 1), value=data["index"], disabled=len(self.steps) < 2)
        self.draw(data)

    def draw(self, data: dict[str, Any]) -> None:
        if data.get("images") is None:
            self.label.text = "no stored step yet"
            return
        self.label.text = f"t = {data['step']}"
        for j, (src, title, mapper) in enumerate(zip(self.sources, self.titles, self.mappers)):
            img = np.asarray(data["images"][j], np.float64)  # (R, R) image, or (N, K) eigenvectors: point × i
            src.data = {"image": [img], "dw": [img.shape[1]], "dh": [img.shape[0]]}
            lim = float(np.nanmax(np.abs(img))) if np.isfinite(img).any() else 1.0
            mapper.update(low=-lim, high=lim)  # symmetric: white is 0
            title.text = f"v_{int(data['indices'][j])}" if data["indices"] is not None else "V_t (point × i)"
