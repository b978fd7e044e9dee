"""A run whose checkpoints come from a user's training loop (the Tracker's plain pieces, no Ray).

The Tracker (``nsa_dist/tracker.py``) snapshots θ_t and the outputs at recorded steps;
:class:`TrackedRunService` analyses those checkpoints with the same :class:`SpectralAnalyzer`
and writes them with the same :class:`RunWriter` as a spec run, so the store, the client, the
figures and resume cannot tell the two sources apart (DESIGN.md, "Sources of checkpoints").
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np
import torch
from torch import nn

from nsa_dist.config import ExperimentSpec
from nsa_dist.data import Dataset
from nsa_dist.pipeline.checkpoint import Checkpoint
from nsa_dist.pipeline.hessian_step import hessian_dims, hessian_eig_count
from nsa_dist.pipeline.model_state import analysis_copy
from nsa_dist.pipeline.pool import ThreadAnalysisPool as ThreadTrackerPool  # noqa: F401 - tracker.py's import, until it names pool.py
from nsa_dist.pipeline.nsa_extras import constant_gram_applies, gram_change_size
from nsa_dist.pipeline.runner import hessian_flags, step_plan
from nsa_dist.pipeline.step_extras import full_kernel_size, per_class_size
from nsa_dist.pipeline.spectral import SpectralAnalyzer, spectrum_size, step_lambda_max
from nsa_dist.store import RunDims, RunWriter, SpectrumStore

__all__ = ["TrackedRunService", "ThreadTrackerPool", "tracked_spec", "tracked_dims", "tracked_static", "RNG_BYTES"]

RNG_BYTES = 1  # a tracked run has no trainer RNG; its resume state is θ alone


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha1()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def tracked_spec(name: str, model: nn.Module, data: Dataset, K: int, *, steps: int, record: dict,
                 spectrum: dict, hessian: dict | None, optimizer: str, seed: int, device: str,
                 loss: str = "l2") -> ExperimentSpec:
    """The ExperimentSpec stored with a tracked run.

    ``data`` is ``{name: arrays, path: "sha1:<digest of X, y, X_test, y_test>"}`` and ``model`` a
    ``source: tracker`` block naming the class, its parameter count and a digest of the parameter
    names and shapes — so reopening the name with other data or another network is refused.
    """
    cls = type(model)
    path = f"{re.sub(r'[^A-Za-z0-9_.]', '_', cls.__module__)}:{re.sub(r'[^A-Za-z0-9_.]', '_', cls.__qualname__)}"
    shapes = [(k, tuple(p.shape), p.requires_grad) for k, p in model.named_parameters()]
    P = sum(p.numel() for p in model.parameters())
    return ExperimentSpec.model_validate({
        "name": name, "seed": seed, "steps": steps, "record": record, "spectrum": spectrum, "hessian": hessian,
        "loss": loss,
        "device": device, "optimizer": {"name": optimizer},
        "data": {"name": "arrays", "n": data.n, "n_test": int(data.X_test.shape[0]),
                 "path": "sha1:" + _digest(data.X, data.y, data.X_test, data.y_test)},
        "model": {"factory": path, "source": "tracker", "input_dim": int(np.prod(data.X.shape[1:])), "output_dim": K,
                  "kwargs": {"n_params": P, "parameters_sha1": hashlib.sha1(repr(shapes).encode()).hexdigest()[:16]}},
    })


def tracked_dims(spec: ExperimentSpec, data: Dataset, analyzer: SpectralAnalyzer, n_params: int) -> RunDims:
    """The store sizes of a tracked run (no optimizer slots; X stored flattened to (N, d))."""
    K, M = spectrum_size(spec, data.n), int(data.X_test.shape[0])
    imgs = analyzer.images
    Hk, Hr, Hg = hessian_dims(spec, n_params)
    return RunDims(N=data.n, M=M, d=int(np.prod(data.X.shape[1:])), Ko=spec.model.output_dim, P=n_params,
                   S=len(spec.record_steps()), T=spec.steps, K=K,
                   Kt=min(K, M) if spec.spectrum.test_points and M else 0,
                   nI=len(imgs.indices) if imgs else 0, R=spec.spectrum.image_size if imgs else 0,
                   F=spec.spectrum.fourier_size if imgs else 0, n_slots=0, L=RNG_BYTES,
                   store_eigenvectors=bool(spec.spectrum.store_eigenvectors), hessian=spec.hessian is not None,
                   Hk=Hk, Hr=Hr, Hg=Hg, Kf=full_kernel_size(spec, data.n), Kc=per_class_size(spec, data.n),
                   **hessian_flags(spec), HI=hessian_eig_count(spec, data.n), Kg=gram_change_size(spec, K),
                   Cg=constant_gram_applies(spec))


def tracked_static(spec: ExperimentSpec, data: Dataset, analyzer: SpectralAnalyzer) -> dict[str, np.ndarray]:
    """The arrays written once when a tracked run is created (X, X_test flattened to (n, d))."""
    N, M = data.n, int(data.X_test.shape[0])
    out = {"X": data.X.reshape(N, -1), "y": data.y, "X_test": data.X_test.reshape(M, int(np.prod(data.X.shape[1:]))), "y_test": data.y_test,
           "image_indices": np.asarray(analyzer.images.indices if analyzer.images else [], dtype=np.int64),
           **step_plan(spec, spec.record_steps(), analyzer.hessian.indices, analyzer.K)}
    return out


class TrackedRunService:
    """Analyses and writes the checkpoints of one tracked run (a thread's or a Ray actor's job).

    Args:
        store_url: the store the run was created in (by the Tracker).
        spec: the run's spec as JSON (``tracked_spec``).
        model: the user's network (copied; its parameters, buffers and modes are overwritten with
            each checkpoint's θ_t and :class:`~nsa_dist.pipeline.model_state.ModelState`).
        data: the run's points and targets.
        threads: torch threads (Ray actors: their CPUs).
        token: the Tracker's lease token, fencing every write (LeaseLost once another took the run).
    """

    def __init__(self, store_url: str, spec: dict, model: nn.Module, data: Dataset, threads: int | None = None,
                 token: str | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.spec = ExperimentSpec.model_validate(spec)
        self.analyzer = SpectralAnalyzer(self.spec, data, model=analysis_copy(model))
        store = SpectrumStore(store_url)
        dims = store.dims(self.spec.name) if store.has_run(self.spec.name) else None  # the run's sizes, as stored
        self.writer: RunWriter = store.writer(self.spec.name, spec, dims, create=False, token=token)

    def pid(self) -> int:
        import os

        return os.getpid()

    def analyze_and_write(self, ck: Checkpoint) -> dict[str, Any]:
        """Compute recorded step ``ck.index`` and write it; returns a short summary."""
        result = self.analyzer.analyze(ck)
        self.writer.write_step(ck.index, result, ck.state)
        return {"index": ck.index, "step": ck.step, "loss": ck.loss, "lambda_max": step_lambda_max(result)}
