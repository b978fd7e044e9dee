"""Issue 19's NSA quantities against float64 references: Fig. 4d's reconstructions f̄_{t,k}
(dense eigh of J Jᵀ) and App. F's dG_t (dense Grams at θ_t, θ_{t+1}; Eq. 26 from per-point
model Hessians)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import dense_jacobian, dense_ntk, flat_model

from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec, ModelSpec
from nsa_dist.errors import ShapeError
from nsa_dist.metrics import reconstruction_ks, top_k_reconstructions
from nsa_dist.models import build_model
from nsa_dist.pipeline import run_experiment
from nsa_dist.pipeline.nsa_extras import gram_change
from nsa_dist.store import SpectrumStore


def test_reconstruction_ks_clamped_and_unique() -> None:
    assert reconstruction_ks(1000) == (10, 100, 200, 500)
    assert reconstruction_ks(150) == (10, 100, 150)
    assert reconstruction_ks(48) == (10, 48)
    assert reconstruction_ks(5) == (5,)


def test_top_k_reconstructions_against_projection_matrix() -> None:
    rng = np.random.default_rng(0)
    V, _ = np.linalg.qr(rng.standard_normal((30, 30)))
    f = rng.standard_normal((30, 2))
    R = top_k_reconstructions(V[:, :20], f, (3, 20))
    for j, k in enumerate((3, 20)):
        P = sum(np.outer(V[:, i], V[:, i]) for i in range(k))  # the projector on span(v_1..v_k)
        np.testing.assert_allclose(R[j], P @ f, atol=1e-12)
    np.testing.assert_allclose(top_k_reconstructions(V, f[:, 0], (30,))[0], f[:, 0], atol=1e-12)  # k = N: f itself
    with pytest.raises(ShapeError, match=r"ks \[21\] must lie in 1..K=20"):
        top_k_reconstructions(V[:, :20], f, (21,))


def _model(K: int = 1):
    torch.manual_seed(0)
    return build_model(ModelSpec(input_dim=2, output_dim=K, depth=3, width=6, activation="tanh"), seed=3).double()


@pytest.mark.parametrize("K", [1, 2])
def test_gram_change_measured_is_the_dense_difference(K: int) -> None:
    model = _model(K)
    X = torch.randn(9, 2, dtype=torch.float64)
    theta, f = flat_model(model)
    dtheta = 0.05 * torch.randn_like(theta)
    G0 = dense_ntk(model, X).numpy()
    torch.nn.utils.vector_to_parameters(theta + dtheta, model.parameters())
    G1 = dense_ntk(model, X).numpy()
    torch.nn.utils.vector_to_parameters(theta, model.parameters())
    V = np.linalg.eigh(G0)[1][:, ::-1][:, :4]  # (N, 4)
    got = gram_change(model, X, theta.numpy(), dtheta.numpy(), V, torch.float64)
    D = V.T @ (G1 - G0) @ V
    np.testing.assert_allclose(got["gram_change"][0], np.diag(D), rtol=1e-9, atol=1e-12 * np.abs(D).max())
    assert got["gram_change_fro"][0] == pytest.approx(np.linalg.norm(D), rel=1e-9)
    # the parameters are left as they were
    np.testing.assert_array_equal(torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy(),
                                  theta.numpy())


def test_gram_change_first_order_is_eq26() -> None:
    """dG_t = −(δ/N)(Q + Qᵀ), Q[:, i] = Aᵀ ℋ(X^i) A m (Eq. 26) for the GD update Δθ = −(δ/N) A m."""
    model = _model()
    N, lr = 7, 0.3
    X = torch.randn(N, 2, dtype=torch.float64)
    y = torch.randn(N, dtype=torch.float64)
    theta, f = flat_model(model)
    J = dense_jacobian(model, X)  # (N, P) = Aᵀ
    m = f(theta, X).reshape(N) - y  # (N,)
    u = J.T @ m  # A m, (P,)
    H = [torch.func.hessian(lambda v, i=i: f(v, X[i:i + 1]).reshape(()))(theta) for i in range(N)]  # ℋ(X^i), (P, P)
    Q = torch.stack([J @ (H[i] @ u) for i in range(N)], dim=1)  # (N, N), column i
    dG = (-(lr / N) * (Q + Q.T)).numpy()
    V = np.linalg.eigh((J @ J.T).numpy())[1][:, ::-1][:, :3]
    got = gram_change(model, X, theta.numpy(), (-(lr / N) * u).numpy(), V, torch.float64)
    Dbar = V.T @ dG @ V
    np.testing.assert_allclose(got["gram_change"][1], np.diag(Dbar), rtol=1e-9, atol=1e-12 * np.abs(Dbar).max())
    assert got["gram_change_fro"][1] == pytest.approx(np.linalg.norm(Dbar), rel=1e-9)
    # first order: measured − predicted shrinks like |Δθ|² (halving the step quarters the gap)
    small = gram_change(model, X, theta.numpy(), (-(lr / N / 2) * u).numpy(), V, torch.float64)
    assert small["gram_change_fro"][2] < 0.3 * got["gram_change_fro"][2], (small, got)


def test_gram_change_unknown_update_is_nan() -> None:
    model = _model()
    X = torch.randn(5, 2, dtype=torch.float64)
    theta, _ = flat_model(model)
    got = gram_change(model, X, theta.numpy(), np.full(theta.shape, np.nan), np.eye(5)[:, :2], torch.float64)
    assert np.isnan(got["gram_change"]).all() and got["gram_change"].shape == (2, 2)


@pytest.fixture(scope="module")
def recon_run(tmp_path_factory: pytest.TempPathFactory):
    url = str(tmp_path_factory.mktemp("recon") / "s.zarr")
    spec = ExperimentSpec(name="recon", data={"n": 40}, model={"depth": 2, "width": 12}, steps=3,
                          record={"every": 1}, spectrum={"k": "all", "images": [1], "store_eigenvectors": [0, 1],
                                                         "gram_change_k": 3})
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    return spec, Client(url).run("recon")


def _dense_gram(spec: ExperimentSpec, run, i: int) -> np.ndarray:
    model = build_model(spec.model, seed=0).double()
    torch.nn.utils.vector_to_parameters(torch.as_tensor(run.g["theta"][i], dtype=torch.float64), model.parameters())
    return dense_ntk(model, torch.as_tensor(run.X, dtype=torch.float64)).numpy()


def test_stored_reconstructions_and_gram_change(recon_run) -> None:
    spec, run = recon_run
    assert run.array("reconstruction_k").tolist() == [10, 40]
    R = run.array("reconstructions")  # (S, 2, N)
    assert np.isnan(R[2]).all(), "reconstructions are written at the eigenvector steps only"
    for i in (0, 1):
        G = _dense_gram(spec, run, i)
        w, V = np.linalg.eigh(G)
        V = V[:, ::-1]
        f = run.outputs(int(run.steps[i]))
        np.testing.assert_allclose(R[i, 0], V[:, :10] @ (V[:, :10].T @ f), atol=2e-4 * np.abs(f).max())
        np.testing.assert_allclose(R[i, 1], f, atol=2e-4 * np.abs(f).max())  # k = N: f itself
        # App. F measured: v_iᵀ (G_{t+1} − G_t) v_i with G_{t+1} from the next stored θ
        D = V[:, :3].T @ (_dense_gram(spec, run, i + 1) - G) @ V[:, :3]
        gc = run.array("gram_change")[i]
        np.testing.assert_allclose(gc[0], np.diag(D), rtol=1e-4, atol=1e-5 * w[-1])
    img = run.array("reconstruction_images")  # (S, 2, R, R); k = N renders f itself
    from nsa_dist.data import load_dataset
    from nsa_dist.pipeline.images import EigenImages, unit_coordinates

    ref = EigenImages(unit_coordinates(load_dataset(spec.data)), [1], spec.spectrum.image_size, 1.0, 3
                      ).image(run.outputs(0)[:, None])[0]
    np.testing.assert_allclose(img[0, 1], ref, atol=2e-4 * np.abs(ref).max())


def test_fig4d_and_appF_drawn(recon_run, tmp_path) -> None:
    from nsa_dist.plots.registry import make_figure, plot_run

    spec, run = recon_run
    paths = plot_run(run, tmp_path, figures=["fig4d_reconstructions", "appF_gram_change"])
    assert [p.name for p in paths] == ["fig4d_reconstructions.png", "appF_gram_change.png"]
    assert make_figure(run, "fig4d_reconstructions")._suptitle.get_text().startswith("NSA Fig. 4d — ")
    assert make_figure(run, "appF_gram_change")._suptitle.get_text().startswith("NSA App. F — ")
    with pytest.raises(KeyError, match=r"only at its eigenvector steps \[0, 1\], not at 2"):
        run.reconstructions(2)
