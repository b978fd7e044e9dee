"""Optional dependencies: the check that names the extra to install (private)."""

from __future__ import annotations

import importlib.util

from nsa_dist.errors import MissingDependencyError

__all__ = ["require"]


def require(module: str, extra: str, what: str) -> None:
    """MissingDependencyError naming ``pip install 'nsa-dist[extra]'`` unless ``module`` imports.

    Args:
        module: the top-level module needed (``"bokeh"``).
        extra: the nsa-dist extra that installs it (``"serve"``).
        what: who needs it, for the message (``"nsa serve"``).
    """
    if importlib.util.find_spec(module) is None:
        raise MissingDependencyError(
            f"{what} needs the {module} package, which is not installed: pip install 'nsa-dist[{extra}]'"
        )
