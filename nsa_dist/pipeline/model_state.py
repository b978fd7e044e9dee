"""What the analysis copy of a user's model needs besides θ_t: its buffers and modes, and inputs
in the dtype it takes (the Tracker's side of measuring the models people bring).

θ_t alone does not fix the function a model computes: a BatchNorm in eval mode normalises by its
running statistics (buffers that change at every train-mode forward), and in train mode by the
batch's own statistics.  :class:`ModelState` is that missing part of step t, snapshotted at
``record(t)`` and carried with θ_t in the :class:`~nsa_dist.pipeline.Checkpoint` to the analysis.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from nsa_dist.models import copy_model

__all__ = ["ModelState", "analysis_copy", "model_inputs", "theta_vector"]


@dataclass(frozen=True)
class ModelState:
    """The buffers and training modes of a model at one step.

    Attributes:
        buffers: ``model.named_buffers()`` as CPU numpy arrays of their own dtype (running
            statistics, ``num_batches_tracked``, …); dtypes numpy lacks (bfloat16) as float32.
        training: every module's ``training`` flag by qualified name ("" is the model itself).
    """

    buffers: dict[str, np.ndarray]
    training: dict[str, bool]

    @classmethod
    def capture(cls, model: nn.Module) -> ModelState:
        """A copy of ``model``'s buffers and modes now (later changes to the model do not reach it)."""
        buffers = {}
        for name, b in model.named_buffers():
            t = b.detach().cpu()
            try:
                buffers[name] = t.numpy().copy()
            except TypeError:  # a dtype numpy lacks
                buffers[name] = t.float().numpy()
        return cls(buffers, {name: m.training for name, m in model.named_modules()})

    def apply(self, model: nn.Module) -> None:
        """Give ``model`` (a copy of the model captured, possibly on another device or in another
        float dtype) these buffer values and modes."""
        modules = dict(model.named_modules())
        with torch.no_grad():
            for name, value in self.buffers.items():
                owner, _, leaf = name.rpartition(".")
                mod = modules[owner]
                v = torch.from_numpy(value)
                cur = mod._buffers.get(leaf)
                if cur is not None and cur.shape == v.shape:
                    cur.copy_(v)  # keeps the copy's device and float dtype
                else:  # a buffer created or reshaped after the copy was taken
                    dev = cur.device if cur is not None else _device(model)
                    if leaf in mod._buffers:
                        mod._buffers[leaf] = v.to(dev)
                    else:
                        mod.register_buffer(leaf, v.to(dev))
        for name, m in modules.items():
            if name in self.training:
                m.training = self.training[name]


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _float_dtype(model: nn.Module) -> torch.dtype:
    """float64 for a float64 model, else float32 (the analysis never computes in half precision)."""
    p = next(model.parameters())
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def analysis_copy(model: nn.Module) -> nn.Module:
    """A CPU copy of ``model`` for the analysis: float64 when the model is, else float32.

    Raises:
        TypeError, AttributeError, RuntimeError: from ``copy.deepcopy`` (the caller names the cause).
    """
    return copy_model(model).cpu().to(_float_dtype(model))


def model_inputs(
    X: np.ndarray | torch.Tensor, model: nn.Module, device: torch.device | str | None = None
) -> torch.Tensor:
    """``X`` as the model takes it: floating inputs in the model's floating dtype, integer inputs
    (token ids, class indices) unchanged; on ``device`` (default the model's).

    Args:
        X: (n, …) points, numpy or torch.
        model: the network they are fed to.
        device: where the tensor goes.

    Returns:
        (n, …) tensor: the model's parameter dtype if X is floating, else X's own dtype.
    """
    p = next(model.parameters())
    t = torch.as_tensor(X)
    dev = p.device if device is None else device
    return t.to(device=dev, dtype=p.dtype) if t.is_floating_point() else t.to(device=dev)


def theta_vector(model: nn.Module) -> np.ndarray:
    """θ as one (P,) CPU vector: float64 for a float64 model (its analysis uses θ_t exactly), else float32."""
    v = torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu()
    return v.to(_float_dtype(model)).numpy().copy()
