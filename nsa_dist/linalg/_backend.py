"""Array modules the eigensolvers run on: NumPy (CPU), torch or CuPy (GPU) (private).

The solvers are written once against :class:`ArrayOps`, a dozen operations that NumPy and CuPy
spell identically (``xp.linalg.qr``, ``xp.zeros``, ...) and torch spells slightly differently.
Small projected matrices (the Lanczos ``H``, at most a few hundred square) always live on the
host; only the tall (N, m) blocks live on the backend's device.
"""

from __future__ import annotations

from enum import Enum
from types import ModuleType
from typing import Any

import numpy as np
import torch

from nsa_dist.errors import MissingDependencyError

__all__ = [
    "Backend",
    "ArrayOps",
    "TorchOps",
    "get_cupy",
    "array_kind",
    "convert",
    "host_empty",
    "HostWorkspace",
    "resolve_backend",
]

_CUPY_HINT = "pip install 'nsa-dist[gpu]' (cupy-cuda12x)"
_NUMPY_SAFE = (torch.float64, torch.float32, torch.float16)  # torch dtypes NumPy can view


def get_cupy() -> ModuleType:
    """Import CuPy, or raise :class:`MissingDependencyError` saying how to install it."""
    try:
        import cupy
    except ImportError as err:
        raise MissingDependencyError(f"backend='cupy' needs CuPy, which is not installed; {_CUPY_HINT}") from err
    return cupy


class Backend(str, Enum):
    """Where the eigensolver runs.

    AUTO: where the input lives — NumPy for NumPy arrays, CPU tensors and SciPy operators;
        torch on the GPU for CUDA tensors (and operators returning them); CuPy for CuPy arrays.
    NUMPY: NumPy/SciPy/LAPACK on the host; GPU inputs are copied over.
    TORCH: torch on the input's device (CUDA for GPU inputs; CPU otherwise, mainly for testing the
        GPU code path on a CPU machine).
    CUPY: CuPy on the current GPU; torch CUDA tensors are shared zero-copy through DLPack.
    """

    AUTO = "auto"
    NUMPY = "numpy"
    TORCH = "torch"
    CUPY = "cupy"


def array_kind(x: Any) -> str | None:
    """ "numpy" | "torch" | "cupy" for an array of that library, else None (no CuPy import)."""
    if isinstance(x, torch.Tensor):
        return "torch"
    if isinstance(x, np.ndarray):
        return "numpy"
    if type(x).__module__.split(".")[0] == "cupy":
        return "cupy"
    return None


def _on_gpu(x: Any) -> bool:
    kind = array_kind(x)
    return kind == "cupy" or (kind == "torch" and x.device.type != "cpu")


def convert(x: Any, kind: str, dtype: Any = None, device: Any = None) -> Any:
    """``x`` (NumPy, torch or CuPy) as a ``kind`` array of ``dtype`` (torch: on ``device``).

    Shares memory where the libraries allow it (torch CPU ↔ NumPy, CUDA ↔ CuPy via DLPack).
    """
    src = array_kind(x)
    if kind == "numpy":
        if src == "torch":
            x = x.detach().cpu()
            x = (x if x.dtype in _NUMPY_SAFE else x.double()).numpy()
        elif src == "cupy":
            x = x.get()
        return np.asarray(x, dtype=dtype)
    if kind == "torch":
        if src == "cupy":
            x = torch.from_dlpack(x)
        elif src != "torch":
            a = np.asarray(x)
            if not a.flags.writeable or min(a.strides, default=0) < 0:
                a = a.copy()  # torch.from_numpy needs a writeable array with positive strides
            x = torch.from_numpy(a)
        return x.detach().to(device=device if device is not None else x.device, dtype=dtype)
    cp = get_cupy()
    if src == "torch":
        x = x.detach()
        x = cp.from_dlpack(x) if x.device.type == "cuda" else x.numpy()
    return cp.asarray(x, dtype=dtype)


def host_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float64, column_major: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory NumPy allocates.

    NumPy asks Linux for transparent huge pages on blocks of ≥ 4 MiB (``madvise``); torch's CPU
    allocator does not, and a GEMM streaming a large matrix then spends its time in TLB misses:
    at N = 10⁴ on two cores an (N, N) @ (N, 32) product ran 66 ms against 87 ms in float64 and
    40 against 51 ms in float32, and a Lanczos re-orthogonalisation against a (10⁴, 1024) basis
    30 against 37 ms.  ``column_major``: Fortran order (column blocks contiguous).
    """
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    return torch.from_numpy(np.empty(shape, dtype=np_dtype, order="F" if column_major else "C"))


def _strides(shape: tuple[int, ...], column_major: bool) -> tuple[int, ...]:
    """Element strides of a dense array of ``shape`` in C or Fortran order (as :func:`host_empty` makes)."""
    dims = shape[::-1] if not column_major else shape
    out, step = [], 1
    for n in dims:
        out.append(step)
        step *= max(n, 1)
    return tuple(out[::-1]) if not column_major else tuple(out)


class HostWorkspace:
    """Big CPU buffers that a caller keeps between solves of the same size (build once, hand on).

    A top-500 at N = 10⁴ writes ~0.6 GB of fresh blocks (Lanczos's basis and its products, the
    deflated float32 rest), and the first touch of fresh pages cost 0.02–0.24 s per 120 MB here:
    reusing them took a top-500 from 3.6–4.4 s to 3.2–3.3 s.  A
    :class:`~nsa_dist.pipeline.SpectralAnalyzer` holds one for its life, so its steps, and the
    training and test Grams of a step, solve in the same memory.  One solve at a time: a buffer is
    the solver's until it returns (the results it returns are never views of one); not for
    concurrent solves.  It keeps what it holds (~1.4 GB for a step at N = 10⁴: two float32 Grams,
    the rest, Lanczos's two blocks) until :meth:`clear` or its owner goes.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def empty(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float64, column_major: bool = False
    ) -> torch.Tensor:
        """The buffer ``name`` (uninitialised contents), reallocated by :func:`host_empty` when its
        shape, dtype or order differ from what is asked."""
        buf = self._buffers.get(name)
        if (
            buf is None
            or tuple(buf.shape) != tuple(shape)
            or buf.dtype != dtype
            or buf.stride() != _strides(tuple(shape), column_major)
        ):
            self._buffers.pop(name, None)  # freed before the new one is allocated
            buf = self._buffers[name] = host_empty(shape, dtype, column_major)
        return buf

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        """Release every buffer."""
        self._buffers.clear()


class ArrayOps:
    """The array operations the solvers need, for NumPy or CuPy (``xp``); float64 throughout."""

    def __init__(self, xp: ModuleType) -> None:
        self.xp = xp
        self.name = "numpy" if xp is np else "cupy"

    def asarray(self, x: Any) -> Any:
        """Any NumPy/torch/CuPy array → this backend's float64 array (no copy when possible)."""
        return convert(x, self.name, self.xp.float64)

    def from_numpy(self, a: np.ndarray) -> Any:
        return self.xp.asarray(a, dtype=self.xp.float64)

    def to_numpy(self, x: Any) -> np.ndarray:
        return x if self.xp is np else self.xp.asnumpy(x)

    def zeros(self, shape: tuple[int, ...]) -> Any:
        """Zeros; column-major so that column blocks ``V[:, a:b]`` are contiguous."""
        return self.xp.zeros(shape, dtype=self.xp.float64, order="F")

    def empty(self, shape: tuple[int, ...]) -> Any:
        """Uninitialised, column-major: for blocks written before they are read (no zeroing pass)."""
        return self.xp.empty(shape, dtype=self.xp.float64, order="F")

    def eye(self, n: int, cols: slice) -> Any:
        """Columns ``cols`` of the (n, n) identity."""
        E = self.zeros((n, cols.stop - cols.start))
        E[cols.start + self.xp.arange(E.shape[1]), self.xp.arange(E.shape[1])] = 1.0
        return E

    def qr(self, A: Any) -> Any:
        return self.xp.linalg.qr(A)[0]

    def qr_r(self, A: Any) -> tuple[Any, Any]:
        """Thin QR, both factors."""
        return self.xp.linalg.qr(A)

    def svd(self, A: Any) -> tuple[Any, Any]:
        """Thin SVD's left factor and singular values (descending)."""
        U, S, _ = self.xp.linalg.svd(A, full_matrices=False)
        return U, S

    def eigh(self, A: Any) -> tuple[Any, Any]:
        return self.xp.linalg.eigh(A)

    def colnorms(self, A: Any) -> Any:
        return self.xp.linalg.norm(A, axis=0)

    def hstack(self, A: Any, B: Any) -> Any:
        return self.xp.concatenate([A, B], axis=1)

    def all_finite(self, A: Any) -> bool:
        return bool(self.xp.isfinite(A).all())


class TorchOps(ArrayOps):
    """:class:`ArrayOps` for torch tensors on ``device`` (CUDA, or CPU for tests)."""

    def __init__(self, device: torch.device | str) -> None:
        self.xp = torch
        self.name = "torch"
        self.device = torch.device(device)

    def asarray(self, x: Any) -> torch.Tensor:
        return convert(x, "torch", torch.float64, self.device)

    def from_numpy(self, a: np.ndarray) -> torch.Tensor:
        return convert(a, "torch", torch.float64, self.device)

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        return x.detach().cpu().numpy()

    def zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Zeros, column-major; on the CPU in NumPy's memory (huge pages, :func:`host_empty`)."""
        if self.device.type == "cpu":
            return host_empty(shape, column_major=len(shape) == 2).zero_()
        return torch.zeros(shape[::-1], dtype=torch.float64, device=self.device).T

    def empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":
            return host_empty(shape, column_major=len(shape) == 2)
        return torch.empty(shape[::-1], dtype=torch.float64, device=self.device).T

    def eye(self, n: int, cols: slice) -> torch.Tensor:
        E = self.zeros((n, cols.stop - cols.start))
        j = torch.arange(E.shape[1], device=self.device)
        E[cols.start + j, j] = 1.0
        return E

    def qr(self, A: torch.Tensor) -> torch.Tensor:
        return torch.linalg.qr(A)[0]

    def qr_r(self, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.linalg.qr(A)

    def svd(self, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        U, S, _ = torch.linalg.svd(A, full_matrices=False)
        return U, S

    def eigh(self, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.linalg.eigh(A)

    def colnorms(self, A: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(A, dim=0)

    def hstack(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return torch.cat([A, B], 1)

    def all_finite(self, A: torch.Tensor) -> bool:
        """One pass without a boolean temporary: a NaN/inf entry makes the sum non-finite (a
        finite sum can overflow too, so only a non-finite sum is checked entry by entry)."""
        return bool(torch.isfinite(A.sum())) or bool(torch.isfinite(A).all())


def resolve_backend(backend: Backend, sample: Any) -> ArrayOps:
    """The :class:`ArrayOps` for ``backend``; AUTO follows where ``sample`` (an array) lives.

    Raises:
        MissingDependencyError: CuPy requested (or a CuPy input) without CuPy installed.
    """
    kind = array_kind(sample)
    if backend is Backend.AUTO:
        if not _on_gpu(sample):
            return ArrayOps(np)
        backend = Backend.CUPY if kind == "cupy" else Backend.TORCH
    if backend is Backend.NUMPY:
        return ArrayOps(np)
    if backend is Backend.CUPY:
        return ArrayOps(get_cupy())
    if kind == "torch":
        return TorchOps(sample.device)
    if kind == "cupy":
        return TorchOps(torch.device("cuda", sample.device.id))
    return TorchOps("cpu")
