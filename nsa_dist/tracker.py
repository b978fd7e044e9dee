"""The write side of the Python API: record NTK / Hessian spectra along a user's own training loop.

```python
tr = Tracker(store, "cnn-run", model, X, y, steps=T, record={"every": 100}, cluster=None)
for step in range(T):
    if tr.due(step):
        tr.record(step, lr=lr, loss=loss)   # snapshot θ_t, f_t; returns at once
    ...                                     # the user's update θ_t → θ_{t+1}
tr.close()                                  # waits for the analyses; status done
```

Contract: ``record(t)`` is called with the model at θ_t, before update t.  The update
(Δθ_t = θ_{t+1} − θ_t, Δf_t) of a recorded step — needed by the first-order metrics — is taken
when the Tracker next sees step t + 1 (``due(t+1)``, ``record(t+1)``, ``log(t+1)``, or ``close()`` after
the last step T − 1); otherwise it is NaN and so are those metrics.  Analyses run in a
background thread (``cluster=None``) or on a Ray spectral-worker pool; at most ``max_inflight``
checkpoints wait, so training blocks only when the analysis falls behind.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from nsa_dist.config import RecordSpec
from nsa_dist.data import Dataset
from nsa_dist.errors import NonFiniteError, ShapeError
from nsa_dist.losses import cross_entropy_loss
from nsa_dist.pipeline import Checkpoint, TrainerState, finish_run
from nsa_dist.pipeline.tracked import RNG_BYTES, TrackedRunService, tracked_dims, tracked_spec, tracked_static
from nsa_dist.pipeline.spectral import SpectralAnalyzer
from nsa_dist.store import LeaseLost, SpectrumStore, Status

if TYPE_CHECKING:
    from nsa_dist.pipeline.tracked import ExperimentSpec

__all__ = ["Tracker"]

_LOSSES = {"mse": "l2", "l2": "l2", "cross_entropy": "cross_entropy"}  # Tracker name → spec loss


class _ThreadPool:
    """In-process analysis: one background thread (torch releases the GIL in its kernels)."""

    def __init__(self, service: TrackedRunService) -> None:
        self.service = service
        self.exe = cf.ThreadPoolExecutor(1, thread_name_prefix="nsa-tracker")
        self.inflight: dict[cf.Future, int] = {}
        self.resubmitted = 0

    def submit(self, ck: Checkpoint) -> None:
        self.inflight[self.exe.submit(self.service.analyze_and_write, ck)] = ck.index

    def wait(self, block: bool) -> list[dict]:
        if not self.inflight:
            return []
        done, _ = cf.wait(list(self.inflight), timeout=None if block else 0, return_when=cf.FIRST_COMPLETED)
        out = []
        for fut in done:
            self.inflight.pop(fut)
            out.append(fut.result())  # re-raises the analysis's error
        return out

    def close(self) -> None:
        self.exe.shutdown(wait=True)


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
        model: the network being trained (any ``nn.Module`` mapping (n, …) → (n,) or (n, K)).
        X: (N, …) training points — (N, d) vectors or (N, C, H, W) images; y: (N,) or (N, K).
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

    Raises:
        ShapeError: model output not (n,) / (n, K), or X, y, X_test, y_test of inconsistent shapes.
        NonFiniteError: NaN/inf in X or y.
        StoreError: the store holds a run of this name with another spec, data or network.
        TypeError: the model cannot be pickled for Ray workers (cluster set).
        LeaseLost: (from ``record`` / ``log`` / ``close``) another writer took the run over while this
            process was paused longer than the lease's ttl; the Tracker closes without writing more.
    """

    def __init__(self, store: str | SpectrumStore, name: str, model: nn.Module, X: Any, y: Any,
                 X_test: Any = None, y_test: Any = None, *, steps: int, record: dict | RecordSpec | None = None,
                 spectrum: dict | None = None, hessian: dict | None = None, loss: str = "mse",
                 optimizer: str = "custom", cluster: str | None = None, workers: int = 1, worker_cpus: float = 1.0,
                 worker_gpus: float = 0.0, max_inflight: int = 2, seed: int = 0, device: str = "auto") -> None:
        if loss not in _LOSSES:
            raise ValueError(f"loss={loss!r} is not one of 'mse' (or 'l2'), 'cross_entropy': the loss the stored "
                             "metrics refer to")
        if optimizer not in ("custom", "gd"):
            raise ValueError(f"optimizer={optimizer!r} is not one of custom, gd")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.store = store if isinstance(store, SpectrumStore) else SpectrumStore(store)
        self.data, K = self._check_data(model, X, y, X_test, y_test)
        rec = record.model_dump() if isinstance(record, RecordSpec) else (record or {"log_points": 20})
        self.spec: ExperimentSpec = tracked_spec(name, model, self.data, K, steps=steps, record=rec,
                                                 spectrum=spectrum or {}, hessian=hessian, optimizer=optimizer,
                                                 seed=seed, device=device, loss=_LOSSES[loss])
        spec_dict = self.spec.model_dump(mode="json")
        self.device = next(model.parameters()).device
        self.X = torch.as_tensor(self.data.X, dtype=torch.float32, device=self.device)  # (N, …)
        self.y = torch.as_tensor(self.data.y, dtype=torch.float32, device=self.device)  # (N,) or (N, K)
        self.X_test = torch.as_tensor(self.data.X_test, dtype=torch.float32, device=self.device)
        self._ce = loss == "cross_entropy"
        self.schedule = self.spec.record_steps()
        self._index = {t: i for i, t in enumerate(self.schedule)}
        self.n_params = sum(p.numel() for p in model.parameters())
        probe = SpectralAnalyzer(self.spec, self.data, model=_cpu_copy(model))  # sizes only (images, hessian)
        self._lease = self.store.lease([name]).acquire()  # one writer of this run at a time
        try:
            self.writer = self.store.writer(name, spec_dict, tracked_dims(self.spec, self.data, probe, self.n_params),
                                            data_fingerprint=self.data.fingerprint(), token=self._lease.token)
        except BaseException:
            self._lease.release()
            raise
        self._done = self.writer.done()
        if not self.writer.static_complete():
            self.writer.write_static(tracked_static(self.spec, self.data, probe))
        del probe
        self.max_inflight = max_inflight
        if cluster is None:
            self.pool: Any = _ThreadPool(TrackedRunService(self.store.url, spec_dict, _cpu_copy(model), self.data,
                                                           token=self._lease.token))
        else:
            from nsa_dist.cluster.tracking import RayTrackerPool

            self.pool = RayTrackerPool(cluster, self.store.url, spec_dict, _cpu_copy(model), self.data,
                                       workers=workers, cpus=worker_cpus, gpus=worker_gpus, token=self._lease.token)
        self.writer.set_status(Status.RUNNING)
        self._pending: tuple[Checkpoint, torch.Tensor, torch.Tensor] | None = None  # awaiting θ_{t+1}
        self._trace: dict[int, float] = {}
        self.max_seen_inflight = 0
        self.blocked = 0  # times record() waited for a free slot
        self.finished: list[dict] = []
        self.closed = False

    # ------------------------------------------------------------------ inputs
    @staticmethod
    def _check_data(model: nn.Module, X: Any, y: Any, X_test: Any, y_test: Any) -> tuple[Dataset, int]:
        X, y = _as_tensor("X", X), _as_tensor("y", y)
        if X.ndim < 2 or X.shape[0] == 0:
            raise ShapeError(f"X must have shape (N, d) or (N, …) with N >= 1, got {tuple(X.shape)}")
        for nm, a in (("X", X), ("y", y)):
            if not torch.isfinite(a.double()).all():
                raise NonFiniteError(f"{nm} holds NaN or inf")
        p = next(model.parameters())
        with torch.no_grad():
            out = model(X[:2].to(device=p.device, dtype=p.dtype))
        n = min(2, X.shape[0])
        if not isinstance(out, torch.Tensor) or out.ndim not in (1, 2) or out.shape[0] != n:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ShapeError(f"the model must map (n, …) inputs to (n,) or (n, K) outputs; for input "
                             f"{tuple(X[:2].shape)} it returned {got}")
        K = 1 if out.ndim == 1 else int(out.shape[1])
        want = (X.shape[0],) if out.ndim == 1 else (X.shape[0], K)
        if tuple(y.shape) != want:
            raise ShapeError(f"y must have shape {want} (N = {X.shape[0]} points, the model's output per point "
                             f"{tuple(out.shape[1:])}); got {tuple(y.shape)}")
        if X_test is None:
            X_test, y_test = X.new_zeros((0,) + tuple(X.shape[1:])), y.new_zeros((0,) + tuple(y.shape[1:]))
        X_test = _as_tensor("X_test", X_test)
        y_test = _as_tensor("y_test", y_test) if y_test is not None else y.new_full((X_test.shape[0],) + tuple(y.shape[1:]), float("nan"))
        if tuple(X_test.shape[1:]) != tuple(X.shape[1:]) or tuple(y_test.shape) != (X_test.shape[0],) + tuple(y.shape[1:]):
            raise ShapeError(f"X_test, y_test must have shapes (M,) + {tuple(X.shape[1:])} and (M,) + "
                             f"{tuple(y.shape[1:])}; got {tuple(X_test.shape)} and {tuple(y_test.shape)}")
        f64 = lambda a: a.to(torch.float64).numpy()  # noqa: E731
        return Dataset(f64(X), f64(y), f64(X_test), f64(y_test), {"source": "tracker"}), K

    # ------------------------------------------------------------------ the loop's calls
    @property
    def inflight(self) -> int:
        return len(self.pool.inflight)

    @property
    def resubmitted(self) -> int:
        """Steps re-sent after their worker died."""
        return self.pool.resubmitted

    def due(self, step: int) -> bool:
        """Whether ``step`` is a recorded step not yet in the store (also takes a pending update)."""
        self._advance(step)
        i = self._index.get(step)
        return i is not None and not self._done[i]

    def log(self, step: int, loss: float) -> None:
        """Note the loss of update ``step`` for the store's loss curve (cheap; written at the next record)."""
        self._advance(step)
        self._trace[step] = float(loss)

    @torch.no_grad()
    def record(self, step: int, lr: float, loss: float | None = None) -> None:
        """Snapshot θ_t and the outputs at recorded step ``step`` and queue its analysis; returns at once.

        Args:
            step: t, one of the recording schedule's steps.
            lr: δ_t, the learning rate of update t.
            loss: the loop's own loss at t (checked, and kept in the loss curve); the stored ``loss`` is
                L(θ_t) over all N points.

        Raises:
            ValueError: ``step`` is not in the schedule; the tracker is closed.
            NonFiniteError: a NaN/inf loss or outputs (the run is marked failed; finished steps are kept).
        """
        if self.closed:
            raise ValueError("this Tracker is closed")
        if step not in self._index:
            raise ValueError(f"step {step} is not a recorded step of this run (schedule: {self.schedule[:8]}"
                             f"{' …' if len(self.schedule) > 8 else ''}); test tr.due(step) first")
        self._advance(step)
        i = self._index[step]
        if self._done[i]:
            return
        f = self.model(self.X)  # (N,) or (N, K)
        L = cross_entropy_loss(f, self.y) if self._ce else 0.5 * ((f - self.y) ** 2).reshape(f.shape[0], -1).sum(1).mean()
        given = float(L) if loss is None else float(loss)
        if not (np.isfinite(given) and np.isfinite(float(L))):
            self._fail(step, f"loss is {given if not np.isfinite(given) else float(L)} at step {step}")
        self._trace[step] = given
        theta = parameters_to_vector(self.model.parameters()).detach().float().cpu().numpy().copy()  # (P,)
        fn = f.float().cpu().numpy().copy()
        f_test = self.model(self.X_test).float().cpu().numpy().copy() if self.X_test.shape[0] else \
            np.zeros((0,) + fn.shape[1:], np.float32)
        state = TrainerState(step, theta, np.zeros((0, self.n_params), np.float32), np.zeros(RNG_BYTES, np.uint8))
        ck = Checkpoint(index=i, step=step, lr=float(lr), loss=float(L), theta=theta, dtheta=theta, f=fn, df=fn,
                        f_test=f_test, loss_trace=np.zeros(0), trace_start=step, state=state)
        self._pending = (ck, theta, fn)

    def _advance(self, step: int) -> None:
        """Submit the pending checkpoint: with its update if the model is now at its step + 1."""
        if self._pending is None or step == self._pending[0].step:
            return
        ck, theta, f = self._pending
        if step == ck.step + 1:
            with torch.no_grad():
                theta1 = parameters_to_vector(self.model.parameters()).detach().float().cpu().numpy()
                f1 = self.model(self.X).float().cpu().numpy()
            dtheta, df = theta1 - theta, f1 - f
        else:
            dtheta, df = np.full_like(theta, np.nan), np.full_like(f, np.nan)
        self._pending = None
        self._submit(_replace(ck, dtheta=dtheta, df=df))

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
            for s in self.pool.wait(block):
                self._done[s["index"]] = True
                self.finished.append(s)
        except LeaseLost:  # another writer has the run: not a word more from this one
            self._stop_lost()
            raise
        except Exception as exc:
            self.writer.set_status(Status.FAILED, f"{type(exc).__name__}: {exc}")
            self.closed = True
            self._lease.release()
            raise

    def _stop_lost(self) -> None:
        """This Tracker's lease was taken over: close without writing (no status, no released lease)."""
        self.closed = True
        self._pending = None
        self._lease.release()

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
        self.writer.set_status(Status.FAILED, f"training diverged: {why}", step)
        self.closed = True
        self.pool.close()
        self._lease.release()
        raise NonFiniteError(f"run {self.spec.name!r}: {why}; the run is marked failed, the "
                             f"{int(self._done.sum())} steps recorded before it are kept")

    def close(self) -> None:
        """Wait for every analysis; status ``done`` when every recorded step is in the store."""
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
                self.writer.set_status(Status.PENDING, f"closed with {missing} of {len(self._done)} recorded steps "
                                       "missing; reopen the Tracker with this name to continue")
            else:
                finish_run(self.writer, self.spec)
        finally:
            self._lease.release()

    def __enter__(self) -> "Tracker":
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
                self.writer.set_status(Status.INTERRUPTED, f"interrupted ({exc_type.__name__}); reopen to continue")
                self._lease.release()

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


def _replace(ck: Checkpoint, **kw: Any) -> Checkpoint:
    from dataclasses import replace

    return replace(ck, **kw)


def _cpu_copy(model: nn.Module) -> nn.Module:
    """A float32 CPU copy of the model for the analysis (a thread's own, or the one pickled to Ray)."""
    import copy

    try:
        return copy.deepcopy(model).cpu().float()
    except (TypeError, AttributeError, RuntimeError) as exc:
        raise TypeError(f"the model ({type(model).__qualname__}) cannot be copied or pickled ({exc}); the Tracker "
                        "analyses a copy of it, in a thread or pickled to the Ray spectral workers — keep "
                        "unpicklable state (locks, open files, data loaders) outside the module") from exc
