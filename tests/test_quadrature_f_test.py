"""E_t(f_test, k) for every k on the quadrature route (NSA Fig. 3e to M at any N): the test Gram's top
``quadrature.top`` exact, brackets beyond at its own log grid to M, from products with the test Gram
only — in every layout, containing the exact values of a dense float64 eigh of the test Gram, and
read back through the client (a new user's trial: the curve stopped at k = top, and the refusal
advised the settings the run already had)."""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.utils import vector_to_parameters

from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.linalg.quadrature import curve_ks
from nsa_dist.models import build_model
from nsa_dist.ntk import gram
from nsa_dist.pipeline import SpectralAnalyzer, Trainer, plan_run, run_experiment, run_id
from nsa_dist.store import SpectrumStore

N, M, TOP = 160, 60, 12
TOL = 1e-6  # the reference test Gram is recomputed from the stored θ in float64: E differs by ~2e-8
NAMES = tuple(f"curve_energy_f_test{s}" for s in ("", "_lower", "_upper"))


def _spec(layout: str, workers: int) -> ExperimentSpec:
    return ExperimentSpec.model_validate(
        {
            "name": f"ftest-{layout}",
            "seed": 0,
            "data": {"n": N, "n_test": M},
            "model": {"depth": 3, "width": 32},
            "steps": 5,
            "record": {"steps": [0, 4]},
            "spectrum": {
                "dtype": "float64",
                "k": "all",
                "energy": "quadrature",
                "layout": layout,
                "workers": workers,
                "images": [],
                "test_points": True,
                "quadrature": {"top": TOP, "lanczos_steps": 20, "probes": 10, "curve_points": 30},
            },
        }
    )


def _exact_f_test(spec: ExperimentSpec, data, theta: np.ndarray, f_test: np.ndarray) -> np.ndarray:
    """E(f_test, k), k = 1..M, from a dense float64 eigh of the test Gram at θ."""
    model = build_model(spec.model, seed=spec.seed, dtype=torch.float64)
    vector_to_parameters(torch.as_tensor(theta, dtype=torch.float64), model.parameters())
    Gt = np.asarray(gram(model, torch.as_tensor(np.asarray(data.X_test), dtype=torch.float64), dtype=torch.float64))
    _, V = np.linalg.eigh(Gt)
    p = np.asarray(f_test, np.float64).reshape(M, -1)
    return np.cumsum(np.sum((V[:, ::-1].T @ p) ** 2, axis=1)) / np.sum(p**2)


def test_f_test_beyond_the_top_is_bracketed_in_every_layout() -> None:
    ks = curve_ks(M, 30)
    got = {}
    for layout, W in (("local", 1), ("block_rows", 3), ("matrix_free", 2)):
        spec = _spec(layout, W)
        data = load_dataset(spec.data, seed=0)
        plan = plan_run(spec, data)
        assert plan.dims.k_test == TOP and plan.has("curve_k_test"), (layout, plan.dims.k_test)
        np.testing.assert_array_equal(plan.curve_k_test(), ks)
        ck = list(Trainer(plan, data).train_until(5))[-1]
        a = SpectralAnalyzer(plan, data).analyze(ck).arrays()
        E = _exact_f_test(spec, data, ck.theta, ck.f_test)[ks - 1]
        v, lo, hi = (np.asarray(a[n], np.float64) for n in NAMES)
        out = (E < lo - TOL) | (E > hi + TOL) | (v < lo) | (v > hi)
        assert not out.any(), (
            f"{layout}: E(f_test, k) outside its bracket at k = {ks[out]}: exact {E[out]}, "
            f"bracket [{lo[out]}, {hi[out]}]"
        )
        top = ks <= TOP
        np.testing.assert_allclose(v[top], E[top], atol=TOL, err_msg=f"{layout}: the exact top part")
        np.testing.assert_allclose(a["energy_f_test"], _exact_f_test(spec, data, ck.theta, ck.f_test)[:TOP], atol=TOL)
        got[layout] = (v, lo, hi)
    v0, lo0, hi0 = got["local"]
    for layout, (v, lo, hi) in got.items():
        width = np.maximum(hi - lo, hi0 - lo0)
        assert np.all(np.abs(v - v0) <= width + 1e-9), f"{layout} vs local: values differ beyond the bracket widths"


def test_the_client_reads_f_test_to_m(tmp_path) -> None:
    spec = _spec("local", 1)
    url = str(tmp_path / "s.zarr")
    assert run_experiment(spec, SpectrumStore(url)).status == "done"
    run = Client(url).run(run_id(spec))
    ds = run.energy_curve("f_test")
    assert ds.attrs["route"] == "quadrature" and int(ds["k"].values[-1]) == M, (ds.attrs["route"], ds["k"].values)
    value, lower, upper = run.energy("f_test", M - 7, step=4)
    assert lower <= value <= upper and upper - lower < 1.0
    assert run.energy("f_test", M, step=4) == (1.0, 1.0, 1.0)
    assert "f_test" in set(run.bracket_widths().phi)  # every φ the run stores (f_test was left out)
    from nsa_dist.export import curve_sources, scalar_sources

    tags = {s.tag for s in curve_sources(run)}
    for s in ("", "_lower", "_upper"):
        assert f"curve_energy_f_test{s}/k_{M}" in tags and f"curve_energy_y{s}/k_{N}" in tags, sorted(tags)[:5]
    # the grid's positions are not k: f_test's curve went out a second time as …/curve_test_<position>
    # (curve_test_10 held E at k = 12), beside its …/k_<k> series
    by_position = sorted(s.tag for s in scalar_sources(run) if "/curve_test_" in s.tag or "/curve_" in s.tag)
    assert not by_position, f"curve arrays exported by grid position too: {by_position[:4]}"
