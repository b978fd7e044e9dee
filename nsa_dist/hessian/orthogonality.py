"""How orthogonal I and S are: ``‖IS‖_F / (‖I‖_F ‖S‖_F)``, and the Rayleigh quotients of Fig. 3.

The Hessian paper shows I and S are asymptotically mutually orthogonal (``‖IS‖_F → 0``
relative to their norms), so the moments add: ``Tr(H^k) ≈ Tr(I^k) + Tr(S^k)``.  Its Fig. 3
shows it along eigenvectors: ``vᵀSv ≈ 0`` on the top eigenvectors of I and ``vᵀIv ≈ 0`` on
those of S.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from nsa_dist.errors import ShapeError
from nsa_dist.hessian._probes import LinearMap, as_linear_map, check_int, rademacher
from nsa_dist.hessian.eigen import Which, extreme_eigenpairs

__all__ = ["Orthogonality", "orthogonality", "RayleighQuotients", "rayleigh_quotients"]


@dataclass(frozen=True)
class Orthogonality:
    """``ρ = ‖IS‖_F / (‖I‖_F ‖S‖_F)`` ∈ [0, 1]: 0 for mutually orthogonal I and S.

    Attributes:
        value: ρ.
        stderr: its standard error (delta method over probes; 0 when exact).
        norm_IS, norm_I, norm_S: the Frobenius norms (estimates for ``method="probes"``).
        n_products: products with I and S together.
        method: "probes" | "dense".
    """

    value: float
    stderr: float
    norm_IS: float
    norm_I: float
    norm_S: float
    n_products: int
    method: str


def _maps(I: Any, S: Any) -> tuple[LinearMap, LinearMap]:
    Imap, Smap = as_linear_map(I, "I"), as_linear_map(S, "S")
    if Imap.P != Smap.P:
        raise ShapeError(f"I and S must have the same shape (P, P); got P = {Imap.P} and P = {Smap.P}")
    return Imap, Smap


def orthogonality(I: Any, S: Any, *, n_probes: int = 32, seed: int = 0, exact: bool = False) -> Orthogonality:
    """``‖IS‖_F / (‖I‖_F ‖S‖_F)`` from Rademacher probes (or exactly, for small P).

    With probes z: ``‖IS‖_F² = E‖I S z‖²``, ``‖I‖_F² = E‖I z‖²``, ``‖S‖_F² = E‖S z‖²`` — one S and
    two I products per probe, and 2 + 2 more for the error.  The ratio of the means is consistent
    (bias O(1/m): +1 to +4 % at 16 probes, measured); its standard error comes from the delta
    method on ``½(log a − log b − log c)`` with the quadratic forms' covariance 2 tr(A_x A_y).

    Args:
        I, S: symmetric (P, P) matrices or operators (e.g. from :func:`~nsa_dist.hessian.hessian_parts`).
        n_probes: m ≥ 2 probes (ignored when exact).
        seed: NumPy seed.
        exact: materialise I and S with P products each and compute the norms densely.

    Returns:
        :class:`Orthogonality`; value and stderr NaN when I or S is the zero matrix (ρ = 0/0:
        S = 0 at a zero loss gradient and for a network linear in θ), the norms still given.

    Raises:
        ValueError: n_probes < 2.
        ShapeError: I and S of different shapes.
    """
    Imap, Smap = _maps(I, S)
    if exact:
        E = np.eye(Imap.P)
        MI, MS = Imap(E), Smap(E)  # (P, P) each
        nIS, nI, nS = (float(np.linalg.norm(M)) for M in (MI @ MS, MI, MS))
        if nI == 0 or nS == 0:  # ρ = 0/0: undefined (S = 0 at a zero loss gradient, a linear net's S)
            return Orthogonality(np.nan, np.nan, nIS, nI, nS, Imap.n_products + Smap.n_products, "dense")
        return Orthogonality(nIS / (nI * nS), 0.0, nIS, nI, nS, Imap.n_products + Smap.n_products, "dense")
    m = check_int("n_probes", n_probes, 2)
    Z = rademacher(np.random.default_rng(seed), Imap.P, m)  # (P, m)
    SZ = Smap(Z)
    IZ, ISZ = np.split(Imap(np.concatenate([Z, SZ], axis=1)), 2, axis=1)  # I Z, I S Z
    q = np.stack([np.sum(ISZ**2, 0), np.sum(IZ**2, 0), np.sum(SZ**2, 0)])  # (3, m): zᵀA_x z, A = SI²S, I², S²
    a, b, c = q.mean(axis=1)
    if b == 0 or c == 0:  # I or S is 0 (every ‖Iz‖ or ‖Sz‖ vanishes): ρ = 0/0, undefined
        return Orthogonality(
            np.nan,
            np.nan,
            float(np.sqrt(a)),
            float(np.sqrt(b)),
            float(np.sqrt(c)),
            Imap.n_products + Smap.n_products,
            "probes",
        )
    # The covariance of the three means from the quadratic forms' own model, Cov(zᵀA_x z, zᵀA_y z)
    # ≤ 2 tr(A_x A_y) (equal for Gaussian z; Rademacher subtracts 2 Σ diag products), tr(A_x A_y)
    # estimated by the mean of (A_x z)ᵀ(A_y z) — 4 more products a probe.  The sample covariance of
    # the quartic terms, used before, shrank with the draw itself: ±2σ covered 0.90 at 16 probes
    # (0.95 now), ±3σ 0.975–0.98 (0.99 now), on the Hessian parts of a LayerNorm + attention net.
    I2Z, I2SZ = np.split(Imap(np.concatenate([IZ, ISZ], axis=1)), 2, axis=1)  # I² Z, I² S Z
    S2Z, SI2SZ = np.split(Smap(np.concatenate([SZ, I2SZ], axis=1)), 2, axis=1)  # S² Z, S I² S Z
    AZ = (SI2SZ, I2Z, S2Z)
    cov = 2 * np.array([[np.mean(np.sum(AZ[x] * AZ[y], 0)) for y in range(3)] for x in range(3)])
    n_products = Imap.n_products + Smap.n_products
    value = float(np.sqrt(a / (b * c)))
    grad = 0.5 * np.array([1 / a, -1 / b, -1 / c])  # d log ρ / d (a, b, c)
    var_log = float(grad @ cov @ grad) / m
    return Orthogonality(
        value,
        value * np.sqrt(max(var_log, 0.0)),
        float(np.sqrt(a)),
        float(np.sqrt(b)),
        float(np.sqrt(c)),
        n_products,
        "probes",
    )


@dataclass(frozen=True)
class RayleighQuotients:
    """``vᵀIv`` and ``vᵀSv`` along k unit eigenvectors v of one matrix (I or S).

    Attributes:
        evals: (k,) that matrix's eigenvalues, in the order found.
        vIv: (k,) ``v_iᵀ I v_i``.
        vSv: (k,) ``v_iᵀ S v_i``.
        evecs: (P, k) the eigenvectors.
        n_products: products with I and S (the eigensolver's included).
    """

    evals: np.ndarray
    vIv: np.ndarray
    vSv: np.ndarray
    evecs: np.ndarray
    n_products: int


def _quotients(
    Imap: LinearMap, Smap: LinearMap, evals: np.ndarray, V: np.ndarray, n_eig: int, tol: float, of_I: bool
) -> RayleighQuotients:
    """The quotients along the eigenvectors V of I (``of_I``) or of S.  Within a repeated eigenvalue
    (equal to 10·tol of the largest |λ|) the eigenvectors are one basis of their eigenspace among many
    and vᵀ(other)v takes any value between the extremes of the other matrix compressed to it (2.29 to
    11.33 on one S's double eigenvalue: the local and gang layouts stored 3.5361 and 3.5342, an audit):
    there V is turned to the basis that diagonalises the other matrix's compression — a choice of
    basis made by the matrices, not by rounding — ordered by its quotient, largest first."""
    n0 = Imap.n_products + Smap.n_products
    IV, SV = Imap(V), Smap(V)  # (P, k) each
    scale = float(np.abs(evals).max()) if evals.size else 0.0
    starts = np.flatnonzero(np.concatenate([[True], np.abs(np.diff(evals)) > 10 * tol * scale, [True]]))
    for a, b in zip(starts[:-1], starts[1:]):
        if b - a < 2:
            continue
        other = SV if of_I else IV
        M = V[:, a:b].T @ other[:, a:b]
        _, Q = np.linalg.eigh((M + M.T) / 2)
        Q = Q[:, ::-1]  # its quotients largest first
        V[:, a:b], IV[:, a:b], SV[:, a:b] = V[:, a:b] @ Q, IV[:, a:b] @ Q, SV[:, a:b] @ Q
    vIv, vSv = np.sum(V * IV, 0), np.sum(V * SV, 0)  # (k,) each
    return RayleighQuotients(evals, vIv, vSv, V, n_eig + Imap.n_products + Smap.n_products - n0)


def rayleigh_quotients(
    I: Any,
    S: Any,
    k: int = 20,
    *,
    which_S: str | Which = "magnitude",
    method: str = "auto",
    tol: float = 1e-10,
    max_iter: int | None = None,
    seed: int = 0,
) -> tuple[RayleighQuotients, RayleighQuotients]:
    """The Hessian paper's Fig. 3: ``vᵀIv`` and ``vᵀSv`` over the top-k eigenvectors of I and of S.

    I is PSD, so its "top" is its largest eigenvalues.  S is indefinite and not symmetric
    about 0, so its k eigenvectors are chosen by ``which_S``: "magnitude" (the k largest |λ|,
    both ends merged — default), "largest" or "smallest" (algebraic); see :class:`Which`.

    Args:
        I, S: (P, P) matrices or operators.
        k: eigenvectors of each, 1 ≤ k < P.
        which_S: "magnitude" | "largest" | "smallest".
        method, tol, max_iter, seed: of :func:`~nsa_dist.hessian.extreme_eigenpairs` (a figure
            needs no 1e-10 eigenvectors: tol=1e-6 converges far sooner on S's clustered spectrum).

    Returns:
        ``(along_I, along_S)`` :class:`RayleighQuotients`; on I's eigenvectors ``vIv = λ(I)``.

    Raises:
        ValueError: k outside 1..P−1; an unknown which_S or method.
        ShapeError: I and S of different shapes.
    """
    Imap, Smap = _maps(I, S)
    eI = extreme_eigenpairs(I, k, which="largest", method=method, tol=tol, max_iter=max_iter, seed=seed)
    eS = extreme_eigenpairs(S, k, which=which_S, method=method, tol=tol, max_iter=max_iter, seed=seed)
    return (
        _quotients(Imap, Smap, eI.evals, eI.evecs.copy(), eI.n_matvec, tol, of_I=True),
        _quotients(Imap, Smap, eS.evals, eS.evecs.copy(), eS.n_matvec, tol, of_I=False),
    )
