"""Issue 22: every eigenvalue and ⟨v_i, φ⟩ from one tridiagonalisation — both reductions (MKL ``?syrdb``
through torch, SciPy ``?sytrd``) in float64 and float32 against dense float64 ``numpy.linalg.eigh``,
and the probe that decides whether the MKL route may run."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import scipy.linalg.lapack as lapack

from nsa_dist.linalg._mkl_syrdb import probe_syrdb, reduction_errors, syrdb_ready
from nsa_dist.linalg.tridiag import Reduction, eig_projections

N = 240


def _mkl_or_skip(dtype: type) -> None:
    if not syrdb_ready(np.dtype(dtype)):
        pytest.skip("this torch build has no usable MKL ?syrdb (the LAPACK route is tested below)")


@pytest.fixture(scope="module")
def problem() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """G (N, N) with a geometric spectrum (gaps ≥ 2 % of λ: every eigenvector well conditioned), Φ (N, 3),
    and float64 eigh's λ (descending) and V."""
    rng = np.random.default_rng(5)
    U, _ = np.linalg.qr(rng.standard_normal((N, N)))
    G = (U * np.geomspace(1e3, 1, N)) @ U.T
    G = (G + G.T) / 2
    Phi = rng.standard_normal((N, 3))
    w, V = np.linalg.eigh(G)
    return G, Phi, w[::-1].copy(), V[:, ::-1].copy()


@pytest.mark.parametrize("route", [Reduction.MKL, Reduction.LAPACK])
@pytest.mark.parametrize("dtype, rel", [(np.float64, 1e-10), (np.float32, 2e-4)])
def test_both_routes_against_dense_eigh(problem, route: Reduction, dtype: type, rel: float) -> None:
    if route is Reduction.MKL:
        _mkl_or_skip(dtype)
    G, Phi, w, V = problem
    idx = (0, 7, N - 1)
    sp = eig_projections(G.astype(dtype), Phi, indices=idx, reduction=route)
    assert sp.reduction is route
    P = V.T @ Phi  # (N, 3)
    dw = np.abs(sp.evals - w) / w  # relative: the spectrum spans 10³
    assert dw.max() <= rel, f"eigenvalue {dw.argmax()} off by {dw.max():.1e} relative"
    # ⟨v_i, φ⟩ up to v_i's sign, in units of ‖φ‖ (eigenvectors with gaps ≥ 2 %: error ~ eps·κ / gap)
    dP = np.abs(np.abs(sp.proj) - np.abs(P)).max(axis=0) / np.linalg.norm(Phi, axis=0)
    assert dP.max() <= 50 * rel, f"projections off by {dP} of ‖φ‖"
    dV = np.abs(np.abs(sp.vectors) - np.abs(V[:, list(idx)])).max(axis=0)
    assert dV.max() <= 50 * rel, f"eigenvectors {idx} off by {dV}"
    big = np.abs(sp.vectors).argmax(axis=0)
    assert (sp.vectors[big, np.arange(len(idx))] > 0).all()
    assert sp.proj.dtype == np.float64 and sp.evals.dtype == np.float64


def test_auto_takes_mkl_where_the_probe_passed(problem) -> None:
    _mkl_or_skip(np.float32)
    G, Phi, *_ = problem
    assert eig_projections(G.astype(np.float32), Phi[:, 0]).reduction is Reduction.MKL


def test_torch_input_left_alone(problem) -> None:
    import torch

    G, Phi, w, _ = problem
    Gt = torch.from_numpy(G.copy())
    sp = eig_projections(Gt, Phi)
    assert torch.equal(Gt, torch.from_numpy(G))  # the reduction ran on a copy
    np.testing.assert_allclose(sp.evals, w, rtol=1e-10)


def test_probe_passes_here_and_says_so_once_when_it_fails(caplog) -> None:
    """The probe on this machine's torch (MKL on x86-64 wheels) passes in both precisions; a
    failing one is tested through :func:`reduction_errors` below (a wrong binding cannot be
    called safely: MKL writes past a wrongly sized workspace)."""
    _mkl_or_skip(np.float32)
    with caplog.at_level(logging.WARNING, logger="nsa_dist.linalg._mkl_syrdb"):
        assert probe_syrdb(np.dtype(np.float32)) and probe_syrdb(np.dtype(np.float64))
    assert not caplog.records


def test_reduction_errors_see_a_wrong_reduction() -> None:
    rng = np.random.default_rng(1)
    A = rng.standard_normal((30, 30))
    A = A + A.T
    c, d, e, tau, _ = lapack.dsytrd(A.copy(order="F"), lower=1)
    Q = lapack.dorgqr(c[1:, :29], tau[:29])[0]  # the reflectors below the diagonal, as ?orgtr('L')
    Q = np.block([[np.ones((1, 1)), np.zeros((1, 29))], [np.zeros((29, 1)), Q]])
    good = reduction_errors(A, Q, d, e)
    assert max(good.values()) < 1e-12 * np.abs(A).max() * 30
    bad = reduction_errors(A, Q, d + 1e-6, e)
    assert all(v > 1e-7 for k, v in bad.items() if k != "|Q'Q - I|·|A|"), bad
    assert reduction_errors(A, Q, d * np.nan, e)["|λ(T) - λ(A)|"] == float("inf")


def test_bad_input_named() -> None:
    from nsa_dist.errors import ShapeError

    with pytest.raises(ShapeError, match=r"Phi must be \(N,\) or \(N, c\) with N = 5"):
        eig_projections(np.eye(5), np.ones((4, 2)))
    with pytest.raises(ValueError, match=r"indices must lie in 0..4"):
        eig_projections(np.eye(5), np.ones(5), indices=(5,))
    with pytest.raises(ValueError, match=r"reduction='qr' is not one of 'auto', 'mkl', 'lapack'"):
        eig_projections(np.eye(5), np.ones(5), reduction="qr")


@pytest.mark.parametrize("n", [1, 3, 10, 60, 129])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_small_and_band_wide_sizes(n: int, dtype: type) -> None:
    """Sizes where a band as wide as G would make MKL return T without Q (kd ≥ N − 1): the band is
    clipped to N/4, and below MIN_N the LAPACK route runs."""
    rng = np.random.default_rng(n)
    X = rng.standard_normal((n, n))
    G = X @ X.T + n * np.eye(n)  # (n, n), well conditioned
    Phi = rng.standard_normal((n, 2))
    w, V = np.linalg.eigh(G)
    sp = eig_projections(G.astype(dtype), Phi)
    eps = float(np.finfo(dtype).eps)
    np.testing.assert_allclose(sp.evals, w[::-1], rtol=0, atol=100 * n * eps * w[-1])
    E, E_ref = np.cumsum(sp.proj**2, 0), np.cumsum((V[:, ::-1].T @ Phi) ** 2, 0)  # energies: sign-free
    np.testing.assert_allclose(E, E_ref, rtol=0, atol=1e3 * n * eps * (Phi**2).sum(0).max())


def test_residual_check_sees_a_wrong_reduction() -> None:
    """The a-posteriori proof run on every MKL reduction: silent on a right one, names a wrong one."""
    from nsa_dist.linalg.tridiag import _lapack, _residual

    rng = np.random.default_rng(3)
    X = rng.standard_normal((80, 80))
    G = X @ X.T
    d, e, qt, q = _lapack(np.array(G, order="F"))
    assert _residual(G, d, e, qt, q) is None
    msg = _residual(G, d * 1.001, e, qt, q)
    assert msg is not None and "‖G x − Q T Qᵀ x‖" in msg
    assert _residual(G, d, e, lambda x: 2 * qt(x), q) is not None  # Q not orthogonal
