"""What failed from outside nsa-dist when a URL or path was used: its endpoint, keys, bucket or disk.

An object store's failure reaches nsa-dist as a chain of exceptions from aiohttp, botocore and
s3fs (and a local path's as an ``OSError``).  :func:`outside_cause` walks that chain and names
the cause in one line; anything it does not recognise is left to the caller.  The optional
packages are matched by class name, never imported here.  The bottom layer (beside ``_fsspec``):
stores (:mod:`nsa_dist.store.faults`) and data paths (:mod:`nsa_dist.data`) both use it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

from nsa_dist._fsspec import storage_options

__all__ = ["endpoint_of", "exception_chain", "outside_cause"]

_DISK = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only filesystem",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a parent of the path is not a directory",
}
_CONNECT = (
    "botocore.exceptions.EndpointConnectionError",
    "botocore.exceptions.ConnectTimeoutError",
    "botocore.exceptions.ReadTimeoutError",
    "aiohttp.client_exceptions.ClientConnectorError",
    "aiohttp.client_exceptions.ServerDisconnectedError",
    "aiohttp.client_exceptions.ServerTimeoutError",
)
_DENIED = {
    "InvalidAccessKeyId": "unknown access key (AWS_ACCESS_KEY_ID)",
    "SignatureDoesNotMatch": "wrong secret key (AWS_SECRET_ACCESS_KEY)",
    "AccessDenied": "access denied for these credentials",
    "403": "access denied (HTTP 403)",
    "ExpiredToken": "expired session token",
    "InvalidToken": "invalid session token",
}


def exception_chain(exc: BaseException, limit: int = 64) -> Iterator[BaseException]:
    """``exc`` and every exception behind it: ``__cause__``, ``__context__`` and a Ray task
    error's ``cause``, each once."""
    todo, seen = [exc], set()
    while todo and len(seen) < limit:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend(x for x in (e.__cause__, e.__context__, getattr(e, "cause", None)) if isinstance(x, BaseException))


def endpoint_of(url: str) -> str | None:
    """The endpoint a remote store URL is reached at (None for a local path)."""
    if "://" not in url or url.startswith("file://"):  # a local path
        return None
    protocol = url.split("://", 1)[0]
    default = {
        "s3": "the AWS default endpoint",
        "s3a": "the AWS default endpoint",
        "gs": "storage.googleapis.com",
        "gcs": "storage.googleapis.com",
    }.get(protocol, f"{protocol}://")
    return storage_options(protocol).get("endpoint_url") or default


def outside_cause(exc: BaseException, url: str) -> str | None:
    """The outside cause found in ``exc``'s chain for ``url`` (a store or a data path), or None:
    for a remote URL its endpoint, credentials or bucket, for a local
    path its disk."""
    remote = endpoint_of(url) is not None
    for e in exception_chain(exc):
        cause = _remote_cause(e, url) if remote else _disk_cause(e, url)
        if cause:
            return cause
    return None


def _names(e: BaseException) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__}


def _remote_cause(e: BaseException, url: str) -> str | None:
    names = _names(e)
    if names & set(_CONNECT):
        return f"cannot reach the endpoint ({_root_reason(e)})"
    if "botocore.exceptions.NoCredentialsError" in names:
        return "no credentials found (set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile)"
    response = getattr(e, "response", None)
    if "botocore.exceptions.ClientError" in names and isinstance(response, dict):
        err = response.get("Error") or {}
        code, op = str(err.get("Code", "")), getattr(e, "operation_name", "a request")
        bucket = url.split("://", 1)[1].split("/", 1)[0]
        if code in _DENIED:
            return f"{_DENIED[code]} on {op}: check the keys and their permissions on bucket {bucket!r}"
        if code == "NoSuchBucket":
            return f"bucket {bucket!r} does not exist"
        if not code or code.isdigit():  # an HTTP status without an S3 error document
            meta = response.get("ResponseMetadata") or {}
            status = meta.get("HTTPStatusCode", code or "?")
            server = (meta.get("HTTPHeaders") or {}).get("server")
            return (
                f"the endpoint answered {op} with HTTP {status}"
                + (f" from {server!r}" if server else "")
                + " and no S3 error code: it is not an S3 API endpoint"
                + (f" (or bucket {bucket!r} is missing)" if str(status) == "404" else "")
            )
    return None


def _root_reason(e: BaseException) -> str:
    """The innermost OS-level reason of a connection failure (e.g. 'Connection refused')."""
    for x in exception_chain(e):
        if isinstance(x, OSError) and x.errno is not None:
            return os.strerror(x.errno) if x.errno > 0 else str(x)
        if isinstance(x, TimeoutError):
            return "timed out"
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _disk_cause(e: BaseException, url: str) -> str | None:
    if not isinstance(e, OSError) or e.errno not in _DISK:
        return None
    root = Path(url.removeprefix("file://")).absolute()
    name = getattr(e, "filename", None)
    if name is not None:
        p = Path(os.fsdecode(name)).absolute()
        if p != root and root not in p.parents and p not in root.parents:
            return None  # another file's fault (a data file, a spec): not the store's
    return f"{_DISK[e.errno]}" + (f" at {os.fsdecode(name)}" if name is not None else "") + f" ({e.strerror})"
