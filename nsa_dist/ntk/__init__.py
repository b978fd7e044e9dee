"""Exact NTK Gramians: structured per-layer formula, torch.func Jacobians, matrix-free products."""

from nsa_dist.ntk._method import Kernel, NTKMethod
from nsa_dist.ntk._operator import NTKOperator
from nsa_dist.ntk.gram import gram, ntk_operator, resolve_method

__all__ = ["Kernel", "NTKMethod", "NTKOperator", "gram", "ntk_operator", "resolve_method"]
