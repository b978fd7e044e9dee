"""NTK trial, 6th round: the known-and-not-done list of the last notes.

* a train-mode BatchNorm at one point (N = 1): the probe returned "no coupling" for a one-point
  batch before looking for batch statistics, so the per-sample route ran the forward inside a
  torch.func transform and BatchNorm's running-statistics update surfaced as torch's raw
  "attempted to call in-place operation (aten::add_.Tensor) that would mutate a captured Tensor"
  (wrapped in ModelForwardError).  A batch norm using its batch's statistics is the batch route at
  every N; the kernel of the one-point batch forward is measured.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from nsa_dist.ntk import gram, ntk_operator, sample_coupling

D = torch.float64


def _conv_bn(norm: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), norm, nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 1)).to(D)


def _batch_reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """J Jᵀ of the batch forward by jacrev, on a copy whose batch norms use the batch's statistics
    without keeping running ones (the same function, no in-place update)."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.track_running_stats, m.running_mean, m.running_var, m.num_batches_tracked = False, None, None, None
    params = {k: p.detach() for k, p in ref.named_parameters()}
    jac = jacrev(lambda p: functional_call(ref, p, (x,)).reshape(-1))(params)
    J = torch.cat([j.reshape(x.shape[0], -1) for j in jac.values()], 1)
    return J @ J.T


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("method", ["auto", "jacobian"])
def test_train_mode_batch_norm_is_the_batch_forward_at_every_n(n, method):
    model = _conv_bn(nn.BatchNorm2d(4)).train()
    x = torch.randn(n, 3, 8, 8, dtype=D, generator=torch.Generator().manual_seed(n))
    before = {k: b.clone() for k, b in model.named_buffers()}
    G = gram(model, x, method=method)
    R = _batch_reference(model, x)
    err = float((G - R).abs().max() / R.abs().max())
    assert err < 1e-12, f"N = {n}, {method}: |G - J Jᵀ| / max = {err:.2e}\nG = {G}\nref = {R}"
    for k, b in model.named_buffers():
        assert torch.equal(b, before[k]), f"gram changed the model's buffer {k}"
    assert "batch statistics in '1' (BatchNorm2d, train mode)" in (sample_coupling(model, x) or ""), n
    op = ntk_operator(model, x)
    GO = op.matmat(torch.eye(n, dtype=D))
    assert float((GO - R).abs().max() / R.abs().max()) < 1e-12, f"N = {n}: ntk_operator {GO} vs {R}"
