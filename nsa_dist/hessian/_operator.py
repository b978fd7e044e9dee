"""The shared machinery of the matrix-free loss-curvature operators (private).

Parameters are laid out as one flat vector θ ∈ R^P: the model's trainable parameters in
``named_parameters`` order, each flattened row-major — the layout of
``torch.cat([p.reshape(-1) for p in params])``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from nsa_dist.config import LossName
from nsa_dist.linalg.operator import LinearOperator
from nsa_dist.ntk import sample_coupling
from nsa_dist.ntk.blame import blame
from nsa_dist.ntk.inputs import as_2d, autograd_on, default_block, trainable_params
from nsa_dist.ntk.state import call, exact_kernels, renorm_copies, stateless

_log = logging.getLogger("nsa_dist")

__all__ = ["LossCurvatureOperator"]

_BLOCK_BYTES = 256e6  # default block: about this much of per-column activations and tangents


class LossCurvatureOperator(LinearOperator):
    """Base of the P×P operators ``H``, ``I``, ``S`` of ``C(θ) = (1/N) Σ_i c(f(x_i; θ), y_i)``.

    Subclasses implement :meth:`_apply` on parameter-shaped dicts of m columns; this class
    converts (P, m) blocks in and out and counts products.

    Attributes:
        shape: (P, P), P the number of trainable parameters.
        dtype, device: of the products (the model's after an optional cast).
        loss: the :class:`~nsa_dist.config.LossName` (l2 or cross_entropy).
        N: data points.
        n_products: columns applied so far (one Hessian-vector product each).
    """

    dim_name = "P"

    @autograd_on  # products differentiate the forward: no inference mode, parametrize cache or autocast
    def __init__(
        self, model: nn.Module, X: torch.Tensor, Y: torch.Tensor, loss: LossName, block_size: int | None
    ) -> None:
        P = sum(p.numel() for p in trainable_params(model).values())
        super().__init__(P, Y.dtype, "torch", X.device)
        with blame(model):
            coupling = sample_coupling(model, X)
            model = stateless(model, X[:2])  # products change no buffer of the user's model
        if coupling is not None:  # C of the batch forward: every product over all points at once
            _log.info("the model couples samples (%s): curvature products over the whole batch", coupling)
            block_size = X.shape[0]
        self.model, self.X, self.Y, self.loss = model, X, Y, loss  # X (N, d), Y (N, K)
        self.N, self.K = X.shape[0], Y.shape[1]
        # (a max_norm embedding's weight copied: its forwards renormalise it in place)
        self._params = renorm_copies(model, {k: p.detach() for k, p in trainable_params(model).items()})
        self._rest = renorm_copies(model, {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad})
        self._buffers = dict(model.named_buffers())
        self._sizes = [p.numel() for p in self._params.values()]
        self.block_size = block_size
        self._width = max((p.shape[0] if p.ndim else 1) for p in self._params.values())

    # ------------------------------------------------------------------ to implement
    def _apply(self, U: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A U for m columns given as a dict of (m, *param.shape) tensors."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers for subclasses
    def _f(self, xb: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        """θ ↦ f(xb; θ), (b, K)."""

        def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return as_2d(call(self.model, {**p, **self._rest, **self._buffers}, (xb,)), xb.shape[0])

        return f

    def _blocks(self, m: int) -> Iterator[slice]:
        """Data blocks for a product with m columns (default: ~256 MB of per-column activations)."""
        width = m * self._width * len(self._sizes) * 8
        b = self.block_size or default_block(self.N, width, self.dtype.itemsize, _BLOCK_BYTES)
        for s in range(0, self.N, b):
            yield slice(s, min(s + b, self.N))

    def _zeros(self, m: int) -> dict[str, torch.Tensor]:
        return {k: torch.zeros((m,) + p.shape, dtype=p.dtype, device=p.device) for k, p in self._params.items()}

    @autograd_on
    def _matmat(self, Vt: torch.Tensor) -> torch.Tensor:
        """A V for V (P, m): parameter-shaped columns in, (P, m) out."""
        m = Vt.shape[1]
        U = {k: u.T.reshape((m,) + p.shape) for (k, p), u in zip(self._params.items(), Vt.split(self._sizes))}
        with exact_kernels(self.model), blame(self.model):
            AU = self._apply(U)
        return torch.cat([AU[k].reshape(m, -1) for k in self._params], dim=1).T  # (P, m)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, loss={self.loss.value!r}, N={self.N}, dtype={self.dtype})"
