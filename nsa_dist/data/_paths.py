"""What a data path is, said truly: missing, a directory, or not a regular file (a FIFO, a socket,
a device) — each its own one-line error naming the path and what was expected.

A data path is a local path or an fsspec URL (``s3://bucket/mnist``, ``gs://…``, ``file:///shared/…``;
s3fs / gcsfs are the ``s3`` / ``gcs`` extras, endpoints and keys from the standard environment
variables as for the store).  The same checks apply to both; a URL is kept as its string, never
passed through ``Path`` (which would fold ``s3://`` into ``s3:/``).

Every failure to reach a URL is one line naming it, its endpoint and the cause: no credentials,
refused keys, a missing bucket or object, an endpoint that cannot be reached, an unknown scheme
(:func:`_failure`; the causes are :func:`nsa_dist._faults.outside_cause`'s, as for a store).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from nsa_dist._fsspec import first_line, is_url, url_to_fs
from nsa_dist.errors import OutsideError

__all__ = ["Location", "regular_file", "directory", "join", "exists", "open_binary", "read_bytes", "is_url"]

Location = Path | str  # a local path, or an fsspec URL kept as a string

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _stat(path: Path, who: str, expected: str) -> os.stat_result:
    try:
        return os.stat(path)
    except FileNotFoundError:
        where = "" if Path(path).is_absolute() else f", relative to the current directory {os.getcwd()!r}"
        tilde = "; '~' is not expanded: write the home directory out" if str(path).startswith("~") else ""
        link = f" (a symbolic link to {os.readlink(path)!r}, which does not)" if os.path.islink(path) else ""
        raise FileNotFoundError(
            f"{who}: {str(path)!r} does not exist{link}{where} (expected {expected}){tilde}"
        ) from None
    except PermissionError as exc:  # a folder on the way without search (x) permission: [Errno 13] alone before
        raise PermissionError(
            f"{who}: {str(path)!r} cannot be reached: permission denied ({exc.filename or path}: a folder on "
            "its way without execute/search permission for this user, or the file without read permission)"
        ) from None
    except OSError as exc:  # a symbolic-link loop (ELOOP), a name too long …: the path and the cause
        raise OSError(f"{who}: {str(path)!r} cannot be read: {exc.strerror}") from None


# packages whose exceptions mean "the filesystem behind a URL failed" (matched by name, never imported)
_REMOTE_PACKAGES = {"botocore", "aiobotocore", "boto3", "s3fs", "aiohttp", "gcsfs", "google", "fsspec"}


def _is_outside(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception behind it) is the filesystem's: an OSError or an error of
    the object-store client packages (botocore's NoCredentialsError is not an OSError)."""
    from nsa_dist._faults import exception_chain

    return any(
        isinstance(e, OSError) or type(e).__module__.split(".")[0] in _REMOTE_PACKAGES for e in exception_chain(exc)
    )


def _failure(exc: BaseException, url: str, who: str, expected: str | None = None) -> Exception:
    """The one-line error for a URL whose filesystem failed: FileNotFoundError when nothing is
    there (naming a missing bucket), else :class:`~nsa_dist.errors.OutsideError` naming the URL,
    its endpoint and the cause (credentials, keys, endpoint, or the client's own message)."""
    from nsa_dist._faults import endpoint_of, outside_cause

    cause = outside_cause(exc, url)
    wanted = f" (expected {expected})" if expected else ""
    if isinstance(exc, FileNotFoundError) and (cause is None or "does not exist" in cause):
        return FileNotFoundError(f"{who}: {url!r} does not exist" + (f": {cause}" if cause else "") + wanted)
    if cause is None:
        cause = f"{type(exc).__name__}: {first_line(exc)[:300]}"
    endpoint = endpoint_of(url)
    return OutsideError(f"{who}: cannot read {url!r}" + (f" (endpoint {endpoint})" if endpoint else "") + f": {cause}")


@contextlib.contextmanager
def _asking(url: str, who: str, expected: str | None = None) -> Iterator[None]:
    """Turn a failure of ``url``'s filesystem inside the block into :func:`_failure`'s one line."""
    try:
        yield
    except Exception as exc:
        if not _is_outside(exc):
            raise
        raise _failure(exc, url, who, expected) from exc


def _info(url: str, who: str, expected: str) -> dict[str, Any]:
    """fsspec's ``info`` of ``url``: its ``type`` ("file", "directory", …) and ``size``.

    Raises:
        FileNotFoundError: no object (and no prefix) at ``url``; a missing bucket is named.
        OutsideError: the filesystem could not be asked (no credentials, refused keys, endpoint
            down …); one line naming the URL, the endpoint and the cause.
        ValueError: an unknown scheme; MissingDependencyError: s3fs / gcsfs not installed.
    """
    fs, p = url_to_fs(url, who)
    with _asking(url, who, expected):
        return fs.info(p)


def regular_file(path: Location, who: str, expected: str) -> Location:
    """``path`` if it is a readable regular file (or a link to one); a URL must name an object.

    Raises:
        FileNotFoundError: it does not exist.
        ValueError: it is a directory, or not a regular file (FIFO, socket, device) — read, a FIFO
            would block and a device never ends.
        PermissionError: a local file this process may not read.
    """
    if is_url(path):
        kind = _info(path, who, expected).get("type")
        if kind == "directory":
            raise ValueError(f"{who}: {path!r} is a directory (a prefix), expected {expected}")
        if kind != "file":
            raise ValueError(f"{who}: {path!r} is not a regular file (it is {kind!r}), expected {expected}")
        return path
    p = Path(path)
    mode = _stat(p, who, expected).st_mode
    if stat.S_ISDIR(mode):
        raise ValueError(f"{who}: {str(p)!r} is a directory, expected {expected}")
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "a special file")
        raise ValueError(f"{who}: {str(p)!r} is not a regular file (it is {kind}), expected {expected}")
    if not os.access(p, os.R_OK):
        raise PermissionError(f"{who}: {str(p)!r} is not readable by this user, expected {expected}")
    return p


def directory(path: Location, who: str, expected: str) -> Location:
    """``path`` if it is a directory (for a URL: a prefix holding objects).

    Raises:
        FileNotFoundError: it does not exist.
        ValueError: it is a file (or another non-directory).
    """
    if is_url(path):
        if _info(path, who, expected).get("type") != "directory":
            raise ValueError(f"{who}: {path!r} is not a directory (a prefix), expected {expected}")
        return path
    p = Path(path)
    if not stat.S_ISDIR(_stat(p, who, expected).st_mode):
        raise ValueError(f"{who}: {str(p)!r} is not a directory, expected {expected}")
    return p


def join(base: Location, name: str) -> Location:
    """``base/name``: a ``Path`` for a local base, a URL string for a URL."""
    return f"{base.rstrip('/')}/{name}" if is_url(base) else Path(base) / name


def exists(path: Location) -> bool:
    """Whether anything is at ``path`` (a URL: an object or a prefix)."""
    if is_url(path):
        fs, p = url_to_fs(path, "data")
        with _asking(path, "data"):
            return bool(fs.exists(p))
    return Path(path).exists()


@contextlib.contextmanager
def open_binary(path: Location) -> Iterator[IO[bytes]]:
    """The file opened for binary reading, local or through fsspec (a URL's failures to open or
    read as :func:`_failure`'s one line; the reader's own errors pass unchanged)."""
    if is_url(path):
        fs, p = url_to_fs(path, "data")
        with _asking(path, "data"):
            f = fs.open(p, "rb")
        with f:
            try:
                yield f
            except Exception as exc:
                from nsa_dist._faults import outside_cause

                if outside_cause(exc, path) is None:
                    raise
                raise _failure(exc, path, "data") from exc
    else:
        with open(path, "rb") as f:
            yield f


def file_size(path: Location) -> int:
    """The file's size in bytes (its stored, possibly compressed, size)."""
    if is_url(path):
        fs, p = url_to_fs(path, "data")
        with _asking(path, "data"):
            return int(fs.size(p))
    return Path(path).stat().st_size


def read_bytes(path: Location) -> bytes:
    """The whole file's bytes."""
    with open_binary(path) as f:
        return f.read()
