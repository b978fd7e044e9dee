"""Parts of ``nsa show``: the line saying how a run measured its curves, and the Hessian table
(what a run measured of H = I + S and the paper's limits)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rich.table import Table

    from nsa_dist.client import Run

__all__ = ["curves_line", "hessian_table"]


def curves_line(run: Run) -> str:
    """How the run measured λ_k and E_t(φ, k): the route, the k measured exactly and, on the
    quadrature route, the kind of bracket beyond them (statistical at a confidence, or provable;
    :attr:`Run.curve_bracket` has the whole sentence)."""
    top, n = int(run.shape("eigenvalues")[1]), run.N
    if run.energy_route == "exact":
        mixed = _mixed_k(run)
        if mixed:
            return (
                f"curves: exact route, k = 1..{top} of N = {n}, E(φ, k) exact except at k {mixed}: inside a "
                "cluster of eigenvalues within rounding (a rank-deficient G's null space"
                + (", or below a float32 G's rounding" if run.spec.spectrum.dtype == "float32" else "")
                + "), where the "
                "eigenvectors are one arbitrary basis — bracketed there (Run.energy, energy_curve)"
            )
        if top >= n:
            return f"curves: exact route, every k = 1..N = {n} exact (eigendecomposition of G_t; no bracket)"
        return f"curves: exact route, k = 1..{top} exact (the eigenpairs kept, spectrum.k; no bracket)"
    conf = run.attrs.get("curve_confidence")
    if conf is not None:
        kind = f"λ_k's statistical, confidence {float(conf):g}"
    else:
        kind = "provable" if run.attrs.get("curve_bracket") else "its kind not recorded"
    return (
        f"curves: quadrature route, k = 1..{top} exact, {top + 1}..{n} bracketed ({kind}; "
        "Run.curve_bracket says how the brackets hold)"
    )


def _mixed_k(run: Run) -> str:
    """The k at which the exact route's E_t(y, k) is bracketed (an eigenvalue cluster), as ranges
    ("41..63"), and the recorded steps where (" at t = 0, 100" — the line named no step, a
    walk-through); "" when every k is exact or the run stores no energy_y."""
    try:
        curve = run.curve("energy_y")
    except KeyError:
        return ""
    ranges = curve.inexact_ranges()
    if not ranges:
        return ""
    wide = np.asarray(curve.upper > curve.lower)  # (S, k): bracketed there
    steps = [int(t) for t in np.asarray(curve.steps)[wide.any(axis=1)]]
    shown = ", ".join(map(str, steps[:6])) + (f" … ({len(steps)} steps)" if len(steps) > 6 else "")
    return f"{ranges} (at t = {shown})" if steps else ranges


def _pm(value: float, se: float) -> str:
    """ "v ± se" ("v" when se is 0 or NaN: exact, or one probe); "—" for NaN."""
    if not np.isfinite(value):
        return "—"
    return f"{value:.4g}" if not np.isfinite(se) or se == 0 else f"{value:.4g} ± {se:.2g}"


def _columns(n: int) -> list[int]:
    """Positions of the analysed steps shown (80 columns): all up to 3, else the first, middle, last."""
    return list(range(n)) if n <= 3 else [0, n // 2, n - 1]


def hessian_table(run: Run) -> Table | None:
    """The Hessian quantities at (up to three of) the analysed steps: Tr(A^k) ± standard error for
    A = H, I, S (Hutch++), the exact and limiting Tr(I^k), λ_max(H), ‖S‖_op, the orthogonality,
    Tr(S) = ∇Cᵀ·G, Theorem 1's gap and the limits of S; None when the run has no Hessian step."""
    from rich.table import Table

    if not run.has("hessian_steps") or not len(run.hessian.steps):
        return None
    steps = run.hessian.steps
    cols = _columns(len(steps))
    t = Table(title="Hessian H = I + S: Tr(A^k) by Hutch++ ± s.e.; the limits from the kernels")
    t.add_column("quantity")
    for i in cols:
        t.add_column(f"t = {steps[i]}", justify="right")

    def row(name: str, v: np.ndarray, se: np.ndarray | None = None) -> None:
        se = np.zeros_like(v) if se is None else se
        t.add_row(name, *(_pm(float(v[i]), float(se[i])) for i in cols))

    if run.has("hessian_moments"):
        for part in "HIS":
            m = run.hessian.moments(part)
            for k in range(4):
                row(f"Tr({part}^{k + 1})", m["estimate"][:, k], m["stderr"][:, k])
        for part, what in (("I_exact", "exact"), ("I_limit", "Θ∞ limit")):
            m = run.hessian.moments(part)["estimate"]
            if np.isfinite(m).any():
                for k in range(2):
                    row(f"Tr(I^{k + 1}) {what}", m[:, k])
    if run.has("hessian_top"):
        row("λ_max(H)", run.hessian.top("H")[:, 0])
    if run.has("hessian_S_op"):
        row("‖S‖_op", run.hessian.S_norms()["op"])
    if run.has("hessian_orthogonality"):
        o = run.hessian.orthogonality
        row("‖IS‖/(‖I‖‖S‖)", o["value"], o["stderr"])
    if run.has("hessian_additivity"):
        g = run.hessian.additivity()
        row("Thm 1 gap, k=2", g["estimate"][:, 1], g["stderr"][:, 1])
    if run.has("hessian_trace_S_G"):
        tr = run.hessian.trace_S()
        row("Tr(S) = ∇Cᵀ·G", tr["G"], tr["G_stderr"])
    if run.has("hessian_S_limit"):
        lim = run.hessian.S_limit()
        row("E[Tr S₀] limit", lim["trace_S_init"])
        row("E[Tr S_t] limit", lim["trace_S"])
        row("Tr(S²) limit", lim["trace_S2"])
    return t
