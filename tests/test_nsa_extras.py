"""Issue 19's NSA quantities against float64 references: Fig. 4d's reconstructions f̄_{t,k}
(dense eigh of J Jᵀ) and App. F's dG_t (dense Grams at θ_t, θ_{t+1}; Eq. 26 from per-point
model Hessians)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import dense_jacobian, dense_ntk, flat_model

from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec, ModelSpec, OptimizerName
from nsa_dist.errors import ShapeError
from nsa_dist.metrics import reconstruction_ks, top_k_reconstructions
from nsa_dist.models import build_model
from nsa_dist.ntk.kernel_change import gram_change
from nsa_dist.pipeline import run_experiment
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
    np.testing.assert_array_equal(
        torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy(), theta.numpy()
    )


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
    H = [torch.func.hessian(lambda v, i=i: f(v, X[i : i + 1]).reshape(()))(theta) for i in range(N)]  # ℋ(X^i), (P, P)
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


class _Normed(torch.nn.Module):
    """An MLP through LayerNorm (affine, then plain) and RMSNorm: PyTorch 2.13's forward-over-forward
    second derivatives of layer_norm / rms_norm are wrong (App. F's first order was 13 % off)."""

    def __init__(self, K: int) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(3, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, K)
        self.ln, self.plain, self.rms = (
            torch.nn.LayerNorm(8),
            torch.nn.LayerNorm(8, elementwise_affine=False),
            torch.nn.RMSNorm(8),
        )

    def forward(self, x):
        h = torch.tanh(self.ln(self.a(x)))
        return self.c(self.rms(torch.tanh(self.plain(self.b(h)))))


class _Encoder(torch.nn.Module):
    """A pre-LN attention block over short sequences (nn.MultiheadAttention, GELU, residuals), pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.ln1, self.ln2 = torch.nn.Linear(2, 8), torch.nn.LayerNorm(8), torch.nn.LayerNorm(8)
        self.att = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.mlp, self.out = (
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)),
            torch.nn.Linear(8, 1),
        )

    def forward(self, x):
        h = self.inp(x)
        a = self.ln1(h)
        h = h + self.att(a, a, a, need_weights=False)[0]
        h = h + self.mlp(self.ln2(h))
        return self.out(h.mean(dim=1))


@pytest.mark.parametrize(
    ("make", "shape"),
    [(lambda: _Normed(1), (9, 3)), (lambda: _Normed(2), (7, 3)), (_Encoder, (6, 4, 2))],
    ids=["layer-rms-norm", "layer-rms-norm-2-outputs", "attention-block"],
)
def test_gram_change_first_order_is_the_derivative_through_normalisation_layers(make, shape) -> None:
    """App. F's first order against a central difference of the dense G along Δθ (Richardson-
    extrapolated: O(ε⁴)) on models people write every day — LayerNorm, RMSNorm, attention."""
    torch.manual_seed(1)
    model = make().double()
    X = torch.randn(*shape, dtype=torch.float64)
    theta, _ = flat_model(model)
    dtheta = 0.02 * torch.randn_like(theta)

    def gram_at(v):
        torch.nn.utils.vector_to_parameters(v, model.parameters())
        return dense_ntk(model, X).numpy()

    def central(eps):
        return (gram_at(theta + eps * dtheta) - gram_at(theta - eps * dtheta)) / (2 * eps)

    dG = (4 * central(5e-3) - central(1e-2)) / 3
    G0 = gram_at(theta)
    V = np.linalg.eigh(G0)[1][:, ::-1][:, :4]
    got = gram_change(model, X, theta.numpy(), dtheta.numpy(), V, torch.float64)
    Dbar = V.T @ dG @ V
    err = np.abs(got["gram_change"][1] - np.diag(Dbar)).max() / np.abs(Dbar).max()
    assert err < 1e-6, (
        f"first-order diag {got['gram_change'][1]} vs the dense derivative {np.diag(Dbar)} ({err:.2g} apart)"
    )
    assert got["gram_change_fro"][1] == pytest.approx(np.linalg.norm(Dbar), rel=1e-6)


class _FrozenShared(torch.nn.Module):
    """A Linear used twice, then a frozen Linear and a LayerNorm (an audit's model: 42 of 121
    parameters frozen, dG 60–81 % off — the frozen ones were differentiated too)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.s, self.frozen, self.ln, self.h = (
            torch.nn.Linear(3, 6),
            torch.nn.Linear(6, 6),
            torch.nn.Linear(6, 6),
            torch.nn.LayerNorm(6),
            torch.nn.Linear(6, 1),
        )
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.s(torch.tanh(self.s(torch.tanh(self.a(x))))))
        return self.h(self.ln(torch.tanh(self.frozen(h))))


@pytest.mark.parametrize("frozen_move", [False, True], ids=["trainable-moved", "frozen-moved-too"])
def test_gram_change_of_a_model_with_frozen_parameters_is_the_trainable_kernels(frozen_move: bool) -> None:
    """The kernel is the trainable parameters'; the update may move the frozen ones too (a user's
    loop that sets them): the first order then follows them as the measured change does (it took
    them as constants: 7–13 % off per eigenvalue)."""
    torch.manual_seed(2)
    model = _FrozenShared().double()
    X = torch.randn(8, 3, dtype=torch.float64)
    theta, _ = flat_model(model)  # every parameter, as the store's θ_t
    mask = torch.cat([torch.full((p.numel(),), float(p.requires_grad)) for p in model.parameters()]).double()
    dtheta = 0.02 * torch.randn_like(theta) * (1.0 if frozen_move else mask)  # training moves the trainable ones

    def gram_at(v):
        torch.nn.utils.vector_to_parameters(v, model.parameters())
        return dense_ntk(model, X).numpy()  # the kernel of the parameters with requires_grad

    G0 = gram_at(theta)
    V = np.linalg.eigh(G0)[1][:, ::-1][:, :3]
    D = V.T @ (gram_at(theta + dtheta) - G0) @ V

    def central(eps):
        return (gram_at(theta + eps * dtheta) - gram_at(theta - eps * dtheta)) / (2 * eps)

    Dbar = V.T @ ((4 * central(5e-3) - central(1e-2)) / 3) @ V
    torch.nn.utils.vector_to_parameters(theta, model.parameters())
    got = gram_change(model, X, theta.numpy(), dtheta.numpy(), V, torch.float64)
    for row, want, what in ((0, D, "measured"), (1, Dbar, "first order")):
        err = np.abs(got["gram_change"][row] - np.diag(want)).max() / np.abs(want).max()
        assert err < 1e-6, (
            f"{what}: {got['gram_change'][row]} vs the trainable kernel's {np.diag(want)} ({err:.2g} apart)"
        )


def test_gram_change_puts_back_what_a_hook_cached() -> None:
    torch.manual_seed(0)
    model = _Normed(1).double()
    cache: dict = {}
    model.ln.register_forward_hook(lambda m, i, o: cache.__setitem__("ln", o.detach()))
    model.cache = cache
    X = torch.randn(6, 3, dtype=torch.float64)
    theta, _ = flat_model(model)
    V = np.linalg.eigh(dense_ntk(model, X).numpy())[1][:, ::-1][:, :2]
    model(X)  # the user's own forward (after the reference's jacrev, which leaves a torch.func tensor)
    gram_change(model, X, theta.numpy(), 0.01 * np.ones(theta.numel()), V, torch.float64)
    assert not torch._C._functorch.is_functorch_wrapped_tensor(cache["ln"]), (
        "the hook's cache holds a torch.func tensor"
    )


def test_gram_change_unknown_update_is_nan() -> None:
    model = _model()
    X = torch.randn(5, 2, dtype=torch.float64)
    theta, _ = flat_model(model)
    got = gram_change(model, X, theta.numpy(), np.full(theta.shape, np.nan), np.eye(5)[:, :2], torch.float64)
    assert np.isnan(got["gram_change"]).all() and got["gram_change"].shape == (2, 2)


@pytest.fixture(scope="module")
def recon_run(tmp_path_factory: pytest.TempPathFactory):
    url = str(tmp_path_factory.mktemp("recon") / "s.zarr")
    spec = ExperimentSpec(
        name="recon",
        data={"n": 40},
        model={"depth": 2, "width": 12},
        steps=3,
        record={"every": 1},
        spectrum={"k": "all", "images": [1], "store_eigenvectors": [0, 1], "gram_change_k": 3},
    )
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

    ref = EigenImages(unit_coordinates(load_dataset(spec.data)), [1], spec.spectrum.image_size, 1.0, 3).image(
        run.outputs(0)[:, None]
    )[0]
    np.testing.assert_allclose(img[0, 1], ref, atol=2e-4 * np.abs(ref).max())


def test_fig4d_and_appF_drawn(recon_run, tmp_path) -> None:
    from nsa_dist.plots.registry import make_figure, plot_run

    spec, run = recon_run
    paths = plot_run(run, tmp_path, figures=["fig4d_reconstructions", "appF_gram_change"])
    assert [p.name for p in paths] == ["fig4d_reconstructions.png", "appF_gram_change.png"]
    assert make_figure(run, "fig4d_reconstructions")._suptitle.get_text().startswith("NSA Fig. 4d — ")
    fig = make_figure(run, "appF_gram_change")
    assert fig._suptitle.get_text().startswith("NSA App. F — ")
    said = " ".join(t.get_text() for t in fig.texts)  # a kinked σ: the first-order dG is not expected to match
    kinked = str(run.spec.model.activation.value) in ("relu", "leaky_relu")
    assert ("piecewise linear" in said) == kinked, (run.spec.model.activation, said)
    with pytest.raises(KeyError, match=r"only at its eigenvector steps \[0, 1\], not at 2"):
        run.kernel.reconstructions(2)


def _psd(N: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((N, N // 2))
    G = A @ A.T  # rank N/2: a null space, as a real Gram of P < N parameters
    w, V = np.linalg.eigh(G)
    return G, w[::-1], V[:, ::-1]


def test_constant_gram_residual_is_gd_on_a_fixed_gram() -> None:
    """Eq. 5 with a schedule against the direct iteration m ← (I − δ_s G/N) m in float64."""
    from nsa_dist.metrics import constant_gram_decays, constant_gram_dynamics, constant_gram_residual

    N = 20
    G, w, V = _psd(N, 0)
    m0 = np.random.default_rng(1).standard_normal(N)
    lr_of = lambda s: 0.5 if s < 7 else 0.05  # noqa: E731 - a step decay
    record = [0, 3, 7, 12]
    for K in (N, 6):  # all eigenpairs (exact), the top 6 (G's rank-6 truncation)
        Gk = V[:, :K] @ np.diag(w[:K]) @ V[:, :K].T
        decays = constant_gram_decays(w[:K], [lr_of(s) for s in range(record[-1])], record, N)
        got = constant_gram_residual(w[:K], (V[:, :K].T @ m0) ** 2, float(m0 @ m0), decays)
        m, ref_norm, ref_E = m0.copy(), [], []
        for t in range(record[-1] + 1):
            if t in record:
                ref_norm.append(np.linalg.norm(m))
                ref_E.append(np.cumsum((V[:, :K].T @ m) ** 2) / (m @ m))
            m = m - lr_of(t) / N * (Gk @ m)
        np.testing.assert_allclose(got.norm, ref_norm, rtol=1e-10)
        np.testing.assert_allclose(got.energy, ref_E, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match=r"offsets must increase within 0..3"):
        constant_gram_decays(w, [0.1, 0.1, 0.1], [0, 4], N)
    # a constant rate agrees with the library's closed form (Eq. 5)
    traj = constant_gram_dynamics(w, V, m0, np.zeros(N), 0.3, np.array(record))
    const = constant_gram_residual(
        w, (V.T @ m0) ** 2, float(m0 @ m0), constant_gram_decays(w, np.full(record[-1], 0.3), record, N)
    )
    np.testing.assert_allclose(const.norm, np.linalg.norm(traj.m, axis=1), rtol=1e-10)


def test_stored_constant_gram_prediction(tmp_path) -> None:
    """The stored Eqs. 4–5 prediction against G_{t0} rebuilt densely from the stored θ_{t0}."""
    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(
        name="cg",
        data={"n": 30},
        model={"depth": 2, "width": 12},
        steps=12,
        record={"every": 4},
        spectrum={"k": "all", "images": [1], "store_eigenvectors": False},
        schedule={"lr": 0.2, "decay": 0.5, "every": 6},
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run("cg")
    G = _dense_gram(spec, run, 0)
    m = run.residual(int(run.steps[0])).astype(np.float64)
    w, V = np.linalg.eigh(G)
    V = V[:, ::-1]
    pred, E = run.array("constant_gram_residual"), run.array("constant_gram_energy")
    assert pred.shape == (len(run.steps), 2) and E.shape == (len(run.steps), 30)
    for t in range(int(run.steps[-1]) + 1):
        if t in run.steps:
            i = int(np.flatnonzero(run.steps == t)[0])
            assert pred[i, 0] == pytest.approx(np.linalg.norm(m), rel=1e-4), f"t = {t}"
            assert pred[i, 1] == pytest.approx(np.linalg.norm(run.residual(t)), rel=1e-6)
            r = int(np.sum(w > 1e-8 * w[-1]))  # compare over the non-null part (any null basis is right)
            np.testing.assert_allclose(E[i, :r], (np.cumsum((V.T @ m) ** 2) / (m @ m))[:r], atol=1e-4)
        m = m - spec.lr_at(t) / 30 * (G @ m)


def test_eqs45_drawn(tmp_path) -> None:
    from nsa_dist.plots.registry import make_figure

    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(
        name="cgp",
        data={"n": 24},
        model={"depth": 2, "width": 8},
        steps=4,
        record={"every": 2},
        spectrum={"k": 12, "images": [1], "store_eigenvectors": False},
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run("cgp")
    assert run.g["constant_gram_residual"].attrs["truncated"] is True  # K = 12 < N = 24
    fig = make_figure(run, "eqs45_constant_gram")
    assert fig._suptitle.get_text().startswith("NSA Eqs. 4–5 — ")
    # Adam: not the paper's dynamics, nothing written, no figure
    spec2 = spec.model_copy(
        update={"name": "cga", "optimizer": spec.optimizer.model_copy(update={"name": OptimizerName.ADAM})}
    )
    assert run_experiment(spec2, SpectrumStore(url)).status == "done"
    run2 = Client(url).run("cga")
    assert not run2.has("constant_gram_residual") and make_figure(run2, "eqs45_constant_gram") is None


# every NSA figure of `nsa plot`: its figure number (panel letters of the paper's captions) and what
_NSA_TITLES = {
    "fig1abc_target_output_points": "NSA Fig. 1a–c — target, network output and training points",
    "fig1d_first_order": "NSA Fig. 1d — accuracy of the first-order dynamics",
    "fig1e_lr_stability": "NSA Fig. 1e — learning rate and its stability bound",
    "fig2a_eigenvalues": "NSA Fig. 2a — eigenvalues of $G_t$ for different t",
    "fig2b_eigenvalues_t": "NSA Fig. 2b — individual eigenvalues along t",
    "fig2c_flow_speed": "NSA Fig. 2c — information flow speed of the top eigenvectors",
    "fig2d_lr_eigen": r"NSA Fig. 2d — $\delta_t \lambda_i^t / N$ along t",
    "fig3a_energy_y": r"NSA Fig. 3a — relative energy of the labels $\bar y$ in the top k eigenvectors of $G_t$",
    "fig3b_energy_f": r"NSA Fig. 3b — relative energy of the network output $\bar f_t$",
    "fig3c_energy_residual": r"NSA Fig. 3c — relative energy of the residual $\bar m_t$",
    "fig3d_energy_df": r"NSA Fig. 3d — relative energy of the differential $d\bar f_t = -(\delta_t/N) G_t \bar m_t$",
    "fig3e_energy_f_test": "NSA Fig. 3e — relative energy of the network output at the test points "
    "(Gramian at the test points)",
    "fig4a_residual_projections": "NSA Fig. 4a — spectral projections of the residual",
    "fig4bc_residual_fourier": "NSA Fig. 4b–c — residual and its Fourier transform",
    "fig4d_reconstructions": r"NSA Fig. 4d — $\bar f_{t,k}$ from the top $k$ eigenvectors of $G_t$, t = 4",
    "appF_gram_change": "NSA App. F — first-order change $dG_t$ of the Gramian",
    "eqs45_constant_gram": "NSA Eqs. 4–5 — residual under a constant Gramian $G_{0}$ vs measured",
    "fig5_eigenvectors": "NSA Fig. 5 — eigenvectors of $G_t$ and their Fourier transforms, t = 4",
    "fig6_eigenvectors_early": "NSA Fig. 6 — eigenvectors of $G_t$ and their Fourier transforms, t = 2",
    "fig7d_preservation": r"NSA Fig. 7d — spectrum preservation: relative energy of $v_i^{t_2}$ in the spectrum "
    r"of $G_{t_1}$",
    "loss": "NSA Fig. 7b (this run) — training loss",
    "energy_against_k": r"NSA — relative energy $E_t(\phi, k)$ against k, with its bracket",
}


def test_every_nsa_figure_title(tmp_path) -> None:
    """A 2-D GD/L2 run with test points and eigenvectors draws every NSA figure, each titled with
    the paper's figure number; the sweep's Fig. 7a–c likewise."""
    from nsa_dist.plots.axes import title_of
    from nsa_dist.plots.registry import FIGURES, make_figure

    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(
        name="titles",
        data={"n": 30, "n_test": 8},
        model={"depth": 2, "width": 8},
        steps=5,
        record={"every": 2},
        spectrum={"k": "all", "images": [1, 2], "test_points": True, "gram_change_k": 2},
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run("titles")
    nsa = [f for f in FIGURES if not f.startswith("hessian_")]
    assert sorted(nsa) == sorted(_NSA_TITLES), "a new NSA figure needs its title here"
    for name in nsa:
        fig = make_figure(run, name)
        assert fig is not None, f"{name} not drawn"
        got = title_of(fig)  # the title line, unwrapped (a long one is wrapped to the figure's width)
        assert got == _NSA_TITLES[name], f"{name}: {got!r}"


def test_eq22_nystrom_equals_exact_test_dynamics() -> None:
    """Eq. 22 through the Nyström extension over all λ_i > 0 is Eq. 18 (the exact test-point
    dynamics with g(X', 𝒳) fixed), iterated directly in float64; the top-K version is the
    prediction of the rank-K truncated kernel."""
    from nsa_dist.metrics import constant_gram_decays, constant_gram_test_outputs, nystrom_extension

    rng = np.random.default_rng(3)
    N, M, P = 16, 5, 10  # P < N: G has a null space, as a real Gram of few parameters
    J, Jt = rng.standard_normal((N, P)), rng.standard_normal((M, P))
    G, g = J @ J.T, Jt @ J.T  # (N, N), (M, N)
    w, V = np.linalg.eigh(G)
    w, V = w[::-1][:P], V[:, ::-1][:, :P]  # the P eigenpairs with λ > 0
    m0, f0 = rng.standard_normal(N), rng.standard_normal(M)
    lr_of = lambda s: 0.02 if s < 5 else 0.01  # noqa: E731
    record = [0, 2, 5, 9]
    decays = constant_gram_decays(w, [lr_of(s) for s in range(record[-1])], record, N)
    got = constant_gram_test_outputs(nystrom_extension(g, w, V), V.T @ m0, f0, decays)
    m, f, ref = m0.copy(), f0.copy(), []
    for t in range(record[-1] + 1):
        if t in record:
            ref.append(f.copy())
        f, m = f - lr_of(t) / N * (g @ m), m - lr_of(t) / N * (G @ m)  # Eq. 17 and Eq. 14's step
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
    # two outputs at once: the columns are independent
    two = constant_gram_test_outputs(
        nystrom_extension(g, w, V), V.T @ np.stack([m0, -m0], 1), np.stack([f0, f0], 1), decays
    )
    np.testing.assert_allclose(two[..., 0], ref, rtol=1e-10)
    np.testing.assert_allclose(two[..., 1] - f0, -(np.asarray(ref) - f0), rtol=1e-10, atol=1e-12)


def test_stored_test_point_prediction_against_exact(tmp_path) -> None:
    """The stored App. E prediction (Nyström from JVP products at θ_{t0}) against Eq. 18 with the
    dense g(X', 𝒳) and G at the stored θ_{t0}, iterated over the run's learning rates."""
    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(
        name="eq22",
        data={"n": 24, "n_test": 6},
        model={"depth": 2, "width": 6},
        steps=8,
        record={"every": 4},
        spectrum={"k": "all", "images": [1], "store_eigenvectors": False},
        schedule={"lr": 0.3, "decay": 0.5, "every": 3},
    )
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run("eq22")
    model = build_model(spec.model, seed=0).double()
    torch.nn.utils.vector_to_parameters(torch.as_tensor(run.g["theta"][0], dtype=torch.float64), model.parameters())
    X, Xt = (torch.as_tensor(a, dtype=torch.float64) for a in (run.X, run.X_test))
    G, g = dense_ntk(model, X).numpy(), dense_ntk(model, Xt, X).numpy()
    m, f = run.residual(0).astype(np.float64), run.outputs(0, "f_test").astype(np.float64)
    got = run.kernel.constant_gram_test()
    assert got.shape == (len(run.steps), 6)
    np.testing.assert_allclose(got[0], f, rtol=1e-12)
    for t in range(int(run.steps[-1]) + 1):
        if t in run.steps:
            i = int(np.flatnonzero(run.steps == t)[0])
            err = np.abs(got[i] - f).max() / np.abs(f - got[0]).max() if t else 0.0
            assert err < 1e-3, f"t = {t}: Eq. 22 off Eq. 18 by {err:.2e} of the change"
        f, m = f - spec.lr_at(t) / 24 * (g @ m), m - spec.lr_at(t) / 24 * (G @ m)
    assert np.isnan(run.g["constant_gram_f_test"][1]).all(), "written at the first recorded step only"
    ds = run.to_xarray()  # named dimensions for the new arrays
    assert ds["constant_gram_f_test"].dims == ("step", "predicted_step", "test_point")
    assert ds["constant_gram_residual"].dims == ("step", "predicted_measured")
    np.testing.assert_array_equal(ds["constant_gram_f_test"].values[0], got)


@pytest.mark.parametrize("K", [1, 3])
def test_cross_gram_times_is_the_dense_kernel_rows(K: int) -> None:
    from nsa_dist.ntk.kernel_change import cross_gram_times

    model = _model(K)
    X, Xt = torch.randn(11, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    V = np.random.default_rng(0).standard_normal((11, 3))
    ref = dense_ntk(model, Xt, X).numpy() @ V  # (M, N) traced kernel rows times V
    np.testing.assert_allclose(cross_gram_times(model, Xt, X, V, torch.float64), ref, rtol=1e-10, atol=1e-12)
    buf = torch.full((4, 11), float("nan"), dtype=torch.float64)  # whole, in a caller's buffer (overwritten)
    np.testing.assert_allclose(cross_gram_times(model, Xt, X, V, torch.float64, out=buf), ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(buf.numpy(), dense_ntk(model, Xt, X).numpy(), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"out must be a contiguous tensor of shape \(4, 11\)"):
        cross_gram_times(model, Xt, X, V, torch.float64, out=torch.empty(11, 4, dtype=torch.float64))


class _Tokens(torch.nn.Module):
    """Token ids through an Embedding or an EmbeddingBag (mean over the sequence), then a Linear."""

    def __init__(self, bag: bool) -> None:
        super().__init__()
        self.bag = bag
        self.e = torch.nn.EmbeddingBag(9, 4, mode="mean") if bag else torch.nn.Embedding(9, 4)
        self.o = torch.nn.Linear(4 if bag else 20, 1)

    def forward(self, t):
        h = torch.tanh(self.e(t))
        return self.o(h if self.bag else h.flatten(1))


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("bag", [False, True])
def test_gram_change_of_a_token_model_is_the_dense_difference(bag: bool) -> None:
    """App. F on token inputs: the ids were cast to the products' float dtype ("Expected tensor for
    argument #1 'indices' to have one of the following scalar types: Long, Int"), so a token model's
    dG_t was NaN at every step; an EmbeddingBag had no forward mode for its first order either."""
    torch.manual_seed(0)
    model = _Tokens(bag).double()
    T = torch.randint(0, 9, (10, 5), generator=torch.Generator().manual_seed(1))
    theta = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    dtheta = 1e-4 * torch.randn_like(theta)
    G0 = dense_ntk(model, T).numpy()
    torch.nn.utils.vector_to_parameters(theta + dtheta, model.parameters())
    G1 = dense_ntk(model, T).numpy()
    torch.nn.utils.vector_to_parameters(theta, model.parameters())
    V = np.linalg.eigh(G0)[1][:, ::-1][:, :3]
    got = gram_change(model, T, theta.numpy(), dtheta.numpy(), V, torch.float64)
    D = V.T @ (G1 - G0) @ V
    np.testing.assert_allclose(got["gram_change"][0], np.diag(D), rtol=1e-8, atol=1e-12 * np.abs(D).max())
    # to first order: the measured change less the second-order term
    assert got["gram_change_fro"][2] < 1e-3 * got["gram_change_fro"][0], got["gram_change_fro"]
