"""What new users ran into with the client, ``nsa plot`` / ``nsa show`` and ``nsa serve``: a k the run
never measured, the route's caption, one φ as a string, a run named like another's id prefix, the
Hessian parts, an unknown sweep, the route in ``nsa show``, the bracket note's colour, Fig. 7c left out."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from nsa_dist.cli import main
from nsa_dist.client import Client, Run
from nsa_dist.config import ExperimentSpec, SweepSpec
from nsa_dist.errors import StoreError
from nsa_dist.pipeline import run_experiment, run_id
from nsa_dist.plots import PlotOptions, make_figure, plot_run
from nsa_dist.store import SpectrumStore

BASE = {"data": {"n": 16}, "model": {"depth": 2, "width": 8}, "steps": 4, "record": {"every": 2}}
# the quadrature route at N = 24: top 4 exact, brackets to N (images only within the top)
QUAD = {
    "k": "all",
    "images": [1],
    "energy": "quadrature",
    "quadrature": {"top": 4, "lanczos_steps": 8, "probes": 4, "curve_points": 6},
}


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Runs named "qauto" (k: all, the exact route) and "qautol" (top 4: a name that starts with the
    other's), a quadrature-route run and a sweep of two seeds without test points."""
    url = str(tmp_path_factory.mktemp("edges") / "s.zarr")
    store = SpectrumStore(url)
    specs = (
        ExperimentSpec.model_validate(
            {**BASE, "model": {"depth": 2, "width": 32}, "name": "qauto", "spectrum": {"k": "all"}}
        ),
        ExperimentSpec.model_validate({**BASE, "name": "qautol", "spectrum": {"k": 4}}),
        ExperimentSpec.model_validate({**BASE, "name": "quad", "data": {"n": 24}, "spectrum": QUAD}),
    )
    for spec in specs:
        assert run_experiment(spec, store).status == "done"
    sweep = SweepSpec(
        name="nt",
        base={**BASE, "spectrum": {"k": 4, "store_eigenvectors": False}},
        grid={"seed": [0, 1]},
    )
    ids = []
    for spec in sweep.expand():
        assert run_experiment(spec, store).status == "done"
        ids.append(run_id(spec))
    store.record_sweep(sweep.name, sweep.model_dump(mode="json"), ids)
    return url


@pytest.fixture(scope="module")
def runs(store_url: str) -> dict[str, Run]:
    c = Client(store_url)
    return {name: c.run(name) for name in ("qauto", "qautol", "quad")}


def test_a_k_beyond_what_the_run_measured_is_refused_in_one_line(
    runs: dict[str, Run], store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``--k 5000`` (beyond N) or a k beyond the K eigenpairs kept is refused naming the k, the run and
    what it measured — not an empty figure, and not left out of ``--k 2 3 5000``."""
    top = runs["qautol"]  # K = 4 of N = 16 on the exact route
    for ks in ((5000,), (2, 3, 5000)):
        argv = ["plot", top.id, "--store", store_url, "--out", str(tmp_path / "o"), "--figures", "fig3a_energy_y"]
        assert main([*argv, "--k", *map(str, ks)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "k=5000" in err and top.id in err and "k = 1..4" in err, err
        assert "spectrum.k: all" in err, err  # what to change
        assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
    with pytest.raises(ValueError, match=r"k=17: run 'qauto-\w+' measured k = 1\.\.16 only \(every k up to N = 16\)"):
        make_figure(runs["qauto"], "fig2b_eigenvalues_t", PlotOptions(ks=(1, 17)))
    with pytest.raises(ValueError, match="k=0"):
        plot_run(runs["qauto"], tmp_path / "p", figures="fig3a_energy_y", opts=PlotOptions(ks=(0,)))
    fig = make_figure(top, "fig3a_energy_y", PlotOptions(ks=(1, 4)))
    assert [t for t in fig.axes[0].get_legend_handles_labels()[1] if t.startswith("k =")] == ["k = 1", "k = 4"]


def test_a_figure_whose_k_stop_below_the_runs_says_what_it_left_out(
    runs: dict[str, Run], caplog: pytest.LogCaptureFixture
) -> None:
    """On the quadrature route E and λ go to N but δλ/N (Fig. 2d) only to the exact top: a k between
    is drawn where it can be and named where it cannot."""
    run = runs["quad"]
    assert (run.energy_route, run.k_max, int(run.shape("eigenvalues")[1])) == ("quadrature", 24, 4)
    opts = PlotOptions(ks=(1, 3, 20))
    with caplog.at_level(logging.WARNING, logger="nsa_dist.plots"):
        fig3a = make_figure(run, "fig3a_energy_y", opts)
        assert not caplog.records, caplog.text
        fig2d = make_figure(run, "fig2d_lr_eigen", opts)
    assert "k = 20" in fig3a.axes[0].get_legend_handles_labels()[1]
    assert "i = 20" not in fig2d.axes[0].get_legend_handles_labels()[1]
    (rec,) = caplog.records
    assert rec.getMessage() == f"Fig. 2d of run {run.id!r}: k = 20 not drawn (this figure stops at k = 4)"


_BRACKETED = ("fig2a_eigenvalues", "fig2b_eigenvalues_t", "fig3a_energy_y", "fig3d_energy_df", "energy_against_k")


@pytest.mark.parametrize("name", ["qauto", "qautol", "quad"])
def test_every_bracketed_figure_says_its_route_and_keeps_it_inside(runs: dict[str, Run], name: str) -> None:
    """Figs. 2a, 2b, 3a–d and E against k carry the route's caption on both routes (the exact one:
    no band, and which k), inside the figure."""
    from test_plots import layout_problems

    run = runs[name]
    want = {
        "qauto": "exact route: every k = 1..N = 16 from the eigendecomposition of G_t (no bracket to draw)",
        "qautol": "exact route: k = 1..4 (the eigenpairs kept) from the eigendecomposition of G_t",
        "quad": "quadrature route: k ≤ 4 exact; shaded band = bracket at confidence 0.95",
    }[name]
    for fig_name in _BRACKETED:
        fig = make_figure(run, fig_name)
        caption = " ".join(fig.get_supxlabel().split("\n"))
        assert caption.startswith(want), (fig_name, caption)
        assert not layout_problems(fig), (fig_name, layout_problems(fig))


def test_bracket_widths_takes_one_phi_as_a_string(runs: dict[str, Run]) -> None:
    run = runs["quad"]
    one = run.bracket_widths("residual")
    assert set(one["phi"]) == {"residual"} and len(one) == len(run.steps)
    both = run.bracket_widths(("y", "residual"))
    np.testing.assert_array_equal(one["width"].to_numpy(), both[both["phi"] == "residual"]["width"].to_numpy())
    with pytest.raises(ValueError, match="phi='bogus' is not one of"):
        run.bracket_widths("bogus")


def test_a_run_is_found_by_its_exact_name_before_an_id_prefix(store_url: str, capsys: pytest.CaptureFixture) -> None:
    """ "qauto" is a prefix of both qauto-… and qautol-…, but exactly one run is named qauto: an exact
    id first, then an exact name, then a unique id prefix; an ambiguous prefix names its candidates."""
    from nsa_dist.serve.run_page import open_run

    c = Client(store_url)
    ids = {n: c.run(n).id for n in ("qauto", "qautol")}
    assert ids["qauto"].startswith("qauto-") and ids["qautol"].startswith("qautol-")
    assert c.run(ids["qautol"]).id == ids["qautol"] and c.run(ids["qauto"][:8]).id == ids["qauto"]
    with pytest.raises(StoreError, match=r"^2 run ids start with 'qau': qauto-\w+, qautol-\w+; give the full id$"):
        c.run("qau")
    with pytest.raises(StoreError, match="no run 'nosuch'"):
        c.run("nosuch")
    assert open_run(c.store, "qauto").id == ids["qauto"]
    assert main(["show", "qauto", "--store", store_url]) == 0
    out = capsys.readouterr().out
    assert out.startswith(ids["qauto"]) and "curves: exact route, every k = 1..N = 16 exact" in out, out
    assert main(["show", "quad", "--store", store_url]) == 0
    assert "curves: quadrature route, k = 1..4 exact, 5..24 bracketed" in capsys.readouterr().out


def test_hessian_moments_names_every_part(runs: dict[str, Run]) -> None:
    with pytest.raises(ValueError, match=r"^part='bogus' is not one of 'H', 'I', 'S', 'I_exact', 'I_limit'$"):
        runs["qauto"].hessian.moments("bogus")
    with pytest.raises(ValueError, match=r"^part='I_exact' is not one of 'H', 'I', 'S'$"):
        runs["qauto"].hessian.top("I_exact")  # the top eigenvalues are of H, I and S only


def test_an_unknown_sweep_reads_without_quotes(store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(KeyError) as info:  # still a KeyError for callers that catch one
        Client(store_url).sweep("nosuch")
    assert str(info.value) == f"no sweep 'nosuch' in {store_url!r} (sweeps: nt)"
    assert main(["plot", "--sweep", "nosuch", "--store", store_url, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"nsa plot: error: no sweep 'nosuch' in {store_url!r} (sweeps: nt)\n"


def test_the_show_line_says_the_route_the_exact_top_and_the_bracket(runs: dict[str, Run]) -> None:
    from nsa_dist._show import curves_line

    assert curves_line(runs["qauto"]) == (
        "curves: exact route, every k = 1..N = 16 exact (eigendecomposition of G_t; no bracket)"
    )
    assert curves_line(runs["qautol"]) == (
        "curves: exact route, k = 1..4 exact (the eigenpairs kept, spectrum.k; no bracket)"
    )
    assert curves_line(runs["quad"]) == (
        "curves: quadrature route, k = 1..4 exact, 5..24 bracketed (λ_k's statistical, confidence 0.95; "
        "Run.curve_bracket says how the brackets hold)"
    )


def test_the_bracket_note_is_grey_and_a_caveat_stays_red(runs: dict[str, Run]) -> None:
    from nsa_dist.serve._nsa_panels import NOTE_GREY, Energy, Fig1e, Fig2a, Fig2b

    run = runs["quad"]
    for panel in (Fig2a(run), Fig2b(run), Energy(run)):
        panel.update(panel.guarded(run))
        assert panel.note.visible and panel.note.text.startswith("quadrature route"), panel.title
        assert panel.note.styles["color"] == NOTE_GREY, panel.title
    assert Fig1e(run).note.styles["color"] == "#b00020"  # gd_note: a caveat on the figure


def test_a_sweep_without_test_points_says_why_fig7c_is_left_out(
    store_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from nsa_dist.plots.sweep import plot_sweep

    sweep = Client(store_url).sweep("nt")
    with caplog.at_level(logging.WARNING, logger="nsa_dist.plots"):
        paths = plot_sweep(sweep, tmp_path)
    assert "fig7c_test_loss.png" not in {p.name for p in paths} and "fig7a_energy_y.png" in {p.name for p in paths}
    # the Hessian figures of a sweep without a Hessian are left out quietly unless named
    assert [r.getMessage() for r in caplog.records] == [
        "sweep 'nt': fig7c_test_loss not drawn: its runs have no test points (data.n_test)"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nsa_dist.plots"):
        assert plot_sweep(sweep, tmp_path, figures=["hessian_regimes"]) == []
    assert [r.getMessage() for r in caplog.records] == [
        "sweep 'nt': hessian_regimes not drawn: its runs record no Hessian (the spec's hessian block)"
    ]


def test_a_run_stored_before_a_new_spec_check_still_opens(store_url: str, tmp_path: Path) -> None:
    """Spec checks added later (phi_width needs phi_steps, images within quadrature.top) refuse new
    specs, never a stored run's: the reader validates the stored spec with ``context={"stored": True}``."""
    import json
    import shutil

    from pydantic import ValidationError

    url = str(tmp_path / "copy.zarr")
    shutil.copytree(store_url, url)
    rid = Client(url).run("quad").id
    meta = Path(url) / "runs" / rid / "zarr.json"
    doc = json.loads(meta.read_text())
    spectrum = doc["attributes"]["spec"]["spectrum"]
    spectrum["images"] = [1, 50]  # beyond top 4
    spectrum["quadrature"]["phi_width"] = 0.01  # without phi_steps
    meta.write_text(json.dumps(doc))
    with pytest.raises(ValidationError, match="phi_width needs"):
        ExperimentSpec.model_validate(doc["attributes"]["spec"])
    run = Client(url).run(rid)
    assert run.spec.spectrum.images == [1, 50] and run.energy("y", 24, step=int(run.steps[-1]))[0] == 1.0
