"""MKL's successive-band tridiagonalisation ``?syrdb`` through the MKL inside torch (private; ctypes).

``?syrdb`` reduces a dense symmetric A to band form (bandwidth ``kd``, BLAS-3) and the band to a
tridiagonal T, ``A = Q T Qᵀ``; with ``jobz = 'V'`` it also forms Q in A's place.  Its cost with Q
formed is about that of ``eigvalsh`` (MKL ``?syevd`` without vectors), while the one-stage
``?sytrd`` (SciPy's, or MKL's own) takes 3–6× that at N = 10⁴ on 2 cores (benchmarks/README.md).
SciPy does not wrap it; torch's ``libtorch_cpu.so`` links MKL statically and exports
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

__all__ = [
    "KD_VALUES",
    "MIN_N",
    "first_column_ready",
    "fortran_info",
    "fortran_int",
    "mkl_function",
    "probe_first_column",
    "probe_syrdb",
    "probe_verdict",
    "reduction_errors",
    "syrdb_explicit",
    "syrdb_ready",
    "syrdb_values",
]

_log = logging.getLogger(__name__)
# band of the first stage: jobz = V at N = 10⁴ float32 under the same load, kd 32 137 s, 64 80 s, 128 67 s,
# 256 64 s
KD = 128
KD_VALUES = 128  # the band for jobz = 'N' (benchmarks/README.md)
MIN_N = 16  # smaller G: SciPy's route (instant there)
_PROBE_N = 256
_P = ctypes.c_void_p


@functools.cache
def mkl_function(name: str) -> ctypes._CFuncPtr | None:
    """The function ``name`` (e.g. ``mkl_lapack_ssyrdb``) of torch's libtorch_cpu.so, or None where it is
    not exported (a torch built without MKL)."""
    try:
        import torch

        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        fn = getattr(lib, name)
    except (OSError, AttributeError):
        return None
    fn.restype = None
    return fn


def _symbol(prefix: str) -> ctypes._CFuncPtr | None:
    """``mkl_lapack_{prefix}syrdb``, or None."""
    return mkl_function(f"mkl_lapack_{prefix}syrdb")


def _prefix(dtype: np.dtype) -> str:
    return {np.dtype(np.float32): "s", np.dtype(np.float64): "d"}[np.dtype(dtype)]


def fortran_int(v: int) -> ctypes.c_int64:
    """A Fortran INTEGER: 8 zeroed bytes hold a small value for both LP64 (4-byte) and ILP64 MKL."""
    return ctypes.c_int64(v)


def fortran_info(v: ctypes.c_int64) -> int:
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
    d, e = _syrdb(A, kd, b"V")
    return A, d, e


def syrdb_values(A: np.ndarray, kd: int = KD_VALUES) -> tuple[np.ndarray, np.ndarray]:
    """T of ``A = Q T Qᵀ`` by MKL ``?syrdb(jobz='N', uplo='L')``: Q is neither formed nor kept.

    With uplo = 'L' every reflector of both stages acts on rows 1…N−1, so ``Q e₁ = e₁`` — what the
    one-vector route of :mod:`nsa_dist.linalg.tridiag` rests on, proven by :func:`probe_first_column`.

    Args:
        A: as :func:`syrdb_explicit` (overwritten by work); kd: its band, clipped the same way.

    Returns:
        (d, e): (N,) and (N − 1,) in A's dtype.

    Raises:
        as :func:`syrdb_explicit`.
    """
    return _syrdb(A, kd, b"N")


def _syrdb(A: np.ndarray, kd: int, jobz: bytes) -> tuple[np.ndarray, np.ndarray]:
    """One ``?syrdb(jobz, uplo='L')`` call on A in place (after its workspace query): (d, e)."""
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
    Z, query = np.zeros(1, A.dtype), np.zeros(4, A.dtype)  # Z: referenced only for jobz = 'U'
    info = fortran_int(0)

    def call(work: np.ndarray, lwork: int) -> None:
        fn(
            ctypes.c_char_p(jobz),
            ctypes.c_char_p(b"L"),
            ctypes.byref(fortran_int(n)),
            ctypes.byref(fortran_int(kd)),
            A.ctypes.data_as(_P),
            ctypes.byref(fortran_int(n)),
            d.ctypes.data_as(_P),
            e.ctypes.data_as(_P),
            tau.ctypes.data_as(_P),
            Z.ctypes.data_as(_P),
            ctypes.byref(fortran_int(1)),
            work.ctypes.data_as(_P),
            ctypes.byref(fortran_int(lwork)),
            ctypes.byref(info),
            ctypes.c_size_t(1),
            ctypes.c_size_t(1),
        )
        if fortran_info(info) != 0:
            raise RuntimeError(f"MKL {prefix}syrdb failed with info = {fortran_info(info)} (N = {n}, kd = {kd})")

    call(query, -1)  # workspace query; never below (2kd + 1)·N + kd: MKL writes past a short workspace
    lwork = max(int(query[0]), (2 * kd + 1) * n + kd)
    call(np.empty(lwork, A.dtype), lwork)
    return d, e[: n - 1]


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
    A = _probe_matrix(_PROBE_N)
    scale = float(np.abs(np.linalg.eigvalsh(A)).max())
    tol = 50 * _PROBE_N * float(np.finfo(dtype).eps) * scale
    try:
        Q, d, e = syrdb_explicit(np.asfortranarray(A.astype(dtype)), KD)
    except RuntimeError as err:
        _log.warning("MKL ?syrdb unusable (%s); k: all reductions take SciPy's ?sytrd (several times slower)", err)
        return False
    return probe_verdict(
        reduction_errors(A, Q, d, e),
        tol,
        f"MKL {_prefix(dtype)}syrdb disagrees with SciPy on a {_PROBE_N}×{_PROBE_N} {dtype} probe",
        "k: all reductions take SciPy's ?sytrd (several times slower)",
    )


def probe_verdict(errs: dict[str, float], tol: float, what: str, instead: str) -> bool:
    """Whether every error of a probe is within ``tol``; if not, one warning ``what (errors > tol);
    instead`` in this module's log."""
    bad = {k: v for k, v in errs.items() if not v <= tol}
    if bad:
        _log.warning("%s (%s > %.1e); %s", what, ", ".join(f"{k} = {v:.1e}" for k, v in bad.items()), tol, instead)
    return not bad


def _probe_matrix(n: int) -> np.ndarray:
    """A fixed symmetric (n, n) float64 matrix with eigenvalues 1 … 1e-6 (log-spaced) + 1e-3."""
    rng = np.random.default_rng(22)
    U, _ = np.linalg.qr(rng.standard_normal((n, n)))
    A = (U * np.logspace(0, -6, n)) @ U.T + 1e-3 * np.eye(n)
    return (A + A.T) / 2


@functools.cache
def first_column_ready(dtype: np.dtype) -> bool:
    """Whether :func:`syrdb_values` may be trusted to leave e₁ fixed (``Q e₁ = e₁``) in ``dtype``:
    :func:`syrdb_ready` and :func:`probe_first_column` passed (once per dtype and process)."""
    return syrdb_ready(np.dtype(dtype)) and probe_first_column(np.dtype(dtype))


def probe_first_column(dtype: np.dtype) -> bool:
    """Prove on a fixed (4·KD_VALUES)² matrix (so the band is the one used at scale) that MKL's
    ``?syrdb(uplo='L')`` leaves e₁ fixed, and that its ``jobz = 'N'`` run yields the T of its
    ``jobz = 'V'`` run.

    Accepted when, with Q formed, every :func:`reduction_errors` is within ``50·n·eps·‖A‖``,
    ``max|Q[:, 0] − e₁|`` and ``max|Q[0, :] − e₁ᵀ|`` within ``50·n·eps``, and the ``jobz = 'N'``
    diagonal and |off-diagonal| within ``50·n·eps·‖A‖`` of the ``jobz = 'V'`` ones; otherwise (or
    when a call fails) one warning names what is off and False is returned.
    """
    dtype = np.dtype(dtype)
    n = 4 * KD_VALUES
    A = _probe_matrix(n)
    eps = float(np.finfo(dtype).eps)
    scale = float(np.abs(np.linalg.eigvalsh(A)).max())
    try:
        Q, d, e = syrdb_explicit(np.asfortranarray(A.astype(dtype)), KD_VALUES)
        d_n, e_n = syrdb_values(np.asfortranarray(A.astype(dtype)), KD_VALUES)
    except RuntimeError as err:
        _log.warning("MKL ?syrdb unusable (%s); the one-vector k: all route takes SciPy's ?sytrd", err)
        return False
    Q = Q.astype(np.float64)
    e1 = np.eye(n)[0]
    errs = {
        **{k: v / scale for k, v in reduction_errors(A, Q, d, e).items()},
        "|Q[:, 0] - e1|": float(np.abs(Q[:, 0] - e1).max()),
        "|Q[0, :] - e1|": float(np.abs(Q[0] - e1).max()),
        "|d(N) - d(V)|/|A|": float(np.abs(d_n.astype(np.float64) - d).max()) / scale,
        "||e(N)| - |e(V)||/|A|": float(np.abs(np.abs(e_n.astype(np.float64)) - np.abs(e)).max()) / scale,
    }
    return probe_verdict(
        errs,
        50 * n * eps,
        f"MKL {_prefix(dtype)}syrdb does not keep e1 fixed on a {n}×{n} {dtype} probe",
        "the one-vector k: all route takes SciPy's ?sytrd",
    )


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
    return {
        "|QTQ' - A|": float(np.abs(Q @ T @ Q.T - A).max()),
        "|Q'Q - I|·|A|": float(np.abs(Q.T @ Q - np.eye(n)).max() * np.abs(w).max()),
        "|λ(T) - λ(A)|": float(np.abs(sl.eigvalsh_tridiagonal(d, e) - w).max()),
    }
