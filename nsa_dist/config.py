"""Validated configuration models (pydantic, ``extra="forbid"``).

Configuration is data: it is read from YAML at the edge (CLI, services) and validated once
here.  A validation error names the field, the value given and what is allowed.
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Activation", "Init", "ModelSpec"]


class Activation(str, Enum):
    """Hidden-layer nonlinearity σ."""

    LEAKY_RELU = "leaky_relu"
    RELU = "relu"
    TANH = "tanh"
    ERF = "erf"
    SOFTPLUS = "softplus"
    GELU = "gelu"


class Init(str, Enum):
    """Parametrisation and initialisation of the Linear layers.

    XAVIER: standard layers ``z = W a + b``, W Xavier(Glorot)-uniform, b = 0 — the NSA paper.
    NTK: the Hessian paper's NTK parametrisation ``z = W a / sqrt(n_in) + beta * b`` with
    W, b ~ N(0, 1) — the parametrisation under which the NTK has a deterministic
    infinite-width limit.
    """

    XAVIER = "xavier"
    NTK = "ntk"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class ModelSpec(_Strict):
    """A fully-connected network R^d → R^K.

    ``depth`` counts Linear layers (the NSA paper's "6 layers with 256 neurons", |θ| = 264,193,
    is ``depth=6, width=256``: 2→256, four 256→256, 256→1).  With ``output_dim=1`` the model
    returns shape (n,), otherwise (n, K).
    """

    input_dim: int = Field(2, ge=1, description="d, the input dimension")
    output_dim: int = Field(1, ge=1, description="K, the number of outputs")
    depth: int = Field(6, ge=1, description="number of Linear layers")
    width: int = Field(256, ge=1, description="hidden-layer width")
    activation: Activation = Activation.LEAKY_RELU
    negative_slope: float = Field(0.01, ge=0.0, lt=1.0, description="leaky_relu slope for z < 0")
    init: Init = Init.XAVIER
    bias_scale: float = Field(0.1, ge=0.0, description="β of the NTK parametrisation")
    residual: bool = Field(False, description="shortcut h + σ(W h + b) between equal-width hidden layers")

    @model_validator(mode="after")
    def _residual_needs_hidden(self) -> "ModelSpec":
        if self.residual and self.depth < 3:
            raise ValueError(f"residual=True needs depth >= 3 (a hidden-to-hidden layer), got depth={self.depth}")
        return self
