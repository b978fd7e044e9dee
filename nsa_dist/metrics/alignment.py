"""Kernel-target alignment of a Gramian with the labels (Cristianini et al.; Cortes et al.)."""

from __future__ import annotations

from typing import Any

import numpy as np

from nsa_dist.errors import ShapeError
from nsa_dist.metrics._validate import as_real, block_size, check_rows, nonzero_norms

__all__ = ["kernel_target_alignment", "alignment_from_products", "centered_sq_frobenius"]


def _centered_frobenius2(G: np.ndarray) -> float:
    """‖HGH‖_F² with H = I − 11ᵀ/N, built row-block by row-block (never a second N×N array)."""
    col_mean = G.mean(axis=0, dtype=np.float64)  # (N,)
    row_mean = G.mean(axis=1, dtype=np.float64)  # (N,)
    grand = col_mean.mean()
    total, B = 0.0, block_size(G.shape[1])
    for a in range(0, G.shape[0], B):
        Gc = G[a : a + B].astype(np.float64) - row_mean[a : a + B, None] - col_mean[None, :] + grand  # (B, N)
        total += float(np.sum(Gc * Gc))
    return total


def _frobenius2(G: np.ndarray) -> float:
    """‖G‖_F² accumulated in float64, row block by row block."""
    B = block_size(G.shape[1])
    return float(sum(np.sum(np.square(G[a : a + B].astype(np.float64))) for a in range(0, G.shape[0], B)))


def kernel_target_alignment(G: Any, y: Any, centered: bool = False) -> float:
    """Alignment A(G, yyᵀ) = ⟨G, T⟩_F / (‖G‖_F ‖T‖_F) between a Gramian and the target, in [−1, 1].

    T = Y Yᵀ = Σ_c y_c y_cᵀ (summed over output columns c).  For one output it is
    A = yᵀ G y / (‖G‖_F ‖y‖²) (Cristianini et al., 2002); in general
    A = tr(Yᵀ G Y) / (‖G‖_F ‖Yᵀ Y‖_F), since ‖Y Yᵀ‖_F = ‖Yᵀ Y‖_F.

    ``centered=True`` gives the centred alignment of Cortes, Mohri & Rostamizadeh (2012):
    with H = I − 11ᵀ/N, G_c = H G H and Y_c = H Y (columns minus their means),
    A_c = ⟨G_c, Y_c Y_cᵀ⟩_F / (‖G_c‖_F ‖Y_c Y_cᵀ‖_F) = tr(Y_cᵀ G Y_c) / (‖HGH‖_F ‖Y_cᵀ Y_c‖_F).

    Args:
        G: (N, N) float Gramian G_t (NTK at the training points).
        y: (N,) target vector ȳ, or (N, C) for C outputs.
        centered: centre G and y first (Cortes et al.) instead of the raw alignment.

    Returns:
        The alignment as a Python float (computed in float64).

    Raises:
        ShapeError: G not square, y not 1-/2-D, or their N differ.
        NonFiniteError: NaN/inf input, or a zero ‖G‖_F or zero target (after centring when
            ``centered``; a constant y centres to 0) — the alignment is then 0/0.
        TypeError: a non-real dtype.
    """
    G = as_real("G", G, (2,))  # (N, N)
    if G.shape[0] != G.shape[1]:
        raise ShapeError(f"G must be a square (N, N) Gramian, got shape {G.shape}")
    Y = as_real("y", y, (1, 2)).astype(np.float64)
    check_rows("y", Y, "G", G)
    Y = Y.reshape(Y.shape[0], -1)  # (N, C)
    if centered:
        Y = Y - Y.mean(axis=0)  # H Y
    what = "the alignment ⟨G, yyᵀ⟩_F / (‖G‖_F ‖yyᵀ‖_F)"
    nonzero_norms("centred y" if centered else "y", np.sum(Y * Y), what)
    G_norm2 = _centered_frobenius2(G) if centered else _frobenius2(G)
    nonzero_norms("centred G" if centered else "G", np.asarray(G_norm2), what)
    # tr(Yᵀ G Y) in float64, row block by row block: a float32 product G·Y would keep the rounding
    # of G's constant offset that centring cancels (rel. error ~1e-4 for an offset 1e6·‖G_c‖).
    numer, B = 0.0, block_size(G.shape[1])
    for a in range(0, G.shape[0], B):
        numer += float(np.sum(Y[a : a + B] * (G[a : a + B].astype(np.float64) @ Y)))
    return float(numer / (np.sqrt(G_norm2) * np.linalg.norm(Y.T @ Y)))


def centered_sq_frobenius(sq_frobenius: float, G1: Any) -> float:
    """‖HGH‖_F² = ‖G‖_F² − 2‖g‖²/N + (1ᵀg)²/N² from ‖G‖_F² and g = G 1 (H = I − 11ᵀ/N, G symmetric)."""
    g = np.asarray(G1, dtype=np.float64).reshape(-1)  # (N,)
    N = g.shape[0]
    return float(sq_frobenius) - 2 * float(g @ g) / N + float(g.sum()) ** 2 / N**2


def alignment_from_products(y: Any, GY: Any, sq_frobenius: float, centered: bool = False, G1: Any = None) -> float:
    """The alignment of :func:`kernel_target_alignment` from products only (G never gathered).

    Raw: ``A = tr(Yᵀ G Y) / (‖G‖_F ‖YᵀY‖_F)``.  Centred, with ``g = G 1`` and ``Y_c = Y − 1ȳᵀ``
    (so ``G Y_c = G Y − g ȳᵀ``): ``A_c = tr(Y_cᵀ G Y_c) / (‖HGH‖_F ‖Y_cᵀ Y_c‖_F)``.

    Args:
        y: (N,) or (N, C) target.
        GY: G y, same shape.
        sq_frobenius: ‖G‖_F² (raw) or ‖HGH‖_F² (centred; see :func:`centered_sq_frobenius`),
            exact or estimated.
        centered: the centred alignment (needs ``G1``).
        G1: (N,) G 1.

    Returns:
        The alignment (float64); NaN when a norm is zero or not finite.
    """
    Y = np.asarray(y, dtype=np.float64).reshape(len(y), -1)  # (N, C)
    GYm = np.asarray(GY, dtype=np.float64).reshape(Y.shape)
    if centered:
        if G1 is None:
            raise ValueError("alignment_from_products(centered=True) needs G1 = G·1")
        g, ybar = np.asarray(G1, dtype=np.float64).reshape(-1), Y.mean(axis=0)  # (N,), (C,)
        Y, GYm = Y - ybar, GYm - g[:, None] * ybar[None, :]
    denom = np.sqrt(max(float(sq_frobenius), 0.0)) * np.linalg.norm(Y.T @ Y)
    if not np.isfinite(denom) or denom == 0.0:
        return float("nan")
    return float(np.sum(Y * GYm) / denom)
