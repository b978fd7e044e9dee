"""A submitted sweep's local data files, shipped with the job in its Ray ``working_dir``.

Every run's local ``data.path`` (relative to the submitting directory, or absolute) is resolved
and the files its loader reads are copied into the job's working directory, which Ray unpacks on
every node and makes the workers' current directory.  A relative path that stays inside the
submitting directory keeps its place (``data/mnist`` → ``<working_dir>/data/mnist``), so the
job's specs — and run ids — are the ones a local ``nsa sweep`` would compute; an absolute or
escaping one (``/data/x.png``, ``../mnist``) is copied to ``_nsa_data/<digest>/<name>`` — the
folder named by the files' content, so one file travels under one name whatever its place in the
sweep (the run keeps its id from job to job) and two files of one name never share it — and the
sweep the job gets says so.  URLs (``s3://``, ``gs://``, ``file://`` for a filesystem every node mounts) are
read by the nodes themselves and are left as they are.

Ray refuses a working_dir over ~500 MiB, and every job upload is held in the head's object
store, so at most ``SHIP_LIMIT_BYTES`` travel; more is refused at submission, naming the
largest file and the ``s3://`` alternative.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nsa_dist.data import Location

__all__ = ["SHIP_LIMIT_BYTES", "SHIPPED_DIR", "prepare_job_data"]

SHIP_LIMIT_BYTES = 100 * 2**20  # data shipped with one job; Ray's working_dir limit is ~500 MiB
SHIPPED_DIR = "_nsa_data"  # where absolute / escaping data paths are copied inside the working_dir
_TAKEN = {"sweep.yaml", "services", SHIPPED_DIR}  # names the job's working_dir already uses


def _digest(files: list[Location], single: bool) -> str:
    """16 hex digits of SHA-256 over ``files``' contents (and, for a folder's files, their names):
    the folder an absolute or escaping data path travels in.  Its position in the sweep named it
    before (``_nsa_data/0/face.png``): a second job with another data path first gave the same file
    another name, so another run id — its run computed again — and a different ``face.png`` at the
    old place clashed with the stored run ("created from other data", an audit)."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: Path(f).name):
        if not single:
            h.update(Path(f).name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _target(path: str, key: Callable[[], str]) -> tuple[str, str | None]:
    """Where ``path``'s data go inside the working_dir, and the ``data.path`` the job's sweep names
    them by: the same relative path when it stays inside the submitting directory (and clear of the
    job's own files), else ``_nsa_data/<key()>/<name>`` (``key``: :func:`_digest`, read only for a path
    that moves).  With ``path`` kept, the second value is None.

    A relative path is kept as written (``./data/x.png``, ``data//mnist/``, ``sub/../data``: the
    same place once copied, :func:`_dirs_for` making the directories a ``..`` steps out of), so the
    job's run ids are the ones a local ``nsa sweep`` computes."""
    norm = os.path.normpath(path)
    first = norm.split(os.sep, 1)[0]
    named = set(Path(path).parts) | {first}
    if not os.path.isabs(norm) and first not in ("..", ".") and not named & _TAKEN:
        return Path(norm).as_posix(), None
    dest = f"{SHIPPED_DIR}/{key()}/{Path(os.path.abspath(norm)).name}"
    return dest, dest


def _dirs_for(path: str) -> list[str]:
    """The directories (relative, normalised) a kept relative ``path`` steps out of with ``..``:
    they must exist in the working_dir for the path to resolve there as it does here."""
    parts = Path(path).parts
    out = [os.path.normpath(os.path.join(*parts[:k])) for k, part in enumerate(parts) if part == ".." and k]
    return [d for d in out if d != "."]


def _rewrite(obj: Any, moved: dict[str, str]) -> Any:
    """``obj`` (a sweep as plain data) with every string equal to a moved path replaced; the caller
    checks that only ``data.path`` changed."""
    if isinstance(obj, dict):
        return {k: _rewrite(v, moved) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rewrite(v, moved) for v in obj]
    return moved.get(obj, obj) if isinstance(obj, str) else obj


def _check_only_paths_moved(old: Any, new: Any, moved: dict[str, str]) -> None:
    """Every run of the rewritten sweep is the original run with ``data.path`` moved (names aside).

    Raises:
        RuntimeError: a rewrite touched anything else (a field whose value equals a data path).
    """
    runs, shipped = old.expand(), new.expand()
    if len(runs) != len(shipped):
        raise RuntimeError(
            f"shipping the data made {len(runs)} runs into {len(shipped)} (two data paths became one); "
            "submit with the data in a bucket (data.path: s3://…) instead"
        )
    for a, b in zip(runs, shipped, strict=True):
        want = a.model_copy(update={"data": a.data.model_copy(update={"path": moved.get(a.data.path, a.data.path)})})
        if want.model_dump(exclude={"name"}) != b.model_dump(exclude={"name"}):
            raise RuntimeError(
                f"shipping the data of run {a.name!r} changed more than data.path; submit with the "
                "data in a bucket (data.path: s3://…) instead"
            )


def prepare_job_data(
    sweep_file: str | Path, work: Path, limit: int = SHIP_LIMIT_BYTES, *, max_runs: int | None = None
) -> dict[str, Any]:
    """Copy the sweep's local data files into ``work`` and return the sweep the job gets.

    Args:
        sweep_file: the sweep (or experiment) YAML; relative data paths are relative to the
            current directory, as for ``nsa run`` / ``nsa sweep``.
        work: the job's working_dir being assembled.
        limit: the most bytes of data that may travel with the job.
        max_runs: the sweep's run limit as ``nsa submit --max-runs`` raised it (None: the default).

    Returns:
        the sweep as plain data (write it as the job's ``sweep.yaml``), data paths rewritten where
        they moved.

    Raises:
        SpecError: a data file is missing / not a readable regular file, or the files exceed
            ``limit`` — one line naming the file, its size and the ``s3://`` alternative.
    """
    from nsa_dist.config import SweepSpec
    from nsa_dist.specfile import SpecError, check_data, load_sweep

    sweep = load_sweep(sweep_file, max_runs=max_runs)
    files = check_data(sweep.expand(), sweep_file, urls=False)  # data.path → its files, local only
    sizes = {os.path.realpath(f): os.stat(f).st_size for fs in files.values() for f in fs}
    total = sum(sizes.values())
    if total > limit:
        big = max(sizes, key=sizes.__getitem__)
        raise SpecError(
            f"{sweep_file}: the data files come to {total / 2**20:.1f} MiB, over the "
            f"{limit / 2**20:.0f} MiB that travel with a job (largest {big!r}, {sizes[big] / 2**20:.1f} "
            "MiB); put the data in a bucket and set data.path: s3://BUCKET/PREFIX (or a file:// path "
            "every node mounts)"
        )
    moved: dict[str, str] = {}
    placed: dict[str, str] = {}  # each file written into work → the real file it copies
    for path, found in files.items():
        single = os.path.isfile(path)  # an image: the path is the file; else a directory of files
        target, named = _target(path, lambda found=found, single=single: _digest(found, single))

        def where(t: str, f: Location, single: bool = single) -> str:
            return t if single else f"{t}/{Path(f).name}"

        if any(placed.get(where(target, f), os.path.realpath(f)) != os.path.realpath(f) for f in found):
            # another data.path normalises to the same place but names other files (``link/..``
            # through a symlink): this one moves, so neither run reads the other's data
            target = named = f"{SHIPPED_DIR}/{_digest(found, single)}/{Path(os.path.abspath(path)).name}"
        if named is not None:
            moved[path] = named
        else:
            for d in _dirs_for(path):
                (work / d).mkdir(parents=True, exist_ok=True)
        for f in found:
            placed[where(target, f)] = os.path.realpath(f)
            dest = work / where(target, f)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
    raw = sweep.model_dump(mode="json")
    if moved:
        raw = _rewrite(raw, moved)
        _check_only_paths_moved(sweep, SweepSpec.model_validate(raw, context={"max_runs": max_runs}), moved)
    return raw
