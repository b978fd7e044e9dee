"""The public NTK entry points: :func:`gram` and :func:`ntk_operator`."""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

from nsa_dist._checks import parse_enum
from nsa_dist.config import NTKMethod
from nsa_dist.errors import ShapeError, UnsupportedModelError
from nsa_dist.models import OutputSelector
from nsa_dist.ntk._jacobian import batch_jacobian_gram, jacobian_gram
from nsa_dist.ntk._method import Kernel
from nsa_dist.ntk._probe import ForwardPlan, batch_decides, plan_forward, refuse_false_gradients
from nsa_dist.ntk._structured import Unproven, not_structured_reason, structured_gram, structured_layers
from nsa_dist.ntk.blame import blame
from nsa_dist.ntk.inputs import (
    autograd_on,
    default_block,
    output_dim,
    prepare_inputs,
    prepare_model,
    trainable_params,
)
from nsa_dist.ntk.layer_features import per_layer_gram, per_layer_layers
from nsa_dist.ntk.operator import NTKOperator
from nsa_dist.ntk.route import NTKRoute
from nsa_dist.ntk.state import preserved, refuse_state_writes, stateless

__all__ = ["gram", "ntk_operator", "resolve_method", "resolve_route", "explain_method", "route_of"]

_log = logging.getLogger("nsa_dist")
_told: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _first_time(model: nn.Module) -> bool:
    """True once per model object: a run's analysis says once, not at every step, what it does."""
    if model in _told:
        return False
    _told.add(model)
    return True


_STRUCTURED_TILE = 768


def _structured_tile(n: int) -> int:
    """768-point tiles; for small N about a quarter of N (a multiple of 64), so symmetry still pays."""
    return min(_STRUCTURED_TILE, max(64, -(-n // 4 // 64) * 64))


def resolve_method(
    model: nn.Module, x: torch.Tensor, method: str | NTKMethod = "auto", *, output: OutputSelector = None
) -> NTKMethod:
    """The concrete method ``gram`` would use for ``model`` at points x (AUTO resolved).

    Decided from probe forwards on the first points of x (:func:`explain_method` says, per
    parameter, which path and why); the model's buffers and modes are left as they were.

    Raises:
        UnsupportedModelError: ``structured`` / ``per_layer`` forced on a model they cannot handle.
    """
    return explain_method(model, x, method, output=output)[0]


def explain_method(
    model: nn.Module, x: torch.Tensor, method: str | NTKMethod = "auto", *, output: OutputSelector = None
) -> tuple[NTKMethod, dict[str, tuple[str, str]]]:
    """``(method, routes)``: the method ``gram`` uses and, per trainable parameter, its path
    ("structured" | "per_layer" | "jacobian" | "batch") and the reason, e.g.
    ``{"0.weight": ("jacobian", "parameter 0.weight is used 2 times per forward (shared or tied)")}``.
    ``output`` selects the output to measure, as in :func:`gram`.

    Raises:
        UnsupportedModelError: ``structured`` / ``per_layer`` forced on a model they cannot handle,
            or a random forward (dropout in train mode).
    """
    route = resolve_route(model, x, method, output=output)
    return route.method, route.routes


@autograd_on
def resolve_route(
    model: nn.Module, x: torch.Tensor, method: str | NTKMethod = "auto", *, output: OutputSelector = None
) -> NTKRoute:
    """The :class:`NTKRoute` of ``model``: one probe of its forward pass on the first points of x
    (as :func:`explain_method`), kept so that :func:`gram` and the block features given it as
    ``method`` never probe again.  ``output`` as in :func:`gram` (pass the same one to both).

    Raises:
        UnsupportedModelError: as :func:`explain_method`.
    """
    m = parse_enum(NTKMethod, method, "method")
    model = prepare_model(model, None, output)
    x = prepare_inputs(model, x, "x", None)
    with blame(model):
        refuse_state_writes(model, x)  # as gram: a route of a forward that changes state is not one
    with preserved(model), blame(model):
        output_dim(model, x)  # as gram: a dict or tuple output without `output=` is named, with its keys
    plan = _plan(model, x)
    return NTKRoute.of(_choose(plan, m), plan, m, model)


def route_of(model: nn.Module, x: torch.Tensor, method: str | NTKMethod | NTKRoute) -> tuple[ForwardPlan, NTKMethod]:
    """The probe's plan of the measured ``model`` at points x and the method to take: a resolved
    :class:`NTKRoute` bound to the model by name (no forward pass) while the model is in the
    training modes it was probed in, else a probe on x and the method chosen from it — the route's
    asked-for one — by :func:`explain_method`'s rule.  Call it inside ``preserved(model)``.

    Raises:
        ValueError: an :class:`NTKRoute` resolved for another network.
    """
    if isinstance(method, NTKRoute):
        bound = method.bind(model)
        if method.holds_for(model):
            return bound, method.method
        method = method.asked  # modes switched since the probe (e.g. train-mode batch norm): probe again
    plan = _plan(model, x)
    return plan, _choose(plan, parse_enum(NTKMethod, method, "method"))


def _plan(model: nn.Module, x: torch.Tensor) -> ForwardPlan:
    with blame(model):
        return plan_forward(model, x)


def _choose(plan: ForwardPlan, m: NTKMethod) -> NTKMethod:
    """The method for a plan: AUTO → the fastest exact one; a forced one checked against the plan."""
    if plan.coupled:
        if m in (NTKMethod.STRUCTURED, NTKMethod.PER_LAYER):
            raise UnsupportedModelError(
                f"method={m.value!r} needs samples that do not interact, but "
                f"{next(iter(plan.routes.values()))[1]}; use method='auto'"
            )
        return NTKMethod.BATCH
    if m is NTKMethod.BATCH:
        return m
    if m is NTKMethod.STRUCTURED:
        why = not_structured_reason(plan)
        if why is not None:
            raise UnsupportedModelError(f"method='structured' does not apply: {why} (use method='auto')")
        return m
    if m is NTKMethod.JACOBIAN:
        return m
    if m is NTKMethod.PER_LAYER:
        if not plan.layers:
            raise UnsupportedModelError(
                "method='per_layer' found no layer with a per-layer formula; routes: "
                + "; ".join(f"{k}: {w}" for k, (_, w) in list(plan.routes.items())[:3])
            )
        return m
    if plan.all_factored:
        return NTKMethod.STRUCTURED
    return NTKMethod.PER_LAYER if plan.layers else NTKMethod.JACOBIAN


def _setup(
    model: nn.Module,
    x1: torch.Tensor,
    x2: torch.Tensor | None,
    dtype: torch.dtype | None,
    output: OutputSelector = None,
):
    model = prepare_model(model, dtype, output)
    x1 = prepare_inputs(model, x1, "x1", dtype)
    if x2 is not None:
        x2 = prepare_inputs(model, x2, "x2", dtype)
        if x2.shape[1:] != x1.shape[1:]:
            raise ShapeError(
                f"x1 and x2 must have the same input dimension d (point shape); got x1 {tuple(x1.shape)} "
                f"and x2 {tuple(x2.shape)}"
            )
    with blame(model):
        # the operators' and the Hessian's policy for every route: no in-place state (a train-mode
        # spectral_norm), no parameter registered by a forward — even where two forwards agree; on
        # every point measured (a state write or a held parameter of some points only)
        refuse_state_writes(model, x1 if x2 is None else torch.cat([x1, x2]))
    with preserved(model), blame(model):
        K = output_dim(model, x1)
        # x2's outputs too: a one-point x1 takes all of its outputs as K, and a (n, T, C) model then met
        # autograd's raw shape error on an x2 of several points (an audit)
        if x2 is not None and output_dim(model, x2) != K:
            raise ShapeError(
                f"the model's outputs at x1 and at x2 differ in size: {K} per point at x1 {tuple(x1.shape)}, "
                f"{output_dim(model, x2)} at x2 {tuple(x2.shape)}"
            )
        return model, x1, x2, K


@autograd_on
def gram(
    model: nn.Module,
    x1: torch.Tensor,
    x2: torch.Tensor | None = None,
    *,
    method: str | NTKMethod | NTKRoute = "auto",
    kernel: str | Kernel = "trace",
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    output: OutputSelector = None,
) -> torch.Tensor:
    """The empirical NTK Gramian ``G(i, j) = ∇_θ f(x1_i) · ∇_θ f(x2_j)`` (NSA Eq. 3, G_t = A_tᵀ A_t).

    Args:
        model: any module mapping (n, …) → (n,) or (n, K); the kernel is over its parameters
            with ``requires_grad``.
        x1: (N1, d) points, or (N1, …) such as images (N1, C, H, W).
        x2: (N2, …) points of the same point shape, or None for the symmetric Gramian at x1
            (upper tiles computed once).
        method: "auto" | "structured" | "per_layer" | "jacobian" (see :class:`NTKMethod`), probed
            on x1's first points at every call (and x2 checked for a forward that decides over
            its batch); or an :class:`NTKRoute` of this network (:func:`resolve_route`), taken as it
            is: no probe — resolve it on the points it is used at (a forward deciding over its
            batch, ``if x.max() > 1``, decides otherwise on other points).
        kernel: "trace" → (N1, N2), Σ_a ∇f_a·∇f_a (the Gramian itself when K = 1);
            "full" → (N1, K, N2, K).
        block_size: points per block (bounds memory); the result does not depend on it.
            Default: 768 (N/4 for small N) for structured, about 256 MB of Jacobian for jacobian.
        dtype: compute dtype (e.g. torch.float64 for reference checks); default the model's.
        out: a contiguous tensor of the result's shape, dtype and device to write the Gramian
            into (its contents are overwritten), e.g. one buffer reused at every recorded step:
            fresh (10⁴)² float32 pages cost their first touch, and a caller can hand them in
            NumPy's huge pages (:class:`nsa_dist.linalg.HostWorkspace`).  The structured method
            writes it directly; the others copy their result into it.
        output: which output to measure when the model returns a dict, a tuple or a Hugging Face
            ``ModelOutput``: a key, an index, or a callable ``output -> tensor``
            (:data:`nsa_dist.models.OutputSelector`; the parameters are then named
            ``model.<name>``).  A ``torch.compile``'d model is measured through the module it wraps.

    Returns:
        The Gramian on the model's device, in ``dtype`` (``out`` itself when given).

    Raises:
        ShapeError: x1/x2 not (n, …), differing point shapes, or a model output not (n,) / (n, K).
        NonFiniteError: NaN/inf in x1 or x2, or in the model's outputs at the probe points.
        UnsupportedModelError: ``method="structured"`` / ``"per_layer"`` on a model outside its reach.
        ValueError: an unknown method or kernel, an :class:`NTKRoute` of another network, a block_size < 1,
            an ``out`` of the wrong shape,
            dtype or device, or not contiguous.
    """
    full = parse_enum(Kernel, kernel, "kernel") is Kernel.FULL
    if not isinstance(method, NTKRoute):
        parse_enum(NTKMethod, method, "method")
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    given = model  # said once per model given: a dtype's cast copy is a new object at every call
    model, x1, x2, K = _setup(model, x1, x2, dtype, output)
    if out is not None:
        _check_out(out, model, x1, x2, K, full)
    with preserved(model):
        plan, m = route_of(model, x1, method)
        with blame(model):
            # autograd's gradients the derivative on every point (a hook or a gradient reversal on some points
            # only), whatever the route — one given (NTKRoute) is not probed; after the probe, whose
            # randomness and coupling errors come first (the operator's `couples` tests every point)
            refuse_false_gradients(model, x1[:0], x1)  # (the probe tested its own points)
            if x2 is not None:
                refuse_false_gradients(model, x2[:0], x2, "x2's points")
        if m is NTKMethod.BATCH and _first_time(given):
            # the route's reason already reads "the model couples samples (…): the kernel of the batch forward"
            _log.info("%s, computed exactly (full-batch Jacobian)", next(iter(plan.routes.values()))[1])
        # a probe on x1 saw x1's batches only: x2's forward may decide over its batch.  A route given
        # (NTKRoute) is the caller's, for the points it was resolved for (the pipeline resolves the
        # test points' own once: SpectralAnalyzer.test_route)
        probed = not isinstance(method, NTKRoute)
        why = batch_decides(model, x2) if probed and x2 is not None and m is not NTKMethod.BATCH else None
        if why is not None:
            _log.info("the model's forward decides over its batch of x2 (%s): the full-batch Jacobian", why)
            m = NTKMethod.BATCH
        try:
            with blame(model):
                G = _gram(model, plan, m, x1, x2, K, full, block_size, out)
        except Unproven as e:  # a feature pass saw an in-place change the probe did not: exact path
            _log.info("per-layer NTK not proven for these points (%s): per-sample Jacobians instead", e)
            with blame(model):
                G = _gram(model, plan, NTKMethod.JACOBIAN, x1, x2, K, full, block_size)
    return out.copy_(G) if out is not None and G is not out else G


def _check_out(
    out: torch.Tensor, model: nn.Module, x1: torch.Tensor, x2: torch.Tensor | None, K: int, full: bool
) -> None:
    """ValueError unless ``out`` can hold the Gramian as the computation makes it (the prepared
    model's dtype, the points' device)."""
    n1, n2 = x1.shape[0], (x1 if x2 is None else x2).shape[0]
    shape = (n1, K, n2, K) if full else (n1, n2)
    dtype = next(model.parameters()).dtype
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != x1.device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous tensor of shape {shape}, dtype {dtype} on {x1.device}; got "
            f"shape {tuple(out.shape)}, dtype {out.dtype} on {out.device}"
            + ("" if out.is_contiguous() else ", not contiguous")
        )


def _gram(
    model: nn.Module,
    plan: ForwardPlan,
    m: NTKMethod,
    x1: torch.Tensor,
    x2: torch.Tensor | None,
    K: int,
    full: bool,
    block_size: int | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    n = x1.shape[0]
    if m is NTKMethod.STRUCTURED:
        return structured_gram(
            model, structured_layers(plan), x1, x2, K, full, block_size or _structured_tile(n), out=out
        )
    if m is NTKMethod.PER_LAYER:
        return per_layer_gram(
            model, per_layer_layers(plan), plan.generic, x1, x2, K, full, block_size or _structured_tile(n)
        )
    P = sum(p.numel() for p in trainable_params(model).values())
    block = block_size or default_block(n, K * P, x1.element_size() if x1.is_floating_point() else 4, 256e6)
    if m is NTKMethod.BATCH:
        return batch_jacobian_gram(stateless(model, x1), x1, x2, K, full, block)
    return jacobian_gram(model, x1, x2, K, full, block)


@autograd_on
def ntk_operator(
    model: nn.Module,
    x: torch.Tensor,
    *,
    kernel: str | Kernel = "trace",
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    output: OutputSelector = None,
) -> NTKOperator:
    """Matrix-free NTK Gramian at x: ``v ↦ G v`` via one VJP and one JVP pass over the data.

    For Lanczos when G (N×N) does not fit in memory.  The operator's ``matmat`` takes (N, m)
    numpy arrays or torch tensors and returns the same type.

    Args:
        model: any module mapping (n, …) → (n,) or (n, K).
        x: (N, d) or (N, …) points.
        kernel: "trace" (an (N, N) operator) or "full" ((N·K, N·K), vectors laid out (N, K)).
        block_size: points per VJP/JVP block (default: about 64 MB of activations).
        dtype: compute dtype; default the model's.
        output: the output to measure, as in :func:`gram`.
    """
    full = parse_enum(Kernel, kernel, "kernel") is Kernel.FULL
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    model, x, _, K = _setup(model, x, None, dtype, output)
    width = max((p.shape[0] if p.ndim else 1) for p in model.parameters())
    return NTKOperator(model, x, K, full, block_size or default_block(x.shape[0], 8 * width, x.element_size()))
