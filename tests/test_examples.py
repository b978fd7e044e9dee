"""Every file in examples/ is a valid experiment or sweep, and the paper's setups say what the paper says."""

from __future__ import annotations

from pathlib import Path

import pytest

from nsa_dist.specfile import load_spec, load_sweep

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_validates(path):
    runs = load_sweep(path).expand()
    assert runs and all(r.steps >= 1 for r in runs)


def test_paper_setup_matches_section_6():
    s = load_spec(EXAMPLES / "nsa_paper.yaml")
    assert (s.data.n, s.model.depth, s.model.width, s.model.activation.value, s.model.init.value) == \
        (10_000, 6, 256, "leaky_relu", "xavier")
    assert (s.schedule.lr, s.schedule.decay, s.schedule.every, s.steps) == (0.25, 0.5, 100_000, 600_000)
    from nsa_dist.models import build_model

    assert sum(p.numel() for p in build_model(s.model).parameters()) == 264_193  # |θ| in the paper


def test_quickstart_is_the_demo_sweeps_6x256_run():
    quick = load_spec(EXAMPLES / "quickstart.yaml")
    demo = {(r.model.depth, r.model.width): r for r in load_sweep(EXAMPLES / "demo_sweep.yaml").expand()}
    run = demo[(6, 256)]
    for field in ("data", "model", "optimizer", "schedule", "steps", "record", "spectrum", "seed"):
        assert getattr(run, field) == getattr(quick, field), field
