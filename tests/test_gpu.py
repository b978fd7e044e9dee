"""GPU paths against the CPU (float64); skipped cleanly on machines without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nsa_dist.config import ExperimentSpec, ModelSpec
from nsa_dist.data import load_dataset
from nsa_dist.linalg import top_eigenpairs
from nsa_dist.models import build_model
from nsa_dist.ntk import gram, ntk_operator
from nsa_dist.ntk.blocks import block_features
from nsa_dist.ntk.shards import FeatureShard, GramTiles, tile_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)"),
]


def _net():
    return build_model(ModelSpec(depth=4, width=64, output_dim=2), seed=0, dtype=torch.float64)


def test_structured_and_jacobian_gram_on_gpu_equal_cpu():
    model, x = _net(), torch.rand(300, 2, dtype=torch.float64)
    ref = gram(model, x)
    for method in ("structured", "jacobian"):
        G = gram(model.cuda(), x.cuda(), method=method)
        assert G.is_cuda
        torch.testing.assert_close(G.cpu(), ref, rtol=1e-10, atol=1e-10)
        model.cpu()


def test_operator_and_lanczos_on_gpu_equal_cpu():
    model, x = _net(), torch.rand(200, 2, dtype=torch.float64)
    ref = top_eigenpairs(gram(model, x).numpy(), 8, method="dense")
    op = ntk_operator(model.cuda(), x.cuda(), block_size=64)
    eig = top_eigenpairs(op, 8, method="lanczos")
    np.testing.assert_allclose(eig.evals, ref.evals, rtol=1e-8)
    eig = top_eigenpairs(gram(model, x.cuda()), 8, method="lanczos")
    np.testing.assert_allclose(eig.evals, ref.evals, rtol=1e-8)


def test_gram_tiles_and_feature_shard_on_gpu_equal_cpu():
    model, x = _net(), torch.rand(150, 2, dtype=torch.float64)
    plan = tile_plan(150, 2)
    feats = dict(enumerate(block_features(model, x, plan.ranges)))
    V = np.random.default_rng(0).standard_normal((150, 3))
    cpu, gpu = GramTiles(feats, plan.ranges, plan.pairs[1]), GramTiles(feats, plan.ranges, plan.pairs[1], device="cuda")
    np.testing.assert_allclose(gpu.matmat(V), cpu.matmat(V), rtol=1e-10, atol=1e-10)
    try:
        import cupy  # noqa: F401
    except ImportError:
        cupy = None
    if cupy is not None:  # the products ran on CuPy views of the torch tiles (zero-copy)
        assert gpu.backend == "cupy"
        assert gpu._cp_tiles[0].data.ptr == gpu.tiles[0].data_ptr()
    fs_cpu, fs_gpu = FeatureShard(feats[0], 1), FeatureShard(feats[0], 1, device="cuda")
    n0 = plan.ranges[0][1]
    np.testing.assert_allclose(fs_gpu.jt(V[:n0]), fs_cpu.jt(V[:n0]), rtol=1e-10, atol=1e-10)


def test_analysis_on_gpu_matches_cpu():
    from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run

    base = dict(data={"n": 64}, model={"depth": 3, "width": 32}, steps=3, record={"every": 1}, spectrum={"k": 10})
    data = load_dataset(ExperimentSpec(**base).data)
    ck = next(Trainer(plan_run(ExperimentSpec(**base, device="cpu"), data), data).train_until(1))
    cpu = SpectralAnalyzer(plan_run(ExperimentSpec(**base, device="cpu"), data), data).analyze(ck).arrays()
    gpu = SpectralAnalyzer(plan_run(ExperimentSpec(**base, device="cuda"), data), data).analyze(ck).arrays()
    np.testing.assert_allclose(gpu["eigenvalues"], cpu["eigenvalues"], rtol=1e-8)
    np.testing.assert_allclose(gpu["energy_y"], cpu["energy_y"], rtol=1e-6, atol=1e-9)
