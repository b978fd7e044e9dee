"""What a researcher writes and types, taken as written: a YAML spec that PyYAML (YAML 1.1) or
pydantic would silently read as another experiment is refused in one line naming the field and
line; a setting the run would ignore is refused; a CLI option the command would drop or mis-read
is a usage error; and a valid spec runs exactly the schedule it states (checked against a float64
reference NTK of an independently re-trained network)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch.func import functional_call, jacrev

from nsa_dist.cli import _parser, main as nsa
from nsa_dist.specfile import SpecError, load_spec, load_sweep

TINY = "name: t\ndata: {name: image2d, n: 24}\nmodel: {depth: 2, width: 8}\nsteps: 4\n"


def _file(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _refused(tmp_path: Path, text: str, capsys) -> str:
    """`nsa run` of ``text``: exit 2, one message (a line per problem), no store; returns stderr."""
    store = tmp_path / "s.zarr"
    rc = nsa(["run", str(_file(tmp_path, text)), "--store", str(store)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("[nsa] ")]
    assert rc == 2, f"exit {rc} (expected 2, refused) for spec {text!r}; stderr: {err!r}"
    assert lines and lines[0].startswith("nsa run: error: "), f"not one error message: {lines}"
    assert "Traceback" not in err, err
    assert not store.exists(), f"a refused spec created the store {store}"
    return err


def _loaded(tmp_path: Path, text: str) -> str:
    """The spec ``load_spec`` made of ``text`` (non-default fields), for failure messages."""
    try:
        return repr(load_spec(_file(tmp_path, text, "probe.yaml")).model_dump(mode="json", exclude_defaults=True))
    except SpecError as exc:
        return f"refused: {exc}"


# ---------------------------------------------------------------------------- YAML 1.1's silent readings
def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path, capsys):
    """PyYAML kept the last value: `steps: 4` then `steps: 2` ran 2 steps, with no word."""
    text = TINY + "seed: 3\nsteps: 2\n"
    assert "refused" in _loaded(tmp_path, text), f"a duplicate 'steps' was read as {_loaded(tmp_path, text)}"
    err = _refused(tmp_path, text, capsys)
    assert "line 6" in err and "'steps' is given twice" in err and "first at line 4" in err, err
    nested = "name: t\ndata: {name: image2d, n: 24, n: 48}\n"
    assert "'n' is given twice" in _loaded(tmp_path, nested), _loaded(tmp_path, nested)
    merged = "name: t\ndata: &d {name: image2d, n: 24}\nmodel: {<<: {depth: 2, width: 8}, width: 4}\n"
    assert "'width': 4" in _loaded(tmp_path, merged), f"a '<<' merge override was refused: {_loaded(tmp_path, merged)}"


@pytest.mark.parametrize(
    "line, meant, read",
    [("steps: 010", 10, 8), ("seed: 0755", 755, 493), ("steps: 1:30", 90, 90)],
)
def test_a_leading_zero_or_base60_number_is_refused_not_read_as_another(tmp_path, capsys, line, meant, read):
    """YAML 1.1: `010` is octal 8, `1:30` is 90 (base 60); the run silently took those values."""
    text = TINY.replace("steps: 4\n", "") + line + "\n"
    got = _loaded(tmp_path, text)
    assert got.startswith("refused"), f"{line!r} was read as {got} (YAML 1.1 value {read})"
    err = _refused(tmp_path, text, capsys)
    assert "line 4" in err and str(read) in err, f"the message names neither the line nor the value {read}: {err}"
    if ":" not in line:
        assert f"write {meant}" in err, err
    quoted = TINY.replace("steps: 4\n", "") + line.replace(": ", ": '") + "'\n"
    if ":" not in line:  # quoted, it is the decimal number the author meant
        key = line.split(":")[0]
        assert f"'{key}': {meant}" in _loaded(tmp_path, quoted), _loaded(tmp_path, quoted)


@pytest.mark.parametrize(
    "text, field",
    [
        (TINY.replace("steps: 4", "steps: yes"), "steps"),
        (TINY.replace("width: 8", "width: on"), "model.width"),
        (TINY + "spectrum: {k: true, images: []}\n", "spectrum.k"),
        (TINY + "record: {steps: [0, yes]}\n", "record.steps"),
        (TINY + "schedule: {lr: on}\n", "schedule.lr"),
    ],
)
def test_a_yaml_boolean_where_a_number_belongs_is_refused(tmp_path, capsys, text, field):
    """pydantic took True for 1: `steps: yes` ran one step, `width: on` a width-1 network."""
    got = _loaded(tmp_path, text)
    assert got.startswith("refused"), f"{field}: a YAML boolean was read as the number 1: {got}"
    err = _refused(tmp_path, text, capsys)
    assert f"  {field}: a boolean where a number belongs" in err, err
    ok = TINY + "spectrum: {test_points: no, store_eigenvectors: yes, images: []}\n"  # real booleans stay
    assert not _loaded(tmp_path, ok).startswith("refused"), _loaded(tmp_path, ok)


@pytest.mark.parametrize(
    "block, field",
    [
        ("schedule: {lr: .inf}", "schedule.lr"),
        ("model: {depth: 2, width: 8, bias_scale: .inf}", "model.bias_scale"),
        ("spectrum: {fourier_limit: .inf, images: []}", "spectrum.fourier_limit"),
        ("optimizer: {name: adam, betas: [.nan, 0.9]}", "optimizer.betas.0"),
    ],
)
def test_an_infinite_or_nan_number_is_refused(tmp_path, capsys, block, field):
    """`lr: .inf` passed `gt=0` and the run trained to NaN."""
    text = TINY.replace("model: {depth: 2, width: 8}\n", "") + block + "\n"
    got = _loaded(tmp_path, text)
    assert got.startswith("refused"), f"{field}: a non-finite value was accepted: {got}"
    err = _refused(tmp_path, text, capsys)
    assert f"  {field}: Input should be a finite number" in err, err


def test_an_integer_written_with_an_exponent_says_how_to_write_it(tmp_path, capsys):
    """`steps: 1e3` is the string '1e3' in YAML 1.1 (no dot): the message said only "unable to parse"."""
    err = _refused(tmp_path, TINY.replace("steps: 4", "steps: 1e3"), capsys)
    assert "steps:" in err and "write 1000" in err, err
    assert "'lr': 0.001" in _loaded(tmp_path, TINY + "schedule: {lr: 1e-3}\n")  # a float field reads it


# ---------------------------------------------------------------------------- settings the run would ignore
@pytest.mark.parametrize(
    "block, says",
    [
        ("schedule: {lr: 0.25, decay: 0.5}", "schedule.decay=0.5 needs schedule.every"),
        ("schedule: {lr: 0.25, every: 2}", "schedule.every=2 needs schedule.decay < 1"),
        ("optimizer: {name: adam, momentum: 0.9}", "optimizer.momentum=0.9 is not used by 'adam'"),
        ("optimizer: {name: gd, betas: [0.5, 0.5]}", "optimizer.betas is Adam's; 'gd' does not use it"),
        ("optimizer: {name: sgd, batch_size: 8, eps: 0.1}", "optimizer.eps is Adam's; 'sgd' does not use it"),
        ("optimizer: {name: adam, betas: [1.5, 0.9]}", "optimizer.betas must each be in [0, 1)"),
        ("hessian: {every: 2, steps: [0]}", "hessian: give every or steps, not both"),
        ("data:\n#  name: mnist", "data: the `data:` block is empty (YAML read null)"),
        ("spectrum: {test_points: true, images: []}", "spectrum.test_points=true needs test points"),
        ("spectrum: {per_class_k: 3, images: []}", "spectrum.per_class_k=3: per-class spectra are of K-output"),
        ("spectrum: {gram_change_k: 2, store_eigenvectors: false}", "spectrum.gram_change_k=2 is measured at"),
        ("model:", "model: the `model:` block is empty (YAML read null) — give its fields indented under it, e.g."),
        # audit D: the orthogonality and every standard error were NaN at every step, the run done
        ("hessian: {probes: 1}", "hessian.probes: 1 — the orthogonality estimate needs at least 2 probes"),
    ],
)
def test_a_setting_the_run_would_not_use_is_refused(tmp_path, capsys, block, says):
    """Each of these validated and ran another experiment than written: a constant lr for a decay
    without `every`, Adam without the momentum given, GD ignoring betas, the Hessian at the steps
    ignoring `every`, the default image2d data for an emptied `data:` block, no test Gram for
    test_points without test points, no per-class spectra of one output, no App. F change without
    eigenvector steps."""
    base = TINY.replace("model: {depth: 2, width: 8}\n", "") if block.startswith("model") else TINY
    base = base.replace("data: {name: image2d, n: 24}\n", "") if block.startswith("data") else base
    text = base + block + "\n"
    got = _loaded(tmp_path, text)
    assert got.startswith("refused"), f"{block!r} was accepted as {got}"
    err = _refused(tmp_path, text, capsys)
    assert says in err, f"expected {says!r} in {err!r}"


def test_stored_specs_of_those_settings_stay_readable():
    """A run stored before a check was added is read back (``context={"stored": True}``)."""
    from nsa_dist.config import ExperimentSpec

    raw = {"schedule": {"lr": 0.25, "decay": 0.5}, "optimizer": {"name": "adam", "momentum": 0.9}, "steps": 4}
    spec = ExperimentSpec.model_validate(raw, context={"stored": True})
    assert (spec.schedule.decay, spec.optimizer.momentum) == (0.5, 0.9), spec


# ---------------------------------------------------------------------------- sweeps
@pytest.mark.parametrize(
    "extra, says, runs_before",
    [
        ("grid: {name: [a, b]}", "grid.name: a sweep names its runs itself", 1),
        ("grid: {model.width: [4, 8]}\nvariants: [{model.width: 16}]", "variants[0] sets model.width", 1),
        ("grid: {model: [{depth: 2}, {depth: 3}]}\nvariants: [{model.width: 4}]", "variants[0] sets model.width", 1),
    ],
)
def test_a_sweep_whose_runs_would_merge_silently_is_refused(tmp_path, extra, says, runs_before):
    """A grid over `name`, or a variant setting a field the grid sweeps, collapsed the grid's runs
    into one (deduplicated), with no word."""
    text = "name: sw\nbase: {data: {n: 20}, model: {depth: 2, width: 4}, steps: 3}\n" + extra + "\n"
    p = _file(tmp_path, text, "sweep.yaml")
    try:
        runs = [r.name for r in load_sweep(p).expand()]
    except SpecError as exc:
        assert says in str(exc), f"expected {says!r} in {exc}"
        return
    pytest.fail(f"{extra!r}: accepted as {len(runs)} run(s) {runs} instead of refused")


# ---------------------------------------------------------------------------- command-line options
@pytest.mark.parametrize(
    "argv, says",
    [
        (["sweep", "x.yaml", "--max-runs", "0"], "--max-runs: 0 is out of range"),  # 0 meant the default 1000
        (["sweep", "x.yaml", "--max-runs", "-3"], "--max-runs: -3 is out of range"),
        (["run", "x.yaml", "--wait", "-5"], "--wait: -5 seconds"),  # -5 meant "wait for ever"
        (["serve", "s.zarr", "--port", "70000"], "--port: 70000 is out of range"),  # an AssertionError, exit 1
        (["plot", "r", "--out", "o", "--figures"], "--figures: expected at least one argument"),  # drew nothing, exit 0
    ],
)
def test_an_option_value_the_command_would_misread_is_a_usage_error(capsys, argv, says):
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        err = capsys.readouterr().err
        assert exc.code == 2 and says in err, f"exit {exc.code}, stderr {err!r}; expected {says!r}"
        return
    pytest.fail(f"`nsa {' '.join(argv)}` parsed as {vars(args)} instead of a usage error ({says!r})")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--step", "2"], "--step: only with a RUN"),
        (["--pair", "0", "3"], "--pair: only with a RUN"),
        (["--k", "5", "10"], "--k with --sweep takes one k"),
        (["--x", "model.depth"], "--x / --line: only with --scalar"),
    ],
)
def test_plot_refuses_options_a_sweep_figure_would_drop(tmp_path, capsys, argv, says):
    """With --sweep, --step / --pair / all but the first --k / --x without --scalar were dropped."""
    rc = nsa(["plot", "--sweep", "sw", "--out", str(tmp_path / "o"), "--store", str(tmp_path / "none.zarr"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and says in err, f"exit {rc}, stderr {err!r}; expected {says!r}"


# ---------------------------------------------------------------------------- one real run
LR, DECAY, EVERY, STEPS, N = 0.05, 0.5, 3, 8, 24
RUN_SPEC = f"""\
name: ref
seed: 5
data: {{name: image2d, n: {N}}}
model: {{depth: 3, width: 16}}
steps: {STEPS}
schedule: {{lr: 5e-2, decay: {DECAY}, every: {EVERY}}}   # lr written as YAML 1.1 text "5e-2"
record: {{steps: [6, 2, 2]}}                            # unsorted, repeated: steps 0, 2, 6, 7
spectrum: {{k: {N}, images: []}}
"""


@pytest.fixture(scope="module")
def ref_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    spec_path = d / "ref.yaml"
    spec_path.write_text(RUN_SPEC)
    store = str(d / "s.zarr")  # Client(Path) is a TypeError (store.keys: `"://" in url`)
    assert nsa(["run", str(spec_path), "--store", store, "--plain"]) == 0
    from nsa_dist.client import Client

    (rid,) = Client(store).runs()["id"]
    return spec_path, store, Client(store).run(rid)


def test_a_valid_spec_runs_the_schedule_it_states_against_a_float64_ntk(ref_run, capsys):
    """The stored spec is the one written; lr_t = 0.05·0.5^⌊t/3⌋ at each recorded step; and the
    stored eigenvalues of G_t equal a float64 jacrev NTK of the network re-trained here by plain GD."""
    from nsa_dist.data.registry import load_dataset
    from nsa_dist.models import build_model

    spec_path, store, run = ref_run
    spec = load_spec(spec_path)
    assert run.spec == spec, f"stored spec differs:\n{run.spec}\nvs written\n{spec}"
    steps = [int(t) for t in run.steps]
    assert steps == [0, 2, 6, 7], f"recorded steps {steps}, expected [0, 2, 6, 7]"
    want_lr = np.array([LR * DECAY ** (t // EVERY) for t in steps])
    np.testing.assert_allclose(run.lr, want_lr, rtol=1e-12, err_msg="stored lr_t vs 0.05·0.5^⌊t/3⌋")

    data = load_dataset(spec.data, seed=spec.seed)
    X = torch.as_tensor(data.X, dtype=torch.float32)
    y = torch.as_tensor(np.asarray(data.y), dtype=torch.float32)
    model = build_model(spec.model, seed=spec.seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    X64 = X.double()
    shown: dict[int, tuple[float, float]] = {}
    for t in range(STEPS):
        if t in steps:
            m64 = build_model(spec.model).double()
            m64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
            params = {k: p.detach() for k, p in m64.named_parameters()}
            J = jacrev(lambda p, m=m64: functional_call(m, p, (X64,)))(params)
            J = torch.cat([j.reshape(N, -1) for j in J.values()], dim=1)
            lam, V = np.linalg.eigh((J @ J.T).numpy())
            ref, V = lam[::-1], V[:, ::-1]
            got = np.asarray(run.eigenvalues[steps.index(t)], dtype=np.float64)
            top = slice(0, 8)  # the well-separated top of G_t
            diff = np.abs(got[top] - ref[top]) / ref[0]
            assert diff.max() < 1e-6, f"t={t}: λ stored {got[top]} vs float64 reference {ref[top]} (rel {diff})"
            yv = y.double().numpy()
            E_ref = np.cumsum((V.T @ yv) ** 2) / (yv @ yv)
            E_got = np.asarray(run.energy("y")[steps.index(t)], dtype=np.float64)
            dE = np.abs(E_got[top] - E_ref[top])
            assert dE.max() < 1e-6, f"t={t}: E(y, k≤8) stored {E_got[top]} vs float64 reference {E_ref[top]} ({dE})"
            shown[t] = (ref[0], E_ref[4])
        for g in opt.param_groups:
            g["lr"] = LR * DECAY ** (t // EVERY)
        opt.zero_grad()
        loss = 0.5 * ((model(X) - y) ** 2).mean()
        loss.backward()
        opt.step()

    # `nsa show` prints λ_max and E(y, 5) at the first and last recorded steps: those numbers
    assert nsa(["show", run.id, "--store", store]) == 0
    out = capsys.readouterr().out
    rows = {ln.split("│")[1].strip(): ln.split("│")[2:4] for ln in out.splitlines() if ln.count("│") >= 4}
    for name, j in (("λ_max", 0), ("E(y, 5)", 1)):
        printed = [float(c.strip()) for c in rows[name]]
        want = [shown[0][j], shown[STEPS - 1][j]]
        np.testing.assert_allclose(printed, want, rtol=2e-4, atol=1e-4, err_msg=f"nsa show's {name} row vs float64")
    # four significant digits of every stored number, however small (a fixed 4 decimals showed
    # an E(y, 1) of 9.6e-06 as 0.0000)
    ends, E = [0, len(run.steps) - 1], run.energy("y")
    stored = {f"E(y, {k})": E[ends, k - 1] for k in (1, 5, 10, 20, 50) if k <= E.shape[1]}
    stored |= {"alignment": run.alignment["raw"][ends], "first-order error": run.first_order["error"][ends]}
    for name, want in stored.items():
        printed = [float(c.strip()) for c in rows[name]]
        np.testing.assert_allclose(printed, want, rtol=6e-4, atol=0, err_msg=f"nsa show's {name} row vs the store")


def test_status_of_a_job_and_a_store_at_once_is_refused(ref_run, capsys):
    """`nsa status JOB --store S` listed the store and dropped JOB, exit 0."""
    _, store, _ = ref_run
    rc = nsa(["status", "somejob", "--store", str(store)])
    err = capsys.readouterr().err
    assert rc == 2 and "give a JOB" in err and "not both" in err, f"exit {rc}, stderr {err!r}"


def test_verify_of_a_folder_that_is_no_store_names_its_own_argument(tmp_path, capsys):
    """`nsa verify DIR` advised `--store PATH`, an option verify does not take (a usage error)."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "x.txt").write_text("x")
    for cmd in ("verify", "ls"):
        argv = [cmd, str(tmp_path / "plain")] if cmd == "verify" else [cmd, "--store", str(tmp_path / "plain")]
        rc = nsa(argv)
        err = capsys.readouterr().err
        want = "`nsa verify STORE`" if cmd == "verify" else "--store PATH"
        assert rc == 2 and want in err and "not a spectrum store" in err, f"{cmd}: exit {rc}, stderr {err!r}"
        if cmd == "verify":
            assert "--store PATH" not in err, err
    # `--store` as every other command takes it (was "unrecognized arguments: --store"); two stores: refused
    rc = nsa(["verify", "--store", str(tmp_path / "plain")])
    err = capsys.readouterr().err
    assert rc == 2 and "not a spectrum store" in err, f"exit {rc}, stderr {err!r}"
    with pytest.raises(SystemExit):
        nsa(["verify", str(tmp_path / "a.zarr"), "--store", str(tmp_path / "plain")])
    assert "two stores given" in capsys.readouterr().err


def test_every_example_validates_and_every_command_has_help(capsys):
    root = Path(__file__).resolve().parents[1]
    for f in sorted((root / "examples").glob("*.yaml")):
        assert load_sweep(f, max_runs=10**6).expand(), f
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in sub.choices:
        with pytest.raises(SystemExit) as exc:
            _parser().parse_args([name, "--help"])
        assert exc.value.code == 0, f"nsa {name} --help exited {exc.value.code}"
    capsys.readouterr()
    assert yaml  # the tests write YAML by hand: the text is the input


def test_a_file_not_in_utf8_is_named_with_its_line(tmp_path, capsys):
    """A Latin-1 file: "'utf-8' codec can't decode byte 0xe9 in position 30", naming neither file nor line."""
    p = tmp_path / "latin1.yaml"
    p.write_bytes(b"name: t\nsteps: 4\n# caf\xe9 au lait\n")
    rc = nsa(["run", str(p), "--store", str(tmp_path / "s.zarr")])
    err = capsys.readouterr().err
    assert rc == 2 and "latin1.yaml: not UTF-8 text: byte 0xe9 on line 3" in err, f"exit {rc}, stderr {err!r}"


def test_a_sweep_file_given_to_run_says_to_use_sweep(tmp_path, capsys):
    """`nsa run sweep.yaml` listed "base / grid / cluster: Extra inputs are not permitted"."""
    root = Path(__file__).resolve().parents[1]
    err = _refused(tmp_path, (root / "examples" / "sweep_tiny.yaml").read_text(), capsys)
    assert "a sweep file (it has base, cluster, grid)" in err and "`nsa sweep " in err, err


def test_ls_and_show_give_the_learning_rate_the_active_regime_ran(tmp_path, capsys):
    """`regime: active` updates with lr · width: ls showed lr 0.01 and show "lr=0.01" for δ = 0.16."""
    from nsa_dist.client import Client

    spec = _file(
        tmp_path,
        "name: act\ndata: {name: image2d, n: 20}\nmodel: {depth: 2, width: 16, init: ntk, regime: active}\n"
        "steps: 2\nschedule: {lr: 0.01}\nrecord: {every: 1}\nspectrum: {k: 4, images: []}\n",
    )
    store = str(tmp_path / "s.zarr")
    assert nsa(["run", str(spec), "--store", store, "--plain"]) == 0
    run = Client(store).run("act")
    assert np.allclose(run.lr, 0.16), f"stored δ_t {run.lr}, expected 0.01 × 16"
    capsys.readouterr()
    assert nsa(["ls", "--store", store]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if run.id in ln)
    cells = [c.strip() for c in row.split("│")]
    assert "0.16" in cells and "0.01" not in cells, f"ls row {cells} vs the run's δ_0 = {run.lr[0]}"
    assert nsa(["show", run.id, "--store", store]) == 0
    head = capsys.readouterr().out.splitlines()[1]
    assert "δ=0.16" in head, f"show's header {head!r} vs the run's δ_0 = {run.lr[0]}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no GPU")
def test_device_cuda_without_a_gpu_is_refused_before_the_store(tmp_path, capsys):
    """It created the run (left 'pending') and failed with "AssertionError: Torch not compiled with
    CUDA enabled (unexpected …)", exit 1."""
    err = _refused(tmp_path, TINY + "device: cuda\n", capsys)
    assert "device: cuda (run 't') but torch sees no CUDA GPU" in err, err


def test_an_emptied_hessian_block_is_refused_not_read_as_no_hessian(tmp_path, capsys):
    """`hessian:` with its lines commented out is YAML null: the run measured no Hessian, no word."""
    text = TINY + "hessian:\n#  probes: 8\n"
    got = _loaded(tmp_path, text)
    assert got.startswith("refused"), f"an emptied hessian block ran as {got} (no Hessian)"
    err = _refused(tmp_path, text, capsys)
    assert "hessian: is empty (null)" in err and "`hessian: {}`" in err, err
    assert not _loaded(tmp_path, TINY + "hessian: {}\n").startswith("refused")
    sweep = _file(tmp_path, "name: sw\nbase:\n  steps: 3\n  hessian:\ngrid: {seed: [0, 1]}\n", "sw.yaml")
    with pytest.raises(SpecError, match=r"base\.hessian: is empty"):
        load_sweep(sweep)


@pytest.mark.parametrize("text, key, kind", [("on: 3\n", "on", "bool"), ("data: {1: 2}\n", "1", "int")])
def test_a_key_that_yaml_reads_as_no_name_is_refused_at_its_line(tmp_path, capsys, text, key, kind):
    """`data: {1: 2}` ended as "TypeError: keywords must be strings (unexpected …)", exit 1;
    `on: 3` as "1: Keys should be strings (got True)"."""
    err = _refused(tmp_path, TINY.replace("data: {name: image2d, n: 24}\n", "") + text, capsys)
    assert f"key {key!r} is a YAML 1.1 {kind}, not a name" in err and "line 4" in err, err
    from pydantic import ValidationError

    from nsa_dist.config import ExperimentSpec

    with pytest.raises(ValidationError, match="Keys should be strings"):  # the Python API: no TypeError
        ExperimentSpec.model_validate({"data": {1: 2}})


def test_a_factory_that_cannot_be_imported_leaves_no_store(tmp_path, capsys):
    """The error was one clear line, but only after a new, empty store had been made."""
    text = "name: f\ndata: {name: image2d, n: 20}\nmodel: {factory: 'no_such_pkg_x.mod:make'}\nsteps: 2\n"
    err = _refused(tmp_path, text, capsys)
    assert "cannot import module 'no_such_pkg_x.mod'" in err, err


def test_a_block_written_as_its_name_says_how_to_write_it(tmp_path, capsys):
    """`optimizer: sgd` said only "Input should be a valid dictionary or instance of OptimizerSpec"."""
    err = _refused(tmp_path, TINY + "optimizer: adam\n", capsys)
    assert "optimizer:" in err and "write `optimizer: {name: adam}`" in err, err


def test_experiment_fields_beside_a_grid_are_told_to_go_under_base(tmp_path):
    """`steps: 3` next to `grid:` said "steps: Extra inputs are not permitted (allowed here: name, base, …)"."""
    p = _file(tmp_path, "name: sw\nsteps: 3\ndata: {n: 20}\ngrid: {seed: [0, 1]}\n", "sw.yaml")
    with pytest.raises(SpecError) as exc:
        load_sweep(p)
    assert "steps, data are experiment fields beside the sweep's base / grid: put them under `base:`" in str(exc.value)


def test_an_empty_store_path_is_not_the_current_directory(monkeypatch, capsys):
    """`NSA_STORE=` (set, empty) or `--store ''` was the store '' — the current directory, where
    `nsa run` wrote its store if the folder was empty, and otherwise refused with "'' is a non-empty
    directory …"."""
    monkeypatch.setenv("NSA_STORE", "")
    for argv in (["ls"], ["verify"], ["run", "x.yaml"]):
        store = _parser().parse_args(argv).store
        assert store == "nsa-results.zarr", f"`NSA_STORE= nsa {' '.join(argv)}`: store {store!r}"
    for argv in (["ls", "--store", ""], ["verify", ""], ["status", "--store", " "]):
        with pytest.raises(SystemExit) as exc:
            _parser().parse_args(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "the store path is empty" in err, f"nsa {argv}: {exc.value.code} {err!r}"


def test_an_empty_spec_file_is_called_empty(tmp_path, capsys):
    """It said "expected a mapping of spec fields at the top level, got NoneType"."""
    err = _refused(tmp_path, "# name: t\n# steps: 4\n", capsys)
    assert "the file holds no fields (empty, or only comments)" in err and "NoneType" not in err, err


def test_a_max_runs_of_zero_is_a_limit_not_the_default(tmp_path):
    """load_sweep(max_runs=0) took 0 for "unset" and accepted up to 1,000 runs."""
    p = _file(tmp_path, "name: sw\nbase: {data: {n: 20}, model: {depth: 2, width: 4}, steps: 3}\n", "sw.yaml")
    assert len(load_sweep(p, max_runs=None).expand()) == 1
    with pytest.raises(SpecError, match="more than the limit 0"):
        runs = load_sweep(p, max_runs=0).expand()
        pytest.fail(f"max_runs=0 accepted {len(runs)} run(s)")


def test_a_rerun_says_where_it_resumes_and_a_finished_one_that_nothing_is_left(tmp_path, capsys):
    """``nsa run`` of a run the store holds in part said only "N steps" and resumed silently (a new
    user's trial); it names the stored steps and the step training resumes from, or says that
    nothing is left to compute."""
    from nsa_dist.config import ExperimentSpec
    from nsa_dist.pipeline import run_experiment, run_id
    from nsa_dist.store import SpectrumStore

    text = "name: r\ndata: {name: image2d, n: 24}\nmodel: {depth: 2, width: 8}\nsteps: 12\nrecord: {every: 3}\n"
    path, url = _file(tmp_path, text), str(tmp_path / "s.zarr")
    spec = load_spec(path)
    seen = []

    def stop(ck, result):
        seen.append(ck.step)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(ExperimentSpec.model_validate(spec.model_dump()), SpectrumStore(url), on_step=stop)
    capsys.readouterr()
    assert nsa(["run", "--plain", str(path), "--store", url]) == 0
    err = capsys.readouterr().err
    assert f"run {run_id(spec)}: 2 of 5 recorded steps already stored; training resumes from step 3" in err, err
    assert nsa(["run", "--plain", str(path), "--store", url]) == 0
    err = capsys.readouterr().err
    assert f"run {run_id(spec)}: 5 of 5 recorded steps already stored: nothing to compute" in err, err


def test_submit_takes_pip_requirements_as_deploy_readme_says(tmp_path) -> None:
    """deploy/README.md documents `nsa submit --pip my-pkg==1.2`; the flag did not exist."""
    args = _parser().parse_args(
        ["submit", "s.yaml", "--address", "http://h:8265", "--pip", "my-pkg==1.2", "--pip", "other"]
    )
    assert args.pip == ["my-pkg==1.2", "other"]
    assert _parser().parse_args(["submit", "s.yaml", "--address", "http://h:8265"]).pip is None
    assert "nsa submit --pip my-pkg==1.2" in (Path(__file__).parents[1] / "deploy" / "README.md").read_text()


def test_a_run_refused_while_it_is_prepared_prints_no_run_line_first(tmp_path, capsys):
    """A data file the loader refuses came after "[nsa] run …: 40 steps", as if the run had started."""
    np.save(tmp_path / "bad.npy", np.zeros((5, 5, 2)))
    spec = tmp_path / "s.yaml"
    data = f"data: {{name: image2d, n: 16, path: {tmp_path / 'bad.npy'}}}"
    spec.write_text(f"name: bad\n{data}\nmodel: {{depth: 2, width: 8}}\nsteps: 2\n")
    assert nsa(["run", str(spec), "--store", str(tmp_path / "s.zarr"), "--plain"]) == 2
    out, err = capsys.readouterr()
    assert "[nsa] run" not in out and "bad.npy' holds an array of shape (5, 5, 2)" in err, (out, err)


def test_submit_passes_a_wait_for_other_writers_to_the_jobs_sweep() -> None:
    """A job refused because another process wrote one of its runs said "wait for it (--wait)",
    and `nsa submit --wait` waits for the job, not for the writer (audit Q): `--wait-for-writers`
    reaches the job's `nsa sweep --wait` (the refusal names it: test_store_contract)."""
    import shlex

    from nsa_dist.cli import _wait_seconds
    from nsa_dist.cluster.jobs import sweep_options

    base = ["submit", "s.yaml", "--address", "http://h:8265"]
    for flags, want in (([], 0.0), (["--wait-for-writers"], None), (["--wait-for-writers", "30"], 30.0)):
        args = _parser().parse_args(base + flags)
        job_sweep = ["sweep", "sweep.yaml", "--store", "s3://b/s.zarr"]
        job_sweep += shlex.split(sweep_options(None, _wait_seconds(args.wait_for_writers)))
        got = _wait_seconds(_parser().parse_args(job_sweep + ["--address", "auto", "--plain"]).wait)
        assert got == want, (flags, sweep_options(None, _wait_seconds(args.wait_for_writers)), got)


def test_the_job_listing_gives_each_job_one_line() -> None:
    """`nsa status` listed a failed job with Ray's message: up to 20,000 characters of its log tail
    (78 lines for 16 jobs, audit Q); one line each now, the whole message for `nsa status JOB`."""
    from nsa_dist.cli import _job_message

    tail = "Job entrypoint command failed with exit code 137, last available logs:\n" + "\n".join(
        f"[nsa] step {i}/9 loss 0.1" for i in range(40)
    )
    one = _job_message(tail, whole=False)
    assert "\n" not in one and one.startswith("Job entrypoint command failed with exit code 137"), one
    assert "nsa logs JOB" in one and "[nsa] step 39/9 loss 0.1" in one  # the tail's last line: the job's own cause
    failed = "Job entrypoint command failed with exit code 2, last available logs:\n[nsa] step 1\nnsa sweep: error: bad"
    assert "nsa sweep: error: bad" in _job_message(failed, whole=False)
    assert _job_message(tail, whole=True).count("\n") == 40
    assert _job_message("Job finished successfully.", whole=False) == "Job finished successfully."


def test_the_progress_line_names_the_k_of_its_energy(tmp_path, capsys):
    """Audit D: with spectrum.k = 5 the line printed E(y,5)'s value as "E(y,10)"."""
    spec = _file(tmp_path, TINY + "spectrum: {k: 5, images: []}\nrecord: {every: 2}\n")
    assert nsa(["run", str(spec), "--store", str(tmp_path / "s.zarr"), "--plain"]) == 0
    out = capsys.readouterr().out
    assert "E(y,5) " in out and "E(y,10)" not in out, out
