"""Are autograd's gradients the derivative of the forward?  The adjoint test on the probe points.

Every NTK route builds G from reverse-mode gradients (Jᵀu), and the matrix-free operator applies
J by forward mode: both are the derivative only when the backward is the adjoint of the forward.
A gradient hook registered inside the forward (``h.register_hook(lambda g: 3 * g)``), a module's
backward hook that replaces ``grad_input``, or a custom ``autograd.Function`` whose backward is not
its forward's derivative (a straight-through estimator) break that: gram then measured the kernel of
the altered gradients and the operator J·(J̃ᵀv) — neither kernel, not symmetric — without a word.

For random output directions u and t = Jᵀu as plain autograd gives it (as training takes it),
``u·(J t) = ‖t‖²`` must hold; J t comes from forward mode (a ``torch.no_grad()`` block as a
constant, as reverse mode takes it), or, where an op has no forward-mode rule, from a central
difference of the forward itself at two step sizes.
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
    no_grad_as_constant,
    padding_rows_constant,
    renorm_copies,
    rest_in_chunks,
    stateless,
)

__all__ = ["gradients_not_derivative"]

_PAIRS = 2  # random output directions u
_EXACT_TOL = {torch.float64: 1e-9, torch.float32: 1e-4}  # J t by forward mode: rounding only
# J t by a central difference (no forward-mode rule): its truncation and rounding (steps eps^(1/3), a quarter of it)
_DIFFERENCE_TOL = {torch.float64: 1e-6, torch.float32: 1e-2}


def gradients_not_derivative(model: nn.Module, xs: torch.Tensor, x: torch.Tensor | None = None) -> str | None:
    """:func:`_adjoint_gap`'s reason; None where the test itself cannot run on these points (a forward
    that runs on its whole batch only, reentrant checkpointing, an op with no derivative at all): the
    probe's other checks and the routes' own errors speak for those models.

    ``x``: every point measured, tested after the probe's points ``xs`` a chunk at a time (one random
    direction each): a gradient hook or a gradient-reversal Function that acts on later points only
    (a flag in the input the probe's points do not carry) put every route's kernel 0.24–2.3 off and
    the loss Hessian 1.3 off, status done (an audit)."""
    try:
        return _adjoint_gap(model, xs, x)
    except Exception:  # noqa: BLE001 - see above
        return None


def _adjoint_gap(model: nn.Module, xs: torch.Tensor, x: torch.Tensor | None = None) -> str | None:
    """Why the model's reverse-mode gradients at the (few) points ``xs`` — then at every point of ``x``,
    a chunk at a time — are not the derivative of its outputs (None: they are, to rounding; or the
    test cannot run: a 16-bit model, a forward that torch.func and a difference both cannot take).
    Runs inside the caller's :func:`~nsa_dist.ntk.state.preserved`."""
    params = trainable_params(model)
    dtype = next(iter(params.values())).dtype
    if dtype not in _EXACT_TOL or not xs.shape[0]:
        return None
    twin = stateless(model, xs)
    primals = renorm_copies(twin, {k: p.detach() for k, p in trainable_params(twin).items()})
    rest = {k: p.detach() for k, p in twin.named_parameters() if not p.requires_grad}
    buffers = dict(twin.named_buffers())

    def gap(pts: torch.Tensor, pairs: int) -> tuple[float, float, str] | None:
        def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return as_2d(call(twin, {**p, **rest, **buffers}, (pts.clone(),)), pts.shape[0])

        # the padding rows of embeddings as reverse mode sees them (no derivative from their lookups)
        with exact_kernels(twin), dense_gradients(twin), frequency_unscaled(twin), padding_rows_constant():
            got = _worst_pair(f, primals, pairs)
            if got is None:
                return None
            worst, by = got
            tol = (_EXACT_TOL if by == "forward mode" else _DIFFERENCE_TOL)[dtype]
            if worst > tol and dtype == torch.float32:
                rounding = _rounding_only(twin, primals, rest, buffers, pts)
                if rounding:
                    return None
                if rounding is None:  # no float64 copy runs (a float32 tensor attribute, too little memory): the
                    # float32 sums' own rounding, ~eps₃₂·√P, is allowed instead (a review: such a plain 10⁶-unit
                    # net was refused again)
                    size = sum(p.numel() for p in primals.values())
                    tol = max(tol, 4 * torch.finfo(torch.float32).eps * size**0.5)
        return None if worst <= tol else (worst, tol, by)

    found, where = gap(xs, _PAIRS), "the probe points"
    if found is None and x is not None and x.shape[0] > xs.shape[0]:
        start = 0
        for chunk in rest_in_chunks(x, 0, _CHUNK_BYTES):
            try:
                found = gap(chunk, 1)
            except Exception:  # noqa: BLE001 - a chunk the test cannot take: the measurement speaks for it
                break
            if found is not None:
                where = f"points {start}–{start + chunk.shape[0] - 1}"
                break
            start += chunk.shape[0]
    if found is None:
        return None
    worst, tol, by = found
    return (
        f"the model's gradients are not the derivative of its outputs: with t = Jᵀu from autograd, u·(J t) by "
        f"{by} is not ‖t‖² (off by {worst:.2g} of it at {where}; rounding allows {tol:g}) — a "
        "gradient hook registered in the forward (Tensor.register_hook), a module backward hook that "
        "replaces grad_input, or a custom autograd.Function whose backward is not its forward's derivative "
        "(a straight-through estimator, a gradient reversal)"
        + ("" if by == "forward mode" else ", or a parameter also used under torch.no_grad()")
        + "; the NTK is made of the derivative, and these gradients give another kernel: remove the hook "
        "or give the Function its true derivative while measuring"
    )


_CHUNK_BYTES = 4 * 2**20  # inputs per chunk of the every-point test (forward and reverse mode over it)


def _worst_pair(f, primals: dict[str, torch.Tensor], pairs: int = _PAIRS) -> tuple[float, str] | None:  # noqa: ANN001
    """(the largest |u·(J t) − ‖t‖²| / ‖t‖² over ``pairs`` random directions u, how J t was taken); None
    where no J t could be taken or f does not depend on the parameters."""
    gen = torch.Generator().manual_seed(29)

    def rand(like: torch.Tensor) -> torch.Tensor:
        return torch.randn(like.shape, generator=gen, dtype=torch.float64).to(like.dtype).to(like.device)

    live = {k: p.clone().requires_grad_(True) for k, p in primals.items()}
    with torch.enable_grad():
        out = f(live)
    if not out.requires_grad:
        return None
    worst, by = 0.0, "forward mode"
    for i in range(pairs):
        u = rand(out)
        g = torch.autograd.grad(out, list(live.values()), u, retain_graph=i < pairs - 1, allow_unused=True)
        # t = Jᵀu as autograd gives it: the two sides are u·(J Jᵀu) and ‖Jᵀu‖², equal when the
        # backward is the forward's adjoint, and a hook's share of the gradient shows whole (a random
        # t saw it through a Cauchy–Schwarz scale √P too large: float32 hooks 3.8× off passed).  A
        # parameter outside the reverse graph (used under torch.no_grad() only) gets no tangent
        t = {k: torch.zeros_like(p) if gk is None else gk.detach() for (k, p), gk in zip(primals.items(), g)}
        rhs = sum(float((gk.double() ** 2).sum()) for gk in g if gk is not None)
        if not rhs > 0:
            continue
        Jt, by = _forward(f, primals, t, u, rhs)
        if Jt is None:  # no forward mode, and a difference that step sizes do not agree on
            return None
        worst = max(worst, abs(float((u.double() * Jt.double()).sum()) - rhs) / rhs)
    return worst, by


def _rounding_only(  # noqa: ANN001
    twin, primals: dict[str, torch.Tensor], rest: dict, buffers: dict, xs: torch.Tensor
) -> bool | None:
    """Whether a float32 model's gap is its rounding: the same test on a float64 copy passes to float64's
    forward-mode tolerance (None: no float64 copy runs, or it computes in float32 inside).  (Float32
    sums over 10⁶ units put u·(J t) 1.2·10⁻⁴ off ‖t‖² with no hook at all: a plain MLP of width 10⁶ was
    refused for a hook it did not have — an audit.)  A hook or a Function with another backward changes
    the gradients in float64 as well."""

    def up(v):  # noqa: ANN001, ANN202
        return v.double() if torch.is_tensor(v) and v.is_floating_point() else v

    p64 = {k: up(p) for k, p in primals.items()}
    rest64, buffers64, xs64 = {k: up(v) for k, v in rest.items()}, {k: up(v) for k, v in buffers.items()}, up(xs)

    def f64(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out = as_2d(call(twin, {**p, **rest64, **buffers64}, (xs64.clone(),)), xs.shape[0])
        if out.dtype != torch.float64:
            raise TypeError(f"the forward returned {out.dtype} for float64 parameters")
        return out

    try:
        got = _worst_pair(f64, p64)
    except Exception:  # noqa: BLE001 - not runnable in float64 (incl. running out of memory for the copy)
        return None
    if got is None or got[1] != "forward mode":
        return None
    return got[0] <= _EXACT_TOL[torch.float64]


def _forward(  # noqa: ANN001
    f, primals: dict[str, torch.Tensor], t: dict[str, torch.Tensor], u: torch.Tensor, rhs: float
) -> tuple[torch.Tensor | None, str]:
    """(J t, how): forward mode, else a central difference of f (an op without a forward-mode rule) at two
    step sizes — None when their u·(J t) disagree beyond the tolerance (a step across a kink or a jump:
    hard top-1 routing flipped by a float32 step)."""
    try:
        with no_grad_as_constant():
            return jvp(f, (primals,), (t,))[1].detach(), "forward mode"
    except (RuntimeError, NotImplementedError, ValueError):
        pass
    how = "a central difference"
    dtype = next(iter(primals.values())).dtype
    norm = _norm(t.values())
    if not norm > 0:
        return None, how
    eps = float(torch.finfo(dtype).eps) ** (1 / 3) * max(_norm(primals.values()), 1.0) / norm
    quotients = []
    for h in (eps, eps / 4):
        with torch.no_grad():
            plus = f({k: p + h * t[k] for k, p in primals.items()})
            minus = f({k: p - h * t[k] for k, p in primals.items()})
        quotients.append((plus - minus) / (2 * h))
    a, b = (float((u.double() * q.double()).sum()) for q in quotients)
    if abs(a - b) > _DIFFERENCE_TOL[dtype] * rhs:
        return None, how
    return quotients[1], how


def _norm(tensors) -> float:  # noqa: ANN001
    return float(torch.sqrt(sum(((x.double() ** 2).sum() for x in tensors), torch.zeros((), dtype=torch.float64))))
