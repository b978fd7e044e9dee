"""Every eigenvalue of a dense symmetric G and the projections ⟨v_i, φ⟩ of a few vectors φ,
without the (N, N) eigenvector matrix.

One tridiagonalisation ``G = Q T Qᵀ`` (the work of ``eigvalsh``), then ``ψ = Qᵀ Φ`` for the few
columns of Φ (2N²c flops), the eigenvalues of T (``dsterf``) and, with ``T = S diag(λ) Sᵀ``,

    Vᵀ Φ = Sᵀ Qᵀ Φ = Sᵀ ψ,

where S comes from divide and conquer on T (float64): G's own (N, N) eigenvectors
``V = Q S`` — the N³ product that dominates ``eigh`` with vectors — are never formed.  A few
eigenvectors (the images of Fig. 5) are ``v_i = Q s_i``.

With ONE φ (:func:`eig_weights`, a step's test half: φ = f_test) Q is not needed at all: G is
reflected so that e₁ ∝ φ, the reduction (which leaves e₁ fixed) runs with jobz = 'N', and
⟨v_i, φ⟩ = ±‖φ‖ S[0, i] — proven per call by cheap checks, the Q route otherwise.

The reduction runs in G's precision (float32 or float64) by one of two :class:`Reduction` routes;
T's eigenproblem is always float64 (MKL's ``dstedc`` or SciPy's ``dstevd``, :class:`Solver`).  A
float32 G therefore gets float32-accurate eigenvalues (absolute errors ~ N·eps₃₂·λ_1 at worst,
4e-7·λ_1 measured at N = 10⁴ — less than the float32 rounding of G itself moves them) where a
float64 ``eigh`` of the same G would be exact for that G.
Cost at N = 10⁴ float32 on 2 cores: ``benchmarks/kall.py`` and benchmarks/README.md.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import scipy.linalg.lapack as lapack

from nsa_dist.linalg._mkl_syrdb import MIN_N, syrdb_explicit, syrdb_ready
from nsa_dist.linalg._tridiag_eig import Solver, lapack_ok, solve_tridiagonal

__all__ = ["Reduction", "Solver", "SpectralProjections", "eig_projections", "eig_weights"]

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
        solver: the divide and conquer that solved T (MKL or LAPACK).
        one_vector: whether :func:`eig_weights` answered without Q (its checks passed).
        checks: :func:`eig_weights`'s proofs as (name, error, tolerance), whether they passed or not.
    """

    evals: np.ndarray
    proj: np.ndarray
    vectors: np.ndarray
    indices: tuple[int, ...]
    reduction: Reduction = Reduction.LAPACK
    solver: Solver = Solver.LAPACK
    one_vector: bool = False
    checks: tuple[tuple[str, float, float], ...] = ()


def eig_projections(
    G: Any,
    Phi: np.ndarray,
    indices: tuple[int, ...] = (),
    reduction: str | Reduction = "auto",
    solver: str | Solver = "auto",
) -> SpectralProjections:
    """λ_1 ≥ … ≥ λ_N of G and ``Vᵀ Φ``, plus the eigenvectors ``indices`` (see module docstring).

    Args:
        G: (N, N) symmetric matrix, NumPy or torch (CPU); reduced in its own precision when
            float32 or float64 (other dtypes: float64), on a copy, so G itself is left alone.  Its
            lower triangle is read (its upper one when C-ordered: the same for a symmetric G).
        Phi: (N, c) or (N,) float vectors φ_j.
        indices: 0-based positions (in descending order of λ) of eigenvectors to return.
        reduction: "auto" | "mkl" | "lapack" (see :class:`Reduction`).
        solver: "auto" | "mkl" | "lapack" (see :class:`Solver`).

    Returns:
        :class:`SpectralProjections`.

    Raises:
        ShapeError: G not square, or Phi's rows ≠ N.
        ValueError: an index outside 0..N−1, an unknown reduction or solver, or "mkl" where
            MKL's ``?syrdb`` (``dstedc``) is missing or failed its probe.
        RuntimeError: LAPACK reports a failure (its ``info`` is named).
    """
    from nsa_dist._checks import parse_enum
    from nsa_dist.errors import ShapeError

    route = parse_enum(Reduction, reduction, "reduction")
    G_np, dtype = _square(G)
    N = G_np.shape[0]
    if np.ndim(Phi) not in (1, 2) or np.shape(Phi)[0] != N:
        raise ShapeError(f"Phi must be (N,) or (N, c) with N = {N}, got shape {np.shape(Phi)}")
    Phi2 = np.asarray(Phi, dtype=np.float64).reshape(N, -1)  # (N, c)
    if any(not 0 <= i < N for i in indices):
        raise ValueError(f"indices must lie in 0..{N - 1}; got {list(indices)}")
    if route is Reduction.AUTO:
        route = Reduction.MKL if N >= MIN_N and syrdb_ready(dtype) else Reduction.LAPACK
    elif route is Reduction.MKL and (N < MIN_N or not syrdb_ready(dtype)):
        raise ValueError(
            f"reduction='mkl' needs N >= {MIN_N} (got {N}) and MKL ?syrdb present and passing its "
            f"probe in {dtype} (see the log); use 'auto' or 'lapack'"
        )
    d = e = apply_qt = apply_q = None
    if route is Reduction.MKL:
        d, e, apply_qt, apply_q = _mkl(_fortran_copy(G_np, dtype))
        bad = _residual(G_np, d, e, apply_qt, apply_q)
        if bad is not None:  # never seen at kd ≤ N/4; proven on every call all the same (3 products)
            _log.warning("MKL ?syrdb's reduction of this %d×%d G is off (%s); redone by SciPy's ?sytrd", N, N, bad)
            route = Reduction.LAPACK
    if route is Reduction.LAPACK:
        d, e, apply_qt, apply_q = _lapack(_fortran_copy(G_np, dtype))
    psi = apply_qt(Phi2)  # (N, c) = Qᵀ Φ
    cols = [N - 1 - i for i in indices]
    # (N,) ascending, (N, c) = Sᵀψ, (N, m) = S[:, cols]
    w, proj, _, Sc, solver = solve_tridiagonal(d, e, psi, solver, cols)
    V = apply_q(Sc) if indices else np.empty((N, 0))  # (N, m)
    flip = V[np.abs(V).argmax(axis=0), np.arange(V.shape[1])] < 0 if V.size else np.zeros(0, bool)
    V[:, flip] *= -1
    return SpectralProjections(w[::-1].copy(), proj[::-1].copy(), V, tuple(indices), route, solver)


def eig_weights(
    G: Any, phi: np.ndarray, reduction: str | Reduction = "auto", solver: str | Solver = "auto"
) -> SpectralProjections:
    """λ_1 ≥ … ≥ λ_N of G and ⟨v_i, φ⟩ of ONE vector φ, with Q neither formed nor applied.

    The Householder reflector H = I − β u uᵀ with H x = σ e₁ (x = φ/‖φ‖, σ = ±1) gives
    G' = H G H, with G's eigenvalues and eigenvectors H v_i, and ⟨H v_i, e₁⟩ = σ ⟨v_i, x⟩.  The
    reduction ``G' = Q T Qᵀ`` with uplo = 'L' leaves e₁ fixed (``Q e₁ = e₁``: every reflector of
    both stages acts on rows 2…N), so with ``T = S diag(λ) Sᵀ`` G' has eigenvectors Q s_i and

        ⟨v_i, φ⟩ = ±‖φ‖ S[0, i]      (i.e. ⟨v_i, φ⟩² = ‖φ‖² S[0, i]²: Gauss quadrature weights),

    up to v_i's sign (which any eigensolver leaves arbitrary).  Cost: G' is a rank-2 update of G
    (one product G u, O(N²)); the reduction runs with jobz = 'N' (MKL ``?syrdb``, proven by
    :func:`~nsa_dist.linalg._mkl_syrdb.probe_first_column`; or SciPy's ``?sytrd``, whose
    Q e₁ = e₁ is its documented reflector form); then divide and conquer on T carrying only S's
    first row (``Solver.ROWS``, O(N²)) where its probe passed, else S whole.

    Every call proves its result (:func:`_weights_checks`, two more products with G): T against G's
    orthogonal invariants, T's first column against G', and the weights' moments against φᵀ G^m φ;
    any failure is logged as a warning and :func:`eig_projections` (Q formed) answers instead.

    Args:
        G: (N, N) symmetric, NumPy or torch (CPU), as :func:`eig_projections` (its lower triangle,
            or upper when C-ordered, is reduced; the checks use all of it).
        phi: (N,) or (N, 1) finite float vector.
        reduction, solver: as :func:`eig_projections`.

    Returns:
        :class:`SpectralProjections` with ``proj`` (N, 1), no vectors; ``one_vector`` True unless
        the checks sent the call to :func:`eig_projections`.

    Raises:
        ShapeError: G not square, or φ not N entries.
        NonFiniteError: φ holds NaN or inf.
        ValueError: an unknown reduction or solver, or "mkl" where MKL's routine is missing or
            failed its probe.
    """
    from nsa_dist._checks import check_finite, parse_enum
    from nsa_dist.errors import ShapeError
    from nsa_dist.linalg._mkl_syrdb import first_column_ready

    route = parse_enum(Reduction, reduction, "reduction")
    G_np, dtype = _square(G)
    N = G_np.shape[0]
    if np.size(phi) != N or np.ndim(phi) > 2:
        raise ShapeError(f"phi must be (N,) or (N, 1) with N = {N}, got shape {np.shape(phi)}")
    check_finite("phi", phi)
    x = np.asarray(phi, dtype=np.float64).reshape(N)  # (N,)
    mkl_ok = N >= MIN_N and first_column_ready(dtype)
    if route is Reduction.MKL and not mkl_ok:
        raise ValueError(
            f"reduction='mkl' needs N >= {MIN_N} (got {N}) and MKL ?syrdb present and passing its "
            f"probes in {dtype} (see the log); use 'auto' or 'lapack'"
        )
    asked = route
    route = Reduction.MKL if route is not Reduction.LAPACK and mkl_ok else Reduction.LAPACK
    d, e, stats = _reflected_tridiagonal(G_np, x, dtype, route)
    lam, _, s0, _, used = solve_tridiagonal(d, e, np.zeros((N, 0)), solver, [])  # (N,) ascending, (N,) = S[0, :]
    unresolved = _unresolved_weight(stats, lam, s0)
    if dtype != np.float64 and unresolved > UNRESOLVED_WEIGHT:
        # φ has weight among eigenvalues below this precision's resolution, where the reflected
        # reduction splits it less faithfully than Q does (E(φ, k) off by up to 0.14 for a Gaussian
        # φ at N = 10⁴ float32): the same route in float64 (exact to ~1e-6 there; 1.7× the time)
        _log.info("one-vector route: %.1e of φ's weight below float32 resolution; reduced in float64", unresolved)
        route = (
            Reduction.MKL
            if asked is not Reduction.LAPACK and N >= MIN_N and first_column_ready(np.float64)
            else Reduction.LAPACK
        )
        dtype = np.dtype(np.float64)
        d, e, stats = _reflected_tridiagonal(G_np, x, dtype, route)
        lam, _, s0, _, used = solve_tridiagonal(d, e, np.zeros((N, 0)), solver, [])
    checks = tuple(_weights_checks(stats, d, e, lam, s0))
    bad = [f"{name} = {err:.2e} > {tol:.2e}" for name, err, tol in checks if not err <= tol]
    if bad:
        _log.warning(
            "the one-vector route's result for this %d×%d G is off (%s); redone with Q formed", N, N, "; ".join(bad)
        )
        whole = "auto" if used is Solver.ROWS else used
        return dataclasses.replace(eig_projections(G, x, reduction=reduction, solver=whole), checks=checks)
    proj = (np.linalg.norm(x) * s0)[::-1, None].copy()  # (N, 1) descending
    return SpectralProjections(lam[::-1].copy(), proj, np.empty((N, 0)), (), route, used, True, checks)


UNRESOLVED_WEIGHT = 1e-3  # largest share of ‖φ‖² below the resolution that a float32 one-vector call keeps


def _resolution(st: _Stats) -> float:
    """δ = (max(100√N, 1000) + 4)·eps·‖G‖_F: the reduction's backward error in G's precision (see
    :func:`_weights_checks`); eigenvalues below it are not resolved by that precision."""
    return (max(100 * np.sqrt(st.N), 1000) + 4) * st.eps * float(np.sqrt(st.fro2))


def _unresolved_weight(st: _Stats, lam: np.ndarray, s0: np.ndarray) -> float:
    """The share of ‖φ‖² on eigenvalues |λ| ≤ δ (:func:`_resolution`): there the float32 reduction's
    split of φ's weight is noise, so E(φ, k) can err by up to this share (plus O(δ/gap) above)."""
    return float((s0[np.abs(lam) <= _resolution(st)] ** 2).sum())


def _reflected_tridiagonal(
    G: np.ndarray, x: np.ndarray, dtype: np.dtype, route: Reduction
) -> tuple[np.ndarray, np.ndarray, _Stats]:
    """T (d, e float64) of G' = H G H (H e₁ ∝ x; H = I for x = 0) reduced in ``dtype`` by ``route`` with
    Q discarded, and what :func:`_weights_checks` compares it with (three products with G in all)."""
    N, nrm = G.shape[0], float(np.linalg.norm(x))
    A = _fortran_copy(G, dtype)  # (N, N), lower triangle: G, then G' = H G H
    X = np.column_stack([x, _householder(x / nrm) if nrm > 0 else np.zeros(N)])  # (N, 2): φ, u
    GX, fro2 = _products(G, X)  # (N, 2) = G [φ, u], ‖G‖_F²
    if nrm > 0:
        _reflect(A, X[:, 1], GX[:, 1])
    col0 = A[:, 0].astype(np.float64)  # G' e₁ (lower part)
    d, e = _reduce_values(A, route)
    del A
    stats = _Stats(
        N,
        float(np.finfo(dtype).eps),
        float(np.trace(G, dtype=np.float64)),
        fro2,
        col0,
        x,
        GX[:, 0],
        _products(G, GX[:, :1])[0][:, 0],
    )
    return d.astype(np.float64), e.astype(np.float64), stats


def _householder(x: np.ndarray) -> np.ndarray:
    """u with H = I − 2 u uᵀ / uᵀu mapping the unit vector x to −sign(x₀) e₁ (u = x + sign(x₀) e₁,
    no cancellation)."""
    u = x.copy()
    u[0] += 1.0 if x[0] >= 0 else -1.0
    return u


def _reflect(A: np.ndarray, u: np.ndarray, Gu: np.ndarray) -> None:
    """A's lower triangle ← that of H A H, H = I − β u uᵀ (β = 2/uᵀu), given Gu = A u in float64:
    ``H A H = A − u wᵀ − w uᵀ`` with ``w = β Gu − (β²/2)(uᵀ Gu) u`` (BLAS ``?syr2``, in place)."""
    from scipy.linalg import blas

    beta = 2.0 / float(u @ u)
    p = beta * Gu
    w = p - 0.5 * beta * float(u @ p) * u
    syr2 = blas.ssyr2 if A.dtype == np.float32 else blas.dsyr2
    out = syr2(-1.0, u.astype(A.dtype), w.astype(A.dtype), lower=1, a=A, overwrite_a=1)
    if out is not A and not np.shares_memory(out, A):  # SciPy copied (never for a Fortran-ordered A)
        A[...] = out


def _products(G: np.ndarray, X: np.ndarray, rows: int = 1024) -> tuple[np.ndarray, float]:
    """G X (N, c) in float64 from G of any float dtype and ‖G‖_F², one sweep of ``rows`` rows at a time."""
    out, fro2 = np.zeros((G.shape[0], X.shape[1])), 0.0
    for lo in range(0, G.shape[0], rows):
        Gb = G[lo : lo + rows].astype(np.float64)  # (rows, N)
        out[lo : lo + rows] = Gb @ X
        fro2 += float(np.einsum("ij,ij->", Gb, Gb))
    return out, fro2


def _reduce_values(A: np.ndarray, route: Reduction) -> tuple[np.ndarray, np.ndarray]:
    """T of A = Q T Qᵀ (uplo = 'L', Q discarded): MKL ``?syrdb(jobz='N')`` or SciPy ``?sytrd``."""
    if route is Reduction.MKL:
        from nsa_dist.linalg._mkl_syrdb import syrdb_values

        return syrdb_values(A)
    s = "s" if A.dtype == np.float32 else "d"
    _, d, e, _, info = getattr(lapack, f"{s}sytrd")(A, lower=1, overwrite_a=1)
    lapack_ok(f"{s}sytrd", info)
    return d, e


@dataclass(frozen=True)
class _Stats:
    """What the checks of :func:`eig_weights` compare against (float64): N, eps of G's dtype, tr G,
    ‖G‖_F², G' e₁ as reduced, φ, Gφ and G²φ."""

    N: int
    eps: float
    trace: float
    fro2: float
    col0: np.ndarray
    phi: np.ndarray
    Gphi: np.ndarray
    G2phi: np.ndarray


def _weights_checks(
    st: _Stats, d: np.ndarray, e: np.ndarray, lam: np.ndarray, s0: np.ndarray
) -> list[tuple[str, float, float]]:
    """Whether T (d, e) belongs to G' = H G H and the weights w_i = ‖φ‖² S[0, i]² are right, as
    (name, error, tolerance) triples.

    Tolerances: the reduction in G's precision is backward stable, T = Qᵀ(G' + Δ)Q with
    ‖Δ‖_F ≤ τ‖G‖_F, τ = max(100√N, 1000)·eps (the scale of :func:`_residual`; the worst-case bound
    is O(N·eps), the observed one O(√N·eps)); forming G' in that precision adds ≤ 4·eps·‖G‖_F.  So
    with δ = (τ + 4·eps)·‖G‖_F, F = ‖G‖_F ≥ ‖G‖₂, and S from float64 divide and conquer
    (orthogonal to c = 100·N·eps₆₄):

    - ``|Σ d − tr G| ≤ √N·δ`` (|tr Δ| ≤ √N‖Δ‖_F) and ``|‖T‖_F − F| ≤ δ`` (orthogonal invariants);
    - ``|d₀ − G'₀₀| ≤ δ`` and ``||e₀| − ‖G'₁:,₀‖| ≤ δ`` (Q e₁ = e₁ on this call);
    - ``|Σ w_i λ_i^m − φᵀ G^m φ| ≤ ‖φ‖²((F + δ)^m − F^m + c·F^m)``, m = 0…3: the weights are
      exact for G + Δ', ‖Δ'‖₂ ≤ δ.

    A route that broke Q e₁ = e₁, or an S not matching λ, is off by O(‖G‖), far above these.
    """
    N, F = st.N, float(np.sqrt(st.fro2))
    delta = _resolution(st)
    c = 100 * N * float(np.finfo(np.float64).eps)
    n2 = float(st.phi @ st.phi)
    w = n2 * s0**2  # (N,)
    checks = [
        ("|tr T - tr G|", abs(float(d.sum()) - st.trace), np.sqrt(N) * delta),
        ("||T|_F - |G|_F|", abs(float(np.sqrt(d @ d + 2 * e @ e)) - F), delta),
        ("|d0 - G'00|", abs(float(d[0]) - st.col0[0]), delta),
        ("||e0| - |G'[1:, 0]||", abs(abs(float(e[0]) if N > 1 else 0.0) - float(np.linalg.norm(st.col0[1:]))), delta),
    ]
    moments = (n2, float(st.phi @ st.Gphi), float(st.Gphi @ st.Gphi), float(st.Gphi @ st.G2phi))  # φᵀG^mφ
    for m, ref in enumerate(moments):
        checks.append(
            (f"|Σ w λ^{m} - φ'G^{m}φ|", abs(float(w @ lam**m) - ref), n2 * ((F + delta) ** m - F**m + c * F**m))
        )
    return checks


_Apply = Callable[[np.ndarray], np.ndarray]


def _square(G: Any) -> tuple[np.ndarray, np.dtype]:
    """G as a NumPy (N, N) array (a torch tensor's own memory) and the dtype it is reduced in."""
    from nsa_dist.errors import ShapeError

    G_np = G.detach().cpu().numpy() if hasattr(G, "detach") else np.asarray(G)
    if G_np.ndim != 2 or G_np.shape[0] != G_np.shape[1]:
        raise ShapeError(f"G must be a square (N, N) matrix, got shape {G_np.shape}")
    return G_np, (G_np.dtype if G_np.dtype in (np.float32, np.float64) else np.dtype(np.float64))


def _fortran_copy(G: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A Fortran-ordered copy of symmetric G in ``dtype`` (of Gᵀ when G is C-ordered: a plain memcpy)."""
    return np.array(G.T if G.flags.c_contiguous else G, dtype=dtype, order="F")


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
        Qb = Q[lo : lo + rows].astype(np.float64)  # (rows, N)
        if transpose:
            out += Qb.T @ X[lo : lo + rows]
        else:
            out[lo : lo + rows] = Qb @ X
    return out


def _lapack(A: np.ndarray) -> tuple[np.ndarray, np.ndarray, _Apply, _Apply]:
    """SciPy ``?sytrd(lower)`` and ``?ormqr``: Q = H_1 ⋯ H_{N−1}, H_i = I − τ_i u_i u_iᵀ with
    u_i = (0…0, 1, c[i+2:, i]) (1 at row i + 1), i.e. the QR-form reflectors of c[1:, :N−1]
    acting on rows 1.. (LAPACK's ``?ormtr`` for uplo = 'L')."""
    s = "s" if A.dtype == np.float32 else "d"
    c, d, e, tau, info = getattr(lapack, f"{s}sytrd")(A, lower=1, overwrite_a=1)
    lapack_ok(f"{s}sytrd", info)
    N = A.shape[0]
    U = np.asfortranarray(c[1:, : N - 1])  # (N − 1, N − 1) reflectors below the diagonal

    def apply(X: np.ndarray, trans: str) -> np.ndarray:
        X = np.array(X, dtype=A.dtype, order="F")  # (N, m)
        if N > 1 and X.shape[1]:
            out, _, info = getattr(lapack, f"{s}ormqr")(
                "L", trans, U, tau[: N - 1], X[1:], max(1, 64 * X.shape[1]), overwrite_c=1
            )
            lapack_ok(f"{s}ormqr", info)
            X[1:] = out
        return X.astype(np.float64)

    return d.astype(np.float64), e.astype(np.float64), lambda X: apply(X, "T"), lambda X: apply(X, "N")
