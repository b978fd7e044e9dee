"""The run pipeline as plain classes: Trainer → SpectralAnalyzer → RunWriter (no Ray here)."""

from nsa_dist.pipeline.checkpoint import Checkpoint, TrainerState
from nsa_dist.pipeline.model_state import ModelState
from nsa_dist.pipeline.runner import (PreparedRun, RunOutcome, finish_run, prepare_run, run_dims, run_experiment,
                                      run_id, spec_json)
from nsa_dist.pipeline.spectral import SpectralAnalyzer, energy_curve
from nsa_dist.pipeline.trainer import Trainer, TrainingDiverged

__all__ = ["Checkpoint", "TrainerState", "ModelState", "PreparedRun", "RunOutcome", "finish_run", "prepare_run", "run_dims", "run_experiment", "run_id", "spec_json",
           "SpectralAnalyzer", "energy_curve", "Trainer", "TrainingDiverged"]
