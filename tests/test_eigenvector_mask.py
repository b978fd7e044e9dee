"""Which steps hold eigenvectors is read from the run's stored ``eigenvector_steps`` mask, never from
the spec's schedule (a run written before the mask existed falls back to the spec), and the step
pair of spectrum preservation (NSA Fig. 7d) is one rule for the writer and the client."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

import nsa_dist.metrics.preservation as preservation_module
from nsa_dist.client import Client
from nsa_dist.config import ExperimentSpec
from nsa_dist.metrics.preservation import preservation_pair
from nsa_dist.metrics.reconstruction import reconstruction_ks
from nsa_dist.pipeline import run_experiment
from nsa_dist.pipeline.checkpoint import TrainerState
from nsa_dist.store import RunDims, SpectrumStore, StepResult, run_arrays, step_specs

SMALL = dict(
    name="mask",
    data={"n": 16, "n_test": 4},
    model={"depth": 2, "width": 8},
    steps=6,
    record={"every": 2},
    spectrum={"k": 4, "dtype": "float64", "images": [1, 2], "image_size": 4, "fourier_size": 3},
)


def _check_reads_follow(run, mask: np.ndarray) -> None:
    """Every reader of ``run`` agrees with ``mask`` ((S,) bool along run.steps) at every finished step."""
    assert run.eigenvector_mask.tolist() == mask.tolist(), f"mask read {run.eigenvector_mask} != {mask}"
    assert run.eigenvector_steps.tolist() == run.steps[mask].tolist()
    for t, has in zip(run.steps.tolist(), mask.tolist()):
        assert run.stores_eigenvectors(t) is has, f"step {t}: stores_eigenvectors {not has}, the mask says {has}"
        if has:
            V = run.eigenvectors(t)
            assert np.isfinite(V).all(), f"step {t}: stored eigenvectors hold NaN"
            assert run.kernel.reconstructions(t)["f"].shape[0] == len(run.array("reconstruction_k"))
        else:
            with pytest.raises(KeyError, match=f"not at {t}"):
                run.eigenvectors(t)
            with pytest.raises(KeyError, match=f"not at {t}"):
                run.kernel.reconstructions(t)


@pytest.mark.parametrize("store", [[2, 5], True])
def test_readers_follow_the_stored_mask_and_an_old_run_without_it_still_reads(tmp_path, store):
    """A run written by the pipeline (eigenvectors at listed steps, or at every recorded step):
    readers agree with its stored mask at every step; with the mask removed (a run written before it
    existed) they read the same by the spec's schedule."""
    url = str(tmp_path / "s.zarr")
    spec = ExperimentSpec(**{**SMALL, "spectrum": {**SMALL["spectrum"], "store_eigenvectors": store}})
    out = run_experiment(spec, SpectrumStore(url))
    assert out.status == "done"
    run = Client(url).run(out.run_id)
    stored = np.asarray(run.array("eigenvector_steps"), bool)
    assert run.steps.tolist() == [0, 2, 4, 5] and len(stored) == 4
    _check_reads_follow(run, stored[run.finished])
    for t in run.eigenvector_steps.tolist():  # the stored columns are orthonormal (float32 storage)
        V = run.eigenvectors(t)
        err = np.abs(V.T @ V - np.eye(V.shape[1])).max()
        assert err < 1e-5, f"step {t}: stored eigenvectors off orthonormal by {err:.2e}"
    a = run.array_attrs("preservation")
    pair = preservation_pair(run.eigenvector_steps.tolist(), listed=isinstance(store, list))
    assert (a["t1"], a["t2"]) == pair, f"stored preservation pair {(a['t1'], a['t2'])}, the rule gives {pair}"
    _, t1, t2, _ = run.spectrum_preservation(i=[1, 2])  # computed by the client: the same default pair
    assert (t1, t2) == pair, f"the client's default pair {(t1, t2)} != the writer's {pair}"

    del SpectrumStore(url).group(out.run_id)["eigenvector_steps"]
    old = Client(url).run(out.run_id)
    assert not old.has("eigenvector_steps")
    _check_reads_follow(old, stored[run.finished])
    assert old.eigenvector_steps.tolist() == run.eigenvector_steps.tolist()


# a run written straight through the store's writer: its mask and its spec's schedule differ
DIMS = RunDims(
    N=5,
    M=2,
    d=3,
    Ko=1,
    P=4,
    S=4,
    T=31,
    K=3,
    k_test=0,
    n_images=0,
    image_size=0,
    fourier_size=0,
    n_slots=1,
    rng_bytes=2,
    store_eigenvectors=True,
)
STEPS = np.array([0, 10, 20, 29])
MASK = np.array([False, True, True, False])
SPEC = {"name": "differ", "steps": 30, "record": {"every": 10}, "spectrum": {"k": 3, "store_eigenvectors": [0, 29]}}


def _basis(i: int) -> np.ndarray:
    """Step index ``i``'s made-up orthonormal (N, K) eigenvectors (float32-representable)."""
    Q = np.linalg.qr(np.random.default_rng(i).standard_normal((DIMS.N, DIMS.K)))[0]
    return Q.astype(np.float32)


def _write_run(url: str) -> None:
    store = SpectrumStore(url)
    w = store.writer("differ-0001", SPEC, DIMS)
    static = {a.name: np.zeros(a.shape, a.dtype) for a in run_arrays(DIMS) if a.name in w.static_names()}
    static.update(steps=STEPS, eigenvector_steps=MASK, reconstruction_k=np.asarray(reconstruction_ks(DIMS.K)))
    w.write_static(static)
    for i in range(DIMS.S):
        specs = step_specs(DIMS, eigenvectors=bool(MASK[i]), hessian=False, first=i == 0)
        result = {n: np.full(a.shape[1:], 0.5 + i).astype(a.dtype) for n, a in specs.items()}
        if MASK[i]:
            result["eigenvectors"] = _basis(i)
        state = TrainerState(
            int(STEPS[i]), np.zeros(DIMS.P, np.float32), np.zeros((1, DIMS.P), np.float32), np.zeros(2, np.uint8)
        )
        w.write_step(i, StepResult.from_arrays(result), state)


def test_a_store_whose_spec_schedule_and_mask_differ_is_read_by_the_mask(tmp_path):
    """The spec says store_eigenvectors [0, 29], the stored mask says steps 10 and 20: every reader
    follows the mask (reading by the spec would ask for rows that were never written)."""
    url = str(tmp_path / "s.zarr")
    _write_run(url)
    run = Client(url).run("differ-0001")
    assert run.spec.spectrum.store_eigenvectors == [0, 29]
    _check_reads_follow(run, MASK)
    for i in np.flatnonzero(MASK):
        got = run.eigenvectors(int(STEPS[i]))
        assert np.array_equal(got, _basis(int(i)).astype(np.float64)), f"eigenvectors at step {STEPS[i]} differ"
    P, t1, t2, rows = run.spectrum_preservation()  # nothing stored: computed, listed → first and last of the mask
    assert (t1, t2) == (10, 20) and rows == [1, 2, 3]
    V1, V2 = _basis(1).astype(np.float64), _basis(2).astype(np.float64)
    ref = (np.cumsum((V1.T @ V2) ** 2, axis=0) / np.sum(V2**2, axis=0)).T  # (rows, K): E relative to ‖v_i^{t2}‖²
    err = np.abs(P - ref).max()
    assert err < 1e-12, f"preservation from the mask's steps off the float64 reference by {err:.2e}"


def test_preservation_pair_is_the_writers_rule():
    """t2 the last; t1 the second of more than two unless the steps were listed, else the first."""
    assert preservation_pair([0, 10, 20, 30], listed=False) == (10, 30)
    assert preservation_pair([0, 10, 20, 30], listed=True) == (0, 30)
    assert preservation_pair([0, 30], listed=False) == (0, 30)
    assert preservation_pair([30], listed=False) is None and preservation_pair([], listed=True) is None
    idx = np.flatnonzero([True, False, True, True])  # storage indices pick alike
    assert preservation_pair(idx, listed=True) == (0, 3)
    failures, tries = doctest.testmod(preservation_module, optionflags=doctest.NORMALIZE_WHITESPACE)[:2]
    assert tries and not failures, f"{failures} of {tries} examples in nsa_dist.metrics.preservation failed"
