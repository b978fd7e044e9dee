"""What the forward pass actually does: which parameter may take which NTK path (private).

The per-layer formulas (structured factors of a Linear layer, formed per-sample gradients of a
convolution, an embedding or a norm's affine parameters) hold for a parameter only when

1. it belongs to a layer of a known kind whose forward is the standard one,
2. that layer is called exactly once per forward and the parameter is used exactly once in the
   autograd graph (tied or shared weights are used twice),
3. the layer's input is not modified in place after the call (its version counter shows it);
   an output modified in place (``ReLU(inplace=True)``, ``out += identity``) is cloned by the
   feature pass instead, so the output gradient is still the layer's own,
4. the model does not couple samples: its outputs for half a batch equal those of the whole batch.

:func:`plan_forward` runs three probe forwards on a few points and returns a :class:`ForwardPlan`
saying, per parameter, the path and why.  Parameters outside the rules go through per-sample
Jacobians (exact for any module); a coupling model goes through the full-batch Jacobian.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.ntk._attention import attention_ok, attention_call_ok
from nsa_dist.ntk.inputs import as_2d, trainable_params
from nsa_dist.ntk.state import batch_stat_modules, preserved

__all__ = ["Route", "FastLayer", "ForwardPlan", "plan_forward", "couples"]

_PROBE_POINTS = 4


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
        return getattr(self.module, "weight_scale", 1.0) if "weight" in self.params else None

    @property
    def b(self) -> float | None:
        return getattr(self.module, "bias_scale", 1.0) if "bias" in self.params else None


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

    @property
    def any_fast(self) -> bool:
        return not self.coupled and bool(self.layers)


def _standard(m: nn.Module) -> bool:
    """A layer of a kind whose per-sample gradient is a function of its own input and output gradient only."""
    from nsa_dist.models import NTKLinear

    kinds = [nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.LayerNorm, nn.GroupNorm,
             nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d] + ([nn.RMSNorm] if hasattr(nn, "RMSNorm") else [])
    if type(m).forward is NTKLinear.forward:
        return True
    if isinstance(m, nn.Embedding) and m.max_norm is not None:
        return False  # renormalises its weight in place during the forward
    return any(isinstance(m, k) and type(m).forward is k.forward for k in kinds)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    tol = 1e-9 if a.dtype == torch.float64 else 1e-4
    return a.shape == b.shape and bool(((a - b).abs().max() <= tol * a.abs().max().clamp_min(1.0)).item())


def _couples(model: nn.Module, x: torch.Tensor) -> str | None:
    """Why the model couples samples (None if it does not); UnsupportedModelError if its forward is random."""
    with torch.no_grad():
        whole = as_2d(model(x))
        again = as_2d(model(x))
        if not _close(whole, again):
            drop = [n for n, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training]
            raise UnsupportedModelError("the model's forward is random (two forwards of the same points differ"
                                        + (f"; dropout in train mode: {', '.join(repr(d) for d in drop)}" if drop else "")
                                        + "): its NTK is not defined; call model.eval() (or disable the randomness)")
        if x.shape[0] < 2:
            return None
        h = x.shape[0] // 2
        try:
            parts = torch.cat([as_2d(model(x[:h])), as_2d(model(x[h:]))])
        except Exception as e:  # a forward that cannot run on fewer points depends on the batch
            return f"its forward fails on a smaller batch ({type(e).__name__})"
    if _close(whole, parts):
        return None
    bn = batch_stat_modules(model)
    return ("batch statistics in " + ", ".join(bn) if bn else
            "its outputs for half a batch differ from those of the whole batch")


def couples(model: nn.Module, x: torch.Tensor) -> str | None:
    """Why the model couples samples, probed on the first points of x (None: it does not); the
    model's buffers and modes are unchanged afterwards."""
    with preserved(model), _rng_kept(x):
        return _couples(model, x[:_PROBE_POINTS])


def _rng_kept(x: torch.Tensor):
    """The global RNG state is the same after the probes (a random forward draws from it)."""
    return torch.random.fork_rng(devices=[x.device.index or 0] if x.device.type == "cuda" else [])


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


def plan_forward(model: nn.Module, x: torch.Tensor) -> ForwardPlan:
    """Decide each trainable parameter's NTK path from probe forwards on the first few points of x.

    The model's buffers and training modes are unchanged afterwards.

    Raises:
        UnsupportedModelError: the forward is random (dropout in train mode).
    """
    params = trainable_params(model)
    xs = x[:_PROBE_POINTS]
    with preserved(model), _rng_kept(xs):
        coupling = _couples(model, xs)
        if coupling is not None:
            why = f"the model couples samples ({coupling}): the kernel of the batch forward"
            return ForwardPlan(True, (), tuple(params), {n: (Route.BATCH, why) for n in params})
        return _plan_layers(model, xs, params)


def _plan_layers(model: nn.Module, xs: torch.Tensor, params: dict[str, torch.Tensor]) -> ForwardPlan:
    owner = {}  # id(param) → (module name, module, local name)
    for mname, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            owner.setdefault(id(p), (mname, m, pname))
    attention = {mname for mname, m in model.named_modules()
                 if attention_ok(m) and any(p.requires_grad for p in m.parameters())}
    cands = {mname: m for mname, m in model.named_modules()
             if mname in attention or (any(p.requires_grad for p in m.parameters(recurse=False)) and _standard(m))}
    cands = {n: m for n, m in cands.items() if n.rpartition(".")[0] not in attention}  # out_proj goes with its attention
    calls: dict[str, list] = {n: [] for n in cands}

    def hook(name):
        def f(mod, args, kwargs, out):
            a = args[0] if args else kwargs.get("query", kwargs.get("input"))
            z = out[0] if name in attention and isinstance(out, tuple) else out
            why = attention_call_ok(mod, args, kwargs, out) if name in attention else None
            calls[name].append((a, a._version if isinstance(a, torch.Tensor) else None, z,
                                z._version if isinstance(z, torch.Tensor) else None, why))
        return f

    handles = [m.register_forward_hook(hook(n), with_kwargs=True) for n, m in cands.items()]
    try:
        with torch.enable_grad():
            out = as_2d(model(xs))
    finally:
        for h in handles:
            h.remove()
    uses = _uses(out)
    routes: dict[str, tuple[str, str]] = {}
    layers: list[FastLayer] = []
    for mname, m in cands.items():
        local = tuple(pn for pn, p in m.named_parameters(recurse=mname in attention) if p.requires_grad)
        seen = calls[mname]
        why = None
        if len(seen) != 1:
            why = f"module {mname!r} is called {len(seen)} times per forward"
        else:
            a, va, z, vz, why = seen[0]
            why = f"{type(m).__name__} ({mname!r}): {why}" if why else None
            shared = [pn for pn in local if uses.get(id(m.get_parameter(pn)), 0) != 1]
            if why is None and shared:
                pn = shared[0]
                why = (f"parameter {mname}.{pn} is used {uses.get(id(m.get_parameter(pn)), 0)} times per forward "
                       "(shared or tied)")
            elif why is None and (not isinstance(a, torch.Tensor) or not isinstance(z, torch.Tensor)):
                why = f"module {mname!r} does not map one tensor to one tensor"
            elif why is None and a._version != va:
                why = f"the input of {mname!r} is modified in place after the call"
        names = [f"{mname}.{pn}" if mname else pn for pn in local]
        if why is not None:
            for n in names:
                routes[n] = (Route.JACOBIAN, why)
            continue
        a, _, z, vz, _ = seen[0]
        factored = isinstance(m, nn.Linear) and a.ndim == 2
        clone = z._version != vz
        path = Route.STRUCTURED if factored else Route.PER_LAYER
        note = f"{type(m).__name__} used once" + ("; its output is modified in place (cloned)" if clone else "")
        if mname in attention:
            if clone:
                for n in names:
                    routes[n] = (Route.JACOBIAN, f"the output of {mname!r} is modified in place")
                continue
            note += " as unmasked self-attention: its projections as Linear layers at every position"
        for n in names:
            routes[n] = (path, note)
        layers.append(FastLayer(mname, m, local, factored, clone))
    for n in params:
        if n not in routes:
            mname, m, _ = owner[id(params[n])]
            routes[n] = (Route.JACOBIAN, f"{type(m).__name__} ({mname!r}) has no per-layer formula")
    order = list(params)
    generic = tuple(n for n in order if routes[n][0] == Route.JACOBIAN)
    return ForwardPlan(False, tuple(layers), generic, {n: routes[n] for n in order})
