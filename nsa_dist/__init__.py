"""nsa-dist: NTK and loss-Hessian spectra during training (see README.md).

The front door re-exports the names most sessions need; the subpackages hold the rest.

Example — a training loop of your own records a tiny network's NTK spectrum with a :class:`Tracker`, and
a :class:`Client` reads it back; the eigenvalues at t = 0 are those of the dense float64 Gram J Jᵀ::

>>> import tempfile, numpy as np, torch
>>> from torch.func import functional_call, jacrev
>>> from nsa_dist import Client, Tracker
>>> _ = torch.manual_seed(0)
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1),
...                             torch.nn.Flatten(0)).double()
>>> X, y = torch.randn(12, 2, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
>>> jac = jacrev(lambda p: functional_call(model, p, (X,)))(dict(model.named_parameters()))
>>> J = torch.cat([j.reshape(12, -1) for j in jac.values()], 1).detach()  # (N, P) at θ_0
>>> folder = tempfile.TemporaryDirectory()
>>> tr = Tracker(f"{folder.name}/runs.zarr", "tiny", model, X, y, steps=3, record={"every": 2},
...              spectrum={"k": 4, "dtype": "float64", "images": []})
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> for step in range(3):
...     loss = ((model(X) - y) ** 2).mean()
...     if tr.due(step):
...         tr.record(step, lr=0.1, loss=loss.item())
...     opt.zero_grad()
...     loss.backward()
...     opt.step()
>>> tr.close()
>>> run = Client(f"{folder.name}/runs.zarr").run("tiny")
>>> run.status, run.steps.tolist(), run.eigenvalues.shape
('done', [0, 2], (2, 4))
>>> dense = np.linalg.eigvalsh((J @ J.T).numpy())[::-1][:4]  # the NTK Gram J Jᵀ at θ_0, float64
>>> bool(np.allclose(run.eigenvalues[0], dense, rtol=1e-10))
True
>>> folder.cleanup()
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nsa_dist.client import Client, Run
    from nsa_dist.config import ExperimentSpec, ModelSpec, SweepSpec
    from nsa_dist.models import build_model
    from nsa_dist.tracker import Tracker

# The front door's names are imported when first asked for (PEP 562): `import nsa_dist.cli` took
# 3.3 s of torch, zarr and pandas before `nsa` could install its signal handlers, so Ctrl-C in those
# seconds printed a 15-line KeyboardInterrupt traceback and SIGTERM killed it without a word (an audit).
_HOMES = {
    "Client": "nsa_dist.client",
    "Run": "nsa_dist.client",
    "ExperimentSpec": "nsa_dist.config",
    "ModelSpec": "nsa_dist.config",
    "SweepSpec": "nsa_dist.config",
    "build_model": "nsa_dist.models",
    "Tracker": "nsa_dist.tracker",
}


def __getattr__(name: str):  # noqa: ANN202 - the front door's names, imported on first use
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'nsa_dist' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


__all__ = ["Client", "ExperimentSpec", "ModelSpec", "Run", "SweepSpec", "build_model", "Tracker", "__version__"]
__version__ = "0.1.0"
