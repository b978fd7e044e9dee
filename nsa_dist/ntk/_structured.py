"""Structured NTK for networks of Linear layers (private).

For a Linear layer ``z = w·W a + β·b`` the per-sample gradient of output f_a is
``∂f_a/∂W = w·δ_a aᵀ`` and ``∂f_a/∂b = β·δ_a`` with ``δ_a = ∂f_a/∂z``.  So the layer's share
of the traced kernel is ``(Â Âᵀ) ⊙ (D Dᵀ)`` with ``Â = [w·A, β·1]`` (N, n_in+1) and
``D = [δ_1 … δ_K]`` (N, K·n_out), both from one forward and one backward pass (DESIGN.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.ntk._probe import ForwardPlan, Route, _uses, plan_forward
from nsa_dist.ntk.inputs import as_2d

# Feature memory (Â, D for all points of one layer group) is kept under this fraction of the
# output's bytes (or _MIN_FEATURE_BYTES): layers are split into groups, one forward/backward
# pass over the data per group.  Trades a few extra passes for peak memory ≈ 1.1× the output.
_FEATURE_FRACTION = 0.125
_MIN_FEATURE_BYTES = 64e6
# Points per forward/backward pass when features are computed for all points at once.
_FEATURE_CHUNK = 2048


@dataclass(frozen=True)
class _Layer:
    """A Linear layer with the scales of its trainable parameters (None: frozen/absent)."""

    module: nn.Linear
    w: float | None
    b: float | None
    clone_out: bool = False

    @property
    def n_cols(self) -> int:
        """Columns of Â, zero-padded to a multiple of 8: BLAS runs 15% slower at K = 257."""
        return _pad8((self.module.in_features if self.w is not None else 0) + (self.b is not None))

    @property
    def n_out(self) -> int:
        return _pad8(self.module.out_features)


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


class Unproven(RuntimeError):
    """A feature pass saw what the probe did not (a saved layer input or output modified in
    place): the per-layer formula is not proven for these points; the caller takes the exact path."""


def structured_layers(plan: ForwardPlan) -> list[_Layer]:
    """The structured factors' layers of a plan whose every parameter takes the structured path."""
    return [_Layer(lay.module, lay.w, lay.b, lay.clone_out) for lay in plan.layers]


def not_structured_reason(plan: ForwardPlan) -> str | None:
    """Why ``method='structured'`` does not apply to the plan's model (None: it does)."""
    for name, (path, why) in plan.routes.items():
        if path != Route.STRUCTURED:
            return f"parameter {name!r} takes the {path} path: {why}"
    return None


def linear_layers(model: nn.Module, x_probe: torch.Tensor) -> list[_Layer]:
    """The model's Linear layers, or UnsupportedModelError saying why the formula does not apply.

    The formula needs (checked on probe forwards, :func:`plan_forward`): every trainable parameter
    in a standard ``nn.Linear`` called once per forward on 2-D (n, features) inputs and used once,
    its input not modified in place, and no coupling of samples (batch statistics).
    """
    plan = plan_forward(model, x_probe)
    why = not_structured_reason(plan)
    if why is not None:
        raise UnsupportedModelError(f"method='structured' does not apply: {why} (use method='auto')")
    return structured_layers(plan)


def layer_passes(
    model: nn.Module, modules: list[nn.Module], x: torch.Tensor, K: int, clone: list[bool] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor | None, ...]]]:
    """One forward and K backward passes over a chunk x: each module's input ``A_l`` (detached),
    its output ``z_l`` and, per model output a, ``δ_{a,l} = ∂f_a/∂z_l`` (None where f_a does not
    depend on z_l).  What the per-layer NTK paths (structured, conv) build their features from.

    ``clone[l]``: hand the model a copy of module l's output (the model modifies it in place) and
    differentiate the original.  Any other saved input or output modified in place, or an input or
    output without one row per point of x, raises :class:`Unproven` — the formula would silently use
    the wrong tensor.
    """
    acts: dict[int, torch.Tensor] = {}
    zs: dict[int, torch.Tensor] = {}
    seen: dict[int, list] = {}
    copy_out = {id(m): c for m, c in zip(modules, clone or [False] * len(modules))}

    def hook(mod: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor | None:
        a = args[0] if args else kwargs.get("input")  # a layer called as layer(input=x) too
        if not isinstance(a, torch.Tensor) or a.shape[:1] != x.shape[:1] or out.shape[:1] != x.shape[:1]:
            raise Unproven(  # the probe proved one row per point
                f"{type(mod).__name__} saw {tuple(getattr(a, 'shape', ()))} → {tuple(out.shape)} in a feature "
                f"pass of {x.shape[0]} points"
            )
        acts[id(mod)], zs[id(mod)] = a.detach(), out
        seen.setdefault(id(mod), []).append((a, a._version, out, out._version))
        return out.clone() if copy_out[id(mod)] else None

    if _global_forward_hooks():
        # a global hook runs before every module's own: one that replaced a layer's output on some points
        # would hand this pass another tensor than the layer's (its own hooks run after the capture)
        raise Unproven("a global forward hook is installed (torch.nn.modules.module.register_module_forward_hook)")
    # first among the module's forward hooks: a user's hook that replaces the output (on some points only:
    # the probe's points passed) acts downstream of the captured z, where δ = ∂f/∂z takes it in (a hook
    # halving a Linear's output on 3 of 8 points put the structured kernel 0.70 off, an audit)
    handles = [m.register_forward_hook(hook, with_kwargs=True, prepend=True) for m in modules]
    try:
        with torch.enable_grad():
            out = as_2d(model(x), x.shape[0])  # (b, K)
            for m in modules:
                calls = seen.get(id(m), [])
                if len(calls) != 1:
                    raise Unproven(f"{type(m).__name__} was called {len(calls)} times in a feature pass")
                a, va, z, vz = calls[0]
                if a._version != va or (not copy_out[id(m)] and z._version != vz):
                    raise Unproven(f"a saved tensor of {type(m).__name__} was modified in place")
            # each parameter used once in these points' graph, as the probe proved on its own points:
            # a forward that reads a weight again for some points only (a per-point branch the probe
            # points did not take) would add a term the layer's formula leaves out
            uses = _uses(out)
            for m in modules:
                for name, p in m.named_parameters():
                    if p.requires_grad and uses.get(id(p), 0) != 1:
                        raise Unproven(
                            f"parameter {name!r} of {type(m).__name__} is used {uses.get(id(p), 0)} times in a "
                            "feature pass (once on the probe points)"
                        )
            Z = [zs[id(m)] for m in modules]
            c, w = _sample_weights(out)
            own = [[p for p in m.parameters() if p.requires_grad] for m in modules]
            flat = [p for ps in own for p in ps]
            got = torch.autograd.grad((out * c[:, None] * w).sum(), Z + flat, retain_graph=True, allow_unused=True)
            mixed = got[: len(Z)]
            _only_through_outputs(modules, Z, own, mixed, got[len(Z) :])
            grads = [
                torch.autograd.grad(out[:, a].sum(), Z, retain_graph=a < K - 1, allow_unused=True) for a in range(K)
            ]  # K × modules × δ (b, …)
            _rows_are_their_points(modules, c, w, mixed, grads)
    finally:
        for h in handles:
            h.remove()
    return [acts[id(m)] for m in modules], Z, grads


def _only_through_outputs(
    modules: list[nn.Module],
    Z: list[torch.Tensor],
    own: list[list[torch.Tensor]],
    mixed: tuple[torch.Tensor | None, ...],
    total: tuple[torch.Tensor | None, ...],
) -> None:
    """:class:`Unproven` unless each layer's parameters reach the outputs through the layer's output z
    only: their whole gradient (``total``, of the weighted outputs) must be what the layer's own op
    makes of ∂/∂z (``mixed``) — the layer's formula.  A forward that differentiates itself (a PINN's
    or a Hamiltonian net's ``torch.autograd.grad(u, x, create_graph=True)``) reuses the layer's
    weight in the derivative's graph through the node the forward made (so it counts as used once),
    and the structured and per-layer kernels were 0.16–0.30 off (an audit).  (Another use of the
    weight before the layer is :func:`_uses`' to find.)"""
    at = 0
    for m, z, ps, g in zip(modules, Z, own, mixed):
        whole, at = total[at : at + len(ps)], at + len(ps)
        if not ps:
            continue
        if g is None:
            local: tuple[torch.Tensor | None, ...] = (None,) * len(ps)
        else:
            local = torch.autograd.grad(z, ps, g, retain_graph=True, allow_unused=True)
        for p, a, b in zip(ps, whole, local):
            a = torch.zeros_like(p) if a is None else a
            b = torch.zeros_like(p) if b is None else b
            if float((a - b).norm()) > 1e4 * float(torch.finfo(a.dtype).eps) * float(a.norm() + b.norm()):
                raise Unproven(
                    f"a parameter of {type(m).__name__} reaches the outputs other than through the layer's output "
                    "in a feature pass (a forward that differentiates itself, or reads the weight again)"
                )


def _global_forward_hooks() -> bool:
    """Whether a global module forward hook is installed (``register_module_forward_hook``)."""
    from torch.nn.modules import module as _module

    return bool(getattr(_module, "_global_forward_hooks", None))


def _sample_weights(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cotangent weights (c (b,), w (K,)) for the output ``out`` (b, K): per point a random sign times
    1 + U[0, 1) (far apart for a swapped pair), per output 0.5 + U[0, 1); seeded, so a pass is
    reproducible."""
    gen = torch.Generator().manual_seed(out.shape[0] * 7919 + out.shape[1])
    b, K = out.shape
    c = (1.0 + torch.rand(b, generator=gen, dtype=torch.float64)) * (torch.randint(0, 2, (b,), generator=gen) * 2 - 1)
    w = 0.5 + torch.rand(K, generator=gen, dtype=torch.float64)
    return c.to(dtype=out.dtype, device=out.device), w.to(dtype=out.dtype, device=out.device)


def _rows_are_their_points(
    modules: list[nn.Module],
    c: torch.Tensor,
    w: torch.Tensor,
    mixed: tuple[torch.Tensor | None, ...],
    grads: list[tuple[torch.Tensor | None, ...]],
) -> None:
    """:class:`Unproven` unless, for every layer, row k of its output gets its gradient from point k's
    outputs only — on every point of the pass, not the probe's few: with cotangent weights c_k·w_a, the
    gradient at row k must be c_k · Σ_a w_a δ_{a,k}.  A forward that sorts its batch by a key (lengths
    for packing) and restores the order after the layer moves rows to other points; the probe's points,
    sharing one key, stayed in place in either order, and the structured kernel was 0.87 off (an audit)."""
    tol = 1e4 * float(torch.finfo(c.dtype).eps)
    for i, m in enumerate(modules):
        if mixed[i] is None:
            continue
        summed = None
        for a, g in enumerate(grads):
            if g[i] is not None:
                summed = g[i] * w[a] if summed is None else summed + g[i] * w[a]
        expect = torch.zeros_like(mixed[i]) if summed is None else summed * c.view((-1,) + (1,) * (summed.ndim - 1))
        got = mixed[i]
        err = (got - expect).reshape(got.shape[0], -1).norm(dim=1)
        size = got.reshape(got.shape[0], -1).norm(dim=1) + expect.reshape(expect.shape[0], -1).norm(dim=1)
        if bool((err > tol * (size + 1e-3 * size.max())).any()):
            k = int(torch.argmax(err / (size + 1e-3 * size.max() + 1e-300)))
            raise Unproven(
                f"row {k} of {type(m).__name__}'s output takes its gradient from other points than point {k} "
                "in a feature pass (the forward moves or mixes rows: sorted, gathered, or coupled)"
            )


def _chunk_features(
    model: nn.Module, layers: list[_Layer], x: torch.Tensor, K: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(Â (b, n_cols), D (b, K, n_out)) per layer for one chunk of points x (b, d)."""
    acts, _, grads = layer_passes(model, [lay.module for lay in layers], x, K, [lay.clone_out for lay in layers])
    feats = []
    for i, lay in enumerate(layers):
        A = acts[i]  # (b, n_in)
        Ahat = A.new_zeros(A.shape[0], lay.n_cols)  # (b, n_cols) = [w·A, β·1, 0…]
        c = 0
        if lay.w is not None:
            torch.mul(A, lay.w, out=Ahat[:, : A.shape[1]])
            c = A.shape[1]
        if lay.b is not None:
            Ahat[:, c] = lay.b
        D = A.new_zeros(A.shape[0], K, lay.n_out)  # (b, K, n_out), zero-padded
        for a, g in enumerate(grads):
            if g[i] is not None:
                D[:, a, : g[i].shape[1]] = g[i]
        feats.append((Ahat, D))
    return feats


def _compute_dtype(model: nn.Module, x: torch.Tensor) -> torch.dtype:
    """The Gram's dtype: the points' when they are floats, else (token ids, indices into a table) the
    model's parameters' — an integer input made an int64 Gram of a buffer-table model (diagonal 1
    where it is 4.1)."""
    if x.is_floating_point():
        return x.dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())


def _features(
    model: nn.Module, layers: list[_Layer], x: torch.Tensor, K: int, chunk: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Features of every point of x, computed ``chunk`` points at a time."""
    n, dtype = x.shape[0], _compute_dtype(model, x)
    A_all = [torch.empty(n, lay.n_cols, dtype=dtype, device=x.device) for lay in layers]
    D_all = [torch.empty(n, K, lay.n_out, dtype=dtype, device=x.device) for lay in layers]
    for s in range(0, n, chunk):
        for l, (A, D) in enumerate(_chunk_features(model, layers, x[s : s + chunk], K)):
            A_all[l][s : s + chunk] = A
            D_all[l][s : s + chunk] = D
    return list(zip(A_all, D_all))


def _layer_groups(layers: list[_Layer], n_points: int, K: int, itemsize: int, out_bytes: float) -> list[list[_Layer]]:
    budget = max(_FEATURE_FRACTION * out_bytes, _MIN_FEATURE_BYTES)
    groups: list[list[_Layer]] = [[]]
    used = 0.0
    for lay in layers:
        size = n_points * (lay.n_cols + K * lay.n_out) * itemsize
        if groups[-1] and used + size > budget:
            groups.append([])
            used = 0.0
        groups[-1].append(lay)
        used += size
    return groups


class _Buffers:
    """Reusable tile work arrays, one pair per tile shape (avoids a malloc per tile)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self._bufs: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.dtype, self.device = dtype, device

    def get(self, shape_a: tuple[int, int], shape_d: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        key = shape_a + shape_d
        if key not in self._bufs:
            self._bufs[key] = (
                torch.empty(shape_a, dtype=self.dtype, device=self.device),
                torch.empty(shape_d, dtype=self.dtype, device=self.device),
            )
        return self._bufs[key]


def _add_tile(out: torch.Tensor, F1: list, F2: list, i: slice, j: slice, full: bool, bufs: _Buffers) -> None:
    """out[i, j] += Σ_l (Â_i Â_jᵀ) ⊙ (D_i D_jᵀ), traced or full over outputs."""
    for (A1, D1), (A2, D2) in zip(F1, F2):
        a1, a2, d1, d2 = A1[i], A2[j], D1[i], D2[j]
        bi, bj, K = a1.shape[0], a2.shape[0], d1.shape[1]
        if full:
            AA, DD = bufs.get((bi, bj), (bi * K, bj * K))
            torch.mm(a1, a2.T, out=AA)  # (bi, bj)
            torch.mm(d1.reshape(bi * K, -1), d2.reshape(bj * K, -1).T, out=DD)  # (bi K, bj K)
            out[i, :, j, :].addcmul_(AA[:, None, :, None], DD.view(bi, K, bj, K))
        else:
            AA, DD = bufs.get((bi, bj), (bi, bj))
            torch.mm(a1, a2.T, out=AA)  # (bi, bj)
            torch.mm(d1.reshape(bi, -1), d2.reshape(bj, -1).T, out=DD)  # (bi, bj)
            out[i, j].addcmul_(AA, DD)


def structured_gram(
    model: nn.Module,
    layers: list[_Layer],
    x1: torch.Tensor,
    x2: torch.Tensor | None,
    K: int,
    full: bool,
    block: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact NTK Gramian by the per-layer formula, assembled in (block × block) tiles.

    ``layers``: from :func:`structured_layers` of the model's plan.  ``out``: the tensor to
    assemble it in (checked by the caller), else a new one.
    Returns (N1, N2) traced or (N1, K, N2, K) full; symmetric tiles are computed once when x2 is None.
    """
    sym = x2 is None
    n1 = x1.shape[0]
    n2 = n1 if sym else x2.shape[0]
    shape = (n1, K, n2, K) if full else (n1, n2)
    dtype = _compute_dtype(model, x1)
    itemsize = torch.empty((), dtype=dtype).element_size()
    bufs = _Buffers(dtype, x1.device)
    if sym and not full:
        plan = _lower_slots(n1, block, sum(lay.n_cols + K * lay.n_out for lay in layers))
        if plan is not None:  # every entry is written below: no zero fill needed
            G = out if out is not None else torch.empty(shape, dtype=dtype, device=x1.device)
            _sym_traced_in_place(G, model, layers, x1, K, block, plan, bufs)
            _mirror_upper(G, block, full)
            return G
    G = out.zero_() if out is not None else torch.zeros(shape, dtype=dtype, device=x1.device)
    starts1 = range(0, n1, block)
    for group in _layer_groups(layers, n1 + (0 if sym else n2), K, itemsize, G.numel() * itemsize):
        F1 = _features(model, group, x1, K, max(block, _FEATURE_CHUNK))
        if sym and not full:
            blocks = [
                [(A[s : s + block], D[s : s + block].reshape(-1, K * D.shape[2])) for A, D in F1] for s in starts1
            ]
            _sym_upper(G, blocks, block, bufs, accumulate=True)
            del F1, blocks
            continue
        F2 = F1 if sym else _features(model, group, x2, K, max(block, _FEATURE_CHUNK))
        for s in starts1:
            i = slice(s, min(s + block, n1))
            for t in range(s, n2, block) if sym else range(0, n2, block):
                _add_tile(G, F1, F2, i, slice(t, min(t + block, n2)), full, bufs)
        del F1, F2
    if sym:
        _mirror_upper(G, block, full)
    return G


def _mirror_upper(G: torch.Tensor, block: int, full: bool) -> None:
    """Copy the computed upper tiles (I < J) onto the lower ones; make diagonal tiles exactly symmetric."""
    n, K = G.shape[0], (G.shape[1] if full else 1)
    for s in range(0, n, block):
        i = slice(s, min(s + block, n))
        b = i.stop - s
        T = G[i, :, i, :].reshape(b * K, b * K) if full else G[i, i]
        T = torch.triu(T) + torch.triu(T, 1).T
        (G[i, :, i, :] if full else G[i, i]).copy_(T.view(b, K, b, K) if full else T)
        for t in range(s + block, n, block):
            j = slice(t, min(t + block, n))
            if full:
                G[j, :, i, :].copy_(G[i, :, j, :].permute(2, 3, 0, 1))
            else:
                G[j, i].copy_(G[i, j].T)


# ------------------------------------------------------------------ symmetric traced kernel, in place
# While the upper tiles (I ≤ J) are computed, G's strictly-lower tiles are unused until the final
# mirror: the features of every block row are kept there, so the whole computation needs one
# forward/backward pass over the data and no memory beyond G and two tile buffers.


def _lower_slots(n: int, block: int, width: int) -> list[tuple[int, int]] | None:
    """For block row I, (row block r, first column) of a (rows_I, width) region in G's lower tiles.

    The region of block I lies in block row r (I itself when it fits, else a later, larger row)
    within columns [0, r·block), so it never overlaps a tile computed before the mirror.
    None when the lower tiles cannot hold all features (few blocks).
    """
    nb = -(-n // block)
    rows = [min(block, n - r * block) for r in range(nb)]
    need = -(-width // block)  # lower tiles per block row of features
    used = [0] * nb
    plan: list[tuple[int, int] | None] = [None] * nb
    for I in range(nb):  # first every block row that holds its own features
        if need <= I:
            plan[I], used[I] = (I * block, 0), need
    for I in range(nb):  # then the others, in the rows with the most room left
        if plan[I] is None:
            fits = [r for r in range(nb) if rows[r] >= rows[I] and used[r] + need <= r]
            if not fits:
                return None
            r = max(fits, key=lambda q: q - used[q])
            plan[I] = (r * block, used[r] * block)
            used[r] += need
    return plan  # type: ignore[return-value]


def _sym_traced_in_place(
    G: torch.Tensor,
    model: nn.Module,
    layers: list[_Layer],
    x: torch.Tensor,
    K: int,
    block: int,
    plan: list[tuple[int, int]],
    bufs: _Buffers,
) -> None:
    """Upper tiles of the traced symmetric Gram, features stored in G's lower tiles."""
    n = x.shape[0]
    feats: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for I, (r0, c0) in enumerate(plan):
        s = I * block
        b = min(block, n - s)
        off, views = c0, []
        for A, D in _chunk_features(model, layers, x[s : s + b], K):
            D = D.reshape(b, -1)  # (b, K·n_out)
            Av, Dv = (
                G[r0 : r0 + b, off : off + A.shape[1]],
                G[r0 : r0 + b, off + A.shape[1] : off + A.shape[1] + D.shape[1]],
            )
            Av.copy_(A)
            Dv.copy_(D)
            off += A.shape[1] + D.shape[1]
            views.append((Av, Dv))
        feats.append(views)
    _sym_upper(G, feats, block, bufs, accumulate=False)


def _sym_upper(
    G: torch.Tensor, feats: list[list[tuple[torch.Tensor, torch.Tensor]]], block: int, bufs: _Buffers, accumulate: bool
) -> None:
    """The upper tiles (I ≤ J) of the traced symmetric Gram from per-block features.

    A diagonal tile is done as three of its 2×2 sub-tiles (the fourth mirrors one), so the
    work is (nb − 1)/(2 nb) + ¾/nb of the full products instead of (nb + 1)/(2 nb).
    """
    for I, fi in enumerate(feats):
        si = I * block
        bi = fi[0][0].shape[0]
        h = bi // 2
        for a, b in ((slice(0, h), slice(0, h)), (slice(0, h), slice(h, bi)), (slice(h, bi), slice(h, bi))):
            if a.stop > a.start and b.stop > b.start:
                _tile(
                    G[si + a.start : si + a.stop, si + b.start : si + b.stop],
                    [(A[a], D[a]) for A, D in fi],
                    [(A[b], D[b]) for A, D in fi],
                    bufs,
                    accumulate,
                )
        for J in range(I + 1, len(feats)):
            sj = J * block
            fj = feats[J]
            _tile(G[si : si + bi, sj : sj + fj[0][0].shape[0]], fi, fj, bufs, accumulate)


def _tile(out: torch.Tensor, fi: list, fj: list, bufs: _Buffers, accumulate: bool) -> None:
    """out (+)= Σ_l (Â_i Â_jᵀ) ⊙ (D_i D_jᵀ) for per-block features (D flattened over outputs)."""
    for l, ((a1, d1), (a2, d2)) in enumerate(zip(fi, fj)):
        AA, DD = bufs.get(tuple(out.shape), tuple(out.shape))
        torch.mm(a1, a2.T, out=AA)  # (bi, bj)
        torch.mm(d1, d2.T, out=DD)  # (bi, bj)
        if l == 0 and not accumulate:
            torch.mul(AA, DD, out=out)
        else:
            out.addcmul_(AA, DD)
