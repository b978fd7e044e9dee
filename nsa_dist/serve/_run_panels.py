"""The panels of one run's page: each reads what it draws through :class:`nsa_dist.client.Run`
(worker thread) and updates its Bokeh sources (document thread)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from bokeh.layouts import column, row
from bokeh.models import (ColorBar, ColumnDataSource, HoverTool, LinearColorMapper, Select, Whisker)

from nsa_dist.plots.axes import ks
from nsa_dist.serve._live import PALETTE, Panel, new_figure, positive

if TYPE_CHECKING:
    from nsa_dist.client import Run

__all__ = ["Eigenvalues", "EnergyMap", "FirstOrder", "Loss", "HessianMoments"]


class Eigenvalues(Panel):
    """λ_i^t of G_t along t for i in 1, 2, 5, 10, … ≤ K (NSA Fig. 2b), log y."""

    title = "Eigenvalues λ_i^t of the NTK Gram G_t along t"

    def __init__(self, run: "Run") -> None:
        self.rows = ks(int(run.dims.K))
        self.source = ColumnDataSource({"t": [], **{f"l{i}": [] for i in self.rows}})
        fig = new_figure("", "step t", "eigenvalue λ_i^t", y_log=True, width=700, css_classes=["nsa-plot-eigenvalues"])
        for c, i in zip(PALETTE * 3, self.rows):
            fig.line("t", f"l{i}", source=self.source, color=c, legend_label=f"i = {i}", line_width=1.5)
            fig.scatter("t", f"l{i}", source=self.source, color=c, size=4)
        fig.legend.location, fig.legend.click_policy = "bottom_left", "hide"
        fig.add_tools(HoverTool(tooltips=[("t", "@t")] + [(f"λ_{i}", f"@l{i}") for i in self.rows[:6]]))
        super().__init__(fig)

    def read(self, run: "Run") -> dict[str, Any]:
        lam = run.eigenvalues  # (S, K)
        return {"t": run.steps, **{f"l{i}": positive(lam[:, i - 1]) for i in self.rows}}

    def show(self, data: dict[str, Any]) -> None:
        self.source.data = data


class EnergyMap(Panel):
    """E_t(φ, k) = Σ_{i≤k} ⟨v_i^t, φ⟩² / ‖φ‖² as a heat map over (recorded step, k), φ chosen (NSA Fig. 3)."""

    title = "Energy E_t(φ, k) over (t, k)"
    PHIS = {"y": "labels y", "f": "outputs f_t", "residual": "residual m_t", "df": "update df_t",
            "df_pred": "first-order update", "f_test": "test outputs"}

    def __init__(self, run: "Run") -> None:
        options = [(p, f"φ = {w}") for p, w in self.PHIS.items() if run.has(f"energy_{p}")]
        self.phi = Select(title="φ", value=options[0][0], options=options, width=200)
        self.source = ColumnDataSource({"image": [], "x": [], "dw": [], "k": []})
        self.fig = new_figure("", "recorded step t", "k", width=700, height=340)
        mapper = LinearColorMapper(palette="Viridis256", low=0.0, high=1.0)
        self.fig.image(image="image", x="x", y=0.5, dw="dw", dh="k", source=self.source, color_mapper=mapper)
        self.fig.add_layout(ColorBar(color_mapper=mapper, title="E"), "right")
        self.fig.add_tools(HoverTool(tooltips=[("step index", "$x{0}"), ("k", "$y{0}"), ("E", "@image{0.0000}")]))
        super().__init__(column(self.phi, self.fig))

    def read(self, run: "Run") -> dict[str, Any]:
        E = run.energy(self.phi.value)  # (S, K)
        return {"E": E, "t": run.steps}

    def show(self, data: dict[str, Any]) -> None:
        E, t = data["E"], data["t"]
        self.source.data = {"image": [np.asarray(E, np.float64).T], "x": [-0.5], "dw": [max(len(t), 1)],
                            "k": [E.shape[1]]}
        self.fig.xaxis.ticker = list(range(len(t)))
        self.fig.xaxis.major_label_overrides = {i: str(int(v)) for i, v in enumerate(t)}


class FirstOrder(Panel):
    """The first-order accuracy along t (NSA Fig. 1d): ‖df − df_pred‖/‖df‖ and cos α_t."""

    title = "First-order accuracy"

    def __init__(self, run: "Run") -> None:
        self.source = ColumnDataSource({"t": [], "error": [], "cos": []})
        err = new_figure("relative error ‖df − df_pred‖ / ‖df‖", "step t", "error", y_log=True)
        cos = new_figure("cos α_t (df, df_pred)", "step t", "cos α")
        for fig, y, c in ((err, "error", PALETTE[3]), (cos, "cos", PALETTE[0])):
            fig.line("t", y, source=self.source, color=c, line_width=1.5)
            fig.scatter("t", y, source=self.source, color=c, size=4)
        super().__init__(row(err, cos))

    def read(self, run: "Run") -> dict[str, Any]:
        fo = run.first_order
        return {"t": run.steps, "error": positive(fo["error"]), "cos": np.asarray(fo["cos"], np.float64)}

    def show(self, data: dict[str, Any]) -> None:
        self.source.data = data


class Loss(Panel):
    """L(θ_t) of every trained step (log-log against t + 1) with the test loss at the recorded steps."""

    title = "Loss"

    def __init__(self, run: "Run") -> None:
        self.test = run.has("loss_test")
        self.trace = ColumnDataSource({"t1": [], "loss": []})
        self.points = ColumnDataSource({"t1": [], "loss": []})
        fig = new_figure("", "step t + 1", "L(θ_t)", x_log=True, y_log=True, width=700)
        fig.line("t1", "loss", source=self.trace, color=PALETTE[0], legend_label="training loss")
        if self.test:
            fig.scatter("t1", "loss", source=self.points, color=PALETTE[1], size=5, legend_label="test loss")
        super().__init__(fig)

    def read(self, run: "Run") -> dict[str, Any]:
        trace = positive(run.loss_trace)
        ok = np.flatnonzero(np.isfinite(trace))
        out = {"trace": {"t1": ok + 1.0, "loss": trace[ok]}}
        if self.test:
            out["points"] = {"t1": run.steps + 1.0, "loss": positive(run.test_loss)}
        return out

    def show(self, data: dict[str, Any]) -> None:
        self.trace.data = data["trace"]
        if "points" in data:
            self.points.data = data["points"]


class HessianMoments(Panel):
    """Tr(A^k), k = 1..4, of A = H, I or S (Hutch++) ± one standard error, along the analysed steps."""

    title = "Hessian moments Tr(A^k) ± standard error (H = I + S)"

    def __init__(self, run: "Run") -> None:
        self.part = Select(title="A", value="H", options=[("H", "H (loss Hessian)"), ("I", "I (Gauss-Newton)"),
                                                         ("S", "S (residual part)")], width=200)
        self.sources = [ColumnDataSource({"t": [], "m": [], "lo": [], "hi": []}) for _ in range(4)]
        figs = []
        for k, src in enumerate(self.sources, start=1):
            fig = new_figure(f"Tr(A^{k})", "step t", "", width=330, height=260)
            fig.line("t", "m", source=src, color=PALETTE[k - 1], line_width=1.5)
            fig.scatter("t", "m", source=src, color=PALETTE[k - 1], size=5)
            fig.add_layout(Whisker(base="t", lower="lo", upper="hi", source=src, line_color=PALETTE[k - 1]))
            fig.add_tools(HoverTool(tooltips=[("t", "@t"), ("Tr", "@m"), ("± s.e.", "@lo … @hi")]))
            figs.append(fig)
        super().__init__(column(self.part, row(*figs)))

    def read(self, run: "Run") -> dict[str, Any]:
        m = run.hessian.moments(self.part.value)
        return {"t": run.hessian.steps, "estimate": m["estimate"], "stderr": m["stderr"]}

    def show(self, data: dict[str, Any]) -> None:
        for k, src in enumerate(self.sources):
            est, se = data["estimate"][:, k], data["stderr"][:, k]
            src.data = {"t": data["t"], "m": est, "lo": est - se, "hi": est + se}
