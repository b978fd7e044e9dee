"""The limits of S (Φ, Υ, Λ and the predictions E[Tr S], Tr(S²), E[Tr S_t]) against finite-width
networks: Monte-Carlo over initialisations and probes, as Θ∞ is checked in test_limit.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import functional_call, grad, jacrev, jvp, stack_module_state, vmap

from nsa_dist.config import ModelSpec
from nsa_dist.hessian import OutputTraces, output_hessian_traces, trace_S_from_G
from nsa_dist.hessian._probes import rademacher
from nsa_dist.hessian.s_limit import limit_S_kernels, limit_trace_S2, limit_trace_S_gd, limit_trace_S_init
from nsa_dist.models import build_model
from nsa_dist.ntk.limit import limit_ntk

F64 = torch.float64
BETA = 0.3


def _x(n: int = 4, d: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _net(width: int, seed: int, depth: int = 3, activation: str = "tanh", d: int = 3) -> torch.nn.Module:
    spec = ModelSpec(input_dim=d, init="ntk", bias_scale=BETA, depth=depth, width=width, activation=activation)
    return build_model(spec, seed=seed, dtype=F64)


def _ensemble(width: int, seeds: range, depth: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """(one of the nets, to call functionally; the parameters of ``_net(width, s, depth)`` for every
    seed s stacked along a leading axis, each (E, ...)): the same nets as built one at a time."""
    models = [_net(width, s, depth) for s in seeds]
    params, _ = stack_module_state(models)
    return models[0], {k: p.detach() for k, p in params.items()}


def _ensemble_probes(params: dict[str, torch.Tensor], seeds: range, m: int) -> dict[str, torch.Tensor]:
    """(E, m, ...) per parameter: net s gets the m Rademacher probes that
    ``output_hessian_traces(net, X, m, seed=s)`` draws for it (one (P, m) draw, ``named_parameters`` order)."""
    sizes = [p[0].numel() for p in params.values()]
    Z = torch.stack(
        [torch.as_tensor(rademacher(np.random.default_rng(s), sum(sizes), m), dtype=F64) for s in seeds]
    )  # (E, P, m)
    return {
        k: z.transpose(1, 2).reshape((len(seeds), m) + p.shape[1:])
        for (k, p), z in zip(params.items(), Z.split(sizes, dim=1))
    }


def _ensemble_f_and_probes(
    model: torch.nn.Module, params: dict[str, torch.Tensor], U: dict[str, torch.Tensor], X: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """f (E, N) and ``zᵀ ∇²_θ f z`` (E, m, N) of every net of a one-output ensemble: the forward-over-
    forward pass of :func:`output_hessian_traces`, vmapped over the nets and their probes."""

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(model, p, (X,)).reshape(-1)

    def second(p: dict[str, torch.Tensor], u: dict[str, torch.Tensor]) -> torch.Tensor:
        return jvp(lambda q: jvp(f, (q,), (u,))[1], (p,), (u,))[1]  # uᵀ ∇²f u, (N,)

    m = next(iter(U.values())).shape[1]
    with torch.no_grad():
        Q = [vmap(second)(params, {k: u[:, j] for k, u in U.items()}) for j in range(m)]  # m × (E, N)
        return vmap(f)(params), torch.stack(Q, dim=1)


def _flat(model: torch.nn.Module, X: torch.Tensor):
    """(θ (P,), f(θ) → (N,)) of a one-output model at X."""
    names = [k for k, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])

    def f(th: torch.Tensor) -> torch.Tensor:
        ps = {n: t.reshape(s) for n, t, s in zip(names, th.split(sizes), shapes)}
        return functional_call(model, ps, (X,)).reshape(-1)

    return theta, f


def _empirical_upsilon_lambda(model: torch.nn.Module, X: torch.Tensor, n_probes: int, seed: int):
    """Probe estimates of Υ_ij = Tr(ℋf_i ℋf_j) = E_z[(ℋf_i z)·(ℋf_j z)] and
    Λ_ij = ∂g_i·∂f_j = E_z[∇_θ(zᵀℋf_i z)·∇_θ f_j] (z Rademacher, E zzᵀ = Id)."""
    theta, f = _flat(model, X)
    J = jacrev(f)(theta)  # (N, P)
    gen = torch.Generator().manual_seed(seed)
    U, L = 0, 0
    for _ in range(n_probes):
        z = torch.randint(0, 2, theta.shape, generator=gen).to(F64) * 2 - 1
        Hz = jvp(jacrev(f), (theta,), (z,))[1]  # (N, P) ℋf_i z
        q = lambda th: jvp(lambda t: jvp(f, (t,), (z,))[1], (th,), (z,))[1]  # noqa: E731 - zᵀℋf z, (N,)
        U = U + Hz @ Hz.T / n_probes
        L = L + jacrev(q)(theta) @ J.T / n_probes
    return U, L


def _rel(A: torch.Tensor, B: torch.Tensor) -> float:
    return float((A - B).norm() / B.norm())


def test_theta_of_the_recursion_is_limit_ntk():
    x = _x(6)
    k = limit_S_kernels(x, depth=4, activation="softplus", bias_scale=BETA)
    ref = limit_ntk(x, depth=4, activation="softplus", bias_scale=BETA)
    assert torch.allclose(k.theta, ref, rtol=1e-5), (k.theta - ref).abs().max()


def test_a_callable_sigma_by_autograd_equals_the_closed_forms():
    x = _x(5)
    a = limit_S_kernels(x, depth=3, activation=torch.tanh, bias_scale=BETA)
    b = limit_S_kernels(x, depth=3, activation="tanh", bias_scale=BETA)
    for name in ("sigma", "theta", "phi", "upsilon", "lam"):
        assert torch.allclose(getattr(a, name), getattr(b, name), rtol=1e-12, atol=1e-14), name


def test_relu_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="smooth σ"):
        limit_S_kernels(_x(), depth=3, activation="relu")


def test_phi_is_the_monte_carlo_mean_of_f_times_g():
    """Φ(x_i, x_j) = E[f(x_i) g(x_j)] over initialisations (g by 2 probes each): 160 nets of width 128
    and depth 3 (O(1/w) from the limit; depth 2 is exact in expectation at any width and is met by
    the t = 0 point of the GD test).  The nets are evaluated as one vmapped ensemble; two of them
    are checked against the net built alone and :func:`output_hessian_traces` with its seed."""
    depth = 3
    x = 2 * _x()
    phi = limit_S_kernels(x, depth=depth, activation="tanh", bias_scale=BETA).phi.numpy()
    seeds = range(160)
    model, params = _ensemble(128, seeds, depth)
    F, Q = _ensemble_f_and_probes(model, params, _ensemble_probes(params, seeds, 2), x)  # (E, N), (E, 2, N)
    for s in (seeds[0], seeds[-1]):  # the batched nets and probes are those of build_model and output_hessian_traces
        m = _net(128, s, depth)
        with torch.no_grad():
            torch.testing.assert_close(F[s], m(x).reshape(-1), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(
            Q[s].numpy(), output_hessian_traces(m, x, 2, seed=s).per_probe[..., 0], rtol=1e-10, atol=1e-12
        )
    S = np.einsum("ei,ej->eij", F.numpy(), Q.mean(1).numpy())  # (seeds, N, N) f(x_i) g(x_j), g by 2 probes
    mean, se = S.mean(0), S.std(0, ddof=1) / np.sqrt(len(S))
    z = np.abs(mean - phi) / se
    assert z.max() < 4.5, f"depth {depth}: |MC − Φ|/se max {z.max():.2f}\nMC {mean}\nΦ {phi}\nse {se}"
    tr = np.trace(S, axis1=1, axis2=2)  # (seeds,) the part of N·Tr(S) whose mean is Tr(Φ̃)
    se_tr = tr.std(ddof=1) / np.sqrt(len(tr))
    assert abs(tr.mean() - np.trace(phi)) < 4 * se_tr, (
        f"Tr: MC {tr.mean():.3f} ± {se_tr:.3f}, Tr(Φ̃) {np.trace(phi):.3f}"
    )
    assert abs(np.trace(phi)) > 5 * se_tr, f"the test must resolve Tr(Φ̃) = {np.trace(phi):.3f} from 0 (se {se_tr:.3f})"


@pytest.mark.parametrize("activation", ["tanh", "softplus", "gelu"])
def test_upsilon_and_lambda_one_hidden_layer_at_width_4096(activation):
    """Depth 2: Υ̃ and Λ̃ of one net of width 4096 (8 probes) within a few % of the limits."""
    x = _x()
    k = limit_S_kernels(x, depth=2, activation=activation, bias_scale=BETA)
    U, L = _empirical_upsilon_lambda(_net(4096, 0, depth=2, activation=activation), x, 8, 0)
    assert _rel(U, k.upsilon) < 0.05 and _rel(L, k.lam) < 0.12, (
        f"{activation}: relative errors Υ {_rel(U, k.upsilon):.3f}, Λ {_rel(L, k.lam):.3f}\n"
        f"Υ {U}\n{k.upsilon}\nΛ {L}\n{k.lam}"
    )


@pytest.mark.slow
def test_upsilon_and_lambda_of_two_hidden_layers_converge_with_width():
    """Depth 3 (the recursion's Φ⁽ᴸ⁻¹⁾, Υ⁽ᴸ⁻¹⁾, Λ⁽ᴸ⁻¹⁾ terms): the errors of Υ̃ and Λ̃ fall from
    width 64 to 512 and are small at 512 (8 probes, tanh)."""
    x = _x()
    k = limit_S_kernels(x, depth=3, activation="tanh", bias_scale=BETA)
    errs = {}
    for w in (64, 512):
        U, L = _empirical_upsilon_lambda(_net(w, 0, activation="tanh"), x, 8, 0)
        errs[w] = (_rel(U, k.upsilon), _rel(L, k.lam))
    assert errs[512][0] < 0.06 and errs[512][1] < 0.12, f"width 512 relative errors (Υ, Λ) {errs[512]}; {errs}"
    assert errs[512][0] < errs[64][0] and errs[512][1] < errs[64][1], f"errors must fall with width: {errs}"


def test_trace_S2_is_the_quadratic_form_of_upsilon():
    """Tr(S²) of a dense S (P ≈ 1.3k, float64) against ∇Cᵀ Υ̃ ∇C at width 256 on 3 points."""
    from nsa_dist.hessian import hessian_parts

    x, y = _x(3), torch.tensor([0.5, -1.0, 1.5], dtype=F64)
    m = _net(256, 0, depth=2)
    _, _, S = hessian_parts(m, x, y, loss="mse", dtype=F64)
    Sd = S.to_dense()
    with torch.no_grad():
        grad_C = ((m(x).reshape(-1) - y) / 3).numpy()
    U = limit_S_kernels(x, depth=2, activation="tanh", bias_scale=BETA).upsilon
    pred, meas = limit_trace_S2(U, grad_C), float((Sd * Sd).sum())
    assert abs(pred - meas) < 0.1 * meas, f"Tr(S²) measured {meas:.4g}, predicted {pred:.4g}"


def test_expected_trace_S_at_init_is_K_trace_phi_over_N():
    x = _x(5)
    k = limit_S_kernels(x, depth=3, activation="atan", bias_scale=BETA)
    assert limit_trace_S_init(k, 2) == pytest.approx(2 * float(k.phi.trace()) / 5)
    assert limit_trace_S_gd(k, np.zeros((5, 2)), [], [0])[0] == pytest.approx(limit_trace_S_init(k, 2))


def test_expected_trace_S_along_gd_matches_trained_ensembles():
    """E[Tr S_t] under GD (MSE, δ = 1): 100 nets of width 256 trained 20 steps, Tr(S_t) = ∇Cᵀ·G by probes,
    against :func:`limit_trace_S_gd`; the prediction that keeps G frozen (Λ̃ = 0) must miss.  The nets
    are trained as one vmapped ensemble; net 0 is checked against itself trained alone by
    ``torch.optim.SGD`` and measured by :func:`output_hessian_traces`."""
    x = _x(4, seed=3)
    y = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=F64)
    steps, lr = [0, 5, 20], 1.0
    k = limit_S_kernels(x, depth=2, activation="tanh", bias_scale=BETA)
    pred = limit_trace_S_gd(k, y.numpy(), [lr] * 20, steps)
    frozen = limit_trace_S_gd(type(k)(k.sigma, k.theta, k.phi, k.upsilon, 0 * k.lam), y.numpy(), [lr] * 20, steps)
    seeds = range(100)
    model, params = _ensemble(256, seeds, 2)
    U = _ensemble_probes(params, seeds, 2)  # each net's probes, the same at every step (as seed=seed gives)

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return 0.5 * ((functional_call(model, p, (x,)).reshape(-1) - y) ** 2).mean()

    cols = []
    for t in range(21):
        if t in steps:
            F, Q = _ensemble_f_and_probes(model, params, U, x)  # (E, N), (E, 2, N)
            R = (F - y).numpy()
            traces = [OutputTraces(q.mean(0), q.std(0, ddof=1) / np.sqrt(len(q)), q) for q in Q[..., None].numpy()]
            cols.append([trace_S_from_G(r, tr)[0] for r, tr in zip(R, traces)])
        with torch.no_grad():  # one SGD step of every net on its own loss
            params = {n: p - lr * g for (n, p), g in zip(params.items(), vmap(grad(loss))(params).values())}
    V = np.array(cols).T  # (seeds, len(steps))
    m = _net(256, seeds[0], depth=2)  # the batched training is net 0 trained alone by torch.optim.SGD
    opt, row = torch.optim.SGD(m.parameters(), lr=lr), []
    for t in range(21):
        if t in steps:
            with torch.no_grad():
                R = (m(x).reshape(-1) - y).numpy()
            row.append(trace_S_from_G(R, output_hessian_traces(m, x, 2, seed=seeds[0]))[0])
        opt.zero_grad()
        (0.5 * ((m(x).reshape(-1) - y) ** 2).mean()).backward()
        opt.step()
    np.testing.assert_allclose(V[0], row, rtol=1e-8, atol=1e-10)
    mean, se = V.mean(0), V.std(0, ddof=1) / np.sqrt(len(V))
    z = np.abs(mean - pred) / se
    assert z.max() < 4.5, f"E[Tr S_t] MC {mean} ± {se}, predicted {pred}"
    assert np.all(np.abs(mean[1:] - frozen[1:]) / se[1:] > 6), f"G frozen: {frozen} vs MC {mean} ± {se}"


def test_trace_S_gd_eigenbasis_equals_the_dense_recursion():
    """limit_trace_S_gd (eigenbasis of Θ̃, scalar recursions, varying δ_t) against the plain matrix
    recursion R_{t+1} = (1 − δ_t Θ̃/N) R_t, G_{t+1} = G_t − (δ_t/N) Λ̃ R_t averaged exactly over
    (R₀, G₀) with E[R₀R₀ᵀ] = Σ̃ + yyᵀ, E[G₀R₀ᵀ] = Φ̃ᵀ, two outputs."""
    x = _x(5, seed=2)
    k = limit_S_kernels(x, depth=3, activation="erf", bias_scale=BETA)
    Th, P, U, L = (t.numpy() for t in (k.theta, k.phi, k.sigma, k.lam))
    Y = np.random.default_rng(0).normal(size=(5, 2))
    lrs = [0.7 * 0.9 ** (t // 4) for t in range(12)]
    ref = []
    B, C = np.eye(5), np.zeros((5, 5))  # R_t = B R₀, G_t = G₀ − Λ̃ C R₀
    for t in range(13):
        if t in (0, 3, 12):
            ref.append(sum(np.trace(B @ P.T) - np.trace(B.T @ L @ C @ (U + np.outer(y, y))) for y in Y.T) / 5)
        if t < 12:
            C, B = C + lrs[t] / 5 * B, B - lrs[t] / 5 * Th @ B
    np.testing.assert_allclose(limit_trace_S_gd(k, Y, lrs, [0, 3, 12]), ref, rtol=1e-9)
    with pytest.raises(ValueError, match="learning rate of every step"):
        limit_trace_S_gd(k, Y, lrs[:5], [12])
