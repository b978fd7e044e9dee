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
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from nsa_dist.config import LossName, RecordSpec
from nsa_dist.data import Dataset
from nsa_dist.errors import AnalysisError, NonFiniteError, ShapeError, UnsupportedModelError
from nsa_dist.losses import cross_entropy_loss, parse_loss
from nsa_dist.models import OutputSelector, SelectedOutput, measured_module, not_a_tensor, single_column
from nsa_dist.ntk import preserved, sample_coupling
from nsa_dist.pipeline import Checkpoint, RunSession, TrainerState
from nsa_dist.pipeline.model_state import ModelState, analysis_copy, model_inputs, theta_vector
from nsa_dist.pipeline.plan import TRACKED_RNG_BYTES
from nsa_dist.pipeline.pool import ThreadAnalysisPool
from nsa_dist.pipeline.tracked import TrackedRunService, tracked_spec
from nsa_dist.store import LeaseLost, SpectrumStore

if TYPE_CHECKING:
    from nsa_dist.pipeline.tracked import ExperimentSpec

__all__ = ["Tracker", "couples_samples"]

log = logging.getLogger("nsa_dist")


def _as_tensor(name: str, a: Any) -> torch.Tensor:
    if isinstance(a, np.ndarray):
        a = torch.from_numpy(a)
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(a).__name__}")
    return a.detach().cpu()


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
        user = measured_module(model)  # a compiled model: the module it wraps
        model = measured_module(user, output)  # the user's module, or its selected output
        self.model = model
        self.store = store if isinstance(store, SpectrumStore) else SpectrumStore(store)
        self.data, K, column = _checked_data(model, X, y, X_test, y_test)
        if column:  # an (n, 1) output (a final nn.Linear(…, 1)) is measured as the (n,) it means
            model = SelectedOutput(model, single_column)
            self.model = model
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
        p = next(model.parameters())
        self.device = p.device
        self.X = model_inputs(self.data.X, model)  # (N, …): the model's float dtype, or integer ids as given
        self.y = torch.as_tensor(self.data.y, device=self.device).to(  # (N,) or (N, K)
            p.dtype if p.dtype == torch.float64 else torch.float32
        )
        self.X_test = model_inputs(self.data.X_test, model)  # (M, …) like X
        self._ce = loss is LossName.CROSS_ENTROPY
        self.schedule = self.spec.record_steps()
        self._index = {t: i for i, t in enumerate(self.schedule)}
        self.n_params = sum(p.numel() for p in model.parameters())
        # one writer of this run at a time: the lease, the run created or reopened as `nsa run` does
        self.session = RunSession.open(self.spec, self.store, data=self.data, model=model, hint="reopen to continue")
        self.plan, self.writer, self._done = self.session.plan, self.session.writer, self.session.done
        self.max_inflight = max_inflight
        try:
            self.pool: Any = self._pool(cluster, _analysis_copy(model), workers, worker_cpus, worker_gpus)
        except BaseException as exc:
            self.session.end(exc)  # not started: the status stays, the lease is given back
            raise
        self.session.start()
        self._pending: tuple[Checkpoint, np.ndarray, np.ndarray] | None = None  # awaiting θ_{t+1}
        self._recorded: set[int] = set()  # steps record() took in this session
        self._failure: AnalysisError | None = None
        self._coupling_said = False
        self._trace: dict[int, float] = {}
        self.max_seen_inflight = 0
        self.blocked = 0  # times record() waited for a free slot
        self.finished: list[dict] = []
        self.closed = False

    def _pool(self, cluster: str | None, model: nn.Module, workers: int, cpus: float, gpus: float) -> Any:
        """The run's analysis pool: a background thread, or Ray spectral workers on ``cluster``."""
        if cluster is None:
            return ThreadAnalysisPool(
                TrackedRunService(self.store.url, self.plan, model, self.data, token=self.session.token)
            )
        from nsa_dist.cluster.tracking import RayTrackerPool

        return RayTrackerPool(
            cluster,
            self.store.url,
            self.plan,
            model,
            self.data,
            workers=workers,
            cpus=cpus,
            gpus=gpus,
            token=self.session.token,
        )

    # ------------------------------------------------------------------ the loop's calls
    @property
    def inflight(self) -> int:
        return len(self.pool.inflight)

    @property
    def resubmitted(self) -> int:
        """Steps re-sent after their worker died."""
        return self.pool.resubmitted

    def due(self, step: int) -> bool:
        """Whether ``step`` is a recorded step still to record: not in the store, not taken by this
        Tracker's ``record`` (so a loop that sees one step twice, e.g. under gradient accumulation,
        records it once).  Also takes a pending update.

        Raises:
            AnalysisError: the analysis of an earlier recorded step failed (the run is marked failed).
        """
        self._poll()
        self._advance(step)
        i = self._index.get(step)
        return i is not None and not self._done[i] and step not in self._recorded

    def log(self, step: int, loss: float) -> None:
        """Note the loss of update ``step`` for the store's loss curve (cheap; written at the next record).

        Raises:
            AnalysisError: the analysis of an earlier recorded step failed (the run is marked failed).
        """
        self._poll()
        self._advance(step)
        self._trace[step] = float(loss)

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
                store), or the tracker is closed; nothing stored changes.
            NonFiniteError: a NaN/inf loss or outputs (the run is marked failed; finished steps are kept).
            AnalysisError: the analysis of an earlier recorded step failed (the run is marked failed).
        """
        self._poll()
        if self.closed:
            raise ValueError("this Tracker is closed")
        if step not in self._index:
            raise ValueError(
                f"step {step} is not a recorded step of this run (schedule: {self.schedule[:8]}"
                f"{' …' if len(self.schedule) > 8 else ''}); test tr.due(step) first"
            )
        i = self._index[step]
        if step in self._recorded or self._done[i]:
            when = "by this Tracker" if step in self._recorded else "in the store, before this Tracker was opened"
            raise ValueError(
                f"step {step} was already recorded ({when}); a step is recorded once, at θ_t before "
                "update t — test tr.due(step) first"
            )
        self._advance(step)
        self._recorded.add(step)
        mstate = ModelState.capture(self.model)  # buffers and modes of step t, with θ_t
        self._say_coupling(step)
        with preserved(self.model):
            f = self.model(self.X)  # (N,) or (N, K)
            f_test = self.model(self.X_test) if self.X_test.shape[0] else f.new_zeros((0,) + tuple(f.shape[1:]))
        L = (
            cross_entropy_loss(f, self.y)
            if self._ce
            else 0.5 * ((f - self.y) ** 2).reshape(f.shape[0], -1).sum(1).mean()
        )
        given = float(L) if loss is None else float(loss)
        if not (np.isfinite(given) and np.isfinite(float(L))):
            self._fail(step, f"loss is {given if not np.isfinite(given) else float(L)} at step {step}")
        self._trace[step] = given
        theta = theta_vector(self.model)  # (P,)
        fn, f_test = _outputs(f), _outputs(f_test)
        state = TrainerState(
            step, theta, np.zeros((0, self.n_params), np.float32), np.zeros(TRACKED_RNG_BYTES, np.uint8)
        )
        ck = Checkpoint(
            index=i,
            step=step,
            lr=float(lr),
            loss=float(L),
            theta=theta,
            dtheta=theta,
            f=fn,
            df=fn,
            f_test=f_test,
            loss_trace=np.zeros(0),
            trace_start=step,
            state=state,
            model_state=mstate,
        )
        self._pending = (ck, theta, fn)

    def _say_coupling(self, step: int) -> None:
        """Log once when the model couples samples (checked at each record until it does)."""
        if self._coupling_said or not couples_samples(self.model, self.X):
            return
        self._coupling_said = True
        bn = _batch_stat_modules(self.model)
        log.warning(
            "run %r: at step %d the model couples samples — its output for one point depends on the other "
            "points of the batch%s; its NTK is that of the full-batch forward on the N = %d points",
            self.spec.name,
            step,
            f" (batch statistics in {', '.join(repr(b) for b in bn)})" if bn else "",
            self.data.n,
        )

    def _advance(self, step: int) -> None:
        """Submit the pending checkpoint: with its update if the model is now at its step + 1."""
        if self._pending is None or step == self._pending[0].step:
            return
        ck, theta, f = self._pending
        if step == ck.step + 1:
            with torch.no_grad(), preserved(self.model):
                theta1 = theta_vector(self.model)
                f1 = _outputs(self.model(self.X))
            dtheta, df = theta1 - theta, f1 - f
        else:
            dtheta, df = np.full_like(theta, np.nan), np.full_like(f, np.nan)
        self._pending = None
        self._submit(_replace(ck, dtheta=dtheta, df=df))

    def _poll(self) -> None:
        """Raise a failed analysis at the Tracker call after it happened (not only at close())."""
        if self._failure is not None:
            raise AnalysisError(str(self._failure), self._failure.step) from self._failure.__cause__
        if not self.closed and self.inflight:
            self._collect(block=False)

    def _submit(self, ck: Checkpoint) -> None:
        self._collect(block=False)
        while self.inflight >= self.max_inflight:
            self.blocked += 1
            self._collect(block=True)
        self._flush_trace()
        self.pool.submit(ck)
        self.max_seen_inflight = max(self.max_seen_inflight, self.inflight)

    def _collect(self, block: bool) -> None:
        try:
            self._take(self.pool.wait(block))
        except LeaseLost:  # another writer has the run: not a word more from this one
            self._stop_lost()
            raise
        except AnalysisError as exc:
            self._abort(exc)
            raise
        except Exception as exc:
            self.session.fail(exc)
            self.closed = True
            self.session.release()
            raise

    def _take(self, summaries: list[dict]) -> None:
        for s in summaries:
            self.session.mark_done(s["index"])
            self.finished.append(s)

    def _abort(self, exc: AnalysisError) -> None:
        """After a failed analysis: let the other queued steps finish (what they store is kept), mark
        the run failed with the error's message and step, and close; later calls raise it again."""
        self._failure, self._pending = exc, None
        while self.inflight:
            try:
                self._take(self.pool.wait(True))
            except Exception:  # noqa: BLE001 - the first failure is the one reported
                pass
        self._flush_trace()
        self.session.fail(exc)  # its message and step
        self.closed = True
        self.pool.close()
        self.session.release()

    def _stop_lost(self) -> None:
        """This Tracker's lease was taken over: close without writing (no status, no released lease)."""
        self.closed = True
        self._pending = None
        self.session.release()

    def _flush_trace(self) -> None:
        for t, v in sorted(self._trace.items()):
            if 0 <= t < self.spec.steps:
                self.writer.write_trace(t, np.asarray([v], np.float64))
        self._trace.clear()

    def _fail(self, step: int, why: str) -> None:
        """Wait for every queued step (nothing recorded is lost), mark the run failed, raise."""
        self._pending = None
        while self.inflight:
            self._collect(block=True)
        self._flush_trace()
        self.session.fail(f"training diverged: {why}", step)
        self.closed = True
        self.pool.close()
        self.session.release()
        raise NonFiniteError(
            f"run {self.spec.name!r}: {why}; the run is marked failed, the "
            f"{int(self._done.sum())} steps recorded before it are kept"
        )

    def close(self) -> None:
        """Wait for every analysis; status ``done`` when every recorded step is in the store.

        Raises:
            AnalysisError: a recorded step's analysis failed (the run is marked failed).
        """
        if self.closed:
            return
        if self._pending is not None:
            self._advance(self.spec.steps if self._pending[0].step == self.spec.steps - 1 else -1)
        try:
            while self.inflight:
                self._collect(block=True)
            self._flush_trace()
        finally:
            self.closed = True
            self.pool.close()
        try:
            missing = int((~self._done).sum())
            if missing:
                self.session.pause(
                    f"closed with {missing} of {len(self._done)} recorded steps "
                    "missing; reopen the Tracker with this name to continue",
                )
            else:
                self.session.finish()
        finally:
            self.session.release()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif issubclass(exc_type, LeaseLost):
            self._stop_lost()
        elif not self.closed:
            self._pending = None
            try:
                while self.inflight:
                    self._collect(block=True)
            finally:
                self.closed = True
                self.pool.close()
                self.session.interrupt(cause=exc_type)
                self.session.release()

    # ------------------------------------------------------------------ resume
    @property
    def resume_step(self) -> int | None:
        """The last step of the unbroken run of recorded steps from 0 (None: nothing recorded)."""
        i = self.writer.resume_index()
        return None if i is None else self.schedule[i]

    def theta_at(self, step: int) -> np.ndarray:
        """θ_t stored with recorded step ``step`` (to restart the loop from there)."""
        i = self._index[step]
        if not self._done[i]:
            raise ValueError(f"step {step} is not recorded yet")
        return np.asarray(self.writer.read_step("theta", i))


def _checked_data(model: nn.Module, X: Any, y: Any, X_test: Any, y_test: Any) -> tuple[Dataset, int, bool]:
    """The checked data, the outputs per point K and whether the model's output is one
    column, (n, 1) — then measured as (n,), with y and y_test accepted as (N,) or (N, 1)."""
    X, y = _as_tensor("X", X), _as_tensor("y", y)
    if X.ndim < 2 or X.shape[0] == 0:
        raise ShapeError(f"X must have shape (N, d) or (N, …) with N >= 1, got {tuple(X.shape)}")
    for nm, a in (("X", X), ("y", y)):
        if not torch.isfinite(a.double()).all():
            raise NonFiniteError(f"{nm} holds NaN or inf")
    with torch.no_grad(), preserved(model):
        out = model(model_inputs(X[:2], model))
    n = min(2, X.shape[0])
    if not isinstance(out, torch.Tensor):
        raise ShapeError(not_a_tensor(out) + " of shape (n,) or (n, K)")
    if out.ndim not in (1, 2) or out.shape[0] != n:
        got = tuple(out.shape)
        raise ShapeError(
            f"the model must map (n, …) inputs to (n,) or (n, K) outputs; for input "
            f"{tuple(X[:2].shape)} it returned {got}"
        )
    K = 1 if out.ndim == 1 else int(out.shape[1])
    column = out.ndim == 2 and K == 1
    if column:
        y = y.reshape(-1) if tuple(y.shape) == (X.shape[0], 1) else y
    want = (X.shape[0],) if out.ndim == 1 or column else (X.shape[0], K)
    if tuple(y.shape) != want:
        also = f" or {(X.shape[0], 1)}" if column else ""
        raise ShapeError(
            f"y must have shape {want}{also} (N = {X.shape[0]} points, the model's output per "
            f"point {tuple(out.shape[1:])}); got {tuple(y.shape)}"
        )
    if X_test is None:
        X_test, y_test = X.new_zeros((0,) + tuple(X.shape[1:])), y.new_zeros((0,) + tuple(y.shape[1:]))
    X_test = _as_tensor("X_test", X_test)
    if X_test.shape[0] and X_test.is_floating_point() != X.is_floating_point():
        raise TypeError(f"X_test ({X_test.dtype}) and X ({X.dtype}) must both be floating points or both integer ids")
    y_test = (
        _as_tensor("y_test", y_test)
        if y_test is not None
        else y.new_full((X_test.shape[0],) + tuple(y.shape[1:]), float("nan"))
    )
    if column and y_test.ndim == 2 and y_test.shape[1] == 1:
        y_test = y_test.reshape(-1)
    if tuple(X_test.shape[1:]) != tuple(X.shape[1:]) or tuple(y_test.shape) != (X_test.shape[0],) + tuple(y.shape[1:]):
        raise ShapeError(
            f"X_test, y_test must have shapes (M,) + {tuple(X.shape[1:])} and (M,) + "
            f"{tuple(y.shape[1:])}; got {tuple(X_test.shape)} and {tuple(y_test.shape)}"
        )
    f64 = lambda a: a.to(torch.float64).numpy()  # noqa: E731
    ids = lambda a: a.numpy().copy() if not a.is_floating_point() else f64(a)  # noqa: E731 - token ids stay integers
    return Dataset(ids(X), f64(y), ids(X_test), f64(y_test), {"source": "tracker"}), K, column


def _outputs(f: torch.Tensor) -> np.ndarray:
    """Model outputs as a CPU array: float64 for a float64 model, else float32."""
    return f.detach().cpu().to(torch.float64 if f.dtype == torch.float64 else torch.float32).numpy().copy()


def _batch_stat_modules(model: nn.Module) -> list[str]:
    """Names of the batch-norm modules normalising by the batch's own statistics (train mode, or no running stats)."""
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or m.running_mean is None)
    ]


def couples_samples(model: nn.Module, X: torch.Tensor, points: int = 4) -> bool:
    """Whether the model couples samples (BatchNorm in train mode or without running statistics):
    the NTK core's probe, :func:`nsa_dist.ntk.sample_coupling`, on the first ``points`` points.
    A random forward (dropout in train mode) cannot be judged and counts as not coupling.
    The model's buffers, modes and the global RNG state are as before."""
    try:
        return sample_coupling(model, X[:points]) is not None
    except UnsupportedModelError:  # a random forward: no verdict
        return False


def _replace(ck: Checkpoint, **kw: Any) -> Checkpoint:
    from dataclasses import replace

    return replace(ck, **kw)


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
