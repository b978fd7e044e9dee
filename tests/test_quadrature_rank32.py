"""The quadrature brackets of a rank-deficient Gram stored in float32 (the pipeline's ``spectrum.dtype:
float32``): beyond G's rank the exact route's eigenvalues are float32 rounding of either sign and its
eigenvectors an arbitrary basis of the numerical null space, so E(φ, k) there can be anything from
E(φ, r) to 1.  The brackets must contain what the exact route returns for the same stored G — the
pipeline's float32 route (``from_tridiagonal``: the reduction in float32) and a float64 ``eigh`` of the
float32 matrix — at every k of a log grid and around the rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_quadrature_rank import K, N, _case

from nsa_dist.linalg.quadrature import curve_ks, spectral_curves
from nsa_dist.linalg.spectrum import from_tridiagonal


@pytest.fixture(scope="module")
def case32() -> dict:
    c = _case(2, 16, N)  # P = 65 < K < N: the top K reaches into the numerical null space
    G32 = c["G"].to(torch.float32)
    w64, V64 = np.linalg.eigh(G32.double().numpy())
    c.update(G32=G32, w64=w64[::-1].copy(), V64=V64[:, ::-1].copy())
    c["tri"] = from_tridiagonal(G32, N, c["phis"], ())  # the exact route of a float32 run
    return c


@pytest.mark.parametrize(
    "phi_steps", [None, pytest.param(0, marks=pytest.mark.slow)], ids=["shared-blocks", "phi-own-block"]
)
def test_float32_brackets_contain_the_float32_exact_routes(case32, phi_steps):
    c = case32
    G32, phis = c["G32"], c["phis"]
    w64, V64, tri = c["w64"], c["V64"], c["tri"]
    fro = float(np.linalg.norm(G32.double().numpy()))
    # G's numerical rank in float32: eigenvalues above the float32 route's rounding (≈ eps₃₂·‖G‖_F;
    # its null space comes out at ±1.2·eps₃₂·λ_1), whose eigenvectors it orders arbitrarily
    r = int((w64 > 8 * np.finfo(np.float32).eps * fro).sum())
    assert 0 < r <= c["bound"], f"numerical rank {r} not in 1 … {c['bound']}"
    ks = np.unique(np.concatenate([curve_ks(N, 60), np.arange(max(1, r - 4), min(N, r + 6))]))
    # the top K as a top-k solve of the float32 run has them: from the float64 eigh of the stored G
    q = spectral_curves(
        G32, w64[:K], V64[:, :K], phis, ks, lanczos_steps=30, probes=16, block_size=16, phi_steps=phi_steps
    )
    e = q.eigenvalue
    # the top K are exact up to the rounding of the solver that gave them: the float32 route's top
    # eigenvalues differ from the float64 eigh's by ~eps₃₂·‖G‖ (λ_1: 3.8e-4 of 5,202)
    for route, lam, tol in (
        ("float64 eigh", w64[ks - 1], 0.0),
        ("float32 tridiagonal", tri.evals[ks - 1], 4 * np.finfo(np.float32).eps * fro),
    ):
        out = (lam < e.lower - tol * (ks <= K)) | (lam > e.upper + tol * (ks <= K))
        assert not out.any(), (
            f"{route}: λ_k outside its bracket at k = {ks[out]}: {e.lower[out]} ≤ {lam[out]} ≤ {e.upper[out]}?"
        )
    assert (tri.evals[ks[ks > r] - 1] < 0).any() or (w64[ks[ks > r] - 1] < 0).any(), "no rounded null eigenvalue"
    beyond = (ks > r) & (ks < N)
    for name, phi in phis.items():
        n2 = np.sum(phi**2)
        b = q.energy[name]
        exact = {
            "float64 eigh": np.cumsum((V64.T @ phi) ** 2) / n2,
            "float32 tridiagonal": np.cumsum(np.sum(tri.proj[name] ** 2, axis=1)) / n2,
        }
        for route, Ex in exact.items():
            x = Ex[ks - 1]
            # the float32 route's own rounding: its projections are float32, and E(k) sums k of their
            # squares (a recursive sum errs by up to (k − 1)·eps·Σ); the float64 eigh is held to 1e-6
            tol = np.maximum(1e-6, ks * np.finfo(np.float32).eps * x) if "float32" in route else 1e-6
            out = (x < b.lower - tol) | (x > b.upper + tol)
            assert not out.any(), (
                f"{route}: E({name}, k) outside its bracket at k = {ks[out]} (r = {r}): lower "
                f"{b.lower[out]}, exact {x[out]}, upper {b.upper[out]}"
            )
        # any basis of the numerical null space, in any order: E(r) … 1 beyond the rank
        Er = exact["float64 eigh"][r - 1]
        ok = (b.lower[beyond] <= Er + 1e-6) & (b.upper[beyond] >= 1.0 - 1e-6)
        assert ok.all(), (
            f"E({name}, k) for r = {r} < k < N must allow [E(r), 1] = [{Er:.4f}, 1]; at k = {ks[beyond][~ok]} "
            f"the bracket is {b.lower[beyond][~ok]} … {b.upper[beyond][~ok]}"
        )
        assert np.all(b.lower <= b.value) and np.all(b.value <= b.upper)
