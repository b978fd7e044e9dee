"""``Client``: a read-only spectrum store — its runs, its sweeps, ``verify``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nsa_dist.client._arrays import flag
from nsa_dist.client._frames import runs_frame
from nsa_dist.client._run import Run
from nsa_dist.client._sweep import Sweep
from nsa_dist.errors import StoreError
from nsa_dist.store import SpectrumStore, mark_damaged, verify_store
from nsa_dist.store.runs import no_such_run

if TYPE_CHECKING:
    import pandas

__all__ = ["Client"]


class Client:
    """Reads a spectrum store at a local path or fsspec URL (``memory://``, ``s3://``, …)."""

    def __init__(self, url: str = "nsa-results.zarr") -> None:
        self.url = url
        self.store = SpectrumStore(url, mode="r")

    @classmethod
    def of(cls, store: SpectrumStore) -> Client:
        """A client of a store opened already (``nsa serve`` holds one for all its pages)."""
        c = cls.__new__(cls)
        c.url, c.store = store.url, store
        return c

    def runs(self, sweep: str | None = None, **where: Any) -> pandas.DataFrame:
        """Every run (or a sweep's) as a DataFrame: id, sweep, status, reason, steps_done,
        steps_total, last_step, data_fingerprint and each spec field as a dotted column ("model.depth", …).

        ``where`` filters on equality, dots written "__": ``runs(model__depth=6)``.  Needs pandas.
        """
        return runs_frame(self.store, sweep, **where)

    def sweeps(self) -> list[str]:
        """Names of the sweeps recorded in the store."""
        return sorted(self.store.sweeps())

    def sweep(self, name: str) -> Sweep:
        """The runs of sweep ``name`` with its grid (:class:`~nsa_dist.client.Sweep`).

        Raises:
            KeyError: no sweep ``name`` (the known ones are named).
        """
        return Sweep(self.store, name)

    def _name_of(self, rid: str) -> str | None:
        try:
            spec = self.store.run_attrs(rid).get("spec")
        except StoreError:
            return None  # a damaged run: never matched by name
        return spec.get("name") if isinstance(spec, dict) else None  # garbage there: damage, named when read

    def verify(self, mark: bool = False) -> list:
        """Every damaged chunk or metadata file of the store (:func:`nsa_dist.store.verify_store`);
        ``mark``: delete the damaged chunks and mark their steps not done (needs a writable store)."""
        mark = flag(mark, "mark")
        damage = verify_store(self.store)
        if mark and damage:
            mark_damaged(SpectrumStore(self.url), damage)
        return damage

    def run(self, run_id: str) -> Run:
        """A run by its id, else by its name when exactly one run has it, else by a unique id prefix.

        Raises:
            StoreError: no run matches, or several do (the candidates are named).
        """
        if not isinstance(run_id, str):  # None, 123: a TypeError from str.startswith (an audit)
            raise StoreError(f"a run is named by its id or name, a string (`nsa ls` lists them); got {run_id!r}")
        ids = self.store.run_ids()
        if run_id in ids:
            return Run(self.store, run_id)
        hits = [r for r in ids if r.startswith(run_id)]
        # a run's id is its name with the spec's hash ("tiny-454f55d50e"): its name is a prefix of it
        named = [r for r in hits or ids if self._name_of(r) == run_id]
        if len(named) == 1:
            return Run(self.store, named[0])
        hits = named or hits
        if len(hits) == 1:
            return Run(self.store, hits[0])
        if not hits:
            raise no_such_run(run_id, self.url, ids)
        what = "runs are named" if named else "run ids start with"
        more = f" … ({len(hits)} in all)" if len(hits) > 10 else ""
        sweep = (
            f" ({run_id!r} is a sweep: `nsa plot --sweep {run_id}`, Client(…).sweep({run_id!r}) read it whole)"
            if run_id in self.store.sweeps()
            else ""
        )
        raise StoreError(f"{len(hits)} {what} {run_id!r}: {', '.join(hits[:10])}{more}; give the full id{sweep}")
