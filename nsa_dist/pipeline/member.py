"""A member of a spectral gang: holds its share of one step's G (tiles or a data shard) or of H.

A plain class with idempotent methods keyed by the step's key (the Ray layer makes it an actor
in a placement group; :class:`~nsa_dist.pipeline.layout.LocalGang` runs it in-process).  It
is handed the run's :class:`~nsa_dist.pipeline.plan.RunPlan`, takes the run's data and a network
of its own from :class:`~nsa_dist.pipeline.materials.RunMaterials` (loaded and built once per
process), and sets θ_t per step.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import numpy as np
import torch
from torch.nn.utils import vector_to_parameters

from nsa_dist.hessian import hessian_parts
from nsa_dist.ntk import NTKMethod
from nsa_dist.ntk.blocks import BlockFeatures
from nsa_dist.ntk.shards import FeatureShard, GramTiles, JacobianShard, shard_features
from nsa_dist.pipeline.hessian_step import hessian_loss
from nsa_dist.pipeline.materials import RunMaterials
from nsa_dist.pipeline.plan import RunPlan

__all__ = ["SpectralShard"]

_SERIAL = itertools.count()


class SpectralShard:
    """One gang member.  ``threads``: torch threads of this process (None: leave as is).

    ``materials`` / ``model``: an in-process member (``nsa run``, a Tracker) is handed the
    analyzer's materials and network instead of taking them from this process's
    :class:`~nsa_dist.pipeline.materials.RunMaterials` — a Tracker's network and in-memory arrays
    cannot be rebuilt from its spec.  Otherwise the member's network for a run is a copy of the
    run's own, kept with the run's materials (dropped with them).
    """

    def __init__(
        self,
        threads: int | None = None,
        *,
        materials: RunMaterials | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        self._held: dict[str, Any] = {}
        self._given = (materials, model) if materials is not None and model is not None else None
        self._serial = next(_SERIAL)  # this member's network is its own (id() is reused)

    # ------------------------------------------------------------------ run state
    def _model(self, plan: RunPlan, theta: np.ndarray) -> tuple[RunMaterials, torch.nn.Module]:
        """The run's materials and this member's network (taken once per run in this process) at θ_t."""
        if self._given is not None:
            m, model = self._given
        else:
            m = RunMaterials.load(plan)
            model = m.hold(("member", self._serial), lambda: m.network(plan.device))
        p = next(model.parameters())  # float32, or a Tracker's float64 model
        vector_to_parameters(torch.as_tensor(np.asarray(theta), dtype=p.dtype, device=p.device), model.parameters())
        return m, model

    @staticmethod
    def _points(
        plan: RunPlan, m: RunMaterials, model: torch.nn.Module, which: str, rng: tuple[int, int] | None = None
    ) -> torch.Tensor:
        X = m.inputs(which, model, plan.device)
        return X if rng is None else X[rng[0] : rng[1]]

    # ------------------------------------------------------------------ block_rows
    def features(
        self, plan: RunPlan, theta: np.ndarray, which: str, ranges: list[tuple[int, int]]
    ) -> BlockFeatures | list[BlockFeatures]:
        """Per-layer features of the given ranges of points (one result per range; a single
        range gives its features unwrapped, as one object-store return)."""
        m, model = self._model(plan, theta)
        X = self._points(plan, m, model, which)
        feats = shard_features(model, X, ranges, plan.torch_dtype, plan.ntk_route)
        return feats[0] if len(ranges) == 1 else feats

    def build_tiles(
        self, key: str, ranges: list[tuple[int, int]], pairs: list[tuple[int, int]], features: dict[int, BlockFeatures]
    ) -> int:
        """Build and hold this member's tiles; returns their bytes."""
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        self._held[key] = GramTiles(features, ranges, pairs, device=dev)
        return self._held[key].nbytes()

    def tiles_matmat(self, key: str, V: np.ndarray) -> np.ndarray:
        return self._get(key).matmat(V)

    def tiles_stats(self, key: str) -> dict[str, float]:
        return self._get(key).stats()

    # ------------------------------------------------------------------ matrix_free
    def shard(self, key: str, plan: RunPlan, theta: np.ndarray, which: str, rng: tuple[int, int]) -> int:
        """Hold the per-layer features (structured or per-layer NTK) or, for models with neither,
        the Jacobian map of points ``rng``; returns bytes held."""
        m, model = self._model(plan, theta)
        X, es = self._points(plan, m, model, which), plan.spec
        dtype = plan.torch_dtype
        if plan.ntk_route.method in (NTKMethod.STRUCTURED, NTKMethod.PER_LAYER):
            feats = shard_features(model, X, [rng], dtype, plan.ntk_route)[0]
            held: Any = FeatureShard(feats, es.model.output_dim, device=plan.device)
            nbytes = sum(A.nbytes + D.nbytes for A, D in feats)
        else:
            held = JacobianShard(model, X[rng[0] : rng[1]], dtype)
            nbytes = 0
        self._held[key] = held
        return nbytes

    def shard_jt(self, key: str, V: np.ndarray) -> np.ndarray:
        return self._get(key).jt(V)

    def shard_j(self, key: str, U: np.ndarray) -> np.ndarray:
        return self._get(key).j(U)

    # ------------------------------------------------------------------ loss curvature
    def curvature(self, key: str, plan: RunPlan, theta: np.ndarray, rng: tuple[int, int], weight: float) -> None:
        """Hold H_s, I_s, S_s of the loss on points ``rng`` (float64), products scaled by ``weight`` = n_s/N."""
        m, model = self._model(plan, theta)
        X, es = self._points(plan, m, model, "train", rng), plan.spec
        y = np.asarray(m.data.y, dtype=np.float64)[rng[0] : rng[1]]
        block = es.hessian.block_size if es.hessian else None
        H, I, S = hessian_parts(model, X, y, loss=hessian_loss(es), block_size=block, dtype=torch.float64)
        self._held[key] = ({"H": H, "I": I, "S": S}, weight)

    def curvature_matmat(self, key: str, part: str, V: np.ndarray) -> np.ndarray:
        ops, weight = self._get(key)
        return weight * np.asarray(ops[part].matmat(np.asarray(V, dtype=np.float64)))

    # ------------------------------------------------------------------ housekeeping
    def _get(self, key: str) -> Any:
        try:
            return self._held[key]
        except KeyError:
            raise KeyError(
                f"this spectral shard (pid {os.getpid()}) holds nothing under {key!r}: it was "
                "released, or the member restarted and lost it"
            ) from None

    def release(self, key: str) -> None:
        self._held.pop(key, None)

    def pid(self) -> int:
        return os.getpid()

    def peak_rss(self) -> int:
        """This process's peak resident memory (bytes, Linux VmHWM)."""
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
