"""One line for a store that failed from outside: its endpoint, its keys, its bucket, its disk.

:func:`describe_fault` names the store URL, the endpoint and the cause found by
:func:`nsa_dist._faults.outside_cause` (shared with the data paths); anything it does not
recognise is left to the caller.
"""

from __future__ import annotations

from nsa_dist._faults import endpoint_of, exception_chain, outside_cause

__all__ = ["describe_fault", "endpoint_of", "exception_chain", "outside_cause"]


def describe_fault(exc: BaseException, url: str) -> str | None:
    """One line naming the store, its endpoint and the outside cause found in ``exc``'s chain, or None.

    Recognised: an endpoint that cannot be reached (refused, unknown host, timed out), refused
    credentials, a missing bucket, an endpoint that answers but not as an object store (an HTTP
    status without an S3 error code), and a local disk that is full, read-only, not writable or
    under a file.
    """
    cause = outside_cause(exc, url)
    if cause is None:
        return None
    endpoint = endpoint_of(url)
    return f"store {url}" + (f" (endpoint {endpoint})" if endpoint else "") + f": {cause}"
