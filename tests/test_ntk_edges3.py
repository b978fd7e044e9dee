"""Edge cases of the NTK routes found by an adversarial trial: a convolution subclass that overrides
``_conv_forward``, forwards whose outputs depend on the batch's size, buffers reassigned by the
forward, sparse embeddings, in-place writes into the input, and train-mode instance norms that
track running statistics.

Every kernel is compared with a float64 reference from plain ``torch.autograd``: one gradient per
output of the full-batch forward (the kernel of the batch forward, as :func:`nsa_dist.ntk.gram`
defines it) — no torch.func."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.ntk import explain_method, gram, jacobian_vector_product, ntk_operator, resolve_route
from nsa_dist.ntk.blocks import block_features

D = torch.float64


def _jacobian(model: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """(N, K, P): the Jacobian of the full-batch forward, one autograd.grad per output."""
    ps = [p for p in model.parameters() if p.requires_grad]
    out = model(X.clone()).reshape(len(X), -1)
    rows = []
    for i in range(len(X)):
        for a in range(out.shape[1]):
            g = torch.autograd.grad(out[i, a], ps, retain_graph=True, allow_unused=True)
            rows.append(
                torch.cat([(t.to_dense() if t is not None else torch.zeros_like(p)).reshape(-1) for t, p in zip(g, ps)])
            )
    return torch.stack(rows).view(len(X), out.shape[1], -1)


def _reference(model: nn.Module, X: torch.Tensor, full: bool = False) -> torch.Tensor:
    J = _jacobian(model, X)
    return torch.einsum("iap,jbp->iajb", J, J) if full else torch.einsum("iap,jap->ij", J, J)


def _err(G: torch.Tensor, R: torch.Tensor) -> float:
    return float((torch.as_tensor(G) - R).abs().max() / R.abs().max())


def _blocks_gram(model: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """G assembled from the block features of two ranges of points (the gang layouts' pieces)."""
    n = len(X)
    feats = block_features(model, X, [(0, n // 3), (n // 3, n)])
    pairs = zip(*[[(torch.as_tensor(A), torch.as_tensor(B)) for A, B in f] for f in feats], strict=True)
    return sum(
        (A @ A.T) * (B @ B.T) for A, B in ((torch.cat([a for a, _ in p]), torch.cat([b for _, b in p])) for p in pairs)
    )


# ------------------------------------------------ 1. a convolution whose _conv_forward is overridden
class _ScaledConv1d(nn.Conv1d):
    """Stock ``forward``, overridden ``_conv_forward``: convolves with a transform of the weight
    (as weight standardisation, a pruning mask or a quantised weight do)."""

    def _conv_forward(self, input, weight, bias):
        return super()._conv_forward(input, 0.5 * torch.tanh(weight), bias)


def test_a_convolution_overriding_conv_forward_is_not_taken_for_the_stock_one():
    torch.manual_seed(0)
    model = nn.Sequential(_ScaledConv1d(2, 4, 3, dtype=D), nn.Tanh(), nn.Flatten(), nn.Linear(28, 2, dtype=D))
    X = torch.randn(6, 2, 9, dtype=D)
    _, routes = explain_method(model, X)
    assert routes["0.weight"][0] == "jacobian" and routes["0.weight"][1].startswith("known layer")
    R = _reference(model, X)
    assert _err(gram(model, X), R) < 1e-10  # the conv formula gave 2.5e-1
    assert _err(gram(model, X, kernel="full"), _reference(model, X, full=True)) < 1e-10
    assert _err(_blocks_gram(model, X), R) < 1e-10


# ------------------------------------------------ 2. outputs that depend on the batch's size
class _BranchOnSize(nn.Module):
    """Another nonlinearity for batches of more than 8 points (the probe forwards 4).  Its
    temperature has no per-layer formula: it takes the per-sample Jacobians, which forward one
    point at a time, next to the fast Linear layers, which forward whole chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6, dtype=D), nn.Linear(6, 2, dtype=D)
        self.t = nn.Parameter(torch.tensor(0.7, dtype=D))

    def forward(self, x):
        h = self.a(x) * self.t
        return self.b(torch.tanh(h) if x.shape[0] > 8 else torch.sin(h))


class _CentredPastFour(_BranchOnSize):
    """Centres its features over the batch, but only in batches of more than 4 points."""

    def forward(self, x):
        h = torch.tanh(self.a(x) * self.t)
        return self.b(h - h.mean(0) if x.shape[0] > 4 else h)


class _AloneDiffers(_BranchOnSize):
    """Its outputs for one point alone differ from those in any batch."""

    def forward(self, x):
        h = torch.tanh(self.a(x) * self.t)
        return self.b(h if x.shape[0] > 1 else 2 * h)


@pytest.mark.parametrize("make", [_BranchOnSize, _CentredPastFour, _AloneDiffers])
def test_a_forward_that_depends_on_the_batch_size_takes_the_batch_route(make):
    torch.manual_seed(0)
    model = make()
    X = torch.randn(12, 4, dtype=D)
    _, routes = explain_method(model, X)
    assert {path for path, _ in routes.values()} == {"batch"}, routes
    assert _err(gram(model, X), _reference(model, X)) < 1e-10  # 1.4e-2 .. 3.8e-1 before
    assert _err(gram(model, X, kernel="full"), _reference(model, X, full=True)) < 1e-10
    later = torch.randn(20, 4, dtype=D) * 2  # a later batch of the run, the route probed once on the first
    assert _err(gram(model, later, method=resolve_route(model, X)), _reference(model, later)) < 1e-10
    with pytest.raises(UnsupportedModelError, match="splits the points among its members"):
        block_features(model, X, [(0, 6), (6, 12)])


def test_a_model_whose_outputs_do_not_depend_on_the_batch_size_keeps_its_fast_route():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, dtype=D), nn.LayerNorm(6, dtype=D), nn.Tanh(), nn.Linear(6, 2, dtype=D))
    X = torch.randn(70, 4, dtype=D)
    method, routes = explain_method(model, X)
    assert method.value == "per_layer" and "batch" not in {p for p, _ in routes.values()}
    assert _err(gram(model, X), _reference(model, X)) < 1e-10


# ------------------------------------------------ 3. buffers the forward reassigns
class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2, dtype=D)
        self.register_buffer("calls", torch.zeros((), dtype=D))

    def forward(self, x):
        self.calls = self.calls + 1  # a new tensor in the buffer's slot, not an in-place write
        return self.lin(x)


class _EMA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2, dtype=D)
        self.register_buffer("mu", torch.zeros(4, dtype=D))

    def forward(self, x):
        self.mu = 0.9 * self.mu + 0.1 * x.mean(0).detach()
        return self.lin(x - self.mu)


def test_a_reassigned_buffer_is_put_back_and_a_stateful_forward_is_named():
    torch.manual_seed(0)
    X = torch.randn(6, 4, dtype=D)
    model = _Counter()
    R = _reference(copy.deepcopy(model), X)
    calls = model.calls
    assert _err(gram(model, X), R) < 1e-10
    assert model.calls is calls and float(model.calls) == 0.0  # 9.0 before: the measurement changed the model
    ema = _EMA()
    with pytest.raises(UnsupportedModelError, match=r"changes its state.*'mu' \(_EMA\)"):
        gram(ema, X)  # before: "the model's forward is random"
    assert float(ema.mu.abs().max()) == 0.0


# ------------------------------------------------ 4. sparse embeddings
class _SparseEmbedding(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.e = nn.Embedding(7, 3, sparse=True, dtype=D)
        self.h = nn.Linear(3, 7, dtype=D)
        if tied:
            self.h.weight = self.e.weight

    def forward(self, ids):
        return self.h(torch.tanh(self.e(ids)).mean(1))[:, :2]


@pytest.mark.parametrize("tied", [False, True])
def test_a_sparse_embedding_gives_the_dense_kernel(tied):
    torch.manual_seed(0)
    model = _SparseEmbedding(tied)
    ids = torch.randint(0, 7, (6, 4))
    R = _reference(model, ids)
    assert _err(gram(model, ids), R) < 1e-10  # before: NotImplementedError (aten::max on SparseCPU)
    assert _err(ntk_operator(model, ids).to_dense(), R) < 1e-10
    assert _err(_blocks_gram(model, ids), R) < 1e-10
    assert model.e.sparse  # left as it was


# ------------------------------------------------ 5. a forward that writes into its input
class _ClampInPlace(nn.Module):
    """Clamps its images to [0, 1] in place: a no-op on points already in range, which the probe
    lets pass, but a write into a tensor torch.func captured."""

    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        self.c = nn.Conv2d(1, 2, 3, dtype=D)
        self.bn = nn.BatchNorm2d(2, dtype=D) if bn else nn.Identity()
        self.h = nn.Linear(18, 2, dtype=D)

    def forward(self, x):
        x.clamp_(0, 1)
        return self.h(torch.tanh(self.bn(self.c(x))).flatten(1))


@pytest.mark.parametrize("bn", [False, True], ids=["per_layer", "batch"])
def test_an_in_place_write_into_the_input_runs_on_every_product(bn):
    torch.manual_seed(0)
    model = _ClampInPlace(bn)
    X = torch.rand(6, 1, 5, 5, dtype=D)
    R = _reference(model, X)
    assert _err(gram(model, X), R) < 1e-10
    assert _err(ntk_operator(model, X).to_dense(), R) < 1e-10  # before: "would mutate a captured Tensor"
    dtheta = torch.randn(sum(p.numel() for p in model.parameters()), dtype=D)
    want = _jacobian(model, X).reshape(len(X) * 2, -1) @ dtheta
    got = jacobian_vector_product(model, X, dtheta)
    assert _err(got.reshape(-1), want) < 1e-10


# ------------------------------------------------ 6. train-mode instance norm tracking statistics
def test_train_mode_instance_norm_with_running_statistics_in_the_operator():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, dtype=D),
        nn.InstanceNorm2d(4, affine=True, track_running_stats=True, dtype=D),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(36, 2, dtype=D),
    ).train()
    X = torch.randn(6, 2, 5, 5, dtype=D)
    before = model[1].running_mean.clone()
    R = _reference(model, X)
    model[1].running_mean.copy_(before)
    # before: "the model's forward modifies its buffer '1.running_mean' (InstanceNorm2d) in place"
    assert _err(ntk_operator(model, X).to_dense(), R) < 1e-10
    assert _err(gram(model, X), R) < 1e-10
    assert torch.equal(model[1].running_mean, before)


def test_functional_reference_helper_is_the_dense_jacobian():
    """The helper itself against torch.func on a plain model (guards the references above)."""
    from torch.func import functional_call, jacrev

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5, dtype=D), nn.Tanh(), nn.Linear(5, 2, dtype=D))
    X = torch.randn(4, 3, dtype=D)
    jac = jacrev(lambda p: functional_call(model, p, (X,)))(dict(model.named_parameters()))
    J = torch.cat([j.reshape(4, 2, -1) for j in jac.values()], 2)
    assert torch.allclose(_jacobian(model, X), J, rtol=1e-12, atol=0)
    assert F.mse_loss(_reference(model, X), torch.einsum("iap,jap->ij", J, J)) < 1e-24


# ------------------------------------------------ 7. matrix-free products where torch.func has no rule
class _RBF(nn.Module):
    """Distances to learnable centres: cdist has no forward-mode rule and a silently wrong batched VJP."""

    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        self.l = nn.Linear(3, 4, dtype=D)
        self.c = nn.Parameter(torch.randn(5, 4, dtype=D))
        self.bn = nn.BatchNorm1d(4, dtype=D) if bn else nn.Identity()
        self.o = nn.Linear(5, 2, dtype=D)

    def forward(self, x):
        return self.o(torch.exp(-(torch.cdist(self.bn(torch.tanh(self.l(x))), self.c) ** 2)))


class _PackedGRU(nn.Module):
    """A GRU over packed sequences (torch.func cannot run pack_padded_sequence at all)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(4, 5, batch_first=True, dtype=D)
        self.head = nn.Linear(5, 2, dtype=D)

    def forward(self, x):
        lengths = (x.abs().sum(-1) != 0).sum(1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        return self.head(self.rnn(packed)[1][-1])


class _Square(torch.autograd.Function):  # no setup_context: torch.func refuses it
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class _OldStyleFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 6, dtype=D), nn.Linear(6, 2, dtype=D)

    def forward(self, x):
        return self.b(_Square.apply(torch.tanh(self.a(x))))


def _packed_points() -> torch.Tensor:
    x = torch.randn(6, 3, 4, dtype=D)
    x[1, 2:] = 0
    x[3, 1:] = 0
    return x


CASES = {
    "cdist": (lambda: _RBF(), lambda: torch.randn(7, 3, dtype=D)),
    "cdist_batch_norm": (lambda: _RBF(bn=True).train(), lambda: torch.randn(7, 3, dtype=D)),
    "packed_gru": (_PackedGRU, _packed_points),
    "autograd_function": (_OldStyleFunction, lambda: torch.randn(7, 3, dtype=D)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("block", [None, 2])
def test_the_operator_falls_back_to_plain_autograd(name, block):
    torch.manual_seed(0)
    make, points = CASES[name]
    model, X = make(), points()
    J = _jacobian(model, X)
    for kernel in ("trace", "full"):
        op = ntk_operator(model, X, kernel=kernel, block_size=block)
        R = _reference(model, X, full=kernel == "full")
        R = R.reshape(op.shape) if kernel == "full" else R
        assert _err(op.to_dense(), R) < 1e-10  # before: no forward-mode rule / no storage / no setup_context
    # Jᵀ V alone (a matrix_free shard's half of a product): cdist's batched VJP was 1e-1..3e-1 off
    op = ntk_operator(model, X, block_size=block)
    V = torch.randn(len(X), 3, dtype=D)
    U = op.jt(V)
    got = torch.cat([u.reshape(u.shape[0], -1) for u in U.values()], 1)
    assert _err(got, torch.einsum("iap,im->map", J, V).reshape(-1, J.shape[2])) < 1e-10
