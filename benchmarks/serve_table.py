"""How fast ``nsa serve`` lists a store of hundreds of runs (issue 21).  Run:
``python benchmarks/serve_table.py [--runs 300] [--steps 6]``.

One small run is recorded, then copied ``--runs`` times on disk (a copy is a valid run: its id is
its directory's name), so that the store is made in seconds.  Timed, each in this process:

* baseline: the same row read through one checked :class:`RunReader` per run, in turn (as
  ``Client.runs()`` did before issue 21, plus the last step's loss and λ_max);
* ``run_summaries(steps=False)``: the table's first listing (each run's zarr.json and lease);
* ``run_summaries()``: every row with its step columns (progress, loss, λ_max), gathered at once;
* ``RunTable.refresh()`` a second time: what a page's periodic refresh re-reads when no run is live.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nsa_dist.config import ExperimentSpec  # noqa: E402
from nsa_dist.pipeline import run_experiment  # noqa: E402
from nsa_dist.serve.table import RunTable  # noqa: E402
from nsa_dist.store import SpectrumStore, run_summaries  # noqa: E402


def _store(root: Path, runs: int, steps: int) -> str:
    url = str(root / "many.zarr")
    spec = ExperimentSpec(
        name="r0", data={"n": 16}, model={"depth": 2, "width": 8}, steps=steps, record={"every": 1}, spectrum={"k": 4}
    )
    rid = run_experiment(spec, SpectrumStore(url)).run_id
    for i in range(1, runs):
        shutil.copytree(Path(url) / "runs" / rid, Path(url) / "runs" / f"r{i:04d}")
    return url


def _baseline(store: SpectrumStore) -> int:
    """The rows through a checked reader per run, in turn."""
    n = 0
    for rid in store.run_ids():
        r = store.reader(rid)
        r.status()
        r.read("steps")
        last = int(r.done.nonzero()[0][-1])
        r.read_step("loss", last)
        r.read_step("eigenvalues", last)
        n += int(r.done.sum())
    return n


def _timed(what: str, fn, base: float | None = None) -> float:
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    ratio = f"  ({base / dt:.1f}x faster than the baseline)" if base else ""
    print(f"{what:<48} {dt * 1000:8.0f} ms{ratio}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--steps", type=int, default=6, help="recorded steps per run (each is one `done` chunk)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = _store(Path(tmp), args.runs, args.steps)
        store = SpectrumStore(url, mode="r")
        print(f"{args.runs} runs of {args.steps} recorded steps in {url}")
        base = _timed("baseline: a checked reader per run, in turn", lambda: _baseline(store))
        _timed("first listing: run_summaries(steps=False)", lambda: run_summaries(store, steps=False), base)
        _timed("every step column: run_summaries()", lambda: run_summaries(store), base)
        table = RunTable(store)
        _timed("RunTable.refresh(), first", table.refresh, base)
        _timed("RunTable.refresh(), again (no live run)", table.refresh, base)


if __name__ == "__main__":
    main()
