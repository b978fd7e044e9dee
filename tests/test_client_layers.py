"""The client package is layered: each module imports only the ones below it, reads other objects
through their public names only, and nothing outside the package imports its private modules."""

from __future__ import annotations

import ast
from pathlib import Path

import nsa_dist
import nsa_dist.client

ROOT = Path(nsa_dist.__file__).parent
CLIENT = ROOT / "client"
# bottom to top; modules on one row do not import each other
LAYERS = [
    ("_arrays",),
    ("_frames", "_curves"),
    ("_hessian", "_kernel", "_images"),
    ("_run",),
    ("_sweep",),
    ("_client",),
]


def _imported(path: Path) -> set[str]:
    """Every nsa_dist module named by an import anywhere in ``path`` (functions and TYPE_CHECKING too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("nsa_dist")}


def test_each_client_module_imports_only_the_layers_below_it() -> None:
    level = {m: i for i, row in enumerate(LAYERS) for m in row}
    assert set(level) == {p.stem for p in CLIENT.glob("_*.py") if p.stem != "__init__"}, "a module missing from LAYERS"
    for name, i in level.items():
        for mod in _imported(CLIENT / f"{name}.py"):
            assert mod != "nsa_dist.client", f"{name} imports the package front door (a circle)"
            if mod.startswith("nsa_dist.client."):
                dep = mod.removeprefix("nsa_dist.client.")
                assert level[dep] < i, f"{name} (layer {i}) imports {dep} (layer {level[dep]}): not below it"


def test_no_client_module_reads_another_objects_private_attributes() -> None:
    for path in CLIENT.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                assert isinstance(owner, ast.Name) and owner.id == "self", (
                    f"{path.name}:{node.lineno} reads .{node.attr} of {ast.unparse(owner)}"
                )


def test_nothing_outside_the_client_imports_its_private_modules() -> None:
    for path in ROOT.rglob("*.py"):
        if CLIENT in path.parents:
            continue
        bad = [m for m in _imported(path) if m.startswith("nsa_dist.client._")]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}; use the front door nsa_dist.client"
    assert {"Client", "Run", "Sweep", "HessianView", "KernelView", "ImagesView"} <= set(nsa_dist.client.__all__)
