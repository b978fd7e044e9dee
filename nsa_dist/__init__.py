"""nsa-dist: NTK and loss-Hessian spectra during training (see README.md).

The front door re-exports the names most sessions need; the subpackages hold the rest.
"""

from nsa_dist.client import Client, Run
from nsa_dist.config import ExperimentSpec, ModelSpec, SweepSpec
from nsa_dist.models import build_model
from nsa_dist.tracker import Tracker

__all__ = ["Client", "ExperimentSpec", "ModelSpec", "Run", "SweepSpec", "build_model", "Tracker", "__version__"]
__version__ = "0.1.0"
