"""Self-attention as two Linear layers at every position, for the per-layer NTK (private).

``nn.MultiheadAttention`` (packed in-projection, no bias_k/bias_v, no zero attention, no dropout)
applied as self-attention without masks is

    qkv = x W_inᵀ + b_in            (n, T, 3E)   — a Linear at T positions
    ctx = softmax(q kᵀ/√d_h) v      (n, T, E)    per head, no parameters
    out = ctx W_outᵀ + b_out        (n, T, E)    — a Linear at T positions

so ``∂f_a/∂W_in = Σ_t δqkv_{a,t} x_tᵀ`` and ``∂f_a/∂W_out = Σ_t δout_{a,t} ctx_tᵀ`` from the inputs
and output gradients of the two projections: the per-layer path's "Linear at L positions".
During a feature pass the module's forward is replaced by exactly this decomposition, with the
projections as :class:`Projection` modules the pass can hook; :func:`attention_call_ok` (at probe
time) checks the call and that the decomposition gives the module's own output.

:func:`composite_attention` is the other half: forward-mode AD (every ``jvp`` of the operators,
the Hessian products, the first-order predictions) needs attention computed by kernels that have
a forward-mode rule, wherever the model calls it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = [
    "Projection",
    "attention_ok",
    "attention_call_ok",
    "composite_attention",
    "decomposed",
    "decomposed_forwards",
    "projections",
]


class Projection(nn.Module):
    """One projection of a MultiheadAttention as a Linear layer: ``x ↦ x Wᵀ + b`` with the
    attention module's own parameters (``owner``'s ``names``)."""

    def __init__(self, owner: nn.MultiheadAttention, weight: str, bias: str) -> None:
        super().__init__()
        object.__setattr__(self, "owner", owner)  # not a submodule
        self.names = (weight, bias)

    @property
    def weight(self) -> torch.Tensor:
        return _attr(self.owner, self.names[0])

    @property
    def bias(self) -> torch.Tensor | None:
        return _attr(self.owner, self.names[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _attr(m: nn.Module, dotted: str) -> torch.Tensor | None:
    """``m.a.b`` by attribute access (so ``torch.func.functional_call``'s swapped tensors are seen)."""
    for part in dotted.split("."):
        m = getattr(m, part)
    return m


def attention_ok(m: nn.Module) -> bool:
    """A standard MultiheadAttention whose forward the decomposition reproduces."""
    return (
        isinstance(m, nn.MultiheadAttention)
        and type(m).forward is nn.MultiheadAttention.forward
        and "forward" not in m.__dict__
        and m._qkv_same_embed_dim
        and m.in_proj_weight is not None
        and m.bias_k is None
        and m.bias_v is None
        and not m.add_zero_attn
        and (m.dropout == 0.0 or not m.training)
    )


def _call(args: tuple, kwargs: dict) -> dict:
    names = (
        "query",
        "key",
        "value",
        "key_padding_mask",
        "need_weights",
        "attn_mask",
        "average_attn_weights",
        "is_causal",
    )
    call = {
        "key_padding_mask": None,
        "need_weights": True,
        "attn_mask": None,
        "average_attn_weights": True,
        "is_causal": False,
    }
    call.update(dict(zip(names, args)))
    call.update(kwargs)
    return call


def _outside(args: tuple, kwargs: dict) -> str | None:
    """Why a call with these arguments is not unmasked batched self-attention (None: it is)."""
    c = _call(args, kwargs)
    q = c.get("query")
    if not (q is c.get("key") is c.get("value")) or not isinstance(q, torch.Tensor) or q.ndim != 3:
        return "it is not called as batched self-attention (query is key is value)"
    if c["key_padding_mask"] is not None or c["attn_mask"] is not None or c["is_causal"]:
        return "it is called with a mask"
    return None


def attention_call_ok(m: nn.MultiheadAttention, args: tuple, kwargs: dict, out: object) -> str | None:
    """Why one recorded call of m is outside the decomposition (None: inside, and it reproduces
    the module's output to rounding)."""
    why = _outside(args, kwargs)
    if why is not None:
        return why
    q = _call(args, kwargs)["query"]
    with torch.no_grad():
        mine = decomposed(m, *projections(m), *args, **kwargs)
    ref = out[0] if isinstance(out, tuple) else out
    tol = 1e-9 if q.dtype == torch.float64 else 1e-4
    if (
        not isinstance(ref, torch.Tensor)
        or mine[0].shape != ref.shape
        or (mine[0] - ref).abs().max() > tol * ref.abs().max().clamp_min(1.0)
    ):
        return "its output differs from the decomposition into projections"
    return None


def decomposed(
    m: nn.MultiheadAttention, p_in: Projection, p_out: Projection, query: torch.Tensor, *args: object, **kwargs: object
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The module's forward for an unmasked self-attention call, through the projections."""
    c = _call((query,) + args, kwargs)
    x = query if m.batch_first else query.transpose(0, 1)  # (n, T, E)
    n, T, E = x.shape
    h = m.num_heads
    q, k, v = (t.reshape(n, T, h, E // h).transpose(1, 2) for t in p_in(x).chunk(3, dim=-1))  # (n, h, T, d_h)
    weights = None
    if c["need_weights"]:
        att = torch.softmax((q * (E // h) ** -0.5) @ k.transpose(-2, -1), dim=-1)  # (n, h, T, T)
        ctx = att @ v
        weights = att.mean(1) if c["average_attn_weights"] else att
    else:
        ctx = F.scaled_dot_product_attention(q, k, v)  # (n, h, T, d_h)
    out = p_out(ctx.transpose(1, 2).reshape(n, T, E))  # (n, T, E)
    return (out if m.batch_first else out.transpose(0, 1)), weights


def projections(m: nn.MultiheadAttention) -> tuple[Projection, Projection]:
    """The in- and out-projection of m as Linear-like modules (each knows the pair as ``pair``)."""
    pair = (Projection(m, "in_proj_weight", "in_proj_bias"), Projection(m, "out_proj.weight", "out_proj.bias"))
    for p in pair:
        object.__setattr__(p, "pair", pair)
    return pair


@contextlib.contextmanager
def decomposed_forwards(pairs: list[tuple[nn.MultiheadAttention, Projection, Projection]]) -> Iterator[None]:
    """Within the block, each attention module runs :func:`decomposed` through its projections.

    A call outside the decomposition (a mask, query not key and value) raises
    :class:`~nsa_dist.ntk._structured.Unproven`: the probe proved unmasked self-attention on its
    points only, and a forward that passes a mask for some batches alone (``key_padding_mask=pad
    if pad.any() else None``) would otherwise run without it — the caller takes the exact path."""
    for m, p_in, p_out in pairs:
        m.forward = lambda *a, _m=m, _i=p_in, _o=p_out, **k: _checked(_m, _i, _o, *a, **k)
    try:
        yield
    finally:
        for m, _, _ in pairs:
            del m.forward


def _checked(
    m: nn.MultiheadAttention, p_in: Projection, p_out: Projection, *args: object, **kwargs: object
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`decomposed` for a call inside it, else :class:`~nsa_dist.ntk._structured.Unproven`."""
    why = _outside(args, kwargs)
    if why is not None:
        from nsa_dist.ntk._structured import Unproven  # (_structured imports this module's users)

        raise Unproven(f"{type(m).__name__}: {why} in a feature pass (the probe saw unmasked self-attention)")
    return decomposed(m, p_in, p_out, *args, **kwargs)


def _math_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` by its math backend: the composite of matmuls and a
    softmax that every AD mode differentiates (the fused CPU flash and CUDA kernels have no
    forward-mode rule).

    A boolean ``attn_mask`` (True: take part; Hugging Face's masks) is made the additive mask
    (0 / -inf) ``F.scaled_dot_product_attention`` makes of it before it dispatches; the aten math
    kernel does not convert it (a padded Llama's ``ntk_operator`` was 0.28 off, a forward with a
    boolean mask up to 1.2 off ``F.scaled_dot_product_attention``'s)."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )[0]


class _CompositeAttention(TorchFunctionMode):
    """Attention by composite kernels, in this thread only.

    * ``F.scaled_dot_product_attention`` called anywhere (a model's own code, nanoGPT / Hugging
      Face style) runs its math backend;
    * ``F.multi_head_attention_forward`` without weights (``nn.MultiheadAttention`` calls the
      fused kernel then) computes them, by the explicit softmax, and returns None for them as asked;
    * the fused fast paths of ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer``
      (``_native_multi_head_attention``, ``_transformer_encoder_layer_fwd``) are not taken: they
      are skipped whenever a torch-function mode is active.

    Each is the same function as the fused kernel, to rounding.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _math_attention(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            call = inspect.signature(func).bind(*args, **kwargs).arguments
            if not call.get("need_weights", True):
                call, dead = _live_rows(call)
                out, _ = func(**{**call, "need_weights": True})
                return _dead_rows_out(out, dead, call.get("out_proj_bias")), None
        return func(*args, **kwargs)


def _live_rows(call: dict) -> tuple[dict, torch.Tensor | None]:
    """``F.multi_head_attention_forward``'s arguments with no query row whose keys are all masked,
    and those rows (N, L) bool (None: none can be, or the masks are not of a form this reads).

    Without weights the fused and math kernels give such a row (a fully padded sequence) zero
    attention, so the output there is ``out_proj``'s bias; the explicit softmax this mode computes
    the weights by is NaN there — the kernel, the operator and the Hessian of a padded batch came out
    NaN where ``gram`` was exact (two audits).  The row's masks are lifted (one additive mask per
    head, 0 on that row), and :func:`_dead_rows_out` puts the bias there.  Read for a key padding
    mask and a 2-D attention mask (bool or additive; a causal one too, which comes with
    ``is_causal``); a 3-D one (per head: its heads' rows may die apart, which the output cannot
    undo), ``add_zero_attn``, ``bias_k`` and static keys are left as they are."""
    kpm, am, q = call.get("key_padding_mask"), call.get("attn_mask"), call["query"]
    if (kpm is None and am is None) or call.get("add_zero_attn"):  # (is_causal comes with its attn_mask)
        return call, None
    if call.get("bias_k") is not None or call.get("static_k") is not None or (am is not None and am.dim() != 2):
        return call, None
    batched = q.dim() == 3
    L, S = q.shape[0], call["key"].shape[0]
    n = q.shape[1] if batched else 1
    h = int(call["num_heads"])

    def additive(m: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        if m is None:
            return q.new_zeros(shape)
        m = m.reshape(shape)
        return torch.where(m, float("-inf"), 0.0).to(q.dtype) if m.dtype == torch.bool else m.to(q.dtype)

    mask = additive(kpm, (n, 1, S)) + additive(am, (1, L, S))  # (n, L, S)
    dead = torch.isneginf(mask).all(-1)  # (n, L)
    mask = torch.where(dead[..., None], 0.0, mask).to(q.dtype)
    mask = mask.repeat_interleave(h, dim=0) if batched else mask.expand(h, L, S)  # (n·h, L, S): per head
    return {**call, "key_padding_mask": None, "attn_mask": mask}, dead


def _dead_rows_out(out: torch.Tensor, dead: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """``out`` (L, N, E) or (L, E) with the all-masked rows ``dead`` (N, L) set to ``out_proj``'s bias
    (0 without one): zero attention through the output projection, as the fused kernel gives."""
    if dead is None:
        return out
    rows = dead.transpose(0, 1)[..., None] if out.dim() == 3 else dead[0][:, None]  # (L, N, 1) or (L, 1)
    fill = bias if bias is not None else out.new_zeros(())
    return torch.where(rows, fill.to(out.dtype), out)


@contextlib.contextmanager
def composite_attention() -> Iterator[None]:
    """Within the block (this thread only), every attention — ``F.scaled_dot_product_attention``
    called by the model itself, ``nn.MultiheadAttention``, the Transformer layers — runs composite
    kernels that have forward-mode and higher-order derivatives: the same function, exactly.

    Thread-local (a torch-function mode): a training loop in another thread keeps its fused
    kernels, and no process-wide switch is left set when blocks in two threads overlap.
    """
    with _CompositeAttention():
        yield
