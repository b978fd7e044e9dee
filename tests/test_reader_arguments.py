"""Audit A2: odd arguments to the readers.  An argument a reader cannot honour is one clear error
naming it — never a value read at another step, another k, or the default: a step given as an array
picked its first match, False was step 0, ``energy(phi, step=5)`` ignored the step, the numerical
rank read K where only K eigenvalues were kept, k = True was 1, a k given to a quantity without one
was ignored, Fig. 7a drew k = 1 for k = −3 and k = K for k = 100."""

from __future__ import annotations

import numpy as np
import pytest

from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec, SweepSpec
from nsa_dist.errors import StoreError
from nsa_dist.pipeline import run_experiment, run_id
from nsa_dist.store import SpectrumStore

BASE = {"data": {"n": 24}, "model": {"depth": 2, "width": 8}, "steps": 6, "record": {"every": 2}}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Client:
    url = str(tmp_path_factory.mktemp("args") / "s.zarr")
    store = SpectrumStore(url)
    for spec in (
        ExperimentSpec(name="kall", **BASE, spectrum={"k": "all", "images": []}),
        ExperimentSpec(name="topk", **BASE, spectrum={"k": 4, "images": []}),
    ):
        assert run_experiment(spec, store).status == "done"
    sweep = SweepSpec(name="sw", base={**BASE, "spectrum": {"k": 5, "images": []}}, grid={"seed": [0, 1]})
    ids = []
    for spec in sweep.expand():
        assert run_experiment(spec, store).status == "done"
        ids.append(run_id(spec))
    store.record_sweep(sweep.name, sweep.model_dump(mode="json"), ids)
    hw = SweepSpec(
        name="hw",
        base={**BASE, "spectrum": {"k": 2, "images": []}, "hessian": {"probes": 4, "lanczos_steps": 6}},
        grid={"model.width": [6, 8]},
    )
    ids = []
    for spec in hw.expand():
        assert run_experiment(spec, store).status == "done"
        ids.append(run_id(spec))
    store.record_sweep(hw.name, hw.model_dump(mode="json"), ids)
    return Client(url)


@pytest.mark.parametrize("step", [np.array([0, 2]), False, True, 2.0, np.float32(2), "2"])
def test_a_step_is_one_integer_in_every_reader(client: Client, step) -> None:
    run = client.run("kall")
    for read in (run.outputs, run.eigenvectors, run.residual):
        with pytest.raises(KeyError, match="is not a recorded step t"):
            read(step)
    np.testing.assert_array_equal(run.outputs(np.int64(2)), run.outputs(2))  # a NumPy integer is one


def test_energy_without_k_reads_the_named_step_or_refuses_it(client: Client) -> None:
    run = client.run("kall")
    rows = run.energy("y")
    assert rows.shape == (len(run.steps), 24)
    np.testing.assert_array_equal(run.energy("y", step=2), rows[list(run.steps).index(2)])
    np.testing.assert_array_equal(run.energy("y", step=None), rows)
    for bad in (3, -2, "x", 2.0):
        with pytest.raises(KeyError):
            run.energy("y", step=bad)


def test_the_numerical_rank_of_a_top_k_run_is_not_its_k(client: Client) -> None:
    top, kall = client.run("topk"), client.run("kall")
    full = kall.numerical_rank()
    assert full > 4, full  # the same G (same seed, same net) has a rank above the 4 the top-k run keeps
    with pytest.raises(ValueError, match=r"kept the top 4 of N = 24 eigenvalues .* rank there is ≥ 4, not known"):
        top.numerical_rank()
    with pytest.raises(ValueError, match="not known"):
        top.numerical_rank(step=None)
    assert top.numerical_rank(among_stored=True) == 4
    assert kall.numerical_rank(step=None).shape == (len(kall.steps),)


def test_quantities_take_an_integer_k_and_only_where_they_have_one(client: Client) -> None:
    from nsa_dist.client._sweep import quantity

    run, sweep = client.run("kall"), client.sweep("sw")
    np.testing.assert_array_equal(quantity(run, "eigenvalues", np.int64(2))[1], run.eigenvalues[:, 1])
    for k in (True, 2.0, np.float64(2)):
        with pytest.raises(ValueError, match="k must be an integer"):
            quantity(run, "eigenvalues", k)
        with pytest.raises(ValueError, match="k must be an integer"):
            sweep.scalar("eigenvalues", k=k)
    for name in ("lambda_max", "alignment", "loss", "loss_recorded"):
        with pytest.raises(ValueError, match=f"quantity '{name}' takes no k"):
            quantity(run, name, 3)
    with pytest.raises(ValueError, match="one value per step and takes no k"):
        quantity(run, "lr", 1)
    with pytest.raises(ValueError, match="unknown quantity 'nope'"):
        sweep.lacking("nope")
    assert sweep.lacking("eigenvalues", 2) == []


def test_fig7a_draws_the_k_asked_for_or_refuses_it(client: Client, tmp_path) -> None:
    from nsa_dist.plots.sweep import fig7a

    sweep = client.sweep("sw")
    assert "E_t(y, 3)" in fig7a(sweep, k=3).axes[0].get_ylabel()
    for k, match in ((-3, r"k=-3: E_t\(y, k\) is stored for k in 1..5"), (0, "k=0"), (100, "k=100"), (True, "integer")):
        with pytest.raises(ValueError, match=match):
            fig7a(sweep, k=k)


def test_cli_sweep_k_below_one_exits_2(client: Client, tmp_path, capsys) -> None:
    from nsa_dist.cli import main

    for k in ("-3", "0"):
        assert main(["plot", "--store", client.url, "--sweep", "sw", "--k", k, "--out", str(tmp_path / k)]) == 2
        err = capsys.readouterr().err
        assert f"k={k}" in err and "1..5" in err, err
        assert not list((tmp_path / k).glob("*.png"))


def test_names_and_filters_that_cannot_match_say_why(client: Client, tmp_path) -> None:
    for bad in (None, 123):
        with pytest.raises(StoreError, match="a run is named by its id or name, a string"):
            client.run(bad)
    with pytest.raises(ValueError, match=r"model__depth='2' matches no run; column 'model.depth' holds 2"):
        client.runs(model__depth="2")
    with pytest.raises(ValueError, match=r"status='Done' matches no run; column 'status' holds 'done'"):
        client.runs(status="Done")
    assert len(client.runs(model__depth=2)) == 6 and len(client.runs(model__width=8)) == 5
    assert set(client.runs(hessian__probes=None)["id"]) == {r for r in client.runs()["id"] if not r.startswith("hw")}
    run = client.run("kall")
    with pytest.raises(StoreError, match="did not measure the Hessian: its spec has no hessian: block"):
        run.hessian.steps  # noqa: B018 — the property's read is the test
    with pytest.raises(KeyError, match="has no test loss: it has no test points"):
        run.test_loss  # noqa: B018
    with pytest.raises(ValueError, match=r"i=\[\]: give the rows i"):
        run.spectrum_preservation(0, 4, [])
    assert "status='done'" in repr(run)


def test_export_into_a_file_says_it_is_a_file(client: Client, tmp_path) -> None:
    from nsa_dist.errors import OutsideError
    from nsa_dist.export import export_tensorboard

    afile = tmp_path / "afile.txt"
    afile.write_text("x")
    with pytest.raises(OutsideError, match=r"afile.txt is a file, not a folder"):
        export_tensorboard(client.run("kall"), afile)


def test_review_a_hessian_scalar_k_is_its_order_not_fig7as_k(client: Client, tmp_path, capsys) -> None:
    """``--scalar hessian_H --k 3``: k is Tr(H^k)'s order, above the sweep's 2 stored eigenpairs — it was
    also handed to Fig. 7a, which now refuses a k beyond K (a review: exit 2, no figure)."""
    from nsa_dist.cli import main

    out = tmp_path / "hk"
    argv = ["plot", "--store", client.url, "--sweep", "hw", "--scalar", "hessian_H", "--x", "model.width", "--k", "3"]
    assert main([*argv, "--out", str(out)]) == 0, capsys.readouterr().err
    assert (out / "scalar_hessian_H.png").is_file() and (out / "fig7a_energy_y.png").is_file()


def test_review_the_sweep_pages_k_is_capped_and_shown(client: Client) -> None:
    from nsa_dist.serve.sweep_page import chosen_k, default_k

    sw = client.sweep("sw")
    assert chosen_k(sw, 99, auto=False) == 5 and chosen_k(sw, -3, auto=False) == 1  # K = 5
    assert chosen_k(sw, 3, auto=False) == 3 and chosen_k(sw, 3, auto=True) == default_k(sw)


def test_review_sweep_scalar_and_eigenvector_steps_are_integers(client: Client) -> None:
    sw, run = client.sweep("sw"), client.run("kall")
    assert list(sw.scalar("loss_recorded", step=2)["step"]) == [2, 2]
    for bad in (2.0, np.array([2, 4]), True):
        with pytest.raises(KeyError, match="is not a recorded step t"):
            sw.scalar("loss_recorded", step=bad)
        with pytest.raises(KeyError, match="is not a recorded step t"):
            run.stores_eigenvectors(bad)
    with pytest.raises(KeyError, match="is not a recorded step t"):
        run.stores_eigenvectors(2.9)  # was int(2.9) = 2: True


def test_review_serve_fig4a_draws_points_and_binned_means_as_nsa_plot(client: Client, monkeypatch) -> None:
    from nsa_dist.plots import projections, residual_projections
    from nsa_dist.serve import _nsa_panels
    from nsa_dist.serve.run_page import run_panels

    monkeypatch.setattr(_nsa_panels, "_JOINED", 5)
    monkeypatch.setattr(projections, "_BINS", 4)
    run = client.run("kall")
    panel = next(p for p in run_panels(run) if "fig4a_residual_projections" in p.figures)
    panel.update(panel.guarded(run))
    assert not panel.error.visible, panel.error.text
    lines, dots = panel.sources[0]["lines"].data, panel.sources[0]["dots"].data
    assert lines["label"] and all("mean over 4 bins of i" in lb for lb in lines["label"]), lines["label"]
    t = int(lines["label"][-1].split("t = ")[1].split(":")[0])
    p = residual_projections(run, t)
    np.testing.assert_allclose(lines["ys"][-1], p.reshape(4, 6).mean(axis=1), rtol=1e-12)
    assert len(dots["x"]) == 24 * len(lines["label"])  # every projection a point, none joined


@pytest.mark.parametrize("value", ["no", 0.0, 1, None])
def test_true_or_false_options_take_a_bool(client: Client, value) -> None:
    """``I_eigenvalues(limit="no")`` read the limit's eigenvalues and ``to_xarray(state="no")`` added the
    resume state: a truthy string was True (Audit A2's cosmetic rest).  Each option takes True or False."""
    run, hw = client.run("kall"), client.run(next(r for r in client.runs()["id"] if r.startswith("hw")))
    for read, name in (
        (lambda: hw.hessian.I_eigenvalues(limit=value), "limit"),
        (lambda: run.to_xarray(state=value), "state"),
        (lambda: run.numerical_rank(among_stored=value), "among_stored"),
        (lambda: client.verify(mark=value), "mark"),
    ):
        with pytest.raises(TypeError, match=f"{name}={value!r} must be True or False"):
            read()
    np.testing.assert_array_equal(hw.hessian.I_eigenvalues(limit=np.bool_(True)), hw.hessian.I_eigenvalues(True))
