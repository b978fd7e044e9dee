"""Training of one run, plain PyTorch (no Ray, no store): GD, minibatch SGD, Adam."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from nsa_dist.config import OptimizerName
from nsa_dist.data import Dataset
from nsa_dist.losses import cross_entropy_loss, is_cross_entropy, is_nce, nce_loss
from nsa_dist.ntk import sample_coupling
from nsa_dist.pipeline.checkpoint import Checkpoint, TrainerState
from nsa_dist.pipeline.materials import RunMaterials
from nsa_dist.pipeline.plan import RunPlan, slot_names

__all__ = ["Trainer", "TrainingDiverged"]

# Points per forward/backward pass when a step's batch is larger (GD's full batch at N = 50,000
# CIFAR images would keep 11 GB of a small CNN's activations): every loss is a mean over points,
# so the gradient is the sum of the pieces' gradients weighted n_piece / n — the same gradient,
# one piece's activations.  A model that couples samples (batch statistics) takes its batch whole.
CHUNK_POINTS = 4096


class TrainingDiverged(FloatingPointError):
    """The loss became NaN/inf at ``step``.

    ``loss_trace`` (float64) are the losses of steps ``trace_start`` … ``step`` not yet handed out
    in a checkpoint — the optimizer's finite ones, then the non-finite one at ``step`` — for the
    caller to write (``writer.write_trace(exc.trace_start, exc.loss_trace)``), so that the loss
    curve of a diverged run reaches the step where it diverged.
    """

    def __init__(self, step: int, loss: float, trace_start: int | None = None, loss_trace: np.ndarray | None = None):
        super().__init__(f"training diverged at step {step}: loss = {loss} (lower the learning rate)")
        self.step, self.loss = step, loss
        self.trace_start = step if trace_start is None else int(trace_start)
        self.loss_trace = np.zeros(0) if loss_trace is None else np.asarray(loss_trace, np.float64)

    def __reduce__(self):  # survive pickling (Ray ships it from the trainer to the coordinator)
        return (TrainingDiverged, (self.step, self.loss, self.trace_start, self.loss_trace))


def _as_target(y: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(np.asarray(y), dtype=torch.float32)


class Trainer:
    """Trains ``spec``'s model on ``data`` with the spec's loss (L = (1/N) Σ ½‖f − y‖², NCE or
    cross-entropy), deterministically for a seed; the learning rate is :meth:`ExperimentSpec.lr_at`.

    ``train_until(stop)`` is idempotent in its target: it runs updates from the current step up
    to ``stop`` and yields a :class:`Checkpoint` at every recorded step passed on the way.  Its
    network is a copy of the run's of its own (:meth:`RunMaterials.network`, built once per process).
    """

    def __init__(self, plan: RunPlan, data: Dataset) -> None:
        spec = plan.spec
        self.plan, self.spec = plan, spec
        self.device = torch.device(plan.device)
        self.model = RunMaterials.load(plan, data=data).network(self.device)
        self.X = torch.as_tensor(data.X, dtype=torch.float32, device=self.device)  # (N, d)
        self.y = _as_target(data.y).to(self.device)  # (N,) or (N, K)
        self.X_test = torch.as_tensor(data.X_test, dtype=torch.float32, device=self.device).reshape(-1, data.X.shape[1])
        self._nce = (
            None
            if not is_nce(spec)
            else tuple(  # (label, log(ν q)) at the training points
                torch.as_tensor(data.extra[k], dtype=torch.float32, device=self.device) for k in ("label", "log_noise")
            )
        )
        self._ce = is_cross_entropy(spec)
        self.record = list(plan.record)
        self._index = {t: i for i, t in enumerate(self.record)}
        self.opt = self._optimizer()
        big = self.X.shape[0] > CHUNK_POINTS
        self._chunk = CHUNK_POINTS if big and sample_coupling(self.model, self.X[:64]) is None else None
        self.gen = torch.Generator().manual_seed(spec.seed + 7919)
        self.step = 0
        self.on_update: Callable[[int, float], None] | None = None  # called after every update
        self._trace: list[float] = []
        self._trace_start = 0

    def _optimizer(self) -> torch.optim.Optimizer:
        o = self.spec.optimizer
        params = self.model.parameters()
        if OptimizerName(o.name) is OptimizerName.CUSTOM:
            raise ValueError(
                "optimizer.name='custom' is a user's own update recorded by a Tracker; a spec run needs gd, sgd or adam"
            )
        if OptimizerName(o.name) is OptimizerName.ADAM:
            return torch.optim.Adam(params, lr=self.spec.lr_at(0), betas=o.betas, eps=o.eps)
        return torch.optim.SGD(params, lr=self.spec.lr_at(0), momentum=o.momentum)

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # ------------------------------------------------------------------ state
    @property
    def slot_names(self) -> tuple[str, ...]:
        """Names of the per-parameter optimizer state tensors kept in :class:`TrainerState`."""
        return slot_names(self.spec)

    def state(self) -> TrainerState:
        params = list(self.model.parameters())
        slots = np.zeros((len(self.slot_names), self.n_params), np.float32)
        for j, name in enumerate(self.slot_names):
            bufs = [self.opt.state.get(p, {}).get(name) for p in params]
            if all(b is not None for b in bufs):
                slots[j] = torch.cat([b.reshape(-1) for b in bufs]).cpu().numpy()
        return TrainerState(self.step, self.theta(), slots, self.gen.get_state().numpy().copy())

    def load_state(self, state: TrainerState) -> None:
        params = list(self.model.parameters())
        vector_to_parameters(torch.as_tensor(state.theta, dtype=torch.float32, device=self.device), params)
        self.opt.state.clear()
        if state.step > 0:
            for j, name in enumerate(self.slot_names):
                off = 0
                for p in params:
                    st = self.opt.state.setdefault(p, {})
                    slot = state.slots[j, off : off + p.numel()]
                    st[name] = torch.as_tensor(slot, device=self.device).view_as(p).clone()
                    off += p.numel()
                    if name == "exp_avg":
                        st["step"] = torch.tensor(float(state.step))
        self.gen.set_state(torch.as_tensor(np.asarray(state.rng, dtype=np.uint8)))
        self.step = state.step
        self._trace, self._trace_start = [], state.step

    def theta(self) -> np.ndarray:
        return parameters_to_vector(self.model.parameters()).detach().cpu().numpy().copy()  # (P,)

    # ------------------------------------------------------------------ training
    def _loss(self, idx: torch.Tensor | slice | None) -> torch.Tensor:
        """L over the points ``idx`` (None: all), a mean over them."""
        X, y = (self.X, self.y) if idx is None else (self.X[idx], self.y[idx])
        if self._nce is not None:
            label, log_noise = (t if idx is None else t[idx] for t in self._nce)
            return nce_loss(self.model(X), label, log_noise)
        if self._ce:
            return cross_entropy_loss(self.model(X), y)
        r = self.model(X) - y
        return 0.5 * (r**2).reshape(r.shape[0], -1).sum(1).mean()

    def _batch(self) -> torch.Tensor | None:
        b = self.spec.optimizer.batch_size
        if b is None:
            return None
        return torch.randperm(self.X.shape[0], generator=self.gen)[:b].to(self.device)

    def _pieces(self, idx: torch.Tensor | None) -> list[tuple[torch.Tensor | slice | None, float]]:
        """The batch ``idx`` (None: every point) as pieces of at most ``CHUNK_POINTS`` points, each
        with its weight n_piece / n; one piece, weight 1, when it is small or the model couples samples."""
        n = self.X.shape[0] if idx is None else idx.shape[0]
        c = self._chunk
        if c is None or n <= c:
            return [(idx, 1.0)]
        return [(slice(s, min(s + c, n)) if idx is None else idx[s : s + c], min(c, n - s) / n) for s in range(0, n, c)]

    def _update(self) -> float:
        """One update θ_t → θ_{t+1}; returns the full-data loss L(θ_t) for GD, the batch loss otherwise."""
        lr = self.spec.lr_at(self.step)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        value = 0.0
        for piece, weight in self._pieces(self._batch()):
            loss = self._loss(piece)
            loss = loss if weight == 1.0 else loss * weight
            part = float(loss.detach())
            if not np.isfinite(part):
                raise self._diverged(part)
            loss.backward()  # gradients add up over the pieces
            value += part
        self.opt.step()
        self.step += 1
        if self.on_update is not None:
            self.on_update(self.step, value)
        return value

    def _diverged(self, loss: float) -> TrainingDiverged:
        """The error for a non-finite loss at the current step, with the losses not yet handed out
        (those noted since the last checkpoint, then ``loss``)."""
        trace = np.asarray([*self._trace, loss], np.float64)
        return TrainingDiverged(self.step, loss, self._trace_start, trace)

    @torch.no_grad()
    def outputs(self, X: torch.Tensor) -> np.ndarray:
        """f(X), in pieces of ``CHUNK_POINTS`` points for a model that does not couple samples."""
        if not X.shape[0]:
            return np.zeros((0,) + tuple(self.y.shape[1:]), np.float32)
        if self._chunk is None or X.shape[0] <= self._chunk:
            return self.model(X).cpu().numpy().copy()
        return torch.cat([self.model(X[s : s + self._chunk]) for s in range(0, X.shape[0], self._chunk)]).cpu().numpy()

    @torch.no_grad()
    def full_loss(self) -> float:
        """L(θ) over every training point (summed over pieces as the update's gradient is)."""
        return sum(float(self._loss(piece)) * weight for piece, weight in self._pieces(None))

    def train_until(self, stop: int) -> Iterator[Checkpoint]:
        """Run updates until ``self.step == stop``, yielding a checkpoint at each recorded step."""
        stop = min(stop, self.spec.steps)
        while self.step < stop:
            t = self.step
            if t not in self._index:
                self._trace.append(self._update())
                continue
            theta, f, f_test = self.theta(), self.outputs(self.X), self.outputs(self.X_test)
            loss = self.full_loss()
            if not np.isfinite(loss):
                raise self._diverged(loss)
            lr, state = self.spec.lr_at(t), self.state()
            self._trace.append(self._update())
            f_next = self.outputs(self.X)
            trace, start = np.asarray(self._trace, np.float64), self._trace_start
            self._trace, self._trace_start = [], self.step
            yield Checkpoint(
                index=self._index[t],
                step=t,
                lr=lr,
                loss=loss,
                theta=theta,
                dtheta=self.theta() - theta,
                f=f,
                df=f_next - f,
                f_test=f_test,
                loss_trace=trace,
                trace_start=start,
                state=state,
            )
            if not np.isfinite(f_next).all():  # θ_t was fine (recorded above), θ_{t+1} is not
                raise TrainingDiverged(self.step, float("nan"))

    def run(self, on_checkpoint: Callable[[Checkpoint], None]) -> None:
        """Train to the end, calling ``on_checkpoint`` at each recorded step."""
        for ck in self.train_until(self.spec.steps):
            on_checkpoint(ck)
