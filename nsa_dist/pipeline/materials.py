"""A run's materials in one process, loaded once: its data, its network, the inputs and the renderer.

:meth:`RunMaterials.load` is the one place of the pipeline that loads a run's data
(:func:`~nsa_dist.data.load_dataset`) and builds its network (:func:`~nsa_dist.models.build_model`).
Every role of a run in a process — the plan, the trainer, the analyzer, a spectral worker, a gang
member — asks it rather than loading or building for itself, so a process loads a run's data and
builds its network once (the Ray actors are processes of their own: each loads once per run).

The network built is the run's *prototype*: seed-fixed, read only by the plan (parameter count,
the NTK route's probe); every role that overwrites parameters (the trainer's updates, the
analyzer's θ_t) takes its own :meth:`RunMaterials.network` copy, so no two roles share parameters.

A process keeps the materials of at most :data:`MAX_RUNS` runs, least recently used dropped
first; what a role keeps with a run (:meth:`RunMaterials.hold`: a worker's analyzer and writer, a
member's network) goes with them.  Materials made around a caller's own network (a Tracker's) are
the caller's and are not kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from nsa_dist.config import DataName
from nsa_dist.data import Dataset, load_dataset
from nsa_dist.models import build_model, copy_model
from nsa_dist.pipeline.images import EigenImages, unit_coordinates
from nsa_dist.pipeline.model_state import model_inputs

if TYPE_CHECKING:
    from nsa_dist.config import ExperimentSpec
    from nsa_dist.pipeline.plan import RunPlan  # noqa: F401 (also imported in load)

__all__ = ["MAX_RUNS", "RunMaterials"]

MAX_RUNS = 2  # runs whose materials one process keeps (a spectral worker alternates between runs)
_KEPT: OrderedDict[str, RunMaterials] = OrderedDict()  # by run id, least recently used first
_LOCK = threading.Lock()


def _same_data(plan: RunPlan, data: Dataset) -> None:
    """RunRefused unless ``data`` is the data ``plan``'s run was opened with."""
    from nsa_dist.store import RunRefused

    loaded = data.fingerprint()
    if loaded != plan.data_fingerprint:
        d = plan.spec.data
        what = f"data.path {d.path!r}" if d.path else f"the {DataName(d.name).value} data"
        raise RunRefused(
            f"run {plan.run_id!r}: {what} now loads as {loaded}, the run was opened on "
            f"{plan.data_fingerprint}: the data changed while the run was running, and this process "
            "would measure other points than the run trains on; refusing — restore the data, or start "
            "a new run (change the spec's `name`)"
        )


class RunMaterials:
    """One run's data and network in this process, and what is derived from them once.

    Attributes:
        run_id: the run's id (the key it is kept under).
        spec: the run's spec.
        data: the run's points (loaded from ``spec.data``, or the caller's).
        given: whether the network is the caller's (then these materials are not kept).
    """

    def __init__(self, run_id: str, spec: ExperimentSpec, data: Dataset, model: nn.Module | None = None) -> None:
        self.run_id, self.spec, self.data = run_id, spec, data
        self.given = model is not None
        self._prototype = model
        self._inputs: dict[tuple, torch.Tensor] = {}
        self._renderers: dict[tuple[int, ...], EigenImages] = {}
        self._held: dict[Any, Any] = {}

    @classmethod
    def load(
        cls,
        run: RunPlan | ExperimentSpec,
        *,
        data: Dataset | None = None,
        model: nn.Module | None = None,
        fresh: bool = False,
        key: str | None = None,
    ) -> RunMaterials:
        """The materials of ``run`` (a plan, or a spec before it is planned) in this process.

        Args:
            data: the run's points when the caller has them (a Tracker's arrays, a test's copy);
                kept materials holding other data are replaced.
            model: the caller's network (a Tracker's): the materials made around it are returned,
                not kept, and nothing is built.
            fresh: load the data from its source again even if kept (a run being opened or a
                trainer starting checks what is on disk now against the store's fingerprint).
            key: the spec's run id when the caller has it (the lease was taken under it).

        Raises:
            as :func:`~nsa_dist.data.load_dataset` (a missing or changed data file).
            RunRefused: data loaded from its source for a plan that carries the run's data
                fingerprint load as other data (the file changed since the run was opened: a
                worker or a replaced gang member started after it would measure other points).
        """
        from nsa_dist.pipeline.plan import RunPlan, run_id  # here: the plan is made from materials

        spec, rid = (run.spec, run.run_id) if isinstance(run, RunPlan) else (run, key or run_id(run))
        with _LOCK:  # the cache is the process's: threads (a notebook's, a Tracker's pool) share it
            kept = _KEPT.get(rid) if model is None else None
            if kept is not None and not fresh and (data is None or data is kept.data):
                _KEPT.move_to_end(rid)
                return kept
        if data is None or fresh:
            data = load_dataset(spec.data, seed=spec.seed)
            if isinstance(run, RunPlan) and run.data_fingerprint is not None:
                _same_data(run, data)
        made = cls(rid, spec, data, model)
        if model is None:  # what the loader loaded or built is kept; a caller's network is the caller's
            with _LOCK:
                old = _KEPT.pop(rid, None)
                _KEPT[rid] = made
                dropped = [old] if old is not None else []
                while len(_KEPT) > MAX_RUNS:
                    dropped.append(_KEPT.popitem(last=False)[1])
            for d in dropped:
                d._release()
        return made

    def _release(self) -> None:
        """Let go of what roles kept with this run (an analyzer holds its materials: without this
        the pair is a cycle that only the cyclic collector frees, N×N buffers and device tensors
        included)."""
        self._held.clear()

    @property
    def prototype(self) -> nn.Module:
        """The run's network as built (seed-fixed), or the caller's; read only — roles that change
        parameters take a :meth:`network`."""
        if self._prototype is None:
            self._prototype = build_model(self.spec.model, seed=self.spec.seed)
        return self._prototype

    def network(self, device: torch.device | str | None = None) -> nn.Module:
        """A copy of the prototype of its own (on ``device``), for a role that overwrites its parameters."""
        net = copy_model(self.prototype)
        return net if device is None else net.to(device)

    def inputs(self, which: str, model: nn.Module, device: torch.device | str) -> torch.Tensor:
        """The training ("train", (N, …)) or test ("test", (M, …)) points as ``model`` takes them
        (:func:`~nsa_dist.pipeline.model_state.model_inputs`) on ``device``, converted once."""
        key = (which, next(model.parameters()).dtype, str(torch.device(device)))
        if key not in self._inputs:
            X = self.data.X if which == "train" else np.asarray(self.data.X_test)
            self._inputs[key] = model_inputs(np.asarray(X).reshape((-1,) + self.data.X.shape[1:]), model, device)
        return self._inputs[key]

    def renderer(self, plan: RunPlan) -> EigenImages | None:
        """The eigenvector images' renderer (its Delaunay triangulation built once), for the plan's
        image indices; None when the run draws none."""
        indices = tuple(plan.image_indices)
        if not indices:
            return None
        if indices not in self._renderers:
            s = self.spec.spectrum
            X01 = unit_coordinates(self.data)
            self._renderers[indices] = EigenImages(X01, list(indices), s.image_size, s.fourier_limit, s.fourier_size)
        return self._renderers[indices]

    def hold(self, key: Any, make: Callable[[], Any]) -> Any:
        """What a role keeps with this run under ``key`` (made by ``make`` the first time)."""
        if key not in self._held:
            self._held[key] = make()
        return self._held[key]

    @staticmethod
    def kept() -> list[str]:
        """The run ids whose materials this process keeps, least recently used first."""
        return list(_KEPT)

    @staticmethod
    def forget(run_id: str | None = None) -> None:
        """Drop the kept materials of ``run_id`` (None: of every run); the roles holding them keep theirs."""
        with _LOCK:
            dropped = list(_KEPT.values()) if run_id is None else [m for m in [_KEPT.pop(run_id, None)] if m]
            if run_id is None:
                _KEPT.clear()
        for d in dropped:
            d._release()

    def drop_network(self) -> None:
        """Forget the built prototype (a sweep's driver plans every run but trains none: it keeps no
        network per run); it is built again if asked for.  A caller's network is kept."""
        if not self.given:
            self._prototype = None
