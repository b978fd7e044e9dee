"""Top-k eigenpairs of (NTK) Gramians: dense LAPACK, block Lanczos, ARPACK; CPU or GPU.

* :func:`top_eigenpairs` — ``G V = V diag(λ)`` for a dense matrix (NumPy, torch, CuPy) or a
  matrix-free operator (``shape`` + ``matmat``), returning :class:`Eigenpairs`.
* :class:`EigMethod` — "auto" | "dense" | "lanczos" | "arpack", and when each wins.
* :class:`Backend` — "auto" | "numpy" | "torch" | "cupy": where the work runs.
* :class:`LanczosConvergenceWarning` — issued when Lanczos stops at ``max_iter``.
* :class:`HostWorkspace` — big CPU buffers a caller keeps between solves of the same size.
* :func:`step_spectrum` — a recorded step's spectrum for top-k and ``k: all`` alike: eigenvalues
  and ⟨v_i, φ⟩ of a few φ as a :class:`StepSpectrum`, by the route a :class:`SpectrumRoute`
  argument allows (eigenpairs; one tridiagonalisation without the N×N eigenvectors; one φ
  without Q) and T's divide and conquer its ``solver`` names (:mod:`nsa_dist.linalg.tridiag`).
* :func:`spectral_curves` — λ_k and E(φ, k) = Σ_{i≤k}⟨v_i, φ⟩²/‖φ‖² for every k from the top
  eigenpairs and products with G, with brackets (Gauss quadrature bounds, stochastic Lanczos
  quadrature of the counting function); :func:`curve_ks` the log grid of reported k.
* :class:`LinearOperator` — the one interface of every matrix-free operator (G, H, I, S, local
  or on a gang): ``shape``, ``dtype``, ``matmat`` on NumPy or torch blocks.

The Lanczos solver itself (:func:`nsa_dist.linalg.lanczos.block_lanczos`) works on any array
module through :class:`ArrayOps`; :func:`as_symmetric_map` turns a matrix or operator into the
validated :class:`SymmetricMap` the solvers take (shared with :mod:`nsa_dist.hessian`).

Owns: symmetric eigensolvers and the operator protocol; knows nothing of networks.
May import: NumPy, SciPy, torch, CuPy (behind a guard), :mod:`nsa_dist.config` (the
:class:`EigMethod` enum, defined with the spec), ``errors`` and ``_checks`` — nothing else of
nsa_dist.

Example — the top 3 eigenpairs of a 60×60 Gram by LAPACK and by block Lanczos, against NumPy's
``eigh`` (eigenvectors up to sign)::

>>> import numpy as np
>>> from nsa_dist.linalg import top_eigenpairs
>>> A = np.random.default_rng(0).standard_normal((60, 60))
>>> G = A @ A.T                                          # symmetric positive semi-definite, float64
>>> w, V = np.linalg.eigh(G)                             # the dense reference, ascending
>>> for method in ("dense", "lanczos"):
...     ep = top_eigenpairs(G, 3, method=method)         # descending: G V = V diag(λ)
...     print(method, np.allclose(ep.evals, w[::-1][:3], rtol=1e-8),
...           np.allclose(np.abs(ep.evecs.T @ V[:, ::-1][:, :3]), np.eye(3), atol=1e-6))
dense True True
lanczos True True

A step's whole spectrum (``k: all``) and the energies E(y, k) = Σ_{i≤k}⟨v_i, y⟩²/‖y‖² by each route
of :func:`step_spectrum`, against the same ``eigh`` (the one-vector route forms neither Q nor V)::

>>> from nsa_dist.linalg import step_spectrum
>>> y = np.sin(np.arange(60.0))
>>> E_ref = np.cumsum((V[:, ::-1].T @ y) ** 2) / (y @ y)
>>> for route in ("auto", "tridiagonal", "eigenpairs"):
...     sp = step_spectrum(G, 60, {"y": y}, route=route)
...     E = np.cumsum(sp.proj["y"][:, 0] ** 2) / (y @ y)
...     print(sp.route, np.allclose(sp.evals, w[::-1], rtol=1e-9), np.allclose(E, E_ref, atol=1e-9))
one_vector True True
tridiagonal True True
eigenpairs True True
"""

from __future__ import annotations

from nsa_dist.config import EigMethod
from nsa_dist.linalg._backend import ArrayOps, Backend, HostWorkspace
from nsa_dist.linalg._inputs import SymmetricMap, as_symmetric_map, sym_rtol
from nsa_dist.linalg.eigenpairs import Eigenpairs, top_eigenpairs
from nsa_dist.linalg.lanczos import LanczosConvergenceWarning
from nsa_dist.linalg.operator import LinearOperator, Materialised
from nsa_dist.linalg.quadrature import SpectralCurves, atoms_density, curve_ks, describe_width, spectral_curves
from nsa_dist.linalg.spectrum import SpectrumRoute, StepSpectrum, step_spectrum

__all__ = [
    "sym_rtol",
    "ArrayOps",
    "Backend",
    "EigMethod",
    "Eigenpairs",
    "HostWorkspace",
    "top_eigenpairs",
    "LanczosConvergenceWarning",
    "LinearOperator",
    "Materialised",
    "SymmetricMap",
    "as_symmetric_map",
    "SpectralCurves",
    "atoms_density",
    "describe_width",
    "curve_ks",
    "spectral_curves",
    "SpectrumRoute",
    "StepSpectrum",
    "step_spectrum",
]
