"""NSA Fig. 4d (the output from its top-k eigenvectors) and App. F (the first-order change of G_t)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.plots.axes import (
    PlotOptions,
    add_top_note,
    colors,
    family_label,
    footnote,
    legend,
    new_figure,
    picture_data,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from nsa_dist.client import Run


def fig4d(run: Run, opts: PlotOptions = PlotOptions()) -> Figure:
    """f̄_{t,k} = Σ_{i≤k} ⟨v_i, f̄_t⟩ v_i at k = 10, 100, 200, 500 (≤ K) at an eigenvector step: the
    last chosen one (``--step 20000 599999``: 599999, as the paper shows the end of training), default
    the last stored; images on [0, 1]² for 2-D data (the paper's linear interpolation), else f̄_{t,k}
    against f̄_t at the training points."""
    from nsa_dist.plots.images import _image

    steps = run.eigenvector_steps
    chosen = [t for t in (opts.steps or ()) if t in set(steps.tolist())]
    t = int(chosen[-1] if chosen else steps[-1])
    rec = run.kernel.reconstructions(t)
    ks = [int(k) for k in rec["k"]]
    fig, ax = new_figure(
        run,
        "4d",
        rf"$\bar f_{{t,k}}$ from the top $k$ eigenvectors of $G_t$, t = {t}",
        ncols=len(ks),
        panel=(3.9, 3.3),
        images="images" in rec,
    )
    f = run.outputs(t)
    for a, j, k in zip(ax[0], range(len(ks)), ks):
        if "images" in rec:
            _image(a, rec["images"][j], f"k = {k}", down=picture_data(run))
            continue
        fk = np.asarray(rec["f"][j]).reshape(-1)
        a.plot(np.asarray(f).reshape(-1), fk, ".", ms=3)
        lim = [float(np.nanmin(f)), float(np.nanmax(f))]
        a.plot(lim, lim, "k--", lw=0.8)
        a.set(title=f"k = {k}", xlabel=r"$\bar f_t$", ylabel=r"$\bar f_{t,k}$")
    add_top_note(fig, run)
    return fig


def appF(run: Run) -> Figure:
    """App. F: v_iᵀ(G_{t+1} − G_t)v_i measured and its first-order value (Eqs. 25–26) at each
    eigenvector step, and ‖Vᵀ dG_t V‖_F relative to ‖Vᵀ G_t V‖_F along t."""
    gc = run.kernel.gram_change()
    fig, ax = new_figure(run, "App. F", r"first-order change $dG_t$ of the Gramian", ncols=2)
    left, right = ax[0]
    i = np.arange(1, gc["measured"].shape[1] + 1)
    cols, labels = colors(len(gc["steps"])), [family_label("t", int(t)) for t in gc["steps"]]
    for j, (c, label) in enumerate(zip(cols, labels)):  # one colour per step: a colour key when many
        left.plot(i, gc["measured"][j], "o-", ms=3, color=c, label=label)
        left.plot(i, gc["first_order"][j], "x--", ms=4, color=c)
    left.plot([], [], "ko-", ms=3, label="measured")  # legend entries for the two line styles
    left.plot([], [], "kx--", ms=4, label="first order (Eqs. 25–26)")
    left.set(xlabel="i", ylabel=r"$v_i^T\,dG_t\,v_i$  ($\approx d\lambda_i$)")
    left.xaxis.get_major_locator().set_params(integer=True)
    left.axhline(0.0, color="k", lw=0.5)
    legend(left, family=("t", labels, cols), fontsize=7)
    evals = run.eigenvalues[[int(np.flatnonzero(run.steps == t)[0]) for t in gc["steps"]]][:, : len(i)]
    scale = np.linalg.norm(evals, axis=1)  # ‖Vᵀ G_t V‖_F = ‖λ_{1..Kg}‖
    right.plot(gc["steps"], gc["fro"][:, 0] / scale, "o-", ms=3, label=r"$\Vert V^T(G_{t+1}-G_t)V\Vert_F$")
    right.plot(gc["steps"], gc["fro"][:, 1] / scale, "s--", ms=3, label=r"$\Vert V^T dG_t V\Vert_F$ (Eq. 26)")
    right.plot(gc["steps"], gc["fro"][:, 2] / scale, "^:", ms=3, label="difference")
    right.set(xlabel="step t", ylabel=r"relative to $\Vert\lambda_{1..k}\Vert$", yscale="log")
    right.grid(alpha=0.3)
    legend(right, fontsize=7)
    act = str(getattr(getattr(run.spec.model, "activation", None), "value", getattr(run.spec.model, "activation", "")))
    if act in ("relu", "leaky_relu"):  # the first-order change misses units that cross their kink
        footnote(
            fig,
            f"note: activation {act!r} is piecewise linear — Eqs. 25–26 differentiate it where it is smooth, "
            "so dG's first-order value misses units that cross the kink in update t (a smooth σ, e.g. tanh, "
            "matches the measured change to first order)",
            color="crimson",
        )
    return fig


def _say_if_diverging(ax: Axes, attrs: dict) -> None:
    """Above GD's stability bound the constant-Gram prediction diverges: say so on the panel (the
    predicted norm is +inf, not drawn, where it overflows float64)."""
    if not attrs.get("diverges"):
        return
    note = f"δ = {attrs['lr_max']:.3g} > 2N/λ_max(G_t0) = {attrs['stability_bound']:.3g}:\nthe prediction diverges"
    if attrs.get("overflow_step", -1) >= 0:
        note += f"\n(beyond float64 from t = {attrs['overflow_step']})"
    ax.text(
        0.02,
        0.03,
        note,
        transform=ax.transAxes,
        fontsize=7,
        color="C3",
        va="bottom",
        bbox={"facecolor": "white", "alpha": 0.8, "lw": 0},
    )


def eqs45(run: Run, opts: PlotOptions = PlotOptions()) -> Figure:
    """Eqs. 4–5: ‖m_t‖ and E_t(m_t, k) measured beside GD's prediction with G fixed at its first
    recorded value (E of the prediction in G_{t0}'s eigenbasis, the measured one in G_t's); with test
    points, App. E's Eq. 22 (Nyström extension) for the test residual beside the measured one."""
    from nsa_dist.plots.axes import ks as chosen_ks

    pred, E = run.array("constant_gram_residual"), run.array("constant_gram_energy")  # (S, 2), (S, K)
    idx = [int(np.flatnonzero(run.schedule == t)[0]) for t in run.steps]
    t0 = int(run.schedule[0])
    test = run.has("constant_gram_f_test")
    fig, ax = new_figure(
        run, "Eqs. 4–5", rf"residual under a constant Gramian $G_{{{t0}}}$ vs measured", ncols=3 if test else 2
    )
    left, right = ax[0][:2]
    if test:  # App. E, Eq. 22 with the Nyström extension
        pred_test, yt = run.kernel.constant_gram_test()[idx], run.array("y_test")  # (S', M[, Ko])
        meas = np.stack([run.outputs(int(t), "f_test") for t in run.steps])
        norm = lambda F: np.linalg.norm((F - yt[None]).reshape(len(F), -1), axis=1)  # noqa: E731
        a = ax[0][2]
        a.plot(run.steps, norm(meas), "o-", ms=3, label=r"measured $\Vert f_t(X') - y'\Vert$")
        a.plot(run.steps, norm(pred_test), "s--", ms=3, label="Eq. 22 (Nyström, App. E)")
        a.set(xlabel="step t", ylabel="test residual norm", yscale="log", title="test points")
        a.grid(alpha=0.3)
        legend(a)
    left.plot(run.steps, pred[idx, 1], "o-", ms=3, label=r"measured $\Vert m_t\Vert$")
    left.plot(run.steps, pred[idx, 0], "s--", ms=3, label=rf"Eq. 5 with $G_{{{t0}}}$ fixed")
    left.set(xlabel="step t", ylabel=r"$\Vert m_t\Vert$", yscale="log")
    left.grid(alpha=0.3)
    legend(left)
    _say_if_diverging(left, run.array_attrs("constant_gram_residual"))
    measured = run.energy("residual")  # (S, K)
    where = f"Eqs. 4–5 of run {run.id!r}"
    rows = chosen_ks(E.shape[1], opts.ks, where) if opts.ks else chosen_ks(E.shape[1], (1, 10, 100, 500))
    cols, labels = colors(len(rows)), [family_label("k", k) for k in rows]
    for c, k, label in zip(cols, rows, labels):
        right.plot(run.steps, measured[:, k - 1], "o-", ms=3, color=c, label=label)
        right.plot(run.steps, E[idx, k - 1], "--", color=c)
    right.plot([], [], "ko-", ms=3, label="measured")
    right.plot([], [], "k--", label="Eq. 5")
    right.set(xlabel="step t", ylabel=r"$E_t(m_t, k)$", ylim=(-0.02, 1.02))
    rank = run.numerical_rank(int(run.steps[0]), among_stored=True) if len(run.steps) else E.shape[1]
    beyond = [k for k in rows if k > rank]
    if beyond:  # G_{t0}'s eigenvectors there are one basis of many: Eq. 5's E is that basis's value
        right.set_title(f"k = {', '.join(map(str, beyond))}: beyond $G_{{{t0}}}$'s numerical rank {rank}", fontsize=8)
    right.grid(alpha=0.3)
    legend(right, family=("k", labels, cols), fontsize=7)
    add_top_note(fig, run)
    return fig
