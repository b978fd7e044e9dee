"""The single-machine product: spec → training → spectra in a real Zarr store → client / CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import killed_after_step
from torch.nn.utils import vector_to_parameters

from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.errors import StoreError
from nsa_dist.models import build_model
from nsa_dist.pipeline import run_experiment, run_id
from nsa_dist.specfile import SpecError, load_spec
from nsa_dist.store import SpectrumStore

REPO = Path(__file__).resolve().parents[1]
TINY = dict(
    name="tiny",
    data={"n": 48, "n_test": 24},
    model={"depth": 3, "width": 24},
    steps=30,
    record={"every": 10},
    spectrum={"k": 12, "test_points": True, "images": [1, 2, 5], "image_size": 8, "fourier_size": 5},
)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("store") / "s.zarr")
    spec = ExperimentSpec(**TINY)
    out = run_experiment(spec, SpectrumStore(url))
    return url, spec, out


def test_stored_spectra_equal_recomputation_from_stored_checkpoint(tiny_run):
    url, spec, out = tiny_run
    assert out.status == "done" and out.steps_computed == 4
    run = Client(url).run(out.run_id)
    assert run.steps.tolist() == [0, 10, 20, 29]
    data = load_dataset(spec.data, seed=spec.seed)
    model = build_model(spec.model, seed=spec.seed).double()
    X = torch.tensor(data.X, dtype=torch.float32).double()  # the points the run trained on
    for i, t in enumerate(run.steps):
        vector_to_parameters(torch.tensor(run.g["theta"][i], dtype=torch.float64), model.parameters())
        params = {k: p.detach() for k, p in model.named_parameters()}
        J = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (X,)))(params)
        J = torch.cat([j.reshape(X.shape[0], -1) for j in J.values()], 1)
        evals, evecs = torch.linalg.eigh(J @ J.T)
        evals, evecs = evals.flip(0)[:12].numpy(), evecs.flip(1)[:, :12].numpy()
        np.testing.assert_allclose(run.eigenvalues[i], evals, rtol=1e-8)
        E = np.cumsum((evecs.T @ data.y) ** 2) / np.sum(data.y**2)
        np.testing.assert_allclose(run.energy("y")[i], E, rtol=1e-6, atol=1e-9)
        f = model(X).detach().numpy()
        np.testing.assert_allclose(run.outputs(int(t)), f, rtol=1e-5, atol=1e-5)
        m = f - data.y
        np.testing.assert_allclose(
            run.energy("residual")[i], np.cumsum((evecs.T @ m) ** 2) / np.sum(m**2), rtol=1e-4, atol=1e-6
        )
        df_pred = -(spec.schedule.lr / 48) * (J @ J.T).numpy() @ m
        np.testing.assert_allclose(run.outputs(int(t), "df_pred"), df_pred, rtol=1e-4, atol=1e-6)
    fo = run.first_order
    assert np.all(fo["error"] < 0.5) and np.all(fo["cos"] > 0.9), fo
    np.testing.assert_allclose(run.lr_eigen_product(), spec.schedule.lr * run.eigenvalues / 48)
    assert run.energy("f_test").shape == (4, 12)
    assert np.all(np.diff(run.energy("y"), axis=1) >= -1e-12)
    P, t1, t2, rows = run.spectrum_preservation()
    assert (t1, t2) == (10, 29) and P.shape == (len(rows), 12) and np.all(P <= 1 + 1e-6)
    assert np.isfinite(run.loss_trace).all() and run.loss_trace.shape == (30,)
    im = run.images.at(29)
    assert im["eigvec_images"].shape == (3, 8, 8) and im["eigvec_fourier"].shape == (3, 5, 5)


def test_the_images_and_fourier_transforms_are_recomputable_from_the_store_alone(tiny_run):
    """The store keeps X standardised (the inputs the network saw), while the eigenvector images and
    their Fourier transforms (NSA Eq. 27) are taken in image2d's [0, 1]² coordinates: the loader's
    x_mean, x_std are a run attribute now (audit P recomputed Eq. 27 from the stored X, 35 % off)."""
    url, spec, out = tiny_run
    run = Client(url).run(out.run_id)
    meta = run.data_meta
    assert meta["source"] == "image2d" and len(meta["x_mean"]) == 2, meta
    x = run.X * np.asarray(meta["x_std"]) + np.asarray(meta["x_mean"])  # the original coordinates
    assert x.min() >= 0 and x.max() <= 1, (x.min(), x.max())
    assert {"y_mean", "y_std"} <= set(meta), meta  # y standardised too
    sp = spec.spectrum
    axis = np.linspace(-sp.fourier_limit, sp.fourier_limit, sp.fourier_size)
    xi = np.stack([g.ravel() for g in np.meshgrid(axis, axis, indexing="ij")], 1)
    i, idx = len(run.steps) - 1, np.asarray(run.array("image_indices"))
    V = run.array("eigenvectors")[i][:, idx - 1].astype(np.float64)
    fourier = np.abs(np.exp(-2j * np.pi * xi @ x.T) @ V / x.shape[0]).T.reshape(-1, sp.fourier_size, sp.fourier_size)
    stored = run.images.at(int(run.steps[-1]))["eigvec_fourier"]
    err = np.max(np.abs(stored - fourier)) / np.max(fourier)
    assert err < 1e-6, f"Eq. 27 from the store differs from the stored |v̂_i| by {err:.2e} relative"


def test_rerun_skips_finished_work(tiny_run):
    url, spec, out = tiny_run
    again = run_experiment(spec, SpectrumStore(url))
    assert again.status == "done" and again.steps_computed == 0 and again.run_id == out.run_id


def test_diverging_run_is_marked_failed_and_keeps_earlier_steps(tmp_path):
    spec = ExperimentSpec(
        **{**TINY, "name": "boom", "schedule": {"lr": 30.0}, "steps": 60, "record": {"steps": [0, 1, 2, 40]}}
    )
    out = run_experiment(spec, SpectrumStore(str(tmp_path / "s.zarr")))
    assert out.status == "failed" and "diverged at step" in out.reason
    run = Client(str(tmp_path / "s.zarr")).run(out.run_id)
    assert run.status == "failed" and run.failed_step is not None and run.failed_step < 40
    expected = [t for t in (0, 1, 2) if t < run.failed_step]
    assert expected and run.steps.tolist() == expected and np.isfinite(run.eigenvalues).all()


@pytest.mark.parametrize("optimizer", [{"name": "sgd", "batch_size": 16, "momentum": 0.9}, {"name": "adam"}])
def test_resume_from_stored_checkpoint_matches_uninterrupted(tmp_path, optimizer):
    spec = ExperimentSpec(**{**TINY, "optimizer": optimizer, "schedule": {"lr": 0.01}})
    full = run_experiment(spec, SpectrumStore(str(tmp_path / "a.zarr")))
    # an interrupted run: stop it after two recorded steps, then re-run the same spec
    store_b = SpectrumStore(str(tmp_path / "b.zarr"))

    def stop_after_two(ck, result):
        if ck.index == 1:
            raise KeyboardInterrupt  # Ctrl-C between steps

    with pytest.raises(KeyboardInterrupt):
        run_experiment(spec, store_b, on_step=stop_after_two)
    assert Client(str(tmp_path / "b.zarr")).run(full.run_id).status == "interrupted"
    resumed = run_experiment(spec, store_b)
    assert resumed.steps_computed == 2
    a, b = Client(str(tmp_path / "a.zarr")).run(full.run_id), Client(str(tmp_path / "b.zarr")).run(full.run_id)
    for name in ("theta", "f", "eigenvalues", "energy_y", "opt_slots", "loss", "loss_trace"):
        np.testing.assert_array_equal(a.g[name][:], b.g[name][:], err_msg=name)


@pytest.mark.slow
def test_killed_process_resumes_to_the_same_arrays(tmp_path):
    spec = {**TINY, "name": "killme", "steps": 80, "record": {"every": 8}}  # 11 recorded steps
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "nsa_dist.cli", "run", str(path), "--plain"]
    assert run_experiment(ExperimentSpec(**spec), SpectrumStore(str(tmp_path / "a.zarr"))).status == "done"
    rid = run_id(ExperimentSpec(**spec))
    # the writer stops itself once its third step is written (a poller raced it), then is killed
    killed_after_step(cmd[3:] + ["--store", str(tmp_path / "b.zarr")], 2, env)
    n_done = int(np.sum(Client(str(tmp_path / "b.zarr")).run(rid).g["done"][:]))
    assert n_done == 3, n_done
    out = subprocess.run(cmd + ["--store", str(tmp_path / "b.zarr")], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    a, b = Client(str(tmp_path / "a.zarr")).run(rid), Client(str(tmp_path / "b.zarr")).run(rid)
    assert b.status == "done" and len(b.steps) == len(a.steps) == 11
    for name in ("theta", "f", "eigenvalues", "energy_y", "energy_df", "loss"):
        np.testing.assert_array_equal(a.g[name][:], b.g[name][:], err_msg=name)


def test_store_mismatches_give_clear_errors(tmp_path):
    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(**{**TINY, "steps": 11})
    out = run_experiment(spec, SpectrumStore(url))
    g = SpectrumStore(url).group(out.run_id)
    g.attrs["spec"] = {**g.attrs["spec"], "seed": 99}
    with pytest.raises(StoreError, match="different spec.*seed: 99 → 0"):
        run_experiment(spec, SpectrumStore(url))
    g.attrs["spec"] = {**g.attrs["spec"], "seed": 0}
    del g["energy_df"]
    with pytest.raises(StoreError, match="array 'energy_df' is missing"):
        run_experiment(spec, SpectrumStore(url))
    g.attrs["schema_version"] = 999
    with pytest.raises(StoreError, match="schema 999"):
        run_experiment(spec, SpectrumStore(url))
    with pytest.raises(StoreError, match="no spectrum store"):
        Client(str(tmp_path / "missing.zarr"))
    with pytest.raises(StoreError, match="no run 'zzz'"):
        Client(url).run("zzz")


def test_memory_fsspec_store():
    spec = ExperimentSpec(**{**TINY, "steps": 11, "spectrum": {"k": 5}})
    out = run_experiment(spec, SpectrumStore("memory://nsa-test/s.zarr"))
    run = Client("memory://nsa-test/s.zarr").run(out.run_id)
    assert run.eigenvalues.shape == (2, 5) and run.status == "done"


def test_bad_specs_and_missing_data(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {name: mnist, n: 10}\noptimizer: {name: sgd}\nmodel: {widht: 3}\n")
    with pytest.raises(SpecError) as e:
        load_spec(bad)
    msg = str(e.value)
    assert "optimizer" in msg and "batch_size is required" in msg and "model.widht" in msg
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="mapping"):
        load_spec(tmp_path / "list.yaml")
    spec = ExperimentSpec(data={"name": "image2d", "path": str(tmp_path / "missing.png")})
    with pytest.raises(FileNotFoundError, match="missing.png"):
        run_experiment(spec, SpectrumStore(str(tmp_path / "s.zarr")))
    (tmp_path / "fake.png").write_text("not an image")
    spec = ExperimentSpec(data={"name": "image2d", "path": str(tmp_path / "fake.png")})
    with pytest.raises(ValueError, match="not a readable PNG/JPEG"):
        run_experiment(spec, SpectrumStore(str(tmp_path / "s.zarr")))


def test_cli_smoke(tmp_path, tiny_run, capsys):
    """``nsa ls/show`` and a refused spec in-process (cli.main); one ``nsa run`` as its own process."""
    from nsa_dist.cli import main

    url, spec, out = tiny_run
    capsys.readouterr()
    assert main(["ls", "--store", url]) == 0
    r = capsys.readouterr()
    assert "tiny" in r.out and "done" in r.out
    assert main(["show", "tiny", "--store", url]) == 0
    r = capsys.readouterr()
    assert "E(y, 5)" in r.out and "λ_max" in r.out
    assert main(["show", "nope", "--store", url]) == 2 and "no run 'nope'" in capsys.readouterr().err
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**TINY, "name": "cli", "steps": 6, "record": {"steps": [0, 3]}}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-m", "nsa_dist.cli", "run", str(path), "--store", str(tmp_path / "c.zarr")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert "[nsa] step        3/6" in r.stdout and "done" in r.stdout
    path.write_text("steps: -1\n")
    assert main(["run", str(path), "--store", str(tmp_path / "c.zarr")]) == 2
    assert "steps: Input should be greater than or equal to 1" in capsys.readouterr().err


def test_client_reads_a_run_while_it_is_writing(tmp_path):
    """A reader sees exactly the steps finished so far (done flag last), and the live status."""
    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(**{**TINY, "name": "live"})
    seen = []

    def watch(ck, result):
        run = Client(url).run(run_id(spec))
        seen.append((run.status, run.steps.tolist(), run.eigenvalues.shape[0]))

    run_experiment(spec, SpectrumStore(url), on_step=watch)
    assert seen == [
        ("running", [0], 1),
        ("running", [0, 10], 2),
        ("running", [0, 10, 20], 3),
        ("running", [0, 10, 20, 29], 4),
    ]
    run = Client(url).run(run_id(spec))
    assert run.status == "done" and len(run.steps) == 4


def test_resume_fills_a_gap_left_by_out_of_order_steps(tmp_path):
    """On a cluster steps can finish out of order: a re-run resumes before the first missing one."""
    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(**{**TINY, "name": "gap"})
    run_experiment(spec, SpectrumStore(url))
    g = SpectrumStore(url).group(run_id(spec))
    ref = {k: g[k][:] for k in ("theta", "eigenvalues", "energy_y")}
    g["done"][2] = False
    g["eigenvalues"][2] = np.nan
    again = run_experiment(spec, SpectrumStore(url))
    assert again.steps_computed == 1 and again.status == "done"
    for k, v in ref.items():
        np.testing.assert_array_equal(g[k][:], v, err_msg=k)


def test_an_error_that_would_recur_marks_the_run_failed(tmp_path):
    spec = ExperimentSpec(**{**TINY, "name": "bad", "spectrum": {"k": "all", "eig_method": "arpack"}})
    with pytest.raises(ValueError, match="arpack"):
        run_experiment(spec, SpectrumStore(str(tmp_path / "s.zarr")))
    run = Client(str(tmp_path / "s.zarr")).run(run_id(spec))
    assert run.status == "failed" and "ValueError" in run.reason


def test_spec_with_a_non_mapping_field_gives_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: mnist\n")
    with pytest.raises(SpecError, match="data: Input should be a valid dictionary"):
        load_spec(bad)
    bad.write_text("data: {name: mnist, n: -3}\n")
    with pytest.raises(SpecError, match="data.n: Input should be greater than or equal to 1"):
        load_spec(bad)
