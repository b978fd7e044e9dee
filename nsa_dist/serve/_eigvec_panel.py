"""The image panels of a run's page: NSA Figs. 4b–c, 5–6 (eigenvectors and the residual as
images, with a slider over the steps), 1a–c (target and output over 2-D inputs) and 4d (the
output from its top-k eigenvectors).

2-D data: the stored images v_i^t and m_t on the input grid and their |Fourier| (``Run.images``).
Other data: the stored eigenvectors V_t (N, K) themselves as one image, points × index
(``Run.eigenvectors``, at ``spectrum.store_eigenvectors`` steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from bokeh.layouts import column, row
from bokeh.models import ColorBar, ColumnDataSource, Div, LinearColorMapper, LogColorMapper, Slider

from nsa_dist.plots.axes import picture_data
from nsa_dist.plots.images import fourier_floors, fourier_scale
from nsa_dist.serve._curves import last_options, need, step_options, step_select
from nsa_dist.serve._live import Panel, new_figure

if TYPE_CHECKING:
    from nsa_dist.client import Run

__all__ = ["Eigenvectors", "Fig1abc", "Fig4d"]

_PER_ROW = 6  # eigenvector images side by side; more stored ones wrap onto further rows (each above its |Fourier|)


class _Image:
    """One image figure: its source, colour mapper (symmetric about 0, 0..max, or — ``log`` — a
    |Fourier| panel's log scale from the sampling noise, as ``nsa plot`` draws it) and title."""

    def __init__(
        self,
        size: int,
        palette: str = "RdBu11",
        symmetric: bool = True,
        x: str = "",
        y: str = "",
        height: int | None = None,
        log: bool = False,
    ) -> None:
        self.source = ColumnDataSource({"image": [], "dw": [], "dh": [], "x": [], "y": []})
        self.fig = new_figure("", x, y, width=size, height=height or size)
        self.mapper = LogColorMapper(palette=palette) if log else LinearColorMapper(palette=palette)
        self.fig.image(image="image", x="x", y="y", dw="dw", dh="dh", source=self.source, color_mapper=self.mapper)
        self.fig.grid.visible = False
        self.symmetric, self.log = symmetric, log

    def picture(self) -> _Image:
        """An image over [0, 1]² of a picture's data: x₂ drawn downwards (see :func:`picture_data`)."""
        picture_axes(self.fig)
        return self

    def draw(
        self, img: Any, title: str, extent: tuple[float, float, float, float] | None = None, floor: float | None = None
    ) -> None:
        """``floor``: a log panel's sampling noise (:func:`~nsa_dist.plots.images.fourier_floors`)."""
        img = np.asarray(img, np.float64)
        x0, y0, w, h = extent or (0.0, 0.0, float(img.shape[1]), float(img.shape[0]))
        if self.log:
            low, high = fourier_scale(img, floor)
            self.source.data = {"image": [np.clip(img, low, None)], "x": [x0], "y": [y0], "dw": [w], "dh": [h]}
            self.mapper.update(low=low, high=high)
            self.fig.title.text = title
            return
        self.source.data = {"image": [img], "x": [x0], "y": [y0], "dw": [w], "dh": [h]}
        top = float(np.nanmax(np.abs(img))) if np.isfinite(img).any() else 1.0
        top = top or 1.0
        self.mapper.update(low=-top if self.symmetric else 0.0, high=top)
        self.fig.title.text = title


def picture_axes(fig: Any) -> None:
    """Draw x₂ downwards on ``fig`` (labelled so), as the picture's rows run."""
    fig.y_range.flipped = True
    fig.yaxis.axis_label = "x₂ (down: the picture's rows)"
    fig.xaxis.axis_label = fig.xaxis.axis_label or "x₁"


class Eigenvectors(Panel):
    """At one stored step (the slider; the newest by default, NSA Fig. 5 — an early one is Fig. 6):
    the residual m_t and its |Fourier| (Figs. 4b–c) and the eigenvector images v_i^t above their
    |Fourier|; without 2-D data, V_t as one image."""

    title = "NSA Figs. 4b–c, 5 and 6 — the residual and the eigenvectors of G_t at a step (and |Fourier|)"
    figures = ("fig4bc_residual_fourier", "fig5_eigenvectors", "fig6_eigenvectors_early")

    def __init__(self, run: Run) -> None:
        self.images = run.has("eigvec_images")
        self.has_residual = run.has("residual_image")
        self.steps: list[int] = []
        self.slider = Slider(title="stored step (index)", start=0, end=1, value=0, step=1, width=500, disabled=True)
        self.label = Div(text="", css_classes=["nsa-eigvec-step"])
        self.limit = float(run.spec.spectrum.fourier_limit) if self.images else 0.0
        n = int(run.dims.n_images) if self.images else 1  # every stored one, as `nsa plot fig5` draws them
        if self.images:
            up = picture_data(run)  # the spatial images upright; the |Fourier| panels keep (ξ₁, ξ₂) up
            self.vecs = [_Image(190).picture() if up else _Image(190) for _ in range(n)]
            fft = {"palette": "Magma256", "symmetric": False, "x": "ξ₁", "y": "ξ₂", "log": True}
            self.ffts = [_Image(190, **fft) for _ in range(n)]
            self.residual = (
                [_Image(260).picture() if up else _Image(260), _Image(260, **fft)] if self.has_residual else []
            )
            rows = [row(*(i.fig for i in self.residual))] if self.residual else []
            for j in range(0, n, _PER_ROW):
                rows += [row(*(i.fig for i in self.vecs[j : j + _PER_ROW]))]
                rows += [row(*(i.fig for i in self.ffts[j : j + _PER_ROW]))]
        else:
            self.vecs, self.ffts, self.residual = [_Image(700, x="index i", y="point", height=300)], [], []
            rows = [row(self.vecs[0].fig)]
            self.title = "Eigenvectors V_t of G_t at the stored steps (NSA Figs. 4b–c, 5–6 need 2-D inputs)"
        super().__init__(column(row(self.slider, self.label), *rows))

    @property
    def controls(self) -> list[Any]:
        """No value-driven chooser: the slider is wired by the page (a small read at one step)."""
        return []

    def state(self) -> tuple[Any, ...]:
        """Also the slider's position among the steps shown (:meth:`read` follows the newest step
        while the slider is at the end)."""
        return (*super().state(), int(self.slider.value), len(self.steps))

    def stored_steps(self, run: Run) -> list[int]:
        """The finished steps whose eigenvectors (or their images) are stored."""
        return [int(t) for t in (run.steps if self.images else run.eigenvector_steps)]

    def at(self, run: Run, step: int) -> dict[str, Any]:
        """What the panel draws at ``step`` (worker thread)."""
        if self.images:
            floors = dict(zip(("residual_floor", "eigvec_floor"), fourier_floors(run, step, self.has_residual)))
            return {"step": step, **run.images.at(step), **floors}
        return {"step": step, "eigvec_images": run.eigenvectors(step)[None], "indices": None}

    def read(self, run: Run) -> dict[str, Any]:
        steps = self.stored_steps(run)
        follow = not self.steps or self.slider.value >= len(self.steps) - 1  # at the newest: follow new steps
        i = len(steps) - 1 if follow else min(self.slider.value, len(steps) - 1)
        return {"steps": steps, "index": i, **(self.at(run, steps[i]) if steps else {"eigvec_images": None})}

    def show(self, data: dict[str, Any]) -> None:
        self.steps = data["steps"]
        if self.steps:
            self.slider.update(end=max(len(self.steps) - 1, 1), value=data["index"], disabled=len(self.steps) < 2)
        self.draw(data)

    def draw(self, data: dict[str, Any]) -> None:
        """Draw the images of one step (document thread)."""
        if data.get("eigvec_images") is None:
            self.label.text = "no stored step yet"
            return
        t = int(data["step"])
        self.label.text = f"t = {t}"
        L = self.limit
        if not self.images:
            self.vecs[0].draw(data["eigvec_images"][0], f"V_t (point × i), t = {t}")
            return
        if self.residual:
            self.residual[0].draw(data["residual_image"], f"Fig. 4b: residual m_t, t = {t}", (0, 0, 1, 1))
            self.residual[1].draw(
                np.asarray(data["residual_fourier"]).T,
                f"Fig. 4c: |m̂_t|, t = {t} (log; black: below the sampling s.e.)",
                (-L, -L, 2 * L, 2 * L),
                data.get("residual_floor"),
            )
        for j, (v, f) in enumerate(zip(self.vecs, self.ffts)):
            i = int(data["indices"][j])
            v.draw(data["eigvec_images"][j], f"v_{i}", (0, 0, 1, 1))
            fourier = np.asarray(data["eigvec_fourier"][j]).T
            f.draw(fourier, f"|v̂_{i}|", (-L, -L, 2 * L, 2 * L), data.get("eigvec_floor"))


class Fig1abc(Panel):
    """(a) the target y at the training points, (b) the output f_t at a chosen step, (c) the
    points, coloured by value on the same scale (NSA Figs. 1a–c, 2-D inputs)."""

    title = "NSA Figs. 1a–c — target, network output and training points"
    figures = ("fig1abc_target_output_points",)

    def __init__(self, run: Run) -> None:
        self.step = step_select("step t of (b)", run.steps)
        self.controls = [self.step]
        self.mapper = LinearColorMapper(palette="Greys256")
        self.sources, figs = [], []
        for title in ("(a) target y", "(b) output f_t", "(c) the training points"):
            src = ColumnDataSource({"x": [], "y": [], "v": []})
            fig = new_figure(title, "x₁", "x₂", width=330, height=330, match_aspect=True)
            if title.startswith("(c)"):
                fig.scatter("x", "y", source=src, size=3, color="#000000")
            else:
                fig.scatter(
                    "x", "y", source=src, size=7, fill_color={"field": "v", "transform": self.mapper}, line_color=None
                )
            self.sources.append(src)
            figs.append(fig)
        self.figs = figs
        if picture_data(run):
            for fig in figs:
                picture_axes(fig)
        figs[1].add_layout(ColorBar(color_mapper=self.mapper, width=8), "right")
        super().__init__(column(self.step, row(*figs)))

    def read(self, run: Run) -> dict[str, Any]:
        have = step_options(run.steps)
        need(have, "recorded step")
        t = int(self.step.value if self.step.value in have else have[-1])
        X, y = np.asarray(run.X, np.float64), np.asarray(run.y, np.float64).reshape(-1)
        return {
            "X": X,
            "y": y,
            "f": np.asarray(run.outputs(t), np.float64).reshape(-1),
            "t": t,
            "options": last_options(have),
        }

    def show(self, data: dict[str, Any]) -> None:
        X = data["X"]
        for src, v in zip(self.sources, (data["y"], data["f"], data["y"])):
            src.data = {"x": X[:, 0], "y": X[:, 1], "v": v}
        self.mapper.update(low=float(np.min(data["y"])), high=float(np.max(data["y"])))
        self.figs[1].title.text = f"(b) output f_t, t = {data['t']}"
        self.figs[2].title.text = f"(c) the N = {len(X)} training points"
        if list(self.step.options) != data["options"]:
            self.step.options = data["options"]


class Fig4d(Panel):
    """f̄_{t,k} = Σ_{i≤k} ⟨v_i, f̄_t⟩ v_i at the stored k (10, 100, 200, 500 ≤ K) at a chosen
    eigenvector step (default the last): images on 2-D data, else f̄_{t,k} against f̄_t."""

    title = "NSA Fig. 4d — the output from the top-k eigenvectors of G_t"
    figures = ("fig4d_reconstructions",)

    def __init__(self, run: Run) -> None:
        self.step = step_select("eigenvector step t", run.eigenvector_steps, width=180)
        self.controls = [self.step]
        self.images = run.has("reconstruction_images")
        n = int(run.shape("reconstruction_k")[0])
        if self.images:
            self.panels: list[Any] = [_Image(240).picture() if picture_data(run) else _Image(240) for _ in range(n)]
            figs = [p.fig for p in self.panels]
        else:
            self.panels = []
            for _ in range(n):
                src = ColumnDataSource({"f": [], "fk": []})
                diag = ColumnDataSource({"x": [], "y": []})
                fig = new_figure("", "f̄_t", "f̄_t,k", width=260, height=260)
                fig.scatter("f", "fk", source=src, size=3)
                fig.line("x", "y", source=diag, color="#000000", line_dash="dashed")
                self.panels.append((fig, src, diag))
            figs = [p[0] for p in self.panels]
        super().__init__(column(self.step, row(*figs)))

    def read(self, run: Run) -> dict[str, Any]:
        have = step_options(run.eigenvector_steps)
        need(have, "step with stored eigenvectors")
        t = int(self.step.value if self.step.value in have else have[-1])
        rec = run.kernel.reconstructions(t)
        return {
            "t": t,
            "options": last_options(have),
            "k": [int(k) for k in rec["k"]],
            "images": rec.get("images"),
            "f": np.asarray(run.outputs(t), np.float64).reshape(-1),
            "fk": np.asarray(rec["f"], np.float64).reshape(len(rec["k"]), -1),
        }

    def show(self, data: dict[str, Any]) -> None:
        if list(self.step.options) != data["options"]:
            self.step.options = data["options"]
        for j, k in enumerate(data["k"][: len(self.panels)]):
            title = f"k = {k}, t = {data['t']}"
            if self.images:
                self.panels[j].draw(data["images"][j], title, (0, 0, 1, 1))
                continue
            fig, src, diag = self.panels[j]
            f = data["f"]
            src.data = {"f": f, "fk": data["fk"][j]}
            lim = [float(np.nanmin(f)), float(np.nanmax(f))] if np.isfinite(f).any() else [0.0, 1.0]
            diag.data = {"x": lim, "y": lim}
            fig.title.text = title
