"""The loss Hessian ``H = I + S`` of a network, matrix-free (the Hessian paper, Jacot et al.).

* Operators — :func:`hessian_operator` (``part="H" | "I" | "S"``), :func:`hessian_parts`:
  P×P products ``v ↦ A v`` by ``torch.func``, blocked over the data; ``loss`` ("mse" = "l2" or
  "cross_entropy", a :class:`~nsa_dist.config.LossName`) fixes the convention
  ``C = (1/N) Σ_i c(f(x_i), y_i)``; :func:`prepare_targets` gives the (N, K) targets it uses.
* Moments ``Tr(A^k)`` — :func:`hutchinson_moments`, :func:`hutchpp_moments` (estimate, standard
  error, products); exact: :func:`gauss_newton_moments` / :func:`gauss_newton_eigenvalues` (I from
  the NTK Gram), :func:`dense_moments` (small P).
* Orthogonality of I and S — :func:`orthogonality` (``‖IS‖_F / (‖I‖_F ‖S‖_F)``),
  :func:`rayleigh_quotients` (Fig. 3).
* Extreme eigenpairs — :func:`extreme_eigenpairs` (largest / smallest / magnitude, Lanczos),
  :func:`edge_of_stability` (``λ_max δ / 2``).
* Spectral density — :func:`slq_density` (stochastic Lanczos quadrature).
* The paper's predictions — :func:`additivity_gap` (Theorem 1, shared probes),
  :func:`output_hessian_traces` / :func:`trace_S_from_G` (Tr(S) = ∇Cᵀ·G),
  :func:`limit_gauss_newton_eigenvalues` (I from Θ∞), :func:`numerical_ranks` (rank bounds).
* The limits of S — :func:`limit_S_kernels` (Φ̃, Υ̃, Λ̃ by recursion), :func:`limit_trace_S_init`
  (E[Tr S] at initialisation), :func:`limit_trace_S2` (Tr(S²) = ∇Cᵀ Υ̃ ∇C),
  :func:`limit_trace_S_gd` (E[Tr S_t] along MSE GD).

Owns: the loss's curvature in output space and every Hessian measurement of a torch model.
May import: torch, NumPy, :mod:`nsa_dist.ntk` (its front door and the public modules
``ntk.inputs``, ``ntk.state``, ``ntk.blame``, ``ntk.limit``), :mod:`nsa_dist.linalg`,
:mod:`nsa_dist.losses` (the loss names' parsing and the residual ∇_f c), :mod:`nsa_dist.config`
(enums), :mod:`nsa_dist.models` (the softplus constants of the limits), ``errors`` and
``_checks`` — never the pipeline, Ray or the store.

Example — the matrix-free H, I and S of a small network's MSE loss, applied to the identity,
against the dense float64 Hessian of ``torch.func.hessian``: H and I + S both::

>>> import torch
>>> from torch.func import functional_call, hessian
>>> from nsa_dist.hessian import hessian_operator
>>> _ = torch.manual_seed(0)
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
>>> X, Y = torch.randn(6, 2, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
>>> H, I, S = (hessian_operator(model, X, Y, part=p) for p in "HIS")
>>> H.shape                                               # P × P, P = 4·2 + 4 + 4 + 1
(17, 17)
>>> params = {n: p.detach() for n, p in model.named_parameters()}
>>> sizes = [p.numel() for p in params.values()]
>>> def C(theta):                                         # C(θ) = (1/2N) Σ ‖f(x_i; θ) − y_i‖²
...     p = dict(zip(params, (t.view_as(q) for t, q in zip(theta.split(sizes), params.values()))))
...     return 0.5 * ((functional_call(model, p, (X,)) - Y) ** 2).sum() / X.shape[0]
>>> dense = hessian(C)(torch.cat([p.reshape(-1) for p in params.values()]))  # the dense reference
>>> eye = torch.eye(17, dtype=torch.float64)
>>> torch.allclose(H.matmat(eye), dense, atol=1e-12), torch.allclose(I.matmat(eye) + S.matmat(eye), dense, atol=1e-12)
(True, True)
"""

from nsa_dist.hessian._loss import prepare_targets
from nsa_dist.hessian._operator import LossCurvatureOperator
from nsa_dist.hessian.eigen import Which, edge_of_stability, extreme_eigenpairs
from nsa_dist.hessian.moments import (
    Moments,
    dense_moments,
    gauss_newton_eigenvalues,
    gauss_newton_moments,
    hutchinson_moments,
    hutchpp_moments,
)
from nsa_dist.hessian.operators import (
    GaussNewtonOperator,
    HessianOperator,
    HessianPart,
    ResidualOperator,
    hessian_operator,
    hessian_parts,
)
from nsa_dist.hessian.orthogonality import Orthogonality, RayleighQuotients, orthogonality, rayleigh_quotients
from nsa_dist.hessian.s_limit import SKernels, limit_S_kernels, limit_trace_S2, limit_trace_S_gd, limit_trace_S_init
from nsa_dist.hessian.slq import SpectralDensity, slq_density
from nsa_dist.hessian.theory import (
    OutputTraces,
    Ranks,
    additivity_gap,
    limit_gauss_newton_eigenvalues,
    numerical_ranks,
    output_hessian_traces,
    power_moments,
    trace_S_from_G,
)

__all__ = [
    "prepare_targets",
    "HessianPart",
    "LossCurvatureOperator",
    "HessianOperator",
    "GaussNewtonOperator",
    "ResidualOperator",
    "hessian_operator",
    "hessian_parts",
    "Moments",
    "hutchinson_moments",
    "hutchpp_moments",
    "dense_moments",
    "gauss_newton_eigenvalues",
    "gauss_newton_moments",
    "Orthogonality",
    "orthogonality",
    "RayleighQuotients",
    "rayleigh_quotients",
    "Which",
    "extreme_eigenpairs",
    "edge_of_stability",
    "SpectralDensity",
    "slq_density",
    "additivity_gap",
    "OutputTraces",
    "output_hessian_traces",
    "trace_S_from_G",
    "limit_gauss_newton_eigenvalues",
    "power_moments",
    "Ranks",
    "numerical_ranks",
    "SKernels",
    "limit_S_kernels",
    "limit_trace_S_init",
    "limit_trace_S2",
    "limit_trace_S_gd",
]
