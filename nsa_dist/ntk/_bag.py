"""``F.embedding_bag`` by composite ops, for the AD modes PyTorch lacks for it (private).

PyTorch 2.13's ``_embedding_bag`` has no forward-mode rule and its backward
(``_embedding_bag_backward``) no derivative: every ``jvp`` through an ``nn.EmbeddingBag`` and every
second derivative (the loss Hessian's H, I and S; PyTorch's own tutorial text classifier is an
``EmbeddingBag(mode='mean')`` and a Linear) raised NotImplementedError.  Composed of an embedding
lookup and a sum / mean / max over each bag, it is the same function, and every mode
differentiates it: :func:`composite_bags` swaps it in for the duration of a block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["composite_bags", "embedding_bag"]

_ARGS = (
    "input",
    "weight",
    "offsets",
    "max_norm",
    "norm_type",
    "scale_grad_by_freq",
    "mode",
    "sparse",
    "per_sample_weights",
    "include_last_offset",
    "padding_idx",
)
_DEFAULTS = {"norm_type": 2.0, "scale_grad_by_freq": False, "mode": "mean", "sparse": False}


def embedding_bag(
    input: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    mode: str = "mean",
    sparse: bool = False,
    per_sample_weights: torch.Tensor | None = None,
    include_last_offset: bool = False,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """``F.embedding_bag`` with ``F.embedding_bag``'s arguments and value (to rounding), composed of
    ``F.embedding`` and a reduction that every AD mode differentiates.

    Bags are the rows of a 2-D ``input``, or the runs of a 1-D one that ``offsets`` start;
    ``padding_idx`` entries take no part (nor count towards a mean); an empty bag is zeros.
    ``scale_grad_by_freq`` does not change the function (only PyTorch's gradient of it), so it is
    not applied: the derivative is what every product of nsa-dist differentiates.  ``sparse`` too
    is a gradient format only."""
    del scale_grad_by_freq, sparse
    if mode not in ("sum", "mean", "max"):
        raise ValueError(f"embedding_bag: mode must be 'sum', 'mean' or 'max', got {mode!r}")
    rows = F.embedding(input, weight, None, max_norm, norm_type)  # renormalises as the fused kernel does
    n_rows = weight.shape[0]
    keep = torch.ones_like(input, dtype=torch.bool) if padding_idx is None else input != padding_idx % n_rows
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(-1).to(rows.dtype)
    if input.dim() == 2:  # (B, L): each row a bag of L entries
        if mode == "max":
            out = rows.masked_fill(~keep.unsqueeze(-1), float("-inf")).amax(dim=1)
        else:
            out = (rows * keep.unsqueeze(-1)).sum(dim=1)
        count = keep.sum(dim=1)
    else:  # (n,) with offsets: bag b is input[offsets[b]:offsets[b + 1]], the last to the end
        starts = offsets[:-1] if include_last_offset else offsets
        # the last bag runs to the input's end, as PyTorch's kernel runs it even with include_last_offset
        # (an offsets[-1] short of it: a review found [9, 6] against PyTorch's [9, 19])
        inner = offsets[1:-1] if include_last_offset else offsets[1:]
        ends = torch.cat([inner, offsets.new_tensor([input.shape[0]])])
        B = starts.shape[0]
        bag = torch.repeat_interleave(torch.arange(B, device=input.device), ends - starts)
        lo, hi = (int(starts[0]), int(ends[-1])) if B else (0, 0)
        rows, keep = rows[lo:hi], keep[lo:hi]
        D = weight.shape[1]
        if mode == "max":
            masked = rows.masked_fill(~keep.unsqueeze(-1), float("-inf"))
            init = torch.full((B, D), float("-inf"), dtype=rows.dtype, device=rows.device)
            out = init.scatter_reduce(0, bag.unsqueeze(-1).expand(-1, D), masked, "amax", include_self=True)
        else:
            out = torch.zeros((B, D), dtype=rows.dtype, device=rows.device).index_add(0, bag, rows * keep.unsqueeze(-1))
        count = torch.zeros(B, dtype=torch.long, device=input.device).index_add(0, bag, keep.long())
    if mode == "mean":
        out = out / count.clamp(min=1).unsqueeze(-1).to(out.dtype)
    elif mode == "max":
        out = torch.where((count > 0).unsqueeze(-1), out, torch.zeros_like(out))  # an empty bag is zeros
    return out


class _CompositeBags(TorchFunctionMode):
    """``F.embedding_bag`` by :func:`embedding_bag` (see :func:`composite_bags`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if func is F.embedding_bag:
            call = {**_DEFAULTS, **dict(zip(_ARGS, args)), **kwargs}
            return embedding_bag(**call)
        return func(*args, **kwargs)


@contextlib.contextmanager
def composite_bags() -> Iterator[None]:
    """Within the block (this thread only), ``F.embedding_bag`` — ``nn.EmbeddingBag``'s forward, or a
    model's own call — runs :func:`embedding_bag`: forward mode and second derivatives then exist."""
    with _CompositeBags():
        yield
