"""The run pipeline as plain classes: spec → RunPlan → Trainer → SpectralAnalyzer → StepResult → RunWriter.

Owns: planning a run (:mod:`~nsa_dist.pipeline.plan`), training, one recorded step's analysis
(the Gram's spectrum and metrics, kernel extras, the Hessian step, images), the gang layouts'
operators and shards, the per-run roles as idempotent plain classes (``services``, ``tracked``)
a run's life as its writer (``session``: lease, create or reopen, statuses, post-run arrays), a
run's materials loaded once per process (``materials``: its data, its network, the inputs and the
eigenvector renderer), a tracked run's model side and driver side (``snapshot``, ``tracked_run``)
and the single-process composition (``runner``).

May import: config, errors, losses, models, data, ntk, linalg, metrics, hessian and store (their
public names).  Never Ray — the cluster layer wraps these classes as actors — and never the
client, cluster, plots or serve packages.
"""

from nsa_dist.pipeline.checkpoint import Checkpoint, TrainerState
from nsa_dist.pipeline.model_state import ModelState
from nsa_dist.pipeline.plan import RunPlan, plan_run, run_id, spec_json
from nsa_dist.pipeline.runner import RunOutcome, run_experiment
from nsa_dist.pipeline.session import PreparedRun, RunSession, finish_run, prepare_run
from nsa_dist.pipeline.spectral import SpectralAnalyzer
from nsa_dist.pipeline.trainer import Trainer, TrainingDiverged

__all__ = [
    "Checkpoint",
    "TrainerState",
    "ModelState",
    "PreparedRun",
    "RunOutcome",
    "RunSession",
    "finish_run",
    "prepare_run",
    "run_experiment",
    "RunPlan",
    "plan_run",
    "run_id",
    "spec_json",
    "SpectralAnalyzer",
    "Trainer",
    "TrainingDiverged",
]
