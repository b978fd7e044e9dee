"""Readers for the on-disk formats of the standard image sets: IDX (MNIST) and pickled batches (CIFAR).

Each reader checks the file against its format and raises ``ValueError`` naming the path and the
expected layout when it does not match, so a wrong or truncated download fails loudly.
"""

from __future__ import annotations

import contextlib
import gzip
import math
import pickle
import struct
import zlib
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from nsa_dist.data._paths import Location, exists, file_size, join, open_binary, regular_file

__all__ = ["find_file", "read_idx", "read_pickle_batch"]

# What a CIFAR python batch may name: NumPy's array reconstruction (ndarray, dtype; numpy 1 and 2
# spell the module differently) and the bytes encoder of pickles written by Python 3 at protocol 2.
# Dicts, lists, bytes, str and ints need no name.  Anything else (os.system, builtins.eval, …)
# could run code while unpickling, and is refused before it is looked up.
_CIFAR_GLOBALS = frozenset(
    {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
        # what NumPy and Python write for the same values otherwise: protocol 5 arrays (Python 3.14's
        # default), NumPy integer scalars (``list(labels_array)``), protocol 2's empty bytes
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("__builtin__", "bytes"),
        ("builtins", "bytes"),
    }
)


def _bytes(*args: Any) -> bytes:
    """``bytes`` as a pickle may call it (``bytes()``, ``bytes(b"…")``, ``bytes("…", "latin1")``) — never
    ``bytes(n)`` (an int or a NumPy integer: n zero bytes a crafted file could set to any size, a review)."""
    if args and not isinstance(args[0], (bytes, bytearray, str)):
        raise pickle.UnpicklingError(
            f"refused bytes({type(args[0]).__name__}) — a CIFAR batch makes bytes only from bytes or text"
        )
    return bytes(*args)


def _scalar(dtype: Any, *data: Any) -> Any:
    """``numpy…multiarray.scalar`` for a number only: a void dtype of any size (``V1000000000``) made
    NumPy allocate and zero it from a 142-byte file (a review)."""
    if not isinstance(dtype, np.dtype) or dtype.kind not in "biufc" or dtype.itemsize > 16:
        raise pickle.UnpicklingError(f"refused a NumPy scalar of dtype {dtype!r} — a CIFAR batch holds numbers")
    if data and not isinstance(data[0], bytes):
        raise pickle.UnpicklingError("refused a NumPy scalar built from something other than its bytes")
    try:
        from numpy._core.multiarray import scalar
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import scalar

    return scalar(dtype, *data)


IDX_IMAGES = 2051  # 0x00000803: unsigned bytes, 3 dims (N, rows, cols)
IDX_LABELS = 2049  # 0x00000801: unsigned bytes, 1 dim (N,)


def find_file(directory: Location, name: str) -> Location | None:
    """``directory/name`` or ``directory/name.gz``, whichever exists; None if neither.
    ``directory`` may be an fsspec URL (a prefix).

    When both exist (``gunzip -k`` keeps the .gz) the plain file is read, and only if the .gz
    inflates to the same bytes: two different datasets under one name (an MNIST and a
    Fashion-MNIST download in one folder, a re-downloaded .gz) are refused, not one of them
    silently trained on.  That comparison reads both files, so it costs a read of each.

    Raises:
        ValueError: the one that exists is a directory or not a regular file; or both exist and
            hold different data (naming both and the first byte where they differ).
    """
    expected = f"the file {name} (optionally gzipped as {name}.gz)"
    plain, gz = join(directory, name), join(directory, f"{name}.gz")
    found = [regular_file(p, "data", expected) for p in (plain, gz) if exists(p)]
    if len(found) == 2:
        _check_same(*found)
    return found[0] if found else None


def _fill(f: BinaryIO, size: int) -> bytes:
    """Up to ``size`` bytes of ``f``, fewer only at the end of the stream."""
    parts, got = [], 0
    while got < size:
        part = f.read(size - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _check_same(plain: Location, gz: Location) -> None:
    """Refuse ``plain`` and ``gz`` unless the gzip stream inflates to exactly ``plain``'s bytes.

    Raises:
        ValueError: they differ (the first differing byte, or which one is longer), or the .gz
            is not a readable gzip file.
    """
    chunk, at = 1 << 20, 0
    try:
        with _open(plain) as a, _open(gz) as b:
            while True:
                x, y = _fill(a, chunk), _fill(b, chunk)
                if x != y:
                    n = min(len(x), len(y))
                    k = next((i for i in range(n) if x[i] != y[i]), n)
                    where = (
                        f"they differ at byte {at + k:,}"
                        if k < n
                        else f"{str(plain if len(x) < len(y) else gz)!r} ends at byte {at + n:,}, the other goes on"
                    )
                    raise ValueError(
                        f"data: both {str(plain)!r} and {str(gz)!r} exist and hold different data "
                        f"({where}, the .gz read decompressed): two datasets under one name — remove "
                        "the one you do not mean (neither was used)"
                    )
                if not x:
                    return
                at += len(x)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:  # a cut-off or damaged .gz
        raise ValueError(
            f"data: both {str(plain)!r} and {str(gz)!r} exist and the .gz is not a readable gzip file "
            f"({exc}); remove the one you do not mean"
        ) from exc


_DEFLATE_MAX_RATIO = 1032  # deflate cannot inflate one byte to more than ~1032 (RFC 1951's longest match / 2 bits)
_READ_CHUNK = 1 << 24


def _gz(path: Location) -> bool:
    return str(path).endswith(".gz")


@contextlib.contextmanager
def _open(path: Location) -> Iterator[BinaryIO]:
    """The file (local or an fsspec URL) as a binary stream, gunzipped on the fly when the name ends in ``.gz``."""
    with open_binary(path) as raw:
        if _gz(path):
            with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                yield f
        else:
            yield raw


def _read_exact(f: BinaryIO, path: Location, size: int, expected: str) -> np.ndarray:
    """Exactly ``size`` bytes of ``f`` into a uint8 array of that size, read in chunks; then the
    stream must end — nothing more is read than one byte past what the header announced."""
    out = np.empty(size, dtype=np.uint8)  # (size,)
    view, got = memoryview(out), 0
    while got < size:
        n = f.readinto(view[got : got + _READ_CHUNK])
        if not n:
            raise ValueError(
                f"{str(path)!r}: the header announces {size:,} data bytes, the file holds {got:,} "
                f"(truncated or not {expected})"
            )
        got += n
    if f.read(1):
        raise ValueError(
            f"{str(path)!r}: holds more than the {size:,} data bytes its header announces "
            f"(not {expected}); refused without reading the rest"
        )
    return out


def read_idx(path: Location, magic: int) -> np.ndarray:
    """An IDX file of unsigned bytes as a uint8 array of its header's shape.

    Layout (LeCun's MNIST page): a big-endian uint32 magic number (2051 for images, 2049 for
    labels; its low byte is the number of dims), one big-endian uint32 per dim, then
    ∏ dims bytes in C order.  The header is read first and the data checked against it while
    streaming: a file (or a gzip stream) holding more or less than ∏ dims bytes is refused
    without being read whole, and a gzip file too small to inflate to ∏ dims bytes before any.

    Args:
        path: the file (a local path or an fsspec URL), optionally gzipped (name ending in ``.gz``).
        magic: the expected magic number, ``IDX_IMAGES`` or ``IDX_LABELS``.

    Returns:
        uint8 array, (N, rows, cols) for images, (N,) for labels.

    Raises:
        ValueError: wrong magic number, or the byte count does not match the header.
    """
    expected = f"an IDX file with magic number {magic} (0x{magic:08x}) and big-endian uint32 dims"
    ndim = magic & 0xFF
    try:
        with _open(path) as f:
            raw = f.read(4)
            if len(raw) < 4 or struct.unpack(">I", raw)[0] != magic:
                raise ValueError(f"{str(path)!r}: expected {expected}, {_what_magic(raw, magic)}")
            raw = f.read(4 * ndim)
            if len(raw) < 4 * ndim:
                raise ValueError(f"{str(path)!r}: truncated header, expected {expected}")
            dims = struct.unpack(f">{ndim}I", raw)
            size = math.prod(dims)
            _check_claim(path, 4 + 4 * ndim, dims, size, expected)
            data = _read_exact(f, path, size, expected)
    except (OSError, EOFError, zlib.error) as exc:  # BadGzipFile is an OSError; a cut-off stream is EOFError
        if _gz(path) and isinstance(exc, gzip.BadGzipFile) and "Not a gzipped file" in str(exc) and _starts_gzip(path):
            # the data were read whole: gzip reads on for a second member and finds other bytes (audit D: its
            # own words alone, "Not a gzipped file (b'ga')", for a file that is one)
            raise ValueError(
                f"{str(path)!r} holds other bytes after its gzip stream ({exc}): something was appended to "
                "the file, or two files were joined — download it again"
            ) from exc
        raise ValueError(f"{str(path)!r} is not a readable {'gzip ' if _gz(path) else ''}file ({exc})") from exc
    return data.reshape(dims)


def _starts_gzip(path) -> bool:  # noqa: ANN001
    """Whether the file at ``path`` begins with gzip's magic bytes."""
    try:
        with open_binary(path) as f:
            return f.read(2) == b"\x1f\x8b"
    except OSError:
        return False


def _what_magic(raw: bytes, magic: int) -> str:
    """What the first bytes of a file that is not the IDX file expected are, said plainly."""
    if not raw:
        return "got an empty file (0 bytes)"
    if len(raw) < 4:
        return f"got a file of {len(raw)} byte(s)"
    got = struct.unpack(">I", raw)[0]
    if raw[:2] == b"\x1f\x8b":
        return f"got the gzip magic bytes 1f 8b (0x{got:08x}): a gzipped file named without .gz — gunzip it or add .gz"
    other = {IDX_IMAGES: "an IDX image file (2051)", IDX_LABELS: "an IDX label file (2049)"}.get(got)
    if other and got != magic:
        return f"got {other}: images and labels swapped?"
    return f"got magic {got} (0x{got:08x})"


def _check_claim(path: Location, head: int, dims: tuple[int, ...], size: int, expected: str) -> None:
    """Refuse a header whose ∏ dims the file cannot hold, before reading any data: a plain file
    must hold exactly that many bytes after the header, a gzip file at most 1032× its size."""
    on_disk = file_size(path)
    if not _gz(path):
        if on_disk - head != size:
            raise ValueError(
                f"{str(path)!r}: header dims {dims} need {size:,} data bytes, the file holds "
                f"{on_disk - head:,} (truncated or not {expected})"
            )
    elif size > _DEFLATE_MAX_RATIO * on_disk:
        raise ValueError(
            f"{str(path)!r}: header dims {dims} need {size:,} data bytes, more than a "
            f"{on_disk:,}-byte gzip file can inflate to (truncated or not {expected})"
        )


class _BatchUnpickler(pickle.Unpickler):
    """An unpickler that admits only the names a CIFAR python batch contains (``_CIFAR_GLOBALS``)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _CIFAR_GLOBALS:
            raise pickle.UnpicklingError(
                f"refused {module}.{name} — a CIFAR batch holds only dicts, lists, strings, "
                "numbers and NumPy arrays, and a pickle naming anything else can run code "
                "(nothing of it was run)"
            )
        return {"bytes": _bytes, "scalar": _scalar}.get(name) or super().find_class(module, name)


def read_pickle_batch(path: Location, keys: tuple[str, ...]) -> dict[str, Any]:
    """A CIFAR python batch: a pickled dict, keys decoded from bytes (the files are Python-2 pickles).

    Unpickled with an unpickler that admits only what the format contains (dicts, lists, bytes /
    str, numbers, NumPy arrays): a crafted file that names any other callable is refused before
    anything of it runs.

    Args:
        path: the batch file (e.g. ``data_batch_1``, ``test``), a local path or an fsspec URL.
        keys: keys that must be present, e.g. ``("data", "labels")``.

    Returns:
        dict with str keys.

    Raises:
        ValueError: the file is not a pickle, names a callable the format does not contain, is not
            a dict, or lacks one of ``keys``.
    """
    expected = f"a pickled dict with keys {list(keys)} (the CIFAR 'python version' batch format)"
    # unpickled as it streams in: a file that is no pickle is refused at its first bytes, not
    # after all of it was read (a 600 MiB one was, to 868 MiB of memory); opening and reading
    # errors are the filesystem's, not the format's
    with open_binary(path) as f:
        try:
            obj = _BatchUnpickler(f, encoding="bytes").load()
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unpickling failure means "not this format"
            raise ValueError(f"{str(path)!r} is not {expected} ({type(exc).__name__}: {exc})") from exc
        if f.read(1):  # read as one batch, the rest ignored: two pickled batches in one file gave the first
            raise ValueError(
                f"{str(path)!r}: bytes follow its pickle — not one CIFAR batch (two pickles in one file, or a "
                "file appended to): restore the batch from the dataset's archive"
            )
    if not isinstance(obj, dict):
        raise ValueError(f"{str(path)!r}: expected {expected}, got a pickled {type(obj).__name__}")
    batch = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"{str(path)!r}: expected {expected}; missing {missing}, found {sorted(map(str, batch))}")
    return batch
