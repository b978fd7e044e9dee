"""Exact NTK Gramians (structured per-layer formula, torch.func Jacobians, matrix-free products)
and the infinite-width limit Θ∞ (:func:`limit_ntk`).

Owns: every way of computing G = J Jᵀ of a torch model (:func:`gram`, :func:`ntk_operator`, the
block and shard features of :mod:`.blocks` / :mod:`.shards` that the gang layouts assemble), the
choice among them (:class:`NTKMethod`, defined with the spec in :mod:`nsa_dist.config`; the
routes of :func:`explain_method`; :func:`resolve_route`'s :class:`NTKRoute`, the probe's result
that a run decides once and hands to every :func:`gram` call, which then never probes again),
and the model hygiene every measurement of a user's model shares — the public modules
:mod:`.inputs` (validation, feature memory rule), :mod:`.state` (buffers and modes restored)
and :mod:`.blame` (one error naming the failing module), which :mod:`nsa_dist.hessian` uses too.

May import: torch, numpy (CuPy only behind a guard), :mod:`nsa_dist.config` (enums),
:mod:`nsa_dist.models` (the NTK parametrisation's layers), :mod:`nsa_dist.linalg`
(:class:`~nsa_dist.linalg.LinearOperator`), ``errors`` and ``_checks`` — never Ray, Zarr, the
pipeline or the store.

Example — :func:`gram` of a small two-output network against the dense float64 Jacobian of
``torch.func.jacrev``, both kernels::

>>> import torch
>>> from torch.func import functional_call, jacrev
>>> from nsa_dist.ntk import explain_method, gram
>>> _ = torch.manual_seed(0)
>>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
>>> x = torch.randn(5, 3, dtype=torch.float64)
>>> G = gram(model, x)                      # (N, N): Σ_a ∇f_a · ∇f_a over the K = 2 outputs
>>> full = gram(model, x, kernel="full")    # (N, K, N, K)
>>> jac = jacrev(lambda p: functional_call(model, p, (x,)))(dict(model.named_parameters()))
>>> J = torch.cat([j.reshape(5, 2, -1) for j in jac.values()], 2)  # (N, K, P), the dense reference
>>> torch.allclose(G, torch.einsum("iap,jap->ij", J, J), rtol=1e-12)
True
>>> torch.allclose(full, torch.einsum("iap,jbp->iajb", J, J), rtol=1e-12)
True
"""

from nsa_dist.config import NTKMethod
from nsa_dist.ntk._method import Kernel
from nsa_dist.ntk._probe import batch_decides, couples as sample_coupling
from nsa_dist.ntk.gram import explain_method, gram, ntk_operator, resolve_method, resolve_route
from nsa_dist.ntk.inputs import prepare_model
from nsa_dist.ntk.limit import limit_ntk
from nsa_dist.ntk.operator import NTKOperator, jacobian_vector_product
from nsa_dist.ntk.route import NTKRoute
from nsa_dist.ntk.state import attributes_restored, preserved

__all__ = [
    "Kernel",
    "NTKMethod",
    "NTKOperator",
    "NTKRoute",
    "batch_decides",
    "explain_method",
    "gram",
    "jacobian_vector_product",
    "limit_ntk",
    "ntk_operator",
    "prepare_model",
    "preserved",
    "attributes_restored",
    "resolve_method",
    "resolve_route",
    "sample_coupling",
]
