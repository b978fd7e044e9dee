"""The loss-Hessian measurements on models researchers write, against dense float64 references.

Each reference is written independently of the library: the loss of the network spelled out as a
function of one flat θ, differentiated by ``torch.func`` (``jacrev`` of ``jacrev``: reverse mode
only) or by plain autograd, and ``numpy.linalg.eigh``.

* ``weight_norm`` (both APIs): PyTorch's fused ``_weight_norm_interface`` has no forward-mode rule
  (H, I, S refused with its NotImplementedError) and a wrong double backward in PyTorch 2.13 — the
  reference spells the normalisation out as ``v · g / ‖v‖``.
* ``Embedding(padding_idx=…)``: reverse mode gives the padding row no gradient, forward mode moved
  it; H, I and S came out asymmetric, 0.77 off (reference: the padding row a constant).
* ``gauss_newton_eigenvalues`` with cross-entropy ran a forward of the user's model: a train-mode
  BatchNorm's running statistics changed, and a train-mode ``spectral_norm`` (refused by every
  operator) was measured at a moving state.
* An op without a forward-mode rule (a custom ``autograd.Function`` without ``jvp``): the products
  fall back to reverse mode.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import jacrev

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.hessian import gauss_newton_eigenvalues, hessian_operator, hessian_parts, output_hessian_traces
from nsa_dist.hessian._probes import rademacher

# the hook-based torch.nn.utils.weight_norm is deprecated, and still in researchers' models
pytestmark = pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")


def _dense(op) -> np.ndarray:
    return op.matmat(np.eye(op.shape[0]))


def _assert_rel(actual: np.ndarray, expected: np.ndarray, what: str, rtol: float = 1e-10) -> None:
    err = float(np.abs(actual - expected).max())
    scale = float(np.abs(expected).max())
    assert err <= rtol * scale, f"{what}: max abs diff {err:.3g}, {err / scale:.3g} relative (allowed {rtol:g})"


def _parts_reference(C, F, theta0: torch.Tensor, loss: str) -> dict[str, np.ndarray]:
    """Dense H (reverse over reverse), I = Jᵀ HC J / N (HC of the loss at F(θ0)) and S = H − I."""
    H = jacrev(jacrev(C))(theta0)
    J = jacrev(F)(theta0)  # (N, K, P)
    F0 = F(theta0)
    N, K = F0.shape
    if loss == "mse":
        HC = torch.eye(K, dtype=torch.float64).expand(N, K, K)
    else:
        p = torch.softmax(F0, -1)
        HC = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    I = torch.einsum("iap,iab,ibq->pq", J, HC, J) / N
    return {"H": H.numpy(), "I": I.numpy(), "S": (H - I).numpy()}


def _loss(F: torch.Tensor, Y: torch.Tensor, loss: str) -> torch.Tensor:
    """C = (1/N) Σ c(f_i, y_i): ½‖f − y‖² or −y·log softmax f (Y one-hot)."""
    if loss == "mse":
        return 0.5 * ((F - Y) ** 2).sum() / F.shape[0]
    return -(Y * torch.log_softmax(F, -1)).sum() / F.shape[0]


# ----------------------------------------------------------------------------- weight_norm


def _wn_net(kind: str) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    if kind == "hook":
        net[0] = torch.nn.utils.weight_norm(net[0])
    else:
        net[0] = torch.nn.utils.parametrizations.weight_norm(net[0])
    return net


def _wn_reference(net: nn.Module, X: torch.Tensor, Y: torch.Tensor, loss: str) -> dict[str, np.ndarray]:
    """The weight-normed network spelled out: W = g · v / ‖v_row‖, in ``named_parameters`` order."""
    names = [n for n, _ in net.named_parameters()]
    params = dict(net.named_parameters())
    shapes = [params[n].shape for n in names]
    sizes = [params[n].numel() for n in names]
    theta0 = torch.cat([params[n].detach().reshape(-1) for n in names])

    def F(theta):
        p = {n: t.view(s) for n, t, s in zip(names, theta.split(sizes), shapes)}
        g = next(p[n] for n in names if n.endswith(("weight_g", "original0")))  # (5, 1)
        v = next(p[n] for n in names if n.endswith(("weight_v", "original1")))  # (5, 3)
        W = v * (g / v.norm(dim=1, keepdim=True))
        return torch.tanh(X @ W.T + p["0.bias"]) @ p["2.weight"].T + p["2.bias"]

    return _parts_reference(lambda t: _loss(F(t), Y, loss), F, theta0, loss)


@pytest.mark.parametrize("kind", ["hook", "parametrization"])
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_weight_norm_parts_match_the_spelled_out_network(kind: str, loss: str) -> None:
    """H, I and S of a weight-normed layer: before, H and S raised torch's NotImplementedError (no
    forward AD for _weight_norm_interface); torch's own double backward is 8.6 off a finite difference."""
    net = _wn_net(kind)
    X = torch.randn(7, 3, dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 0, 1, 0, 0])
    Y = torch.randn(7, 2, dtype=torch.float64) if loss == "mse" else labels
    Yt = Y if loss == "mse" else torch.nn.functional.one_hot(labels, 2).double()
    ref = _wn_reference(net, X, Yt, loss)
    for part, op in zip("HIS", hessian_parts(net, X, Y, loss=loss)):
        _assert_rel(_dense(op), ref[part], f"{kind} weight_norm {loss}: {part}")


def test_weight_norm_output_traces_give_tr_S() -> None:
    """The probe values ``zᵀ ∇²_θ f_k(x_i) z`` behind G (and Tr S) of a weight-normed network, per
    probe against the spelled-out network's dense output Hessians: before, a ModelForwardError (no
    forward AD for _weight_norm_interface)."""
    net = _wn_net("parametrization")
    X = torch.randn(4, 3, dtype=torch.float64)
    tr = output_hessian_traces(net, X, n_probes=3, seed=1)
    names = [n for n, _ in net.named_parameters()]
    params = dict(net.named_parameters())
    sizes = [params[n].numel() for n in names]
    theta0 = torch.cat([params[n].detach().reshape(-1) for n in names])
    Z = torch.as_tensor(rademacher(np.random.default_rng(1), theta0.numel(), 3))

    def F(theta):
        p = {n: t.view(params[n].shape) for n, t in zip(names, theta.split(sizes))}
        v, g = p["0.parametrizations.weight.original1"], p["0.parametrizations.weight.original0"]
        W = v * (g / v.norm(dim=1, keepdim=True))
        return torch.tanh(X @ W.T + p["0.bias"]) @ p["2.weight"].T + p["2.bias"]

    Hf = jacrev(jacrev(F))(theta0)  # (N, K, P, P)
    ref = torch.einsum("ikpq,pm,qm->mik", Hf, Z, Z).numpy()
    _assert_rel(tr.per_probe, ref, "zᵀ∇²f z of a weight-normed network")


# ----------------------------------------------------------------------------- Embedding(padding_idx)


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 3, padding_idx=0)
        self.out = nn.Linear(3, 2)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(t)).mean(1))


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_embedding_padding_row_is_a_constant(loss: str) -> None:
    """H, I and S of an embedding model with padding_idx: autograd trains no padding row, so the
    reference holds it fixed.  Before: forward mode moved it — H 0.77 relative off, asymmetric."""
    torch.manual_seed(0)
    net = _Bag().double()
    with torch.no_grad():
        net.emb.weight[0] = torch.randn(3)  # a padding row that is not zero: its value matters
    T = torch.tensor([[0, 1, 2], [3, 0, 0], [4, 5, 1], [0, 0, 0], [2, 2, 3]])
    labels = torch.tensor([0, 1, 1, 0, 1])
    Y = torch.randn(5, 2, dtype=torch.float64) if loss == "mse" else labels
    Yt = Y if loss == "mse" else torch.nn.functional.one_hot(labels, 2).double()
    names = [n for n, _ in net.named_parameters()]
    params = {n: p.detach() for n, p in net.named_parameters()}
    sizes = [p.numel() for p in params.values()]
    theta0 = torch.cat([p.reshape(-1) for p in params.values()])
    pad_row = params["emb.weight"][0].clone()

    def F(theta):
        p = {n: t.view(params[n].shape) for n, t in zip(names, theta.split(sizes))}
        W = torch.cat([pad_row[None], p["emb.weight"][1:]])  # the padding row: a constant
        return torch.tanh(W[T]).mean(1) @ p["out.weight"].T + p["out.bias"]

    ref = _parts_reference(lambda t: _loss(F(t), Yt, loss), F, theta0, loss)
    for part in "HIS":
        _assert_rel(_dense(hessian_operator(net, T, Y, part=part, loss=loss)), ref[part], f"padding_idx {loss}: {part}")


# ----------------------------------------------------------------------------- gauss_newton_eigenvalues and state


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3)).double()
    with torch.no_grad():
        net[1].running_mean.uniform_(-1, 1)
        net[1].running_var.uniform_(0.5, 2)
    return net.train()


def test_gauss_newton_eigenvalues_leave_batch_norm_buffers_alone() -> None:
    """Cross-entropy I of a train-mode BatchNorm network from the Gram: before, its extra forward
    updated the user's running statistics (and num_batches_tracked)."""
    net = _bn_net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    X = torch.randn(6, 3, dtype=torch.float64)
    labels = torch.tensor([0, 2, 1, 1, 0, 2])
    mu = gauss_newton_eigenvalues(net, X, labels, loss="cross_entropy")
    changed = [k for k, v in net.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed, f"gauss_newton_eigenvalues changed the model's buffers {changed}"

    ref_net = copy.deepcopy(net)
    names = [n for n, _ in ref_net.named_parameters()]
    params = {n: p.detach() for n, p in ref_net.named_parameters()}
    sizes = [p.numel() for p in params.values()]
    theta0 = torch.cat([p.reshape(-1) for p in params.values()])

    def F(theta):  # the batch forward: train-mode batch statistics, no running-statistics writes
        p = {n: t.view(params[n].shape) for n, t in zip(names, theta.split(sizes))}
        h = X @ p["0.weight"].T + p["0.bias"]
        h = (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + ref_net[1].eps) * p["1.weight"] + p["1.bias"]
        return torch.tanh(h) @ p["3.weight"].T + p["3.bias"]

    Yt = torch.nn.functional.one_hot(labels, 3).double()
    ref = _parts_reference(lambda t: _loss(F(t), Yt, "cross_entropy"), F, theta0, "cross_entropy")
    lam = np.sort(np.linalg.eigvalsh(ref["I"]))[::-1][: mu.size]
    _assert_rel(mu, lam, "eigenvalues of I (train-mode BatchNorm, cross-entropy)")


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_gauss_newton_eigenvalues_refuse_train_mode_spectral_norm(loss: str) -> None:
    """A train-mode spectral_norm runs a power iteration in every forward (another function each
    time): the operators refuse it, and so must I's spectrum from the Gram — before, it returned
    eigenvalues and (cross-entropy) moved the user's ``_u``/``_v``."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    net[0] = torch.nn.utils.parametrizations.spectral_norm(net[0])
    X = torch.randn(5, 3, dtype=torch.float64)
    Y = torch.randn(5, 2, dtype=torch.float64) if loss == "mse" else torch.tensor([0, 1, 1, 0, 1])
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match="_SpectralNorm"):
        hessian_operator(net, X, Y, part="I", loss=loss)
    with pytest.raises(UnsupportedModelError, match="_SpectralNorm"):
        gauss_newton_eigenvalues(net, X, Y, loss=loss)
    changed = [k for k, v in net.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed, f"the refusal changed the model's buffers {changed}"


# ----------------------------------------------------------------------------- no forward-mode rule


class _Cube(torch.autograd.Function):
    """x³ with a (twice-differentiable) backward and no jvp: forward mode cannot run it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x**3

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 - torch's protocol
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


class _CubeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_Cube.apply(torch.tanh(self.a(x))))


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_an_op_without_forward_mode_falls_back_to_reverse_mode(loss: str) -> None:
    """H, I, S of a model with a custom autograd.Function without jvp: before, each product raised
    torch's "You must implement the jvp function" (as a ModelForwardError)."""
    torch.manual_seed(0)
    net = _CubeNet().double()
    X = torch.randn(6, 3, dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 0, 1, 0])
    Y = torch.randn(6, 2, dtype=torch.float64) if loss == "mse" else labels
    Yt = Y if loss == "mse" else torch.nn.functional.one_hot(labels, 2).double()
    names = [n for n, _ in net.named_parameters()]
    params = {n: p.detach() for n, p in net.named_parameters()}
    sizes = [p.numel() for p in params.values()]
    theta0 = torch.cat([p.reshape(-1) for p in params.values()])

    def F(theta):  # x³ spelled out
        p = {n: t.view(params[n].shape) for n, t in zip(names, theta.split(sizes))}
        return torch.tanh(X @ p["a.weight"].T + p["a.bias"]) ** 3 @ p["b.weight"].T + p["b.bias"]

    ref = _parts_reference(lambda t: _loss(F(t), Yt, loss), F, theta0, loss)
    for part, op in zip("HIS", hessian_parts(net, X, Y, loss=loss)):
        _assert_rel(_dense(op), ref[part], f"custom Function without jvp, {loss}: {part}")


class _LopsidedProduct(torch.autograd.Function):
    """a·b with no jvp and a backward that hides b from a's gradient's own derivative (``b.detach()``):
    its reverse-over-reverse second derivative is not symmetric (∂g_a/∂b = 0, ∂g_b/∂a = g)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 - torch's protocol
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        a, b = ctx.saved_tensors
        return g * b.detach(), g * a


class _LopsidedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(_LopsidedProduct.apply(torch.tanh(self.a(x)), torch.tanh(self.b(x))))


def test_reverse_mode_with_a_wrong_double_backward_is_refused() -> None:
    """Without forward mode the products rest on PyTorch's double backward; where that is wrong (H
    not symmetric) the operator refuses by name instead of returning a non-Hessian.  Before: torch's
    "You must implement the jvp function" as a ModelForwardError."""
    torch.manual_seed(0)
    net = _LopsidedNet().double()
    X = torch.randn(6, 3, dtype=torch.float64)
    Y = torch.randn(6, 2, dtype=torch.float64)
    for part in "HS":
        op = hessian_operator(net, X, Y, part=part)
        for _ in range(2):  # every later product too (was: only the first; the second returned the non-Hessian)
            with pytest.raises(UnsupportedModelError, match="not symmetric"):
                op.matmat(np.eye(4 * 3 + 4 + 4 * 3 + 4 + 2 * 4 + 2)[:, :3])


def test_class_indices_as_a_column_are_refused_with_the_fix_named() -> None:
    """Integer cross-entropy targets of shape (N, 1) (a data loader's column of labels) are refused
    with the shape to pass instead; before, only "Y must have K = 3 columns"."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    X = torch.randn(5, 3, dtype=torch.float64)
    labels = torch.tensor([[0], [2], [1], [1], [0]])
    with pytest.raises(ValueError, match=r"integer class indices go as shape \(N,\)"):
        hessian_operator(net, X, labels, loss="cross_entropy")


def test_float32_hook_weight_norm_measured_in_float64() -> None:
    """A float32 model with the hook-based ``torch.nn.utils.weight_norm`` measured in float64 (a cast
    copy; gauss_newton_eigenvalues always casts): before, torch's deepcopy error "Only Tensors
    created explicitly by the user (graph leaves) support the deepcopy protocol"."""
    net = _wn_net("hook").float()
    X = torch.randn(6, 3, dtype=torch.float64)
    Y = torch.randn(6, 2, dtype=torch.float64)
    ref = _wn_reference(_wn_net("hook").float().double(), X, Y, "mse")  # the same float32 values
    H = hessian_operator(net, X, Y, dtype=torch.float64)
    _assert_rel(_dense(H), ref["H"], "H of a float32 weight-normed network in float64")
    mu = gauss_newton_eigenvalues(net, X, Y)
    lam = np.sort(np.linalg.eigvalsh(ref["I"]))[::-1][: mu.size]
    _assert_rel(mu, lam, "eigenvalues of I of a float32 weight-normed network")


def test_a_failing_forward_is_named_as_the_hessian_it_broke():
    """The error names the measurement it broke (was "computing the NTK of …" for Hessian calls)."""
    from nsa_dist.errors import ModelForwardError

    calls = [0]  # outside the module: a measurement puts the module's own attributes back after each call

    class Breaks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 1).double()

        def forward(self, x):
            calls[0] += 1
            if calls[0] > 3:  # the probes pass; the products fail
                raise RuntimeError("boom")
            return self.lin(x)

    X, Y = torch.randn(4, 2, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)
    with pytest.raises(ModelForwardError, match=r"computing the loss Hessian of Breaks failed.*boom"):
        H = hessian_operator(Breaks(), X, Y, part="H")
        H.matmat(torch.eye(3, dtype=torch.float64))
