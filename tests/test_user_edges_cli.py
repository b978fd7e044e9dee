"""What new users met at the CLI's edges: each bad input refused in one line naming the cause and
the way out, before any store is touched, and each message true to what the command did."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from nsa_dist.cli import main as nsa
from nsa_dist.client import Client

REPO = Path(__file__).resolve().parents[1]
TINY = {"name": "e", "data": {"name": "image2d", "n": 64}, "model": {"depth": 2, "width": 16}, "steps": 2}
QUAD = {
    "name": "q",
    "data": {"name": "image2d", "n": 300},
    "model": {"depth": 3, "width": 32},
    "steps": 10,
    "record": {"steps": [0, 9]},
    "spectrum": {"k": "all", "energy": "quadrature", "quadrature": {"top": 16, "lanczos_steps": 30, "probes": 8}},
}


def _spec(tmp_path: Path, spec: dict, name: str = "spec.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(spec))
    return p


def _err(capsys) -> list[str]:
    """stderr's lines, progress and log lines (``[nsa] …``) aside."""
    return [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("[nsa] ")]


# ---------------------------------------------------------------------------- spec validation
def test_phi_width_without_phi_steps_is_an_invalid_spec_before_the_store(tmp_path, capsys):
    """It passed validation, and the run was created and failed at its first step."""
    spec = {**TINY, "spectrum": {"k": "all", "energy": "quadrature", "quadrature": {"top": 8, "phi_width": 0.05}}}
    store = tmp_path / "s.zarr"
    assert nsa(["run", str(_spec(tmp_path, spec)), "--store", str(store)]) == 2
    err = _err(capsys)
    assert err[0].endswith("invalid experiment spec") and len(err) == 2, err
    assert err[1].strip().startswith("spectrum.quadrature.phi_width: phi_width needs spectrum.quadrature.phi_steps")
    assert not store.exists()
    ok = {**spec, "spectrum": {**spec["spectrum"], "quadrature": {"top": 8, "phi_width": 0.05, "phi_steps": 0}}}
    from nsa_dist.specfile import load_spec

    assert load_spec(_spec(tmp_path, ok, "ok.yaml")).spectrum.quadrature.phi_width == 0.05


@pytest.mark.parametrize("steps", [2**63, 10**23])
def test_a_number_of_steps_no_run_can_take_is_an_invalid_spec_before_the_store(tmp_path, capsys, steps):
    """2**63 passed, the run was created and broke in its plan (OverflowError, a run pending 0/21 left in
    the store); 10**23 a TypeError in the record grid's geomspace (an audit)."""
    store = tmp_path / "s.zarr"
    assert nsa(["run", str(_spec(tmp_path, {**TINY, "steps": steps})), "--store", str(store)]) == 2
    err = _err(capsys)
    assert err[0].endswith("invalid experiment spec") and len(err) == 2, err
    assert err[1].strip().startswith("steps: Input should be less than or equal to 1000000000000000"), err
    assert not store.exists()


def test_an_empty_data_path_is_an_invalid_spec(tmp_path, capsys):
    """``data.path: ''`` passed: mnist looked for its files "in ''", image2d read "'.' is a directory" (an audit)."""
    spec = {**TINY, "data": {**TINY.get("data", {}), "path": ""}}
    assert nsa(["run", str(_spec(tmp_path, spec)), "--store", str(tmp_path / "s.zarr")]) == 2
    err = _err(capsys)
    assert len(err) == 2 and err[1].strip() == "data.path: String should have at least 1 character (got '')", err


def test_a_sweep_whose_grid_repeats_an_experiment_says_it_runs_once(tmp_path, capsys):
    """``model.width: [8, 8]`` silently became one run (an audit).  Said before anything runs (here the
    data path is missing, so nothing does)."""
    base = {**TINY, "data": {"name": "image2d", "n": 16, "path": str(tmp_path / "absent.png")}}
    sweep = {"name": "twice", "base": base, "grid": {"model.width": [8, 8, 12]}}
    assert nsa(["sweep", str(_spec(tmp_path, sweep)), "--store", str(tmp_path / "s.zarr")]) == 2
    err = capsys.readouterr().err
    assert "[nsa] sweep twice: 3 grid points are 2 distinct experiments; each runs once" in err, err
    assert "absent.png" in err, err


def test_a_sweep_says_its_base_name_names_no_run(tmp_path, capsys):
    """Audit D: base.name (a spec copied under ``base:``) was dropped without a word."""
    base = {**TINY, "data": {"name": "image2d", "n": 16, "path": str(tmp_path / "absent.png")}}
    sweep = {"name": "sw", "base": base, "grid": {"seed": [0, 1]}}
    assert nsa(["sweep", str(_spec(tmp_path, sweep)), "--store", str(tmp_path / "s.zarr")]) == 2
    err = capsys.readouterr().err
    assert "[nsa] sweep sw: base.name 'e' names no run — the runs are named sw__<field>-<value>" in err, err


def test_a_misspelt_field_in_a_sweep_is_one_line_like_in_a_spec(tmp_path, capsys):
    """A typo in a sweep's grid or base was a raw pydantic dump (``model.fc.widht``, a URL)."""
    sweep = yaml.safe_load((REPO / "examples" / "sweep_tiny.yaml").read_text())
    grid = {**sweep, "grid": {"model.depth": [2], "model.widht": [32]}}
    base = {**sweep, "base": {**sweep["base"], "stepz": 30}}
    for name, bad, said in (
        ("grid", grid, "model.widht: Extra inputs are not permitted (got 32); did you mean 'width'?"),
        ("base", base, "stepz: Extra inputs are not permitted (got 30); did you mean 'steps'?"),
    ):
        assert nsa(["sweep", str(_spec(tmp_path, bad, f"{name}.yaml")), "--store", str(tmp_path / "s")]) == 2
        err = _err(capsys)
        assert len(err) == 2 and err[0].endswith("invalid sweep spec"), err
        assert err[1].startswith("  sweep run 'tinysweep__") and said in err[1], err
        assert "pydantic" not in err[1] and ".fc." not in err[1] and "(allowed here: " in err[1], err
    typo = {**TINY, "model": {"depth": 2, "widht": 32}}
    assert nsa(["run", str(_spec(tmp_path, typo)), "--store", str(tmp_path / "s")]) == 2
    err = _err(capsys)
    assert err[1] == (
        "  model.widht: Extra inputs are not permitted (got 32); did you mean 'width'? (allowed here: input_dim, "
        "output_dim, depth, width, activation, negative_slope, init, bias_scale, residual, regime)"
    ), err


def test_images_beyond_quadrature_top_are_an_invalid_spec(tmp_path, capsys):
    """They were dropped silently: only image [1] of [1, 50, 150] was stored."""
    from nsa_dist.config import ExperimentSpec

    spectrum = {"k": "all", "energy": "quadrature", "quadrature": {"top": 10}, "images": [1, 50, 150]}
    assert nsa(["run", str(_spec(tmp_path, {**TINY, "spectrum": spectrum})), "--store", str(tmp_path / "s")]) == 2
    err = _err(capsys)
    assert len(err) == 2 and "spectrum.images [50, 150] are beyond spectrum.quadrature.top=10" in err[1], err
    free = {"k": "all", "layout": "matrix_free", "workers": 2, "quadrature": {"top": 10}, "images": [50]}
    with pytest.raises(ValueError, match=r"spectrum.images \[50\] are beyond spectrum.quadrature.top=10"):
        ExperimentSpec.model_validate({**TINY, "spectrum": free})  # energy: auto off local is quadrature too
    # the default list (drawn up to the top), the exact route, and a spec read back from a store pass
    ExperimentSpec.model_validate({**TINY, "spectrum": {**spectrum, "images": [1, 10]}})
    ExperimentSpec.model_validate({**TINY, "spectrum": {k: v for k, v in spectrum.items() if k != "images"}})
    ExperimentSpec.model_validate({**TINY, "spectrum": {"k": "all", "energy": "exact", "images": [50]}})
    ExperimentSpec.model_validate({**TINY, "spectrum": spectrum}, context={"stored": True})


def test_a_directory_as_spec_file_is_named_as_one(tmp_path, capsys):
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "a.yaml").write_text("name: a\n")
    assert nsa(["run", str(tmp_path / "specs")]) == 2
    assert _err(capsys) == [
        f"nsa run: error: spec file {str(tmp_path / 'specs')!r} is a directory; give a YAML spec file (it holds a.yaml)"
    ]


# ---------------------------------------------------------------------------- memory and layout
def test_the_budget_refusal_of_an_exact_k_all_says_what_helps_in_readable_sizes(tmp_path, capsys):
    """It advised more spectrum.workers, which cannot help (energy: exact keeps G whole)."""
    spec = {
        **TINY,
        "data": {"name": "image2d", "n": 300},
        "spectrum": {"k": "all", "energy": "exact", "layout": "auto", "memory_budget_gb": 0.0001, "workers": 2},
    }
    assert nsa(["run", str(_spec(tmp_path, spec)), "--store", str(tmp_path / "s.zarr")]) == 2
    (line,) = _err(capsys)
    assert "its Gram needs ~1.58 MB per worker even as local" in line and "memory_budget_gb=0.0001 (100 kB)" in line
    assert "raise the budget or lower data.n" in line and "energy: quadrature or auto" in line, line
    assert "workers" not in line and not (tmp_path / "s.zarr").exists(), line
    from nsa_dist.pipeline.layout import size_text

    assert [size_text(b) for b in (512, 5.39e5, 1.58e6, 9.99e7, 3.2e9)] == [
        "512 B",
        "539 kB",
        "1.58 MB",
        "99.9 MB",
        "3.2 GB",
    ]


def test_a_layout_the_spec_did_not_set_is_said_to_be_the_default():
    from nsa_dist.config import ExperimentSpec
    from nsa_dist.pipeline.layout import choose_layout

    default = choose_layout(ExperimentSpec.model_validate(TINY), 64, 40)
    given = choose_layout(ExperimentSpec.model_validate({**TINY, "spectrum": {"layout": "block_rows"}}), 64, 40)
    # decided by value (a sweep's runs carry every field; the stored reason must not depend on how the
    # run was submitted: tests/test_bit_identical.py)
    dumped = ExperimentSpec.model_validate(ExperimentSpec.model_validate(TINY).model_dump(mode="json"))
    assert (default.reason, given.reason) == ("the default", "set in the spec")
    assert choose_layout(dumped, 64, 40).reason == "the default"


# ---------------------------------------------------------------------------- a run's log lines
@pytest.fixture(scope="module")
def quad_run(tmp_path_factory) -> tuple[str, str]:
    """The small quadrature run of QUAD: (store, its stderr)."""
    tmp = tmp_path_factory.mktemp("quad")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert nsa(["run", str(_spec(tmp, QUAD)), "--store", str(tmp / "q.zarr"), "--plain"]) == 0
    return str(tmp / "q.zarr"), err.getvalue()


def test_nsa_run_shows_the_pipelines_log_lines_once(quad_run, capsys):
    """The CLI configured no logging: docs/curves.md's line for a bracket wider than 0.02 was lost."""
    store, err = quad_run
    widths = [ln for ln in err.splitlines() if "bracket is widest at k = " in ln]
    assert widths and all(ln.startswith("[nsa] step ") for ln in widths), err
    assert any(ln.startswith("[nsa] step 0: E(residual, k)'s bracket is widest at k = ") for ln in widths), err
    assert len(widths) == len(set(widths)), err  # no line twice
    assert "[nsa] spectrum layout: local (the default)" in err
    from nsa_dist.cli import _LogLine

    log = logging.getLogger("nsa_dist")  # put back after the command
    assert not any(isinstance(h, _LogLine) for h in log.handlers) and log.level == logging.NOTSET
    capsys.readouterr()
    rid = next(p.name for p in (Path(store) / "runs").iterdir() if p.is_dir())
    assert nsa(["show", rid, "--store", store]) == 0
    out = capsys.readouterr().out
    assert "spectrum layout local (the default)" in out and "bracket, widest" in out, out


# ---------------------------------------------------------------------------- nsa verify
def test_verify_offers_mark_only_where_it_helps_and_names_the_store(quad_run, tmp_path, capsys):
    store, _ = quad_run
    chunk, meta = str(tmp_path / "chunk.zarr"), str(tmp_path / "meta.zarr")
    for url in (chunk, meta):
        shutil.copytree(store, url)
    rid = next(p.name for p in (Path(store) / "runs").iterdir() if p.is_dir())
    (Path(chunk) / "runs" / rid / "loss" / "c" / "1").write_bytes(b"junk")
    assert nsa(["verify", chunk]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"run `nsa verify {chunk} --mark` to forget the damaged steps, then re-run to recompute them"
    (Path(meta) / "runs" / rid / "zarr.json").write_text("garbage")
    assert nsa(["verify", meta]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert "--mark` to forget" not in "\n".join(out), out
    assert out[-1] == (
        "damaged metadata (a zarr.json) cannot be repaired by --mark: restore the file from a copy, or delete "
        f"the run's folder ({meta}/runs/{rid}) and re-run it"
    ), out


# ---------------------------------------------------------------------------- small messages
def test_a_plain_sweep_line_shows_a_dash_for_what_is_not_measured_yet(capsys):
    from nsa_dist.cli import _SweepTable

    run = SimpleNamespace(run_id="s__a", status="running", done=0, total=4, step=None, loss=None, lambda_max=None)
    with _SweepTable("s", plain=True) as table:
        table.update([run])
    assert capsys.readouterr().out == "[nsa] s__a: running 0/4 step - loss - λ_max -\n"
    # a run the re-run sweep skipped (every step stored): said so, not "step - loss - λ_max -"
    done = SimpleNamespace(run_id="s__b", status="done", done=4, total=4, step=None, loss=None, lambda_max=None)
    with _SweepTable("s", plain=True) as table:
        table.update([done])
    assert capsys.readouterr().out == "[nsa] s__b: done 4/4 (already in the store)\n"


def test_ls_on_a_folder_or_file_that_is_no_store_gives_advice_that_works(tmp_path, capsys):
    """It advised `nsa run SPEC.yaml --store figs`, which refuses such a folder."""
    (tmp_path / "figs").mkdir()
    (tmp_path / "figs" / "a.png").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("x")
    for path, kind in ((tmp_path / "figs", "a directory with other files"), (tmp_path / "notes.txt", "a file")):
        assert nsa(["ls", "--store", str(path)]) == 2
        (line,) = _err(capsys)
        assert line.startswith(f"nsa ls: error: {str(path)!r} is {kind}, not a spectrum store"), line
        assert "give the store's path with --store PATH" in line and "first)" not in line, line


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_store_that_cannot_be_created_is_named_with_the_cause(tmp_path, capsys):
    assert nsa(["run", str(_spec(tmp_path, TINY)), "--store", "/proc/nope.zarr", "--plain"]) == 2
    (line,) = _err(capsys)
    assert line.startswith("nsa run: error: store '/proc/nope.zarr': No such file or directory"), line
    assert "takes no new folders; give --store a path in a writable folder" in line, line


def test_a_lease_refusal_after_wait_says_the_wait_ran_out(tmp_path):
    from nsa_dist.store import LeaseHeld, SpectrumStore

    url = str(tmp_path / "s.zarr")
    with SpectrumStore(url).lease(["r"], ttl=30.0):
        with pytest.raises(LeaseHeld, match=r"the wait of 0\.3 s ran out; wait longer \(--wait SECONDS"):
            SpectrumStore(url).lease(["r"], wait=0.3, ttl=30.0).acquire()
        with pytest.raises(
            LeaseHeld, match=r"wait for it \(--wait; for a job, nsa submit --wait-for-writers\) or use another store$"
        ):
            SpectrumStore(url).lease(["r"], ttl=30.0).acquire()


def test_plot_refuses_a_scalar_without_sweep_and_the_help_is_complete(tmp_path, capsys):
    assert nsa(["plot", "somerun", "--out", str(tmp_path), "--scalar", "lambda_max", "--x", "model.depth"]) == 2
    assert _err(capsys) == [
        "nsa plot: error: --scalar/--x: only with --sweep NAME (across a sweep's runs), not with a RUN"
    ]
    for argv, said in (
        (["plot", "--help"], "20000 599999"),
        (["status", "--help"], "Ray dashboard address"),
        (["logs", "--help"], "the Ray Job's id"),
        (["cancel", "--help"], "Ray dashboard address"),
    ):
        with pytest.raises(SystemExit):
            nsa(argv)
        out = " ".join(capsys.readouterr().out.split())
        assert said in out and "600000" not in out, out


@pytest.mark.slow
def test_sigterm_of_nsa_serve_says_it_stopped(tmp_path):
    """A read-only server was told to "re-run the same command to resume"."""
    from nsa_dist.store import SpectrumStore

    url = str(tmp_path / "s.zarr")
    SpectrumStore(url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "nsa_dist.cli", "serve", url, "--port", "0"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        for line in proc.stdout:
            if line.startswith("nsa serve: "):
                break
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == "nsa serve: stopped (SIGTERM)", err[-3000:]


def test_ls_piped_shows_every_id_whole(tmp_path, capsys):
    """Piped, ``nsa ls`` is 80 columns wide and cut the id to ``tiny-…``, which no other command takes."""
    long = {**TINY, "name": "a-rather-long-run-name-for-a-sweep"}
    store = str(tmp_path / "s.zarr")
    assert nsa(["run", str(_spec(tmp_path, long)), "--store", store, "--plain"]) == 0
    capsys.readouterr()
    assert nsa(["ls", "--store", store]) == 0
    out = capsys.readouterr().out
    (rid,) = Client(store).runs()["id"]
    assert rid in out, out


@pytest.mark.parametrize(
    "text, where, hint",
    [
        (
            "name: a\ndata: {name: image2d, n: 64\nsteps: 2\n",
            "line 3, column 6: expected ',' or '}'",
            "while parsing a flow mapping at line 2, column 7",
        ),
        ("name: a\n\tsteps: 2\n", "line 2, column 1: found character '\\t'", "YAML indents with spaces, not tabs"),
    ],
)
def test_a_yaml_syntax_error_is_one_line_naming_where(tmp_path, capsys, text, where, hint):
    """PyYAML's text took 6 lines and named "<unicode string>" instead of the file."""
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    assert nsa(["run", str(p), "--store", str(tmp_path / "s.zarr")]) == 2
    err = _err(capsys)
    assert len(err) == 1 and "bad.yaml: not valid YAML: " in err[0], err
    assert where in err[0] and hint in err[0] and "unicode string" not in err[0], err
    assert not (tmp_path / "s.zarr").exists()


def test_a_union_field_is_refused_in_one_line_with_a_guess(tmp_path, capsys):
    """``spectrum.k: al`` printed pydantic's two union branches (``spectrum.k.int``, ``spectrum.k.literal['all']``)."""
    for value, said in (
        ("al", "spectrum.k: expected an integer or 'all' (got 'al'); did you mean 'all'?"),
        ("2.5", "spectrum.k: expected an integer or 'all' (got 2.5)"),
        ("1e3", "spectrum.k: expected an integer or 'all' (got '1e3'); YAML reads 1e3 as text, not a number: write"),
    ):
        p = tmp_path / "k.yaml"
        p.write_text(yaml.safe_dump(TINY)[:-1] + f"\nspectrum: {{k: {value}}}\n")
        assert nsa(["run", str(p), "--store", str(tmp_path / "s.zarr")]) == 2
        err = capsys.readouterr().err
        assert said in err and ".int" not in err and "literal[" not in err, err
    assert not (tmp_path / "s.zarr").exists()


def test_a_misspelt_factory_key_is_said_as_such(tmp_path, capsys):
    """``factroy:`` was taken for a net's block: every factory key (``kwargs`` too) was blamed, no
    guess was offered, and the allowed list was the net's."""
    spec = {**TINY, "model": {"factroy": "nsa_dist.models:cnn", "kwargs": {"width": 4}}}
    assert nsa(["run", str(_spec(tmp_path, spec)), "--store", str(tmp_path / "s.zarr")]) == 2
    err = capsys.readouterr().err
    assert "model.factroy: Extra inputs are not permitted" in err and "did you mean 'factory'?" in err, err
    assert "model.kwargs" not in err and "depth" not in err, err
    assert "(allowed here: factory, kwargs, input_dim, output_dim, output)" in err, err  # not the Tracker's `source`


def test_a_flag_after_a_command_is_refused_with_that_commands_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        nsa(["show", "somerun", "--bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: nsa show ") and "nsa show: error: unrecognized arguments: --bogus" in err, err


def test_every_command_says_what_it_does_and_each_argument():
    """Most commands' ``--help`` began with "positional arguments:", and ``run``, ``spec``, ``--out``,
    ``--job-id`` and the stores of verify/serve had no word of help."""
    import argparse

    from nsa_dist.cli import _parser

    (sub,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    missing = []
    for name, cmd in sub.choices.items():
        if not cmd.description:
            missing.append(f"nsa {name}: no description")
        for a in cmd._actions:
            if a.help is None:
                missing.append(f"nsa {name} {'/'.join(a.option_strings) or a.dest}: no help")
    assert not missing, "\n".join(missing)


def test_a_misspelt_array_name_gets_a_guess_and_the_runs_arrays(tmp_path, capsys):
    store = str(tmp_path / "s.zarr")
    assert nsa(["run", str(_spec(tmp_path, TINY)), "--store", store, "--plain"]) == 0
    long = {**TINY, "name": "a-rather-long-run-name-for-a-sweep"}
    assert nsa(["run", str(_spec(tmp_path, long)), "--store", store, "--plain"]) == 0
    run = Client(store).run("e")
    with pytest.raises(Exception, match="no array 'gram_sq_frob'; did you mean 'gram_sq_frobenius'") as exc:
        run.per_step("gram_sq_frob")
    assert "— it has: X, " in str(exc.value) and "eigenvalues" in str(exc.value), exc.value
    capsys.readouterr()
    assert nsa(["status", "--store", store]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 2 and len({row.index(" done ") for row in rows}) == 1, rows  # one column
