"""docs/store.md names every array a run can have (an audit found the quadrature route's ten arrays
and the test curve missing from its tables, while its text said "the arrays are in store.md")."""

from __future__ import annotations

import itertools
import re
from dataclasses import fields
from pathlib import Path

from nsa_dist.store.dims import RunDims
from nsa_dist.store.schema import run_arrays

PHIS = ("df_pred", "f_test", "residual", "df", "y", "f")  # longest first


def _every_array() -> set[str]:
    """The arrays of a run with every optional part switched on."""
    sizes = {f.name: 3 for f in fields(RunDims) if f.type in ("int", int)}
    flags = {f.name: True for f in fields(RunDims) if f.type in ("bool", bool)}
    return {a.name for a in run_arrays(RunDims(**{**sizes, **flags, "state_dtype": "float32"}))}


def _documented() -> set[str]:
    text = (Path(__file__).resolve().parents[1] / "docs" / "store.md").read_text()
    names = set()
    for code in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text):
        parts = re.split(r"\{([^}]*)\}", code)  # energy_{y,f,residual}: each alternative
        choices = [p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]
        names |= {"".join(c).strip() for c in itertools.product(*choices)}
    return names


def test_every_array_of_a_run_is_in_store_md():
    documented = _documented()

    def named(array: str) -> bool:
        base = re.sub(r"_(lower|upper)$", "", array)  # a bracket's ends: "`x`, `_lower`, `_upper`"
        if array in documented or base in documented:
            return True
        phi = next((p for p in PHIS if base.endswith("_" + p)), None)
        return phi is not None and base[: -len(phi)] + "<φ>" in documented

    missing = sorted(a for a in _every_array() if not named(a))
    assert not missing, f"arrays a run can have that docs/store.md does not name: {missing}"
