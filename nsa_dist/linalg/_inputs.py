"""Turn what the caller passed into one shape: a validated symmetric map on backend arrays (private).

Accepted: a dense (N, N) NumPy array, torch tensor (CPU or CUDA) or CuPy array; a SciPy sparse
matrix or ``LinearOperator``; any object with ``shape == (N, N)`` and ``matmat(V)`` (or only
``matvec(v)``) taking and returning NumPy, torch or CuPy arrays.  The array type an operator
wants is found by one probe product (torch first when its ``dtype`` is a torch dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nsa_dist.errors import NonFiniteError, NSAError, ShapeError
from nsa_dist.linalg._backend import (
    ArrayOps,
    Backend,
    TorchOps,
    _on_gpu,
    array_kind,
    convert,
    get_cupy,
    host_empty,
    resolve_backend,
)

__all__ = ["SymmetricMap", "as_symmetric_map", "sym_rtol", "upcast_product"]

_PROBE_ERRORS = (TypeError, AttributeError, RuntimeError, ValueError)
_EPS64 = float(np.finfo(np.float64).eps)


@dataclass
class SymmetricMap:
    """``G`` as the solvers see it.

    Attributes:
        N: dimension.
        ops: backend of :meth:`matmat`'s arrays.
        apply: ``X (N, b) ↦ G X (N, b)``, float64 ``ops`` arrays; NaN/inf outputs raise.  None:
            ``dense @ X`` (a closure over the map itself would make a reference cycle, which kept
            a float32 G's float64 copy — 0.8 GB at N = 10⁴ — alive until the cyclic collector ran).
        source: the validated dense (N, N) input as it was given (any float dtype, its own
            device), else None for an operator.
        dense: ``source`` as a float64 matrix on the backend, made on first use (a float32 G
            solved with float32 products never needs it), else None.
        eps: machine epsilon of the products (float32 operators: 1.2e-7; dense inputs are
            applied in float64).
        sym_rtol: relative asymmetry of the products the solvers tolerate (inf for a dense
            matrix: checked once on entry).
        n_matvec: columns G was applied to (an operator's probe included).
    """

    N: int
    ops: ArrayOps
    apply: Callable[[Any], Any] | None
    source: Any = None
    eps: float = _EPS64
    sym_rtol: float = float("inf")
    n_matvec: int = 0
    _dense: Any = None

    @property
    def dense(self) -> Any:
        if self._dense is None and self.source is not None:
            src, ops = self.source, self.ops
            converted = str(src.dtype) not in ("float64", "torch.float64")
            if converted and ops.name == "torch" and ops.device.type == "cpu" and not _on_gpu(src):
                self._dense = host_empty(tuple(src.shape)).copy_(convert(src, "torch"))  # in huge pages
            else:
                self._dense = ops.asarray(src)  # (N, N) float64, no copy where src already is one
        return self._dense

    def product(self) -> Callable[[Any], Any]:
        """``X ↦ G X`` uncounted, as a function that holds G but not this map."""
        if self.apply is not None:
            return self.apply
        dense = self.dense
        return lambda X: dense @ X

    def matmat(self, X: Any) -> Any:
        """G X for X (N, b) on the backend, counted in ``n_matvec``."""
        self.n_matvec += X.shape[1]
        return self.dense @ X if self.apply is None else self.apply(X)

    def to_dense(self, block: int = 512) -> Any:
        """The (N, N) matrix; an operator is applied to the identity ``block`` columns at a time.

        Raises:
            ValueError: the materialised operator is not symmetric to ``sym_rtol``.
        """
        if self.dense is not None:
            return self.dense
        G = self.ops.zeros((self.N, self.N))
        for s in range(0, self.N, block):
            cols = slice(s, min(s + block, self.N))
            G[:, cols] = self.matmat(self.ops.eye(self.N, cols))
        _check_symmetric(G, self.sym_rtol, self.ops.name, "the operator")
        return (G + G.T) / 2

    def check_symmetric(self, seed: int) -> None:
        """Raise ValueError unless ``xᵀ(G y) = yᵀ(G x)`` to ``sym_rtol`` for random x, y (2 products)."""
        X = self.ops.from_numpy(np.random.default_rng(seed).standard_normal((self.N, 2)))
        X = self.ops.qr(X)  # (N, 2) orthonormal
        GX = self.matmat(X)  # (N, 2)
        C = self.ops.to_numpy(X.T @ GX)  # (2, 2)
        asym, scale = abs(C[0, 1] - C[1, 0]), float(self.ops.colnorms(GX).max())
        if asym > self.sym_rtol * scale:
            raise ValueError(
                f"G_or_operator is not symmetric: |xᵀ(G y) − yᵀ(G x)| = {asym:.3g} for orthonormal "
                f"x, y ({asym / scale:.3g} of ‖G x‖, allowed ≤ {self.sym_rtol:.1e})"
            )


def sym_rtol(eps: float) -> float:
    """Relative asymmetry tolerated as rounding: √eps (1.5e-8 in float64, 3.5e-4 in float32)."""
    return float(np.sqrt(eps))


_TORCH_HOST_N = 2048  # AUTO: a dense host matrix at least this large runs on torch's CPU BLAS


def as_symmetric_map(G: Any, backend: Backend, name: str = "G_or_operator") -> SymmetricMap:
    """Validate ``G_or_operator`` and wrap it; a dense matrix is moved to ``backend`` once.

    ``name``: what error messages call the argument.  With AUTO a dense host matrix of
    N ≥ 2048 runs on torch's CPU BLAS (MKL): its (N, 16–48) float64 products and the tall QRs of
    Lanczos ran 2–4× faster there than on NumPy's OpenBLAS at N = 10⁴ on two shared cores
    (``benchmarks/topk.py``).  A float32 G there is applied through :func:`upcast_product`:
    float64 products of the stored matrix without an (N, N) float64 copy — 0.8 GB less at
    N = 10⁴, and faster (a top-20 Lanczos of the paper's Gram: 1.3 s against 2.5–3.4 s with
    the copy; top-100 2.2 s against 2.6–3.1 s).

    Raises:
        ShapeError: not (N, N), or an operator returning the wrong shape.
        NonFiniteError: NaN/inf in the matrix or an operator's output.
        ValueError: a dense matrix that is not symmetric (names the max asymmetry).
        TypeError: neither an array nor an operator, or complex entries.
    """
    if array_kind(G) is not None:
        return _dense_map(G, backend, name)
    import scipy.sparse as sp
    from scipy.sparse.linalg import LinearOperator, aslinearoperator

    if sp.issparse(G):
        G = aslinearoperator(G)
    if not (hasattr(G, "matmat") or hasattr(G, "matvec")) or not hasattr(G, "shape"):
        raise TypeError(
            f"{name} must be an (N, N) array (NumPy, torch, CuPy) or an operator with "
            f"`shape` and `matmat(V)` or `matvec(v)`; got {type(G).__name__}"
        )
    shape = tuple(G.shape)
    if len(shape) != 2 or shape[0] != shape[1]:
        raise ShapeError(f"{name} must be square (N, N); the operator has shape {shape}")
    return _operator_map(G, shape[0], backend, numpy_only=isinstance(G, LinearOperator))


def _dense_map(G: Any, backend: Backend, name: str) -> SymmetricMap:
    shape = tuple(G.shape)
    if len(shape) != 2 or shape[0] != shape[1]:
        raise ShapeError(f"{name} must be a square 2-D (N, N) matrix, got shape {shape}")
    if "complex" in str(G.dtype):
        raise TypeError(f"{name} must be real symmetric, got dtype {G.dtype}")
    if isinstance(G, torch.Tensor):
        G = G.detach()  # a G that tracks gradients: its values (no graph through the solver)
    host_torch = backend is Backend.AUTO and shape[0] >= _TORCH_HOST_N and not _on_gpu(G)
    ops = TorchOps("cpu") if host_torch else resolve_backend(backend, G)
    # a float G is checked as it is: its float64 copy holds the same values, and a float32 G read
    # as it is reads half the bytes (0.09 s against 0.39–0.44 s at N = 10⁴); the copy
    # is made only if the solver needs it (SymmetricMap.dense)
    is_float = G.is_floating_point() if isinstance(G, torch.Tensor) else G.dtype.kind == "f"
    checked = G if is_float else ops.asarray(G)  # integer or bool entries: their float64 copy
    n_bad = _non_finite(checked)
    if n_bad:
        raise NonFiniteError(
            f"{name} holds {n_bad} NaN/inf entries (of {shape[0] * shape[1]}); "
            "only finite matrices have an eigendecomposition"
        )
    _check_symmetric(checked, sym_rtol(_eps_of(G)), ops.name, name)
    # a float32 G on the host: float64 products a slab of rows at a time (no float64 copy)
    host = ops.name == "torch" and ops.device.type == "cpu" and not _on_gpu(checked)
    slabs = host and str(checked.dtype) in ("float32", "torch.float32")
    apply = None
    if slabs:
        try:
            apply = upcast_product(_viewed(checked))  # a NumPy G viewed, not copied
        except ValueError:  # a NumPy view torch cannot view (negative strides): the float64 copy
            apply = None
    return SymmetricMap(shape[0], ops, apply, source=checked)


def _viewed(G: Any) -> torch.Tensor:
    """G as a tensor over the same memory.  A read-only NumPy G (np.load's mmap), which is only read here,
    through a writable NumPy view of it: ``torch.as_tensor`` warns of a read-only array, and silencing that
    with ``warnings.catch_warnings()`` swapped the process's warning filters under every other thread (a
    Tracker's training thread beside its analysis: Audit TS)."""
    if isinstance(G, np.ndarray) and not G.flags.writeable:
        G = np.asarray(_WritableView(G))
    return torch.as_tensor(G)


class _WritableView:
    """A NumPy array interface over a read-only array's memory, marked writable (and keeping it alive)."""

    def __init__(self, a: np.ndarray) -> None:
        self.keep = a
        self.__array_interface__ = {**a.__array_interface__, "data": (a.__array_interface__["data"][0], False)}


def upcast_product(G: torch.Tensor, slab_bytes: float = 8e6) -> Callable[[torch.Tensor], torch.Tensor]:
    """``X (N, b) float64 ↦ G X`` in float64 for a torch G of any float dtype, without a float64
    copy of G: a lower-precision G is upcast one slab of rows at a time (~``slab_bytes``, at least
    64 rows), so the products are those of the stored matrix to float64 rounding.  Slabs that stay
    in cache pay off: at N = 10⁴ an (N, 29) product took 0.15–0.16 s with 2–8 MB slabs, 0.42 s
    with 64 MB ones and 0.33 s from a whole float64 copy (2 shared cores).  A float32 G's whole copy is
    0.8 GB at N = 10⁴; float32 products instead err by ~eps₃₂·‖G‖ (at N = 500 they blurred
    λ_k below ~10⁻⁶·λ_1 and doubled the quadrature's brackets).  Holds G, nothing else."""
    N = int(G.shape[0])
    rows = max(64, int(slab_bytes // (8 * max(N, 1))))

    def apply(X: torch.Tensor) -> torch.Tensor:
        if G.dtype == torch.float64:
            return G @ X
        out = torch.empty((N, X.shape[1]), dtype=torch.float64, device=X.device)
        for a in range(0, N, rows):
            out[a : a + rows] = G[a : a + rows].to(torch.float64) @ X
        return out

    return apply


def _non_finite(G: Any) -> int:
    """NaN/inf entries of G (NumPy, torch or CuPy): one pass without a boolean temporary when
    there are none (a finite sum can overflow too, so only a non-finite sum is counted entry by
    entry)."""
    xp = torch if isinstance(G, torch.Tensor) else np if isinstance(G, np.ndarray) else get_cupy()
    if bool(xp.isfinite(G.sum())):
        return 0
    return int((~xp.isfinite(G)).sum())


def _check_symmetric(G: Any, rtol: float, backend: str, what: str) -> None:
    """Raise ValueError naming max |G − Gᵀ| if it exceeds ``rtol · max |G|``.

    Tiles: 256 on NumPy; 512 on torch's CPU (the transposed tile stays in cache: at N = 10⁴ float64
    0.18 s against 0.84 s with 4096-tiles); 4096 on a GPU (fewer kernel launches)."""
    asym, scale = _asymmetry(G, tile=256 if backend == "numpy" else 4096 if _on_gpu(G) else 512)
    if asym > rtol * scale:
        raise ValueError(
            f"{what} must be symmetric; max |G - Gᵀ| = {asym:.3g} ({asym / scale:.3g} of max |G|, "
            f"allowed ≤ {rtol:.1e}); symmetrise with (G + G.T) / 2 if this is rounding"
        )


def _asymmetry(G: Any, tile: int) -> tuple[float, float]:
    """(max |G − Gᵀ|, max |G|) over upper tiles: cache-friendly, no (N, N) temporary."""
    N, asym, scale = G.shape[0], 0.0, 0.0
    for i in range(0, N, tile):
        for j in range(i, N, tile):
            A = G[i : i + tile, j : j + tile]
            asym = max(asym, float(abs(A - G[j : j + tile, i : i + tile].T).max()))
            scale = max(scale, float(abs(A).max()))
    return asym, scale


def _operator_map(op: Any, N: int, backend: Backend, numpy_only: bool) -> SymmetricMap:
    feed, out = _probe(op, N, backend, numpy_only)
    if tuple(out.shape) not in ((N, 1), (N,)):
        raise ShapeError(
            f"the operator's matmat returned shape {tuple(out.shape)} for a block of shape "
            f"({N}, 1); it must map (N, b) to (N, b) with N = {N}"
        )
    ops = resolve_backend(backend, out)

    def apply(X: Any) -> Any:
        Y = _apply(op, feed(X))
        if tuple(Y.shape) != tuple(X.shape):
            raise ShapeError(
                f"the operator's matmat returned shape {tuple(Y.shape)} for a block of shape "
                f"{tuple(X.shape)}; it must map (N, b) to (N, b) with N = {N}"
            )
        Y = ops.asarray(Y)
        if not ops.all_finite(Y):
            raise NonFiniteError(
                f"the operator returned NaN/inf for a block of {X.shape[1]} vectors; check the model/data it wraps"
            )
        return Y

    return SymmetricMap(N, ops, apply, eps=_eps_of(out), sym_rtol=sym_rtol(_eps_of(out)), n_matvec=1)


def _probe(op: Any, N: int, backend: Backend, numpy_only: bool) -> tuple[Callable[[Any], Any], Any]:
    """Find the array type ``op`` consumes: returns a converter to it and one product's output.

    Tried in order: torch when ``op.dtype`` is a torch dtype (on ``op.device`` if it has one);
    else the requested backend's type first, then NumPy, torch on the CPU, torch on CUDA.
    """
    dt = getattr(op, "dtype", None)
    if isinstance(dt, torch.dtype):
        candidates = [("torch", dt, getattr(op, "device", None))]
    elif numpy_only:
        candidates = [("numpy", np.float64, None)]
    else:
        candidates = [("numpy", np.float64, None), ("torch", torch.float64, "cpu")]
        if torch.cuda.is_available():
            candidates.append(("torch", torch.float64, "cuda"))
        if backend is Backend.CUPY:
            candidates.insert(0, ("cupy", np.float64, None))
        elif backend is Backend.TORCH:
            candidates.insert(0, candidates.pop(1))
    x = np.full((N, 1), 1.0 / np.sqrt(max(N, 1)))
    first_err: Exception | None = None
    for kind, dtype, device in candidates:
        try:
            out = _apply(op, convert(x, kind, dtype, device))
        except NSAError:
            raise  # already one clear error (e.g. a model's forward failed, the module named), not the array type
        except _PROBE_ERRORS as err:
            first_err = first_err or err
            continue
        if array_kind(out) is None:
            out = np.asarray(out)
        return (lambda X, kind=kind, dtype=dtype, device=device: _contiguous(convert(X, kind, dtype, device))), out
    tried = ", ".join(f"{kind} {dtype}" + (f" on {device}" if device else "") for kind, dtype, device in candidates)
    raise TypeError(
        f"the operator's matmat/matvec failed on every array type tried ({tried}): {first_err!r}"
    ) from first_err


def _contiguous(X: Any) -> Any:
    if isinstance(X, torch.Tensor):
        return X.contiguous()
    return np.ascontiguousarray(X) if isinstance(X, np.ndarray) else X


def _apply(op: Any, X: Any) -> Any:
    """``op.matmat(X)``, or column by column through ``op.matvec``."""
    if hasattr(op, "matmat"):
        Y = op.matmat(X)
    else:
        Y = _stack([op.matvec(X[:, j]).reshape(-1) for j in range(X.shape[1])])
    vec = Y.ndim == 1 and X.shape[1] == 1 and Y.shape[0] == X.shape[0]  # matmat of an (N,)-returning op
    return Y.reshape(X.shape) if vec else Y


def _stack(cols: list[Any]) -> Any:
    """Columns (N,) → (N, b) in their own array library."""
    kind = array_kind(cols[0])
    if kind == "torch":
        return torch.stack(cols, 1)
    if kind == "cupy":
        return get_cupy().stack(cols, axis=1)
    return np.stack([np.asarray(c) for c in cols], 1)


def _eps_of(x: Any) -> float:
    """Machine epsilon of ``x``'s float dtype (float64's for anything else)."""
    dt = x.dtype
    if isinstance(dt, torch.dtype):
        return float(torch.finfo(dt).eps) if dt.is_floating_point else _EPS64
    dt = np.dtype(str(dt))
    return float(np.finfo(dt).eps) if dt.kind == "f" else _EPS64
