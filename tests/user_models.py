"""Networks written the way people write them (a model-factory module for the tests)."""

from __future__ import annotations

import torch
from torch import nn


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


def inplace_resnet(channels: int = 3, eval_bn: bool = True) -> nn.Module:
    """A torchvision-style residual CNN on (n, 64) digits as 1×8×8 images: in-place ReLUs,
    ``out += identity``, BatchNorm (eval mode unless ``eval_bn=False``)."""
    m = nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(inplace=True),
        _Block(channels),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * channels, 1),
        nn.Flatten(0),
    )
    return m.eval() if eval_bn else m


class _Tied(nn.Module):
    def __init__(self, d: int, width: int) -> None:
        super().__init__()
        self.inp, self.a, self.b, self.head = (
            nn.Linear(d, width),
            nn.Linear(width, width),
            nn.Linear(width, width),
            nn.Linear(width, 1),
        )
        self.b.weight = self.a.weight  # weight tying: one Parameter in two modules
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.relu(self.inp(x))
        return self.head(torch.tanh(self.b(torch.tanh(self.a(h))))).squeeze(-1)


def tied_mlp(d: int = 64, width: int = 6) -> nn.Module:
    """An MLP on (n, d) points whose two hidden Linear layers share one weight, with an in-place ReLU."""
    return _Tied(d, width)


def column_mlp(d: int = 2, width: int = 8) -> nn.Module:
    """An MLP ending in ``nn.Linear(width, 1)``: (n, 1) outputs, one target per point."""
    return nn.Sequential(nn.Linear(d, width), nn.Tanh(), nn.Linear(width, 1))


def frozen_first(d: int = 2, width: int = 8) -> nn.Module:
    """An MLP whose first Linear is frozen (``requires_grad`` False): θ has parameters H does not."""
    net = nn.Sequential(nn.Linear(d, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
    net[0].requires_grad_(False)
    return net


class _AutoScale(nn.Module):
    """Takes raw [0, 255] or unit-range inputs: rescales the batch when it looks raw — a decision over
    the whole batch, which a point forwarded alone makes otherwise."""

    def __init__(self, d: int, width: int, threshold: float) -> None:
        super().__init__()
        self.threshold = threshold
        self.body = nn.Sequential(nn.Linear(d, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.max() > self.threshold:
            x = x / 255.0 * 10
        return self.body(x)[:, 0]


def auto_scale(d: int = 2, width: int = 8, threshold: float = 0.3) -> nn.Module:
    return _AutoScale(d, width, threshold)


class _GateHook(nn.Module):
    """A gate on the head's input, applied by a forward pre-hook written as a closure over the module."""

    def __init__(self, d: int = 2, width: int = 8) -> None:
        super().__init__()
        self.a, self.h = nn.Linear(d, width), nn.Linear(width, 1)
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.h.register_forward_pre_hook(lambda m, i: (i[0] * self.g,))

    def forward(self, x):
        return self.h(torch.tanh(self.a(x))).squeeze(-1)


def gate_hook(d: int = 2, width: int = 8) -> nn.Module:
    return _GateHook(d, width)


class _LoRAHook(nn.Module):
    """A frozen base layer with a low-rank adapter added by a forward hook (closure over A and B)."""

    def __init__(self, d: int = 2, width: int = 8, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(d, width), nn.Tanh(), nn.Linear(width, 1))
        for p in self.base[0].parameters():
            p.requires_grad_(False)
        self.A, self.B = nn.Linear(d, rank, bias=False), nn.Linear(rank, width, bias=False)
        nn.init.normal_(self.B.weight, std=0.3)
        self.base[0].register_forward_hook(lambda m, i, o: o + self.B(self.A(i[0])))

    def forward(self, x):
        return self.base(x).squeeze(-1)


def lora_hook(d: int = 2, width: int = 8) -> nn.Module:
    return _LoRAHook(d, width)


class _ScaledAutoScale(nn.Module):
    """Rescales a batch that looks raw ([0, 255]); a learnt output scale keeps it off the structured route."""

    def __init__(self, d: int, width: int, threshold: float) -> None:
        super().__init__()
        self.threshold = threshold
        self.body = nn.Sequential(nn.Linear(d, width), nn.Tanh(), nn.Linear(width, 1))
        self.t = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        if x.max() > self.threshold:
            x = x / 255.0 * 10
        return self.t * self.body(x)[:, 0]


def scaled_auto_scale(d: int = 2, width: int = 8, threshold: float = 1.0) -> nn.Module:
    return _ScaledAutoScale(d, width, threshold)


class _DeadResidual(nn.Module):
    """A residual MLP whose first layer's bias kills every ReLU: its NTK is a constant kernel c·11ᵀ."""

    def __init__(self, d: int, width: int) -> None:
        super().__init__()
        self.inp, self.l1, self.out = nn.Linear(d, width), nn.Linear(width, width), nn.Linear(width, 1)
        nn.init.constant_(self.inp.bias, -50.0)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.relu(self.inp(x))
        o = self.l1(h)
        o += h
        return self.out(self.relu(o)).squeeze(-1)


def dead_residual(d: int = 64, width: int = 6) -> nn.Module:
    return _DeadResidual(d, width)
