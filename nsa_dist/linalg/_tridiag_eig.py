"""T's eigenproblem for :mod:`nsa_dist.linalg.tridiag` (private): ``T = S diag(λ) Sᵀ`` as far as it is
used — S whole by divide and conquer (MKL ``dstedc`` or SciPy ``dstevd``), or only the rows of S a
caller needs (S's first row, ψᵀS) by the rows-only divide and conquer of
:func:`~nsa_dist.linalg._mkl_stedc.rows_of_s`, each proven (probes once, checks per call)."""

from __future__ import annotations

import logging
from enum import Enum

import numpy as np
import scipy.linalg.lapack as lapack

__all__ = ["Solver", "lapack_ok", "solve_tridiagonal"]

_log = logging.getLogger(__name__)


class Solver(str, Enum):
    """How T = S diag(λ) Sᵀ is solved: divide and conquer in float64 either way.

    AUTO: ROWS, else MKL, where their probes passed
        (:mod:`nsa_dist.linalg._mkl_stedc`), else LAPACK (a probe's failure is logged once).
    MKL: ``dstedc(compz='I')`` of the MKL inside torch (S whole): at N = 10⁴ on 2 cores 5.2–5.9 s
        against 7.5–8.9 s for SciPy's in one session, 7.3–7.7 against 6.5 s in another — no
        clear winner; ROWS took 1.7–2.1 s there (benchmarks/README.md).
    LAPACK: SciPy's ``dstevd`` (OpenBLAS's LAPACK), S whole; portable, the reference (and the
        route before the MKL ones, which benchmarks compare against by asking for it).
    ROWS: divide and conquer carrying only the rows of S that are used — S's first row for
        :func:`~nsa_dist.linalg.tridiag.eig_weights`, ψᵀS for
        :func:`~nsa_dist.linalg.tridiag.eig_projections` — with MKL's ``dlaed4`` for the
        secular equations, and the few eigenvector columns asked for by inverse iteration:
        O(c·N²) flops, no (N, N) S.
    """

    AUTO = "auto"
    MKL = "mkl"
    LAPACK = "lapack"
    ROWS = "rows"


def lapack_ok(name: str, info: int) -> None:
    if info != 0:
        raise RuntimeError(f"LAPACK {name} failed with info = {info}")


def solve_tridiagonal(
    d: np.ndarray, e: np.ndarray, X: np.ndarray, solver: str | Solver, cols: list[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Solver]:
    """T = tridiag(e, d, e) = S diag(λ) Sᵀ as far as it is used: λ (N,) ascending, Sᵀ X (N, c), S[0, :] (N,),
    the columns S[:, cols] (N, m, 0-based ascending positions), and the :class:`Solver` that ran.

    ROWS (where asked for, or AUTO with its probe passed) carries the rows, and the
    few columns come from bisection and inverse iteration on T (LAPACK ``dstebz`` + ``dstein``,
    O(N) each); both are checked per call (:func:`_rows_errors`, :func:`_columns_errors`); on a failure
    (a warning) and otherwise S is formed whole by :func:`_tridiagonal_eigh`.

    Raises:
        ValueError: an unknown solver, or "rows" where its probe failed.
    """
    from nsa_dist._checks import parse_enum
    from nsa_dist.linalg._mkl_stedc import first_row_ready, rows_of_s

    route = parse_enum(Solver, solver, "solver")
    if route is Solver.ROWS and not first_row_ready():
        raise ValueError(
            "solver='rows' needs MKL dlaed4 present and passing its probe (see the log); use 'auto', 'mkl' or 'lapack'"
        )
    if route is Solver.ROWS or route is Solver.AUTO and first_row_ready():
        lam, M = rows_of_s(d, e, X)  # (2 + c, N): S[0], S[−1], XᵀS
        Sc, bad = _columns(d, e, lam, cols)
        bad = bad or _rows_errors(d, e, X, lam, M[2:])
        if bad is None:
            return lam, M[2:].T.copy(), M[0].copy(), Sc, Solver.ROWS
        _log.warning("the rows-only divide and conquer of this T is off (%s); S formed whole", bad)
        route = Solver.AUTO
    lam, S, used = _tridiagonal_eigh(d, e, route)
    return lam, S.T @ X, np.array(S[0]), np.array(S[:, cols]), used


def _columns(d: np.ndarray, e: np.ndarray, lam: np.ndarray, cols: list[int]) -> tuple[np.ndarray, str | None]:
    """S[:, cols] (N, m) by bisection and inverse iteration (SciPy ``eigh_tridiagonal``, ``stebz``), and
    None when each column is a unit vector with ``‖T s − λ s‖∞ ≤ 100·N·eps₆₄·‖T‖`` for its λ of ``lam``,
    else what is off (inverse iteration that failed to converge included)."""
    from scipy.linalg import LinAlgError, eigh_tridiagonal

    N = d.shape[0]
    Sc = np.empty((N, len(cols)))
    try:
        for j, c in enumerate(cols):
            Sc[:, j] = eigh_tridiagonal(d, e, select="i", select_range=(c, c), lapack_driver="stebz")[1][:, 0]
    except LinAlgError as err:
        return Sc, f"inverse iteration: {err}"
    TS = d[:, None] * Sc
    TS[:-1] += e[:, None] * Sc[1:]
    TS[1:] += e[:, None] * Sc[:-1]
    norm = max(float(np.abs(lam).max()), np.finfo(np.float64).tiny)
    res = np.abs(TS - Sc * lam[cols]).max(initial=0.0) / norm
    unit = np.abs(np.linalg.norm(Sc, axis=0) - 1.0).max(initial=0.0)
    tol = 100 * N * float(np.finfo(np.float64).eps)
    return Sc, None if res <= tol and unit <= tol else f"columns {cols}: residual {res:.1e}, |‖s‖ − 1| {unit:.1e}"


def _rows_errors(d: np.ndarray, e: np.ndarray, X: np.ndarray, lam: np.ndarray, P: np.ndarray) -> str | None:
    """Whether P = XᵀS (c, N) fits T and X: Σ_i P_ji² λ_i^m = x_jᵀ T^m x_j for m = 0, 1, 2 within
    ``100·N·eps₆₄·‖T‖^m·‖x_j‖²`` (divide and conquer is backward stable in float64: S exact for T + E,
    ‖E‖ ≤ O(N·eps)‖T‖); None when it holds, else what is off."""
    N = d.shape[0]
    if not X.shape[1]:
        return None
    TX = d[:, None] * X
    TX[:-1] += e[:, None] * X[1:]
    TX[1:] += e[:, None] * X[:-1]
    norm = max(float(np.abs(lam).max()), np.finfo(np.float64).tiny)
    tol = 100 * N * float(np.finfo(np.float64).eps) * (X * X).sum(axis=0)  # (c,)
    refs = ((X * X).sum(axis=0), (X * TX).sum(axis=0), (TX * TX).sum(axis=0))
    bad = [
        f"m = {m}: {float(np.max(np.abs((P**2) @ lam**m - ref) / (tol * norm**m))):.1e} × allowed"
        for m, ref in enumerate(refs)
        if not np.all(np.abs((P**2) @ lam**m - ref) <= tol * norm**m)
    ]
    return "; ".join(bad) if bad else None


def _tridiagonal_eigh(
    d: np.ndarray, e: np.ndarray, solver: str | Solver = "auto"
) -> tuple[np.ndarray, np.ndarray, Solver]:
    """Eigenvalues (N,) ascending and eigenvectors S (N, N) of T = tridiag(e, d, e), float64, by
    divide and conquer (its merges are GEMMs, and an NTK's many near-zero eigenvalues deflate;
    13 s at N = 10⁴ by SciPy's where chunked MRRR took ~30 s), and the :class:`Solver` that ran.

    Raises:
        ValueError: an unknown solver, or "mkl" where MKL's ``dstedc`` is missing or failed its probe.
        RuntimeError: LAPACK reports a failure.
    """
    from nsa_dist._checks import parse_enum
    from nsa_dist.linalg._mkl_stedc import stedc, stedc_ready

    route = parse_enum(Solver, solver, "solver")
    if route in (Solver.MKL, Solver.AUTO) and d.shape[0] > 1 and stedc_ready():
        return (*stedc(d, e), Solver.MKL)
    if route is Solver.MKL and d.shape[0] > 1:
        raise ValueError(
            "solver='mkl' needs MKL dstedc present and passing its probe (see the log); use 'auto' or 'lapack'"
        )
    if d.shape[0] == 1:
        return d.copy(), np.ones((1, 1)), Solver.LAPACK
    w, S, info = lapack.dstevd(d, e, compute_v=1)
    lapack_ok("dstevd", info)
    return w, S, Solver.LAPACK
