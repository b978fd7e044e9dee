"""A recorded step's spectrum — eigenvalues and the coordinates ⟨v_i, φ⟩ of a few vectors φ — for
top-k and ``k: all`` alike: the one door through which a step's eigenproblem is solved.

:func:`step_spectrum` takes the route a step allows, chosen by its ``route`` argument:

* ``eigenpairs`` — :func:`~nsa_dist.linalg.top_eigenpairs` (dense LAPACK, block Lanczos, ARPACK;
  a matrix or a matrix-free operator), then ``Vᵀ Φ``;
* ``tridiagonal`` — at a ``k: all`` step that needs no eigenvectors, on a dense G: one
  tridiagonalisation ``G = Q T Qᵀ`` (the cost of ``eigvalsh``) and ``Vᵀ Φ = Sᵀ Qᵀ Φ``, the (N, N)
  eigenvectors never formed (:func:`~nsa_dist.linalg.tridiag.eig_projections`);
* ``one_vector`` — the tridiagonal route with one φ column and no eigenvector asked for: Q is not
  formed either (:func:`~nsa_dist.linalg.tridiag.eig_weights`, proven per call, the Q route
  when its checks fail).

``route="auto"`` (the default) takes the fastest that applies — one vector, else tridiagonal,
else eigenpairs; ``"tridiagonal"`` never takes the one-vector route; ``"eigenpairs"`` always
eigenpairs.  A step the tridiagonal routes do not apply to (top-k, eigenvectors needed, an
operator) takes eigenpairs whatever the route.  ``solver`` picks T's divide and conquer on the
tridiagonal routes (:class:`~nsa_dist.linalg.tridiag.Solver`: "auto" — the rows-only one or MKL's
``dstedc`` where their probes passed —, "mkl", "lapack" — SciPy's ``dstevd``, S whole —, "rows").

Measured (benchmarks/README.md): a recorded ``k: all`` step of examples/nsa_paper.yaml (N = 10⁴
float32, test points) took 47.6–48.3 s by the default routes against 84–86 s with Q in both halves
and S whole; one tridiagonal Gram 39 s against 120 s for the float64 eigh with vectors (2 cores),
eigenvalues within 4.7e-7·λ_1 of eigh's — less than the float32 Gram's own rounding moves them.
Only ``k: all``: a top-k keeps its float64 eigensolver and its stored numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from nsa_dist._checks import parse_enum
from nsa_dist.config import EigMethod
from nsa_dist.linalg._backend import HostWorkspace, array_kind
from nsa_dist.linalg.eigenpairs import top_eigenpairs
from nsa_dist.linalg.tridiag import Solver, eig_projections, eig_weights

__all__ = ["SpectrumRoute", "StepSpectrum", "step_spectrum", "from_eigenpairs", "from_tridiagonal"]


class SpectrumRoute(str, Enum):
    """Which routes :func:`step_spectrum` may take (see the module docstring).

    AUTO: one vector, else tridiagonal, where they apply; else eigenpairs.
    TRIDIAGONAL: tridiagonal (Q formed, even for one φ) where it applies; else eigenpairs.
    EIGENPAIRS: eigenpairs always.
    """

    AUTO = "auto"
    TRIDIAGONAL = "tridiagonal"
    EIGENPAIRS = "eigenpairs"


@dataclass(frozen=True)
class StepSpectrum:
    """Eigenvalues of G_t and the coordinates of the step's vectors φ in its eigenbasis.

    Attributes:
        evals: (K,) float64, descending.
        proj: name → (K, C) float64, ``proj[name][i, c] = ⟨v_i, φ_c⟩`` (C columns of φ).
        columns: 0-based index → (N,) eigenvector v_i, for the indices asked for (images).
        evecs: (N, K) float64 when the eigenvectors were computed (top-k, or a step that
            stores them), else None.
        n_matvec: products with G the solver used (0 for a dense factorisation).
        route: the route that ran: "eigenpairs" | "tridiagonal" | "one_vector".
        method: the eigensolver that ran on the eigenpairs route (None on the others).
        max_residual: ``max_i ‖G v_i − λ_i v_i‖`` where the solver yields it (Lanczos), else None.
    """

    evals: np.ndarray
    proj: dict[str, np.ndarray]
    columns: dict[int, np.ndarray] = field(default_factory=dict)
    evecs: np.ndarray | None = None
    n_matvec: int = 0
    route: str = "eigenpairs"
    method: EigMethod | None = None
    max_residual: float | None = None


def step_spectrum(
    G: Any,
    k: int,
    phis: dict[str, np.ndarray],
    *,
    vectors: bool = False,
    indices: tuple[int, ...] = (),
    route: str | SpectrumRoute = "auto",
    solver: str | Solver = "auto",
    method: str | EigMethod = "auto",
    start: np.ndarray | None = None,
    workspace: HostWorkspace | None = None,
) -> StepSpectrum:
    """The top k of a symmetric G and ⟨v_i, φ⟩ of each φ, by the route ``route`` allows.

    Args:
        G: a dense symmetric (N, N) matrix (NumPy, torch, CuPy) or a matrix-free operator
            (``shape`` and ``matmat``), as :func:`~nsa_dist.linalg.top_eigenpairs` takes.
        k: eigenpairs kept, 1 ≤ k ≤ N; k ≥ N is ``k: all``.
        phis: name → φ, (N,) or (N, C) each; a non-finite column is projected as zeros (its
            energy is NaN anyway).
        vectors: the step needs all k eigenvectors (``evecs``): eigenpairs.
        indices: 0-based eigenvectors wanted as ``columns`` (e.g. drawn as images).
        route: "auto" | "tridiagonal" | "eigenpairs" (:class:`SpectrumRoute`).
        solver: T's divide and conquer on the tridiagonal routes (:class:`~nsa_dist.linalg.tridiag.Solver`).
        method: the eigensolver on the eigenpairs route ("auto" | "dense" | "lanczos" | "arpack");
            "auto" and "dense" on an operator are Lanczos.
        start: Lanczos's starting block (e.g. the last step's eigenvectors), or None.
        workspace: host buffers the dense solver reuses between calls.

    Returns:
        :class:`StepSpectrum`; ``route`` says which route ran.

    Raises:
        ValueError: an unknown route, solver or method (and as the route's solver raises).
    """
    r = parse_enum(SpectrumRoute, route, "route")
    dense = array_kind(G) is not None  # an operator with only ``matvec`` (or a sparse matrix) is not
    if r is not SpectrumRoute.EIGENPAIRS and dense and not vectors and k >= G.shape[0]:  # k: all
        _check_dense(G)
        one_column = len(phis) == 1 and np.size(next(iter(phis.values()))) == G.shape[0]
        if r is SpectrumRoute.AUTO and one_column and not indices:  # no Q
            return _one_vector(G, k, *next(iter(phis.items())), solver)
        return from_tridiagonal(G, k, phis, indices, solver)
    if not dense:
        method = "lanczos" if parse_enum(EigMethod, method, "method").value in ("auto", "dense") else method
    eig = top_eigenpairs(
        G,
        k,
        method,
        start=start if start is not None and start.shape[0] == G.shape[0] else None,
        workspace=workspace,
    )
    sp = from_eigenpairs(eig.evals, eig.evecs, phis, indices, eig.n_matvec)
    return StepSpectrum(
        sp.evals, sp.proj, sp.columns, sp.evecs, sp.n_matvec, "eigenpairs", eig.method, eig.max_residual
    )


def _check_dense(G: Any) -> None:
    """Refuse on the tridiagonal routes what :func:`~nsa_dist.linalg.top_eigenpairs` refuses on the
    eigenpairs one: those routes reduce one triangle, so an unsymmetric G came back as the spectrum
    of that triangle, and an inf entry as ``λ_1 = inf`` (a NaN as a LAPACK ``info``).

    Raises:
        ShapeError: G not square 2-D.
        NonFiniteError: NaN/inf entries (counted).
        ValueError: complex entries, or max |G − Gᵀ| above √eps of G's dtype × max |G| (named).
    """
    from nsa_dist.errors import NonFiniteError, ShapeError
    from nsa_dist.linalg._inputs import _check_symmetric, _eps_of, _non_finite, sym_rtol

    shape = tuple(G.shape)
    if len(shape) != 2 or shape[0] != shape[1]:
        raise ShapeError(f"G must be a square 2-D (N, N) matrix, got shape {shape}")
    if "complex" in str(G.dtype):
        raise ValueError(f"G must be real symmetric, got dtype {G.dtype}")
    n_bad = _non_finite(G)
    if n_bad:
        raise NonFiniteError(
            f"G holds {n_bad} NaN/inf entries (of {shape[0] * shape[1]}); "
            "only finite matrices have an eigendecomposition"
        )
    _check_symmetric(G, sym_rtol(_eps_of(G)), array_kind(G) or "numpy", "G")


def _matrix(phis: dict[str, np.ndarray], N: int) -> tuple[np.ndarray, dict[str, slice]]:
    """The φ as one (N, C) matrix (non-finite columns zeroed: their energies are NaN anyway)."""
    cols, where, at = [], {}, 0
    for name, phi in phis.items():
        P = np.asarray(phi, dtype=np.float64).reshape(N, -1)  # (N, c)
        P = np.where(np.isfinite(P).all(axis=0), P, 0.0)
        cols.append(P)
        where[name] = slice(at, at + P.shape[1])
        at += P.shape[1]
    return np.concatenate(cols, axis=1), where


def from_eigenpairs(
    evals: np.ndarray, evecs: np.ndarray, phis: dict[str, np.ndarray], indices: tuple[int, ...], n_matvec: int = 0
) -> StepSpectrum:
    """:class:`StepSpectrum` of computed eigenpairs (evals (K,), evecs (N, K)): ``proj = Vᵀ Φ``."""
    N = evecs.shape[0]
    Phi, where = _matrix(phis, N)
    P = evecs.T @ Phi  # (K, C)
    return StepSpectrum(
        np.asarray(evals, np.float64),
        {n: P[:, s] for n, s in where.items()},
        {i: evecs[:, i] for i in indices if i < evecs.shape[1]},
        evecs,
        n_matvec,
    )


def from_tridiagonal(
    G: Any, k: int, phis: dict[str, np.ndarray], indices: tuple[int, ...], solver: str | Solver = "auto"
) -> StepSpectrum:
    """:class:`StepSpectrum` of the top k of G (N, N) by :func:`~nsa_dist.linalg.tridiag.eig_projections`:
    every eigenvalue and ``Vᵀ Φ`` at the cost of ``eigvalsh``, no (N, N) eigenvectors."""
    N = G.shape[0]
    Phi, where = _matrix(phis, N)
    idx = tuple(i for i in indices if i < k)
    sp = eig_projections(G, Phi, idx, solver=solver)
    return StepSpectrum(
        sp.evals[:k].copy(),
        {n: sp.proj[:k, s] for n, s in where.items()},
        {i: sp.vectors[:, j] for j, i in enumerate(idx)},
        route="tridiagonal",
    )


def _one_vector(G: Any, k: int, name: str, phi: np.ndarray, solver: str | Solver) -> StepSpectrum:
    """The top k of G (N, N) and ⟨v_i, φ⟩ of one φ column by :func:`~nsa_dist.linalg.tridiag.eig_weights`
    (no Q; route "tridiagonal" where its checks sent it to the Q route); a non-finite φ is zeroed."""
    p = np.asarray(phi, dtype=np.float64).reshape(-1)  # (N,)
    sp = eig_weights(G, p if np.isfinite(p).all() else np.zeros_like(p), solver=solver)
    return StepSpectrum(
        sp.evals[:k].copy(), {name: sp.proj[:k]}, route="one_vector" if sp.one_vector else "tridiagonal"
    )
