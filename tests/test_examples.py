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
    assert (s.data.n, s.model.depth, s.model.width, s.model.activation.value, s.model.init.value) == (
        10_000,
        6,
        256,
        "leaky_relu",
        "xavier",
    )
    assert (s.schedule.lr, s.schedule.decay, s.schedule.every, s.steps) == (0.25, 0.5, 100_000, 600_000)
    from nsa_dist.models import build_model

    assert sum(p.numel() for p in build_model(s.model).parameters()) == 264_193  # |θ| in the paper


def test_quickstart_is_the_demo_sweeps_6x256_run():
    quick = load_spec(EXAMPLES / "quickstart.yaml")
    demo = {(r.model.depth, r.model.width): r for r in load_sweep(EXAMPLES / "demo_sweep.yaml").expand()}
    run = demo[(6, 256)]
    for field in ("data", "model", "optimizer", "schedule", "steps", "record", "spectrum", "seed"):
        assert getattr(run, field) == getattr(quick, field), field


def test_paper_setup_keeps_the_papers_k_and_the_fig7d_eigenvectors():
    s = load_spec(EXAMPLES / "nsa_paper.yaml")
    assert s.spectrum.k == "all" and s.spectrum.store_eigenvectors == [20_000, 599_999]
    assert {20_000, 599_999} <= set(s.record_steps())


def test_mnist_sweep_runs_at_tiny_size(tmp_path):
    """The MNIST example's base (bundled subset, one-hot, per-class spectra) shrunk to seconds."""
    from nsa_dist.client import Client
    from nsa_dist.config import ExperimentSpec
    from nsa_dist.pipeline import run_experiment
    from nsa_dist.store import SpectrumStore

    sweep = load_sweep(EXAMPLES / "mnist_sweep.yaml")
    base = sweep.expand()[0].model_dump()
    base.update(name="mnist_tiny", steps=3, record={"every": 2})
    base["data"].update(n=20, n_test=10)
    base["model"].update(width=8, depth=2)
    base["spectrum"].update(k=5, per_class_k=2, full_k=3)
    spec = ExperimentSpec.model_validate(base)
    url = str(tmp_path / "s.zarr")
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run("mnist_tiny")
    assert run.kernel.per_class_eigenvalues.shape == (2, 10, 2) and run.stability_eigenvalues.shape == (2, 3)
    assert (run.kernel.per_class_eigenvalues > 0).all() and (run.test_loss > 0).all()


def test_hessian_paper_examples_are_the_papers_settings():
    """Fig. 1: the three nonlinearities at initialisation over seeds; the regimes: both, over widths."""
    fig1 = load_sweep(EXAMPLES / "hessian_fig1.yaml").expand()
    assert {r.model.activation.value for r in fig1} == {"softplus", "atan", "softplus_normalized"}
    assert len({r.seed for r in fig1}) >= 5 and all(r.record_steps() == [0] and r.hessian for r in fig1)
    active = load_sweep(EXAMPLES / "hessian_active.yaml").expand()
    assert {r.model.regime for r in active} == {"ntk", "active"} and len({r.model.width for r in active}) >= 4
    assert all(r.model.init.value == "ntk" and r.hessian.top_k >= 1 for r in active)  # ‖S‖_op needs Lanczos
    fig3 = load_spec(EXAMPLES / "hessian_fig3.yaml")
    assert fig3.hessian.orthogonality and len(fig3.hessian.indices(fig3.record_steps())) >= 5


@pytest.mark.parametrize(
    "multi, single",
    [("mnist_sweep.yaml", "mnist_one_vs_rest.yaml"), ("cifar100_sweep.yaml", "cifar100_one_vs_rest.yaml")],
)
def test_onehot_examples_name_their_kernel_and_offer_single_output(multi: str, single: str) -> None:
    """The one-hot examples say they use the traced multi-output Gram the NSA paper sets aside and
    point at a single-output (one-vs-rest) sweep that is otherwise the same."""
    text = (EXAMPLES / multi).read_text()
    head = text[: text.index("name:")]
    assert "traced" in head and "out of scope" in head and single in head, head
    m, s = load_sweep(EXAMPLES / multi).expand(), load_sweep(EXAMPLES / single).expand()
    assert all(r.model.output_dim > 1 and r.data.target.value == "onehot" for r in m)
    assert all(r.model.output_dim == 1 and r.data.target.value == "one_vs_rest" for r in s)
    assert len(m) == len(s)
    for a, b in zip(m, s):
        assert (a.model.depth, a.model.width, a.schedule, a.steps, a.data.n) == (
            b.model.depth,
            b.model.width,
            b.schedule,
            b.steps,
            b.data.n,
        )


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_says_the_ntk_path_its_model_takes(path):
    """The '# NTK path:' line of each example is what the NTK core decides for its (first) model."""
    import torch

    from nsa_dist.models import build_model
    from nsa_dist.ntk import explain_method

    said = next(line for line in path.read_text().splitlines() if line.startswith("# NTK path:"))
    spec = load_sweep(path).expand()[0]
    model = build_model(spec.model, seed=0)
    _, routes = explain_method(model, torch.randn(4, spec.model.input_dim))
    paths = {p for p, _ in routes.values()}
    want = {"structured", "per_layer"} if "'per_layer'" in said else {"structured"}
    assert paths == want, f"{path.name} says {said!r}; the NTK core takes {paths}"
