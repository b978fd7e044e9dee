"""Shared fixtures: float64 reference machinery for the NTK tests."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, jacrev


def dense_jacobian(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """J (n·K, P) of the whole batch by ``torch.func.jacrev`` — the reference every fast path meets."""
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    rest = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}
    out = model(x)
    nk = out.numel()
    J = jacrev(lambda p: functional_call(model, {**p, **rest}, (x,)))(params)
    return torch.cat([j.reshape(nk, -1) for j in J.values()], dim=1)


def flat_model(model: torch.nn.Module):
    """(θ flat, f(v, X)): the model's parameters as one vector and the network as a function of it
    (for dense ``torch.func.hessian`` / ``jacrev`` references over all parameters)."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    names, shapes = list(params), [p.shape for p in params.values()]
    flat = torch.cat([p.reshape(-1) for p in params.values()])

    def unflat(v):
        out, o = {}, 0
        for n, s in zip(names, shapes):
            k = s.numel()
            out[n] = v[o:o + k].view(s)
            o += k
        return out

    return flat, (lambda v, X: functional_call(model, unflat(v), (X,)))


def dense_ntk(model: torch.nn.Module, x1: torch.Tensor, x2: torch.Tensor | None = None, full: bool = False):
    """Reference kernel: traced (n1, n2) or full (n1, K, n2, K) from dense Jacobians."""
    J1 = dense_jacobian(model, x1)
    J2 = J1 if x2 is None else dense_jacobian(model, x2)
    n1, n2 = x1.shape[0], (x1 if x2 is None else x2).shape[0]
    K = J1.shape[0] // n1
    Gf = (J1 @ J2.T).reshape(n1, K, n2, K)
    return Gf if full else Gf.diagonal(dim1=1, dim2=3).sum(-1)


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    """Relative Frobenius error ≤ rtol; on failure name the worst entries and by how much."""
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).norm() / expected.norm().clamp_min(1e-300)
    if not err <= rtol:
        diff = (actual - expected).abs().flatten()
        worst = diff.topk(min(5, diff.numel()))
        idx = [tuple(int(i) for i in torch.unravel_index(j, actual.shape)) for j in worst.indices]
        rows = ", ".join(f"{i}: {float(actual[i]):.6g} vs {float(expected[i]):.6g}" for i in idx)
        raise AssertionError(f"{what}: relative error {float(err):.3e} > {rtol:.1e}; worst entries {rows}")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def local_ray_fixture(num_cpus: int):
    """A module-scoped fixture that starts an embedded Ray with ``num_cpus`` and shuts it down."""

    @pytest.fixture(scope="module")
    def local_ray():
        ray = pytest.importorskip("ray")
        from nsa_dist.cluster import connect

        connect(num_cpus=num_cpus)
        yield ray
        ray.shutdown()

    return local_ray
