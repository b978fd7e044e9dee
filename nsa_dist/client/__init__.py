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
"""

from nsa_dist.client._arrays import RunArrays
from nsa_dist.client._client import Client
from nsa_dist.client._curves import BracketedCurve
from nsa_dist.client._frames import flatten_spec, run_to_xarray, runs_frame
from nsa_dist.client._hessian import HessianView
from nsa_dist.client._images import ImagesView
from nsa_dist.client._kernel import KernelView
from nsa_dist.client._run import PHI_NAMES, Run
from nsa_dist.client._sweep import QUANTITIES, Curve, Sweep, quantity, varied_fields

__all__ = ["Client", "Run", "BracketedCurve", "RunArrays", "HessianView", "KernelView", "ImagesView", "Sweep", "Curve", "QUANTITIES",
           "quantity", "varied_fields", "run_to_xarray", "runs_frame", "flatten_spec", "PHI_NAMES"]
