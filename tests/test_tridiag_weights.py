"""Issue 22: the one-vector `k: all` route (eigenvalues and ⟨v_i, φ⟩² of one φ with Q never formed) and
MKL's divide and conquer on T — each against dense float64 ``numpy.linalg.eigh`` / SciPy ``dstevd``,
their probes, and the per-call checks that send a wrong result to the Q route."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import scipy.linalg.lapack as lapack

from nsa_dist.errors import NonFiniteError, ShapeError
from nsa_dist.linalg._mkl_stedc import (
    first_row,
    first_row_errors,
    first_row_ready,
    probe_stedc,
    stedc,
    stedc_errors,
    stedc_ready,
)
from nsa_dist.linalg._mkl_syrdb import first_column_ready, probe_first_column
from nsa_dist.linalg.tridiag import Reduction, Solver, eig_projections, eig_weights

N = 240


def _ntk_like(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """G (n, n) with an NTK's spectrum — n/4 large eigenvalues decaying as 10⁴·i^-1.5, then a tight
    cluster of small ones 1e-2·(1 + 1e-4·i) (n/2 of them) and exact zeros — with float64 eigh's λ
    (descending) and V."""
    rng = np.random.default_rng(seed)
    m = n // 4
    mu = np.concatenate(
        [1e4 / np.arange(1, m + 1) ** 1.5, 1e-2 * (1 + 1e-4 * np.arange(n // 2)), np.zeros(n - m - n // 2)]
    )
    U, _ = np.linalg.qr(rng.standard_normal((n, n)))
    G = (U * mu) @ U.T
    G = (G + G.T) / 2
    w, V = np.linalg.eigh(G)
    return G, w[::-1].copy(), V[:, ::-1].copy()


def _geometric(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """G (n, n) with eigenvalues 10³ … 1 (gaps ≥ 2 %: every ⟨v_i, φ⟩ well conditioned), eigh's λ, V."""
    rng = np.random.default_rng(seed)
    U, _ = np.linalg.qr(rng.standard_normal((n, n)))
    G = (U * np.geomspace(1e3, 1, n)) @ U.T
    G = (G + G.T) / 2
    w, V = np.linalg.eigh(G)
    return G, w[::-1].copy(), V[:, ::-1].copy()


@pytest.mark.parametrize("route", [Reduction.MKL, Reduction.LAPACK])
@pytest.mark.parametrize("dtype, rel", [(np.float64, 1e-10), (np.float32, 2e-4)])
def test_weights_against_dense_eigh(route: Reduction, dtype: type, rel: float) -> None:
    """Distinct eigenvalues: each λ_i and each ⟨v_i, φ⟩² (sign-free) against float64 eigh."""
    if route is Reduction.MKL and not first_column_ready(np.dtype(dtype)):
        pytest.skip("this torch build has no usable MKL ?syrdb")
    G, w, V = _geometric(N, 5)
    phi = np.random.default_rng(6).standard_normal(N)
    sp = eig_weights(G.astype(dtype), phi, reduction=route)
    assert sp.one_vector and sp.reduction is route and sp.proj.shape == (N, 1) and sp.vectors.shape == (N, 0)
    assert sp.solver is (Solver.ROWS if first_row_ready() else Solver.LAPACK if not stedc_ready() else Solver.MKL)
    dw = np.abs(sp.evals - w) / w
    assert dw.max() <= rel, f"eigenvalue {dw.argmax()} off by {dw.max():.1e} relative"
    P2, ref = sp.proj[:, 0] ** 2, (V.T @ phi) ** 2
    dP = np.abs(P2 - ref) / (phi @ phi)
    assert dP.max() <= 50 * rel, f"⟨v_i, φ⟩² off at i = {dP.argmax()} by {dP.max():.1e} of ‖φ‖²"
    assert all(err <= tol for _, err, tol in sp.checks), sp.checks


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_ntk_like_clusters_match_the_q_route_and_eigh(dtype: type) -> None:
    """An NTK's clustered near-zero eigenvalues: ⟨v_i, φ⟩ is not unique inside a cluster, the energy
    E(φ, k) = Σ_{i≤k} ⟨v_i, φ⟩² / ‖φ‖² is at its edges; both against eigh and against the Q route of the
    same G — in float64 at every edge, in float32 at the edges its rounding (~N·eps₃₂·λ_1 = 0.3) resolves."""
    G, w, V = _ntk_like(N, 7)
    phi = np.random.default_rng(8).standard_normal(N)
    sp = eig_weights(G.astype(dtype), phi)
    q = eig_projections(G.astype(dtype), phi)
    assert sp.one_vector
    eps = float(np.finfo(dtype).eps)
    np.testing.assert_allclose(sp.evals, w, rtol=0, atol=50 * N * eps * w[0])
    np.testing.assert_allclose(sp.evals, q.evals, rtol=0, atol=50 * N * eps * w[0])
    edges = np.array([0, 10, N // 4 - 1, N - 1] + ([N // 4 + N // 2 - 1] if dtype == np.float64 else []))
    E, E_ref = np.cumsum(sp.proj[:, 0] ** 2) / (phi @ phi), np.cumsum((V.T @ phi) ** 2) / (phi @ phi)
    E_q = np.cumsum(q.proj[:, 0] ** 2) / (phi @ phi)
    tol = 1e-10 if dtype == np.float64 else 1e-3
    assert np.abs(E - E_ref)[edges].max() <= tol, f"E(φ, k) at k = {edges + 1}: {E[edges]} vs eigh {E_ref[edges]}"
    assert np.abs(E - E_q)[edges].max() <= tol, f"E(φ, k) at k = {edges + 1}: {E[edges]} vs Q route {E_q[edges]}"


def test_weight_below_float32_resolution_is_reduced_in_float64(caplog) -> None:
    """A float32 call keeps float32 only while φ's weight on eigenvalues below float32's resolution
    is ≤ 1e-3 of ‖φ‖² (there the reflected reduction's split is noise: E(φ, k) was off by 0.11–0.14
    for a Gaussian φ at N = 10⁴); above that share it is redone in float64 and E(φ, k) is exact at
    every edge, inside the clusters too (against float64 eigh of the float32 matrix itself)."""
    G, _, V = _ntk_like(N, 7)
    G32 = G.astype(np.float32)
    _, V32 = np.linalg.eigh(G32.astype(np.float64))
    V32 = V32[:, ::-1]
    rng = np.random.default_rng(9)
    spread = rng.standard_normal(N)  # ~3/4 of its weight on the cluster and the zeros
    smooth = V[:, :20] @ rng.standard_normal(20)  # weight on the top eigenvectors only
    caplog.set_level(logging.INFO, logger="nsa_dist.linalg.tridiag")
    edges = np.array([0, 10, N // 4 - 1, N // 4 + N // 2 - 1, N - 1])
    for phi, redone, tol in ((spread, True, 1e-8), (smooth, False, 1e-3)):
        caplog.clear()
        sp = eig_weights(G32, phi)
        assert sp.one_vector
        assert ("reduced in float64" in caplog.text) is redone, caplog.text
        E, E_ref = np.cumsum(sp.proj[:, 0] ** 2) / (phi @ phi), np.cumsum((V32.T @ phi) ** 2) / (phi @ phi)
        err = np.abs(E - E_ref)[edges]
        assert err.max() <= tol, f"E(φ, k) at k = {edges + 1} off by {err} (float64 redo: {redone})"


def test_edge_vectors_and_sizes() -> None:
    """φ = 0 (no reflector: every weight 0), φ = ±e₁ (H maps e₁ to ∓e₁), N = 1 and N below MKL's minimum."""
    G, w, V = _geometric(40, 9)
    zero = eig_weights(G, np.zeros(40))
    assert zero.one_vector and not zero.proj.any()
    np.testing.assert_allclose(zero.evals, w, rtol=1e-12)
    for phi in (np.eye(40)[0], -np.eye(40)[0], np.eye(40)[39]):
        sp = eig_weights(G, phi)
        np.testing.assert_allclose(sp.proj[:, 0] ** 2, (V.T @ phi) ** 2, rtol=0, atol=1e-12)
    one = eig_weights(np.array([[3.0]]), np.array([2.0]))
    assert one.evals.tolist() == [3.0] and abs(one.proj[0, 0]) == 2.0
    G5, w5, V5 = _geometric(5, 10)
    sp5 = eig_weights(G5, np.arange(5.0))
    assert sp5.reduction is Reduction.LAPACK
    np.testing.assert_allclose(sp5.proj[:, 0] ** 2, (V5.T @ np.arange(5.0)) ** 2, rtol=0, atol=1e-12)


def test_torch_input_left_alone() -> None:
    import torch

    G, w, _ = _geometric(N, 11)
    Gt = torch.from_numpy(G.copy())
    sp = eig_weights(Gt, np.ones(N))
    assert torch.equal(Gt, torch.from_numpy(G))  # G' was formed on a copy
    np.testing.assert_allclose(sp.evals, w, rtol=1e-10)


def test_a_wrong_result_goes_to_the_q_route(caplog) -> None:
    """An unsymmetric G: the reduction reads one triangle, the checks all of G (its trace, ‖G‖_F,
    φᵀG^mφ), so they see that T is not G's and the call is answered by :func:`eig_projections`."""
    G, *_ = _geometric(60, 12)
    G = G + np.triu(np.full((60, 60), 5.0), 1)  # the upper triangle moved
    with caplog.at_level(logging.WARNING, logger="nsa_dist.linalg.tridiag"):
        sp = eig_weights(G, np.ones(60))
    assert not sp.one_vector and sp.vectors.shape == (60, 0)
    assert any("one-vector route's result" in r.getMessage() and "|G|_F" in r.getMessage() for r in caplog.records)
    assert any(err > tol for _, err, tol in sp.checks)


def test_checks_see_wrong_weights_and_a_wrong_first_column() -> None:
    """The checks, fed a right answer, then S's first row for other eigenvalues, then a T whose first
    entries are not G''s (what a reduction moving e₁ would give)."""
    from nsa_dist.linalg.tridiag import _householder, _products, _reflect, _Stats, _weights_checks

    G, *_ = _geometric(80, 13)
    phi = np.random.default_rng(14).standard_normal(80)
    A = np.array(G, order="F")
    u = _householder(phi / np.linalg.norm(phi))
    GX, fro2 = _products(G, np.column_stack([phi, u]))
    _reflect(A, u, GX[:, 1])
    st = _Stats(
        80,
        float(np.finfo(np.float64).eps),
        float(np.trace(G)),
        fro2,
        A[:, 0].copy(),
        phi,
        GX[:, 0],
        _products(G, GX[:, :1])[0][:, 0],
    )
    _, d, e, _, _ = lapack.dsytrd(A.copy(order="F"), lower=1)
    lam, S, _ = lapack.dstevd(d, e, compute_v=1)

    def failing(d_: np.ndarray, e_: np.ndarray, s0: np.ndarray) -> list[str]:
        return [name for name, err, tol in _weights_checks(st, d_, e_, lam, s0) if not err <= tol]

    assert failing(d, e, S[0]) == []
    assert any("Σ w λ^1" in n for n in failing(d, e, S[0, ::-1]))  # weights on the wrong eigenvalues
    Tm = np.diag(d) + np.diag(e, 1) + np.diag(e, -1)
    R = np.eye(80)
    R[:2, :2] = [[0.6, -0.8], [0.8, 0.6]]  # a rotation moving e₁
    _, d2, e2, _, _ = lapack.dsytrd(np.asfortranarray(R.T @ Tm @ R), lower=1)
    assert {"|d0 - G'00|", "||e0| - |G'[1:, 0]||"} <= set(failing(d2, e2, S[0]))


def test_bad_input_named() -> None:
    with pytest.raises(ShapeError, match=r"phi must be \(N,\) or \(N, 1\) with N = 5"):
        eig_weights(np.eye(5), np.ones((5, 2)))
    with pytest.raises(ShapeError, match=r"G must be a square"):
        eig_weights(np.ones((5, 4)), np.ones(5))
    with pytest.raises(NonFiniteError, match="phi holds 1 NaN/inf"):
        eig_weights(np.eye(5), np.array([1, 2, np.nan, 0, 0]))
    with pytest.raises(ValueError, match=r"reduction='mkl' needs N >= 16 \(got 5\)"):
        eig_weights(np.eye(5), np.ones(5), reduction="mkl")
    with pytest.raises(ValueError, match=r"solver='qr' is not one of 'auto', 'mkl', 'lapack', 'rows'"):
        eig_weights(np.eye(20), np.ones(20), solver="qr")


def test_probes_pass_here_without_a_warning(caplog) -> None:
    """On this machine's torch (MKL on x86-64 wheels): ?syrdb leaves e₁ fixed (Q[:, 0] = e₁, Q[0, :] = e₁ᵀ),
    its jobz = 'N' T is its jobz = 'V' T, and dstedc agrees with SciPy's dstevd."""
    if not (first_column_ready(np.dtype(np.float32)) and stedc_ready()):
        pytest.skip("this torch build has no usable MKL ?syrdb / dstedc (the LAPACK routes are tested)")
    with caplog.at_level(logging.WARNING):
        assert probe_first_column(np.dtype(np.float32)) and probe_first_column(np.dtype(np.float64))
        assert probe_stedc() and first_row_ready()
    assert not caplog.records


@pytest.mark.parametrize("n", [2, 3, 26, 300])
def test_mkl_stedc_against_scipy_dstevd(n: int) -> None:
    """MKL's divide and conquer against SciPy's on T with clustered and split eigenvalues; both
    solvers through :func:`eig_projections` give the same projections."""
    if not stedc_ready():
        pytest.skip("this torch build has no usable MKL dstedc")
    rng = np.random.default_rng(n)
    d = np.concatenate([rng.standard_normal(n // 2), np.full(n - n // 2, 1e-9)])
    e = rng.standard_normal(n - 1) * np.where(np.arange(n - 1) % 7 == 3, 0.0, 1.0)
    w, S = stedc(d, e)
    w_ref = lapack.dstevd(d, e, compute_v=0)[0]
    np.testing.assert_allclose(w, w_ref, rtol=0, atol=50 * n * 2.2e-16 * np.abs(w_ref).max())
    errs = stedc_errors(d, e, w, S)
    assert max(errs.values()) <= 50 * n * 2.2e-16, errs


def test_both_solvers_in_the_q_route() -> None:
    """The Q route with T solved by MKL dstedc and by SciPy dstevd (the fallback, asked for by name)."""
    G, w, V = _geometric(N, 15)
    Phi = np.random.default_rng(16).standard_normal((N, 2))
    lap = eig_projections(G, Phi, solver="lapack")
    assert lap.solver is Solver.LAPACK
    np.testing.assert_allclose(np.abs(lap.proj), np.abs(V.T @ Phi), rtol=0, atol=1e-9 * np.abs(Phi).max())
    if stedc_ready():
        mkl = eig_projections(G, Phi, solver="mkl")
        assert mkl.solver is Solver.MKL
        np.testing.assert_allclose(mkl.evals, lap.evals, rtol=0, atol=1e-12 * w[0])
        np.testing.assert_allclose(np.abs(mkl.proj), np.abs(lap.proj), rtol=0, atol=1e-9 * np.abs(Phi).max())


def test_stedc_errors_see_a_wrong_result() -> None:
    rng = np.random.default_rng(17)
    d, e = rng.standard_normal(30), rng.standard_normal(29)
    w, S, _ = lapack.dstevd(d, e, compute_v=1)
    assert max(stedc_errors(d, e, w, S).values()) < 1e-13
    bad = stedc_errors(d, e, w, S[:, ::-1])  # eigenvectors paired with the wrong eigenvalues
    assert bad["|TS - Sw|"] > 1e-3 and bad["|w - λ(T)|"] < 1e-13
    assert stedc_errors(d, e, w * np.nan, S)["|w - λ(T)|"] == float("inf")


def _split_clustered(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """T (d, e) with a few large eigenvalues, a tight cluster near 1e-9 and zero off-diagonals: deflation
    by tiny z, by close poles and by splitting all occur in the merges."""
    rng = np.random.default_rng(seed)
    m = max(n // 5, 1)
    mu = np.concatenate([1e3 / np.arange(1, m + 1) ** 2, 1e-9 * (1 + 1e-7 * np.arange(n - m))])
    U, _ = np.linalg.qr(rng.standard_normal((n, n)))
    _, d, e, _, _ = lapack.dsytrd(np.asfortranarray((U * mu) @ U.T), lower=1)
    e = e.copy()
    e[n // 3 : n // 3 + 1] = 0.0
    return d.copy(), e


@pytest.mark.parametrize("n, leaf", [(2, 32), (3, 1), (40, 4), (300, 8), (300, 32)])
def test_first_row_against_dstevd(n: int, leaf: int) -> None:
    """The first-row divide and conquer: eigenvalues and the weights S[0, i]² (summed over each cluster of
    eigenvalues closer than 1e-6·‖T‖, where single ones are not unique) against SciPy's dstevd."""
    if not first_row_ready():
        pytest.skip("this torch build has no usable MKL dlaed4")
    d, e = _split_clustered(n, n + leaf)
    w, s0 = first_row(d, e, leaf=leaf)
    errs = first_row_errors(d, e, w, s0)
    assert errs["|w - λ(T)|"] <= 50 * n * 2.2e-16, errs
    assert errs["|cluster weights - dstevd's|"] <= 50 * n * 2.2e-16 / 1e-6, errs
    assert abs(float(s0 @ s0) - 1.0) <= 50 * n * 2.2e-16


def test_first_row_errors_see_a_wrong_row_and_the_solver_is_checked() -> None:
    d, e = _split_clustered(60, 1)
    w, S, _ = lapack.dstevd(d, e, compute_v=1)
    assert max(first_row_errors(d, e, w, S[0]).values()) < 1e-13
    assert first_row_errors(d, e, w, S[0, ::-1])["|cluster weights - dstevd's|"] > 1e-3
    assert first_row_errors(d, e, w, S[-1])["|cluster weights - dstevd's|"] > 1e-3  # the last row is not the first


@pytest.mark.parametrize("solver", [Solver.MKL, Solver.LAPACK])
def test_whole_s_solvers_give_the_first_row_route_s_weights(solver: Solver) -> None:
    """eig_weights with S formed whole (MKL dstedc, SciPy dstevd: the fallbacks) against ROWS."""
    if not first_row_ready() or (solver is Solver.MKL and not stedc_ready()):
        pytest.skip("this torch build lacks MKL dlaed4 / dstedc")
    G, w, _ = _ntk_like(N, 18)
    phi = np.random.default_rng(19).standard_normal(N)
    a, b = eig_weights(G, phi), eig_weights(G, phi, solver=solver)
    assert a.solver is Solver.ROWS and b.solver is solver and a.one_vector and b.one_vector
    np.testing.assert_allclose(a.evals, b.evals, rtol=0, atol=1e-12 * w[0])
    Ea, Eb = np.cumsum(a.proj[:, 0] ** 2), np.cumsum(b.proj[:, 0] ** 2)
    edges = [0, 10, N // 4 - 1, N // 4 + N // 2 - 1, N - 1]
    np.testing.assert_allclose(Ea[edges], Eb[edges], rtol=0, atol=1e-10 * float(phi @ phi))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_q_route_without_eigenvectors_carries_only_psi_rows(dtype: type) -> None:
    """eig_projections with no eigenvector asked for solves T by the rows-only divide and conquer (ψᵀS):
    the same eigenvalues and energies as with S whole (MKL dstedc / SciPy dstevd) and as float64 eigh."""
    if not first_row_ready():
        pytest.skip("this torch build has no usable MKL dlaed4")
    G, w, V = _ntk_like(N, 20)
    Phi = np.random.default_rng(21).standard_normal((N, 3))
    rows, whole = eig_projections(G.astype(dtype), Phi), eig_projections(G.astype(dtype), Phi, solver="lapack")
    assert rows.solver is Solver.ROWS and whole.solver is Solver.LAPACK
    eps = float(np.finfo(dtype).eps)
    np.testing.assert_allclose(rows.evals, whole.evals, rtol=0, atol=100 * N * 2.2e-16 * w[0])
    np.testing.assert_allclose(rows.evals, w, rtol=0, atol=50 * N * eps * w[0])
    n2 = (Phi**2).sum(axis=0)
    edges = [0, 10, N // 4 - 1, N - 1] + ([N // 4 + N // 2 - 1] if dtype == np.float64 else [])
    E, E_whole = np.cumsum(rows.proj**2, 0) / n2, np.cumsum(whole.proj**2, 0) / n2
    E_ref = np.cumsum((V.T @ Phi) ** 2, 0) / n2
    np.testing.assert_allclose(E[edges], E_whole[edges], rtol=0, atol=1e-10)
    np.testing.assert_allclose(E[edges], E_ref[edges], rtol=0, atol=1e-10 if dtype == np.float64 else 1e-3)


def test_rows_check_sees_wrong_rows() -> None:
    from nsa_dist.linalg._tridiag_eig import _rows_errors

    d, e = _split_clustered(50, 2)
    X = np.random.default_rng(3).standard_normal((50, 2))
    w, S, _ = lapack.dstevd(d, e, compute_v=1)
    P = X.T @ S  # (2, 50)
    assert _rows_errors(d, e, X, w, P) is None
    assert "m = 1" in (_rows_errors(d, e, X, w, P[:, ::-1]) or "")  # weights on the wrong eigenvalues
    assert "m = 0" in (_rows_errors(d, e, X, w, 1.01 * P) or "")


def test_rows_route_with_eigenvectors_by_inverse_iteration() -> None:
    """Eigenvectors asked for (the images) with ROWS: columns of S by inverse iteration, v_i = Q s_i,
    against float64 eigh; the columns' check names a λ they do not belong to."""
    from nsa_dist.linalg._tridiag_eig import _columns

    if not first_row_ready():
        pytest.skip("this torch build has no usable MKL dlaed4")
    G, w, V = _geometric(N, 22)
    Phi = np.random.default_rng(23).standard_normal((N, 2))
    idx = (0, 1, 9, N - 1)
    sp = eig_projections(G, Phi, indices=idx)
    assert sp.solver is Solver.ROWS
    np.testing.assert_allclose(np.abs(sp.vectors), np.abs(V[:, list(idx)]), rtol=0, atol=1e-9)
    np.testing.assert_allclose(np.abs(sp.proj), np.abs(V.T @ Phi), rtol=0, atol=1e-9 * np.abs(Phi).max())
    d, e = _split_clustered(40, 4)
    lam = lapack.dstevd(d, e, compute_v=0)[0]
    assert _columns(d, e, lam, [0, 39])[1] is None
    assert "residual" in (_columns(d, e, lam[::-1].copy(), [0, 39])[1] or "")
