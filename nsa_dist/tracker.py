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

What the Tracker cannot measure ends the recording, not the training: a model cast, moved or given
other parameters after the Tracker was created, a ``requires_grad`` changed, a random forward (an
active dropout) at ``record(t)`` end the run ``interrupted`` with the reason (``Tracker.stopped``),
every recorded step kept, and the loop's later calls do nothing.  A δ_t that is not one number
(parameter groups with different rates) or, under ``optimizer="gd"``, an update that is not
full-batch GD at δ_t is stored as NaN.  The Tracker's own forwards run outside the loop's autocast.

Distributed data parallel (DDP: ``torchrun``, Lightning's ``strategy="ddp"``): every rank runs the
same loop on the same θ_t, so rank 0 records the run and every other rank's Tracker writes nothing
(``due`` is False there; ``record``, ``log`` and ``close`` return at once).  The rank is
``torch.distributed``'s when its process group is initialised, else the launcher's ``RANK``, else
``NODE_RANK`` / ``LOCAL_RANK`` (what Lightning's launcher gives the processes it starts); create
the Tracker after ``init_process_group`` where a launcher sets none of them.  Rank 0's own buffers
(e.g. BatchNorm running statistics, which DDP broadcasts from it) are the ones recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import re
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from nsa_dist.config import LossName, RecordSpec
from nsa_dist.data import Dataset
from nsa_dist.errors import StoreError, UnsupportedModelError
from nsa_dist.losses import parse_loss
from nsa_dist.models import OutputSelector, note_parameters, user_named_modules
from nsa_dist.ntk import attributes_restored, preserved
from nsa_dist.ntk.inputs import _AUTOCAST_DEVICES, autograd_on
from nsa_dist.pipeline import RunSession
from nsa_dist.pipeline.checkpoint import Checkpoint
from nsa_dist.pipeline.model_state import analysis_copy, theta_vector
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
        max_retries: how often Ray re-runs a recorded step whose spectral worker died (it restarts the
            worker each time); one more death fails that step's analysis (as ``cluster.max_retries``
            of a spec).  Not used without ``cluster``.
        max_inflight: checkpoints waiting for analysis before ``record`` blocks.
        seed, device: as in a spec ("auto": CUDA when available).
        output: which output is f when the model returns a dict, a tuple or a Hugging Face
            ``ModelOutput``: a key, an index, or a callable ``output -> tensor`` (as in
            :func:`nsa_dist.ntk.gram`).  A ``torch.compile``'d model is analysed through the module
            it wraps (``_orig_mod``, the same parameters), so the analyses never recompile it.

    Raises:
        ShapeError: model output not (n,) / (n, K), or X, y, X_test, y_test of inconsistent shapes.
        NonFiniteError: NaN/inf in X, y, X_test or y_test.
        StoreError: the store holds a run of this name with another spec, data or network.
        TypeError: the model cannot be pickled for Ray workers (cluster set); integer X (kept as
            token ids) that the model's forward cannot take (integer features: pass X.float()).
        UnsupportedModelError: the model has float16 / bfloat16 parameters, or its forward is
            random as handed over (a dropout in train mode — a fresh module is: call
            ``model.eval()`` before creating the Tracker; at a later ``record`` the run stops
            instead, see :meth:`record`).
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
        max_retries: int = 3,
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
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
        low = sorted({str(p.dtype) for p in model.parameters() if p.dtype in (torch.float16, torch.bfloat16)})
        if low:
            raise UnsupportedModelError(
                f"the model has {', '.join(low)} parameters; the Tracker measures float32 or float64 models (f_t, "
                "G_t and the update in that precision) — train a float32 model under torch.autocast for mixed "
                "precision (the Tracker's own forwards run outside it)"
            )
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
        self._user = user  # the user's module (self.model may wrap it): its names are the ones said
        self._trainable = {k: p.requires_grad for k, p in user.named_parameters()}
        self._layout = _parameter_layout(user)
        self.stopped: str | None = None  # why the Tracker stopped recording by itself (training goes on)
        self.finished = False  # the run was finished when this Tracker opened it: it records and writes nothing
        self._said: set[str] = set()  # the warnings given (each kind once per Tracker)
        self._gd_step: tuple[int, np.ndarray] | None = None  # optimizer="gd": (t, ∇L(θ_t)) of the pending step
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
        # a copy as the analysis has it, to tell at each record whether the model still computes what a copy
        # made now computes at its parameters and buffers (state outside them: an attribute, a plain-tensor
        # mask, a swapped module, which the analysis copy does not follow)
        self._twin = _analysis_copy(self.model)

        network = _network_digest(user, output)

        def pool(session: RunSession) -> Any:  # a copy of the network analyses, in a thread or on Ray
            _same_network(session.writer, self.spec.name, network)  # before the run starts: nothing changes
            return _analysis_pool(
                cluster, session, self.model, self.data, workers, worker_cpus, worker_gpus, max_retries
            )

        # one writer of this run at a time: the lease, the run created or reopened as `nsa run` does
        update = self._with_update
        self.tracked = TrackedRun.open(
            self.spec, store, self.data, self.model, pool, max_inflight, update, self.snapshots.moved
        )
        self.session, self.pool, self.schedule = self.tracked.session, self.tracked.pool, self.tracked.schedule
        self.plan, self.writer = self.session.plan, self.session.writer
        self.store: SpectrumStore = self.writer.store
        # the steps the store held when this Tracker opened the run: the loop passing one again is
        # checked to be on the recorded path (its θ there is the stored θ_t) before any more is recorded
        done = self.session.done
        self._unchecked = {int(t) for i, t in enumerate(self.schedule) if done[i]}
        # the stored step a reopened run continues from: the first new step recorded must not hold its θ
        last = self.writer.resume_index() if self._unchecked else None
        self._continued_from = None if last is None else int(self.schedule[last])
        self._first_seen: int | None = None  # the first step the loop called due / log / record with
        if self.tracked.finished_before(self.session):
            _log.warning(
                "run %r: every recorded step of it is already in %s (a finished run): this Tracker records "
                "nothing — give a new run another name to record it",
                self.spec.name,
                self.store.url,
            )
            self._unchecked = set()  # nothing is recorded: nothing to check, and the run stays as it is
            # nothing written either — no loss from log() (it overwrote the stored loss curve with another
            # loop's; a NaN one marked the finished run failed), no status: the lease goes back now
            self.finished = True
            self.tracked.leave_finished()
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
        records it once).  Also takes a pending update.  False from the moment the model stops being
        the one the run measures (see :meth:`record`), or passes a step the store held when this
        Tracker opened the run with parameters other than the stored θ_t (another initialisation or
        trajectory: restore ``theta_at(resume_step)`` first): the recording stops there, training goes on.

        Raises:
            AnalysisError: the analysis of an earlier recorded step failed (the run is marked failed).
        """
        if self.tracked is None or self.finished:
            return False  # a DDP rank other than 0 (rank 0 records), or a finished run
        self._seen(step)
        self.tracked.check()
        if self.tracked.closed or not self._still_measurable(step) or not self._on_the_recorded_path(step):
            return False
        if step < self.tracked.seen:  # the loop's counter went back: a step before the latest is not recorded
            self._say_once(
                "back",
                f"the loop went back from step {self.tracked.seen} to step {step}: steps before the latest one "
                "are not recorded (θ there would be a later step's)",
            )
            return False
        # a loop may ask of a step ahead (due(t + 1) before update t): the pending step waits for its update
        self.tracked.advance(step, seen=False, wait=True)
        return self.tracked.due(step)

    def log(self, step: int, loss: float) -> None:
        """Note the loss of update ``step`` for the store's loss curve (cheap; written at the next record).
        Nothing once the Tracker stopped recording by itself (:attr:`stopped`).

        Raises:
            ValueError: the Tracker is closed (the loss could no longer be written).
            AnalysisError: the analysis of an earlier recorded step failed (the run is marked failed).
            NonFiniteError: a NaN/inf loss with a non-finite parameter (the run is marked failed at
                this step, as by :meth:`record`; finished steps are kept).  A NaN/inf loss with finite
                parameters (a batch the loop skips) is kept in the loss curve, with a warning.
        """
        if self.tracked is None or self.finished:
            return
        self._seen(step)
        self.tracked.check()
        if self.stopped is not None:
            return
        if self.tracked.closed:
            raise ValueError(
                f"this Tracker is closed{self.tracked.why_closed}; the loss of step {step} would not be written"
            )
        if not self._still_measurable(step):
            return
        # a loss logged as step t + 1 before update t: not yet taken; log(t + 1) may also come after
        # update t + 1 (the README loop logs after opt.step())
        self.tracked.advance(step, wait=True, after=True)
        if not np.isfinite(float(loss)):  # said at the step it happens, not at the next record
            self.tracked.trace[step] = float(loss)
            bad = _non_finite_parameters(self._user)
            if not bad:  # a batch the loop skips (θ untouched): the curve keeps its NaN, the run goes on — it
                # failed the run and then refused every later log (an audit's loop skipping one corrupt batch)
                _log.warning(
                    "the loss logged at step %d is %s but the parameters are finite: kept in the loss curve; "
                    "the run goes on (a non-finite parameter would end it)",
                    step,
                    float(loss),
                )
                return
            raise self.tracked.diverged(
                step, f"loss is {float(loss)} at step {step}, with non-finite parameters ({bad})"
            )
        self.tracked.trace[step] = float(loss)

    @torch.no_grad()
    def record(self, step: int, lr: Any, loss: float | None = None) -> None:
        """Snapshot θ_t, the model's buffers and modes, and the outputs at recorded step ``step`` and
        queue its analysis; returns at once.  The user's model is left as it was (a train-mode
        BatchNorm's running statistics are not advanced by the Tracker's own forwards), and the
        Tracker's forwards run outside the loop's ``torch.autocast`` (f_t in the model's own dtype).

        The recording stops — the run ends ``interrupted`` with the reason, every recorded step kept,
        :attr:`stopped` says why, a warning is logged, and from then on ``due`` is False and
        ``record`` / ``log`` do nothing — when the model is no longer the one the run measures: a
        parameter's ``requires_grad`` changed since the Tracker was created (the NTK / Hessian
        differentiate the run's trainable parameters, fixed then: record a fine-tuning phase as its
        own run under another name), the model was cast or moved (``model.double()``: create the
        Tracker after), parameters were added, removed or reshaped, or its forward is random at
        ``record(t)`` (a dropout in train mode: record in eval mode).  Training goes on.

        Args:
            step: t, one of the recording schedule's steps.
            lr: δ_t, the learning rate of update t — a number, or the optimizer (or its scheduler, or
                the scheduler's ``get_last_lr()``): its groups' one rate; groups with different rates
                make δ_t ambiguous, stored as NaN (with a warning).  Under ``optimizer="gd"`` a step
                whose update is not full-batch gradient descent at δ_t (Δθ_t ≠ −δ_t ∇L(θ_t): another
                optimizer, clipping, mini-batches, another rate; checked for one output, to 10⁻⁶ for a
                float64 model, 10⁻⁴ for a float32 one, 1 % where TF32 or 16-bit parameters round — a
                reduced-precision loop's rounding) stores δ_t as NaN, with a warning, and predicts that step's Δf_t as
                J_t Δθ_t of the update made (as ``optimizer="custom"``).
            loss: the loop's own loss at t (checked, and kept in the loss curve); the stored ``loss`` is
                L(θ_t) over all N points.

        Raises:
            ValueError: ``step`` is not in the schedule, was recorded before (in this session or in the
                store), or the tracker is closed; nothing stored changes.
            NonFiniteError: a NaN/inf loss or outputs (the run is marked failed; finished steps are kept).
            AnalysisError: the analysis of an earlier recorded step failed (the run is marked failed).
        """
        if self.tracked is None or self.finished:
            return
        self._seen(step)
        self.tracked.check()
        if self.stopped is not None or not self._still_measurable(step):
            return
        i = self.tracked.recordable(step)
        self.tracked.advance(step)
        why = self._unrecordable(step) or self._not_moved_since_resume(step)
        if why is not None:
            self._stop(why)
            return
        rate = self._rate(step, lr)
        self.tracked.recorded.add(step)
        ck = autograd_on(self.snapshots.take)(step, i, rate)  # the loop's autocast is not the model's f_t
        given = ck.loss if loss is None else float(loss)
        if not (np.isfinite(given) and np.isfinite(ck.loss)):
            raise self.tracked.diverged(step, f"loss is {given if not np.isfinite(given) else ck.loss} at step {step}")
        if self.spec.optimizer.name == "gd" and ck.f.ndim == 1:
            first = next(self.model.parameters())
            tol = _autocast_tolerance(first.dtype, first.device.type, _tf32(self.model, first.device.type))
            self._gd_step = (step, autograd_on(self._gradient)(), tol)
        self.tracked.trace[step] = given
        self.tracked.pending = ck  # handed over with its update when the model is at step + 1

    def _rate(self, step: int, lr: Any) -> float:
        """δ_t from what ``record`` was given: a number, an optimizer (or a scheduler, through its
        optimizer: after the scheduler's step of update t − 1 its groups hold update t's rate) or a
        list of group rates."""
        groups = getattr(lr, "param_groups", None) or getattr(getattr(lr, "optimizer", None), "param_groups", None)
        rates = [g["lr"] for g in groups] if groups is not None else lr if isinstance(lr, (list, tuple)) else [lr]
        try:
            rates = [float(r) for r in rates]
        except (TypeError, ValueError) as e:  # lr=None, lr=opt.param_groups: float()'s own error (an audit)
            raise TypeError(
                f"record({step}, lr=…): lr must be the learning rate of update t (a number), the optimizer or its "
                f"scheduler, or a list of its groups' rates; got {type(lr).__name__} ({e})"
            ) from e
        if any(r < 0 for r in rates):
            raise ValueError(f"record({step}, lr=…): a learning rate must be ≥ 0, got {rates}")
        if len(set(rates)) == 1 and not math.isfinite(rates[0]):
            self._say_once(  # NaN was stored without a word once the per-step note went quiet (a review)
                "nonfinite",
                f"step {step}: δ_t is stored as NaN — the learning rate given is {rates[0]} (said once: so is every "
                "later step's given so)",
            )
            return math.nan
        if len(set(rates)) == 1:
            return rates[0]
        self._say_once(
            "rates",
            f"step {step}: δ_t is stored as NaN — the parameter groups have different learning rates {rates}, so "
            "the one learning rate of update t is ambiguous (said once: so is every later step's while they differ)",
        )
        return math.nan

    def _gradient(self) -> np.ndarray:
        """∇L(θ) over all N points for the loss L = (1/N) Σ ½(f − y)², as a (P,) vector in parameter
        order (zero for frozen parameters), computed without touching the parameters' ``.grad``."""
        params = list(self.model.parameters())
        trainable = [p for p in params if p.requires_grad]
        with torch.enable_grad(), preserved(self.model):
            f = self.model(self.snapshots.X)
            L = 0.5 * ((f - self.snapshots.y) ** 2).mean()
            grads = torch.autograd.grad(L, trainable, allow_unused=True)
        by_param = {id(p): g for p, g in zip(trainable, grads)}
        flat = [
            (by_param.get(id(p)) if by_param.get(id(p)) is not None else torch.zeros_like(p)).reshape(-1)
            for p in params
        ]
        return torch.cat(flat).detach().cpu().double().numpy()

    def _with_update(self, ck: Checkpoint, step: int) -> Checkpoint:
        """``ck`` with its update, f_{t+1} = f(θ_{t+1}) computed with step t's buffers and per-module
        training modes: the loop may have switched modes since ``record(t)`` (``model.eval()`` to
        record, ``model.train()`` to train), and a train-mode dropout or batch-statistics forward
        would make Δf_t noise — and the running statistics the training forward moved (batch norm)
        a change of the function that no J_t Δθ_t predicts (at step 6 of a BN net 0.32 against
        0.0012 of first-order error).  The user's buffers and modes are restored after, and the
        forward runs outside the loop's autocast.  Under ``optimizer="gd"`` δ_t becomes NaN when
        Δθ_t is not −δ_t ∇L(θ_t) (see :meth:`record`)."""
        # the parameters the analysis thread's held-parameter check compares, noted as the step is handed over
        # (every hand-over comes through here), in the thread that runs the model: a parameter replaced since
        # the copy (load_state_dict(assign=True)) and read by a global hook is held — noted at record(t) only,
        # one replaced before due(t + 1) handed step t over was missed (a review)
        note_parameters(self.model)
        modes = ck.model_state.training if ck.model_state is not None else {}
        with preserved(self.model):
            for name, m in self.model.named_modules():
                if name in modes:
                    m.training = modes[name]
            # step t's buffer values, handed to the forward (functional_call): the user's own buffers
            # are not written — the loop's graph of step t + 1 (an eval-mode BN saves them) stays valid
            ck = autograd_on(self.snapshots.with_update)(ck, step, _buffers_of(ck, self.model))
        gd, self._gd_step = self._gd_step, None
        if gd is None or gd[0] != ck.step or not np.isfinite(ck.lr) or not np.isfinite(ck.dtheta).all():
            return ck
        want = -ck.lr * gd[1]  # full-batch GD's Δθ_t
        off = float(np.linalg.norm(ck.dtheta.astype(np.float64) - want))
        size = float(np.linalg.norm(want))
        rounding = 4 * float(np.finfo(ck.theta.dtype).eps) * float(np.linalg.norm(ck.theta.astype(np.float64)))
        if off <= gd[2] * size + rounding:  # _autocast_tolerance: 1e-6 (float64), 1e-4 (float32 on the CPU), …
            return ck
        self._say_once(
            "gd",
            f"step {ck.step}: δ_t is stored as NaN — optimizer='gd' predicts the update of full-batch gradient "
            f"descent at δ_t = {ck.lr:.6g}, but the model's Δθ_t differs from −δ_t ∇L(θ_t) by "
            f"{off / size if size else math.inf:.3g} of its size (another optimizer, weight decay, gradient clipping, "
            "mini-batches, another learning rate, or a reduced-precision loop's rounding): its prediction is "
            "J_t Δθ_t of the update made, as under optimizer='custom' "
            "(said once: so is every later step's whose update is not GD)",
        )
        return replace(ck, lr=math.nan)

    def _say_once(self, kind: str, what: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            _log.warning("run %r: %s", self.spec.name, what)

    def _still_measurable(self, step: int | None) -> bool:
        """Whether the model is still the network the run measures — its parameters' names, shapes,
        dtypes and devices as when the Tracker was created; else stop the recording (the pending
        step's update NaN: f_{t+1} of another network is no update of step t's)."""
        layout = _parameter_layout(self._user)
        if layout == self._layout:
            return True
        why = _layout_change(self._layout, layout)
        self._stop(f"recording stopped {'at close' if step is None else f'at step {step}'}: {why}")
        return False

    def _on_the_recorded_path(self, step: int) -> bool:
        """Whether the model, at a step the store held when this Tracker opened the run, is the
        network recorded there: its θ is the stored θ_t (to ``THETA_MATCH`` of its norm; the stored
        θ_t is float32).  Else stop the recording — a loop restarted from a fresh initialisation, or
        on another trajectory, would add its steps to another network's (was: taken silently, the
        run ``done`` with a loss curve that jumped between the two networks)."""
        if step not in self._unchecked:  # not stored before, or compared already
            return True
        self._unchecked.discard(step)
        stored = np.asarray(self.writer.read_step("theta", self.tracked.index[step]), np.float64)
        off = float(np.linalg.norm(theta_vector(self.model).astype(np.float64) - stored))
        size = float(np.linalg.norm(stored))
        if off <= THETA_MATCH * size:
            return True
        resume = step if self.resume_step is None else self.resume_step
        self._stop(
            f"recording stopped at step {step}: the model is not the network this run recorded at step {step} — "
            f"its parameters differ from the stored θ_{step} by {off / size if size else math.inf:.3g} of their "
            "norm (another initialisation or another trajectory), and its steps would be mixed with the stored "
            f"ones; continue the stored run from its state (torch.nn.utils.vector_to_parameters("
            f"torch.as_tensor(tr.theta_at({resume})), model.parameters()) and the loop from step {resume}), "
            "or record this network as its own run (a new Tracker under another name)"
        )
        return False

    def _seen(self, step: int) -> None:
        if self._first_seen is None:
            self._first_seen = int(step)

    def _not_moved_since_resume(self, step: int) -> str | None:
        """Why the first new step of a reopened run cannot be recorded: the loop's first call was after the
        stored step s the run continues from, and the model holds θ_s bit for bit — restored from
        ``theta_at(s)`` and started at s + 1 (every later step was stored with the step before's θ, status
        done: an audit).  A loop that went through step s (due(s), log(s)) made update s, even one that
        changed nothing (a learning rate 0, a skipped AMP step: a review)."""
        s, self._continued_from = self._continued_from, None
        if s is None or step <= s or (self._first_seen is not None and self._first_seen <= s):
            return None
        stored = np.asarray(self.writer.read_step("theta", self.tracked.index[s]))
        if not np.array_equal(theta_vector(self.model).astype(stored.dtype), stored):
            return None
        return (
            f"recording stopped at step {step}: the model's parameters are the stored θ_{s} bit for bit, so the "
            f"loop is at step {step} without "
            + (f"update {s}" if step - 1 == s else f"updates {s} … {step - 1}")
            + f" — restored from theta_at({s}), it must go on from step {s} (for t in range({s}, …)), where the "
            f"update of step {s} is made"
        )

    def _unrecordable(self, step: int) -> str | None:
        """Why step ``step`` cannot be recorded on the model as it is now, None when it can: its
        trainable set differs from the run's, or its forward is random.  (Neither touches the update
        of the step before, which is the same function of the same parameters.)"""
        now = {k: p.requires_grad for k, p in self._user.named_parameters()}
        changed = [k for k in self._trainable if now.get(k) != self._trainable[k]]
        if changed:
            shown = ", ".join(f"{k} ({'unfrozen' if now.get(k) else 'frozen'})" for k in changed[:6])
            more = f", … ({len(changed)} in all)" if len(changed) > 6 else ""
            return (
                f"recording stopped at step {step}: requires_grad changed since the Tracker was created for "
                f"{shown}{more}; a run's NTK and Hessian are over the trainable parameters it was created with "
                "— record the phase with another trainable set as its own run (a new Tracker under another name)"
            )
        random = _random_modules(self._user)
        if random:
            return (
                f"recording stopped at step {step}: the model's forward is random at record({step}) (dropout in "
                f"train mode: {', '.join(repr(n) for n in random[:3])}), so f_t and its NTK are not defined — "
                "call model.eval() around tr.record(t) (step t is analysed in the modes it has then)"
            )
        if autograd_on(_forward_differs)(self.model, self.snapshots.X):
            return (
                f"recording stopped at step {step}: the model's forward is random at record({step}) — two forwards "
                "of the same points differ: a dropout that is not an nn.Dropout module (F.dropout(…, "
                "training=self.training), nn.MultiheadAttention(dropout=…), F.scaled_dot_product_attention("
                "dropout_p=…)), another random op, or a forward that changes the model's state — so f_t and its "
                "NTK are not defined; call model.eval() around tr.record(t)"
            )
        if autograd_on(_copy_differs)(self._twin, self.model, self.snapshots.X):
            return (
                f"recording stopped at step {step}: the model no longer computes what a copy of it made when the "
                "Tracker was created computes at the same parameters and buffers — state outside them changed (an "
                "attribute such as a scale or a temperature, a mask held as a plain tensor, a module replaced), "
                "which the analysis's copy does not follow, so f_t and G_t would be of two functions; keep such "
                "state in registered buffers (self.register_buffer) or parameters, or record each phase as its "
                "own run"
            )
        return None

    def _stop(self, why: str) -> None:
        """End the run ``interrupted`` with ``why`` (every recorded step kept, the pending one's update NaN:
        the model is no longer the one measured) and stop recording; training goes on."""
        _log.warning("run %r: %s", self.spec.name, why)
        self.stopped = why
        self._gd_step = None
        if not self.tracked.closed:
            self.tracked.interrupt(None, why)

    def _collect(self, block: bool) -> None:
        """Note the steps the pool finished (wait for one if ``block``)."""
        self.tracked.collect(block)

    def close(self) -> None:
        """Wait for every analysis; status ``done`` when every recorded step is in the store.

        The last step's update is taken only from the model the run measures (else the recording
        stops, as in :meth:`record`, and that update is NaN).

        Raises:
            AnalysisError: a recorded step's analysis failed (the run is marked failed).
        """
        if self.tracked is None:
            return
        if not self.tracked.closed:
            self._still_measurable(None)
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
        if exc_type is None:
            self.close()
        elif self.tracked is not None:
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


# How close the model's θ must be to the stored θ_t, relative to its norm, at a step a reopened run
# already holds: far above the float32 rounding of the stored θ_t (~6e-8) and the drift of a re-run
# that is not bit-deterministic over a few steps, far below the O(1) of another initialisation.
THETA_MATCH = 1e-3


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


def _network_digest(model: nn.Module, output: OutputSelector) -> str:
    """A digest of the network beyond its parameters' names and shapes (which the run's spec holds):
    each module's class, a torch module's settings (``extra_repr``: a dropout rate, a norm's eps, a
    slope — a user module's may show state that changes in training, so only its class counts; not
    ``inplace=``) and the output selector: a string or index as given, a callable by its qualified name
    only (two lambdas are one selector here: a stable code fingerprint across processes and Python
    versions does not exist, and a false refusal would strand the run)."""

    def module(m: nn.Module) -> str:
        cls = type(m)
        settings = m.extra_repr() if cls.__module__.startswith("torch.") else ""
        settings = re.sub(r" at 0x[0-9a-fA-F]+", "", settings)
        settings = re.sub(r",?\s*inplace=(True|False)", "", settings)  # in place or not: the same function
        return f"{cls.__module__}.{cls.__qualname__}({settings})"

    parts = [f"{n}: {module(m)}" for n, m in model.named_modules()]
    if output is None or isinstance(output, (str, int)):
        parts.append(f"output: {output!r}")
    else:
        # a callable by its qualified name only: its bytecode and constants are not stable across processes
        # and Python versions (set constants, addresses), and a false refusal would strand the run
        name = getattr(output, "__qualname__", type(output).__qualname__)
        parts.append(f"output: {getattr(output, '__module__', '')}.{name}")
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def _same_network(writer: Any, name: str, network: str) -> None:
    """Refuse to continue a run recorded with another network (same parameter names and shapes, other
    modules or settings or output selector); note the network of a run that has none noted yet."""
    stored = writer.attr("tracker_network")
    if stored is None:
        writer.set_attrs(tracker_network=network)
    elif stored != network:
        raise StoreError(
            f"run {name!r} exists in {writer.store.url!r} recorded with another network: the same parameter "
            f"names and shapes, but other modules or torch module settings (e.g. another activation or dropout rate) "
            f"or another output selector (digest {stored} → {network}); refusing to continue it with this one — "
            "use another name"
        )


def _tf32(model: nn.Module, device: str) -> bool:
    """Whether a float32 model's products on ``device`` may round to TF32 (~10⁻³): CUDA matmuls with
    ``torch.backends.cuda.matmul.allow_tf32``, convolutions with ``torch.backends.cudnn.allow_tf32``
    (on by default) where the model has any."""
    if device != "cuda":
        return False
    convs = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    return bool(torch.backends.cuda.matmul.allow_tf32) or (convs and bool(torch.backends.cudnn.allow_tf32))


def _autocast_tolerance(dtype: torch.dtype, device: str = "cpu", tf32: bool = False) -> float:
    """The relative tolerance of the GD check of update t of a model in ``dtype`` on ``device`` (beside
    4·eps·‖θ‖ for the rounding of θ_{t+1} − θ_t): float64, which neither autocast nor TF32 touch, 10⁻⁶;
    float32 10⁻⁴ (its gradient rounds at ~10⁻⁷, a plain loop's update was ≤ 2·10⁻⁵ off; at 1 % a weight
    decay of 5·10⁻⁴ and a cosine schedule's rate 0.5 % below the δ given passed as GD, and the closed-form
    prediction put the first-order error 1.5–3.4× off — Audit K4); float32 whose products may round to
    TF32 (``tf32``: ~10⁻³) or 16-bit parameters 1 %; and 4·eps of an autocast dtype active at ``record``
    when larger (``record`` usually runs outside the loop's autocast, whose update — 0.28–0.48 % off
    −δ∇L for a bf16 loop — then fails the check: δ_t NaN, the prediction J_t Δθ_t, never a wrong
    closed form).  Clipping, momentum, mini-batches or another rate moved the update by 51 % to 94×."""
    if dtype == torch.float64:
        tol = 1e-6
    elif dtype == torch.float32 and not tf32:
        tol = 1e-4
    else:
        tol = 1e-2
    for dev in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(dev):
                tol = max(tol, 4.0 * float(torch.finfo(torch.get_autocast_dtype(dev)).eps))
        except (RuntimeError, ValueError, TypeError):  # a device type this torch build does not know
            continue
    return tol


def _parameter_layout(model: nn.Module) -> list[tuple[str, tuple[int, ...], str, str]]:
    """Each parameter's name, shape, dtype and device: what the run's θ_t vector and inputs were made for."""
    return [(k, tuple(p.shape), str(p.dtype), str(p.device)) for k, p in model.named_parameters()]


def _layout_change(before: list[tuple], now: list[tuple]) -> str:
    """What changed between two :func:`_parameter_layout` s, in words."""
    old, new = {e[0]: e[1:] for e in before}, {e[0]: e[1:] for e in now}
    if old.keys() != new.keys() or any(old[k][0] != new[k][0] for k in old):
        added, removed = sorted(new.keys() - old.keys()), sorted(old.keys() - new.keys())
        reshaped = sorted(k for k in old.keys() & new.keys() if old[k][0] != new[k][0])
        parts = [
            f"{what} {', '.join(names[:4])}"
            for what, names in (("added", added), ("removed", removed), ("reshaped", reshaped))
            if names
        ]
        return (
            f"the model's parameters changed since the Tracker was created ({'; '.join(parts)}); a run measures "
            "one network — record the new one as its own run (a new Tracker under another name)"
        )
    said = lambda d: ", ".join(sorted({f"{e[1].removeprefix('torch.')} on {e[2]}" for e in d.values()}))  # noqa: E731
    return (
        f"the model was cast or moved from {said(old)} to {said(new)} after the Tracker was created; the "
        "Tracker measures the model it was made for — cast or move the model first (e.g. model.double()), "
        "then create the Tracker"
    )


def _buffers_of(ck: Checkpoint, model: nn.Module) -> dict[str, torch.Tensor]:
    """Step t's buffer values (``ck.model_state``) as new tensors like ``model``'s buffers of the
    same name and shape (a buffer made or reshaped since step t is left as the model has it)."""
    if ck.model_state is None:
        return {}
    now = dict(model.named_buffers())
    return {
        name: torch.from_numpy(np.asarray(value)).to(device=now[name].device, dtype=now[name].dtype)
        for name, value in ck.model_state.buffers.items()
        if name in now and tuple(now[name].shape) == tuple(np.shape(value))
    }


@torch.no_grad()
def _forward_differs(model: nn.Module, X: Any) -> bool:
    """Whether two forwards of the first points of X differ (beyond a kernel's rounding): a random
    forward that no module names — its analysis failed at the next call ("the model's forward is
    random"), the run failed with nothing stored and the user's loop was ended (an audit).  The
    user's random streams, buffers, modes and cached attributes are as they were."""
    x = X[:64] if isinstance(X, torch.Tensor) else X  # enough draws that two masks never agree by chance
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), attributes_restored(model), preserved(model):
        a, b = (torch.as_tensor(model(x)).double() for _ in range(2))
    finite = torch.isfinite(a)  # non-finite outputs are the NaN check's, after this one
    if not torch.equal(finite, torch.isfinite(b)):
        return True
    a, b = a[finite], b[finite]
    scale = float(a.abs().max()) if a.numel() else 0.0
    return not torch.allclose(a, b, rtol=1e-5, atol=1e-7 * max(scale, 1.0))


@torch.no_grad()
def _copy_differs(twin: nn.Module, model: nn.Module, X: Any) -> bool:
    """Whether ``model``'s outputs on the first points of X differ (beyond rounding) from those of ``twin`` — a
    copy made at the Tracker's creation — run at the model's parameters, buffers and per-module modes now.
    An annealed attribute read λ₁ 35.9 for 224.7, a pruning mask held as a plain tensor E 0.16 off, a
    swapped activation E 0.30 off, status done (an audit: the analysis copy is made once).  The user's
    random streams, buffers, modes and cached attributes are as they were."""
    x = X[:64] if isinstance(X, torch.Tensor) else X  # the points _forward_differs runs (a GCN runs on all only)
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), attributes_restored(model), preserved(model), _full_float32():
            a = torch.as_tensor(model(x)).double().cpu()
    except Exception:  # noqa: BLE001 — a forward that does not run on these points: nothing to compare
        return False
    dtype = next((p.dtype for p in twin.parameters() if p.is_floating_point()), torch.float32)
    own = next((p.dtype for p in model.parameters() if p.is_floating_point()), dtype)
    state = {  # copies: a train-mode norm of the twin writes its running statistics into what it is given
        k: v.detach().to(device="cpu", dtype=dtype if v.is_floating_point() else v.dtype, copy=True)
        for k, v in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items()
    }  # (named_buffers: non-persistent ones too, which state_dict leaves out — a review)
    modes = {n: m.training for n, m in model.named_modules()}
    kept = {n: m.training for n, m in twin.named_modules()}
    try:
        for n, m in twin.named_modules():
            m.training = modes.get(n, m.training)
        with torch.random.fork_rng(devices=[]), attributes_restored(twin), preserved(twin):
            xt = x.cpu().to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x.cpu()
            b = torch.as_tensor(torch.func.functional_call(twin, state, (xt,), strict=False)).double()
    except Exception:  # noqa: BLE001 — a copy that cannot run so: the analysis itself will say what fails
        return False
    finally:
        for n, m in twin.named_modules():
            m.training = kept.get(n, m.training)
    if a.shape != b.shape:
        return True
    finite = torch.isfinite(a) & torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return True
    a, b = a[finite], b[finite]
    scale = float(a.abs().max()) if a.numel() else 0.0
    # the model's own float and device against the CPU copy's: float64 on the CPU to 1e-9, float32 (another
    # device's kernels, summation orders) to 1e-3, a 16-bit model's float32 copy to 3e-2 — what it catches
    # (the audit's cases) is 0.16–5× off
    rtol = 3e-2 if torch.finfo(own).bits <= 16 else 1e-9 if own == torch.float64 and not devices else 1e-3
    return bool(((a - b).abs() > rtol * max(scale, 1e-30)).any())


@contextlib.contextmanager
def _full_float32() -> Iterator[None]:
    """CUDA matmuls and convolutions in full float32 (TF32 off, cuDNN's default for convolutions is on: a
    CNN's outputs ~10⁻³ off the CPU copy's), restored after."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def _random_modules(model: nn.Module) -> list[str]:
    """Names of the dropout modules that are active (train mode, p > 0): a random forward."""
    return [
        n or "<root>"
        for n, m in user_named_modules(model)
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0
    ]


def _analysis_pool(
    cluster: str | None,
    session: RunSession,
    model: nn.Module,
    data: Dataset,
    workers: int,
    cpus: float,
    gpus: float,
    max_retries: int,
) -> Any:
    """A tracked run's analysis pool on a copy of ``model``: a background thread (``cluster`` None),
    or Ray spectral workers on ``cluster``; either writes with the session's lease token."""
    url, plan, token, model = session.writer.store.url, session.plan, session.token, _analysis_copy(model)
    if cluster is None:
        return ThreadAnalysisPool(TrackedRunService(url, plan, model, data, token=token))
    from nsa_dist.cluster.tracking import RayTrackerPool

    return RayTrackerPool(
        cluster, url, plan, model, data, workers=workers, cpus=cpus, gpus=gpus, max_retries=max_retries, token=token
    )


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


def _non_finite_parameters(model: nn.Module) -> str:
    """The names of the model's parameters holding a NaN/inf, as one phrase ('' when every one is finite)."""
    bad = [n for n, p in model.named_parameters() if p.is_floating_point() and not bool(torch.isfinite(p).all())]
    return ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "") if bad else ""
