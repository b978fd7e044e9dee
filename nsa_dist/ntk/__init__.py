"""Exact NTK Gramians (structured per-layer formula, torch.func Jacobians, matrix-free products)
and the infinite-width limit Θ∞ (:func:`limit_ntk`)."""

from nsa_dist.ntk._method import Kernel, NTKMethod
from nsa_dist.ntk.inputs import prepare_model
from nsa_dist.ntk._operator import NTKOperator, jacobian_vector_product
from nsa_dist.ntk.gram import explain_method, gram, ntk_operator, resolve_method
from nsa_dist.ntk._probe import couples as sample_coupling
from nsa_dist.ntk.state import preserved
from nsa_dist.ntk.limit import limit_ntk

__all__ = ["Kernel", "NTKMethod", "NTKOperator", "explain_method", "gram", "jacobian_vector_product", "limit_ntk", "ntk_operator", "prepare_model", "preserved", "resolve_method",
           "sample_coupling"]
