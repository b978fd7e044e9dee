"""Fully-connected networks built from a :class:`~nsa_dist.config.ModelSpec`."""

from __future__ import annotations

import copy
import functools
import logging
import math
import sys
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from nsa_dist.config import Activation, FactoryModelSpec, Init, ModelSpec
from nsa_dist.errors import ModelFactoryError, ShapeError, UnsupportedModelError

__all__ = [
    "CNN",
    "FCNet",
    "NTKLinear",
    "OutputSelector",
    "SelectedOutput",
    "normalized_softplus",
    "build_factory_model",
    "build_model",
    "cnn",
    "describe_output",
    "measured_module",
    "not_a_tensor",
    "user_named_modules",
    "copy_model",
    "copied_from",
    "resolve_factory",
    "select_output",
]


class NTKLinear(nn.Linear):
    """Linear layer in the NTK parametrisation: ``z = W a / sqrt(n_in) + beta * b``.

    The parameters are W ~ N(0, 1) and b ~ N(0, 1); the scales live in ``weight_scale`` and
    ``bias_scale``, which the structured NTK reads (its share of G is
    ``(w² A Aᵀ + β²) ⊙ (Δ Δᵀ)``).
    """

    def __init__(self, in_features: int, out_features: int, beta: float = 0.1) -> None:
        super().__init__(in_features, out_features, bias=True)
        self.weight_scale = 1.0 / math.sqrt(in_features)
        self.bias_scale = float(beta)
        nn.init.normal_(self.weight)
        nn.init.normal_(self.bias)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(a, self.weight * self.weight_scale, self.bias * self.bias_scale)


def _activation(spec: ModelSpec) -> nn.Module:
    act = Activation(spec.activation)
    if act is Activation.LEAKY_RELU:
        return nn.LeakyReLU(spec.negative_slope)
    if act is Activation.ERF:
        return _Erf()
    if act is Activation.ATAN:
        return _Atan()
    if act is Activation.SOFTPLUS_NORMALIZED:
        return _NormalizedSoftplus()
    return {
        Activation.RELU: nn.ReLU,
        Activation.TANH: nn.Tanh,
        Activation.SOFTPLUS: nn.Softplus,
        Activation.GELU: nn.GELU,
    }[act]()


class _Erf(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.erf(z)


class _Atan(nn.Module):
    """σ(z) = arctan z (the Hessian paper's Fig. 1)."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.atan(z)


def _gauss_moments(phi, n: int = 200) -> tuple[float, float]:
    """(E φ(z), E φ(z)²) for z ~ N(0, 1) by n-node Gauss–Hermite quadrature (float64)."""
    import numpy as np

    z, w = np.polynomial.hermite_e.hermegauss(n)
    w = w / w.sum()
    v = phi(torch.tensor(z, dtype=torch.float64)).numpy()
    return float(w @ v), float(w @ v**2)


_SP_MEAN, _SP_SQ = _gauss_moments(nn.functional.softplus)
SOFTPLUS_SHIFT = _SP_MEAN  # a = E softplus(z) ≈ 0.8063 for z ~ N(0, 1)
SOFTPLUS_SCALE = math.sqrt(_SP_SQ - _SP_MEAN**2)  # b = std softplus(z) ≈ 0.5542


def normalized_softplus(z: torch.Tensor) -> torch.Tensor:
    """σ(z) = (softplus(z) − a) / b with a, b the mean and standard deviation of softplus(z), z ~ N(0, 1).

    The Hessian paper names a "normalized smooth ReLU" (Fig. 1) without defining it; this is the
    normalisation that makes E σ(z) = 0 and E σ(z)² = 1 under the standard Gaussian pre-activations
    of the first layer (docs/design-notes.md).  σ′(z) = sigmoid(z) / b.
    """
    return (nn.functional.softplus(z) - SOFTPLUS_SHIFT) / SOFTPLUS_SCALE


class _NormalizedSoftplus(nn.Module):
    """:func:`normalized_softplus`."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return normalized_softplus(z)


class FCNet(nn.Module):
    """``f(x) = W_L σ(… σ(W_1 x + b_1) …) + b_L`` with optional residual hidden layers.

    Args:
        layers: the Linear layers, first to last.
        act: the nonlinearity σ applied after every layer but the last.
        residual: if True, a hidden layer whose input and output widths match computes
            ``h + σ(W h + b)`` instead of ``σ(W h + b)``.
        squeeze: return (n,) instead of (n, 1) for a scalar output.
    """

    def __init__(self, layers: list[nn.Linear], act: nn.Module, residual: bool = False, squeeze: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.act = act
        self.residual = residual
        self.squeeze = squeeze

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x  # (n, d)
        for layer in self.layers[:-1]:
            z = self.act(layer(h))  # (n, width)
            h = h + z if self.residual and z.shape == h.shape else z
        out = self.layers[-1](h)  # (n, K)
        return out.squeeze(-1) if self.squeeze and out.shape[-1] == 1 else out


def build_model(
    spec: ModelSpec | FactoryModelSpec, *, seed: int | None = None, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Build the network that ``spec`` describes (a :class:`FactoryModelSpec`: see :func:`build_factory_model`).

    Args:
        spec: depth, width, activation, init, residual, input/output dimensions.
        seed: if given, the parameters are drawn from ``torch.Generator().manual_seed(seed)``
            semantics via a forked RNG, so the global RNG state is left untouched.
        dtype: parameter dtype (float32 for training, float64 for reference checks).

    ``regime="active"`` divides the output by √width (the last layer's scales; the trainer
    multiplies the learning rate by width, :meth:`ExperimentSpec.lr_at`).

    Returns:
        FCNet mapping (n, d) → (n,) when K = 1, else (n, K).
    """
    if isinstance(spec, FactoryModelSpec):
        return build_factory_model(spec, seed=seed, dtype=dtype)
    dims = [spec.input_dim] + [spec.width] * (spec.depth - 1) + [spec.output_dim]
    with torch.random.fork_rng(enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        layers = [_linear(spec, n_in, n_out) for n_in, n_out in zip(dims[:-1], dims[1:])]
    if spec.regime == "active":  # the Hessian paper's active regime: f / √w, exactly (the scales the NTK reads)
        last = layers[-1]
        last.weight_scale /= math.sqrt(spec.width)
        last.bias_scale /= math.sqrt(spec.width)
    model = FCNet(layers, _activation(spec), residual=spec.residual)
    return model.to(dtype)


def _linear(spec: ModelSpec, n_in: int, n_out: int) -> nn.Linear:
    if Init(spec.init) is Init.NTK:
        return NTKLinear(n_in, n_out, beta=spec.bias_scale)
    layer = nn.Linear(n_in, n_out)
    nn.init.xavier_uniform_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


# --------------------------------------------------------------------------- convolutional nets


class CNN(nn.Module):
    """``conv → σ → avg-pool`` per entry of ``channels``, flatten, ``Linear → σ`` per hidden width, ``Linear``.

    Every convolution is k×k with 'same' zero padding; pooling is ``pool × pool`` average
    pooling (no parameters), so the NTK's per-layer path (Conv2d + Linear) applies.
    Inputs: (n, C, H, W) images or the same flattened to (n, C·H·W) (as the CIFAR loader yields).
    """

    def __init__(
        self,
        input_shape: tuple[int, int, int],
        convs: list[nn.Conv2d],
        linears: list[nn.Linear],
        act: nn.Module,
        pool: int,
        squeeze: bool = True,
    ) -> None:
        super().__init__()
        self.input_shape = tuple(input_shape)
        self.convs, self.linears = nn.ModuleList(convs), nn.ModuleList(linears)
        self.act, self.pool, self.squeeze = act, nn.AvgPool2d(pool) if pool > 1 else nn.Identity(), squeeze

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape((x.shape[0],) + self.input_shape)  # (n, C, H, W)
        for conv in self.convs:
            h = self.pool(self.act(conv(h)))  # (n, C_l, H / pool^l, W / pool^l)
        h = h.flatten(1)  # (n, C_L·H_L·W_L)
        for lin in self.linears[:-1]:
            h = self.act(lin(h))  # (n, hidden)
        out = self.linears[-1](h)  # (n, K)
        return out.squeeze(-1) if self.squeeze and out.shape[-1] == 1 else out


def cnn(
    in_channels: int = 3,
    image_size: int = 32,
    channels: tuple[int, ...] | list[int] = (16, 32),
    hidden: tuple[int, ...] | list[int] = (128,),
    output_dim: int = 1,
    kernel_size: int = 3,
    activation: str = "relu",
    pool: int = 2,
) -> CNN:
    """A small CNN for (n, C, H, W) images — a model factory (``model: {factory: "nsa_dist.models:cnn"}``).

    Args:
        in_channels, image_size: C and H = W of the inputs.
        channels: output channels of the convolutions, first to last.
        hidden: widths of the Linear hidden layers after flattening.
        output_dim: K (the model returns (n,) for K = 1).
        kernel_size: odd k of the k×k convolutions.
        activation: one of :class:`~nsa_dist.config.Activation`'s values.
        pool: average-pooling factor after each convolution (1: none).

    Raises:
        ValueError: an even kernel, or pooling that shrinks the image below one pixel.
    """
    if kernel_size % 2 != 1:
        raise ValueError(f"cnn: kernel_size must be odd ('same' padding), got {kernel_size}")
    side = image_size // (pool ** len(channels))
    if side < 1:
        raise ValueError(f"cnn: image_size={image_size} pooled by {pool} {len(channels)} times leaves no pixels")
    chans = [in_channels] + list(channels)
    convs = [nn.Conv2d(a, b, kernel_size, padding=kernel_size // 2) for a, b in zip(chans[:-1], chans[1:])]
    dims = [chans[-1] * side * side] + list(hidden) + [output_dim]
    linears = [nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])]
    act = _activation(ModelSpec(activation=Activation(activation)))
    return CNN((in_channels, image_size, image_size), convs, linears, act, pool)


# --------------------------------------------------------------------------- models by import path

_SHIP_HINT = (
    "the package must be importable on the driver and on every Ray worker: install it in the cluster's "
    "image, or ship it with the job's runtime_env (py_modules / working_dir; see deploy/README.md)"
)


def resolve_factory(path: str) -> Callable[..., nn.Module]:
    """The callable at import path ``"package.module:attr"`` (attr may be dotted).

    Raises:
        ModelFactoryError: the module cannot be imported, lacks the attribute, or it is not callable;
            the message names the path and says the package must be importable on every worker.
    """
    import importlib

    module, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise ModelFactoryError(
            f"model.factory={path!r}: cannot import module {module!r} ({exc}); {_SHIP_HINT}"
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelFactoryError(
                f"model.factory={path!r}: module {module!r} has no attribute {attr!r}; {_SHIP_HINT}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelFactoryError(
            f"model.factory={path!r} is a {type(obj).__name__}, not a callable returning an nn.Module"
        )
    return obj


def build_factory_model(
    spec: FactoryModelSpec, *, seed: int | None = None, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """``factory(**kwargs)`` under a forked RNG seeded with ``seed`` (deterministic, global RNG untouched);
    with ``spec.output`` set, the :class:`SelectedOutput` of that output (a compiled model: the
    module it wraps, :func:`measured_module`).

    Raises:
        ModelFactoryError: the import path does not resolve, the call fails or returns no nn.Module,
            or the spec is a Tracker's (its model is not rebuilt from the spec).
    """
    if spec.source == "tracker":
        raise ModelFactoryError(
            f"this run's model ({spec.factory}) was handed to a Tracker; it is not rebuilt from "
            "the spec — pass the model to Tracker again"
        )
    fn = resolve_factory(spec.factory)
    with torch.random.fork_rng(enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        try:
            model = fn(**spec.kwargs)
        except TypeError as exc:
            raise ModelFactoryError(f"model.factory={spec.factory!r} called with kwargs {spec.kwargs}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ModelFactoryError(f"model.factory={spec.factory!r} returned a {type(model).__name__}, not an nn.Module")
    model = measured_module(model, spec.output).to(dtype)
    if spec.input_dim is not None and _check_factory_output(spec, model, dtype):
        # one column (n, 1), measured as the (n,) it means, as the Tracker does (the run stored f, df,
        # … as (N, 1) against its (N,) schema and failed at step 0)
        model = SelectedOutput(model, single_column)
    return model


def _check_factory_output(spec: FactoryModelSpec, model: nn.Module, dtype: torch.dtype) -> bool:
    """The model must map the data's (n, d) inputs to (n,) for K = 1 or (n, K); whether it returns
    one column (n, 1) for K = 1."""
    x = torch.zeros(2, spec.input_dim, dtype=dtype)
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's forward on the data's shape
        raise ModelFactoryError(
            f"model.factory={spec.factory!r} ({spec.kwargs}) fails on the data's inputs of "
            f"shape (n, {spec.input_dim}): {type(exc).__name__}: {exc}"
        ) from exc
    K = spec.output_dim
    want = (2,) if K == 1 else (2, K)
    if not isinstance(out, torch.Tensor):
        raise ModelFactoryError(
            f"model.factory={spec.factory!r} ({spec.kwargs}): {not_a_tensor(out)} (in a spec: "
            "model.output, a key or an index)"
        )
    if tuple(out.shape) != want and not (K == 1 and tuple(out.shape) == (2, 1)):
        raise ModelFactoryError(
            f"model.factory={spec.factory!r} ({spec.kwargs}) returns {tuple(out.shape)} for "
            f"inputs (2, {spec.input_dim}); the targets need {want} (K = {K})"
        )
    return K == 1 and tuple(out.shape) == (2, 1)


# --------------------------------------------------------------------------- outputs as models return them

_log = logging.getLogger("nsa_dist")
_compiled_said: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models whose compiled submodules were reported

OutputSelector = str | int | Callable[[Any], torch.Tensor] | None
"""Which output of a model to measure: None (the model returns the tensor), a key (a dict's or a
``ModelOutput``'s, or an attribute name), an index (a tuple's or a list's; the i-th value of a
dict / ``ModelOutput``, as ``ModelOutput[i]``), or a callable ``output -> tensor``."""


def describe_output(out: Any) -> str:
    """A model output's type in words, with its keys or items: "dict with keys ['logits', 'hidden']"."""
    name = type(out).__name__
    if isinstance(out, torch.Tensor):
        return f"Tensor of shape {tuple(out.shape)}"
    if isinstance(out, Mapping):
        return f"{name} with keys {list(out.keys())}"
    if isinstance(out, (tuple, list)):
        items = ", ".join(
            f"Tensor {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__ for v in out[:6]
        )
        return f"{name} of {len(out)} ({items}{', …' if len(out) > 6 else ''})"
    return name


def _check_selector(output: OutputSelector) -> None:
    """TypeError unless ``output`` is a selector: None, a key, an index or a callable."""
    if not (
        output is None
        or callable(output)
        or isinstance(output, str)
        or (isinstance(output, int) and not isinstance(output, bool))
    ):
        raise TypeError(f"output must be None, a key (str), an index (int) or a callable, got {type(output).__name__}")


def _selector_name(output: OutputSelector) -> str:
    if callable(output):
        return getattr(output, "__qualname__", None) or repr(output)
    return repr(output)


def select_output(out: Any, output: OutputSelector) -> torch.Tensor:
    """The tensor ``output`` selects from a model's output ``out`` (None: ``out`` itself).

    Raises:
        ShapeError: the key / index is not in ``out``, or what it selects is not a tensor (both
            named, with the output's type and keys).
        TypeError: ``output`` is none of None, str, int, callable.
    """
    if output is None:
        return out
    if callable(output):
        sel = output(out)
    elif isinstance(output, str):
        if isinstance(out, Mapping) and output in out:
            sel = out[output]
        elif not isinstance(out, Mapping) and hasattr(out, output):  # a named tuple's or a dataclass's field
            sel = getattr(out, output)
        else:
            raise ShapeError(f"output={output!r} is not a key of the model's output, a {describe_output(out)}")
    else:
        _check_selector(output)
        items = list(out.values()) if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else None
        if items is None or not -len(items) <= output < len(items):
            raise ShapeError(f"output={output} does not index the model's output, a {describe_output(out)}")
        sel = items[output]
    if not isinstance(sel, torch.Tensor):
        raise ShapeError(
            f"output={_selector_name(output)} selects a {describe_output(sel)} from the model's output "
            f"(a {describe_output(out)}), not a tensor"
        )
    return sel


def not_a_tensor(out: Any) -> str:
    """Why a model output that is not a tensor cannot be measured as it is, and what to pass."""
    hint = (
        "a key, e.g. output=" + repr(next(iter(out.keys())))
        if isinstance(out, Mapping) and len(out)
        else "an index, e.g. output=0"
        if isinstance(out, (tuple, list))
        else "a key or an index"
    )
    return (
        f"the model returns a {describe_output(out)}, not a tensor: say which output to measure with output= "
        f"{hint}, or a callable that returns the tensor"
    )


class SelectedOutput(nn.Module):
    """A model with one of its outputs selected: ``forward(*args) = select_output(model(*args), output)``.

    The model is the submodule ``model`` (its parameters are shared, named ``model.<name>``).
    """

    def __init__(self, model: nn.Module, output: OutputSelector) -> None:
        super().__init__()
        self.model = model
        self.__dict__["output"] = output  # a plain attribute: a selector that is a module adds no parameters

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return select_output(self.model(*args, **kwargs), self.output)

    def extra_repr(self) -> str:
        return f"output={_selector_name(self.output)}"


def user_named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``named_modules()`` of the module the user wrote: through the :class:`SelectedOutput` wrappers
    the measurements put around it, so that a message names ``'2'``, not ``'model.2'``."""
    while isinstance(model, SelectedOutput):
        model = model.model
    return model.named_modules()


def single_column(out: torch.Tensor) -> torch.Tensor:
    """The (n,) values of a one-column (n, 1) output (a selector: a model ending in
    ``nn.Linear(…, 1)`` is measured as the scalar function it is)."""
    return out[:, 0]


def measured_module(model: nn.Module, output: OutputSelector = None) -> nn.Module:
    """The module nsa-dist measures for a user's ``model`` (every entry point applies this once).

    * a ``torch.compile``'d model (``OptimizedModule``) is measured through the module it wraps
      (``_orig_mod``, the same parameters): the measurements run many forwards under hooks and
      ``torch.func`` transforms, each of which would make Dynamo recompile until its limit;
    * a ``DistributedDataParallel`` or ``DataParallel`` wrapper through its ``module`` (the same
      parameters): its forward is a collective (DDP broadcasts the buffers: a Tracker's probe on rank 0
      waited for a rank that never came) and its parameter names carry a ``module.`` prefix;
    * with ``output`` given, a :class:`SelectedOutput` of it.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``output`` is of no selector type.
        UnsupportedModelError: a TorchScript module (the module it was made from is measured).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):  # torch.func's stateless calls refuse it, deep inside
        raise UnsupportedModelError(
            f"model is a TorchScript module ({type(model).__name__}, from torch.jit.script / torch.jit.trace): "
            "its parameters cannot be swapped for the per-parameter derivatives every measurement takes; "
            "pass the Python module it was made from (it shares the parameters, so a loop may train either)"
        )
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    while isinstance(model, wrappers) or (dynamo is not None and isinstance(model, dynamo.OptimizedModule)):
        model = model._orig_mod if not isinstance(model, wrappers) else model.module
    if dynamo is not None and model not in _compiled_said:
        inner = [name for name, m in model.named_modules() if isinstance(m, dynamo.OptimizedModule)]
        if inner:
            _compiled_said.add(model)
            _log.warning(
                "submodule %s of %s is torch.compile'd: the measurements run its compiled forward under "
                "hooks and torch.func transforms, so Dynamo recompiles it (exact, but slow); pass the "
                "model with uncompiled submodules, or compile the whole model (a compiled model is "
                "measured through the module it wraps)",
                ", ".join(repr(n) for n in inner[:3]),
                type(model).__name__,
            )
    if output is None:
        return model
    _check_selector(output)
    return SelectedOutput(model, output)


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


_COPIED_FROM: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


# the parameters of each module nsa-dist copied, as the thread running it last saw them outside a functional
# call (at the copy; a Tracker's at each record), by weak reference: another thread — a Tracker's analysis —
# asks for them while the training thread may have temporaries swapped into the slots (functional_call)
_PARAMETERS_OF: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[str, weakref.ref], ...]] = weakref.WeakKeyDictionary()


def note_parameters(model: nn.Module) -> None:
    """Remember ``model``'s ``named_parameters()`` now (:func:`noted_parameters`): to be called by the thread
    that runs the model, outside any functional call of it — where one is under way (a slot holds a plain
    tensor, functional_call's temporary: a signal handler's hand-over inside the Tracker's own probe, or
    another thread's copy) the note before stands."""
    params = tuple(model.named_parameters())
    if all(isinstance(p, nn.Parameter) for _, p in params) or model not in _PARAMETERS_OF:
        _PARAMETERS_OF[model] = tuple((n, weakref.ref(p)) for n, p in params)


def noted_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``model``'s parameters as last noted (:func:`note_parameters`; at every :func:`copy_model` of it), the
    live ones — read without touching the module, which another thread may be running with temporaries
    swapped into its slots at this moment (a parameter freed since is held by nothing)."""
    return [(n, p) for n, r in _PARAMETERS_OF.get(model, ()) if (p := r()) is not None]


def copied_from(model: nn.Module) -> nn.Module | None:
    """The module :func:`copy_model` copied ``model`` from (None: not such a copy, or it is gone)."""
    return _COPIED_FROM.get(model)


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)`` whose hooks act on the copy.

    ``deepcopy`` copies a hook that is a bound method or a ``functools.partial`` with the module it
    holds, but a function is copied as itself: a hook written as a lambda or closure over the model
    (``self.h.register_forward_pre_hook(lambda m, i: (i[0] * self.g,))``, a LoRA adapter added by
    ``lambda m, i, o: o + self.B(self.A(i[0]))``) still read the *user's* modules from the copy's
    forward.  The copy's ``g`` was then never used — its Jacobian columns zero, the user's ``g`` a
    constant (an NTK 2 % off, status ``done``; a float32 model measured in float64 mixed dtypes) —
    and a network trained as a copy of the built one never trained ``g``.  Here such a hook is
    rebuilt on the copy — and so is a function kept on a module (``self.act = lambda z: … * self.alpha``):
    its closure cells and defaults that hold a piece of the model (a module, a
    parameter, a buffer — or a list, tuple or dict of them, or a ``partial`` over them) point at the
    copy's pieces; what else they hold is left as it is, and so are the globals it reads (a global
    ``model`` is the user's: a forward reading the model's parameters that way is refused by the
    measurement, :func:`nsa_dist.ntk.state.refuse_state_writes`).  The copy remembers its original
    (:func:`copied_from`)."""
    memo: dict[int, Any] = {}
    note_parameters(model)
    twin = copy.deepcopy(model, memo)
    for m in twin.modules():
        for name in _HOOK_DICTS:
            hooks = m.__dict__.get(name)
            for key, fn in list((hooks or {}).items()):
                new = _rebound(fn, memo, 0)
                if new is not fn:
                    hooks[key] = new
        for key, fn in list(m.__dict__.items()):  # a function kept on the module: `self.act = lambda z: … self.a`
            if isinstance(fn, types.FunctionType | functools.partial):
                new = _rebound(fn, memo, 0)
                if new is not fn:
                    m.__dict__[key] = new
    _COPIED_FROM[twin] = model
    return twin


def _rebound(fn: Any, memo: dict[int, Any], depth: int) -> Any:
    """``fn`` reading the copy's pieces of the model (``memo``: deepcopy's, original id → copy)."""
    if depth > 4:
        return fn
    if isinstance(fn, functools.partial):
        inner = _rebound(fn.func, memo, depth + 1)
        args = tuple(_piece(a, memo, depth) for a in fn.args)
        kw = {k: _piece(v, memo, depth) for k, v in fn.keywords.items()}
        same = inner is fn.func and all(a is b for a, b in zip(args, fn.args, strict=True))
        if same and all(kw[k] is fn.keywords[k] for k in kw):
            return fn
        return functools.partial(inner, *args, **kw)
    if not isinstance(fn, types.FunctionType):
        return fn  # a bound method or a callable object: deepcopy copied what it holds
    cells = []
    for c in fn.__closure__ or ():
        try:
            v = c.cell_contents
        except ValueError:  # an empty cell (a name assigned later in the enclosing function)
            cells.append(c)
            continue
        w = _piece(v, memo, depth)
        cells.append(types.CellType(w) if w is not v else c)
    defaults = tuple(_piece(v, memo, depth) for v in fn.__defaults__ or ())
    kwdefaults = {k: _piece(v, memo, depth) for k, v in (fn.__kwdefaults__ or {}).items()}
    changed = any(a is not b for a, b in zip(cells, fn.__closure__ or (), strict=True))
    changed |= any(a is not b for a, b in zip(defaults, fn.__defaults__ or (), strict=True))
    changed |= any(kwdefaults[k] is not v for k, v in (fn.__kwdefaults__ or {}).items())
    if not changed:
        return fn
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults or None, tuple(cells) or None)
    new.__kwdefaults__, new.__qualname__ = kwdefaults or None, fn.__qualname__
    new.__dict__.update(fn.__dict__)
    return new


def _piece(v: Any, memo: dict[int, Any], depth: int) -> Any:
    """The copy's counterpart of ``v`` when v is a piece of the model or holds one, else v itself."""
    if id(v) in memo and memo[id(v)] is not v:
        return memo[id(v)]
    if isinstance(v, types.FunctionType | functools.partial):
        return _rebound(v, memo, depth + 1)
    if depth < 4 and isinstance(v, list | tuple | dict):  # rebuilt only when an item is (or holds) a piece
        items = list(v.items()) if isinstance(v, dict) else list(enumerate(v))
        mapped = [(k, _piece(x, memo, depth + 1)) for k, x in items]
        if all(m is x for (_, m), (_, x) in zip(mapped, items, strict=True)):
            return v
        if isinstance(v, dict):
            return type(v)(mapped) if type(v) is dict else {k: m for k, m in mapped}
        return type(v)(m for _, m in mapped) if type(v) in (list, tuple) else [m for _, m in mapped]
    return v
