"""Gang calls are typed method calls: the :class:`~nsa_dist.pipeline.layout.Member` protocol names
SpectralShard's methods with their arguments, and both gangs (in process, Ray actors) answer it
through one implementation (:class:`~nsa_dist.pipeline.layout.ShardCalls`).  A type checker sees a
misspelled or mis-called member call; these tests keep the protocol and the shard from drifting apart."""

from __future__ import annotations

import inspect
import os

import numpy as np
import torch
from conftest import dense_ntk

from nsa_dist.cluster.gang import GangMembers
from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.models import build_model
from nsa_dist.pipeline import plan_run
from nsa_dist.pipeline.layout import LocalGang, Member, ShardCalls, TiledGram, each
from nsa_dist.pipeline.member import SpectralShard


def _methods(cls: type) -> dict[str, list[str]]:
    """Public methods of ``cls`` defined on it (not ``object``'s), with their parameter names."""
    return {
        name: list(inspect.signature(fn).parameters)
        for name, fn in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def test_member_protocol_is_the_shards_methods():
    shard, proto = _methods(SpectralShard), _methods(Member)
    assert set(proto) == set(shard), (
        f"in SpectralShard only: {sorted(set(shard) - set(proto))}; in Member only: {sorted(set(proto) - set(shard))}"
    )
    for name, params in proto.items():
        assert params == shard[name], f"{name}: Member takes {params}, SpectralShard takes {shard[name]}"


def test_both_gangs_answer_every_member_call_through_one_implementation():
    missing = [n for n in _methods(Member) if n not in vars(ShardCalls)]
    assert not missing, f"ShardCalls does not implement {missing}"
    local, ray_member = type(LocalGang([SpectralShard()]).member(0)), type(GangMembers([object()]).member(0))
    for cls in (local, ray_member):
        assert issubclass(cls, ShardCalls)
        own = {n for n, v in vars(cls).items() if inspect.isfunction(v) and not n.startswith("__")}
        assert own == {"_start", "_start_each"}, f"{cls.__name__} overrides {sorted(own)}: only how a call starts"


def test_in_process_member_calls_give_the_shards_results():
    """pid, and G V from tiles built through member calls, against a float64 dense Gram."""
    gang = LocalGang([SpectralShard() for _ in range(3)])
    assert gang.get([m.pid() for m in each(gang)]) == [os.getpid()] * 3
    spec = ExperimentSpec(
        name="calls", data={"n": 23, "n_test": 5}, model={"depth": 2, "width": 8}, spectrum={"dtype": "float64", "k": 4}
    )
    data = load_dataset(spec.data, seed=spec.seed)
    model = build_model(spec.model, seed=spec.seed)  # float32, as a member builds it
    theta = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()]).astype(np.float64)
    G = TiledGram(gang, plan_run(spec, data), theta, "train", data.n, np.dtype(np.float64))
    X = torch.as_tensor(np.asarray(data.X, dtype=np.float32), dtype=torch.float64)  # as a member feeds its net
    ref = dense_ntk(model.double(), X).numpy()
    V = np.random.default_rng(0).standard_normal((data.n, 3))
    err = np.abs(G.matmat(V) - ref @ V).max() / np.abs(ref @ V).max()
    assert err < 1e-10, f"G V through member calls off the dense float64 Gram by {err:.2e} relative"
    stats = G.trace_stats()
    tr = np.trace(ref)
    assert abs(stats["trace"] - tr) <= 1e-10 * abs(tr), f"Tr G {stats['trace']} through member calls != {tr}"
    G.close()
    assert not any(s._held for s in gang.members), "release left state on a member"
