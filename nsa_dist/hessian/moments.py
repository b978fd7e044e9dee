"""Moments ``Tr(A^k)`` of ``A ∈ {H, I, S}``: Hutchinson, Hutch++, and exact ones.

Every estimator reuses one set of products for all orders.  Hutch++'s sketch columns q need
``A^j q`` for j ≤ h = ⌈k_max / 2⌉ (``qᵀ A^k q = (A^a q)ᵀ (A^b q)``, a = ⌊k/2⌋, b = k − a); the
Gaussian probes z of the Hutchinson part need every ``A^j z``, j ≤ k_max, because the standard
error of order k is built from ``‖P⊥ A^k z‖²``.  Hutchinson costs ``m · k_max`` products,
Hutch++ ``2s + s·h + g·k_max`` (s sketch columns, g = m − s probes).

How the error bars are calibrated.  Given the sketch Q (any orthonormal Q), ``Tr A^k =
Tr Qᵀ A^k Q + Tr B`` with ``B = P⊥ A^k P⊥``: the first term is computed exactly, the second is
the mean of g forms ``z_iᵀ B z_i`` over Gaussian z_i, distributed as ``Σ_j λ_j(B) χ²_g / g``
with variance ``2 ‖B‖_F² / g``.  The sketch adds no variance of its own (the estimate is
unbiased for every Q), so that conditional variance is the one to estimate, and:

1. ``‖B‖_F²`` is estimated by ``D = (1/g) Σ_i ‖B z_i‖²`` — Hutchinson on ``Tr B²``, quadratic in
   the probes and unbiased for any probes with ``E zzᵀ = P⊥`` — not from the pair forms
   ``(z_iᵀ B z_j)²``.  Those are quartic in the probes: when a few eigenvalues dominate B (the
   outliers of H and S that a sketch leaves in ``A³``, ``A⁴``: ``‖B‖_F⁴ / ‖B²‖_F²`` is 2–4 on a
   small network) a quartic estimate moves with the square of the estimate's own χ² draw, and
   a low draw came with a much too small bar; D moves with the draw itself (with one dominant
   direction λ: estimate ``λ χ²_g / g``, D ``λ² χ²_g / g``).
2. The sketch is ``orth(A² Ω)`` (one subspace iteration, s more products) rather than
   ``orth(A Ω)``: it leaves less of the outliers to the remainder.  For the additivity gap
   (:func:`~nsa_dist.hessian.additivity_gap`) it is H's, ``orth(H² Ω)``: its dominant space
   carries the cross terms ``IS + SI``, which a sketch of ``[I Ω₁, S Ω₂]`` left to the remainder.
3. The standard error is floored at the float64 rounding of the sums (``P · u ·
   Σ ‖A^a v‖ ‖A^b v‖``, :func:`_with_rounding`), which is all that is left when the remainder
   is numerically null (I of rank below the sketch; ``H − I − S`` at k = 1).

Measured over 2000 seeds (``tests/test_hutch_coverage.py``: a 60 × 60 Wigner matrix with 12
probes; S, H and the additivity gap of two small networks, MSE and cross-entropy, with the
pipeline's 16 probes), every order k = 1…4 covers 68.3 % / 95.4 % within three binomial
standard deviations (±1σ 0.66–0.71, ±2σ 0.943–0.965); with the quartic estimate and
``orth(A Ω)``, ±2σ covered 0.89–0.92 for H and S at k = 2, 4 and 0.87 for the gap at k = 3, 4.
What is left is about 0.01 at ±2σ for the even orders, whose remainders are positive
semi-definite (D still moves with the draw, if only linearly): on seeds 2000–3999 S⁴ of the
MSE network covered ±2σ at 0.937, against 0.952 with the true conditional standard error
(S² at ±1σ: 0.643, and 0.646 with the true one — the estimate's own spread, not D's).
No Student-t widening is applied: D's Satterthwaite degrees of freedom ``g ‖B‖_F⁴ / ‖B²‖_F²``
also set the estimate's own excess kurtosis (``12 ‖B²‖_F² / (g ‖B‖_F⁴)``), which raises the
±1σ coverage while the noise in D lowers it; measured, a widening to the ``t_ν`` interval
over-covered the gap at ±1σ (0.72).  The limit is a remainder with one or two steeply decaying directions,
where the estimate is χ²_g-like: I of rank N·K above the sketch covers ±1σ at 0.66–0.69 and
±2σ at only 0.92–0.94 with 16 probes (the pipeline also has I's moments exactly, from the
NTK Gram).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nsa_dist.config import LossName
from nsa_dist.hessian._loss import curvature_sqrt
from nsa_dist.hessian._operator import copyable
from nsa_dist.hessian._probes import LinearMap, as_linear_map, check_int, gaussian, rademacher
from nsa_dist.hessian.operators import _setup
from nsa_dist.losses import parse_loss
from nsa_dist.ntk import gram, preserved
from nsa_dist.ntk.blame import blame
from nsa_dist.ntk.inputs import as_2d
from nsa_dist.ntk.state import stateless

if TYPE_CHECKING:
    from torch import nn

    from nsa_dist.models import OutputSelector

__all__ = [
    "Moments",
    "hutchinson_moments",
    "hutchpp_moments",
    "dense_moments",
    "gauss_newton_eigenvalues",
    "gauss_newton_moments",
]


@dataclass(frozen=True)
class Moments:
    """``Tr(A^k)`` for ``k = 1 … max_order``.

    Attributes:
        estimate: (max_order,) float64, ``estimate[k − 1] ≈ Tr(A^k)``.
        stderr: (max_order,) standard errors of the estimates (module docstring: how they are
            calibrated); 0 for values computed without sampling, NaN when fewer than two
            probes leave no spread to measure.
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


def _remainder(
    terms: list[tuple[float, list[np.ndarray]]], Q: np.ndarray, max_order: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hutchinson's mean and standard error for ``B_k = Σ_t c_t P⊥ A_t^k P⊥``, k = 1 … max_order.

    ``terms`` holds (c_t, [Z, A_t Z, …, A_t^max_order Z]) for the same g ≥ 1 Gaussian probes Z
    (P, g), already projected by ``P⊥ = 1 − Q Qᵀ`` (Q (P, s) orthonormal; s = 0 for plain
    Hutchinson).  The estimate is the mean of ``z_iᵀ B_k z_i``; its variance ``2 ‖B_k‖_F² / g``
    is estimated with ``‖B_k‖_F² ≈ (1/g) Σ_i ‖B_k z_i‖²`` (unbiased: ``E ‖B z‖² = Tr(B P⊥ B)``;
    module docstring).

    Returns:
        ((max_order,) mean, (max_order,) stderr — NaN for g < 2, (max_order,) the rounding scale
        of :func:`_form_scale` averaged over the probes).
    """
    g = terms[0][1][0].shape[1]
    q = sum(c * _quadratic_forms(pw, max_order) for c, pw in terms)  # (max_order, g)
    scale = sum(_form_scale(pw, max_order) for _, pw in terms) / g
    if g < 2:
        return q.mean(axis=1), np.full(max_order, np.nan), scale
    sq = np.empty((max_order, g))
    for k in range(1, max_order + 1):
        BZ = sum(c * pw[k] for c, pw in terms)  # (P, g): B_k z_i
        BZ = BZ - Q @ (Q.T @ BZ)
        sq[k - 1] = np.einsum("pm,pm->m", BZ, BZ)  # ‖B_k z_i‖²
    return q.mean(axis=1), np.sqrt(2 * sq.mean(axis=1) / g), scale


def _form_scale(pw: list[np.ndarray], max_order: int) -> np.ndarray:
    """(max_order,) ``Σ_i ‖A^a v_i‖ ‖A^b v_i‖`` over the columns v_i of ``pw[0]`` (a + b = k as in
    :func:`_quadratic_forms`): the size of the terms whose float64 sum is a trace estimate."""
    n = [np.linalg.norm(X, axis=0) for X in pw]
    return np.array([np.sum(n[k // 2] * n[k - k // 2]) for k in range(1, max_order + 1)])


def _with_rounding(se: np.ndarray, scale: np.ndarray, P: int) -> np.ndarray:
    """The sampling standard error, floored at ``P · u · scale`` (u the float64 unit roundoff): the
    rounding of the sums, which is all that is left when the remainder is numerically null."""
    return np.hypot(se, P * np.finfo(np.float64).eps / 2 * scale)


def _sketch(A: LinearMap, Omega: np.ndarray) -> np.ndarray:
    """Q (P, s): an orthonormal basis of ``A² Ω`` (one subspace iteration: the remainder left to
    Hutchinson keeps fewer of the outliers than with ``A Ω``)."""
    return np.linalg.qr(A(A(Omega)))[0]


def hutchinson_moments(A: Any, n_probes: int = 32, *, max_order: int = 4, seed: int = 0) -> Moments:
    """Hutchinson's estimate ``Tr(A^k) ≈ (1/m) Σ_i z_iᵀ A^k z_i`` with Gaussian probes z_i.

    Unbiased; the standard error ``√(2 ‖A^k‖_F² / m)`` with ``‖A^k‖_F² ≈ (1/m) Σ_i ‖A^k z_i‖²``
    (module docstring).

    Args:
        A: symmetric (P, P): a dense NumPy/torch matrix or an operator (``shape``, ``matmat``),
            e.g. from :func:`~nsa_dist.hessian.hessian_operator`.
        n_probes: m ≥ 1 probes (stderr NaN for m = 1); the cost is ``m · max_order`` products.
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
    est, se, scale = _remainder([(1.0, _powers(Amap, Z, kmax))], np.zeros((Amap.P, 0)), kmax)
    return Moments(est, _with_rounding(se, scale, Amap.P), Amap.n_products, "hutchinson")


def hutchpp_moments(
    A: Any, n_probes: int = 32, *, max_order: int = 4, sketch: int | None = None, seed: int = 0
) -> Moments:
    """Hutch++ (Meyer et al. 2021) for every power: ``Tr(A^k) = Tr(Qᵀ A^k Q) + Tr(P⊥ A^k P⊥)``.

    Q (P, s) is an orthonormal basis of ``A² Ω`` (Ω Rademacher, s sketch columns): it captures
    the dominant eigenspace of A and so of every power ``A^k``.  The first term is computed
    exactly; the second by Hutchinson with ``g = n_probes − s`` Gaussian probes projected by
    ``P⊥ = 1 − Q Qᵀ``.  Much lower variance than Hutchinson when a few eigenvalues dominate
    (the outliers of I and H).  The standard error is the whole estimate's: given Q the sketch
    part is exact and the estimate unbiased, so all the variance is the Hutchinson part's,
    ``2 ‖P⊥ A^k P⊥‖_F² / g``, estimated from the ``‖P⊥ A^k z_i‖²`` (module docstring).

    Args:
        A: symmetric (P, P) matrix or operator.
        n_probes: random vectors in all, s + g ≥ 1.
        max_order: highest k (≥ 1).
        sketch: s, default ``n_probes // 2`` (capped at P; s = P makes the result exact).
        seed: NumPy seed.

    Returns:
        :class:`Moments` (method "hutch++"); cost ``2s + s·⌈max_order / 2⌉ + g·max_order``
        products.  The stderr is 0 when s = P (exact) and NaN when g < 2.

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
    Q, scale = np.zeros((Amap.P, 0)), np.zeros(kmax)
    if s > 0:
        Q = _sketch(Amap, rademacher(rng, Amap.P, s))  # (P, s)
        pw = _powers(Amap, Q, h)
        est += _quadratic_forms(pw, kmax).sum(axis=1)
        scale += _form_scale(pw, kmax)
    if g > 0 and s < Amap.P:
        Z = gaussian(rng, Amap.P, g)  # (P, g)
        Z -= Q @ (Q.T @ Z)
        mean, se, rscale = _remainder([(1.0, _powers(Amap, Z, kmax))], Q, kmax)
        est += mean
        se = _with_rounding(se, scale + rscale, Amap.P)
    return Moments(est, se, Amap.n_products, "hutch++")


def dense_moments(A: Any, max_order: int = 4) -> Moments:
    """Exact ``Tr(A^k) = Σ_i λ_i^k`` from ``eigvalsh`` of the dense matrix (an operator is
    materialised with P products) — for small P and tests."""
    kmax = check_int("max_order", max_order, 1)
    Amap = as_linear_map(A)
    M = Amap(np.eye(Amap.P))  # (P, P)
    lam = np.linalg.eigvalsh((M + M.T) / 2)
    est = np.array([np.sum(lam**k) for k in range(1, kmax + 1)])
    return Moments(est, np.zeros(kmax), Amap.n_products, "dense")


def gauss_newton_eigenvalues(
    model: nn.Module, X: torch.Tensor, Y: Any, *, loss: str | LossName = "mse", output: OutputSelector = None
) -> np.ndarray:
    """The spectrum of I outside its null space, from the NTK Gram (exact, no Hessian products).

    ``I = (1/N) Jᵀ HC J`` has the same nonzero eigenvalues as ``(1/N) HC^{1/2} G HC^{1/2}``,
    ``G = J Jᵀ`` the full (N·K) × (N·K) NTK Gram (the Hessian paper: I is the weighted kernel
    PCA of the data w.r.t. the NTK).  For MSE ``HC = Id`` and this is ``G / N``.

    Args:
        model: the module; X (N, d) inputs; Y targets as for :func:`~nsa_dist.hessian.hessian_operator`
            (only cross-entropy uses them).
        loss: "mse" | "cross_entropy".
        output: which output is f when the model returns a dict, a tuple or a ``ModelOutput``.

    Returns:
        (N·K,) float64 NumPy, descending (the zeros of a rank-deficient Gram included).

    Raises:
        as :func:`~nsa_dist.hessian.hessian_operator`.
    """
    loss_ = parse_loss(loss)
    model, X, Yt = _setup(model, X, Y, loss_, torch.float64, output)
    N, K = Yt.shape
    # as the Hessian operators: a forward that writes a buffer other than a norm's running statistics
    # (spectral_norm's power iteration in train mode) is refused — its loss is another function at
    # every forward; the outputs are those of a copy that writes none (the user's model is unchanged)
    with blame(model, "the loss Hessian"), copyable(model):
        once = stateless(model, X)
    G = gram(model, X, kernel="full", dtype=torch.float64)  # (N, K, N, K); model: f already selected
    if loss_ is LossName.CROSS_ENTROPY:
        with preserved(once), blame(once, "the loss Hessian"), torch.no_grad():
            R = curvature_sqrt(loss_, as_2d(once(X), X.shape[0]), Yt)  # (N, K, K)
        G = torch.einsum("iab,ibjc,jdc->iajd", R, G, R)
    M = G.reshape(N * K, N * K).cpu().numpy() / N
    return np.linalg.eigvalsh((M + M.T) / 2)[::-1].copy()


def gauss_newton_moments(
    model: nn.Module,
    X: torch.Tensor,
    Y: Any,
    *,
    loss: str | LossName = "mse",
    max_order: int = 4,
    output: OutputSelector = None,
) -> Moments:
    """Exact ``Tr(I^k) = Σ_i μ_i^k`` over :func:`gauss_newton_eigenvalues` μ (method "ntk_gram";
    ``output`` as there)."""
    kmax = check_int("max_order", max_order, 1)
    mu = gauss_newton_eigenvalues(model, X, Y, loss=loss, output=output)
    est = np.array([np.sum(mu**k) for k in range(1, kmax + 1)])
    return Moments(est, np.zeros(kmax), 0, "ntk_gram")
