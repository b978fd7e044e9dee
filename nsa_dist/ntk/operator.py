"""Matrix-free NTK products v ↦ G v (re-exported from :mod:`nsa_dist.ntk`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.func import jvp, vjp, vmap

from nsa_dist.linalg.operator import LinearOperator
from nsa_dist.models import OutputSelector, measured_module
from nsa_dist.ntk._jacobian import vmap_unsafe
from nsa_dist.ntk._probe import couples
from nsa_dist.ntk.blame import blame
from nsa_dist.ntk.inputs import as_2d, autograd_on, functorch_refused, model_dtype, refuse_complex, trainable_params
from nsa_dist.ntk.state import (
    RandomDraws,
    attributes_kept,
    call,
    dense_gradients,
    exact_kernels,
    frequency_unscaled,
    no_grad_as_constant,
    padding_rows_constant,
    preserved,
    renorm_copies,
    rng_kept,
    stateless,
)

_log = logging.getLogger("nsa_dist")

# What torch.func raises where it has no rule for an op (then plain autograd computes the same products).
_NO_RULE = (RuntimeError, NotImplementedError, ValueError)


class NTKOperator(LinearOperator):
    """The NTK Gramian as a linear operator, never formed: ``G V = J (Jᵀ V)``.

    One VJP pass over the data (blocked) gives ``U = Jᵀ V`` in parameter space, one JVP pass
    gives ``J U``; cost O(N·P) per column, memory O(block·P + m·P) for m columns.  Where torch.func
    cannot run the forward's ops batched (no forward-mode rule: cdist, embedding_bag; a packed
    sequence; an ``autograd.Function`` without ``setup_context``) or runs them wrong (cdist's batched
    VJP), the same products come from plain reverse passes: one per cotangent for ``Jᵀ V``, one per
    output row for ``J U`` — exact, slower.
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
            model = stateless(model, x)  # products change no buffer of the user's model
        if coupling is not None:  # the kernel of the batch forward: every product over all points at once
            _log.info("the model couples samples (%s): operator products over the whole batch", coupling)
            block = x.shape[0]
        self.model, self.x, self.K, self.full, self.block = model, x, K, full, block
        # (a max_norm embedding's weight copied: its forwards renormalise it in place)
        self._params = renorm_copies(model, {k: p.detach() for k, p in trainable_params(model).items()})
        self._rest = renorm_copies(model, {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad})
        self._buffers = dict(model.named_buffers())
        # torch.func's batched products, unless the forward holds an op whose vmap is silently wrong
        # (cdist's batched VJP was off by 1e-1..3e-1); set False when a transform has no rule (a packed
        # sequence, forward AD of cdist or embedding_bag, an autograd.Function without setup_context)
        # (checked on the first block, as the products forward it: a coupling model's whole batch)
        with blame(model):
            self._batched = not vmap_unsafe(model, self._params, {**self._rest, **self._buffers}, x[:block].clone())

    def _f(self, xb: torch.Tensor):
        def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
            # a copy made inside the transform: a forward may write into its input (x.clamp_(0, 1) on
            # points already in range, which the probe lets pass), and torch.func refuses to mutate a
            # tensor captured from outside
            return as_2d(call(self.model, {**p, **self._rest, **self._buffers}, (xb.clone(),)), xb.shape[0])  # (b, K)

        return f

    def _cotangents(self, Vb: torch.Tensor) -> torch.Tensor:
        """Vb (b, m) traced or (b, K, m) full → cotangents (m', b, K)."""
        K = self.K
        if self.full:
            return Vb.permute(2, 0, 1)  # (m, b, K)
        eye = torch.eye(K, dtype=Vb.dtype, device=Vb.device)
        # one cotangent per (column, output a): v placed in output a only -> Σ_a J_a J_aᵀ v
        return (Vb.T[:, None, :, None] * eye[None, :, None, :]).reshape(-1, Vb.shape[0], K)  # (m K, b, K)

    @autograd_on
    def _matmat(self, Vt: torch.Tensor) -> torch.Tensor:
        m, N, K = Vt.shape[1], self.x.shape[0], self.K
        Vr = Vt.reshape(N, K, m) if self.full else Vt  # (N, K, m) or (N, m)
        out = self.j(self.jt(Vr), m).reshape(self.shape[0], m)
        if bool(torch.isfinite(Vt).all()) and not bool(torch.isfinite(out).all()):
            # the probe saw finite outputs: a product that is not finite is the composite kernels' (an
            # attention row whose keys are all masked per head) — said, never handed on as a kernel
            from nsa_dist.errors import NonFiniteError

            raise NonFiniteError(
                f"G·v of {type(self.model).__name__} is not finite where its outputs are: an op's composite "
                "(differentiable) kernel is NaN where the model's own is not — e.g. an attention row whose keys "
                "are all masked under a per-head (3-D) mask; gram() measures it by another route"
            )
        return out

    @autograd_on
    def jt(self, Vr: torch.Tensor) -> dict[str, torch.Tensor]:
        """``U = Jᵀ V`` by one VJP pass: Vr (N, m) traced or (N, K, m) full → (m·K or m, *param) per parameter."""
        m = Vr.shape[-1]
        n_cot = m if self.full else m * self.K
        U = {k: torch.zeros((n_cot,) + p.shape, dtype=p.dtype, device=p.device) for k, p in self._params.items()}
        with (
            exact_kernels(self.model),
            dense_gradients(self.model),
            frequency_unscaled(self.model),  # the derivative's Jᵀ, as the JVP's J: not scaled by token counts
            blame(self.model),
            attributes_kept(self.model),
        ):
            self._jt_into(U, Vr)
        return U

    def _jt_into(self, U: dict[str, torch.Tensor], Vr: torch.Tensor) -> None:
        for s in range(0, self.x.shape[0], self.block):
            xb, cot = self.x[s : s + self.block], self._cotangents(Vr[s : s + self.block])
            g = None
            if self._batched:
                try:
                    _, pull = vjp(self._f(xb), self._params)
                    (g,) = vmap(pull)(cot)
                except _NO_RULE as e:
                    self._unbatched(e)
            if g is None:
                g = self._vjps(xb, cot)
            for k in U:
                U[k] += g[k]

    def _unbatched(self, e: Exception) -> None:
        """From now on plain reverse passes: torch.func has no rule for some op of the forward."""
        self._batched = False
        _log.info(
            "NTK operator products by plain reverse passes (torch.func: %s: %s)",
            type(e).__name__,
            str(e).strip().splitlines()[0][:200] if str(e).strip() else "",
        )

    def _live(self, xb: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Parameters that require grad and the block's outputs (b, K) of a plain autograd forward."""
        live = {k: v.clone().requires_grad_(True) for k, v in self._params.items()}
        with torch.enable_grad():
            return live, self._f(xb)(live)

    def _vjps(self, xb: torch.Tensor, cot: torch.Tensor) -> dict[str, torch.Tensor]:
        """``Jᵀ c`` for each cotangent c (n_cot, b, K) by plain reverse passes (no torch.func)."""
        live, out = self._live(xb)
        ps = list(live.values())
        rows = [
            torch.autograd.grad(out, ps, c, retain_graph=True, allow_unused=True)
            if out.requires_grad
            else [None] * len(ps)
            for c in cot
        ]
        return {
            k: torch.stack([r[i] if r[i] is not None else torch.zeros_like(p) for r in rows])
            for i, (k, p) in enumerate(live.items())
        }

    def _jvps(self, xb: torch.Tensor, U: dict[str, torch.Tensor], n_cot: int) -> torch.Tensor:
        """``J u`` for each of the n_cot directions of U, (n_cot, b, K), from the block's Jacobian
        rows by plain reverse passes, one per output (no forward mode, no double backward: cdist has
        neither)."""
        live, out = self._live(xb)
        if not out.requires_grad:
            return out.new_zeros((n_cot,) + tuple(out.shape))
        ps = list(live.values())
        flat = torch.cat([U[k].reshape(n_cot, -1) for k in live], 1)  # (n_cot, P)
        rows = out.reshape(-1)
        JU = out.new_empty(rows.shape[0], n_cot)
        for r in range(rows.shape[0]):
            g = torch.autograd.grad(rows[r], ps, retain_graph=r < rows.shape[0] - 1, allow_unused=True)
            JU[r] = flat @ torch.cat([(t if t is not None else torch.zeros_like(p)).reshape(-1) for t, p in zip(g, ps)])
        return JU.T.reshape((n_cot,) + tuple(out.shape))

    @autograd_on
    def j(self, U: dict[str, torch.Tensor], m: int) -> torch.Tensor:
        """``J U`` by one JVP pass: (N, m) traced (Σ over outputs) or (N, K, m) full."""
        N, K = self.x.shape[0], self.K
        out = torch.empty((N, K, m) if self.full else (N, m), dtype=self.dtype, device=self.x.device)
        # the padding rows of embeddings as reverse mode (Jᵀ v) sees them: no derivative from their lookups
        with (
            exact_kernels(self.model),
            padding_rows_constant(),
            no_grad_as_constant(),  # a no_grad block as Jᵀv (reverse mode) takes it: a constant
            dense_gradients(self.model),
            blame(self.model),
            attributes_kept(self.model),  # activations a hook cached inside the transforms: put back
        ):
            self._j_into(out, U, m)
        return out

    def _j_into(self, out: torch.Tensor, U: dict[str, torch.Tensor], m: int) -> None:
        N, K = self.x.shape[0], self.K
        n_cot = next(iter(U.values())).shape[0]
        for s in range(0, N, self.block):
            xb = self.x[s : s + self.block]
            JU = None
            if self._batched:
                f = self._f(xb)
                try:
                    JU = vmap(lambda u, f=f: jvp(f, (self._params,), (u,))[1])(U)  # (n_cot, b, K)
                except _NO_RULE as e:
                    self._unbatched(e)
            if JU is None:
                JU = self._jvps(xb, U, n_cot)
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


@autograd_on
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
        UnsupportedModelError: the forward is random (it draws from torch's generator: train-mode dropout).
    """
    from nsa_dist.errors import ShapeError, UnsupportedModelError

    model = measured_module(model, output)
    params = dict(model.named_parameters())
    refuse_complex(model, params)  # dθ is a real vector over every parameter
    P = sum(p.numel() for p in params.values())
    if dtheta.numel() != P:
        raise ShapeError(f"dθ must have the model's P = {P} entries, got {dtheta.numel()}")
    dtype = model_dtype(model)
    tangents, off = {}, 0
    for k, p in params.items():
        tangents[k] = dtheta[off : off + p.numel()].to(device=p.device, dtype=dtype).view_as(p)
        off += p.numel()
    with torch.no_grad(), blame(model, "J·dθ"), preserved(model), rng_kept(x), RandomDraws() as draws:
        model(x.clone())
    if draws.drew:  # its J·dθ would be that of one random draw
        drop = [n for n, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training]
        raise UnsupportedModelError(
            "J·dθ: the model's forward is random (it draws from torch's random numbers"
            + (f"; dropout in train mode: {', '.join(repr(d) for d in drop)}" if drop else "")
            + "): call model.eval() (or disable the randomness)"
        )
    return _jvp(model, x, params, tangents)


def _jvp(model: nn.Module, x: torch.Tensor, params: dict, tangents: dict) -> torch.Tensor:
    """:func:`jacobian_vector_product`'s pass."""
    with blame(model, "J·dθ"):
        twin = stateless(model, x)
        primals = renorm_copies(twin, {k: p.detach() for k, p in twin.named_parameters()})
        buffers = dict(twin.named_buffers())

        def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return call(twin, {**p, **buffers}, (x.clone(),))

        with exact_kernels(twin), dense_gradients(twin), no_grad_as_constant():
            try:
                _, out = jvp(f, (primals,), (tangents,))
            except NotImplementedError as e:  # an op without forward-mode AD (weight_norm, a custom Function)
                if "forward AD" not in str(e) and "forward mode AD" not in str(e):
                    raise
                out = _instead(f, primals, tangents, _jvp_by_reverse, e, "an op of the model has no forward-mode rule")
            except RuntimeError as e:  # (a subclass of it is above) torch.func cannot run an op (a packed LSTM)
                if not functorch_refused(e):
                    raise
                out = _instead(f, primals, tangents, _jvp_plain, e, "torch.func cannot run an op of the model")
    return out.detach()


def _instead(f, primals: dict, tangents: dict, how, e: Exception, why: str) -> torch.Tensor:  # noqa: ANN001
    """J·dθ by ``how`` (:func:`_jvp_plain`, :func:`_jvp_by_reverse`: second derivatives of the backward)
    where forward mode failed with ``e`` for the reason ``why``, checked against a central difference."""
    _log.info("J·dθ by %s (%s): %s", how.__name__, why, str(e).strip().splitlines()[0][:200])
    out = how(f, primals, tangents)
    if not _agrees_with_difference(f, primals, tangents, out):
        raise NotImplementedError(
            f"J·dθ: {why} and its backward cannot be differentiated again (e.g. @once_differentiable), "
            "so neither mode gives J·dθ"
        ) from e
    return out


def _jvp_plain(
    f: Callable[[dict[str, torch.Tensor]], torch.Tensor], primals: dict[str, torch.Tensor], tangents: dict
) -> torch.Tensor:
    """``J · t`` by plain autograd (no torch.func): the derivative of the linear map w ↦ Jᵀw at w = 0
    applied to t, by double backward."""
    leaves = {k: p.detach().requires_grad_(True) for k, p in primals.items()}
    with torch.enable_grad():
        out = f(leaves)
        w = torch.zeros_like(out, requires_grad=True)
        g = torch.autograd.grad(out, list(leaves.values()), w, create_graph=True, allow_unused=True)
        live = [(gk, tangents[k]) for k, gk in zip(leaves, g) if gk is not None and gk.requires_grad]
        jt = torch.autograd.grad([a for a, _ in live], w, [t for _, t in live], allow_unused=True)[0] if live else None
    return torch.zeros_like(out) if jt is None else jt


def _jvp_by_reverse(
    f: Callable[[dict[str, torch.Tensor]], torch.Tensor], primals: dict[str, torch.Tensor], tangents: dict
) -> torch.Tensor:
    """``J · t`` without forward mode: w ↦ Jᵀw = pull(w) is linear in w, and its own vjp at any w
    applied to t is (Jᵀ)ᵀ t = J t — two reverse passes and a double backward."""
    out, pull = vjp(f, primals)
    _, pull_t = vjp(lambda w: pull(w)[0], torch.zeros_like(out))
    return pull_t(tangents)[0]


def _agrees_with_difference(
    f: Callable[[dict[str, torch.Tensor]], torch.Tensor], primals: dict, tangents: dict, jt: torch.Tensor
) -> bool:
    """Whether ``jt`` is J·t to a central difference's accuracy (5 %): a backward marked
    ``once_differentiable`` is differentiated as a constant inside torch.func, and the vjp of the vjp
    then gave a J·t 50 % off without an error (a review's repro)."""
    norm = torch.sqrt(sum((t.double() ** 2).sum() for t in tangents.values()))
    scale = torch.sqrt(sum((p.double() ** 2).sum() for p in primals.values()))
    if not float(norm) > 0:
        return True
    eps = float(torch.finfo(jt.dtype).eps) ** (1 / 3) * max(float(scale), 1.0) / float(norm)
    with torch.no_grad():
        plus = f({k: p + eps * tangents[k] for k, p in primals.items()})
        minus = f({k: p - eps * tangents[k] for k, p in primals.items()})
    fd = (plus - minus) / (2 * eps)
    return float(torch.linalg.norm((jt - fd).double())) <= 0.05 * float(torch.linalg.norm(fd.double())) + 1e-12
