"""Fully-connected networks built from a :class:`~nsa_dist.config.ModelSpec`."""

from __future__ import annotations

import math

import torch
from torch import nn

from nsa_dist.config import Activation, Init, ModelSpec

__all__ = ["FCNet", "NTKLinear", "build_model"]


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
    return {Activation.RELU: nn.ReLU, Activation.TANH: nn.Tanh,
            Activation.SOFTPLUS: nn.Softplus, Activation.GELU: nn.GELU}[act]()


class _Erf(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.erf(z)


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


def build_model(spec: ModelSpec, *, seed: int | None = None, dtype: torch.dtype = torch.float32) -> FCNet:
    """Build the network that ``spec`` describes.

    Args:
        spec: depth, width, activation, init, residual, input/output dimensions.
        seed: if given, the parameters are drawn from ``torch.Generator().manual_seed(seed)``
            semantics via a forked RNG, so the global RNG state is left untouched.
        dtype: parameter dtype (float32 for training, float64 for reference checks).

    Returns:
        FCNet mapping (n, d) → (n,) when K = 1, else (n, K).
    """
    dims = [spec.input_dim] + [spec.width] * (spec.depth - 1) + [spec.output_dim]
    with torch.random.fork_rng(enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        layers = [_linear(spec, n_in, n_out) for n_in, n_out in zip(dims[:-1], dims[1:])]
    model = FCNet(layers, _activation(spec), residual=spec.residual)
    return model.to(dtype)


def _linear(spec: ModelSpec, n_in: int, n_out: int) -> nn.Linear:
    if Init(spec.init) is Init.NTK:
        return NTKLinear(n_in, n_out, beta=spec.bias_scale)
    layer = nn.Linear(n_in, n_out)
    nn.init.xavier_uniform_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer
