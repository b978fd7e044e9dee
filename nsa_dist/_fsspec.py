"""fsspec URLs shared by the store and the data loaders: which extra a protocol needs, and the
options its filesystem takes from the standard environment variables."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from nsa_dist.errors import MissingDependencyError

__all__ = ["EXTRAS", "S3_CLIENT", "first_line", "is_url", "require_extra", "storage_options", "url_to_fs"]

# fsspec protocols that need a package outside the core dependencies: (module, extra)
EXTRAS = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}

# botocore client settings for s3:// (s3fs ``config_kwargs``).  botocore's default (legacy mode,
# 5 attempts, exponential backoff) times s3fs's own 5 tries of a refused connection made a dead
# endpoint cost seconds per request and a run's error path (interrupt, lease release) minutes;
# standard mode retries throttling, 5xx and connection errors once, after at most 1 s.
S3_CLIENT: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 15,
    "retries": {"mode": "standard", "total_max_attempts": 2},
}


def is_url(path: Any) -> bool:
    """Whether ``path`` is an fsspec URL (``s3://``, ``gs://``, ``file://``, …) rather than a local path."""
    return isinstance(path, str) and "://" in path


def storage_options(protocol: str) -> dict[str, Any]:
    """fsspec options from the standard environment variables.

    s3: ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (e.g. MinIO, moto, Ceph); the keys come
    from the usual ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / profiles (botocore).  The
    client's connect timeout and retries are bounded (:data:`S3_CLIENT`): an endpoint that is down
    is one error line within seconds, not after minutes of retries; ``AWS_MAX_ATTEMPTS`` /
    ``AWS_RETRY_MODE`` (or ``max_attempts`` / ``retry_mode`` in the AWS profile) keep botocore's
    own retry settings instead.  gs:
    ``STORAGE_EMULATOR_HOST``; credentials from ``GOOGLE_APPLICATION_CREDENTIALS`` (gcsfs).
    Directory listings are never cached: other processes add runs and steps.
    """
    opts: dict[str, Any] = {}
    if protocol in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            opts["endpoint_url"] = endpoint
        opts["use_listings_cache"] = False
        opts["config_kwargs"] = _s3_client_config()
    elif protocol in ("gs", "gcs"):
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            opts["endpoint_url"] = os.environ["STORAGE_EMULATOR_HOST"]
        opts["use_listings_cache"] = False
    return opts


def _s3_client_config() -> dict[str, Any]:
    """botocore ``Config`` arguments for the store's S3 client: :data:`S3_CLIENT`, without the
    retry setting where the user has chosen one (environment or AWS profile)."""
    if os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE"):
        return {k: v for k, v in S3_CLIENT.items() if k != "retries"}
    try:
        import botocore.session

        profile = botocore.session.Session().get_scoped_config()
    except Exception:  # no botocore, or a profile that does not exist: botocore reports it when it connects
        profile = {}
    if "max_attempts" in profile or "retry_mode" in profile:
        return {k: v for k, v in S3_CLIENT.items() if k != "retries"}
    return dict(S3_CLIENT)


def require_extra(url: str, what: str) -> str:
    """The URL's protocol, after checking that its filesystem package is installed.

    Raises:
        MissingDependencyError: s3fs / gcsfs is missing; the message names the extra to install.
    """
    protocol = url.split("://", 1)[0]
    module, extra = EXTRAS.get(protocol, (None, None))
    if module and importlib.util.find_spec(module) is None:
        raise MissingDependencyError(f"{what} {url!r} needs the {module} package: pip install 'nsa-dist[{extra}]'")
    return protocol


def url_to_fs(url: str, what: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` (options from the environment) and the path inside it.

    Args:
        url: an fsspec URL, e.g. ``s3://bucket/mnist``.
        what: what the URL is, for messages (``"data.path"``).

    Raises:
        MissingDependencyError: the protocol's package (s3fs, gcsfs) is not installed.
        ValueError: fsspec does not know the protocol (or its package is missing); one line
            naming the URL.
    """
    import fsspec

    protocol = require_extra(url, what)
    try:
        return fsspec.core.url_to_fs(url, **storage_options(protocol))
    except ValueError as exc:
        raise ValueError(f"{what}: {url!r}: unknown scheme {protocol}:// (fsspec: {first_line(exc)})") from exc
    except ImportError as exc:
        raise ValueError(f"{what}: {url!r}: no filesystem for {protocol}:// ({first_line(exc)})") from exc


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (fsspec's ImportError adds install advice below)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
