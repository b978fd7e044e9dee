"""Validated configuration models (pydantic, ``extra="forbid"``).

Configuration is data: it is read from YAML at the edge (CLI, services) and validated once
here.  A validation error names the field, the value given and what is allowed.
"""

from __future__ import annotations

import difflib
import math
import re
import reprlib
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "ID_NEUTRAL",
    "is_id_neutral",
    "Activation",
    "Init",
    "ModelSpec",
    "FactoryModelSpec",
    "DataName",
    "Target",
    "DataSpec",
    "OptimizerName",
    "OptimizerSpec",
    "LossName",
    "ScheduleSpec",
    "RecordSpec",
    "NTKMethod",
    "EigMethod",
    "Layout",
    "EnergyRoute",
    "QuadratureSpec",
    "SpectrumSpec",
    "HessianSpec",
    "ExperimentSpec",
    "ClusterSpec",
    "SweepSpec",
]


class Activation(str, Enum):
    """Hidden-layer nonlinearity σ."""

    LEAKY_RELU = "leaky_relu"
    RELU = "relu"
    TANH = "tanh"
    ERF = "erf"
    SOFTPLUS = "softplus"
    GELU = "gelu"
    ATAN = "atan"
    SOFTPLUS_NORMALIZED = "softplus_normalized"  # (softplus(z) − a) / b: E σ(z) = 0, E σ(z)² = 1 for z ~ N(0, 1)


class Init(str, Enum):
    """Parametrisation and initialisation of the Linear layers.

    XAVIER: standard layers ``z = W a + b``, W Xavier(Glorot)-uniform, b = 0 — the NSA paper.
    NTK: the Hessian paper's NTK parametrisation ``z = W a / sqrt(n_in) + beta * b`` with
    W, b ~ N(0, 1) — the parametrisation under which the NTK has a deterministic
    infinite-width limit.
    """

    XAVIER = "xavier"
    NTK = "ntk"


ID_NEUTRAL: dict[str, Any] = {"id_neutral": True}
"""``json_schema_extra`` of a field added after runs were stored: at its default it is left out of
the run id's hash (:func:`nsa_dist.pipeline.plan.id_json`), so every stored run keeps its id.  Mark
every new field so; the ids of specs written before it then never change."""


def is_id_neutral(field: Any) -> bool:
    """Whether a pydantic ``FieldInfo`` carries :data:`ID_NEUTRAL`."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("id_neutral"))


class _Strict(BaseModel):
    # allow_inf_nan=False: a YAML ``.inf`` / ``.nan`` in any number field is refused (an infinite
    # lr or bias scale trained to NaN with no word of the cause)
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, v: Any, info: ValidationInfo) -> Any:
        """A boolean where a number belongs is refused: YAML 1.1 reads ``yes``/``no``/``on``/``off``
        as booleans and pydantic would take True for 1 (``steps: yes`` ran one step)."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _bool_in_number(field.annotation, v):
            raise ValueError(
                "a boolean where a number belongs (YAML reads yes/no/on/off/true/false as booleans); write the number"
            )
        return v


def _bool_in_number(tp: Any, v: Any) -> bool:
    """Whether ``v`` is (or holds, in a list, tuple or dict) a bool where annotation ``tp`` takes a number."""
    import types
    import typing

    if get_origin(tp) is Annotated:
        return _bool_in_number(get_args(tp)[0], v)
    if isinstance(v, bool):
        if tp in (int, float):
            return True
        if get_origin(tp) in (typing.Union, types.UnionType):
            args = get_args(tp)
            return bool(set(args) & {int, float}) and bool not in args and Any not in args
        return False
    origin, args = get_origin(tp), get_args(tp)
    if get_origin(tp) in (typing.Union, types.UnionType):
        return any(_bool_in_number(a, v) for a in args if get_origin(a) in (list, tuple, dict))
    if origin in (list, tuple) and isinstance(v, (list, tuple)) and args:
        items = args if origin is tuple and Ellipsis not in args else args[:1] * len(v)
        return any(_bool_in_number(a, x) for a, x in zip(items, v))
    if origin is dict and isinstance(v, dict) and len(args) == 2:
        return any(_bool_in_number(args[1], x) for x in v.values())
    return False


def _stored(info: ValidationInfo) -> bool:
    """Whether a spec is read back from a store (``context={"stored": True}``): the checks of what a
    run cannot do are the author's, and a run stored before one was added stays readable."""
    return bool((info.context or {}).get("stored"))


class ModelSpec(_Strict):
    """A fully-connected network R^d → R^K.

    ``depth`` counts Linear layers (the NSA paper's "6 layers with 256 neurons", |θ| = 264,193,
    is ``depth=6, width=256``: 2→256, four 256→256, 256→1).  With ``output_dim=1`` the model
    returns shape (n,), otherwise (n, K).
    """

    input_dim: int = Field(2, ge=1, description="d, the input dimension")
    output_dim: int = Field(1, ge=1, description="K, the number of outputs")
    depth: int = Field(
        6,
        ge=1,
        le=10_000,
        description="number of Linear layers (each ~4 KB of Python objects "
        "and a sequential step of every pass: 10,000 at most)",
    )
    width: int = Field(256, ge=1, description="hidden-layer width")
    activation: Activation = Activation.LEAKY_RELU
    negative_slope: float = Field(0.01, ge=0.0, lt=1.0, description="leaky_relu slope for z < 0")
    init: Init = Init.XAVIER
    bias_scale: float = Field(0.1, ge=0.0, description="β of the NTK parametrisation")
    residual: bool = Field(False, description="shortcut h + σ(W h + b) between equal-width hidden layers")
    regime: Literal["ntk", "active"] = Field(
        "ntk",
        description="active: the Hessian paper's active regime — the "
        "output divided by √width and the learning rate multiplied by width "
        "(needs init='ntk')",
    )

    @model_validator(mode="after")
    def _residual_needs_hidden(self) -> ModelSpec:
        if self.residual and self.depth < 3:
            raise ValueError(f"residual=True needs depth >= 3 (a hidden-to-hidden layer), got depth={self.depth}")
        if self.regime == "active" and (Init(self.init) is not Init.NTK or self.depth < 2):
            raise ValueError(
                f"model.regime='active' (output / √width, lr · width) is the Hessian paper's NTK "
                f"parametrisation with hidden layers: it needs init='ntk' and depth >= 2, got "
                f"init={Init(self.init).value!r}, depth={self.depth}"
            )
        return self

    @property
    def lr_factor(self) -> float:
        """The learning-rate multiplier of the regime: ``width`` (active), 1 (ntk)."""
        return float(self.width) if self.regime == "active" else 1.0


# --------------------------------------------------------------------------- user-defined networks


class FactoryModelSpec(_Strict):
    """Any ``nn.Module``, built by calling ``factory(**kwargs)`` — ``"pkg.module:function"``.

    The module must be importable wherever the model is built: on the driver and on every Ray
    worker (ship it with the job's ``runtime_env``, see deploy/README.md).  The import is
    resolved when the model is built, not here, so a stored spec can always be read back.
    ``input_dim`` / ``output_dim`` default to the data's d (flattened) and K; the model must
    map the data's (n, d) inputs to (n,) or (n, K) — or, with ``output`` set, return a dict, a
    tuple or a Hugging Face ``ModelOutput`` whose ``output`` (a key or an index) is that tensor.
    ``source="tracker"`` marks a model handed to a :class:`~nsa_dist.Tracker` (``factory`` then
    only names its class; it is not rebuilt).
    """

    factory: str = Field(..., description="import path 'package.module:function' of the model factory")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the factory")
    input_dim: int | None = Field(None, ge=1, description="d of the (flattened) inputs")
    output_dim: int = Field(1, ge=1, description="K, the number of outputs")
    source: Literal["factory", "tracker"] = Field(
        "factory", description="set by a Tracker (not written in a spec)", json_schema_extra={"internal": True}
    )
    output: str | int | None = Field(
        None,
        description="the output to measure when the model returns a dict, tuple "
        "or ModelOutput: a key or an index (None: the model returns the tensor)",
    )

    @model_serializer(mode="wrap")
    def _no_default_output(self, handler: Any) -> dict:
        """``output`` is written only when set: a spec without it keeps the JSON (and run id) it had."""
        d = handler(self)
        if isinstance(d, dict) and d.get("output") is None:
            d.pop("output", None)
        return d

    @field_validator("factory")
    @classmethod
    def _import_path(cls, v: str) -> str:
        import re

        if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", v):
            raise ValueError(
                f"model.factory={v!r} is not an import path 'package.module:function' (e.g. 'nsa_dist.models:cnn')"
            )
        return v


def _model_kind(v: Any) -> str:
    """Which model block a value is: a factory when it names one."""
    if isinstance(v, FactoryModelSpec):
        return "factory"
    if isinstance(v, dict):  # `factory`, or a key misspelt from it, makes it one: `factroy:` is then said as
        keys = [str(k) for k in v]  # such, not as a net's unknown field beside every factory key
        if "factory" in keys or difflib.get_close_matches("factory", keys, n=1, cutoff=0.7):
            return "factory"
    return "fc"


# --------------------------------------------------------------------------- experiments


class DataName(str, Enum):
    """Built-in datasets (see :mod:`nsa_dist.data`)."""

    IMAGE2D = "image2d"
    MNIST = "mnist"
    CIFAR10 = "cifar10"
    CIFAR100 = "cifar100"
    DIGITS = "digits"
    DENSITY2D = "density2d"
    GAUSSIAN_MIXTURE = "gaussian_mixture"
    ARRAYS = "arrays"  # data handed to a Tracker in memory; never loaded from a spec


class Target(str, Enum):
    """Target of a classification dataset: the label as a number, ±1 one-vs-rest, or one-hot (K outputs)."""

    LABEL = "label"
    ONE_VS_REST = "one_vs_rest"
    ONEHOT = "onehot"


_N_CLASSES = {DataName.MNIST: 10, DataName.CIFAR10: 10, DataName.CIFAR100: 100, DataName.DIGITS: 10}


class DataSpec(_Strict):
    """Which data, how many points.  ``path``: an image (image2d) or a data directory (mnist, cifar),
    a local path (relative to the current directory) or an fsspec URL (``s3://``, ``gs://``, ``file://``)."""

    name: DataName = DataName.IMAGE2D
    n: int = Field(1000, ge=1, description="training points N")
    n_test: int = Field(0, ge=0, description="test points")
    path: str | None = Field(None, min_length=1)  # '' read the current directory as the data (an audit)
    pool: bool = Field(False, description="mnist: 2x2 average pooling to 14x14")
    grayscale: bool = Field(True, description="cifar: luminance (d=1024) instead of RGB (d=3072)")
    target: Target = Target.LABEL
    positive_class: int = Field(0, ge=0, description="the +1 class of target=one_vs_rest")
    dim: int = Field(5, ge=1, description="gaussian_mixture: the dimension d")
    noise: Literal["uniform", "gaussian"] = Field(
        "uniform",
        description="density data (NCE): the noise q — uniform over the data's box or the data's Gaussian fit",
    )
    noise_ratio: int = Field(
        1, ge=1, description="density data (NCE): ν noise samples per data sample; N = n counts both"
    )

    @property
    def input_dim(self) -> int:
        """d of the inputs this spec yields."""
        name = DataName(self.name)
        if name is DataName.IMAGE2D:
            return 2
        if name is DataName.ARRAYS:
            return 0  # a Tracker's arrays: d is the model block's input_dim
        if name is DataName.MNIST:
            return 196 if self.pool else 784
        if name is DataName.DIGITS:
            return 64
        if name is DataName.DENSITY2D:
            return 2
        if name is DataName.GAUSSIAN_MIXTURE:
            return self.dim
        return 1024 if self.grayscale else 3072

    @property
    def output_dim(self) -> int:
        """K of the targets this spec yields."""
        name = DataName(self.name)
        return _N_CLASSES[name] if name in _N_CLASSES and Target(self.target) is Target.ONEHOT else 1

    @model_validator(mode="after")
    def _target_fits(self) -> DataSpec:
        name = DataName(self.name)
        if (
            name in (DataName.IMAGE2D, DataName.DENSITY2D, DataName.GAUSSIAN_MIXTURE)
            and Target(self.target) is not Target.LABEL
        ):
            raise ValueError(
                f"data.target={Target(self.target).value!r}: {name.value} has real-valued targets, only 'label' applies"
            )
        if name in _N_CLASSES and self.positive_class >= _N_CLASSES[name]:
            raise ValueError(
                f"data.positive_class={self.positive_class} but {name.value} has classes 0..{_N_CLASSES[name] - 1}"
            )
        return self

    @model_validator(mode="after")
    def _fields_apply(self, info: ValidationInfo) -> DataSpec:
        """Refuse a setting the named data would silently ignore (a ``path`` for the bundled digits,
        ``pool`` for cifar10, …): the run would train on other data than the author meant."""
        if _stored(info):
            return self
        name = DataName(self.name)
        density = (DataName.DENSITY2D, DataName.GAUSSIAN_MIXTURE)
        applies = {
            # arrays: a Tracker's, whose path is the arrays' digest ("sha1:…")
            "path": (
                DataName.IMAGE2D,
                DataName.DENSITY2D,
                DataName.MNIST,
                DataName.CIFAR10,
                DataName.CIFAR100,
                DataName.ARRAYS,
            ),
            "pool": (DataName.MNIST,),
            "grayscale": (DataName.CIFAR10, DataName.CIFAR100),
            "positive_class": tuple(_N_CLASSES),
            "dim": (DataName.GAUSSIAN_MIXTURE,),
            "noise": density,
            "noise_ratio": density,
        }
        ignored = [
            f"data.{f}={getattr(self, f)!r} applies to {', '.join(n.value for n in where)} only"
            for f, where in applies.items()
            if name not in where and getattr(self, f) != type(self).model_fields[f].default
        ]
        if self.positive_class != 0 and name in _N_CLASSES and Target(self.target) is not Target.ONE_VS_REST:
            ignored.append(f"data.positive_class={self.positive_class} applies with target: one_vs_rest only")
        if ignored:
            raise ValueError(
                f"{'; '.join(ignored)} — {name.value} would ignore it, and the run would not be the one "
                "written; remove it (or name the data it is for)"
            )
        return self

    @model_validator(mode="after")
    def _arrays_are_a_trackers(self, info: ValidationInfo) -> DataSpec:
        """``name: arrays`` names the arrays handed to a Tracker in memory (its ``path`` their
        digest, ``sha1:…``): no spec can load them, and a file named there would not be read."""
        digest = str(self.path or "").startswith("sha1:")
        if DataName(self.name) is DataName.ARRAYS and not _stored(info) and not digest:
            raise ValueError(
                "data.name='arrays' is what a Tracker calls the arrays handed to it in memory; a spec cannot "
                "load data by it (a path there would not be read): record your own arrays (.npz, CSV, …) "
                "with nsa_dist.Tracker, or name built-in data (image2d, mnist, cifar10, …) with its path"
            )
        return self

    @model_validator(mode="after")
    def _density_noise(self, info: ValidationInfo) -> DataSpec:
        if DataName(self.name) is DataName.DENSITY2D and self.noise == "gaussian" and not _stored(info):
            raise ValueError(
                "data.noise='gaussian' with density2d: the Gaussian fit puts noise points outside [0, 1]², "
                "where the image's density is 0 and y = log p = -inf (every energy of y NaN); use "
                "noise: uniform (the data's box)"
            )
        return self


class OptimizerName(str, Enum):
    """GD: full batch (the NSA paper).  SGD: minibatches of ``batch_size``.  ADAM: full batch or minibatch Adam."""

    GD = "gd"
    SGD = "sgd"
    ADAM = "adam"
    CUSTOM = "custom"  # a user's own update (Tracker): first-order prediction J·Δθ; not trainable from a spec


class OptimizerSpec(_Strict):
    name: OptimizerName = OptimizerName.GD
    batch_size: int | None = Field(None, ge=1, description="minibatch size (sgd; optional for adam)")
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)

    @model_validator(mode="after")
    def _batch(self, info: ValidationInfo) -> OptimizerSpec:
        name = OptimizerName(self.name)
        if not _stored(info):  # a setting the optimizer named does not use is refused, not silently dropped
            if any(not 0.0 <= b < 1.0 for b in self.betas):
                raise ValueError(f"optimizer.betas must each be in [0, 1) (Adam's decay rates), got {list(self.betas)}")
            if name is OptimizerName.ADAM and self.momentum != 0.0:
                raise ValueError(
                    f"optimizer.momentum={self.momentum:g} is not used by 'adam' (its momentum is betas[0]); "
                    "drop it, or use name='gd' / 'sgd' for heavy-ball momentum"
                )
            unused = [f for f in ("betas", "eps") if getattr(self, f) != OptimizerSpec.model_fields[f].default]
            if name in (OptimizerName.GD, OptimizerName.SGD) and unused:
                raise ValueError(
                    f"optimizer.{'/'.join(unused)} {'is' if len(unused) == 1 else 'are'} Adam's; "
                    f"{name.value!r} does not use {'it' if len(unused) == 1 else 'them'}: drop "
                    f"{'it' if len(unused) == 1 else 'them'}, or set name='adam'"
                )
        if name is OptimizerName.SGD and self.batch_size is None:
            raise ValueError("optimizer.batch_size is required for optimizer.name='sgd' (use 'gd' for full batch)")
        if name is OptimizerName.GD and self.batch_size is not None:
            raise ValueError("optimizer.batch_size must be unset for 'gd' (full batch); use name='sgd'")
        return self


class LossName(str, Enum):
    """L2: ℓ = ½(f − y)², L = (1/N) Σ ℓ (the NSA paper), residual m = f − y.

    NCE: noise-contrastive estimation of an unnormalised log-density f (NSA §6 "Scope"):
    ℓ_i = −[c_i log σ(h_i) + (1 − c_i) log(1 − σ(h_i))], h_i = f_i − log(ν q(x_i)), over data
    (c = 1) and noise (c = 0) points; residual m_i = ∂ℓ_i/∂f_i = σ(h_i) − c_i.  Needs a
    density dataset (``density2d``, ``gaussian_mixture``); the noise q and the ratio ν are
    ``data.noise`` and ``data.noise_ratio``.

    CROSS_ENTROPY: ℓ_i = −Σ_k y_ik log softmax(f_i)_k on one-hot (or probability) targets, K ≥ 2
    outputs (the logits); residual m_i = ∂ℓ_i/∂f_i = softmax(f_i) − y_i, loss curvature
    HC_i = diag(p_i) − p_i p_iᵀ in the Hessian's I.

    The one loss enum: the pipeline, :mod:`nsa_dist.hessian` and the Tracker use it; a model
    measured outside a spec also calls l2 "mse" (:func:`nsa_dist.losses.parse_loss`).
    """

    L2 = "l2"
    NCE = "nce"
    CROSS_ENTROPY = "cross_entropy"


class ScheduleSpec(_Strict):
    """Learning rate δ_t = lr · decay^⌊t / every⌋ (NSA: 0.25, halved every 1e5 steps)."""

    lr: float = Field(0.25, gt=0.0)
    decay: float = Field(1.0, gt=0.0, le=1.0)
    every: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _decay_needs_every(self, info: ValidationInfo) -> ScheduleSpec:
        if _stored(info):
            return self
        if self.decay != 1.0 and self.every is None:
            raise ValueError(
                f"schedule.decay={self.decay:g} needs schedule.every (the steps between decays); without "
                "it the learning rate would stay lr at every step"
            )
        if self.every is not None and self.decay == 1.0:
            raise ValueError(
                f"schedule.every={self.every} needs schedule.decay < 1 (the factor applied every "
                f"{self.every} steps); with decay 1 the learning rate would stay lr: set decay, or drop every"
            )
        return self

    def lr_at(self, step: int) -> float:
        return self.lr * (self.decay ** (step // self.every) if self.every else 1.0)


MAX_RECORDED_STEPS = 1_000_000  # recorded steps of one run: each is an eigendecomposition and a chunk per array


class RecordSpec(_Strict):
    """Which steps are analysed: exactly one of ``every``, ``log_points``, ``steps``.

    Step t means the state θ_t before update t; step 0 (initialisation) and the last
    training step are always included.
    """

    every: int | None = Field(None, ge=1)
    log_points: int | None = Field(
        None,
        ge=2,
        description="log-spaced steps: at most this many, fewer where early points round to the same step "
        "(log_points: 20 of 1000 steps records 19)",
    )
    steps: list[int] | None = None

    @field_validator("steps")
    @classmethod
    def _canonical(cls, v: list[int] | None) -> list[int] | None:
        """Sorted, each step once: the same schedule is the same spec (and the same run id, so a
        re-run with the steps in another order resumes the stored run instead of starting anew)."""
        return None if v is None else sorted(set(v))

    @model_validator(mode="after")
    def _one(self) -> RecordSpec:
        given = [k for k in ("every", "log_points", "steps") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"record: give exactly one of every / log_points / steps, got {given or 'none'}")
        if self.steps is not None and (not self.steps or min(self.steps) < 0):
            raise ValueError(f"record.steps must be a non-empty list of steps >= 0, got {self.steps}")
        return self

    def count(self, total: int) -> int:
        """How many steps :meth:`schedule` records for ``total`` updates, by arithmetic (nothing built).

        An upper bound for ``log_points`` (rounding may merge early points) and ``steps``.
        """
        if self.every is not None:
            n = -(-total // self.every)  # ⌈total / every⌉ multiples of every in [0, total − 1]
            return n + ((total - 1) % self.every != 0)  # and the last step when it is not one
        if self.log_points is not None:
            return self.log_points + 1  # the points and step 0 (geomspace builds all of them)
        return len(self.steps) + 2

    def schedule(self, total: int) -> list[int]:
        """The sorted recorded steps in [0, total − 1] for a run of ``total`` updates.

        Raises:
            ValueError: more than ``MAX_RECORDED_STEPS`` steps would be recorded (checked by
                :meth:`count` before any list is built), or ``record.steps`` past the last step.
        """
        last = total - 1
        n = self.count(total)
        if n > MAX_RECORDED_STEPS:
            which = (
                f"record.every={self.every}"
                if self.every is not None
                else f"record.log_points={self.log_points}"
                if self.log_points is not None
                else "record.steps"
            )
            raise ValueError(
                f"{which} with steps={total} records {n:,} steps, more than {MAX_RECORDED_STEPS:,} "
                "(each is a full spectral analysis); record fewer steps"
            )
        if self.every is not None:
            s = list(range(0, total, self.every))
            return s if s[-1] == last else s + [last]
        if self.log_points is not None:
            import numpy as np

            s = {int(round(v)) for v in np.geomspace(1, total, self.log_points) - 1}
        else:
            bad = [t for t in self.steps if t > last]
            if bad:
                raise ValueError(f"record.steps {bad} lie past the last training step {last} (steps={total})")
            s = set(self.steps)
        return sorted(s | {0, last})


# --------------------------------------------------------------------------- algorithm choices
# (the spec names them; nsa_dist.ntk and nsa_dist.linalg re-export them from their front doors)


class NTKMethod(str, Enum):
    """How the Gramian is computed.

    Which parameter may take which path is decided from what the forward pass does (probe
    forwards: which layer used which parameter how often, whether a saved layer input or output
    was modified in place, whether the samples are coupled), never from module types alone.

    STRUCTURED: per-layer formula ``G = Σ_l (Â_l Â_lᵀ) ⊙ (Δ_l Δ_lᵀ)`` from one forward and one
        backward pass per block (Â_l = [w_l·A_l, β_l·1] the scaled layer inputs, Δ_l the output
        gradients).  Costs O(N²·Σ_l(n_in+n_out)) and never forms the N×P Jacobian: wins for every
        network whose trainable parameters all live in ``nn.Linear`` layers applied once per
        sample to (n, features) inputs — MLPs, residual MLPs, the NTK parametrisation.
    PER_LAYER: the hybrid ``G = Σ_g J_g J_gᵀ`` over parameter groups: the structured factors of
        Linear layers, formed per-sample gradients of Conv1d/2d/3d, Embedding, LayerNorm,
        GroupNorm, eval-mode BatchNorm and unmasked self-attention (its two projections) from
        their inputs and output gradients, and per-sample Jacobians (torch.func) for every other
        parameter (recurrent, masked attention, tied weights), contracted at the GEMM rate on
        upper tiles.  Costs O(N²·P_formed) plus about three passes' work per point for the
        features; memory ``min(N·K·P_formed, FEATURE_BYTES)`` plus G (past the budget, one
        extra forward/backward pass per column group).  Wins for CNNs, ResNets and Transformers:
        one unsupported module costs only its own parameters' Jacobians.
    JACOBIAN: per-sample Jacobians from ``torch.func`` (``vmap(jacrev)``; one reverse pass per point
        where vmap has no rule) contracted block by block, ``G_IJ = J_I J_Jᵀ``.  Costs O(N²·P)
        plus the Jacobians: exact for any module whose samples do not interact.
    BATCH: the full-batch Jacobian ``J = ∂f(X)/∂θ`` (one forward of all points, reverse passes in
        row chunks): the kernel of the batch forward for models that couple samples (BatchNorm
        in train mode or without running statistics).  The only exact choice there.
    AUTO: BATCH when the samples are coupled, else STRUCTURED when every parameter qualifies,
        else PER_LAYER when any layer does, otherwise JACOBIAN.
    """

    AUTO = "auto"
    STRUCTURED = "structured"
    JACOBIAN = "jacobian"
    PER_LAYER = "per_layer"
    BATCH = "batch"


class EigMethod(str, Enum):
    """How :func:`~nsa_dist.linalg.top_eigenpairs` computes the top-k eigenpairs of the (N, N) Gramian.

    DENSE: LAPACK ``eigh`` (SciPy on the host, ``torch.linalg.eigh`` / ``cupy.linalg.eigh`` on the
        GPU), O(N³).  Wins when k is a large fraction of N (k > N/3), for small N (≤ 500), and
        for ``k="all"``.  An operator is first materialised with N products.
    LANCZOS: thick-restart block Lanczos with full reorthogonalisation
        (:func:`nsa_dist.linalg.lanczos.block_lanczos`), O(N²·m) for a dense G with m ≈ 3k
        products.  Wins for k ≪ N: ≥ 10× faster than ``eigh`` for the top 100 of N = 5000 on two
        cores, and the only choice when G is matrix-free (an NTK operator too large to form).
    ARPACK: SciPy's ``eigsh(which="LA")``, implicitly restarted single-vector Lanczos, on the host
        only.  A reference: fewer products than LANCZOS for very small k, but one matvec at a time
        (BLAS-2), so slower on dense matrices and operators with batched products.
    AUTO: DENSE when k > N/3 or N ≤ 500, else LANCZOS.
    """

    AUTO = "auto"
    DENSE = "dense"
    LANCZOS = "lanczos"
    ARPACK = "arpack"


class Layout(str, Enum):
    """Where one recorded step's Gram G_t lives while it is analysed (DESIGN.md, "Scaling one step").

    LOCAL: one worker holds the whole G (~N² entries) — fastest while G fits; the only layout
    for ``k: all`` with ``energy: exact`` (``k: all`` runs on every layout by the quadrature
    route, :class:`EnergyRoute`).  BLOCK_ROWS: a gang of ``spectrum.workers`` workers holds the upper tile
    pairs, each a balanced share (~N²/(2W)); per-point features are computed once and shared;
    every metric is exact.  MATRIX_FREE: no G anywhere, ``G V = J (Jᵀ V)`` over data shards
    (~(N/W)·Σ(n_in + n_out) + P·b per worker) — for N whose G fits nowhere; ‖G‖_F is then
    estimated (Hutch++, with its standard error).  AUTO: the first of these that fits
    ``spectrum.memory_budget_gb`` per worker; the choice and the reason are recorded.
    """

    AUTO = "auto"
    LOCAL = "local"
    BLOCK_ROWS = "block_rows"
    MATRIX_FREE = "matrix_free"


class EnergyRoute(str, Enum):
    """How ``spectrum.k: all`` gets E_t(φ, k) and λ_k for every k (docs/design-notes.md, "The curve beyond one node").

    EXACT: every eigenvalue and projection of the whole G (layout local only).  QUADRATURE: the
    top ``quadrature.top`` eigenpairs exactly, beyond them Gauss quadrature of each φ's spectral
    measure and stochastic Lanczos quadrature of G's eigenvalue counting function, from products
    with G only (every layout), with a bracket at every reported k.  AUTO: exact when the layout
    is local (G fits whole on one worker within the budget), quadrature otherwise.
    """

    AUTO = "auto"
    EXACT = "exact"
    QUADRATURE = "quadrature"


class QuadratureSpec(_Strict):
    """Sizes of the quadrature route of ``k: all`` (defaults measured, docs/design-notes.md)."""

    top: int = Field(100, ge=1, description="exact top eigenpairs (the curve is exact for k ≤ top)")
    lanczos_steps: int = Field(60, ge=2, description="block Lanczos steps from the φ's and the probes")
    probes: int = Field(24, ge=2, description="Rademacher probes of G's eigenvalue counting function")
    curve_points: int = Field(
        100, ge=2, description="points of the log-spaced k grid from 1 to N (fewer after rounding to distinct integers)"
    )
    confidence: float = Field(
        0.95, gt=0, lt=1, description="pointwise confidence of the counting function's statistical bracket"
    )
    density_grid: int = Field(200, ge=10, description="points of G's SLQ spectral density")
    block_size: int = Field(
        16,
        ge=1,
        description="φ columns and probes per block Lanczos run (bigger: sharper "
        "values and Ritz bounds, a larger basis N·lanczos_steps·block_size)",
    )
    phi_steps: int | None = Field(
        None,
        ge=0,
        description="block Lanczos steps of a separate run of the step's φ columns after the probes' "
        "(null: the φ's share the probes' blocks and lanczos_steps; 0: up to min(4·lanczos_steps, "
        "block_size·lanczos_steps / the φ columns); n: up to n); longer runs narrow E(φ, k)'s bracket "
        "where φ's energy lies deep in the tail",
        json_schema_extra=ID_NEUTRAL,
    )
    phi_width: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="with phi_steps: φ's run stops (checked every 20 steps) once its own (Gauss–Radau) "
        "part of E(φ, k)'s bracket is at most this at every reported k beyond the top; 0: always "
        "phi_steps. The rest of the width is λ_k's bracket",
        json_schema_extra=ID_NEUTRAL,
    )

    @field_validator("phi_width")
    @classmethod
    def _width_needs_steps(cls, v: float, info: ValidationInfo) -> float:
        if v > 0 and info.data.get("phi_steps", 0) is None and not _stored(info):
            raise ValueError(
                "phi_width needs spectrum.quadrature.phi_steps (φ's own run, which it stops): set "
                "phi_steps too (0: its automatic length), or drop phi_width"
            )
        return v


_IMAGES = (1, 2, 3, 4, 5, 6, 10, 100, 500, 1000, 2000, 4000)  # spectrum.images' default: those ≤ K are drawn


class SpectrumSpec(_Strict):
    """Spectral analysis at each recorded step."""

    layout: Layout = Field(Layout.LOCAL, description="local | block_rows | matrix_free | auto (see Layout)")
    workers: int = Field(1, ge=1, description="spectral workers sharing one step's G (block_rows, matrix_free)")
    memory_budget_gb: float | None = Field(
        None,
        gt=0,
        description="the memory a worker's share of G_t may take: layout=auto chooses a layout whose part fits "
        "(default: half of this machine's memory); an explicit layout whose part does not is run as set, with a "
        "warning; the process's own ~0.4 GB (torch, Ray) and block_rows' transient products come on top",
    )
    frobenius_probes: int = Field(32, ge=2, description="matrix_free: Hutch++ probes of ‖G‖_F²")

    k: int | Literal["all"] = Field(100, description="top eigenpairs of G_t, or 'all'")
    energy: EnergyRoute = Field(EnergyRoute.AUTO, description="k: all — exact | quadrature | auto (see EnergyRoute)")
    quadrature: QuadratureSpec = Field(default_factory=QuadratureSpec, description="k: all on the quadrature route")
    eig_method: EigMethod = Field(EigMethod.AUTO, description="auto | dense | lanczos | arpack (see EigMethod)")
    ntk_method: NTKMethod = Field(
        NTKMethod.AUTO, description="auto | structured | per_layer | jacobian | batch (see NTKMethod)"
    )
    dtype: Literal["float64", "float32"] = "float64"
    block_size: int | None = Field(None, ge=1)
    test_points: bool = Field(False, description="also the Gram at test points and E_t(f_test, k) (Fig. 3e)")
    warm_start: bool = Field(
        False,
        description="Lanczos starts from the previous recorded step's eigenvectors "
        "(saves products only when G moves little between records; results then depend on "
        "the steps this analyzer saw before, within the solver's tolerance)",
    )
    store_eigenvectors: bool | list[int] = Field(
        True,
        description="store v_i^t at every recorded step (True), "
        "none (False) or only at these recorded steps (e.g. Fig. 7d's pair)",
    )
    per_class_k: int = Field(
        0,
        ge=0,
        description="K-output networks: top eigenvalues of each diagonal block "
        "J_a J_aᵀ of the full kernel (per-class spectra; 0: off)",
    )
    full_k: int = Field(
        10,
        ge=1,
        description="K-output networks: top eigenvalues of the full (N·K)×(N·K) kernel "
        "(sets the GD stability bound and the flow speeds)",
    )
    gram_change_k: int = Field(
        0,
        ge=0,
        description="App. F: the change of G over update t projected on its top "
        "gram_change_k eigenvectors, measured and to first order, at the eigenvector steps "
        "(0: off; costs ~8 full-batch forward/backward passes per eigenvector — about 3× a "
        "1000-point step on CPU at 10, so best with a store_eigenvectors list)",
    )
    images: list[int] = Field(
        default_factory=lambda: list(_IMAGES),
        description="2-D data: eigenvector indices (1-based) drawn as images + Fourier (Fig. 5)",
    )
    image_size: int = Field(48, ge=4)
    fourier_limit: float = Field(40.0, gt=0)
    fourier_size: int = Field(41, ge=3)

    @model_validator(mode="after")
    def _methods(self, info: ValidationInfo) -> SpectrumSpec:
        if isinstance(self.k, int) and self.k < 1:
            raise ValueError(f"spectrum.k must be >= 1 or 'all', got {self.k}")
        if any(i < 1 for i in self.images):
            raise ValueError(f"spectrum.images are 1-based eigenvector indices, got {self.images}")
        layout = Layout(self.layout)
        energy = EnergyRoute(self.energy)
        if self.k == "all" and energy is EnergyRoute.EXACT and layout in (Layout.BLOCK_ROWS, Layout.MATRIX_FREE):
            raise ValueError(
                f"spectrum.energy='exact' with k='all' (a full eigh of G) needs spectrum.layout='local', "
                f"got layout={layout.value!r}; use energy 'quadrature' (or 'auto') for every k from "
                "products with G"
            )
        if self.k != "all" and energy is EnergyRoute.QUADRATURE:
            raise ValueError(
                f"spectrum.energy='quadrature' is the route of k='all', got k={self.k}; set k: all "
                "(quadrature.top sets the exact part)"
            )
        if EigMethod(self.eig_method) is EigMethod.DENSE and layout is not Layout.LOCAL:
            raise ValueError(
                f"spectrum.eig_method='dense' needs layout='local' (G is never gathered with "
                f"layout={layout.value!r}); use 'auto' or 'lanczos'"
            )
        quadrature = energy is EnergyRoute.QUADRATURE or (
            self.k == "all" and energy is EnergyRoute.AUTO and layout in (Layout.BLOCK_ROWS, Layout.MATRIX_FREE)
        )
        beyond = [i for i in self.images if i > self.quadrature.top]
        if quadrature and beyond and self.images != list(_IMAGES) and not _stored(info):  # the default: those ≤ top
            raise ValueError(
                f"spectrum.images {beyond} are beyond spectrum.quadrature.top={self.quadrature.top}: the "
                "quadrature route of k: all keeps only the top eigenvectors; raise quadrature.top to "
                f"{max(beyond)} or drop those indices"
            )
        if isinstance(self.store_eigenvectors, list) and any(t < 0 for t in self.store_eigenvectors):
            raise ValueError(f"spectrum.store_eigenvectors steps must be >= 0, got {self.store_eigenvectors}")
        return self

    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as torch's (``torch.float64`` or ``torch.float32``): G_t, its features and its
        products are computed in it.  (NumPy's is ``np.dtype(dtype)``, itemsize 8 or 4.)"""
        import torch

        return {"float64": torch.float64, "float32": torch.float32}[self.dtype]

    def eigenvectors_at(self, step: int) -> bool:
        """Whether v_i^t is stored at recorded step ``step`` (see ``store_eigenvectors``)."""
        s = self.store_eigenvectors
        return step in s if isinstance(s, list) else bool(s)


class HessianSpec(_Strict):
    """Loss-Hessian measurements H = I + S at recorded steps (the Hessian paper, Jacot et al.).

    Analysed steps: every ``every``-th recorded step (and the last), or the training ``steps``
    listed (each must be a recorded step).  The loss is the run's: C = (1/2N) Σ ‖f − y‖² (l2) or
    C = (1/N) Σ CE(softmax f, y) (cross_entropy); NCE is not supported.
    """

    every: int = Field(1, ge=1, description="every n-th recorded step")
    steps: list[int] | None = Field(None, description="or exactly these (recorded) training steps")
    moments: bool = Field(True, description="Tr(A^k), k = 1..4, A in H, I, S (Hutch++) and exact Tr(I^k)")
    probes: int = Field(
        16,
        ge=1,
        description="random probes of the moment / orthogonality estimates (≥ 2: the orthogonality estimate "
        "needs two, 1 is refused in a new spec; ≥ 4 for Hutch++'s standard errors)",
    )
    orthogonality: bool = Field(True, description="‖IS‖_F / (‖I‖_F ‖S‖_F)")
    rayleigh_k: int = Field(
        20,
        ge=0,
        description="Hessian paper Fig. 3: vᵀIv, vᵀSv over the top-k eigenvectors of I and of S (0: off; "
        "at most P − 1, P the trainable parameters: a larger k stores P − 1)",
    )
    top_k: int = Field(
        5,
        ge=0,
        description="top eigenvalues of H, I, S by Lanczos, and ‖S‖_op = max |λ(S)| (0: off; at most P − 1, "
        "P the trainable parameters: a larger k stores P − 1)",
    )
    eig_tol: float = Field(
        1e-6,
        gt=0,
        lt=1,
        description="Lanczos residual tolerance of those eigenpairs "
        "(relative to |λ|_max); S's clustered spectrum edge converges slowly below ~1e-4",
    )
    density: bool = Field(True, description="spectral density of H by stochastic Lanczos quadrature")
    density_probes: int = Field(4, ge=1)
    lanczos_steps: int = Field(40, ge=2)
    density_grid: int = Field(200, ge=10)
    block_size: int | None = Field(None, ge=1)
    additivity: bool = Field(
        True,
        description="Theorem 1: Tr(H^k) − Tr(I^k) − Tr(S^k), k = 1..4, with shared probes (and its standard error)",
    )
    trace_G: bool = Field(
        True,
        description="Tr(S) = ∇Cᵀ·G from the per-point traces G_i = Σ_p ∂²f(x_i)/∂θ_p² "
        "(probe estimate with standard errors)",
    )
    limit: bool = Field(
        True,
        description="the infinite-width prediction of I (kernel PCA of Θ∞, limit_ntk) beside "
        "the measured I — fully-connected init='ntk' runs in the NTK regime only (NaN otherwise)",
    )

    @model_validator(mode="after")
    def _two_probes(self, info: ValidationInfo) -> HessianSpec:
        if self.probes < 2 and not _stored(info):  # a run stored before this check stays readable
            raise ValueError(
                f"hessian.probes: {self.probes} — the orthogonality estimate needs at least 2 probes (it and every "
                "standard error were NaN at every step); give 2 or more (4 or more for Hutch++'s standard errors)"
            )
        return self

    @model_validator(mode="after")
    def _every_or_steps(self, info: ValidationInfo) -> HessianSpec:
        if self.steps is not None and self.every != 1 and not _stored(info):
            raise ValueError(
                f"hessian: give every or steps, not both (hessian.steps {self.steps} would analyse those "
                f"steps and ignore every={self.every})"
            )
        return self

    def indices(self, record: list[int]) -> list[int]:
        """Indices into the recording schedule ``record`` that are analysed."""
        if self.steps is not None:
            missing = sorted(set(self.steps) - set(record))
            if missing:
                raise ValueError(
                    f"hessian.steps {missing} are not recorded steps (recorded: {record[:10]}"
                    f"{' …' if len(record) > 10 else ''}); add them to record.steps"
                )
            return [i for i, t in enumerate(record) if t in set(self.steps)]
        return sorted(set(range(0, len(record), self.every)) | {len(record) - 1})


class ExperimentSpec(_Strict):
    """One training run and what is measured along it (read from YAML by ``nsa run``).

    ``model.input_dim`` / ``model.output_dim`` default to the data's d and K.
    """

    name: str = Field("run", pattern=r"^[A-Za-z0-9_.-]+$", max_length=200)
    seed: int = Field(0, ge=0, lt=2**63, description="seeds the data draw, the initialisation and the probes")
    data: DataSpec = Field(default_factory=DataSpec)
    model: Annotated[
        Annotated[ModelSpec, Tag("fc")] | Annotated[FactoryModelSpec, Tag("factory")], Discriminator(_model_kind)
    ] = Field(default_factory=ModelSpec)
    loss: LossName = LossName.L2
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    steps: int = Field(
        1000, ge=1, le=10**15, description="number of training updates"
    )  # 2**63 passed and broke the run after creating it; 1e23 a TypeError in the record grid (an audit)
    record: RecordSpec = Field(default_factory=lambda: RecordSpec(log_points=20))
    spectrum: SpectrumSpec = Field(default_factory=SpectrumSpec)
    hessian: HessianSpec | None = Field(None, description="loss-Hessian measurements (off when absent)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when available")

    def torch_device(self) -> str:
        """The device trainer and analysis run on ("cuda" only when torch sees a GPU)."""
        if self.device == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @model_validator(mode="before")
    @classmethod
    def _fill_model_dims(cls, values: Any, info: ValidationInfo) -> Any:
        if not isinstance(values, dict):
            return values
        if any(k in values and values[k] is None for k in ("data", "model")):
            return values  # 'data:' with nothing under it: field validation says it is empty, no default run
        data, model = values.get("data") or {}, values.get("model") or {}
        if not isinstance(data, (dict, DataSpec)) or not isinstance(model, (dict, ModelSpec, FactoryModelSpec)):
            return values  # let field validation report "data" / "model" is not a mapping
        try:
            data = data if isinstance(data, DataSpec) else DataSpec.model_validate(data, context=info.context)
        except ValueError:
            return values  # field validation reports the data errors under "data." (a key not a name too)
        model = model.model_dump(exclude_unset=True) if isinstance(model, BaseModel) else dict(model)
        if DataName(data.name) is DataName.ARRAYS:
            return {**values, "data": data, "model": model}  # a Tracker's: the model block carries d and K
        model.setdefault("input_dim", data.input_dim)
        model.setdefault("output_dim", data.output_dim)
        return {**values, "data": data, "model": model}

    @model_validator(mode="after")
    def _measured_as_written(self, info: ValidationInfo) -> ExperimentSpec:
        """A measurement the spec asks for that the run would silently skip is refused."""
        if _stored(info) or DataName(self.data.name) is DataName.ARRAYS:
            return self
        s = self.spectrum
        if s.test_points and self.data.n_test == 0:
            raise ValueError(
                "spectrum.test_points=true needs test points: set data.n_test > 0 (with data.n_test: 0 "
                "the test Gram and E_t(f_test, k) would be skipped)"
            )
        if s.per_class_k > 0 and self.model.output_dim == 1:
            raise ValueError(
                f"spectrum.per_class_k={s.per_class_k}: per-class spectra are of K-output networks, this "
                "one has K = 1 output; drop it (or use one-hot targets, data.target='onehot')"
            )
        if s.gram_change_k > 0 and s.store_eigenvectors is False:
            raise ValueError(
                f"spectrum.gram_change_k={s.gram_change_k} is measured at the eigenvector steps, and "
                "spectrum.store_eigenvectors=false stores none: list the steps in store_eigenvectors"
            )
        return self

    @model_validator(mode="after")
    def _dims_match(self) -> ExperimentSpec:
        if DataName(self.data.name) is DataName.ARRAYS:
            pass  # a Tracker's arrays: it checked the model against them
        elif self.model.input_dim != self.data.input_dim:
            raise ValueError(
                f"model.input_dim={self.model.input_dim} but data {self.data.name.value} has d={self.data.input_dim}"
            )
        if DataName(self.data.name) is not DataName.ARRAYS and self.model.output_dim != self.data.output_dim:
            raise ValueError(f"model.output_dim={self.model.output_dim} but the targets have K={self.data.output_dim}")
        if self.optimizer.batch_size is not None and self.optimizer.batch_size > self.data.n:
            raise ValueError(f"optimizer.batch_size={self.optimizer.batch_size} exceeds data.n={self.data.n}")
        record = self.record.schedule(self.steps)  # raises on steps past the end
        density = DataName(self.data.name) in (DataName.DENSITY2D, DataName.GAUSSIAN_MIXTURE)
        if (LossName(self.loss) is LossName.NCE) != density:
            raise ValueError(
                f"loss={LossName(self.loss).value!r} with data {DataName(self.data.name).value!r}: "
                "loss 'nce' goes with the density datasets density2d / gaussian_mixture and only with them"
            )
        if LossName(self.loss) is LossName.NCE and self.hessian is not None:
            raise ValueError(
                "hessian: the Hessian measurements support loss 'l2' and 'cross_entropy'; remove the "
                "block for loss='nce'"
            )
        if LossName(self.loss) is LossName.CROSS_ENTROPY:
            self._check_cross_entropy()
        if isinstance(self.spectrum.store_eigenvectors, list):
            missing = sorted(set(self.spectrum.store_eigenvectors) - set(record))
            if missing:
                raise ValueError(
                    f"spectrum.store_eigenvectors {missing} are not recorded steps (recorded: "
                    f"{record[:10]}{' …' if len(record) > 10 else ''}); add them to record.steps"
                )
        if self.hessian is not None:
            self.hessian.indices(record)
        return self

    def _check_cross_entropy(self) -> None:
        K = self.model.output_dim
        if K < 2:
            raise ValueError(
                f"loss='cross_entropy' needs K >= 2 outputs (logits of K classes), but the model has "
                f"output_dim={K}; use one-hot targets (data.target='onehot') of a classification dataset"
            )
        name = DataName(self.data.name)
        if name in _N_CLASSES and Target(self.data.target) is not Target.ONEHOT:
            raise ValueError(
                f"loss='cross_entropy' needs one-hot targets; set data.target='onehot' "
                f"(got {Target(self.data.target).value!r})"
            )

    def record_steps(self) -> list[int]:
        return self.record.schedule(self.steps)

    def lr_at(self, step: int) -> float:
        """The learning rate of update ``step``: the schedule's times the regime's factor (active: × width)."""
        factor = self.model.lr_factor if isinstance(self.model, ModelSpec) else 1.0
        return self.schedule.lr_at(step) * factor


# --------------------------------------------------------------------------- sweeps


class ClusterSpec(_Strict):
    """How a sweep uses a Ray cluster.

    Trainers take ``trainer_gpus`` GPUs each ("auto": 1 when the cluster has GPUs, else 0) and
    ``trainer_cpus`` CPUs; the pool of ``spectral_workers`` takes ``worker_cpus`` / ``worker_gpus``
    each (fractions allowed, "auto": 0.5 GPU when there are GPUs).  ``max_inflight`` bounds the
    checkpoints of one run waiting for analysis: a slow analysis throttles its trainer.
    ``*_resources`` are extra custom Ray resources each actor needs (to pin work to nodes).
    """

    spectral_workers: int = Field(2, ge=1)
    worker_cpus: float = Field(1.0, ge=0)
    worker_gpus: float | Literal["auto"] = "auto"
    trainer_cpus: float = Field(1.0, ge=0)
    trainer_gpus: float | Literal["auto"] = "auto"
    max_inflight: int = Field(2, ge=1)
    max_concurrent_runs: int | None = Field(None, ge=1)
    trainer_resources: dict[str, float] = Field(default_factory=dict)
    worker_resources: dict[str, float] = Field(default_factory=dict)
    max_retries: int = Field(
        3,
        ge=0,
        description="retries of a (run, step) whose spectral worker or gang died, "
        "and restarts of a run's trainer, before the run is marked failed",
    )


MAX_SWEEP_RUNS = 1000  # runs of one sweep unless raised explicitly (validation context "max_runs")


class SweepSpec(_Strict):
    """A base experiment and the variations of it to run.

    ``grid`` maps dotted field paths of the experiment spec to lists of values; the sweep is
    their Cartesian product (e.g. ``{"model.depth": [2, 4, 6, 8], "model.width": [64, 256, 1024]}``,
    NSA Fig. 7).  ``variants`` adds explicit runs, each a dict of dotted paths → values applied to
    every grid point (or to the base when the grid is empty).  A value that is itself a block
    (``spectrum: {layout: block_rows}``) replaces the base's whole block, whose other fields fall
    back to their defaults; to change one field keep the rest, give its dotted path
    (``spectrum.layout: block_rows``).  Each resulting run is named
    ``<name>__<field>-<value>__…`` and gets the stable id of its spec.  A sweep of more than
    ``MAX_SWEEP_RUNS`` runs (counted before anything is expanded) is refused unless validated
    with a higher ``context={"max_runs": N}`` (``nsa sweep --max-runs N``).
    """

    name: str = Field("sweep", pattern=r"^[A-Za-z0-9_.-]+$", max_length=60)
    base: dict[str, Any] = Field(default_factory=dict, description="an ExperimentSpec (as YAML/dict)")
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    variants: list[dict[str, Any]] = Field(default_factory=list)
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    # the expansion, made once when the sweep is validated (keyed by the fields it was made of)
    _runs: tuple[str, tuple[ExperimentSpec, ...]] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _valid(self, info: ValidationInfo) -> SweepSpec:
        for path, values in self.grid.items():
            if not values:
                raise ValueError(f"grid.{path} is an empty list; give at least one value")
        named = [f"grid.{p}" for p in self.grid if p.split(".")[0] == "name"]
        named += [f"variants[{i}].{p}" for i, v in enumerate(self.variants) for p in v if p.split(".")[0] == "name"]
        if named:
            raise ValueError(
                f"{', '.join(named)}: a sweep names its runs itself (<sweep name>__<field>-<value>…), so a "
                "name there would be overwritten and its runs merged into one; set the sweep's name instead"
            )
        for i, variant in enumerate(self.variants):
            overridden = [p for p in variant if any(_overlaps(p, g) for g in self.grid)]
            if overridden:
                raise ValueError(
                    f"variants[{i}] sets {', '.join(overridden)}, which the grid sweeps: every grid point of that "
                    "variant would get the variant's value (the grid's runs merged into one); put the value in "
                    "the grid, or the field in the variants only"
                )
        given = (info.context or {}).get("max_runs")
        limit = MAX_SWEEP_RUNS if given is None else int(given)  # 0 is a limit, not "the default"
        if self.size > limit:
            sizes = " × ".join(f"{len(v)} {k}" for k, v in self.grid.items())
            raise ValueError(
                f"the sweep has {self.size:,} runs ({sizes or 'no grid'}"
                f"{f' × {len(self.variants)} variants' if self.variants else ''}), more than the limit "
                f"{limit:,}; shrink the grid, or raise the limit explicitly (nsa sweep / nsa submit "
                "--max-runs N)"
            )
        self._runs = (self._key(), tuple(self._expand()))  # every run must be a valid ExperimentSpec
        return self

    def _key(self) -> str:
        return self.model_dump_json(exclude={"cluster"})

    @property
    def size(self) -> int:
        """The number of runs before duplicates are dropped: ∏ |grid values| · max(1, |variants|), by arithmetic."""
        return math.prod(len(v) for v in self.grid.values()) * max(1, len(self.variants))

    def expand(self) -> list[ExperimentSpec]:
        """The sweep's runs, in a stable order (grid in the order given, then variants).

        Expanded and validated once, when the sweep is; every later call returns those runs (a
        copy of the sweep with other fields is expanded again)."""
        if self._runs is None or self._runs[0] != self._key():
            self._runs = (self._key(), tuple(self._expand()))
        return list(self._runs[1])

    def _expand(self) -> list[ExperimentSpec]:
        import itertools

        keys = list(self.grid)
        points = [dict(zip(keys, vals)) for vals in itertools.product(*(self.grid[k] for k in keys))]
        combos = [{**p, **v} for p in points for v in (self.variants or [{}])]
        out, seen = [], set()
        for combo in combos:
            spec = dict(self.base)
            for path, value in combo.items():
                spec = _set_path(spec, path, value)
            suffix = "__".join(f"{p.split('.')[-1]}-{_short(v)}" for p, v in combo.items())
            spec["name"] = f"{self.name}__{suffix}" if suffix else self.name
            try:
                run = ExperimentSpec.model_validate(spec)
            except ValidationError as exc:
                problems = "; ".join(line.strip() for line in format_validation_error(exc).splitlines())
                raise ValueError(f"sweep run {spec['name']!r} ({combo}) is not a valid experiment: {problems}") from exc
            except ValueError as exc:
                raise ValueError(f"sweep run {spec['name']!r} ({combo}) is not a valid experiment: {exc}") from exc
            key = run.model_dump_json(exclude={"name"})  # width [8, 8.0]: one experiment, run once
            if key not in seen:
                seen.add(key)
                out.append(run)
        return out


def _overlaps(a: str, b: str) -> bool:
    """Whether dotted paths ``a`` and ``b`` set the same field (one is the other or holds it)."""
    pa, pb = a.split("."), b.split(".")
    n = min(len(pa), len(pb))
    return pa[:n] == pb[:n]


def spec_as_today(stored: Any) -> dict | None:
    """A stored experiment spec (JSON) as this nsa-dist writes the same spec: the fields added since it
    was recorded at their defaults (so a run recorded before them compares equal to today's spec of it);
    None when it no longer reads as a spec."""
    import json

    if not isinstance(stored, dict) or "name" not in stored:  # {} (a run that could not be read) is no spec
        return None
    try:
        return json.loads(ExperimentSpec.model_validate(stored, context={"stored": True}).model_dump_json())
    except Exception:  # noqa: BLE001 - a spec of another shape is simply not today's spec of anything
        return None


def _short(v: Any) -> str:
    """A value as a name fragment: only [A-Za-z0-9_.-], dicts/lists by their values."""
    import re

    if isinstance(v, dict):
        return "-".join(_short(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return "-".join(_short(x) for x in v)
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(v))[:24]


def _set_path(d: dict, path: str, value: Any) -> dict:
    """A copy of ``d`` with the dotted ``path`` set to ``value`` (intermediate dicts created)."""
    head, _, rest = path.partition(".")
    if not head:
        raise ValueError(f"empty field path in sweep: {path!r}")
    out = dict(d)
    if rest:
        sub = out.get(head, {})
        if not isinstance(sub, dict):
            raise ValueError(f"sweep path {path!r}: {head!r} is not a group of fields")
        out[head] = _set_path(sub, rest, value)
    else:
        out[head] = value
    return out


# --------------------------------------------------------------------------- validation errors, one line each
MAX_ERRORS = 20  # validation problems listed (then "… and N more")
_SHORT = reprlib.Repr()  # how a rejected value is shown: a few levels and items, long strings cut
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxset = 2, 4, 6, 6, 6
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 80, 80, 40


_EMPTY_EXAMPLES = {  # what an empty block of a spec could hold (format_validation_error)
    "data": ", e.g. `data: {name: image2d, n: 10000}`",
    "model": ", e.g. `model: {depth: 6, width: 256}`",
    "optimizer": ", e.g. `optimizer: {name: sgd}`",
}


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem: ``field.path: message (got value)``, at most ``MAX_ERRORS`` of them,
    each value shortened (a huge input never becomes a huge message)."""
    lines, errors = [], _merge_union_branches(exc.errors())
    root = globals().get(exc.title)
    for e in errors[:MAX_ERRORS]:
        loc = tuple(e["loc"])
        allowed = _allowed_fields(root, loc) if e["type"] == "extra_forbidden" else None
        if len(loc) > 1 and loc[0] == "model" and loc[1] in ("fc", "factory"):
            loc = loc[:1] + loc[2:]  # drop the tag of the model block's union (a net or a factory)
        where = ".".join(str(p) for p in loc) or ("" if root is SweepSpec else "(spec)")  # a sweep's line names its run
        msg = _clip(e["msg"].removeprefix("Value error, "), 1000)
        got = e.get("input")
        hint = _exponent_hint(got) if e["type"] in ("int_parsing", "union") else ""
        hint = hint or e.get("_hint", "")
        if e["type"] == "model_type" and isinstance(got, str) and loc and loc[-1] in ("data", "optimizer"):
            hint = f"; a block of fields: write `{loc[-1]}: {{name: {got}}}`"  # `optimizer: sgd`
        empty = e["type"] in ("model_type", "dict_type") and got is None and bool(loc)
        if empty:  # `data:` with nothing under it (its fields not indented, or left out): YAML reads null
            msg = f"the `{loc[-1]}:` block is empty (YAML read null) — give its fields indented under it"
            hint = _EMPTY_EXAMPLES.get(str(loc[-1]), "")
        got = "" if isinstance(got, dict) else hint if empty else f" (got {_SHORT.repr(got)}){hint}"
        if allowed:
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            got += (f"; did you mean {close[0]!r}?" if close else "") + f" (allowed here: {', '.join(allowed)})"
        lines.append(f"  {_clip(where, 200)}: {msg}{got}" if where else f"  {msg}{got}")
    if len(errors) > MAX_ERRORS:
        lines.append(f"  … and {len(errors) - MAX_ERRORS} more problems")
    return "\n".join(lines)


_BRANCH = re.compile(r"(int|float|str|bool|none|literal\[.*\])")  # pydantic's loc item of a union's branch
_BRANCH_WORDS = {"int": "an integer", "float": "a number", "str": "text", "bool": "true or false", "none": "null"}


def _merge_union_branches(errors: list[dict]) -> list[dict]:
    """The errors of one value refused by every branch of a union (``k: int | 'all'``) as one:
    ``spectrum.k: expected an integer or 'all' (got 'al'); did you mean 'all'?`` — pydantic lists a
    line per branch, under a loc ending in the branch's type (``spectrum.k.int``, ``…literal['all']``)."""
    out: list[dict] = []
    for e in errors:
        loc = tuple(e["loc"])
        tag = loc[-1] if loc and isinstance(loc[-1], str) and _BRANCH.fullmatch(loc[-1]) else None
        prev = out[-1] if out else None
        if tag is not None and prev is not None and prev.get("_branches") is not None and prev["loc"] == loc[:-1]:
            prev["_branches"].append(e)
        elif tag is not None:
            out.append({**e, "loc": loc[:-1], "_branches": [e]})
        else:
            out.append(e)
    merged = []
    for e in out:
        branches = e.pop("_branches", None)
        if branches is None or len(branches) == 1:
            merged.append(branches[0] if branches else e)
            continue
        alts, literals = [], []
        for b in branches:
            tag = b["loc"][-1]
            if b["type"] == "literal_error":
                alts.append(b.get("ctx", {}).get("expected", tag))
                literals += [x.strip().strip("'\"") for x in alts[-1].split(" or ")]
            else:
                alts.append(_BRANCH_WORDS.get(tag, b["msg"]))
        got = e.get("input")
        close = difflib.get_close_matches(got, literals, n=1) if isinstance(got, str) else []
        hint = f"; did you mean {close[0]!r}?" if close else ""
        merged.append({**e, "type": "union", "msg": "expected " + " or ".join(alts), "_hint": hint})
    return merged


def _exponent_hint(got: object) -> str:
    """ "; YAML reads 1e3 as text: write 1000" for an integer written with an exponent (PyYAML's
    YAML 1.1 takes ``1e3`` — no dot — for a string); "" otherwise."""
    if not isinstance(got, str) or not any(c in got for c in "eE"):
        return ""
    try:
        v = float(got)
    except ValueError:
        return ""
    if not math.isfinite(v) or not v.is_integer():
        return ""
    return f"; YAML reads {got} as text, not a number: write {int(v)}"


def _allowed_fields(root: object, loc: tuple) -> list[str] | None:
    """The fields of the block that holds ``loc``'s last key (None: not a spec block, e.g. a sweep's base)."""
    if not (isinstance(root, type) and issubclass(root, BaseModel)):
        return None
    cls, tagged = root, None
    for p in loc[:-1]:
        if isinstance(p, int):  # an item of a list of blocks
            continue
        if tagged is not None:
            if p in tagged:  # the tag of a union's member (model: fc / factory)
                cls, tagged = tagged[p], None
                continue
            if len(tagged) != 1:
                return None
            cls, tagged = next(iter(tagged.values())), None
        field = cls.model_fields.get(str(p))
        tagged = _blocks(field.annotation) if field is not None else None
        if not tagged:
            return None
    if tagged is not None:
        if len(tagged) != 1:
            return None
        cls = next(iter(tagged.values()))
    return [name for name, f in cls.model_fields.items() if not (f.json_schema_extra or {}).get("internal")]


def _blocks(tp: object, tag: str | None = None) -> dict[str | None, type[BaseModel]]:
    """The spec blocks (pydantic models) an annotation holds, by their union tag (None: untagged)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return {tag: tp}
    out: dict[str | None, type[BaseModel]] = {}
    if get_origin(tp) is Annotated:
        base, *meta = get_args(tp)
        return _blocks(base, next((m.tag for m in meta if isinstance(m, Tag)), tag))
    for arg in get_args(tp):  # a union, an optional, a list
        out.update(_blocks(arg, tag))
    return out


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"
