"""The curvature operators follow the model: a product is at the parameters as they are then,
however they were changed — a hand-written SGD loop's ``p.data -= lr * p.grad`` bumps no version
counter and ``p.data = new`` replaces the storage the products held (audit S: S 0.64 off with
H ≠ I + S by 0.28 of H, or all three at the old θ, 0.80 off, no error)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev

from nsa_dist.hessian import hessian_parts

F64 = torch.float64


def dense_parts(model: nn.Module, X: torch.Tensor, Y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """H of C = (1/2N) Σ‖f − y‖² by torch.func.hessian, I = JᵀJ / N by jacrev, S = H − I."""
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    shapes = [params[k].shape for k in names]
    sizes = [params[k].numel() for k in names]
    theta = torch.cat([params[k].detach().reshape(-1) for k in names])

    def f(t: torch.Tensor) -> torch.Tensor:
        p = {k: v.view(s) for k, v, s in zip(names, t.split(sizes), shapes)}
        return functional_call(model, p, (X,)).reshape(X.shape[0], -1)

    def C(t: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((f(t) - Y) ** 2).sum() / X.shape[0]

    H = hessian(C)(theta)
    J = jacrev(f)(theta).reshape(-1, theta.numel())
    Iref = J.T @ J / X.shape[0]
    return H, Iref, H - Iref


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _update(model: nn.Module, how: str) -> None:
    gen = torch.Generator().manual_seed(1)
    new = {
        k: v + 0.3 * torch.randn(v.shape, generator=gen, dtype=v.dtype) if v.is_floating_point() else v
        for k, v in model.state_dict().items()
    }
    if how == "load_state_dict":
        model.load_state_dict(new)
        return
    if how == "optimizer":
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        opt.step()
        return
    for k, p in model.named_parameters():
        if how == "data.copy_":
            p.data.copy_(new[k])
        elif how == "data -=":
            p.data -= new[k] - p.data
        elif how == "no_grad copy_":
            with torch.no_grad():
                p.copy_(new[k])
        elif how == "data = new":
            p.data = new[k].clone()


@pytest.mark.parametrize(
    "how", ["data.copy_", "data -=", "no_grad copy_", "load_state_dict", "optimizer", "data = new"]
)
def test_products_are_at_the_parameters_as_they_are_now(how):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    X, Y = torch.randn(8, 3, dtype=F64), torch.randn(8, 2, dtype=F64)
    H, I, S = hessian_parts(model, X, Y)
    eye = torch.eye(H.shape[0], dtype=F64)
    before = [A.matmat(eye) for A in (H, I, S)]
    _update(model, how)
    Hr, Ir, Sr = dense_parts(model, X, Y)
    got = [A.matmat(eye) for A in (H, I, S)]
    errs = {n: rel(g, r) for n, g, r in zip("HIS", got, (Hr, Ir, Sr))}
    assert max(errs.values()) < 1e-10, f"after {how}: H, I, S against the dense parts at the new θ: {errs}"
    assert rel(got[1] + got[2], got[0]) < 1e-10, f"after {how}: H ≠ I + S by {rel(got[1] + got[2], got[0]):.2g}"
    assert rel(before[2], Sr) > 1e-3, "the update did not change S: the test measures nothing"


def _fresh_matches(make, X, Y, **kw):
    """Operators built before an update, applied after it, against operators built after it."""
    model = make()
    H, I, S = hessian_parts(model, X, Y, **kw)
    P = H.shape[0]
    V = torch.randn(P, 3, generator=torch.Generator().manual_seed(2), dtype=F64)
    for A in (H, I, S):
        A.matmat(V)
    _update(model, "data.copy_")
    fresh = hessian_parts(model, X, Y, **kw)
    for name, old, new in zip("HIS", (H, I, S), fresh):
        a, b = old.matmat(V.to(old.dtype)), new.matmat(V.to(new.dtype))
        assert rel(a, b) < 1e-10, f"{name} built before the update is {rel(a, b):.2g} off one built after it"


def test_a_cast_copy_and_a_stateless_twin_follow_the_users_model():
    torch.manual_seed(0)
    X, Y = torch.randn(10, 3), torch.randn(10, 1)
    # float32 model measured in float64: the operators compute with a cast copy
    _fresh_matches(lambda: nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1)), X, Y, dtype=F64)

    # a train-mode batch norm: the operators compute with a copy that keeps no running statistics
    def bn():
        return nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1)).double().train()

    _fresh_matches(bn, X.double(), Y.double())


def test_a_max_norm_embedding_follows():
    torch.manual_seed(0)

    class Tok(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e, self.h = nn.Embedding(7, 4, max_norm=1.0), nn.Linear(4, 1)

        def forward(self, t):
            return self.h(torch.tanh(self.e(t).mean(1)))

    X = torch.randint(0, 7, (9, 3))
    _fresh_matches(lambda: Tok().double(), X, torch.randn(9, 1, dtype=F64))


def test_a_cast_after_the_operators_were_built_is_refused_by_name():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    X, Y = torch.randn(6, 3), torch.randn(6, 1)
    H, _, _ = hessian_parts(model, X, Y)
    model.double()
    with pytest.raises(
        ValueError, match=r"changed from \(4, 3\) torch.float32 on cpu to \(4, 3\) torch.float64 .*build them again"
    ):
        H.matvec(torch.ones(H.shape[0]))


def test_output_hessian_traces_of_an_op_without_forward_over_forward_ad():
    """SiLU's backward has no forward-mode rule in PyTorch 2.13: G failed with torch's
    NotImplementedError (audit S); it is now taken by reverse mode, each probe's zᵀ∇²f_ik z against
    jacrev∘jacrev."""
    from nsa_dist.hessian import output_hessian_traces
    from nsa_dist.hessian._probes import rademacher

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.SiLU(), nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2)).double()
    X = torch.randn(5, 3, dtype=F64)
    tr = output_hessian_traces(model, X, 3, seed=7)
    names = [k for k, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    sizes = [params[k].numel() for k in names]
    theta = torch.cat([params[k].detach().reshape(-1) for k in names])

    def f(t: torch.Tensor) -> torch.Tensor:
        p = {k: v.view(params[k].shape) for k, v in zip(names, t.split(sizes))}
        return functional_call(model, p, (X,))

    Hf = jacrev(jacrev(f))(theta)  # (N, K, P, P)
    Z = torch.as_tensor(rademacher(__import__("numpy").random.default_rng(7), theta.numel(), 3))
    ref = torch.einsum("pm,ikpq,qm->mik", Z, Hf, Z).numpy()
    err = abs(tr.per_probe - ref).max() / abs(ref).max()
    assert err < 1e-10, f"zᵀ∇²f z by reverse mode {err:.2g} off jacrev∘jacrev"


def test_a_function_without_jvp_is_not_taken_by_reverse_mode_unchecked():
    """A review: the reverse-mode fallback also took a custom Function without jvp, whose backward on the
    saved output detached (as a C++ or NumPy kernel's) gives a wrong second derivative — G 0.25 off, no
    error.  Only PyTorch's own ops without a forward-over-forward rule take it."""
    from nsa_dist.errors import ModelForwardError
    from nsa_dist.hessian import output_hessian_traces

    class Tanh(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return torch.tanh(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(output.detach())

        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return g * (1 - y * y)

    class Act(nn.Module):
        def forward(self, x):
            return Tanh.apply(x)

    model = nn.Sequential(nn.Linear(3, 4), Act(), nn.Linear(4, 2)).double()
    with pytest.raises(ModelForwardError, match="jvp"):
        output_hessian_traces(model, torch.randn(5, 3, dtype=F64), 2)


def _bn_eval() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1)).double()
    m.train()(torch.randn(32, 3, dtype=F64) * 2 + 1)  # running statistics away from their start
    return m.eval()


@pytest.mark.parametrize("dtype", [None, F64])
def test_buffers_changed_after_the_build_are_followed(dtype):
    """A review: only the parameters were watched — an eval-mode batch norm's running statistics moved (a
    train-mode forward between products, a load_state_dict) left S 0.03 and a cast copy's H 0.45 off."""
    X, Y = torch.randn(9, 3, dtype=F64), torch.randn(9, 1, dtype=F64)
    model = _bn_eval()
    if dtype is None:
        model = model.float()
        X, Y = X.float(), Y.float()
    ops = hessian_parts(model, X, Y, dtype=dtype)
    V = torch.randn(ops[0].shape[0], 2, generator=torch.Generator().manual_seed(3), dtype=F64)
    for A in ops:
        A.matmat(V.to(A.dtype))
    with torch.no_grad():
        model.train()(torch.randn(32, 3, dtype=X.dtype) - 1)  # moves the running statistics only
    model.eval()
    fresh = hessian_parts(model, X, Y, dtype=dtype)
    for name, old, new in zip("HIS", ops, fresh):
        a, b = old.matmat(V.to(old.dtype)), new.matmat(V.to(new.dtype))
        assert rel(a, b) < 1e-10, f"{name} built before the statistics moved is {rel(a, b):.2g} off one built after"


def test_a_change_of_what_is_trained_or_of_a_mode_is_refused_by_name():
    X, Y = torch.randn(6, 3, dtype=F64), torch.randn(6, 1, dtype=F64)
    model = _bn_eval()
    H, _, _ = hessian_parts(model, X, Y)
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="trainable .*build them again"):
        H.matvec(torch.ones(H.shape[0], dtype=F64))
    model = _bn_eval()
    H, _, _ = hessian_parts(model, X, Y)
    model.train()
    with pytest.raises(ValueError, match=r"module .1. \(BatchNorm1d\) .* switched to train mode.*build them again"):
        H.matvec(torch.ones(H.shape[0], dtype=F64))


def test_what_the_follow_must_not_refuse():
    """The second review: a compiled model with an output selector was refused at the build (its names
    `_orig_mod.…` against the selector's `model.…`), a forward that adds a submodule at its first call and a
    plain MLP switched to eval for validation were refused as a mode change."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = nn.Linear(3, 5), nn.Linear(5, 2)

        def forward(self, x):
            if not hasattr(self, "act"):
                self.act = nn.Tanh()
            return {"out": self.l2(self.act(self.l1(x)))}

    torch.manual_seed(0)
    X, Y = torch.randn(6, 3, dtype=F64), torch.randn(6, 2, dtype=F64)
    for make in (lambda m: m, torch.compile):
        model = Net().double()
        H, I, S = hessian_parts(make(model), X, Y, output="out")
        eye = torch.eye(H.shape[0], dtype=F64)
        first = [A.matmat(eye) for A in (H, I, S)]
        model.eval()
        again = [A.matmat(eye) for A in (H, I, S)]
        assert all(torch.equal(a, b) for a, b in zip(first, again))
        assert rel(again[1] + again[2], again[0]) < 1e-12


def test_a_mode_read_through_a_helper_is_followed():
    """The third review: a module whose mode only a helper function reads was switched after the build; H and
    I followed (they compute on the model), S kept the old residuals (0.53 off, H ≠ I + S by 0.21)."""

    def gain(mod: nn.Module) -> float:
        return 2.0 if mod.training else 1.0

    class Scaled(nn.Module):
        def forward(self, x):
            return torch.tanh(x) * gain(self)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Scaled(), nn.Linear(4, 2)).double().eval()
    X, Y = torch.randn(6, 3, dtype=F64), torch.randn(6, 2, dtype=F64)
    H, I, S = hessian_parts(model, X, Y)
    eye = torch.eye(H.shape[0], dtype=F64)
    _ = S.matmat(eye)
    model.train()
    Hr, Ir, Sr = dense_parts(model, X, Y)
    errs = {n: rel(A.matmat(eye), r) for n, A, r in zip("HIS", (H, I, S), (Hr, Ir, Sr))}
    assert max(errs.values()) < 1e-10, f"after the switch, against the dense parts in train mode: {errs}"


@pytest.mark.parametrize("what", ["X", "Y", "Y numpy"])
def test_the_data_is_the_data_given_at_the_build(what):
    """The operators held the caller's X and Y: changed in place afterwards, H and I used the new data and S
    its old residuals — H ≠ I + S by 0.17–0.66 (an audit).  They now keep the data given at the build."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    X, Y = torch.randn(8, 3, dtype=F64), torch.randn(8, 2, dtype=F64)
    Yn = Y.numpy().copy()
    H, I, S = hessian_parts(model, X, Yn if what == "Y numpy" else Y)
    ref = dense_parts(model, X.clone(), Y.clone())
    {"X": X, "Y": Y}.get(what, torch.from_numpy(Yn)).mul_(2)  # (torch.from_numpy: the same memory as Yn)
    eye = torch.eye(H.shape[0], dtype=F64)
    got = [A.matmat(eye) for A in (H, I, S)]
    errs = {n: rel(g, r) for n, g, r in zip("HIS", got, ref)}
    assert max(errs.values()) < 1e-10, f"after {what} changed in place: H, I, S against the data at the build: {errs}"


def test_slq_density_takes_a_float32_operator():
    """Its Krylov code checked the products' symmetry at float64's 1.5e-8: every float32 H and I was refused as
    "not symmetric" (3e-8 off: float32 rounding), naming functions the caller never called (an audit)."""
    from nsa_dist.hessian import slq_density

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3))
    X, Y = torch.randn(40, 3), torch.randint(0, 3, (40,))
    H, I, _ = hessian_parts(model, X, Y, loss="cross_entropy")
    for A in (H, I):
        est, err = slq_density(A, n_probes=4, n_steps=20, seed=1).moment(1)  # Tr(A) / P and its standard error
        exact = float(torch.trace(A.matmat(torch.eye(A.shape[0])))) / A.shape[0]
        assert abs(est - exact) <= 4 * err, f"Tr/P {est:.4g} ± {err:.2g} against the exact {exact:.4g}"


def test_cross_entropy_targets_must_be_real_and_non_negative():
    """Negative rows made the documented-PSD I indefinite (an entry −0.745), complex targets lost their imaginary
    part with a torch warning only (an audit)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    X = torch.randn(6, 3, dtype=F64)
    with pytest.raises(ValueError, match="non-negative"):
        hessian_parts(model, X, -torch.ones(6, 3, dtype=F64), loss="cross_entropy")
    with pytest.raises(TypeError, match="real"):
        hessian_parts(model, X, torch.ones(6, 3, dtype=torch.complex128), loss="cross_entropy")


def test_residuals_for_trace_s_from_g_take_the_hessian_apis_loss_names():
    """``losses.residual("mse", …)`` was refused ("not a valid LossName") though the Hessian API takes "mse", and
    an R of the wrong shape met NumPy's reshape error in ``trace_S_from_G`` (an audit)."""
    import numpy as np

    from nsa_dist.errors import ShapeError
    from nsa_dist.hessian import output_hessian_traces, trace_S_from_G
    from nsa_dist.losses import residual

    f, y = np.array([[1.0, 2.0]]), np.array([[0.5, 0.0]])
    assert np.array_equal(residual("mse", f, y), residual("l2", f, y))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    traces = output_hessian_traces(model, torch.randn(5, 3, dtype=F64), n_probes=2)
    with pytest.raises(ShapeError, match="traces' shape"):
        trace_S_from_G(np.zeros((5, 3)), traces)


def test_bf16_operators_take_numpy_targets_and_slq():
    """A bf16 model with a NumPy Y failed in the data copy (NumPy has no bfloat16), and slq_density on a bf16
    operator failed turning its products into NumPy (the second review)."""
    import numpy as np

    from nsa_dist.hessian import slq_density

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).bfloat16()
    X = torch.randn(64, 8).bfloat16()
    H, _, _ = hessian_parts(model, X, np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32))
    est, _ = slq_density(H, n_probes=2, n_steps=10).moment(1)
    assert np.isfinite(est)


def test_cross_entropy_rounding_below_zero_is_no_negative_weight():
    """Integer rows with a −1 passed the sign check (I indefinite); a −1e−17 of a user's softmax was refused
    (the second review)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    X = torch.randn(10, 4, dtype=F64)
    oh = torch.nn.functional.one_hot(torch.arange(10) % 3, 3)
    bad = oh.clone()
    bad[0] = torch.tensor([-1, 0, 0])
    with pytest.raises(ValueError, match="non-negative"):
        hessian_parts(model, X, bad, loss="cross_entropy")
    near = oh.double()
    near[0, 1] = -1e-17
    hessian_parts(model, X, near, loss="cross_entropy")
