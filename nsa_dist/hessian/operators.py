"""Matrix-free ``H``, ``I`` and ``S``: the loss Hessian and its two parts, ``H = I + S``.

For ``C(θ) = (1/N) Σ_i c(f(x_i; θ), y_i)`` with ``J = ∂f/∂θ`` ((N·K) × P) the Hessian paper's
decomposition is

    H = ∇²_θ C = (1/N) Jᵀ HC J + (1/N) Σ_i ∇_f c_i · ∇²_θ f(x_i) = I + S,

``I`` the Gauss–Newton / Fisher part (PSD), ``S`` the residual part (indefinite, zero at a global
minimum of MSE).  Every product runs blocked over the data with ``torch.func``; nothing of size
P×P or N×P is formed.  Products differentiate the model as its gradient (reverse mode) does —
``weight_norm`` by its composite formula, an embedding's padding row a constant — and fall back to
reverse mode for an op without a forward-mode rule (:mod:`nsa_dist.hessian._operator`).
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.func import grad, vjp, vmap

from nsa_dist._checks import parse_enum
from nsa_dist.config import LossName
from nsa_dist.hessian._loss import loss_curvature, loss_sum, prepare_targets
from nsa_dist.hessian._operator import LossCurvatureOperator, copyable
from nsa_dist.losses import parse_loss, residual
from nsa_dist.models import OutputSelector, measured_module
from nsa_dist.ntk.blame import blame
from nsa_dist.ntk.inputs import output_dim, prepare_inputs, prepare_model
from nsa_dist.ntk.state import parameters_kept, preserved, refuse_parameter_writes

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "HessianPart",
    "HessianOperator",
    "GaussNewtonOperator",
    "ResidualOperator",
    "hessian_operator",
    "hessian_parts",
]


class HessianPart(str, Enum):
    """Which P×P matrix :func:`hessian_operator` applies.

    H: the full loss Hessian ``∇²_θ C``, by forward-over-reverse (``jvp`` of ``grad``): one
        product costs about three backward passes.
    I: the Gauss–Newton / Fisher part ``(1/N) Jᵀ HC J``, by a ``jvp`` (``J v``), the loss
        curvature, and a ``vjp``: cheaper than H, and PSD.
    S: the residual part ``(1/N) Σ_i r_i · ∇²_θ f(x_i)`` with ``r_i = ∇_f c_i`` held fixed — the
        Hessian of ``θ ↦ (1/N) Σ_i r_iᵀ f(x_i; θ)``, computed directly (not as H − I, so a
        small S does not drown in the rounding of H and I).
    """

    H = "H"
    I = "I"  # noqa: E741 - the paper's name
    S = "S"


class HessianOperator(LossCurvatureOperator):
    """``H v = ∇²_θ C v`` — forward-over-reverse, ``jvp(grad C_b)`` per data block b."""

    _SECOND_ORDER = True

    def _apply(self, U: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        m = next(iter(U.values())).shape[0]
        out = self._zeros(m)
        for b in self._blocks(m):
            f, Yb = self._f(self.X[b]), self.Y[b]
            g = grad(lambda p: loss_sum(self.loss, f(p), Yb) / self.N)
            HU = self._hvp(g, U)  # (m, *shape) each
            for k in out:
                out[k] += HU[k]
        return out

    def _apply_plain(self, U: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        m = next(iter(U.values())).shape[0]
        out = self._zeros(m)
        for b in self._blocks(m):
            f, Yb = self._f(self.X[b]), self.Y[b]
            HU = self._plain_hvp(lambda p: loss_sum(self.loss, f(p), Yb) / self.N, U)
            for k in out:
                out[k] += HU[k]
        return out


class GaussNewtonOperator(LossCurvatureOperator):
    """``I v = (1/N) Jᵀ HC (J v)`` — ``jvp`` for ``J v`` (b, K), the loss curvature, ``vjp`` back."""

    def _apply(self, U: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        m = next(iter(U.values())).shape[0]
        out = self._zeros(m)
        for b in self._blocks(m):
            f, Yb = self._f(self.X[b]), self.Y[b]
            F, pull = vjp(f, self._params)  # F (b, K)
            JU = self._jvp(f, F, pull, U)  # (m, b, K)
            W = loss_curvature(self.loss, F.detach(), Yb, JU) / self.N  # (m, b, K)
            (IU,) = vmap(pull)(W)
            for k in out:
                out[k] += IU[k]
        return out

    def _apply_plain(self, U: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """J u as the derivative of the linear map ``w ↦ Jᵀ w`` at w (double backward), then Jᵀ back."""
        m = next(iter(U.values())).shape[0]
        out = self._zeros(m)
        keys = list(self._params)
        for b in self._blocks(m):
            theta = self._leaves()
            F = self._f(self.X[b])(theta)  # (b, K), with its graph
            w = torch.zeros_like(F, requires_grad=True)
            JTw = self._grads(F, theta, w, create_graph=True)  # linear in w
            JU = torch.stack([self._grads([JTw[k] for k in keys], w, [U[k][j] for k in keys]) for j in range(m)])
            W = loss_curvature(self.loss, F.detach(), self.Y[b], JU) / self.N  # (m, b, K)
            for j in range(m):
                IU = self._grads(F, theta, W[j])
                for k in out:
                    out[k][j] += IU[k]
        return out


class ResidualOperator(LossCurvatureOperator):
    """``S v = ∇²_θ [(1/N) Σ_i r_iᵀ f(x_i; θ)] v`` with the residuals ``r_i = ∇_f c_i`` fixed at θ.

    Attributes:
        R: (N, K) the fixed output-space gradients ``∇_f c_i`` (f − y for MSE, p − y for CE).
    """

    _SECOND_ORDER = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._residuals()

    def _residuals(self) -> None:
        """R at the parameters the products are at."""
        with torch.no_grad():
            F = torch.cat([self._f(self.X[b])(self._params) for b in self._blocks(1)])  # (N, K)
        self.R = residual(self.loss, F, self.Y)  # (N, K)

    _refresh = _residuals  # the parameters changed (an optimizer step, a hand-written update): R with them

    def _apply(self, U: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        m = next(iter(U.values())).shape[0]
        out = self._zeros(m)
        for b in self._blocks(m):
            f, Rb = self._f(self.X[b]), self.R[b]
            g = grad(lambda p: (f(p) * Rb).sum() / self.N)
            SU = self._hvp(g, U)
            for k in out:
                out[k] += SU[k]
        return out

    def _apply_plain(self, U: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        m = next(iter(U.values())).shape[0]
        out = self._zeros(m)
        for b in self._blocks(m):
            f, Rb = self._f(self.X[b]), self.R[b]
            SU = self._plain_hvp(lambda p: (f(p) * Rb).sum() / self.N, U)
            for k in out:
                out[k] += SU[k]
        return out


_CLASSES = {HessianPart.H: HessianOperator, HessianPart.I: GaussNewtonOperator, HessianPart.S: ResidualOperator}


def _setup(
    model: nn.Module,
    X: torch.Tensor,
    Y: torch.Tensor | np.ndarray,
    loss: LossName,
    dtype: torch.dtype | None,
    output: OutputSelector = None,
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    with copyable(model):  # a float32 model measured in float64 is a cast copy
        model = prepare_model(model, dtype, output)
    X_given = X
    X = prepare_inputs(model, X, "X", dtype)
    with preserved(model), blame(model, "the loss Hessian"), parameters_kept(model) as written:
        K = output_dim(model, X)  # the first forward: a data-dependent initialisation (ActNorm) is refused here
        refuse_parameter_writes(written())
    cdt = next(p.dtype for p in model.parameters() if p.requires_grad)
    Yt = prepare_targets(Y, loss, X.shape[0], K, cdt, X.device)
    return model, _own(X, X_given), _own(Yt, Y)


def _own(t: torch.Tensor, given: object) -> torch.Tensor:
    """``t``, or a copy where it shares memory with what the caller passed: the operators measure the data
    given at their build (an in-place change of the caller's X or Y afterwards moved H and I but not S's
    residuals: H ≠ I + S by 0.17–0.66, an audit)."""
    if t.device.type != "cpu":
        shares = isinstance(given, torch.Tensor) and given.device == t.device and _same_storage(t, given)
    elif isinstance(given, torch.Tensor):
        shares = given.device.type == "cpu" and _same_storage(t, given)
    else:  # (a bfloat16 t, which NumPy cannot view, was cast from what was given: no shared memory)
        shares = (
            isinstance(given, np.ndarray) and t.dtype != torch.bfloat16 and np.shares_memory(given, t.detach().numpy())
        )
    if not shares:
        return t
    with torch.inference_mode(False):  # (built inside the caller's inference_mode: a normal tensor all the same)
        return t.detach().clone()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def hessian_parts(
    model: nn.Module,
    X: torch.Tensor,
    Y: torch.Tensor | np.ndarray,
    *,
    loss: str | LossName = "mse",
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    output: OutputSelector = None,
) -> tuple[HessianOperator, GaussNewtonOperator, ResidualOperator]:
    """The three operators ``(H, I, S)`` of one model, dataset and loss (validated once).

    Args and Raises: as :func:`hessian_operator`.
    """
    loss_ = parse_loss(loss)
    if block_size is not None and (isinstance(block_size, bool) or block_size < 1):
        raise ValueError(f"block_size must be None or an int >= 1, got {block_size!r}")
    source = measured_module(model, output)  # the names the operator's own model has (a copy keeps them)
    model, X, Yt = _setup(model, X, Y, loss_, dtype, output)
    return tuple(_CLASSES[part](model, X, Yt, loss_, block_size, source) for part in HessianPart)  # type: ignore[return-value]


def hessian_operator(
    model: nn.Module,
    X: torch.Tensor,
    Y: torch.Tensor | np.ndarray,
    *,
    part: str | HessianPart = "H",
    loss: str | LossName = "mse",
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    output: OutputSelector = None,
) -> LossCurvatureOperator:
    """The matrix-free P×P operator ``H``, ``I`` or ``S`` of ``C(θ) = (1/N) Σ_i c(f(x_i; θ), y_i)``.

    ``H = I + S`` with ``I = (1/N) Jᵀ HC J`` and ``S = (1/N) Σ_i ∇_f c_i · ∇²_θ f(x_i)`` (the
    Hessian paper's decomposition of ``H(C ∘ Y)``).  The operator has ``shape == (P, P)``,
    ``matmat(V)`` for V (P, m) NumPy or torch (the same type back), ``matvec``, ``to_dense()``
    and an ``n_products`` counter; it works with :func:`nsa_dist.linalg.top_eigenpairs`.  It follows
    the model: each product is at the parameters as they are then, however they were changed (an
    optimizer step, ``p.data -= …``, ``load_state_dict``, ``p.data = new``); a cast, a move or a resize
    of a parameter after the operator was built is refused (build it again).

    Args:
        model: a module mapping (n, d) → (n,) or (n, K); the parameters are those with
            ``requires_grad``, flattened in ``named_parameters`` order.
        X: (N, d) inputs.
        Y: (N,) or (N, K) targets: values for MSE; class indices (N,) (integer) or one-hot /
            probability rows (N, K) for cross-entropy.
        part: "H" | "I" | "S" (see :class:`HessianPart`).
        loss: "mse" (``C = (1/2N) Σ ‖f − y‖²``) or "cross_entropy" (``C = (1/N) Σ CE(softmax f, y)``);
            or a :class:`~nsa_dist.config.LossName` ("l2" = "mse").
        block_size: data points per block (bounds memory; the result does not depend on it).
            Default: about 256 MB of per-column activations.
        dtype: compute dtype (e.g. torch.float64 for reference checks); default the model's.
        output: which output is f when the model returns a dict, a tuple or a ``ModelOutput``
            (a key, an index or a callable; :func:`nsa_dist.ntk.gram`).

    Returns:
        :class:`HessianOperator`, :class:`GaussNewtonOperator` or :class:`ResidualOperator`.

    Raises:
        ValueError: an unknown part or loss (the allowed values are named), block_size < 1,
            class indices outside 0..K−1.
        ShapeError: X not (N, d); Y not (N,) / (N, K) matching X and the model's K outputs;
            cross-entropy on a scalar-output model.
        NonFiniteError: NaN/inf in X or Y.
    """
    part_ = parse_enum(HessianPart, part, "part")
    loss_ = parse_loss(loss)
    if block_size is not None and (isinstance(block_size, bool) or block_size < 1):
        raise ValueError(f"block_size must be None or an int >= 1, got {block_size!r}")
    source = measured_module(model, output)  # the names the operator's own model has (a copy keeps them)
    model, X, Yt = _setup(model, X, Y, loss_, dtype, output)
    return _CLASSES[part_](model, X, Yt, loss_, block_size, source)
