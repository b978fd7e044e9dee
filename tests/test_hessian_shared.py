"""The loss Hessian of a network that calls one module twice (``Sequential(lin, act, lin)``): its
products equal Tᵀ H_u T, where H_u is the Hessian of the same network with the two uses untied
(two modules holding equal weights) and T maps the tied parameters onto both copies — and the
user's module keeps its Parameters (``functional_call``'s tie_weights swap left a plain tensor in
their place before)."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from nsa_dist.hessian import HessianOperator


def test_hessian_of_a_module_called_twice_is_the_untied_hessian_folded() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    tied = nn.Sequential(lin, nn.Tanh(), lin)
    untied = nn.Sequential(copy.deepcopy(lin), nn.Tanh(), copy.deepcopy(lin))
    X, Y = torch.randn(7, 3, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    P = sum(p.numel() for p in tied.parameters())
    assert P == 12
    T = np.vstack([np.eye(P), np.eye(P)])  # θ_untied = T θ_tied
    V = np.random.default_rng(0).standard_normal((P, 4))
    got = np.asarray(HessianOperator(tied, X, Y, "mse", None).matmat(V), np.float64)
    Hu = HessianOperator(untied, X, Y, "mse", None)
    want = T.T @ np.asarray(Hu.matmat(T @ V), np.float64)
    err = np.abs(got - want).max()
    assert err <= 1e-12 * max(1.0, np.abs(want).max()), f"tied Hessian products off by {err:.3e}"
    assert isinstance(lin._parameters["weight"], nn.Parameter) and isinstance(lin._parameters["bias"], nn.Parameter)
    again = np.asarray(HessianOperator(tied, X, Y, "mse", None).matmat(V), np.float64)  # the module is intact
    np.testing.assert_array_equal(again, got)
