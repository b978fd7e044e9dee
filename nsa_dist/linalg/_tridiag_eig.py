"""T's eigenproblem for :mod:`nsa_dist.linalg.tridiag` (private): ``T = S diag(λ) Sᵀ`` as far as it is
used — S whole by divide and conquer (MKL ``dstedc`` or SciPy ``dstevd``), or only the rows of S a
caller needs (S's first row, ψᵀS) by the rows-only divide and conquer of
:func:`~nsa_dist.linalg._mkl_stedc.rows_of_s`, each proven (probes once, checks per call)."""

from __future__ import annotations

import logging
from enum import Enum

import numpy as np
import scipy.linalg.lapack as lapack

__all__ = ["MKL_STEDC", "Solver", "lapack_ok", "solve_tridiagonal"]

_log = logging.getLogger(__name__)

# Solver.AUTO takes the rows-only divide and conquer (no eigenvector asked for) or MKL's dstedc where their
# probes passed.  False: SciPy's dstevd, S whole (the route before, for benchmarks).
MKL_STEDC = True


class Solver(str, Enum):
    """How T = S diag(λ) Sᵀ is solved: divide and conquer in float64 either way.

    AUTO: ROWS where no eigenvector is asked for, else MKL, where their probes passed
        (:mod:`nsa_dist.linalg._mkl_stedc`), else LAPACK (a probe's failure is logged once).
    MKL: ``dstedc(compz='I')`` of the MKL inside torch: its merges' GEMMs run on MKL; 5.2–5.9 s
        against 7.5–8.9 s for SciPy's at N = 10⁴ on 2 cores.
    LAPACK: SciPy's ``dstevd`` (OpenBLAS's LAPACK); portable, the reference.
    ROWS: divide and conquer carrying only the rows of S that are used — S's first row for
        :func:`~nsa_dist.linalg.tridiag.eig_weights`, ψᵀS for
        :func:`~nsa_dist.linalg.tridiag.eig_projections` — with MKL's ``dlaed4`` for the
        secular equations: O(c·N²) flops, no (N, N) S; not where eigenvectors are asked for.
    """

    AUTO = "auto"
    MKL = "mkl"
    LAPACK = "lapack"
    ROWS = "rows"


def lapack_ok(name: str, info: int) -> None:
    if info != 0:
        raise RuntimeError(f"LAPACK {name} failed with info = {info}")


def solve_tridiagonal(d: np.ndarray, e: np.ndarray, X: np.ndarray, solver: str | Solver, cols: list[int]
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Solver]:
    """T = tridiag(e, d, e) = S diag(λ) Sᵀ as far as it is used: λ (N,) ascending, Sᵀ X (N, c), S[0, :] (N,),
    the columns S[:, cols] (N, m), and the :class:`Solver` that ran.  ROWS (where asked for, or AUTO with
    ``MKL_STEDC``, no columns and its probe passed) is checked per call by :func:`_rows_errors`; on a
    failure (a warning) and otherwise S is formed whole by :func:`_tridiagonal_eigh`.

    Raises:
        ValueError: an unknown solver, "rows" with columns asked for, or a solver whose probe failed.
    """
    from nsa_dist._checks import parse_enum
    from nsa_dist.linalg._mkl_stedc import first_row_ready, rows_of_s

    route = parse_enum(Solver, solver, "solver")
    if route is Solver.ROWS and (cols or not first_row_ready()):
        raise ValueError("solver='rows' gives no eigenvector columns and needs MKL dlaed4 passing its probe (see the "
                         "log); use 'auto', 'mkl' or 'lapack'")
    if route is Solver.ROWS or route is Solver.AUTO and MKL_STEDC and not cols and first_row_ready():
        lam, M = rows_of_s(d, e, X)  # (2 + c, N): S[0], S[−1], XᵀS
        bad = _rows_errors(d, e, X, lam, M[2:])
        if bad is None:
            return lam, M[2:].T.copy(), M[0].copy(), np.empty((d.shape[0], 0)), Solver.ROWS
        _log.warning("the rows-only divide and conquer of this T is off (%s); S formed whole", bad)
        route = Solver.AUTO
    lam, S, used = _tridiagonal_eigh(d, e, route)
    return lam, S.T @ X, np.array(S[0]), np.array(S[:, cols]), used


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
    bad = [f"m = {m}: {float(np.max(np.abs((P ** 2) @ lam ** m - ref) / (tol * norm ** m))):.1e} × allowed"
           for m, ref in enumerate(refs) if not np.all(np.abs((P ** 2) @ lam ** m - ref) <= tol * norm ** m)]
    return "; ".join(bad) if bad else None


def _tridiagonal_eigh(d: np.ndarray, e: np.ndarray, solver: str | Solver = "auto"
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
    if (route is Solver.MKL or route is Solver.AUTO and MKL_STEDC) and d.shape[0] > 1 and stedc_ready():
        return (*stedc(d, e), Solver.MKL)
    if route is Solver.MKL and d.shape[0] > 1:
        raise ValueError("solver='mkl' needs MKL dstedc present and passing its probe (see the log); "
                         "use 'auto' or 'lapack'")
    if d.shape[0] == 1:
        return d.copy(), np.ones((1, 1)), Solver.LAPACK
    w, S, info = lapack.dstevd(d, e, compute_v=1)
    lapack_ok("dstevd", info)
    return w, S, Solver.LAPACK
