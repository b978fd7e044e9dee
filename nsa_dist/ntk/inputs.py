"""Validation of models and inputs shared by the NTK paths and the Hessian operators (:mod:`nsa_dist.hessian`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import torch
from torch import nn
from torch.nn.utils import parametrize

from nsa_dist._checks import check_finite
from nsa_dist.errors import ShapeError, UnsupportedModelError
from nsa_dist.models import OutputSelector, measured_module, not_a_tensor
from nsa_dist.ntk.state import cast_copy, forwarded_few, preserved

# Feature memory rule shared by the NTK paths: per-sample gradients / Jacobians of all points are
# held in memory while they fit in this many bytes; past it they are split into groups of columns
# (per_layer: one forward/backward pass over the data per group).
FEATURE_BYTES = 2 * 2**30

P = ParamSpec("P")
R = TypeVar("R")

__all__ = [
    "FEATURE_BYTES",
    "autograd_on",
    "prepare_model",
    "trainable_params",
    "prepare_inputs",
    "output_dim",
    "as_2d",
    "default_block",
    "functorch_refused",
]


def prepare_model(model: nn.Module, dtype: torch.dtype | None, output: OutputSelector = None) -> nn.Module:
    """The module every measurement computes with: ``model`` checked (an nn.Module with trainable
    parameters), a ``torch.compile``'d one unwrapped and ``output`` selected
    (:func:`nsa_dist.models.measured_module`), a copy cast to ``dtype`` if it differs."""
    model = measured_module(model, output)
    trainable_params(model)
    if dtype is not None and dtype != model_dtype(model):
        model = cast_copy(model, dtype)
    return model


def model_dtype(model: nn.Module) -> torch.dtype:
    """The model's floating dtype: its first real floating parameter's (a complex filter or an integer
    table registered first is not the model's precision), else its first parameter's."""
    first = next(iter(model.parameters()))
    return next((q.dtype for q in model.parameters() if q.is_floating_point()), first.dtype)


def trainable_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters the NTK differentiates: those with ``requires_grad``."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError(f"{type(model).__name__} has no trainable parameters: its NTK is zero")
    refuse_complex(model, params, "trainable ")
    return params


def refuse_complex(model: nn.Module, params: dict[str, torch.Tensor], which: str = "") -> None:
    """UnsupportedModelError naming ``params``' complex ones: gram took the complex gradients' product
    without a conjugate (5 % off the kernel over the real and imaginary parts, returned complex: an
    audit's FFT filter), the Hessian counted 5 entries for 10, J·dθ cast a real dθ to complex."""
    complex_ = [k for k, p in params.items() if p.is_complex()]
    if complex_:
        raise UnsupportedModelError(
            f"{type(model).__name__} has complex {which}parameters ({', '.join(repr(k) for k in complex_[:5])}): "
            "nsa-dist measures kernels and curvatures over real parameters — register a complex weight as two "
            "real ones and build it in the forward (w = torch.complex(w_re, w_im)): the same function, "
            "measured over its real and imaginary parts"
        )


def prepare_inputs(model: nn.Module, x: torch.Tensor, name: str, dtype: torch.dtype | None) -> torch.Tensor:
    """Check ``x`` is a finite (n, …) tensor — (n, d) vectors, (n, C, H, W) images, (n, T) token
    ids — and move it to the model's device; floating inputs are cast to ``dtype`` (default the
    model's), integer inputs stay integers.  A tensor made under ``torch.inference_mode`` (which
    autograd cannot record, nor track in-place changes of) is copied into a normal one."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (n, d) or (n, …), got {type(x).__name__}")
    if x.ndim < 2 or x.shape[0] == 0 or any(s == 0 for s in x.shape[1:]):
        raise ShapeError(
            f"{name} must have shape (n, d) — or (n, …) such as images (n, C, H, W) — with n >= 1 "
            f"and no empty axis, got {tuple(x.shape)}"
        )
    check_finite(name, x)
    if x.is_inference():  # made under torch.inference_mode: autograd cannot record it (a normal copy)
        with torch.inference_mode(False):
            x = x.clone()
    p = next(iter(model.parameters()))
    if not (x.is_floating_point() or x.is_complex()):  # token ids, class indices: as the model takes them
        return x.to(device=p.device)
    # the model's dtype is its real parameters' (a complex filter registered first made real points complex,
    # and the first Linear failed on them); a real x stays real, a complex one complex
    target = dtype or model_dtype(model)
    if x.is_complex():
        target = torch.promote_types(target, torch.complex64)
    elif target.is_complex:
        target = torch.empty(0, dtype=target).real.dtype
    return x.to(dtype=target, device=p.device)


def autograd_on(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run with ``torch.inference_mode`` off, parametrizations not cached and no autocast:
    every NTK product differentiates the forward, in the compute dtype asked for.

    - Inside inference mode (an evaluation loop's) nothing can be differentiated — not even under
      ``torch.enable_grad()`` — so a call there failed with "Inference tensors do not track version
      counter".
    - Inside ``torch.nn.utils.parametrize.cached()`` a parametrized weight (weight_norm,
      spectral_norm, orthogonal) is computed once from the registered original and reused: the
      torch.func paths, which swap the original for their own tensor, read the cached weight and
      differentiate nothing through it (a weight_norm network's Gram was 0.28 off, silently).
    """

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with torch.inference_mode(False), _parametrizations_uncached(), _no_autocast():
            return fn(*args, **kwargs)

    return run


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


@contextlib.contextmanager
def _no_autocast() -> Iterator[None]:
    """Within the block no ``torch.autocast`` region of the caller's is in effect: a float32 model's
    NTK is computed in float32 as documented (``dtype``: default the model's), not in bfloat16 — an
    evaluation loop under ``torch.autocast("cpu", torch.bfloat16)`` gave Grams 1.5e-3 off, forward,
    backward and the kernel's own products all in bfloat16."""
    with contextlib.ExitStack() as stack:
        for dev in _AUTOCAST_DEVICES:
            try:
                on = torch.is_autocast_enabled(dev)
            except (RuntimeError, ValueError, TypeError):  # a device type this build does not know
                continue
            if on:
                stack.enter_context(torch.autocast(dev, enabled=False))
        yield


@contextlib.contextmanager
def _parametrizations_uncached() -> Iterator[None]:
    """Within the block every parametrized tensor is computed at each access (``parametrize.cached()``
    suspended; the caller's cache is kept as it is for after the block)."""
    depth = getattr(parametrize, "_cache_enabled", 0)
    if not depth:
        yield
        return
    parametrize._cache_enabled = 0
    try:
        yield
    finally:
        parametrize._cache_enabled = depth


def output_dim(model: nn.Module, x: torch.Tensor) -> int:
    """K of a model mapping (n, …) → (n,) [K=1] or (n, K); else a ShapeError naming the shape.  The
    model is left as it was (a Tracker's constructor ran this forward outside any measurement: a train-mode
    norm's running statistics and a counter moved, a review)."""
    with torch.no_grad(), preserved(model):
        few, out = forwarded_few(lambda p: model(p.clone()), x)  # a copy: a forward may write into its input
    n = few.shape[0]
    if not isinstance(out, torch.Tensor):
        raise ShapeError(not_a_tensor(out) + " of shape (n,) or (n, K)")
    if n == 1 and out.numel() >= 1:  # one point: all of it is its outputs (a forward may squeeze the batch axis)
        return int(out.numel())
    if out.ndim == 1 and out.shape[0] == n:
        return 1
    if out.ndim == 2 and out.shape[0] == n:
        return int(out.shape[1])
    raise ShapeError(
        f"model output must have shape (n,) or (n, K); for input {tuple(few.shape)} it returned {tuple(out.shape)}"
    )


def as_2d(out: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """(n,) → (n, 1); (n, K) unchanged.  ``n``: the batch's length; a one-point batch's output is
    its one row whatever its shape (a forward ending in ``.squeeze()`` returns () or (K,) there)."""
    if n == 1 or out.ndim == 0:
        return out.reshape(1, -1)
    return out.unsqueeze(-1) if out.ndim == 1 else out


def default_block(n: int, width: int, itemsize: int, budget_bytes: float = 64e6) -> int:
    """A block size whose (block, width) working arrays stay near ``budget_bytes``."""
    return int(max(16, min(n, budget_bytes // max(1, width * itemsize))))


def functorch_refused(e: BaseException) -> bool:
    """Whether ``e`` is torch.func failing to transform an op it has no rule for: an
    ``autograd.Function`` without ``setup_context`` ("In order to use an autograd.Function with
    functorch transforms … it must override the setup_context staticmethod"), or a kernel that reads
    its input's storage, which a transform's wrapped tensor has none of (an LSTM over a packed
    sequence: "Cannot access data pointer of Tensor that doesn't have storage"), or a new-style
    Function with neither a ``vmap`` staticmethod nor ``generate_vmap_rule`` ("… does not have vmap
    support"), or non-reentrant activation checkpointing ("… don't yet support saved tensor hooks"), or a
    forward that differentiates itself (a PINN's ``x.requires_grad_()`` and ``torch.autograd.grad`` of
    its output: "… inside of a function being transformed by a functorch transform"), or an op vmap has
    no batching rule for (an eval-mode ``nn.RReLU``'s ``aten::rrelu_with_noise``: the Hessian failed with
    vmap's message, an audit).  Plain autograd runs them all."""
    msg = str(e)
    return (
        ("setup_context" in msg and "functorch" in msg)
        or "doesn't have storage" in msg
        or ("vmap over" in msg and "does not have vmap support" in msg)  # a Function without a vmap rule
        or "support saved tensor hooks" in msg  # torch.utils.checkpoint(use_reentrant=False)
        or "being transformed by a functorch transform" in msg  # requires_grad_() / autograd.grad in the forward
        or "vmap: we do not yet support aten::" in msg  # an op without a batching rule (eval-mode RReLU)
    )
