"""The runs of an opened store, as read: their ids, groups, attributes, sizes and lease-aware status.

:class:`RunIndex` is what the checked reader, the verifier and the summaries need of a store;
:class:`~nsa_dist.store.zarr_store.SpectrumStore` adds creating the store, writing runs, leases
and sweeps on top of it.
"""

from __future__ import annotations

from typing import Any

import zarr

from nsa_dist.errors import StoreError
from nsa_dist.store.keys import METADATA_ERRORS, Keys
from nsa_dist.store.lease import LeaseInfo, effective_status, read_lease
from nsa_dist.store.schema import RunDims

__all__ = ["RunIndex", "no_such_run"]


class RunIndex:
    """The runs under ``runs/`` of the store whose keys are ``keys``.

    Args:
        keys: the opened store (:class:`~nsa_dist.store.keys.Keys`).
    """

    def __init__(self, keys: Keys) -> None:
        self.keys, self.url, self.read_only = keys, keys.url, keys.read_only

    def run_ids(self) -> list[str]:
        """Every run (a group with a zarr.json under ``runs/``), without opening any of them, and
        every run's folder that holds arrays but lost its zarr.json: listed, so that reading it
        names the missing file (a ``damaged`` row, a ``nsa verify`` line) — never a run hidden."""
        return sorted(
            k
            for k in self.keys.list_dir("runs")
            if k != "zarr.json" and (self.keys.exists(f"runs/{k}/zarr.json") or self._lost_metadata(k))
        )

    def _lost_metadata(self, run_id: str) -> bool:
        """Whether ``runs/<run_id>`` has no zarr.json but holds an array (a run is created with its
        zarr.json first, so this is damage, not a run being made)."""
        prefix = f"runs/{run_id}"
        return not self.keys.exists(f"{prefix}/zarr.json") and any(
            self.keys.exists(f"{prefix}/{c}/zarr.json") for c in self.keys.list_dir(prefix) if c != "zarr.json"
        )

    def has_run(self, run_id: str) -> bool:
        return self.keys.exists(f"runs/{run_id}/zarr.json")

    def run_path(self, run_id: str) -> str:
        return f"{self.url.rstrip('/')}/runs/{run_id}"

    def group(self, run_id: str) -> zarr.Group:
        """The run's group, opened afresh.

        Raises:
            StoreError: no such run (naming the runs there), or its zarr.json cannot be read.
        """
        if not self.has_run(run_id):
            if self._lost_metadata(run_id):
                raise StoreError(
                    f"run {run_id!r}: {self.run_path(run_id)}/zarr.json is missing (the run's folder holds its "
                    "arrays, its metadata is lost); restore the file from a copy, or delete the run's folder "
                    "and re-run it"
                )
            raise no_such_run(run_id, self.url, self.run_ids())
        try:
            return zarr.open_group(store=self.keys.zarr, path=f"runs/{run_id}", mode="r" if self.read_only else "r+")
        except METADATA_ERRORS as exc:
            raise StoreError(
                f"run {run_id!r}: {self.run_path(run_id)}/zarr.json is unreadable ({type(exc).__name__}: {exc})"
            ) from exc

    def run_attrs(self, run_id: str) -> dict[str, Any]:
        """The run's attributes, read afresh."""
        return self.group(run_id).attrs.asdict()

    def run_status(self, run_id: str, attrs: dict | None = None) -> tuple[str | None, str | None]:
        """(status, reason) as it is now: a ``running`` run whose lease expired is ``interrupted``."""
        a = attrs if attrs is not None else self.run_attrs(run_id)
        return effective_status(
            a.get("status"), a.get("reason"), self.lease_info(run_id), creating=bool(a.get("creating"))
        )

    def dims(self, run_id: str) -> RunDims:
        """The run's array sizes as stored when it was created."""
        a = self.run_attrs(run_id)
        if "dims" not in a:
            raise StoreError(f"run {run_id!r}: {self.run_path(run_id)}/zarr.json has no 'dims' attribute")
        return RunDims.from_json(a["dims"])

    def lease_info(self, run_id: str) -> LeaseInfo | None:
        """The run's lease as last written, or None."""
        return read_lease(self.keys, run_id)

    def creation_live(self, run_id: str) -> bool:
        """Whether a live writer (fresh lease) may still be creating run ``run_id``."""
        info = self.lease_info(run_id)
        return info is not None and info.fresh()


def no_such_run(run_id: str, url: str, ids: list[str]) -> StoreError:
    """The error for a run id the store does not hold: the ids closest to it first (a misspelt
    name finds its run among hundreds), at most ten, and how many there are."""
    import difflib

    names = {i: i.rsplit("-", 1)[0] for i in ids}  # "quickstart-596f17d55e" is the run named "quickstart"
    close = [i for i in ids if difflib.get_close_matches(run_id, [i, names[i]], n=1, cutoff=0.75)]
    shown = (close + [i for i in ids if i not in close])[:10]
    more = f" … ({len(ids)} in all)" if len(ids) > len(shown) else ""
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return StoreError(f"no run {run_id!r} in {url!r} (runs: {', '.join(shown) or 'none'}{more}){hint}")
