"""The Zarr spectrum store: schema (the one contract), writer, checked reader, leases, verify.

Owns: everything under a store URL (local path, ``memory://``, ``s3://`` …) — the layout of a
run (:mod:`.schema`: sizes in :mod:`.dims`, the per-step arrays defined by the step records of
:mod:`.records`), a run's status (:mod:`.status`), opening a URL and the raw key operations
(:mod:`.keys`), writer leases and fencing (:mod:`.lease`; on a local store each fenced put a rename
out of a revocable write folder, :mod:`.fencing`, and lease writes under a lock file, :mod:`.locks`),
the runs as read (:mod:`.runs`), checked
reads (:mod:`.reader`), creating and writing runs (:mod:`.zarr_store`), ``nsa verify`` and its
repair through the writer (:mod:`.verify`), one-line summaries (:mod:`.summary`) and naming a
store's outside faults (:mod:`.faults`).  Only this package touches Zarr; everything else reads
and writes through it.

May import: numpy, zarr, :mod:`nsa_dist.errors`, :mod:`nsa_dist._fsspec`, ``_faults``, and
:mod:`nsa_dist.metrics` (the schema sizes the reconstruction arrays) — nothing of the pipeline,
the cluster or the client.  Inside, the modules import downwards only, never in a circle:
``status``, ``keys``, ``locks`` ← ``lease`` ← ``fencing`` ← ``runs`` ← ``reader`` ← ``zarr_store`` ← ``verify``
(``dims`` ← ``records`` ← ``schema`` beside them; ``summary`` and ``faults`` on top); only ``keys`` calls the Zarr
store's key API, and ``fencing`` implements it (the fenced writer's local store).

Example — a store round trip in a temporary folder: a tiny run written by the pipeline, listed,
read through the checked reader and verified::

>>> import tempfile
>>> from nsa_dist.config import ExperimentSpec
>>> from nsa_dist.pipeline import run_experiment
>>> from nsa_dist.store import SpectrumStore, run_summaries, verify_store
>>> folder = tempfile.TemporaryDirectory()
>>> store = SpectrumStore(f"{folder.name}/runs.zarr")
>>> spec = ExperimentSpec.model_validate({"name": "tiny", "data": {"n": 16}, "model": {"depth": 2, "width": 8},
...                                       "steps": 3, "record": {"every": 2}, "spectrum": {"k": 4, "images": []}})
>>> out = run_experiment(spec, store)                     # the writer: create, write every step, finish
>>> [(s.id == out.run_id, s.status) for s in run_summaries(store, store.run_ids())]
[(True, 'done')]
>>> r = store.reader(out.run_id)                          # the checked reader
>>> r.read("eigenvalues").shape                           # (recorded steps, k)
(2, 4)
>>> verify_store(store)                                   # every chunk checked: nothing damaged
[]
>>> folder.cleanup()
"""

from nsa_dist.store.faults import describe_fault
from nsa_dist.store.keys import Keys, open_zarr_group
from nsa_dist.store.lease import (
    Lease,
    LeaseHeld,
    LeaseInfo,
    LeaseLost,
    RunRefused,
    check_holder,
    effective_status,
    parse_lease,
)
from nsa_dist.store.reader import RunReader
from nsa_dist.store.records import GramStep, HessianStep, ImageStep, KernelExtras, StepResult
from nsa_dist.store.schema import PHIS, SCHEMA_VERSION, RunDims, StepRecord, run_arrays, step_specs
from nsa_dist.store.status import Status
from nsa_dist.store.summary import RunSummary, run_summaries
from nsa_dist.store.verify import Damage, mark_damaged, verify_store
from nsa_dist.store.zarr_store import RunWriter, SpectrumStore

__all__ = [
    "GramStep",
    "HessianStep",
    "ImageStep",
    "KernelExtras",
    "StepResult",
    "PHIS",
    "SCHEMA_VERSION",
    "Damage",
    "Keys",
    "Lease",
    "LeaseHeld",
    "LeaseInfo",
    "LeaseLost",
    "RunRefused",
    "RunDims",
    "RunReader",
    "RunSummary",
    "RunWriter",
    "SpectrumStore",
    "Status",
    "StepRecord",
    "check_holder",
    "describe_fault",
    "effective_status",
    "mark_damaged",
    "open_zarr_group",
    "parse_lease",
    "run_arrays",
    "run_summaries",
    "step_specs",
    "verify_store",
]
