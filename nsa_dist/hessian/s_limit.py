"""The infinite-width limits of S = ∇C·ℋY (the Hessian paper, Proposition 4 and Theorem 1).

For ``build_model(ModelSpec(init="ntk", depth=L, bias_scale=β, ...))`` (every layer
``z = W a / √n_in + β b``, W, b ~ N(0, 1); L counts Linear layers) write ``f⁽ᴸ⁾(x)`` for an
output, ``g⁽ᴸ⁾(x) = Σ_p ∂²f⁽ᴸ⁾(x)/∂θ_p²`` (the paper's G evaluated at x) and, for the n
preactivations f_j⁽ᴸ⁻¹⁾ of the last hidden layer (with their g_j⁽ᴸ⁻¹⁾),

    f⁽ᴸ⁾ = Σ_j W_j σ(f_j⁽ᴸ⁻¹⁾)/√n + β b,
    g⁽ᴸ⁾ = Σ_j W_j [σ̈(f_j⁽ᴸ⁻¹⁾) Θ_jj⁽ᴸ⁻¹⁾(x, x) + σ̇(f_j⁽ᴸ⁻¹⁾) g_j⁽ᴸ⁻¹⁾] / √n,

since f is linear in its own layer's weights.  As the widths grow, (f_j, g_j) become iid centred
Gaussian processes; Gaussian integration by parts (Stein: ``E[v h(u)] = Σ Cov(v, u_a) E[∂_a h]``)
then gives the limiting kernels as recursions over the layers, starting from ``Σ⁽¹⁾ = Θ⁽¹⁾ =
xᵀx′/n₀ + β²`` and ``Φ⁽¹⁾ = Υ⁽¹⁾ = Λ⁽¹⁾ = 0`` (a linear net has no curvature).  With
``𝕃^{a,b}(x, y) = E[a(u) b(u′)]`` for (u, u′) ~ N(0, Σ⁽ᴸ⁻¹⁾ on {x, y}), ``Σ̇⁽ᴸ⁾ = 𝕃^{σ̇,σ̇}``,
``T = Θ⁽ᴸ⁻¹⁾`` and ``D(x) = Θ⁽ᴸ⁻¹⁾(x, x) + Φ⁽ᴸ⁻¹⁾(x, x)``:

* ``Φ⁽ᴸ⁾(x, y) = E[f(x) g(y)]`` (the kernel of E[Tr S] at initialisation, paper §"the matrix S",
  consequence 3)::

      Φ⁽ᴸ⁾(x, y) = Φ⁽ᴸ⁻¹⁾(x, y) Σ̇⁽ᴸ⁾(x, y) + D(y) 𝕃^{σ,σ̈}(x, y)

* ``Υ⁽ᴸ⁾(x, y) = Σ_{p,p′} ∂²_{pp′}f(x) ∂²_{pp′}f(y)`` (Tr(S²) = ∇Cᵀ Υ̃ ∇C, Proposition 4): the
  mixed (W_j, θ′) blocks give ``2 Σ̇ T``, the (θ′, θ′) block ``𝕃^{σ̈,σ̈} T² + Σ̇ Υ⁽ᴸ⁻¹⁾`` (the
  terms ∂fᵀ ℋf_j ∂f vanish with the NTK's motion)::

      Υ⁽ᴸ⁾ = 2 Σ̇⁽ᴸ⁾ T + 𝕃^{σ̈,σ̈} T² + Σ̇⁽ᴸ⁾ Υ⁽ᴸ⁻¹⁾

* ``Λ⁽ᴸ⁾(x, y) = ∂_θ g(x) · ∂_θ f(y)`` (how G moves under training: ``dG = −Λ̃ ∇C dt``)::

      Λ⁽ᴸ⁾(x, y) = D(x) 𝕃^{σ̈,σ}(x, y) + Φ⁽ᴸ⁻¹⁾(y, x) Σ̇⁽ᴸ⁾(x, y) + T(x, y) D(x) 𝕃^{σ⃛,σ̇}(x, y)
                 + T(x, y) Φ⁽ᴸ⁻¹⁾(y, x) 𝕃^{σ̈,σ̈}(x, y) + Λ⁽ᴸ⁻¹⁾(x, y) Σ̇⁽ᴸ⁾(x, y)

The consequences computed here (one output; a K-output net has ``⊗ Id_K``):

* :func:`limit_trace_S_init` — MSE, ``E[Tr S] = E[(Y − Y*)ᵀ G]/N = K Tr(Φ̃)/N`` (E[G] = 0).
* :func:`limit_trace_S2` — ``Tr(S²) = ∇Cᵀ (Υ̃ ⊗ Id_K) ∇C`` (Proposition 4; Υ̃ does not move).
* :func:`limit_trace_S_gd` — MSE under GD with steps δ_t: linearised, ``R_{t+1} = (1 − δ_t Θ̃/N) R_t``
  and ``G_{t+1} = G_t − (δ_t/N) Λ̃ R_t``, so ``E[Tr S_t] = (1/N) Σ_k [Tr(B_t Φ̃ᵀ) − Tr(B_t Λ̃ C_t
  (Σ̃ + y_k y_kᵀ))]`` with ``B_t = Π_{s<t}(1 − δ_s Θ̃/N)``, ``C_t = Σ_{s<t} (δ_s/N) B_s``
  (the paper's MSE formulae of Theorem 1 in discrete time; E over the initialisation, with
  ``E[R₀R₀ᵀ] = Σ̃ + y yᵀ`` and ``E[G₀ R₀ᵀ] = Φ̃ᵀ``).

Smooth σ only (the paper's setting needs σ̈, σ⃛): relu / leaky_relu are refused.  The recursions
are derived here from the definitions above (the paper's appendix states its own; tests/test_s_limit.py
checks each kernel and prediction against finite-width networks: Monte-Carlo over initialisations,
probes, dense float64 Hessians, trained ensembles).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nsa_dist._checks import check_finite
from nsa_dist.config import Activation
from nsa_dist.errors import ShapeError
from nsa_dist.models import SOFTPLUS_SCALE, SOFTPLUS_SHIFT
from nsa_dist.ntk.limit import as_points, check_options, cos_angle, gauss_hermite, resolved_nodes

__all__ = ["SKernels", "limit_S_kernels", "limit_trace_S_init", "limit_trace_S2", "limit_trace_S_gd"]

_F64 = torch.float64
_QUAD_ELEMS = 2**21
_PAIRS = ((0, 0), (1, 1), (0, 2), (2, 0), (2, 2), (3, 1), (1, 3))  # (a, b) of 𝕃^{σ^(a), σ^(b)} on i ≤ j


@dataclass(frozen=True)
class SKernels:
    """The limiting Gram matrices at N points, each (N, N) float64 (row x_i, column x_j).

    Attributes:
        sigma: Σ̃⁽ᴸ⁾, the covariance of the outputs at initialisation.
        theta: Θ̃∞ (:func:`~nsa_dist.ntk.limit_ntk`'s kernel, by its own quadrature: within ~1e-7 relative
            of it for tanh and atan, to rounding for softplus).
        phi: Φ̃, ``E[f(x_i) g(x_j)]`` (not symmetric).
        upsilon: Υ̃, ``Tr(ℋf(x_i) ℋf(x_j))`` (symmetric).
        lam: Λ̃, ``∂g(x_i)·∂f(x_j)`` (not symmetric).
    """

    sigma: torch.Tensor
    theta: torch.Tensor
    phi: torch.Tensor
    upsilon: torch.Tensor
    lam: torch.Tensor


_Derivs = Callable[[torch.Tensor], list[torch.Tensor]]


def _tanh(u: torch.Tensor) -> list[torch.Tensor]:
    t = torch.tanh(u)
    d1 = 1 - t * t
    return [t, d1, -2 * t * d1, d1 * (6 * t * t - 2)]


def _atan(u: torch.Tensor) -> list[torch.Tensor]:
    r = 1 / (1 + u * u)
    return [torch.atan(u), r, -2 * u * r * r, (6 * u * u - 2) * r**3]


def _softplus(u: torch.Tensor, scale: float = 1.0, shift: float = 0.0) -> list[torch.Tensor]:
    s = torch.sigmoid(u)
    d2 = s * (1 - s)
    return [(torch.nn.functional.softplus(u) - shift) / scale, s / scale, d2 / scale, d2 * (1 - 2 * s) / scale]


def _erf(u: torch.Tensor) -> list[torch.Tensor]:
    d1 = 2 / math.sqrt(math.pi) * torch.exp(-u * u)
    return [torch.erf(u), d1, -2 * u * d1, (4 * u * u - 2) * d1]


def _gelu(u: torch.Tensor) -> list[torch.Tensor]:
    pdf = torch.exp(-0.5 * u * u) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + torch.erf(u / math.sqrt(2)))
    return [u * cdf, cdf + u * pdf, pdf * (2 - u * u), pdf * (u**3 - 4 * u)]


_CLOSED: dict[Activation, _Derivs] = {
    Activation.TANH: _tanh,
    Activation.ATAN: _atan,
    Activation.SOFTPLUS: _softplus,
    Activation.ERF: _erf,
    Activation.GELU: _gelu,
    Activation.SOFTPLUS_NORMALIZED: lambda u: _softplus(u, SOFTPLUS_SCALE, SOFTPLUS_SHIFT),
}  # [σ, σ̇, σ̈, σ⃛] in closed form (a callable σ gets them by autograd)


def _autograd_derivatives(phi: Callable[[torch.Tensor], torch.Tensor], u: torch.Tensor) -> list[torch.Tensor]:
    """[σ, σ̇, σ̈, σ⃛](u) by nested autograd (zeros once a derivative no longer depends on u)."""
    with torch.enable_grad():
        u = u.detach().requires_grad_(True)
        out = [phi(u)]
        for _ in range(3):
            prev = out[-1]
            if not prev.requires_grad:
                out.append(torch.zeros_like(u))
                continue
            (d,) = torch.autograd.grad(prev.sum(), u, create_graph=True)
            out.append(d)
    return [t.detach() for t in out]


def _expectations(
    derivs: _Derivs, n: int, k11: torch.Tensor, k22: torch.Tensor, k12: torch.Tensor
) -> dict[tuple[int, int], torch.Tensor]:
    """``𝕃^{σ^(a), σ^(b)}`` for the (a, b) of ``_PAIRS`` on broadcast (k11, k22, k12), by n×n
    Gauss–Hermite quadrature: u = √k11 z₁, u′ = √k22 (ρ z₁ + √(1 − ρ²) z₂)."""
    z, w = gauss_hermite(n)
    k11, k22, k12 = torch.broadcast_tensors(k11, k22, k12)
    shape = k12.shape
    k11, k22, k12 = k11.reshape(-1), k22.reshape(-1), k12.reshape(-1)
    _, rho = cos_angle(k11, k22, k12)
    s1, s2 = k11.sqrt(), k22.sqrt()
    out = {p: torch.empty_like(k12) for p in _PAIRS}
    chunk = max(1, _QUAD_ELEMS // (n * n))
    for s in range(0, k12.numel(), chunk):
        c = slice(s, s + chunk)
        du = derivs(s1[c, None] * z)  # 4 × (c, n)
        v = torch.addcmul(
            (s2[c] * rho[c])[:, None, None] * z[:, None],
            (s2[c] * (1 - rho[c] ** 2).clamp_min(0).sqrt())[:, None, None],
            z,
        )  # (c, n, n)
        dv = [d @ w for d in derivs(v)]  # 4 × (c, n): E over z₂ given z₁
        for a, b in _PAIRS:
            out[(a, b)][c] = (du[a] * dv[b]) @ w
    return {p: t.reshape(shape) for p, t in out.items()}


_CHECK_PAIRS = ((0, 0), (1, 1), (2, 2), (0, 2), (3, 1))


def _resolve(derivs: _Derivs, n: int, variances: torch.Tensor, layer: int) -> int:
    """The node count for one layer (:func:`~nsa_dist.ntk.limit.resolved_nodes` over σ and its
    first three derivatives): σ̈ and σ⃛ live on |u| ≲ 3, and at a variance v the nodes ``√v z_i``
    step over them — with 64 nodes 𝕃^{σ̈,σ̈} of tanh is 2 % off at v = 3 and has the wrong sign at
    v = 100.

    Raises:
        ValueError: not resolved with 1024 nodes: inputs far from standardised (variance above 4),
            or else a σ that is not smooth (a callable relu: σ̇ jumps).
    """
    return resolved_nodes(
        derivs,
        _CHECK_PAIRS,
        n,
        variances,
        layer,
        "σ is not smooth (a kink or jump in σ, σ̇ or σ̈, as relu's: the limits of S need a smooth σ)",
    )


def _pair_matrices(derivs: _Derivs, n: int, K: torch.Tensor) -> dict[tuple[int, int], torch.Tensor]:
    """(N, N) ``𝕃^{σ^(a), σ^(b)}_K`` for the (a, b) of ``_PAIRS``, evaluated on i ≤ j only:
    ``𝕃^{a,b}(x_j, x_i) = 𝕃^{b,a}(x_i, x_j)``."""
    i, j = torch.triu_indices(*K.shape)
    d = K.diagonal()
    e = _expectations(derivs, n, d[i], d[j], (K[i, j] + K[j, i]) / 2)
    out = {}
    for a, b in _PAIRS:
        M = torch.empty_like(K)
        M[i, j], M[j, i] = e[(a, b)], e[(b, a)]
        out[(a, b)] = M
    return out


def _smooth_activation(activation: str | Activation | Callable) -> _Derivs:
    """[σ, σ̇, σ̈, σ⃛] of a smooth activation (closed forms) or of a callable σ (autograd)."""
    if callable(activation) and not isinstance(activation, (str, Activation)):
        return lambda u: _autograd_derivatives(activation, u)
    try:
        act = Activation(activation)
    except ValueError:
        allowed = ", ".join(repr(a.value) for a in Activation)
        raise ValueError(f"activation={activation!r} is not one of {allowed} (or a callable σ)") from None
    if act not in _CLOSED:
        raise ValueError(
            f"activation={act.value!r}: the limits of S need a smooth σ (σ̈ and σ⃛ enter Φ, Υ, Λ); "
            "use tanh, erf, softplus, softplus_normalized, atan or gelu"
        )
    return _CLOSED[act]


def limit_S_kernels(
    x: torch.Tensor | np.ndarray,
    *,
    depth: int,
    activation: str | Activation | Callable[[torch.Tensor], torch.Tensor] = "tanh",
    bias_scale: float = 0.1,
    quadrature: int = 64,
) -> SKernels:
    """Σ̃, Θ̃∞, Φ̃, Υ̃, Λ̃ at the points x, by the recursions of the module docstring.

    Cost: ``(depth − 1) · N(N + 1)/2 · n²`` (n the node count used, ≥ quadrature) evaluations of σ and its first three
    derivatives (closed forms for the named activations): about 4× :func:`~nsa_dist.ntk.limit_ntk`.

    Args:
        x: (N, d) points.
        depth: L ≥ 1 Linear layers (``ModelSpec.depth``).
        activation: a smooth one of :class:`~nsa_dist.config.Activation` (not relu / leaky_relu),
            or a callable elementwise σ (three times differentiable by autograd).
        bias_scale: β.
        quadrature: Gauss–Hermite nodes per dimension (≥ 2), the least used: doubled, layer by
            layer, up to 1024, until the diagonal ``E[σ^(a)(u) σ^(b)(u)]`` at every pre-activation
            variance agree with a fine trapezoid rule to 3e-5 of their scale (1e-3 at 1024 nodes;
            64 nodes miss σ̈ of tanh by 2 % at variance 3, as Σ⁽¹⁾ = |x|²/n₀ + β² often is).

    Returns:
        :class:`SKernels` of float64 CPU tensors.

    Raises:
        ShapeError / NonFiniteError: x not (N, d) or not finite.
        ValueError: depth < 1, quadrature < 2, bias_scale < 0, relu / leaky_relu or an unknown activation;
            pre-activation variances too large for 1024 nodes to resolve σ's derivatives
            (unstandardised inputs; the message names the layer and variance).
    """
    check_options(depth, 0.0, bias_scale, quadrature)
    derivs = _smooth_activation(activation)
    a = as_points(x, "x")
    beta2, n0 = float(bias_scale) ** 2, a.shape[1]
    sigma = a @ a.T / n0 + beta2  # (N, N) Σ⁽¹⁾
    theta = sigma.clone()
    phi, ups, lam = (torch.zeros_like(sigma) for _ in range(3))
    for layer in range(1, depth):
        E = _pair_matrices(derivs, _resolve(derivs, int(quadrature), sigma.diagonal(), layer), sigma)
        sdot = E[(1, 1)]  # Σ̇⁽ᴸ⁾
        D = theta.diagonal() + phi.diagonal()  # (N,) Θ(x, x) + Φ(x, x)
        phi_new = phi * sdot + D[None, :] * E[(0, 2)]
        ups_new = 2 * sdot * theta + E[(2, 2)] * theta**2 + sdot * ups
        lam_new = (
            D[:, None] * E[(2, 0)]
            + phi.T * sdot
            + theta * D[:, None] * E[(3, 1)]
            + theta * phi.T * E[(2, 2)]
            + lam * sdot
        )
        sigma = E[(0, 0)] + beta2
        theta = theta * sdot + sigma
        phi, ups, lam = phi_new, ups_new, lam_new
    return SKernels(sigma, theta, phi, ups, lam)


def _np(t: torch.Tensor | np.ndarray) -> np.ndarray:
    return np.asarray(t.detach().cpu() if isinstance(t, torch.Tensor) else t, np.float64)


def limit_trace_S_init(kernels: SKernels, n_outputs: int = 1) -> float:
    """MSE: ``E[Tr S] = E[(Y − Y*)ᵀ G]/N = E[Yᵀ G]/N − Y*ᵀ E[G]/N = K Tr(Φ̃)/N`` at initialisation
    (the paper's consequence 3 with ∇C = (Y − Y*)/N; K = ``n_outputs``)."""
    if isinstance(n_outputs, bool) or not isinstance(n_outputs, (int, np.integer)) or n_outputs < 1:
        raise ValueError(f"n_outputs (K) must be an int >= 1, got {n_outputs!r}")
    P = _np(kernels.phi)
    return float(n_outputs * np.trace(P) / P.shape[0])


def limit_trace_S2(upsilon: torch.Tensor | np.ndarray, grad_C: np.ndarray) -> float:
    """``Tr(S²) = ∇Cᵀ (Υ̃ ⊗ Id_K) ∇C`` (Proposition 4).

    Args:
        upsilon: (N, N) Υ̃.
        grad_C: (N,) or (N, K) ∇_Y C (MSE: (f − y)/N; cross-entropy: (softmax f − y)/N).

    Raises:
        ShapeError: upsilon not square, grad_C without N rows; NonFiniteError: NaN/inf in either.
    """
    U = _np(upsilon)
    if U.ndim != 2 or U.shape[0] != U.shape[1]:
        raise ShapeError(f"upsilon must be a square (N, N) Gram, got shape {U.shape}")
    g = _rows("grad_C", grad_C, U.shape[0])  # (N, K)
    check_finite("upsilon", U)
    return float(np.einsum("ik,ij,jk->", g, U, g))


def _rows(name: str, a: object, N: int) -> np.ndarray:
    """``a`` (N,) or (N, K) as finite (N, K) float64; a ShapeError / NonFiniteError naming it."""
    v = _np(a) if isinstance(a, torch.Tensor) else np.asarray(a, np.float64)
    if v.ndim not in (1, 2) or v.shape[0] != N:
        raise ShapeError(f"{name} must be (N,) or (N, K) with N = {N} (the kernels' points); got shape {v.shape}")
    check_finite(name, v)
    return v.reshape(N, -1)


def limit_trace_S_gd(kernels: SKernels, y: np.ndarray, lrs: Sequence[float], at: Sequence[int]) -> np.ndarray:
    """MSE under full-batch GD: ``E[Tr S_t]`` over the initialisation at the steps ``at``.

    ``B_t = Π_{s<t}(Id − δ_s Θ̃/N)``, ``C_t = Σ_{s<t} (δ_s/N) B_s`` (R_t = B_t R₀,
    G_t = G₀ − Λ̃ C_t R₀), ``E[Tr S_t] = (1/N) Σ_k [Tr(B_t Φ̃ᵀ) − Tr(B_t Λ̃ C_t (Σ̃ + y_k y_kᵀ))]``.

    Args:
        kernels: :func:`limit_S_kernels` at the N training points.
        y: (N,) or (N, K) targets Y*.
        lrs: δ_s for s = 0 .. max(at) − 1 (at least that many).
        at: steps t ≥ 0 (θ_t, before update t).

    Returns:
        (len(at),) float64.

    Raises:
        ValueError: fewer learning rates than max(at), a non-finite one, or a negative step.
        ShapeError / NonFiniteError: y without N rows, or NaN/inf in y.
    """
    steps = [int(t) for t in at]
    if any(t < 0 for t in steps):
        raise ValueError(f"steps must be >= 0, got {steps}")
    T = max(steps, default=0)
    if len(lrs) < T:
        raise ValueError(f"need the learning rate of every step before {T}; got {len(lrs)}")
    if not all(math.isfinite(float(lr)) for lr in lrs[:T]):
        raise ValueError(f"learning rates must be finite; got {list(lrs[:T])}")
    Th, P, U, L = (_np(k) for k in (kernels.theta, kernels.phi, kernels.sigma, kernels.lam))
    N = Th.shape[0]
    Y = _rows("y", y, N)  # (N, K)
    K = Y.shape[1]
    lam, V = np.linalg.eigh((Th + Th.T) / 2)  # B_t = V diag(b_t) Vᵀ, C_t = V diag(c_t) Vᵀ
    Pv, Lv = V.T @ P.T @ V, V.T @ L @ V  # Φ̃ᵀ, Λ̃ in the eigenbasis of Θ̃
    Mv = [V.T @ (U + np.outer(Y[:, k], Y[:, k])) @ V for k in range(K)]  # E[R₀R₀ᵀ] per output
    b, c, want, out = np.ones(N), np.zeros(N), set(steps), {}
    for t in range(T + 1):
        if t in want:  # Tr(B Φ̃ᵀ) = Σ b_i Pv_ii;  Tr(B Λ̃ C M) = Σ_ij b_i Lv_ij c_j Mv_ji
            out[t] = (K * b @ np.diag(Pv) - sum(np.einsum("i,ij,j,ji->", b, Lv, c, M) for M in Mv)) / N
        if t < T:
            c = c + lrs[t] / N * b
            b = b * (1 - lrs[t] / N * lam)
    return np.array([out[t] for t in steps])
