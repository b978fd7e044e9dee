"""An optional PyTorch Lightning callback that feeds a :class:`~nsa_dist.Tracker`.

Lightning is not a dependency: this module defines ``SpectrumCallback`` only when ``lightning``
(or ``pytorch_lightning``) is importable, and otherwise raises an error naming what to install.
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
        """Records the Tracker's due steps at the start of each training batch (θ_t before update t).

        The Tracker must hold the module being trained (the LightningModule or the network inside
        it); the step is ``trainer.global_step`` and δ_t the first optimizer's first group's lr.
        The Tracker is closed at the end of training.
        """

        def __init__(self, tracker: Any) -> None:
            self.tracker = tracker

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            step = int(trainer.global_step)
            if self.tracker.due(step):
                self.tracker.record(step, lr=float(trainer.optimizers[0].param_groups[0]["lr"]))

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.tracker.close()

else:

    def __getattr__(name: str) -> Any:
        if name == "SpectrumCallback":
            raise MissingDependencyError(
                "nsa_dist.lightning.SpectrumCallback needs PyTorch Lightning: "
                "pip install lightning (it is not an nsa-dist dependency); "
                "without it, call tracker.due/record in your own loop"
            )
        raise AttributeError(name)
