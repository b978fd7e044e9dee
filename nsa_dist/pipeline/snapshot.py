"""A user's network at its recorded steps as checkpoints: the Tracker's side of a tracked run that
touches the model.

:func:`checked_data` checks the user's arrays against the network once; :class:`StepSnapshots`
then takes, at a recorded step t, θ_t, the outputs f_t, the buffers and per-module training modes
(:class:`~nsa_dist.pipeline.model_state.ModelState`) and L(θ_t) — leaving the user's module as it
was — and, once the model is at t + 1, the update Δθ_t, Δf_t.  The checkpoints are those a spec
run's trainer makes, so :class:`~nsa_dist.pipeline.tracked.TrackedRunService` analyses them alike.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from nsa_dist.data import Dataset
from nsa_dist.errors import NonFiniteError, ShapeError, UnsupportedModelError
from nsa_dist.losses import cross_entropy_loss
from nsa_dist.models import (
    OutputSelector,
    SelectedOutput,
    measured_module,
    not_a_tensor,
    single_column,
    user_named_modules,
)
from nsa_dist.ntk import attributes_restored, preserved, sample_coupling
from nsa_dist.ntk.state import forwarded_few
from nsa_dist.pipeline.checkpoint import Checkpoint, TrainerState
from nsa_dist.pipeline.model_state import ModelState, model_inputs, theta_vector
from nsa_dist.pipeline.plan import TRACKED_RNG_BYTES

__all__ = ["StepSnapshots", "checked_data", "couples_samples", "measured_inputs"]

log = logging.getLogger("nsa_dist")


class StepSnapshots:
    """Checkpoints of ``model`` at recorded steps, on the run's points.

    Args:
        model: the measured network (the user's module, or its selected output).
        data: the checked points (:func:`checked_data`).
        cross_entropy: L is the cross-entropy of softmax(f) against one-hot y, else ½‖f − y‖² per point.
        name: the run's name (for the log line saying the model couples samples).
    """

    def __init__(self, model: nn.Module, data: Dataset, *, cross_entropy: bool, name: str) -> None:
        p = next(model.parameters())
        self.model, self.data, self.ce, self.name = model, data, cross_entropy, name
        self.X = model_inputs(data.X, model)  # (N, …): the model's float dtype, or integer ids as given
        self.y = torch.as_tensor(data.y, device=p.device).to(  # (N,) or (N, K)
            p.dtype if p.dtype == torch.float64 else torch.float32
        )
        self.X_test = model_inputs(data.X_test, model)  # (M, …) like X
        self.n_params = sum(q.numel() for q in model.parameters())
        self._coupling_said = False
        self._versions: dict[int, list[int]] = {}  # the parameters' versions at the last step taken

    @torch.no_grad()
    def take(self, step: int, index: int, lr: float) -> Checkpoint:
        """Recorded step ``index`` (training step ``step``, learning rate δ_t = ``lr``) at the model's
        θ_t, with its buffers and modes and ``loss`` = L(θ_t) over all N points; its update is θ_t
        and f_t until :meth:`with_update` gives the real one."""
        mstate = ModelState.capture(self.model)  # buffers and modes of step t, with θ_t
        # the user's module, in the user's thread: an activation cache its loop reads next keeps the
        # loop's own forward's (not the test points')
        with attributes_restored(self.model):
            self._say_coupling(step)
            with preserved(self.model):
                f = self.model(self.X)  # (N,) or (N, K)
                f_test = self.model(self.X_test) if self.X_test.shape[0] else f.new_zeros((0,) + tuple(f.shape[1:]))
        L = (
            cross_entropy_loss(f, self.y)
            if self.ce
            else 0.5 * ((f - self.y) ** 2).reshape(f.shape[0], -1).sum(1).mean()
        )
        theta = theta_vector(self.model)  # (P,)
        self._versions = {index: [p._version for p in self.model.parameters()]}  # for :meth:`moved`
        fn = _outputs(f)
        state = TrainerState(
            step, theta, np.zeros((0, self.n_params), np.float32), np.zeros(TRACKED_RNG_BYTES, np.uint8)
        )
        return Checkpoint(
            index=index,
            step=step,
            lr=float(lr),
            loss=float(L),
            theta=theta,
            dtheta=theta,
            f=fn,
            df=fn,
            f_test=_outputs(f_test),
            loss_trace=np.zeros(0),
            trace_start=step,
            state=state,
            model_state=mstate,
        )

    @torch.no_grad()
    def moved(self, ck: Checkpoint) -> bool:
        """Whether the model has moved since ``ck`` was taken: a parameter written in place since
        (an optimizer step, even one of learning rate 0 — a warmup's first), or θ no longer θ_t bit
        for bit (parameters replaced)."""
        versions = self._versions.get(ck.index)
        if versions is not None and versions != [p._version for p in self.model.parameters()]:
            return True
        return not np.array_equal(theta_vector(self.model), ck.theta)

    def with_update(self, ck: Checkpoint, step: int, buffers: dict[str, torch.Tensor] | None = None) -> Checkpoint:
        """``ck`` with its update Δθ_t, Δf_t when the model is now at ``step`` = t + 1, else with NaN ones.

        ``buffers``: values the forward of θ_{t+1} takes for these buffers instead of the model's
        (step t's running statistics: Δf_t is then the change J_t Δθ_t predicts); the model's own
        buffers are not written."""
        if step == ck.step + 1:
            with torch.no_grad(), preserved(self.model), attributes_restored(self.model):
                theta1 = theta_vector(self.model)
                f1 = _outputs(
                    functional_call(self.model, buffers, (self.X,), strict=False) if buffers else self.model(self.X)
                )
            return replace(ck, dtheta=theta1 - ck.theta, df=f1 - ck.f)
        return replace(ck, dtheta=np.full_like(ck.theta, np.nan), df=np.full_like(ck.f, np.nan))

    def _say_coupling(self, step: int) -> None:
        """Log once when the model couples samples (checked at each record until it does)."""
        if self._coupling_said or not couples_samples(self.model, self.X):
            return
        self._coupling_said = True
        bn = _batch_stat_modules(self.model)
        log.warning(
            "run %r: at step %d the model couples samples — its output for one point depends on the other "
            "points of the batch%s; its NTK is that of the full-batch forward on the N = %d points",
            self.name,
            step,
            f" (batch statistics in {', '.join(repr(b) for b in bn)})" if bn else "",
            self.data.n,
        )


def measured_inputs(
    model: nn.Module, output: OutputSelector, X: Any, y: Any, X_test: Any, y_test: Any
) -> tuple[nn.Module, nn.Module, Dataset, int]:
    """What a Tracker measures: the network as measured (the module a ``torch.compile``'d model
    wraps, its ``output`` selected, a one-column output (n, 1) as the (n,) it means), the user's
    module (whose class and parameters the spec names), the checked data (:func:`checked_data`)
    and the outputs per point K."""
    user = measured_module(model)  # a compiled model: the module it wraps
    model = measured_module(user, output)  # the user's module, or its selected output
    data, K, column = checked_data(model, X, y, X_test, y_test)
    if column:  # an (n, 1) output (a final nn.Linear(…, 1)) is measured as the (n,) it means
        model = SelectedOutput(model, single_column)
    return model, user, data, K


def _as_tensor(name: str, a: Any) -> torch.Tensor:
    """The caller's array as a CPU tensor of its own: a copy, never a view — a loop that shuffles or augments
    its X or y in place (``rng.shuffle(X)`` for minibatches) changed a float64 run's data under the Tracker,
    and later steps were measured on other points than the stored ones (E(y, k) 0.33 off, df 1.1, an audit)."""
    if isinstance(a, np.ndarray):
        a = torch.from_numpy(a)
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(a).__name__}")
    return a.detach().cpu().clone()


def _first_point(bad: torch.Tensor) -> int:
    """The first point (row) of a per-entry mask that holds a True entry (0 for a scalar)."""
    return int(bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()[0, 0]) if bad.ndim else 0


def _finite(name: str, a: torch.Tensor) -> None:
    """NonFiniteError naming ``name``, how many entries are NaN or inf and the first point holding one."""
    bad = ~torch.isfinite(a.double())
    if bad.any():
        first = _first_point(bad)
        raise NonFiniteError(
            f"{name} holds {int(bad.sum())} NaN/inf entries (the first in point {first}): clean the "
            "data before handing it to the Tracker"
        )


def _fits(name: str, a: torch.Tensor, model: nn.Module) -> None:
    """NonFiniteError when ``a`` (finite) overflows the model's floating dtype: a float64 X with an entry
    of 10³⁹ read "x holds 1 NaN/inf entries … lower the learning rate" for a float32 model (an audit)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is None or not a.is_floating_point() or a.dtype == dtype:
        return
    bad = ~torch.isfinite(a.to(dtype))
    if bad.any():
        first = _first_point(bad)
        big = float(a.double().abs().max())
        raise NonFiniteError(
            f"{name} is {a.dtype} and {int(bad.sum())} of its entries overflow the model's {dtype} (the first "
            f"in point {first}; the largest |value| {big:.3g}, {dtype}'s largest {torch.finfo(dtype).max:.3g}): "
            "rescale the data, or measure a float64 model"
        )


def checked_data(model: nn.Module, X: Any, y: Any, X_test: Any, y_test: Any) -> tuple[Dataset, int, bool]:
    """The checked data, the outputs per point K and whether the model's output is one
    column, (n, 1) — then measured as (n,), with y and y_test accepted as (N,) or (N, 1)."""
    X, y = _as_tensor("X", X), _as_tensor("y", y)
    if X.ndim < 2 or X.shape[0] == 0:
        raise ShapeError(f"X must have shape (N, d) or (N, …) with N >= 1, got {tuple(X.shape)}")
    _finite("X", X)
    _finite("y", y)
    _fits("X", X, model)  # the inputs go into the model in its dtype (y stays float64)
    try:
        with torch.no_grad(), preserved(model), attributes_restored(model):
            # two points, or all of them for a forward that runs on no fewer (a transductive model over their graph)
            few, out = forwarded_few(lambda p: model(model_inputs(p, model)), X)
    except RuntimeError as e:
        if X.is_floating_point():
            raise
        raise TypeError(
            f"X is {X.dtype}: integer inputs are kept as token ids (for an embedding), and the model's "
            f"forward failed on them ({e}); integer features (pixels 0–255, counts) go in as floats: "
            "pass X.float() (and X_test.float())"
        ) from e
    n = few.shape[0]
    if not isinstance(out, torch.Tensor):
        raise ShapeError(not_a_tensor(out) + " of shape (n,) or (n, K)")
    if out.ndim not in (1, 2) or out.shape[0] != n:
        got = tuple(out.shape)
        raise ShapeError(
            f"the model must map (n, …) inputs to (n,) or (n, K) outputs; for input "
            f"{tuple(few.shape)} it returned {got}"
        )
    K = 1 if out.ndim == 1 else int(out.shape[1])
    column = out.ndim == 2 and K == 1
    if column:
        y = y.reshape(-1) if tuple(y.shape) == (X.shape[0], 1) else y
    want = (X.shape[0],) if out.ndim == 1 or column else (X.shape[0], K)
    if tuple(y.shape) != want:
        also = f" or {(X.shape[0], 1)}" if column else ""
        labels = (
            f" — class labels? one-hot them first: y = torch.nn.functional.one_hot(labels, {K}).float()"
            if len(want) == 2 and tuple(y.shape) == want[:1] and not y.is_floating_point()
            else ""
        )
        raise ShapeError(
            f"y must have shape {want}{also} (N = {X.shape[0]} points, the model's output per "
            f"point {tuple(out.shape[1:])}); got {tuple(y.shape)}{labels}"
        )
    if X_test is None:
        X_test, y_test = X.new_zeros((0,) + tuple(X.shape[1:])), y.new_zeros((0,) + tuple(y.shape[1:]))
    X_test = _as_tensor("X_test", X_test)
    if X_test.shape[0] and X_test.is_floating_point() != X.is_floating_point():
        raise TypeError(f"X_test ({X_test.dtype}) and X ({X.dtype}) must both be floating points or both integer ids")
    given_y_test = y_test
    y_test = (
        _as_tensor("y_test", y_test)
        if y_test is not None
        else y.new_full((X_test.shape[0],) + tuple(y.shape[1:]), float("nan"))
    )
    if column and y_test.ndim == 2 and y_test.shape[1] == 1:
        y_test = y_test.reshape(-1)
    _finite("X_test", X_test)
    _fits("X_test", X_test, model)
    if given_y_test is not None:  # none given: unknown test targets, NaN (the test loss is not measured)
        _finite("y_test", y_test)
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
        for n, m in user_named_modules(model)
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or m.running_mean is None)
    ]


def couples_samples(model: nn.Module, X: torch.Tensor, points: int = 64) -> bool:
    """Whether the model couples samples (BatchNorm in train mode or without running statistics):
    the NTK core's probe, :func:`nsa_dist.ntk.sample_coupling`, on the first distinct of the first ``points``.
    A random forward (dropout in train mode) or NaN outputs (a diverged step, which the caller's own
    check names and fails the run on) cannot be judged and count as not coupling.
    The model's buffers, modes and the global RNG state are as before."""
    try:
        return sample_coupling(model, X[:points]) is not None
    except (UnsupportedModelError, NonFiniteError):  # no verdict: this is a note, never the run's error
        return False
