"""Moments ``Tr(A^k)`` of ``A ∈ {H, I, S}``: Hutchinson, Hutch++, and exact ones.

Every estimator reuses one set of products for all orders: with ``h = ⌈k_max / 2⌉`` powers
``A^j z`` (j ≤ h) of a probe z, ``zᵀ A^k z = (A^a z)ᵀ (A^b z)`` for ``a = ⌊k/2⌋, b = k − a``, so
the four moments k = 1…4 cost two products per probe.

Standard errors use every probe.  The Hutchinson probes are Gaussian, so one form ``zᵀ B z``
(B symmetric: ``A^k``, or ``P⊥ A^k P⊥`` for Hutch++) has variance exactly ``2 ‖B‖_F²``, and
``‖B‖_F²`` is estimated without bias from all m² forms ``z_iᵀ B z_j`` — the m(m − 1) with
i ≠ j have mean ``‖B‖_F²``, the spread of the m with i = j has mean ``2 ‖B‖_F²`` — instead of
from the m diagonal forms alone (whose sample variance has m − 1 degrees of freedom, too few
for honest intervals at 4 or 8 probes).  Hutch++'s sketch adds no variance: given Q the
estimate is unbiased (``Tr A^k = Tr Qᵀ A^k Q + Tr P⊥ A^k P⊥`` for every orthonormal Q), so its
variance is the mean over Q of the Hutchinson part's, which the remainder's forms estimate.
What probes cannot calibrate is a remainder of very low effective rank (a few outliers the
sketch missed, e.g. in ``I`` of rank N·K above the sketch size, or in high powers): there the
estimate is χ²-like with few degrees of freedom and ±1σ / ±2σ under-cover whatever the
variance estimate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nsa_dist.config import LossName
from nsa_dist.hessian._loss import curvature_sqrt
from nsa_dist.hessian._probes import LinearMap, as_linear_map, check_int, gaussian, rademacher
from nsa_dist.hessian.operators import _setup
from nsa_dist.losses import parse_loss
from nsa_dist.ntk import gram
from nsa_dist.ntk.inputs import as_2d

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Moments", "hutchinson_moments", "hutchpp_moments", "dense_moments", "gauss_newton_eigenvalues",
           "gauss_newton_moments"]


@dataclass(frozen=True)
class Moments:
    """``Tr(A^k)`` for ``k = 1 … max_order``.

    Attributes:
        estimate: (max_order,) float64, ``estimate[k − 1] ≈ Tr(A^k)``.
        stderr: (max_order,) standard errors of the estimates (0 for exact values; NaN when a
            single probe leaves no spread to measure).
        n_products: operator columns applied (0 for the Gram and dense routes).
        method: "hutchinson" | "hutch++" | "dense" | "ntk_gram".
    """

    estimate: np.ndarray
    stderr: np.ndarray
    n_products: int
    method: str

    def trace(self, k: int) -> float:
        """The estimate of ``Tr(A^k)``."""
        return float(self.estimate[k - 1])


def _powers(A: LinearMap, Z: np.ndarray, h: int) -> list[np.ndarray]:
    """[Z, A Z, …, A^h Z], each (P, m)."""
    out = [Z]
    for _ in range(h):
        out.append(A(out[-1]))
    return out


def _quadratic_forms(pw: list[np.ndarray], max_order: int) -> np.ndarray:
    """(max_order, m): row k−1 holds ``z_iᵀ A^k z_i = (A^a z_i)ᵀ (A^b z_i)`` per column i."""
    return np.stack([np.einsum("pm,pm->m", pw[k // 2], pw[k - k // 2]) for k in range(1, max_order + 1)])


def _forms(pw: list[np.ndarray], max_order: int) -> np.ndarray:
    """(max_order, m, m): slice k−1 holds every ``z_iᵀ A^k z_j = (A^a z_i)ᵀ (A^b z_j)``, symmetrised."""
    C = np.stack([pw[k // 2].T @ pw[k - k // 2] for k in range(1, max_order + 1)])
    return (C + C.transpose(0, 2, 1)) / 2


def _gaussian_mean_stderr(C: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean of the diagonal forms of C (K, m, m) and its standard error from all m² forms.

    For m independent Gaussian probes and ``C_ij = z_iᵀ B z_j``: ``Var(C_ii) = 2 ‖B‖_F²``,
    ``E[C_ij²] = ‖B‖_F²`` (i ≠ j) and ``E[s²] = 2 ‖B‖_F²`` (s² the diagonal's sample variance), so
    ``T = (Σ_{i≠j} C_ij² + (m/2) s²) / m²`` is unbiased for ``‖B‖_F²`` and ``√(2T/m)`` is the
    standard error of the mean (NaN for m < 2).
    """
    m = C.shape[1]
    d = np.einsum("kii->ki", C)  # (K, m)
    if m < 2:
        return d.mean(axis=1), np.full(C.shape[0], np.nan)
    off = np.sum(C ** 2, axis=(1, 2)) - np.sum(d ** 2, axis=1)
    T = (off + m / 2 * d.var(axis=1, ddof=1)) / m ** 2
    return d.mean(axis=1), np.sqrt(2 * T / m)


def hutchinson_moments(A: Any, n_probes: int = 32, *, max_order: int = 4, seed: int = 0) -> Moments:
    """Hutchinson's estimate ``Tr(A^k) ≈ (1/m) Σ_i z_iᵀ A^k z_i`` with Gaussian probes z_i.

    Unbiased; the standard error ``√(2 ‖A^k‖_F² / m)`` with ``‖A^k‖_F²`` estimated from all m²
    forms ``z_iᵀ A^k z_j`` (see the module docstring).

    Args:
        A: symmetric (P, P): a dense NumPy/torch matrix or an operator (``shape``, ``matmat``),
            e.g. from :func:`~nsa_dist.hessian.hessian_operator`.
        n_probes: m ≥ 1 probes; the cost is ``m · ⌈max_order / 2⌉`` products.
        max_order: highest k (≥ 1).
        seed: NumPy seed of the probes.

    Returns:
        :class:`Moments` (method "hutchinson").

    Raises:
        ValueError: n_probes < 1 or max_order < 1.
    """
    m = check_int("n_probes", n_probes, 1)
    kmax = check_int("max_order", max_order, 1)
    Amap = as_linear_map(A)
    Z = gaussian(np.random.default_rng(seed), Amap.P, m)  # (P, m)
    est, se = _gaussian_mean_stderr(_forms(_powers(Amap, Z, -(-kmax // 2)), kmax))
    return Moments(est, se, Amap.n_products, "hutchinson")


def hutchpp_moments(A: Any, n_probes: int = 32, *, max_order: int = 4, sketch: int | None = None,
                    seed: int = 0) -> Moments:
    """Hutch++ (Meyer et al. 2021) for every power: ``Tr(A^k) = Tr(Qᵀ A^k Q) + Tr(P⊥ A^k P⊥)``.

    Q (P, s) is an orthonormal basis of ``A Ω`` (Ω Rademacher, s sketch columns): it captures
    the dominant eigenspace of A and so of every power ``A^k``.  The first term is computed
    exactly; the second by Hutchinson with ``g = n_probes − s`` Gaussian probes projected by
    ``P⊥ = 1 − Q Qᵀ``.  Much lower variance than Hutchinson when a few eigenvalues dominate
    (the outliers of I and H).  The standard error is the whole estimate's: given Q the sketch
    part is exact and the estimate unbiased, so all the variance is the Hutchinson part's,
    ``2 ‖P⊥ A^k P⊥‖_F² / g``, estimated from all g² remainder forms (module docstring).

    Args:
        A: symmetric (P, P) matrix or operator.
        n_probes: random vectors in all, s + g ≥ 1.
        max_order: highest k (≥ 1).
        sketch: s, default ``n_probes // 2`` (capped at P; s = P makes the result exact).
        seed: NumPy seed.

    Returns:
        :class:`Moments` (method "hutch++"); cost ``s + (s + g) · ⌈max_order / 2⌉`` products.
        The stderr is 0 when s = P (exact) and NaN when g < 2.

    Raises:
        ValueError: n_probes < 1, max_order < 1, sketch outside 0..n_probes.
    """
    m = check_int("n_probes", n_probes, 1)
    kmax = check_int("max_order", max_order, 1)
    s = check_int("sketch", m // 2 if sketch is None else sketch, 0, m)
    Amap = as_linear_map(A)
    s = min(s, Amap.P)
    g, h, rng = m - s, -(-kmax // 2), np.random.default_rng(seed)
    est = np.zeros(kmax)
    se = np.zeros(kmax) if s == Amap.P else np.full(kmax, np.nan)  # Q spans R^P: exact
    Q = np.zeros((Amap.P, 0))
    if s > 0:
        Q = np.linalg.qr(Amap(rademacher(rng, Amap.P, s)))[0]  # (P, s)
        est += _quadratic_forms(_powers(Amap, Q, h), kmax).sum(axis=1)
    if g > 0 and s < Amap.P:
        Z = gaussian(rng, Amap.P, g)  # (P, g)
        Z -= Q @ (Q.T @ Z)
        mean, se = _gaussian_mean_stderr(_forms(_powers(Amap, Z, h), kmax))
        est += mean
    return Moments(est, se, Amap.n_products, "hutch++")


def dense_moments(A: Any, max_order: int = 4) -> Moments:
    """Exact ``Tr(A^k) = Σ_i λ_i^k`` from ``eigvalsh`` of the dense matrix (an operator is
    materialised with P products) — for small P and tests."""
    kmax = check_int("max_order", max_order, 1)
    Amap = as_linear_map(A)
    M = Amap(np.eye(Amap.P))  # (P, P)
    lam = np.linalg.eigvalsh((M + M.T) / 2)
    est = np.array([np.sum(lam ** k) for k in range(1, kmax + 1)])
    return Moments(est, np.zeros(kmax), Amap.n_products, "dense")


def gauss_newton_eigenvalues(model: nn.Module, X: torch.Tensor, Y: Any, *, loss: str | LossName = "mse") -> np.ndarray:
    """The spectrum of I outside its null space, from the NTK Gram (exact, no Hessian products).

    ``I = (1/N) Jᵀ HC J`` has the same nonzero eigenvalues as ``(1/N) HC^{1/2} G HC^{1/2}``,
    ``G = J Jᵀ`` the full (N·K) × (N·K) NTK Gram (the Hessian paper: I is the weighted kernel
    PCA of the data w.r.t. the NTK).  For MSE ``HC = Id`` and this is ``G / N``.

    Args:
        model: the module; X (N, d) inputs; Y targets as for :func:`~nsa_dist.hessian.hessian_operator`
            (only cross-entropy uses them).
        loss: "mse" | "cross_entropy".

    Returns:
        (N·K,) float64 NumPy, descending (the zeros of a rank-deficient Gram included).

    Raises:
        as :func:`~nsa_dist.hessian.hessian_operator`.
    """
    loss_ = parse_loss(loss)
    model, X, Yt = _setup(model, X, Y, loss_, torch.float64)
    N, K = Yt.shape
    G = gram(model, X, kernel="full", dtype=torch.float64)  # (N, K, N, K)
    if loss_ is LossName.CROSS_ENTROPY:
        with torch.no_grad():
            R = curvature_sqrt(loss_, as_2d(model(X)), Yt)  # (N, K, K)
        G = torch.einsum("iab,ibjc,jdc->iajd", R, G, R)
    M = G.reshape(N * K, N * K).cpu().numpy() / N
    return np.linalg.eigvalsh((M + M.T) / 2)[::-1].copy()


def gauss_newton_moments(model: nn.Module, X: torch.Tensor, Y: Any, *, loss: str | LossName = "mse",
                         max_order: int = 4) -> Moments:
    """Exact ``Tr(I^k) = Σ_i μ_i^k`` over :func:`gauss_newton_eigenvalues` μ (method "ntk_gram")."""
    kmax = check_int("max_order", max_order, 1)
    mu = gauss_newton_eigenvalues(model, X, Y, loss=loss)
    est = np.array([np.sum(mu ** k) for k in range(1, kmax + 1)])
    return Moments(est, np.zeros(kmax), 0, "ntk_gram")
