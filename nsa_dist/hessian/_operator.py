"""The shared machinery of the matrix-free loss-curvature operators (private).

Parameters are laid out as one flat vector θ ∈ R^P: the model's trainable parameters in
``named_parameters`` order, each flattened row-major — the layout of
``torch.cat([p.reshape(-1) for p in params])``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from nsa_dist.errors import ShapeError
from nsa_dist.hessian._loss import Loss
from nsa_dist.ntk._inputs import as_2d, default_block, trainable_params

__all__ = ["LossCurvatureOperator"]

_BLOCK_BYTES = 256e6  # default block: about this much of per-column activations and tangents


class LossCurvatureOperator:
    """Base of the P×P operators ``H``, ``I``, ``S`` of ``C(θ) = (1/N) Σ_i c(f(x_i; θ), y_i)``.

    Subclasses implement :meth:`_apply` on parameter-shaped dicts of m columns; this class
    converts (P, m) blocks in and out and counts products.

    Attributes:
        shape: (P, P), P the number of trainable parameters.
        dtype, device: of the products (the model's after an optional cast).
        loss: the :class:`Loss`.
        N: data points.
        n_products: columns applied so far (one Hessian-vector product each).
    """

    def __init__(self, model: nn.Module, X: torch.Tensor, Y: torch.Tensor, loss: Loss,
                 block_size: int | None) -> None:
        self.model, self.X, self.Y, self.loss = model, X, Y, loss  # X (N, d), Y (N, K)
        self.N, self.K = X.shape[0], Y.shape[1]
        self._params = {k: p.detach() for k, p in trainable_params(model).items()}
        self._rest = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}
        self._buffers = dict(model.named_buffers())
        self._sizes = [p.numel() for p in self._params.values()]
        P = sum(self._sizes)
        self.shape = (P, P)
        self.dtype, self.device = X.dtype, X.device
        self.block_size = block_size
        self._width = max(p.shape[0] for p in self._params.values())
        self.n_products = 0

    # ------------------------------------------------------------------ to implement
    def _apply(self, U: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A U for m columns given as a dict of (m, *param.shape) tensors."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers for subclasses
    def _f(self, xb: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        """θ ↦ f(xb; θ), (b, K)."""
        def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return as_2d(functional_call(self.model, ({**p, **self._rest}, self._buffers), (xb,)))
        return f

    def _blocks(self, m: int) -> Iterator[slice]:
        """Data blocks for a product with m columns (default: ~256 MB of per-column activations)."""
        width = m * self._width * len(self._sizes) * 8
        b = self.block_size or default_block(self.N, width, self.X.element_size(), _BLOCK_BYTES)
        for s in range(0, self.N, b):
            yield slice(s, min(s + b, self.N))

    def _zeros(self, m: int) -> dict[str, torch.Tensor]:
        return {k: torch.zeros((m,) + p.shape, dtype=p.dtype, device=p.device) for k, p in self._params.items()}

    # ------------------------------------------------------------------ public
    def matmat(self, V: Any) -> Any:
        """A V for V of shape (P, m) (or (P,)); numpy in → numpy out, torch in → torch out (in ``dtype``).

        Raises:
            ShapeError: V is not (P,) or (P, m).
        """
        is_np = not isinstance(V, torch.Tensor)
        Vt = torch.as_tensor(np.asarray(V) if is_np else V).to(dtype=self.dtype, device=self.device)
        vec = Vt.ndim == 1
        Vt = Vt[:, None] if vec else Vt
        if Vt.ndim != 2 or Vt.shape[0] != self.shape[0]:
            raise ShapeError(f"operator of shape {self.shape} got a block of shape {tuple(np.shape(V))}; "
                             f"expected (P,) or (P, m) with P = {self.shape[0]}")
        m = Vt.shape[1]
        U = {k: u.T.reshape((m,) + p.shape) for (k, p), u in zip(self._params.items(), Vt.split(self._sizes))}
        AU = self._apply(U)
        out = torch.cat([AU[k].reshape(m, -1) for k in self._params], dim=1).T  # (P, m)
        self.n_products += m
        out = out[:, 0] if vec else out
        return out.cpu().numpy() if is_np else out

    def matvec(self, v: Any) -> Any:
        """A v for a single vector v (P,)."""
        return self.matmat(v)

    def to_dense(self, block: int = 256) -> torch.Tensor:
        """Materialise A (P, P) by applying it to the identity ``block`` columns at a time (small P only)."""
        P = self.shape[0]
        A = torch.empty((P, P), dtype=self.dtype, device=self.device)
        for s in range(0, P, block):
            E = torch.zeros((P, min(block, P - s)), dtype=self.dtype, device=self.device)
            E[s:s + E.shape[1]].fill_diagonal_(1.0)
            A[:, s:s + E.shape[1]] = self.matmat(E)
        return A

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(shape={self.shape}, loss={self.loss.value!r}, N={self.N}, "
                f"dtype={self.dtype})")
