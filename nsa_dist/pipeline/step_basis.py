"""A recorded step's eigenbasis as the metrics use it: eigenvalues, ⟨v_i, φ⟩ of the step's few φ,
a few eigenvectors — from top-k eigenpairs, or from one tridiagonalisation without the N×N
eigenvectors (``k: all`` at steps that store none)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nsa_dist.linalg.tridiag import eig_projections

__all__ = ["StepSpectrum", "from_eigenpairs", "from_tridiagonal"]


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
    """

    evals: np.ndarray
    proj: dict[str, np.ndarray]
    columns: dict[int, np.ndarray] = field(default_factory=dict)
    evecs: np.ndarray | None = None
    n_matvec: int = 0


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


def from_tridiagonal(G: Any, k: int, phis: dict[str, np.ndarray], indices: tuple[int, ...]) -> StepSpectrum:
    """:class:`StepSpectrum` of the top k of G (N, N) by :func:`~nsa_dist.linalg.tridiag.eig_projections`:
    every eigenvalue and ``Vᵀ Φ`` at the cost of ``eigvalsh``, no (N, N) eigenvectors."""
    N = G.shape[0]
    Phi, where = _matrix(phis, N)
    idx = tuple(i for i in indices if i < k)
    sp = eig_projections(G, Phi, idx)
    return StepSpectrum(
        sp.evals[:k].copy(),
        {n: sp.proj[:k, s] for n, s in where.items()},
        {i: sp.vectors[:, j] for j, i in enumerate(idx)},
    )
