"""What the every-point checks cost: `gram(model, x)` wall time on the models of benchmarks/README.md's
"every-point checks" tables, min of 3 warm calls.

The checks change the code, not an option, so the baseline is another checkout: run this under each
and compare (the README's ratios alternate the two twice and take the better min of each)::

    PYTHONPATH=/path/to/other/checkout OMP_NUM_THREADS=2 python benchmarks/every_point_checks.py
    OMP_NUM_THREADS=2 python benchmarks/every_point_checks.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

from nsa_dist.ntk import gram


def mlp(dtype: torch.dtype) -> nn.Sequential:
    """The paper's 6×256 leaky-ReLU net on 2-D inputs."""
    layers: list[nn.Module] = [nn.Linear(2, 256), nn.LeakyReLU()]
    for _ in range(5):
        layers += [nn.Linear(256, 256), nn.LeakyReLU()]
    return nn.Sequential(*layers, nn.Linear(256, 1)).to(dtype)


class CNN(nn.Module):
    """Two 3×3 convolutions and a Linear head with K = 10 outputs on 12×12 images."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.f = nn.Conv2d(1, 8, 3), nn.Conv2d(8, 8, 3), nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(torch.relu(self.c2(torch.relu(self.c1(x)))).flatten(1))


def main() -> None:
    torch.manual_seed(0)
    cases = [
        ("6x256 MLP, N = 2,000, float32", mlp(torch.float32), torch.randn(2000, 2)),
        ("6x256 MLP, N = 2,000, float64", mlp(torch.float64), torch.randn(2000, 2, dtype=torch.float64)),
        ("6x256 MLP, N = 8,000, float32", mlp(torch.float32), torch.randn(8000, 2)),
        ("CNN (K = 10), N = 500, float32", CNN(), torch.randn(500, 1, 12, 12)),
    ]
    for name, model, x in cases:
        gram(model, x)  # warm
        times = []
        for _ in range(3):
            t = time.perf_counter()
            gram(model, x)
            times.append(time.perf_counter() - t)
        print(f"{name}: {min(times):.3f} s")


if __name__ == "__main__":
    main()
