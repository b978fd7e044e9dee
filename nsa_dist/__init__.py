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

from nsa_dist.client import Client, Run
from nsa_dist.config import ExperimentSpec, ModelSpec, SweepSpec
from nsa_dist.models import build_model
from nsa_dist.tracker import Tracker

__all__ = ["Client", "ExperimentSpec", "ModelSpec", "Run", "SweepSpec", "build_model", "Tracker", "__version__"]
__version__ = "0.1.0"
