"""Every eigenvalue of a dense symmetric G and the projections ⟨v_i, φ⟩ of a few vectors φ,
without the (N, N) eigenvector matrix.

One tridiagonalisation ``G = Q T Qᵀ`` (the work of ``eigvalsh``), then ``ψ = Qᵀ Φ`` for the few
columns of Φ (2N²c flops), the eigenvalues of T (``dsterf``) and, with ``T = S diag(λ) Sᵀ``,

    Vᵀ Φ = Sᵀ Qᵀ Φ = Sᵀ ψ,

where S comes from divide and conquer on T (``dstevd``, float64): G's own (N, N) eigenvectors
``V = Q S`` — the N³ product that dominates ``eigh`` with vectors — are never formed.  A few
eigenvectors (the images of Fig. 5) are ``v_i = Q s_i``.

The reduction runs in G's precision (float32 or float64) by one of two :class:`Reduction` routes;
T's eigenproblem is always float64.  A float32 G therefore gets float32-accurate eigenvalues
(absolute errors ~ N·eps₃₂·λ_1 at worst, 4e-7·λ_1 measured at N = 10⁴ — less than the float32
rounding of G itself moves them) where a float64 ``eigh`` of the same G would be exact for that G.
Cost at N = 10⁴ float32 on 2 cores: ``benchmarks/kall.py`` and benchmarks/README.md (issue 22).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import numpy as np
import scipy.linalg.lapack as lapack

import logging

from nsa_dist.linalg._mkl_syrdb import MIN_N, syrdb_explicit, syrdb_ready

__all__ = ["Reduction", "SpectralProjections", "eig_projections"]

_log = logging.getLogger(__name__)


class Reduction(str, Enum):
    """How G is brought to tridiagonal form ``G = Q T Qᵀ``.

    AUTO: MKL where :func:`~nsa_dist.linalg._mkl_syrdb.syrdb_ready` proved it, else LAPACK.
    MKL: ``?syrdb`` (band reduction, BLAS-3, then band → tridiagonal) of the MKL inside torch,
        Q formed; ``Qᵀ Φ`` is one product.  Wins wherever it exists: about the cost of
        ``eigvalsh``, 2–4× faster than LAPACK's one-stage ``?sytrd`` at N = 10⁴ on 2 cores.
    LAPACK: SciPy's ``?sytrd`` (one-stage Householder: half its flops are memory-bound
        matrix-vector products) and ``?ormqr`` for ``Qᵀ Φ``; portable, the reference route.
    """

    AUTO = "auto"
    MKL = "mkl"
    LAPACK = "lapack"


@dataclass(frozen=True)
class SpectralProjections:
    """All eigenvalues of G and the coordinates of Φ in its eigenbasis.

    Attributes:
        evals: (N,) float64, descending.
        proj: (N, c) float64, ``proj[i, j] = ⟨v_i, φ_j⟩`` with v_i the eigenvector of evals[i].
        vectors: (N, m) float64, the eigenvectors of ``indices`` (0-based, into evals), each
            signed so that its largest-|entry| component is positive (as ``top_eigenpairs``).
        indices: the m indices of ``vectors``.
        reduction: the route that ran (MKL or LAPACK).
    """

    evals: np.ndarray
    proj: np.ndarray
    vectors: np.ndarray
    indices: tuple[int, ...]
    reduction: Reduction = Reduction.LAPACK


def eig_projections(G: Any, Phi: np.ndarray, indices: tuple[int, ...] = (),
                    reduction: str | Reduction = "auto") -> SpectralProjections:
    """λ_1 ≥ … ≥ λ_N of G and ``Vᵀ Φ``, plus the eigenvectors ``indices`` (see module docstring).

    Args:
        G: (N, N) symmetric matrix, NumPy or torch (CPU); reduced in its own precision when
            float32 or float64 (other dtypes: float64), on a copy, so G itself is left alone.  Its
            lower triangle is read (its upper one when C-ordered: the same for a symmetric G).
        Phi: (N, c) or (N,) float vectors φ_j.
        indices: 0-based positions (in descending order of λ) of eigenvectors to return.
        reduction: "auto" | "mkl" | "lapack" (see :class:`Reduction`).

    Returns:
        :class:`SpectralProjections`.

    Raises:
        ShapeError: G not square, or Phi's rows ≠ N.
        ValueError: an index outside 0..N−1, an unknown reduction, or "mkl" where
            MKL's ``?syrdb`` is missing or failed its probe.
        RuntimeError: LAPACK reports a failure (its ``info`` is named).
    """
    from nsa_dist._checks import parse_enum
    from nsa_dist.errors import ShapeError

    route = parse_enum(Reduction, reduction, "reduction")
    G_np = G.detach().cpu().numpy() if hasattr(G, "detach") else np.asarray(G)
    dtype = G_np.dtype if G_np.dtype in (np.float32, np.float64) else np.dtype(np.float64)
    if G_np.ndim != 2 or G_np.shape[0] != G_np.shape[1]:
        raise ShapeError(f"G must be a square (N, N) matrix, got shape {G_np.shape}")
    N = G_np.shape[0]
    if np.ndim(Phi) not in (1, 2) or np.shape(Phi)[0] != N:
        raise ShapeError(f"Phi must be (N,) or (N, c) with N = {N}, got shape {np.shape(Phi)}")
    Phi2 = np.asarray(Phi, dtype=np.float64).reshape(N, -1)  # (N, c)
    if any(not 0 <= i < N for i in indices):
        raise ValueError(f"indices must lie in 0..{N - 1}; got {list(indices)}")
    if route is Reduction.AUTO:
        route = Reduction.MKL if N >= MIN_N and syrdb_ready(dtype) else Reduction.LAPACK
    elif route is Reduction.MKL and (N < MIN_N or not syrdb_ready(dtype)):
        raise ValueError(f"reduction='mkl' needs N >= {MIN_N} (got {N}) and MKL ?syrdb present and passing its "
                         f"probe in {dtype} (see the log); use 'auto' or 'lapack'")
    d = e = apply_qt = apply_q = None
    G_f = G_np.T if G_np.flags.c_contiguous else G_np  # symmetric: Gᵀ's Fortran copy is a plain memcpy
    if route is Reduction.MKL:
        d, e, apply_qt, apply_q = _mkl(np.array(G_f, dtype=dtype, order="F"))
        bad = _residual(G_np, d, e, apply_qt, apply_q)
        if bad is not None:  # never seen at kd ≤ N/4; proven on every call all the same (3 products)
            _log.warning("MKL ?syrdb's reduction of this %d×%d G is off (%s); redone by SciPy's ?sytrd", N, N, bad)
            route = Reduction.LAPACK
    if route is Reduction.LAPACK:
        d, e, apply_qt, apply_q = _lapack(np.array(G_f, dtype=dtype, order="F"))
    psi = apply_qt(Phi2)  # (N, c) = Qᵀ Φ
    w, S = _tridiagonal_eigh(d, e)  # (N,) ascending, (N, N)
    proj = S.T @ psi  # (N, c)
    cols = [N - 1 - i for i in indices]
    V = apply_q(np.array(S[:, cols])) if indices else np.empty((N, 0))  # (N, m)
    del S
    flip = V[np.abs(V).argmax(axis=0), np.arange(V.shape[1])] < 0 if V.size else np.zeros(0, bool)
    V[:, flip] *= -1
    return SpectralProjections(w[::-1].copy(), proj[::-1].copy(), V, tuple(indices), route)


_Apply = Callable[[np.ndarray], np.ndarray]


def _ok(name: str, info: int) -> None:
    if info != 0:
        raise RuntimeError(f"LAPACK {name} failed with info = {info}")


def _mkl(A: np.ndarray) -> tuple[np.ndarray, np.ndarray, _Apply, _Apply]:
    """MKL ``?syrdb`` with Q formed: (d, e) float64 and X ↦ Qᵀ X, X ↦ Q X (float64 accumulation)."""
    Q, d, e = syrdb_explicit(A)  # Q (N, N) in A's dtype, A's own memory

    def qt(X: np.ndarray) -> np.ndarray:
        return _blocked(Q, X, transpose=True)

    def q(X: np.ndarray) -> np.ndarray:
        return _blocked(Q, X, transpose=False)

    return d.astype(np.float64), e.astype(np.float64), qt, q


def _residual(G: np.ndarray, d: np.ndarray, e: np.ndarray, qt: _Apply, q: _Apply) -> str | None:
    """Whether ``G = Q T Qᵀ`` holds on a fixed random x: ``‖G x − Q T Qᵀ x‖ ≤ tol·‖G‖_F‖x‖`` and
    ``|‖Qᵀ x‖ − ‖x‖| ≤ tol·‖x‖`` with tol = max(100√N, 1000)·eps of G's dtype (a wrong reduction
    is off by O(1)); None when it holds, else what is off."""
    N = G.shape[0]
    eps = float(np.finfo(G.dtype if G.dtype in (np.float32, np.float64) else np.float64).eps)
    tol = max(100 * np.sqrt(N), 1000) * eps
    x = np.random.default_rng(0).standard_normal((N, 1))  # (N, 1)
    y = qt(x)  # Qᵀ x
    Ty = d[:, None] * y
    Ty[:-1] += e[:, None] * y[1:]
    Ty[1:] += e[:, None] * y[:-1]
    r = float(np.linalg.norm(_blocked(G, x, transpose=False) - q(Ty)) / (np.linalg.norm(G) * np.linalg.norm(x)))
    o = abs(float(np.linalg.norm(y) / np.linalg.norm(x)) - 1.0)
    if r <= tol and o <= tol:
        return None
    return f"‖G x − Q T Qᵀ x‖ / ‖G‖‖x‖ = {r:.1e}, |‖Qᵀ x‖/‖x‖ − 1| = {o:.1e}, allowed {tol:.1e}"


def _blocked(Q: np.ndarray, X: np.ndarray, transpose: bool, rows: int = 1024) -> np.ndarray:
    """Qᵀ X or Q X in float64 from a float32/float64 Q (any order), ``rows`` rows of Q at a time (no
    float64 copy of Q)."""
    N = Q.shape[0]
    out = np.zeros((N, X.shape[1]))
    for lo in range(0, N, rows):
        Qb = Q[lo:lo + rows].astype(np.float64)  # (rows, N)
        if transpose:
            out += Qb.T @ X[lo:lo + rows]
        else:
            out[lo:lo + rows] = Qb @ X
    return out


def _lapack(A: np.ndarray) -> tuple[np.ndarray, np.ndarray, _Apply, _Apply]:
    """SciPy ``?sytrd(lower)`` and ``?ormqr``: Q = H_1 ⋯ H_{N−1}, H_i = I − τ_i u_i u_iᵀ with
    u_i = (0…0, 1, c[i+2:, i]) (1 at row i + 1), i.e. the QR-form reflectors of c[1:, :N−1]
    acting on rows 1.. (LAPACK's ``?ormtr`` for uplo = 'L')."""
    s = "s" if A.dtype == np.float32 else "d"
    c, d, e, tau, info = getattr(lapack, f"{s}sytrd")(A, lower=1, overwrite_a=1)
    _ok(f"{s}sytrd", info)
    N = A.shape[0]
    U = np.asfortranarray(c[1:, :N - 1])  # (N − 1, N − 1) reflectors below the diagonal

    def apply(X: np.ndarray, trans: str) -> np.ndarray:
        X = np.array(X, dtype=A.dtype, order="F")  # (N, m)
        if N > 1 and X.shape[1]:
            out, _, info = getattr(lapack, f"{s}ormqr")("L", trans, U, tau[:N - 1], X[1:], max(1, 64 * X.shape[1]),
                                                         overwrite_c=1)
            _ok(f"{s}ormqr", info)
            X[1:] = out
        return X.astype(np.float64)

    return d.astype(np.float64), e.astype(np.float64), lambda X: apply(X, "T"), lambda X: apply(X, "N")


def _tridiagonal_eigh(d: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (N,) ascending and eigenvectors S (N, N) of T = tridiag(e, d, e), float64, by
    divide and conquer (LAPACK ``dstevd``: its merges are GEMMs, and an NTK's many near-zero
    eigenvalues deflate; 13 s at N = 10⁴ where chunked MRRR took ~30 s)."""
    if d.shape[0] == 1:
        return d.copy(), np.ones((1, 1))
    w, S, info = lapack.dstevd(d, e, compute_v=1)
    _ok("dstevd", info)
    return w, S
