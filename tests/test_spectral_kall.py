"""Issue 22: ``k: all`` at a step that stores no eigenvectors — every eigenvalue and ⟨v_i, φ⟩ from one
tridiagonalisation — stores what the full eigh stores; the tridiagonal route against float64 eigh."""

from __future__ import annotations

import numpy as np
import pytest

from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.errors import ShapeError
from nsa_dist.linalg.tridiag import eig_projections
from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run


def _spec(store: bool, **spectrum) -> ExperimentSpec:
    return ExperimentSpec.model_validate(
        {
            "name": "kall",
            "seed": 0,
            "data": {"name": "image2d", "n": 150, "n_test": 60},
            "model": {"depth": 2, "width": 128},
            "steps": 3,
            "record": {"steps": [0, 2]},
            "spectrum": {
                "k": "all",
                "dtype": "float64",
                "test_points": True,
                "store_eigenvectors": store,
                "images": [1, 2, 10],
                "image_size": 8,
                "fourier_size": 5,
                **spectrum,
            },
        }
    )


@pytest.fixture(scope="module")
def two_routes() -> tuple[dict, dict, SpectralAnalyzer]:
    full, proj = _spec(True), _spec(False)
    data = load_dataset(full.data, seed=0)
    # index 1: no App. E prediction, so no vectors needed
    ck = list(Trainer(plan_run(full, data), data).train_until(3))[-1]
    an = SpectralAnalyzer(plan_run(proj, data), data)
    ref = SpectralAnalyzer(plan_run(full, data), data)
    assert an.route.value == "auto"  # the tridiagonal routes on by default (MKL ?syrdb: faster than eigh)
    want, got = ref.analyze(ck).arrays(), an.analyze(ck).arrays()
    assert ref.eig_route == {"train": "eigenpairs", "test": "one_vector"}  # stored vectors need eigh
    return want, got, an, ck


def test_k_all_without_vectors_stores_what_eigh_stores(two_routes) -> None:
    want, got, an, _ = two_routes
    assert an.eig_route == {"train": "tridiagonal", "test": "one_vector"}
    assert "eigenvectors" in want and "eigenvectors" not in got
    for key in sorted(set(got) - {"loss", "lr", "step_notes"}):
        a, b = np.asarray(got[key], np.float64), np.asarray(want[key], np.float64)
        assert a.shape == b.shape, f"{key}: shape {a.shape} vs {b.shape}"
        scale = max(float(np.nanmax(np.abs(b))), 1e-300) if b.size else 1.0
        err = float(np.nanmax(np.abs(a - b))) / scale if b.size else 0.0
        tol = 1e-5 if key.startswith(("eigvec_", "residual_")) else 1e-9  # images: interpolated float32
        assert err <= tol, f"{key}: max |Δ| = {err:.2e} of max |value| (allowed {tol:g})"


def test_float32_k_all_within_the_float32_grams_own_rounding() -> None:
    """A float32 Gram is reduced in float32: its stored spectrum may differ from the float64 eigh of
    the same G by float32 rounding — key by key within 10·N·eps₃₂ of the key's scale, or within
    twice what the float32 rounding of G itself does to that eigh (the float64 Gram's: clustered
    small eigenvalues make ⟨v_i, φ⟩² ill-conditioned for both); the eigenvalues within 50·N·eps₃₂·λ_1."""
    spec32, spec64 = _spec(False, dtype="float32"), _spec(False)
    data = load_dataset(spec32.data, seed=0)
    ck = list(Trainer(plan_run(spec32, data), data).train_until(3))[-1]
    an = SpectralAnalyzer(plan_run(spec32, data), data)
    got = an.analyze(ck).arrays()
    assert an.eig_route == {"train": "tridiagonal", "test": "one_vector"}
    eigh32 = SpectralAnalyzer(plan_run(spec32, data), data, route="eigenpairs").analyze(ck).arrays()
    eigh64 = SpectralAnalyzer(plan_run(spec64, data), data, route="eigenpairs").analyze(ck).arrays()
    lam1 = float(eigh32["eigenvalues"][0])
    dlam = np.abs(got["eigenvalues"] - eigh32["eigenvalues"]).max()
    assert dlam <= 50 * 150 * np.finfo(np.float32).eps * lam1, f"eigenvalues off by {dlam / lam1:.1e}·λ_1"
    for key in (
        "eigenvalues",
        "eigenvalues_test",
        "energy_y",
        "energy_f",
        "energy_residual",
        "energy_df",
        "energy_f_test",
        "projections_residual",
    ):
        ours = float(np.nanmax(np.abs(np.asarray(got[key], np.float64) - eigh32[key])))
        rounding = float(np.nanmax(np.abs(np.asarray(eigh64[key], np.float64) - eigh32[key])))
        float32_level = 10 * 150 * np.finfo(np.float32).eps * float(np.nanmax(np.abs(eigh32[key])))
        assert ours <= max(2 * rounding, float32_level), (
            f"{key}: float32 route off by {ours:.1e}; the float32 Gram's rounding {rounding:.1e}, "
            f"10·N·eps₃₂ {float32_level:.1e}"
        )


def test_one_vector_test_half_stores_what_the_q_route_stores(two_routes) -> None:
    """The test half (one φ = f_test, no Q) against the route it replaces (Q formed, ψ = Qᵀφ) and against
    float64 eigh with vectors, on the same test Gram: eigenvalues_test and energy_f_test to 1e-9."""
    from nsa_dist.linalg import top_eigenpairs
    from nsa_dist.metrics import energy_from_projections

    _, got, an, ck = two_routes
    G_t = an._gram(an.X_test)  # (M, M) float64, as the analyzer's
    q = eig_projections(G_t, ck.f_test)
    assert not q.one_vector
    eig = top_eigenpairs(G_t, "all")
    for name, evals, E in (
        ("Q route", q.evals, energy_from_projections(q.proj, ck.f_test)),
        ("eigh", eig.evals, energy_from_projections(eig.evecs.T @ ck.f_test.reshape(-1, 1), ck.f_test)),
    ):
        for key, ref in (("eigenvalues_test", evals), ("energy_f_test", E)):
            err = float(np.abs(got[key] - ref).max()) / float(np.abs(ref).max())
            assert err <= 1e-9, f"{key}: max |Δ| = {err:.2e} of max |value| against the {name}"


def test_eig_projections_against_eigh() -> None:
    rng = np.random.default_rng(0)
    A = rng.standard_normal((200, 40))
    G = A @ A.T + np.diag(np.linspace(0, 1, 200))  # distinct eigenvalues
    Phi = rng.standard_normal((200, 3))
    sp = eig_projections(G, Phi, indices=(0, 7, 199))
    w, V = np.linalg.eigh(G)
    w, V = w[::-1], V[:, ::-1]
    np.testing.assert_allclose(sp.evals, w, rtol=0, atol=1e-12 * w[0])
    np.testing.assert_allclose(np.abs(sp.proj), np.abs(V.T @ Phi), rtol=0, atol=1e-9 * np.abs(Phi).max())
    np.testing.assert_allclose(np.abs(sp.vectors), np.abs(V[:, [0, 7, 199]]), rtol=0, atol=1e-9)
    big = np.abs(sp.vectors).argmax(axis=0)
    assert (sp.vectors[big, np.arange(3)] > 0).all()


def test_eig_projections_bad_input_named() -> None:
    with pytest.raises(ShapeError, match=r"Phi must be \(N,\) or \(N, c\) with N = 5"):
        eig_projections(np.eye(5), np.ones((4, 2)))
    with pytest.raises(ValueError, match=r"indices must lie in 0..4"):
        eig_projections(np.eye(5), np.ones(5), indices=(5,))


def test_only_one_phi_column_skips_q(two_routes) -> None:
    """Several φ columns (a multi-output f_test) keep the Q route; one column takes the one-vector
    route, the same eigenvalues and energies (float64)."""
    from nsa_dist.pipeline.layout import DenseGram

    _, _, an, ck = two_routes
    G = DenseGram(an._gram(an.X_test))
    M = G.shape[0]
    F = np.column_stack([ck.f_test, np.linspace(-1, 1, M)])  # (M, 2)
    two = an._spectrum(G, M, "test", {"f_test": F}, False)
    assert an.eig_route["test"] == "tridiagonal" and two.proj["f_test"].shape == (M, 2)
    one = an._spectrum(G, M, "test", {"f_test": F[:, :1]}, False)
    assert an.eig_route["test"] == "one_vector" and one.proj["f_test"].shape == (M, 1)
    np.testing.assert_allclose(one.evals, two.evals, rtol=0, atol=1e-12 * two.evals[0])
    np.testing.assert_allclose(
        np.cumsum(one.proj["f_test"][:, 0] ** 2),
        np.cumsum(two.proj["f_test"][:, 0] ** 2),
        rtol=0,
        atol=1e-10 * float(F[:, 0] @ F[:, 0]),
    )


def test_app_e_cross_kernel_in_the_test_grams_buffer_changes_nothing() -> None:
    """App. E's g(X_test, 𝒳) V at t0 is assembled whole in the test Gram's workspace buffer when
    the step has test Grams (M ≠ N here: the buffer is reshaped for it, then for the test Gram),
    in transient blocks of rows otherwise (no buffer held for nothing); the prediction is the same."""
    import torch

    with_test, without = _spec(False), _spec(False, test_points=False)
    data = load_dataset(with_test.data, seed=0)
    ck = next(iter(Trainer(plan_run(with_test, data), data).train_until(1)))  # index 0: App. E
    a, b = SpectralAnalyzer(plan_run(with_test, data), data), SpectralAnalyzer(plan_run(without, data), data)
    assert a.plan.has("constant_gram_f_test") and b.plan.has("constant_gram_f_test")
    seen = []
    cross = a._cross_buffer
    a._cross_buffer = lambda: seen.append(cross()) or seen[-1]  # the buffer App. E was handed
    got, want = a.analyze(ck).arrays(), b.analyze(ck).arrays()
    assert len(seen) == 1 and isinstance(seen[0], torch.Tensor) and tuple(seen[0].shape) == (60, 150)
    assert b._cross_buffer() is None
    held = a._workspace.nbytes - b._workspace.nbytes
    assert held == 60 * 60 * 8, (
        f"{held} bytes more: the test Gram's (M, M) float64 only, not also the (M, N) cross kernel"
    )
    np.testing.assert_allclose(got["constant_gram_f_test"], want["constant_gram_f_test"], rtol=1e-12, atol=1e-14)
