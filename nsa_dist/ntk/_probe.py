"""What the forward pass actually does: which parameter may take which NTK path (private).

A fast route (structured factors of a Linear layer; formed per-sample gradients of a
convolution, an embedding, a norm's affine parameters, self-attention's projections) computes a
layer's per-sample gradients from its recorded input A and output gradient δ.  That is the true
per-sample gradient only when (docs/design-notes.md, "What a fast NTK route assumes about a
layer"; a failed proof's reason starts with the assumption's name):

- known layer: a kind with a closed form, its class's own forward, one tensor in and one out;
- reads its parameters: its trainable parameters are exactly its registered weight and bias
  (no parametrization, no ``weight_g``/``weight_v``, no forward replaced on the instance);
- called once: one call per forward, each parameter used once in the autograd graph;
- sample axis: its input and output have the batch's length on the sample axis, and the
  gradient of point k's output reaches only row k of its output;
- returns its output: its output equals its class forward on the recorded input, through the
  same autograd graph (no hook or other forward replaced it); a copy is handed to the network,
  so in-place changes of the network's copy leave the differentiated output as computed;
- input kept: its input is not modified in place after the call;
- and, for the model, samples do not interact: the outputs for half a batch equal the whole's.

:func:`plan_forward` proves each on probe forwards of the first few points (a no-grad forward,
one with grad and hooks, the two halves, one backward pass per probe point) and returns a
:class:`ForwardPlan` saying, per parameter, the path and why.  A layer that is not proven takes
per-sample Jacobians (exact for any module), alone; a coupling model the full-batch Jacobian.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from nsa_dist.errors import NonFiniteError, UnsupportedModelError
from nsa_dist.models import user_named_modules
from nsa_dist.ntk._adjoint import _Coarsest, gradients_not_derivative
from nsa_dist.ntk._attention import attention_call_ok, attention_ok, decomposed, projections
from nsa_dist.ntk.inputs import as_2d, autograd_on, trainable_params
from nsa_dist.ntk.state import (
    FrequencyScaledLookups,
    RandomDraws,
    batch_stat_modules,
    parameters_kept,
    plain_scalars,
    preserved,
    refuse_parameter_writes,
    rng_kept,
)

__all__ = ["Route", "FastLayer", "ForwardPlan", "plan_forward", "couples"]

_PROBE_POINTS = 4

# The assumptions a fast route makes about a layer (docs/design-notes.md, "What a fast NTK route
# assumes about a layer"); the reason given for a layer that fails a proof starts with its name.
KNOWN = "known layer"
READS = "reads its parameters"
ONCE = "called once"
AXIS = "sample axis"
RETURNS = "returns its output"
KEPT = "input kept"


class Route:
    """Path names stored with a run and returned by ``resolve_method(..., explain=True)``."""

    STRUCTURED = "structured"  # Linear on (n, features): factors Â, D
    PER_LAYER = "per_layer"  # formed per-sample gradients from the layer's input and output gradient
    JACOBIAN = "jacobian"  # per-sample Jacobians (torch.func), any module
    BATCH = "batch"  # the full-batch Jacobian: the model couples samples


@dataclass(frozen=True)
class FastLayer:
    """A layer whose trainable parameters take a per-layer path.

    Attributes:
        name: the module's qualified name.
        module: the module.
        params: names (within the module) of its trainable parameters.
        factored: Linear on 2-D inputs (structured factors) rather than formed gradients.
        clone_out: the model modifies the layer's output in place: the feature pass hands the
            model a copy and differentiates the original.
    """

    name: str
    module: nn.Module
    params: tuple[str, ...]
    factored: bool
    clone_out: bool

    @property
    def w(self) -> float | None:
        """The weight's scale in the structured factor (NTK parametrisation), None when frozen."""
        return self._scale("weight")

    @property
    def b(self) -> float | None:
        """The bias's scale (NTK parametrisation), None when frozen or absent."""
        return self._scale("bias")

    def _scale(self, name: str) -> float | None:
        from nsa_dist.models import NTKLinear

        if name not in self.params:
            return None
        return getattr(self.module, f"{name}_scale") if type(self.module).forward is NTKLinear.forward else 1.0


@dataclass(frozen=True)
class ForwardPlan:
    """Which parameter takes which path (see the module docstring), and why.

    Attributes:
        coupled: the model couples samples; every parameter takes the full-batch Jacobian.
        layers: the per-layer (fast) layers, in module order.
        generic: qualified names of the parameters taken by per-sample Jacobians.
        routes: every trainable parameter → (path, reason).
    """

    coupled: bool
    layers: tuple[FastLayer, ...]
    generic: tuple[str, ...]
    routes: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def all_factored(self) -> bool:
        return not self.coupled and not self.generic and all(lay.factored for lay in self.layers)


def _standard(m: nn.Module) -> bool:
    """A layer of a kind whose per-sample gradient is a function of its own input and output gradient only."""
    from nsa_dist.models import NTKLinear

    kinds = [
        nn.Linear,
        nn.Conv1d,
        nn.Conv2d,
        nn.Conv3d,
        nn.Embedding,
        nn.LayerNorm,
        nn.GroupNorm,
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
    ] + ([nn.RMSNorm] if hasattr(nn, "RMSNorm") else [])
    if isinstance(m, torch.jit.ScriptModule):  # TorchScript: neither its forward nor hooks are Python's
        return False
    if type(m).forward is NTKLinear.forward:
        return True
    if isinstance(m, nn.Embedding) and m.max_norm is not None:
        return False  # renormalises its weight in place during the forward
    # A stock forward that calls an overridable method must run the stock one too: ConvNd.forward
    # calls self._conv_forward, and a subclass that overrides only that (weight standardisation, a
    # pruning mask, a scaled or quantised weight) convolves with another weight than the registered
    # one — the probe's reference forward would run the same override and prove nothing.
    return any(
        isinstance(m, k)
        and type(m).forward is k.forward
        and getattr(type(m), "_conv_forward", None) is getattr(k, "_conv_forward", None)
        for k in kinds
    )


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the dtype's tolerance relative to their scale (not an absolute one: outputs scaled by
    1e-9 hid a coupling)."""
    tol = 1e-9 if a.dtype == torch.float64 else 1e-4
    if a.shape != b.shape:
        return False
    scale = torch.maximum(a.abs().max(), b.abs().max()) if a.numel() else a.new_zeros(())
    return bool(((a - b).abs().max() <= tol * scale).item()) if a.numel() else True


def _couples(
    model: nn.Module,
    x: torch.Tensor,
    again: torch.Tensor | None = None,
    window: tuple[torch.Tensor, list[int]] | None = None,
    all_points: torch.Tensor | None = None,
) -> str | None:
    """:func:`_coupling`'s reason, with :func:`_sixteen_bit`'s note where the forward computes in 16 bits."""
    why = _coupling(model, x, again, window, all_points)
    return None if why is None else why + _sixteen_bit(model, x)


def _coupling(
    model: nn.Module,
    x: torch.Tensor,
    again: torch.Tensor | None = None,
    window: tuple[torch.Tensor, list[int]] | None = None,
    all_points: torch.Tensor | None = None,
) -> str | None:
    """Why the model couples samples (None if it does not); UnsupportedModelError if its forward is
    random.  ``again``: the outputs of a second forward of x already run with grad (else one is run
    here).  ``window``: a copy of the points the probe points were chosen from (the first
    ``_SCAN``) and the probe points' rows in it, forwarded as one batch too.  ``all_points``: every
    point the kernel is asked at (:func:`_whole_batch_differs`).  Every forward here
    runs with grad, as the Gram's own passes do: without it PyTorch may take another path (an
    eval-mode TransformerEncoder's nested tensors zero padded positions)."""
    with torch.enable_grad():
        with RandomDraws() as draws:
            whole = as_2d(model(x), x.shape[0])
        drew = bool(draws.drew)  # proof of a random forward, where two forwards may still agree
        _no_reentrant_checkpoint(whole)
        whole = whole.detach()
        if again is None:  # whole was the first forward: a lazy module draws its initial values there only
            with RandomDraws() as draws:
                again = as_2d(model(x), x.shape[0])
            drew = drew and bool(draws.drew)
        again = again.detach()
        _finite_outputs(model, whole, again)
        if drew or not _close(whole, again):
            drop = [
                n for n, m in user_named_modules(model) if isinstance(m, nn.modules.dropout._DropoutNd) and m.training
            ]
            state = [] if drop or drew else _changed_buffers(model, x)
            if state:
                raise UnsupportedModelError(
                    f"the model's forward changes its state: every forward writes its {', '.join(state)}, "
                    "and two forwards of the same points differ: its NTK is not defined at any one state; "
                    "call model.eval() if the module updates its state only in training (e.g. spectral_norm), "
                    "or keep the state out of the forward"
                )
            raise UnsupportedModelError(
                "the model's forward is random ("
                + ("it draws from torch's random numbers" if drew else "two forwards of the same points differ")
                + (f"; dropout in train mode: {', '.join(repr(d) for d in drop)}" if drop else "")
                + "): its NTK is not defined; call model.eval() (or disable the randomness)"
            )
        bn = batch_stat_modules(model)
        if bn:  # they couple by construction; the halves below can miss it ([a, b, a, b], a constant output),
            # and at one point they still write their running statistics, which only the batch route keeps
            # out of the transforms (a per-sample route met torch.func's raw in-place error)
            return "batch statistics in " + ", ".join(bn)
        if x.shape[0] < 2:
            return None
        h = x.shape[0] // 2
        try:
            parts = torch.cat([as_2d(model(x[:h]), h), as_2d(model(x[h:]), x.shape[0] - h)]).detach()
        except Exception as e:  # a forward that cannot run on fewer points depends on the batch
            return f"its forward fails on a smaller batch ({type(e).__name__})"
    if not _close(whole, parts):
        return "its outputs for half a batch differ from those of the whole batch"
    return (
        _batch_size_matters(model, x, whole, window)
        or _first_point_moves(model, x)
        or (_whole_batch_differs(model, all_points) if all_points is not None else None)
    )


def _finite_outputs(model: nn.Module, *outs: torch.Tensor) -> None:
    """NonFiniteError when a probe forward's outputs hold NaN or inf: no kernel is defined there,
    and the checks below, which compare outputs, would take the NaN for a forward that is random
    (a left-padded Hugging Face BLOOM, whose fully masked attention rows give NaN, was refused as
    "the model's forward is random").  Non-finite parameters or buffers are named as the cause
    (a NaN weight was reported as NaN outputs at the points, with the advice to check masking)."""
    for out in outs:
        bad = ~torch.isfinite(out)
        if bool(bad.any()):
            rows = bad.reshape(out.shape[0], -1).any(1)
            held = [  # a parameter NaN or inf; a buffer NaN (−inf is what attention masks hold)
                f"{name} ({n} of {t.numel()} entries)"
                for name, t, n in (
                    *((k, p, int((~torch.isfinite(p)).sum())) for k, p in model.named_parameters()),
                    *((k, b, int(torch.isnan(b).sum())) for k, b in model.named_buffers() if b.is_floating_point()),
                )
                if n
            ]
            if held:
                raise NonFiniteError(
                    f"the model's parameters hold NaN or inf, or its buffers NaN — {', '.join(held[:5])}"
                    + (f" and {len(held) - 5} more" if len(held) > 5 else "")
                    + f" — so its outputs are NaN or inf at {int(rows.sum())} of the {out.shape[0]} probe points "
                    "and no NTK or Hessian is defined (a diverged training step, or a checkpoint loaded with NaN)"
                )
            raise NonFiniteError(
                f"the model's outputs hold NaN or inf at {int(rows.sum())} of the {out.shape[0]} probe points "
                "(the first distinct points of x): its NTK is not defined there; check the forward at those "
                "points (e.g. an attention row whose every key is masked, as a fully padded sequence gives)"
            )


def _no_reentrant_checkpoint(out: torch.Tensor) -> None:
    """UnsupportedModelError when ``out`` was computed through ``torch.utils.checkpoint`` with
    ``use_reentrant=True``: its backward runs only under ``.backward()`` — ``torch.autograd.grad``
    and every torch.func transform refuse it, so no NTK route can differentiate the forward (it
    surfaced as a batch route chosen for "a forward that fails on repeated points", then torch.func's
    "autograd.Function … must override setup_context")."""
    stack, seen = [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if type(fn).__name__ == "CheckpointFunctionBackward":
            raise UnsupportedModelError(
                "the model's forward uses torch.utils.checkpoint with use_reentrant=True, whose backward runs "
                "only under .backward() (torch.autograd.grad and torch.func refuse it), so its NTK cannot be "
                "computed; checkpoint with use_reentrant=False (the same function), or turn activation "
                "checkpointing off for the measurement (e.g. model.gradient_checkpointing_disable())"
            )
        stack.extend(nxt for nxt, _ in fn.next_functions)


def _changed_buffers(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The buffers one forward of x changes, in place or by reassignment (``self.mu = …``), as
    "'name' (Type)" (the caller restores them: it runs inside ``preserved``), and the plain attributes
    it changes, as "attribute 'name' (Type)" (a warm-up counter ``self.calls += 1`` the forward reads
    was called "random … call model.eval()", which changes nothing: an audit)."""
    before = {n: (b, b.detach().clone()) for n, b in model.named_buffers()}
    scalars = plain_scalars(model)
    owners = {f"{n}.{k}" if n else k: m for n, m in model.named_modules() for k in m._buffers}
    try:
        with torch.no_grad():
            model(x.clone())
    except Exception:  # noqa: BLE001 — the caller's own message then
        return []
    now = dict(model.named_buffers())
    norms = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
    attributes = [  # (NaN where it was NaN is unchanged: a `tau = nan` the forward never writes was named)
        f"attribute {k!r} ({type(m).__name__})"
        for m, k, v in scalars
        if (now_v := m.__dict__.get(k, v)) != v and not (now_v != now_v and v != v)
    ]
    return [
        f"buffer {n!r} ({type(owners[n]).__name__})"
        for n, (b, v) in before.items()
        if (now.get(n) is not b or not torch.equal(b, v))
        and not (isinstance(owners[n], norms) and owners[n].training)  # statistics its output does not read
    ] + attributes


def _batch_size_matters(
    model: nn.Module, x: torch.Tensor, whole: torch.Tensor, window: tuple[torch.Tensor, list[int]] | None
) -> str | None:
    """Why the probe points' outputs change with the batch's size (None: they do not) — a forward
    that branches on ``x.shape[0]`` or takes a batch statistic only past some size, which the
    halves of four points never show.  The routes forward other sizes than the probe's: per-sample
    Jacobians one point at a time, feature passes whole chunks (a run's later batches, too).  So
    point 0 alone, and the probe window (the first ``_SCAN`` points, the most a run probes on) as one
    batch, must give the probe batch's outputs."""
    with torch.enable_grad():
        try:
            one = as_2d(model(x[:1].clone()), 1).detach()
        except Exception:  # noqa: BLE001 — no per-sample route can run it either: that one fails loudly
            one = None
        if one is not None and not _close(whole[:1], one):
            return (
                "a point's outputs alone differ from its outputs in a batch (the forward depends on the batch's size)"
            )
        if window is None or window[0].shape[0] <= x.shape[0]:
            return None
        pts, rows = window
        try:
            big = as_2d(model(pts), pts.shape[0]).detach()
        except Exception as e:  # noqa: BLE001
            return f"its forward fails on a batch of {pts.shape[0]} points ({type(e).__name__})"
    if big.shape[0] != pts.shape[0] or not _close(whole, big[rows]):
        return (
            f"the probe points' outputs in a batch of {pts.shape[0]} differ from those in a batch of "
            f"{x.shape[0]} (the forward depends on the batch's size)"
        )
    return None


_WHOLE_BYTES = 256 * 2**20  # the largest whole-batch forward the check runs (a no-grad one)


def _whole_batch_differs(model: nn.Module, x: torch.Tensor, probed: bool = True) -> str | None:
    """Why the outputs of a point forwarded alone differ from its outputs in the one batch of all the
    points (None: they do not, or there are too few points to tell more than the probe did).

    The probe's batches (four points, their halves, point 0, the first 64) all hold the probe points,
    so a forward that decides something over its whole batch — ``if x.max() > 1: x = x / 255``,
    ``if x.sum() > 0`` — decides alike on every one of them, and the per-sample routes then ran each
    point alone, where it decides otherwise (a Gram 0.35 off, an `nsa run`'s λ_max 80× off, nothing
    said).  The kernel is the one batch's: each point alone must give its outputs in it, to the
    outputs' scale (as the halves are compared).  A batch whose forward would keep more than
    ``_WHOLE_BYTES`` (measured on two points: the module outputs and the tensors autograd saves) is
    checked on its first points that fit; a forward vmap cannot batch goes one point at a time, over
    at most ``_ONE_BY_ONE`` points spread over the batch.  With grad, as the Gram's own passes run."""
    n = x.shape[0]
    if n <= (_PROBE_POINTS if probed else 1):  # ``probed``: the probe's batches were of these points
        return None
    try:
        per_point = _kept_bytes(model, x[:2]) / 2
    except Exception:  # noqa: BLE001 — a forward that runs on no fewer: the others say what it does
        return None
    m = n if per_point * n <= _WHOLE_BYTES else max(_SCAN, int(_WHOLE_BYTES // max(per_point, 1.0)))
    pts = x[: min(n, m)].clone()
    what = f"the batch of all {n} points" if pts.shape[0] == n else f"a batch of the first {pts.shape[0]} points"
    with torch.enable_grad():
        try:
            batch = as_2d(model(pts), pts.shape[0]).detach()
        except _OUT_OF_MEMORY:
            raise
        except Exception as e:  # noqa: BLE001 — a forward that cannot run on the whole batch
            return f"its forward fails on {what} ({type(e).__name__})"
        try:
            i = _first_apart(model, pts, batch)
        except _OUT_OF_MEMORY:
            raise
        except Exception:  # noqa: BLE001 — no per-sample route can run it either: that one fails loudly
            return None
    if i is None:
        return None
    return (
        f"point {i}'s outputs alone differ from its outputs in {what} "
        "(the forward decides something over its whole batch, e.g. `if x.max() > 1`)"
    )


_OUT_OF_MEMORY = (torch.OutOfMemoryError, MemoryError)  # the machine's limit, not the model's coupling
_ONE_BY_ONE = 1024  # points the one-at-a-time fallback forwards (about 0.1 ms each for a small net)


def _first_apart(model: nn.Module, x: torch.Tensor, batch: torch.Tensor) -> int | None:
    """The first point whose outputs alone differ from its row of ``batch`` by more than :func:`_close`
    allows (the tolerance of the whole output's scale: to a row's own, float32 rounding of an output
    near 0 by cancellation — 2.6e-08 in the batch, 4.1e-08 alone — would count); None: none does.
    Vmapped over single-point batches, else one point at a time (a forward branching on its batch's
    values raises under vmap) over at most ``_ONE_BY_ONE`` points spread over x, stopping at the
    first that differs."""
    n = batch.shape[0]
    scale = float(batch.abs().max()) if batch.numel() else 0.0
    tol = (1e-9 if batch.dtype == torch.float64 else 1e-4) * scale

    def apart(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape != b.shape or bool(((a - b).abs() > tol).any())

    try:
        alone = torch.func.vmap(lambda xi: as_2d(model(xi[None]), 1)[0], randomness="error")(x)
        alone = alone.reshape(n, -1).detach()
    except _OUT_OF_MEMORY:
        raise
    except Exception:  # noqa: BLE001 — one forward per point
        alone = None
    if alone is not None:
        if alone.shape != batch.shape:
            return 0
        off = ((alone - batch).abs().reshape(n, -1) > tol).any(1).nonzero()
        return int(off[0, 0]) if len(off) else None
    for i in torch.linspace(0, n - 1, min(n, _ONE_BY_ONE)).round().long().unique().tolist():
        if apart(as_2d(model(x[i : i + 1]), 1).detach()[0], batch[i]):
            return int(i)
    return None


def _kept_bytes(model: nn.Module, x: torch.Tensor) -> float:
    """The bytes a forward with grad keeps on the points ``x``, about: its input, every tensor the
    modules return and every tensor autograd saves for the backward pass (a forward on raw parameters,
    ``tanh(x @ W1) @ W2``, has no module outputs to count)."""
    big = [float(x.numel() * x.element_size())]

    def count(t):
        if isinstance(t, torch.Tensor):
            big.append(float(t.numel() * t.element_size()))
        return t

    def hook(_m, _i, out):
        for t in out if isinstance(out, (tuple, list)) else (out,):
            count(t)

    handles = []
    for m in model.modules():
        try:
            handles.append(m.register_forward_hook(hook))
        except RuntimeError:  # a TorchScript module takes no hooks: its input and the others' outputs count
            pass
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            model(x.clone())
    finally:
        for h in handles:
            h.remove()
    return sum(big)


def _first_point_moves(model: nn.Module, x: torch.Tensor) -> str | None:
    """Why point 0's output or its gradient in θ changes when the other points of its batch do
    (None: neither changes).  The halves above miss a coupling where the halves carry the batch's
    statistics (probe points [a, b, a, b]) or the output is constant (a zero-initialised readout,
    whose gradient — the features — still depends on the batch)."""
    params = [p for p in model.parameters() if p.requires_grad]
    other = x.clone()
    other[1:] = x[:1]  # [a, a, a, a] against [a, b, c, d]
    if not params or torch.equal(other, x):
        return None
    seen = []
    for batch in (x, other):
        try:
            with torch.enable_grad():
                out = as_2d(model(batch), batch.shape[0])
                if not out.requires_grad:
                    return None
                g = torch.autograd.grad(out[0].sum(), params, allow_unused=True)
        except Exception as e:  # a forward on repeated points that fails depends on the batch
            return f"its forward fails on repeated points ({type(e).__name__})"
        # a parameter outside one batch's graph has a zero gradient, not none: a hard top-1 mixture of experts
        # whose batch [a, a, a, a] never reached expert 1 read as coupling (an audit)
        seen.append([out[0].detach()] + [torch.zeros_like(p) if t is None else t.detach() for p, t in zip(params, g)])
    if all(_close(a, b) for a, b in zip(*seen, strict=True)):
        return None
    return "one point's output or its gradient changes with the other points of its batch"


@autograd_on
def batch_decides(model: nn.Module, x: torch.Tensor) -> str | None:
    """Why the outputs of points of x forwarded alone differ from theirs in the one batch of x (None:
    they do not): :func:`_whole_batch_differs` for points the probe did not see — a route probed on
    the training points measured the test points' Gram, or a cross Gram's second set, with each point
    alone where the forward decides over its batch (``if x.max() > 1``; a test spectrum 1.5e-3 of
    λ_max off, λ₃ 16× off, status ``done``)."""
    with preserved(model), rng_kept(x), _unzeroed(model):
        return _whole_batch_differs(model, x.clone(), probed=False)


@autograd_on
def couples(model: nn.Module, x: torch.Tensor) -> str | None:
    """Why the model couples samples, probed on the first points of x (None: it does not); the
    model's buffers and modes are unchanged afterwards."""
    idx = _probe_index(x)
    xs = x[idx]  # a copy: a forward that writes into its input must not write into x
    with preserved(model), rng_kept(x), _unzeroed(model), parameters_kept(model) as written:
        try:
            with FrequencyScaledLookups() as lookups:  # (the operator's products are reverse and forward mode)
                why = _couples(model, xs, window=_window(x, idx), all_points=x)
        except Exception as e:
            refuse_parameter_writes(written())
            why = _only_whole(model, x, xs, e)
        refuse_parameter_writes(written())
        refuse_frequency_scaled(lookups)
        refuse_false_gradients(model, x[idx], x)  # on every point of x: a hook on later points only
    _unchanged_input(x[idx], xs)
    return why


def _sixteen_bit(model: nn.Module, xs: torch.Tensor) -> str:
    """A note for a coupling found in a float32 or float64 model whose forward computes in a 16-bit float
    (a bf16 autocast region, a ``.half()`` branch): 16-bit rounding changes with the batch's size, so the
    comparisons of batches that found the coupling cannot tell it from that rounding (an audit read a
    bf16 autocast region as "the forward decides something over its whole batch")."""
    try:
        with _Coarsest(trainable_params(model)) as seen:
            out = model(xs[:2].clone())
    except Exception:  # noqa: BLE001 — the reason already given stands
        return ""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    floats = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
    if seen.dtype not in (torch.float16, torch.bfloat16) or not floats or floats[0].dtype == seen.dtype:
        return ""
    return (
        f"; or only the rounding of its {str(seen.dtype).removeprefix('torch.')} computations (autocast or a "
        "cast), which changes with the batch's size: a per-sample route cannot tell that from a coupling"
    )


def _only_whole(model: nn.Module, x: torch.Tensor, xs: torch.Tensor, e: Exception) -> str:
    """Why a model whose forward failed on the probe points (``e``) couples samples: it runs on the
    batch of all the points only (a transductive GCN over their fixed graph: Â relu(Â X W₁) W₂); else
    ``e`` again."""
    if x.shape[0] <= xs.shape[0] or isinstance(e, (UnsupportedModelError, NonFiniteError, *_OUT_OF_MEMORY)):
        raise e
    try:  # a failure of the probe's with-grad forward that a no-grad one of the same points has not
        with torch.no_grad():  # is not about the batch (`h.numpy()` in the forward): the probe's error stands
            model(xs.clone())
    except Exception:  # noqa: BLE001 — the probe points fail either way: does the whole batch run?
        pass
    else:
        raise e
    try:
        with torch.enable_grad():  # as the probe ran
            model(x.clone())
    except Exception:  # noqa: BLE001 — it fails on the whole batch too: the probe's error stands
        raise e from None
    return (
        f"its forward fails on the {xs.shape[0]} probe points ({type(e).__name__}) and runs on the batch of "
        f"all {x.shape[0]} points only"
    )


def _window(x: torch.Tensor, idx: list[int]) -> tuple[torch.Tensor, list[int]]:
    """A copy of the points the probe points were chosen from, and their rows in it."""
    return x[: min(x.shape[0], _SCAN)].clone(), idx


_SCAN = 64  # rows searched for distinct probe points


def _probe_index(x: torch.Tensor) -> list[int]:
    """The first ``_PROBE_POINTS`` distinct points among the first ``_SCAN`` (repeated probe points
    hide a coupling: halves of [a, a, a, a] are the whole's statistics); the first points as they are
    when there are no two distinct ones (a placeholder batch of zeros: nothing can be told from it)."""
    keep: list[int] = []
    for i in range(min(x.shape[0], _SCAN)):
        if all(not torch.equal(x[i], x[j]) for j in keep):
            keep.append(i)
            if len(keep) == _PROBE_POINTS:
                break
    return keep if len(keep) > 1 else list(range(min(x.shape[0], _PROBE_POINTS)))


def _unchanged_input(x: torch.Tensor, seen: torch.Tensor) -> None:
    """UnsupportedModelError when the probe's forwards changed the values of their input ``seen`` (a
    copy of ``x``): every pass of the Gram would change the caller's points."""
    if not torch.equal(x, seen):
        raise UnsupportedModelError(
            "the model's forward changes its input in place (e.g. x /= 2 on the tensor it is given): "
            "every forward would measure other points and overwrite the caller's; copy it first in the "
            "forward (x = x.clone())"
        )


@contextlib.contextmanager
def _unzeroed(model: nn.Module) -> Iterator[None]:
    """Within the block every trainable parameter that is all zeros (a zero-initialised readout,
    LoRA's B, ReZero's α, a zero-initialised last norm's γ) holds fixed random values; on exit it
    holds its own values again (through ``.data``: no version bump).

    The probe's proofs read gradients and outputs: behind a zero readout every layer's output
    gradient δ is zero and the outputs constant, so "z's row k reaches only f_k", "the outputs do
    not depend on the batch's size" held for any forward — and a run's route, probed once at θ_0,
    took per-layer formulas for a layer of a sort-and-dispatch, a transposed axis or a batch
    centring past 4 points at every later step (0.04–1.0 off).  Proven at a point where the
    gradients flow, a route holds wherever training takes the zeros."""
    zero: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad or nn.parameter.is_lazy(p):  # a lazy one: set by the forward
            continue
        if not p.is_floating_point() or p.numel() == 0:
            continue
        seen.add(id(p))
        if not bool(p.detach().any()):
            zero.append((p, p.detach().clone()))
    if not zero:
        yield
        return
    g = torch.Generator().manual_seed(13)
    try:
        for p, _ in zero:
            fan_in = p[0].numel() if p.ndim > 1 else 1
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64) / math.sqrt(fan_in)
            p.data.copy_(noise.to(dtype=p.dtype, device=p.device))
        yield
    finally:
        for p, v in zero:
            p.data.copy_(v)


def _uses(out: torch.Tensor) -> dict[int, int]:
    """How often each leaf tensor (parameter) is used in the autograd graph of ``out``: its edges."""
    count: dict[int, int] = {}
    seen: set[int] = set()
    stack = [out.grad_fn] if out.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None:
                count[id(var)] = count.get(id(var), 0) + 1
            else:
                stack.append(nxt)
    return count


def refuse_false_gradients(
    model: nn.Module, xs: torch.Tensor, x: torch.Tensor | None = None, label: str = "points", offset: int = 0
) -> None:
    """UnsupportedModelError when autograd's gradients at the probe's points xs — then at every point
    of x (``label``, indices from ``offset`` in the message) — are not the derivative of the outputs (a gradient hook, a
    straight-through estimator: :mod:`nsa_dist.ntk._adjoint`)."""
    why = gradients_not_derivative(model, xs, x, label, offset)
    if why is not None:
        raise UnsupportedModelError(why)


def refuse_frequency_scaled(lookups: FrequencyScaledLookups) -> None:
    """UnsupportedModelError when the forward called an embedding lookup with scale_grad_by_freq=True
    in its own code (the modules' own flags are switched off: :func:`~nsa_dist.ntk.state.frequency_unscaled`)."""
    if lookups.seen:
        raise UnsupportedModelError(
            f"the forward calls {lookups.seen[0]}(…, scale_grad_by_freq=True): autograd's gradient of that "
            "lookup is scaled by each token's count in the batch, which is not the derivative of the "
            "function, and the NTK is made of the derivative; use nn.Embedding / nn.EmbeddingBag with "
            "scale_grad_by_freq=True (their flag is off while the NTK is measured) or pass "
            "scale_grad_by_freq=False"
        )


def plan_forward(model: nn.Module, x: torch.Tensor) -> ForwardPlan:
    """Decide each trainable parameter's NTK path from probe forwards on the first few points of x.

    The model's buffers and training modes are unchanged afterwards.

    Raises:
        UnsupportedModelError: the forward is random (dropout in train mode), or changes its input.
    """
    params = trainable_params(model)
    idx = _probe_index(x)
    xs = x[idx]  # a copy: a forward that writes into its input must not write into x
    with preserved(model), rng_kept(xs), _unzeroed(model):
        try:
            with FrequencyScaledLookups() as lookups:
                trace = _Trace(model, xs)  # the forward with grad and hooks: also the randomness check's second forward
        except Exception as e:
            why = f"the model couples samples ({_only_whole(model, x, xs, e)}): the kernel of the batch forward"
            return ForwardPlan(True, (), tuple(params), {n: (Route.BATCH, why) for n in params})
        refuse_frequency_scaled(lookups)
        _unchanged_input(x[idx], xs)
        coupling = _couples(model, xs, again=trace.out, window=_window(x, idx), all_points=x)
        refuse_false_gradients(model, xs)  # (after the randomness and coupling checks: their errors first; every
        # point is gram's and a gang member's to test, after this)
        if coupling is not None:
            why = f"the model couples samples ({coupling}): the kernel of the batch forward"
            return ForwardPlan(True, (), tuple(params), {n: (Route.BATCH, why) for n in params})
        reordered = _Trace(model, xs.flip(0)) if xs.shape[0] > 1 else None
        return _plan_layers(model, trace, params, reordered)


def _not_own(m: nn.Module, local: tuple[str, ...], attention: bool) -> str | None:
    """Why m's forward may read something other than exactly its registered parameters (None: it
    reads them): a parametrization, a forward replaced on the instance, trainable parameters the
    formula does not know (weight_norm's ``weight_g``/``weight_v``), a weight that is not a parameter."""
    if any(parametrize.is_parametrized(s) for s in (m.modules() if attention else [m])):
        return "its weight is computed by a parametrization (torch.nn.utils.parametrize)"
    if "forward" in m.__dict__:
        return "its forward is replaced on the instance"
    own = _ATTENTION_OWN if attention else ("weight", "bias")
    extra = [pn for pn in local if pn not in own]
    if extra:
        return (
            f"it has trainable parameters {', '.join(extra)} besides its own weight and bias "
            "(a reparametrised weight, e.g. weight_norm)"
        )
    for pn in own:
        sub, _, leaf = pn.rpartition(".")
        holder = m.get_submodule(sub) if sub else m
        t = getattr(holder, leaf, None)
        if isinstance(t, torch.Tensor) and t.requires_grad and holder._parameters.get(leaf) is not t:
            return f"its {pn} is not its registered parameter (computed before each forward)"
    return None


_ATTENTION_OWN = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")


@dataclass
class _Call:
    """One recorded call of a candidate layer: its input, the output it computed, the copy the
    network was handed and their version counters at the call."""

    args: tuple
    kwargs: dict
    a: object
    va: int | None
    z: object
    given: object
    vg: int | None
    why: str | None  # the attention call's own check


def _batch_dim(m: nn.Module, attention: bool) -> int:
    return 1 if attention and not m.batch_first else 0


def _reference(m: nn.Module, call: _Call, attention: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer's class forward on a copy of its recorded input, with its registered parameters;
    that copy: a leaf that requires grad where the input does, so the two graphs match)."""
    q = call.a.detach().requires_grad_(call.a.requires_grad)
    if not attention:
        return type(m).forward(m, q), q
    args = tuple(q if i < 3 else v for i, v in enumerate(call.args))
    kwargs = {k: (q if k in ("query", "key", "value") else v) for k, v in call.kwargs.items()}
    return decomposed(m, *projections(m), *args, **kwargs)[0], q


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs().max() / a.abs().max().clamp_min(1e-300)).item()) if a.numel() else 0.0


def _tol(t: torch.Tensor) -> float:
    return 1e-9 if t.dtype == torch.float64 else 1e-4


def _own_output(m: nn.Module, call: _Call, attention: bool, params: list[torch.Tensor], label: str) -> str | None:
    """Why the output the network used is not the layer's own function of its input and registered
    parameters (None when it is): its value must equal the class forward's on the recorded input,
    and its autograd graph down to that input must be the class forward's (the same operations on
    the same parameters) — for self-attention, whose module runs other kernels than its
    decomposition, one random VJP w.r.t. the parameters instead."""
    z = call.z
    try:
        with torch.enable_grad():
            ref, a = _reference(m, call, attention)
    except Exception as e:  # noqa: BLE001 — then the output cannot be proven to be the layer's own
        return f"{RETURNS}: {type(m).__name__}.forward fails on the recorded input of {label} ({type(e).__name__})"
    if ref.shape != z.shape or not (torch.equal(ref, z) or _close(ref, z)):
        err = (
            f" (by {_rel(ref, z):.1e} relative)"
            if ref.shape == z.shape
            else f" ({tuple(z.shape)} vs {tuple(ref.shape)})"
        )
        return (
            f"{RETURNS}: the output of {label} differs from {type(m).__name__}.forward on its input with its "
            f"registered parameters{err}: a forward hook or another forward replaces it"
        )
    if not attention:
        if _graph(z, call.a) != _graph(ref, a):
            return (
                f"{RETURNS}: the output of {label} is not computed by {type(m).__name__}.forward from its input "
                "and registered parameters alone (its autograd graph differs): a forward hook or another forward "
                "replaces it"
            )
        return None
    g = torch.Generator(device=z.device).manual_seed(7)
    v = torch.randn(z.shape, generator=g, dtype=z.dtype, device=z.device)
    got = (
        torch.autograd.grad(z, params, v, retain_graph=True, allow_unused=True)
        if z.requires_grad
        else [None] * len(params)
    )
    want = torch.autograd.grad(ref, params, v, allow_unused=True)
    for p, gz, gr in zip(params, got, want):
        gz = torch.zeros_like(p) if gz is None else gz
        gr = torch.zeros_like(p) if gr is None else gr
        if not _close(gr, gz):
            return (
                f"{RETURNS}: the gradient of {label}'s output w.r.t. its parameters is not the layer's own "
                f"(by {_rel(gr, gz):.1e} relative): a forward hook or another forward replaces it"
            )
    return None


def _graph(z: torch.Tensor, a: object) -> list:
    """z's autograd graph down to the input a, as a canonical list: node types in depth-first order,
    the parameters (leaves) reached, and "in" where the input (or a tensor without grad) enters."""
    stop = a.grad_fn if isinstance(a, torch.Tensor) else None
    out: list = []
    seen: dict[int, int] = {}
    stack = [z.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or (stop is not None and fn is stop):
            out.append("in")
            continue
        var = getattr(fn, "variable", None)
        if var is not None:
            out.append("in" if var is a else ("leaf", id(var)))
            continue
        if id(fn) in seen:
            out.append(("again", seen[id(fn)]))
            continue
        seen[id(fn)] = len(seen)
        out.append(type(fn).__name__)
        stack.extend(nxt for nxt, _ in reversed(fn.next_functions))
    return out


def _own_rows(out: torch.Tensor, outputs: dict[str, tuple[torch.Tensor, int, str]]) -> dict[str, str]:
    """Layers whose output rows do not each reach only their own point's output (name → why).

    For each probe point k, the gradient of a random combination of f(x_k)'s outputs w.r.t. every
    layer's output must vanish outside row k of its sample axis: one backward pass per point (a
    batched pass, ``is_grads_batched``, ran 6× slower than the loop on a ResNet's convolutions)."""
    b = out.shape[0]
    names = list(outputs)
    if b < 2 or not names or not out.requires_grad:
        return {}
    g = torch.Generator(device=out.device).manual_seed(11)
    u = torch.rand(out.shape, generator=g, dtype=out.dtype, device=out.device) + 0.5
    eye = torch.eye(b, dtype=out.dtype, device=out.device)
    cot = eye[:, :, None] * u[None]  # (b, b, K): cotangent k is f(x_k)'s combination
    Z = [outputs[n][0] for n in names]
    per = [torch.autograd.grad(out, Z, cot[k], retain_graph=True, allow_unused=True) for k in range(b)]
    grads = [None if per[0][i] is None else torch.stack([p[i] for p in per]) for i in range(len(Z))]
    bad: dict[str, str] = {}
    for n, d in zip(names, grads):
        if d is None:
            continue
        z, dim, label = outputs[n]
        d = d.detach().movedim(dim + 1, 1).reshape(b, b, -1).abs().amax(2)  # (point k, row r)
        scale = float(d.max())
        leak = d * (1 - eye)
        if scale > 0 and float(leak.max()) > _tol(z) * scale:
            k, r = divmod(int(leak.argmax()), b)
            bad[n] = (
                f"{AXIS}: row {r} of the output of {label} (shape {tuple(z.shape)}) reaches point {k}'s "
                "output: its rows are not one per point (an axis of the batch's length that is not "
                "the sample axis, or a broadcast)"
            )
    return bad


class _Trace:
    """One forward of the probe points with grad, every candidate layer hooked: each call's input,
    the output it computed and the copy the network was handed instead (so the computed output
    stays as it was, whatever the network does to its copy)."""

    def __init__(self, model: nn.Module, xs: torch.Tensor) -> None:
        self.attention = {
            mname
            for mname, m in model.named_modules()
            if attention_ok(m) and any(p.requires_grad for p in m.parameters())
        }
        cands = {
            mname: m
            for mname, m in model.named_modules()
            if mname in self.attention or (any(p.requires_grad for p in m.parameters(recurse=False)) and _standard(m))
        }
        # an attention's out_proj goes with its attention
        self.cands = {n: m for n, m in cands.items() if n.rpartition(".")[0] not in self.attention}
        self.calls: dict[str, list[_Call]] = {n: [] for n in self.cands}
        self.b = xs.shape[0]
        handles = [m.register_forward_hook(self._hook(n), with_kwargs=True) for n, m in self.cands.items()]
        try:
            with torch.enable_grad():
                self.out = as_2d(model(xs), xs.shape[0])
        finally:
            for h in handles:
                h.remove()

    def _hook(self, name: str):
        att = name in self.attention

        def f(mod, args, kwargs, out):
            a = args[0] if args else kwargs.get("query", kwargs.get("input"))
            z = out[0] if att and isinstance(out, tuple) else out
            why = attention_call_ok(mod, args, kwargs, out) if att else None
            given = z.clone() if isinstance(z, torch.Tensor) else z
            self.calls[name].append(
                _Call(
                    args,
                    kwargs,
                    a,
                    a._version if isinstance(a, torch.Tensor) else None,
                    z,
                    given,
                    given._version if isinstance(given, torch.Tensor) else None,
                    why,
                )
            )
            if not isinstance(z, torch.Tensor):
                return None
            return (given,) + tuple(out[1:]) if isinstance(out, tuple) else given

        return f


def _plan_layers(
    model: nn.Module, trace: _Trace, params: dict[str, torch.Tensor], reordered: _Trace | None = None
) -> ForwardPlan:
    """Each parameter's route from the probe's traced forward; ``reordered``: the same points in
    another order, whose rows must be one per point too (a forward that permutes the points by
    their values — sort-and-dispatch — may leave an already ordered probe in place)."""
    owner = {}  # id(param) → (module name, module, local name)
    for mname, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            owner.setdefault(id(p), (mname, m, pname))
    attention, cands, calls, out = trace.attention, trace.cands, trace.calls, trace.out
    homes = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))  # tied: > 1
    canonical = {id(p): n for n, p in params.items()}
    b = trace.b
    uses = _uses(out)
    routes: dict[str, tuple[str, str]] = {}
    layers: list[FastLayer] = []
    proven: dict[str, tuple[nn.Module, tuple[str, ...], _Call]] = {}
    for mname, m in cands.items():
        att = mname in attention
        local = tuple(pn for pn, p in m.named_parameters(recurse=att) if p.requires_grad)
        label = f"{_kind(m)} {mname!r}"
        seen = calls[mname]
        why = _not_own(m, local, att)
        why = None if why is None else f"{READS}: {label}: {why}"
        if why is None and len(seen) != 1:
            why = (
                f"{ONCE}: {label} is called {len(seen)} times per forward"
                if seen
                else f"{ONCE}: {label} is never called as a module (its parameters are used directly, e.g. by "
                "F.linear, or not at all)"
            )
        tied = [pn for pn in local if homes[id(m.get_parameter(pn))] > 1]
        if why is None and tied:
            why = (
                f"{ONCE}: parameter {mname}.{tied[0]} is also registered in another module (tied), which the "
                "forward may use too"
            )
        if why is None:
            c = seen[0]
            shared = [pn for pn in local if uses.get(id(m.get_parameter(pn)), 0) != 1]
            if c.why:
                why = f"{KNOWN}: {label}: {c.why}"
            elif shared:
                pn = shared[0]
                n_uses = uses.get(id(m.get_parameter(pn)), 0)
                why = (
                    f"{ONCE}: parameter {mname}.{pn} is used {n_uses} times per forward (shared or tied)"
                    if n_uses
                    else f"{ONCE}: parameter {mname}.{pn} takes no part in the output's graph (under no_grad, "
                    "detached or unused): its columns of J are zero"
                )
            elif not isinstance(c.a, torch.Tensor) or not isinstance(c.z, torch.Tensor):
                why = f"{KNOWN}: {label} does not map one tensor to one tensor"
            elif c.a._version != c.va:
                why = f"{KEPT}: the input of {label} is modified in place after the call"
            else:
                why = _sample_axis(m, c, att, b, label) or _own_output(
                    m, c, att, [m.get_parameter(pn) for pn in local], label
                )
        if why is not None:
            for pn in local:
                routes[canonical.get(id(m.get_parameter(pn)), f"{mname}.{pn}")] = (Route.JACOBIAN, why)
            continue
        proven[mname] = (m, local, seen[0])
    rows = _own_rows(
        out, {n: (c.z, _batch_dim(m, n in attention), f"{_kind(m)} {n!r}") for n, (m, _, c) in proven.items()}
    )
    if reordered is not None:
        one = {n: c[0].z for n, c in reordered.calls.items() if len(c) == 1 and isinstance(c[0].z, torch.Tensor)}
        again = {
            n: (one[n], _batch_dim(m, n in attention), f"{_kind(m)} {n!r}")
            for n, (m, _, _c) in proven.items()
            if n not in rows and n in one
        }
        reversed_rows = _own_rows(reordered.out, again)
        rows.update({n: why + " (the probe points in reverse order)" for n, why in reversed_rows.items()})
    for mname, (m, local, c) in proven.items():
        names = [canonical.get(id(m.get_parameter(pn)), f"{mname}.{pn}") for pn in local]
        if mname in rows:
            for n in names:
                routes[n] = (Route.JACOBIAN, rows[mname])
            continue
        factored = isinstance(m, nn.Linear) and c.a.ndim == 2
        clone = c.given._version != c.vg
        path = Route.STRUCTURED if factored else Route.PER_LAYER
        note = f"{type(m).__name__} used once" + ("; its output is modified in place (cloned)" if clone else "")
        if mname in attention:
            if clone:
                for n in names:
                    routes[n] = (Route.JACOBIAN, f"{RETURNS}: the output of {mname!r} is modified in place")
                continue
            note += " as unmasked self-attention: its projections as Linear layers at every position"
        for n in names:
            routes[n] = (path, note + "; proven on the probe points")
        layers.append(FastLayer(mname, m, local, factored, clone))
    for n in params:
        if n not in routes:
            routes[n] = _unowned(model, n, *owner[id(params[n])], used=uses.get(id(params[n]), 0) > 0)
    order = list(params)
    generic = tuple(n for n in order if routes[n][0] == Route.JACOBIAN)
    return ForwardPlan(False, tuple(layers), generic, {n: routes[n] for n in order})


def _kind(m: nn.Module) -> str:
    """The layer's class name (the original class of a parametrized module)."""
    return type(m).__bases__[0].__name__ if parametrize.is_parametrized(m) else type(m).__name__


def _sample_axis(m: nn.Module, c: _Call, attention: bool, b: int, label: str) -> str | None:
    """Why the layer's input or output does not have the probe batch's length on its sample axis."""
    dim = _batch_dim(m, attention)
    for what, t in (("input", c.a), ("output", c.z)):
        if t.ndim <= dim or t.shape[dim] != b:
            return (
                f"{AXIS}: the {what} of {label} has shape {tuple(t.shape)}, not one row per point of the "
                f"probe's {b} (a table or a tensor broadcast over the points)"
            )
    return None


def _unowned(model: nn.Module, name: str, mname: str, m: nn.Module, pname: str, used: bool = True) -> tuple[str, str]:
    """The route and reason of a parameter outside every candidate layer (``used``: the probe's
    forward reached it)."""
    if ".parametrizations." in f".{name}":
        layer = f".{name}".split(".parametrizations.")[0][1:]
        host = model.get_submodule(layer)
        return Route.JACOBIAN, (
            f"{READS}: {_kind(host)} {layer!r}: its weight is computed by a parametrization "
            "(torch.nn.utils.parametrize)"
        )
    if not used:  # registered, never read (its Jacobian columns are zero): "used by its own forward" was said
        return Route.JACOBIAN, f"{KNOWN}: {name!r} is not used by the probe's forward (its gradient is zero there)"
    if not mname:
        return Route.JACOBIAN, f"{KNOWN}: {name!r} is a parameter of the model itself, used by its own forward"
    return Route.JACOBIAN, f"{KNOWN}: {type(m).__name__} ({mname!r}) has no per-layer formula"
