"""A model whose hooks are closures over itself (a gate, a LoRA adapter, a notebook's global
``model``) is measured and trained as itself: every copy nsa-dist makes (the float64 cast, the
trained network, the Tracker's analysis copy) takes its hooks along, bound to the copy (audit J:
the copy's hooks read the user's modules — an NTK 2 % off with status ``done``, a LoRA model failing
on mixed dtypes, a gate that never trained)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import user_models
from torch import nn

from nsa_dist.models import copy_model
from nsa_dist.ntk import gram


def dense_ntk(model: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """J Jᵀ of the full-batch forward by plain autograd, one reverse pass per point."""
    ps = [p for p in model.parameters() if p.requires_grad]
    out = model(X)
    rows = [torch.autograd.grad(out[i], ps, retain_graph=True) for i in range(len(X))]
    J = torch.stack([torch.cat([g.reshape(-1) for g in r]) for r in rows])
    return J @ J.T


class _GlobalGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.h, self.g = nn.Linear(2, 6), nn.Linear(6, 1), nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, x):
        return self.h(torch.tanh(self.a(x))).squeeze(-1)


def _global_gate() -> nn.Module:
    """A notebook's hook reading its model through the global name ``model`` (globals of its own:
    the test builds a second such model as the reference)."""
    model = _GlobalGate()
    model.h.register_forward_pre_hook(eval("lambda m, i: (i[0] * model.g,)", {"model": model}))
    return model


def _default_gate() -> nn.Module:
    m = _GlobalGate()
    m.h.register_forward_pre_hook(lambda mod, i, g=m.g: (i[0] * g,))
    return m


def _partial_gate() -> nn.Module:
    def gate(owner, mod, i):
        return (i[0] * owner.g,)

    m = _GlobalGate()
    m.h.register_forward_pre_hook(functools.partial(gate, m))
    return m


class _AttributeGate(nn.Module):
    """A gate kept on the module as a function (a closure over the module), not as a hook."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.h, self.g = nn.Linear(2, 6), nn.Linear(6, 1), nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.gate = lambda z: z * self.g

    def forward(self, x):
        return self.h(self.gate(torch.tanh(self.a(x)))).squeeze(-1)


def _kwonly_gate() -> nn.Module:
    m = _GlobalGate()

    def gate(mod, i, *, owner=m):
        return (i[0] * owner.g,)

    m.h.register_forward_pre_hook(gate)
    return m


def _partial_in_closure_gate() -> nn.Module:
    m = _GlobalGate()
    read = functools.partial(lambda owner, z: z * owner.g, m)
    m.h.register_forward_pre_hook(lambda mod, i: (read(i[0]),))
    return m


BUILDERS = {
    "closure": user_models.gate_hook,
    "lora": user_models.lora_hook,
    "partial": _partial_gate,
    "attribute": _AttributeGate,
    "kwonly": _kwonly_gate,
    "partial_in_closure": _partial_in_closure_gate,
}


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_a_float32_model_with_hooks_over_itself_measured_in_float64_is_exact(kind):
    torch.manual_seed(0)
    m32 = BUILDERS[kind]()
    X = torch.randn(12, 2)
    torch.manual_seed(0)
    ref = BUILDERS[kind]().double()  # its hooks bound to itself
    ref.load_state_dict({k: v.double() for k, v in m32.state_dict().items()})
    want = dense_ntk(ref, X.double())
    got = gram(m32, X, dtype=torch.float64)
    err = float((got - want).norm() / want.norm())
    assert err < 1e-12, f"{kind}: relative error {err:.2e} of the float64 NTK of a float32 model"


class _Holder:
    def __init__(self, g):
        self.g = g

    def __call__(self, mod, i):
        return (i[0] * self.g,)


def _object_gate() -> nn.Module:
    m = _GlobalGate()
    m.h.register_forward_pre_hook(_Holder(m.g))
    return m


def _nested_gate() -> nn.Module:
    m = _GlobalGate()
    held = {"p": [m.g]}
    m.h.register_forward_pre_hook(lambda mod, i: (i[0] * held["p"][0],))
    return m


@pytest.mark.parametrize(
    "build, cast",
    [(b, c) for b in (_default_gate, _object_gate, _nested_gate) for c in (False, True)] + [(_global_gate, True)],
    ids=lambda v: v.__name__ if callable(v) else ("cast" if v else "own dtype"),
)
def test_a_forward_reading_a_parameter_not_through_its_module_is_refused(build, cast):
    """A hook holding the tensor itself (a default argument, a callable object, a nested container), or
    — in a copy nsa-dist makes — reading the model through a global name (the user's model, not the
    copy): a measurement substitutes parameters by name and cannot reach it (the NTK was 1–4 % off,
    status ``done``).  In its own dtype (no copy) the global-name hook reads the measured module: exact
    (``test_a_hook_reading_its_model_through_a_global_name…``)."""
    from nsa_dist.errors import UnsupportedModelError

    model = build() if cast else build().double()
    with pytest.raises(UnsupportedModelError, match=r"reads parameter 'g' other than through its module"):
        gram(model, torch.randn(6, 2), dtype=torch.float64 if cast else None)


def test_a_hook_reading_a_parameter_for_its_own_log_is_measured():
    """A hook that holds a parameter but whose output does not depend on it (a logging hook) is fine."""
    torch.manual_seed(0)
    m = user_models.gate_hook().double()
    norms = []
    w = m.h.weight
    m.h.register_forward_hook(lambda mod, i, o: norms.append(float(w.detach().norm())))
    X = torch.randn(8, 2, dtype=torch.float64)
    want = dense_ntk(m, X)
    err = float((gram(m, X) - want).norm() / want.norm())
    assert err < 1e-12, err


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_the_copy_trains_and_reads_its_own_parameters(kind):
    torch.manual_seed(0)
    model = BUILDERS[kind]()
    twin = copy_model(model)
    X = torch.randn(5, 2)
    before = model(X).detach().clone()
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(0.5)
    assert torch.equal(model(X), before), f"{kind}: moving the copy's parameters moved the model's output"
    twin(X).sum().backward()
    gated = [n for n, p in twin.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert not gated, f"{kind}: the copy's {gated} get no gradient from the copy's forward"
    assert all(p.grad is None for p in model.parameters()), f"{kind}: the copy's backward reached the model"


def test_a_tracked_float64_model_with_a_gate_hook_stores_its_own_spectrum(tmp_path):
    from nsa_dist import Tracker
    from nsa_dist.client import Client

    torch.manual_seed(0)
    model = user_models.gate_hook(d=3).double()
    X, y = torch.randn(30, 3, dtype=torch.float64), torch.randn(30, dtype=torch.float64)
    want = np.linalg.eigvalsh(dense_ntk(model, X).detach().numpy())[::-1][:5]
    url = str(tmp_path / "s.zarr")
    with Tracker(url, "g", model, X, y, steps=1, spectrum={"k": 5, "images": []}) as tr:
        tr.record(0, lr=0.05, loss=0.0)
    got = np.asarray(Client(url).run("g").eigenvalues[0])
    np.testing.assert_allclose(got, want, rtol=1e-10, err_msg="the Tracker's spectrum of a gate-hooked model")


@pytest.mark.slow
def test_a_run_of_a_hooked_factory_trains_the_gate_and_stores_its_ntk(tmp_path):
    from nsa_dist.client import Client
    from nsa_dist.pipeline import run_experiment

    spec = {
        "name": "gate",
        "data": {"name": "image2d", "n": 24, "n_test": 4},
        "model": {"factory": "user_models:gate_hook", "kwargs": {"width": 6}},
        "steps": 3,
        "schedule": {"lr": 0.2},
        "record": {"steps": [0, 2]},
        "spectrum": {"k": 6, "images": []},
    }
    from nsa_dist.config import ExperimentSpec

    url = str(tmp_path / "s.zarr")
    run_experiment(ExperimentSpec.model_validate(spec), url)
    run = Client(url).run("gate")
    theta = np.asarray(run.per_step("theta"), dtype=np.float64)
    model = user_models.gate_hook(width=6).double()
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    g = names.index("g")
    start = sum(sizes[:g])
    assert not np.allclose(theta[0, start : start + 6], theta[1, start : start + 6]), "the gate did not train"
    X = torch.as_tensor(np.asarray(run.X), dtype=torch.float32).double()
    for row, vec in enumerate(theta):
        torch.nn.utils.vector_to_parameters(torch.as_tensor(vec), model.parameters())
        want = np.linalg.eigvalsh(dense_ntk(model, X).detach().numpy())[::-1][:6]
        np.testing.assert_allclose(run.eigenvalues[row], want, rtol=1e-9, err_msg=f"recorded step {row}")


class _Bag(nn.Module):
    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.functional = functional
        self.e = nn.EmbeddingBag(10, 4, mode="sum", scale_grad_by_freq=not functional)
        self.h = nn.Linear(4, 2)

    def forward(self, t):
        if self.functional:
            return self.h(torch.tanh(nn.functional.embedding(t, self.e.weight, scale_grad_by_freq=True).sum(1)))
        return self.h(torch.tanh(self.e(t)))


def test_a_frequency_scaled_embedding_bag_is_measured_by_its_derivative():
    """``EmbeddingBag(scale_grad_by_freq=True)`` took autograd's count-scaled gradient for the
    derivative: the probe saw point 0's gradient move with its neighbours, took the model for one that
    couples samples, and the batch route measured a kernel 8 % off (status ``done``)."""
    from nsa_dist.ntk import explain_method

    torch.manual_seed(0)
    T = torch.randint(0, 10, (12, 6))
    model = _Bag(functional=False).double()
    plain = copy_model(model)
    plain.e.scale_grad_by_freq = False  # the same function; autograd's gradient is then the derivative
    J = []
    for i in range(len(T)):
        for a in range(2):
            g = torch.autograd.grad(plain(T)[i, a], list(plain.parameters()))
            J.append(torch.cat([x.reshape(-1) for x in g]))
    J = torch.stack(J).view(len(T), 2, -1)
    want = torch.einsum("iap,jap->ij", J, J)
    got = gram(model, T)
    err = float((got - want).norm() / want.norm())
    assert err < 1e-12, f"relative error {err:.2e}; route {explain_method(model, T)[0]}"
    assert model.e.scale_grad_by_freq, "the user's flag was not put back"


def test_a_functional_frequency_scaled_lookup_is_refused_naming_it():
    from nsa_dist.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=r"embedding\(…, scale_grad_by_freq=True\).*not the derivative"):
        gram(_Bag(functional=True).double(), torch.randint(0, 10, (12, 6)))


def test_test_points_whose_batch_forward_decides_otherwise_take_the_batch_kernel(tmp_path):
    """A route probed on the training points measured the test Gram and the cross Gram with each
    test point alone, where a forward deciding over its batch (``if x.max() > 1``) decides otherwise:
    the stored test spectrum matched neither kernel (λ₃ 16× off, status ``done``; audit J)."""
    from nsa_dist import Tracker
    from nsa_dist.client import Client

    torch.manual_seed(0)
    model = user_models.scaled_auto_scale(d=4).double()
    X = torch.rand(40, 4, dtype=torch.float64)
    Xt = torch.rand(20, 4, dtype=torch.float64)
    Xt[15] *= 255  # a raw [0, 255] point: the test batch is rescaled as a whole

    def J_of(points):
        ps = list(model.parameters())
        out = model(points)
        rows = [torch.autograd.grad(out[i], ps, retain_graph=True) for i in range(len(points))]
        return torch.stack([torch.cat([g.reshape(-1) for g in r]) for r in rows])

    J1, J2 = J_of(X), J_of(Xt)
    cross = gram(model, X, Xt)
    err = float((cross - J1 @ J2.T).norm() / (J1 @ J2.T).norm())
    assert err < 1e-12, f"cross Gram relative error {err:.2e}"
    url = str(tmp_path / "s.zarr")
    y, yt = torch.randn(40, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
    spectrum = {"k": 10, "images": [], "test_points": True}
    with Tracker(url, "t", model, X, y, Xt, yt, steps=1, spectrum=spectrum) as tr:
        tr.record(0, lr=0.1)
    got = np.asarray(Client(url).run("t").per_step("eigenvalues_test")[0], dtype=np.float64)
    want = np.linalg.eigvalsh((J2 @ J2.T).detach().numpy())[::-1][:10]
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12 * want[0], err_msg="the stored test spectrum")


@pytest.mark.parametrize("layout", ["local", "block_rows"])
def test_a_runs_test_points_that_decide_over_their_batch_get_its_kernel_in_every_layout(layout):
    """On a gang the test Gram was sharded with the training points' per-sample route."""
    import dataclasses

    from nsa_dist.config import ExperimentSpec
    from nsa_dist.data import load_dataset
    from nsa_dist.pipeline.plan import plan_run
    from nsa_dist.pipeline.spectral import SpectralAnalyzer
    from nsa_dist.pipeline.trainer import Trainer

    spec = ExperimentSpec.model_validate(
        {
            "name": "t",
            "data": {"name": "image2d", "n": 24, "n_test": 6},
            "model": {"factory": "user_models:scaled_auto_scale", "kwargs": {"width": 6, "threshold": 50.0}},
            "steps": 3,
            "spectrum": {"dtype": "float64", "k": 6, "test_points": True, "images": [], "layout": layout}
            | ({"workers": 2} if layout != "local" else {}),
        }
    )
    data = load_dataset(spec.data, seed=spec.seed)
    X_test = data.X_test.copy()
    X_test[2] *= 255  # one raw point: the test batch is rescaled as a whole
    data = dataclasses.replace(data, X_test=X_test)
    plan = plan_run(spec, data)
    ck = list(Trainer(plan, data).train_until(3))[1]
    got = SpectralAnalyzer(plan, data).analyze(ck).arrays()["eigenvalues_test"]
    model = user_models.scaled_auto_scale(width=6, threshold=50.0).double()
    torch.nn.utils.vector_to_parameters(torch.as_tensor(np.asarray(ck.theta, np.float64)), model.parameters())
    Xt = torch.as_tensor(X_test, dtype=torch.float32).double()
    ps = list(model.parameters())
    out = model(Xt)
    J = torch.stack(
        [torch.cat([g.reshape(-1) for g in torch.autograd.grad(out[i], ps, retain_graph=True)]) for i in range(6)]
    )
    want = np.linalg.eigvalsh((J @ J.T).detach().numpy())[::-1]
    np.testing.assert_allclose(np.ravel(got)[:6], want, rtol=1e-8, atol=1e-12 * want[0], err_msg=layout)


def test_a_hook_reading_its_model_through_a_global_name_is_exact_in_its_own_dtype():
    torch.manual_seed(0)
    m = _global_gate().double()
    X = torch.randn(8, 2, dtype=torch.float64)
    want = dense_ntk(m, X)
    err = float((gram(m, X) - want).norm() / want.norm())
    assert err < 1e-12, err


class _BufferTable(nn.Module):
    """Token ids into a fixed (buffer) table, then a trained head: integer inputs, float features."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(10, 4))
        self.h = nn.Linear(4, 1)

    def forward(self, t):
        return self.h(torch.tanh(self.table[t].sum(1)))[:, 0]


def test_integer_inputs_give_a_float_gram_on_the_structured_route():
    """The structured route took the Gram's dtype from the inputs: token ids made an int64 Gram
    (diagonal 1 where it is 4.1; review of this session's diff)."""
    torch.manual_seed(0)
    m = _BufferTable().double()
    T = torch.randint(0, 10, (5, 6))
    got, want = gram(m, T), gram(m, T, method="jacobian")
    assert got.dtype == torch.float64, got.dtype
    err = float((got - want).norm() / want.norm())
    assert err < 1e-12, err
