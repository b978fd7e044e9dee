"""The NTK between new and training points, and its change over one update (NSA Eq. 9, App. F).

* :func:`cross_gram_times` — g_θ(X_out, 𝒳) V, kernel rows between new points and the training
  points times columns V (the Nyström extension of eigenvectors, Eq. 9), a block of rows at a time
  or all of them in a caller's buffer.
* :func:`gram_change` — App. F: the change of the Gramian over update t, projected on the top
  eigenvectors, measured (G_{t+1} − G_t, from θ_{t+1} = θ_t + Δθ_t) and to first order
  (dG_t = ∂G/∂θ · Δθ_t = dJ Jᵀ + J dJᵀ, which for GD is −(δ/N)(Q_t + Q_tᵀ), Eq. 26).
  Both by products with the network, never the dense G: the measured part by first-order
  products, the first-order part by Hessian-vector products (forward over reverse, checked
  once against a central difference of the gradients) — never forward over forward, which PyTorch
  2.13 gets wrong for ``layer_norm`` and ``rms_norm`` (a transformer's first-order dG was 13 % off).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import nn

    from nsa_dist.ntk.route import NTKRoute

__all__ = ["cross_gram_times", "gram_change"]


def _gram_times(model: nn.Module, X: torch.Tensor, V: torch.Tensor, frozen: dict) -> Callable:
    """p ↦ G(p) V with G = Σ_a J_a J_aᵀ (the output-traced Gram), J = ∂f(X)/∂p over the trainable
    parameters p (``frozen``: the others' values, constants), by one VJP and JVPs."""
    import torch
    from torch.func import jvp, vjp

    from nsa_dist.ntk.state import call, no_grad_as_constant

    def f(p, Z):
        out = call(model, {**p, **frozen}, (Z,))
        return out.reshape(out.shape[0], -1)  # (n, Ko)

    def GV(p):
        fx, pull = vjp(lambda q: f(q, X), p)
        cols = []
        for j in range(V.shape[1]):
            acc = 0.0
            for a in range(fx.shape[1]):
                cot = torch.zeros_like(fx)
                cot[:, a] = V[:, j]
                (u,) = pull(cot)  # J_aᵀ v_j, a dict like p
                with no_grad_as_constant():  # a no_grad block a constant, as the VJP takes it
                    acc = acc + jvp(lambda q: f(q, X), (p,), (u,))[1][:, a]  # J_a J_aᵀ v_j, (N,)
            cols.append(acc)
        return torch.stack(cols, dim=1)  # (N, Kg)

    return GV


def _first_order(
    model: nn.Module, X: torch.Tensor, V: torch.Tensor, p0: dict, dp: dict, frozen: dict, dfrozen: dict
) -> torch.Tensor:
    """D̄ = Vᵀ (∂G/∂θ·Δθ) V, (Kg, Kg), by Hessian-vector products only.

    With g_{i,a} = J_aᵀ v_i (the gradient of the scalar v_iᵀ f_a) and dg_{i,a} = ∇g_{i,a}·Δθ (that
    scalar's Hessian times Δθ), v_iᵀ dG v_j = Σ_a ⟨dg_{i,a}, g_{j,a}⟩ + ⟨g_{i,a}, dg_{j,a}⟩, and
    ⟨dg_{i,a}, g_{j,a}⟩ = v_jᵀ (J_a dg_{i,a}): one HVP and one first-order JVP per (i, a).

    J is autograd's (a ``torch.no_grad()`` block or a ``.data`` read a constant, as training's gradient
    takes it), but G's change is that of its values: dg is the derivative of the map θ ↦ g(θ), through
    such blocks too — forward mode over reverse with no convention, since forward mode differentiates
    through ``no_grad`` and the inner reverse level keeps it a constant (taken under the constant
    convention at both levels, a weight normalised by a norm taken under no_grad gave a first-order
    change 0.23 where G's derivative was −0.033, status done: an audit).  The first dg is compared with
    a central difference of g along Δθ (PyTorch's second derivatives are wrong for some ops in one mode
    or another); where two steps of the difference disagree (a kink between them) with reverse over
    reverse; a disagreement raises instead of storing either.

    J is over the trainable parameters ``p0``; the frozen ones (``frozen``) are constants of the
    kernel but not of the update: where Δθ moves them too (``dfrozen`` not zero — a user's loop that
    sets a frozen parameter), dg_{i,a} takes their motion as well (∇_p g·Δp + ∇_r g·Δr), as the
    measured D does.

    Raises:
        UnsupportedModelError: the model's second derivatives disagree with the difference (or the modes).
    """
    import torch
    from torch.func import jvp, vjp

    from nsa_dist.ntk.state import FORWARD_AD_LOCK, call, no_grad_as_constant

    def f(q, r=frozen):
        out = call(model, {**q, **r}, (X,))
        return out.reshape(out.shape[0], -1)  # (n, Ko)

    moved = any(bool(torch.any(d != 0)) for d in dfrozen.values())
    fx = f(p0)
    Kg, Ko = V.shape[1], fx.shape[1]
    M = torch.zeros((Kg, Kg), dtype=V.dtype, device=V.device)  # M[i, j] = Σ_a ⟨dg_{i,a}, g_{j,a}⟩
    for a in range(Ko):
        for i in range(Kg):
            cot = torch.zeros_like(fx)
            cot[:, a] = V[:, i]
            grad = lambda q, r=frozen, cot=cot: vjp(lambda q_: f(q_, r), q)[1](cot)[0]  # noqa: E731 - J_a(q)ᵀ v_i
            with FORWARD_AD_LOCK, torch.enable_grad():  # no constant convention at the outer level (above)
                # forward over reverse: ∇²(v_iᵀ f_a) Δθ (with the frozen parameters' own motion)
                dg = jvp(grad, (p0, frozen), (dp, dfrozen))[1] if moved else jvp(grad, (p0,), (dp,))[1]
            if a == 0 and i == 0:
                _checked_second(
                    dg,
                    grad,
                    p0,
                    frozen,
                    dp,
                    dfrozen,
                    lambda c=cot: _reverse_second(f, p0, frozen, dp, dfrozen, c, moved),
                )
            with no_grad_as_constant():
                M[i] += V.T @ jvp(f, (p0,), (dg,))[1][:, a]  # v_jᵀ J_a dg_{i,a} for every j
    return M + M.T


def _checked_second(
    dg: dict, grad: Callable, p0: dict, frozen: dict, dp: dict, dfrozen: dict, reverse: Callable[[], dict]
) -> None:
    """UnsupportedModelError unless ``dg`` (forward over reverse) is the derivative of ``grad`` along
    (Δp, Δr): a central difference at steps h and h/4 (their agreement first: across a kink they differ
    and prove nothing, and then reverse over reverse, ``reverse()``, is the reference)."""
    import torch

    from nsa_dist.errors import UnsupportedModelError

    flat = lambda d: torch.cat([t.reshape(-1) for t in d.values()]).double() if d else torch.zeros(0)  # noqa: E731
    dtype = next(iter(p0.values())).dtype
    eps = float(torch.finfo(dtype).eps)
    norm = float(torch.cat([flat(p0), flat(frozen)]).norm())
    dnorm = float(torch.cat([flat(dp), flat(dfrozen)]).norm())
    got = flat(dg)
    if dnorm == 0.0:
        return
    h = eps ** (1 / 3) * max(norm, 1.0) / dnorm

    def at(step: float) -> torch.Tensor:
        q = {k: (p + step * dp[k]).detach() for k, p in p0.items()}
        r = {k: (p + step * dfrozen[k]).detach() for k, p in frozen.items()}
        with torch.enable_grad():
            return flat(grad(q, r))

    g0 = float(at(0.0).norm())
    d1, d2 = ((at(s) - at(-s)) / (2 * s) for s in (h, h / 4))
    tol = 1e-5 if dtype == torch.float64 else 3e-2
    floor = 64 * eps * g0 / h  # the difference's rounding
    size = max(float(got.norm()), float(d2.norm()))
    if float((d1 - d2).norm()) <= tol * size + floor:
        gap = float((got - d2).norm())
        if gap <= tol * size + floor:
            return
        raise UnsupportedModelError(
            f"the second derivatives PyTorch {torch.__version__} takes of this model are not those of its gradients: "
            f"a Hessian-vector product is {gap / max(size, 1e-300):.2g} (relative) off a central difference of the "
            "gradients, so App. F's first-order kernel change is not measured"
        )
    _same_second_derivative(dg, reverse(), UnsupportedModelError)


def _reverse_second(
    f: Callable, p0: dict, frozen: dict, dp: dict, dfrozen: dict, cot: torch.Tensor, moved: bool
) -> dict:
    """The same Hessian-vector product as the forward-over-reverse dg, by reverse over reverse:
    ∇_p of ⟨∇_(p, r) (cotᵀ f), (Δp, Δr)⟩ (the frozen r's part only where Δr moves them)."""
    from torch.func import grad, vjp

    if not moved:
        return vjp(lambda q: vjp(f, q)[1](cot)[0], p0)[1](dp)[0]

    def along(q):
        gq, gr = vjp(f, q, frozen)[1](cot)
        return sum((gq[n] * dp[n]).sum() for n in gq) + sum((gr[n] * dfrozen[n]).sum() for n in gr)

    return grad(along)(p0)


def _same_second_derivative(fwd: dict, rev: dict, error: type[Exception]) -> None:
    """Raise ``error`` unless forward-over-reverse ``fwd`` and reverse-over-reverse ``rev`` (the same
    Hessian-vector product, dicts like the parameters) agree to the dtype's precision."""
    import torch

    a = torch.cat([fwd[k].reshape(-1) for k in fwd]).double()
    b = torch.cat([rev[k].reshape(-1) for k in fwd]).double()
    rtol = 1e-7 if fwd[next(iter(fwd))].dtype == torch.float64 else 1e-3
    err, scale = float((a - b).norm()), float(max(a.norm(), b.norm()))
    if not err <= rtol * scale:
        raise error(
            f"the second derivatives of this model disagree between PyTorch {torch.__version__}'s forward and reverse "
            f"modes (a Hessian-vector product {err / max(scale, 1e-300):.2g} apart), so App. F's first-order kernel "
            "change is not measured"
        )


def _unflat(model: nn.Module, vec: np.ndarray, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A flat (P,) vector as the model's named parameters (in ``dtype``)."""
    import torch

    dev = next(model.parameters()).device
    t = torch.as_tensor(np.ascontiguousarray(vec, np.float64), device=dev).to(dtype)
    out, o = {}, 0
    for n, p in model.named_parameters():
        out[n] = t[o : o + p.numel()].view(p.shape)
        o += p.numel()
    return out


def cross_gram_times(
    model: nn.Module,
    X_out: torch.Tensor,
    X: torch.Tensor,
    V: np.ndarray,
    dtype: torch.dtype,
    method: str | NTKRoute = "auto",
    block_size: int | None = None,
    out: torch.Tensor | None = None,
) -> np.ndarray:
    """g_θ(X_out, 𝒳) V at the model's parameters: the kernel rows between new points and the N
    training points (NSA Eq. 9's g_t(X, 𝒳) v_k), through :func:`nsa_dist.ntk.gram` (the run's own
    NTK path), a block of rows (≤ 32 Mi floats) at a time, never all M×N rows at once — unless
    ``out`` is given.

    Args:
        X_out: (M, …) new points; X: (N, …) training points; V: (N, K) columns.
        dtype: the kernel's dtype; method, block_size: as ``spectrum.ntk_method`` / ``block_size``, or
            the run's resolved :class:`~nsa_dist.ntk.NTKRoute` (no probe of the forward pass).
        out: a contiguous (M, N) tensor of ``dtype`` on the points' device to assemble all the
            rows in, in one call (its contents are overwritten): the training points' features
            are then computed once instead of once per block of rows (at N = M = 10⁴ the blocks
            were three, 2.77–2.85 s against 2.31–2.37 s in a reused buffer, equal results).

    Returns:
        (M, K) float64.

    Raises:
        ValueError: ``out`` of the wrong shape, dtype or device, or not contiguous.
    """
    import torch

    from nsa_dist.ntk.gram import gram

    N, M = X.shape[0], X_out.shape[0]
    Vt = torch.as_tensor(np.ascontiguousarray(V, np.float64), device=X.device).to(dtype)  # (N, K)
    if out is not None:
        return (
            (gram(model, X_out, X, method=method, block_size=block_size, dtype=dtype, out=out) @ Vt)
            .detach()
            .cpu()
            .double()
            .numpy()
        )
    rows = max(1, (32 << 20) // max(N, 1))
    out = [
        (gram(model, X_out[i : i + rows], X, method=method, block_size=block_size, dtype=dtype) @ Vt)
        .detach()
        .cpu()
        .double()
        .numpy()
        for i in range(0, M, rows)
    ]  # (b, N) @ (N, K) each
    return np.concatenate(out, axis=0)  # (M, K)


def gram_change(
    model: nn.Module, X: torch.Tensor, theta: np.ndarray, dtheta: np.ndarray, evecs: np.ndarray, dtype: torch.dtype
) -> dict[str, np.ndarray]:
    """App. F: dG_t projected on the top Kg eigenvectors V of G_t, measured and to first order.

    measured:    D = Vᵀ (G(θ_t + Δθ_t) − G(θ_t)) V
    first order: D̄ = Vᵀ (∂G/∂θ · Δθ_t) V, ∂G/∂θ·Δθ = dJ Jᵀ + J dJᵀ, dJ = ∂J/∂θ · Δθ;
                 for GD (Δθ = −(δ/N) Jᵀ m) this is −(δ/N) Vᵀ(Q_t + Q_tᵀ)V of Eq. 26, with the
                 i-th column of Q_t = Aᵀ ℋ_t(X^i) A m̄_t.

    diag(D̄)_i is the first-order change of λ_i (perturbation theory: dλ_i = v_iᵀ dG v_i).

    Args:
        model: the network (its parameters are left as they were).
        X: (N, d) training inputs.
        theta: (P,) θ_t; dtheta: (P,) Δθ_t = θ_{t+1} − θ_t (NaN: unknown, e.g. a Tracker's last step).
        evecs: (N, Kg) eigenvectors of G_t.
        dtype: the products' dtype (float64 for the paper's quantities).

    Returns:
        {"gram_change": (2, Kg) [diag D, diag D̄], "gram_change_fro": (3,) [‖D‖_F, ‖D̄‖_F, ‖D − D̄‖_F]};
        NaN when Δθ_t is not finite.

    Raises:
        UnsupportedModelError: PyTorch's forward and reverse modes disagree on this model's second
            derivatives (see :func:`_first_order`).
    """
    import torch

    from nsa_dist.ntk.state import attributes_kept, exact_kernels

    Kg = evecs.shape[1]
    if not np.all(np.isfinite(dtheta)):
        return {"gram_change": np.full((2, Kg), np.nan), "gram_change_fro": np.full(3, np.nan)}
    names = [n for n, _ in model.named_parameters()]
    dev = next(model.parameters()).device
    unflat = lambda v: _unflat(model, v, dtype)  # noqa: E731

    orig = next(model.parameters()).dtype
    model.to(dtype)
    try:
        Xd = X.to(dtype) if X.is_floating_point() else X  # token ids stay integers
        V = torch.as_tensor(np.ascontiguousarray(evecs, np.float64), device=dev).to(dtype)  # (N, Kg)
        p0, dp = unflat(theta), unflat(dtheta)
        p1 = {n: p0[n] + dp[n] for n in names}
        # G_t is the kernel of the trainable parameters: the frozen ones (θ holds every parameter) are
        # constants — differentiated too, they made a frozen layer's run's dG 60–81 % off
        train = {n for n, p in model.named_parameters() if p.requires_grad}
        q0, q1, dq = ({n: p[n] for n in names if n in train} for p in (p0, p1, dp))
        rest0, rest1, drest = ({n: p[n] for n in names if n not in train} for p in (p0, p1, dp))
        # attention by composite kernels: forward-mode AD through it; activations a hook cached: put back
        with exact_kernels(model), attributes_kept(model):
            G0V, G1V = _gram_times(model, Xd, V, rest0)(q0), _gram_times(model, Xd, V, rest1)(q1)  # (N, Kg) each
            Dbar = _first_order(model, Xd, V, q0, dq, rest0, drest).detach().cpu().double().numpy()  # (Kg, Kg)
        D = (V.T @ (G1V - G0V)).detach().cpu().double().numpy()  # (Kg, Kg)
    finally:
        model.to(orig)
    fro = np.linalg.norm
    return {
        "gram_change": np.stack([np.diag(D), np.diag(Dbar)]),
        "gram_change_fro": np.array([fro(D), fro(Dbar), fro(D - Dbar)]),
    }
