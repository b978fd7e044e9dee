"""NTK trial, 5th round: parametrized weights, padding and bag embeddings, state written or
parameters registered by a forward, fused and skip-initialised layers.

Every kernel is compared with the dense float64 reference — ``torch.func.jacrev`` of
``functional_call`` over the trainable parameters of an independent float64 build of the same
network, contracted by einsum — through every route ("auto", "jacobian", "per_layer",
"structured" where it applies), ``kernel="full"``, the matrix-free ``ntk_operator`` and a float32
model measured with ``dtype=torch.float64``.

Found and fixed:

* a float32 model with the hook-based ``torch.nn.utils.weight_norm`` (or ``spectral_norm``)
  measured in float64 failed with torch's raw "Only Tensors created explicitly by the user …"
  (``prepare_model``'s cast copy deep-copied the pre-hook's non-leaf weight): ``ntk.state.copyable``;
* a train-mode ``parametrizations.spectral_norm`` whose power iteration had converged was measured
  (two forwards agreed to the probe's tolerance) while the Hessian and ``ntk_operator`` refused it:
  the kernel was 1.8e-10 off a reference one forward later — now every route refuses it;
* a forward that registers a parameter (``self.s = nn.Parameter(…)`` on its first call, a buffer
  turned into a parameter) was measured with the parameter set of whichever forward came first
  (0.11 off) and the user's model kept the new parameter — now refused, the model left as it was.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm as param_weight_norm

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.ntk import gram, ntk_operator, resolve_route
from nsa_dist.ntk.blocks import block_features

D = torch.float64
TOL = 1e-12


def _reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(N, K, N, K) float64 J Jᵀ of ``model`` (already float64), dense, by torch.func.jacrev."""
    for m in model.modules():  # a sparse embedding gradient: the same derivative, dense
        if hasattr(m, "sparse"):
            m.sparse = False
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    n, K = x.shape[0], model(x).shape[1]  # every network here maps (n, …) → (n, K)
    jac = jacrev(lambda p: functional_call(model, p, (x,)))(params)
    J = torch.cat([j.reshape(n, K, -1) for j in jac.values()], 2)
    return torch.einsum("iap,jbp->iajb", J, J)


def _err(G: torch.Tensor, R: torch.Tensor) -> float:
    G = torch.as_tensor(G)
    return float((G - R).abs().max() / R.abs().max())


class _LoRA(nn.Module):
    """W + A B: a low-rank update as a parametrization (A, B trainable parameters of it)."""

    def __init__(self, n: int, r: int = 2) -> None:
        super().__init__()
        self.A = nn.Parameter(0.3 * torch.randn(n, r))
        self.B = nn.Parameter(0.3 * torch.randn(r, n))

    def forward(self, W: torch.Tensor) -> torch.Tensor:
        return W + self.A @ self.B


class _Symmetric(nn.Module):
    def forward(self, W: torch.Tensor) -> torch.Tensor:
        return W.triu() + W.triu(1).T


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))


_IDS = torch.tensor([[2, 1, 3], [0, 2, 2], [4, 5, 6], [2, 2, 2], [1, 6, 2]])


def _padded(cls, **kw) -> nn.Module:
    e = cls(7, 4, **kw)
    with torch.no_grad():
        e.weight[2] = torch.randn(4)  # a non-zero padding row: it must take no part in the kernel
    return e


def _build(name: str) -> tuple[nn.Module, torch.Tensor]:
    """The network ``name`` in float32, seeded: the same weights at every call."""
    torch.manual_seed(0)
    x = torch.randn(5, 3)
    m = _mlp()
    if name == "hook_weight_norm":
        with warnings.catch_warnings():  # deprecated, and still in researchers' models
            warnings.simplefilter("ignore")
            torch.nn.utils.weight_norm(m[2])
        m(x[:2])  # the pre-hook leaves its computed (non-leaf) weight on the module
    elif name == "hook_spectral_norm_eval":
        torch.nn.utils.spectral_norm(m[2])
        for _ in range(20):
            m(torch.randn(4, 3))
        m.eval()
        m(x[:2])
    elif name == "weight_norm":
        param_weight_norm(m[2])
    elif name == "spectral_norm_eval":
        spectral_norm(m[2])
        for _ in range(20):
            m(torch.randn(4, 3))
        m.eval()
    elif name == "orthogonal":
        orthogonal(m[2])
    elif name == "lora":
        parametrize.register_parametrization(m[2], "weight", _LoRA(6))
        m[2].parametrizations.weight.original.requires_grad_(False)  # frozen base, trainable A, B
    elif name == "symmetric_used_twice":  # one parametrized layer called twice, its weight read by the head
        lin = m[2]
        parametrize.register_parametrization(lin, "weight", _Symmetric())
        m.insert(3, lin)
    elif name == "tied_original":  # two parametrizations of one shared original
        m.insert(3, nn.Linear(6, 6))
        m.insert(4, nn.Tanh())
        parametrize.register_parametrization(m[2], "weight", _Symmetric())
        parametrize.register_parametrization(m[3], "weight", _LoRA(6))
        m[3].parametrizations.weight.original = m[2].parametrizations.weight.original
    elif name in ("embedding_padding", "embedding_padding_sparse"):
        e = _padded(nn.Embedding, padding_idx=2, sparse=name.endswith("sparse"))
        m, x = nn.Sequential(e, nn.Flatten(), nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 2)), _IDS
    elif name in ("bag_mean", "bag_sum_padding", "bag_max_sparse"):
        kw = {"bag_mean": {"mode": "mean"}, "bag_sum_padding": {"mode": "sum", "padding_idx": 2}}
        kw = kw.get(name, {"mode": "max", "sparse": True})
        m, x = nn.Sequential(_padded(nn.EmbeddingBag, **kw), nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)), _IDS
    elif name == "fused_conv_bn":
        from torch.nn.utils.fusion import fuse_conv_bn_eval

        conv, bn = nn.Conv2d(2, 3, 3).eval(), nn.BatchNorm2d(3).eval()
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        m, x = (
            nn.Sequential(fuse_conv_bn_eval(conv, bn), nn.Tanh(), nn.Flatten(), nn.Linear(12, 2)),
            torch.randn(5, 2, 4, 4),
        )
    elif name == "skip_init":
        lin = torch.nn.utils.skip_init(nn.Linear, 3, 6)
        with torch.no_grad():
            lin.weight.normal_()
            lin.bias.normal_()
        m = nn.Sequential(lin, nn.Tanh(), nn.Linear(6, 2))
    else:
        raise KeyError(name)
    return m, x


def _pair(name: str) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """(float32 model, its independent float64 twin with the same weights, float32 inputs)."""
    m32, x = _build(name)
    m64, _ = _build(name)
    m64 = m64.double()
    m64.load_state_dict(m32.state_dict())
    return m32, m64, x


CASES = [
    "hook_weight_norm",
    "hook_spectral_norm_eval",
    "weight_norm",
    "spectral_norm_eval",
    "orthogonal",
    "lora",
    "symmetric_used_twice",
    "tied_original",
    "embedding_padding",
    "embedding_padding_sparse",
    "bag_mean",
    "bag_sum_padding",
    "bag_max_sparse",
    "fused_conv_bn",
    "skip_init",
]


@pytest.mark.parametrize("name", CASES)
def test_every_route_agrees_with_the_dense_reference(name: str) -> None:
    """Each route on the float64 model and the float32 model measured in float64 (a cast copy —
    for the hook-based weight_norm / spectral_norm it failed with torch's deepcopy RuntimeError),
    also inside ``parametrize.cached()``."""
    m32, m64, x = _pair(name)
    x64 = x.double() if x.is_floating_point() else x
    _, ref_model, _ = _pair(name)
    F = _reference(ref_model.double(), x64)
    T = torch.einsum("iaja->ij", F)
    n = x.shape[0]
    errs = {}
    for method in ("auto", "jacobian", "per_layer"):
        errs[method] = _err(gram(m64, x64, method=method), T)
    if name == "skip_init":  # the one network here all of whose layers the structured route takes
        errs["structured"] = _err(gram(m64, x64, method="structured"), T)
    errs["full"] = _err(gram(m64, x64, kernel="full"), F)
    errs["operator"] = _err(ntk_operator(m64, x64).matmat(torch.eye(n, dtype=D)), T)
    errs["float32→64"] = _err(gram(m32, x, dtype=D), T)
    errs["operator float32→64"] = _err(ntk_operator(m32, x, dtype=D).matmat(torch.eye(n, dtype=D)), T)
    with parametrize.cached():
        errs["cached"] = _err(gram(m64, x64), T)
    bad = {k: v for k, v in errs.items() if not v < TOL}
    assert not bad, f"{name}: relative difference from the dense float64 reference {bad}"


def _converged_train_spectral_norm() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    m = _mlp().double()
    spectral_norm(m[2])
    for _ in range(300):  # the power iteration converges: two forwards agree to the probe's tolerance
        m(torch.randn(4, 3, dtype=D))
    return m.train(), torch.randn(5, 3, dtype=D)


@pytest.mark.parametrize(
    "route", ["auto", "jacobian", "per_layer", "full", "float32→64", "operator", "route", "block_features"]
)
def test_train_mode_spectral_norm_is_refused_by_every_route(route: str) -> None:
    """A train-mode spectral_norm rewrites ``_u``/``_v`` in every forward: the Hessian and
    ``ntk_operator`` refuse it, and so must every Gram route — before, a converged iteration was
    measured (1.8e-10 relative off a reference one forward later)."""
    m, x = _converged_train_spectral_norm()
    if route == "float32→64":
        m, x = m.float(), x.float()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    calls = {
        "full": lambda: gram(m, x, kernel="full"),
        "float32→64": lambda: gram(m, x, dtype=D),
        "operator": lambda: ntk_operator(m, x),
        "route": lambda: resolve_route(m, x),
        "block_features": lambda: block_features(m, x, [(0, 2), (2, 5)]),
    }
    with pytest.raises(UnsupportedModelError, match=r"'2\.parametrizations\.weight\.0\._u' \(_SpectralNorm\).*eval"):
        calls.get(route, lambda: gram(m, x, method=route))()
    changed = [k for k, v in m.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed, f"the refusal changed the model's buffers {changed}"


class _LazyScale(nn.Module):
    """Registers its output scale on the first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "scale" not in self._parameters:
            self.scale = nn.Parameter(torch.full((2,), 1.5, dtype=D))
        return self.lin(x) * self.scale


class _BufferToParameter(nn.Module):
    """Turns its buffer into a trainable parameter on the first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2, dtype=D)
        self.register_buffer("scale", torch.full((2,), 1.5, dtype=D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "scale" in self._buffers:
            self.scale = nn.Parameter(self._buffers.pop("scale").clone())
        return self.lin(x) * self.scale


@pytest.mark.parametrize("cls", [_LazyScale, _BufferToParameter])
@pytest.mark.parametrize("route", ["auto", "jacobian", "operator"])
def test_a_parameter_registered_by_the_forward_is_refused(cls, route: str) -> None:
    """Its kernel depends on which forward came first (0.11 off before, the Jacobian without the
    scale against one with it) and the measurement added the parameter to the user's model."""
    torch.manual_seed(0)
    m, x = cls(), torch.randn(5, 3, dtype=D)
    names = ({n for n, _ in m.named_parameters()}, {n for n, _ in m.named_buffers()})
    with pytest.raises(UnsupportedModelError, match=r"registers parameter 'scale'"):
        ntk_operator(m, x) if route == "operator" else gram(m, x, method=route)
    after = ({n for n, _ in m.named_parameters()}, {n for n, _ in m.named_buffers()})
    assert after == names, f"the measurement changed the model's (parameters, buffers): {names} → {after}"
    # after one forward of the user's own the parameter set is fixed: measured as any model
    m(x)
    F = _reference(m, x)
    err = _err(gram(m, x, method=route if route != "operator" else "auto"), torch.einsum("iaja->ij", F))
    assert err < TOL, f"relative difference from the dense reference {err:.2e}"


class _LazyHead(nn.Module):
    """Builds its head (a submodule with parameters) on the first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 4, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "head"):
            self.head = nn.Linear(4, 2, dtype=D)
        return self.head(torch.tanh(self.body(x)))


class _RotaryCache(nn.Module):
    """Registers a cache buffer (cos of positions, as a rotary embedding) on its first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2, dtype=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "cos_cached" not in self._buffers:
            self.register_buffer("cos_cached", torch.cos(torch.arange(3, dtype=D)), persistent=False)
        return self.lin(x * self.cos_cached)


def test_a_submodule_built_by_the_forward_is_refused_and_removed() -> None:
    """Refused as a registered parameter, and the head the probe's forward built is not left on the
    user's model (it was: a second gram measured the model with that random head; review of 0127b2d)."""
    torch.manual_seed(0)
    m, x = _LazyHead(), torch.randn(5, 3, dtype=D)
    with pytest.raises(UnsupportedModelError, match=r"registers parameter 'head.weight'"):
        gram(m, x)
    assert [n for n, _ in m.named_parameters()] == ["body.weight", "body.bias"] and not hasattr(m, "head")


@pytest.mark.parametrize("route", ["auto", "jacobian"])
def test_a_cache_buffer_registered_by_the_forward_is_measured(route: str) -> None:
    """A buffer a forward registers (a rotary cache) is computed state, not a parameter: measured exactly,
    as before 0127b2d (which refused it as 'registers buffer'), and not left on the model."""
    torch.manual_seed(0)
    m, x = _RotaryCache(), torch.randn(5, 3, dtype=D)
    G = gram(m, x, method=route)
    assert "cos_cached" not in dict(m.named_buffers())
    m(x)  # the reference with the cache in place
    err = _err(G, torch.einsum("iaja->ij", _reference(m, x)))
    assert err < TOL, f"relative difference from the dense reference {err:.2e}"
