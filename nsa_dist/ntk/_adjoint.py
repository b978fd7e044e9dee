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

import contextlib
import math
import sys
import threading
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction
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
# J t by forward mode: rounding only (16-bit: a 3× hook put a bf16 model's kernel 0.65 off with no test, its
# rounding 0.0027 — an audit)
_EXACT_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}
# J t by a central difference (no forward-mode rule): its truncation and rounding (steps eps^(1/3), a quarter of it)
_DIFFERENCE_TOL = {torch.float64: 1e-6, torch.float32: 1e-2}


def gradients_not_derivative(
    model: nn.Module, xs: torch.Tensor, x: torch.Tensor | None = None, label: str = "points", offset: int = 0
) -> str | None:
    """:func:`_adjoint_gap`'s reason; None where the test itself cannot run on these points (a forward
    that runs on its whole batch only, reentrant checkpointing, an op with no derivative at all): the
    probe's other checks and the routes' own errors speak for those models.

    ``x``: every point measured (``label`` and their indices from ``offset`` in the reason), after the probe's
    points ``xs``, a chunk at a time: a gradient hook or a gradient-reversal Function that acts on later points only
    (a flag in the input the probe's points do not carry) put every route's kernel 0.24–2.3 off and the loss Hessian
    1.3 off, status done (an audit).  A chunk is tested where its forward can make autograd's gradients other than
    the derivative — it registers a tensor hook, or its graph holds a Python ``autograd.Function`` (a module's full
    backward hooks are one) — or the model has legacy module backward hooks; one forward with a graph tells (the
    whole test cost 1.2–1.5× a plain network's ``gram``, a review)."""
    try:
        return _adjoint_gap(model, xs, x, label, offset)
    except Exception:  # noqa: BLE001 - see above
        return None


def _adjoint_gap(
    model: nn.Module, xs: torch.Tensor, x: torch.Tensor | None = None, label: str = "points", offset: int = 0
) -> str | None:
    """Why the model's reverse-mode gradients at the (few) points ``xs`` — then at every point of ``x``,
    a chunk at a time — are not the derivative of its outputs (None: they are, to rounding; or the
    test cannot run: a 16-bit model, a forward that torch.func and a difference both cannot take).
    Runs inside the caller's :func:`~nsa_dist.ntk.state.preserved`."""
    params = trainable_params(model)
    dtype = next(iter(params.values())).dtype
    first = xs if xs.shape[0] or x is None else x[:2]  # (no xs: the probe tested them, or none is made)
    if dtype not in _EXACT_TOL or not first.shape[0]:
        return None
    made: dict[str, object] = {}

    def parts() -> tuple[nn.Module, dict, dict, dict]:  # the stateless twin and its tensors, made once needed
        if not made:
            twin = stateless(model, first)
            made.update(
                twin=twin,
                primals=renorm_copies(twin, {k: p.detach() for k, p in trainable_params(twin).items()}),
                rest={k: p.detach() for k, p in twin.named_parameters() if not p.requires_grad},
                buffers=dict(twin.named_buffers()),
            )
        return made["twin"], made["primals"], made["rest"], made["buffers"]  # type: ignore[return-value]

    def gap(pts: torch.Tensor, pairs: int) -> tuple[float, float, str, str] | None:
        twin, primals, rest, buffers = parts()

        def f(p: dict[str, torch.Tensor], rest: dict = rest, buffers: dict = buffers, pts: torch.Tensor = pts):
            return as_2d(call(twin, {**p, **rest, **buffers}, (pts.clone(),)), pts.shape[0])

        with _Measuring(twin):
            got = _worst_pair(f, primals, pairs)
            if got is None and dtype == torch.float64:
                return None
            # a 16-bit model takes no difference (its steps tell nothing) and a float32 one's may not tell (kinks
            # over many points): a Function without forward mode, or whose jvp is as wrong as its backward (3×),
            # passed a bf16 / fp16 model untested (the kernel 1.0 off, a review) — the float64 copy is asked
            if got is None:
                got = _Gap(math.inf, "no J t", math.inf, next(iter(primals.values())).dtype, True)
            worst, by, tol, coarse, functions = got
            if dtype not in (torch.float64, torch.float32) and not functions:  # a 16-bit model without a Python
                # Function: its own forward mode is its test (a copy was no twin of a deep bf16 net — 30 tanh
                # layers, the gradients 1 apart — refused, and cost ~7 bytes a parameter: a review)
                return None if worst <= tol else (worst, tol, by, "")
            if dtype == torch.float64:
                fine = _EXACT_TOL[dtype] if by == "forward mode" else _DIFFERENCE_TOL[dtype]
                # a coarser part's allowance: forward mode's rounding there, a difference's at its steps
                if not fine < worst <= (_EXACT_TOL[coarse] if by == "forward mode" else tol):
                    return None if worst <= tol else (worst, tol, by, "")
                # a float64 model computing a part in float32 (T5's RMS norm): a gap within that part's
                # allowance, and the test again at float64's with that part in float64 (a hook acting on
                # float32 gradients only, 3× — a gap of 0.41 — passed the re-run alone: the third review)
                again = _in_float64(f, primals, rest, buffers, pts, pairs, coarse)
                if again == "cannot run":  # (a float32 tensor attribute in a matmul): what its float32 part makes
                    return None
                if isinstance(again, _Gap):
                    return None if again.worst <= again.tol else (again.worst, again.tol, again.by + _COPY, "")
                if again == "coarse" and by != "forward mode":  # a difference at the coarse part's steps
                    return None
                return (worst, fine, by, _other(again))
            if worst <= (tol if by == "forward mode" else _DIFFERENCE_TOL[torch.float64]) and dtype == torch.float32:
                return None
            # a float32 or 16-bit model: a gap of its rounding, or a difference (whose steps see 1.01× Functions
            # as rounding: the kernel 0.0105 off, an audit), is judged on a float64 copy — the same model only
            # where its gradients are the model's to rounding (a hook on float32 gradients only, a Function the
            # forward takes for float32 tensors only: kernels 0.10–0.65 off passed on the copy, an audit)
            size = sum(p.numel() for p in primals.values())
            again = _in_float64(f, primals, rest, buffers, pts, _PAIRS, coarse)
            if isinstance(again, _Gap):
                return None if again.worst <= again.tol else (again.worst, again.tol, again.by + _COPY, "")
            if isinstance(again, tuple) and dtype != torch.float32:  # a 16-bit model's copy that is no twin of it
                # (its own rounding): the copy tells nothing either way
                return None if worst <= tol else (worst, tol, by, "")
            if isinstance(again, tuple):  # (no J t of the model's own: the gradients' distance is the gap)
                return (worst, tol, by, _other(again)) if math.isfinite(worst) else (*again, _COPIED, "")
            if again in ("cannot run", "coarse") and by == "forward mode":  # no float64 copy runs (a float32
                # tensor attribute, too little memory): the coarse float's own rounding, ~eps·√P, is allowed
                # instead (a review: such a plain 10⁶-unit float32 net was refused again)
                tol = max(tol, _rounding(coarse, size))
        return None if worst <= tol else (worst, tol, by, "")

    def screened(pts: torch.Tensor) -> str | None:  # the model's own forward (the caller's `preserved` puts state back)
        own = renorm_copies(model, {k: p.detach() for k, p in params.items()})  # (a max_norm table: a copy)
        frozen = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}

        def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return as_2d(call(model, {**p, **frozen}, (pts.clone(),)), pts.shape[0])

        try:
            return _may_alter_gradients(f, own, lambda: _Measuring(model))
        except Exception:  # noqa: BLE001 - a forward that fails here: the test itself says what it can
            return "function"

    def tested(pts: torch.Tensor, pairs: int, seen: str | None) -> tuple[float, float, str, str] | None:
        try:
            return gap(pts, pairs)
        except Exception as e:
            # the test cannot run where the forward registers a gradient hook (one without `if z.requires_grad`
            # fails under forward mode and no_grad): refused — it passed, and the kernel was 1.2–1.5 off (a review)
            if (seen or screened(pts)) == "hook":
                raise _Untestable(f"{type(e).__name__}: {e}") from None
            raise

    where = "the probe points"
    try:
        found = tested(xs, _PAIRS, None) if xs.shape[0] else None
        if found is None and x is not None and x.shape[0] > xs.shape[0]:
            every = "hook" if _legacy_backward_hooks(model) else None
            start = offset
            for chunk in rest_in_chunks(x, 0, _CHUNK_BYTES, _CHUNK_POINTS):
                seen = every or screened(chunk)
                where = f"{label} {start}–{start + chunk.shape[0] - 1}"
                try:
                    if seen:
                        found = tested(chunk, 1, seen)
                except _Untestable:
                    raise
                except Exception:  # noqa: BLE001 - a chunk the test cannot take: the measurement speaks for it
                    break
                if found is not None:
                    break
                start += chunk.shape[0]
    except _Untestable as e:
        return (
            f"the model's forward registers a gradient hook at {where}, and whether its gradients are the "
            f"derivative of its outputs cannot be tested there ({e}) — a hook that changes the gradient gives "
            "another kernel than the NTK; register it only `if tensor.requires_grad`, or remove it while measuring"
        )
    if found is None:
        return None
    worst, tol, by, note = found
    if math.isnan(worst) and by.startswith("forward mode"):  # not a gap: forward mode's own 0·∞ (an audit's lp_pool)
        return (
            f"u·(J t) by forward mode is NaN at {where} (a 0·∞ in an op's forward-mode rule: a square root or "
            "p-norm of exact zeros — lp_pool over an all-zero window, vector_norm of a zero row — even where a later "
            "where or relu leaves autograd's gradients finite), so whether the gradients are the derivative cannot be "
            "tested and forward-mode products are not defined there; keep the argument of the root away from 0 (e.g. "
            "add a small epsilon) while measuring"
        )
    if by == _COPIED:
        return (
            f"the model's gradients are not the derivative of its outputs: at {where} no forward-mode or difference "
            f"test of the model itself could be taken, and autograd's gradients are {worst:.2g} apart from those of "
            f"a float64 copy of the model, where rounding allows {tol:.2g} — a gradient hook or a custom "
            "autograd.Function acting on some dtypes only; the NTK is made of the derivative: remove the hook or "
            "give the Function its true derivative while measuring"
        )
    return (
        f"the model's gradients are not the derivative of its outputs: for random u and t, u·(J t) by "
        f"{by} is not (Jᵀu)·t with Jᵀu from autograd (off by {worst:.2g} of its scale at {where}; rounding "
        f"allows {tol:g}){note} — a gradient hook registered in the forward (Tensor.register_hook), a module backward "
        "hook that replaces grad_input, or a custom autograd.Function whose backward is not its forward's "
        "derivative (a straight-through estimator, a gradient reversal)"
        + ("" if by.startswith("forward mode") else ", or a parameter also used under torch.no_grad()")
        + "; the NTK is made of the derivative, and these gradients give another kernel: remove the hook "
        "or give the Function its true derivative while measuring"
    )


_DOWN = {
    torch.Tensor.to,
    torch.Tensor.float,
    torch.Tensor.half,
    torch.Tensor.bfloat16,
    torch.Tensor.type,
    torch.Tensor.type_as,
    torch.as_tensor,
}


class _Float64Throughout(torch.overrides.TorchFunctionMode):
    """A float64 tensor's casts to a coarser float (``.to``, ``.float()``, ``.half()``, ``.bfloat16()``,
    ``.type``) return it unchanged; ``made`` counts them.  Hugging Face T5's layer norm takes the
    variance of its float64 input in float32, and the test's forward mode differed from autograd by
    1.5·10⁻⁸ against float64's 10⁻⁹: a T5 encoder exact to 6·10⁻¹⁶ of jacrev was refused (`make zoo`).
    Allowing float32's 10⁻⁴ wherever a float32 tensor appeared (the first fix) let a hook 1 + 10⁻⁴
    through beside a harmless float32 branch (kernel 3·10⁻⁵ off, a review); here the casts are undone
    and the gap must fall to float64's allowance."""

    def __init__(self) -> None:
        super().__init__()
        self.made = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        wanted = kwargs.get("dtype")
        if (
            isinstance(wanted, torch.dtype)
            and wanted.is_floating_point
            and wanted != torch.float64
            and func not in _DOWN
            and any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args)
        ):  # an op's own dtype= (softmax(…, dtype=torch.float32) of a float64 score: refused as a hook, an audit)
            self.made += 1
            kwargs = {**kwargs, "dtype": torch.float64}
        out = func(*args, **kwargs)
        x = args[0] if args else None
        if (
            func in _DOWN
            and isinstance(x, torch.Tensor)
            and x.dtype == torch.float64
            and isinstance(out, torch.Tensor)
            and out.is_floating_point()
            and out.dtype != torch.float64
        ):
            self.made += 1
            return x.clone() if x.device == out.device else x.to(out.device)  # a copy, as the cast made one
        return out


class _Measuring(contextlib.ExitStack):
    """The contexts every product of the test runs in (the routes' own: exact kernels, dense gradients,
    token counts unscaled, embeddings' padding rows constant)."""

    def __init__(self, twin: nn.Module) -> None:
        super().__init__()
        self._twin = twin

    def __enter__(self) -> _Measuring:
        super().__enter__()
        for cm in (
            exact_kernels(self._twin),
            dense_gradients(self._twin),
            frequency_unscaled(self._twin),
            padding_rows_constant(),
        ):
            self.enter_context(cm)
        return self


def _legacy_backward_hooks(model: nn.Module) -> bool:
    """Whether a module's backward hooks act outside a Python Function node of the graph: the legacy
    ``register_backward_hook`` (on the module's last grad_fn), and global module backward hooks."""
    from torch.nn.modules import module as _module

    if getattr(_module, "_global_backward_hooks", None) or getattr(_module, "_global_backward_pre_hooks", None):
        return True
    return any(m._backward_hooks or m._backward_pre_hooks for m in model.modules())


class _Untestable(Exception):
    """The adjoint test failed to run where the forward registers a gradient hook."""


def _may_alter_gradients(f, primals: dict[str, torch.Tensor], measuring) -> str | None:  # noqa: ANN001
    """Whether one forward of f with a graph registers a tensor hook or a hook on a graph node
    (``grad_fn.register_hook`` / ``register_prehook``: ``"hook"``), enters a saved-tensors hooks block
    (``"saved"``: non-reentrant checkpointing does too) or puts a Python ``autograd.Function`` in its graph
    (``"function"``; a module's full backward hooks run in one) — what can make autograd's gradients other than
    the derivative (None: neither).  Node hooks and saved-tensors hooks on later points only put the kernel
    0.62–10.9 off, status done (an audit): they are C calls, seen by a profile function on this thread.  (A hook
    a C++ extension's op installs is not seen: the probe's points are tested whatever this says, where a route
    is probed.)"""
    live = {k: p.detach().requires_grad_(True) for k, p in primals.items()}  # (views: no copy of the weights)
    with _hooks_watched() as seen, _c_hooks_watched() as c_seen, measuring(), torch.enable_grad():
        out = f(live)
    if seen or "hook" in c_seen:
        return "hook"
    if "saved" in c_seen or "unwatched" in c_seen:  # (unwatched: tested, as a saved-tensors chunk is)
        return "saved"
    return "function" if _python_functions(out) else None


_C_HOOKS = {"register_hook": "hook", "register_prehook": "hook", "_push_saved_tensors_default_hooks": "saved"}


@contextlib.contextmanager
def _c_hooks_watched() -> Iterator[set[str]]:
    """Within the block, on this thread, the kinds (:data:`_C_HOOKS`) of the hook-registering C calls made:
    a graph node's ``register_hook`` / ``register_prehook`` (methods of immutable C types, which no wrapper
    can replace) and the push of saved-tensors hooks.  A profile function already set is called on."""
    seen: set[str] = set()
    before = sys.getprofile()
    if before is not None and not callable(before):  # a C-level profiler (cProfile before Python 3.12): not
        # replaced — a profile function that cannot call it on would stop it for the rest of the run (a review)
        seen.add("unwatched")
        yield seen
        return

    def watch(frame, event, arg):  # noqa: ANN001, ANN202
        if event == "c_call":
            kind = _C_HOOKS.get(getattr(arg, "__name__", ""))
            if kind == "saved" or (kind and isinstance(getattr(arg, "__self__", None), torch.autograd.graph.Node)):
                seen.add(kind)
        if before is not None:
            before(frame, event, arg)

    sys.setprofile(watch)
    try:
        yield seen
    finally:
        sys.setprofile(before)


_WATCH_LOCK = threading.Lock()
_WATCHERS: list[list[int]] = []
_IN_PLACE: list = []  # the method in place when the first open block installed the wrapper


def _watching_register_hook(self: torch.Tensor, hook):  # noqa: ANN001, ANN202
    for seen in list(_WATCHERS):
        seen.append(1)
    return _IN_PLACE[0](self, hook)


@contextlib.contextmanager
def _hooks_watched() -> Iterator[list[int]]:
    """Within the block, every ``Tensor.register_hook`` call is counted in the list yielded (one wrapper
    of the method in place — torch's, or a library's own wrapper of it, which it calls — installed while
    any block is open, in any thread, and that method put back after the last)."""
    seen: list[int] = []
    with _WATCH_LOCK:
        if not _WATCHERS:
            _IN_PLACE[:] = [torch.Tensor.register_hook]
            torch.Tensor.register_hook = _watching_register_hook
        _WATCHERS.append(seen)
    try:
        yield seen
    finally:
        with _WATCH_LOCK:
            _WATCHERS.remove(seen)
            if not _WATCHERS:
                torch.Tensor.register_hook = _IN_PLACE.pop()


_CHUNK_BYTES = 4 * 2**20  # inputs per chunk of the every-point test (forward and reverse mode over it)
_CHUNK_POINTS = 2048  # and points: a 2-input net's 4 MB were 524,288 points, +0.4 GB of activations (a review)


def _worst_pair(f, primals: dict[str, torch.Tensor], pairs: int = _PAIRS) -> _Gap | None:  # noqa: ANN001
    """(the largest gap over ``pairs`` random directions u, how J t was taken, the rounding it allows); None
    where no J t could be taken or f does not depend on the parameters.  Per u, with g = Jᵀu as autograd
    gives it (as training takes it): |u·(J g) − ‖g‖²| / ‖g‖², and for the first u also
    |u·(J r) − g·r| / (‖g‖‖r‖/√n) for a random r over the n live entries.  Where a difference at the
    parameters' float's steps cannot tell, it is taken at the steps of the coarsest float the forward computes
    in (:class:`_Coarsest`): a float64 net's float32 part drowned float64's steps in its rounding, the two
    steps disagreed, and a Function there with a 3× backward passed as "cannot tell" — the kernel 0.85 off
    (an audit)."""
    gen = torch.Generator().manual_seed(29)

    def rand(like: torch.Tensor) -> torch.Tensor:
        return torch.randn(like.shape, generator=gen, dtype=torch.float64).to(like.dtype).to(like.device)

    live = {k: p.clone().requires_grad_(True) for k, p in primals.items()}
    with torch.enable_grad(), _Coarsest(live.values()) as coarse:
        out = f(live)
    if not out.requires_grad:
        return None
    functions = _python_functions(out)
    seen: list[tuple[float, str, float]] = []  # (gap, how, allowance) of every J t taken

    def measure(v: dict[str, torch.Tensor], target: float, scale: float, difference: bool = False) -> None:
        Jv, how, allows = (_difference if difference else _forward)(f, primals, v, u, target, scale, coarse.dtype)
        if Jv is not None:  # (None: no forward mode, and a difference that cannot tell)
            seen.append((abs(_dot(u, Jv) - target) / scale, how, allows))

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
        measure(t, rhs, rhs)
        if i:
            continue
        if functions and seen and seen[-1][1] == "forward mode":
            # a Python Function's forward-mode rule is its author's too: a jvp as wrong as its backward (3×)
            # passed the comparison of the two (kernels 0.48–0.59 off, a straight-through estimator 0.031 —
            # an audit); a difference of the forward itself tells
            measure(t, rhs, rhs, difference=True)
        # and a direction r off the gradients' range: autograd's gradient projected (a hook zeroing some
        # units, a gradient reversal of weight 0 in its warm-up) keeps u·(J t) = ‖t‖² for every t = Jᵀu
        # it gives — 0.20 and 0.30 off kernels passed (a review) — and shows in u·(J r) against g·r, whose
        # size is ‖g‖‖r‖/√n for a random r
        r = {k: torch.zeros_like(p) if gk is None else rand(p) for (k, p), gk in zip(primals.items(), g)}
        n = sum(p.numel() for p, gk in zip(primals.values(), g) if gk is not None)
        target = sum(_dot(gk, r[k]) for k, gk in zip(primals, g) if gk is not None)
        measure(r, target, rhs**0.5 * _norm(r.values()) / n**0.5)
    if not seen:
        return None
    worst, by, tol = max(seen, key=lambda m: m[0] / m[2])  # the gap furthest beyond its way's allowance
    return _Gap(worst, by, tol, coarse.dtype, functions)


def _python_functions(out: torch.Tensor) -> bool:
    """Whether ``out``'s graph holds a Python ``autograd.Function`` (a module's full backward hooks run in one)."""
    stack, visited = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        if isinstance(node, BackwardCFunction):
            return True
        stack.extend(nxt for nxt, _ in node.next_functions)
    return False


def _lifted(primals: dict, rest: dict, buffers: dict, pts: torch.Tensor) -> tuple[dict, dict, dict, torch.Tensor]:
    """The tensors with every coarser float lifted to float64."""

    def up(v):  # noqa: ANN001, ANN202
        return v.double() if torch.is_tensor(v) and v.is_floating_point() and v.dtype != torch.float64 else v

    return (
        {k: up(v) for k, v in primals.items()},
        {k: up(v) for k, v in rest.items()},
        {k: up(v) for k, v in buffers.items()},
        up(pts),
    )


class _Gap(NamedTuple):
    worst: float  # the largest gap, a fraction of its scale
    by: str  # how J t was taken: "forward mode" or "a central difference"
    tol: float  # the rounding allowed that way
    coarse: torch.dtype  # the coarsest float the forward computes in
    functions: bool = False  # whether the graph holds a Python autograd.Function


class _Coarsest(torch.overrides.TorchFunctionMode):
    """The coarsest floating dtype (``dtype``, the largest eps) among the given tensors and every tensor an
    op returns inside the block that depends on them (requires grad: a float32 constant or mask is no float32
    part)."""

    def __init__(self, tensors) -> None:  # noqa: ANN001
        super().__init__()
        self.dtype = torch.float64
        for x in tensors:
            self._see(x)

    def _see(self, x: object) -> None:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.dtype and x.requires_grad:
            if torch.finfo(x.dtype).eps > torch.finfo(self.dtype).eps:
                self.dtype = x.dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        out = func(*args, **(kwargs or {}))
        if self.dtype != torch.bfloat16:
            for x in out if isinstance(out, (tuple, list)) else (out,):
                self._see(x)
        return out


def _rounding(dtype: torch.dtype, size: int) -> float:
    """How far a model computing in ``dtype`` may put autograd's gradients, or u·(J t), off float64's, as a
    fraction of their scale: float32 sums over 10⁶ units put u·(J t) 1.2·10⁻⁴ off (an audit), ~eps₃₂·√P —
    also a 16-bit model's, which CPU kernels sum in float32."""
    return max(_EXACT_TOL[dtype], 4 * torch.finfo(torch.float32).eps * size**0.5)


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() * b.double()).sum())


_COPY = " on a float64 copy of the model"
_COPIED = "a float64 copy's gradients"


def _other(again: object) -> str:
    """The reason's note where the model's gradients are not a float64 copy's (``again``: (apart, allowed))."""
    if not isinstance(again, tuple):
        return ""
    return (
        f"; and autograd's gradients are {again[0]:.2g} apart from a float64 copy's, where its rounding allows "
        f"{again[1]:.2g} (a hook or a Function acting on some dtypes only)"
    )


def _in_float64(  # noqa: ANN001
    f, primals: dict[str, torch.Tensor], rest: dict, buffers: dict, pts: torch.Tensor, pairs: int, coarse: torch.dtype
) -> _Gap | str | tuple[float, float]:
    """The test again with the model's coarser floats in float64: its parameters, buffers and inputs lifted and
    its casts down undone (:class:`_Float64Throughout`) — a float32 model's gap that is its rounding (float32
    sums over 10⁶ units put u·(J t) 1.2·10⁻⁴ off ‖t‖² with no hook at all, an audit), a float64 model's float32
    part (T5).  The gap there, else why not: ``"cannot run"`` (the forward fails so, no J t is taken),
    ``"coarse"`` (a part stays coarser: the copy tells no more), or (apart, allowed) where autograd's
    gradients there are not the model's own to ``coarse``'s rounding (a hook or a Function acting on float32
    tensors only, which the copy would not test)."""
    p64, rest64, buffers64, pts64 = _lifted(primals, rest, buffers, pts)

    def f64(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return f(p, rest64, buffers64, pts64)

    try:
        with _Float64Throughout():
            again = _worst_pair(f64, p64, pairs)
            if again is None:
                return "cannot run"
            if again.coarse != torch.float64:
                return "coarse"
            lift = _gradient(f64, p64, torch.Generator().manual_seed(31))
        own = _gradient(f, primals, torch.Generator().manual_seed(31))
    except Exception:  # noqa: BLE001 - not runnable so (incl. running out of memory for the copy)
        return "cannot run"
    size = sum(p.numel() for p in primals.values())
    apart = _norm(a.double() - b for a, b in zip(own, lift)) / max(_norm(lift), torch.finfo(torch.float64).tiny)
    allowed = _rounding(coarse, size)
    return again if apart <= allowed else (apart, allowed)


def _gradient(f, primals: dict[str, torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:  # noqa: ANN001
    """Jᵀu for a random u (float64 draws), zeros for a parameter outside the graph."""
    live = {k: p.detach().clone().requires_grad_(True) for k, p in primals.items()}
    with torch.enable_grad():
        out = f(live)
        u = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
        g = torch.autograd.grad(out, list(live.values()), u, allow_unused=True)
    return [torch.zeros_like(p) if gk is None else gk.detach() for p, gk in zip(live.values(), g)]


def _forward(  # noqa: ANN001
    f,
    primals: dict[str, torch.Tensor],
    t: dict[str, torch.Tensor],
    u: torch.Tensor,
    target: float,
    scale: float,
    coarse: torch.dtype,
) -> tuple[torch.Tensor | None, str, float]:
    """(J t, how): forward mode, else a central difference of f (an op without a forward-mode rule) at two
    step sizes — None when their u·(J t) disagree beyond the tolerance of ``scale`` (a step across a
    kink or a jump: hard top-1 routing flipped by a float32 step), or when the smaller step's gap from
    ``target`` (what autograd's gradient gives) is under 0.8 of the larger's: a gap that shrinks with
    the step is the difference's truncation (ReLU kinks inside the step: 0.021, 0.014, 0.008 of the
    scale at steps h, h/4, h/16 over 2,000 points of a float32 net with a cdist layer — refused, a
    review), where a gradient hook's gap stays as it is.  The third value: the rounding the way allows.
    Where the parameters' float's steps cannot tell and the forward computes in a coarser float
    (``coarse``), the difference is taken again at that float's steps and allowance."""
    try:
        with no_grad_as_constant():
            return jvp(f, (primals,), (t,))[1].detach(), "forward mode", _EXACT_TOL[next(iter(primals.values())).dtype]
    except (RuntimeError, NotImplementedError, ValueError):
        pass
    return _difference(f, primals, t, u, target, scale, coarse)


def _difference(  # noqa: ANN001
    f,
    primals: dict[str, torch.Tensor],
    t: dict[str, torch.Tensor],
    u: torch.Tensor,
    target: float,
    scale: float,
    coarse: torch.dtype,
) -> tuple[torch.Tensor | None, str, float]:
    """:func:`_forward`'s central difference."""
    how = "a central difference"
    norm = _norm(t.values())
    if not norm > 0:
        return None, how, math.inf
    fine = next(iter(primals.values())).dtype
    for steps in dict.fromkeys(d for d in (fine, coarse) if d in _DIFFERENCE_TOL):  # the float's own steps; where
        # they cannot tell, the coarsest's (a 16-bit float's steps tell nothing)
        eps = float(torch.finfo(steps).eps) ** (1 / 3) * max(_norm(primals.values()), 1.0) / norm
        quotients = []
        for h in (eps, eps / 4):
            with torch.no_grad():
                plus = f({k: p + h * t[k] for k, p in primals.items()})
                minus = f({k: p - h * t[k] for k, p in primals.items()})
            quotients.append((plus - minus) / (2 * h))
        a, b = (_dot(u, q) for q in quotients)
        if abs(a - b) <= _DIFFERENCE_TOL[steps] * scale and abs(b - target) >= 0.8 * abs(a - target):
            return quotients[1], how, _DIFFERENCE_TOL[steps]
    return None, how, math.inf


def _norm(tensors) -> float:  # noqa: ANN001
    return float(torch.sqrt(sum(((x.double() ** 2).sum() for x in tensors), torch.zeros((), dtype=torch.float64))))
