"""The public faces' runnable examples: every ``>>>`` in the docstring of ``nsa_dist``, ``ntk``,
``linalg``, ``hessian``, ``store`` and ``client`` runs as a doctest, and each face carries one.

Each example checks against a float64 dense reference where there is one (the NTK Gram against
``torch.func.jacrev``, the eigenpairs against NumPy's ``eigh``, H against ``torch.func.hessian``),
so an example that drifts from the code fails here with doctest's report of what differs.
"""

from __future__ import annotations

import doctest
import importlib
import io

import pytest

FACES = ["nsa_dist", "nsa_dist.ntk", "nsa_dist.linalg", "nsa_dist.hessian", "nsa_dist.store", "nsa_dist.client"]


@pytest.mark.parametrize("name", FACES)
def test_the_face_example_runs(name: str) -> None:
    module = importlib.import_module(name)
    # the module's docstring and what the face defines itself (re-exported names are checked where they live)
    tests = [t for t in doctest.DocTestFinder().find(module, name) if t.examples]
    assert tests, f"{name} carries no runnable example (>>>) in its docstring"
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test, out=report.write)
    assert runner.failures == 0, f"{runner.failures} of {runner.tries} examples in {name} failed:\n{report.getvalue()}"
