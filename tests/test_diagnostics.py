"""A diagnostic never ends the run it observes: the constant-Gram predictions stay exact above GD's
stability bound (log space), and any per-step or post-run diagnostic that raises is stored as NaN
with its reason while the run finishes ``done``."""

from __future__ import annotations

import json
from decimal import Decimal, getcontext

import numpy as np
import pytest
import torch

from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec
from nsa_dist.metrics import Decays, constant_gram_log_decays, constant_gram_residual
from nsa_dist.pipeline import run_experiment
from nsa_dist.pipeline.diagnostics import StepNotes, is_infrastructure
from nsa_dist.store import LeaseLost, SpectrumStore


def _psd(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    A = np.random.default_rng(seed).standard_normal((n, n))
    w, V = np.linalg.eigh(A @ A.T)
    return w[::-1].copy(), V[:, ::-1].copy()


def _reference_energy(w, p, rest, lrs, steps, n):
    """E(m̄_t, k) and log‖m̄_t‖ in 60-digit decimals (no overflow at any exponent)."""
    getcontext().prec = 60
    E, log_norm = [], []
    for t in steps:
        r2 = [Decimal(1) for _ in w]
        for s in range(t):
            r2 = [x * (Decimal(1) - Decimal(float(lrs[s])) * Decimal(float(lam)) / n) ** 2 for x, lam in zip(r2, w)]
        kept = [x * Decimal(float(pi)) for x, pi in zip(r2, p)]
        total = sum(kept) + Decimal(rest)
        c, row = Decimal(0), []
        for x in kept:
            c += x
            row.append(float(c / total))
        E.append(row)
        log_norm.append(float(total.ln() / 2))
    return np.array(E), np.array(log_norm)


def test_constant_gram_residual_above_the_stability_bound_is_exact_in_log_space() -> None:
    """δ = 1.8·(2N/λ_1): r_1 grows as 2.6^t and overflows float64 after ~740 steps; the energies
    stay finite and equal a 60-digit reference, the norm is +inf only where it exceeds float64."""
    N, K = 12, 5
    w, V = _psd(N, 3)
    w = w[:K]
    m0 = np.random.default_rng(4).standard_normal(N)
    p = (V[:, :K].T @ m0) ** 2
    lr = 1.8 * 2 * N / w[0]
    steps = [0, 10, 400, 900]
    lrs = np.full(steps[-1], lr)
    dec = constant_gram_log_decays(w, lrs, steps, N)
    assert dec.overflows().tolist() == [False, False, False, True]
    got = constant_gram_residual(w, p, float(m0 @ m0), dec)
    ref_E, ref_log = _reference_energy(w, p, float(m0 @ m0 - p.sum()), lrs, steps, N)
    assert np.isfinite(got.energy).all(), got.energy
    err = np.abs(got.energy - ref_E).max()
    assert err < 1e-12, f"E differs from the 60-digit reference by {err:.2e}"
    finite = np.isfinite(got.norm)
    assert finite.tolist() == [True, True, True, False] and got.norm[-1] == np.inf
    rel = np.abs(np.log(got.norm[finite]) - ref_log[finite]).max()
    assert rel < 1e-12, f"log‖m̄_t‖ differs by {rel:.2e}"
    # below the bound the log-space route gives exactly the values of the direct product
    stable = constant_gram_log_decays(w, np.full(20, 0.5 * lr / 1.8), [0, 5, 20], N)
    direct = constant_gram_residual(w, p, float(m0 @ m0), stable.values())
    np.testing.assert_allclose(constant_gram_residual(w, p, float(m0 @ m0), stable).energy, direct.energy, rtol=1e-13)
    assert Decays.of(stable.values()).sign.tolist() == stable.sign.tolist()


def test_app_e_prediction_beyond_the_bound_is_nan_with_its_reason() -> None:
    """App. E's test-point prediction on a real network: the steps whose decay overflows are NaN,
    the reason names the rate, the bound and the first overflowing recorded step; earlier steps are
    the finite prediction."""
    from nsa_dist.models import build_model
    from nsa_dist.ntk import gram
    from nsa_dist.pipeline.nsa_extras import test_point_prediction

    spec = ExperimentSpec.model_validate(
        {
            "name": "appe",
            "data": {"n": 16, "n_test": 6},
            "model": {"depth": 2, "width": 8},
            "steps": 1500,
            "record": {"steps": [0, 5, 1499]},
            "schedule": {"lr": 1.0},
            "spectrum": {"k": 16},
        }
    )
    torch.manual_seed(0)
    model = build_model(spec.model, seed=0).double()
    X, X_test = torch.randn(16, 2, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    G = gram(model, X, dtype=torch.float64).numpy()
    w, V = np.linalg.eigh(G)
    w, V = w[::-1].copy(), V[:, ::-1].copy()
    spec = spec.model_copy(update={"schedule": spec.schedule.model_copy(update={"lr": 3.0 * 2 * 16 / w[0]})})
    with torch.no_grad():
        f, f_test = model(X).numpy().ravel(), model(X_test).numpy().ravel()
    pred, why = test_point_prediction(model, X, X_test, w, V, f - 1.0, f_test, spec, torch.float64)
    assert np.isfinite(pred[:2]).all() and np.isnan(pred[2]).all(), pred
    assert why is not None and "stability bound" in why and "recorded step 1499" in why, why


def _tiny(name: str, **over) -> ExperimentSpec:
    base = {
        "name": name,
        "data": {"n": 24, "n_test": 8},
        "model": {"depth": 2, "width": 8},
        "steps": 6,
        "record": {"every": 2},
        "spectrum": {"k": 6, "test_points": True, "store_eigenvectors": True, "gram_change_k": 3},
    }
    base.update(over)
    return ExperimentSpec.model_validate(base)


def test_a_failing_diagnostic_is_nan_with_its_reason_and_the_run_is_done(tmp_path, monkeypatch) -> None:
    """Fault injection: the alignment, App. F's dG_t, one Hessian quantity and the post-run
    Eqs. 4–5 prediction raise at every step; every other array is computed, the run is done."""
    import nsa_dist.metrics as metrics
    import nsa_dist.pipeline.hessian_step as hs
    import nsa_dist.pipeline.producers as sp

    def boom(*a, **k):
        raise FloatingPointError("injected")

    monkeypatch.setattr(sp, "alignment_from_products", boom)
    monkeypatch.setattr(sp, "gram_change", boom)
    monkeypatch.setattr(hs, "orthogonality", boom)
    monkeypatch.setattr(metrics, "constant_gram_residual", boom)  # imported by write_constant_gram when called
    spec = _tiny("inj", hessian={"probes": 4, "orthogonality": True, "steps": [0]})
    url = str(tmp_path / "s.zarr")
    out = run_experiment(spec, SpectrumStore(url))
    assert out.status == "done", out
    run = Client(url).run(out.run_id)
    assert run.status == "done" and len(run.steps) == len(run.schedule)
    assert np.isnan(run.per_step("alignment")).all() and np.isnan(run.per_step("alignment_centered")).all()
    assert np.isfinite(run.per_step("first_order_cos")[1:]).all() and np.isfinite(run.per_step("loss_test")).all()
    assert np.isfinite(run.eigenvalues).all() and np.isfinite(run.energy("y")).all()
    assert np.isnan(run.array("hessian_orthogonality")[0]).all() and np.isfinite(run.array("hessian_moments")[0]).all()
    assert set(run.notes) == set(run.steps.tolist())
    first = run.notes[int(run.steps[0])]
    assert first["alignment"] == "FloatingPointError: injected" and "hessian_orthogonality" in first
    assert run.has("gram_change") and "gram_change" in first and "gram_change_fro" in first
    assert np.isnan(run.array("gram_change")[0]).all() and np.isfinite(run.array("reconstructions")[0]).all()
    assert run.attrs["post_run_notes"] == {
        "constant_gram_residual": "FloatingPointError: injected",
        "constant_gram_energy": "FloatingPointError: injected",
    }
    assert not run.has("constant_gram_residual") and run.has("preservation")


def test_a_run_without_failures_notes_nothing(tmp_path) -> None:
    url = str(tmp_path / "s.zarr")
    out = run_experiment(_tiny("clean"), SpectrumStore(url))
    run = Client(url).run(out.run_id)
    assert out.status == "done" and run.notes == {} and run.attrs["post_run_notes"] == {}
    assert (run.per_step("step_notes") == "").all()


def test_infrastructure_errors_are_not_swallowed() -> None:
    """A lost lease, an interrupt, memory and Ray's errors pass through the guard: the machinery
    that handles them (fencing, retries on another worker) must see them."""
    import ray.exceptions

    notes = StepNotes("r", 0)
    for exc in (LeaseLost("taken over"), KeyboardInterrupt(), MemoryError(), ray.exceptions.RayActorError()):
        assert is_infrastructure(exc)
        with pytest.raises(type(exc)):
            notes.guard(("x",), _raiser(exc))
    assert notes.reasons == {}
    assert notes.guard(("a", "b"), _raiser(np.linalg.LinAlgError("singular"))) is None
    assert json.loads(notes.json()) == {"a": "LinAlgError: singular", "b": "LinAlgError: singular"}


def _raiser(exc: BaseException):
    def f():
        raise exc

    return f


def test_a_run_above_the_bound_is_done_and_its_figure_says_the_prediction_diverges(tmp_path) -> None:
    """δ above 2N/λ_max(G_0) for a few steps: the run is done, the Eqs. 4–5 arrays record where the
    prediction diverges, and the figure says so."""
    from nsa_dist.plots import make_figure
    from nsa_dist.plots.axes import title_of

    url = str(tmp_path / "s.zarr")
    out = run_experiment(_tiny("above", schedule={"lr": 1.0}), SpectrumStore(url))  # 2N/λ_max(G_0) = 0.79
    assert out.status == "done", out
    run = Client(url).run(out.run_id)
    attrs = run.array_attrs("constant_gram_residual")
    assert attrs["diverges"] is True and attrs["lr_max"] == 1.0 and attrs["stability_bound"] < 1.0, attrs
    assert attrs["first_unstable_step"] == 0 and attrs["overflow_step"] == -1, attrs
    assert np.isfinite(run.array("constant_gram_energy")).all()
    fig = make_figure(run, "eqs45_constant_gram")
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert any("the prediction diverges" in t for t in texts), (title_of(fig), texts)


def test_store_strings_are_never_rich_markup_in_the_cli(tmp_path, capsys) -> None:
    """A failure reason (and notes) holding Rich markup — "[/data/x]", "[bold]" — is printed as it
    is by `nsa ls` and `nsa show`; it used to end both with a MarkupError listing nothing."""
    from nsa_dist.cli import main

    url = str(tmp_path / "s.zarr")
    out = run_experiment(_tiny("markup"), SpectrumStore(url))
    store = SpectrumStore(url)
    w = store.writer(out.run_id, store.run_attrs(out.run_id)["spec"], store.dims(out.run_id))
    reason = "FileNotFoundError: [/data/x] missing [bold]not bold[/bold] [red"
    w.set_status("failed", reason)
    w.set_attrs(post_run_notes={"preservation": "ValueError: [/oops]"})
    capsys.readouterr()
    assert main(["ls", "--store", url]) == 0
    listed = capsys.readouterr().out
    assert "failed" in listed and "[red" in listed, listed  # the reason, literally, in a narrow table
    assert main(["show", out.run_id, "--store", url]) == 0
    shown = capsys.readouterr().out
    assert reason in shown.replace("\n", "") and "ValueError: [/oops]" in shown, shown


def _unexplained_nans(run) -> dict[int, list[str]]:
    """{step: [arrays the step writes (the store's own step_specs) that are NaN in every entry, no note]}."""
    from nsa_dist.store.schema import step_specs

    hess = run.array("hessian_steps")[run.finished] if run.has("hessian_steps") else np.zeros(len(run.steps), bool)
    out: dict[int, list[str]] = {}
    for i, t in enumerate(run.steps.tolist()):
        specs = step_specs(run.dims, eigenvectors=run.stores_eigenvectors(t), hessian=bool(hess[i]), first=i == 0)
        for name in sorted(set(specs) - {"step_notes"}):
            row = np.asarray(run.per_step(name)[i])
            if row.dtype.kind in "fc" and row.size and np.isnan(row).all() and name not in run.notes.get(int(t), {}):
                out.setdefault(int(t), []).append(name)
    return out


@pytest.mark.parametrize(
    ("name", "over", "status"),
    [
        # a one-vs-rest class with no point among the N: y constant, the centred alignment 0/0
        (
            "ovr_empty",
            {
                "data": {"name": "digits", "n": 6, "n_test": 4, "target": "one_vs_rest", "positive_class": 9},
                "spectrum": {"k": "all", "test_points": True},
                "steps": 3,
                "record": {"every": 1},
            },
            "done",
        ),
        # an NCE update whose Δθ is finite and whose outputs overflow: df and its comparisons NaN
        (
            "nce_div",
            {
                "loss": "nce",
                "data": {"name": "gaussian_mixture", "dim": 2, "n": 40, "noise": "gaussian", "noise_ratio": 1},
                "model": {"depth": 3, "width": 16},
                "schedule": {"lr": 1000.0},
                "steps": 8,
                "record": {"every": 1},
                "spectrum": {"k": 10},
            },
            "failed",
        ),
        # an update that overflows J_t Δθ_t at some points (a partial inf row of df̄_t, no note: a review)
        (
            "huge_lr",
            {"data": {"n": 24}, "schedule": {"lr": 1e38}, "steps": 3, "record": {"every": 1}, "spectrum": {"k": 6}},
            "failed",
        ),
        # a learning rate decayed to nothing: Δf_t = 0 exactly, E(Δf, k) and the first order 0/0
        (
            "lr_gone",
            {
                "data": {"n": 24},
                "schedule": {"lr": 0.25, "decay": 1e-200, "every": 1},
                "steps": 4,
                "record": {"every": 1},
                "spectrum": {"k": 6},
            },
            "done",
        ),
    ],
)
def test_every_nan_a_finished_step_stores_has_its_reason(tmp_path, name, over, status) -> None:
    """Audit N: these stored NaN with an empty step note (the README: a NaN always comes with its reason)."""
    base = {"name": name, "model": {"depth": 2, "width": 8}, "optimizer": {"name": "gd"}, "schedule": {"lr": 0.1}}
    spec = ExperimentSpec.model_validate({**base, **over})
    url = str(tmp_path / "s.zarr")
    out = run_experiment(spec, SpectrumStore(url))
    assert out.status == status, out
    run = Client(url).run(out.run_id)
    assert len(run.steps) >= 1
    missing = _unexplained_nans(run)
    for i, t in enumerate(run.steps.tolist()):  # and no inf stored as a measurement
        for array in ("df_pred", "energy_df_pred", "first_order_error", "first_order_cos"):
            if run.has(array):
                row = np.asarray(run.per_step(array)[i])
                assert not np.isinf(row).any(), f"{array} at step {t}: {row}"
    assert missing == {}, f"NaN without a note: {missing}"
    if name == "ovr_empty":
        assert "constant" in run.notes[0]["alignment_centered"]
    elif name == "huge_lr":
        assert "not finite" in run.notes[0]["df_pred"], run.notes
    elif name == "lr_gone":
        assert "is 0 at every point" in run.notes[2]["first_order_error"], run.notes
    else:
        last = run.notes[int(run.steps[-1])]
        assert "not finite" in last["df"] and np.isfinite(run.per_step("df_pred")[-1]).all()
