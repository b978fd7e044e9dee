"""Divide and conquer on a symmetric tridiagonal T through the MKL inside torch (private; ctypes).

``T = S diag(λ) Sᵀ`` by ``dstedc(compz='I')``: LAPACK's divide and conquer, whose merges are GEMMs.
SciPy wraps only its ``dstevd`` (OpenBLAS's LAPACK); torch's ``libtorch_cpu.so`` links MKL
statically and exports ``mkl_lapack_dstedc`` (Fortran calling convention, as ``?syrdb`` in
:mod:`nsa_dist.linalg._mkl_syrdb`), which took 5.2–5.9 s against 7.5–8.9 s at N = 10⁴ on 2 cores
(benchmarks/README.md).

Where S itself is not needed, :func:`rows_of_s` runs the same divide and conquer carrying only
the rows of S that are used (S's first row, ψᵀS) through the merges, with MKL's ``dlaed4`` for the
secular equations: O(c·N²) flops and no N×N matrix.

A private symbol's calling convention is an assumption, so it is proven before use
(:func:`stedc_ready`, :func:`first_row_ready`): a fixed tridiagonal of 300 rows with clustered,
deflating eigenvalues must give SciPy ``dstevd``'s eigenvalues, a small residual and orthonormal S
(its first row's weights, cluster by cluster); otherwise (or when the symbol is missing) the caller
takes SciPy's ``dstevd`` and one warning is logged.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np

from nsa_dist.linalg._mkl_syrdb import fortran_info, fortran_int, mkl_function, probe_verdict

__all__ = [
    "first_row",
    "first_row_errors",
    "first_row_ready",
    "probe_stedc",
    "rows_of_s",
    "stedc",
    "stedc_errors",
    "stedc_ready",
]

_log = logging.getLogger(__name__)
_P = ctypes.c_void_p
_PROBE_N = 300  # > LAPACK's SMLSIZ (25): the divide and conquer itself runs, with several merges


def stedc(d: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues and eigenvectors of T = tridiag(e, d, e) by MKL ``dstedc(compz='I')``, float64.

    Args:
        d: (N,) diagonal; e: (N − 1,) off-diagonal (any float dtype; copied to float64).

    Returns:
        (w, S): w (N,) ascending, S (N, N) Fortran-ordered with ``T S = S diag(w)``.

    Raises:
        RuntimeError: the symbol is missing, or MKL reports a failure (its ``info`` is named).
    """
    fn = mkl_function("mkl_lapack_dstedc")
    if fn is None:
        raise RuntimeError("MKL dstedc is not exported by this torch build")
    n = int(np.shape(d)[0])
    w = np.array(d, dtype=np.float64)  # (N,) overwritten by λ
    off = np.zeros(max(n, 1))
    off[: n - 1] = e
    S = np.zeros((n, n), order="F")
    info = fortran_int(0)

    def call(work: np.ndarray, lwork: int, iwork: np.ndarray, liwork: int) -> None:
        fn(
            ctypes.c_char_p(b"I"),
            ctypes.byref(fortran_int(n)),
            w.ctypes.data_as(_P),
            off.ctypes.data_as(_P),
            S.ctypes.data_as(_P),
            ctypes.byref(fortran_int(max(n, 1))),
            work.ctypes.data_as(_P),
            ctypes.byref(fortran_int(lwork)),
            iwork.ctypes.data_as(_P),
            ctypes.byref(fortran_int(liwork)),
            ctypes.byref(info),
            ctypes.c_size_t(1),
        )
        if fortran_info(info) != 0:
            raise RuntimeError(f"MKL dstedc failed with info = {fortran_info(info)} (N = {n})")

    query, iquery = np.zeros(4), np.zeros(4, dtype=np.int64)  # int64 slots hold LP64 and ILP64 integers
    call(query, -1, iquery, -1)
    lwork = max(int(query[0]), 1 + 4 * n + n * n)  # LAPACK's documented minimum for compz = 'I'
    liwork = max(int(iquery[0] & 0xFFFFFFFF), 3 + 5 * n)
    call(np.zeros(lwork), lwork, np.zeros(liwork, dtype=np.int64), liwork)
    return w, S


def stedc_errors(d: np.ndarray, e: np.ndarray, w: np.ndarray, S: np.ndarray) -> dict[str, float]:
    """How far (w, S) is from T = tridiag(e, d, e)'s eigendecomposition, relative to ‖T‖₂:
    ``max|w − λ(T)|`` (λ by SciPy's ``dstevd``), ``max|T S − S diag(w)|`` and ``max|SᵀS − I|``·‖T‖
    (inf where not finite).

    Args:
        d (n,), e (n − 1,): T; w (n,) ascending and S (n, n): its claimed eigenpairs.

    Returns:
        The three errors by name, as fractions of ‖T‖₂.
    """
    import scipy.linalg.lapack as lapack

    names = ("|w - λ(T)|", "|TS - Sw|", "|S'S - I|")
    if not (np.isfinite(w).all() and np.isfinite(S).all()):
        return dict.fromkeys(names, float("inf"))
    ref = lapack.dstevd(np.asarray(d, np.float64), np.asarray(e, np.float64), compute_v=0)[0]
    scale = max(float(np.abs(ref).max()), np.finfo(np.float64).tiny)
    TS = d[:, None] * S
    TS[:-1] += e[:, None] * S[1:]
    TS[1:] += e[:, None] * S[:-1]
    return dict(
        zip(
            names,
            (
                float(np.abs(w - ref).max()) / scale,
                float(np.abs(TS - S * w).max()) / scale,
                float(np.abs(S.T @ S - np.eye(S.shape[0])).max()),
            ),
        )
    )


def first_row_errors(
    d: np.ndarray, e: np.ndarray, w: np.ndarray, s0: np.ndarray, gap: float = 1e-6
) -> dict[str, float]:
    """How far (w, s0) is from T's eigenvalues and first eigenvector row, against SciPy's ``dstevd``,
    relative to ‖T‖₂: ``max|w − λ(T)|`` and ``max|Σ_{i∈g} s0_i² − Σ_{i∈g} S[0, i]²|`` over the groups g
    of eigenvalues closer than ``gap``·‖T‖ (inside a cluster S[0, i] is not unique, its sum is);
    inf where not finite."""
    import scipy.linalg.lapack as lapack

    names = ("|w - λ(T)|", "|cluster weights - dstevd's|")
    if not (np.isfinite(w).all() and np.isfinite(s0).all()):
        return dict.fromkeys(names, float("inf"))
    ref, S, _ = lapack.dstevd(np.asarray(d, np.float64), np.asarray(e, np.float64), compute_v=1)
    scale = max(float(np.abs(ref).max()), np.finfo(np.float64).tiny)
    group = np.concatenate([[0], np.cumsum(np.diff(ref) > gap * scale)])  # (n,) cluster ids, ascending
    dW = np.bincount(group, s0**2) - np.bincount(group, S[0] ** 2)
    return dict(zip(names, (float(np.abs(w - ref).max()) / scale, float(np.abs(dW).max()))))


@functools.cache
def first_row_ready() -> bool:
    """Whether :func:`first_row` is present and right: on the probe T of :func:`probe_stedc` (several
    merges, deflation by tiny z and by close poles) every :func:`first_row_errors` is within
    ``50·n·eps₆₄`` (eigenvalues) and ``50·n·eps₆₄ / 1e-6`` (cluster weights, separated by ≥ 1e-6·‖T‖);
    once per process, a failure logged as one warning."""
    d, e = _probe_tridiagonal(_PROBE_N)
    try:
        w, s0 = first_row(d, e, leaf=16)
    except RuntimeError as err:
        _log.warning("MKL dlaed4 unusable (%s); T's first eigenvector row comes from a whole divide and conquer", err)
        return False
    errs = first_row_errors(d, e, w, s0)
    tol = 50 * _PROBE_N * float(np.finfo(np.float64).eps)
    return probe_verdict(
        {k: v * (1e-6 if "cluster" in k else 1.0) for k, v in errs.items()},
        tol,
        f"the first-row divide and conquer disagrees with SciPy's dstevd on a {_PROBE_N}-row probe "
        "(cluster weights scaled by 1e-6)",
        "T's first eigenvector row comes from a whole divide and conquer",
    )


@functools.cache
def stedc_ready() -> bool:
    """Whether :func:`stedc` is present and right: :func:`probe_stedc` passed (once per process)."""
    return probe_stedc()


def probe_stedc() -> bool:
    """Solve a fixed 300-row T with ``mkl_lapack_dstedc`` and check it against SciPy's ``dstevd``.

    T: the tridiagonal reduction of a matrix with a spectrum like an NTK's — a few large eigenvalues and a
    cluster of 10⁻¹²-scale ones, with two
    zero off-diagonals that split T — so that deflation and several merges run.  Accepted when
    every :func:`stedc_errors` is within ``50·n·eps₆₄``; otherwise, or when the call fails, one
    warning names the reason and False is returned.
    """
    d, e = _probe_tridiagonal(_PROBE_N)
    try:
        w, S = stedc(d, e)
    except RuntimeError as err:
        _log.warning("MKL dstedc unusable (%s); T's eigenproblem takes SciPy's dstevd", err)
        return False
    return probe_verdict(
        stedc_errors(d, e, w, S),
        50 * _PROBE_N * float(np.finfo(np.float64).eps),
        f"MKL dstedc disagrees with SciPy's dstevd on a {_PROBE_N}-row probe",
        "T's eigenproblem takes SciPy's dstevd",
    )


def _probe_tridiagonal(n: int) -> tuple[np.ndarray, np.ndarray]:
    """d (n,), e (n − 1,) of a fixed T: the tridiagonal reduction of ``U diag(μ) Uᵀ`` with μ = 10⁴·i⁻²
    for i ≤ n/3 and a cluster 10⁻⁸·(1 + 10⁻⁶·i) below, two off-diagonals then set to 0."""
    import scipy.linalg.lapack as lapack

    rng = np.random.default_rng(22)
    m = n // 3
    mu = np.concatenate([1e4 / np.arange(1, m + 1) ** 2, 1e-8 * (1 + 1e-6 * np.arange(n - m))])
    U, _ = np.linalg.qr(rng.standard_normal((n, n)))
    _, d, e, _, _ = lapack.dsytrd(np.asfortranarray((U * mu) @ U.T), lower=1)
    e = e.copy()
    e[[n // 4, n // 2]] = 0.0
    return d.copy(), e


def first_row(d: np.ndarray, e: np.ndarray, leaf: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues of T = tridiag(e, d, e) and the first row of its eigenvector matrix S (``s0[i] = S[0, i]``,
    each column's sign arbitrary): :func:`rows_of_s` with no X."""
    w, M = rows_of_s(d, e, None, leaf)
    return w, M[0]


def rows_of_s(
    d: np.ndarray, e: np.ndarray, X: np.ndarray | None = None, leaf: int = 32
) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues of T = tridiag(e, d, e) and the rows e₁ᵀS, e_Nᵀ S and XᵀS of its eigenvector matrix S,
    by divide and conquer carrying only those rows of each block's S (Cuppen's method with LAPACK's
    deflation, ``dlaed2``, and Gu–Eisenstat eigenvectors, ``dlaed3``; the secular equations by MKL's
    ``dlaed4``): O((c + 2)·N²) flops, memory O(K²) for the largest undeflated merge — where
    :func:`stedc` forms all of S (N² memory, GEMMs of N³ flops less deflation).

    Args:
        d: (N,) diagonal; e: (N − 1,) off-diagonal (float64).
        X: (N, c) float64 columns to project (``Sᵀ X``), or None.
        leaf: blocks of at most this many rows are solved whole (SciPy ``dstevd``).

    Returns:
        (w, M): w (N,) ascending; M (2 + c, N) with rows S[0, :], S[N − 1, :] and (XᵀS)[j, :], each
        eigenvector's sign arbitrary but the same in every row.

    Raises:
        RuntimeError: ``dlaed4`` is missing or reports a failure.
    """
    d, e = np.asarray(d, np.float64), np.asarray(e, np.float64)
    n = d.shape[0]
    X = np.zeros((n, 0)) if X is None else np.asarray(X, np.float64).reshape(n, -1)
    scale = max(float(np.abs(d).max(initial=0.0)), float(np.abs(e).max(initial=0.0)))
    if scale == 0.0:  # T = 0: S = I
        return d.copy(), np.vstack([np.eye(n)[[0, n - 1]], X.T])
    w, M = _rows(d / scale, e / scale, X, leaf)
    return w * scale, M


def _rows(d: np.ndarray, e: np.ndarray, X: np.ndarray, leaf: int) -> tuple[np.ndarray, np.ndarray]:
    """(w ascending, M = [S[0]; S[−1]; XᵀS]) of tridiag(e, d, e): a leaf whole, else two halves merged."""
    import scipy.linalg.lapack as lapack

    n = d.shape[0]
    if n == 1:
        return d.copy(), np.vstack([np.ones((2, 1)), X.T])
    if n <= leaf:
        w, S, info = lapack.dstevd(d, e, compute_v=1)
        if info != 0:
            raise RuntimeError(f"LAPACK dstevd failed with info = {info}")
        return w, np.vstack([S[[0, n - 1]], X.T @ S])
    m, b = n // 2, float(e[n // 2 - 1])
    d1, d2 = d[:m].copy(), d[m:].copy()
    d1[-1] -= abs(b)  # T = diag(T1, T2) − |b|(e_m e_mᵀ + e_{m+1}e_{m+1}ᵀ) + |b| v vᵀ, v = e_m + sign(b) e_{m+1}
    d2[0] -= abs(b)
    w1, M1 = _rows(d1, e[: m - 1], X[:m], leaf)
    w2, M2 = _rows(d2, e[m:], X[m:], leaf)
    z = np.concatenate([M1[1], np.copysign(1.0, b) * M2[0]]) / np.sqrt(2.0)  # ‖z‖ = 1
    M = np.block(
        [
            [M1[:1], np.zeros_like(M2[:1])],  # first row: block 1's
            [np.zeros_like(M1[:1]), M2[1:2]],  # last row: block 2's
            [M1[2:], M2[2:]],
        ]
    )  # XᵀS: each block its own part of X
    return _merge(np.concatenate([w1, w2]), z, 2.0 * abs(b), M)


def _merge(D: np.ndarray, z: np.ndarray, rho: float, M: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues of diag(D) + ρ z zᵀ and the rows M (r, n) of T's block eigenvectors carried into
    its eigenvectors: deflation as LAPACK's ``dlaed2``, the rest as ``dlaed3``."""
    order = np.argsort(D, kind="stable")
    D, z, M = D[order], z[order].copy(), M[:, order]
    tol = 8 * (np.finfo(np.float64).eps / 2) * max(float(np.abs(D).max()), float(np.abs(z).max()))
    kept, pj = [], -1
    for nj in np.flatnonzero(rho * np.abs(z) > tol):  # tiny z_j: deflated as they stand
        if pj < 0:
            pj = nj
            continue
        tau = float(np.hypot(z[nj], z[pj]))
        c, s = z[nj] / tau, -z[pj] / tau
        if abs((D[nj] - D[pj]) * c * s) <= tol:  # close poles: rotate z_pj to 0, deflate pj
            z[nj], z[pj] = tau, 0.0
            M[:, pj], M[:, nj] = c * M[:, pj] + s * M[:, nj], c * M[:, nj] - s * M[:, pj]
            D[pj], D[nj] = D[pj] * c * c + D[nj] * s * s, D[pj] * s * s + D[nj] * c * c
        else:
            kept.append(pj)
        pj = nj
    if pj >= 0:
        kept.append(pj)
    K = np.array(kept, dtype=np.int64)
    if K.size:
        D = D.copy()
        D[K], M[:, K] = _secular(D[K], z[K], rho, M[:, K])
    order = np.argsort(D, kind="stable")
    return D[order], M[:, order]


def _secular(dl: np.ndarray, w: np.ndarray, rho: float, M: np.ndarray, rows: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Roots λ_j of 1 + ρ Σ w_i² / (dl_i − λ) (MKL ``dlaed4``, one call a root) and the rows M (r, k)
    carried into the eigenvectors u_j ∝ ŵ / (dl − λ_j), ŵ the Gu–Eisenstat vector recomputed from the
    roots (``dlaed3``).

    Blocks of ``rows`` roots, on two threads when k is large (``dlaed4`` and NumPy release the GIL):
    the first sweep finds the roots and accumulates ŵ_i² = −Π_j (dl_i − λ_j) / Π_{j≠i} (dl_i − dl_j),
    the second projects M on each block's eigenvectors."""
    from concurrent.futures import ThreadPoolExecutor

    k = dl.shape[0]
    dl, w = np.ascontiguousarray(dl), np.ascontiguousarray(w)
    lam = np.empty(k)
    if k == 1:
        _dlaed4_rows(dl, w, rho, 0, 1, lam)
        return lam, M.copy()
    if k == 2:  # dlaed4 hands it to dlaed5, whose "delta" rows are the eigenvectors (as dlaed3 uses them)
        U = _dlaed4_rows(dl, w, rho, 0, 2, lam)
        return lam, M @ (U / np.linalg.norm(U, axis=1)[:, None]).T
    blocks = [(lo, min(lo + rows, k)) for lo in range(0, k, rows)]
    Delta: dict[int, np.ndarray] = {}

    def products(block: tuple[int, int]) -> np.ndarray:
        lo, hi = block
        Delta[lo] = R = _dlaed4_rows(dl, w, rho, lo, hi, lam)  # (b, k): row j − lo = dl − λ_j
        j = np.arange(lo, hi)
        gap = dl[None, :] - dl[j, None]  # (b, k): dl_i − dl_j
        gap[np.arange(hi - lo), j] = 1.0
        return np.prod(R / gap, axis=0)  # (k,)

    def project(block: tuple[int, int]) -> np.ndarray:
        U = what[None, :] / Delta.pop(block[0])  # (b, k): row j ∝ u_j
        U /= np.linalg.norm(U, axis=1)[:, None]
        return M @ U.T  # (r, b)

    pool = ThreadPoolExecutor(2) if k >= 1024 else None  # small merges: threads cost more than they save
    run = pool.map if pool is not None else map
    try:
        P = np.prod(np.stack(list(run(products, blocks))), axis=0)
        what = np.copysign(np.sqrt(np.maximum(-P, 0.0)), w)  # Gu–Eisenstat ŵ
        return lam, np.concatenate(list(run(project, blocks)), axis=1)
    finally:
        if pool is not None:
            pool.shutdown()


def _dlaed4_rows(dl: np.ndarray, w: np.ndarray, rho: float, lo: int, hi: int, lam: np.ndarray) -> np.ndarray:
    """Roots lo … hi − 1 (0-based) of the secular equation by MKL ``dlaed4`` into ``lam``, and their
    (hi − lo, k) rows ``dl − λ_j``."""
    fn = mkl_function("mkl_lapack_dlaed4")
    if fn is None:
        raise RuntimeError("MKL dlaed4 is not exported by this torch build")
    k = dl.shape[0]
    out = np.empty((hi - lo, k))
    dlam, info, kk, r = ctypes.c_double(0.0), fortran_int(0), fortran_int(k), ctypes.c_double(rho)
    pd, pw = dl.ctypes.data_as(_P), w.ctypes.data_as(_P)
    for j in range(lo, hi):
        fn(
            ctypes.byref(kk),
            ctypes.byref(fortran_int(j + 1)),
            pd,
            pw,
            out[j - lo].ctypes.data_as(_P),
            ctypes.byref(r),
            ctypes.byref(dlam),
            ctypes.byref(info),
        )
        if fortran_info(info) != 0:
            raise RuntimeError(f"MKL dlaed4 failed with info = {fortran_info(info)} (root {j + 1} of {k})")
        lam[j] = dlam.value
    return out
