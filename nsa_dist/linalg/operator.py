"""The one linear-operator interface every matrix-free map shares (G, the cross kernel, H, I, S, local or on a gang).

The solvers (:func:`nsa_dist.linalg.top_eigenpairs`, the Hessian moments, SLQ) only need
``shape`` and ``matmat``; :class:`LinearOperator` gives every operator the same front door —
NumPy or torch in, the same type out, ``(n,)`` or ``(n, m)``, a :class:`ShapeError` naming the
expected shape, products counted in ``n_products`` — so that each operator only implements
``_matmat`` on 2-D blocks of its own array type (``native``: "torch" on ``device``, or "numpy").
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from nsa_dist.errors import ShapeError

__all__ = ["LinearOperator", "Materialised"]


class LinearOperator:
    """Base of the matrix-free operators: ``V ↦ A V`` for an (n, n) A never formed.

    Attributes:
        shape: (n, n).
        dtype: the products' dtype (torch dtype for torch-native operators, else NumPy).
        native: "torch" or "numpy" — the array type ``_matmat`` takes and returns.
        device: torch device of a torch-native operator.
        n_products: columns applied so far (one product with A each).
    """

    native: str = "numpy"
    device: Any = None
    dim_name: str = "n"  # how error messages call the dimension (N points, P parameters)

    def __init__(self, n: int, dtype: Any, native: str = "numpy", device: Any = None) -> None:
        self.shape, self.dtype, self.native, self.device = (n, n), dtype, native, device
        self.n_products = 0

    # ------------------------------------------------------------------ to implement
    def _matmat(self, V: Any) -> Any:
        """A V for a 2-D block V (n, m) of the native type (dtype/device already set)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the front door
    @property
    def n_matvec(self) -> int:
        """Alias of ``n_products`` (the eigensolvers' name)."""
        return self.n_products

    def matmat(self, V: Any) -> Any:
        """A V for V (n,) or (n, m), NumPy or torch; returns the same type and shape.

        Raises:
            ShapeError: V is not (n,) or (n, m).
        """
        is_torch = isinstance(V, torch.Tensor)
        shape = tuple(V.shape) if hasattr(V, "shape") else np.shape(V)
        if len(shape) not in (1, 2) or shape[0] != self.shape[0]:
            n = self.dim_name
            raise ShapeError(
                f"operator of shape {self.shape} got a block of shape {shape}; expected ({n},) or "
                f"({n}, m) with {n} = {self.shape[0]}"
            )
        vec = len(shape) == 1
        if self.native == "torch":
            Vn = torch.as_tensor(V if is_torch else np.asarray(V)).to(dtype=self.dtype, device=self.device)
        else:
            Vn = np.asarray(V.detach().cpu().numpy() if is_torch else V, dtype=np.float64)
        Vn = Vn[:, None] if vec else Vn
        out = self._matmat(Vn)
        self.n_products += Vn.shape[1]
        out = out[:, 0] if vec else out
        if is_torch and self.native != "torch":
            return torch.as_tensor(out, device=V.device)
        if not is_torch and self.native == "torch":
            out = out.detach().cpu()
            # (NumPy has no bfloat16: a bf16 operator's products reach NumPy callers in float32 — slq_density
            # failed on every bf16 H, I and S, a review)
            return (out.float() if out.dtype == torch.bfloat16 else out).numpy()
        return out

    def matvec(self, v: Any) -> Any:
        """A v for a single vector v (n,)."""
        return self.matmat(v)

    def to_dense(self, block: int = 256) -> Any:
        """Materialise A (n, n) by applying it to the identity ``block`` columns at a time (small n only)."""
        n = self.shape[0]
        if self.native == "torch":
            A = torch.empty((n, n), dtype=self.dtype, device=self.device)
            eye = lambda s, e: torch.eye(n, dtype=self.dtype, device=self.device)[:, s:e]  # noqa: E731
        else:
            A = np.empty((n, n))
            eye = lambda s, e: np.eye(n)[:, s:e]  # noqa: E731
        for s in range(0, n, block):
            e = min(s + block, n)
            A[:, s:e] = self.matmat(eye(s, e))
        return A

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype})"


class Materialised(LinearOperator):
    """``source`` formed once as a dense (n, n) matrix (n columns, ``block`` a product) once it has
    made ``after`` columns itself (default 0: at the first product); every product after that is
    one matrix product.

    For a small n — the loss Hessian of a small network — the estimates of one analysis make
    thousands of products a few columns at a time, each a pass through the model with a fixed
    cost (4–8 ms through ``torch.func`` for such nets, against 0.02–0.04 ms a column at N = 24:
    benchmarks/README.md).  The matrix is kept as formed, not symmetrised: an operator whose
    products are not symmetric (a model PyTorch differentiates wrongly twice) is refused by the
    eigensolvers' own checks as it was without this.  ``block`` bounds the columns of one
    product (a product's memory grows with them: 512 columns of a small CNN's Hessian took
    12 GB).  ``n_products`` counts every product through this operator; ``source.n_products``
    those the source made.  An error of the source's products is raised as it is, and nothing
    is kept of a formation that failed.
    """

    def __init__(self, source: LinearOperator, after: int = 0, block: int = 32) -> None:
        super().__init__(source.shape[0], source.dtype, source.native, source.device)
        self.source, self._A, self.after, self.block = source, None, after, block

    @property
    def formed(self) -> bool:
        """Whether the dense matrix has been formed."""
        return self._A is not None

    def _matmat(self, V: Any) -> Any:
        if self._A is None and self.source.n_products + V.shape[1] <= self.after:
            return self.source.matmat(V)
        if self._A is None:
            self._A = self.source.to_dense(self.block)
        return self._A @ V

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.source!r})"
