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
    return ExperimentSpec.model_validate({
        "name": "kall", "seed": 0, "data": {"name": "image2d", "n": 150, "n_test": 60},
        "model": {"depth": 2, "width": 128}, "steps": 3, "record": {"steps": [0, 2]},
        "spectrum": {"k": "all", "dtype": "float64", "test_points": True, "store_eigenvectors": store,
                     "images": [1, 2, 10], "image_size": 8, "fourier_size": 5, **spectrum}})


@pytest.fixture(scope="module")
def two_routes() -> tuple[dict, dict, SpectralAnalyzer]:
    import nsa_dist.pipeline.spectral as spectral_mod

    full, proj = _spec(True), _spec(False)
    data = load_dataset(full.data, seed=0)
    ck = list(Trainer(plan_run(full, data), data).train_until(3))[-1]  # index 1: no App. E prediction, so no vectors needed
    an = SpectralAnalyzer(plan_run(proj, data), data)
    assert not spectral_mod.TRIDIAGONAL_K_ALL  # off by default (slower than eigh at N = 10⁴ here)
    spectral_mod.TRIDIAGONAL_K_ALL = True
    try:
        return SpectralAnalyzer(plan_run(full, data), data).analyze(ck).arrays(), an.analyze(ck).arrays(), an
    finally:
        spectral_mod.TRIDIAGONAL_K_ALL = False


def test_k_all_without_vectors_stores_what_eigh_stores(two_routes) -> None:
    want, got, an = two_routes
    assert an.n_products == {"train": 0, "test": 0}  # the tridiagonal route ran for both Grams
    assert "eigenvectors" in want and "eigenvectors" not in got
    for key in sorted(set(got) - {"loss", "lr"}):
        a, b = np.asarray(got[key], np.float64), np.asarray(want[key], np.float64)
        assert a.shape == b.shape, f"{key}: shape {a.shape} vs {b.shape}"
        scale = max(float(np.nanmax(np.abs(b))), 1e-300) if b.size else 1.0
        err = float(np.nanmax(np.abs(a - b))) / scale if b.size else 0.0
        tol = 1e-5 if key.startswith(("eigvec_", "residual_")) else 1e-9  # images: interpolated float32
        assert err <= tol, f"{key}: max |Δ| = {err:.2e} of max |value| (allowed {tol:g})"


def test_eig_projections_against_eigh() -> None:
    rng = np.random.default_rng(0)
    A = rng.standard_normal((200, 40))
    G = A @ A.T + np.diag(np.linspace(0, 1, 200))  # distinct eigenvalues
    Phi = rng.standard_normal((200, 3))
    sp = eig_projections(G, Phi, indices=(0, 7, 199), chunk=37)
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
