"""The Hessian paper's figures of one run (H = I + S at the analysed steps), each with the
predictions the run stores beside the measurements: the exact Tr(I^k), the Θ∞ limit of I, the
limits of S (E[Tr S] at initialisation and along GD, Tr(S²) = ∇CᵀΥ̃∇C), all read through
``run.hessian`` (:class:`nsa_dist.client.HessianView`) as ``nsa plot`` reads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from nsa_dist.plots.axes import density_note, density_on_log_axis
from nsa_dist.serve._curves import (
    Curves,
    Picked,
    Plot,
    Series,
    chosen,
    color,
    hline,
    last_options,
    need,
    spread,
    step_options,
    step_select,
)

if TYPE_CHECKING:
    from nsa_dist.client import Run

__all__ = [
    "Moments",
    "Orthogonality",
    "Rayleigh",
    "EdgeOfStability",
    "Density",
    "ISpectrum",
    "Additivity",
    "TraceS",
    "SNorms",
]

_BLACK, _LIMIT_I, _LIMIT_S = "#000000", "#d62728", "#8c564b"  # S's limits: not the green of S itself


def _finite(a: Any) -> bool:
    return bool(np.isfinite(np.asarray(a, np.float64)).any())


class _HessianCurves(Curves):
    """A Hessian figure: a note while no analysed step is finished."""

    def read(self, run: Run) -> dict[str, Any]:
        need(run.hessian.steps, "step with a Hessian analysis")
        return super().read(run)


class Moments(_HessianCurves):
    """Tr(A^k), k = 1..4, of H, I, S (Hutch++ ± one standard error) with the exact Tr(I^k), its Θ∞
    limit and the limits of S: E[Tr S_t] (k = 1) and ∇CᵀΥ̃∇C (k = 2) (Hessian paper Fig. 1)."""

    title = "Hessian paper Fig. 1 — moments Tr(A^k) of H = I + S, measured and predicted"
    figures = ("hessian_moments",)
    ncols = 2
    plots = tuple(
        Plot("step t", "trace" if k in (1, 3) else "", title=f"Tr(A^{k})", width=600, height=300) for k in range(1, 5)
    )

    def series(self, run: Run) -> list[list[Series]]:
        h = run.hessian
        t = h.steps
        parts = {p: h.moments(p) for p in "HIS"}
        exact = h.moments("I_exact")["estimate"]
        limit = h.moments("I_limit")["estimate"] if run.has("hessian_I_limit_moments") else None
        S_lim = h.S_limit() if run.has("hessian_S_limit") else None
        out = []
        for k in range(4):
            s = [
                Series(t, m["estimate"][:, k], f"{p} (Hutch++)", color(j), err=m["stderr"][:, k])
                for j, (p, m) in enumerate(parts.items())
            ]
            if _finite(exact[:, k]):
                s.append(Series(t, exact[:, k], "I exact (NTK Gram)", _BLACK, "dashed", markers=False))
            if limit is not None and _finite(limit[:, k]):
                s.append(Series(t, limit[:, k], "I limit (Θ∞, kernel PCA)", _LIMIT_I, "dotted", markers=False))
            if S_lim is not None and k < 2:
                pred = S_lim["trace_S" if k == 0 else "trace_S2"]
                if _finite(pred):
                    s.append(
                        Series(
                            t,
                            pred,
                            "S limit: E[Tr S_t] (MSE GD)" if k == 0 else "S limit: ∇CᵀΥ̃∇C",
                            _LIMIT_S,
                            "dashdot",
                            markers=False,
                        )
                    )
            out.append(s)
        return out


class Orthogonality(_HessianCurves):
    """‖IS‖_F / (‖I‖_F ‖S‖_F) along t ± one standard error (Hessian paper Fig. 3)."""

    title = "Hessian paper Fig. 3 — orthogonality of I and S: ‖IS‖_F / (‖I‖_F ‖S‖_F)"
    figures = ("hessian_orthogonality",)
    plots = (Plot("step t", "normalised ‖IS‖_F"),)

    def series(self, run: Run) -> list[list[Series]]:
        o = run.hessian.orthogonality
        return [[Series(run.hessian.steps, o["value"], "‖IS‖_F / (‖I‖_F‖S‖_F)", err=o["stderr"])]]


class Rayleigh(_HessianCurves):
    """vᵀIv and vᵀSv over the top eigenvectors of I and of S at a chosen analysed step (Hessian
    paper Fig. 3)."""

    title = "Hessian paper Fig. 3 — Rayleigh quotients along the eigenvectors of I and of S"
    figures = ("hessian_fig3_rayleigh",)
    plots = (
        Plot("eigenvector i of I", "Rayleigh quotient", title="along eigenvectors of I", width=460),
        Plot("eigenvector i of S", "Rayleigh quotient", title="along eigenvectors of S", width=460),
    )

    def __init__(self, run: Run) -> None:
        self.step = step_select("step t", run.hessian.steps)
        super().__init__(run, [self.step])

    def choices(self, run: Run) -> list[tuple[Any, list[Any]]]:
        return [(self.step, last_options(run.hessian.steps))]

    def series(self, run: Run) -> list[list[Series]]:
        (t,) = chosen(self.step, run.hessian.steps, lambda s: step_options(s)[-1:])
        R = run.hessian.rayleigh(t)
        out = []
        for key in ("I", "S"):
            i = np.arange(1, R[key].shape[1] + 1)
            out.append(
                [
                    Series(i, R[key][0], f"vᵀIv, t = {t}", color(0)),
                    Series(i, R[key][1], "vᵀSv", color(1)),
                    hline(i, 0.0, "0"),
                ]
            )
        return out


class EdgeOfStability(_HessianCurves):
    """λ_max(H)·δ_t / 2 along t against 1 (GD on the local quadratic is stable below 1)."""

    title = "Hessian paper — edge of stability λ_max(H)·δ_t / 2 (not a figure of the paper)"
    figures = ("hessian_edge_of_stability",)
    plots = (Plot("step t", "λ_max(H) δ_t / 2"),)

    def series(self, run: Run) -> list[list[Series]]:
        t = run.hessian.steps
        return [
            [
                Series(t, run.hessian.edge_of_stability(), "λ_max(H) δ_t / 2"),
                hline(t, 1.0, "1 (edge of stability)", _LIMIT_I),
            ]
        ]


class _HessianPicked(Picked):
    """A Hessian figure at analysed steps picked by the user."""

    def steps_of(self, run: Run) -> np.ndarray:
        """The analysed steps."""
        return run.hessian.steps

    def read(self, run: Run) -> dict[str, Any]:
        need(run.hessian.steps, "step with a Hessian analysis")
        return super().read(run)


class Density(_HessianPicked):
    """The SLQ spectral density of H at chosen analysed steps (log y)."""

    title = "Hessian paper § the matrix I — spectral density of H (stochastic Lanczos quadrature)"
    figures = ("hessian_density",)
    plots = (Plot("eigenvalue of H", "density", y_log=True, width=700),)

    default = staticmethod(spread(4))
    default_text = "four spread from the first to the last"

    def series(self, run: Run) -> list[list[Series]]:
        out = []
        for j, t in enumerate(self.picked(run)):
            grid, dens = run.hessian.density(t)
            out.append(Series(grid, density_on_log_axis(dens)[0], f"t = {t}", color(j), markers=False))
        return [out]

    def note_text(self, run: Run) -> str:
        counts = [density_on_log_axis(run.hessian.density(t)[1]) for t in self.picked(run)]
        return density_note(sum(n for _, n in counts), sum(len(d) for d, _ in counts))


class ISpectrum(_HessianPicked):
    """The eigenvalues of I (outside its null space) measured at chosen steps beside the kernel
    PCA of Θ∞ (the paper's limit) — log-log."""

    title = "Hessian paper § the matrix I — eigenvalues of I: measured vs the Θ∞ limit (kernel PCA)"
    figures = ("hessian_I_spectrum",)
    plots = (Plot("index i", "λ_i(I)", x_log=True, y_log=True, width=700),)

    default = staticmethod(spread(3))
    default_text = "first, middle and last"

    def series(self, run: Run) -> list[list[Series]]:
        steps = run.hessian.steps
        mu, lim = run.hessian.I_eigenvalues(), run.hessian.I_eigenvalues(limit=True)
        pos = {int(t): j for j, t in enumerate(steps)}
        i = np.arange(1, mu.shape[1] + 1)
        out = []
        for j, t in enumerate(self.picked(run)):
            out.append(Series(i, mu[pos[t]], f"measured, t = {t}", color(j), markers=len(i) <= 60))
            if _finite(lim[pos[t]]):
                out.append(Series(i, lim[pos[t]], f"limit (Θ∞), t = {t}", color(j), "dashed", markers=False))
        return [out]


class Additivity(_HessianCurves):
    """Theorem 1: (Tr H^k − Tr I^k − Tr S^k) / |Tr H^k|, k = 1..4, ± its standard error."""

    title = "Hessian paper, Theorem 1 — additivity: (Tr H^k − Tr I^k − Tr S^k) / |Tr H^k|"
    figures = ("hessian_additivity",)
    ncols = 2
    plots = tuple(
        Plot("step t", "relative gap" if k in (1, 3) else "", title=f"k = {k}", width=520, height=280)
        for k in range(1, 5)
    )

    def series(self, run: Run) -> list[list[Series]]:
        t, g = run.hessian.steps, run.hessian.additivity()
        H = np.abs(run.hessian.moments("H")["estimate"])
        out = []
        for k in range(4):
            with np.errstate(all="ignore"):
                rel, se = g["estimate"][:, k] / H[:, k], g["stderr"][:, k] / H[:, k]
            out.append([Series(t, rel, "gap / |Tr(H^k)|", err=se), hline(t, 0.0, "0")])
        return out


class TraceS(_HessianCurves):
    """Proposition 4: Tr(S) as ∇Cᵀ·G and by Hutch++ on S (± standard errors) beside the limits
    E[Tr S_t] along GD and E[Tr S] at initialisation (a star at t = 0)."""

    title = "Hessian paper, Proposition 4 — Tr(S) = ∇Cᵀ·G against Hutch++ and the limits"
    figures = ("hessian_trace_S",)
    plots = (Plot("step t", "Tr(S)", width=700),)

    def series(self, run: Run) -> list[list[Series]]:
        t, tr = run.hessian.steps, run.hessian.trace_S()
        out = [
            Series(t, tr["G"], "∇Cᵀ·G (probes)", color(0), err=tr["G_stderr"]),
            Series(t, tr["hutchpp"], "Hutch++ on S", color(1), "dashed", err=tr["hutchpp_stderr"]),
        ]
        if run.has("hessian_S_limit"):
            lim = run.hessian.S_limit()
            if _finite(lim["trace_S"]):
                out.append(Series(t, lim["trace_S"], "limit E[Tr S_t] (MSE GD)", _LIMIT_S, "dashdot", markers=False))
            if _finite(lim["trace_S_init"]) and len(t):
                # at t = 0, where it applies, whichever step the Hessian was first analysed at
                out.append(Series(np.zeros(1), lim["trace_S_init"][:1], "limit E[Tr S] at init = K Tr(Φ̃)/N", _LIMIT_I))
        return [out + [hline(t, 0.0, "0")]]


class SNorms(_HessianCurves):
    """‖S‖_op (Lanczos) beside Tr(S⁴)^{1/4} and ‖S‖_F = Tr(S²)^{1/2}, and the limit (∇CᵀΥ̃∇C)^{1/2}
    (Proposition 4, consequence 2; log y)."""

    title = "Hessian paper, Proposition 4, consequence 2 — ‖S‖_op ≤ Tr(S⁴)^{1/4} ≤ ‖S‖_F"
    figures = ("hessian_S_norms",)
    plots = (Plot("step t", "norm of S", y_log=True, width=700),)

    def series(self, run: Run) -> list[list[Series]]:
        t, n = run.hessian.steps, run.hessian.S_norms()
        out = [
            Series(t, n["op"], "‖S‖_op", color(0)),
            Series(t, n["k4"], "Tr(S⁴)^{1/4} (±1 s.e.)", color(1), "dashed", err=n["k4_stderr"]),
            Series(t, n["k2"], "‖S‖_F = Tr(S²)^{1/2} (±1 s.e.)", color(2), "dashed", err=n["k2_stderr"]),
        ]
        if run.has("hessian_S_limit"):
            lim = run.hessian.S_limit()["trace_S2"]
            if _finite(lim):
                out.append(
                    Series(t, np.sqrt(np.clip(lim, 0, None)), "limit (∇CᵀΥ̃∇C)^{1/2}", _LIMIT_S, "dotted", markers=False)
                )
        return [out]
