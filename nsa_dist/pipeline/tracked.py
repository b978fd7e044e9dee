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
from nsa_dist.pipeline.model_state import analysis_copy
from nsa_dist.pipeline.notes import recorded_notes
from nsa_dist.pipeline.plan import RunPlan
from nsa_dist.pipeline.spectral import SpectralAnalyzer
from nsa_dist.store import RunWriter, SpectrumStore

__all__ = ["TrackedRunService", "tracked_spec"]


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha1()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def tracked_spec(
    name: str,
    model: nn.Module,
    data: Dataset,
    K: int,
    *,
    steps: int,
    record: dict,
    spectrum: dict,
    hessian: dict | None,
    optimizer: str,
    seed: int,
    device: str,
    loss: str = "l2",
) -> ExperimentSpec:
    """The ExperimentSpec stored with a tracked run.

    ``data`` is ``{name: arrays, path: "sha1:<digest of X, y, X_test, y_test>"}`` and ``model`` a
    ``source: tracker`` block naming the class, its parameter count and a digest of the parameter
    names and shapes — so reopening the name with other data or another network is refused.
    """
    cls = type(model)
    path = f"{re.sub(r'[^A-Za-z0-9_.]', '_', cls.__module__)}:{re.sub(r'[^A-Za-z0-9_.]', '_', cls.__qualname__)}"
    shapes = [(k, tuple(p.shape), p.requires_grad) for k, p in model.named_parameters()]
    P = sum(p.numel() for p in model.parameters())
    return ExperimentSpec.model_validate(
        {
            "name": name,
            "seed": seed,
            "steps": steps,
            "record": record,
            "spectrum": spectrum,
            "hessian": hessian,
            "loss": loss,
            "device": device,
            "optimizer": {"name": optimizer},
            "data": {
                "name": "arrays",
                "n": data.n,
                "n_test": int(data.X_test.shape[0]),
                "path": "sha1:" + _digest(data.X, data.y, data.X_test, data.y_test),
            },
            "model": {
                "factory": path,
                "source": "tracker",
                "input_dim": int(np.prod(data.X.shape[1:])),
                "output_dim": K,
                "kwargs": {"n_params": P, "parameters_sha1": hashlib.sha1(repr(shapes).encode()).hexdigest()[:16]},
            },
        }
    )


class TrackedRunService:
    """Analyses and writes the checkpoints of one tracked run (a thread's or a Ray actor's job).

    Args:
        store_url: the store the run was created in (by the Tracker).
        plan: the run's plan (of its ``tracked_spec``).
        model: the user's network (copied; its parameters, buffers and modes are overwritten with
            each checkpoint's θ_t and :class:`~nsa_dist.pipeline.model_state.ModelState`).
        data: the run's points and targets.
        threads: torch threads (Ray actors: their CPUs).
        token: the Tracker's lease token, fencing every write (LeaseLost once another took the run).
        relay_notes: in a Ray actor: the ``nsa_dist`` log's notes of each step travel back in its
            summary (:mod:`nsa_dist.pipeline.notes`).
    """

    def __init__(
        self,
        store_url: str,
        plan: RunPlan,
        model: nn.Module,
        data: Dataset,
        threads: int | None = None,
        token: str | None = None,
        relay_notes: bool = False,
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.relay_notes = relay_notes
        self.spec = plan.spec
        self.analyzer = SpectralAnalyzer(plan, data, model=analysis_copy(model))
        self.writer: RunWriter = SpectrumStore(store_url).writer(
            plan.run_id, plan.spec_json, plan.dims, create=False, token=token
        )

    def pid(self) -> int:
        import os

        return os.getpid()

    def analyze_and_write(self, ck: Checkpoint) -> dict[str, Any]:
        """Compute recorded step ``ck.index`` and write it; returns a short summary."""
        with recorded_notes(self.relay_notes) as notes:
            result = self.analyzer.analyze(ck)
            self.writer.write_step(ck.index, result, ck.state)
        return {"index": ck.index, "step": ck.step, "loss": ck.loss, "lambda_max": result.lambda_max, "notes": notes}
