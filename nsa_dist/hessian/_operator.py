"""The shared machinery of the matrix-free loss-curvature operators (private).

Parameters are laid out as one flat vector θ ∈ R^P: the model's trainable parameters in
``named_parameters`` order, each flattened row-major — the layout of
``torch.cat([p.reshape(-1) for p in params])``.

Products take forward mode where they can (``jvp``: ``H v`` forward-over-reverse, ``J v`` of I).

* ``weight_norm`` (``torch.nn.utils.weight_norm`` and ``parametrizations.weight_norm``) calls the
  fused ``_weight_norm_interface``, which has no forward-mode rule and, in PyTorch 2.13 on CPU, a
  wrong double backward (``torch.autograd.functional.hessian`` of a weight-normed layer is not even
  symmetric: 8.6 off a finite difference): within products ``torch._weight_norm`` is computed by
  its composite formula ``v · g / ‖v‖`` (:func:`autograd_conventions`) — the same function, with
  derivatives of every order right.
* An ``Embedding``'s ``padding_idx`` row gets no gradient in reverse mode but moved with its
  tangent in forward mode: within products it is looked up as a constant (:func:`autograd_conventions`),
  as the gradient and the NTK's Jacobian see it.
* Other ops without a forward-mode rule (a custom ``autograd.Function`` without ``jvp``): on the
  first NotImplementedError saying so, an operator switches to reverse mode for good — ``H v =
  (∇g)ᵀ v`` by a ``vjp`` of the gradient g (H is symmetric) and ``J v`` as the ``vjp`` of the
  linear map ``w ↦ Jᵀ w`` — and checks once that the operator it then applies is symmetric (a
  wrong double backward, as weight_norm's, shows as an asymmetric H): if not, it refuses.
* An ``autograd.Function`` that ``torch.func`` cannot run at all (old style: ``forward(ctx, …)``
  without ``setup_context``): on torch.func's error saying so, an operator switches to plain
  autograd for good — one forward with a graph, then every column by double backward
  (:meth:`LossCurvatureOperator._apply_plain`) — with the same symmetry check.
* ``nn.EmbeddingBag`` (no forward-mode rule, no double backward in PyTorch) runs composite ops
  within products (:func:`nsa_dist.ntk.state.exact_kernels`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.func import grad, jvp, vjp, vmap
from torch.overrides import TorchFunctionMode

from nsa_dist.config import LossName
from nsa_dist.errors import UnsupportedModelError
from nsa_dist.linalg.operator import LinearOperator
from nsa_dist.ntk import sample_coupling
from nsa_dist.ntk.blame import blame
from nsa_dist.ntk.inputs import as_2d, autograd_on, default_block, functorch_refused, trainable_params
from nsa_dist.ntk.state import (  # copyable: re-exported
    attributes_kept,
    call,
    copyable,
    data_as_constant,
    exact_kernels,
    frequency_unscaled,
    no_grad_as_constant,
    padding_rows_constant,
    renorm_copies,
    stateless,
    ties_as_backward,
)

_log = logging.getLogger("nsa_dist")

__all__ = ["LossCurvatureOperator", "autograd_conventions", "copyable"]

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
    _SECOND_ORDER = False  # products made of f's second derivatives (H, S): checked by _check_second_order

    @autograd_on  # products differentiate the forward: no inference mode, parametrize cache or autocast
    def __init__(
        self,
        model: nn.Module,
        X: torch.Tensor,
        Y: torch.Tensor,
        loss: LossName,
        block_size: int | None,
        source: nn.Module | None = None,
    ) -> None:
        P = sum(p.numel() for p in trainable_params(model).values())
        super().__init__(P, Y.dtype, "torch", X.device)
        with blame(model, "the loss Hessian"):
            coupling = sample_coupling(model, X)
            with copyable(model):
                model = stateless(model, X)  # products change no buffer of the user's model
        self._coupled = coupling is not None
        if coupling is not None:  # C of the batch forward: every product over all points at once
            _log.info("the model couples samples (%s): curvature products over the whole batch", coupling)
            block_size = X.shape[0]
        self.model, self.X, self.Y, self.loss = model, X, Y, loss  # X (N, d), Y (N, K)
        self.N, self.K = X.shape[0], Y.shape[1]
        self._read_model()
        self._sizes = [p.numel() for p in self._params.values()]
        self.block_size = block_size
        self._width = max((p.shape[0] if p.ndim else 1) for p in self._params.values())
        self._reverse = False  # True once an op of the model turned out to have no forward-mode rule
        self._refused: UnsupportedModelError | None = None  # its reverse-mode products failed the symmetry check
        self._plain = False  # True once torch.func could not run the model: plain autograd from then on
        self._derivative_checked = not self._SECOND_ORDER  # (H and S) their products against a difference, once
        self._follow(source if source is not None else model)

    # ------------------------------------------------------------------ the parameters a product is at
    def _follow(self, source: nn.Module) -> None:
        """Products follow ``source`` (the user's model) as it is at each product: its parameters and
        buffers by name (the operator's model may be a copy — a cast, a stateless twin — or a wrapper
        whose names carry a prefix), their values when last read, which parameters are trainable and
        each module's mode; a product first compares them (O(P))."""
        mine = [n for n, _ in self.model.named_parameters()]
        theirs = [n for n, _ in source.named_parameters()]
        if len(mine) != len(theirs):
            raise ValueError(f"the operator's model and {type(source).__name__} hold different parameters")
        a, b = mine[0], theirs[0]
        cut, add = (a[: len(a) - len(b)], "") if a.endswith(b) else ("", b[: len(b) - len(a)])
        to_src = lambda n: add + n[len(cut) :] if n.startswith(cut) else None  # noqa: E731
        if [to_src(n) for n in mine] != theirs:
            raise ValueError(f"the operator's model and {type(source).__name__} hold different parameters")
        bufs = {n for n, _ in source.named_buffers()}
        self._source = source
        self._pairs = [(n, to_src(n), True) for n in mine] + [
            (n, to_src(n), False) for n, _ in self.model.named_buffers() if to_src(n) in bufs
        ]
        self._to_src = to_src
        self._flags = self._flags_now()
        self._seen = [t.detach().clone() for t in self._watched()]

    def _flags_now(self) -> tuple[dict[str, bool], dict[str, bool]]:
        """Which parameters are trainable, and each module's mode, by name (a module a forward adds later
        is not one of them: it was refused as a mode change, a review)."""
        src = self._source
        grads = {n: p.requires_grad for n, p in src.named_parameters()}
        return grads, {n: m.training for n, m in src.named_modules()}

    def _watched(self) -> list[torch.Tensor]:
        """The source's tensors the pairs name, as they are now (a reassigned buffer is the new one)."""
        params, buffers = dict(self._source.named_parameters()), dict(self._source.named_buffers())
        return [(params if is_param else buffers)[src] for _, src, is_param in self._pairs]

    def _sync(self) -> None:
        """Read the model again where it changed since the last product, however it was changed:
        ``p.data -= lr·p.grad`` (a hand-written SGD loop) bumps no version counter and ``p.data = new``
        replaces the storage the products held — S mixed the new θ's ∇²f with the old residuals (0.64
        off, H ≠ I + S by 0.28 of H), or all three stayed at the old θ (0.80 off), no error (an audit);
        a batch norm's running statistics moved by a train-mode forward, or an orthogonal
        parametrization's base buffer replaced (H, I, S 0.03–0.45 off, a review).  A copy the operator
        computes with takes the new values.

        Raises:
            ValueError: a parameter or buffer changed shape, dtype or device, a parameter's
                ``requires_grad`` changed, or a module whose mode the set-up depends on
                (:func:`_mode_matters`) was switched between train and eval since the operator was
                built (build it again); any other module's mode is followed.
        """
        grads, modes = self._flags_now()
        for n, was in self._flags[0].items():
            if grads.get(n) is not was:
                raise ValueError(
                    f"parameter {n!r} of the model is {'no longer' if was else 'now'} trainable (requires_grad) or "
                    "gone since its curvature operators were built: they differentiate the parameters trainable then "
                    "— build them again"
                )
        switched = [n for n, was in self._flags[1].items() if modes.get(n, was) is not was]
        if switched:
            src = dict(self._source.named_modules())
            for n in switched:
                if _mode_matters(src[n]):  # a norm, a dropout, …: the operator's set-up depends on it
                    was = self._flags[1][n]
                    raise ValueError(
                        f"module {n or '<root>'!r} ({type(src[n]).__name__}) of the model was switched to "
                        f"{'eval' if was else 'train'} mode after its curvature operators were built: it computes "
                        "another function — build them again"
                    )
            # any other module's mode is followed (a helper, a hook or a parent may read it: S stayed at the old
            # residuals, 0.53 off, a review): the operator's own copy takes it, and S's residuals are read again
            mine = dict(self.model.named_modules())
            for mn, m in mine.items():
                sn = self._to_src(mn)
                if sn in src and m is not src[sn]:
                    m.training = src[sn].training
            self._flags = (self._flags[0], {n: modes.get(n, was) for n, was in self._flags[1].items()})
        now = self._watched()
        for (name, _, _), t, seen in zip(self._pairs, now, self._seen):
            if t.shape != seen.shape or t.dtype != seen.dtype or t.device != seen.device:
                raise ValueError(
                    f"{name} of the model changed from {tuple(seen.shape)} {seen.dtype} on {seen.device} to "
                    f"{tuple(t.shape)} {t.dtype} on {t.device} after its curvature operators were built (a cast, "
                    "a move, a resize): build them again for the model as it is now"
                )
        if not switched and (
            not now or not bool(torch.stack([_differs(t.detach(), s) for t, s in zip(now, self._seen)]).any())
        ):
            return
        mine = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        with torch.no_grad():
            for (name, _, _), t in zip(self._pairs, now):
                if mine[name] is not t:
                    mine[name].copy_(t.detach().to(mine[name].dtype))
        self._seen = [t.detach().clone() for t in now]
        self._read_model()
        self._refresh()

    def _read_model(self) -> None:
        """The tensors the products compute with, read from the operator's model: the trainable
        parameters, the frozen ones and the buffers (a max_norm embedding's weight copied: its forwards
        renormalise it in place)."""
        model = self.model
        self._params = renorm_copies(model, {k: _own_memory(p.detach()) for k, p in trainable_params(model).items()})
        self._rest = renorm_copies(model, {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad})
        self._buffers = dict(model.named_buffers())

    def _refresh(self) -> None:
        """What a subclass derives from the parameters, read again after they changed."""

    # ------------------------------------------------------------------ to implement
    def _apply(self, U: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A U for m columns given as a dict of (m, *param.shape) tensors."""
        raise NotImplementedError

    def _apply_plain(self, U: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """:meth:`_apply` by plain autograd (no torch.func transform): for a model torch.func cannot run."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers for subclasses
    def _f(self, xb: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        """θ ↦ f(xb; θ), (b, K)."""

        def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return as_2d(call(self.model, {**p, **self._rest, **self._buffers}, (xb,)), xb.shape[0])

        return f

    def _forward_mode(self, product: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
        """``product()`` (a forward-mode product), or None — from then on for every product — when an
        op of the model has no forward-mode rule (the caller then takes reverse mode)."""
        if self._reverse:
            return None
        try:
            with no_grad_as_constant():  # a no_grad block a constant, as the reverse-mode products take it
                return product()
        except NotImplementedError as e:
            if not _no_forward_rule(e):
                raise
            _log.info("an op of the model has no forward-mode AD (%s): Hessian products by reverse mode", e)
            self._reverse = True
            return None

    def _hvp(self, g: Callable, U: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``∇g · u`` for each of the m columns u of U, g the gradient of a scalar of θ (so ∇g is a
        symmetric Hessian): ``jvp(g)``, or ``vjp(g)`` — ``(∇g)ᵀ u``, the same — without forward mode."""
        out = self._forward_mode(lambda: vmap(lambda u: jvp(g, (self._params,), (u,))[1])(U))
        if out is not None:
            return out
        _, pull = vjp(g, self._params)
        return vmap(lambda u: pull(u)[0])(U)

    def _jvp(self, f: Callable, out: torch.Tensor, pull: Callable, U: dict[str, torch.Tensor]) -> torch.Tensor:
        """``J u`` (m, b, K) for f at θ (``out, pull = vjp(f, θ)``): ``jvp(f)``, or without forward mode
        the ``vjp`` of the linear map ``w ↦ Jᵀ w = pull(w)`` (its transpose is J)."""
        JU = self._forward_mode(lambda: vmap(lambda u: jvp(f, (self._params,), (u,))[1])(U))
        if JU is not None:
            return JU
        _, pull_t = vjp(lambda w: pull(w)[0], torch.zeros_like(out))
        return vmap(lambda u: pull_t(u)[0])(U)

    # ------------------------------------------------------------------ plain autograd (no torch.func)
    def _leaves(self) -> dict[str, torch.Tensor]:
        """The parameters as fresh leaves that require grad (a plain autograd forward's inputs)."""
        return {k: p.detach().requires_grad_(True) for k, p in self._params.items()}

    @staticmethod
    def _grads(
        out: torch.Tensor | list[torch.Tensor],
        wrt: dict[str, torch.Tensor] | torch.Tensor,
        cotangent: torch.Tensor | list[torch.Tensor] | None = None,
        create_graph: bool = False,
    ) -> dict[str, torch.Tensor] | torch.Tensor:
        """``torch.autograd.grad`` of ``out`` (a tensor, or a list paired with ``cotangent``'s list)
        at ``wrt`` (a dict of leaves, or one tensor), zeros where ``out`` does not depend on one
        (or does not require grad at all); the graph is kept for the next column."""
        outs = out if isinstance(out, list) else [out]
        cots = cotangent if isinstance(cotangent, list) else [cotangent] * len(outs)
        live = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
        leaves = list(wrt.values()) if isinstance(wrt, dict) else [wrt]
        if live:
            got = torch.autograd.grad(
                [o for o, _ in live],
                leaves,
                None if cotangent is None else [c for _, c in live],
                retain_graph=True,
                create_graph=create_graph,
                allow_unused=True,
            )
        else:
            got = [None] * len(leaves)
        full = [torch.zeros_like(x) if t is None else t for x, t in zip(leaves, got)]
        return dict(zip(wrt, full)) if isinstance(wrt, dict) else full[0]

    def _plain_hvp(self, scalar: Callable[[dict[str, torch.Tensor]], torch.Tensor], U: dict[str, torch.Tensor]):
        """``∇²(scalar) u`` for each of the m columns u of U by double backward: the gradient once
        with its graph, then one backward of ``∇scalar · u`` per column."""
        theta = self._leaves()
        g = self._grads(scalar(theta), theta, create_graph=True)
        keys = list(theta)
        m = next(iter(U.values())).shape[0]
        cols = [self._grads([g[k] for k in keys], theta, [U[k][j] for k in keys]) for j in range(m)]
        return {k: torch.stack([c[k] for c in cols]) for k in keys}

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
        if self._refused is not None:  # every later product too: the parts of one analysis share it
            raise self._refused
        self._sync()
        forward_mode, plain = not self._reverse, self._plain
        with (
            exact_kernels(self.model),
            autograd_conventions(),
            frequency_unscaled(self.model),  # the derivative's Hessian, not token-count-scaled gradients
            blame(self.model, "the loss Hessian"),
            attributes_kept(self.model),  # activations a hook cached inside the transforms: put back
        ):
            try:
                AV = self._columns(Vt)
            except RuntimeError as e:  # torch.func cannot run an op of the model: plain autograd for good
                if self._plain or not functorch_refused(e):
                    raise
                _log.info("torch.func cannot run the model (%s): Hessian products by plain autograd", e)
                self._plain = True
                AV = self._columns(Vt)
            try:
                if (forward_mode and self._reverse) or (self._plain and not plain):  # switched mode in this product
                    self._check_symmetric()
                if not self._derivative_checked:
                    self._derivative_checked = True
                    self._check_second_order()
            except UnsupportedModelError as e:
                self._refused = e
                raise
        if bool(torch.isfinite(Vt).all()) and not bool(torch.isfinite(AV).all()):
            from nsa_dist.errors import NonFiniteError

            raise NonFiniteError(  # a NaN operator read as a matrix: numpy's "eigenvalues did not converge" (an audit)
                f"the loss Hessian's product of {type(self.model).__name__} is not finite for a finite vector: an op's "
                "composite (differentiable) kernel is NaN where the model's own is not — e.g. an attention row whose "
                "keys are all masked under a per-head (3-D) mask — or the loss is not finite at these outputs"
            )
        return AV

    def _columns(self, Vt: torch.Tensor) -> torch.Tensor:
        m = Vt.shape[1]
        U = {k: u.T.reshape((m,) + p.shape) for (k, p), u in zip(self._params.items(), Vt.split(self._sizes))}
        AU = self._apply_plain(U) if self._plain else self._apply(U)
        return torch.cat([AU[k].reshape(m, -1) for k in self._params], dim=1).T  # (P, m)

    def _check_symmetric(self) -> None:
        """UnsupportedModelError unless ``xᵀ A y = yᵀ A x`` for two fixed random x, y: reverse-over-reverse
        products rest on PyTorch's double backward of every op, which is wrong for some."""
        gen = torch.Generator().manual_seed(0)
        V = torch.randn(self.shape[0], 2, generator=gen, dtype=torch.float64).to(self.dtype).to(self.device)
        AV = self._columns(V)
        a, b = float(V[:, 0] @ AV[:, 1]), float(V[:, 1] @ AV[:, 0])
        scale = float(V.norm(dim=0).max() * AV.norm(dim=0).max())
        tol = 1e-8 if self.dtype == torch.float64 else 1e-3
        if not abs(a - b) <= tol * scale:
            why = (
                "torch.func cannot transform an autograd.Function of this model (no setup_context), and plain "
                "autograd's second derivatives of it are wrong (a backward marked once_differentiable, or made of "
                "ops autograd does not see)"
                if self._plain
                else f"an op of this model has no forward-mode AD in PyTorch {torch.__version__}, and its reverse-mode "
                "second derivatives are wrong"
            )
            raise UnsupportedModelError(
                f"{why}: the {type(self).__name__}'s products are not symmetric "
                f"(|xᵀAy − yᵀAx| = {abs(a - b):.3g}, {abs(a - b) / max(scale, 1e-300):.2g} of ‖x‖‖Ay‖), so this "
                "curvature is not measured"
            )

    def _check_second_order(self) -> None:
        """UnsupportedModelError when the model's forward runs a custom ``autograd.Function`` and the
        products' second derivatives of f disagree with a central difference of its (first-order)
        gradients on the first few points.  Second derivatives through a Function are differentiations
        of its backward: one written on a detached input — as a NumPy, C++ or CUDA-extension backward
        is — gives a correct gradient and a wrong Hessian, and a symmetric one, so the symmetry check
        passes (H and S 0.25–1.4 of max|H| off, status done: an audit).  Only models with such a
        Function are differenced: elsewhere PyTorch's own rules hold, and a ``torch.no_grad()`` block
        is a constant for the products but not for a difference (:func:`_second_order_gap`).  Every point is
        looked at, a chunk at a time, and each chunk whose forward runs a Function is differenced: one used
        by later points only (a flag in the input) put H 0.36 and S 0.50 off, status done (an audit)."""
        # a forward that couples its samples (a GCN over the whole graph) runs on all of them only
        starts = [0] if self._coupled else [0, *range(_CHECK_POINTS, self.N, _CHECK_CHUNK)]
        for i, start in enumerate(starts):
            stop = self.N if self._coupled or i + 1 == len(starts) else starts[i + 1]
            xs, label = self.X[start:stop], f"points {start}–{stop - 1}"
            if self.dtype != torch.float64 and self._second_order_in_float64(xs, label):
                continue
            self._second_order_at(xs, (), label)

    def _second_order_in_float64(self, xs: torch.Tensor, label: str = "") -> bool:
        """The check of a float32 (bf16, …) operator on a float64 twin of its parameters, buffers and points:
        whether it was made (UnsupportedModelError when it refuses).  A float32 difference resolves a
        second derivative to its 3·10⁻² tolerance only: a Function wrong on a side branch 1.7–2 % of
        max|H| passed (a review); float64 resolves 10⁻⁵.  A forward that cannot run in float64 (a
        float32-only kernel, a float32 tensor it keeps outside its buffers) or a difference float64
        cannot settle (a cast to float32 inside) leaves the check to the operator's own dtype — and so
        does a twin whose forward runs fewer of the Functions: a library that dispatches float32 to its
        fused Function and float64 to plain ops (the twin settled on the plain ops, and a Function 0.135
        of max|H| off was measured: a review)."""
        with torch.enable_grad():
            own = python_functions(self._f(xs)(self._leaves()))
        if not own:
            return True
        keep = self._params, self._rest, self._buffers
        try:
            self._params, self._rest, self._buffers = ({k: _widened(t) for k, t in d.items()} for d in keep)
            return self._second_order_at(_widened(xs), own, label)
        except UnsupportedModelError:
            raise
        except Exception as e:  # noqa: BLE001  any failure of the twin: the check in the model's own dtype
            _log.debug("the float64 second-order check could not run (%s: %s)", type(e).__name__, e)
            return False
        finally:
            self._params, self._rest, self._buffers = keep

    def _second_order_at(self, xs: torch.Tensor, needed: tuple[str, ...] | list[str], label: str = "") -> bool:
        """The check at points ``xs`` with the operator's current parameters: whether a difference
        settled it (None from :func:`_second_order_gap` where no step pair agreed); not settled where
        the forward runs not all of the Functions ``needed``."""
        f = self._f(xs)
        theta = self._leaves()
        with torch.enable_grad():
            out = f(theta)
        functions = python_functions(out)
        if not set(needed) <= set(functions):
            return False
        if not functions or not out.requires_grad:
            return True
        gen = torch.Generator().manual_seed(31)
        u = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype).to(out.device)

        def scalar(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return (f(p) * u).sum()

        def product(V: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # this operator's own mode
            U = {k: v[None] for k, v in V.items()}
            got = self._plain_hvp(scalar, U) if self._plain else self._hvp(grad(scalar), U)
            return {k: t[0] for k, t in got.items()}

        settled, gap = _second_order_gap(scalar, self._params, product, gen, self._grads)
        if gap is None:
            return settled
        raise UnsupportedModelError(
            f"the model's forward runs the custom autograd.Function {', '.join(functions)}, and the second "
            f"derivatives taken through it (differentiating its backward) are not those of its gradients: "
            f"{type(self).__name__}'s product is {gap:.2g} (relative) off a central difference of the gradients "
            f"at {label} — a backward computed on detached inputs, in NumPy, or in a C++/CUDA extension "
            "has a correct gradient and no correct derivative of its own; write the backward in differentiable "
            "torch ops (or give it its own double backward), so this curvature is not measured"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, loss={self.loss.value!r}, N={self.N}, dtype={self.dtype})"


_CHECK_POINTS = 16  # points the second-order check differences its gradients on first
_CHECK_CHUNK = 256  # and then a chunk at a time (each a forward; differenced where it runs a Function)
_SECOND_TOL = {torch.float64: 1e-5, torch.float32: 3e-2}  # the difference's truncation and rounding


def python_functions(out: torch.Tensor) -> list[str]:
    """The custom ``torch.autograd.Function`` classes in ``out``'s autograd graph (their backward
    nodes' names less "Backward"), each once."""
    seen: set[int] = set()
    names: list[str] = []
    stack = [out.grad_fn] if out.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            name = type(node).__name__.removesuffix("Backward")
            if name not in names:
                names.append(name)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return names


def _second_order_gap(scalar, params, product, gen, grads) -> tuple[bool, float | None]:  # noqa: ANN001
    """(settled, gap): the relative gap between ``product(v)`` (∇²scalar · v as the operator takes it)
    and a central difference of ∇scalar along v, for up to three random v — gap None at the first v
    where they agree (settled), and where no v gives a difference that two step sizes agree on (a
    step across a kink proves nothing either way: not settled)."""
    dtype = next(iter(params.values())).dtype
    tol = _SECOND_TOL.get(dtype, _SECOND_TOL[torch.float32])
    eps = float(torch.finfo(dtype).eps)
    norm = _norm(params.values())
    worst = None

    def floor_of(size: float, step: float) -> float:  # a difference's rounding
        return 64 * eps * size / step

    for _ in range(3):
        v = {k: torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p) for k, p in params.items()}
        h = eps ** (1 / 3) * max(norm, 1.0) / max(_norm(v.values()), 1e-300)

        def gradient(shift: float, v: dict[str, torch.Tensor] = v) -> torch.Tensor:
            th = {k: (p + shift * v[k]).detach().requires_grad_(True) for k, p in params.items()}
            with torch.enable_grad():
                val = scalar(th)
            return torch.cat([t.reshape(-1) for t in grads(val, th).values()]).double()

        g = gradient(0.0)
        g0 = _norm([g])
        # first order first: where the scalar's own difference is not ∇scalar·v (a .detach() or no_grad block
        # the products take as a constant, as training does), a difference of the gradients proves nothing
        # either (a correct Function beside a detached scale was refused: a review)
        slope = float(g @ torch.cat([t.reshape(-1) for t in v.values()]).double())
        with torch.no_grad():
            s0 = abs(float(scalar(params)))
            first = [float(scalar(_shift(params, v, a)) - scalar(_shift(params, v, -a))) / (2 * a) for a in (h, h / 4)]
        agree = abs(first[0] - first[1]) <= tol * abs(first[1]) + floor_of(s0, h)
        if agree and abs(first[1] - slope) > tol * max(abs(slope), abs(first[1])) + floor_of(s0, h):
            return True, None
        diffs = [(gradient(step) - gradient(-step)) / (2 * step) for step in (h, h / 4)]
        Hv = torch.cat([t.reshape(-1) for t in product(v).values()]).double()
        size = max(float(Hv.norm()), float(diffs[1].norm()))
        floor = floor_of(g0, h)
        if float((diffs[0] - diffs[1]).norm()) > tol * size + floor:
            continue  # the steps disagree: a kink or a jump between them
        gap = float((Hv - diffs[1]).norm())  # (first order held: the products' derivative is the function's)
        if gap <= tol * size + floor:
            return True, None
        worst = max(worst or 0.0, gap / max(size, 1e-300))
    return worst is not None, worst


def _widened(t: torch.Tensor) -> torch.Tensor:
    """A float64 (complex128) copy of a floating (complex) tensor; integer ones as they are."""
    if t.is_complex():
        return t.to(torch.complex128)
    return t.to(torch.float64) if t.is_floating_point() else t


def _shift(params: dict[str, torch.Tensor], v: dict[str, torch.Tensor], step: float) -> dict[str, torch.Tensor]:
    return {k: p + step * v[k] for k, p in params.items()}


def _norm(tensors) -> float:  # noqa: ANN001
    return float(torch.sqrt(sum(((x.double() ** 2).sum() for x in tensors), torch.zeros((), dtype=torch.float64))))


def _no_forward_rule(e: NotImplementedError) -> bool:
    """Whether PyTorch raised ``e`` for an op without forward-mode AD ("Trying to use forward AD with
    …", "You must implement the jvp function … to use it with forward mode AD")."""
    text = str(e)
    return "forward AD" in text or "forward mode AD" in text


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether a and b differ anywhere, NaN equal to NaN (an unused NaN buffer re-read every product)."""
    ne = a != b
    if a.is_floating_point():
        ne &= ~(torch.isnan(a) & torch.isnan(b))
    return ne.any()


_MODE_DEPENDENT = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.modules.dropout._DropoutNd,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
    nn.RReLU,
    nn.MultiheadAttention,
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.RNNBase,
)


def _mode_matters(m: nn.Module) -> bool:
    """Whether ``m``'s train/eval mode can change what it computes: PyTorch's norms, dropouts, RReLU,
    attention, transformer and recurrent layers; any other module whose forward reads ``training`` (or
    whose source cannot be read); not a layer or container whose forward does not."""
    return _mode_matters_for(type(m))


@functools.lru_cache(maxsize=4096)
def _mode_matters_for(cls: type) -> bool:
    if issubclass(cls, _MODE_DEPENDENT):
        return True
    try:
        return "training" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True


class _WeightNormComposite(TorchFunctionMode):
    """``torch._weight_norm`` by its composite formula (see :func:`autograd_conventions`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if func is torch._weight_norm:
            v, g, dim = (_arg(args, kwargs, i, k, 0) for i, k in enumerate(("v", "g", "dim")))
            return v * (g / torch.norm_except_dim(v, 2, dim))
        return func(*args, **kwargs)


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: object) -> object:
    """Argument i (called ``name``) of a call, positional or keyword."""
    return args[i] if len(args) > i else kwargs.get(name, default)


@contextlib.contextmanager
def autograd_conventions() -> Iterator[None]:
    """Within the block products of every order differentiate the model as its first-order reverse
    mode (``torch.autograd.grad``, the NTK's Jacobian) does, and forward mode runs where PyTorch's
    fused kernels lack it:

    * ``weight_norm`` (``torch.nn.utils.weight_norm`` or ``parametrizations.weight_norm``) computes
      its weight by the composite formula instead of the fused ``_weight_norm_interface`` — which
      has no forward-mode rule, and whose double backward is wrong in PyTorch 2.13;
    * an ``Embedding`` with ``padding_idx`` looks the padding row up as a constant: reverse mode
      gives that row no gradient, while forward mode (``jvp``) moved the looked-up row with its
      tangent — H, I and S of an embedding model with padding were asymmetric, 0.77 off;
    * a tensor read through ``.data`` is a constant at every level (:func:`~nsa_dist.ntk.state.data_as_constant`);
    * PReLU, fmax, clamp with tensor bounds, atan2 and nan_to_num take their backward's derivative at ties
      and kinks in every mode (:func:`~nsa_dist.ntk.state.ties_as_backward`)."""
    with _WeightNormComposite(), padding_rows_constant(), data_as_constant(), ties_as_backward():
        yield


def _own_memory(p: torch.Tensor) -> torch.Tensor:
    """``p``, or a contiguous copy where entries share memory (an ``expand``-ed Parameter, stride 0):
    forward mode's dual tensors take the primal's strides, and a tangent written into one memory
    location from several entries is refused by torch (the Hessian's products failed on such a model,
    an audit; its entries are coordinates of their own, as autograd's gradient of it has them)."""
    if any(st == 0 and n > 1 for st, n in zip(p.stride(), p.shape)):
        return p.contiguous()
    return p
