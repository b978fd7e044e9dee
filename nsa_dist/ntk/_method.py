"""Choice of NTK algorithm (private; re-exported from :mod:`nsa_dist.ntk`)."""

from __future__ import annotations

from enum import Enum

__all__ = ["NTKMethod", "Kernel"]


class NTKMethod(str, Enum):
    """How the Gramian is computed.

    STRUCTURED: per-layer formula ``G = Σ_l (Â_l Â_lᵀ) ⊙ (Δ_l Δ_lᵀ)`` from one forward and one
        backward pass per block (Â_l = [w_l·A_l, β_l·1] the scaled layer inputs, Δ_l the output
        gradients).  Costs O(N²·Σ_l(n_in+n_out)) and never forms the N×P Jacobian: wins for every
        network whose trainable parameters all live in ``nn.Linear`` layers applied once per
        sample to (n, features) inputs — MLPs, residual MLPs, the NTK parametrisation.
    PER_LAYER: per-sample per-layer gradients of networks of ``nn.Conv2d`` and ``nn.Linear`` layers
        from one forward and one backward pass per block (``unfold`` for convolutions), contracted
        block by block; Linear layers on (n, features) inputs keep the structured factors.  Wins
        for CNNs: the Jacobian of the large Linear layers is never formed (see ``_conv.py``).
    JACOBIAN: per-sample Jacobians from ``torch.func`` (``vmap(jacrev)``) contracted block by block,
        ``G_IJ = J_I J_Jᵀ``.  Costs O(N²·P) plus the Jacobians: the fallback for any module
        (convolutions, norms, weight sharing).
    AUTO: STRUCTURED when the model qualifies, else PER_LAYER when it qualifies, otherwise JACOBIAN.
    """

    AUTO = "auto"
    STRUCTURED = "structured"
    JACOBIAN = "jacobian"
    PER_LAYER = "per_layer"


class Kernel(str, Enum):
    """Which kernel of a K-output model.

    TRACE: the output-traced (N, N) kernel ``Σ_a ∇f_a(x)·∇f_a(x′)`` — for K = 1 the NSA Gramian.
    FULL: the full (N, K, N, K) kernel ``∇f_a(x)·∇f_b(x′)``.
    """

    TRACE = "trace"
    FULL = "full"
