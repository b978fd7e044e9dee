"""The loss names and the one residual m = ∂ℓ/∂f (nsa_dist.losses) against autograd in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nsa_dist.config import LossName
from nsa_dist.losses import cross_entropy_loss, nce_loss, parse_loss, residual

F64 = torch.float64


def _autograd_residual(loss_fn, f: torch.Tensor, *args: torch.Tensor) -> np.ndarray:
    """∂(N·L)/∂f = ∂ℓ_i/∂f_i row by row, by autograd (L the mean loss)."""
    f = f.clone().requires_grad_(True)
    (loss_fn(f, *args) * f.shape[0]).backward()
    return f.grad.numpy()


@pytest.mark.parametrize("rows", ["onehot", "probability", "unnormalised"])
def test_cross_entropy_residual_is_the_gradient(rows: str) -> None:
    g = torch.Generator().manual_seed(0)
    f = torch.randn(7, 4, generator=g, dtype=F64) * 3
    y = {
        "onehot": torch.nn.functional.one_hot(torch.arange(7) % 4, 4).to(F64),
        "probability": torch.softmax(torch.randn(7, 4, generator=g, dtype=F64), -1),
        "unnormalised": torch.rand(7, 4, generator=g, dtype=F64) * 2,
    }[rows]
    want = _autograd_residual(cross_entropy_loss, f, y)
    got_np = residual(LossName.CROSS_ENTROPY, f.numpy(), y.numpy())
    got_t = residual("cross_entropy", f, y)
    assert isinstance(got_np, np.ndarray) and got_np.dtype == np.float64
    assert isinstance(got_t, torch.Tensor) and got_t.dtype == F64
    np.testing.assert_allclose(got_np, want, rtol=1e-12, atol=1e-14, err_msg="NumPy residual vs autograd")
    np.testing.assert_allclose(got_t.numpy(), want, rtol=1e-12, atol=1e-14, err_msg="torch residual vs autograd")


def test_cross_entropy_residual_on_one_hot_rows_is_softmax_minus_y() -> None:
    """The NSA paper's m = softmax(f) − y, to the bit, on one-hot targets (what runs store)."""
    f = np.random.default_rng(1).standard_normal((9, 3)).astype(np.float32)
    y = np.eye(3)[np.arange(9) % 3]
    z = np.exp(f.astype(np.float64) - f.astype(np.float64).max(-1, keepdims=True))
    assert np.array_equal(residual(LossName.CROSS_ENTROPY, f, y), z / z.sum(-1, keepdims=True) - y)


@pytest.mark.parametrize("shape", [(6,), (6, 2)])
def test_l2_residual_is_f_minus_y(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(2)
    f, y = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape)
    want = _autograd_residual(
        lambda a, b: 0.5 * ((a - b) ** 2).reshape(len(a), -1).sum(1).mean(),
        torch.as_tensor(f, dtype=F64),
        torch.as_tensor(y),
    )
    got = residual(LossName.L2, f, y)
    assert got.dtype == np.float64 and got.shape == shape
    np.testing.assert_array_equal(got, want)
    ft = torch.as_tensor(f)
    assert torch.equal(
        residual("l2", ft, torch.as_tensor(y, dtype=torch.float32)), ft - torch.as_tensor(y, dtype=torch.float32)
    )


def test_nce_residual_is_the_gradient_and_needs_log_noise() -> None:
    rng = np.random.default_rng(3)
    f, log_noise = rng.standard_normal(8) * 4, rng.standard_normal(8)
    c = (np.arange(8) < 3).astype(np.float64)
    want = _autograd_residual(nce_loss, torch.as_tensor(f), torch.as_tensor(c), torch.as_tensor(log_noise))
    np.testing.assert_allclose(residual(LossName.NCE, f, c, log_noise=log_noise), want, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="loss='nce' needs .* log_noise"):
        residual(LossName.NCE, f, c)


def test_parse_loss_names_the_allowed_values() -> None:
    assert parse_loss("mse") is parse_loss("l2") is parse_loss(LossName.L2) is LossName.L2
    assert parse_loss("cross_entropy") is LossName.CROSS_ENTROPY
    for bad in ("hinge", "nce", LossName.NCE):
        with pytest.raises(ValueError, match=r"^loss='(hinge|nce)' is not one of 'mse', 'cross_entropy' \(or 'l2'"):
            parse_loss(bad)
