"""``nsa verify``: every damaged chunk or metadata file of a store, and its repair through the writer.

A recorded step is ``done`` only after every chunk it writes is stored, so a done step whose
chunk is missing, or whose chunk fails its CRC32C checksum / zstd frame, is damage.
:func:`verify_store` lists it; :func:`mark_damaged` has each run's writer (holding the run's
lease) forget the damaged steps (:meth:`~nsa_dist.store.zarr_store.RunWriter.forget_steps`), so
that a re-run recomputes exactly those steps and keeps everything else.

A run's or an array's folder that is a symbolic link (it holds the metadata, so it is not just
removed like a linked chunk) is replaced by a real folder: a copy of what the link points to
(the target is only read, never written through), verified like any folder afterwards.  A link
to nothing recoverable (dangling, or to a folder without a ``zarr.json``) is removed: a run's
folder — the run is gone and a re-run creates it anew; an array's folder — the array is created
empty and the whole run marked for recomputation from scratch.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from nsa_dist.errors import StoreError
from nsa_dist.store.fencing import RunFence
from nsa_dist.store.reader import RunReader, chunk_grid, chunk_problem, chunk_selection, covering
from nsa_dist.store.runs import RunIndex
from nsa_dist.store.status import STORED_STATUSES
from nsa_dist.store.zarr_store import SpectrumStore

__all__ = ["Damage", "mark_damaged", "verify_run", "verify_store"]


@dataclass(frozen=True)
class Damage:
    """One damaged piece of a store: the run, the array ('' for the run's own metadata), the
    recorded step index (None: not a per-step chunk), the file and what is wrong."""

    run_id: str
    array: str
    index: int | None
    step: int | None
    path: str
    problem: str
    key: str | None = None  # the chunk's store key (to delete), None for metadata
    unfinished: bool = False  # not damage: a creation interrupted before its arrays were made, or an array
    # added to the schema after the run was recorded (a re-run ends it)
    stray: bool = False  # an entry of the wrong kind no recorded step needs: removed, nothing recomputed
    link: bool = False  # ``path`` is a run's or an array's folder that is a symbolic link: replaced by a copy
    post_run: bool = False  # in an array written after the last step (preservation …): --mark removes the
    # array (``key``: its folder) and the re-run writes it anew; no step is recomputed
    remade: bool = False  # an array whose folder is gone (--mark makes it anew, empty: its steps recomputed)
    # or a ``status`` attribute that is no status (--mark sets it ``pending``)

    @property
    def metadata(self) -> bool:
        """A damaged zarr.json, which --mark cannot repair (restore it from a copy, or delete the run)."""
        return self.key is None and self.index is None and not self.link and not self.remade

    @classmethod
    def of_run(cls, run_id: str, path: str, problem: str, **flags: bool) -> Damage:
        """Damage of the run itself (its folder or its zarr.json), not of one of its arrays."""
        return cls(run_id, "", None, None, path, problem, **flags)

    def __str__(self) -> str:
        at = f" step {self.step} (index {self.index})" if self.index is not None else ""
        return f"{self.run_id}: {self.array or '(run metadata)'}{at}: {self.problem} — {self.path}"


def verify_run(store: RunIndex, run_id: str) -> list[Damage]:
    """Every damaged chunk or metadata file of one run."""
    try:
        r = RunReader(store, run_id, tolerant=True)  # a damaged `done` chunk is named below, per step
    except StoreError as exc:
        folder = _linked(store, run_id)
        return [
            Damage.of_run(run_id, folder or f"{store.run_path(run_id)}/zarr.json", str(exc), link=folder is not None)
        ]
    status, odd = r.attrs.get("status"), []
    if status is not None and status not in STORED_STATUSES:  # listed as it was ('12345' in `nsa ls`); the
        # run's other damage is checked too (returned alone, it hid a missing chunk that --mark then kept)
        odd = [
            Damage.of_run(
                run_id,
                f"{r.path}/zarr.json",
                f"its status attribute holds {status!r}, no status ({', '.join(STORED_STATUSES)}); --mark sets it "
                "'pending' and a re-run resumes the run from its finished steps",
                remade=True,
            )
        ]
    if r.attrs.get("creating"):  # no step can be recorded yet: nothing to check, nothing damaged
        if store.creation_live(run_id):
            return odd
        return odd + [
            Damage.of_run(
                run_id,
                f"{r.path}/zarr.json",
                "its creation was interrupted (its writer "
                "stopped before making every array); re-run it (nsa run / nsa sweep) to finish creating it",
                unfinished=True,
            )
        ]
    out: list[Damage] = list(odd)
    steps = None
    for name, a in r.specs.items():
        try:
            arr = r.array(name)
        except StoreError as exc:
            folder = _linked(store, run_id, name)
            older = folder is None and "recorded by an earlier nsa-dist" in str(exc)  # not damage: a re-run adds it
            gone = folder is None and not older and not store.keys.list_dir(f"runs/{run_id}/{name}")
            again = "every recorded step" if a.per_step or name == "loss_trace" else "the array"
            out.append(
                Damage(
                    run_id,
                    name,
                    None,
                    None,
                    folder or f"{r.path}/{name}/zarr.json",
                    f"run {run_id!r}: array {name!r} is missing (its folder is gone); --mark makes it anew, empty, "
                    f"and a re-run recomputes {again}"
                    if gone
                    else str(exc),
                    link=folder is not None,
                    unfinished=older,
                    remade=gone,
                )
            )
            continue
        if tuple(arr.shape) != tuple(a.shape):  # metadata edited or from another run: every read fails or lies
            out.append(
                Damage(
                    run_id,
                    name,
                    None,
                    None,
                    f"{r.path}/{name}/zarr.json",
                    f"run {run_id!r}: array {name!r}'s metadata says shape {tuple(arr.shape)}, the run's dims say "
                    f"{tuple(a.shape)}",
                )
            )
            continue
        wrong, used = r.wrong_kinds(name), set()

        def wrong_kind(key: str, i: int | None) -> bool:
            hit = covering(wrong, key)
            if hit is not None and (hit, i) not in used:
                used.add((hit, i))
                out.append(
                    Damage(run_id, name, i, None, f"{r.path}/{name}/{hit}", wrong[hit], f"runs/{run_id}/{name}/{hit}")
                )
            return hit is not None

        if not a.per_step:
            for key in r.missing_static_keys(name):  # read as its fill value: wrong numbers
                if covering(wrong, key) is not None:
                    continue  # an entry of the wrong kind there: named as such below
                out.append(
                    Damage(
                        run_id,
                        name,
                        None,
                        None,
                        f"{r.path}/{name}/{key}",
                        "chunk missing (the losses of steps the run trained)"
                        if name == "loss_trace"
                        else "chunk missing (the array is written whole when the run is created)",
                        f"runs/{run_id}/{name}/{key}",
                    )
                )
            for c in chunk_grid(arr):
                key = arr.metadata.encode_chunk_key(c)
                if wrong_kind(key, None):
                    continue
                problem = chunk_problem(arr, chunk_selection(arr, c))
                if problem:
                    out.append(
                        Damage(
                            run_id, name, None, None, f"{r.path}/{name}/{key}", problem, f"runs/{run_id}/{name}/{key}"
                        )
                    )
            if name == "steps" and not any(d.array == "steps" for d in out):
                steps = r.read("steps")
        else:
            want = r.expected(name) if name != "done" else np.ones(len(r.done), bool)
            present = r.present_chunks(name)
            flag_lost = _flag_must_exist(r) if name == "done" else None
            for i in np.flatnonzero(want):
                for c in r.step_chunks(name, int(i)):
                    key = arr.metadata.encode_chunk_key(c)
                    if wrong_kind(key, int(i)):
                        continue
                    if key not in present:
                        if flag_lost is None or flag_lost[i]:
                            out.append(
                                Damage(
                                    run_id,
                                    name,
                                    int(i),
                                    None,
                                    f"{r.path}/{name}/{key}",
                                    "chunk missing (the step is marked done)"
                                    if flag_lost is None
                                    else "chunk missing where the step's done flag was written (the run is finished, "
                                    "or a later step is done): the step's results are hidden from every reader, and "
                                    "--mark has a re-run compute it again",
                                    None,
                                )
                            )
                        continue
                    problem = chunk_problem(arr, chunk_selection(arr, c))
                    if problem:
                        out.append(
                            Damage(
                                run_id,
                                name,
                                int(i),
                                None,
                                f"{r.path}/{name}/{key}",
                                problem,
                                f"runs/{run_id}/{name}/{key}",
                            )
                        )
        for hit in sorted(set(wrong) - {h for h, _ in used}):  # at a step not done, or stray: removed only
            out.append(
                Damage(
                    run_id,
                    name,
                    None,
                    None,
                    f"{r.path}/{name}/{hit}",
                    wrong[hit],
                    f"runs/{run_id}/{name}/{hit}",
                    stray=True,
                )
            )
    out += _verify_post_run(r)
    if steps is not None:
        out = [replace(d, step=int(steps[d.index]) if d.index is not None else None) for d in out]
    return out


def _flag_must_exist(r: RunReader) -> np.ndarray:
    """Per recorded step, whether its ``done`` chunk must be stored: every step of a finished run,
    and every step before a later done one (steps are recorded in order, and a step forgotten by
    ``--mark`` has its flag written False).  Elsewhere a missing flag is a step not yet done."""
    if r.status()[0] == "done":
        return np.ones(len(r.done), bool)
    return np.cumsum(r.done[::-1])[::-1] - r.done > 0


def _verify_post_run(r: RunReader) -> list[Damage]:
    """The arrays written after a run's last step (``preservation``, ``constant_gram_*``: not in
    the schema, each written whole): unreadable metadata, a chunk missing, of the wrong kind or
    failing its checksum.  Each damaged array is one Damage whose key is the array's folder:
    ``--mark`` removes the array, and the re-run of the finished run writes it anew."""
    out: list[Damage] = []
    folder = lambda n: f"runs/{r.id}/{n}"  # noqa: E731
    for name in r.names():
        if name in r.specs:
            continue
        try:
            arr = r.array(name)
        except StoreError as exc:
            out.append(
                Damage(r.id, name, None, None, f"{r.path}/{name}/zarr.json", str(exc), folder(name), post_run=True)
            )
            continue
        wrong, present = r.wrong_kinds(name), r.present_chunks(name)
        for c in chunk_grid(arr):
            key = arr.metadata.encode_chunk_key(c)
            hit = covering(wrong, key)
            if hit is not None:
                problem, key = wrong[hit], hit
            elif key not in present:
                problem = "chunk missing (the array is written whole after the last step)"
            else:
                problem = chunk_problem(arr, chunk_selection(arr, c))
            if problem:
                out.append(
                    Damage(r.id, name, None, None, f"{r.path}/{name}/{key}", problem, folder(name), post_run=True)
                )
                break  # the array is removed whole: one line for it
    return out


def _linked(store: RunIndex, run_id: str, name: str | None = None) -> str | None:
    """The run's (or its array ``name``'s) folder when it is a symbolic link on a local store, else None."""
    if not store.keys.local:
        return None
    folder = os.path.join(store.keys.path, "runs", run_id, *([name] if name else []))
    return folder if os.path.islink(folder) else None


def verify_store(store: RunIndex, run_ids: list[str] | None = None) -> list[Damage]:
    """Every damaged piece of every run (or of ``run_ids``), and one ``unfinished`` entry for each
    run whose creation was interrupted (not damage: a plain re-run finishes it).  On a local
    store, a run's folder that is a symbolic link to nothing usable (no run to list) is named too."""
    ids = run_ids if run_ids is not None else store.run_ids()
    out = [d for rid in ids for d in verify_run(store, rid)]
    runs = os.path.join(store.keys.path, "runs") if store.keys.local else None
    if run_ids is None and runs is not None and os.path.isdir(runs):
        for e in sorted(os.scandir(runs), key=lambda e: e.name):
            if e.is_symlink() and e.name not in ids:
                out.append(
                    Damage.of_run(
                        e.name,
                        e.path,
                        f"the run's folder is a symbolic link (to "
                        f"{os.readlink(e.path)}) to no run's folder; --mark removes the link and a re-run "
                        "creates the run anew",
                        link=True,
                    )
                )
    return out


def mark_damaged(
    store: SpectrumStore, damage: list[Damage], *, wait: float | None = 0.0
) -> dict[str, list[int] | None]:
    """Have each damaged run's writer forget its damaged steps, so that a re-run recomputes them.

    The runs' leases are taken first (a run a live writer holds is refused: :class:`LeaseHeld`),
    then each run's writer, fenced by the lease, marks the run ``pending``, its damaged steps not
    done and deletes the damaged chunks (:meth:`RunWriter.forget_steps`).  A damaged static array
    is rewritten on the next run; a damaged ``loss_trace`` chunk makes the re-run train again from
    the recorded step before it.  A run whose creation was interrupted (``unfinished``) is left as
    it is: a plain re-run finishes it.

    A run's or an array's folder that is a symbolic link (``link``) is first replaced by a real
    folder holding a copy of the link's target (copied into the writer's fenced write folder, then
    renamed into the link's place; the target is only read), and the run verified again like any
    other: what the copy lacks or holds damaged is marked as above.  A link to nothing
    recoverable (dangling, or to a folder without a ``zarr.json``) is removed: for a run's folder
    the run is gone (a re-run creates it anew; its value here is None), for an array's folder the
    array is created empty and every step of the run marked not done (recomputed from scratch).

    Args:
        store: the store, opened writable.
        damage: what :func:`verify_store` found.
        wait: seconds to wait for another writer's lease (as :meth:`SpectrumStore.lease`).

    Returns:
        Run id → the step indices marked not done (None: the run was removed, a re-run makes it anew).

    Raises:
        StoreError: damaged metadata (a zarr.json) cannot be repaired here (naming each file).
        LeaseHeld: a live writer holds one of the runs.
    """
    damage = [d for d in damage if not d.unfinished]
    meta = [d for d in damage if d.metadata]
    if meta:
        raise StoreError(
            "cannot repair damaged metadata (restore it, or delete the run and re-run): "
            + "; ".join(f"{d.path}" for d in meta)
        )
    rids = sorted({d.run_id for d in damage})
    if not rids:
        return {}
    marked: dict[str, list[int] | None] = {}
    with store.lease(rids, wait=wait) as lease:
        for rid in rids:
            ds = [d for d in damage if d.run_id == rid]
            scratch = False
            for _ in range(3):  # a link inside a copied run folder (an array's) is replaced on the next round
                links = [d for d in ds if d.link]
                if not links:
                    break
                fence = RunFence(Path(store.keys.path), rid, lease.token, store.url)
                lost = [d for d in links if not _replace_link(fence, Path(d.path))]
                if not store.has_run(rid):  # its folder linked to nothing: gone, a re-run creates it anew
                    break
                if lost:  # an array's folder linked to nothing: the array made anew, the run recomputed
                    store.reopen(rid, token=lease.token).finish_creation()
                    scratch = True
                ds = [d for d in verify_run(store, rid) if not d.unfinished]
                meta = [d for d in ds if d.metadata]
                if meta:
                    raise StoreError(
                        f"run {rid!r}: the copy that replaced its linked folder has damaged metadata "
                        "(restore it, or delete the run and re-run): " + "; ".join(d.path for d in meta)
                    )
            if not store.has_run(rid):
                marked[rid] = None
                continue
            if any(d.remade and d.array for d in ds):  # an array's folder gone: made anew, empty
                store.reopen(rid, token=lease.token).finish_creation()
            r = RunReader(store, rid, tolerant=True)
            # a gone `done` says nothing of which steps finished, a gone per-step array holds none of them
            scratch = scratch or any(
                d.remade and d.array and (r.specs[d.array].per_step or d.array == "loss_trace") for d in ds
            )
            idx = list(range(len(r.done))) if scratch else _steps_to_recompute(r, ds)
            store.reopen(rid, token=lease.token).forget_steps(
                idx,
                list(dict.fromkeys(d.key for d in ds if d.key is not None)),
                static_damaged=scratch
                or any(
                    d.index is None and d.array and d.array != "loss_trace" and not d.stray and not d.post_run
                    for d in ds
                ),
                reason=f"{len(idx)} damaged step(s) marked for recompute by nsa verify; re-run to resume",
            )
            marked[rid] = idx
    return marked


def _replace_link(fence: RunFence, link: Path) -> bool:
    """Replace the symbolic link ``link`` (a run's or an array's folder) by a real folder holding
    a copy of its target; whether anything was recovered (False: the link was only removed).

    The copy is made in the writer's write folder (a revoked writer finds it gone: LeaseLost) and
    renamed into place after the link itself is removed; links inside the target are copied as
    links (never followed: the next verification names and removes them), and only regular files
    are copied (a FIFO or a device there is never opened: its chunk is then missing, and marked)."""
    target = os.path.realpath(link)
    found = os.path.isdir(target) and os.path.isfile(os.path.join(target, "zarr.json"))
    copy = fence.folder / f"{uuid.uuid4().hex}.copy"
    try:
        if found:
            shutil.copytree(target, copy, symlinks=True, copy_function=_copy_file)
        fence.delete(link)
        if found:
            fence.check_inside(link)
            copy.rename(link)
    except FileNotFoundError:
        if not fence.folder.is_dir():
            raise fence.lost() from None
        raise
    finally:
        if copy.exists():
            shutil.rmtree(copy, ignore_errors=True)
    return found


def _copy_file(src: str, dst: str) -> None:
    """``shutil.copy2`` for a regular file; anything else (FIFO, device, socket) is left out."""
    if os.path.isfile(src) and not os.path.islink(src):
        shutil.copy2(src, dst)


def _steps_to_recompute(r: RunReader, ds: list[Damage]) -> list[int]:
    """The recorded steps a re-run must compute again: the damaged ones, and for a damaged
    ``loss_trace`` chunk the first recorded step after the chunk's start (training resumes from
    the checkpoint before it)."""
    idx = {d.index for d in ds if d.index is not None}
    if not any(d.array == "steps" for d in ds):
        steps = r.read("steps")
        for d in ds:
            if d.array == "loss_trace" and d.key is not None and not d.stray:
                last = d.key.rsplit("/", 1)[-1]  # a chunk, or a folder of the wrong kind above several
                start = int(last) * r.array("loss_trace").chunks[0] if last.isdigit() else -1
                later = np.flatnonzero(steps > start)
                idx |= {int(later[0])} if len(later) else set()
    return sorted(i for i in idx if i < len(r.done))
