"""One recorded step's Gram on a gang of spectral workers, as operators the solvers consume (no Ray).

A *gang* is a :class:`Gang` of :class:`~nsa_dist.pipeline.member.SpectralShard` members: in one
process (:class:`LocalGang`, used by ``nsa run`` and the tests) or Ray actors in a placement
group (``nsa_dist.cluster.gang.RayGang``).  The step's driver (the spectral worker analysing the
step) only ever holds vectors: ``G V``, ``‖G‖_F²`` and the Hessian products come back from the
gang as partial sums.

* :class:`TiledGram` — layout ``block_rows``: tiles of G dealt to the members (exact).
* :class:`ShardedGram` — layout ``matrix_free``: ``G V = J (Jᵀ V)``, ``Jᵀ V`` reduced over shards.
* :class:`ShardedCurvature` — ``H V = Σ_s (n_s/N) H_s V`` (also I, S) over the same shards.
* :func:`choose_layout` — ``layout: auto`` by a per-worker memory budget.

``run`` arguments are handed to the members as they are (the run's
:class:`~nsa_dist.pipeline.plan.RunPlan`: a member loads the run's data and network once by it).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar, cast

import numpy as np

from nsa_dist.config import ExperimentSpec, Layout
from nsa_dist.hessian.moments import hutchpp_moments
from nsa_dist.linalg.operator import LinearOperator
from nsa_dist.ntk.blocks import row_blocks
from nsa_dist.ntk.shards import tile_plan

if TYPE_CHECKING:
    from nsa_dist.ntk.blocks import BlockFeatures
    from nsa_dist.pipeline.member import SpectralShard
    from nsa_dist.pipeline.plan import RunPlan

COUPLES = "the model couples samples"  # how the probe's reason for the batch route begins
BATCH_ASKED = "spectrum.ntk_method='batch' computes the kernel of the whole batch's forward at once"

__all__ = [
    "Handle",
    "Member",
    "ShardCalls",
    "Gang",
    "each",
    "LocalGang",
    "StepGram",
    "DenseGram",
    "TiledGram",
    "ShardedGram",
    "ShardedCurvature",
    "LayoutChoice",
    "choose_layout",
    "layout_bytes",
    "held_bytes",
    "layout_budget",
]

_keys = itertools.count()

T = TypeVar("T")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class Handle(Protocol[R_co]):
    """A member call's result to come, of type ``R_co``: the value itself in process, an ObjectRef
    on Ray.  :meth:`Gang.get` fetches it; handed to another member call as an argument it arrives
    there as the value."""


Sent: TypeAlias = T | Handle[T]
"""An argument of a member call: the value, or a handle of it (:meth:`Gang.put`, or another call's result)."""


class Member(Protocol):
    """The calls one gang member answers: the methods of
    :class:`~nsa_dist.pipeline.member.SpectralShard` (same names and arguments), each started at
    once and answered by a :class:`Handle` of the shard method's result: a gang's partial
    products are ``gang.get([m.tiles_matmat(key, h) for m in each(gang)])``.
    """

    def features(
        self, plan: Sent[RunPlan], theta: Sent[np.ndarray], which: str, ranges: list[tuple[int, int]]
    ) -> list[Handle[BlockFeatures]]:
        """The per-layer features of each range of points: one handle per range (block_rows)."""
        ...

    def build_tiles(
        self,
        key: str,
        ranges: list[tuple[int, int]],
        pairs: list[tuple[int, int]],
        features: dict[int, Handle[BlockFeatures]],
    ) -> Handle[int]:
        """Build and hold the member's tiles of G from the blocks' features; their bytes."""
        ...

    def tiles_matmat(self, key: str, V: Sent[np.ndarray]) -> Handle[np.ndarray]:
        """The member's partial product of its tiles with V (N, k)."""
        ...

    def tiles_stats(self, key: str) -> Handle[dict[str, float]]:
        """The member's part of ‖G‖_F² and Tr(G) (``sq_frobenius``, ``trace``)."""
        ...

    def shard(
        self, key: str, plan: Sent[RunPlan], theta: Sent[np.ndarray], which: str, rng: tuple[int, int]
    ) -> Handle[int]:
        """Hold the features (or the Jacobian map) of the points ``rng`` (matrix_free); bytes held."""
        ...

    def shard_jt(self, key: str, V: Sent[np.ndarray]) -> Handle[np.ndarray]:
        """J_sᵀ V_s of the member's shard."""
        ...

    def shard_j(self, key: str, U: Sent[np.ndarray]) -> Handle[np.ndarray]:
        """J_s U of the member's shard."""
        ...

    def curvature(
        self, key: str, plan: Sent[RunPlan], theta: Sent[np.ndarray], rng: tuple[int, int], weight: float
    ) -> Handle[None]:
        """Hold H_s, I_s, S_s of the loss on the points ``rng``, products scaled by ``weight``."""
        ...

    def curvature_matmat(self, key: str, part: str, V: Sent[np.ndarray]) -> Handle[np.ndarray]:
        """``weight`` · A_s V for A = ``part`` ("H", "I" or "S")."""
        ...

    def release(self, key: str) -> Handle[None]:
        """Drop what the member holds under ``key``."""
        ...

    def pid(self) -> Handle[int]:
        """The member's process id."""
        ...

    def peak_rss(self) -> Handle[int]:
        """The member's peak resident memory (bytes)."""
        ...


class ShardCalls(Member):
    """A :class:`Member` that starts each call on ``target`` (a SpectralShard, or an actor of one):
    subclasses say how a call starts (:meth:`_start`, :meth:`_start_each`)."""

    def __init__(self, target: SpectralShard) -> None:
        self.target = target

    def _start(self, method: Callable[..., R], *args: Any) -> Handle[R]:
        """Start ``method(*args)`` (a method of :attr:`target`); its result's handle."""
        raise NotImplementedError

    def _start_each(self, n: int, method: Callable[..., Any], *args: Any) -> list[Handle[Any]]:
        """Start ``method(*args)``, which returns ``n`` results (one unwrapped when ``n`` = 1); a handle each."""
        raise NotImplementedError

    def features(
        self, plan: Sent[RunPlan], theta: Sent[np.ndarray], which: str, ranges: list[tuple[int, int]]
    ) -> list[Handle[BlockFeatures]]:
        return self._start_each(len(ranges), self.target.features, plan, theta, which, ranges)

    def build_tiles(
        self,
        key: str,
        ranges: list[tuple[int, int]],
        pairs: list[tuple[int, int]],
        features: dict[int, Handle[BlockFeatures]],
    ) -> Handle[int]:
        return self._start(self.target.build_tiles, key, ranges, pairs, features)

    def tiles_matmat(self, key: str, V: Sent[np.ndarray]) -> Handle[np.ndarray]:
        return self._start(self.target.tiles_matmat, key, V)

    def tiles_stats(self, key: str) -> Handle[dict[str, float]]:
        return self._start(self.target.tiles_stats, key)

    def shard(
        self, key: str, plan: Sent[RunPlan], theta: Sent[np.ndarray], which: str, rng: tuple[int, int]
    ) -> Handle[int]:
        return self._start(self.target.shard, key, plan, theta, which, rng)

    def shard_jt(self, key: str, V: Sent[np.ndarray]) -> Handle[np.ndarray]:
        return self._start(self.target.shard_jt, key, V)

    def shard_j(self, key: str, U: Sent[np.ndarray]) -> Handle[np.ndarray]:
        return self._start(self.target.shard_j, key, U)

    def curvature(
        self, key: str, plan: Sent[RunPlan], theta: Sent[np.ndarray], rng: tuple[int, int], weight: float
    ) -> Handle[None]:
        return self._start(self.target.curvature, key, plan, theta, rng, weight)

    def curvature_matmat(self, key: str, part: str, V: Sent[np.ndarray]) -> Handle[np.ndarray]:
        return self._start(self.target.curvature_matmat, key, part, V)

    def release(self, key: str) -> Handle[None]:
        return self._start(self.target.release, key)

    def pid(self) -> Handle[int]:
        return self._start(self.target.pid)

    def peak_rss(self) -> Handle[int]:
        return self._start(self.target.peak_rss)


class Gang(Protocol):
    """A gang: ``size`` members addressed by index, whose calls are typed method calls
    (:meth:`member`); results are fetched with :meth:`get`."""

    size: int

    def member(self, i: int) -> Member:
        """Member ``i``'s calls."""
        ...

    def get(self, handles: Iterable[Handle[T]]) -> list[T]:
        """The results behind handles, in order (raises the member's error)."""
        ...

    def put(self, value: T) -> Handle[T]:
        """A handle for a value sent to several members (an object-store ref on Ray)."""
        ...


def each(gang: Gang) -> list[Member]:
    """Every member of ``gang``, in index order."""
    return [gang.member(i) for i in range(gang.size)]


class _InProcess(ShardCalls):
    """A member in this process: a call runs at once; its handle is its result."""

    def _start(self, method: Callable[..., R], *args: Any) -> Handle[R]:
        return method(*args)

    def _start_each(self, n: int, method: Callable[..., Any], *args: Any) -> list[Handle[Any]]:
        out = method(*args)
        return [out] if n == 1 else list(out)


class LocalGang:
    """A gang of plain members in this process (the same code path as Ray, without Ray)."""

    def __init__(self, members: list[SpectralShard]) -> None:
        self.members, self.size = members, len(members)

    def member(self, i: int) -> Member:
        return _InProcess(self.members[i])

    def get(self, handles: Iterable[Handle[T]]) -> list[T]:
        return cast("list[T]", list(handles))

    def put(self, value: T) -> Handle[T]:
        return value


class StepGram(Protocol):
    """What the step's metrics need of G: products, the exact or estimated ‖G‖_F², release."""

    shape: tuple[int, int]
    dtype: Any

    def matmat(self, V: np.ndarray) -> np.ndarray: ...

    def sq_frobenius(self) -> tuple[float, float]: ...

    def close(self) -> None: ...


class DenseGram(LinearOperator):
    """Layout ``local``: G held whole (torch, on the analysis device)."""

    def __init__(self, G: Any) -> None:
        super().__init__(G.shape[0], G.dtype, "torch", G.device)
        self.G = G

    def _matmat(self, V: Any) -> Any:
        return self.G @ V

    def sq_frobenius(self) -> tuple[float, float]:
        """(‖G‖_F², 0): exact, summed in float64 over 512-row slabs, each copied once and squared
        in place (cache-sized: 0.28 s against 0.51 s for 4096-row slabs squared into a second copy,
        N = 10⁴).  The copy is explicit: ``.double()`` of a float64 G is G itself."""
        import torch

        return float(
            sum(
                torch.sum(self.G[a : a + 512].to(torch.float64, copy=True).pow_(2))
                for a in range(0, self.shape[0], 512)
            )
        ), 0.0

    def close(self) -> None:
        self.G = None


def _working(gang: Gang, n: int) -> list[Member]:
    """The members that take a share of ``n`` points: all of them, or the first ``n`` when the
    gang has more members than points (a test set of 5 points on a gang of 8: each of 5 members
    holds one point, the others idle) — never an error where ``layout: local`` gives the numbers."""
    return each(gang)[: max(1, min(gang.size, n))]


class _GangGram(LinearOperator):
    """Common part of the gang layouts: a key naming the step's state on every working member, release."""

    def __init__(self, gang: Gang, N: int, dtype: np.dtype) -> None:
        super().__init__(N, np.dtype(dtype))
        self.gang = gang
        self.members = _working(gang, N)
        self.key = f"g{os.getpid()}-{next(_keys)}"

    def close(self) -> None:
        self.gang.get([m.release(self.key) for m in self.members])


class TiledGram(_GangGram):
    """Layout ``block_rows``: every member holds its balanced share of the upper tile pairs.

    Each member computes the structured features of its own blocks of points once; each
    member then fetches the features of the blocks its tiles touch (zero-copy from the object
    store on one node) and builds its tiles.  ``G V`` = the sum of the members' partial products.
    """

    def __init__(self, gang: Gang, run: RunPlan, theta: np.ndarray, which: str, N: int, dtype: np.dtype) -> None:
        super().__init__(gang, N, dtype)
        members = self.members
        plan = tile_plan(N, len(members))
        run_h, theta_h = gang.put(run), gang.put(theta)
        feats: dict[int, Handle[BlockFeatures]] = {}
        for m, owned in zip(members, plan.owners):
            feats.update(zip(owned, m.features(run_h, theta_h, which, [plan.ranges[b] for b in owned])))
        need = [sorted({b for p in pairs for b in p}) for pairs in plan.pairs]
        self.nbytes = gang.get(
            [
                m.build_tiles(self.key, plan.ranges, plan.pairs[i], {b: feats[b] for b in need[i]})
                for i, m in enumerate(members)
            ]
        )
        del feats
        self.plan = plan

    def _matmat(self, V: np.ndarray) -> np.ndarray:
        h = self.gang.put(np.ascontiguousarray(V))
        parts = self.gang.get([m.tiles_matmat(self.key, h) for m in self.members])
        return np.sum(parts, axis=0).astype(self.dtype, copy=False)

    def sq_frobenius(self) -> tuple[float, float]:
        return self.trace_stats()["sq_frobenius"], 0.0

    def trace_stats(self) -> dict[str, float]:
        """Exact ``sq_frobenius`` = ‖G‖_F² and ``trace`` = Tr(G), summed over the members' tiles."""
        stats = self.gang.get([m.tiles_stats(self.key) for m in self.members])
        return {k: float(sum(s[k] for s in stats)) for k in ("sq_frobenius", "trace")}


class ShardedGram(_GangGram):
    """Layout ``matrix_free``: member s holds the features (or the Jacobian map) of its data shard.

    ``G V``: each member returns ``J_sᵀ V_s`` (m, K·P'), the driver sums them (the reduction
    through Ray), broadcasts the sum and concatenates the members' ``J_s U``.
    """

    def __init__(
        self,
        gang: Gang,
        run: RunPlan,
        theta: np.ndarray,
        which: str,
        N: int,
        dtype: np.dtype,
        frobenius_probes: int = 32,
        seed: int = 0,
    ) -> None:
        super().__init__(gang, N, dtype)
        self.ranges = row_blocks(N, len(self.members))
        run_h, theta_h = gang.put(run), gang.put(theta)
        self.nbytes = gang.get([m.shard(self.key, run_h, theta_h, which, r) for m, r in zip(self.members, self.ranges)])
        self.probes, self.seed = frobenius_probes, seed
        self._fro: tuple[float, float] | None = None

    def _matmat(self, V: np.ndarray) -> np.ndarray:
        members = self.members
        U = np.sum(
            self.gang.get(
                [m.shard_jt(self.key, np.ascontiguousarray(V[a:b])) for m, (a, b) in zip(members, self.ranges)]
            ),
            axis=0,
        )  # (m, dim)
        h = self.gang.put(U)
        out = np.concatenate(self.gang.get([m.shard_j(self.key, h) for m in members]), axis=0)  # (N, m)
        return out.astype(self.dtype, copy=False)

    def sq_frobenius(self) -> tuple[float, float]:
        """‖G‖_F² = Tr(G²) by Hutch++ (estimate, standard error), computed once."""
        if self._fro is None:
            m = hutchpp_moments(self, self.probes, max_order=2, seed=self.seed)
            self._fro = (float(m.estimate[1]), float(m.stderr[1]))
        return self._fro


class ShardedCurvature:
    """``A V = Σ_s (n_s / N) A_s V`` for A ∈ {H, I, S} of the loss over the gang's data shards.

    Each member holds its shard's operators (``C_s = (1/n_s) Σ_{i∈s} c_i``); the weights make the
    sum the Hessian of ``C = (1/N) Σ_i c_i``.  ``shape`` is (P, P).
    """

    def __init__(self, gang: Gang, run: RunPlan, theta: np.ndarray, N: int, P: int) -> None:
        self.gang, self.shape = gang, (P, P)
        self.key = f"h{os.getpid()}-{next(_keys)}"
        self.members = _working(gang, N)
        ranges = row_blocks(N, len(self.members))
        run_h, theta_h = gang.put(run), gang.put(theta)
        gang.get([m.curvature(self.key, run_h, theta_h, r, (r[1] - r[0]) / N) for m, r in zip(self.members, ranges)])

    def part(self, name: str) -> _Part:
        return _Part(self, name)

    def close(self) -> None:
        self.gang.get([m.release(self.key) for m in self.members])


class _Part(LinearOperator):
    """One of H, I, S as an operator summing the members' products."""

    def __init__(self, owner: ShardedCurvature, name: str) -> None:
        super().__init__(owner.shape[0], np.dtype(np.float64))
        self.owner, self.name = owner, name

    def _matmat(self, V: np.ndarray) -> np.ndarray:
        gang = self.owner.gang
        h = gang.put(np.ascontiguousarray(V))
        parts = gang.get([m.curvature_matmat(self.owner.key, self.name, h) for m in self.owner.members])
        return np.sum(parts, axis=0)


# --------------------------------------------------------------------------- choosing a layout


@dataclass(frozen=True)
class LayoutChoice:
    layout: Layout
    reason: str


def _machine_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def layout_bytes(spec: ExperimentSpec, N: int, feature_width: int) -> dict[Layout, float]:
    """Per-worker bytes of an N-point Gram in each layout (the estimates :func:`choose_layout` weighs).

    local ≈ 1.1·N²·(itemsize + 8) (G, and the float64 copy the solver works on), block_rows ≈
    (B+1)/(2BW)·N²·itemsize + N·feature_width·itemsize (B = 4W blocks), matrix_free ≈
    (N/W)·feature_width·itemsize; ``feature_width`` = Σ_l (n_in + 1 + K·n_out).
    """
    s = spec.spectrum
    item = np.dtype(s.dtype).itemsize
    W, B = s.workers, 4 * s.workers
    return {
        Layout.LOCAL: N * N * (item + 8) * 1.1,
        Layout.BLOCK_ROWS: (B + 1) / (2 * B * W) * N * N * item + N * feature_width * item,
        Layout.MATRIX_FREE: N / W * feature_width * item,
    }


def held_bytes(spec: ExperimentSpec, n: int, feature_width: int, layout: Layout, in_process: bool = False) -> float:
    """Bytes one process holds for an n-point Gram in ``layout``: one worker's part
    (:func:`layout_bytes`), or, with the gang's W members all in this process (``nsa run``, a
    Tracker), theirs — ``block_rows``: the W members' tiles beside the one copy of the block
    features they share (LocalGang hands the values themselves); ``matrix_free``: their W shards."""
    one = layout_bytes(spec, n, feature_width)[layout]
    W = spec.spectrum.workers
    if layout is Layout.LOCAL or not in_process or W == 1:
        return one
    shared = n * feature_width * np.dtype(spec.spectrum.dtype).itemsize if layout is Layout.BLOCK_ROWS else 0.0
    return W * (one - shared) + shared


def size_text(b: float) -> str:
    """Bytes as people read them, 3 significant digits: "539 kB", "1.58 MB", "3.2 GB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.3g} B"


def layout_budget(spec: ExperimentSpec) -> float:
    """The per-worker bytes ``layout: auto`` fits into: ``memory_budget_gb``, else half this machine."""
    gb = spec.spectrum.memory_budget_gb
    return gb * 1e9 if gb else 0.5 * _machine_bytes()


def choose_layout(
    spec: ExperimentSpec, N: int, feature_width: int, coupled: str | None = None, *, in_process: bool = False
) -> LayoutChoice:
    """Resolve ``spectrum.layout`` for an N-point Gram; ``auto`` picks the first layout that fits.

    Per-worker bytes (:func:`layout_bytes`) against ``memory_budget_gb`` (default half this
    machine's memory, :func:`layout_budget`).  ``feature_width``: numbers per point of the
    per-layer features the tiles are assembled from (:func:`~nsa_dist.ntk.blocks.feature_width`;
    Σ_l (n_in + 1 + K·n_out) for a net of Linear layers).

    ``coupled``: why the model couples samples (None: it does not) — its kernel is that of the
    whole batch's forward, which no split of the points reproduces: only ``local``.

    ``in_process``: the gang's W members will all live in this process (``nsa run``'s and a
    Tracker's in-process gang), so ``block_rows`` is weighed by what the process holds, not one
    member: the W members' tiles beside the one shared copy of the block features (more workers
    do not lower it).  ``matrix_free``, the last resort, is taken without a budget test (in
    process it holds every point's features; :func:`~nsa_dist.pipeline.budget.check_fits`
    weighs those against the machine).

    Raises:
        ValueError: a distributed layout for a model that couples samples.
    """
    s = spec.spectrum
    layout = Layout(s.layout)
    if coupled == BATCH_ASKED:
        if layout in (Layout.BLOCK_ROWS, Layout.MATRIX_FREE):
            raise ValueError(
                f"spectrum.layout={layout.value!r} splits the points over workers, but {BATCH_ASKED}, which no "
                "split of the points reproduces: use ntk_method 'auto' (or 'per_layer', 'jacobian'), or layout 'local'"
            )
        return LayoutChoice(Layout.LOCAL, f"{BATCH_ASKED}: the whole batch on one worker")
    if coupled is not None:
        # the route's reason says it already ("the model couples samples (…): the kernel of …")
        why = coupled if coupled.startswith(COUPLES) else f"{COUPLES} ({coupled})"
        if layout in (Layout.BLOCK_ROWS, Layout.MATRIX_FREE):
            said = why.removesuffix(": the kernel of the batch forward")  # said once, below
            raise ValueError(
                f"spectrum.layout={layout.value!r} splits the points over workers, but {said}: its kernel is "
                "that of the whole batch's forward; use layout 'local'"
                + (" (or put batch norm in eval mode)" if "batch statistics" in why else "")
            )
        return LayoutChoice(Layout.LOCAL, f"{why}: the whole batch on one worker")
    if layout is not Layout.AUTO:
        # by value, not by what the spec's text named: a sweep's runs carry every field, and the reason
        # is stored (the same run must store the same attributes, whichever way it was submitted)
        default = type(s).model_fields["layout"].default
        return LayoutChoice(layout, "the default" if layout == default else "set in the spec")
    W = s.workers
    budget = layout_budget(spec)
    need = layout_bytes(spec, N, feature_width)
    local, tiles = need[Layout.LOCAL], held_bytes(spec, N, feature_width, Layout.BLOCK_ROWS, in_process)
    where = (
        f"in this process as the tiles of its {W} gang members" if in_process else f"per worker as tiles on {W} workers"
    )
    sz = size_text
    if s.k == "all" and s.energy.value == "exact":
        return LayoutChoice(Layout.LOCAL, "k: all with energy: exact needs the whole G")
    if s.k == "all" and local <= budget:
        return LayoutChoice(
            Layout.LOCAL,
            f"k: all: G needs ~{sz(local)} on one worker, within the budget {sz(budget)}: every eigenpair exactly",
        )
    if local <= budget:
        return LayoutChoice(Layout.LOCAL, f"G needs ~{sz(local)} on one worker, within the budget {sz(budget)}")
    if W > 1 and tiles <= budget:
        return LayoutChoice(
            Layout.BLOCK_ROWS,
            f"G needs ~{sz(local)} whole (budget {sz(budget)}); ~{sz(tiles)} {where}",
        )
    return LayoutChoice(
        Layout.MATRIX_FREE,
        f"G needs ~{sz(local)} whole and ~{sz(tiles)} {where}, over the budget {sz(budget)}: products J(JᵀV) only",
    )
