"""MKL's successive-band tridiagonalisation ``?syrdb`` through the MKL inside torch (private; ctypes).

``?syrdb`` reduces a dense symmetric A to band form (bandwidth ``kd``, BLAS-3) and the band to a
tridiagonal T, ``A = Q T Qᵀ``; with ``jobz = 'V'`` it also forms Q in A's place.  Its cost with Q
formed is about that of ``eigvalsh`` (MKL ``?syevd`` without vectors), while the one-stage
``?sytrd`` (SciPy's, or MKL's own) takes 3–6× that at N = 10⁴ on 2 cores (benchmarks/README.md,
issue 22).  SciPy does not wrap it; torch's ``libtorch_cpu.so`` links MKL statically and exports
its internal ``mkl_lapack_?syrdb`` with the Fortran calling convention (every argument by
reference, hidden string lengths last).

That convention is an assumption about a private symbol, so it is proven before use
(:func:`syrdb_ready`): a probe reduction of a fixed 256 × 256 matrix must reproduce A from Q T Qᵀ,
have Q orthogonal and T the eigenvalues of SciPy's ``eigvalsh``; otherwise (or when the symbol is
missing: a torch built without MKL) the caller takes SciPy's route and one warning is logged.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import numpy as np

__all__ = ["MIN_N", "probe_syrdb", "reduction_errors", "syrdb_explicit", "syrdb_ready"]

_log = logging.getLogger(__name__)
KD = 128  # band of the first stage: jobz = V at N = 10⁴ float32 under the same load, kd 32 137 s, 64 80 s, 128 67 s, 256 64 s
MIN_N = 16  # smaller G: SciPy's route (instant there)
_PROBE_N = 256
_P = ctypes.c_void_p


@functools.cache
def _symbol(prefix: str) -> ctypes._CFuncPtr | None:
    """``mkl_lapack_{prefix}syrdb`` of torch's libtorch_cpu.so, or None where it is not exported."""
    try:
        import torch

        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        fn = getattr(lib, f"mkl_lapack_{prefix}syrdb")
    except (OSError, AttributeError):
        return None
    fn.restype = None
    return fn


def _prefix(dtype: np.dtype) -> str:
    return {np.dtype(np.float32): "s", np.dtype(np.float64): "d"}[np.dtype(dtype)]


def _int(v: int) -> ctypes.c_int64:
    """A Fortran INTEGER: 8 zeroed bytes hold a small value for both LP64 (4-byte) and ILP64 MKL."""
    return ctypes.c_int64(v)


def _info(v: ctypes.c_int64) -> int:
    """LAPACK's info as a signed 32-bit value (LP64 MKL writes only the low 4 bytes)."""
    low = v.value & 0xFFFFFFFF
    return low - (1 << 32) if low >= 1 << 31 else low


def syrdb_explicit(A: np.ndarray, kd: int = KD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``A = Q T Qᵀ`` by MKL ``?syrdb(jobz='V', uplo='L')``, Q formed in A's place.

    Args:
        A: (N, N) float32 or float64, Fortran-ordered, symmetric (its lower triangle is read);
            overwritten by Q.
        kd: bandwidth of the intermediate band matrix, clipped to N // 4: with kd ≥ N − 1 (a band
            as wide as A) MKL returns T but not Q (seen for N = 2 … 129), while every N ≥ 4 with
            kd ≤ N/2 − 1 reduced correctly.

    Returns:
        (Q, d, e): Q is ``A`` itself (N, N), d (N,) the diagonal and e (N − 1,) the off-diagonal
        of T, in A's dtype.

    Raises:
        RuntimeError: the symbol is missing, or MKL reports a failure (its ``info`` is named).
        ValueError: A not square and Fortran-ordered.
    """
    n = A.shape[0]
    prefix = _prefix(A.dtype)
    fn = _symbol(prefix)
    if fn is None:
        raise RuntimeError("MKL ?syrdb is not exported by this torch build")
    if not (A.flags.f_contiguous and A.ndim == 2 and A.shape[1] == n):
        raise ValueError(f"A must be a square Fortran-ordered matrix, got shape {A.shape}")
    if n < MIN_N:
        raise ValueError(f"MKL ?syrdb is used for N >= {MIN_N}, got N = {n}")
    kd = max(1, min(kd, n // 4))
    d, e, tau = np.empty(n, A.dtype), np.empty(max(n - 1, 1), A.dtype), np.empty(max(n - 1, 1), A.dtype)
    Z, query = np.zeros(1, A.dtype), np.zeros(4, A.dtype)  # Z: not referenced for jobz = 'V'
    info = _int(0)

    def call(work: np.ndarray, lwork: int) -> None:
        fn(ctypes.c_char_p(b"V"), ctypes.c_char_p(b"L"), ctypes.byref(_int(n)), ctypes.byref(_int(kd)),
           A.ctypes.data_as(_P), ctypes.byref(_int(n)), d.ctypes.data_as(_P), e.ctypes.data_as(_P),
           tau.ctypes.data_as(_P), Z.ctypes.data_as(_P), ctypes.byref(_int(1)), work.ctypes.data_as(_P),
           ctypes.byref(_int(lwork)), ctypes.byref(info), ctypes.c_size_t(1), ctypes.c_size_t(1))
        if _info(info) != 0:
            raise RuntimeError(f"MKL {prefix}syrdb failed with info = {_info(info)} (N = {n}, kd = {kd})")

    call(query, -1)  # workspace query; never below (2kd + 1)·N + kd: MKL writes past a short workspace
    lwork = max(int(query[0]), (2 * kd + 1) * n + kd)
    call(np.empty(lwork, A.dtype), lwork)
    return A, d, e[:n - 1]


@functools.cache
def syrdb_ready(dtype: np.dtype) -> bool:
    """Whether :func:`syrdb_explicit` is present and right in ``dtype`` (float32 / float64): the
    probe :func:`probe_syrdb` passed (checked once per dtype and process; a failure is logged)."""
    return probe_syrdb(np.dtype(dtype))


def probe_syrdb(dtype: np.dtype) -> bool:
    """Reduce a fixed symmetric 256 × 256 matrix of ``dtype`` with ``mkl_lapack_?syrdb``.

    Accepted when every :func:`reduction_errors` (against SciPy's ``eigvalsh``) is within
    ``50·N·eps·‖A‖`` (eps of ``dtype``); otherwise, or when the call fails, one warning
    names the reason and False is returned.
    """
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(22)
    U, _ = np.linalg.qr(rng.standard_normal((_PROBE_N, _PROBE_N)))
    A = (U * np.logspace(0, -6, _PROBE_N)) @ U.T + 1e-3 * np.eye(_PROBE_N)  # (n, n) float64 reference
    A = (A + A.T) / 2
    scale = float(np.abs(np.linalg.eigvalsh(A)).max())
    tol = 50 * _PROBE_N * float(np.finfo(dtype).eps) * scale
    try:
        Q, d, e = syrdb_explicit(np.asfortranarray(A.astype(dtype)), KD)
    except RuntimeError as err:
        _log.warning("MKL ?syrdb unusable (%s); k: all reductions take SciPy's ?sytrd (several times slower)", err)
        return False
    errs = reduction_errors(A, Q, d, e)
    bad = {k: v for k, v in errs.items() if not v <= tol}
    if bad:
        _log.warning("MKL %ssyrdb disagrees with SciPy on a %d×%d %s probe (%s > %.1e); k: all reductions take "
                     "SciPy's ?sytrd (several times slower)", _prefix(dtype), _PROBE_N, _PROBE_N, dtype,
                     ", ".join(f"{k} = {v:.1e}" for k, v in bad.items()), tol)
        return False
    return True


def reduction_errors(A: np.ndarray, Q: np.ndarray, d: np.ndarray, e: np.ndarray) -> dict[str, float]:
    """How far ``A = Q T Qᵀ`` (T = tridiag(e, d, e)) is from true, in float64, as absolute errors:
    ``max|Q T Qᵀ − A|``, ``max|QᵀQ − I|·‖A‖₂`` and ``max|λ(T) − λ(A)|`` (inf where not finite).

    Args:
        A: (n, n) the symmetric matrix reduced; Q (n, n), d (n,), e (n − 1,) its reduction.

    Returns:
        The three errors by name.
    """
    import scipy.linalg as sl

    A, Q, d, e = (np.asarray(x, np.float64) for x in (A, Q, d, e))
    n = A.shape[0]
    if not all(np.isfinite(x).all() for x in (Q, d, e)):
        return {"|QTQ' - A|": float("inf"), "|Q'Q - I|·|A|": float("inf"), "|λ(T) - λ(A)|": float("inf")}
    w = sl.eigvalsh(A)
    T = np.diag(d) + np.diag(e, -1) + np.diag(e, 1)
    return {"|QTQ' - A|": float(np.abs(Q @ T @ Q.T - A).max()),
            "|Q'Q - I|·|A|": float(np.abs(Q.T @ Q - np.eye(n)).max() * np.abs(w).max()),
            "|λ(T) - λ(A)|": float(np.abs(sl.eigvalsh_tridiagonal(d, e) - w).max())}
