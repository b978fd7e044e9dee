"""A measurement leaves the user's module's own attributes as it found them (session 26).

The probe and the routes run forwards of the user's model inside ``preserved``, which put back its
buffers but not its Python attributes.  A forward that grows a cache (a position table re-registered
as a longer buffer, its length kept in an int, as the rotary embeddings of transformers did) was left
with the int of the probe's points and the buffer of the entry: ``gram`` itself failed in its next
forward ("the size of tensor a (6) must match the size of tensor b (2)").  A counter counted the
probe's forwards, and a Glow ActNorm refused by the probe kept its flag set when the flag was a
plain tensor attribute or a dict item.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.hessian import hessian_parts
from nsa_dist.ntk import gram, jacobian_vector_product, ntk_operator

F64 = torch.float64


class Positions(nn.Module):
    """A position table kept as a buffer and grown — re-registered — when a longer input comes."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim, self.cached = dim, 2
        self.register_buffer("table", self._table(2), persistent=False)

    def _table(self, n: int) -> torch.Tensor:
        pos = torch.arange(n, dtype=F64)[:, None]
        return torch.sin(pos / (1 + torch.arange(self.dim, dtype=F64)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, dim)
        if x.shape[1] > self.cached:
            self.cached = x.shape[1]
            self.register_buffer("table", self._table(x.shape[1]), persistent=False)
        return x + self.table[: x.shape[1]]


class Grows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos, self.a, self.b = Positions(3), nn.Linear(3, 5), nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(self.pos(x)))).sum(1)


def _reference_gram(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model = copy.deepcopy(model)  # its forwards grow its cache: the user's model stays as it is
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(model(x[i : i + 1]).sum(), params)])
        for i in range(x.shape[0])
    ]
    J = torch.stack(rows)
    return J @ J.T


def test_a_forward_that_grows_its_cache_is_measured_and_left_as_it_was() -> None:
    torch.manual_seed(0)
    m = Grows().double()
    x = torch.randn(5, 6, 3, dtype=F64)
    ref = _reference_gram(m, x)
    G = torch.as_tensor(gram(m, x))  # failed: the probe left cached = 6 with the 2-row table
    err = float((G - ref).abs().max() / ref.abs().max())
    assert err < 1e-12, f"gram off per-sample autograd by {err:.3g}"
    G_op = torch.as_tensor(ntk_operator(m, x).matmat(torch.eye(5, dtype=F64)))
    err = float((G_op - ref).abs().max() / ref.abs().max())
    assert err < 1e-12, f"ntk_operator off per-sample autograd by {err:.3g}"
    assert (m.pos.cached, tuple(m.pos.table.shape)) == (2, (2, 3)), (
        f"the model's cache was left at cached = {m.pos.cached} with a table of {tuple(m.pos.table.shape)}"
    )
    assert m(torch.randn(2, 4, 3, dtype=F64)).shape == (2, 1)  # the user's next forward, a length between


class Counts(nn.Module):
    """A forward that counts its calls (bookkeeping the output does not read)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.calls = nn.Linear(3, 6), nn.Linear(6, 1), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.b(torch.tanh(self.a(x))).squeeze(-1)


def test_the_probes_forwards_are_not_counted_by_the_users_counter() -> None:
    torch.manual_seed(0)
    m = Counts().double()
    x, y = torch.randn(8, 3, dtype=F64), torch.randn(8, 1, dtype=F64)
    P = sum(p.numel() for p in m.parameters())
    calls = []
    gram(m, x)
    calls.append(("gram", m.calls))
    ntk_operator(m, x).matmat(torch.eye(8, dtype=F64))
    calls.append(("ntk_operator", m.calls))
    jacobian_vector_product(m, x, torch.randn(P, dtype=F64))
    calls.append(("jacobian_vector_product", m.calls))
    for part in hessian_parts(m, x, y):
        part.matmat(torch.eye(P, dtype=F64)[:, :3])
    calls.append(("hessian_parts", m.calls))
    assert all(c == 0 for _, c in calls), f"the user's counter after each call: {calls}"


class FlaggedActNorm(nn.Module):
    """Glow's ActNorm with its flag as a tensor attribute (not a buffer) or a dict item."""

    def __init__(self, flag: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 6), nn.Linear(6, 1)
        self.loc, self.logs = nn.Parameter(torch.zeros(6)), nn.Parameter(torch.zeros(6))
        self.flag = flag
        self.done = torch.tensor(False) if flag == "tensor" else {"initialized": False}

    def initialized(self) -> bool:
        return bool(self.done) if self.flag == "tensor" else self.done["initialized"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if not self.initialized():
            with torch.no_grad():
                self.loc.data.copy_(-h.mean(0))
                self.logs.data.copy_(-torch.log(h.std(0) + 1e-6))
            if self.flag == "tensor":
                self.done.fill_(True)
            else:
                self.done["initialized"] = True
        return self.b(torch.tanh((h + self.loc) * torch.exp(self.logs))).squeeze(-1)


@pytest.mark.parametrize("flag", ["tensor", "dict"])
def test_a_refused_actnorm_gets_its_flag_back_when_it_is_a_tensor_or_a_dict_item(flag: str) -> None:
    torch.manual_seed(0)
    m = FlaggedActNorm(flag).double()
    x = torch.randn(16, 3, dtype=F64)
    with pytest.raises(UnsupportedModelError, match=r"writes its own parameters \('loc', 'logs'"):
        gram(m, x)
    assert not m.initialized(), f"the refused probe left the {flag} flag set"
    assert float(m.loc.detach().abs().max()) == 0.0 and float(m.logs.detach().abs().max()) == 0.0
    m(x)  # the user's first batch initialises it: then measured, and the flag stays set
    assert m.initialized()
    gram(m, x)
    assert m.initialized()


def test_a_lazy_module_keeps_the_sizes_its_first_forward_gave_it() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 1)).double()
    x = torch.randn(6, 3, dtype=F64)
    m(x)
    ref = _reference_gram(m, x)
    G = torch.as_tensor(gram(m, x))
    assert float((G - ref).abs().max() / ref.abs().max()) < 1e-12
    assert m[0].in_features == 3 and m(x).shape == (6, 1)


class Lookup(nn.Module):
    """A token table looked up functionally with a max_norm: every forward renormalises its rows in place."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4) * 3)
        self.head = nn.Linear(4, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(torch.nn.functional.embedding(idx, self.table, max_norm=1.0))).sum(1)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_a_functional_max_norm_lookup_is_measured_as_an_embedding_with_max_norm_is() -> None:
    """It was refused as "writes its own parameters" (a review): it is renormalised as nn.Embedding's is."""
    torch.manual_seed(0)
    m = Lookup().double()
    x, y = torch.randint(0, 10, (6, 3)), torch.randn(6, 1, dtype=F64)
    entry = m.table.detach().clone()
    ref = _reference_gram(m, x)  # on a copy, renormalised by its first forward as the user's own would be
    for name, G in [("gram", gram(m, x)), ("ntk_operator", ntk_operator(m, x).matmat(torch.eye(6, dtype=F64)))]:
        err = float((torch.as_tensor(G) - ref).abs().max() / ref.abs().max())
        assert err < 1e-12, f"{name} off per-sample autograd by {err:.3g}"
    # the loss Hessian against double backward on a renormalised copy
    twin = copy.deepcopy(m)
    twin(x)
    params = list(twin.parameters())
    g = torch.cat(
        [t.reshape(-1) for t in torch.autograd.grad(0.5 * ((twin(x) - y) ** 2).mean(), params, create_graph=True)]
    )
    H = torch.stack(
        [torch.cat([t.reshape(-1) for t in torch.autograd.grad(gi, params, retain_graph=True)]) for gi in g]
    )
    got = torch.as_tensor(hessian_parts(m, x, y)[0].matmat(torch.eye(H.shape[0], dtype=F64)))
    err = float((got - H).abs().max() / H.abs().max())
    assert err < 1e-10, f"H off double backward by {err:.3g} of max|H|"
    assert torch.equal(m.table.detach(), entry), "the user's table was renormalised by the measurement"


class Filter(nn.Module):
    """A Fourier filter: a complex weight on the rfft of a hidden layer (registered first)."""

    def __init__(self, trainable: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, dtype=torch.complex128), requires_grad=trainable)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(10, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.fft.rfft(torch.tanh(self.a(x)), dim=-1) * self.w
        return self.b(torch.cat([torch.fft.irfft(h, n=8, dim=-1), h.abs()[:, :2]], -1)).squeeze(-1)


def test_complex_parameters_are_refused_by_name_and_a_frozen_one_is_measured() -> None:
    """A complex parameter registered first made the points complex (its dtype was taken for the model's)
    and the first Linear failed, blamed; real points now stay real.  A trainable complex parameter is
    refused: the Gram took its gradients' product without a conjugate (5 % off the kernel over its
    real and imaginary parts, returned complex)."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 8, dtype=F64), torch.randn(6, 1, dtype=F64)
    m = Filter(trainable=True).double()
    for call_ in (lambda: gram(m, x), lambda: hessian_parts(m, x, y)):
        with pytest.raises(UnsupportedModelError, match=r"complex trainable parameters \('w'\).*torch\.complex"):
            call_()
    m = Filter(trainable=False).double()
    ref = _reference_gram(m, x)
    G = torch.as_tensor(gram(m, x))
    assert G.dtype == F64, f"the Gram came back {G.dtype}"
    err = float((G - ref).abs().max() / ref.abs().max())
    assert err < 1e-12, f"gram off per-sample autograd by {err:.3g}"


class Shifted(nn.Module):
    """ActNorm with its shift in a plain attribute set from the first batch (not a parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.loc = nn.Linear(3, 6), nn.Linear(6, 1), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.loc is None:
            self.loc = -h.mean(0).detach()
        return self.b(torch.tanh(h + self.loc)).squeeze(-1)


class Masked(nn.Module):
    """A mask of the input recomputed by every call and kept on the module (read by the next layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.mask = nn.Linear(3, 6), nn.Linear(6, 1), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mask = (x[:, :1] > 0).to(x.dtype)
        return self.b(torch.tanh(self.a(x)) * (1 + self.mask)).squeeze(-1)


def test_an_attribute_initialised_from_the_first_batch_is_refused_and_a_recomputed_one_measured() -> None:
    """Every measurement puts attributes back, so a shift set from the data on the first call was set again
    from each block of points (a kernel that moved 18 % with the block size, a review): refused by name
    until the user's own first forward sets it.  A value every call recomputes is not an initialisation."""
    torch.manual_seed(0)
    x = torch.randn(16, 3, dtype=F64)
    m = Shifted().double()
    with pytest.raises(UnsupportedModelError, match=r"sets 'loc' from its input on its first call"):
        gram(m, x)
    assert m.loc is None, "the refused probe left the shift set"
    m(x)  # the user's first batch
    ref = _reference_gram(m, x)
    for name, G in [
        ("gram", gram(m, x)),
        ("block 4", ntk_operator(m, x, block_size=4).matmat(torch.eye(16, dtype=F64))),
    ]:
        err = float((torch.as_tensor(G) - ref).abs().max() / ref.abs().max())
        assert err < 1e-12, f"{name} off per-sample autograd by {err:.3g}"
    m = Masked().double()
    ref = _reference_gram(m, x)
    err = float((torch.as_tensor(gram(m, x)) - ref).abs().max() / ref.abs().max())
    assert err < 1e-12, f"a recomputed mask: gram off per-sample autograd by {err:.3g}"


class Graph(nn.Module):
    """A GCN over its fixed graph, the normalised adjacency kept as a (small) sparse attribute."""

    def __init__(self, adj: torch.Tensor) -> None:
        super().__init__()
        self.adj, self.a, self.b = adj, nn.Linear(3, 6), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(torch.sparse.mm(self.adj, self.a(x)))).squeeze(-1)


def test_a_sparse_tensor_attribute_is_kept_by_reference() -> None:
    """Comparing a small sparse attribute's values failed every measurement ("Could not run 'aten::eq.Tensor'
    … SparseCPU", a review)."""
    torch.manual_seed(0)
    n = 12
    A = ((torch.rand(n, n) < 0.3).double() + torch.eye(n, dtype=F64)).clamp(max=1)
    A = A / A.sum(1, keepdim=True)
    m = Graph(A.to_sparse()).double()
    G = torch.as_tensor(gram(m, torch.randn(n, 3, dtype=F64)))
    assert G.shape == (n, n) and bool(torch.isfinite(G).all())


def test_a_frozen_complex_parameter_stays_complex_in_a_float64_copy() -> None:
    """A float32 model measured with dtype=float64 is a cast copy: Module.to(float64) dropped the complex
    filter's imaginary part (the kernel 41 % off, a review)."""
    torch.manual_seed(0)
    m = Filter(trainable=False)  # float32, the filter complex128
    m.w.data = m.w.data.to(torch.complex64)
    x = torch.randn(6, 8)
    twin = copy.deepcopy(m).double()
    twin.w.data = m.w.data.to(torch.complex128)  # complex kept complex, by hand
    ref = _reference_gram(twin, x.double())
    G = torch.as_tensor(gram(m, x, dtype=F64))
    err = float((G - ref).abs().max() / ref.abs().max())
    assert err < 1e-6, f"gram of the float64 copy off by {err:.3g}"  # (x and the weights were float32)
    assert m.w.dtype == torch.complex64


def test_a_tracker_built_on_a_model_leaves_its_state_as_it_was(tmp_path) -> None:
    """Tracker(...) ran one forward outside any measurement: a train-mode norm's running statistics moved
    and a counter counted it (a review)."""
    import numpy as np

    from nsa_dist import Tracker

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Conv1d(1, 3, 3, padding=1)
            self.n = nn.InstanceNorm1d(3, track_running_stats=True, affine=True)
            self.o, self.calls = nn.Linear(24, 1), 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.o(torch.tanh(self.n(self.c(x[:, None]))).flatten(1))

    rng = np.random.default_rng(0)
    X = rng.standard_normal((32, 8)).astype(np.float32)
    torch.manual_seed(0)
    m = Net().train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    tracker = Tracker(
        str(tmp_path / "t.zarr"), "t", m, X, X[:, :1].copy(), steps=2, record={"every": 1}, spectrum={"k": 4}
    )
    try:
        changed = [k for k, v in m.state_dict().items() if not torch.equal(v, before[k])]
        assert not changed and m.calls == 0, f"Tracker(...) changed {changed}, calls {m.calls}"
    finally:
        tracker.stop("enough")


def test_j_dtheta_of_a_model_with_a_complex_parameter_is_refused_by_name() -> None:
    """dθ is a real vector over every parameter: a complex one took a complex dθ, or failed in torch's words."""
    torch.manual_seed(0)
    m = Filter(trainable=True).double()
    P = sum(p.numel() for p in m.parameters())
    with pytest.raises(UnsupportedModelError, match=r"complex parameters \('w'\)"):
        jacobian_vector_product(m, torch.randn(6, 8, dtype=F64), torch.randn(P, dtype=F64))


class ShiftedIn(nn.Module):
    """The shift of Shifted kept in a dict, or in a buffer registered as None."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.a, self.b, self.where = nn.Linear(3, 6), nn.Linear(6, 1), where
        self.stats: dict = {}
        self.register_buffer("loc", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.where == "dict":
            if "loc" not in self.stats:
                self.stats["loc"] = -h.mean(0).detach()
            loc = self.stats["loc"]
        else:
            if self.loc is None:
                self.loc = -h.mean(0).detach()
            loc = self.loc
        return self.b(torch.tanh(h + loc)).squeeze(-1)


class KeepsFirstBatch(nn.Module):
    """Keeps its first batch for a plot; the outputs never read it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.example = nn.Linear(3, 6), nn.Linear(6, 1), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.example is None:
            self.example = x[:1].detach()
        return self.b(torch.tanh(self.a(x))).squeeze(-1)


@pytest.mark.parametrize("where", ["dict", "buffer"])
def test_an_initialisation_kept_in_a_dict_or_a_buffer_is_refused_too(where: str) -> None:
    """A review: in a dict item the operator's kernel moved 8.9 % between block sizes, in a buffer
    registered as None gram and the operator differed by 2.8 %."""
    torch.manual_seed(0)
    m = ShiftedIn(where).double()
    with pytest.raises(UnsupportedModelError, match=r"from its input on its first call and keeps it"):
        gram(m, torch.randn(16, 3, dtype=F64))
    assert not m.stats and m.loc is None


def test_a_first_batch_kept_but_not_read_is_measured() -> None:
    torch.manual_seed(0)
    m, x = KeepsFirstBatch().double(), torch.randn(8, 3, dtype=F64)
    ref = _reference_gram(m, x)
    err = float((torch.as_tensor(gram(m, x)) - ref).abs().max() / ref.abs().max())
    assert err < 1e-12, f"gram off per-sample autograd by {err:.3g}"
    assert m.example is None


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_a_functional_max_norm_of_any_norm_type_is_measured() -> None:
    class P3(Lookup):
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            e = torch.nn.functional.embedding(idx, self.table, max_norm=1.0, norm_type=3.0)
            return self.head(torch.tanh(e)).sum(1)

    torch.manual_seed(0)
    m, x = P3().double(), torch.randint(0, 10, (6, 3))
    ref = _reference_gram(m, x)
    err = float((torch.as_tensor(gram(m, x)) - ref).abs().max() / ref.abs().max())
    assert err < 1e-12, f"gram off per-sample autograd by {err:.3g}"
