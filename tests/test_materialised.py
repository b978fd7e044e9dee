"""A small Hessian formed once as a dense matrix (``linalg.Materialised``) gives the operator's numbers.

The Hessian step of a network with P ≤ ``DENSE_P`` parameters hands H, I and S to the estimates
wrapped so: their products go to the operator until it has made P of them, then the matrix is
formed (P more columns) and every later product is a matrix product.  Checked in float64 against
the operators' own products and against the step computed without it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from nsa_dist.config import ExperimentSpec
from nsa_dist.hessian import hessian_parts
from nsa_dist.linalg import LinearOperator, Materialised


def _parts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()  # P = 38
    X, Y = torch.randn(10, 3, dtype=torch.float64), torch.randn(10, 2, dtype=torch.float64)
    return model, X, Y


def test_products_equal_the_operators_before_and_after_the_matrix_is_formed():
    model, X, Y = _parts()
    ref = dict(zip("HIS", hessian_parts(model, X, Y)))
    P = ref["H"].shape[0]
    first = Materialised(hessian_parts(model, X, Y)[0])  # P ≤ FORM_BLOCK: formed at the first product
    first.matvec(torch.ones(P, dtype=torch.float64))
    assert first.formed and first.source.n_products == P, first.source.n_products
    wrapped = {p: Materialised(op, after=P) for p, op in zip("HIS", hessian_parts(model, X, Y))}
    gen = torch.Generator().manual_seed(1)
    for i in range(12):  # 7 columns a product: formed at the 6th (42 > P = 38)
        V = torch.randn(P, 7, generator=gen, dtype=torch.float64)
        for p, M in wrapped.items():
            want, got = ref[p].matmat(V), M.matmat(V)
            err = float((got - want).abs().max() / want.abs().max())
            assert err < 1e-13, f"{p}, product {i} ({'formed' if M.formed else 'not formed'}): {err:.2e} off"
            assert M.formed == (i >= 5), (p, i, M.source.n_products)
    for p, M in wrapped.items():
        assert M.source.n_products == 35 + P, (p, M.source.n_products)  # 5 products of 7, then P to form it
        assert M.n_products == 12 * 7
        A = M._A  # as formed: symmetric to rounding, not symmetrised
        assert float((A - A.T).abs().max()) <= 1e-13 * float(A.abs().max()), p
    v = torch.randn(P, dtype=torch.float64, generator=gen)  # a vector in, a vector out; NumPy in, NumPy out
    assert wrapped["S"].matmat(v).shape == (P,)
    out = wrapped["S"].matmat(v.numpy())
    assert isinstance(out, np.ndarray) and np.allclose(out, ref["S"].matmat(v).numpy(), rtol=1e-12, atol=0)


class _FailsAfter(LinearOperator):
    """A symmetric operator whose products fail once ``limit`` columns were made."""

    def __init__(self, n: int, limit: int) -> None:
        super().__init__(n, np.float64)
        self.limit = limit

    def _matmat(self, V):
        if self.n_products + V.shape[1] > self.limit:
            raise RuntimeError("the source's products failed")
        return 2.0 * V


def test_a_failing_formation_raises_the_sources_error_and_keeps_nothing():
    M = Materialised(_FailsAfter(8, 9), after=4)
    assert np.array_equal(M.matmat(np.ones((8, 2))), 2 * np.ones((8, 2)))  # the source's own product
    for _ in range(2):  # each try forms it anew, and fails as the source does
        with pytest.raises(RuntimeError, match="the source's products failed"):
            M.matmat(np.ones((8, 3)))
        assert not M.formed
    ok = Materialised(_FailsAfter(8, 100), after=0)
    assert np.array_equal(ok.matmat(np.eye(8)[:, :1]), 2 * np.eye(8)[:, :1]) and ok.formed


def test_the_hessian_step_of_a_small_network_is_the_operators_to_rounding(tmp_path, monkeypatch):
    """Every Hessian array of a run, with the dense matrices formed and without (``DENSE_P = 0``)."""
    from nsa_dist.pipeline import hessian_step, run_experiment
    from nsa_dist.store import SpectrumStore

    spec = {
        "name": "dense",
        "data": {"name": "image2d", "n": 16, "n_test": 4},
        "model": {"depth": 2, "width": 8, "init": "ntk", "activation": "tanh"},  # P = 33
        "steps": 2,
        "record": {"every": 2},
        "schedule": {"lr": 0.05},
        "spectrum": {"k": 4, "dtype": "float64"},
        "hessian": {"top_k": 3, "rayleigh_k": 2, "density_grid": 10, "probes": 4},
    }
    arrays, default = {}, hessian_step.DENSE_P
    for dense in (default, 0):
        monkeypatch.setattr(hessian_step, "DENSE_P", dense)
        url = str(tmp_path / f"d{dense}.zarr")
        run = run_experiment(ExperimentSpec(**spec), SpectrumStore(url))
        assert run.status == "done"
        g = SpectrumStore(url).group(run.run_id)
        arrays[dense] = {n: np.asarray(a[...]) for n, a in g.arrays() if n.startswith("hessian")}
    got, want = arrays[default], arrays[0]
    assert set(got) == set(want) and len(got) > 10, sorted(got)
    for name in sorted(want):
        if name == "hessian_products":
            assert (got[name] < want[name]).all() and (got[name] <= 3 * 2 * 33).all(), (got[name], want[name])
            continue
        a, b = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
        assert np.array_equal(np.isnan(a), np.isnan(b)), name
        scale = max(float(np.nanmax(np.abs(b))), 1e-300)
        err = float(np.nanmax(np.abs(a - b), initial=0.0)) / scale
        assert err < 1e-11, f"{name}: {err:.2e} of its largest value apart ({a} against {b})"


class _Skewed(LinearOperator):
    """A (6, 6) operator that is not symmetric (a model whose second derivatives PyTorch gets wrong)."""

    def __init__(self) -> None:
        super().__init__(6, np.float64)
        self.A = np.diag(np.arange(1.0, 7.0)) + 0.3 * np.triu(np.ones((6, 6)), 1)

    def _matmat(self, V):
        return self.A @ V


def test_an_asymmetric_source_is_kept_as_it_is_and_refused_by_the_eigensolver():
    """Symmetrised at formation, an embedding with ``scale_grad_by_freq`` (H 9.6 % asymmetric) gave
    finite tops with no note where the operator path refused them (audit H)."""
    from nsa_dist.linalg import top_eigenpairs

    M = Materialised(_Skewed())
    V = np.random.default_rng(0).standard_normal((6, 2))
    assert np.array_equal(M.matmat(V), _Skewed().A @ V)
    with pytest.raises(ValueError, match="symmetric"):
        top_eigenpairs(Materialised(_Skewed()), 2)
