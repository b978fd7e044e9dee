"""Read-only access to a spectrum store: ``Client(url).runs()``, ``Client(url).run(id)``, ``.sweep(name)``.

The client never talks to live actors: it reads the Zarr store, also while runs are still
writing — a :class:`Run` sees every step finished when it was opened (``refresh()`` to update).
Everything comes out as plain NumPy arrays (or, on request, xarray / pandas).

What it owns, bottom to top (a module imports only the ones above it in this list):

* ``_arrays`` — :class:`RunArrays`: a run's id, status and checked reads at its finished steps.
* ``_curves`` — :class:`BracketedCurve`: E_t(φ, k) and λ_i at every measured k with its bracket,
  on the exact and the quadrature route.
* ``_frames`` — a run as an :class:`xarray.Dataset`, a store's runs as a :class:`pandas.DataFrame`.
* ``_hessian``, ``_kernel``, ``_images`` — the named views of a run's other families:
  ``run.hessian`` (H = I + S), ``run.kernel`` (per-class spectra, projections, reconstructions,
  dG_t, the constant-Gram prediction), ``run.images`` (2-D data).
* ``_run`` — :class:`Run`: the NSA quantities (eigenvalues, energies, losses, GD's stability).
* ``_sweep`` — :class:`Sweep`: the runs of one sweep read together, :func:`quantity`.
* ``_client`` — :class:`Client`: the store's runs and sweeps, ``verify``.

It may import ``config``, ``errors``, ``metrics``, ``losses``, ``hessian`` and ``store``.

Example — a tiny run written to a temporary store and read back; the stored energies E_t(y, k)
are the relative energy of y in the stored eigenvectors::

>>> import tempfile, numpy as np
>>> from nsa_dist.client import Client
>>> from nsa_dist.config import ExperimentSpec
>>> from nsa_dist.pipeline import run_experiment
>>> from nsa_dist.store import SpectrumStore
>>> folder = tempfile.TemporaryDirectory()
>>> url = f"{folder.name}/runs.zarr"
>>> spec = ExperimentSpec.model_validate({"name": "tiny", "data": {"n": 16}, "model": {"depth": 2, "width": 8},
...                                       "steps": 3, "record": {"every": 2},
...                                       "spectrum": {"k": 4, "images": [], "store_eigenvectors": True}})
>>> _ = run_experiment(spec, SpectrumStore(url))
>>> c = Client(url)
>>> c.runs()[["status", "steps_done"]].values.tolist()
[['done', 2]]
>>> run = c.run("tiny")                                   # by name, id or unique id prefix
>>> run.steps.tolist(), run.eigenvalues.shape
([0, 2], (2, 4))
>>> V, y = run.eigenvectors(2), run.y.reshape(-1)         # (N, k) at t = 2, the targets
>>> E = np.cumsum((V.T @ y) ** 2) / (y @ y)               # E_t(y, k) = Σ_{i≤k} ⟨v_i, y⟩² / ‖y‖²
>>> bool(np.allclose(run.energy("y")[1], E, rtol=1e-5))
True
>>> folder.cleanup()
"""

from nsa_dist.client._arrays import RunArrays
from nsa_dist.client._client import Client
from nsa_dist.client._curves import BracketedCurve
from nsa_dist.client._frames import flatten_spec, run_to_xarray, runs_frame
from nsa_dist.client._hessian import HessianView
from nsa_dist.client._images import ImagesView
from nsa_dist.client._kernel import KernelView
from nsa_dist.client._run import PHI_NAMES, Run
from nsa_dist.client._sweep import QUANTITIES, Curve, Sweep, quantity, records, varied_fields

__all__ = [
    "Client",
    "Run",
    "BracketedCurve",
    "RunArrays",
    "HessianView",
    "KernelView",
    "ImagesView",
    "Sweep",
    "Curve",
    "QUANTITIES",
    "quantity",
    "records",
    "varied_fields",
    "run_to_xarray",
    "runs_frame",
    "flatten_spec",
    "PHI_NAMES",
]
