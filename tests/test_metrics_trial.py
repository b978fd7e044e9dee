"""Adversarial trial of nsa_dist.metrics against independent float64 references written from the paper.

Every reference here is built from the definition (NSA §2–4, §6, App. A, D, E, G) with NumPy /
torch, never from the product's code: iterated GD recursions instead of closed forms, projectors
from QR instead of coordinates, numpy.fft instead of the Monte-Carlo transform, a real network
trained one GD step (Jacobian by torch.func.jacrev) for Eq. (3).  Inputs are the ones research
produces: degenerate eigenvalues with arbitrary bases inside the eigenspace, sign flips,
rank-deficient G, zero / orthogonal φ, k = 1 and k = N, N = 1 and 2, float32, NaN/inf,
eigenvalues in ascending (``np.linalg.eigh``) order, odd and non-square images.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import functional_call, jacrev

from nsa_dist.errors import NonFiniteError, ShapeError
from nsa_dist.metrics import (
    FrequencyGrid,
    alignment_from_products,
    centered_sq_frobenius,
    constant_gram_decay,
    constant_gram_decays,
    constant_gram_dynamics,
    constant_gram_log_decays,
    constant_gram_residual,
    constant_gram_test_outputs,
    energy_from_projections,
    first_order_accuracy,
    first_order_update,
    flow_speed,
    fourier_transform,
    fourier_transform_grid,
    frequency_grid,
    kernel_target_alignment,
    lr_eigen_product,
    nystrom_extension,
    nystrom_from_products,
    reconstruction_ks,
    relative_energy,
    spectral_projections,
    spectrum_preservation,
    stability_bound,
    top_k_reconstructions,
)

# ------------------------------------------------------------------ helpers


def close(name: str, got, want, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    """assert_allclose that says which quantity differs, where, and by how much."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != reference {want.shape}"
    err = np.abs(got - want)
    tol = atol + rtol * np.abs(want)
    if not np.all(err <= tol):
        i = np.unravel_index(int(np.argmax(err - tol)), err.shape) if err.ndim else ()
        raise AssertionError(
            f"{name}: max |got − ref| = {err.max():.3e} (tol {atol:g} + {rtol:g}·|ref|) at {i}: "
            f"got {got[i]!r}, ref {want[i]!r}"
        )


def orthonormal(N: int, seed: int) -> np.ndarray:
    return np.linalg.qr(np.random.default_rng(seed).standard_normal((N, N)))[0]


# G = Q diag(LAM) Qᵀ with a triple eigenvalue, a double zero (rank-deficient) and descending order.
LAM = np.array([9.0, 4.0, 4.0, 4.0, 1.5, 0.0, 0.0])
N7 = LAM.size
Q7 = orthonormal(N7, 0)
G7 = Q7 @ np.diag(LAM) @ Q7.T


def rotated_basis(seed: int) -> np.ndarray:
    """Another orthonormal eigenbasis of G7 (descending): a random rotation inside each degenerate
    eigenspace and random sign flips of every column."""
    rng = np.random.default_rng(seed)
    V = Q7.copy()
    for lo, hi in ((1, 4), (5, 7)):
        R = np.linalg.qr(rng.standard_normal((hi - lo, hi - lo)))[0]
        V[:, lo:hi] = V[:, lo:hi] @ R
    return V * rng.choice([-1.0, 1.0], size=N7)


def projector(cols: np.ndarray) -> np.ndarray:
    """Orthogonal projector onto span(cols), from an independent QR."""
    Qc = np.linalg.qr(cols)[0]
    return Qc @ Qc.T


# k at which span{v_1..v_k} does not depend on the basis inside a degenerate eigenspace
K_EDGES = (1, 4, 5, 7)


# ------------------------------------------------------------------ energy (§6)


def test_relative_energy_is_projector_share_and_basis_free_at_eigenspace_edges():
    phi = np.random.default_rng(1).standard_normal(N7)
    for seed in range(4):
        V = rotated_basis(seed)
        E = relative_energy(V, phi)
        for k in K_EDGES:
            ref = phi @ projector(Q7[:, :k]) @ phi / (phi @ phi)
            close(f"E(φ,{k}) basis seed {seed}", E[k - 1], ref)
            assert relative_energy(V, phi, k) == pytest.approx(ref, rel=1e-10, abs=1e-13)
        close("⟨v_i,φ⟩²", spectral_projections(V, phi), (V.T @ phi) ** 2)
    # float32 in, float64 out, to float32 rounding
    E32 = relative_energy(Q7.astype(np.float32), phi.astype(np.float32))
    assert E32.dtype == np.float64
    close("E float32", E32, np.cumsum((Q7.T @ phi) ** 2) / (phi @ phi), rtol=1e-5, atol=1e-6)


def test_relative_energy_orthogonal_zero_small_and_several_columns():
    V = Q7
    phi = V[:, 5] - 2 * V[:, 6]  # orthogonal to the top 5
    close("E(φ ⟂ top-5)", relative_energy(V, phi), [0, 0, 0, 0, 0, 0.2, 1.0], atol=1e-14)
    with pytest.raises(NonFiniteError, match="zero norm"):
        relative_energy(V, np.zeros(N7))
    assert np.isnan(relative_energy(V, np.zeros(N7), undefined="nan")).all()
    with pytest.raises(NonFiniteError, match="phi"):
        relative_energy(V, np.r_[np.nan, np.ones(N7 - 1)])
    assert relative_energy([[-1.0]], [3.0], 1) == 1.0  # N = 1
    V2 = np.array([[1.0, 1.0], [1.0, -1.0]]) / np.sqrt(2)
    close("N=2", relative_energy(V2, [3.0, 1.0]), [0.8, 1.0])
    Phi = np.random.default_rng(2).standard_normal((N7, 3))
    ref_cols = np.cumsum((Q7.T @ Phi) ** 2, axis=0).T / (Phi**2).sum(0)[:, None]
    close("E per column", relative_energy(V, Phi), ref_cols)
    ref_pool = np.cumsum(((Q7.T @ Phi) ** 2).sum(1)) / (Phi**2).sum()
    close("E pooled", relative_energy(V, Phi, pooled=True), ref_pool)
    close("energy_from_projections", energy_from_projections(Q7.T @ Phi, Phi), ref_pool)


# ------------------------------------------------------------------ preservation (Fig. 7d)


def test_spectrum_preservation_reference_and_basis_freedom():
    rng = np.random.default_rng(3)
    V1, V2 = rotated_basis(1), orthonormal(N7, 9)
    ref = np.cumsum((V1.T @ V2) ** 2, axis=0).T  # row i: E_{t1}(v_i^{t2}, k)
    close("preservation", spectrum_preservation(V1, V2), ref)
    close("preservation i=[3,1]", spectrum_preservation(V1, V2, [3, 1]), ref[[2, 0]])
    close("preservation i=2", spectrum_preservation(V1, V2, 2), ref[1])
    P = spectrum_preservation(V1, V2 * rng.choice([-1.0, 1.0], N7))  # t2 signs do not matter
    Pb = spectrum_preservation(rotated_basis(5), V2)  # t1 basis inside eigenspaces does not at edges
    for k in K_EDGES:
        close(f"preservation k={k} sign", P[:, k - 1], ref[:, k - 1])
        close(f"preservation k={k} basis", Pb[:, k - 1], ref[:, k - 1])
    with pytest.raises(ShapeError):
        spectrum_preservation(V1, V2, 0)  # 1-based


# ------------------------------------------------------------------ alignment


def ref_alignment(G: np.ndarray, Y: np.ndarray, centered: bool) -> float:
    G, Y = np.asarray(G, np.float64), np.asarray(Y, np.float64).reshape(len(G), -1)
    if centered:
        H = np.eye(len(G)) - np.full((len(G), len(G)), 1 / len(G))
        G, Y = H @ G @ H, H @ Y
    T = Y @ Y.T
    return float(np.sum(G * T) / (np.linalg.norm(G) * np.linalg.norm(T)))


def test_kernel_target_alignment_reference_raw_centred_multi_output():
    rng = np.random.default_rng(4)
    for Y in (rng.standard_normal(N7), rng.standard_normal((N7, 3))):
        for c in (False, True):
            want = ref_alignment(G7, Y, c)
            assert kernel_target_alignment(G7, Y, centered=c) == pytest.approx(want, rel=1e-12)
            g1 = G7 @ np.ones(N7)
            fro2 = centered_sq_frobenius(np.sum(G7**2), g1) if c else np.sum(G7**2)
            got = alignment_from_products(Y, G7 @ Y, fro2, centered=c, G1=g1)
            assert got == pytest.approx(want, rel=1e-12), f"alignment_from_products centred={c}"
    H = np.eye(N7) - 1 / N7
    assert centered_sq_frobenius(np.sum(G7**2), G7.sum(1)) == pytest.approx(np.sum((H @ G7 @ H) ** 2), rel=1e-12)
    assert kernel_target_alignment(G7, Q7[:, 0]) == pytest.approx(9 / np.linalg.norm(LAM), rel=1e-12)
    with pytest.raises(NonFiniteError, match="centred y"):
        kernel_target_alignment(G7, np.ones(N7), centered=True)


def test_centred_alignment_of_float32_gramian_is_float64_exact():
    """DEFECT: G·Y was taken in G's float32 before the float64 sum; with the constant offset an
    NTK Gramian commonly has (a bias), centring cancels it and the float32 rounding of G·Y_c
    remains: the centred alignment was 0.577073 for a float64 reference 0.577293 (−2.2e-4, rel
    −3.8e-4) at offset 1e6; the raw one rel −4.6e-8."""
    rng = np.random.default_rng(0)
    N = 300
    A = rng.standard_normal((N, 3))
    y = A[:, 0] + 0.1 * rng.standard_normal(N)
    G32 = (1e6 + A @ A.T).astype(np.float32)
    for c in (False, True):
        want = ref_alignment(G32.astype(np.float64), y, c)  # the same float32 values, in float64
        got = kernel_target_alignment(G32, y, centered=c)
        assert got == pytest.approx(want, rel=1e-9), f"centred={c}: got {got!r}, ref {want!r}, diff {got - want:.3e}"


# ------------------------------------------------------------------ flow (§4)


def test_flow_quantities_reference_including_rounding_negative_eigenvalues():
    lam = np.array([8.0, 4.0, 2.0, 0.0, -1e-15])
    N, lr = 4, 0.75  # δλ/N = 1.5, 0.75, 0.375, 0, ~0
    close("δλ/N", lr_eigen_product(lam, lr, N), lr * lam / N)
    close("s_i", flow_speed(lam, lr, N), [0.5, 0.75, 0.375, 0.0, 0.0], atol=1e-15)
    lrs = np.array([[0.5], [1.0]])
    close("δ_t λ/N", lr_eigen_product(np.stack([lam, lam]), lrs, N), lrs * lam / N)
    assert stability_bound(8.0, 4) == 1.0
    close("2N/λmax", stability_bound([8.0, 2.0], 4), [1.0, 4.0])
    # at the bound the flow along v_1 stops: s_1 = 0, and beyond it is negative
    assert flow_speed([8.0], stability_bound(8.0, 4), 4)[0] == pytest.approx(0.0, abs=1e-15)
    assert flow_speed([8.0], 1.1 * stability_bound(8.0, 4), 4)[0] < 0
    with pytest.raises(NonFiniteError):
        lr_eigen_product([1.0, np.inf], 0.1, 2)
    with pytest.raises(ValueError):
        lr_eigen_product([1.0], -0.1, 2)


# ------------------------------------------------------------------ first order (Eq. 3) on a real net


def _net_one_step(lr: float, N: int = 12):
    """A tanh MLP on 2-D inputs, one GD step on L = (1/N) Σ ½(f − y)² (the paper's Eq. 1)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    X = torch.rand(N, 2, dtype=torch.float64)
    y = torch.sin(3 * X[:, 0]) * X[:, 1]
    params = {k: v.detach() for k, v in net.named_parameters()}

    def f(p):
        return functional_call(net, p, (X,))[:, 0]

    J = jacrev(f)(params)
    A = torch.cat([j.reshape(N, -1) for j in J.values()], dim=1)  # (N, |θ|), row i = ∇θ f(X^i)
    G = (A @ A.T).numpy()
    f0 = f(params)
    p_req = {k: v.clone().requires_grad_() for k, v in params.items()}
    loss = 0.5 * ((f(p_req) - y) ** 2).mean()
    grads = torch.autograd.grad(loss, list(p_req.values()))
    new = {k: v - lr * g for (k, v), g in zip(params.items(), grads)}
    df = (f(new) - f0).detach().numpy()
    return G, (f0 - y).detach().numpy(), df


def test_first_order_update_matches_a_real_gd_step_with_the_mean_loss_convention():
    errs = []
    for lr in (0.04, 0.02):
        G, m, df = _net_one_step(lr)
        pred = first_order_update(G, m, lr)
        close("df̄ = −(δ/N)Gm (own formula)", pred, -(lr / len(m)) * G @ m)
        acc = first_order_accuracy(df, pred)
        ref_err = np.linalg.norm(df - pred) / np.linalg.norm(df)
        ref_cos = df @ pred / (np.linalg.norm(df) * np.linalg.norm(pred))
        assert acc.error == pytest.approx(ref_err, rel=1e-12) and acc.cos_alpha == pytest.approx(ref_cos, rel=1e-12)
        assert acc.error < 0.05 and acc.cos_alpha > 0.998, f"lr={lr}: {acc}"
        errs.append(acc.error)
        # the sum-loss convention (no 1/N) would be off by a factor N: far outside
        assert first_order_accuracy(df, pred * len(m)).error > 5
    assert errs[1] == pytest.approx(errs[0] / 2, rel=0.2), f"error not O(δ): {errs}"  # second order left


# ------------------------------------------------------------------ constant-Gram dynamics (Eqs. 4–5, App. D–E)


def gd_iterate(G: np.ndarray, f0: np.ndarray, y: np.ndarray, lrs) -> list[tuple[np.ndarray, np.ndarray]]:
    """(f̄_t, m̄_t) for t = 0..len(lrs) by the recursion f̄_{t+1} = f̄_t − (δ_t/N) G (f̄_t − ȳ)."""
    N, f, out = G.shape[0], f0.astype(np.float64), []
    for lr in [*lrs, None]:
        out.append((f.copy(), f - y))
        if lr is not None:
            f = f - (lr / N) * G @ (f - y)
    return out


def test_constant_gram_dynamics_equals_gd_recursion_for_any_eigenbasis_order_and_truncation():
    rng = np.random.default_rng(5)
    f0, y = rng.standard_normal(N7), rng.standard_normal(N7)
    lr = 0.6 * 2 * N7 / 9.0
    ref = gd_iterate(G7, f0, y, [lr] * 6)
    steps = np.arange(7)
    for seed in range(3):
        V = rotated_basis(seed)
        p = rng.permutation(N7)  # any order, as documented
        out = constant_gram_dynamics(LAM[p], V[:, p], f0, y, lr, steps)
        close(f"f̄_t seed {seed}", out.f, np.array([a for a, _ in ref]))
        close(f"m̄_t seed {seed}", out.m, np.array([b for _, b in ref]))
    # only the eigenpairs with λ > 0 (rank 5): the null space part never moves, exact
    top = constant_gram_dynamics(LAM[:5], Q7[:, :5], f0, y, lr, 6)
    close("f̄_6 from λ>0 only", top.f, ref[6][0])
    # ascending order from eigh, float32 in → float32 out
    lam_a, V_a = np.linalg.eigh(G7)
    o32 = constant_gram_dynamics(lam_a.astype(np.float32), V_a.astype(np.float32), f0.astype(np.float32), y, lr, 6)
    assert o32.f.dtype == np.float64  # y float64
    close("f̄_6 eigh order", o32.f, ref[6][0], rtol=1e-5, atol=1e-5)
    # several outputs
    F0, Y = rng.standard_normal((N7, 2)), rng.standard_normal((N7, 2))
    refM = gd_iterate(G7, F0, Y, [lr] * 3)[3]
    close("f̄_3 (N, M)", constant_gram_dynamics(LAM, Q7, F0, Y, lr, 3).f, refM[0])


def test_log_decays_equal_direct_products_over_a_schedule():
    lam = np.array([9.0, 4.0, 1.0, 0.0, -1e-15])
    lrs = np.array([0.5, 0.5, 1.7, 0.1, 1.7, 0.5, 2.0])  # 1 − δλ/N crosses 0 and goes below −1
    N, offsets = 3, [0, 1, 4, 7]
    ref = np.array([np.prod([1 - d * lam / N for d in lrs[:o]], axis=0) if o else np.ones(5) for o in offsets])
    close("r_i(t_j)", constant_gram_decays(lam, lrs, offsets, N), ref, rtol=1e-12)
    close("r_i(T)", constant_gram_decay(lam, lrs, N), ref[-1], rtol=1e-12)
    dec = constant_gram_log_decays(lam, lrs, offsets, N)
    close("sign", dec.sign, np.sign(ref))


@pytest.mark.parametrize(
    "lrs, offsets, n, err, match",
    [
        ([0.1, np.nan], [2], 3, NonFiniteError, "lrs"),
        ([0.1, np.inf], [2], 3, NonFiniteError, "lrs"),
        ([0.1, -0.1], [2], 3, ValueError, "negative"),
        ([0.1, 0.1], [2], 0, ShapeError, "n must"),
        ([0.1, 0.1], [0.5, 1.7], 3, TypeError, "integers"),
    ],
)
def test_log_decays_refuse_bad_rates_n_and_offsets(lrs, offsets, n, err, match):
    """DEFECT: a NaN rate gave silent NaN decays, a negative rate a growing "decay" (3.0 for
    δ = −1, λ = 2, N = 1), n = 0 a silent −inf, and offsets 0.5, 1.7 were truncated to 0, 1."""
    with pytest.raises(err, match=match):
        constant_gram_log_decays([2.0, 1.0], lrs, offsets, n)


def test_constant_gram_residual_equals_gd_recursion_and_takes_eigh_order():
    """DEFECT: with eigenpairs in ascending order (``np.linalg.eigh``'s) the energy column k-1
    summed the k SMALLEST eigenvalues' shares: E(m̄_5, 1) was 0.2747 (the share of λ = 0) for a
    reference 1.9e-5."""
    rng = np.random.default_rng(6)
    f0, y = rng.standard_normal(N7), rng.standard_normal(N7)
    lrs = [0.9, 0.9, 0.3, 0.3, 0.3]
    ref = gd_iterate(G7, f0, y, lrs)
    m0 = f0 - y
    offsets = [0, 2, 5]
    want_norm = [np.linalg.norm(ref[o][1]) for o in offsets]
    want_E = np.array([np.cumsum((Q7.T @ ref[o][1]) ** 2) / (ref[o][1] @ ref[o][1]) for o in offsets])
    for name, lam, V in (("descending", LAM, Q7), ("eigh ascending", *np.linalg.eigh(G7))):
        p = (V.T @ m0) ** 2
        res = constant_gram_residual(lam, p, m0 @ m0, constant_gram_log_decays(lam, lrs, offsets, N7))
        close(f"‖m̄_t‖ {name}", res.norm, want_norm)
        for k in K_EDGES:  # basis-free k
            close(f"E(m̄_t,{k}) {name}", res.energy[:, k - 1], want_E[:, k - 1], atol=1e-10)
    # top-5 (λ > 0) only: the null-space residual stays, exact
    p5 = (Q7[:, :5].T @ m0) ** 2
    res5 = constant_gram_residual(LAM[:5], p5, m0 @ m0, constant_gram_decays(LAM[:5], lrs, offsets, N7))
    close("‖m̄_t‖ top-5", res5.norm, want_norm)


@pytest.mark.parametrize(
    "proj, m0_sq, err",
    [([1.0, 0.5], np.nan, NonFiniteError), ([1.0, -0.5], 2.0, ValueError), ([1.0, 0.5], 1.5**0.5, ValueError)],
)
def test_constant_gram_residual_refuses_nan_negative_and_unsquared_norms(proj, m0_sq, err):
    """DEFECT: NaN ‖m̄‖² and a negative projection gave silent NaN; ‖m̄‖ passed for ‖m̄‖² (below
    Σ p_i) was clipped to a residual-free prediction, a wrong number without a word."""
    with pytest.raises(err):
        constant_gram_residual([2.0, 1.0], proj, m0_sq, np.ones((1, 2)))


def test_test_point_outputs_equal_gd_on_a_rank_deficient_jacobian_kernel():
    """Eq. (22) with Nyström eigenfunctions (Eq. 9) against GD iterated at train and test points
    (Eq. 17), for a Jacobian kernel of rank 4 < N = 6, using only the eigenpairs with λ > 0."""
    rng = np.random.default_rng(7)
    J = rng.standard_normal((6 + 3, 4))  # rows: ∇θ f at 6 training and 3 test points, |θ| = 4
    G, g = J[:6] @ J[:6].T, J[6:] @ J[:6].T
    lam, V = np.linalg.eigh(G)
    keep = lam > 1e-10 * lam.max()
    lam, V = lam[keep], V[:, keep]
    f0, y, f0t = rng.standard_normal(6), rng.standard_normal(6), rng.standard_normal(3)
    lrs = [0.7, 0.7, 0.2, 0.4]
    m, ft = f0 - y, f0t.copy()
    for d in lrs:
        ft, m = ft - (d / 6) * g @ m, m - (d / 6) * G @ m
    ext = nystrom_extension(g, lam, V)
    close("ṽ = g v / λ", ext, g @ V / lam)
    out = constant_gram_test_outputs(ext, V.T @ (f0 - y), f0t, constant_gram_decays(lam, lrs, [4], 6))
    close("f_t(X') Eq. 22", out[0], ft)


# ------------------------------------------------------------------ Nyström (App. A)


def test_nystrom_reproduces_eigenvectors_at_training_points_and_flips_with_them():
    V = rotated_basis(2)[:, :5]
    close("ṽ(𝒳) = v", nystrom_extension(G7, LAM[:5], V), V)
    close("ṽ(𝒳) = v float32", nystrom_extension(G7.astype(np.float32), LAM[:5], V.astype(np.float32)), V, atol=1e-5)
    close("from products", nystrom_from_products(G7 @ V, LAM[:5]), V)
    with pytest.raises(NonFiniteError, match="zeros"):
        nystrom_extension(G7, LAM, Q7)
    with pytest.raises(ValueError, match="negative"):
        nystrom_extension(G7, np.r_[LAM[:5], -1e-17], Q7[:, :6])


# ------------------------------------------------------------------ reconstruction (Fig. 4d)


def test_top_k_reconstructions_are_projections_and_basis_free_at_edges():
    rng = np.random.default_rng(8)
    phi, Phi = rng.standard_normal(N7), rng.standard_normal((N7, 2))
    for seed in range(3):
        V = rotated_basis(seed)
        R = top_k_reconstructions(V, phi, K_EDGES)
        RM = top_k_reconstructions(V, Phi, (1, 4))
        for j, k in enumerate(K_EDGES):
            close(f"φ̄_{k}", R[j], projector(Q7[:, :k]) @ phi)
        close("(N, Ko)", RM, np.stack([projector(Q7[:, :k]) @ Phi for k in (1, 4)]))
    assert reconstruction_ks(150) == (10, 100, 150) and reconstruction_ks(5) == (5,)


@pytest.mark.parametrize(
    "evecs, ks, err",
    [(Q7, (1.5,), TypeError), (Q7, (), ShapeError), (Q7, (0,), ShapeError), (np.ones((2, 3)), (3,), ShapeError)],
)
def test_top_k_reconstructions_refuse_bad_ks_and_wide_evecs(evecs, ks, err):
    """DEFECT: a float k raised an internal slicing TypeError, no k an obscure np.stack error, and
    (N, K > N) "eigenvectors" were accepted and summed."""
    with pytest.raises(err, match="k|evecs"):
        top_k_reconstructions(evecs, np.ones(evecs.shape[0]), ks)


# ------------------------------------------------------------------ Fourier (App. G, Eq. 27)


@pytest.mark.parametrize("n0, n1", [(5, 7), (4, 6), (1, 3), (9, 2)])
def test_fourier_of_an_image_on_its_pixel_grid_is_numpy_fft2_over_n(n0, n1):
    """On X^k = (a/n0, b/n1), Eq. 27 at integer ξ is fft2(image)/N at (ξ0 mod n0, ξ1 mod n1):
    frequencies of np.fft.fftfreq(n, 1/n), centred by fftshift — odd and non-square images."""
    rng = np.random.default_rng(n0 * 10 + n1)
    a, b = np.meshgrid(np.arange(n0) / n0, np.arange(n1) / n1, indexing="ij")
    X = np.stack([a.ravel(), b.ravel()], axis=1)
    img = rng.standard_normal((n0, n1))
    want = np.fft.fftshift(np.fft.fft2(img) / img.size)
    f0, f1 = (np.fft.fftshift(np.fft.fftfreq(n, d=1 / n)) for n in (n0, n1))
    pts = np.stack(np.meshgrid(f0, f1, indexing="ij"), axis=-1).reshape(-1, 2)
    close("φ̂ direct", fourier_transform(img.ravel(), X, pts).reshape(n0, n1), want, atol=1e-13)
    grid = FrequencyGrid(pts, (n0, n1))
    close("φ̂ by axes", fourier_transform_grid(img.ravel(), X, grid).reshape(n0, n1), want, atol=1e-13)
    close("|φ̂| sign-free", np.abs(fourier_transform(-img.ravel(), X, pts)).reshape(n0, n1), np.abs(want), atol=1e-13)


def test_fourier_grid_equals_direct_sum_on_random_points_and_paper_grid():
    rng = np.random.default_rng(9)
    X, Phi = rng.random((50, 2)), rng.standard_normal((50, 2))
    grid = frequency_grid(40.0, 9, 2)
    ax = np.linspace(-40, 40, 9)
    assert grid.shape == (9, 9)
    close("grid points", grid.points, np.stack(np.meshgrid(ax, ax, indexing="ij"), -1).reshape(-1, 2), atol=0)
    E = np.exp(-2j * np.pi * grid.points @ X.T)  # (F, N)
    close("φ̂ (F, M)", fourier_transform(Phi, X, grid.points), E @ Phi / 50, atol=1e-13)
    close("φ̂ grid (F, M)", fourier_transform_grid(Phi, X, grid), E @ Phi / 50, atol=1e-13)
    x1 = rng.random((30, 1))
    close(
        "d = 1",
        fourier_transform(x1[:, 0] * 0 + 1, x1, [0.0, 2.5]),
        np.exp(-2j * np.pi * np.outer([0, 2.5], x1[:, 0])).mean(1),
    )


def test_fourier_grid_takes_torch_tensors_that_require_grad():
    """DEFECT: fourier_transform_grid called np.asarray on X first, so a torch X requiring grad
    (an eigenfunction's input straight from training) raised RuntimeError, while
    fourier_transform accepted it."""
    X = torch.rand(8, 2, dtype=torch.float64, requires_grad=True)
    phi = torch.rand(8, dtype=torch.float64, requires_grad=True)
    grid = frequency_grid(2.0, 5)
    want = np.exp(-2j * np.pi * grid.points @ X.detach().numpy().T) @ phi.detach().numpy() / 8
    close("φ̂ grid, torch", fourier_transform_grid(phi, X, grid), want, atol=1e-13)


# ------------------------------------------------------------------ NaN / inf: one clear error


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda b: spectral_projections(Q7, b), "phi"),
        (lambda b: spectrum_preservation(Q7, np.c_[b, b]), "evecs_t2"),
        (lambda b: kernel_target_alignment(np.outer(b, b), np.ones(N7)), "G"),
        (lambda b: first_order_update(G7, b, 0.1), "residual"),
        (lambda b: first_order_accuracy(b, np.ones(N7)), "df_real"),
        (lambda b: constant_gram_dynamics(LAM, Q7, b, np.zeros(N7), 0.1, 2), "f0"),
        (lambda b: nystrom_extension(np.outer(b, b), LAM[:5], Q7[:, :5]), "g_test"),
        (lambda b: top_k_reconstructions(Q7, b, (1,)), "phi"),
        (lambda b: fourier_transform(b, np.zeros((N7, 2)), [[1.0, 0.0]]), "phi"),
        (lambda b: stability_bound(b, N7), "evals_max"),
    ],
)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_inputs_raise_one_error_naming_the_input(call, name, bad):
    b = np.ones(N7)
    b[3] = bad
    with pytest.raises(NonFiniteError, match=name):
        call(b)


def test_per_step_rates_against_eigenvalues_over_time_are_not_aligned_with_k():
    """DEFECT: δ_t of shape (T,) against λ of shape (T, K) broadcast along the LAST axis: for
    T = K, δλ/N[t, k] was δ_k λ_tk / N without a word (at [1, 0]: 0.05·20/2 = 0.5 for a
    reference 0.1·20/2 = 1.0); now a ShapeError asks for lr[:, None]."""
    evals = np.array([[10.0, 5.0], [20.0, 10.0]])
    lr = np.array([0.05, 0.1])
    close("δ_t λ_tk / N", lr_eigen_product(evals, lr[:, None], 2), lr[:, None] * evals / 2)
    for fn in (lr_eigen_product, flow_speed):
        with pytest.raises(ShapeError, match="ambiguous"):
            fn(evals, lr, 2)


def test_energy_from_float32_projections_is_summed_in_float64():
    """DEFECT: a float32 P was squared and cumulated in float32: E(φ, k) off by 6.5e-7 (at
    k = 3957 of K = 4000) against the float64 sum of the same values (relative_energy sums in
    float64); a (K,) P or a torch P raised internal errors (AxisError / TypeError)."""
    rng = np.random.default_rng(0)
    P = (rng.standard_normal((4000, 1)) / 60).astype(np.float32)
    phi = P[:, 0].astype(np.float64)  # ‖φ‖ = ‖P‖ for a complete orthonormal basis
    want = np.cumsum(phi**2) / (phi @ phi)
    close("E from float32 P", energy_from_projections(P, phi), want, rtol=1e-12, atol=1e-13)
    close("E from (K,) P", energy_from_projections(P[:, 0], phi), want, rtol=1e-12, atol=1e-13)
    close(
        "E from torch P",
        energy_from_projections(torch.from_numpy(P), torch.from_numpy(phi)),
        want,
        rtol=1e-12,
        atol=1e-13,
    )
    assert np.isnan(energy_from_projections(P, np.zeros(4000))).all()  # undefined at φ = 0


def test_undefined_nan_marks_only_the_non_finite_columns():
    """DEFECT: with undefined="nan", one NaN in one column of a (N, M) φ made EVERY column's
    energy NaN; the finite column's E(φ, 1) = 1/3 was lost."""
    Phi = np.ones((3, 2))
    Phi[0, 1] = np.nan
    E = relative_energy(np.eye(3), Phi, undefined="nan")
    close("finite column", E[0], [1 / 3, 2 / 3, 1.0])
    assert np.isnan(E[1]).all()
    assert np.isnan(relative_energy(np.eye(3), Phi, undefined="nan", pooled=True)).all()
    assert np.isnan(relative_energy(np.eye(3), torch.tensor(Phi[:, 1]), 1, undefined="nan"))


def test_one_and_two_points():
    """N = 1 and N = 2, by hand: the scalar recursion m_{t+1} = (1 − δλ/N) m_t and its 2-D twin."""
    # N = 1: G = [λ], r = 1 − δλ
    lam, lr, f0, y = 3.0, 0.25, 2.0, 0.5
    out = constant_gram_dynamics([lam], [[-1.0]], [f0], [y], lr, [0, 1, 3])
    close("N=1 m̄_t", out.m[:, 0], [(f0 - y) * (1 - lr * lam) ** t for t in (0, 1, 3)])
    close("N=1 df̄", first_order_update([[lam]], [f0 - y], lr), [-lr * lam * (f0 - y)])
    assert kernel_target_alignment([[lam]], [y]) == pytest.approx(1.0)
    close("N=1 φ̂", fourier_transform([2.0], [[0.3]], [1.0]), [2.0 * np.exp(-2j * np.pi * 0.3)])
    # N = 2, float32 in → float32 out for the products, float64 for the energies
    V = (np.array([[1.0, 1.0], [1.0, -1.0]]) / np.sqrt(2)).astype(np.float32)
    G = (V @ np.diag([4.0, 1.0]) @ V.T).astype(np.float32)
    m = np.array([1.0, 3.0], np.float32)
    df = first_order_update(G, m, 0.5)
    assert df.dtype == np.float32
    close("N=2 df̄", df, -(0.5 / 2) * G.astype(np.float64) @ m, rtol=1e-6)
    ext = nystrom_extension(G, np.array([4.0, 1.0], np.float32), V)
    assert ext.dtype == np.float32
    close("N=2 ṽ", ext, V.astype(np.float64), atol=1e-6)
    o32 = constant_gram_dynamics(np.array([4.0, 1.0], np.float32), V, m, np.zeros(2, np.float32), 0.5, 2)
    assert o32.m.dtype == np.float32
    Gd = G.astype(np.float64)
    close("N=2 m̄_2", o32.m, (np.eye(2) - 0.25 * Gd) @ (np.eye(2) - 0.25 * Gd) @ m, rtol=1e-6)


def test_test_point_outputs_do_not_depend_on_the_basis_of_a_degenerate_eigenspace():
    rng = np.random.default_rng(10)
    U = np.linalg.qr(rng.standard_normal((6, 4)))[0]
    W = np.linalg.qr(rng.standard_normal((5, 4)))[0]
    J_train = U @ np.diag([3.0, 2.0, 2.0, 1.0]) @ W.T  # G = U diag(9, 4, 4, 1) Uᵀ, rank 4 of 6
    J_test = rng.standard_normal((3, 5))
    G, g = J_train @ J_train.T, J_test @ J_train.T
    f0, y, f0t = rng.standard_normal(6), rng.standard_normal(6), rng.standard_normal(3)
    lam, lrs = np.array([9.0, 4.0, 4.0, 1.0]), [0.5, 0.5, 0.5]
    m, ft = f0 - y, f0t.copy()
    for d in lrs:
        ft, m = ft - (d / 6) * g @ m, m - (d / 6) * G @ m
    dec = constant_gram_decays(lam, lrs, [3], 6)
    for seed in range(3):
        R = np.linalg.qr(np.random.default_rng(seed).standard_normal((2, 2)))[0]
        V = U.copy()
        V[:, 1:3] = V[:, 1:3] @ R
        V *= np.random.default_rng(seed).choice([-1.0, 1.0], 4)
        out = constant_gram_test_outputs(nystrom_extension(g, lam, V), V.T @ (f0 - y), f0t, dec)
        close(f"f_t(X') basis {seed}", out[0], ft)


def test_preservation_names_a_zero_eigenvector_of_t2():
    """DEFECT (message): a zero column of evecs_t2 (an eigenvector not computed, stored as 0) was
    reported as "phi has zero norm (columns [2])", an argument the caller never passed and a
    0-based index for a 1-based eigenvector number."""
    V2 = np.eye(3)
    V2[:, 2] = 0.0
    for i in (None, 3, [1, 3]):
        with pytest.raises(NonFiniteError, match=r"evecs_t2 has zero columns \(eigenvector numbers \[3\]"):
            spectrum_preservation(np.eye(3), V2, i)
    close("i=1 still fine", spectrum_preservation(np.eye(3), V2, 1), [1.0, 1.0, 1.0])


def test_complete_basis_residual_ignores_the_rounding_of_the_squared_norm():
    """With K = N the part outside the eigenvectors is 0, but m0_sq − Σ p_i is rounding (5e-8 when
    ‖m̄‖² comes from float32-stored outputs, as the pipeline's writer does): held fixed, it floored
    the predicted ‖m̄_100‖ at 2.3e-4 for a GD reference 1.8e-10.  ``complete=True`` drops it."""
    rng = np.random.default_rng(0)
    Q = np.linalg.qr(rng.standard_normal((5, 5)))[0]
    lam = np.array([5.0, 4.0, 3.0, 2.0, 1.0])
    G = Q @ np.diag(lam) @ Q.T
    f0, y = rng.standard_normal(5), rng.standard_normal(5)
    ref = gd_iterate(G, f0, y, [1.0] * 100)[100][1]
    m0_32 = f0.astype(np.float32) - y
    p = (Q.T @ (f0 - y)) ** 2
    dec = constant_gram_log_decays(lam, [1.0] * 100, [100], 5)
    res = constant_gram_residual(lam, p, float(m0_32 @ m0_32), dec, complete=True)
    # the float64 GD reference itself carries ~1e-16·‖m̄_0‖ of rounding: 4e-7 relative at 1.8e-10
    close("‖m̄_100‖, K = N", res.norm, [np.linalg.norm(ref)], rtol=1e-5, atol=0)
    close("E(m̄_100, k), K = N", res.energy[0], np.cumsum((Q.T @ ref) ** 2) / (ref @ ref), rtol=1e-5, atol=1e-5)
    no = constant_gram_residual(lam, p, float(m0_32 @ m0_32), dec)  # the documented default keeps it
    assert no.norm[0] > 1e-5, f"the rounding rest no longer floors the norm: {no.norm[0]:.3e}"
