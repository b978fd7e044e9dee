"""Hessian measurements recorded along training: store, client, plots, against dense float64 references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import flat_model
from torch.func import hessian
from torch.nn.utils import vector_to_parameters

from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.models import build_model
from nsa_dist.pipeline import run_experiment, run_id
from nsa_dist.plots import plot_run
from nsa_dist.store import SpectrumStore

# P = 25 parameters: 60 probes make Hutch++'s sketch span R^P, so its moments are exact
SPEC = dict(
    name="hess",
    data={"n": 24},
    model={"depth": 2, "width": 6},
    steps=16,
    record={"every": 5},
    spectrum={"k": 8, "images": []},
    hessian={"every": 2, "probes": 60, "rayleigh_k": 4, "top_k": 3, "density_grid": 64, "lanczos_steps": 24},
)


def _dense_parts(model, X, y):
    """Dense H (P, P) of C = (1/2N) Σ (f − y)² and its Gauss–Newton part I = Jᵀ J / N."""
    flat, f = flat_model(model)
    loss = lambda v: 0.5 * ((f(v, X) - y) ** 2).mean()  # noqa: E731
    H = hessian(loss)(flat)
    J = torch.func.jacrev(lambda v: f(v, X))(flat)  # (N, P)
    I = J.T @ J / X.shape[0]
    return H.numpy(), I.numpy(), (H - I).numpy()


@pytest.fixture(scope="module")
def hess_run(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("h") / "s.zarr")
    spec = ExperimentSpec(**SPEC)
    out = run_experiment(spec, SpectrumStore(url))
    assert out.status == "done"
    return Client(url).run(out.run_id), spec


def test_recorded_hessian_quantities_match_dense_references(hess_run):
    run, spec = hess_run
    assert run.steps.tolist() == [0, 5, 10, 15]
    assert run.hessian.steps.tolist() == [0, 10, 15]
    data = load_dataset(spec.data, seed=spec.seed)
    model = build_model(spec.model, seed=spec.seed).double()
    X, y = torch.tensor(data.X, dtype=torch.float32).double(), torch.tensor(data.y)
    for j, t in enumerate(run.hessian.steps):
        i = int(np.flatnonzero(run.steps == t)[0])
        vector_to_parameters(torch.tensor(run.g["theta"][i], dtype=torch.float64), model.parameters())
        H, I, S = _dense_parts(model, X, y)
        for part, A in (("H", H), ("I", I), ("S", S)):
            ref = [np.trace(np.linalg.matrix_power(A, k)) for k in range(1, 5)]
            np.testing.assert_allclose(
                run.hessian.moments(part)["estimate"][j], ref, rtol=1e-8, atol=1e-10, err_msg=f"Tr({part}^k) at t={t}"
            )
        np.testing.assert_allclose(
            run.hessian.moments("I_exact")["estimate"][j],
            [np.trace(np.linalg.matrix_power(I, k)) for k in range(1, 5)],
            rtol=1e-8,
        )
        assert abs(np.trace(S)) < 1e-10 * np.abs(S).sum(), "Tr(S) = 0 for a piecewise-linear net with MSE"
        evals = {p: np.sort(np.linalg.eigvalsh(A))[::-1] for p, A in (("H", H), ("I", I), ("S", S))}
        for part in "HIS":
            np.testing.assert_allclose(run.hessian.top(part)[j], evals[part][:3], rtol=1e-7, atol=1e-10)
        R = run.hessian.rayleigh(int(t))
        np.testing.assert_allclose(R["I"][0], evals["I"][:4], rtol=1e-7, atol=1e-10)  # vᵀIv = λ(I) on I's eigvecs
        exact = np.linalg.norm(I @ S) / (np.linalg.norm(I) * np.linalg.norm(S))
        o = run.hessian.orthogonality
        assert abs(o["value"][j] - exact) <= 4 * o["stderr"][j] + 1e-12, (o["value"][j], exact, o["stderr"][j])
        grid, dens = run.hessian.density(int(t))
        assert abs(np.trapezoid(dens, grid) - 1) < 0.05
    np.testing.assert_allclose(run.hessian.edge_of_stability(), run.hessian.top("H")[:, 0] * run.lr[[0, 2, 3]] / 2)


def test_hessian_figures_and_unrecorded_steps(hess_run, tmp_path):
    run, _ = hess_run
    names = [
        "hessian_moments",
        "hessian_orthogonality",
        "hessian_fig3_rayleigh",
        "hessian_edge_of_stability",
        "hessian_density",
        "hessian_I_spectrum",
        "hessian_additivity",
        "hessian_trace_S",
        "hessian_S_norms",
    ]
    paths = plot_run(run, tmp_path, figures=names)
    assert [p.stem for p in paths] == names and all(p.stat().st_size > 10_000 for p in paths)
    with pytest.raises(KeyError, match="not a finished recorded step"):
        run.hessian.density(7)


# The Hessian paper's numbering: its text says "Figure 1" for the moments along training (the sign of
# Tr(S) per nonlinearity) and "Figure 3 illustrates the mutual orthogonality of I and S"; figures it
# does not have name the statement they draw (Theorem 1, Proposition 4, the kernel PCA of I).
_TITLES = {
    "hessian_moments": "Hessian paper Fig. 1 — moments",
    "hessian_orthogonality": "Hessian paper Fig. 3 — orthogonality of I and S",
    "hessian_fig3_rayleigh": "Hessian paper Fig. 3 — Rayleigh quotients",
    "hessian_additivity": "Hessian paper, Theorem 1 — additivity",
    "hessian_trace_S": "Hessian paper, Proposition 4 — Tr(S)",
    "hessian_S_norms": "Hessian paper, Proposition 4, consequence 2 — $\\Vert S\\Vert_{op}$",
    "hessian_I_spectrum": "Hessian paper, § the matrix I (kernel PCA of Θ∞) — eigenvalues of I",
    "hessian_density": "Hessian paper, § the matrix I (a few large eigenvalues, a bulk) — spectral density",
    "hessian_edge_of_stability": "Hessian paper — edge of stability",
}


def test_every_hessian_plot_title_follows_the_papers_numbering(hess_run):
    from nsa_dist.plots import FIGURES, make_figure
    from nsa_dist.plots.axes import title_of

    run, _ = hess_run
    assert {n for n in FIGURES if n.startswith("hessian_")} == set(_TITLES), "a Hessian figure without a checked title"
    for name, want in _TITLES.items():
        title = title_of(make_figure(run, name))  # unwrapped
        assert title.startswith(want), f"{name}: {title!r} should start with {want!r}"
        assert "Fig. —" not in title and "— —" not in title, title
        if "_fig" in name:  # a figure named after its number carries that number
            assert f"Fig. {name.split('_fig')[1][0]} " in title, (name, title)
    # the additivity gaps' y axes write their values out: no "+1.2e-3" offset above a panel (Audit V)
    fig = make_figure(run, "hessian_additivity")
    fig.canvas.draw()
    offsets = [ax.yaxis.get_offset_text().get_text() for ax in fig.axes if ax.get_yscale() == "linear"]
    assert offsets and not any("+" in o for o in offsets), offsets
    assert all(not ax.yaxis.get_major_formatter().get_useOffset() for ax in fig.axes if ax.get_yscale() == "linear")


def test_the_limits_of_S_apply_only_where_derived():
    """NaN, with the reason, for a non-NTK init (as the limit of I) and for relu (σ̈ is needed)."""
    from nsa_dist.data import load_dataset
    from nsa_dist.pipeline import plan_run
    from nsa_dist.pipeline.hessian_step import HessianAnalysis

    X, y = torch.zeros(4, 2), np.zeros(4)
    F = torch.zeros(4, 1, dtype=torch.float64)

    def analysis(spec: dict) -> HessianAnalysis:
        es = ExperimentSpec(**spec)
        return HessianAnalysis(plan_run(es, load_dataset(es.data)), X, y)

    for model, why in (
        ({"init": "xavier", "activation": "tanh"}, "init='xavier'"),
        ({"init": "ntk", "activation": "relu"}, "smooth σ"),
    ):
        h = analysis({**SPEC, "model": {"depth": 2, "width": 4, **model}})
        assert why in h.s_limit_reason(), h.s_limit_reason()
        assert np.isnan(h._limit_S(F, 3)).all()
    h = analysis(
        {**SPEC, "model": {"depth": 2, "width": 4, "init": "ntk", "activation": "tanh"}, "optimizer": {"name": "adam"}}
    )
    out = h._limit_S(F, 3)  # the GD prediction needs plain GD; E[Tr S] at t = 0 and Tr(S²) do not
    assert h.s_limit_reason() is None and np.isnan(out[1]) and np.isfinite(out[[0, 2]]).all(), out


def test_hessian_spec_errors():
    with pytest.raises(ValueError, match=r"hessian.steps \[7\] are not recorded steps"):
        ExperimentSpec(**{**SPEC, "hessian": {"steps": [0, 7]}})
    with pytest.raises(ValueError, match="probes"):
        ExperimentSpec(**{**SPEC, "hessian": {"probes": 0}})
    spec = ExperimentSpec(**{k: v for k, v in SPEC.items() if k != "hessian"})
    assert spec.hessian is None


# --------------------------------------------------------------------------- issue 10: theory beside measurement


def test_the_limits_hold_along_training_only_where_the_ntk_stays_at_its_limit():
    """Audit S: an Adam run stored the I and S limits after initialisation (the NTK change grows with width
    under Adam), and GD past the limiting kernel's stability bound (a catapult) an E[Tr S_t] of −1.5·10¹⁹."""
    from nsa_dist.data import load_dataset
    from nsa_dist.ntk import limit_ntk
    from nsa_dist.pipeline import plan_run
    from nsa_dist.pipeline.hessian_step import HessianAnalysis

    X = torch.randn(6, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = np.zeros(6)
    model = {"depth": 2, "width": 4, "init": "ntk", "activation": "tanh"}
    lam = float(np.linalg.eigvalsh(limit_ntk(X, depth=2, activation="tanh").numpy())[-1])
    bound = 2 * 6 / lam  # lr·λ_max(Θ̃∞)/N = 2 for the L2 loss

    def analysis(**over) -> HessianAnalysis:
        es = ExperimentSpec(**{**SPEC, "model": model, **over})
        return HessianAnalysis(plan_run(es, load_dataset(es.data)), X, y)

    adam = analysis(optimizer={"name": "adam"})
    assert adam.trained_reason(0) is None and "optimizer='adam'" in adam.trained_reason(3)
    for lr, momentum, holds in ((0.9 * bound, 0.0, True), (1.1 * bound, 0.0, False), (1.1 * bound, 0.5, True)):
        h = analysis(optimizer={"name": "gd", "momentum": momentum}, schedule={"lr": lr})
        why = h.trained_reason(3)
        assert (why is None) == holds and h.trained_reason(0) is None, (lr / bound, momentum, why)
        if not holds:
            assert "stability bound" in why and "= 2.2 ≥ 2" in why, why
    broken = analysis()  # a limit that cannot be computed is a reason (called outside the notes' guard)
    broken.limit_gram = lambda: (_ for _ in ()).throw(ValueError("overflows float64"))
    assert "could not be computed (ValueError: overflows float64)" in broken.trained_reason(3)


def test_an_adam_run_stores_its_limits_at_initialisation_only(tmp_path):
    model = {"depth": 2, "width": 6, "init": "ntk", "activation": "tanh"}
    run, _ = _run(tmp_path, **{**SPEC, "model": model, "optimizer": {"name": "adam"}, "schedule": {"lr": 1e-3},
                               "hessian": {**SPEC["hessian"], "every": 1, "probes": 4}})  # fmt: skip
    lim = run.hessian.I_eigenvalues(limit=True)
    assert np.isfinite(lim[0]).all() and np.isnan(lim[1:]).all(), lim
    later = run.notes[int(run.hessian.steps[1])]
    assert "optimizer='adam'" in later["hessian_I_limit_eigenvalues"] and "hessian_S_limit" in later, later


def _dense_loss_parts(model, X, Y, ce: bool):
    """Dense H, I, S and J of the MSE or cross-entropy loss (float64), HC = diag p − ppᵀ for CE."""
    flat, net = flat_model(model)

    def F(v):
        f = net(v, X)
        return f[:, None] if f.ndim == 1 else f

    N = X.shape[0]
    Y2 = Y.reshape(N, -1)
    C = (
        (lambda v: -(Y2 * torch.log_softmax(F(v), -1)).sum() / N)
        if ce
        else (lambda v: 0.5 * ((F(v) - Y2) ** 2).sum() / N)
    )
    H = hessian(C)(flat)
    J = torch.func.jacrev(F)(flat).reshape(-1, flat.numel())
    if ce:
        p = torch.softmax(F(flat), -1).detach()
        HC = torch.block_diag(*[torch.diag(pi) - torch.outer(pi, pi) for pi in p])
    else:
        HC = torch.eye(J.shape[0], dtype=torch.float64)
    I = J.T @ HC @ J / N
    return H.numpy(), I.numpy(), (H - I).numpy(), F(flat).detach().numpy()


def _model_at(run, spec, t):
    model = build_model(spec.model, seed=spec.seed).double()
    i = int(np.flatnonzero(run.steps == t)[0])
    vector_to_parameters(torch.tensor(run.g["theta"][i], dtype=torch.float64), model.parameters())
    return model


def _run(tmp_path, **spec):
    url = str(tmp_path / "s.zarr")
    es = ExperimentSpec(**spec)
    out = run_experiment(es, SpectrumStore(url))
    assert out.status == "done", out
    return Client(url).run(out.run_id), es


_THEORY = dict(
    name="theory",
    data={"n": 10},
    model={"depth": 2, "width": 5, "init": "ntk", "activation": "atan"},
    steps=6,
    record={"every": 5},
    spectrum={"k": "all", "images": []},
    schedule={"lr": 0.5},
    hessian={"probes": 48, "rayleigh_k": 0, "top_k": 2, "density": False},
)  # P = 21: exact Hutch++


@pytest.mark.parametrize("k", ["all", 4])
def test_theory_arrays_match_dense_references(tmp_path, k, capsys):
    """Exact I (reused Gram, both k), its Θ∞ limit, the additivity gap, Tr(S) by G, ‖S‖_op."""
    from nsa_dist.hessian import limit_gauss_newton_eigenvalues
    from nsa_dist.ntk import limit_ntk

    run, spec = _run(tmp_path, **{**_THEORY, "spectrum": {"k": k, "images": []}})
    url = str(tmp_path / "s.zarr")
    data = load_dataset(spec.data, seed=spec.seed)
    X, y = torch.tensor(data.X, dtype=torch.float32).double(), torch.tensor(data.y)
    lim = limit_gauss_newton_eigenvalues(limit_ntk(X, depth=2, activation="atan"))
    add, trS = run.hessian.additivity(), run.hessian.trace_S()
    for j, t in enumerate(run.hessian.steps):
        H, I, S, F = _dense_loss_parts(_model_at(run, spec, int(t)), X, y, ce=False)
        mu = np.sort(np.linalg.eigvalsh(I))[::-1][:10]
        np.testing.assert_allclose(
            run.hessian.I_eigenvalues()[j], mu, rtol=1e-7, atol=1e-12, err_msg=f"eigenvalues of I at t={t}"
        )
        np.testing.assert_allclose(
            run.hessian.moments("I_exact")["estimate"][j],
            [np.trace(np.linalg.matrix_power(I, p)) for p in range(1, 5)],
            rtol=1e-7,
        )
        np.testing.assert_allclose(run.hessian.I_eigenvalues(limit=True)[j], lim, rtol=1e-12)
        np.testing.assert_allclose(
            run.hessian.moments("I_limit")["estimate"][j], [np.sum(lim**p) for p in range(1, 5)], rtol=1e-12
        )
        tr = lambda A, p: np.trace(np.linalg.matrix_power(A, p))  # noqa: E731
        gap = [tr(H, p) - tr(I, p) - tr(S, p) for p in range(1, 5)]
        np.testing.assert_allclose(add["estimate"][j][1:], gap[1:], rtol=1e-7, err_msg=f"additivity gap at t={t}")
        assert abs(add["estimate"][j][0]) < 1e-12 * tr(H, 1), add["estimate"][j]
        assert abs(trS["G"][j] - np.trace(S)) <= 5 * trS["G_stderr"][j] + 1e-12, (
            trS["G"][j],
            trS["G_stderr"][j],
            np.trace(S),
        )
        np.testing.assert_allclose(trS["hutchpp"][j], np.trace(S), rtol=1e-7, atol=1e-12)
        np.testing.assert_allclose(run.hessian.S_norms()["op"][j], np.abs(np.linalg.eigvalsh(S)).max(), rtol=1e-5)
    from nsa_dist.hessian.s_limit import limit_S_kernels, limit_trace_S2, limit_trace_S_gd, limit_trace_S_init

    ker = limit_S_kernels(X, depth=2, activation="atan", bias_scale=spec.model.bias_scale)
    pred = run.hessian.S_limit()
    for j, t in enumerate(run.hessian.steps):  # the recorded limits of S are the library's at this run's data
        np.testing.assert_allclose(pred["trace_S_init"][j], limit_trace_S_init(ker), rtol=1e-10)
        np.testing.assert_allclose(
            pred["trace_S"][j], limit_trace_S_gd(ker, y.numpy(), [0.5] * int(t), [int(t)])[0], rtol=1e-10
        )
        grad_C = (run.outputs(int(t)).reshape(-1).astype(np.float64) - y.numpy()) / len(y)
        np.testing.assert_allclose(pred["trace_S2"][j], limit_trace_S2(ker.upsilon, grad_C), rtol=1e-4)
    from nsa_dist.plots import make_figure

    fig = make_figure(run, "hessian_trace_S")  # the limits drawn beside the measured Tr(S) with error bars
    lines = {ln.get_label(): ln for ax in fig.axes for ln in ax.get_lines()}
    np.testing.assert_array_equal(lines["limit E[Tr $S_t$] (MSE GD)"].get_ydata(), pred["trace_S"])
    assert any(c.get_label() == "Hutch++ on S" for c in fig.axes[0].containers), "measured Tr(S) has error bars"
    fig = make_figure(run, "hessian_moments")
    lines = {ln.get_label(): ln for ax in fig.axes for ln in ax.get_lines()}
    np.testing.assert_array_equal(lines[r"S limit: $\nabla C^T\tilde\Upsilon\nabla C$"].get_ydata(), pred["trace_S2"])
    assert (
        np.isclose(pred["trace_S"][0], pred["trace_S_init"][0], rtol=1e-12)
        and pred["trace_S"][-1] != pred["trace_S"][0]
    ), pred
    from nsa_dist.cli import main

    assert main(["show", run.id, "--store", url]) == 0
    out = capsys.readouterr().out
    m, top = run.hessian.moments("S"), run.hessian.top("H")[:, 0]
    for j in range(len(run.hessian.steps)):  # every number printed is the run's (2 analysed steps: both shown)
        for want in (
            f"{m['estimate'][j, 1]:.4g}",
            f"{top[j]:.4g}",
            f"{pred['trace_S2'][j]:.4g}",
            f"{pred['trace_S'][j]:.4g}",
            f"{trS['G'][j]:.4g} ± {trS['G_stderr'][j]:.2g}",
        ):
            assert want in out, f"nsa show lacks {want!r}:\n{out}"
    for label in ("Tr(S^2)", "λ_max(H)", "E[Tr S₀] limit", "E[Tr S_t] limit", "Tr(S²) limit", "Hutch++ ± s.e."):
        assert label in out, out
    norms = run.hessian.S_norms()
    assert np.all(norms["op"] <= norms["k4"] * (1 + 1e-9)) and np.all(norms["k4"] <= norms["k2"] * (1 + 1e-9)), norms


def test_cross_entropy_run_records_I_and_S_of_its_loss(tmp_path):
    run, spec = _run(
        tmp_path,
        name="ce",
        loss="cross_entropy",
        data={"name": "digits", "n": 6, "target": "onehot"},
        model={"depth": 2, "width": 2, "init": "ntk", "activation": "tanh"},
        steps=4,
        record={"every": 3},
        spectrum={"k": 8, "images": []},
        schedule={"lr": 1.0},
        hessian={"probes": 4, "rayleigh_k": 0, "top_k": 0, "density": False, "additivity": False},
    )
    data = load_dataset(spec.data, seed=spec.seed)
    X, Y = torch.tensor(data.X, dtype=torch.float32).double(), torch.tensor(data.y, dtype=torch.float64)
    assert run.train_loss[-1] < run.train_loss[0], run.train_loss
    f0 = run.outputs(0)
    p = np.exp(f0 - f0.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(run.train_loss[0], -np.mean(np.sum(data.y * np.log(p), 1)), rtol=1e-5, err_msg="CE loss")
    np.testing.assert_allclose(run.residual(0), p - data.y, rtol=1e-5, atol=1e-7, err_msg="m = softmax(f) − y")
    for j, t in enumerate(run.hessian.steps):
        H, I, S, F = _dense_loss_parts(_model_at(run, spec, int(t)), X, Y, ce=True)
        np.testing.assert_allclose(
            run.hessian.moments("I_exact")["estimate"][j],
            [np.trace(np.linalg.matrix_power(I, p)) for p in range(1, 5)],
            rtol=1e-6,
            err_msg=f"CE Tr(I^k) at t={t}",
        )
        mu = np.sort(np.linalg.eigvalsh(I))[::-1][:60]
        np.testing.assert_allclose(run.hessian.I_eigenvalues()[j], mu, rtol=1e-6, atol=1e-10)
        trS = run.hessian.trace_S()  # Tr(S) = (1/N) Σ (p_i − y_i)ᵀ G_i against the dense CE S
        assert abs(trS["G"][j] - np.trace(S)) <= 5 * trS["G_stderr"][j] + 1e-12, (
            trS["G"][j],
            trS["G_stderr"][j],
            np.trace(S),
        )
    from nsa_dist.hessian import hessian_parts

    H_op, I_op, S_op = hessian_parts(_model_at(run, spec, 3), X, Y, loss="cross_entropy", dtype=torch.float64)
    np.testing.assert_allclose(S_op.to_dense().numpy(), S, rtol=1e-8, atol=1e-12, err_msg="CE S operator vs dense")
    np.testing.assert_allclose(I_op.to_dense().numpy(), I, rtol=1e-8, atol=1e-12, err_msg="CE I operator vs dense")


def test_block_rows_gives_the_first_two_exact_moments_of_I_from_the_tiles(tmp_path):
    run, spec = _run(tmp_path, **{**_THEORY, "spectrum": {"k": 4, "images": [], "layout": "block_rows", "workers": 2}})
    data = load_dataset(spec.data, seed=spec.seed)
    X, y = torch.tensor(data.X, dtype=torch.float32).double(), torch.tensor(data.y)
    exact = run.hessian.moments("I_exact")["estimate"]
    for j, t in enumerate(run.hessian.steps):
        _, I, _, _ = _dense_loss_parts(_model_at(run, spec, int(t)), X, y, ce=False)
        np.testing.assert_allclose(exact[j][:2], [np.trace(I), np.trace(I @ I)], rtol=1e-6)
        assert np.isnan(exact[j][2:]).all() and np.isnan(run.hessian.I_eigenvalues()[j]).all()


def test_theory_spec_errors():
    with pytest.raises(ValueError, match="cross_entropy.*K >= 2"):
        ExperimentSpec(name="x", loss="cross_entropy", data={"n": 8})
    with pytest.raises(ValueError, match="cross_entropy.*data.target='onehot'"):
        ExperimentSpec(name="x", loss="cross_entropy", data={"name": "digits", "n": 8, "target": "label"})
    with pytest.raises(ValueError, match="hessian.*'l2' and 'cross_entropy'"):
        ExperimentSpec(name="x", loss="nce", data={"name": "density2d", "n": 8}, hessian={})


def test_hessian_sweep_quantities_and_figures(tmp_path):
    """Moments over seeds against step and width, the width convergence to Θ∞ with its fitted slope."""
    from nsa_dist.client import quantity
    from nsa_dist.config import SweepSpec
    from nsa_dist.pipeline import run_id
    from nsa_dist.plots.sweep import HESSIAN_SWEEP_FIGURES, fit_slope, plot_sweep

    url = str(tmp_path / "s.zarr")
    store = SpectrumStore(url)
    sweep = SweepSpec(
        name="hw",
        base={
            **_THEORY,
            "data": {"n": 6},
            "steps": 1,
            "record": {"steps": [0]},
            "hessian": {"probes": 8, "rayleigh_k": 0, "top_k": 1, "density": False, "additivity": False},
        },
        grid={"model.width": [3, 12], "seed": [0, 1]},
    )
    ids = []
    for spec in sweep.expand():
        assert run_experiment(spec, store).status == "done"
        ids.append(run_id(spec))
    store.record_sweep(sweep.name, sweep.model_dump(mode="json"), ids)
    c = Client(url)
    s = c.sweep("hw")
    for cv in s.curves("hessian_S", k=2):
        runs = [c.run(r) for r in c.runs(sweep="hw", model__width=cv.key["model.width"])["id"]]
        V = np.stack([r.hessian.moments("S")["estimate"][:, 1] for r in runs])
        np.testing.assert_allclose(cv.mean, V.mean(0), err_msg=str(cv.key))
        np.testing.assert_allclose(cv.std, V.std(0))
        np.testing.assert_array_equal(cv.t, runs[0].hessian.steps)
    run = c.run(ids[0])
    t, err = quantity(run, "hessian_I_error", k=2)
    ex, lim = run.hessian.moments("I_exact")["estimate"][:, 1], run.hessian.moments("I_limit")["estimate"][:, 1]
    np.testing.assert_allclose(err, np.abs(ex - lim) / lim)
    t, ratio = quantity(run, "hessian_S_ratio")
    np.testing.assert_allclose(
        ratio, run.hessian.moments("S")["estimate"][:, 1] / run.hessian.moments("I")["estimate"][:, 1]
    )
    with pytest.raises(ValueError, match="needs k, the moment order"):
        quantity(run, "hessian_S")
    out = plot_sweep(s, tmp_path / "fig", figures=list(HESSIAN_SWEEP_FIGURES))
    assert [p.stem for p in out] == list(HESSIAN_SWEEP_FIGURES) and all(p.stat().st_size > 10_000 for p in out)
    from nsa_dist.plots.sweep import hessian_moments_figure

    ax = hessian_moments_figure(s, "S").axes[1]  # one analysed step: each grid point's seeds and mean ± std
    assert [t.get_text() for t in ax.get_xticklabels()] == ["3", "12"]
    dots = [ln for ln in ax.lines if ln.get_marker() == "."]
    assert len(dots) == 2 and all(len(ln.get_ydata()) == 2 for ln in dots)
    np.testing.assert_allclose(
        sorted(np.concatenate([ln.get_ydata() for ln in dots])), sorted(s.scalar("hessian_S", 2, step=0)["value"])
    )
    w = np.array([16.0, 64.0, 256.0])
    assert fit_slope(w, 3 * w**-0.5) == pytest.approx(-0.5)


def test_a_quantity_switched_off_is_said_so_by_its_accessor(tmp_path):
    """Every accessor of a quantity the hessian block switched off said only "has no array
    'hessian_moments'; did you mean 'hessian_products' …" and listed the run's arrays (audit O)."""
    off = {"moments": False, "orthogonality": False, "rayleigh_k": 0, "top_k": 0, "density": False}
    off |= {"additivity": False, "trace_G": False, "limit": False}
    spec = ExperimentSpec(**{**SPEC, "name": "off", "steps": 6, "hessian": {"every": 2, **off}})
    url = str(tmp_path / "s.zarr")
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    h = Client(url).run(run_id(spec)).hessian
    assert len(h.steps) > 0
    said = {
        "hessian.moments: false": (lambda: h.moments("H"), lambda: h.moments("I_exact"), h.I_eigenvalues, h.S_limit),
        "hessian.orthogonality: false": (lambda: h.orthogonality,),
        "hessian.rayleigh_k: 0": (h.rayleigh,),
        "hessian.top_k: 0": (lambda: h.top("H"), h.edge_of_stability),
        "hessian.density: false": (h.density,),
        "hessian.additivity: false": (h.additivity,),
        "hessian.trace_G: false": (h.trace_S, h.G),
    }
    for switch, reads in said.items():
        for read in reads:
            with pytest.raises(KeyError, match=f"did not measure 'hessian_\\w+': its spec says {switch}"):
                read()


def test_s_norms_carry_their_standard_errors_to_the_figure(hess_run, tmp_path):
    """Tr(S⁴)^{1/4} and ‖S‖_F come from Hutch++ estimates with standard errors but were drawn as bare
    points beside ‖S‖_op, the inequality the figure is for (audit Y)."""
    run, _ = hess_run
    n, m = run.hessian.S_norms(), run.hessian.moments("S")
    ok = n["k2"] > 0
    np.testing.assert_allclose(n["k2_stderr"][ok], m["stderr"][ok, 1] / (2 * n["k2"][ok]))
    assert np.isfinite(n["k4_stderr"]).all() and (n["k4_stderr"] >= 0).all(), n
    from nsa_dist.plots.hessian import S_norms

    ax = S_norms(run).axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sum("±1 s.e." in label for label in labels) == 2, labels


def test_the_i_spectrum_figure_leaves_out_is_null_space(tmp_path):
    """With fewer parameters (9) than points (24), most of I's 24 stored eigenvalues are rounding of either
    sign: the figure clipped them to 10⁻¹⁶ and drew them as values (an audit); now left out and counted."""
    from nsa_dist.plots.hessian import I_spectrum

    spec = ExperimentSpec(**{**SPEC, "name": "narrow", "model": {"depth": 2, "width": 2}, "steps": 4})
    url = str(tmp_path / "n.zarr")
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run("narrow")
    mu = run.hessian.I_eigenvalues()
    rank = [int(np.sum(m > 1e-12 * m[0])) for m in mu]  # ≤ P = 9; the rest |λ| < 10⁻¹⁵
    assert max(rank) <= 9 and np.all(np.abs(mu[0, rank[0] :]) < 1e-14), mu[0]
    fig = I_spectrum(run)
    measured = [ln for ln in fig.axes[0].lines if ln.get_label().startswith("measured")]
    assert measured
    left_out = 0
    for ln in measured:
        y = np.asarray(ln.get_ydata(), float)
        r = int(np.isfinite(y).sum())
        assert r in rank and np.isnan(y[r:]).all() and (y[:r] > 0).all(), (y, rank)
        left_out = max(left_out, 24 - r)
    assert any(f"{left_out} of the 24 eigenvalues are I's null space" in t.get_text() for t in fig.texts), [
        t.get_text() for t in fig.texts
    ]
