"""Networks that use one module twice, or tie one Parameter into two modules (a language model's
input embedding reused as its output head): every NTK route meets a float64 dense reference, the
route says why a shared layer is not "used once", and the user's model keeps its Parameters.

The references are written as plain functions of the parameter tensors (``torch.func.jacrev`` over
them, no ``functional_call``), so the tying they differentiate is the one written here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import jacrev

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.ntk import explain_method, gram, ntk_operator

DTYPES = [torch.float32, torch.float64]


class Twice(nn.Module):
    """``lin(tanh(lin(x)))``: one Linear called twice (as ``Sequential(lin, Tanh(), lin)``)."""

    def __init__(self, d: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential()
        lin = nn.Linear(d, d)
        self.net.append(lin).append(nn.Tanh()).append(lin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def twice_ref(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    W, b = p["net.0.weight"], p["net.0.bias"]
    return torch.tanh(x @ W.T + b) @ W.T + b


class TiedLM(nn.Module):
    """Token ids (n, T) → logits (n, V): embedding, mean over tokens, tanh Linear, and an output
    head whose weight is the embedding's (Hugging Face's tied input/output embeddings)."""

    def __init__(self, V: int = 11, d: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids).mean(1))))


def tied_ref(p: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    E = p["emb.weight"]
    return torch.tanh(E[ids].mean(1) @ p["mid.weight"].T + p["mid.bias"]) @ E.T


def _twice() -> tuple[nn.Module, torch.Tensor, object]:
    return Twice(), torch.randn(9, 3), twice_ref


def _tied() -> tuple[nn.Module, torch.Tensor, object]:
    return TiedLM(), torch.randint(0, 11, (8, 4)), tied_ref


CASES = {"module_twice": _twice, "tied_embedding": _tied}


def reference(model: nn.Module, x: torch.Tensor, fn) -> torch.Tensor:
    """Full (n, K, n, K) kernel in float64 from the dense Jacobian of ``fn`` over the model's
    (deduplicated) parameters."""
    p = {k: v.detach().double() for k, v in model.named_parameters()}
    xs = x.double() if x.is_floating_point() else x
    J = jacrev(fn)(p, xs)  # {name: (n, K, *shape)}
    n, K = J[next(iter(J))].shape[:2]
    J = torch.cat([J[k].reshape(n * K, -1) for k in p], dim=1)
    return (J @ J.T).reshape(n, K, n, K)


def _check(what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    err = float((got.double() - want).abs().max())
    scale = float(want.abs().max())
    assert err <= tol * scale, f"{what}: max abs difference {err:.3e} > {tol:.0e} × max |G| {scale:.3e}"
    return err


def _parameters_intact(model: nn.Module, before: dict[str, nn.Parameter]) -> None:
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys(), f"parameter names changed: {sorted(after)} vs {sorted(before)}"
    for k, p in after.items():
        assert isinstance(p, nn.Parameter), f"{k} is now a {type(p).__name__}, not the model's nn.Parameter"
        assert p is before[k], f"{k} is no longer the model's own Parameter object"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model_dtype", DTYPES, ids=["f32_model", "f64_model"])
@pytest.mark.parametrize("method", ["auto", "jacobian", "per_layer"])
def test_gram_of_shared_parameters_meets_dense_reference(case, model_dtype, method):
    """gram(…, dtype=float64) of a float32 or float64 model with shared parameters equals the
    float64 dense kernel, traced and full, symmetric and cross; repeated calls leave the model's
    own Parameters in place (a module called twice used to lose them to plain tensors)."""
    model, x, fn = CASES[case]()
    model = model.to(model_dtype)
    before = dict(model.named_parameters(remove_duplicate=False))
    Gf = reference(model, x, fn)
    G = Gf.diagonal(dim1=1, dim2=3).sum(-1)
    n2 = x.shape[0] // 2
    for _ in range(2):  # the second call sees the model the first one left
        kw = {"method": method, "dtype": torch.float64}
        if method == "per_layer" and case == "module_twice":
            with pytest.raises(UnsupportedModelError, match="per_layer"):
                gram(model, x, **kw)
            continue
        _check(f"{case} {method} traced", gram(model, x, **kw), G, 1e-12)
        _check(f"{case} {method} full", gram(model, x, kernel="full", **kw), Gf, 1e-12)
        _check(f"{case} {method} cross", gram(model, x[:n2], x[n2:], **kw), G[:n2, n2:], 1e-12)
        _parameters_intact(model, before)
    # in the model's own dtype (float32: float32 rounding)
    tol = 1e-5 if model_dtype == torch.float32 else 1e-12
    if not (method == "per_layer" and case == "module_twice"):
        _check(f"{case} {method} own dtype", gram(model, x, method=method), G, tol)
    _parameters_intact(model, before)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model_dtype", DTYPES, ids=["f32_model", "f64_model"])
def test_operator_of_shared_parameters_meets_dense_reference(case, model_dtype):
    """The matrix-free operator (VJP/JVP over all parameters) of a shared-parameter model:
    G V equals the dense reference's, and the model keeps its Parameters."""
    model, x, fn = CASES[case]()
    model = model.to(model_dtype)
    before = dict(model.named_parameters(remove_duplicate=False))
    G = reference(model, x, fn).diagonal(dim1=1, dim2=3).sum(-1)
    V = np.random.default_rng(0).standard_normal((x.shape[0], 3))
    GV = ntk_operator(model, x, dtype=torch.float64).matmat(V)
    _check(f"{case} operator", torch.as_tensor(GV), G @ torch.as_tensor(V), 1e-12)
    _parameters_intact(model, before)


def test_route_says_a_module_called_twice_is_not_used_once():
    """explain_method (the probe plan_run runs) on a float32 network calling one Linear twice:
    the Jacobian route, and per parameter the reason — the module is called 2 times."""
    model, x, _ = _twice()
    before = dict(model.named_parameters(remove_duplicate=False))
    gram(model, x)  # a gram first, as the pipeline does at a record step
    method, routes = explain_method(model, x[:4], "auto")
    assert method.value == "jacobian", f"auto took {method.value}: {routes}"
    assert set(routes) == {"net.0.weight", "net.0.bias"}, routes
    for name, (path, why) in routes.items():
        assert path == "jacobian", f"{name}: {path} ({why})"
        assert "called 2 times per forward" in why, f"{name}: {why}"
    _parameters_intact(model, before)


def test_route_says_a_tied_parameter_is_not_used_once():
    """The tied embedding takes the Jacobian path (named as tied), the untied Linear its per-layer
    formula: auto resolves to per_layer with the Jacobian part for the tied weight."""
    model, x, _ = _tied()
    method, routes = explain_method(model, x[:4], "auto")
    assert method.value == "per_layer", f"auto took {method.value}: {routes}"
    path, why = routes["emb.weight"]
    assert path == "jacobian" and "tied" in why, f"emb.weight: {path} ({why})"
    assert routes["mid.weight"][0] == "structured", routes
    with pytest.raises(UnsupportedModelError, match="tied"):
        gram(model, x, method="structured")
