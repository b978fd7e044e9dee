"""The Hessian paper's predictions, measured: additivity (Theorem 1), Tr(S) = ∇Cᵀ·G (Proposition 4),
the kernel-PCA limit of I, and the rank bounds of I and S.

* :func:`additivity_gap` — ``Tr(H^k) − Tr(I^k) − Tr(S^k)``, k = 1..4, estimated with one set of
  probes shared by H, I and S (a Hutch++ sketch spanning the dominant space of H, then
  Hutchinson on the rest), so the gap's standard error is that of the gap itself, not of three
  independent estimates.  ``H = I + S`` exactly, so k = 1 is 0 to rounding; for k ≥ 2 the gap is
  ``2 Tr(IS)`` (k = 2) and cross terms, which vanish only in the infinite-width limit.
* :func:`output_hessian_traces` — the vector ``G_i = Σ_p ∂²f(x_i)/∂θ_p²`` (per point and output)
  by Rademacher probes ``zᵀ ∇²_θ f(x_i) z`` (forward-over-forward, all points at once), with
  standard errors; :func:`trace_S_from_G` gives ``Tr(S) = (1/N) Σ_i ∇_f c_iᵀ G_i``.
* :func:`limit_gauss_newton_eigenvalues` — the nonzero spectrum of I predicted by the limiting NTK:
  ``eig((1/N) HC^{1/2} (Θ̃∞ ⊗ Id_K) HC^{1/2})`` (the weighted kernel PCA; MSE: ``eig(Θ̃∞)/N``).
* :func:`numerical_ranks` — ranks of dense I, S, H at a stated tolerance beside the paper's bounds
  ``Rank(I) ≤ N n_L`` and ``Rank(S) ≤ 2(L − 1) w N n_L``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.func import jvp, vmap

from nsa_dist._checks import check_finite
from nsa_dist.config import LossName
from nsa_dist.errors import ShapeError, UnsupportedModelError
from nsa_dist.hessian._loss import curvature_sqrt, prepare_targets
from nsa_dist.hessian._operator import _no_forward_rule, autograd_conventions, copyable
from nsa_dist.hessian._probes import as_linear_map, check_int, gaussian, rademacher
from nsa_dist.hessian.moments import (
    Moments,
    _form_scale,
    _powers,
    _quadratic_forms,
    _remainder,
    _sketch,
    _with_rounding,
)
from nsa_dist.hessian.operators import hessian_parts
from nsa_dist.losses import parse_loss
from nsa_dist.ntk import sample_coupling
from nsa_dist.ntk.blame import blame
from nsa_dist.ntk.inputs import (
    as_2d,
    default_block,
    output_dim,
    prepare_inputs,
    prepare_model,
    trainable_params,
)
from nsa_dist.ntk.state import FORWARD_AD_LOCK, call, exact_kernels, stateless

if TYPE_CHECKING:
    from torch import nn

    from nsa_dist.models import OutputSelector

_log = logging.getLogger("nsa_dist")

__all__ = [
    "additivity_gap",
    "OutputTraces",
    "output_hessian_traces",
    "trace_S_from_G",
    "limit_gauss_newton_eigenvalues",
    "Ranks",
    "numerical_ranks",
    "power_moments",
]


def power_moments(evals: np.ndarray, max_order: int = 4) -> np.ndarray:
    """``Σ_i λ_i^k`` for k = 1..max_order, (max_order,) float64 (NaN where λ is NaN).

    Raises:
        ValueError: max_order < 1.
    """
    check_int("max_order", max_order, 1)
    lam = np.asarray(evals, np.float64)
    return np.array([np.sum(lam**k) for k in range(1, max_order + 1)])


# --------------------------------------------------------------------------- Theorem 1: additivity


def additivity_gap(
    H: Any, I: Any, S: Any, n_probes: int = 32, *, max_order: int = 4, sketch: int | None = None, seed: int = 0
) -> Moments:
    """``Tr(H^k) − Tr(I^k) − Tr(S^k)`` for k = 1..max_order with probes shared by H, I and S.

    Hutch++ with one sketch for the three: Q (P, s) an orthonormal basis of ``H² Ω`` (s
    Rademacher columns: the dominant space of H, where the cross terms ``IS + SI`` of the gap
    are largest); the Q-part of every trace exactly, the rest by Hutchinson with the same
    ``g = n_probes − s`` Gaussian probes projected by ``1 − QQᵀ`` for H, I and S, the gap formed
    per probe (its standard error from ``‖P⊥ (H^k − I^k − S^k) z_i‖²`` as
    :func:`~nsa_dist.hessian.hutchpp_moments`, calibrated as :mod:`nsa_dist.hessian.moments`
    describes).

    Returns:
        :class:`Moments` (method "additivity") of the gap; stderr that of the Hutchinson part
        (0 when s = P: exact; NaN when g < 2).  Cost ``2s + 3 s ⌈max_order / 2⌉ + 3 g max_order``
        products.

    Raises:
        ValueError: n_probes < 1, max_order < 1, sketch outside 0..n_probes; ShapeError: the
            three are not square of one size.
    """
    m = check_int("n_probes", n_probes, 1)
    kmax = check_int("max_order", max_order, 1)
    s = check_int("sketch", m // 2 if sketch is None else sketch, 0, m)
    maps = [as_linear_map(A, name) for A, name in ((H, "H"), (I, "I"), (S, "S"))]
    P = maps[0].P
    if any(mp.P != P for mp in maps):
        raise ShapeError(f"H, I, S must have one size (P, P); got P = {[mp.P for mp in maps]}")
    s = min(s, P)
    g, h, rng = m - s, -(-kmax // 2), np.random.default_rng(seed)
    est = np.zeros(kmax)
    se = np.zeros(kmax) if s == P else np.full(kmax, np.nan)
    Q, scale = np.zeros((P, 0)), np.zeros(kmax)
    if s > 0:
        Q = _sketch(maps[0], rademacher(rng, P, s))  # (P, s): H's dominant space
        pw = [_powers(mp, Q, h) for mp in maps]
        q = [_quadratic_forms(p, kmax).sum(axis=1) for p in pw]
        est += q[0] - q[1] - q[2]
        scale += sum(_form_scale(p, kmax) for p in pw)
    if g > 0 and s < P:
        Z = gaussian(rng, P, g)
        Z -= Q @ (Q.T @ Z)
        terms = [(c, _powers(mp, Z, kmax)) for c, mp in zip((1.0, -1.0, -1.0), maps)]  # H − I − S
        mean, se, rscale = _remainder(terms, Q, kmax)
        est += mean
        se = _with_rounding(se, scale + rscale, P)
    return Moments(est, se, sum(mp.n_products for mp in maps), "additivity")


# --------------------------------------------------------------------------- Proposition 4: Tr(S) = ∇Cᵀ G


@dataclass(frozen=True)
class OutputTraces:
    """``G_i = Σ_p ∂²f(x_i)/∂θ_p²`` per point and output, by Rademacher probes.

    Attributes:
        estimate: (N, K) mean of ``zᵀ ∇²_θ f_k(x_i) z`` over the probes (unbiased for G).
        stderr: (N, K) standard error (NaN with one probe).
        per_probe: (m, N, K) the probe values (any linear functional of G gets its own stderr).
    """

    estimate: np.ndarray
    stderr: np.ndarray
    per_probe: np.ndarray


def output_hessian_traces(
    model: nn.Module,
    X: torch.Tensor,
    n_probes: int = 16,
    *,
    seed: int = 0,
    dtype: torch.dtype | None = torch.float64,
    block_size: int | None = None,
    output: OutputSelector = None,
) -> OutputTraces:
    """The vector G of the Hessian paper (``G = Σ_p ∂²Y/∂θ_p²``) at the points X, by probes.

    For a Rademacher z (``E zzᵀ = Id``), ``E[zᵀ ∇²_θ f(x_i) z] = Tr ∇²_θ f(x_i) = G_i``;
    ``zᵀ ∇²f z = d²/dt² f(x_i; θ + t z)`` at t = 0 is one forward-over-forward pass (``jvp`` of
    ``jvp``) for every point and output at once.

    Args:
        model: the module (its trainable parameters, ``named_parameters`` order).
        X: (N, d) inputs.
        n_probes: m ≥ 1 probes.
        seed: NumPy seed of the probes.
        dtype: compute dtype (default float64; None: the model's).
        block_size: points per block (default: about 256 MB of tangents; all N when the model
            couples samples, e.g. train-mode batch norm).
        output: which output is f when the model returns a dict, a tuple or a ``ModelOutput``.

    Returns:
        :class:`OutputTraces`.

    PyTorch's forward-over-forward second derivatives are checked once (first point and probe) against
    reverse mode; where they disagree (layer_norm, instance_norm, train-mode batch_norm in PyTorch 2.13)
    every block is computed by reverse mode, three backward passes per probe.

    Raises:
        ValueError: n_probes < 1; as :func:`~nsa_dist.hessian.hessian_operator` for model and X.
    """
    m = check_int("n_probes", n_probes, 1)
    with copyable(model):  # a float32 model measured in float64 is a cast copy
        model = prepare_model(model, dtype, output)
    X = prepare_inputs(model, X, "X", dtype)
    with blame(model, _TRACES):
        coupling = sample_coupling(model, X)
        with copyable(model):
            model = stateless(model, X)  # train-mode batch norm: no running statistics written
    params = {k: p.detach() for k, p in trainable_params(model).items()}
    rest = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())
    sizes = [p.numel() for p in params.values()]
    P = sum(sizes)
    p0 = next(iter(params.values()))  # the probes' dtype: the parameters' (X may hold token ids)
    Z = torch.as_tensor(rademacher(np.random.default_rng(seed), P, m), dtype=p0.dtype, device=p0.device)  # (P, m)
    U = {k: u.T.reshape((m,) + p.shape) for (k, p), u in zip(params.items(), Z.split(sizes))}
    N = X.shape[0]
    if coupling is not None:  # f(x_i) depends on the whole batch: one block of all N points
        _log.info("the model couples samples (%s): output Hessian traces over the whole batch", coupling)
        b = N
    else:
        width = max((p.shape[0] if p.ndim else 1) for p in params.values())  # a 0-dim parameter: 1
        b = block_size or default_block(N, m * width * len(sizes) * 8, p0.element_size(), 256e6)
    out, reverse = [], False
    for s in range(0, N, b):
        xb = X[s : s + b]

        def f(p: dict[str, torch.Tensor], xb: torch.Tensor = xb) -> torch.Tensor:
            return as_2d(call(model, {**p, **rest, **buffers}, (xb,)), xb.shape[0])

        def second(u: dict[str, torch.Tensor], f: Any = f) -> torch.Tensor:
            first = lambda p: jvp(f, (p,), (u,))[1]  # noqa: E731 - ∇f·u at p
            return jvp(first, (params,), (u,))[1]  # uᵀ ∇²f u, (b, K)

        with torch.no_grad(), exact_kernels(model), autograd_conventions(), blame(model, _TRACES):
            got = None if reverse else _forward_second(second, U)
            if got is None:  # an op without forward-mode AD (silu's backward in 2.13): reverse mode from now on
                reverse = True
                got = _reverse_second(f, params, U)
            out.append(got)  # (m, b, K)
        if s == 0 and not reverse:
            try:
                _check_forward_second(model, f, params, {k: u[0] for k, u in U.items()}, out[0][0, 0])
            except UnsupportedModelError as e:
                # wrong forward-over-forward (layer_norm, instance_norm, train-mode batch_norm in 2.13): G by
                # reverse mode, the check's own reference — G and Tr(S) via G were NaN there (Audit H3)
                _log.info("G by reverse mode: %s", str(e).split(", so G")[0])
                reverse = True
                with torch.no_grad(), exact_kernels(model), autograd_conventions(), blame(model, _TRACES):
                    out[0] = _reverse_second(f, params, U)
    q = torch.cat(out, dim=1).cpu().numpy().astype(np.float64)  # (m, N, K)
    se = q.std(axis=0, ddof=1) / np.sqrt(m) if m > 1 else np.full(q.shape[1:], np.nan)
    return OutputTraces(q.mean(axis=0), se, q)


def _forward_second(second: Any, U: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """``uᵀ ∇²f u`` (m, b, K) forward-over-forward, or None when an op of the model has no
    forward-mode rule for its derivative (``aten::silu_backward`` in PyTorch 2.13: G failed with
    that NotImplementedError, an audit)."""
    try:
        # forward mode's levels are the process's: a Tracker's training thread probes the user's model in
        # forward mode beside this (the lock every other forward-mode product takes; Audit TS found this one without)
        with FORWARD_AD_LOCK:
            return vmap(second)(U)
    except NotImplementedError as e:
        # PyTorch's own ops only: a custom Function without jvp took reverse mode through its backward, which
        # no check guards there — a backward on detached or NumPy tensors put G 0.25–0.70 off (a review)
        if not (_no_forward_rule(e) and "with aten::" in str(e)):
            raise
        _log.info("an op of the model has no forward-over-forward AD (%s): G by reverse mode", e)
        return None


def _reverse_second(f: Any, params: dict[str, torch.Tensor], U: dict[str, torch.Tensor]) -> torch.Tensor:
    """``uᵀ ∇²f_ik u`` for every point i and output k by reverse mode only, per probe u: with w a
    (b, K) leaf, ``b(w) = u · ∇_θ(u · ∇_θ(wᵀ f))`` is linear in w and its gradient is the (b, K)
    array wanted — three backward passes for all points at once (plain autograd's double backward
    of each op, which the forward-mode check takes as its reference)."""
    m = next(iter(U.values())).shape[0]
    rows = []
    with torch.enable_grad():
        for j in range(m):
            theta = {k: p.detach().requires_grad_(True) for k, p in params.items()}
            F = f(theta)
            w = torch.zeros_like(F, requires_grad=True)
            leaves = list(theta.values())
            g = torch.autograd.grad((F * w).sum(), leaves, create_graph=True, allow_unused=True)
            a = sum((gi * U[k][j]).sum() for gi, k in zip(g, theta) if gi is not None)
            if not (torch.is_tensor(a) and a.requires_grad):  # f linear in θ: no second derivative
                rows.append(torch.zeros_like(F).detach())
                continue
            h = torch.autograd.grad(a, leaves, create_graph=True, allow_unused=True)
            c = sum((hi * U[k][j]).sum() for hi, k in zip(h, theta) if hi is not None)
            if not (torch.is_tensor(c) and c.requires_grad):
                rows.append(torch.zeros_like(F).detach())
                continue
            (sw,) = torch.autograd.grad(c, w, allow_unused=True)
            rows.append(torch.zeros_like(F).detach() if sw is None else sw.detach())
    return torch.stack(rows)


def _check_forward_second(
    model: nn.Module, f: Any, params: dict[str, torch.Tensor], u: dict[str, torch.Tensor], fwd: torch.Tensor
) -> None:
    """Raise UnsupportedModelError when the forward-over-forward ``uᵀ ∇²f_k(x_0) u`` (``fwd``, (K,))
    differs from reverse mode (``∇(∇f_k · u) · u`` by plain autograd): PyTorch's second-order
    forward mode is wrong for some ops (layer_norm, instance_norm, train-mode batch_norm in 2.13)."""
    with torch.enable_grad(), exact_kernels(model), autograd_conventions(), blame(model, _TRACES):
        pr = {k: p.clone().requires_grad_(True) for k, p in params.items()}
        F = f(pr)[0]  # (K,) the first point's outputs
        ref, first = [], []
        for k in range(F.shape[0]):
            g = torch.autograd.grad(F[k], list(pr.values()), create_graph=True, allow_unused=True)
            gu = sum((gi * u[n]).sum() for gi, n in zip(g, pr) if gi is not None)
            first.append(float(gu.detach().abs()) if torch.is_tensor(gu) else 0.0)
            if not (torch.is_tensor(gu) and gu.requires_grad):
                ref.append(0.0)
                continue
            h = torch.autograd.grad(gu, list(pr.values()), retain_graph=True, allow_unused=True)
            ref.append(float(sum((hi.detach() * u[n]).sum() for hi, n in zip(h, pr) if hi is not None)))
    ref_, fwd_ = np.array(ref), fwd.detach().cpu().double().numpy().reshape(-1)
    rtol = 1e-6 if fwd.dtype == torch.float64 else 1e-3
    scale = max(np.abs(ref_).max(), np.abs(fwd_).max(), rtol * max(first, default=0.0))
    err = np.abs(fwd_ - ref_).max()
    if not err <= rtol * scale:
        suspects = sorted(
            {
                type(mod).__name__
                for mod in model.modules()
                if isinstance(mod, _FWD2_SUSPECTS)
                and not (isinstance(mod, torch.nn.modules.batchnorm._BatchNorm) and not mod.training)
            }
        )
        likely = f" (likely op: {', '.join(suspects)})" if suspects else ""
        raise UnsupportedModelError(
            f"forward-mode second derivatives of this model are wrong in this PyTorch {torch.__version__}"
            f"{likely}: uᵀ∇²f u forward-over-forward {fwd_[np.argmax(np.abs(fwd_ - ref_))]:.6g} vs reverse mode "
            f"{ref_[np.argmax(np.abs(fwd_ - ref_))]:.6g} (relative error {err / max(scale, 1e-300):.2g}), "
            "so G (and Tr(S) via G) is not measured"
        )


_TRACES = "the per-point output Hessian traces G_i"  # what an error names (not the loss Hessian)

_FWD2_SUSPECTS = (
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
    torch.nn.modules.batchnorm._BatchNorm,
)


def trace_S_from_G(R: np.ndarray, traces: OutputTraces) -> tuple[float, float]:
    """``Tr(S) = (1/N) Σ_i R_iᵀ G_i`` (R_i = ∇_f c_i: f − y for MSE, p − y for cross-entropy) and
    its standard error over the probes; R (N,) or (N, K) like the traces."""
    R = np.asarray(R, np.float64)
    if R.size != traces.estimate.size:
        raise ShapeError(
            f"R must have the traces' shape {tuple(traces.estimate.shape)} (N points × K outputs, or (N,)); "
            f"got {tuple(R.shape)}"
        )
    R = R.reshape(traces.estimate.shape)
    N = R.shape[0]
    per = np.einsum("mik,ik->m", traces.per_probe, R) / N  # (m,)
    se = float(per.std(ddof=1) / np.sqrt(len(per))) if len(per) > 1 else float("nan")
    return float(per.mean()), se


# --------------------------------------------------------------------------- the limit of I


def limit_gauss_newton_eigenvalues(
    theta: Any, F: Any = None, Y: Any = None, *, loss: str | LossName = "mse"
) -> np.ndarray:
    """The spectrum of I predicted by a (limiting) NTK Gram ``Θ̃`` (N, N): kernel PCA weighted by HC.

    ``I = (1/N) Jᵀ HC J`` with ``J Jᵀ → Θ̃∞ ⊗ Id_K`` has the nonzero eigenvalues of
    ``(1/N) HC^{1/2} (Θ̃∞ ⊗ Id_K) HC^{1/2}``; for MSE (HC = Id) they are those of ``Θ̃∞ / N``,
    each K times.  Cross-entropy weights by ``HC_i = diag p_i − p_i p_iᵀ`` at the outputs F.

    Args:
        theta: (N, N) symmetric Gram (e.g. :func:`~nsa_dist.ntk.limit_ntk` at the training points).
        F: (N,) or (N, K) outputs (cross-entropy: the logits whose softmax gives p; MSE: only K is read).
        Y: cross-entropy targets: (N, K) one-hot / probability rows or (N,) integer class indices
            (default: uniform rows 1/K); unused for MSE.
        loss: "mse" | "cross_entropy".

    Returns:
        (N·K,) float64, descending.

    Raises:
        ShapeError: theta not square, F without N rows, Y not fitting (N, K), cross-entropy with K = 1.
        NonFiniteError: NaN/inf in theta, F or Y.
        ValueError: theta not symmetric (beyond rounding), cross-entropy without F.
    """
    loss_ = parse_loss(loss)
    T0 = theta.detach().cpu() if isinstance(theta, torch.Tensor) else np.asarray(theta)
    sym_rtol = 1e-8 if T0.dtype in (torch.float64, np.float64) else 1e-4  # a float32 Gram's rounding
    T = np.asarray(T0, np.float64)
    if T.ndim != 2 or T.shape[0] != T.shape[1]:
        raise ShapeError(f"theta must be a square (N, N) Gram, got shape {T.shape}")
    check_finite("theta", T)
    N = T.shape[0]
    asym = float(np.abs(T - T.T).max(initial=0.0))
    if asym > sym_rtol * max(float(np.abs(T).max(initial=0.0)), 1e-300):
        raise ValueError(f"theta must be a symmetric Gram Θ̃(x_i, x_j) at one set of points; max |Θ − Θᵀ| = {asym:.3g}")
    if F is None:
        if loss_ is LossName.CROSS_ENTROPY:
            raise ValueError("the cross-entropy limit of I needs the outputs F (its HC = diag p − ppᵀ depends on them)")
        K = 1
    else:
        Fa = np.asarray(F.detach().cpu() if isinstance(F, torch.Tensor) else F, np.float64)
        if Fa.ndim not in (1, 2) or Fa.shape[0] != N:
            raise ShapeError(f"F must be (N,) or (N, K) with N = {N} (theta's size) rows; got shape {Fa.shape}")
        check_finite("F", Fa)
        Fa = Fa.reshape(N, -1)
        K = Fa.shape[1]
    if loss_ is LossName.L2:
        lam = np.linalg.eigvalsh((T + T.T) / 2) / N
        return np.sort(np.repeat(lam, K))[::-1].copy()
    Ft = torch.as_tensor(Fa, dtype=torch.float64)
    if Y is None:
        Yt = torch.full((N, K), 1.0 / K, dtype=torch.float64)
    else:
        Yv = Y.detach().cpu() if isinstance(Y, torch.Tensor) else Y
        Yt = prepare_targets(Yv, loss_, N, K, torch.float64, torch.device("cpu"))
    if K < 2:
        raise ShapeError(f"loss='cross_entropy' needs K >= 2 outputs (logits); F has K = {K}")
    R = curvature_sqrt(loss_, Ft, Yt).numpy()  # (N, K, K)
    M = np.einsum("iab,ij,jbc->iajc", R, T, R).reshape(N * K, N * K) / N
    return np.linalg.eigvalsh((M + M.T) / 2)[::-1].copy()


# --------------------------------------------------------------------------- rank bounds


@dataclass(frozen=True)
class Ranks:
    """Numerical ranks of I, S, H (eigenvalues with |λ| > tol · max|λ| of that matrix) and the bounds.

    Attributes:
        I, S, H: the ranks.
        bound_I: N·n_L.
        bound_S: 2(L − 1)·w·N·n_L (None when the hidden widths differ: the paper states it for a
            constant width w; None too when a trainable parameter lies outside the Linear layers —
            a custom weight, a norm's affine, an embedding —: the paper's network has none, and
            its L and w would not describe the model).
        P: parameters; tol: the relative tolerance; evals: {"I", "S", "H"} the dense spectra.
    """

    I: int  # noqa: E741 - the paper's name
    S: int
    H: int
    bound_I: int
    bound_S: int | None
    P: int
    tol: float
    evals: dict[str, np.ndarray]


_MAX_DENSE_P = 4096


def numerical_ranks(
    model: nn.Module,
    X: torch.Tensor,
    Y: Any,
    *,
    loss: str | LossName = "mse",
    tol: float = 1e-9,
    output: OutputSelector = None,
) -> Ranks:
    """Ranks of the dense I, S and H of a small network, beside ``Rank(I) ≤ N n_L`` and
    ``Rank(S) ≤ 2(L − 1) w N n_L`` (the Hessian paper; L Linear layers, hidden width w).

    Args:
        model: a fully-connected network (its Linear layers give L and w; n_L is the output size
            K of a forward), P ≤ 4096.
        X: (N, d) inputs; Y: targets as for :func:`~nsa_dist.hessian.hessian_operator`.
        loss: "mse" | "cross_entropy".
        tol: relative tolerance: an eigenvalue counts when |λ| > tol · max|λ| (0 < tol < 1).
        output: which output is f when the model returns a dict, a tuple or a ``ModelOutput``.

    Raises:
        ValueError: P too large for a dense eigendecomposition, a tol outside (0, 1), a model
            without Linear layers.
    """
    if not (isinstance(tol, float) and 0 < tol < 1):
        raise ValueError(f"tol (relative to the largest |eigenvalue|) must be a float in (0, 1), got {tol!r}")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        raise ValueError(
            f"numerical_ranks needs a fully-connected network (nn.Linear layers); {type(model).__name__} has none"
        )
    P = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if P > _MAX_DENSE_P:
        raise ValueError(
            f"numerical_ranks forms the dense P×P matrices: P = {P} > {_MAX_DENSE_P}; use a smaller network"
        )
    H, I, S = hessian_parts(model, X, Y, loss=loss, dtype=torch.float64, output=output)
    evals, ranks = {}, {}
    for name, op in (("I", I), ("S", S), ("H", H)):
        M = op.to_dense().cpu().numpy()
        lam = np.linalg.eigvalsh((M + M.T) / 2)
        evals[name] = lam
        top = np.abs(lam).max()
        ranks[name] = int(np.sum(np.abs(lam) > tol * top)) if top > 0 else 0
    fm = prepare_model(model, None, output)
    nL = output_dim(fm, prepare_inputs(fm, X, "X", None))  # K of a forward, not the last Linear registered
    N, L = X.shape[0], len(linears)
    hidden = {m.out_features for m in linears[:-1]}
    in_linears = {id(p) for m in linears for p in m.parameters()}
    fc = all(id(p) in in_linears for p in model.parameters() if p.requires_grad)
    bound_S = (2 * (L - 1) * hidden.pop() * N * nL if len(hidden) == 1 else (0 if L == 1 else None)) if fc else None
    return Ranks(ranks["I"], ranks["S"], ranks["H"], N * nL, bound_S, P, tol, evals)
