"""Float32 products for a float32 Gram held to float64 accuracy (nsa_dist/linalg/_deflated.py, issue 22).

The route must give what the float64 products give, within the solver's tolerance, checked here
against float64 products of the same float32 matrix; and it must hand over to them wherever it
cannot prove itself (a spectrum with nothing to deflate, a failed check after the solve).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import nsa_dist.linalg._deflated as deflated
from nsa_dist.linalg import top_eigenpairs
from nsa_dist.linalg._deflated import DeflatedGram, deflation_applies

N = deflated.MIN_N
K = deflated.MIN_K
TOL = 1e-10


def _kernel_gram(n: int, seed: int = 0) -> torch.Tensor:
    """A float32 Gram of n points in [−1, 1]² under a constant plus a Matérn-3/2 kernel: its
    spectrum decays like the paper's NTK's (one large eigenvalue, then polynomially, ~i^−2.5)."""
    x = torch.from_numpy(np.random.default_rng(seed).uniform(-1, 1, (n, 2)))
    r = 3**0.5 * torch.cdist(x, x) / 1.0  # length scale 1: the float32 rest errs ~30× under tol/2
    G = 50.0 * (0.5 + (1 + r) * torch.exp(-r))  # float64
    # cdist's matmul route is not exactly symmetric (and not always the same across runs); one ulp
    # of float64 asymmetry became one float32 ulp after rounding, which the float64 reference
    # route rejects (1e-7 of max |G| > its 1.5e-8): made exactly symmetric before rounding
    return ((G + G.T) / 2).float()


@pytest.fixture(scope="module")
def gram() -> torch.Tensor:
    return _kernel_gram(N)


def test_deflated_products_equal_float64_ones(gram):
    G64 = gram.double()
    D = DeflatedGram(gram, seed=0)
    X = torch.linalg.qr(torch.randn(N, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))).Q
    exact = G64 @ X
    assert torch.equal(D.exact(X), exact) or float((D.exact(X) - exact).abs().max()) < 1e-9 * float(exact.abs().max())
    err = float(torch.linalg.vector_norm(D.matmat(X) - exact, dim=0).max())
    plain = float(torch.linalg.vector_norm((gram @ X.float()).double() - exact, dim=0).max())
    assert err < 0.1 * plain, f"deflated float32 products err {err:.2e}, plain float32 ones {plain:.2e}"
    assert err <= D.predicted_error, f"product error {err:.2e} above the predicted bound {D.predicted_error:.2e}"
    assert D.rest_fro < 0.05 * float(torch.linalg.vector_norm(G64)), "U S Uᵀ took out little of G"


def test_top_k_equals_float64_products_within_tolerance(gram):
    fast = top_eigenpairs(gram, K, tol=TOL)
    assert fast.products == "deflated-float32"
    ref = top_eigenpairs(gram.double(), K, tol=TOL)  # the float64 products of the same matrix
    assert ref.products == "float64"
    lam1 = ref.evals[0]
    d_eval = np.abs(fast.evals - ref.evals).max() / lam1
    V = torch.from_numpy(fast.evecs)
    true = torch.linalg.vector_norm(gram.double() @ V - V * torch.from_numpy(fast.evals), dim=0).numpy()
    orth = np.abs(fast.evecs.T @ fast.evecs - np.eye(K)).max()
    assert d_eval <= 2 * TOL, f"eigenvalues differ by {d_eval:.2e}·λ₁ from the float64 route's"
    dense = torch.linalg.eigvalsh(gram.double()).numpy()[::-1][:K]  # LAPACK, the dense reference
    d_dense = np.abs(fast.evals - dense).max() / lam1
    assert d_dense <= TOL, f"eigenvalues differ by {d_dense:.2e}·λ₁ from dense float64 eigvalsh"
    assert true.max() <= TOL * lam1, f"true residual {true.max() / lam1:.2e}·λ₁ > tol {TOL:.0e} (every vector)"
    # a bound up to the rounding of a residual itself (√N·eps₆₄·λ₁: a sampled vector reports its
    # true residual, whose product here runs in another GEMM order)
    slack = np.sqrt(gram.shape[0]) * np.finfo(np.float64).eps * lam1
    assert fast.max_residual >= true.max() - slack, (
        f"reported {fast.max_residual:.3e} is not a bound of {true.max():.3e} (allowed rounding {slack:.1e})"
    )
    assert orth < 1e-12, f"‖VᵀV − I‖_max = {orth:.2e}"
    cos = np.abs((fast.evecs * ref.evecs).sum(axis=0))[:50]
    assert cos.min() > 1 - 1e-8, f"a top-50 eigenvector moved: min |cos| = {cos.min():.12f}"


def _flat_gram(seed: int) -> torch.Tensor:
    """Float32, 300 eigenvalues of 4e5…4e6 over a Wigner bulk: the top 256 are well separated (Lanczos
    is quick) but 64 directions leave ‖G − U S Uᵀ‖_F ≈ ‖G‖_F / 2, far too much to round to float32."""
    g = torch.Generator().manual_seed(seed)
    L = torch.randn(N, 300, generator=g, dtype=torch.float64) * torch.linspace(30, 10, 300, dtype=torch.float64)
    A = torch.randn(N, N, generator=g, dtype=torch.float64)
    return (L @ L.T + (A + A.T) / 2).float()


def _true_residual(G: torch.Tensor, out) -> float:
    V = torch.from_numpy(out.evecs)
    return torch.linalg.vector_norm(G.double() @ V - V * torch.from_numpy(out.evals), dim=0).max().item()


def test_a_flat_spectrum_hands_over_before_solving(caplog):
    G = _flat_gram(2)
    with caplog.at_level(logging.INFO, logger="nsa_dist.linalg._deflated"):
        out = top_eigenpairs(G, K, tol=TOL)
    assert out.products == "float64"
    assert "not tried" in caplog.text
    assert _true_residual(G, out) <= TOL * out.evals[0]


def test_a_failed_check_hands_over_after_solving(monkeypatch, caplog):
    G = _flat_gram(3)
    monkeypatch.setattr(deflated, "_ERR_PER_FRO", 0.0)  # let the a-priori gate pass: only the sample can refuse
    with caplog.at_level(logging.INFO, logger="nsa_dist.linalg._deflated"):
        out = top_eigenpairs(G, K, tol=TOL)
    assert out.products == "float64", "float32 products of a flat spectrum passed a float64 check"
    assert "failed their check" in caplog.text
    assert _true_residual(G, out) <= TOL * out.evals[0]


def test_where_the_route_applies(gram):
    assert deflation_applies(gram, K, "auto") and deflation_applies(gram.numpy(), K, "torch")
    assert not deflation_applies(gram, K - 1, "auto")  # too few eigenpairs for the set-up
    assert not deflation_applies(gram.double(), K, "auto")  # already float64
    assert not deflation_applies(gram, K, "numpy")  # the caller chose NumPy's products
    assert not deflation_applies(gram[: N - 1, : N - 1], K, "auto")  # too small
    small = top_eigenpairs(_kernel_gram(600), 100)
    assert small.products == "float64"


def test_a_workspace_is_reused_and_changes_nothing(gram):
    """A HostWorkspace hands the same buffers to the next solve of the same size (no fresh pages),
    and a solve in it returns what a solve in fresh memory returns; results are not views of it."""
    from nsa_dist.linalg import HostWorkspace

    ws = HostWorkspace()
    a = top_eigenpairs(gram, K, tol=TOL, workspace=ws)
    held = {name: buf.data_ptr() for name, buf in ws._buffers.items()}
    assert {"deflated.rest", "lanczos.V", "lanczos.AV"} <= set(held), sorted(held)
    b = top_eigenpairs(gram, K, tol=TOL, workspace=ws)
    assert {name: buf.data_ptr() for name, buf in ws._buffers.items()} == held, "the buffers were reallocated"
    fresh = top_eigenpairs(gram, K, tol=TOL)
    for out in (a, b):
        np.testing.assert_array_equal(out.evals, fresh.evals)
        np.testing.assert_array_equal(out.evecs, fresh.evecs)
    small = top_eigenpairs(_kernel_gram(N // 2 + 1000), K, tol=TOL, workspace=ws)  # another size: reallocated
    assert ws._buffers["lanczos.V"].shape[0] == N // 2 + 1000 and small.products == "float64"
    ws.clear()
    assert ws.nbytes == 0


def test_views_and_tensors_that_track_gradients_are_taken(gram):
    """A reversed NumPy view (negative strides), a read-only array and a tensor that requires
    grad are valid inputs: each gives the same top-k as the plain tensor, on both routes."""
    plain = top_eigenpairs(gram, K, tol=TOL)
    arr = gram.numpy()
    rev = arr[::-1, ::-1]  # symmetric too: the same spectrum, eigenvectors reversed
    ro = arr.copy()
    ro.flags.writeable = False
    for G, flip in ((rev, True), (ro, False), (gram.clone().requires_grad_(), False)):
        out = top_eigenpairs(G, K, tol=TOL)
        assert out.products == "deflated-float32"
        assert np.abs(out.evals - plain.evals).max() <= 2 * TOL * plain.evals[0]
        small = top_eigenpairs(
            G[:3000, :3000] if not flip else np.ascontiguousarray(arr[:3000, :3000])[::-1, ::-1], 20, tol=TOL
        )  # the float64 route (N < 4096)
        assert small.products == "float64" and np.isfinite(small.evals).all()
