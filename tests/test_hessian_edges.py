"""Edge cases of the Hessian code against independent float64 references (double backward, eigvalsh).

* ``output_hessian_traces``: forward-over-forward second derivatives that PyTorch gets wrong
  (LayerNorm, train-mode BatchNorm) raise instead of giving a silently wrong G; models that
  couple samples are differentiated over the whole batch; token-id inputs work.
* ``extreme_eigenpairs(which="magnitude")`` with 2k ≥ P returns no eigenpair twice.
* ``method="arpack"`` notices a skipped copy of a repeated eigenvalue.
* ``numerical_ranks``: n_L is the model's output size, not the last Linear registered.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from nsa_dist.hessian import extreme_eigenpairs, hessian_operator, numerical_ranks, output_hessian_traces
from nsa_dist.hessian._probes import rademacher
from nsa_dist.linalg import top_eigenpairs


def _reference_forms(model: nn.Module, X: torch.Tensor, n_probes: int, seed: int) -> np.ndarray:
    """(m, N, K) ``zᵀ ∇²_θ f_k(x_i) z`` by reverse-mode double backward of the whole-batch forward,
    with the library's Rademacher probes (same seed, same layout)."""
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    P = sum(p.numel() for p in params)
    Z = torch.as_tensor(rademacher(np.random.default_rng(seed), P, n_probes), dtype=torch.float64)
    F = model(X).reshape(X.shape[0], -1)
    N, K = F.shape
    out = np.zeros((n_probes, N, K))
    for i in range(N):
        for k in range(K):
            g = torch.autograd.grad(F[i, k], params, create_graph=True, allow_unused=True)
            g = torch.cat([(t if t is not None else torch.zeros_like(p)).reshape(-1) for t, p in zip(g, params)])
            for j in range(n_probes):
                z = Z[:, j]
                gz = g @ z
                if not gz.requires_grad:
                    continue
                h = torch.autograd.grad(gz, params, retain_graph=True, allow_unused=True)
                h = torch.cat([(t if t is not None else torch.zeros_like(p)).reshape(-1) for t, p in zip(h, params)])
                out[j, i, k] = float(h @ z)
    return out


def _mlp(*middle: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), *middle, nn.Tanh(), nn.Linear(5, 2)).double()


# --------------------------------------------------------------------------- output_hessian_traces


def test_traces_layernorm_by_reverse_mode_where_forward_mode_is_wrong():
    """PyTorch 2.13's forward-over-forward second derivatives of layer_norm are wrong: G was refused
    (Tr(S) via G NaN in a run, Audit H3); it is measured by reverse mode, the check's reference."""
    model = _mlp(nn.LayerNorm(5, elementwise_affine=False))
    X = torch.randn(4, 3, dtype=torch.float64)
    tr = output_hessian_traces(model, X, 4, seed=5)
    np.testing.assert_allclose(tr.per_probe, _reference_forms(model, X, 4, seed=5), rtol=1e-10, atol=1e-12)


def test_a_layernorm_tracker_run_measures_tr_s_via_g(tmp_path):
    """Audit H3: an attention-style model with LayerNorm stored Tr(S) via G as NaN ("forward-mode second
    derivatives … wrong"); by reverse mode it is measured, and agrees with Hutch++'s Tr(S) on S."""
    from nsa_dist import Tracker
    from nsa_dist.client import Client

    model = _mlp(nn.LayerNorm(5))
    X, y = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64)
    url = str(tmp_path / "s.zarr")
    with Tracker(url, "ln", model, X, y, steps=1, record={"steps": [0]}, spectrum={"k": 4, "images": []},
                 hessian={"probes": 16, "lanczos_steps": 8}) as tr:  # fmt: skip
        tr.record(0, lr=0.1)
    tr_s = Client(url).run("ln").hessian.trace_S()
    assert np.isfinite(tr_s["G"]).all() and np.isfinite(tr_s["G_stderr"]).all(), tr_s
    gap, se = abs(tr_s["G"][0] - tr_s["hutchpp"][0]), np.hypot(tr_s["G_stderr"][0], tr_s["hutchpp_stderr"][0])
    assert gap <= 4 * se, (tr_s, gap / se)


def test_traces_per_probe_match_reverse_mode_without_layernorm():
    model = _mlp()
    X = torch.randn(4, 3, dtype=torch.float64)
    tr = output_hessian_traces(model, X, 3, seed=1)
    np.testing.assert_allclose(tr.per_probe, _reference_forms(model, X, 3, seed=1), rtol=1e-10, atol=1e-12)


class _Center(nn.Module):
    """Subtracts the batch mean: f(x_i) depends on every point of the batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)


def test_traces_sample_coupling_model_uses_whole_batch():
    model = _mlp(_Center())
    X = torch.randn(5, 3, dtype=torch.float64)
    tr = output_hessian_traces(model, X, 3, seed=2, block_size=1)  # blocks of one point would centre to 0
    np.testing.assert_allclose(tr.per_probe, _reference_forms(model, X, 3, seed=2), rtol=1e-10, atol=1e-12)


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(7, 4)
        self.l1 = nn.Linear(20, 3)
        self.l2 = nn.Linear(3, 2)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(torch.tanh(self.e(t)).flatten(1))))


def test_traces_token_ids():
    torch.manual_seed(0)
    model = _Tokens().double()
    X = torch.randint(0, 7, (4, 5))
    tr = output_hessian_traces(model, X, 2, seed=3)
    np.testing.assert_allclose(tr.per_probe, _reference_forms(model, X, 2, seed=3), rtol=1e-10, atol=1e-12)


def test_traces_train_batchnorm_by_reverse_mode_and_state_untouched():
    model = _mlp(nn.BatchNorm1d(5)).train()
    before = {k: b.clone() for k, b in model.named_buffers()}
    X = torch.randn(6, 3, dtype=torch.float64)
    tr = output_hessian_traces(model, X, 2, seed=6)  # by reverse mode (forward mode is wrong for it)
    np.testing.assert_allclose(tr.per_probe, _reference_forms(model, X, 2, seed=6), rtol=1e-10, atol=1e-12)
    for k, b in model.named_buffers():
        assert torch.equal(b, before[k]), k


def test_traces_eval_batchnorm_matches_reference():
    model = _mlp(nn.BatchNorm1d(5))
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    model.eval()
    X = torch.randn(4, 3, dtype=torch.float64)
    tr = output_hessian_traces(model, X, 2, seed=4)
    np.testing.assert_allclose(tr.per_probe, _reference_forms(model, X, 2, seed=4), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- eigenpairs


def test_magnitude_with_overlapping_ends_has_no_duplicates():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)).double()  # P = 17
    X, Y = torch.randn(8, 2, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    S = hessian_operator(model, X, Y, part="S")
    D = S.to_dense().numpy()
    lam = np.linalg.eigvalsh((D + D.T) / 2)
    k = 12
    want = lam[np.argsort(-np.abs(lam))][:k]
    got = extreme_eigenpairs(S, k, which="magnitude")
    np.testing.assert_allclose(np.sort(got.evals), np.sort(want), atol=1e-12)
    assert np.all(np.diff(np.abs(got.evals)) <= 1e-12)  # descending |λ|
    np.testing.assert_allclose(got.evecs.T @ got.evecs, np.eye(k), atol=1e-10)
    np.testing.assert_allclose(D @ got.evecs, got.evecs * got.evals, atol=1e-10)


def test_arpack_finds_every_copy_of_a_repeated_eigenvalue():
    torch.manual_seed(0)
    N, d, K = 32, 60, 10
    X, Y = torch.randn(N, d, dtype=torch.float64), torch.randn(N, K, dtype=torch.float64)
    I = hessian_operator(nn.Linear(d, K, bias=False).double(), X, Y, part="I")  # I = Id_K ⊗ XᵀX/N
    ref = np.sort(np.repeat(np.linalg.eigvalsh((X.T @ X / N).numpy()), K))[::-1][:5]
    with pytest.warns(RuntimeWarning, match="ARPACK"):
        got = top_eigenpairs(I, 5, method="arpack")
    np.testing.assert_allclose(got.evals, ref, rtol=1e-8)
    np.testing.assert_allclose(got.evecs.T @ got.evecs, np.eye(5), atol=1e-8)


def test_arpack_distinct_spectrum_unchanged_and_silent():
    rng = np.random.default_rng(0)
    Q = np.linalg.qr(rng.standard_normal((40, 40)))[0]
    lam = np.linspace(-1, 3, 40)
    A = (Q * lam) @ Q.T
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = top_eigenpairs(A, 4, method="arpack")
    np.testing.assert_allclose(got.evals, lam[::-1][:4], rtol=1e-9)
    assert got.method.value == "arpack"


# --------------------------------------------------------------------------- numerical_ranks


class _AuxHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        self.aux = nn.Linear(4, 7)  # registered after the head, never used in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_numerical_ranks_bound_uses_output_size():
    torch.manual_seed(0)
    model = _AuxHead().double()
    model.aux.requires_grad_(False)
    N = 8
    X, Y = torch.randn(N, 3, dtype=torch.float64), torch.randn(N, 2, dtype=torch.float64)
    r = numerical_ranks(model, X, Y)
    assert r.bound_I == N * 2
    assert r.I <= r.bound_I


def test_a_scalar_parameter_in_the_hessian_operator_and_the_traces():
    """A learnable temperature (a 0-dim parameter): the block width read p.shape[0] (IndexError)."""

    class Temp(nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.t = nn.Linear(3, 2), nn.Parameter(torch.tensor(0.7))

        def forward(self, x):
            return torch.tanh(self.l(x)) / self.t

    torch.manual_seed(0)
    m = Temp().double()
    X, Y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    H = np.asarray(hessian_operator(m, X, Y).to_dense())
    assert H.shape == (9, 9) and np.allclose(H, H.T)
    assert output_hessian_traces(m, X, 4).estimate.shape == (5, 2)


def test_tuple_output_models_take_output_everywhere_the_error_advises_it():
    """A model returning (logits, extra): the ShapeError says to pass ``output=``, which
    output_hessian_traces, gauss_newton_eigenvalues and numerical_ranks did not take; each now gives
    what the same model with the selection done by hand gives."""
    from nsa_dist.hessian import gauss_newton_eigenvalues

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.b(torch.tanh(self.a(x)))
            return h, h.sum()

    class First(nn.Module):
        def __init__(self, pair):
            super().__init__()
            self.pair = pair

        def forward(self, x):
            return self.pair(x)[0]

    torch.manual_seed(0)
    m = Pair().double()
    X, Y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    plain = First(m)
    a, b = output_hessian_traces(m, X, 8, output=0), output_hessian_traces(plain, X, 8)
    np.testing.assert_allclose(a.per_probe, b.per_probe, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(gauss_newton_eigenvalues(m, X, Y, output=0), gauss_newton_eigenvalues(plain, X, Y))
    r, s = numerical_ranks(m, X, Y, output=0), numerical_ranks(plain, X, Y)
    assert (r.I, r.S, r.H, r.bound_I) == (s.I, s.S, s.H, s.bound_I)


class _Expanded(nn.Module):
    """A Linear whose weight is an ``expand``-ed Parameter (stride 0 along its rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(5, 4).double()
        self.l.weight = nn.Parameter(torch.randn(1, 5, dtype=torch.float64).expand(4, 5))
        self.o = nn.Linear(4, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.tanh(self.l(x)))


def test_hessian_of_a_stride_zero_parameter_matches_double_backward():
    """Forward mode's dual of a stride-0 Parameter failed with torch's raw "more than one element of
    the written-to tensor" (audit L): its entries are coordinates of their own, as autograd has them."""
    from torch.func import functional_call

    from nsa_dist.hessian import hessian_parts

    torch.manual_seed(0)
    model, X, Y = _Expanded(), torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    H, I, S = hessian_parts(model, X, Y)
    names = [n for n, _ in model.named_parameters()]
    vals = tuple(p.detach().contiguous().clone() for p in model.parameters())

    def loss(*flat: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((functional_call(model, dict(zip(names, flat)), (X,)) - Y) ** 2).sum(1).mean()

    blocks = torch.autograd.functional.hessian(loss, vals)
    rows = [[blocks[i][j].reshape(a.numel(), b.numel()) for j, b in enumerate(vals)] for i, a in enumerate(vals)]
    ref = torch.cat([torch.cat(row, 1) for row in rows]).numpy()
    got = np.asarray(H.to_dense())
    assert np.abs(got - ref).max() < 1e-12 * np.abs(ref).max(), f"H off by {np.abs(got - ref).max():.3g}"
    assert np.abs(np.asarray(I.to_dense()) + np.asarray(S.to_dense()) - got).max() < 1e-12
