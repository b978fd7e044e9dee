"""The Zarr spectrum store: schema (the one contract), writer, checked reader, leases, verify.

Only this package touches Zarr; everything else reads and writes through it.
"""

from nsa_dist.store.faults import describe_fault
from nsa_dist.store.lease import Lease, LeaseHeld, LeaseInfo, LeaseLost, check_holder, effective_status, parse_lease
from nsa_dist.store.records import GramStep, HessianStep, ImageStep, KernelExtras, StepResult
from nsa_dist.store.reader import Damage, RunReader, mark_damaged, verify_store
from nsa_dist.store.summary import RunSummary, run_summaries
from nsa_dist.store.schema import PHIS, SCHEMA_VERSION, RunDims, StepRecord, run_arrays, step_specs
from nsa_dist.store.zarr_store import RunWriter, SpectrumStore, Status, open_zarr_group

__all__ = ["GramStep", "HessianStep", "ImageStep", "KernelExtras", "StepResult", "PHIS", "SCHEMA_VERSION", "Damage", "Lease", "LeaseHeld", "LeaseInfo", "LeaseLost", "RunDims", "RunReader", "RunSummary",
           "RunWriter", "SpectrumStore", "Status", "StepRecord", "check_holder", "describe_fault", "effective_status",
           "mark_damaged",
           "open_zarr_group", "parse_lease", "run_arrays", "run_summaries", "step_specs", "verify_store"]
