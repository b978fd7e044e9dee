"""What a fast route or the operator took for granted and the probe did not prove (an audit of about
70 unusual models against jacrev, float64): each case measured against a dense reference, or one
clear error where the gradients are not the derivative."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.ntk import explain_method, gram, ntk_operator
from tests.conftest import assert_close_rel

D = torch.float64


def _rows(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """J (n·K, P) by plain reverse passes of the batch forward, the hooks as they are."""
    ps = list(model.parameters())
    out = model(x).reshape(-1)
    return torch.stack(
        [
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(out[i], ps, retain_graph=True)])
            for i in range(len(out))
        ]
    )


def _operator(model: nn.Module, x: torch.Tensor, **kw) -> torch.Tensor:
    op = ntk_operator(model, x, **kw)
    return op.matmat(torch.eye(op.shape[0], dtype=D))


class _Embed(nn.Module):
    def __init__(self, functional: bool = False) -> None:
        super().__init__()
        self.e, self.o, self.functional = nn.Embedding(7, 4, scale_grad_by_freq=True), nn.Linear(4, 2), functional

    def forward(self, t):
        h = F.embedding(t, self.e.weight, scale_grad_by_freq=True) if self.functional else self.e(t)
        return self.o(torch.tanh(h).mean(1))


def test_the_operator_measures_the_derivative_of_a_frequency_scaled_embedding():
    """``scale_grad_by_freq`` scales autograd's gradient by token counts: gram switched it off, the
    operator's VJP did not (its JVP is unscaled), 7.5e-2 off the kernel without a word; the same lookup
    written with F.embedding in the model's own code was measured by the operator anyway."""
    torch.manual_seed(0)
    t = torch.randint(0, 7, (10, 5), generator=torch.Generator().manual_seed(1))
    m = _Embed().double()
    plain = copy.deepcopy(m)
    plain.e.scale_grad_by_freq = False  # the true derivative
    J = _rows(plain, t)
    full = J @ J.T  # (n·K, n·K), rows (i, a)
    traced = full.view(10, 2, 10, 2).diagonal(dim1=1, dim2=3).sum(-1)
    assert_close_rel(_operator(m, t), traced, 1e-12, "operator, traced")
    assert_close_rel(_operator(m, t, kernel="full"), full, 1e-12, "operator, full")
    assert_close_rel(gram(m, t), traced, 1e-12, "gram")
    assert m.e.scale_grad_by_freq  # the user's flag is back
    f = _Embed(functional=True).double()
    f.load_state_dict(m.state_dict())
    for measure in (lambda: gram(f, t), lambda: ntk_operator(f, t)):
        with pytest.raises(UnsupportedModelError, match=r"embedding\(…, scale_grad_by_freq=True\)"):
            measure()


class _RowBranch(nn.Module):
    """Reads ``a.weight`` a second time for the points with x₀ > 2 only: the probe's first points
    do not take the branch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(6, 5), nn.Linear(5, 1)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        rows = [h[i] + 0.3 * self.a.weight.sum(1) if x[i, 0] > 2 else h[i] for i in range(x.shape[0])]
        return self.o(torch.stack(rows))


def test_a_weight_read_again_by_points_the_probe_did_not_see_leaves_the_fast_route():
    """The probe proved "used once" on its 4 points; the structured route then left out the second
    use at the other points (1.2e-2 off, 6.9e-2 on a cross Gram): every feature pass now counts the
    uses again, and a layer used otherwise than the probe saw takes the exact route."""
    torch.manual_seed(0)
    x = torch.randn(12, 6, dtype=D)
    x[6:, 0] += 5.0
    m = _RowBranch().double()
    assert explain_method(m, x)[0].value == "structured"  # what the probe proves on its points
    J = _rows(m, x)
    for method in ("auto", "structured", "per_layer"):
        assert_close_rel(gram(m, x, method=method), J @ J.T, 1e-12, method)
    x2 = torch.randn(5, 6, dtype=D)
    x2[:, 0] += 5.0
    assert_close_rel(gram(m, x[:6], x2), J[:6] @ _rows(m, x2).T, 1e-12, "cross Gram")


class _Hooked(nn.Module):
    def __init__(self, scale: float | None) -> None:
        super().__init__()
        self.a, self.b, self.o, self.scale = nn.Linear(6, 5), nn.Linear(5, 5), nn.Linear(5, 1), scale
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if h.requires_grad:
            if self.scale is None:  # a hook that only looks (returns None): the gradient is unchanged
                h.register_hook(lambda g: self.seen.append(g.detach()))
            else:
                h.register_hook(lambda g: g * self.scale)
        return self.o(torch.tanh(self.b(h)))


class _Reverse(torch.autograd.Function):  # a gradient reversal layer (domain-adversarial training)
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -0.5 * g


class _GradientReversal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 6), nn.Linear(6, 2)

    def forward(self, x):
        return self.b(_Reverse.apply(torch.tanh(self.a(x))))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "make",
    [lambda: _Hooked(3.0), lambda: _Hooked(1.5), _GradientReversal],
    ids=["hook_3g", "hook_1.5g", "gradient_reversal"],
)
def test_gradients_that_are_not_the_derivative_are_one_clear_error(make, dtype):
    """A gradient hook g → 3g in the forward: gram measured the hooked gradients' kernel (2.5 off the
    NTK) and the operator J·(J̃ᵀv), neither kernel (0.54 off the hooked one); a gradient reversal
    Function (backward −g/2) likewise.  The adjoint test u·(J t) = (Jᵀu)·t on the probe points
    now refuses both, naming the cause, for every route and the operator."""
    torch.manual_seed(0)
    m = make().to(dtype)  # float32 too: a review's float32 hook g → 3g passed a first version (3.8× off)
    x = torch.randn(12, m.a.in_features, dtype=dtype)
    measures = [lambda meth=meth: gram(m, x, method=meth) for meth in ("auto", "per_layer", "jacobian")]
    for measure in [*measures, lambda: ntk_operator(m, x), lambda: explain_method(m, x)]:
        with pytest.raises(UnsupportedModelError, match="gradients are not the derivative of its outputs"):
            measure()


class _WideHooked(nn.Module):
    """One hidden layer of 10⁶ units (the NSA paper's widths go to 10⁴; a user's to 10⁶), optionally a
    forward hook g → 1.001 g on it."""

    def __init__(self, scale: float | None) -> None:
        super().__init__()
        self.a, self.o, self.scale = nn.Linear(2, 10**6), nn.Linear(10**6, 1), scale

    def forward(self, x):
        h = F.leaky_relu(self.a(x), 0.01)
        if self.scale is not None and h.requires_grad:
            h.register_hook(lambda g: g * self.scale)
        return self.o(h)


def test_a_float32_network_of_a_million_units_is_not_taken_for_a_hooked_one():
    """Float32 sums over 10⁶ units put u·(J t) 1.2–2.2·10⁻⁴ off ‖t‖² with no hook at all, past the
    float32 tolerance 10⁻⁴: the run failed with "a gradient hook registered in the forward …" (an
    audit).  A float32 gap is now checked again on a float64 copy; a hook g → 1.001 g still is refused."""
    torch.manual_seed(0)
    x = torch.rand(6, 2)
    m = _WideHooked(None)
    J = _rows(m.double(), x.double())
    m = m.float()
    # float32 sums of 10⁶ terms: G itself is 7.5·10⁻⁵ off the float64 one
    assert_close_rel(gram(m, x), J @ J.T, 3e-4, "gram of the float32 network against float64 J Jᵀ")
    hooked = _WideHooked(1.001)
    with pytest.raises(UnsupportedModelError, match="gradients are not the derivative of its outputs"):
        gram(hooked, x)


class _WideFixedFeatures(nn.Module):
    """The same 10⁶ units behind a fixed random projection kept as a plain float32 tensor attribute
    (no parameter, no buffer): no float64 copy of it runs (a review)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.b = torch.randn(2, 10**6), torch.randn(10**6)
        self.o = nn.Linear(10**6, 1)

    def forward(self, x):
        return self.o(F.leaky_relu(x @ self.proj + self.b, 0.01))


def test_a_million_unit_network_no_float64_copy_runs_is_not_taken_for_a_hooked_one():
    """Its float32 gap (1.06·10⁻⁴) was refused as a hook again when the float64 re-check could not run;
    then the float32 sums' own rounding, ~eps₃₂·√P, is allowed."""
    torch.manual_seed(0)
    m, x = _WideFixedFeatures(), torch.rand(6, 2)
    assert gram(m, x).shape == (6, 6)


class _NoGradNorm(nn.Linear):
    """A weight read with gradient and under torch.no_grad() (a scale taken without gradient): forward
    mode differentiates through no_grad, reverse mode does not — a first version of the adjoint test
    refused it, and the Hessian with it."""

    def forward(self, x):
        with torch.no_grad():
            s = self.weight.norm()
        return F.linear(x, self.weight / s, self.bias)


def test_a_hook_that_only_looks_and_a_weight_read_under_no_grad_are_measured():
    """No false alarm: a hook returning None changes no gradient; a no_grad block is a constant, as
    autograd (and training) takes it."""
    torch.manual_seed(0)
    m = _Hooked(None).double()
    x = torch.randn(12, 6, dtype=D)
    J = _rows(m, x)
    assert_close_rel(gram(m, x), J @ J.T, 1e-12, "gram")
    assert_close_rel(_operator(m, x), J @ J.T, 1e-12, "operator")
    assert m.seen  # the user's hook ran
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        m = nn.Sequential(_NoGradNorm(10, 32), nn.Tanh(), nn.Linear(32, 1)).to(dtype)
        x = torch.randn(12, 10, dtype=dtype)
        J = _rows(m, x).double()
        assert_close_rel(gram(m, x), J @ J.T, tol, f"no_grad norm, {dtype}")
        assert_close_rel(_operator(m, x), J @ J.T, tol, f"no_grad norm operator, {dtype}")


class _Ident(torch.autograd.Function):  # old style: no setup_context, which torch.func refuses
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g


class _CoupledFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.o = nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 1)

    def forward(self, x):
        return self.o(_Ident.apply(torch.tanh(self.bn(self.a(x)))))


def test_the_batch_route_falls_back_to_plain_autograd():
    """A train-mode BatchNorm (the batch route) with an old-style autograd.Function: the batch route's
    torch.func.vjp raised torch.func's "must override setup_context"; the same rows now come from
    plain reverse passes, as on the other routes."""
    torch.manual_seed(0)
    m = _CoupledFunction().double()
    x = torch.randn(10, 6, dtype=D)
    assert explain_method(m, x)[0].value == "batch"
    J = _rows(m, x)
    assert_close_rel(gram(m, x), J @ J.T, 1e-12, "gram")
    assert_close_rel(gram(m, x, block_size=3), J @ J.T, 1e-12, "gram, blocks of 3")


def test_products_under_a_callers_no_grad_and_the_hessian_of_a_no_grad_block():
    """Forward mode takes a no_grad block of the forward as a constant only while grad is enabled
    around it: a caller's ``torch.no_grad()`` (an evaluation loop's) must not make every op one.
    The Hessian's forward-over-reverse products take the block as reverse mode does."""
    from nsa_dist.hessian import hessian_operator

    torch.manual_seed(0)
    m = nn.Sequential(_NoGradNorm(3, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    x, y = torch.randn(6, 3, dtype=D), torch.randn(6, 1, dtype=D)
    J = _rows(m, x)
    op = ntk_operator(m, x)
    with torch.no_grad():
        assert_close_rel(op.matmat(torch.eye(6, dtype=D)), J @ J.T, 1e-12, "operator under no_grad")
    ps = list(m.parameters())
    loss = 0.5 * ((m(x) - y) ** 2).sum() / x.shape[0]
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, ps, create_graph=True)])
    dense = torch.stack(
        [torch.cat([t.reshape(-1) for t in torch.autograd.grad(g[i], ps, retain_graph=True)]) for i in range(len(g))]
    )  # reverse over reverse: the no_grad norm a constant, as training's gradient takes it
    H = hessian_operator(m, x, y, part="H")
    assert_close_rel(H.matmat(torch.eye(len(g), dtype=D)), dense, 1e-10, "loss Hessian")


def _hessian_parts_dense(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """H by reverse over reverse, I = JᵀJ/N, S = H − I of C = (1/2N) Σ ‖f − y‖²."""
    ps = list(model.parameters())
    out = model(x)
    n = x.shape[0]
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(0.5 * ((out - y) ** 2).sum() / n, ps, create_graph=True)])
    H = torch.stack(
        [torch.cat([t.reshape(-1) for t in torch.autograd.grad(g[i], ps, retain_graph=True)]) for i in range(len(g))]
    )
    J = _rows(model, x)
    return {"H": H, "I": J.T @ J / n, "S": H - J.T @ J / n}


def test_the_loss_hessian_of_a_frequency_scaled_embedding_is_the_derivatives():
    """An audit of the Hessian operators on the same ~70 models: with nn.Embedding(scale_grad_by_freq=
    True) H, I, S were 0.15 / 0.086 / 0.93 off (reverse passes scaled by token counts, forward passes
    not), as the NTK operator was."""
    from nsa_dist.hessian import hessian_operator

    t = torch.randint(0, 7, (10, 5), generator=torch.Generator().manual_seed(1))
    y = torch.randn(10, 2, dtype=D, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    m = _Embed().double()
    plain = copy.deepcopy(m)
    plain.e.scale_grad_by_freq = False
    dense = _hessian_parts_dense(plain, t, y)
    for part, R in dense.items():
        A = hessian_operator(m, t, y, part=part).matmat(torch.eye(R.shape[0], dtype=D))
        assert_close_rel(A, R, 1e-12, part)


def test_hessian_parts_follow_parameters_changed_in_place():
    """H and I read the parameters as they are at each product; S kept the residuals of the θ it was
    made at: after an optimizer-style in-place step it was 0.99 off a new S, and H ≠ I + S by 0.47."""
    from nsa_dist.hessian import hessian_operator

    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 5, dtype=D, generator=gen), torch.randn(8, 2, dtype=D, generator=gen)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    ops = {p: hessian_operator(m, x, y, part=p) for p in "HIS"}
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn(p.shape, dtype=D, generator=gen))
    eye = torch.eye(ops["H"].shape[0], dtype=D)
    for part, R in _hessian_parts_dense(m, x, y).items():
        assert_close_rel(ops[part].matmat(eye), R, 1e-12, f"{part} after the step")


def test_forward_mode_in_two_threads_keeps_its_tangents():
    """Forward-mode AD's dual levels are the process's: a Tracker measuring J·Δθ in its thread while
    the training thread's probe ran the adjoint test lost its tangents ("no level exists", or J·t = 0:
    a CI run's Tracker test).  Every forward-mode product now runs under one lock."""
    import threading

    from nsa_dist.ntk import jacobian_vector_product

    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 2)).double()
    b = nn.Sequential(nn.Linear(3, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1)).double()
    xa, xb = torch.randn(8, 4, dtype=D), torch.randn(8, 3, dtype=D)
    dtheta = torch.randn(sum(p.numel() for p in a.parameters()), dtype=D)
    want = (_rows(a, xa) @ dtheta).view(8, 2)
    errors: list[str] = []

    def products() -> None:
        for i in range(40):
            try:
                got = jacobian_vector_product(a, xa, dtheta)
                if not torch.allclose(got, want, rtol=1e-10, atol=1e-12):
                    errors.append(f"J·dθ {i}: off by {float((got - want).abs().max()):.3g}")
            except Exception as e:  # noqa: BLE001 - what the other thread made of it
                errors.append(f"J·dθ {i}: {type(e).__name__}: {e}")

    worker = threading.Thread(target=products)
    worker.start()
    for _ in range(40):
        explain_method(b, xb)  # the probe: its adjoint test runs forward mode in this thread
    worker.join()
    assert not errors, errors[:3]
