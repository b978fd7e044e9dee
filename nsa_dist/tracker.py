"""The write side of the Python API: record NTK / Hessian spectra along a user's own training loop.

```python
tr = Tracker(store, "cnn-run", model, X, y, steps=T, record={"every": 100}, cluster=None)
for step in range(T):
    if tr.due(step):
        tr.record(step, lr=lr, loss=loss)   # snapshot θ_t, f_t; returns at once
    ...                                     # the user's update θ_t → θ_{t+1}
tr.close()                                  # waits for the analyses; status done
```

Contract: ``record(t)`` is called with the model at θ_t, before update t, once per recorded t; it
snapshots θ_t with the model's buffers and per-module training modes, and step t is analysed on
the model exactly as it was then (the Tracker's own forwards leave the user's model unchanged).  The update
(Δθ_t = θ_{t+1} − θ_t, Δf_t) of a recorded step — needed by the first-order metrics — is taken
when the Tracker next sees step t + 1 (``due(t+1)``, ``record(t+1)``, ``log(t+1)``, or ``close()`` after
the last step T − 1); otherwise it is NaN and so are those metrics.  Analyses run in a
background thread (``cluster=None``) or on a Ray spectral-worker pool; at most ``max_inflight``
checkpoints wait, so training blocks only when the analysis falls behind.  A failed analysis is
raised as one :class:`~nsa_dist.errors.AnalysisError` (run, step, cause) at the next Tracker call.

Distributed data parallel (DDP: ``torchrun``, Lightning's ``strategy="ddp"``): every rank runs the
same loop on the same θ_t, so rank 0 records the run and every other rank's Tracker writes nothing
(``due`` is False there; ``record``, ``log`` and ``close`` return at once).  The rank is
``torch.distributed``'s when its process group is initialised, else the launcher's ``RANK``, else
``NODE_RANK`` / ``LOCAL_RANK`` (what Lightning's launcher gives the processes it starts); create
the Tracker after ``init_process_group`` where a launcher sets none of them.  Rank 0's own buffers
(e.g. BatchNorm running statistics, which DDP broadcasts from it) are the ones recorded.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from nsa_dist.config import LossName, RecordSpec
from nsa_dist.data import Dataset
from nsa_dist.losses import parse_loss
from nsa_dist.models import OutputSelector
from nsa_dist.ntk import preserved
from nsa_dist.pipeline import RunSession
from nsa_dist.pipeline.checkpoint import Checkpoint
from nsa_dist.pipeline.model_state import analysis_copy
from nsa_dist.pipeline.pool import ThreadAnalysisPool
from nsa_dist.pipeline.snapshot import StepSnapshots, couples_samples, measured_inputs
from nsa_dist.pipeline.tracked import TrackedRunService, tracked_spec
from nsa_dist.pipeline.tracked_run import TrackedRun
from nsa_dist.store import SpectrumStore

if TYPE_CHECKING:
    from nsa_dist.pipeline.tracked import ExperimentSpec

__all__ = ["Tracker", "couples_samples", "distributed_rank"]

_log = logging.getLogger("nsa_dist")


class Tracker:
    """Records a user's training run into a spectrum store — same schema as ``nsa run``.

    Args:
        store: a store path / fsspec URL or a :class:`SpectrumStore`.
        name: the run's id (``[A-Za-z0-9_.-]+``); reopening the same name continues the run.
        model: the network being trained (any ``nn.Module`` mapping (n, …) → (n,) or (n, K)); float32
            or float64 (a float64 model is fed float64 points and analysed from its float64 θ_t).
            Its buffers (e.g. BatchNorm running statistics) and per-module training modes at
            ``record(t)`` are part of step t: the analysis computes with them.
        X: (N, …) training points — (N, d) vectors, (N, C, H, W) images, or (N, T) integer token ids
            (kept integers up to the model; floating points are fed in the model's dtype);
            y: (N,) or (N, K).
        X_test, y_test: optional (M, …) / (M,) or (M, K) test points.
        steps: T, the number of updates the loop will make (sizes the store).
        record: when to record, a :class:`RecordSpec` block (``every`` / ``log_points`` / ``steps``).
        spectrum, hessian: the spec blocks of the same names (hessian None: off).
        loss: the loss the stored metrics refer to: "mse" — L = (1/N) Σ ½‖f − y‖² — or "cross_entropy"
            (y one-hot (N, K), K ≥ 2: m_t = softmax(f) − y, the Hessian's HC = diag p − ppᵀ).
        optimizer: "custom" (any update: the first-order prediction is J_t Δθ_t) or "gd" (plain full-batch
            gradient descent on that loss: the closed form −δ_t/N·G_t m_t, as ``nsa run``).
        cluster: None (a background thread of this process), "local" (an embedded Ray), "auto" (the
            running Ray cluster) or "ray://HOST:PORT".
        workers, worker_cpus, worker_gpus: the Ray spectral-worker pool.
        max_inflight: checkpoints waiting for analysis before ``record`` blocks.
        seed, device: as in a spec ("auto": CUDA when available).
        output: which output is f when the model returns a dict, a tuple or a Hugging Face
            ``ModelOutput``: a key, an index, or a callable ``output -> tensor`` (as in
            :func:`nsa_dist.ntk.gram`).  A ``torch.compile``'d model is analysed through the module
            it wraps (``_orig_mod``, the same parameters), so the analyses never recompile it.

    Raises:
        ShapeError: model output not (n,) / (n, K), or X, y, X_test, y_test of inconsistent shapes.
        NonFiniteError: NaN/inf in X or y.
        StoreError: the store holds a run of this name with another spec, data or network.
        TypeError: the model cannot be pickled for Ray workers (cluster set).
        LeaseLost: (from ``record`` / ``log`` / ``close``) another writer took the run over while this
            process was paused longer than the lease's ttl; the Tracker closes without writing more.
    """

    def __init__(
        self,
        store: str | SpectrumStore,
        name: str,
        model: nn.Module,
        X: Any,
        y: Any,
        X_test: Any = None,
        y_test: Any = None,
        *,
        steps: int,
        record: dict | RecordSpec | None = None,
        spectrum: dict | None = None,
        hessian: dict | None = None,
        loss: str | LossName = "mse",
        optimizer: str = "custom",
        cluster: str | None = None,
        workers: int = 1,
        worker_cpus: float = 1.0,
        worker_gpus: float = 0.0,
        max_inflight: int = 2,
        seed: int = 0,
        device: str = "auto",
        output: OutputSelector = None,
    ) -> None:
        loss = parse_loss(loss)
        if optimizer not in ("custom", "gd"):
            raise ValueError(f"optimizer={optimizer!r} is not one of custom, gd")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.model, user, self.data, K = measured_inputs(model, output, X, y, X_test, y_test)
        rec = record.model_dump() if isinstance(record, RecordSpec) else (record or {"log_points": 20})
        self.spec: ExperimentSpec = tracked_spec(
            name,
            user,
            self.data,
            K,
            steps=steps,
            record=rec,
            spectrum=spectrum or {},
            hessian=hessian,
            optimizer=optimizer,
            seed=seed,
            device=device,
            loss=loss,
        )
        self._trainable = {k: p.requires_grad for k, p in self.model.named_parameters()}
        self.rank = distributed_rank()
        if self.rank:  # DDP: rank 0 records; this rank checked its inputs and writes nothing
            _log.info(
                "Tracker %r: distributed rank %d — rank 0 records this run, this process writes nothing",
                name,
                self.rank,
            )
            self.tracked = None
            return
        ce = loss is LossName.CROSS_ENTROPY
        self.snapshots = StepSnapshots(self.model, self.data, cross_entropy=ce, name=self.spec.name)

        def pool(session: RunSession) -> Any:  # a copy of the network analyses, in a thread or on Ray
            return _analysis_pool(cluster, session, self.model, self.data, workers, worker_cpus, worker_gpus)

        # one writer of this run at a time: the lease, the run created or reopened as `nsa run` does
        update = self._with_update
        self.tracked = TrackedRun.open(self.spec, store, self.data, self.model, pool, max_inflight, update)
        self.session, self.pool, self.schedule = self.tracked.session, self.tracked.pool, self.tracked.schedule
        self.plan, self.writer = self.session.plan, self.session.writer
        self.store: SpectrumStore = self.writer.store
        # the trainable set (self._trainable, above) is part of the run: the stored network digest, the
        # NTK route resolved once on the analysis copy and the Hessian's parameter set are all fixed here

    # ------------------------------------------------------------------ the loop's calls
    @property
    def inflight(self) -> int:
        return self.tracked.inflight if self.tracked else 0

    @property
    def resubmitted(self) -> int:
        """Steps re-sent after their worker died."""
        return self.pool.resubmitted if self.tracked else 0

    @property
    def max_seen_inflight(self) -> int:
        return self.tracked.max_seen_inflight if self.tracked else 0

    @property
    def blocked(self) -> int:
        """Times record() waited for a free slot."""
        return self.tracked.blocked if self.tracked else 0

    def due(self, step: int) -> bool:
        """Whether ``step`` is a recorded step still to record: not in the store, not taken by this
        Tracker's ``record`` (so a loop that sees one step twice, e.g. under gradient accumulation,
        records it once).  Also takes a pending update.

        Raises:
            AnalysisError: the analysis of an earlier recorded step failed (the run is marked failed).
        """
        if self.tracked is None:
            return False  # a DDP rank other than 0: rank 0 records
        self.tracked.check()
        if self.tracked.closed:
            return False
        self.tracked.advance(step)
        return self.tracked.due(step)

    def log(self, step: int, loss: float) -> None:
        """Note the loss of update ``step`` for the store's loss curve (cheap; written at the next record).

        Raises:
            ValueError: the Tracker is closed (the loss could no longer be written).
            AnalysisError: the analysis of an earlier recorded step failed (the run is marked failed).
        """
        if self.tracked is None:
            return
        self.tracked.check()
        if self.tracked.closed:
            raise ValueError(f"this Tracker is closed; the loss of step {step} would not be written")
        self.tracked.advance(step)
        self.tracked.trace[step] = float(loss)

    @torch.no_grad()
    def record(self, step: int, lr: float, loss: float | None = None) -> None:
        """Snapshot θ_t, the model's buffers and modes, and the outputs at recorded step ``step`` and
        queue its analysis; returns at once.  The user's model is left as it was (a train-mode
        BatchNorm's running statistics are not advanced by the Tracker's own forwards).

        Args:
            step: t, one of the recording schedule's steps.
            lr: δ_t, the learning rate of update t.
            loss: the loop's own loss at t (checked, and kept in the loss curve); the stored ``loss`` is
                L(θ_t) over all N points.

        Raises:
            ValueError: ``step`` is not in the schedule, was recorded before (in this session or in the
                store), the tracker is closed, or a parameter's ``requires_grad`` changed since the
                Tracker was created (the NTK / Hessian differentiate the trainable parameters of
                the run, fixed then: record a fine-tuning phase as its own run); nothing stored changes.
            NonFiniteError: a NaN/inf loss or outputs (the run is marked failed; finished steps are kept).
            AnalysisError: the analysis of an earlier recorded step failed (the run is marked failed).
        """
        if self.tracked is None:
            return
        self.tracked.check()
        self._check_trainable(step)
        i = self.tracked.recordable(step)
        self.tracked.advance(step)
        self.tracked.recorded.add(step)
        ck = self.snapshots.take(step, i, lr)
        given = ck.loss if loss is None else float(loss)
        if not (np.isfinite(given) and np.isfinite(ck.loss)):
            raise self.tracked.diverged(step, f"loss is {given if not np.isfinite(given) else ck.loss} at step {step}")
        self.tracked.trace[step] = given
        self.tracked.pending = ck  # handed over with its update when the model is at step + 1

    def _with_update(self, ck: Checkpoint, step: int) -> Checkpoint:
        """``ck`` with its update, f_{t+1} computed in step t's per-module training modes: the loop may
        have switched modes since ``record(t)`` (``model.eval()`` to record, ``model.train()`` to train),
        and a train-mode dropout or batch-statistics forward would make Δf_t noise, not the change
        of the function that J_t Δθ_t predicts.  The user's modes are restored after."""
        modes = ck.model_state.training if ck.model_state is not None else {}
        with preserved(self.model):
            for name, m in self.model.named_modules():
                if name in modes:
                    m.training = modes[name]
            return self.snapshots.with_update(ck, step)

    def _check_trainable(self, step: int) -> None:
        """Refuse a step whose trainable set (``requires_grad``) differs from the Tracker's own."""
        now = {k: p.requires_grad for k, p in self.model.named_parameters()}
        changed = [k for k in self._trainable if now.get(k) != self._trainable[k]]
        if changed:
            shown = ", ".join(f"{k} ({'unfrozen' if now.get(k) else 'frozen'})" for k in changed[:6])
            more = f", … ({len(changed)} in all)" if len(changed) > 6 else ""
            raise ValueError(
                f"step {step}: requires_grad changed since the Tracker was created for {shown}{more}; "
                "a run's NTK and Hessian are over the trainable parameters it was created with — "
                "record the phase with another trainable set as its own run (a new Tracker)"
            )

    def _collect(self, block: bool) -> None:
        """Note the steps the pool finished (wait for one if ``block``)."""
        self.tracked.collect(block)

    def close(self) -> None:
        """Wait for every analysis; status ``done`` when every recorded step is in the store.

        Raises:
            AnalysisError: a recorded step's analysis failed (the run is marked failed).
        """
        if self.tracked is not None:
            self.tracked.close()

    def stop(self, reason: str) -> None:
        """End the run ``interrupted`` with ``reason`` while the loop trains on: every recorded step is
        kept (the last one analysed, its update NaN when the model is not at its step + 1 yet), and
        from then on ``due`` is False and ``record`` refused (a new Tracker of the name continues)."""
        if self.tracked is not None and not self.tracked.closed:
            self.tracked.interrupt(None, reason)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.tracked is not None:
            self.tracked.exit(exc_type)

    # ------------------------------------------------------------------ resume
    @property
    def resume_step(self) -> int | None:
        """The last step of the unbroken run of recorded steps from 0 (None: nothing recorded)."""
        self._writer_only("resume_step")
        i = self.writer.resume_index()
        return None if i is None else self.schedule[i]

    def theta_at(self, step: int) -> np.ndarray:
        """θ_t stored with recorded step ``step`` (to restart the loop from there)."""
        self._writer_only("theta_at")
        i = self.tracked.index[step]
        if not self.session.done[i]:
            raise ValueError(f"step {step} is not recorded yet")
        return np.asarray(self.writer.read_step("theta", i))

    def _writer_only(self, what: str) -> None:
        if self.tracked is None:
            raise ValueError(
                f"Tracker.{what} on distributed rank {self.rank}: only rank 0 opens the run; read it there "
                "and send it to the other ranks (torch.distributed.broadcast_object_list)"
            )


def distributed_rank() -> int:
    """This process's global rank in a distributed (DDP) job, 0 when it is not in one:
    ``torch.distributed``'s when a process group is initialised, else the ``RANK`` a launcher
    (torchrun) set, else not 0 when ``NODE_RANK`` or ``LOCAL_RANK`` is (Lightning's launcher sets
    these for the processes it starts)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    if os.environ.get("RANK", "").strip():
        return int(os.environ["RANK"])
    node, local = (int(os.environ.get(v, "").strip() or 0) for v in ("NODE_RANK", "LOCAL_RANK"))
    return 0 if node == local == 0 else max(1, local)


def _analysis_pool(
    cluster: str | None, session: RunSession, model: nn.Module, data: Dataset, workers: int, cpus: float, gpus: float
) -> Any:
    """A tracked run's analysis pool on a copy of ``model``: a background thread (``cluster`` None),
    or Ray spectral workers on ``cluster``; either writes with the session's lease token."""
    url, plan, token, model = session.writer.store.url, session.plan, session.token, _analysis_copy(model)
    if cluster is None:
        return ThreadAnalysisPool(TrackedRunService(url, plan, model, data, token=token))
    from nsa_dist.cluster.tracking import RayTrackerPool

    return RayTrackerPool(cluster, url, plan, model, data, workers=workers, cpus=cpus, gpus=gpus, token=token)


def _analysis_copy(model: nn.Module) -> nn.Module:
    """A CPU copy of the model for the analysis (a thread's own, or the one pickled to Ray): float64
    for a float64 model, else float32."""
    try:
        return analysis_copy(model)
    except (TypeError, AttributeError, RuntimeError) as exc:
        raise TypeError(
            f"the model ({type(model).__qualname__}) cannot be copied or pickled ({exc}); the Tracker "
            "analyses a copy of it, in a thread or pickled to the Ray spectral workers — keep "
            "unpicklable state (locks, open files, data loaders) outside the module"
        ) from exc
