"""The exceptions nsa-dist raises on bad input.

Every error names what was wrong (the argument, its shape or value) and what is allowed, so a
researcher can fix the call without reading the source.  They subclass the builtin that a
caller would catch anyway (``ValueError`` / ``TypeError``).
"""

from __future__ import annotations

__all__ = [
    "NSAError",
    "ShapeError",
    "NonFiniteError",
    "UnsupportedModelError",
    "MissingDependencyError",
    "ModelFactoryError",
    "StoreError",
    "ModelForwardError",
    "AnalysisError",
    "ResourceError",
    "OutsideError",
    "ServeError",
]


class NSAError(Exception):
    """Base class of every error raised by nsa-dist."""


class ShapeError(NSAError, ValueError):
    """An array or a model output has the wrong shape."""


class NonFiniteError(NSAError, ValueError):
    """An input or a result holds NaN or inf."""


class UnsupportedModelError(NSAError, TypeError):
    """A method was forced on a model it cannot handle (e.g. ``structured`` on a conv layer)."""


class MissingDependencyError(NSAError, ImportError):
    """An optional dependency (CuPy, nngeometry, ...) is needed but not installed."""


class StoreError(NSAError, ValueError):
    """A spectrum store is missing, corrupt, or does not match the run being written."""


class ServeError(NSAError, ValueError):
    """``nsa serve`` refuses an unsafe or impossible setting (a non-loopback address without
    ``--allow-remote`` and a token, a port in use)."""


class ResourceError(NSAError, ValueError):
    """A run, a sweep or an input would need more memory (or more of anything) than allowed:
    refused from its sizes before anything is allocated."""


class OutsideError(NSAError, OSError):
    """Something outside the process failed (a store's endpoint or disk, a cluster's address):
    the message names what was reached and what answered."""


class ModelFactoryError(NSAError, ImportError):
    """A ``model.factory`` import path cannot be imported or called."""

    def __reduce__(self):  # survive pickling across Ray processes with its message
        return (ModelFactoryError, (str(self),))


class ModelForwardError(NSAError, RuntimeError):
    """The model's forward (or its derivatives) failed inside an NTK / Hessian computation; the
    message names the module that was running and the cause (the torch error is chained)."""

    def __reduce__(self):  # survive pickling across Ray processes with its message
        return (ModelForwardError, (str(self),))


class AnalysisError(NSAError, RuntimeError):
    """The analysis of a recorded step failed; the message names the run, the step and the cause,
    and the original exception is chained as ``__cause__``.

    Attributes:
        step: t, the recorded step whose analysis failed (None when unknown).
    """

    def __init__(self, message: str, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step

    def __reduce__(self):  # survive pickling across Ray processes with its message and step
        return (AnalysisError, (str(self), self.step))
