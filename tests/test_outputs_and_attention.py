"""Models as people write them today: attention by ``F.scaled_dot_product_attention`` in the
model's own code (nanoGPT / Hugging Face style), outputs returned as a dict, a tuple or a
``ModelOutput``, and ``torch.compile``'d modules — every product (operator, Hessian, Tracker)
exact against float64 ``jacrev`` / ``torch.func.hessian`` references."""

from __future__ import annotations

import shutil
import subprocess
import threading
import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_rel, dense_jacobian, dense_ntk, flat_model
from torch import nn

from nsa_dist.errors import ModelFactoryError, ModelForwardError, ShapeError
from nsa_dist.hessian import hessian_operator
from nsa_dist.linalg import top_eigenpairs
from nsa_dist.ntk import explain_method, gram, jacobian_vector_product, ntk_operator

F64 = torch.float64


# ---------------------------------------------------------------------- models
class SelfAttention(nn.Module):
    """One nanoGPT-style block: a packed q/k/v projection, ``F.scaled_dot_product_attention``
    (causal or not) called directly, an output projection with a residual, a mean-pooled head."""

    def __init__(self, E: int = 8, heads: int = 2, K: int = 2, causal: bool = False) -> None:
        super().__init__()
        self.qkv, self.proj, self.head = nn.Linear(E, 3 * E), nn.Linear(E, E), nn.Linear(E, K)
        self.heads, self.causal = heads, causal
        self.explicit = False  # the references: attention written out (softmax(q kᵀ/√d + mask) v)

    def forward(self, x):  # x (n, T, E)
        n, T, E = x.shape
        q, k, v = (t.reshape(n, T, self.heads, E // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if self.explicit:
            s = q @ k.transpose(-2, -1) / (E // self.heads) ** 0.5  # (n, h, T, T)
            if self.causal:
                s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            y = torch.softmax(s, -1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (n, h, T, d)
        h = x + self.proj(y.transpose(1, 2).reshape(n, T, E))
        return self.head(torch.tanh(h).mean(1))  # (n, K)


class TinyOutput(OrderedDict):
    """Like transformers' ``ModelOutput``: a dict whose keys are attributes too, and whose
    integer index is the position among its values."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, k):
        return list(self.values())[k] if isinstance(k, int) else super().__getitem__(k)


def _model_output_class():
    try:
        from transformers.modeling_outputs import SequenceClassifierOutput

        return lambda **kw: SequenceClassifierOutput(**kw)
    except ImportError:
        return TinyOutput


class MultiOut(nn.Module):
    """An MLP returning ``kind``: a dict, a tuple, or a ModelOutput of (logits, hidden)."""

    def __init__(self, kind: str, d: int = 3, K: int = 2) -> None:
        super().__init__()
        self.body, self.head, self.kind = nn.Linear(d, 6), nn.Linear(6, K), kind

    def forward(self, x):
        h = torch.tanh(self.body(x))
        logits = self.head(h)
        logits = logits.squeeze(-1) if logits.shape[-1] == 1 else logits  # (n,) for K = 1
        if self.kind == "dict":
            return {"hidden": h, "logits": logits}
        if self.kind == "tuple":
            return (h, logits)
        return _model_output_class()(logits=logits, hidden_states=(h,))


SELECT = {"dict": "logits", "tuple": 1, "model_output": "logits"}


class Picked(nn.Module):
    """The reference's own selection (not nsa-dist's): the logits of a MultiOut."""

    def __init__(self, model: MultiOut) -> None:
        super().__init__()
        self.m = model

    def forward(self, x):
        out = self.m(x)
        return out[1] if isinstance(out, tuple) else out["logits"]


def multi_out(kind: str = "dict", d: int = 3, K: int = 2) -> nn.Module:
    """Model factory (``test_outputs_and_attention:multi_out``)."""
    return MultiOut(kind, d, K)


# ---------------------------------------------------------------------- references
def _explicit(model: SelfAttention) -> SelfAttention:
    """The same model (its parameters) with its attention written out: what references differentiate."""
    import copy

    twin = copy.deepcopy(model)
    twin.explicit = True
    return twin


def _loss(model: nn.Module, X: torch.Tensor, Y: torch.Tensor):
    """(θ flat, θ ↦ C = (1/2N) Σ ‖f − y‖²) over all parameters."""
    flat, f = flat_model(model)
    return flat, lambda v: 0.5 * ((f(v, X).reshape(Y.shape) - Y) ** 2).sum() / X.shape[0]


def _hessian_times(model: nn.Module, X: torch.Tensor, Y: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """∇²_θ C · V (P, m) by double backward, one column at a time (plain autograd, no torch.func:
    in torch 2.13 ``torch.func.hessian`` is 5 % off on a TransformerEncoderLayer's LayerNorm
    weights, where double backward agrees with central differences of the gradient to 3e-11)."""
    flat, C = _loss(model, X, Y)
    flat = flat.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(C(flat), flat, create_graph=True)
    return torch.stack([torch.autograd.grad(g @ v, flat, retain_graph=True)[0] for v in V.T], dim=1)


def _dense_hessian(model: nn.Module, X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """∇²_θ C (P, P) by double backward, vectorised over the columns."""
    flat, C = _loss(model, X, Y)
    return torch.autograd.functional.hessian(C, flat, vectorize=True)


def _tokens(n=6, T=5, E=8):
    return torch.randn(n, T, E, dtype=F64)


# ---------------------------------------------------------------------- forward-mode AD through attention
@pytest.mark.parametrize("causal", [False, True])
def test_operator_through_a_models_own_sdpa_is_exact(causal):
    """ntk_operator's products (a VJP then a JVP through F.scaled_dot_product_attention) equal
    the dense float64 jacrev Gram, traced and full; the eigensolver on the operator too."""
    model, X = SelfAttention(causal=causal).double(), _tokens()
    ref = dense_ntk(_explicit(model), X)
    assert_close_rel(gram(model, X), ref, 1e-12, "gram")
    op = ntk_operator(model, X)
    assert_close_rel(op.matmat(torch.eye(6, dtype=F64)), ref, 1e-12, f"operator (causal={causal})")
    full = ntk_operator(model, X, kernel="full").to_dense().reshape(6, 2, 6, 2)
    assert_close_rel(full, dense_ntk(_explicit(model), X, full=True), 1e-12, "full operator")
    e = top_eigenpairs(op, 3, method="lanczos", tol=1e-12)
    assert_close_rel(torch.as_tensor(e.evals), torch.linalg.eigvalsh(ref).flip(0)[:3], 1e-10, "top eigenvalues")


@pytest.mark.parametrize("causal", [False, True])
def test_hessian_products_through_a_models_own_sdpa_are_exact(causal):
    """H·V, I·V and S·V (forward-over-reverse through the attention) equal double backward and
    Jᵀ J V / N of the float64 model with its attention written out."""
    model, X = SelfAttention(causal=causal).double(), _tokens()
    Y = torch.randn(6, 2, dtype=F64)
    V = torch.randn(sum(p.numel() for p in model.parameters()), 3, dtype=F64)
    HV = _hessian_times(_explicit(model), X, Y, V)
    J = dense_jacobian(_explicit(model), X)
    IV = J.T @ (J @ V) / X.shape[0]
    for part, ref in (("H", HV), ("I", IV), ("S", HV - IV)):
        op = hessian_operator(model, X, Y, part=part)
        assert_close_rel(op.matmat(V), ref, 1e-11, f"{part}·V (causal={causal})")


def test_attention_modules_and_transformer_layers_still_exact_under_forward_mode():
    """nn.MultiheadAttention called without weights (the fused kernel) and a TransformerEncoderLayer
    in eval mode (its fused fast path) go through the same composite kernels."""

    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = nn.MultiheadAttention(8, 2, batch_first=True)
            self.enc = nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0, batch_first=True)
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            a, w = self.att(x, x, x, need_weights=False)
            assert w is None  # as asked, also under the composite kernels
            return self.head(self.enc(a).mean(1)).squeeze(-1)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, X = Enc().double().eval(), _tokens()
    Y = torch.randn(6, dtype=F64)
    V = torch.randn(sum(p.numel() for p in model.parameters()), 2, dtype=F64)
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel([SDPBackend.MATH]):  # the references: torch's own process-wide switches
            ref, HV = dense_ntk(model, X), _hessian_times(model, X, Y, V)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    assert_close_rel(ntk_operator(model, X).to_dense(), ref, 1e-12, "operator")
    assert_close_rel(hessian_operator(model, X, Y).matmat(V), HV, 1e-11, "H·V")


def test_second_order_forward_products_through_a_models_own_sdpa():
    """The other forward-mode products — App. F's kernel change (forward over reverse over
    forward) and the per-point traces G_i (forward over forward) — equal the same products on the
    model with its attention written out (which has forward-mode rules of its own)."""
    from nsa_dist.hessian import output_hessian_traces
    from nsa_dist.ntk.kernel_change import gram_change

    model, X = SelfAttention(E=4, causal=True).double(), _tokens(5, 4, 4)
    twin = _explicit(model)
    a, b = output_hessian_traces(model, X, 3, seed=1), output_hessian_traces(twin, X, 3, seed=1)
    assert_close_rel(torch.as_tensor(a.per_probe), torch.as_tensor(b.per_probe), 1e-12, "G_i probes")
    theta = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
    dtheta = 1e-3 * np.random.default_rng(0).standard_normal(theta.shape)
    evecs = np.linalg.eigh(dense_ntk(twin, X).numpy())[1][:, ::-1][:, :2]
    got, ref = gram_change(model, X, theta, dtheta, evecs, F64), gram_change(twin, X, theta, dtheta, evecs, F64)
    for k in ref:
        assert_close_rel(torch.as_tensor(got[k]), torch.as_tensor(ref[k]), 1e-10, k)


def test_composite_attention_is_thread_local_and_sets_no_process_switch():
    """The kernels are switched for the products' thread only: no global SDPA flag is touched and
    another thread (a training loop beside a Tracker's analysis) sees no mode."""
    from nsa_dist.ntk.state import exact_kernels

    seen = {}
    flags = (
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.mha.get_fastpath_enabled(),
    )
    with exact_kernels(nn.Linear(1, 1)):
        t = threading.Thread(target=lambda: seen.update(mode=torch._C._is_torch_function_mode_enabled()))
        t.start()
        t.join()
        here = torch._C._is_torch_function_mode_enabled()
        inside = (
            torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.mha.get_fastpath_enabled(),
        )
    assert here and not seen["mode"], f"mode here {here}, in another thread {seen['mode']}"
    assert inside == flags, f"process-wide flags changed inside the block: {flags} -> {inside}"


class _NoForwardRule(torch.autograd.Function):
    """An op with a backward but no forward-mode rule (as a fused kernel may be)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()


class _NoRuleAtAll(_NoForwardRule):
    """An op that no AD mode can differentiate (its backward fails too)."""

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("no derivative of this op")


class _Odd(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.a, self.b, self.op = nn.Linear(3, 4), nn.Linear(4, 1), op

    def forward(self, x):
        return self.b(self.op.apply(self.a(x))).squeeze(-1)


def test_a_kernel_without_forward_mode_rule_is_one_clear_error_through_the_eigensolver():
    """A product that still cannot run is the ModelForwardError naming the module — also when it
    surfaces through top_eigenpairs (not a TypeError about array types).  An op without a
    forward-mode rule alone runs: the operator's products fall back to plain reverse passes."""
    X = torch.randn(5, 3, dtype=F64)
    model = _Odd(_NoForwardRule).double()
    out, ps = model(X), list(model.parameters())  # the reference by plain autograd (torch.func refuses the op)
    J = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(o, ps, retain_graph=True)]) for o in out])
    assert_close_rel(ntk_operator(model, X).to_dense(), J @ J.T, 1e-12, "no forward-mode rule")
    op = ntk_operator(_Odd(_NoRuleAtAll).double(), X)
    with pytest.raises(ModelForwardError, match="computing the NTK of _Odd failed"):
        top_eigenpairs(op, 2)


# ---------------------------------------------------------------------- outputs as models return them
@pytest.mark.parametrize("kind", ["dict", "tuple", "model_output"])
def test_selected_output_is_exact_through_gram_operator_and_hessian(kind):
    model, X = MultiOut(kind).double(), torch.randn(7, 3, dtype=F64)
    ref_model = Picked(model)
    ref = dense_ntk(ref_model, X)
    sel = SELECT[kind]
    assert_close_rel(gram(model, X, output=sel), ref, 1e-12, f"gram ({kind}, output={sel!r})")
    pick = lambda o: o[1] if isinstance(o, tuple) else o["logits"]  # noqa: E731
    assert_close_rel(gram(model, X, output=pick), ref, 1e-12, f"gram with a callable ({kind})")
    assert_close_rel(ntk_operator(model, X, output=sel).to_dense(), ref, 1e-12, f"operator ({kind})")
    _, routes = explain_method(model, X, output=sel)
    assert set(routes) == {f"model.{k}" for k, _ in model.named_parameters()}, routes
    dtheta = torch.randn(sum(p.numel() for p in model.parameters()), dtype=F64)
    assert_close_rel(
        jacobian_vector_product(model, X, dtheta, output=sel).reshape(-1),
        dense_jacobian(ref_model, X) @ dtheta,
        1e-12,
        f"J·dθ ({kind})",
    )
    Y = torch.randn(7, 2, dtype=F64)
    V = torch.randn(sum(p.numel() for p in model.parameters()), 2, dtype=F64)
    assert_close_rel(
        hessian_operator(model, X, Y, output=sel).matmat(V), _hessian_times(ref_model, X, Y, V), 1e-11, f"H·V ({kind})"
    )


def test_an_unselected_output_names_its_type_and_keys():
    X = torch.randn(4, 3, dtype=F64)
    with pytest.raises(
        ShapeError,
        match=r"returns a dict with keys \['hidden', 'logits'\], not a tensor.*"
        r"output='hidden'",
    ):
        gram(MultiOut("dict").double(), X)
    with pytest.raises(ShapeError, match=r"returns a tuple of 2 \(Tensor \(2, 6\), Tensor \(2, 2\)\).*output=0"):
        ntk_operator(MultiOut("tuple").double(), X)
    with pytest.raises(
        ShapeError,
        match=r"output='scores' is not a key of the model's output, a dict with keys "
        r"\['hidden', 'logits'\]",
    ):
        gram(MultiOut("dict").double(), X, output="scores")
    with pytest.raises(ShapeError, match=r"output=2 does not index the model's output, a tuple of 2"):
        hessian_operator(MultiOut("tuple").double(), X, torch.zeros(4, 2), output=2)
    with pytest.raises(TypeError, match="output must be None, a key"):
        gram(MultiOut("dict").double(), X, output=1.5)


def _train(tr, model, X, y, steps, lr=0.05, pick=lambda out: out):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    thetas = {}
    for t in range(steps):
        if tr.due(t):
            thetas[t] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            tr.record(t, lr=lr)
        opt.zero_grad()
        (0.5 * ((pick(model(X)) - y) ** 2).sum(-1).mean()).backward()
        opt.step()
    tr.close()
    return thetas


_HESSIAN = {
    "probes": 2,
    "moments": False,
    "orthogonality": False,
    "rayleigh_k": 0,
    "top_k": 3,
    "density": False,
    "additivity": False,
    "trace_G": False,
    "limit": False,
    "eig_tol": 1e-10,
}


@pytest.mark.parametrize("hessian", [False, True])
def test_tracker_on_a_models_own_sdpa_is_exact(tmp_path, hessian):
    """The Tracker on a float64 model calling F.scaled_dot_product_attention (causal): the stored
    NTK eigenvalues (the Lanczos operator and the J·Δθ prediction are forward-mode products) and,
    with Hessian recording, the top eigenvalues of H, equal the dense references at each θ_t."""
    from nsa_dist import Tracker
    from nsa_dist.client import Client

    torch.manual_seed(0)
    model, X, y = SelfAttention(E=4, causal=True).double(), _tokens(8, 4, 4), torch.randn(8, 2, dtype=F64)
    url = str(tmp_path / "t.zarr")
    tr = Tracker(
        url,
        "sdpa",
        model,
        X,
        y,
        steps=3,
        record={"every": 2},
        spectrum={"k": 3, "images": [], "eig_method": "lanczos"},
        hessian=_HESSIAN if hessian else None,
    )
    thetas = _train(tr, model, X, y, 3)
    run = Client(url).run("sdpa")
    assert run.status == "done", run.status
    ref_model = SelfAttention(E=4, causal=True).double()
    ref_model.explicit = True
    for i, t in enumerate(sorted(thetas)):
        ref_model.load_state_dict(thetas[t])
        ref = torch.linalg.eigvalsh(dense_ntk(ref_model, X)).flip(0)[:3]
        assert_close_rel(torch.as_tensor(np.asarray(run.g["eigenvalues"][i])), ref, 1e-9, f"NTK eigenvalues t={t}")
        if hessian:
            Hr = torch.linalg.eigvalsh(_dense_hessian(ref_model, X, y)).flip(0)[:3]
            got = torch.as_tensor(np.asarray(run.g["hessian_top"][i, 0]))
            assert_close_rel(got, Hr, 1e-8, f"top eigenvalues of H at t={t}")
    fo = np.asarray(run.g["first_order_error"][:])
    assert np.isfinite(fo[:-1]).all(), f"J·Δθ through the attention: first-order errors {fo}"


@pytest.mark.parametrize("kind", ["dict", "model_output"])
def test_tracker_measures_the_selected_output(tmp_path, kind):
    from nsa_dist import Tracker
    from nsa_dist.client import Client

    torch.manual_seed(0)
    model, X, y = MultiOut(kind).double(), torch.randn(10, 3, dtype=F64), torch.randn(10, 2, dtype=F64)
    url = str(tmp_path / "t.zarr")
    tr = Tracker(
        url,
        "out",
        model,
        X,
        y,
        steps=3,
        record={"every": 2},
        spectrum={"k": 3, "images": []},
        hessian=_HESSIAN,
        output=SELECT[kind],
    )
    thetas = _train(tr, model, X, y, 3, pick=lambda o: o["logits"])
    run = Client(url).run("out")
    assert run.status == "done", run.status
    ref_model = MultiOut(kind).double()
    for i, t in enumerate(sorted(thetas)):
        ref_model.load_state_dict(thetas[t])
        ref = torch.linalg.eigvalsh(dense_ntk(Picked(ref_model), X)).flip(0)[:3]
        assert_close_rel(torch.as_tensor(np.asarray(run.g["eigenvalues"][i])), ref, 1e-9, f"NTK eigenvalues t={t}")
        Hr = torch.linalg.eigvalsh(_dense_hessian(Picked(ref_model), X, y)).flip(0)[:3]
        assert_close_rel(torch.as_tensor(np.asarray(run.g["hessian_top"][i, 0])), Hr, 1e-8, f"H at t={t}")
    with pytest.raises(ShapeError, match=r"returns a dict with keys \['hidden', 'logits'\], not a tensor"):
        Tracker(str(tmp_path / "u.zarr"), "u", MultiOut("dict"), X, y, steps=3)
    from nsa_dist.ntk import explain_method

    # explain_method as gram (it raised "AttributeError: 'dict' object has no attribute 'ndim'")
    with pytest.raises(ShapeError, match=r"returns a dict with keys \['hidden', 'logits'\], not a tensor"):
        explain_method(MultiOut("dict"), X)


def test_a_spec_factory_model_with_an_output_key_is_exact(tmp_path):
    """``model: {factory: …, output: 'logits'}``: the run trains and measures the selected output;
    every stored spectrum equals the float64 reference at the stored θ; without ``output`` the
    factory is refused naming the output's type and keys."""
    from nsa_dist.client import Client
    from nsa_dist.config import ExperimentSpec
    from nsa_dist.models import build_model
    from nsa_dist.pipeline import run_experiment, run_id
    from nsa_dist.store import SpectrumStore

    spec = ExperimentSpec.model_validate(
        dict(
            name="sel",
            data={"name": "image2d", "n": 12},
            steps=3,
            record={"every": 2},
            schedule={"lr": 0.05},
            spectrum={"k": 4, "dtype": "float64", "images": []},
            model={
                "factory": "test_outputs_and_attention:multi_out",
                "kwargs": {"kind": "model_output", "d": 2, "K": 1},
                "output": "logits",
            },
        )
    )
    url = str(tmp_path / "s.zarr")
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run(run_id(spec))
    model = build_model(spec.model, dtype=F64)
    ref_model = Picked(model.model)
    X = torch.as_tensor(run.g["X"][:])
    for i in range(run.g["theta"].shape[0]):
        torch.nn.utils.vector_to_parameters(torch.as_tensor(run.g["theta"][i], dtype=F64), model.parameters())
        ref = torch.linalg.eigvalsh(dense_ntk(ref_model, X)).flip(0)[:4]
        assert_close_rel(torch.as_tensor(np.asarray(run.g["eigenvalues"][i])), ref, 1e-8, f"eigenvalues at record {i}")
    bare = spec.model.model_copy(update={"output": None})
    with pytest.raises(ModelFactoryError, match=r"returns a TinyOutput|returns a SequenceClassifierOutput"):
        build_model(bare)
    assert "output" not in spec.model.model_copy(update={"output": None}).model_dump(), (
        "a factory block without output must keep the JSON (and run id) it had"
    )


# ---------------------------------------------------------------------- torch.compile'd models
def _compile_usable() -> str | None:
    """Why torch.compile cannot run here (None: it can)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler for torch.compile's inductor backend"
    try:
        subprocess.run([cc, "--version"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the C compiler does not run: {exc}"
    return None


@pytest.mark.slow
def test_a_compiled_model_is_measured_through_its_module_without_recompiling(tmp_path):
    """gram / ntk_operator / a Hessian product / the Tracker on ``torch.compile(model)`` equal the
    uncompiled model's, and the measurements compile nothing (Dynamo's frame counters do not move,
    no recompile-limit warning)."""
    why = _compile_usable()
    if why:
        pytest.skip(why)
    import torch._dynamo
    from torch._dynamo.utils import counters

    from nsa_dist import Tracker
    from nsa_dist.client import Client

    torch._dynamo.reset()
    model, X = SelfAttention().double(), _tokens()
    Y = torch.randn(6, 2, dtype=F64)
    V = torch.randn(sum(p.numel() for p in model.parameters()), 2, dtype=F64)
    G0, ref, HV = gram(model, X), dense_ntk(_explicit(model), X), _hessian_times(_explicit(model), X, Y, V)
    compiled = torch.compile(model)
    compiled(X)  # the user's own compiled forward, once
    frames = dict(counters["frames"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        G = gram(compiled, X)
        Gop = ntk_operator(compiled, X).to_dense()
        HVc = hessian_operator(compiled, X, Y).matmat(V)
        url = str(tmp_path / "c.zarr")
        tr = Tracker(url, "compiled", compiled, X, Y, steps=3, record={"every": 2}, spectrum={"k": 3, "images": []})
        _train(tr, compiled, X, Y, 3)  # the loop trains the compiled module
    assert_close_rel(G, G0, 1e-14, "gram of the compiled model vs the uncompiled one")
    assert_close_rel(G, ref, 1e-12, "gram vs reference")
    assert_close_rel(Gop, ref, 1e-12, "operator")
    assert_close_rel(HVc, HV, 1e-11, "H·V")
    assert Client(url).run("compiled").status == "done"
    after = dict(counters["frames"])
    assert after == frames, f"the measurements compiled frames: Dynamo's frame counters {frames} -> {after}"
    limit = [
        str(w.message) for w in caught if "recompile" in str(w.message).lower() or "cache_size_limit" in str(w.message)
    ]
    assert not limit, limit


def test_a_compiled_submodule_is_reported_once(caplog):
    """A model holding a torch.compile'd submodule (which the measurements would recompile) is
    named in one warning saying what to pass instead (torch.compile is lazy: nothing compiles here)."""
    import logging

    from nsa_dist.models import measured_module

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    model[0] = torch.compile(model[0])
    with caplog.at_level(logging.WARNING, logger="nsa_dist"):
        assert measured_module(model) is model
        measured_module(model)
    said = [r.getMessage() for r in caplog.records if "torch.compile'd" in r.getMessage()]
    assert len(said) == 1 and "submodule '0' of Sequential" in said[0] and "uncompiled submodules" in said[0], said
    outer = torch.compile(nn.Linear(2, 1))
    assert isinstance(measured_module(outer), nn.Linear) and measured_module(outer) is outer._orig_mod


def test_a_torchscript_model_is_refused_in_one_line_naming_what_to_pass(tmp_path):
    """``torch.jit.script`` / ``torch.jit.trace`` of a whole model failed deep inside torch.func ("The
    stateless API can't be used with Jitted modules") in gram, the operators and the Tracker (an
    audit); a scripted submodule inside a Python model is measured, exactly."""
    from nsa_dist import Tracker
    from nsa_dist.errors import UnsupportedModelError

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    X, Y = torch.randn(5, 3, dtype=F64), torch.randn(5, 2, dtype=F64)
    for jitted in (torch.jit.script(net), torch.jit.trace(net, X)):
        for call in (
            lambda j=jitted: gram(j, X),
            lambda j=jitted: ntk_operator(j, X),
            lambda j=jitted: hessian_operator(j, X, Y),
            lambda j=jitted: Tracker(str(tmp_path / "s.zarr"), "j", j, X, Y, steps=1, spectrum={"k": 2, "images": []}),
        ):
            with pytest.raises(UnsupportedModelError, match="TorchScript module .* pass the Python module"):
                call()
    inner = nn.Sequential(torch.jit.script(nn.Linear(3, 4).double()), nn.Tanh(), nn.Linear(4, 2).double())
    plain = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    plain.load_state_dict(inner.state_dict())
    assert_close_rel(gram(inner, X), dense_ntk(plain, X), 1e-12, "a scripted submodule's NTK")
