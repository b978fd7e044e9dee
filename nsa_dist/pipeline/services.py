"""The per-run roles as plain classes with idempotent methods (the Ray layer makes them actors).

``TrainerService.checkpoint(i)`` = "train until recorded step i and hand me its checkpoint":
called again after a restart it resumes from the last stored checkpoint, never from counting
steps.  ``SpectralService.analyze_and_write(...)`` computes one (run, step) and writes it to
the store; doing it twice writes the same chunks twice.  Both write on behalf of the driver that
holds the run's lease: given its token, every write is fenced by it (``LeaseLost`` once another
driver took the run over), and each checks that the data it loaded is the run's.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from nsa_dist.config import ExperimentSpec
from nsa_dist.data import Dataset, load_dataset
from nsa_dist.pipeline.checkpoint import Checkpoint, TrainerState
from nsa_dist.pipeline.runner import pin_layout, run_id, spec_json
from nsa_dist.pipeline.spectral import SpectralAnalyzer, step_lambda_max
from nsa_dist.pipeline.trainer import Trainer
from nsa_dist.store import RunWriter, SpectrumStore

__all__ = ["TrainerService", "SpectralService", "open_writer"]


def open_writer(store_url: str, spec: ExperimentSpec, data: Dataset | None = None,
                token: str | None = None) -> RunWriter:
    """The writer of an existing run (created by the coordinator), checked against the spec and
    against ``data`` (this node's copy must be the run's), fenced by the driver's lease ``token``.

    The run's array sizes are read from the store (written when the coordinator created it).
    """
    store = SpectrumStore(store_url)
    rid = run_id(spec)
    dims = store.dims(rid) if store.has_run(rid) else None  # None: StoreError below, not shared storage
    return store.writer(rid, spec_json(spec), dims, create=False, token=token,
                        data_fingerprint=data.fingerprint() if data is not None else None)


class TrainerService:
    """Trains one run; restarts resume from the store's last finished checkpoint."""

    def __init__(self, spec: dict, store_url: str, threads: int | None = None, token: str | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.spec = ExperimentSpec.model_validate(spec)
        self.run_id, self.store_url = run_id(self.spec), store_url
        self.data = load_dataset(self.spec.data, seed=self.spec.seed)
        self.writer = open_writer(store_url, self.spec, self.data, token)
        self._reset()

    def _reset(self, before: int | None = None) -> None:
        """A fresh trainer at the last stored checkpoint (with index < ``before`` when given)."""
        self.trainer = Trainer(self.spec, self.data)
        i = self.writer.resume_index(before)
        if i is not None:
            self.trainer.load_state(TrainerState(**self.writer.state_at(i)))

    def pid(self) -> int:
        import os

        return os.getpid()

    def step(self) -> int:
        return self.trainer.step

    def checkpoint(self, index: int) -> Checkpoint:
        """Train until recorded step ``index`` and return its checkpoint (writes the loss trace)."""
        t = self.trainer.record[index]
        if self.trainer.step > t:  # asked again for a step already passed: start over from the store
            self._reset(before=index + 1)
        for ck in self.trainer.train_until(t + 1):
            self.writer.write_trace(ck.trace_start, ck.loss_trace)
            if ck.index == index:
                return ck
        raise RuntimeError(f"run {self.run_id}: recorded step {t} (index {index}) was not reached")


class SpectralService:
    """Analyses (run, step) checkpoints and writes them; keeps the analyzers of recent runs."""

    def __init__(self, store_url: str, threads: int | None = None, cache: int = 2) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.store_url, self.cache = store_url, cache
        self._runs: OrderedDict[str, tuple[SpectralAnalyzer, RunWriter]] = OrderedDict()

    def pid(self) -> int:
        import os

        return os.getpid()

    def _run(self, run_id: str, spec: dict) -> tuple[SpectralAnalyzer, RunWriter]:
        if run_id not in self._runs:
            es = ExperimentSpec.model_validate(spec)
            data = load_dataset(es.data, seed=es.seed)
            analyzer = SpectralAnalyzer(es, data)
            writer = open_writer(self.store_url, es, data)
            pin_layout(writer, analyzer)  # the driver's choice, not this node's memory
            self._runs[run_id] = (analyzer, writer)
            while len(self._runs) > self.cache:
                self._runs.popitem(last=False)
        self._runs.move_to_end(run_id)
        return self._runs[run_id]

    def analyze_and_write(self, run_id: str, spec: dict, ck: Checkpoint, pool: Any = None,
                          token: str | None = None) -> dict[str, Any]:
        """Compute recorded step ``ck.index`` of ``run_id`` and write it; returns a short summary.

        ``pool``: the step's gang (a :class:`~nsa_dist.pipeline.layout.Pool`) when the run's layout
        is distributed; this worker then drives Lanczos and the metrics on the gang's products.
        ``token``: the driver's lease token, fencing the write (LeaseLost once it lost the run).
        """
        analyzer, writer = self._run(run_id, spec)
        writer.token = token
        result = analyzer.analyze(ck, pool)
        writer.write_step(ck.index, result, ck.state)
        E = result["energy_y"]
        return {"run_id": run_id, "index": ck.index, "step": ck.step, "loss": ck.loss,
                "lambda_max": step_lambda_max(result), "energy_y_10": float(E[min(10, len(E)) - 1])}
