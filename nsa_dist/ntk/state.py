"""The user's model is never changed by a measurement (shared with :mod:`nsa_dist.hessian`).

NTK, operator and Hessian calls run forwards of the user's model: a BatchNorm in train mode
updates its running statistics and ``num_batches_tracked`` on every forward.  ``preserved``
puts buffers and training modes back afterwards; ``stateless`` gives a model whose forwards
change no buffer at all (needed inside ``torch.func`` transforms, which refuse to mutate a
captured tensor), computing the same function.  ``call`` is ``torch.func.functional_call``
that leaves a module called twice, or a parameter tied into two modules, as it was.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.modules.lazy import LazyModuleMixin
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.models import copied_from, copy_model, noted_parameters, user_named_modules

__all__ = [
    "preserved",
    "parameters_kept",
    "refuse_parameter_writes",
    "plain_scalars",
    "frequency_unscaled",
    "renorm_copies",
    "dense_gradients",
    "stateless",
    "refuse_state_writes",
    "rest_in_chunks",
    "batch_stat_modules",
    "exact_kernels",
    "padding_rows_constant",
    "no_grad_as_constant",
    "call",
    "copyable",
    "cast_copy",
    "attributes_kept",
    "attributes_restored",
]


def rng_kept(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Called from the main thread: the global generators (CPU, and x's CUDA device) as they were on
    exit — the probe of a random forward draws before it is refused, and the caller's later draws
    (its own dropout) stay what they would have been.  From another thread (a Tracker's analysis)
    nothing is written back: the training loop draws meanwhile in the main thread, and a restore
    repeated its draws (a review: 13,779 of 30,415)."""
    if threading.current_thread() is not threading.main_thread():
        return contextlib.nullcontext()
    return torch.random.fork_rng(devices=[x.device.index or 0] if x.device.type == "cuda" else [])


class RandomDraws(TorchDispatchMode):
    """Within the block (this thread only: a dispatch mode), whether any op drew random numbers — an
    op tagged ``nondeterministic_seeded`` (dropout's ``bernoulli_``, ``rand``/``randn``, ``normal_``,
    ``randperm``, …): ``drew`` lists them.  A forward that draws is random (train-mode dropout), and
    proven so, where two of its forwards may still agree (a probe whose two forwards drew the same
    mask took it for deterministic: an audit).  Thread-local, so a training loop drawing in another
    thread is not seen, and nothing of the global generators is read or written back (a restore of
    their state from an analysis thread repeated the training thread's draws: a review)."""

    def __init__(self) -> None:
        super().__init__()
        self.drew: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs):
            self.drew.append(str(func))
        return func(*args, **kwargs)


def _draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a ``nondeterministic_seeded`` op draws here: ops that draw only in training or for a
    dropout carry the tag regardless — the fused attention kernels (``dropout_p``), cuDNN's RNN
    (``dropout``, ``train``), ``native_dropout`` (``p``, ``train``), ``rrelu_with_noise``
    (``training``): an eval-mode Transformer layer or ``nn.RReLU`` draws nothing (a review)."""
    schema = func._schema.arguments
    names = [a.name for a in schema]

    def value(name: str) -> Any:
        i = names.index(name)
        if name in kwargs:
            return kwargs[name]
        return args[i] if i < len(args) else schema[i].default_value

    if any(flag in names and value(flag) is False for flag in ("train", "training")):
        return False
    probs = [n for n in ("dropout_p", "dropout") if n in names]
    if "dropout" in func.name() and "p" in names:
        probs.append("p")
    return not any(isinstance(value(n), (int, float)) and value(n) == 0 for n in probs)


@contextlib.contextmanager
def preserved(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block the model may run forwards freely; on exit its buffers (the same tensors,
    with the same values), the weights of its ``max_norm`` embeddings (which every forward
    renormalises in place), its set of submodules, parameters and buffers (none a forward registered
    is left), every module's training mode and its own attributes (:func:`attributes_restored`) are
    what they were on entry.  Inside it no embedding scales its gradient by token frequency
    (``scale_grad_by_freq`` rescales autograd's gradient, not the function: the NTK is made of the
    derivative) or returns a sparse one (:func:`dense_gradients`)."""
    modes = [(m, m.training) for m in model.modules()]
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    # the buffer slots themselves: a forward that reassigns a buffer (``self.n = self.n + 1``, an EMA
    # written ``self.mu = 0.9 * self.mu + …``) leaves the saved tensor alone and puts a new one there
    slots = [(m, dict(m._buffers)) for m in model.modules()]
    # a forward that registers a parameter or buffer (``self.s = nn.Parameter(…)`` on its first call,
    # a buffer turned into a parameter) leaves the model with another parameter set: removed again
    params = [(m, set(m._parameters.keys())) for m in model.modules()]  # keys(): a TorchScript module's dict
    children = [(m, set(m._modules.keys())) for m in model.modules()]  # a submodule built by a forward: removed
    # an embedding with max_norm renormalises the rows it looks up in place, in every forward
    # (torch.embedding_renorm_ on its weight): its weight is put back too
    ids = renormed_weights(model)
    renormed = [(p, p.detach().clone()) for p in model.parameters() if id(p) in ids]
    try:
        with frequency_unscaled(model), dense_gradients(model), attributes_kept(model), attributes_restored(model):
            yield model
    finally:
        for m, names in children:
            for name in set(m._modules.keys()) - names:
                del m._modules[name]
        for m, names in params:
            for name in set(m._parameters.keys()) - names:
                del m._parameters[name]
        for m, bufs in slots:
            for name in set(m._buffers.keys()) - set(bufs):
                del m._buffers[name]
            for name, t in bufs.items():
                if m._buffers.get(name) is not t:
                    m._buffers[name] = t
        with torch.no_grad():
            for b, v in saved + renormed:
                if not torch.equal(b, v):
                    b.data.copy_(v)  # through .data: no version bump, so a backward that saved b still runs
        for m, mode in modes:
            m.training = mode


_SCALARS = (bool, int, float, complex, str, type(None))


def plain_scalars(model: nn.Module) -> list[tuple[nn.Module, str, Any]]:
    """Every module's own attributes (not torch's) that hold a number, a string, a bool or None: the
    Python state a forward may read and write (a data-dependent initialisation's flag, a counter)."""
    return [
        (m, k, v)
        for m in model.modules()
        for k, v in vars(m).items()
        if k not in _MODULE_INTERNALS and isinstance(v, _SCALARS)
    ]


# parameters a functional max_norm lookup renormalises (``F.embedding(idx, self.table, max_norm=1)``), by id:
# what nn.Embedding(max_norm=…) is to :func:`renormed_weights`, found by the probe (:func:`parameters_kept`)
_FUNCTIONAL_RENORM: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def renormed_weights(model: nn.Module) -> set[int]:
    """The ids of the parameters every forward renormalises in place: the weights of ``max_norm``
    embeddings, and parameters the probe saw looked up by a functional ``max_norm`` embedding."""
    ids = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None
    }
    return ids | {id(p) for p in model.parameters() if _FUNCTIONAL_RENORM.get(id(p)) is p}


def _renormalised(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether ``after`` is ``before`` with some rows scaled down — what ``torch.embedding_renorm_`` (a
    ``max_norm`` lookup, of any ``norm_type``) does to the rows it looks up: each changed row a multiple
    in (0, 1) of itself.  (A data-dependent initialisation sets values, not multiples of the old ones;
    a forward that shrinks a weight in every call is refused as random, its two forwards differing.)"""
    if before.ndim != 2 or before.shape != after.shape or not before.is_floating_point():
        return False
    b, a = before.double(), after.double()
    rows = (a != b).any(dim=1).nonzero().flatten()
    if rows.numel() == 0:
        return False
    b, a = b[rows], a[rows]
    scale = (a * b).sum(1) / (b * b).sum(1).clamp_min(1e-300)  # the multiple, where it is one
    ok = bool(((scale > 0) & (scale < 1)).all())
    return ok and bool(torch.allclose(a, scale[:, None] * b, rtol=1e-5, atol=0))


@contextlib.contextmanager
def parameters_kept(model: nn.Module) -> Iterator[Callable[[], list[str]]]:
    """For the probe's first forwards: yields a function naming the parameters whose values a forward
    changed; on exit, if any was, the parameters' values and the modules' plain attributes
    (:func:`plain_scalars`) are put back.  A Glow-style ActNorm initialises itself from the first
    batch it sees (``self.loc.data.copy_(-h.mean(0))`` behind a Python flag): ``gram`` initialised
    the user's model from the probe points, flag set, and measured that model (an audit).  A copy of
    the values is kept for the probe only: later forwards of a model that passed it write none.

    A parameter looked up by a functional ``max_norm`` embedding (``F.embedding(idx, self.table,
    max_norm=1)``) is renormalised by every forward, as an ``nn.Embedding(max_norm=…)``'s weight is:
    not a write of the kind refused (it was, as "writes its own parameters": a review).  Told by what
    the write did (:func:`_renormalised`: rows scaled down — a TorchFunctionMode over the
    probe's forwards cost 0.2 s of a 1.5 s Hessian setup), it is put back and remembered
    (:func:`renormed_weights`), so the routes renormalise copies of it."""
    # a lazy parameter is the forward's to set (LazyLinear's weight takes its shape from the first input),
    # and a max_norm embedding's weight is renormalised by every lookup (:func:`preserved` puts it back)
    renormed = renormed_weights(model)
    saved = [
        (n, p, p.detach().clone())
        for n, p in model.named_parameters()
        if not nn.parameter.is_lazy(p) and id(p) not in renormed
    ]
    scalars = plain_scalars(model)

    def same(p: torch.Tensor, v: torch.Tensor) -> bool:  # NaN where it was NaN (a diverged weight) is the same
        return p.shape == v.shape and bool(torch.eq(p.detach(), v).logical_or(p.detach().isnan() & v.isnan()).all())

    def changed() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        return [(n, p, v) for n, p, v in saved if not same(p, v)]

    def written() -> list[str]:
        return [n for n, p, v in changed() if not _renormalised(v, p.detach())]

    try:
        yield written
    finally:
        moved = changed()
        names = written()
        with torch.no_grad():
            for n, p, v in moved:
                if p.shape == v.shape:
                    p.data.copy_(v)
                if n not in names:
                    _FUNCTIONAL_RENORM[id(p)] = p
        if names:
            for m, k, v in scalars:
                m.__dict__[k] = v


def refuse_parameter_writes(names: list[str]) -> None:
    """UnsupportedModelError when the probe's forwards changed the values of parameters ``names`` (they
    are put back: :func:`parameters_kept`)."""
    if names:
        shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise UnsupportedModelError(
            f"the model's forward writes its own parameters ({shown} changed in a forward of the probe points) — "
            "a data-dependent initialisation on the first forward (ActNorm, as in Glow), or a forward that "
            "updates a weight: nsa-dist would measure the model at parameters set by its own probe points. Your model "
            "is left as it was: run the forward on your own data first (the initialisation done), then measure"
        )


@contextlib.contextmanager
def frequency_unscaled(model: nn.Module) -> Iterator[None]:
    """Within the block no ``nn.Embedding`` / ``nn.EmbeddingBag`` of the model scales its gradient by
    token frequency: ``scale_grad_by_freq`` rescales autograd's gradient, not the function, and the
    NTK and the Hessian are made of the derivative."""
    scaled = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.scale_grad_by_freq]
    for m in scaled:
        m.scale_grad_by_freq = False
    try:
        yield
    finally:
        for m in scaled:
            m.scale_grad_by_freq = True


_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"training"}  # torch's own attributes of every module
_ABSENT = object()
_ORIGINALS: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


def cast_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` cast to ``dtype``, remembered as the user's module's copy (so that
    :func:`preserved` of the copy keeps the user's module's attributes too)."""
    with copyable(model):
        # Module.to(float64) casts a complex tensor to a real one (its imaginary part dropped: a frozen
        # complex filter's kernel 41 % off, a review): complex tensors take dtype's complex counterpart
        wide = torch.promote_types(dtype, torch.complex64) if dtype.is_floating_point else dtype
        twin = copy_model(model)._apply(
            lambda t: t.to(wide if t.is_complex() else dtype) if t.is_floating_point() or t.is_complex() else t
        )
    _ORIGINALS[twin] = _ORIGINALS.get(model, model)
    return twin


def _escaped(v: Any) -> bool:
    """Whether v is a tensor of a ``torch.func`` transform (unusable once the transform ended)."""
    return isinstance(v, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(v)


@contextlib.contextmanager
def attributes_kept(model: nn.Module) -> Iterator[None]:
    """On exit, what a forward hook or a forward stored in the module's own attributes inside a
    ``torch.func`` transform (activations cached as ``self.cache["x"] = out.detach()``,
    ``self.acts.append(out)``) is put back as it was on entry (:func:`_unescaped`) — in the
    user's module too when ``model`` is its cast copy: the copy's hooks are the user's, and write
    where the user's closures point."""
    owners = [model] + ([_ORIGINALS[model]] if model in _ORIGINALS else [])
    plain = [(o, _plain_state(o)) for o in owners]
    try:
        yield
    finally:
        for o, state in plain:
            _unescaped(o, state)


_SEQUENCES = (list, collections.deque)
_SMALL_TENSOR = 4096  # elements of a tensor attribute whose values attributes_restored keeps (a flag, a count)
_DEPTH = 3  # container levels searched below a module attribute (a dict of lists of tensors: 2)


@contextlib.contextmanager
def attributes_restored(model: nn.Module, values: bool = True) -> Iterator[None]:
    """On exit every module's own attributes (not torch's) are what they were on entry: the
    references, the values of small tensors (a flag a forward sets in place), and the items of the
    dicts, lists and deques they hold, ``_DEPTH`` levels down; attributes a forward added go.  A lazy
    module's are left to its first forward (its sizes are set with the parameters it makes).

    For every forward a measurement runs (:func:`preserved`), and in the user's own thread (the
    Tracker's f_t, f_test at ``record``): an activation cache the user's loop reads next must hold
    the user's forward's, not the test points'; a counter must not count the probe's forwards; and
    a cache a forward grows (a position table re-registered as a longer buffer, its length kept in
    an int) must stay one: :func:`preserved` put the buffer back and kept the length, and ``gram``'s
    next forward failed (6 rows expected, 2 found)."""
    # a lazy module's first forward sets its sizes (LazyLinear's in_features) as it makes its parameters,
    # which stay: its attributes stay too
    attrs = [
        (m, {n: v for n, v in vars(m).items() if n not in _MODULE_INTERNALS})
        for m in model.modules()
        if not (isinstance(m, LazyModuleMixin) and m.has_uninitialized_params())
    ]
    # a small tensor attribute written in place (a flag ``self.initialized.fill_(1)``, a step count): its values
    # (``values=False`` inside torch.func's transforms, around each functional call: a copy into a captured
    # tensor is refused there — as is the in-place write it would undo)
    small = [(v, v._version, v.detach().clone()) for _, a in attrs for v in a.values() if values and _small_plain(v)]
    held: list[tuple[Any, Any]] = []
    seen: set[int] = set()

    def walk(v: Any, depth: int) -> None:
        if depth == 0 or id(v) in seen or not isinstance(v, (dict, *_SEQUENCES)):
            return
        seen.add(id(v))
        held.append((v, _items(v)))
        for x in list(v.values() if isinstance(v, dict) else v):
            walk(x, depth - 1)

    for _, a in attrs:
        for v in a.values():
            walk(v, _DEPTH)
    try:
        yield
    finally:
        with torch.no_grad():
            unsure: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for t, version, v in small:
                if t.shape != v.shape or t.dtype != v.dtype:
                    t.data = v
                elif t._version != version:  # written in place
                    t.data.copy_(v)
                else:  # or through .data, which moves no version: compared, one synchronisation per device
                    unsure.setdefault(t.device, []).append((t, v))
            for pairs in unsure.values():
                moved = torch.stack([_differs(t, v) for t, v in pairs]).tolist()
                for (t, v), m in zip(pairs, moved):
                    if m:
                        t.data.copy_(v)
        for c, items in held:
            if isinstance(c, dict):
                if c.keys() != items.keys() or any(c[k] is not v for k, v in items.items()):
                    c.clear()
                    c.update(items)
            elif len(c) != len(items) or any(x is not y for x, y in zip(c, items)):
                c.clear()
                c.extend(items)
        for m, a in attrs:
            for n in [n for n in vars(m) if n not in _MODULE_INTERNALS and n not in a]:
                del m.__dict__[n]
            for n, v in a.items():
                if m.__dict__.get(n, _ABSENT) is not v:
                    m.__dict__[n] = v


def _small_plain(v: Any) -> bool:
    """A tensor attribute :func:`attributes_restored` keeps the values of: dense, on a real device, not a
    parameter, not requiring grad, at most ``_SMALL_TENSOR`` elements (a sparse adjacency, a meta
    placeholder, a quantized or nested tensor is kept by reference only: their comparisons failed)."""
    return (
        isinstance(v, torch.Tensor)
        and not isinstance(v, nn.Parameter)
        and v.layout == torch.strided
        and not v.is_meta
        and not v.is_quantized
        and not v.is_nested
        and not _escaped(v)
        and not v.requires_grad
        and v.numel() <= _SMALL_TENSOR
    )


def _differs(t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor (no synchronisation): whether t's values differ from v's, NaN equal to NaN."""
    same = torch.eq(t, v)
    if t.is_floating_point() or t.is_complex():
        same = same | (t.isnan() & v.isnan())
    return ~same.all()


def _same_values(t: torch.Tensor, v: torch.Tensor) -> bool:
    """Equal values, NaN where NaN (a flag or a count: a NaN attribute is not written by being NaN)."""
    return not bool(_differs(t, v))


def _slots(m: nn.Module) -> Iterator[tuple[Any, Any, Any]]:
    """(holder, key, value) of a module's own attributes (not torch's) and of the items of the
    dicts, lists and deques they hold, ``_DEPTH`` levels down."""

    def inside(v: Any, depth: int) -> Iterator[tuple[Any, Any, Any]]:
        if depth == 0:
            return
        pairs = list(v.items()) if isinstance(v, dict) else list(enumerate(v)) if isinstance(v, _SEQUENCES) else []
        for k, y in pairs:
            yield v, k, y
            yield from inside(y, depth - 1)

    for name, v in list(vars(m).items()):
        if name not in _MODULE_INTERNALS:
            yield m.__dict__, name, v
            yield from inside(v, _DEPTH)


def _items(v: Any) -> Any:
    """A copy of a container's items (dict, list or deque), else None."""
    return dict(v) if isinstance(v, dict) else list(v) if isinstance(v, _SEQUENCES) else None


def _plain_state(model: nn.Module) -> list[tuple[nn.Module, str, Any, Any]]:
    """Every module's own attributes (not torch's) as on entry, with a copy of the items of those
    that are dicts, lists or deques: where a forward hook or a forward stores activations
    (``self.cache["x"] = out.detach()``, ``self.acts.append(out)``)."""
    return [
        (m, name, v, _items(v)) for m in model.modules() for name, v in vars(m).items() if name not in _MODULE_INTERNALS
    ]


def _holds_escaped(v: Any, depth: int = _DEPTH) -> bool:
    """Whether v is a torch.func tensor or a container holding one, ``depth`` levels down."""
    if _escaped(v):
        return True
    if depth == 0 or not isinstance(v, (dict, *_SEQUENCES)):
        return False
    return any(_holds_escaped(x, depth - 1) for x in (v.values() if isinstance(v, dict) else v))


def _clean(v: Any, items: Any, depth: int = _DEPTH) -> None:
    """The entry items ``items`` back in container ``v`` where it now holds a torch.func tensor: a
    dict's key gets its entry value or goes; a list or deque of the entry length gets its entry
    item at that place, otherwise (items added or removed) the escaped ones go.  Containers inside
    it lose their escaped items (``depth`` levels down)."""
    if isinstance(v, dict):
        for k in [k for k, x in v.items() if _escaped(x)]:
            if isinstance(items, dict) and k in items and not _escaped(items[k]):
                v[k] = items[k]
            else:
                del v[k]
        inner = list(v.values())
    elif isinstance(v, _SEQUENCES):
        now = list(v)
        same = isinstance(items, list) and len(items) == len(now)
        kept = [
            x if not _escaped(x) else items[i]
            for i, x in enumerate(now)
            if not _escaped(x) or (same and not _escaped(items[i]))
        ]
        if len(kept) != len(now) or any(a is not b for a, b in zip(kept, now)):
            v.clear()
            v.extend(kept)
        inner = kept
    else:
        return
    for x in inner:
        if depth > 1 and _holds_escaped(x, depth - 1):
            _clean(x, None, depth - 1)


def _unescaped(model: nn.Module, plain: list[tuple[nn.Module, str, Any, Any]]) -> None:
    """Put back what a forward stored inside the measurement's ``torch.func`` transforms: such a
    tensor is unusable afterwards (reading it raises "… escaped from inside a function being
    vmapped"), and a copy of the model (a float32 model measured in float64) failed on it.  An
    attribute holding one, or a container built anew that holds one, gets its entry value back; a
    container's item holding one gets its entry item back, or goes if it was not there (one level
    deep: attributes, and the items of dicts, lists and deques); nothing else a forward stored is
    touched."""
    seen = set()
    for m, name, v, items in plain:
        seen.add((id(m), name))
        now = vars(m).get(name, _ABSENT)
        if now is not v and _holds_escaped(now):  # an escaped tensor, or a container a forward built
            m.__dict__[name] = now = v
        if _holds_escaped(now):
            _clean(now, items)
    for m in model.modules():
        for name, x in list(vars(m).items()):
            if (id(m), name) in seen or name in _MODULE_INTERNALS:
                continue
            if _escaped(x):
                del m.__dict__[name]
            elif _holds_escaped(x):
                _clean(x, None)


def renorm_copies(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (keyed by ``named_parameters()`` names, e.g. detached parameters for
    ``torch.func``) with the weights of ``max_norm`` embeddings replaced by copies: such an
    embedding renormalises the rows it looks up in place in every forward, and a detached
    parameter shares the user's storage — products run outside :func:`preserved` would rewrite
    the user's embedding."""
    ids = renormed_weights(model)
    if not ids:
        return tensors
    names = {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}
    return {k: (v.detach().clone() if k in names else v) for k, v in tensors.items()}


@contextlib.contextmanager
def dense_gradients(model: nn.Module) -> Iterator[None]:
    """Within the block no embedding returns a sparse gradient: ``sparse=True`` (Embedding,
    EmbeddingBag) changes only the gradient's layout, which torch.func's transforms cannot batch
    and the kernels' per-sample gradients cannot reshape — the same derivative, dense."""
    sparse = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    for m in sparse:
        m.sparse = False
    try:
        yield
    finally:
        for m in sparse:
            m.sparse = True


def batch_stat_modules(model: nn.Module) -> list[str]:
    """The batch-norm modules whose forward uses the batch's own statistics (train mode, or no
    running statistics) — they couple the samples of a batch — as "'name' (Type, why)"."""
    return [
        f"{name!r} ({type(m).__name__}, {'train mode' if m.training else 'no running statistics'})"
        for name, m in user_named_modules(model)
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or m.running_mean is None)
    ]


# Norms whose train-mode forward updates running statistics it does not read (it normalises by the
# batch's or the instance's own statistics).
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


WHOLE_INPUT_BYTES = 64 * 2**20  # the largest batch of inputs a check forward falls back to


def forwarded_few(forward: Callable[[torch.Tensor], Any], x: torch.Tensor, n: int = 2) -> tuple[torch.Tensor, Any]:
    """``(points, forward(points))`` for the first ``n`` points of x; where the forward fails on them,
    for all of x — a transductive model over a fixed graph of all the points (a GCN's Â X W) runs on
    no fewer — when its inputs take at most ``WHOLE_INPUT_BYTES`` and the whole batch runs; otherwise
    the first failure is raised, as it was (a forward broken on every input is named on two points,
    not after a forward of every point)."""
    few = x[:n]
    try:
        return few, forward(few)
    except Exception as e:
        if x.shape[0] <= n or x.numel() * x.element_size() > WHOLE_INPUT_BYTES:
            raise
        try:
            return x, forward(x)
        except Exception:  # noqa: BLE001 — broken on the whole batch too: the first failure stands
            raise e from None


def _refuse_held_parameters(model: nn.Module, x: torch.Tensor) -> None:
    """UnsupportedModelError naming a parameter :func:`_held_parameters` finds."""
    held = _held_parameters(model, x)
    if held:
        raise UnsupportedModelError(
            f"the model's forward reads parameter {held[0]!r} other than through its module's attribute — "
            "held by a hook (a default argument, a closure variable, a callable object or a global hook), or "
            "by a function stored on the module that a copy cannot follow — so the NTK, measured with the "
            "parameters substituted by name, would take it as a constant; read it through the module in the "
            "hook (`module.<name>`, `self.<name>` in a closure)"
        )


def _held_parameters(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The trainable parameters a forward reads other than through their module's attribute (what
    :func:`_refuse_held_parameters` refuses): every route measures the model with its parameters substituted by name
    (``functional_call``), so a tensor held elsewhere — a hook's default argument (``g=self.g``), a
    closure variable, a callable object or a bound method holding it, a global hook — enters as a
    constant (an NTK 1–4 % off, status ``done``); so does, in a copy nsa-dist made (a float64 cast,
    an analysis copy), a reference it could not follow to the user's module (a lambda stored as an
    attribute, ``self.act = lambda z: … * self.alpha``).  Found, not guessed: one forward of two
    points with the parameters substituted, and the leaves of its autograd graph must hold none of
    the model's own (or, for a copy, of the module it was copied from)."""
    # the tensors themselves are kept while their ids are compared (an id is an object's only while it lives:
    # one freed meanwhile gave its id to a subs clone below, a parameter "held" on a model holding none — twice
    # in fresh-clone CI); and an original's parameters are those noted by the thread that runs it
    # (:func:`noted_parameters`), never read from its slots: a Tracker's training thread runs the user's module
    # beside this analysis thread, and its record-time checks swap temporaries into those slots — a parameter
    # really held (a global hook's) was missed whenever this look fell inside such a swap
    kept = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for origin in _origins(model):
        kept += [(n, p) for n, p in noted_parameters(origin) if p.requires_grad]
    own = {id(p): n for n, p in kept}
    if not own:
        return []
    subs = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters() if p.requires_grad}
    with preserved(model), torch.enable_grad():
        try:
            few, out = forwarded_few(lambda pts: call(model, subs, (pts.clone(),)), x)
        except Exception:  # noqa: BLE001 — a forward that fails here fails loudly in the measurement
            return []
        held = [own[id(t)] for t in _graph_leaves(out) if id(t) in own]
        # and every other point, a chunk at a time: a tensor held for some points only (a branch the first
        # two do not take) entered every route as a constant, 4.9 % off (an audit)
        for chunk in rest_in_chunks(x, few.shape[0], _HELD_CHUNK_BYTES, _HELD_CHUNK_POINTS):
            if held:
                break
            try:
                out = call(model, subs, (chunk.clone(),))
            except Exception:  # noqa: BLE001
                break
            held = [own[id(t)] for t in _graph_leaves(out) if id(t) in own]
    del kept  # (alive until here)
    return held


_HELD_CHUNK_BYTES = 4 * 2**20  # inputs per forward of the held-parameter check over the other points (with a graph)
_HELD_CHUNK_POINTS = 4096  # and points: 4 MB of a 2-input net are 524,288 points, and their graph gigabytes


def rest_in_chunks(
    x: torch.Tensor, start: int, chunk_bytes: int = WHOLE_INPUT_BYTES, max_points: int | None = None
) -> Iterator[torch.Tensor]:
    """x's points from ``start`` on, in chunks of at most ``chunk_bytes`` of inputs (and ``max_points``
    points) and at least two points (a train-mode norm refuses a batch of one: the last chunk takes its
    neighbour's)."""
    n = x.shape[0]
    per = max(1, x[:1].numel() * x.element_size())
    size = max(2, min(chunk_bytes // per, max_points or n))
    s = start
    while s < n:
        e = min(n, s + size)
        if n - e == 1:
            e = n
        yield x[s:e]
        s = e


def _origins(model: nn.Module) -> list[nn.Module]:
    """The modules ``model`` was copied from by nsa-dist (its cast or analysis copies, and the modules
    those were copied from), nearest first: both links of each — the user's module a cast copy stands
    for (``_ORIGINALS``) and the module it was copied from (:func:`copied_from`), which differ for a
    copy of a copy (a stateless copy of a float64 cast)."""
    out: list[nn.Module] = []
    todo = [model]
    while todo:
        m = todo.pop(0)
        for o in (copied_from(m), _ORIGINALS.get(m)):
            if o is not None and o is not model and all(o is not x for x in out):
                out.append(o)
                todo.append(o)
    return out


def _graph_leaves(out: Any) -> list[torch.Tensor]:
    """The leaf tensors requiring grad that the outputs ``out`` (a tensor or a nest of them) were computed from."""
    roots = [t.grad_fn for t in _tensors(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, leaves = set(), []
    while roots:
        node = roots.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            leaves.append(node.variable)
        roots.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return leaves


def _tensors(out: Any) -> list[Any]:
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _tensors(v)]
    return [out]


def refuse_state_writes(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The buffers of train-mode batch and instance norms that one forward of x's first two points
    (all of x for a forward that runs on no fewer: :func:`forwarded_few`) writes in place
    (their running statistics: the outputs do not read them), after checking that it writes no
    other buffer in place and registers no parameter or buffer — the user's model is left as it was.

    One policy for the NTK and the Hessian (every route, the operators and the Gram): a
    train-mode ``spectral_norm`` runs a power iteration that rewrites its ``_u``/``_v`` in every
    forward, so every forward computes another function.  Two forwards of a converged iteration
    agree to within a float tolerance, yet the kernel measured at one state is not the next
    forward's (1.8e-10 relative off a reference one forward later, in float64; within the float32
    tolerance the iteration need not be near convergence at all), and torch.func's transforms
    cannot run an in-place write of a captured buffer — it is refused, with ``model.eval()`` named.

    Raises:
        UnsupportedModelError: a forward writes a buffer in place other than a norm's running
            statistics, or registers a parameter (named; a buffer it registers, a cache, is measured).
    """
    before = {name: (b, b._version) for name, b in model.named_buffers()}
    params = {name for name, _ in model.named_parameters()}
    with preserved(model), torch.no_grad(), parameters_kept(model) as written:
        # two points (all of x for a forward that runs on no fewer); a copy: a forward may write into its input
        few, _ = forwarded_few(lambda p: model(p.clone()), x)
        # then the other points, a chunk at a time: a forward that writes a buffer (or a weight) for some
        # points only (`if x.abs().max() > 3: self.peak.copy_(…)`) was measured when the first two did not
        # (an audit); a chunk that fails ends this (the measurement's own forward names the failure)
        for chunk in rest_in_chunks(x, few.shape[0]):
            try:
                model(chunk.clone())
            except Exception:  # noqa: BLE001
                break
        refuse_parameter_writes(written())
        changed = [name for name, (b, v) in before.items() if b._version != v]
        # a buffer registered by a forward (a rotary-embedding cache built on the first call) is state the
        # forward computes, not a parameter: measured as before; a parameter is not fixed before a forward
        new = [f"parameter {n!r}" for n, _ in model.named_parameters() if n not in params]
    if new:
        raise UnsupportedModelError(
            f"the model's forward registers {', '.join(new)}: its parameters are not fixed before a forward, "
            "and a kernel over them is not defined; register them in __init__ (or run one forward before measuring)"
        )
    owners = {f"{n}.{k}" if n else k: m for n, m in model.named_modules() for k, _ in m.named_buffers(recurse=False)}
    other = [name for name in changed if not isinstance(owners[name], _NORMS)]
    if other:
        mod = owners[other[0]]
        hint = (
            "call model.eval() if the module updates its state only in training (e.g. spectral_norm's power iteration)"
            if mod.training
            else f"{type(mod).__name__} is in eval mode already: its forward writes the buffer in every "
            "mode — update it only under `if self.training:` (or keep the count outside the module)"
        )
        raise UnsupportedModelError(
            f"the model's forward modifies its buffer {other[0]!r} ({type(mod).__name__}) in "
            "place; nsa-dist computes kernels only of forwards that change no state "
            f"besides batch- and instance-norm running statistics; {hint}"
        )
    _refuse_data_initialised(model, x)
    _refuse_held_parameters(model, x)  # after a forward: a lazy module's parameters exist now
    return changed


def _tensor_slots(model: nn.Module) -> dict[tuple[int, Any], tuple[str, torch.Tensor]]:
    """Every tensor a module holds outside its parameters, by slot — its buffers, its own attributes and
    the items of the dicts, lists and deques they hold, ``_DEPTH`` levels down — with a name to show."""
    out: dict[tuple[int, Any], tuple[str, torch.Tensor]] = {}

    def walk(holder: Any, key: Any, v: Any, label: str, depth: int) -> None:
        if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
            out[(id(holder), key)] = (label, v)
        elif depth and isinstance(v, dict):
            for k, y in list(v.items()):
                walk(v, k, y, f"{label}[{k!r}]", depth - 1)
        elif depth and isinstance(v, _SEQUENCES):
            for i, y in enumerate(list(v)):
                walk(v, i, y, f"{label}[{i}]", depth - 1)

    for n, m in model.named_modules():
        pre = f"{n}." if n else ""
        for k, v in m._buffers.items():
            walk(m._buffers, k, v, pre + k, 0)
        for k, v in list(vars(m).items()):
            if k not in _MODULE_INTERNALS:
                walk(m.__dict__, k, v, pre + k, _DEPTH)
    return out


def _set_since(model: nn.Module, entry: dict[tuple[int, Any], tuple[str, torch.Tensor]]) -> dict:
    """The slots of :func:`_tensor_slots` a forward set to another tensor since ``entry``."""
    return {k: lv for k, lv in _tensor_slots(model).items() if k not in entry or entry[k][1] is not lv[1]}


def _same_outputs(a: Any, b: Any) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(
        not isinstance(x, torch.Tensor)
        or (x.shape == y.shape and bool(torch.isclose(x, y, rtol=1e-6, atol=0, equal_nan=True).all()))
        for x, y in zip(ta, tb)
    )


def _refuse_data_initialised(model: nn.Module, x: torch.Tensor) -> None:
    """Refuse a forward that initialises state from its input on its first call, keeps it and reads it
    (``if self.loc is None: self.loc = -h.mean(0)``, an ActNorm whose shift is not a parameter — in
    an attribute, a buffer registered as None, a dict or a list): every measurement puts the state
    back (:func:`attributes_restored`, :func:`preserved`), so each of its forwards initialised it again
    from its own block of points — a kernel that moved with the block size (18 % between blocks of 4
    and 16, a review) — and before that the probe's points set it for good.  Told apart from a cache
    of the shapes (the same for other points), from a value recomputed by every call (a padding mask:
    the first points' again after other points'), and from one the outputs do not read (a first batch
    kept for a plot, a running maximum for a monitor: the first points' outputs unchanged)."""
    if x.shape[0] < 2:
        return
    entry = _tensor_slots(model)
    few = x[:2]
    other = x[-2:] if x.shape[0] >= 4 else (few * 1.5 + 0.25 if few.is_floating_point() else None)
    if other is None:
        return
    try:
        with preserved(model), torch.no_grad():
            out_first = model(few.clone())
            first = _set_since(model, entry)
        if not first:
            return
        with preserved(model), torch.no_grad():
            model(other.clone())
            second = _set_since(model, entry)
            out_again = model(few.clone())
            again = _set_since(model, entry)
    except Exception:  # noqa: BLE001 — a forward that fails on these points fails loudly in the measurement
        return
    if _same_outputs(out_first, out_again):
        return  # what it kept, the outputs do not read
    for key, (name, v) in first.items():
        w, z = second.get(key, (None, None))[1], again.get(key, (None, None))[1]
        if w is None or z is None or w.shape != v.shape or z.shape != w.shape:
            continue
        if not _same_values(v, w) and _same_values(z, w):  # from the points, and kept by the next call
            raise UnsupportedModelError(
                f"the model's forward sets {name!r} from its input on its first call and keeps it (a "
                "data-dependent initialisation, as Glow's ActNorm): each measurement would set it from its "
                "own points. Your model is left as it was: run the forward on your own data first (the "
                "initialisation done), then measure"
            )


def stateless(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """``model`` itself when its forward changes no buffer, else a copy whose train-mode batch and
    instance norms keep no running statistics (the same outputs: train mode normalises by the
    batch's or the instance's statistics).

    Raises:
        UnsupportedModelError: as :func:`refuse_state_writes`.
    """
    if not refuse_state_writes(model, x):
        return model
    with copyable(model):
        twin = copy_model(model)
    _ORIGINALS[twin] = _ORIGINALS.get(model, model)
    for m in twin.modules():
        if isinstance(m, _NORMS) and m.training:
            # as torch.func's replace_all_batch_norm_modules_
            m.running_mean = m.running_var = m.num_batches_tracked = None
    return twin


@contextlib.contextmanager
def copyable(model: nn.Module) -> Iterator[None]:
    """Within the block ``copy.deepcopy(model)`` works although the model uses the hook-based
    ``torch.nn.utils.weight_norm`` or ``torch.nn.utils.spectral_norm``: their pre-hooks leave the
    computed weight, a non-leaf tensor, on the module, and deepcopy refuses non-leaf tensors ("Only
    Tensors created explicitly by the user …") — a float32 model measured in float64, or one with a
    train-mode batch norm, failed with that torch error.  The weight is detached meanwhile (every
    forward recomputes it) and put back."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    held = []
    for m in model.modules():
        for hook in m._forward_pre_hooks.values():
            t = getattr(m, hook.name, None) if isinstance(hook, (WeightNorm, SpectralNorm)) else None
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                held.append((m, hook.name, t))
                setattr(m, hook.name, t.detach())
    # a tensor a forward stored inside some other code's torch.func transform cannot be copied
    # ("Cannot access storage of TensorWrapper"): None in the copy, the user's left as it is
    dead = [(holder, key, x) for m in model.modules() for holder, key, x in _slots(m) if _escaped(x)]
    for holder, key, _ in dead:
        holder[key] = None
    try:
        yield
    finally:
        for m, name, t in held:
            setattr(m, name, t)
        for holder, key, x in dead:
            holder[key] = x


@contextlib.contextmanager
def exact_kernels(model: nn.Module) -> Iterator[None]:
    """Composite kernels inside forward-mode and higher-order AD, whatever calls attention: the
    math backend of ``F.scaled_dot_product_attention`` (a model's own call or
    ``nn.MultiheadAttention``'s; the CPU flash kernel has no forward-mode rule) and no fused
    Transformer fast path (``_transformer_encoder_layer_fwd`` has none either) — the same
    function, differentiable every way.  Thread-local, for the duration of the block
    (:func:`nsa_dist.ntk._attention.composite_attention`); ``model`` is not inspected.  So is
    ``F.embedding_bag`` (``nn.EmbeddingBag``), which has no forward-mode rule and no second
    derivative in PyTorch (:func:`nsa_dist.ntk._bag.composite_bags`)."""
    from nsa_dist.ntk._attention import composite_attention
    from nsa_dist.ntk._bag import composite_bags

    with composite_attention(), composite_bags():
        yield


class FrequencyScaledLookups(TorchFunctionMode):
    """Sees the embedding lookups of a forward called with ``scale_grad_by_freq=True``
    (``F.embedding`` / ``F.embedding_bag`` / ``torch.embedding`` / ``torch.embedding_bag`` in the
    model's own code: the modules' flags are off inside :func:`preserved`): ``self.seen`` lists them."""

    _AT = {F.embedding: 5, F.embedding_bag: 5, torch.embedding: 3, torch.embedding_bag: 3}
    _WEIGHT = {F.embedding: 1, F.embedding_bag: 1, torch.embedding: 0, torch.embedding_bag: 0}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        at = self._AT.get(func)
        weight = _arg(args, kwargs, self._WEIGHT[func], "weight", None) if at is not None else None
        trained = isinstance(weight, torch.Tensor) and weight.requires_grad  # a frozen table: no gradient to scale
        if trained and _arg(args, kwargs, at, "scale_grad_by_freq", False):
            self.seen.append(f"{getattr(func, '__module__', 'torch')}.{func.__name__}")
        return func(*args, **kwargs)


_DATA = torch.Tensor.data  # the ``.data`` attribute's descriptor (its getter's ``__self__``)


def _prelu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.prelu`` as ``where(x > 0, x, w·x)``: its backward's slope at 0 (the weight) in every mode."""
    if weight.numel() != 1 and x.ndim >= 1:
        shape = [1] * x.ndim
        shape[1 if x.ndim >= 2 else 0] = weight.numel()
        weight = weight.reshape(shape)
    else:
        weight = weight.reshape(())
    return torch.where(x > 0, x, weight * x)


def _fmax(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.fmax`` as the ``where`` its backward takes: a where a ≥ b or b is NaN."""
    return torch.where((a >= b) | torch.isnan(b), a, b)


def _clamp(x: torch.Tensor, lo: torch.Tensor | None, hi: torch.Tensor | None) -> torch.Tensor:
    """``torch.clamp`` with tensor bounds as its backward takes it: x wherever lo ≤ x ≤ hi (at a bound too)."""
    out = x if lo is None else torch.where(x < lo, lo, x)
    return out if hi is None else torch.where(x > hi, hi, out)


def _atan2(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``torch.atan2`` with the derivative its backward gives at (0, 0), 0, instead of forward mode's NaN."""
    at0 = (x == 0) & (y == 0)
    safe = torch.atan2(torch.where(at0, torch.zeros_like(y), y), torch.where(at0, torch.ones_like(x), x))
    return torch.where(at0, torch.atan2(y, x).detach(), safe)


def _nan_to_num(x: torch.Tensor, nan: float | None = 0.0, posinf: float | None = None, neginf: float | None = None):
    """``torch.nan_to_num`` as ``where``: a non-finite value's tangent dropped, as its backward drops it (forward
    mode multiplied a NaN tangent by 0: NaN, after a fully masked softmax row)."""
    if not x.is_floating_point():
        return torch.nan_to_num(x, nan=nan, posinf=posinf, neginf=neginf)
    fi = torch.finfo(x.dtype)

    def full(v: float) -> torch.Tensor:  # as torch casts it (1e6 in float16: inf, not full_like's error)
        return torch.full_like(x, v, dtype=torch.float64).to(x.dtype)

    out = torch.where(torch.isnan(x), full(0.0 if nan is None else nan), x)
    out = torch.where(x == float("inf"), full(fi.max if posinf is None else posinf), out)
    return torch.where(x == float("-inf"), full(fi.min if neginf is None else neginf), out)


def _tie_rule(func: Callable, args: tuple, kwargs: dict) -> Callable[[], torch.Tensor] | None:
    """The composite of :func:`ties_as_backward` for this call, or None."""
    if "out" in kwargs:
        return None
    if func in (F.prelu, torch.prelu):
        x, w = (_arg(args, kwargs, i, k, None) for i, k in enumerate(("input", "weight")))
        return lambda: _prelu(x, w)
    if func in (torch.fmax, torch.Tensor.fmax) and not kwargs:
        return lambda: _fmax(*args)
    if func in (torch.atan2, torch.Tensor.atan2, torch.arctan2) and not kwargs:
        return lambda: _atan2(*args)
    if func in (torch.nan_to_num, torch.Tensor.nan_to_num):
        x = _arg(args, kwargs, 0, "input", None)
        nan, pos, neg = (
            _arg(args, kwargs, i, k, d) for i, k, d in ((1, "nan", 0.0), (2, "posinf", None), (3, "neginf", None))
        )
        return lambda: _nan_to_num(x, nan, pos, neg)
    if func in (torch.clamp, torch.clip, torch.Tensor.clamp, torch.Tensor.clip):
        x, lo, hi = (_arg(args, kwargs, i, k, None) for i, k in enumerate(("input", "min", "max")))
        if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
            if not all(b is None or isinstance(b, torch.Tensor) for b in (lo, hi)):
                return None  # a tensor and a number: as it is (rare)
            if lo is not None and hi is not None and bool((lo > hi).any()):
                return None  # torch's value there is hi, not this where's
            if any(b is not None and b.is_floating_point() and bool(torch.isnan(b).any()) for b in (lo, hi)):
                return None  # a NaN bound: torch's value is NaN there (a review)
            return lambda: _clamp(x, lo, hi)
    return None


class _TiesAsBackward(TorchFunctionMode):
    """See :func:`ties_as_backward`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        rule = _tie_rule(func, args, kwargs)
        return rule() if rule is not None else func(*args, **kwargs)


@contextlib.contextmanager
def ties_as_backward() -> Iterator[None]:
    """Ops whose forward-mode rule (PyTorch 2.13) is not their backward's transpose at some points computed as
    ``where`` composites of the same values, whose derivatives in every mode are the backward's: PReLU at 0
    (forward mode's slope 1 against the weight), ``fmax`` at a tie and ``clamp`` with tensor bounds at a
    bound (the other branch's tangent), ``atan2`` at (0, 0) and ``nan_to_num`` of a non-finite value (NaN
    tangents where the backward is 0).  Zero biases and a point at the origin met them: an operator's G 0.08
    off and not symmetric, I 0.03–0.05 off JᵀJ/N, H NaN (an audit).  (PReLU's double backward has the
    forward rule's slope too, so reverse over reverse needs the composite as well.)"""
    with _TiesAsBackward():
        yield


class _DataConstant(TorchFunctionMode):
    """See :func:`data_as_constant`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        if getattr(func, "__self__", None) is _DATA:
            return args[0].detach()
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def data_as_constant() -> Iterator[None]:
    """A tensor read through ``.data`` in the forward is a constant at every level of torch.func's
    transforms, as plain autograd takes it: nested (forward over reverse, reverse over reverse) ``.data``
    dropped the inner level only, and a Hessian of a model scaling by ``self.a.bias.data[0]`` came back
    0.49 off and not symmetric, a straight-through estimator written with ``.data`` 1.4 off (an audit).
    ``detach()`` shares the storage, so a forward writing through ``.data`` still writes."""
    with _DataConstant():
        yield


class _NoGradConstant(TorchFunctionMode):
    """See :func:`no_grad_as_constant`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DATA:  # ``t.data``: a constant (:func:`data_as_constant`)
            return args[0].detach()
        rule = _tie_rule(func, args, kwargs)  # forward mode as the backward at ties (:func:`ties_as_backward`)
        if rule is not None:
            return rule()
        if not torch.is_grad_enabled():
            if getattr(func, "__name__", "") == "__get__":  # an attribute: read on the tensor itself (a detached
                # copy's requires_grad made a module's full backward hook mark every output non-differentiable:
                # torch's "Error while setting up backward hooks" in the NTK operator, an audit), a tensor detached
                out = func(*args, **kwargs)
                return out.detach() if isinstance(out, torch.Tensor) else out
            args, kwargs = tree_map(lambda a: a.detach() if isinstance(a, torch.Tensor) else a, (args, kwargs))
        return func(*args, **kwargs)


# forward-mode AD's dual levels are the process's, not a thread's: a Tracker measuring in its thread
# while the training thread probes a model lost its tangents (J·t = 0, "no level exists") — every
# forward-mode product of nsa-dist runs under this lock (no_grad_as_constant takes it)
FORWARD_AD_LOCK = threading.RLock()


@contextlib.contextmanager
def no_grad_as_constant() -> Iterator[None]:
    """Forward mode (``torch.func.jvp``) as reverse mode sees a ``torch.no_grad()`` block of the
    forward: the block's inputs detached (detach drops the tangent), so that a parameter read there is
    a constant, as autograd and training take it.  Forward mode differentiated through it: the
    operator's J·u against its Jᵀv made a kernel 1.5e-4 off for a weight normalised by a norm taken
    under no_grad.  A ``.data`` read likewise (:func:`data_as_constant`).  Grad is enabled inside (a
    caller's no_grad would make every op a constant), and :data:`FORWARD_AD_LOCK` held (forward mode's
    levels are shared by the process's threads)."""
    with FORWARD_AD_LOCK, torch.enable_grad(), _NoGradConstant():
        yield


class _PaddingRowsConstant(TorchFunctionMode):
    """An embedding lookup's ``padding_idx`` rows enter as constants (see :func:`padding_rows_constant`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.embedding:  # (input, weight, padding_idx=None, …); its own torch.embedding call is not seen
            idx, weight, pad = (
                _arg(args, kwargs, i, k, None) for i, k in enumerate(("input", "weight", "padding_idx"))
            )
            pad = None if pad is None else pad % weight.shape[0]
        elif func is torch.embedding:  # (weight, indices, padding_idx=-1 for none, …)
            weight, idx, pad = (
                _arg(args, kwargs, i, k, -1) for i, k in enumerate(("weight", "indices", "padding_idx"))
            )
            pad = None if pad is None or pad < 0 else pad
        else:
            return out
        if pad is None:
            return out
        return torch.where((idx == pad).unsqueeze(-1), out.detach(), out)


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: object) -> object:
    """Argument i (called ``name``) of a call, positional or keyword."""
    return args[i] if len(args) > i else kwargs.get(name, default)


@contextlib.contextmanager
def padding_rows_constant() -> Iterator[None]:
    """Within the block (this thread only) an ``Embedding``'s ``padding_idx`` row is looked up as a
    constant: forward mode (``jvp``) then differentiates the model as reverse mode does — autograd's
    embedding backward gives that row no gradient from its lookups, so the NTK's Jacobian (every
    Gram route) has none, while ``jvp`` moved the looked-up row with its tangent.  The NTK
    operator's ``J u`` takes u from ``Jᵀ v``, whose padding row is zero unless another use fills it:
    a head tied to the embedding (``tie_word_embeddings`` with ``padding_idx = pad_token_id``, as
    Hugging Face builds Llama / Qwen2) made the operator 0.08 off the Gram, and not symmetric."""
    with _PaddingRowsConstant():
        yield


def call(model: nn.Module, tensors: dict[str, torch.Tensor], args: tuple[Any, ...]) -> Any:
    """``model(*args)`` with its parameters and buffers replaced by ``tensors`` (keyed by the names
    of ``named_parameters()`` / ``named_buffers()``), differentiable in them as
    ``torch.func.functional_call``, for any sharing in the model.

    ``functional_call`` (tie_weights=True) swaps every name of a tied tensor in turn: a module
    registered twice (``Sequential(lin, act, lin)``) has two names for one attribute, the second
    swap saves the first's replacement as the "original", and the restore leaves that plain tensor
    in the user's module in place of its Parameter.  Here every attribute slot is swapped once,
    under its first name, and a Parameter tied into two modules (an embedding's weight reused by
    the output head) gets the same replacement in both, so the forward sees the tying and the
    derivative in the one entry sums both uses.  The module's own attributes are put back after it
    (:func:`attributes_restored`), as its tensors are."""
    canon: dict[int, str] = {}  # tensor → its first name (the one named_parameters() keeps)
    slots: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    seen: set[int] = set()
    for prefix, mod in model.named_modules(remove_duplicate=False):
        if id(mod) in seen:  # the same module under a second name: its attributes are swapped already
            continue
        seen.add(id(mod))
        for attr, t in [*mod._parameters.items(), *mod._buffers.items()]:
            if t is None:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            first = canon.setdefault(id(t), name)
            if first in tensors:
                slots[name] = tensors[first]
                used.add(first)
    slots.update({k: v for k, v in tensors.items() if k not in used})
    # functional_call puts the module's tensors back, and with them a buffer the forward re-registered
    # (a cache it grew); the module's attributes go back too, or the cache's length kept in an int
    # says the entry buffer is the grown one (the next block's forward failed, 6 rows expected, 2 found)
    with attributes_restored(model, values=False):
        return functional_call(model, slots, args, tie_weights=False)
