"""NCE density estimation (NSA §6 "Scope"): the loss's functional derivative, the density data, a tiny run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import dense_jacobian

from nsa_dist.client import Client
from nsa_dist.config import DataSpec, ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.losses import loss_value, nce_loss, nce_residual
from nsa_dist.models import build_model
from nsa_dist.pipeline import run_experiment
from nsa_dist.store import SpectrumStore


def test_nce_residual_is_the_functional_derivative() -> None:
    """m_i = N ∂L/∂f_i for L = (1/N) Σ ℓ_i, by autograd in float64."""
    g = torch.Generator().manual_seed(0)
    f = (3 * torch.randn(50, generator=g, dtype=torch.float64)).requires_grad_()
    label = (torch.rand(50, generator=g) < 0.4).double()
    log_noise = torch.randn(50, generator=g, dtype=torch.float64) + 1.0
    (grad,) = torch.autograd.grad(nce_loss(f, label, log_noise), f)
    m = nce_residual(f.detach().numpy(), label.numpy(), log_noise.numpy())
    err = np.abs(m - 50 * grad.numpy()).max()
    assert err < 1e-12, f"max |m − N ∂L/∂f| = {err:.2e}"
    # and the value: −[c log σ(h) + (1 − c) log(1 − σ(h))] averaged
    h = (f - log_noise).detach().numpy()
    sig = 1 / (1 + np.exp(-h))
    ref = -np.mean(label.numpy() * np.log(sig) + (1 - label.numpy()) * np.log(1 - sig))
    assert float(nce_loss(f.detach(), label, log_noise)) == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize(
    "data",
    [
        {"name": "density2d", "n": 6000, "noise": "uniform", "noise_ratio": 2},
        {"name": "gaussian_mixture", "dim": 3, "n": 6000, "noise": "uniform"},
        {"name": "gaussian_mixture", "dim": 3, "n": 6000, "noise": "gaussian"},
    ],
)
def test_density_data_true_log_density_is_normalised(data: dict) -> None:
    """E_q[p/q] = ∫ p = 1: the mean of exp(log p − log q) over the noise points is 1 (Monte Carlo)."""
    ds = load_dataset(DataSpec(**data))
    nu = data.get("noise_ratio", 1)
    label, log_nq = ds.extra["label"], ds.extra["log_noise"]
    assert ds.X.shape == (6000, ds.X.shape[1]) and int(label.sum()) == 6000 // (1 + nu)
    noise = label == 0
    w = np.exp(ds.y[noise] - (log_nq[noise] - np.log(nu)))  # p/q at the noise points
    se = w.std() / np.sqrt(len(w))
    assert abs(w.mean() - 1) < 4 * se + 0.02, f"E_q[p/q] = {w.mean():.3f} ± {se:.3f}, expected 1"
    assert np.isfinite(ds.y).all() and np.isfinite(log_nq).all()


def test_nce_config_errors() -> None:
    with pytest.raises(ValueError, match="loss 'nce' goes with the density datasets"):
        ExperimentSpec(loss="nce", data={"n": 10})
    with pytest.raises(ValueError, match="loss 'nce' goes with the density datasets"):
        ExperimentSpec(data={"name": "density2d", "n": 10})
    with pytest.raises(ValueError, match="Hessian measurements support loss .l2. and .cross_entropy."):
        ExperimentSpec(loss="nce", data={"name": "density2d", "n": 10}, hessian={})
    with pytest.raises(ValueError, match="must be >= 1 \\+ ratio = 4"):
        load_dataset(DataSpec(name="density2d", n=3, noise_ratio=3))


def test_nce_run_first_order_and_test_loss(tmp_path) -> None:
    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(
        name="nce",
        loss="nce",
        data={"name": "density2d", "n": 120, "n_test": 40},
        model={"depth": 3, "width": 32},
        steps=60,
        record={"every": 20},
        schedule={"lr": 1.0},
        spectrum={"k": 30, "images": [1, 2], "test_points": True},
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run("nce")
    ds = load_dataset(spec.data, seed=spec.seed)
    np.testing.assert_allclose(run.y, ds.y)
    assert run.train_loss[-1] < 0.8 * run.train_loss[0], run.train_loss
    model = build_model(spec.model, seed=0).double()
    X = torch.as_tensor(ds.X, dtype=torch.float64)
    for i, t in enumerate(run.steps[:-1]):
        torch.nn.utils.vector_to_parameters(torch.as_tensor(run.g["theta"][i], dtype=torch.float64), model.parameters())
        J = dense_jacobian(model, X).numpy()  # (N, P)
        with torch.no_grad():
            f = model(X).numpy()
        m = nce_residual(f, ds.extra["label"], ds.extra["log_noise"])
        pred = -(run.lr[i] / run.N) * (J @ (J.T @ m))  # NSA Eq. 3 with the NCE derivative
        e = np.linalg.norm(run.outputs(int(t), "df_pred") - pred) / np.linalg.norm(pred)
        assert e < 1e-4, f"t = {t}: stored df_pred off the dense −(δ/N) J Jᵀ m by {e:.2e}"
        assert run.first_order["error"][i] < 0.1, (t, run.first_order["error"][i])
        # E_t(y, k) is of the centred log-density (its constant would carry most of ‖y‖²)
        V, yc = run.eigenvectors(int(t)), ds.y - ds.y.mean()
        np.testing.assert_allclose(run.energy("y")[i], np.cumsum((V.T @ yc) ** 2) / (yc @ yc), rtol=1e-4, atol=1e-6)
        # and so is the alignment yᵀGy/(‖G‖_F‖y‖²): 0.81 of the raw log-density's, 0.12 of the centred's
        G = J @ J.T
        want = yc @ G @ yc / (np.linalg.norm(G) * (yc @ yc))
        assert run.alignment["raw"][i] == pytest.approx(want, rel=1e-4), (t, run.alignment["raw"][i], want)
        H = np.eye(len(yc)) - 1.0 / len(yc)  # the centred one: H G H against ȳ (centring twice moved it)
        want_c = yc @ G @ yc / (np.linalg.norm(H @ G @ H) * (yc @ yc))
        got_c = run.alignment["centered"][i]
        assert got_c == pytest.approx(want_c, rel=1e-4), (t, got_c, want_c)
        # the energies of the residual are of the NCE derivative
        np.testing.assert_allclose(
            run.energy("residual")[i, -1], np.sum((run.eigenvectors(int(t)).T @ m) ** 2) / (m @ m), rtol=1e-4
        )
        ref = loss_value(spec, ds, run.g["f_test"][i].astype(np.float64), test=True)
        assert run.test_loss[i] == pytest.approx(ref, rel=1e-10)
    # every figure of an L2 run is drawn for the NCE run too, with the note on GD's bound
    from matplotlib.pyplot import imread

    from nsa_dist.plots import FIGURES, make_figure, plot_run
    from nsa_dist.plots.axes import title_of

    written = plot_run(run, tmp_path / "figs")
    # Eqs. 4–5 are GD on the L2 loss: no constant-Gram prediction for NCE; App. F is off by default
    skipped = ("eqs45_constant_gram", "appF_gram_change")
    assert [p.stem for p in written] == [f for f in FIGURES if not f.startswith("hessian_") and f not in skipped]
    assert "centred log-density" in title_of(make_figure(run, "fig3a_energy_y"))
    for p in written:
        img = imread(p)
        assert img.ndim == 3 and img[..., :3].std() > 0.01, f"{p.name} is blank"
    fig = make_figure(run, "fig1e_lr_stability")
    assert any("NCE" in t.get_text() for t in fig.texts), [t.get_text() for t in fig.texts]
