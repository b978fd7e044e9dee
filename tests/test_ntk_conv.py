"""The per-layer NTK of Conv2d + Linear networks and inputs of any shape, against float64 jacrev (issue 12 §3)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close_rel, dense_ntk
from torch import nn

from nsa_dist.errors import ShapeError, UnsupportedModelError
from nsa_dist.models import cnn
from nsa_dist.ntk import NTKMethod, gram, ntk_operator, resolve_method


def _cnn(K: int = 1, **kw) -> nn.Module:
    torch.manual_seed(1)
    return cnn(in_channels=2, image_size=8, channels=(3, 4), hidden=(6,), output_dim=K, **kw).double()


class _Odd(nn.Module):
    """Strided, dilated, bias-free convolution; a frozen conv; a Linear applied at every pixel."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 3, 3, stride=2, padding=1, dilation=1)
        self.c2 = nn.Conv2d(3, 4, (3, 2), padding=(2, 1), dilation=2, bias=False)
        self.frozen = nn.Conv2d(4, 4, 1)
        self.frozen.requires_grad_(False)
        self.pix = nn.Linear(4, 5)  # on (n, H, W, 4): per-pixel weights, formed per sample
        self.out = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.frozen(torch.tanh(self.c2(torch.tanh(self.c1(x)))))  # (n, 4, H', W')
        h = torch.tanh(self.pix(h.permute(0, 2, 3, 1)))  # (n, H', W', 5)
        return self.out(h.mean((1, 2)))  # (n, 2)


@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("kernel", ["trace", "full"])
def test_per_layer_cnn_matches_jacrev(K, kernel):
    model = _cnn(K)
    x1, x2 = torch.randn(7, 2, 8, 8, dtype=torch.float64), torch.randn(5, 2, 8, 8, dtype=torch.float64)
    assert resolve_method(model, x1) is NTKMethod.PER_LAYER
    full = kernel == "full"
    for block in (2, 3, 64):
        assert_close_rel(
            gram(model, x1, kernel=kernel, block_size=block),
            dense_ntk(model, x1, full=full),
            1e-12,
            f"G(x1) K={K} {kernel} block={block}",
        )
        assert_close_rel(
            gram(model, x1, x2, kernel=kernel, block_size=block),
            dense_ntk(model, x1, x2, full=full),
            1e-12,
            f"G(x1, x2) K={K} {kernel} block={block}",
        )


def test_per_layer_odd_convolutions_and_frozen_layers_match_jacrev():
    torch.manual_seed(2)
    model = _Odd().double()
    x = torch.randn(6, 2, 9, 7, dtype=torch.float64)
    assert resolve_method(model, x) is NTKMethod.PER_LAYER
    assert_close_rel(gram(model, x, method="per_layer", block_size=4), dense_ntk(model, x), 1e-12, "odd conv net")
    assert_close_rel(
        gram(model, x, method="per_layer", kernel="full"), dense_ntk(model, x, full=True), 1e-12, "odd conv net, full"
    )


def test_flat_inputs_and_float32_dtype_argument():
    model = _cnn(1).float()
    x = torch.randn(6, 2 * 8 * 8)
    G = gram(model, x, dtype=torch.float64)
    assert G.dtype == torch.float64
    assert_close_rel(G, dense_ntk(model.double(), x.double()), 1e-12, "flat inputs reshaped by the CNN")


def test_image_inputs_on_jacobian_path_and_operator():
    model = _cnn(2)
    x = torch.randn(5, 2, 8, 8, dtype=torch.float64)
    ref = dense_ntk(model, x)
    assert_close_rel(gram(model, x, method="jacobian", block_size=2), ref, 1e-12, "jacobian on images")
    assert_close_rel(ntk_operator(model, x, block_size=2).to_dense(), ref, 1e-12, "operator on images")


def test_shape_errors_and_unsupported_models():
    model = _cnn(1)
    with pytest.raises(ShapeError, match=r"x1 must have shape \(n, d\) — or \(n, …\)"):
        gram(model, torch.randn(5, dtype=torch.float64))
    with pytest.raises(ShapeError, match="same input dimension"):
        gram(model, torch.randn(3, 2, 8, 8, dtype=torch.float64), torch.randn(3, 2, 4, 16, dtype=torch.float64))
    with pytest.raises(UnsupportedModelError, match="structured"):
        gram(model, torch.randn(3, 2, 8, 8, dtype=torch.float64), method="structured")
    bn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 1)).double()
    with pytest.raises(UnsupportedModelError, match="BatchNorm2d"):
        gram(bn, torch.randn(3, 1, 4, 4, dtype=torch.float64), method="per_layer")
    x = torch.randn(3, 1, 4, 4, dtype=torch.float64)
    assert resolve_method(bn, x) is NTKMethod.BATCH  # train-mode batch norm couples the samples
    grouped = nn.Sequential(
        nn.Conv2d(2, 2, 3, groups=2, padding=1, padding_mode="reflect"), nn.Flatten(), nn.Linear(32, 1)
    ).double()
    xg = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    assert resolve_method(grouped, xg) is NTKMethod.PER_LAYER  # the layer's own VJP per sample
    assert_close_rel(gram(grouped, xg, method="per_layer"), dense_ntk(grouped, xg), 1e-12, "grouped, reflect-padded")


def test_mlp_still_uses_structured():
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    assert resolve_method(mlp, x) is NTKMethod.STRUCTURED
    assert_close_rel(gram(mlp, x), dense_ntk(mlp, x), 1e-12, "MLP on image-shaped inputs")


def test_hessian_operators_take_image_inputs():
    """H = I + S of a CNN on (n, C, H, W) inputs, against torch.func.hessian of the loss (float64)."""
    from torch.func import functional_call, hessian

    from nsa_dist.hessian import hessian_parts

    model = cnn(in_channels=1, image_size=4, channels=(2,), hidden=(3,), output_dim=1, activation="tanh").double()
    X, Y = torch.randn(5, 1, 4, 4, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    names, shapes = zip(*[(k, p.shape) for k, p in model.named_parameters()])
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def C(t):
        parts = dict(zip(names, (c.reshape(s) for c, s in zip(t.split([s.numel() for s in shapes]), shapes))))
        return 0.5 * ((functional_call(model, parts, (X,)) - Y) ** 2).sum() / X.shape[0]

    H, I, S = hessian_parts(model, X, Y, loss="mse")
    assert_close_rel(H.to_dense(), hessian(C)(theta), 1e-10, "H of a CNN on images")
