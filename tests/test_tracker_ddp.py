"""A Tracker in a plain ``torch.distributed`` DDP loop (two CPU processes, gloo): rank 0 records the
run, the other rank's Tracker writes nothing; every stored step against ``torch.func.jacrev`` at the
θ_t rank 0 stepped.  Was: both ranks opened the run, and the second died of ``LeaseHeld``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from nsa_dist import Client
from nsa_dist.tracker import distributed_rank

N, K, T = 48, 4, 4

_SCRIPT = """
import sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn
from nsa_dist import Tracker

def net():
    torch.manual_seed(0)
    return {NET}

def data():
    g = torch.Generator().manual_seed(1)
    X = torch.randn({N}, 3, generator=g, dtype=torch.float64)
    return X, torch.sin(X.sum(1))

def main(rank, url, out, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2)
    model, (X, y) = net(), data()
    ddp = nn.parallel.DistributedDataParallel(model)
    given = ddp if {WRAPPED} else model  # the wrapper: measured through the module it wraps
    tr = Tracker(url, "ddp", given, X, y, steps={T}, record={{"every": 1}}, spectrum={{"k": {K}}}, device="cpu")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mine = slice(rank * {N} // 2, (rank + 1) * {N} // 2)  # each rank's half; DDP averages the gradients
    thetas = []
    for step in range({T}):
        loss = 0.5 * ((ddp(X[mine]).squeeze(-1) - y[mine]) ** 2).mean()
        thetas.append(torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone())
        if tr.due(step):
            tr.record(step, lr=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    tr.close()
    torch.save({{"rank": tr.rank, "thetas": thetas}}, f"{{out}}.{{rank}}")
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1], sys.argv[2], int(sys.argv[3])), nprocs=2)
"""


_NETS = {
    "plain": "nn.Sequential(nn.Linear(3, 12), nn.Tanh(), nn.Linear(12, 1)).double()",
    # buffers: DDP's forward broadcasts them, a collective the other rank never joined while rank 0's
    # Tracker probed the wrapper (it hung in Tracker.__init__)
    "batchnorm": "nn.Sequential(nn.Linear(3, 12), nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 1)).double().eval()",
}


def _net(kind: str = "plain") -> nn.Module:
    torch.manual_seed(0)
    return eval(_NETS[kind])


def _data():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(N, 3, generator=g, dtype=torch.float64)
    return X, torch.sin(X.sum(1))


@pytest.mark.slow
@pytest.mark.parametrize("kind, wrapped", [("plain", False), ("batchnorm", True)], ids=["module", "wrapper"])
def test_rank_zero_records_a_plain_ddp_loop_exactly(tmp_path, kind, wrapped):
    """The Tracker given the module, or the DistributedDataParallel wrapper around it (measured through
    the module: its parameters were stored as ``module.0.weight``, and a model with buffers hung)."""
    from conftest import free_port

    script = tmp_path / "ddp_loop.py"
    script.write_text(_SCRIPT.format(N=N, K=K, T=T, NET=_NETS[kind], WRAPPED=wrapped))
    url, out = str(tmp_path / "s.zarr"), str(tmp_path / "seen")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "NODE_RANK")}
    cmd = [sys.executable, str(script), url, out, str(free_port())]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the spawned ranks too
        stdout, stderr = proc.communicate()
        pytest.fail(f"the two ranks did not finish in 240 s (a collective one rank never joined?): {stderr[-2000:]}")
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = {r: torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1)}
    assert [seen[r]["rank"] for r in (0, 1)] == [0, 1]
    run = Client(url).run("ddp")
    assert run.status == "done" and [int(s) for s in run.steps] == list(range(T))
    X, y = _data()
    m = _net(kind)
    for t in range(T):
        theta = seen[0]["thetas"][t]
        torch.testing.assert_close(theta, seen[1]["thetas"][t], rtol=0, atol=1e-14)  # DDP kept the ranks equal
        torch.nn.utils.vector_to_parameters(theta, m.parameters())
        params = {k: v.detach() for k, v in m.named_parameters()}
        J = jacrev(lambda p: functional_call(m, p, (X,)).reshape(-1))(params)
        J = torch.cat([j.reshape(N, -1) for j in J.values()], 1)
        lam, V = torch.linalg.eigh(J @ J.T)
        lam, V = lam.flip(0)[:K], V.flip(1)[:, :K]
        i = list(run.steps).index(t)
        np.testing.assert_allclose(run.g["eigenvalues"][i][:K], lam.numpy(), rtol=1e-9)
        with torch.no_grad():
            f = m(X).squeeze(-1)
        E = (torch.cumsum((V.T @ (f - y)) ** 2, 0) / ((f - y) @ (f - y))).numpy()
        np.testing.assert_allclose(run.g["energy_residual"][i][:K], E, rtol=1e-7, atol=1e-10)
        np.testing.assert_allclose(float(run.g["lr"][i]), 0.1)


@pytest.mark.parametrize(
    "env, rank",
    [
        ({}, 0),
        ({"RANK": "3"}, 3),
        ({"RANK": "0", "LOCAL_RANK": "0"}, 0),
        ({"LOCAL_RANK": "1"}, 1),
        ({"NODE_RANK": "1", "LOCAL_RANK": "0"}, 1),
        ({"NODE_RANK": "0", "LOCAL_RANK": "0"}, 0),
    ],
)
def test_the_rank_from_the_launchers_variables(monkeypatch, env, rank):
    for v in ("RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(v, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert distributed_rank() == rank
