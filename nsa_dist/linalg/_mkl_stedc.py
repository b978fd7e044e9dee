"""Divide and conquer on a symmetric tridiagonal T through the MKL inside torch (private; ctypes).

``T = S diag(λ) Sᵀ`` by ``dstedc(compz='I')``: LAPACK's divide and conquer, whose merges are GEMMs.
SciPy wraps only its ``dstevd`` (OpenBLAS's LAPACK); torch's ``libtorch_cpu.so`` links MKL
statically and exports ``mkl_lapack_dstedc`` (Fortran calling convention, as ``?syrdb`` in
:mod:`nsa_dist.linalg._mkl_syrdb`), which took 5.2–5.9 s against 7.5–8.9 s at N = 10⁴ on 2 cores
(benchmarks/README.md, issue 22).

A private symbol's calling convention is an assumption, so it is proven before use
(:func:`stedc_ready`): a fixed tridiagonal of 300 rows with clustered, deflating eigenvalues must
give SciPy ``dstevd``'s eigenvalues, a small residual and orthonormal S; otherwise (or when the
symbol is missing) the caller takes SciPy's ``dstevd`` and one warning is logged.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np

from nsa_dist.linalg._mkl_syrdb import fortran_info, fortran_int, mkl_function, probe_verdict

__all__ = ["probe_stedc", "stedc", "stedc_errors", "stedc_ready"]

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
    off[:n - 1] = e
    S = np.zeros((n, n), order="F")
    info = fortran_int(0)

    def call(work: np.ndarray, lwork: int, iwork: np.ndarray, liwork: int) -> None:
        fn(ctypes.c_char_p(b"I"), ctypes.byref(fortran_int(n)), w.ctypes.data_as(_P), off.ctypes.data_as(_P),
           S.ctypes.data_as(_P), ctypes.byref(fortran_int(max(n, 1))), work.ctypes.data_as(_P),
           ctypes.byref(fortran_int(lwork)), iwork.ctypes.data_as(_P), ctypes.byref(fortran_int(liwork)),
           ctypes.byref(info), ctypes.c_size_t(1))
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
    return dict(zip(names, (float(np.abs(w - ref).max()) / scale, float(np.abs(TS - S * w).max()) / scale,
                            float(np.abs(S.T @ S - np.eye(S.shape[0])).max()))))


@functools.cache
def stedc_ready() -> bool:
    """Whether :func:`stedc` is present and right: :func:`probe_stedc` passed (once per process)."""
    return probe_stedc()


def probe_stedc() -> bool:
    """Solve a fixed 300-row T with ``mkl_lapack_dstedc`` and check it against SciPy's ``dstevd``.

    T: the tridiagonal reduction of a matrix with a spectrum like an NTK's — a few large eigenvalues and a cluster of 10⁻¹²-scale ones, with two
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
    return probe_verdict(stedc_errors(d, e, w, S), 50 * _PROBE_N * float(np.finfo(np.float64).eps),
                         f"MKL dstedc disagrees with SciPy's dstevd on a {_PROBE_N}-row probe",
                         "T's eigenproblem takes SciPy's dstevd")


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
