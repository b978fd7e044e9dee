"""Closed-form GD dynamics of the L2 loss under a constant Gramian (NSA Eqs. 4–5, App. D Eqs. 14–16)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from nsa_dist.errors import ShapeError
from nsa_dist.metrics._validate import as_real, check_rows, count, positive_scalar, work_dtype

__all__ = [
    "constant_gram_dynamics",
    "ConstantGramTrajectory",
    "constant_gram_decay",
    "constant_gram_residual",
    "ConstantGramResidual",
    "constant_gram_test_outputs",
    "constant_gram_decays",
    "constant_gram_log_decays",
    "Decays",
]


class ConstantGramTrajectory(NamedTuple):
    """Predicted outputs f̄_t and residuals m̄_t = f̄_t − ȳ at the requested steps t."""

    f: np.ndarray
    """f̄_t: (N,) / (N, M) for a scalar step, (T, N) / (T, N, M) for T steps."""
    m: np.ndarray
    """m̄_t, same shape as ``f``."""


def _steps(steps: Any) -> np.ndarray:
    """``steps`` as a 0-D or 1-D int64 array of values >= 0."""
    t = np.asarray(steps)
    if t.dtype.kind not in "iu" or t.ndim > 1:
        raise TypeError(f"steps must be an integer or a 1-D integer array, got {steps!r}")
    if t.size == 0 or np.any(t < 0):
        raise ValueError(f"steps must be integers >= 0 (GD iterations t), got {t.tolist()}")
    return t.astype(np.int64)


def constant_gram_dynamics(
    evals: Any, evecs: Any, f0: Any, y: Any, lr: float, steps: int | Any
) -> ConstantGramTrajectory:
    """GD on the L2 loss with a fixed Gramian, in closed form (NSA Eqs. 4–5; App. D Eqs. 14, 16).

    With c_i = ⟨v_i, m̄_0⟩, m̄_0 = f̄_0 − ȳ and r_i = 1 − δλ_i/N:

        m̄_t = Σ_i r_i^t c_i v_i + m̄_0^z                              (Eq. 5 / Eq. 14)
        f̄_t = f̄_0 − Σ_i (1 − r_i^t) c_i v_i                          (Eq. 4 / Eq. 16)

    the exact solution of m̄_{t+1} = (I − δG/N) m̄_t, f̄_{t+1} = f̄_t − (δ/N) G m̄_t.  m̄_0^z is the
    part of m̄_0 outside span(evecs): it never moves.  Pass all N eigenpairs (zero eigenvalues
    included) for the exact dynamics of G; with only the top K < N eigenpairs, the remaining
    eigenvalues are treated as 0 (G replaced by its rank-K truncation V diag(λ) Vᵀ).

    Args:
        evals: (K,) eigenvalues λ_i of G (any order, matched with the columns of ``evecs``).
        evecs: (N, K) orthonormal eigenvectors v_i as columns, K <= N.
        f0: f̄_0, outputs at the N training points: (N,) or (N, M).
        y: ȳ, labels of the same shape as ``f0``.
        lr: learning rate δ > 0.
        steps: t, an integer >= 0 or a 1-D array of T such integers.

    Returns:
        ``ConstantGramTrajectory(f, m)``: (N,) / (N, M) each for a scalar ``steps``, else
        (T, N) / (T, N, M); float32 if every array input is float32, else float64.
        Unstable steps (δ > 2N/λ_max) overflow to ±inf for large t, as GD would.

    Raises:
        ShapeError: evecs not (N, K) with K <= N, evals not (K,), or f0/y not matching (N,...).
        NonFiniteError: NaN/inf input.
        ValueError: lr <= 0, or a negative step.
        TypeError: a non-real dtype, or non-integer steps.
    """
    lam = as_real("evals", evals, (1,))  # (K,)
    V = as_real("evecs", evecs, (2,))  # (N, K)
    f0 = as_real("f0", f0, (1, 2))  # (N,) or (N, M)
    y = as_real("y", y, (1, 2))
    if V.shape[1] > V.shape[0] or lam.shape[0] != V.shape[1]:
        raise ShapeError(f"evecs must be (N, K) with K <= N and evals (K,), got evecs {V.shape}, evals {lam.shape}")
    check_rows("f0", f0, "evecs", V)
    if y.shape != f0.shape:
        raise ShapeError(f"y has shape {y.shape} and f0 has shape {f0.shape}; they must be equal")
    lr, t = positive_scalar("lr", lr), _steps(steps)
    dtype = work_dtype(lam, V, f0, y)
    V, N = V.astype(np.float64), V.shape[0]
    m0 = f0.astype(np.float64) - y  # (N,) or (N, M)
    c = V.T @ m0  # (K,) or (K, M)
    m0_z = m0 - V @ c  # (N,) or (N, M), outside span(evecs)
    decay = np.power(1.0 - lr * lam.astype(np.float64) / N, np.atleast_1d(t)[:, None])  # (T, K)
    kept = np.einsum("nk,tk,k...->tn...", V, decay, c, optimize=True)  # (T, N) or (T, N, M): Σ r_i^t c_i v_i
    learned = (V @ c)[None] - kept  # Σ (1 − r_i^t) c_i v_i
    f, m = f0[None] - learned, kept + m0_z[None]
    if t.ndim == 0:
        f, m = f[0], m[0]
    return ConstantGramTrajectory(f.astype(dtype), m.astype(dtype))


class ConstantGramResidual(NamedTuple):
    """‖m̄_t‖ and E(m̄_t, k) predicted by GD with the Gramian G_{t0} held fixed (Eq. 5)."""

    norm: np.ndarray
    """(S,) ‖m̄_t‖ at each requested step."""
    energy: np.ndarray
    """(S, K) E(m̄_t, k) = Σ_{i≤k} ⟨v_i, m̄_t⟩² / ‖m̄_t‖² in the eigenbasis of G_{t0}."""


class Decays(NamedTuple):
    """r_i(t_j) = Π_s (1 − δ_s λ_i/N) held as a sign and a log-modulus.

    Beyond GD's stability bound (δ λ_i/N > 2) |r_i| grows geometrically and overflows float64
    after a few hundred steps; its logarithm does not, so ratios such as E(m̄_t, k) stay exact.
    """

    log_abs: np.ndarray
    """(S, K) or (K,) log|r_i(t_j)| (−inf where r is exactly 0)."""
    sign: np.ndarray
    """Same shape: the sign of r_i(t_j) (0 where r is 0)."""

    def values(self) -> np.ndarray:
        """r itself, ±inf where its modulus overflows float64."""
        with np.errstate(over="ignore"):
            return self.sign * np.exp(self.log_abs)

    def overflows(self) -> np.ndarray:
        """(S,) whether any r_i(t_j) of step j overflows float64 (the prediction diverges there)."""
        return ~np.isfinite(self.values()).reshape(self.log_abs.shape[0], -1).all(axis=1)

    @classmethod
    def of(cls, values: Any) -> Decays:
        """The decays of finite values r (e.g. from :func:`constant_gram_decays`)."""
        r = as_real("decays", values, (1, 2)).astype(np.float64)
        with np.errstate(divide="ignore"):
            return cls(np.log(np.abs(r)), np.sign(r))


def _rates(lrs: Any) -> np.ndarray:
    """``lrs`` as a 1-D float64 array of finite rates >= 0 (none: an empty array)."""
    d = np.asarray(lrs.detach().cpu().numpy() if hasattr(lrs, "detach") else lrs).reshape(-1)
    if d.size == 0:
        return d.astype(np.float64)
    d = as_real("lrs", d, (1,)).astype(np.float64)
    if np.any(d < 0):
        bad = np.flatnonzero(d < 0)[:10].tolist()
        raise ValueError(f"lrs must be learning rates >= 0, got negative values at indices {bad} (min {d.min()})")
    return d


def constant_gram_log_decays(evals: Any, lrs: Any, offsets: Any, n: int) -> Decays:
    """r_i(t_j) = Π_{s<t_j−t_0} (1 − δ_s λ_i/N) at several steps as :class:`Decays`, one pass over the rates.

    Exact: over each run of updates the product is Π_u (1 − δ_u λ_i/N)^{count_u} over the
    distinct rates δ_u, summed as count_u · log|1 − δ_u λ_i/N| with the sign's parity.

    Args:
        evals: (K,) eigenvalues of G_{t0}.
        lrs: (T,) the rates of updates t_0, t_0 + 1, … (at least max(offsets) of them).
        offsets: (S,) increasing t_j − t_0 ≥ 0.
        n: N.

    Returns:
        :class:`Decays` of shape (S, K).

    Raises:
        NonFiniteError: NaN/inf in evals or lrs.
        ValueError: a negative rate, or offsets not increasing within 0..T.
        TypeError: non-integer offsets or n.
        ShapeError: n < 1.
    """
    lam = as_real("evals", evals, (1,)).astype(np.float64)
    d = _rates(lrs)
    off = np.asarray(offsets).reshape(-1)
    if off.size and off.dtype.kind not in "iu":
        raise TypeError(f"offsets must be integers (steps t_j − t_0), got dtype {off.dtype}: {off.tolist()[:10]}")
    off, n = off.astype(np.int64), count("n", n, 1)
    if np.any(np.diff(off) < 0) or (off.size and (off[0] < 0 or off[-1] > d.size)):
        raise ValueError(f"offsets must increase within 0..{d.size} (the rates given), got {off.tolist()[:10]}")
    log_abs, sign = np.empty((off.size, lam.size)), np.empty((off.size, lam.size))
    la, sg, prev = np.zeros_like(lam), np.ones_like(lam), 0
    for j, o in enumerate(off):
        rates, counts = np.unique(d[prev:o], return_counts=True)
        for rate, c in zip(rates, counts):
            factor = 1.0 - rate * lam / n
            with np.errstate(divide="ignore"):
                la = la + int(c) * np.log(np.abs(factor))
            sg = sg * np.sign(factor) ** (int(c) % 2) * (factor != 0)
        log_abs[j], sign[j], prev = la, sg, o
    return Decays(log_abs, sign)


def constant_gram_decay(evals: Any, lrs: Any, n: int) -> np.ndarray:
    """Π_s (1 − δ_s λ_i / N) over the learning rates δ_s of a run of updates (Eq. 5 with a schedule).

    Exact: the product is taken as Π_u (1 − δ_u λ_i/N)^{count_u} over the distinct rates δ_u.
    Beyond the stability bound the product overflows to ±inf (:func:`constant_gram_log_decays`
    keeps it finite).

    Args:
        evals: (K,) eigenvalues λ_i of G.
        lrs: (T,) learning rates of T consecutive updates (T = 0: all ones).
        n: N, the number of training points.

    Returns:
        (K,) float64.
    """
    T = int(np.asarray(lrs).size)
    return constant_gram_log_decays(evals, lrs, [T], n).values()[0]


def constant_gram_decays(evals: Any, lrs: Any, offsets: Any, n: int) -> np.ndarray:
    """r_i(t_j) = Π_{s<t_j−t_0} (1 − δ_s λ_i/N) at several steps (:func:`constant_gram_log_decays`'s values).

    Returns:
        (S, K) float64, ±inf where |r| overflows (beyond the stability bound).
    """
    return constant_gram_log_decays(evals, lrs, offsets, n).values()


def constant_gram_residual(
    evals: Any, proj: Any, m0_sq: float, decays: Decays | Any, *, complete: bool = False
) -> ConstantGramResidual:
    """‖m̄_t‖ and E(m̄_t, k) under GD with G fixed at G_{t0} (NSA Eq. 5 / App. D Eq. 14), from projections.

    With p_i = ⟨v_i, m̄_{t0}⟩² (summed over output columns) and the decay r_i(t) = Π_{s=t0}^{t−1}
    (1 − δ_s λ_i/N) (:func:`constant_gram_log_decays`):  ‖m̄_t‖² = Σ_i r_i(t)² p_i + ‖m̄_{t0}^z‖²,
    ‖m̄^z‖² = ‖m̄_{t0}‖² − Σ_i p_i (the part outside the K eigenvectors, which never moves: the
    rank-K truncation of G, exact for K = N).

    Summed in log space: above the stability bound (δ λ_1/N > 2) the energies stay exact and the
    norm is +inf only where it exceeds float64 (the prediction diverges there).

    Args:
        evals: (K,) eigenvalues of G_{t0}, any order (matched with ``proj`` and the columns of
            ``decays``); proj: (K,) p_i.
        m0_sq: ‖m̄_{t0}‖² (the SQUARED norm, >= Σ p_i).
        decays: :class:`Decays` or finite values r_i(t_j), (S, K).
        complete: the K eigenvectors span R^N (K = N): m̄^z = 0 exactly.  Pass it then: the
            difference ‖m̄_{t0}‖² − Σ p_i is only rounding (e.g. ‖m̄‖² from float32-stored outputs,
            ~1e-7 relative), and held fixed it would floor the predicted ‖m̄_t‖ at ~3e-4·‖m̄_{t0}‖
            and drive E(m̄_t, K) to 0 once the residual has converged.

    Returns:
        ``ConstantGramResidual(norm (S,), energy (S, K))`` float64; ``energy[:, k-1]`` is the share
        of the k LARGEST eigenvalues (inputs are sorted by descending eigenvalue first); NaN
        where m̄_t = 0.

    Raises:
        ShapeError: mismatched shapes.
        NonFiniteError: NaN/inf in evals, proj or m0_sq.
        ValueError: a negative p_i or m0_sq, or m0_sq < Σ p_i (not ‖m̄_{t0}‖²).
    """
    lam = as_real("evals", evals, (1,)).astype(np.float64)
    p = as_real("proj", proj, (1,)).astype(np.float64)
    dec = decays if isinstance(decays, Decays) else Decays.of(decays)
    la = np.asarray(dec.log_abs, np.float64)
    if p.shape != lam.shape or la.ndim != 2 or la.shape[1] != lam.shape[0]:
        raise ShapeError(f"proj {p.shape}, evals {lam.shape} and decays {la.shape} must be (K,), (K,), (S, K)")
    m0_sq = float(as_real("m0_sq", m0_sq, (0,)))
    if np.any(p < 0) or m0_sq < 0:
        raise ValueError(f"proj (min {p.min()}) and m0_sq ({m0_sq}) are squared norms and must be >= 0")
    if m0_sq < float(p.sum()) * (1 - 1e-3):
        raise ValueError(
            f"m0_sq = {m0_sq} < Σ proj = {float(p.sum())}: ‖m̄_t0‖² cannot be below the energy of its "
            "projections (Bessel); pass the SQUARED norm, with proj from orthonormal eigenvectors"
        )
    order = np.argsort(-lam, kind="stable")  # E(m̄_t, k) sums the k LARGEST eigenvalues' shares
    lam, p, la = lam[order], p[order], la[:, order]
    rest = 0.0 if complete else max(m0_sq - float(p.sum()), 0.0)  # ‖m̄^z‖², clipped at round-off
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_kept = 2.0 * la + np.log(p)[None, :]  # (S, K) log(r_i² p_i), −inf where p_i = 0 or r_i = 0
        log_rest = np.full((la.shape[0], 1), np.log(rest))
        scale = np.max(np.concatenate([log_kept, log_rest], axis=1), axis=1, keepdims=True)  # (S, 1)
        scale = np.where(np.isfinite(scale), scale, 0.0)
        kept = np.exp(log_kept - scale)
        total = kept.sum(axis=1, keepdims=True) + np.exp(log_rest - scale)  # (S, 1), ≥ 1 unless all zero
        norm = np.exp(0.5 * (scale[:, 0] + np.log(total[:, 0])))
        return ConstantGramResidual(norm, np.cumsum(kept, axis=1) / total)


def constant_gram_test_outputs(ext: Any, coef: Any, f0_test: Any, decays: Decays | Any) -> np.ndarray:
    """Outputs at test points under GD with a fixed Gramian, through its eigenfunctions (App. E, Eq. 22):

        f_t(X') = f_0(X') − Σ_i [1 − r_i(t)] ⟨v_i, m̄_0⟩ ṽ_i(X'),   ṽ_i(X') = g(X', 𝒳) v_i / λ_i (Eq. 9)

    with r_i(t) = Π_s (1 − δ_s λ_i/N) (:func:`constant_gram_decay`).  Over all eigenpairs with
    λ_i > 0 this is Eq. 18 exactly (g(X', 𝒳) m̄_0^z = 0 for a Jacobian kernel); over the top K it
    is the rank-K truncation.  Columns of ``ext`` that are NaN (eigenpairs left out) count as 0.
    Steps at which some r_i(t) overflows float64 (beyond the stability bound) are NaN: the
    prediction diverges there.

    Args:
        ext: (M, K) Nyström extensions ṽ_i at the M test points (:func:`nystrom_extension`).
        coef: (K,) or (K, Ko) c_i = ⟨v_i, m̄_0⟩ per output column.
        f0_test: (M,) or (M, Ko) f_0(X').
        decays: (S, K) r_i(t) at S steps, finite values or :class:`Decays`.

    Returns:
        (S, M) or (S, M, Ko) float64.
    """
    dec = decays if isinstance(decays, Decays) else Decays.of(decays)
    E = np.nan_to_num(as_real("ext", ext, (2,)).astype(np.float64, copy=True), nan=0.0)  # (M, K)
    c = as_real("coef", coef, (1, 2)).astype(np.float64)
    f0 = as_real("f0_test", f0_test, (1, 2)).astype(np.float64)
    r = np.asarray(dec.values(), np.float64)  # (S, K), ±inf where it overflows
    diverged = dec.overflows() if r.ndim == 2 else np.zeros(0, bool)
    r = np.where(diverged[:, None], 0.0, r) if r.ndim == 2 else r
    if (
        r.ndim != 2
        or c.shape[0] != E.shape[1]
        or r.shape[1] != E.shape[1]
        or f0.shape[0] != E.shape[0]
        or c.ndim != f0.ndim
    ):
        raise ShapeError(
            f"ext {E.shape}, coef {c.shape}, f0_test {f0.shape}, decays {r.shape} do not match "
            "(M, K), (K[, Ko]), (M[, Ko]), (S, K)"
        )
    C = c.reshape(c.shape[0], -1)  # (K, Ko)
    learned = np.einsum("mk,sk,ko->smo", E, 1.0 - r, C)  # (S, M, Ko)
    out = f0.reshape(f0.shape[0], -1)[None] - learned
    with np.errstate(invalid="ignore"):
        out[diverged | ~np.isfinite(out).reshape(out.shape[0], -1).all(axis=1)] = np.nan
    return out[..., 0] if f0.ndim == 1 else out
