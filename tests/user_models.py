"""Networks written the way people write them (a model-factory module for the tests)."""

from __future__ import annotations

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
    m = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, channels, 3, padding=1, bias=False),
                      nn.BatchNorm2d(channels), nn.ReLU(inplace=True), _Block(channels), nn.AdaptiveAvgPool2d(2),
                      nn.Flatten(), nn.Linear(4 * channels, 1), nn.Flatten(0))
    return m.eval() if eval_bn else m
