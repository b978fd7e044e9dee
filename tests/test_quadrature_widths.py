"""What E's bracket is made of where it is widest (``notes["widest"]``, :func:`describe_width`): the
stored G's rounding, λ_k's bracket, φ's own quadrature — so that a researcher knows which knob narrows
a wide band, and that no knob narrows a float32 G's rounding.  The pipeline logs it for a band wider
than 0.02, and ``nsa show`` gives each shown step's widest band."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from nsa_dist.cli import main
from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec
from nsa_dist.linalg.quadrature import curve_ks, describe_width, spectral_curves
from nsa_dist.pipeline import run_experiment
from nsa_dist.store import SpectrumStore

N, K = 600, 20


@pytest.fixture(scope="module")
def case() -> dict:
    """A G whose tail falls over 6 decades (as the NTK's does) below a gap after the top K, half of it
    below a float32 G's rounding (δ ≈ 4·eps₃₂·‖G‖_F = 10⁻³); a target spread over every eigenvector."""
    rng = np.random.default_rng(3)
    Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    lam = np.concatenate([1e3 * np.logspace(0, -1, K), np.logspace(0, -6, N - K)])
    G = (Q * lam) @ Q.T
    G = (G + G.T) / 2
    phis = {"y": Q @ rng.standard_normal(N), "f": Q[:, :5] @ rng.standard_normal(5)}
    return {"G": G, "phis": phis, "ks": curve_ks(N, 40)}


def _curves(c: dict, dtype: torch.dtype):
    G = torch.from_numpy(c["G"]).to(dtype)
    w, V = np.linalg.eigh(G.double().numpy())
    return spectral_curves(G, w[::-1][:K].copy(), V[:, ::-1][:, :K].copy(), c["phis"], c["ks"], lanczos_steps=60)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_the_parts_make_up_the_widest_bracket(case, dtype):
    c = _curves(case, dtype)
    for name, b in c.energy.items():
        w = c.notes["widest"][name]
        width = b.upper - b.lower
        assert w["width"] == pytest.approx(width.max(), abs=1e-15) and w["k"] == case["ks"][np.argmax(width)], (
            f"{name}: widest {w} against the curve's largest width {width.max()} at k = {case['ks'][np.argmax(width)]}"
        )
        parts = {p: w[p] for p in ("rounding", "eigenvalue", "phi")}
        assert min(parts.values()) >= 0.0, f"{name}: a negative part in {parts}"
        assert sum(parts.values()) == pytest.approx(w["width"], abs=1e-12), f"{name}: {parts} do not add to {w}"


def test_a_float32_gs_band_is_its_rounding_and_a_float64_gs_is_not(case):
    """The same G stored in float32 and float64: below the float32 rounding (half the spectrum) the
    float32 band is the rounding's (0.59 of 0.60), which only a float64 G narrows; the float64 band
    (0.035) is λ_k's."""
    c32, c64 = _curves(case, torch.float32), _curves(case, torch.float64)
    w32, w64 = c32.notes["widest"]["y"], c64.notes["widest"]["y"]
    assert w32["rounding"] > 0.5 * w32["width"], f"float32: {w32}"
    assert w64["rounding"] < 0.01 * w64["width"] and w64["eigenvalue"] > 0.5 * w64["width"], f"float64: {w64}"
    s32, s64 = describe_width("y", c32), describe_width("y", c64)
    assert s32.startswith(f"E(y, k)'s bracket is widest at k = {w32['k']}") and "spectrum.dtype: float64" in s32, s32
    assert "lanczos_steps" in s64 and "spectrum.dtype" not in s64, s64
    assert s64.index("λ_k's bracket") < s64.index("rounding"), f"the largest part first: {s64}"
    assert describe_width("absent", c64) == ""


def _wide_spec(name: str, steps: int, record: list[int]) -> ExperimentSpec:
    """A small float32 quadrature run whose bands pass 0.02 (few probes and Lanczos steps)."""
    return ExperimentSpec.model_validate(
        {
            "name": name,
            "seed": 0,
            "data": {"n": 160, "n_test": 8},
            "model": {"depth": 3, "width": 32},
            "steps": steps,
            "record": {"steps": record},
            "spectrum": {
                "dtype": "float32",
                "k": "all",
                "energy": "quadrature",
                "images": [],
                "quadrature": {"top": 10, "lanczos_steps": 8, "probes": 6, "curve_points": 30},
            },
        }
    )


def test_the_pipeline_logs_a_wide_band_and_nsa_show_shows_it(caplog, capsys, tmp_path):
    """A quadrature run whose band passes 0.02: each step logs what its widest bracket is made of,
    and ``nsa show`` gives the widest bracket of y and the residual at the steps it shows."""
    spec = _wide_spec("wide", 3, [0, 2])
    url = str(tmp_path / "w.zarr")
    with caplog.at_level(logging.INFO, logger="nsa_dist.pipeline.producers"):
        assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run("wide")
    lines = [r.getMessage() for r in caplog.records if "bracket is widest" in r.getMessage()]
    shown = []
    for phi in ("y", "residual"):
        c = run.curve(f"energy_{phi}")
        width = c.upper - c.lower
        assert width.shape == (2, c.k.size) and width.max() > 0.02, f"the test needs a band wider than 0.02: {phi}"
        for i, step in enumerate(c.steps):
            j = int(np.argmax(width[i]))
            shown.append(f"{width[i, j]:.3f} at k = {int(c.k[j]):,}")
            if width[i, j] > 0.02:
                want = f"step {step}: E({phi}, k)'s bracket is widest at k = {int(c.k[j])}: {width[i, j]:.3f}"
                assert any(line.startswith(want) for line in lines), f"{want!r} not in {lines}"
    assert main(["show", "wide", "--store", url]) == 0
    out = capsys.readouterr().out
    assert "E(y, k) bracket, widest" in out and "E(residual, k) bracket, widest" in out, out
    for text in shown:
        assert text in out, f"{text!r} not in {out}"
    # the same as a table, for every φ the run stores
    df = run.bracket_widths()
    assert list(df.columns) == ["step", "phi", "width", "k", "value", "lower", "upper"]
    assert sorted(set(df.phi)) == sorted(("y", "f", "residual", "df", "df_pred")) and len(df) == 10
    for r in df.itertuples():
        c = run.curve(f"energy_{r.phi}")
        i, j = list(c.steps).index(r.step), list(c.k).index(r.k)
        assert r.width == pytest.approx((c.upper - c.lower)[i].max(), abs=0) == r.upper - r.lower, r
        assert (r.value, r.lower, r.upper) == (c.value[i, j], c.lower[i, j], c.upper[i, j]), r
    with pytest.raises(ValueError, match="not one of"):
        run.bracket_widths(("nope",))
    # the exact route: a bracket only inside the null space (this G's rank is ~134 of 160: the
    # eigenvectors there are one arbitrary basis, docs/curves.md), a point everywhere else, and no
    # widest-bracket row in nsa show (that row is the quadrature route's account of its knobs)
    d = spec.model_dump(mode="json")
    d["name"], d["spectrum"]["energy"], d["spectrum"]["dtype"] = "exact", "exact", "float64"
    exact = ExperimentSpec.model_validate(d)
    assert run_experiment(exact, SpectrumStore(url)).status == "done"
    run = Client(url).run("exact")
    for phi in ("y", "residual"):
        c = run.curve(f"energy_{phi}")
        np.testing.assert_array_equal(c.lower[:, c.exact], c.value[:, c.exact])
        np.testing.assert_array_equal(c.upper[:, c.exact], c.value[:, c.exact])
        lam = run.eigenvalues
        for i in range(len(c.steps)):  # every bracketed k lies in the step's null space
            wide = c.upper[i] > c.lower[i]
            assert wide.any() and (lam[i, wide] <= 1e-9 * lam[i, 0]).all(), (c.k[wide], lam[i, wide] / lam[i, 0])
    assert main(["show", "exact", "--store", url]) == 0
    assert "bracket, widest" not in capsys.readouterr().out


class _Float32Products:
    """G as an operator whose products come back in float32 (as a ``block_rows`` gang's under
    ``spectrum.dtype: float32``)."""

    def __init__(self, G: np.ndarray) -> None:
        self.G, self.shape, self.dtype = G, G.shape, np.float32

    def matmat(self, X: np.ndarray) -> np.ndarray:
        return (self.G @ np.asarray(X, np.float64)).astype(np.float32)


def test_float32_products_are_named_as_a_float32_g(case):
    """An operator with float32 products and a dominant top eigenvalue (‖G‖_F < 3·λ_1) is a float32 G
    too: its rounding part is narrowed only by a float64 G (the rule once compared δ with 1.5× the
    float64 one and called it "float64 already")."""
    G = case["G"]
    w, V = np.linalg.eigh(G)
    assert np.linalg.norm(G) < 3 * w[-1]
    c = spectral_curves(
        _Float32Products(G), w[::-1][:K].copy(), V[:, ::-1][:, :K].copy(), case["phis"], case["ks"], lanczos_steps=60
    )
    assert c.notes["storage_eps"] == pytest.approx(float(np.finfo(np.float32).eps))
    text = describe_width("y", c)
    assert "spectrum.dtype: float64" in text and "float64 already" not in text, text


def test_the_account_logs_nothing_of_the_bracket_it_does_not_report(caplog):
    """The bracket with δ = 0 (only for the account of the widths) logs none of its fallbacks: a
    float32 G where it fell back to λ_K at k = 19 and 22 while the reported brackets did not."""
    n = 200
    rng = np.random.default_rng(1010)
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    G = torch.from_numpy((Q * np.logspace(2, -6, n)) @ Q.T).float()
    G = (G + G.T) / 2
    w, V = np.linalg.eigh(G.double().numpy())
    with caplog.at_level(logging.INFO, logger="nsa_dist.linalg.quadrature"):
        c = spectral_curves(
            G,
            w[::-1][:10].copy(),
            V[:, ::-1][:, :10].copy(),
            {"y": Q @ rng.standard_normal(n)},
            curve_ks(n, 30),
            lanczos_steps=30,
            probes=12,
            block_size=4,
        )
    said = [r.getMessage() for r in caplog.records if "fell below its proven lower end" in r.getMessage()]
    i = np.searchsorted(c.k, [19, 22])
    assert (c.eigenvalue.upper[i] < w[-10]).all(), f"the reported upper ends {c.eigenvalue.upper[i]} are λ_K"
    assert not said, f"logged a fallback of the unreported bracket: {said}"


def test_a_failing_account_costs_nothing_but_itself(case, monkeypatch, caplog):
    """The widths' account runs inside every quadrature step: should it fail, the curves come back
    the same, its notes empty, and one warning says so (no sentence, no end of the run)."""
    import nsa_dist.linalg.quadrature as quad

    ref = _curves(case, torch.float64)

    def broken(*args, **kwargs):
        raise FloatingPointError("an account that fails")

    monkeypatch.setattr(quad, "_widest", broken)
    with caplog.at_level(logging.WARNING, logger="nsa_dist.linalg.quadrature"):
        got = _curves(case, torch.float64)
    assert got.notes["widest"] == {} and describe_width("y", got) == ""
    assert any("account of the brackets' widths failed" in r.getMessage() for r in caplog.records), caplog.text
    for name, b in ref.energy.items():
        for part in ("value", "lower", "upper"):
            np.testing.assert_array_equal(getattr(got.energy[name], part), getattr(b, part), err_msg=f"{name} {part}")
    np.testing.assert_array_equal(got.eigenvalue.upper, ref.eigenvalue.upper)


def test_a_failing_sentence_does_not_end_the_step(monkeypatch, caplog):
    """The log sentence runs inside every quadrature step: should it fail, the step still ends with
    its curves and one warning says so."""
    import nsa_dist.pipeline.producers as producers

    def broken(*args, **kwargs):
        raise KeyError("a sentence that fails")

    monkeypatch.setattr(producers, "describe_width", broken)
    spec = _wide_spec("sentence", 2, [1])
    from nsa_dist.data import load_dataset
    from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run

    data = load_dataset(spec.data, seed=0)
    plan = plan_run(spec, data)
    ck = list(Trainer(plan, data).train_until(2))[-1]
    with caplog.at_level(logging.WARNING, logger="nsa_dist.pipeline.producers"):
        a = SpectralAnalyzer(plan, data).analyze(ck).arrays()
    assert np.isfinite(a["curve_energy_residual_upper"]).all()
    assert any("widths' sentence failed" in r.getMessage() for r in caplog.records), caplog.text
