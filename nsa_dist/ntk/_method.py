"""Choice of NTK algorithm (private; re-exported from :mod:`nsa_dist.ntk`)."""

from __future__ import annotations

from enum import Enum

__all__ = ["NTKMethod", "Kernel"]


class NTKMethod(str, Enum):
    """How the Gramian is computed.

    Which parameter may take which path is decided from what the forward pass does (probe
    forwards: which layer used which parameter how often, whether a saved layer input or output
    was modified in place, whether the samples are coupled), never from module types alone.

    STRUCTURED: per-layer formula ``G = Σ_l (Â_l Â_lᵀ) ⊙ (Δ_l Δ_lᵀ)`` from one forward and one
        backward pass per block (Â_l = [w_l·A_l, β_l·1] the scaled layer inputs, Δ_l the output
        gradients).  Costs O(N²·Σ_l(n_in+n_out)) and never forms the N×P Jacobian: wins for every
        network whose trainable parameters all live in ``nn.Linear`` layers applied once per
        sample to (n, features) inputs — MLPs, residual MLPs, the NTK parametrisation.
    PER_LAYER: the hybrid ``G = Σ_g J_g J_gᵀ`` over parameter groups: the structured factors of
        Linear layers, formed per-sample gradients of Conv1d/2d/3d, Embedding, LayerNorm,
        GroupNorm, eval-mode BatchNorm and unmasked self-attention (its two projections) from
        their inputs and output gradients, and per-sample Jacobians (torch.func) for every other
        parameter (recurrent, masked attention, tied weights), contracted at the GEMM rate on
        upper tiles.  Costs O(N²·P_formed) plus about three passes' work per point for the
        features; memory ``min(N·K·P_formed, FEATURE_BYTES)`` plus G (past the budget, one
        extra forward/backward pass per column group).  Wins for CNNs, ResNets and Transformers:
        one unsupported module costs only its own parameters' Jacobians.
    JACOBIAN: per-sample Jacobians from ``torch.func`` (``vmap(jacrev)``; one reverse pass per point
        where vmap has no rule) contracted block by block, ``G_IJ = J_I J_Jᵀ``.  Costs O(N²·P)
        plus the Jacobians: exact for any module whose samples do not interact.
    BATCH: the full-batch Jacobian ``J = ∂f(X)/∂θ`` (one forward of all points, reverse passes in
        row chunks): the kernel of the batch forward for models that couple samples (BatchNorm
        in train mode or without running statistics).  The only exact choice there.
    AUTO: BATCH when the samples are coupled, else STRUCTURED when every parameter qualifies,
        else PER_LAYER when any layer does, otherwise JACOBIAN.
    """

    AUTO = "auto"
    STRUCTURED = "structured"
    JACOBIAN = "jacobian"
    PER_LAYER = "per_layer"
    BATCH = "batch"


class Kernel(str, Enum):
    """Which kernel of a K-output model.

    TRACE: the output-traced (N, N) kernel ``Σ_a ∇f_a(x)·∇f_a(x′)`` — for K = 1 the NSA Gramian.
    FULL: the full (N, K, N, K) kernel ``∇f_a(x)·∇f_b(x′)``.
    """

    TRACE = "trace"
    FULL = "full"
