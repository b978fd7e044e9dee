"""Run ids never change under a spec that did not change: a field added later is marked
``ID_NEUTRAL`` and left out of the hash at its default, so stored runs keep being found."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from nsa_dist.config import ID_NEUTRAL, ExperimentSpec
from nsa_dist.pipeline.plan import id_json, run_id
from nsa_dist.specfile import load_spec, load_sweep

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# The first run id of each shipped example, as every release since the ids were introduced wrote it.
# A change here means every stored run of that spec is orphaned (a sweep would recompute it).
IDS = {
    "cifar100_one_vs_rest.yaml": "cifar100_one_vs_rest__depth-2__width-64-5310e394a2",
    "cifar10_full.yaml": "cifar10_full__hidden-128-72d8c4382a",
    "cifar_cnn.yaml": "cifar_cnn-3b494962ca",
    "demo_sweep.yaml": "demo__depth-2__width-64-183a448a52",
    "hessian_active.yaml": "hessian_active__width-16__regime-ntk__seed-0-974272dc74",
    "hessian_fig3.yaml": "hessian_fig3-a81bf17b13",
    "mnist_full.yaml": "mnist_full__depth-2-cecd11622d",
    "nce_density.yaml": "nce_density-955818214f",
    "nsa_fig7_sweep.yaml": "nsa_fig7__depth-2__width-64-fea6bc5fd8",
    "nsa_paper.yaml": "nsa_paper-a9e02e6351",
    "quickstart.yaml": "quickstart-596f17d55e",
    "tiny.yaml": "tiny-a881957836",
}


def _first_spec(path: Path) -> ExperimentSpec:
    try:
        return load_sweep(path).expand()[0]
    except Exception:
        return load_spec(path)


@pytest.mark.parametrize("name", sorted(IDS))
def test_example_ids_are_stable(name: str) -> None:
    got = run_id(_first_spec(EXAMPLES / name))
    assert got == IDS[name], f"{name}: run id {got!r}, stored runs were written as {IDS[name]!r}"


class _Inner(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    a: int = 1
    added_later: int = Field(0, json_schema_extra=ID_NEUTRAL)


class _Outer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    inner: _Inner = Field(default_factory=_Inner)
    b: str = "x"
    added_later_too: list[int] = Field(default_factory=list, json_schema_extra=ID_NEUTRAL)


def test_a_neutral_field_at_its_default_is_not_hashed() -> None:
    assert id_json(_Outer()) == {"inner": {"a": 1}, "b": "x"}


def test_a_neutral_field_set_is_hashed() -> None:
    got = id_json(_Outer(inner=_Inner(added_later=2), added_later_too=[3]))
    assert got == {"inner": {"a": 1, "added_later": 2}, "b": "x", "added_later_too": [3]}


def test_a_sweep_is_expanded_once(monkeypatch) -> None:
    """Validating a sweep expands it; later ``expand()`` calls (the CLI, the coordinator, the data
    check) return those runs without validating each run again; a copy with other fields does."""
    calls = []
    real = ExperimentSpec.model_validate.__func__

    def counting(cls, *a, **kw):
        calls.append(1)
        return real(cls, *a, **kw)

    monkeypatch.setattr(ExperimentSpec, "model_validate", classmethod(counting))
    sweep = load_sweep(EXAMPLES / "hessian_fig1.yaml")
    n = len(calls)
    assert n == 18, n
    runs = [sweep.expand() for _ in range(3)]
    assert len(calls) == n and runs[0] == runs[2]
    other = sweep.model_copy(update={"name": "other"})
    assert other.expand()[0].name.startswith("other__") and len(calls) == 2 * n


def test_record_steps_in_another_order_are_the_same_run():
    """``record.steps`` is a set of steps: given in another order, or with a step twice, the run
    is the same (one id, so a re-run resumes it); the stored spec lists them sorted, once."""
    base = dict(name="order", steps=60, data={"n": 20, "n_test": 4}, model={"depth": 1, "width": 8})
    ids = {run_id(ExperimentSpec(**base, record={"steps": s})) for s in ([0, 20, 50], [50, 0, 20], [20, 50, 20, 0, 50])}
    assert len(ids) == 1, f"one schedule, {len(ids)} run ids: {sorted(ids)}"
    assert ExperimentSpec(**base, record={"steps": [50, 0, 20, 20]}).record.steps == [0, 20, 50]
