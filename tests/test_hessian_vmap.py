"""The Hessian routes on models holding ops whose torch.func ``vmap`` is silently wrong in the NTK
(torch 2.13: cdist's batched VJP, PReLU's kernel backward; ``_VMAP_UNSAFE`` in nsa_dist/ntk).

Every number is compared in float64 with a reference from plain ``torch.autograd`` (double
backward of the full-batch loss, one reverse pass per output for J) — no torch.func, whose
``hessian`` / ``jacrev`` batch by the same vmap (and ``hessian`` needs cdist's forward AD, which
torch lacks).  PReLU (one slope, one per channel, before the first Linear), with as many points
as outputs and blocks of one and two points: H, I, S (products with K and N columns, dense),
output-Hessian traces, Lanczos eigenvalues, Hutchinson moments, the Gauss–Newton spectrum from
the NTK Gram.  cdist (an RBF layer with trainable centres, the direct and the matmul kernel):
torch has neither forward AD nor double backward for it, so every second-order route must raise
— or, once a torch has them, agree with the same function written without cdist; the
Gauss–Newton spectrum (NTK Gram, first order) must agree now.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_close_rel
from test_hessian_edges import _reference_forms  # double backward, the library's probes
from torch import nn

from nsa_dist.errors import ModelForwardError
from nsa_dist.hessian import (
    extreme_eigenpairs,
    gauss_newton_eigenvalues,
    hessian_operator,
    hessian_parts,
    hutchinson_moments,
    numerical_ranks,
    output_hessian_traces,
)

RTOL = 1e-10


# --------------------------------------------------------------------------- plain-autograd references


def _flat(grads, params) -> torch.Tensor:
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)])


def _dense_parts(model: nn.Module, X: torch.Tensor, Y: torch.Tensor, loss: str):
    """(H, I, S) P×P by double backward of the full-batch loss and a row-by-row Jacobian."""
    params = [p for p in model.parameters() if p.requires_grad]
    P = sum(p.numel() for p in params)
    F = model(X).reshape(X.shape[0], -1)
    N, K = F.shape
    if loss == "mse":
        C = 0.5 * ((F - Y) ** 2).sum() / N
    else:
        C = nn.functional.cross_entropy(F, Y, reduction="sum") / N
    g = _flat(torch.autograd.grad(C, params, create_graph=True), params)
    rows = [torch.autograd.grad(g[i], params, retain_graph=True, allow_unused=True) for i in range(P)]
    H = torch.stack([_flat(r, params) for r in rows])
    Fo = F.reshape(-1)
    J = torch.stack([_flat(torch.autograd.grad(Fo[i], params, retain_graph=True), params) for i in range(N * K)])
    if loss == "mse":
        HC = torch.eye(N * K, dtype=F.dtype)
    else:
        p = F.detach().softmax(1)
        HC = torch.block_diag(*[torch.diag(pi) - torch.outer(pi, pi) for pi in p])
    H = H.detach()
    I = (J.T @ HC @ J / N).detach()  # noqa: E741 - the paper's name
    return H, I, H - I


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


# --------------------------------------------------------------------------- models


def _prelu(slopes: str, first: bool, K: int = 3, width: int = 8, seed: int = 0) -> nn.Module:
    """Linear–PReLU–Linear (or PReLU on the input first); one slope or one per channel, spread
    over both signs so the slope gradients are not degenerate."""
    torch.manual_seed(seed)
    d = 3
    n = 1 if slopes == "one" else (d if first else width)
    act = nn.PReLU(num_parameters=n)
    layers = [act, nn.Linear(d, width)] if first else [nn.Linear(d, width), act]
    model = nn.Sequential(*layers, nn.Tanh() if first else nn.Identity(), nn.Linear(width, K)).double()
    with torch.no_grad():
        act.weight.uniform_(-0.5, 0.5)
    return model


class _RBF(nn.Module):
    """exp(−‖x − c_j‖²) features with trainable centres, then a Linear; ``explicit`` computes
    the same function without cdist (the reference)."""

    def __init__(self, centres: int = 6, K: int = 3, mode: str = "use_mm_for_euclid_dist_if_necessary") -> None:
        super().__init__()
        torch.manual_seed(1)
        self.centers = nn.Parameter(torch.randn(centres, 3, dtype=torch.float64))
        self.lin = nn.Linear(centres, K).double()
        self.mode, self.explicit = mode, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.explicit:
            d2 = ((x[:, None, :] - self.centers[None]) ** 2).sum(-1)
        else:
            d2 = torch.cdist(x, self.centers, compute_mode=self.mode) ** 2
        return self.lin(torch.exp(-d2))


def _data(N: int, K: int, loss: str, seed: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, 3, dtype=torch.float64, generator=g)
    if loss == "mse":
        return X, torch.randn(N, K, dtype=torch.float64, generator=g)
    return X, torch.randint(0, K, (N,), generator=g)


_PRELU = [("one", False), ("channel", False), ("channel", True)]
_PRELU_IDS = ["one-slope", "per-channel", "on-input"]


# --------------------------------------------------------------------------- PReLU: every route exact


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
@pytest.mark.parametrize("N", [3, 6], ids=["N=K", "N=6"])
@pytest.mark.parametrize(("slopes", "first"), _PRELU, ids=_PRELU_IDS)
def test_prelu_H_I_S_products_and_dense(slopes, first, N, loss):
    K = 3
    model = _prelu(slopes, first, K)
    X, Y = _data(N, K, loss)
    ref = dict(zip("HIS", _dense_parts(model, X, Y, loss)))
    P = ref["H"].shape[0]
    V = torch.randn(P, max(K, N, 4), dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for bs in (None, 1, 2):
        ops = dict(zip("HIS", hessian_parts(model, X, Y, loss=loss, block_size=bs)))
        for part, op in ops.items():
            D = ref[part]
            assert_close_rel(op.to_dense(), D, RTOL, f"{part} dense, block {bs}")
            for m in sorted({1, K, N}):  # as many columns as outputs / as points
                assert_close_rel(op.matmat(V[:, :m]), D @ V[:, :m], RTOL, f"{part} V[:, :{m}], block {bs}")
        single = hessian_operator(model, X, Y, part="H", loss=loss, block_size=bs)
        assert_close_rel(single.matvec(V[:, 0]), ref["H"] @ V[:, 0], RTOL, f"hessian_operator H v, block {bs}")


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
@pytest.mark.parametrize(("slopes", "first"), _PRELU, ids=_PRELU_IDS)
def test_prelu_spectra_and_traces(slopes, first, loss):
    K, N = 3, 6
    model = _prelu(slopes, first, K, seed=3)
    X, Y = _data(N, K, loss, seed=11)
    ref = dict(zip("HIS", _dense_parts(model, X, Y, loss)))
    ops = dict(zip("HIS", hessian_parts(model, X, Y, loss=loss)))
    for part, op in ops.items():
        D = ref[part].numpy()
        lam = np.linalg.eigvalsh(D)
        top = extreme_eigenpairs(op, 3, which="largest", method="lanczos").evals
        assert _rel(np.sort(top)[::-1], lam[::-1][:3]) < RTOL, f"{part}: top eigenvalues"
        bottom = extreme_eigenpairs(op, 2, which="smallest", method="lanczos").evals
        assert np.abs(np.sort(bottom) - lam[:2]).max() < 1e-9 * np.abs(lam).max(), f"{part}: bottom eigenvalues"
        est = hutchinson_moments(op, n_probes=4, max_order=2, seed=5).estimate
        assert _rel(est, hutchinson_moments(D, n_probes=4, max_order=2, seed=5).estimate) < RTOL, f"{part}: Hutchinson"
    # the Gauss–Newton spectrum from the NTK Gram, and numerical_ranks' dense eigenvalues
    mu = gauss_newton_eigenvalues(model, X, Y, loss=loss)
    lam_I = np.linalg.eigvalsh(ref["I"].numpy())[::-1]
    assert _rel(mu, lam_I[: mu.size]) < RTOL
    ranks = numerical_ranks(model, X, Y, loss=loss)
    for part in "ISH":
        assert _rel(np.sort(ranks.evals[part]), np.linalg.eigvalsh(ref[part].numpy())) < 1e-9, part
    # output-Hessian traces G (forward-over-forward, vmapped over probes)
    tr = output_hessian_traces(model, X, n_probes=3, seed=7, block_size=2)
    np.testing.assert_allclose(tr.per_probe, _reference_forms(model, X, 3, 7), rtol=0, atol=RTOL * 10)


# --------------------------------------------------------------------------- cdist: raise, never wrong

_MODES = [
    (6, "use_mm_for_euclid_dist_if_necessary"),  # the direct kernel (CdistBackward0)
    (6, "use_mm_for_euclid_dist"),  # the matmul kernel (EuclideanDistBackward0)
    (30, "use_mm_for_euclid_dist_if_necessary"),  # more than 25 centres: the matmul kernel by default
]
_MODE_IDS = ["cdist-kernel", "matmul-kernel", "30-centres"]


def _raises_or_matches(compute, reference, what: str) -> None:
    """The route either fails loudly (torch 2.13: no forward AD / double backward of cdist) or —
    on a torch that has them — gives the reference's numbers; never a silently wrong one."""
    try:
        got = compute()
    except (ModelForwardError, NotImplementedError) as e:
        assert "cdist" in str(e) or "euclidean_dist" in str(e), f"{what}: {e}"
        return
    assert_close_rel(torch.as_tensor(np.asarray(got)), torch.as_tensor(np.asarray(reference())), RTOL, what)


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
@pytest.mark.parametrize(("centres", "mode"), _MODES, ids=_MODE_IDS)
def test_cdist_second_order_routes_raise_or_are_exact(centres, mode, loss):
    K, N = 3, 6
    model = _RBF(centres, K, mode)
    X, Y = _data(N, K, loss, seed=12)
    model.explicit = True
    ref = dict(zip("HIS", _dense_parts(model, X, Y, loss)))
    forms = _reference_forms(model, X, 2, 3)
    model.explicit = False
    P = ref["H"].shape[0]
    V = torch.randn(P, K, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    for part in "HIS":
        for bs in (None, 2):
            _raises_or_matches(
                lambda part=part, bs=bs: hessian_operator(model, X, Y, part=part, loss=loss, block_size=bs).matmat(V),
                lambda part=part: ref[part] @ V,
                f"{part} V, block {bs}",
            )
        _raises_or_matches(
            lambda part=part: hessian_operator(model, X, Y, part=part, loss=loss).to_dense(),
            lambda part=part: ref[part],
            f"{part} dense",
        )
    _raises_or_matches(
        lambda: numerical_ranks(model, X, Y, loss=loss).evals["H"],
        lambda: np.linalg.eigvalsh(ref["H"].numpy()),
        "numerical_ranks H",
    )
    _raises_or_matches(lambda: output_hessian_traces(model, X, n_probes=2, seed=3).per_probe, lambda: forms, "G")


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
@pytest.mark.parametrize(("centres", "mode"), _MODES, ids=_MODE_IDS)
def test_cdist_gauss_newton_spectrum_exact(centres, mode, loss):
    """First order only (the NTK Gram, whose vmap is guarded in nsa_dist.ntk): works and is exact."""
    K, N = 3, 6
    model = _RBF(centres, K, mode)
    X, Y = _data(N, K, loss, seed=13)
    mu = gauss_newton_eigenvalues(model, X, Y, loss=loss)
    model.explicit = True
    _, I, _ = _dense_parts(model, X, Y, loss)
    mu_ref = gauss_newton_eigenvalues(model, X, Y, loss=loss)
    lam = np.linalg.eigvalsh(I.numpy())[::-1]
    assert _rel(mu, mu_ref) < RTOL
    assert _rel(mu, lam[: mu.size]) < RTOL
