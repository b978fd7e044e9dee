"""An optional PyTorch Lightning callback that feeds a :class:`~nsa_dist.Tracker`.

Lightning is not a dependency: this module defines ``SpectrumCallback`` only when ``lightning``
(or ``pytorch_lightning``) is importable, and otherwise raises an error naming what to install.

Step t is Lightning's ``trainer.global_step`` — the t-th ``optimizer.step`` — and is recorded from
``on_before_optimizer_step``: the gradients are computed, θ is still θ_t, and the learning rate in
the optimizer's groups is the δ_t that step applies (after a scheduler's ``step`` of the previous
update, or a warm-up written into the groups in an overridden ``optimizer_step``).  So one record
per optimizer step under gradient accumulation (not one per micro-batch), and under manual
optimization one per ``opt.step()`` call, whichever optimizer steps (its own lr).  The update Δθ_t,
Δf_t is taken at the end of the batch that made it (before validation runs), or at the end of
training.  The loss ``training_step`` returned for the batch of update t is the run's loss curve at
t (``Run.loss_trace``: the optimizer's own loss, a mini-batch's under SGD, as under ``nsa run``;
under DDP the mean of the ranks' batch losses),
for every update, recorded or not — under automatic optimization without gradient accumulation (else
the curve holds the recorded steps' full-batch loss only).  Checked against ``torch.func.jacrev`` at
the optimizer's own θ_t, δ_t, θ_{t+1} (``tests/test_lightning.py``): full-batch and mini-batch SGD,
momentum, Adam, per-step schedulers, gradient accumulation, max_steps / max_epochs, validation in
between, the Tracker holding the LightningModule or the network inside it, resuming from a
checkpoint, manual optimization.

An optimizer whose parameter groups have different learning rates (a backbone and a head trained
at their own rates) is recorded as :meth:`~nsa_dist.Tracker.record` records it: δ_t, the one rate of
update t, is ambiguous and stored as NaN (with a warning), Δf_t is predicted as J_t Δθ_t of the
update made, and every spectrum is measured; so are the steps of groups whose rates part later
under a scheduler.  Refused before training with a ``ValueError`` naming the cause: a Trainer that
changed the tracked model's dtype or device after the Tracker was created (``precision="64-true"``
on a float32 module, ``"bf16-true"``, …:
build the module in its training dtype first).  Mixed precision (``"bf16-mixed"``) is measured on
the module's own float32 parameters, outside autocast; under ``optimizer="gd"`` its updates, rounded
by bf16 (0.3–0.8 % off −δ∇L), are not taken for GD: δ_t is NaN and Δf_t predicted as J_t Δθ_t. An
exception in training (Lightning's ``on_exception``, a KeyboardInterrupt too) ends the run
``interrupted`` with every finished step kept; the end of training closes the Tracker, and a later
``fit`` with the same callback is refused before it trains (a new Tracker of the same name
continues the run).  The model is recorded in the
modes it has in training: an active Dropout (train mode) makes its forward random — refused when the
Tracker is created, and at a record (a module put in train mode after) the recording ends
``interrupted`` while training goes on, as when a parameter's ``requires_grad`` changes mid-fit
(:meth:`~nsa_dist.Tracker.record`).

DDP with ``strategy="ddp"`` (Lightning starts a process per device that runs the script again):
every process creates its Tracker and callback as in one process; rank 0's records the run, the
others write nothing (:class:`~nsa_dist.Tracker`'s distributed ranks).  ``"ddp_spawn"`` /
``"ddp_notebook"`` are refused before training (they would send the Tracker, which writes from
this process, to other processes); checked against a single-process run of the same full batch
in float64 (``tests/test_lightning.py``).
"""

from __future__ import annotations

from typing import Any

from nsa_dist.errors import MissingDependencyError

__all__ = ["SpectrumCallback"]

try:
    import lightning.pytorch as _pl
except ImportError:  # pragma: no cover - depends on the environment
    try:
        import pytorch_lightning as _pl  # type: ignore[no-redef]
    except ImportError:
        _pl = None

if _pl is not None:

    class SpectrumCallback(_pl.Callback):
        """Records the Tracker's due steps at each optimizer step (θ_t and δ_t as that step uses them).

        The Tracker must hold the module being trained (the LightningModule or the network inside
        it), created in the dtype and on the device it trains in; the step is ``trainer.global_step``.
        The Tracker is closed at the end of training, and ends the run ``interrupted`` on an exception.
        """

        def __init__(self, tracker: Any) -> None:
            self.tracker = tracker
            self._layout = _layout(tracker.model)  # the dtypes and devices the Tracker was made for
            self._ended = False  # a fit ended and closed the Tracker

        def __getstate__(self) -> Any:
            raise TypeError(
                "a SpectrumCallback cannot be sent to another process: its Tracker writes the run from the "
                "process that created it — use strategy='ddp' (a process per device, each running the script "
                "and creating its own Tracker; rank 0 records) instead of 'ddp_spawn' / 'ddp_notebook', or one device"
            )

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            if self._ended:
                raise ValueError(
                    "this SpectrumCallback's Tracker was closed when an earlier fit ended (or raised); to "
                    "train on, give this fit a new SpectrumCallback with a new Tracker of the same run name "
                    "(it continues the run)"
                )
            now = _layout(self.tracker.model)
            if now != self._layout:
                raise ValueError(
                    f"the Trainer (precision={trainer.precision!r}) moved or cast the tracked model from "
                    f"{_said(self._layout)} to {_said(now)} after the Tracker was created for it; the Tracker "
                    "measures the model it was made for — build the module in the dtype and on the device it "
                    "trains in (e.g. module.double() for precision='64-true') before creating the Tracker"
                )

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            step = int(trainer.global_step)
            if self.tracker.due(step):  # the optimizer's groups: one rate is δ_t, different ones NaN (said)
                self.tracker.record(step, lr=[float(g["lr"]) for g in optimizer.param_groups])

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._at = int(trainer.global_step)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            step = int(trainer.global_step)
            self.tracker.due(step)  # the update of a step made in this batch
            loss = _batch_loss(outputs)
            made_one = step == getattr(self, "_at", step) + 1 and pl_module.automatic_optimization
            if made_one and loss is not None and int(getattr(trainer, "accumulate_grad_batches", 1)) == 1:
                if int(getattr(trainer, "world_size", 1)) > 1:
                    # DDP: the mean of the ranks' batch losses, the loss of the global batch the averaged
                    # gradient is of (rank 0's shard alone was stored: 0.68 for the global 0.52, an audit).
                    # Every rank runs this hook at this step, so the collective is joined by all
                    loss = trainer.strategy.reduce(loss.detach().reshape(()).clone(), reduce_op="mean")
                self.tracker.log(step - 1, float(loss))  # the loss of the batch that made update t: the loss curve

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._ended = True
            self.tracker.due(int(trainer.global_step))  # the last step's update, however long the run
            self.tracker.close()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            self._ended = True
            self.tracker.__exit__(type(exception), exception, exception.__traceback__)

    def _batch_loss(outputs: Any) -> Any:
        """The loss ``training_step`` returned (a one-element tensor, or a dict's ``"loss"``), else None."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if hasattr(loss, "numel") and loss.numel() == 1:
            return loss.detach()
        return None

    def _layout(model: Any) -> list[tuple[str, str]]:
        return sorted({(str(p.dtype), str(p.device)) for p in model.parameters()})

    def _said(layout: list[tuple[str, str]]) -> str:
        return ", ".join(f"{d.removeprefix('torch.')} on {dev}" for d, dev in layout)

else:

    def __getattr__(name: str) -> Any:
        if name == "SpectrumCallback":
            raise MissingDependencyError(
                "nsa_dist.lightning.SpectrumCallback needs PyTorch Lightning: "
                "pip install lightning (it is not an nsa-dist dependency); "
                "without it, call tracker.due/record in your own loop"
            )
        raise AttributeError(name)
