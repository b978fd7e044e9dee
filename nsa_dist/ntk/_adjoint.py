"""Are autograd's gradients the derivative of the forward?  The adjoint test on the probe points.

Every NTK route builds G from reverse-mode gradients (Jᵀu), and the matrix-free operator applies
J by forward mode: both are the derivative only when the backward is the adjoint of the forward.
A gradient hook registered inside the forward (``h.register_hook(lambda g: 3 * g)``), a module's
backward hook that replaces ``grad_input``, or a custom ``autograd.Function`` whose backward is not
its forward's derivative (a straight-through estimator) break that: gram then measured the kernel of
the altered gradients and the operator J·(J̃ᵀv) — neither kernel, not symmetric — without a word.

For random directions u (outputs) and t (parameters), ``u·(J t) = (Jᵀu)·t`` must hold; J t comes
from forward mode, or, where an op has no forward-mode rule, from a central difference of the
forward itself, and Jᵀu from plain autograd as training takes it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import jvp

from nsa_dist.ntk.inputs import as_2d, trainable_params
from nsa_dist.ntk.state import (
    call,
    dense_gradients,
    exact_kernels,
    frequency_unscaled,
    padding_rows_constant,
    renorm_copies,
    stateless,
)

__all__ = ["gradients_not_derivative"]

_PAIRS = 3  # random (u, t) pairs: one could cancel by chance
_EXACT_TOL = {torch.float64: 1e-8, torch.float32: 2e-3}  # J t by forward mode: rounding only
_DIFFERENCE_TOL = 0.05  # J t by a central difference (no forward-mode rule): its truncation error


def gradients_not_derivative(model: nn.Module, xs: torch.Tensor) -> str | None:
    """:func:`_adjoint_gap`'s reason; None where the test itself cannot run on these points (a forward
    that runs on its whole batch only, reentrant checkpointing, an op with no derivative at all): the
    probe's other checks and the routes' own errors speak for those models."""
    try:
        return _adjoint_gap(model, xs)
    except Exception:  # noqa: BLE001 - see above
        return None


def _adjoint_gap(model: nn.Module, xs: torch.Tensor) -> str | None:
    """Why the model's reverse-mode gradients at the (few) points ``xs`` are not the derivative of
    its outputs (None: they are, to rounding; or the test cannot run: a 16-bit model, a forward that
    torch.func and a difference both cannot take).  Runs inside the caller's
    :func:`~nsa_dist.ntk.state.preserved`."""
    params = trainable_params(model)
    dtype = next(iter(params.values())).dtype
    if dtype not in _EXACT_TOL or not xs.shape[0]:
        return None
    twin = stateless(model, xs)
    primals = renorm_copies(twin, {k: p.detach() for k, p in trainable_params(twin).items()})
    rest = {k: p.detach() for k, p in twin.named_parameters() if not p.requires_grad}
    buffers = dict(twin.named_buffers())

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return as_2d(call(twin, {**p, **rest, **buffers}, (xs.clone(),)), xs.shape[0])

    gen = torch.Generator().manual_seed(29)

    def rand(like: torch.Tensor) -> torch.Tensor:
        return torch.randn(like.shape, generator=gen, dtype=torch.float64).to(like.dtype).to(like.device)

    # the padding rows of embeddings as reverse mode sees them (no derivative from their lookups)
    with exact_kernels(twin), dense_gradients(twin), frequency_unscaled(twin), padding_rows_constant():
        live = {k: p.clone().requires_grad_(True) for k, p in primals.items()}
        with torch.enable_grad():
            out = f(live)
        if not out.requires_grad:
            return None
        worst, by = 0.0, "forward mode"
        for i in range(_PAIRS):
            u = rand(out)
            g = torch.autograd.grad(out, list(live.values()), u, retain_graph=i < _PAIRS - 1, allow_unused=True)
            # a parameter outside the reverse graph (used under torch.no_grad() only, which forward mode
            # still differentiates) has zero columns of J by convention (the probe's route says so): no
            # tangent along it
            t = {k: rand(p) if gk is not None else torch.zeros_like(p) for (k, p), gk in zip(primals.items(), g)}
            Jt, by = _forward(f, primals, t)
            if Jt is None:
                return None
            lhs = float((u.double() * Jt.double()).sum())
            rhs = sum(float((gk.double() * t[k].double()).sum()) for k, gk in zip(live, g) if gk is not None)
            t_norm = _norm(t.values())
            g_norm = _norm(gk for gk in g if gk is not None)
            scale = float(torch.linalg.norm(u.double())) * float(torch.linalg.norm(Jt.double())) + g_norm * t_norm
            if scale > 0:
                worst = max(worst, abs(lhs - rhs) / scale)
    tol = _EXACT_TOL[dtype] if by == "forward mode" else _DIFFERENCE_TOL
    if worst <= tol:
        return None
    return (
        f"the model's gradients are not the derivative of its outputs: u·(J t) by {by} and (Jᵀu)·t by "
        f"autograd differ by {worst:.2g} of their scale at the probe points (rounding allows {tol:g}) — a "
        "gradient hook registered in the forward (Tensor.register_hook), a module backward hook that "
        "replaces grad_input, or a custom autograd.Function whose backward is not its forward's derivative "
        "(a straight-through estimator); the NTK is made of the derivative, and these gradients give "
        "another kernel: remove the hook or give the Function its true derivative while measuring"
    )


def _forward(f, primals: dict[str, torch.Tensor], t: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, str]:  # noqa: ANN001
    """(J t, how): forward mode, else a central difference of f (an op without a forward-mode rule)."""
    try:
        return jvp(f, (primals,), (t,))[1].detach(), "forward mode"
    except (RuntimeError, NotImplementedError, ValueError):
        pass
    scale = max(_norm(primals.values()), 1.0)
    norm = _norm(t.values())
    if not norm > 0:
        return None, "a central difference"
    eps = float(torch.finfo(next(iter(primals.values())).dtype).eps) ** (1 / 3) * scale / norm
    try:
        with torch.no_grad():
            plus = f({k: p + eps * t[k] for k, p in primals.items()})
            minus = f({k: p - eps * t[k] for k, p in primals.items()})
    except Exception:  # noqa: BLE001 - the test cannot run: the probe's other checks stand
        return None, "a central difference"
    return (plus - minus) / (2 * eps), "a central difference"


def _norm(tensors) -> float:  # noqa: ANN001
    return float(torch.sqrt(sum(((x.double() ** 2).sum() for x in tensors), torch.zeros((), dtype=torch.float64))))
