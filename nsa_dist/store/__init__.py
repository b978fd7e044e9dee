"""The Zarr spectrum store: schema, writer (pipeline side) and group access (client side)."""

from nsa_dist.store.schema import PHIS, SCHEMA_VERSION, RunDims, run_arrays
from nsa_dist.store.zarr_store import RunWriter, SpectrumStore, Status, open_zarr_group

__all__ = ["PHIS", "SCHEMA_VERSION", "RunDims", "RunWriter", "SpectrumStore", "Status", "open_zarr_group", "run_arrays"]
