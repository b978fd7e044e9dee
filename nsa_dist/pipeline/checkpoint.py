"""What the trainer hands to the spectral analysis at a recorded step (plain numpy, object-store friendly)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from nsa_dist.pipeline.model_state import ModelState

__all__ = ["Checkpoint", "TrainerState"]


@dataclass(frozen=True)
class Checkpoint:
    """The state at recorded step t (before update t) and the update it made.

    Attributes:
        index: position of t in the recording schedule.
        step: t.
        lr: δ_t used by update t.
        loss: L(θ_t) = (1/N) Σ ½‖f_t − y‖².
        theta: (P,) float32, θ_t (float64 for a float64 model, whose analysis uses θ_t exactly).
        dtheta: (P,) like theta, θ_{t+1} − θ_t.
        f: (N,) or (N, K) outputs f_t at the training points.
        df: like f: the real change f_{t+1} − f_t.
        f_test: (M,) or (M, K) outputs at the test points.
        loss_trace: losses of the steps since the previous record (for the loss curve).
        trace_start: first step covered by ``loss_trace``.
        state: the trainer state at t, to resume from exactly here.
        model_state: the model's buffers and training modes at t (a Tracker's user model: the
            analysis computes with them); None for a spec run, whose model has no state besides θ.
    """

    index: int
    step: int
    lr: float
    loss: float
    theta: np.ndarray
    dtheta: np.ndarray
    f: np.ndarray
    df: np.ndarray
    f_test: np.ndarray
    loss_trace: np.ndarray
    trace_start: int
    state: TrainerState
    model_state: ModelState | None = None


@dataclass(frozen=True)
class TrainerState:
    """Everything needed to continue training exactly from step t.

    Attributes:
        step: t.
        theta: (P,) float32 parameters θ_t.
        slots: (n_slots, P) float32 optimizer state (none for GD, the momentum buffer for SGD
            with momentum, Adam's first and second moments).
        rng: (L,) uint8 state of the minibatch generator.
    """

    step: int
    theta: np.ndarray
    slots: np.ndarray
    rng: np.ndarray
