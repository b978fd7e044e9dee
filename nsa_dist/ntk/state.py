"""The user's model is never changed by a measurement (shared with :mod:`nsa_dist.hessian`).

NTK, operator and Hessian calls run forwards of the user's model: a BatchNorm in train mode
updates its running statistics and ``num_batches_tracked`` on every forward.  ``preserved``
puts buffers and training modes back afterwards; ``stateless`` gives a model whose forwards
change no buffer at all (needed inside ``torch.func`` transforms, which refuse to mutate a
captured tensor), computing the same function.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from nsa_dist.errors import UnsupportedModelError

__all__ = ["preserved", "stateless", "batch_stat_modules", "exact_kernels"]


@contextlib.contextmanager
def preserved(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block the model may run forwards freely; on exit its buffers (values) and every
    module's training mode are what they were on entry."""
    modes = [(m, m.training) for m in model.modules()]
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield model
    finally:
        with torch.no_grad():
            for b, v in saved:
                if not torch.equal(b, v):
                    b.data.copy_(v)  # through .data: no version bump, so a backward that saved b still runs
        for m, mode in modes:
            m.training = mode


def batch_stat_modules(model: nn.Module) -> list[str]:
    """The batch-norm modules whose forward uses the batch's own statistics (train mode, or no
    running statistics) — they couple the samples of a batch — as "'name' (Type, why)"."""
    return [
        f"{name!r} ({type(m).__name__}, {'train mode' if m.training else 'no running statistics'})"
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or m.running_mean is None)
    ]


def stateless(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """``model`` itself when its forward changes no buffer, else a copy whose train-mode batch norms
    keep no running statistics (the same outputs: train mode normalises by the batch's statistics).

    Raises:
        UnsupportedModelError: a forward changes a buffer of another kind of module (named).
    """
    before = {name: b._version for name, b in model.named_buffers()}
    with preserved(model), torch.no_grad():
        model(x)
        changed = [name for name, b in model.named_buffers() if b._version != before[name]]
    if not changed:
        return model
    owners = {f"{n}.{k}" if n else k: m for n, m in model.named_modules() for k, _ in m.named_buffers(recurse=False)}
    other = [name for name in changed if not isinstance(owners[name], nn.modules.batchnorm._BatchNorm)]
    if other:
        mod = owners[other[0]]
        raise UnsupportedModelError(
            f"the model's forward modifies its buffer {other[0]!r} ({type(mod).__name__}) in "
            "place; nsa-dist computes kernels only of forwards that change no state "
            "besides batch-norm running statistics"
        )
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
            # as torch.func's replace_all_batch_norm_modules_
            m.running_mean = m.running_var = m.num_batches_tracked = None
    return twin


@contextlib.contextmanager
def exact_kernels(model: nn.Module) -> Iterator[None]:
    """Composite kernels inside forward-mode and higher-order AD, whatever calls attention: the
    math backend of ``F.scaled_dot_product_attention`` (a model's own call or
    ``nn.MultiheadAttention``'s; the CPU flash kernel has no forward-mode rule) and no fused
    Transformer fast path (``_transformer_encoder_layer_fwd`` has none either) — the same
    function, differentiable every way.  Thread-local, for the duration of the block
    (:func:`nsa_dist.ntk._attention.composite_attention`); ``model`` is not inspected."""
    from nsa_dist.ntk._attention import composite_attention

    with composite_attention():
        yield
