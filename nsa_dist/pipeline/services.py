"""The per-run roles as plain classes with idempotent methods (the Ray layer makes them actors).

``TrainerService.checkpoint(i)`` = "train until recorded step i and hand me its checkpoint":
called again after a restart it resumes from the last stored checkpoint, never from counting
steps.  ``SpectralService.analyze_and_write(...)`` computes one (run, step) and writes it to
the store; doing it twice writes the same chunks twice.  Both write on behalf of the driver that
holds the run's lease: given its token, every write is fenced by it (``LeaseLost`` once another
driver took the run over), and each checks that the data it loaded is the run's.  Both take the
run's data and network from :class:`~nsa_dist.pipeline.materials.RunMaterials` (once per process).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from nsa_dist.data import Dataset
from nsa_dist.pipeline.checkpoint import Checkpoint, TrainerState
from nsa_dist.pipeline.materials import RunMaterials
from nsa_dist.pipeline.notes import recorded_notes
from nsa_dist.pipeline.plan import RunPlan
from nsa_dist.pipeline.spectral import SpectralAnalyzer
from nsa_dist.pipeline.trainer import Trainer
from nsa_dist.store import RunWriter, SpectrumStore

__all__ = ["TrainerService", "SpectralService", "open_writer"]

_SERIAL = itertools.count()


def open_writer(store_url: str, plan: RunPlan, data: Dataset | None = None, token: str | None = None) -> RunWriter:
    """The writer of an existing run (created by the coordinator), checked against the plan's spec
    and against ``data`` (this node's copy must be the run's), fenced by the driver's lease ``token``."""
    return SpectrumStore(store_url).writer(
        plan.run_id,
        plan.spec_json,
        plan.dims,
        create=False,
        token=token,
        data_fingerprint=data.fingerprint() if data is not None else None,
    )


class TrainerService:
    """Trains one run; restarts resume from the store's last finished checkpoint.  Its data is
    loaded when it starts (checked against the run's fingerprint: what is on disk now)."""

    def __init__(self, plan: RunPlan, store_url: str, threads: int | None = None, token: str | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.plan, self.spec = plan, plan.spec
        self.run_id, self.store_url = plan.run_id, store_url
        self._refused: Exception | None = None
        try:
            self.data = RunMaterials.load(plan, fresh=True).data
            self.writer = open_writer(store_url, plan, self.data, token)
            self._reset()
        except Exception as exc:  # noqa: BLE001 — raised by the first call, where the driver reads its cause
            # (raised here, it killed the actor: the run failed as "its trainer kept dying: ActorDiedError"
            # after restarts that could not help, the cause — data changed under a sweep — only in Ray's
            # tracebacks on the terminal: an audit)
            self._refused = exc

    def _usable(self) -> None:
        if self._refused is not None:
            raise self._refused

    def _reset(self, before: int | None = None) -> None:
        """A fresh trainer at the last stored checkpoint (with index < ``before`` when given)."""
        self.trainer = Trainer(self.plan, self.data)
        i = self.writer.resume_index(before)
        if i is not None:
            self.trainer.load_state(TrainerState(**self.writer.state_at(i)))

    def pid(self) -> int:
        import os

        return os.getpid()

    def step(self) -> int:
        self._usable()
        return self.trainer.step

    def checkpoint(self, index: int) -> Checkpoint:
        """Train until recorded step ``index`` and return its checkpoint (writes the loss trace)."""
        self._usable()
        t = self.trainer.record[index]
        if self.trainer.step > t:  # asked again for a step already passed: start over from the store
            self._reset(before=index + 1)
        for ck in self.trainer.train_until(t + 1):
            self.writer.write_trace(ck.trace_start, ck.loss_trace)
            if ck.index == index:
                return ck
        raise RuntimeError(f"run {self.run_id}: recorded step {t} (index {index}) was not reached")


class SpectralService:
    """Analyses (run, step) checkpoints and writes them.  Its analyzer and writer of a run are kept
    with the run's :class:`~nsa_dist.pipeline.materials.RunMaterials` (at most
    :data:`~nsa_dist.pipeline.materials.MAX_RUNS` runs per process, least recently used dropped)."""

    def __init__(self, store_url: str, threads: int | None = None, relay_notes: bool = False) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.store_url = store_url
        self.relay_notes = relay_notes  # in a Ray actor: the log's notes travel back in the summary
        self._serial = next(_SERIAL)  # what this service keeps with a run is its own (id() is reused)

    def pid(self) -> int:
        import os

        return os.getpid()

    def _run(self, plan: RunPlan) -> tuple[SpectralAnalyzer, RunWriter]:
        m = RunMaterials.load(plan)
        return m.hold(
            ("spectral_service", self._serial),
            lambda: (SpectralAnalyzer(plan, m.data), open_writer(self.store_url, plan, m.data)),
        )

    def analyze_and_write(
        self, plan: RunPlan, ck: Checkpoint, gang: Any = None, token: str | None = None
    ) -> dict[str, Any]:
        """Compute recorded step ``ck.index`` of the planned run and write it; returns a short summary.

        ``gang``: the step's gang (a :class:`~nsa_dist.pipeline.layout.Gang`) when the run's layout
        is distributed; this worker then drives Lanczos and the metrics on the gang's products.
        ``token``: the driver's lease token, fencing the write (LeaseLost once it lost the run).
        """
        with recorded_notes(self.relay_notes) as notes:
            analyzer, writer = self._run(plan)
            writer.token = token
            result = analyzer.analyze(ck, gang)
            writer.write_step(ck.index, result, ck.state)
        return {
            "notes": notes,
            "run_id": plan.run_id,
            "index": ck.index,
            "step": ck.step,
            "loss": ck.loss,
            "lambda_max": result.lambda_max,
            "energy_y_10": result.energy_y_at(10),
        }
