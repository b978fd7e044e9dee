"""Issue 11's per-step quantities against direct float64 computations: the full (N·K)×(N·K)
kernel's top eigenvalues, the momentum-aware first-order prediction, the test loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import dense_jacobian, dense_ntk

from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec, ModelSpec
from nsa_dist.data import load_dataset
from nsa_dist.losses import loss_value
from nsa_dist.models import build_model
from nsa_dist.ntk.kernel_spectra import full_kernel_top
from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run, run_experiment
from nsa_dist.pipeline.step_extras import predicted_update
from nsa_dist.store import SpectrumStore


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(b))


@pytest.mark.parametrize("N, k", [(12, 36), (12, 4), (200, 5)])  # all (dense), a few (dense), Lanczos (NK = 600)
def test_full_kernel_top_matches_dense_jacobian_product(N: int, k: int) -> None:
    torch.manual_seed(1)
    model = build_model(ModelSpec(input_dim=4, output_dim=3, depth=3, width=8, activation="tanh"), seed=1).double()
    X = torch.randn(N, 4, dtype=torch.float64)
    J = dense_jacobian(model, X)  # (N·K, P), rows (point, output)
    ref = np.sort(np.linalg.eigvalsh((J @ J.T).numpy()))[::-1][:k]
    got = full_kernel_top(model, X, k, dtype=torch.float64)
    assert got.shape == (k,)
    err = np.abs(got - ref) / ref[0]
    assert err.max() < 1e-8, f"max |λ − λ_ref|/λ_1 = {err.max():.2e} at i = {err.argmax() + 1}: {got[:5]} vs {ref[:5]}"
    # the output-traced Gram's λ_max (the stored `eigenvalues`) is a different, larger number
    traced = np.linalg.eigvalsh(dense_ntk(model, X).numpy())[-1]
    assert traced > 1.2 * got[0], (traced, got[0])


def test_full_kernel_top_rejects_bad_k() -> None:
    model = build_model(ModelSpec(input_dim=2, output_dim=2, depth=2, width=4), seed=0)
    with pytest.raises(ValueError, match="k=9 outside 1..N·K=8"):
        full_kernel_top(model, torch.randn(4, 2), 9)


def test_held_out_loss_is_the_l2_loss_at_the_test_points() -> None:
    from nsa_dist.data import Dataset

    spec = ExperimentSpec(name="ho", data={"n": 4}, model={"depth": 2, "width": 4}, steps=1)  # loss l2
    f, y = np.array([[1.0, 2.0], [0.0, 0.0]]), np.array([[0.0, 0.0], [1.0, 1.0]])
    data = Dataset(np.zeros((2, 2)), np.zeros((2, 2)), np.zeros((2, 2)), y)
    assert loss_value(spec, data, f, test=True) == pytest.approx(0.5 * (5.0 + 2.0) / 2)
    assert np.isnan(
        loss_value(spec, Dataset(data.X, data.y, np.zeros((0, 2)), np.zeros((0, 2))), np.zeros((0, 2)), test=True)
    )


@pytest.fixture(scope="module")
def momentum_run():
    spec = ExperimentSpec(
        name="mom",
        data={"n": 40},
        model={"depth": 3, "width": 16},
        steps=8,
        record={"every": 1},
        optimizer={"name": "gd", "momentum": 0.9},
        schedule={"lr": 0.02},
        spectrum={"k": 10},
    )
    data = load_dataset(spec.data)
    trainer = Trainer(plan_run(spec, data), data)
    cks = list(trainer.train_until(spec.steps))
    return spec, data, cks


def test_momentum_prediction_is_the_actual_update(momentum_run) -> None:
    """df̄ = −(δ/N) G m − δμ J b equals J·Δθ (dense float64 Jacobian) and tracks the real df."""
    spec, data, cks = momentum_run
    an = SpectralAnalyzer(plan_run(spec, data), data)
    model = build_model(spec.model, seed=spec.seed).double()
    X = torch.as_tensor(data.X, dtype=torch.float64)
    for ck in cks[3:6]:  # the buffer is well developed after a few steps
        out = an.analyze(ck).arrays()
        torch.nn.utils.vector_to_parameters(torch.as_tensor(ck.theta, dtype=torch.float64), model.parameters())
        J = dense_jacobian(model, X).numpy()  # (N, P)
        jd = J @ ck.dtheta.astype(np.float64)  # J·Δθ
        e = _rel(out["df_pred"], jd)
        assert e < 2e-3, f"step {ck.step}: ‖df_pred − J·Δθ‖/‖J·Δθ‖ = {e:.2e}"
        assert out["first_order_error"] < 0.05, f"step {ck.step}: first-order error {out['first_order_error']:.3f}"
        # the momentum-free GD formula −(δ/N) G m misses the buffer's contribution
        m = ck.f.astype(np.float64) - data.y
        plain = -(ck.lr / data.n) * (J @ (J.T @ m))
        assert _rel(plain, jd) > 0.3, f"step {ck.step}: momentum-free prediction within {_rel(plain, jd):.2f}"


def test_predicted_update_without_momentum_is_the_paper_formula(momentum_run) -> None:
    spec, data, cks = momentum_run
    plain = spec.model_copy(update={"optimizer": spec.optimizer.model_copy(update={"momentum": 0.0})})
    G = np.arange(16.0).reshape(4, 4)
    ck = cks[2]
    m = np.ones(4)
    called = []
    got = predicted_update(plain, ck, m, lambda v: G @ v, lambda u: called.append(u) or np.zeros(4))
    np.testing.assert_allclose(got, -(ck.lr / 4) * G @ m)
    assert not called, "J·u used without momentum"


@pytest.fixture(scope="module")
def onehot_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("x") / "s.zarr")
    spec = ExperimentSpec(
        name="oh",
        data={"name": "digits", "n": 24, "n_test": 10, "target": "onehot"},
        model={"depth": 2, "width": 8},
        steps=4,
        record={"every": 2},
        spectrum={"k": 10, "full_k": 6},
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    return url


@pytest.fixture(scope="module")
def onehot_run(onehot_url: str):
    return Client(onehot_url).run("oh")


def test_onehot_run_figures_show_and_plain_xarray(onehot_url, onehot_run, tmp_path, capsys) -> None:
    """The figures and ``nsa show`` of a K-output run use the full kernel and say so; xarray names its axes."""
    from matplotlib.pyplot import imread

    from nsa_dist.cli import main
    from nsa_dist.plots import make_figure, plot_run

    written = plot_run(onehot_run, tmp_path)
    assert {"fig1e_lr_stability", "fig2c_flow_speed", "fig2d_lr_eigen", "fig3a_energy_y"} <= {p.stem for p in written}
    for p in written:
        img = imread(p)
        assert img.ndim == 3 and img[..., :3].std() > 0.01, p
    fig = make_figure(onehot_run, "fig1e_lr_stability")
    texts = " ".join(
        [fig.get_suptitle()]
        + [t for ax in fig.axes for t in (ax.get_title(), ax.get_ylabel(), *ax.get_legend_handles_labels()[1])]
    )
    assert "full" in texts and "kernel" in texts, texts
    assert main(["show", "oh", "--store", onehot_url]) == 0
    out = capsys.readouterr().out
    assert "λ_max (full NK×NK kernel)" in out, out
    xr = pytest.importorskip("xarray")
    ds = xr.open_zarr(onehot_url, group=f"runs/{onehot_run.id}", consolidated=False)
    assert ds["f"].dims == ("step", "point", "output") and ds["y"].dims == ("point", "output")
    assert ds["eigenvalues_full"].dims == ("step", "k_full")
    np.testing.assert_array_equal(ds["eigenvalues_full"].values, onehot_run.g["eigenvalues_full"][:])


def test_nsa_show_notes_gd_formulas_for_sgd_and_adam(tmp_path, capsys) -> None:
    from nsa_dist.cli import main

    url = str(tmp_path / "s.zarr")
    for name, opt in (("sgd", {"name": "sgd", "batch_size": 8}), ("adam", {"name": "adam"})):
        spec = ExperimentSpec(
            name=name,
            data={"n": 24},
            model={"depth": 2, "width": 8},
            steps=3,
            record={"every": 2},
            optimizer=opt,
            schedule={"lr": 0.01},
            spectrum={"k": 5},
        )
        assert run_experiment(spec, SpectrumStore(url)).status == "done"
        assert main(["show", name, "--store", url]) == 0
        out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
        what = "minibatch SGD (batch 8)" if name == "sgd" else "Adam"
        assert "formulas of full-batch GD" in out and f"this run uses {what}" in out, out


def test_stored_full_kernel_and_stability_of_onehot_run(onehot_run) -> None:
    run = onehot_run
    lam_full = run.g["eigenvalues_full"]
    assert lam_full.shape == (3, 6)
    model = build_model(run.spec.model, seed=0).double()
    X = torch.as_tensor(run.X, dtype=torch.float64)
    for i, t in enumerate(run.steps):
        torch.nn.utils.vector_to_parameters(torch.as_tensor(run.g["theta"][i], dtype=torch.float64), model.parameters())
        J = dense_jacobian(model, X).numpy()  # (N·10, P)
        ref = np.sort(np.linalg.eigvalsh(J @ J.T))[::-1][:6]
        e = np.abs(run.stability_eigenvalues[i] - ref).max() / ref[0]
        assert e < 1e-6, f"t = {t}: stored full-kernel eigenvalues off by {e:.2e}"
    np.testing.assert_allclose(run.lambda_max, run.stability_eigenvalues[:, 0])
    np.testing.assert_allclose(run.stability_bound(), 2 * run.N / run.lambda_max)
    np.testing.assert_allclose(run.flow_speed(), 1 - np.abs(1 - run.lr[:, None] * run.stability_eigenvalues / run.N))
    assert (run.eigenvalues[:, 0] > 1.5 * run.lambda_max).all()  # the traced Gram's λ_max is not the one


def test_test_loss_recomputed_from_the_model(onehot_run) -> None:
    run = onehot_run
    y_test = run.g["y_test"][:]
    model = build_model(run.spec.model, seed=0).double()
    X_test = torch.as_tensor(run.X_test, dtype=torch.float64)
    for i in range(len(run.steps)):
        f_store = run.g["f_test"][i].astype(np.float64)
        np.testing.assert_allclose(run.test_loss[i], 0.5 * np.mean(np.sum((f_store - y_test) ** 2, 1)), rtol=1e-12)
        torch.nn.utils.vector_to_parameters(torch.as_tensor(run.g["theta"][i], dtype=torch.float64), model.parameters())
        with torch.no_grad():
            f = model(X_test).numpy()
        ref = 0.5 * np.mean(np.sum((f - y_test) ** 2, 1))
        assert abs(run.test_loss[i] - ref) < 1e-5 * ref, f"step {run.steps[i]}: {run.test_loss[i]} vs {ref}"


# ---------------------------------------------------------------- the paper's k without N×N eigenvectors per step
def test_eigenvector_schedule_and_stored_projections(tmp_path) -> None:
    """Eigenvectors only at the listed steps; Fig. 4a projections and every-k energies at all steps."""
    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(
        name="sched",
        data={"n": 48, "n_test": 8},
        model={"depth": 2, "width": 16},
        steps=30,
        record={"every": 10},
        spectrum={"k": "all", "store_eigenvectors": [10, 29], "images": [1]},
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run("sched")
    assert run.eigenvector_steps.tolist() == [10, 29]
    arr = run.g["eigenvectors"]
    assert arr.nchunks_initialized == 2, f"{arr.nchunks_initialized} eigenvector chunks written, expected 2"
    with pytest.raises(KeyError, match=r"only at steps \[10, 29\], not at 20"):
        run.eigenvectors(20)
    for t in run.steps:  # p_i = ⟨v_i, m⟩² from a recomputed G_t (float64) against the stored array
        model = build_model(spec.model, seed=0).double()
        i = int(np.flatnonzero(run.steps == t)[0])
        torch.nn.utils.vector_to_parameters(torch.as_tensor(run.g["theta"][i], dtype=torch.float64), model.parameters())
        J = dense_jacobian(model, torch.as_tensor(run.X, dtype=torch.float64)).numpy()
        w, V = np.linalg.eigh(J @ J.T)
        m = run.residual(int(t))
        p_ref = (V[:, ::-1].T @ m) ** 2
        p = run.kernel.residual_projections(int(t))
        assert p.shape == (48,)
        # G_t has a null space (rank ≤ P): any basis of it is right, so compare the partial sums
        # (energies) over the non-null eigenvalues, and the full sum
        r = int(np.sum(w > 1e-8 * w[-1]))
        d = np.abs(np.cumsum(p) - np.cumsum(p_ref)) / (m @ m)
        e = max(d[:r].max(), d[-1])
        assert e < 1e-4, f"t = {t}: partial sums of ⟨v_i, m⟩² off by {e:.2e}"
        np.testing.assert_allclose(np.cumsum(p) / (m @ m), run.energy("residual")[i], atol=1e-6)
    P, t1, t2, rows = run.spectrum_preservation()
    assert (t1, t2) == (10, 29) and P.shape == (len(rows), 48)
    np.testing.assert_allclose(P[:, -1], 1.0, atol=1e-5)  # all N eigenvectors of G_{t1} span everything


@pytest.mark.slow
def test_per_class_spectra_match_dense_diagonal_blocks(tmp_path) -> None:
    from nsa_dist.ntk.kernel_spectra import per_class_top

    model = build_model(ModelSpec(input_dim=3, output_dim=3, depth=2, width=8, activation="tanh"), seed=2).double()
    X = torch.randn(15, 3, dtype=torch.float64)
    Gf = dense_ntk(model, X, full=True).numpy()  # (N, K, N, K)
    got = per_class_top(model, X, 4, dtype=torch.float64)
    assert got.shape == (3, 4)
    for a in range(3):
        ref = np.sort(np.linalg.eigvalsh(Gf[:, a, :, a]))[::-1][:4]
        e = np.abs(got[a] - ref).max() / ref[0]
        assert e < 1e-8, f"class {a}: {got[a]} vs {ref} (rel {e:.2e})"
    # stored along a one-hot run
    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(
        name="pc",
        data={"name": "digits", "n": 20, "target": "onehot"},
        model={"depth": 2, "width": 8},
        steps=3,
        record={"every": 2},
        spectrum={"k": 5, "per_class_k": 3, "store_eigenvectors": False},
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run("pc")
    assert run.kernel.per_class_eigenvalues.shape == (2, 10, 3)
    m = build_model(spec.model, seed=0).double()
    torch.nn.utils.vector_to_parameters(torch.as_tensor(run.g["theta"][0], dtype=torch.float64), m.parameters())
    Gf = dense_ntk(m, torch.as_tensor(run.X, dtype=torch.float64), full=True).numpy()
    ref = np.stack([np.sort(np.linalg.eigvalsh(Gf[:, a, :, a]))[::-1][:3] for a in range(10)])
    e = np.abs(run.kernel.per_class_eigenvalues[0] - ref).max() / ref.max()
    assert e < 1e-6, f"stored per-class eigenvalues off by {e:.2e}"
