"""User-defined networks in specs and sweeps (issue 12 §2) and the CIFAR CNN example (§3)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_close_rel

from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec, SweepSpec
from nsa_dist.errors import ModelFactoryError
from nsa_dist.models import CNN, build_model
from nsa_dist.ntk import NTKMethod, gram, resolve_method
from nsa_dist.pipeline import run_experiment, run_id
from nsa_dist.specfile import SpecError, load_spec
from nsa_dist.store import SpectrumStore

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CNN8 = {"factory": "nsa_dist.models:cnn", "kwargs": {"in_channels": 1, "image_size": 8, "channels": [3], "hidden": [8]}}
BASE = dict(
    data={"name": "digits", "n": 30, "target": "one_vs_rest"},
    model=CNN8,
    steps=6,
    record={"every": 3},
    schedule={"lr": 0.05},
    spectrum={"k": 8},
)


def test_factory_spec_builds_the_network_deterministically():
    spec = ExperimentSpec(**BASE)
    assert spec.model.input_dim == 64 and spec.model.output_dim == 1
    a, b = build_model(spec.model, seed=3), build_model(spec.model, seed=3)
    assert isinstance(a, CNN)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert resolve_method(a, torch.zeros(2, 64)) is NTKMethod.PER_LAYER
    fc = ExperimentSpec(data={"n": 10}, model={"depth": 2, "width": 4})
    assert run_id(fc) == run_id(ExperimentSpec.model_validate(fc.model_dump(mode="json")))  # FC specs unchanged


def test_kwargs_grid_sweep_runs_and_stores_the_right_spectra(tmp_path):
    sweep = SweepSpec(name="nets", base=BASE, grid={"model.kwargs.channels": [[2], [4]]})
    runs = sweep.expand()
    assert [r.name for r in runs] == ["nets__channels-2", "nets__channels-4"]
    url = str(tmp_path / "s.zarr")
    for spec in runs:
        assert run_experiment(spec, SpectrumStore(url)).status == "done"
        run = Client(url).run(run_id(spec))
        model = build_model(spec.model, dtype=torch.float64)
        torch.nn.utils.vector_to_parameters(torch.as_tensor(run.g["theta"][1], dtype=torch.float64), model.parameters())
        X = torch.as_tensor(run.g["X"][:])
        evals = torch.linalg.eigvalsh(gram(model, X, method="jacobian")).flip(0)[:8]
        assert_close_rel(torch.as_tensor(run.g["eigenvalues"][1]), evals, 1e-5, f"{spec.name} eigenvalues at t=3")
    assert Client(url).run(run_id(runs[1])).spec.model.kwargs["channels"] == [4]


def test_missing_import_path_gives_the_clear_error(tmp_path):
    bad = {**BASE, "model": {"factory": "no_such_pkg.nets:resnet_small"}}
    msg = r"model.factory='no_such_pkg.nets:resnet_small': cannot import module 'no_such_pkg.nets'.*every Ray worker"
    with pytest.raises(ModelFactoryError, match=msg):
        run_experiment(ExperimentSpec(**bad), SpectrumStore(str(tmp_path / "s.zarr")))
    from nsa_dist.cluster import SweepCoordinator  # the driver builds every run's model before Ray starts

    with pytest.raises(ModelFactoryError, match=msg):
        SweepCoordinator(SweepSpec(name="bad", base=bad, grid={"seed": [0, 1]}), str(tmp_path / "t.zarr"))
    with pytest.raises(ModelFactoryError, match="has no attribute 'nope'"):
        build_model(ExperimentSpec(**{**BASE, "model": {"factory": "nsa_dist.models:nope"}}).model)
    with pytest.raises(ModelFactoryError, match=r"returns \(2, 3\) for inputs \(2, 64\); the targets need \(2,\)"):
        build_model(ExperimentSpec(**{**BASE, "model": {**CNN8, "kwargs": {**CNN8["kwargs"], "output_dim": 3}}}).model)
    with pytest.raises(ValueError, match="is not an import path"):
        ExperimentSpec(**{**BASE, "model": {"factory": "no colon"}})


def test_spec_file_error_names_the_model_field(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("data: {n: 10}\nmodel: {depth: 0}\n")
    with pytest.raises(SpecError, match=r"model\.depth: Input should be greater"):
        load_spec(p)


def _cifar_standin(root: Path, n_per_batch: int = 8) -> Path:
    """A generated directory in the CIFAR-10 python pickle format (5 train batches + test)."""
    import pickle

    d = root / "cifar-10-batches-py"
    d.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{b}" for b in range(1, 6)] + ["test_batch"]:
        labels = rng.integers(0, 10, n_per_batch)
        batch = {
            b"data": rng.integers(0, 256, (n_per_batch, 3072), dtype=np.uint8),
            b"labels": [int(c) for c in labels],
            b"batch_label": b"stand-in",
        }
        with open(d / name, "wb") as fh:
            pickle.dump(batch, fh)
    return d


def test_cifar_cnn_example_runs_on_a_stand_in(tmp_path):
    spec = load_spec(EXAMPLES / "cifar_cnn.yaml")
    assert spec.model.factory == "nsa_dist.models:cnn" and spec.model.input_dim == 3072
    small = spec.model_dump(mode="json")
    small.update(steps=4, record={"every": 2}, spectrum={**small["spectrum"], "k": 10})
    small["data"].update(path=str(_cifar_standin(tmp_path)), n=24, n_test=6)
    small["optimizer"]["batch_size"] = 8
    small["model"]["kwargs"]["channels"] = [4, 8]
    small["model"]["kwargs"]["hidden"] = [16]
    spec = ExperimentSpec.model_validate(small)
    url = str(tmp_path / "s.zarr")
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run(run_id(spec))
    assert np.isfinite(run.g["eigenvalues"][:]).all() and run.g["eigenvalues_test"].shape == (3, 6)


@pytest.mark.slow
def test_factory_sweep_on_local_ray_equals_single_process_runs(local_ray, tmp_path):
    from nsa_dist.cluster import SweepCoordinator

    sweep = SweepSpec(
        name="rnets",
        base=BASE,
        grid={"model.kwargs.hidden": [[4], [8]]},
        cluster={"spectral_workers": 1, "max_inflight": 1},
    )
    url = str(tmp_path / "s.zarr")
    assert [o.status for o in SweepCoordinator(sweep, url).run()] == ["done", "done"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the trainer actor (trainer_cpus = 1): conv backward sums in thread order
    try:
        for spec in sweep.expand():
            run_experiment(spec, SpectrumStore(str(tmp_path / f"{spec.name}.zarr")))
    finally:
        torch.set_num_threads(threads)
    for spec in sweep.expand():
        ref = str(tmp_path / f"{spec.name}.zarr")
        a, b = Client(ref).run(run_id(spec)), Client(url).run(run_id(spec))
        for name in ("theta", "f", "eigenvalues", "energy_y", "loss"):
            np.testing.assert_array_equal(a.g[name][:], b.g[name][:], err_msg=f"{spec.name}: {name}")


def test_a_factory_ending_in_one_output_column_runs(tmp_path):
    """``nn.Linear(width, 1)`` last: the factory check accepted the (n, 1) outputs, then step 0 failed
    ("df has shape (32, 1), the store holds (32,)") and the run ended failed; now measured as (n,),
    as the Tracker measures it."""
    spec = ExperimentSpec(
        name="column",
        data={"n": 32},
        model={"factory": "user_models:column_mlp", "kwargs": {"width": 8}},
        steps=2,
        record={"every": 1},
        spectrum={"k": 8, "images": []},
    )
    url = str(tmp_path / "s.zarr")
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run(run_id(spec))
    model = build_model(spec.model, seed=spec.seed)
    with torch.no_grad():
        want = model(torch.as_tensor(run.X, dtype=torch.float32)).reshape(-1).numpy()
    np.testing.assert_allclose(run.outputs(0), want, rtol=1e-6, err_msg="f_0 against the factory's model")


def test_a_factory_deciding_over_its_whole_batch_stores_the_batch_forwards_spectrum(tmp_path):
    """A model that rescales its batch when it looks raw (max > 0.3 on the 2-D points): run alone, the
    points below 0.3 decide otherwise, and `nsa run` stored λ_max 43.2 against the batch forward's
    0.535 (per-sample Jacobians), nothing said."""
    spec = ExperimentSpec(
        name="auto",
        data={"n": 32},
        model={"factory": "user_models:auto_scale", "kwargs": {"width": 8}},
        steps=1,
        record={"every": 1},
        spectrum={"k": 8, "images": [], "dtype": "float64"},
    )
    url = str(tmp_path / "s.zarr")
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run(run_id(spec))
    assert "outputs alone differ" in run.attrs["ntk_paths"]["routes"]["body.0.weight"], run.attrs["ntk_paths"]
    model = build_model(spec.model, seed=spec.seed).double()
    X = torch.as_tensor(run.X, dtype=torch.float64)
    params = {k: p.detach() for k, p in model.named_parameters()}
    J = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (X,)))(params)
    J = torch.cat([j.reshape(X.shape[0], -1) for j in J.values()], dim=1)
    want = np.linalg.eigvalsh((J @ J.T).numpy())[::-1][:8]
    got = np.asarray(run.eigenvalues[0], np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9 * want[0], err_msg="λ_i of G_0 (float32 data)")


def test_a_run_compares_every_point_alone_with_the_whole_batch_not_the_first_64(tmp_path):
    """A run's probe took the first 64 points only: with the one raw point at index 250, those decide
    alike alone and together, and the run stored the per-sample kernel of a batch that rescales."""
    from user_models import auto_scale

    from nsa_dist import Tracker

    torch.manual_seed(0)
    model = auto_scale(d=4, width=8, threshold=1.0).double()
    X = torch.rand(300, 4, dtype=torch.float64)
    X[250] *= 255
    y = torch.randn(300, dtype=torch.float64)
    url = str(tmp_path / "s.zarr")
    with Tracker(url, "late", model, X, y, steps=1, spectrum={"k": 4, "images": []}) as tr:
        tr.record(0, lr=0.1)
    run = Client(url).run("late")
    assert "point 0's outputs alone differ" in run.attrs["ntk_paths"]["routes"]["body.0.weight"], run.attrs
    params = {k: p.detach() for k, p in model.named_parameters()}
    J = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (X,)))(params)
    J = torch.cat([j.reshape(300, -1) for j in J.values()], dim=1)
    want = np.linalg.eigvalsh((J @ J.T).numpy())[::-1][:4]
    np.testing.assert_allclose(run.eigenvalues[0], want, rtol=1e-9, err_msg="λ_1..4 of the batch forward's G")


def test_a_sweeps_refused_run_is_named(tmp_path):
    """A sweep whose grid puts a coupling model on a distributed layout was refused without saying which
    of its runs (it names the run now; nothing is started)."""
    from nsa_dist.pipeline.session import RunSession

    base = dict(data={"n": 32}, steps=1, record={"every": 1}, spectrum={"k": 4, "images": []})
    ok = ExperimentSpec(name="mlp", model={"factory": "user_models:column_mlp"}, **base)
    bad = ExperimentSpec(
        name="auto_rows",
        model={"factory": "user_models:auto_scale"},
        **{**base, "spectrum": {**base["spectrum"], "layout": "block_rows", "workers": 2}},
    )
    with pytest.raises(ValueError, match=r"^run 'auto_rows': spectrum.layout='block_rows' splits the points"):
        RunSession.open_all([ok, bad], SpectrumStore(str(tmp_path / "s.zarr")))
