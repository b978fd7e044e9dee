"""The NSA paper's line figures of one run, each read through :class:`nsa_dist.client.Run` (and
the plots' public data helpers) exactly as ``nsa plot`` reads them: Figs. 1d–e, 2a–d, 3a–e (along
t, and against k on a log axis at chosen steps), 4a, 7d, Eqs. 4–5 with App. E, App. F and the loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from bokeh.models import Select

from nsa_dist.plots import residual_projections
from nsa_dist.plots.axes import gd_note, ks, lr_steps, nonpositive_note, unknown_rate_lines
from nsa_dist.plots.projections import _JOINED, _binned_mean
from nsa_dist.serve._curves import Curves, Picked, Plot, Series, color, hline, need, spread, stairs, step_options
from nsa_dist.serve._live import Waiting

if TYPE_CHECKING:
    from nsa_dist.client import Run

__all__ = [
    "bracket_note",
    "Fig1d",
    "Fig1e",
    "Fig2a",
    "Fig2b",
    "Fig2c",
    "Fig2d",
    "Energy",
    "Fig4a",
    "Fig7d",
    "Eqs45",
    "AppF",
    "Loss",
]


NOTE_GREY = "#555555"  # a note that is no caveat (the waiting note's colour, serve._live)


class Fig1d(Curves):
    """‖df̃_t − df̄_t‖ / ‖df̃_t‖ and cos α_t along t (NSA Fig. 1d)."""

    title = "NSA Fig. 1d — accuracy of the first-order dynamics"
    figures = ("fig1d_first_order",)
    plots = (
        Plot("step t", "‖df − df_pred‖ / ‖df‖", y_log=True, width=460),
        Plot("step t", "cos α_t (df, df_pred)", width=460),
    )

    def series(self, run: Run) -> list[list[Series]]:
        fo = run.first_order
        return [[Series(run.steps, fo["error"], "error_t", color(3))], [Series(run.steps, fo["cos"], "cos α_t")]]


class Fig1e(Curves):
    """δ_t (the schedule's, piecewise constant between its decays; markers: the recorded values) and
    GD's stability bound 2N/λ_max^t along t (NSA Fig. 1e), as ``nsa plot``'s figure draws them."""

    title = "NSA Fig. 1e — learning rate δ_t and its stability bound 2N/λ_max^t"
    figures = ("fig1e_lr_stability",)
    plots = (Plot("step t", "learning rate", y_log=True),)

    def series(self, run: Run) -> list[list[Series]]:
        # held from each decay to the next: from recorded steps alone a decay between two of them was
        # drawn at the later one, joined by a slope (an audit: δ halved at t = 150 drawn at 231)
        x, y = stairs(*lr_steps(run, int(run.steps[-1])))
        full = " (full NK×NK kernel)" if run.Ko > 1 else ""
        return [
            [
                Series(x, y, "δ_t", color(0), markers=False),
                Series(run.steps, run.lr, "δ_t recorded", color(0), line=False),
                Series(run.steps, run.stability_bound(), "2N/λ_max^t" + full, color(1)),
            ]
        ]

    def note_text(self, run: Run) -> str:
        return gd_note(run) or ""


class Fig2a(Picked):
    """λ_i^t against i at chosen steps (log-log; NSA Fig. 2a): every i the run measured, the
    bracket shaded where it is not a point (the quadrature route beyond its top)."""

    title = "NSA Fig. 2a — eigenvalues λ_i^t of G_t against i"
    note_color = NOTE_GREY  # the bracket note: how the curves were measured, not a warning
    figures = ("fig2a_eigenvalues",)
    plots = (Plot("index i", "eigenvalue λ_i^t", x_log=True, y_log=True),)

    default = staticmethod(spread(6))
    default_text = "six spread from the first to the last"

    def series(self, run: Run) -> list[list[Series]]:
        curve = run.curve("eigenvalue")
        pos = {int(t): j for j, t in enumerate(run.steps)}
        return [[_against_k(curve, pos[t], f"t = {t}", color(j), log=True) for j, t in enumerate(self.picked(run))]]

    def note_text(self, run: Run) -> str:
        curve = run.curve("eigenvalue")
        pos = {int(t): j for j, t in enumerate(run.steps)}
        rows = [pos[t] for t in self.picked(run) if t in pos]
        return _joined(bracket_note(run), nonpositive_note(curve.value[rows], curve.k, _top(curve)))


class Fig2b(Curves):
    """λ_i^t along t for i in 1, 2, 5, 10, … ≤ the largest i measured (log y; NSA Fig. 2b), each
    with its bracket shaded where it is not a point."""

    title = "NSA Fig. 2b — eigenvalues λ_i^t of G_t along t"
    note_color = NOTE_GREY  # the bracket note: how the curves were measured, not a warning
    figures = ("fig2b_eigenvalues_t",)
    css = "nsa-plot-eigenvalues"
    plots = (Plot("step t", "eigenvalue λ_i^t", y_log=True, width=700),)

    def series(self, run: Run) -> list[list[Series]]:
        curve = run.curve("eigenvalue")
        return [[_along_t(curve, i, f"i = {i}", color(j), log=True) for j, i in enumerate(ks(int(curve.k[-1])))]]

    def note_text(self, run: Run) -> str:
        curve, rows = run.curve("eigenvalue"), ks(int(run.curve("eigenvalue").k[-1]))
        values = np.array([curve.at(i)[0] for i in rows]).T  # (steps, rows)
        return _joined(bracket_note(run), nonpositive_note(values, np.asarray(rows), _top(curve)))


def _top(curve: Any) -> float:
    """λ_1 over the run's steps (NaN before any)."""
    first = np.asarray(curve.value[:, 0], np.float64)
    return float(np.nanmax(first)) if np.isfinite(first).any() else float("nan")


def _joined(*notes: str) -> str:
    """The non-empty notes of a panel as one."""
    return "; ".join(n for n in notes if n)


def _gd_notes(run: Run, log_axis: bool = False) -> str:
    """Figs. 2c-d's note: which λ_i^t (Ko > 1: the full kernel's, not Fig. 2a's), :func:`gd_note`, and
    where δ_t is unknown (or, on Fig. 2d's log axis, 0): the curves stop there, as in ``nsa plot``."""
    full = "λ_i^t here are the full (N·Ko)×(N·Ko) kernel's, not Figs. 2a-b's output-traced Gram's" if run.Ko > 1 else ""
    rates = "; ".join(unknown_rate_lines(run, zero_hidden=log_axis)[0]).replace("\n", " ")
    return "; ".join(n for n in (full, gd_note(run) or "", rates) if n)


class Fig2c(Curves):
    """s_i^t = 1 − |1 − δ_t λ_i^t / N| of the top 8 eigenvectors along t (NSA Fig. 2c)."""

    title = "NSA Fig. 2c — information flow speed s_i^t = 1 − |1 − δ_t λ_i^t / N|"
    figures = ("fig2c_flow_speed",)
    plots = (Plot("step t", "s_i^t"),)

    def series(self, run: Run) -> list[list[Series]]:
        s = run.flow_speed()
        return [[Series(run.steps, s[:, i], f"i = {i + 1}", color(i)) for i in range(min(8, s.shape[1]))]]

    def note_text(self, run: Run) -> str:
        return _gd_notes(run)


class Fig2d(Curves):
    """δ_t λ_i^t / N along t with the stability limit 2 (log y; NSA Fig. 2d)."""

    title = "NSA Fig. 2d — δ_t λ_i^t / N along t"
    figures = ("fig2d_lr_eigen",)
    plots = (Plot("step t", "δ_t λ_i^t / N", y_log=True),)

    def series(self, run: Run) -> list[list[Series]]:
        p = run.lr_eigen_product()
        out = [Series(run.steps, p[:, i - 1], f"i = {i}", color(j)) for j, i in enumerate(ks(p.shape[1]))]
        return [out + [hline(run.steps, 2.0, "2 (stability limit)", "#d62728", "dotted")]]

    def note_text(self, run: Run) -> str:
        return _gd_notes(run, log_axis=True)


class Energy(Picked):
    """E_t(φ, k) along t for k = 1, 2, 5, 10, … (NSA Fig. 3a–e) and against k on a log axis at
    chosen steps, every measured k with its bracket shaded; below, E_t(φ, k) as a heat map over
    (t, log k) beside its bracket's width.  φ chosen.  For φ = df_pred (Fig. 3d) the real update df̃_t
    is drawn dashed."""

    title = "NSA Fig. 3a–e — relative energy E_t(φ, k) = Σ_{i≤k} ⟨v_i^t, φ⟩² / ‖φ‖²"
    note_color = NOTE_GREY  # the bracket note: how the curves were measured, not a warning
    figures = (
        "fig3a_energy_y",
        "fig3b_energy_f",
        "fig3c_energy_residual",
        "fig3d_energy_df",
        "fig3e_energy_f_test",
        "energy_against_k",
    )
    PHIS = {
        "y": "3a: labels y",
        "f": "3b: outputs f_t",
        "residual": "3c: residual m_t",
        "df_pred": "3d: first-order update df_t (real df̃_t dashed)",
        "f_test": "3e: test outputs f_t(X')",
        "df": "real update df̃_t = f_{t+1} − f_t",
    }
    pick_title = "steps t (curves against k)"
    plots = (
        Plot("step t", "E_t(φ, k)", title="along t, one line per k", width=560),
        Plot("k", "E_t(φ, k)", x_log=True, title="against k at the chosen steps", width=560),
    )

    def __init__(self, run: Run) -> None:
        options = [(p, f"Fig. {w}" if w[0].isdigit() else w) for p, w in self.PHIS.items() if run.has(f"energy_{p}")]
        self.phi = Select(title="φ", value=options[0][0], options=options, width=330)
        super().__init__(run, [self.phi])
        self.map = _EnergyMap()
        self.body.children.append(self.map.layout)

    def read(self, run: Run) -> dict[str, Any]:
        data = super().read(run)
        data["map"] = _EnergyMap.read(run.curve(f"energy_{self.phi.value}"))
        return data

    def show(self, data: dict[str, Any]) -> None:
        super().show(data)
        self.map.show(data["map"])

    def series(self, run: Run) -> list[list[Series]]:
        phi = self.phi.value
        curve, steps = run.curve(f"energy_{phi}"), run.steps
        rows = ks(int(curve.k[-1]))
        along = [_along_t(curve, k, f"k = {k}", color(j)) for j, k in enumerate(rows)]
        if phi == "df_pred" and run.has("energy_df"):
            real = run.curve("energy_df")
            along += [
                Series(steps, real.at(k)[0], f"k = {k}, real df̃", color(j), "dashed", markers=False)
                for j, k in enumerate(rows)
                if k <= real.k[-1]
            ]
        pos = {int(t): j for j, t in enumerate(steps)}
        against = [_against_k(curve, pos[t], f"t = {t}", color(j)) for j, t in enumerate(self.picked(run))]
        return [along, against]

    def note_text(self, run: Run) -> str:
        return bracket_note(run)


def bracket_note(run: Run) -> str:
    """The note of a panel of bracketed curves: on the quadrature route, where k is exact and how
    the shaded brackets are guaranteed (:func:`nsa_dist.plots.brackets.bracket_caption`); "" on the
    exact route (no bracket)."""
    from nsa_dist.plots.brackets import bracket_caption

    return bracket_caption(run) if run.energy_route == "quadrature" else ""


def _band(lo: np.ndarray, hi: np.ndarray, value: np.ndarray, log: bool) -> tuple[np.ndarray, np.ndarray]:
    """A band on a log axis keeps a lower bound ≤ 0 at half the smallest positive value (it runs
    off the bottom rather than being cut)."""
    if not log:
        return lo, hi
    pos = np.asarray(value, np.float64)
    pos = pos[np.isfinite(pos) & (pos > 0)]
    floor = float(pos.min()) / 2 if len(pos) else 1e-300
    return np.maximum(lo, floor), np.maximum(hi, floor)


def _against_k(curve: Any, j: int, label: str, col: str, log: bool = False) -> Series:
    """Row ``j`` (a step) of a bracketed curve against k, its bracket a staircase band where it is
    not a point (:func:`nsa_dist.plots.brackets.band_polygon`); markers at the measured k beyond the
    exact part."""
    from nsa_dist.plots.brackets import band_polygon

    k, v, lo, hi = curve.k, curve.value[j], curve.lower[j], curve.upper[j]
    band = band_x = None
    if not curve.degenerate and np.any(hi > lo):
        ok = np.isfinite(lo) & np.isfinite(hi)
        band_x, blo, bhi = band_polygon(k[ok], lo[ok], hi[ok], curve.increasing)
        band = _band(blo, bhi, v, log)
    return Series(k, v, label, col, markers=len(k) <= 60, band=band, band_x=band_x)


def _along_t(curve: Any, k: int, label: str, col: str, log: bool = False) -> Series:
    """A bracketed curve at one k along t, its bracket shaded where it is not a point."""
    value, lo, hi = curve.at(k)
    band = _band(lo, hi, value, log) if np.any(hi > lo) else None
    return Series(curve.steps, value, label, col, band=band)


class Fig4a(Picked):
    """⟨v_i^t, m_t⟩² against i at chosen steps (log y; NSA Fig. 4a)."""

    title = "NSA Fig. 4a — spectral projections ⟨v_i^t, m_t⟩² of the residual"
    figures = ("fig4a_residual_projections",)
    plots = (Plot("index i", "⟨v_i^t, m_t⟩²", y_log=True),)

    default = staticmethod(spread(2))  # the first and the last, as nsa plot
    default_text = "first and last"

    def steps_of(self, run: Run) -> np.ndarray:
        """The steps with projections: every finished step when stored, else the eigenvector steps."""
        return run.steps if run.has("projections_residual") else run.eigenvector_steps

    def series(self, run: Run) -> list[list[Series]]:
        need(self.steps_of(run), "step with stored projections (or eigenvectors)")
        out = []
        for j, t in enumerate(self.picked(run)):
            p, r = residual_projections(run, t), run.numerical_rank(t, among_stored=True)
            label = f"t = {t}" + (f" (beyond i = {r}: G_t's numerical rank, one basis of many)" if r < len(p) else "")
            i = np.arange(1, len(p) + 1)
            if len(p) <= _JOINED:
                out.append(Series(i, p, label, color(j)))
            else:  # as nsa plot's Fig. 4a: the points, and their means over runs of i (joined, a solid band)
                centre, mean = _binned_mean(p)
                out.append(Series(i, p, f"{label}: each i", color(j), line=False))
                out.append(Series(centre, mean, f"t = {t}: mean over {len(centre)} bins of i", color(j), markers=False))
        return [out]


class Fig7d(Curves):
    """E_{t1}(v_i^{t2}, k) against k (log x) for rows i (NSA Fig. 7d); the pair stored at the end,
    or one chosen among the eigenvector steps."""

    title = "NSA Fig. 7d — spectrum preservation E_{t1}(v_i^{t2}, k)"
    figures = ("fig7d_preservation",)
    plots = (Plot("k (top eigenvectors of G_t1)", "E_t1(v_i^t2, k)", x_log=True, width=700),)
    STORED = "stored"

    def __init__(self, run: Run) -> None:
        opts = [self.STORED] + step_options(run.eigenvector_steps)
        self.t1 = Select(title="t1", value=self.STORED, options=opts, width=150)
        self.t2 = Select(title="t2", value=self.STORED, options=opts, width=150)
        self.pair = ""
        super().__init__(run, [self.t1, self.t2])

    def choices(self, run: Run) -> list[tuple[Any, list[str]]]:
        opts = [self.STORED] + step_options(run.eigenvector_steps)
        return [(self.t1, opts), (self.t2, opts)]

    def series(self, run: Run) -> list[list[Series]]:
        a, b = self.t1.value, self.t2.value
        if not run.has("preservation") and len(run.eigenvector_steps) < 2:
            need([], "two steps with stored eigenvectors (or the pair stored at the end)")
        if self.STORED in (a, b):
            P, t1, t2, rows = run.spectrum_preservation()
        else:
            P, t1, t2, rows = run.spectrum_preservation(int(a), int(b))
        self.pair = f"t1 = {t1}, t2 = {t2}"
        k = np.arange(1, P.shape[1] + 1)
        return [[Series(k, E, f"i = {i}", color(j), markers=len(k) <= 60) for j, (i, E) in enumerate(zip(rows, P))]]

    def read(self, run: Run) -> dict[str, Any]:
        data = super().read(run)
        data["pair"] = self.pair
        return data

    def show(self, data: dict[str, Any]) -> None:
        super().show(data)
        self.figs[0].title.text = data["pair"]


class Eqs45(Curves):
    """‖m_t‖ and E_t(m_t, k) measured beside GD's prediction with G fixed at its first recorded
    value (NSA Eqs. 4–5); with test points, App. E's Eq. 22 (Nyström) for the test residual."""

    title = "NSA Eqs. 4–5 (and App. E, Eq. 22) — the residual under a constant Gramian G_t0 vs measured"
    figures = ("eqs45_constant_gram",)

    def __init__(self, run: Run) -> None:
        self.test = run.has("constant_gram_f_test")
        plots = (Plot("step t", "‖m_t‖", y_log=True, width=420), Plot("step t", "E_t(m_t, k)", width=420))
        if self.test:
            plots += (Plot("step t", "test residual ‖f_t(X') − y'‖", y_log=True, width=420, title="App. E"),)
        super().__init__(run, plots=plots)

    def series(self, run: Run) -> list[list[Series]]:
        if not run.has("constant_gram_residual"):
            raise Waiting("Eqs. 4–5's prediction is written when the run finishes")
        pred, E = run.array("constant_gram_residual"), run.array("constant_gram_energy")  # (S_all, 2), (S_all, K)
        idx = [int(np.flatnonzero(run.schedule == t)[0]) for t in run.steps]
        t, t0 = run.steps, int(run.schedule[0])
        norms = [
            Series(t, pred[idx, 1], "measured ‖m_t‖", color(0)),
            Series(t, pred[idx, 0], f"Eq. 5 with G_{t0} fixed", color(1), "dashed"),
        ]
        measured = run.energy("residual")
        energy = []
        for j, k in enumerate(ks(E.shape[1], (1, 10, 100, 500))):
            energy += [
                Series(t, measured[:, k - 1], f"k = {k}, measured", color(j)),
                Series(t, E[idx, k - 1], f"k = {k}, Eq. 5", color(j), "dashed", markers=False),
            ]
        out = [norms, energy]
        if self.test:
            pred_test, yt = run.kernel.constant_gram_test()[idx], run.array("y_test")
            meas = np.stack([run.outputs(int(s), "f_test") for s in t])
            norm = lambda F: np.linalg.norm((F - yt[None]).reshape(len(F), -1), axis=1)  # noqa: E731
            out.append(
                [
                    Series(t, norm(meas), "measured", color(0)),
                    Series(t, norm(pred_test), "Eq. 22 (Nyström, App. E)", color(1), "dashed"),
                ]
            )
        return out

    def note_text(self, run: Run) -> str:
        if not run.has("constant_gram_residual") or not len(run.steps):
            return ""
        pred = run.array("constant_gram_residual")[[int(np.flatnonzero(run.schedule == t)[0]) for t in run.steps], 0]
        bad = run.steps[~np.isfinite(pred) | (pred > 1e300)]
        if not len(bad):
            return ""
        return (
            f"Eq. 5's prediction is not finite from t = {int(bad[0])} (not drawn there): with G fixed, GD "
            "diverges when δ > 2N/λ_max(G_t0)" + ("; see the notes above" if run.notes else "")
        )


class AppF(Picked):
    """v_iᵀ(G_{t+1} − G_t)v_i measured and to first order (Eqs. 25–26) at the eigenvector steps, and
    ‖Vᵀ dG_t V‖_F relative to ‖λ_{1..k}‖ along t (NSA App. F)."""

    title = "NSA App. F — the first-order change dG_t of the Gramian"
    figures = ("appF_gram_change",)
    plots = (
        Plot("i", "v_iᵀ dG_t v_i (≈ dλ_i)", width=560),
        Plot("step t", "relative to ‖λ_1..k‖", y_log=True, width=480),
    )

    pick_title = "steps t (left)"

    def steps_of(self, run: Run) -> np.ndarray:
        """The eigenvector steps (App. F's dG_t is stored at them)."""
        return run.eigenvector_steps

    def series(self, run: Run) -> list[list[Series]]:
        need(run.eigenvector_steps, "step with stored eigenvectors")
        gc = run.kernel.gram_change()
        i = np.arange(1, gc["measured"].shape[1] + 1)
        pos = {int(t): j for j, t in enumerate(gc["steps"])}
        left = []
        for j, t in enumerate(self.picked(run)):
            left += [
                Series(i, gc["measured"][pos[t]], f"measured, t = {t}", color(j)),
                Series(i, gc["first_order"][pos[t]], f"first order, t = {t}", color(j), "dashed"),
            ]
        lam = run.eigenvalues[[int(np.flatnonzero(run.steps == t)[0]) for t in gc["steps"]]][:, : len(i)]
        scale = np.linalg.norm(lam, axis=1)  # ‖Vᵀ G_t V‖_F = ‖λ_{1..Kg}‖
        names = ("‖Vᵀ(G_{t+1} − G_t)V‖_F", "‖Vᵀ dG_t V‖_F (Eq. 26)", "difference")
        right = [
            Series(gc["steps"], gc["fro"][:, c] / scale, n, color(c), ("solid", "dashed", "dotted")[c])
            for c, n in enumerate(names)
        ]
        return [left, right]


class Loss(Curves):
    """L(θ_t) of every trained step (log-log against t + 1), the recorded steps and the test loss."""

    title = "Loss L(θ_t) (NSA Fig. 7b–c for this run)"
    figures = ("loss",)
    plots = (Plot("step t + 1", "L(θ_t)", x_log=True, y_log=True, width=700),)

    def series(self, run: Run) -> list[list[Series]]:
        trace = np.asarray(run.loss_trace, np.float64)
        ok = np.flatnonzero(np.isfinite(trace))
        out = [
            Series(ok + 1.0, trace[ok], "training loss, every step", color(0), markers=False),
            Series(run.steps + 1.0, run.train_loss, "recorded steps", color(0)),
        ]
        if run.has("loss_test"):
            out.append(Series(run.steps + 1.0, run.test_loss, "test loss", color(1)))
        return [out]


def _edges(c: np.ndarray, log: bool) -> np.ndarray:
    """(n + 1,) cell edges around the centres ``c`` (ascending): midpoints, in log space for ``log``."""
    e = np.log(np.asarray(c, np.float64)) if log else np.asarray(c, np.float64)
    if len(e) == 1:
        return np.exp(e + [-0.5, 0.5]) if log else e + np.array([-0.5, 0.5])
    mid = 0.5 * (e[1:] + e[:-1])
    out = np.concatenate([[e[0] - (mid[0] - e[0])], mid, [e[-1] + (e[-1] - mid[-1])]])
    return np.exp(out) if log else out


class _EnergyMap:
    """E_t(φ, k) over (t, log k) as a heat map, and beside it the width of its bracket upper − lower
    (zero on the exact route and for k ≤ top: a wide bracket shows as a bright cell, never hidden in
    a smooth colour) — the :class:`Energy` panel's third row.  Every measured k up to :data:`MAP_K`
    of them (log-spaced in k beyond)."""

    MAP_K = 120

    def __init__(self) -> None:
        from bokeh.layouts import row
        from bokeh.models import ColorBar, ColumnDataSource, LinearColorMapper

        from nsa_dist.serve._live import new_figure

        self.sources, self.mappers, figs = [], [], []
        for title, palette in (
            ("E_t(φ, k) over t and k", "Viridis256"),
            ("its bracket's width, upper − lower", "Magma256"),
        ):
            src = ColumnDataSource({"left": [], "right": [], "bottom": [], "top": [], "v": []})
            mapper = LinearColorMapper(palette=palette, low=0.0, high=1.0)
            fig = new_figure(
                title, "step t", "k", y_log=True, width=500, height=320, css_classes=["nsa-plot", "nsa-energy-map"]
            )
            fig.quad(
                left="left",
                right="right",
                bottom="bottom",
                top="top",
                source=src,
                fill_color={"field": "v", "transform": mapper},
                line_alpha=0,
            )
            fig.add_layout(ColorBar(color_mapper=mapper, width=10), "right")
            self.sources.append(src)
            self.mappers.append(mapper)
            figs.append(fig)
        self.layout = row(*figs)

    @classmethod
    def picked(cls, k: np.ndarray) -> np.ndarray:
        """Indices into the measured ``k`` (ascending) of the map's rows: every one when there are
        at most :data:`MAP_K`, else :data:`MAP_K` of them log-spaced in k (each a measured k; at
        small k, where log-spaced points fall between integers, every k)."""
        n = len(k)
        if n <= cls.MAP_K:
            return np.arange(n)

        def spaced(m: int) -> np.ndarray:
            return np.unique(np.clip(np.searchsorted(k, np.geomspace(k[0], k[-1], m)), 0, n - 1))

        # points merge at small k: the most of them that give at most MAP_K rows
        lo, hi, best = cls.MAP_K, min(64 * n, 1 << 20), spaced(cls.MAP_K)
        while lo < hi:
            m = (lo + hi + 1) // 2
            got = spaced(m)
            if len(got) <= cls.MAP_K:
                lo, best = m, got
            else:
                hi = m - 1
        return best

    @classmethod
    def read(cls, curve: Any) -> dict[str, Any]:
        """The cells of both maps from a :class:`~nsa_dist.client.BracketedCurve` (worker thread)."""
        k = curve.k
        pick = cls.picked(np.asarray(k))
        k, value, width = k[pick], curve.value[:, pick], curve.width[:, pick]
        xe, ye = _edges(np.asarray(curve.steps, np.float64), False), _edges(k, True)
        S, n = value.shape
        cells = {
            "left": np.repeat(xe[:-1], n),
            "right": np.repeat(xe[1:], n),
            "bottom": np.tile(ye[:-1], S),
            "top": np.tile(ye[1:], S),
        }
        # a point (no bracket) is width 0; where E itself is NaN (a step's update not seen) so is its width —
        # it showed as 0, "exact" (an audit)
        w = np.where(np.isfinite(value), np.nan_to_num(width, nan=0.0), np.nan).ravel()
        wide = float(np.nanmax(w)) if np.isfinite(w).any() else 0.0
        return {"maps": [{**cells, "v": value.ravel()}, {**cells, "v": w}], "wide": wide}

    def show(self, data: dict[str, Any]) -> None:
        for src, cols in zip(self.sources, data["maps"]):
            src.data = cols
        self.mappers[1].high = max(data["wide"], 1e-12)  # the width's scale: its largest value (0 → a flat map)
