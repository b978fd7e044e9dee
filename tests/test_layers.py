"""What each package may import (its ``__init__`` docstring says the same), and no
package imports another's private module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import nsa_dist

ROOT = Path(nsa_dist.__file__).parent

# package → the other parts of nsa_dist it may import (top-level names under nsa_dist)
ALLOWED = {
    "ntk": {"config", "errors", "_checks", "models", "linalg"},
    "linalg": {"config", "errors", "_checks"},
    "metrics": {"errors", "_checks"},
    "hessian": {"config", "errors", "_checks", "models", "linalg", "ntk", "losses"},
    "plots": {"client", "config"},
    "data": {"config", "errors", "_fsspec", "_faults"},
    "serve": {"store", "client", "plots", "errors", "_extras"},
    "store": {"errors", "_fsspec", "_faults", "metrics"},
    "pipeline": {"config", "errors", "losses", "models", "data", "ntk", "linalg", "metrics", "hessian", "store"},
    "cluster": {"config", "errors", "data", "pipeline", "store", "_fsspec", "specfile"},
    "client": {"config", "errors", "losses", "metrics", "hessian", "store"},
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every nsa_dist module imported by ``path`` (``from a import b`` gives a.b too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(line, name) for line, name in out if name.split(".")[0] == "nsa_dist"]


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_its_docstring_allows(package: str) -> None:
    bad = []
    for path in _modules(package):
        for line, name in _imports(path):
            parts = name.split(".")
            top = parts[1] if len(parts) > 1 else ""
            if (
                top
                and top != package
                and top not in ALLOWED[package]
                and (ROOT / top).exists() | (ROOT / f"{top}.py").exists()
            ):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
    assert not bad, f"nsa_dist.{package} may import only {sorted(ALLOWED[package])}:\n" + "\n".join(bad)


def test_no_private_module_of_another_package_is_imported() -> None:
    """``nsa_dist.X._y`` is X's own: other packages use X's front door or its public modules."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        own = path.relative_to(ROOT).parts[0]
        for line, name in _imports(path):
            parts = name.split(".")
            if len(parts) > 2 and parts[1] != own and parts[2].startswith("_") and (ROOT / parts[1]).is_dir():
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
    assert not bad, "\n".join(bad)
