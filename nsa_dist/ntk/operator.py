"""Matrix-free NTK products v ↦ G v (re-exported from :mod:`nsa_dist.ntk`)."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.func import jvp, vjp, vmap

from nsa_dist.linalg.operator import LinearOperator
from nsa_dist.models import OutputSelector, measured_module
from nsa_dist.ntk._probe import couples
from nsa_dist.ntk.blame import blame
from nsa_dist.ntk.inputs import as_2d, trainable_params
from nsa_dist.ntk.state import call, exact_kernels, stateless

_log = logging.getLogger("nsa_dist")


class NTKOperator(LinearOperator):
    """The NTK Gramian as a linear operator, never formed: ``G V = J (Jᵀ V)``.

    One VJP pass over the data (blocked) gives ``U = Jᵀ V`` in parameter space, one JVP pass
    gives ``J U``; cost O(N·P) per column, memory O(block·P + m·P) for m columns.
    For ``kernel="trace"`` the operator is ``Σ_a J_a J_aᵀ`` on (N,) vectors; for ``"full"`` it is
    the (N·K)×(N·K) kernel acting on vectors laid out as (N, K) flattened row-major.
    ``matmat`` takes (N, m) numpy arrays or torch tensors and returns the same type
    (:class:`~nsa_dist.linalg.operator.LinearOperator`).

    Attributes:
        shape: (N, N) or (N·K, N·K).
        dtype: torch dtype of the products.
    """

    native = "torch"
    dim_name = "N"

    def __init__(self, model: nn.Module, x: torch.Tensor, K: int, full: bool, block: int) -> None:
        dtype = next(iter(trainable_params(model).values())).dtype
        super().__init__(x.shape[0] * (K if full else 1), dtype, "torch", x.device)
        with blame(model):
            coupling = couples(model, x)
            model = stateless(model, x[:2])  # products change no buffer of the user's model
        if coupling is not None:  # the kernel of the batch forward: every product over all points at once
            _log.info("the model couples samples (%s): operator products over the whole batch", coupling)
            block = x.shape[0]
        self.model, self.x, self.K, self.full, self.block = model, x, K, full, block
        self._params = {k: p.detach() for k, p in trainable_params(model).items()}
        self._rest = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}
        self._buffers = dict(model.named_buffers())

    def _f(self, xb: torch.Tensor):
        def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return as_2d(call(self.model, {**p, **self._rest, **self._buffers}, (xb,)), xb.shape[0])  # (b, K)

        return f

    def _cotangents(self, Vb: torch.Tensor) -> torch.Tensor:
        """Vb (b, m) traced or (b, K, m) full → cotangents (m', b, K)."""
        K = self.K
        if self.full:
            return Vb.permute(2, 0, 1)  # (m, b, K)
        eye = torch.eye(K, dtype=Vb.dtype, device=Vb.device)
        # one cotangent per (column, output a): v placed in output a only -> Σ_a J_a J_aᵀ v
        return (Vb.T[:, None, :, None] * eye[None, :, None, :]).reshape(-1, Vb.shape[0], K)  # (m K, b, K)

    def _matmat(self, Vt: torch.Tensor) -> torch.Tensor:
        m, N, K = Vt.shape[1], self.x.shape[0], self.K
        Vr = Vt.reshape(N, K, m) if self.full else Vt  # (N, K, m) or (N, m)
        return self.j(self.jt(Vr), m).reshape(self.shape[0], m)

    def jt(self, Vr: torch.Tensor) -> dict[str, torch.Tensor]:
        """``U = Jᵀ V`` by one VJP pass: Vr (N, m) traced or (N, K, m) full → (m·K or m, *param) per parameter."""
        m = Vr.shape[-1]
        n_cot = m if self.full else m * self.K
        U = {k: torch.zeros((n_cot,) + p.shape, dtype=p.dtype, device=p.device) for k, p in self._params.items()}
        with exact_kernels(self.model), blame(self.model):
            self._jt_into(U, Vr)
        return U

    def _jt_into(self, U: dict[str, torch.Tensor], Vr: torch.Tensor) -> None:
        for s in range(0, self.x.shape[0], self.block):
            _, pull = vjp(self._f(self.x[s : s + self.block]), self._params)
            (g,) = vmap(pull)(self._cotangents(Vr[s : s + self.block]))
            for k in U:
                U[k] += g[k]

    def j(self, U: dict[str, torch.Tensor], m: int) -> torch.Tensor:
        """``J U`` by one JVP pass: (N, m) traced (Σ over outputs) or (N, K, m) full."""
        N, K = self.x.shape[0], self.K
        out = torch.empty((N, K, m) if self.full else (N, m), dtype=self.dtype, device=self.x.device)
        with exact_kernels(self.model), blame(self.model):
            self._j_into(out, U, m)
        return out

    def _j_into(self, out: torch.Tensor, U: dict[str, torch.Tensor], m: int) -> None:
        N, K = self.x.shape[0], self.K
        for s in range(0, N, self.block):
            f = self._f(self.x[s : s + self.block])
            JU = vmap(lambda u: jvp(f, (self._params,), (u,))[1])(U)  # (n_cot, b, K)
            if self.full:
                out[s : s + self.block] = JU.permute(1, 2, 0)
            else:
                b = JU.shape[1]
                out[s : s + self.block] = JU.view(m, K, b, K).diagonal(dim1=1, dim2=3).sum(-1).T  # (b, m)

    def to_dense(self, block: int = 1 << 30) -> torch.Tensor:
        """Materialise G by applying the operator to the identity (for checks on small N)."""
        return super().to_dense(block)

    def __repr__(self) -> str:
        return f"NTKOperator(shape={self.shape}, dtype={self.dtype}, kernel={'full' if self.full else 'trace'})"


def jacobian_vector_product(
    model: nn.Module, x: torch.Tensor, dtheta: torch.Tensor, *, output: OutputSelector = None
) -> torch.Tensor:
    """``J · dθ`` at the points x: the first-order change of the outputs, (n,) or (n, K) like the model's.

    ``dθ`` is a (P,) vector over *all* parameters in ``named_parameters`` order (a training step's
    Δθ).  One forward-mode pass of the batch forward (a coupling model's batch stays one batch),
    under the same rules as every NTK product: the model's buffers are not changed, attention
    uses composite kernels, and a failing module is named.  ``output`` selects the output of a
    model returning a dict, tuple or ``ModelOutput`` (as in :func:`nsa_dist.ntk.gram`).

    Raises:
        ShapeError: dθ does not have P entries.
        ModelForwardError: the forward fails (the module is named).
    """
    from nsa_dist.errors import ShapeError

    model = measured_module(model, output)
    params = dict(model.named_parameters())
    P = sum(p.numel() for p in params.values())
    if dtheta.numel() != P:
        raise ShapeError(f"dθ must have the model's P = {P} entries, got {dtheta.numel()}")
    dtype = next(iter(params.values())).dtype
    tangents, off = {}, 0
    for k, p in params.items():
        tangents[k] = dtheta[off : off + p.numel()].to(device=p.device, dtype=dtype).view_as(p)
        off += p.numel()
    with blame(model):
        twin = stateless(model, x[:2])
        primals = {k: p.detach() for k, p in twin.named_parameters()}
        buffers = dict(twin.named_buffers())
        with exact_kernels(twin):
            _, out = jvp(lambda p: call(twin, {**p, **buffers}, (x,)), (primals,), (tangents,))
    return out.detach()
