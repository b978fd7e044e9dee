"""What one worker of a run holds in memory, estimated from the spec alone (nothing is built).

A run whose estimate exceeds this machine (or, with ``layout: auto``, the per-worker
``spectrum.memory_budget_gb``) is refused in one line before its data is loaded or its model
built: ``model.width: 10**9`` or ``data.n: 10**8`` must not be found out by the allocator.

Parts (bytes, lower estimates — a run refused here would certainly not fit):

* the Gram of the run's layout, per worker — :func:`~nsa_dist.pipeline.layout.layout_bytes`;
  where the gang's W members share one process (``nsa run`` on a ``block_rows`` / ``matrix_free``
  layout: :class:`~nsa_dist.pipeline.layout.LocalGang`), the other W − 1 members' own parts too
  (``block_rows``: their tiles — the block features are one shared copy; ``matrix_free``: their
  shards' features);
* a ``matrix_free`` shard's feature pass, transient: one chunk's features before they are copied
  into the shard's arrays and its forward activations, c·(width + Σ n_out)·itemsize for
  c = min(:data:`~nsa_dist.ntk.blocks.ROW_CHUNK`, N/W) points (measured on the 6×256 and 3×512
  nets: 1.6–4.4× the chunk's features above what is kept; ``block_rows`` passes its blocks before
  any tile exists, so its pass is not added to the tiles);
* a ``matrix_free`` member's product temporaries: one chunk of (points × columns × outputs),
  at most :data:`~nsa_dist.ntk.shards.CHUNK_BYTES` (each member's, where they share the process);
* the top-k eigenvectors, N·k·8 (``k: all``: N² on the exact route, N·quadrature.top on the
  quadrature route, which also holds the Lanczos bases and products of the column groups that run
  side by side (the probes' and φ's, or φ's own longer run with ``quadrature.phi_steps``),
  2·N·lanczos_steps·8 per column, as many columns as fit the route's 1 GB cap together (at least
  one group of ``block_size``) — :func:`~nsa_dist.linalg.quadrature.quadrature_basis_bytes`);
* with ``spectrum.test_points``, the test Gram's own buffer held whole, M·M·itemsize, or
  M·max(M, N)·itemsize where App. E assembles the (M, N) cross kernel in it at t0 (GD without
  momentum on the L2 loss); on a gang only what it needs beyond G; its eigenvectors M·min(k, M)·8;
* the data, (N + M)·d·16 (float64 as loaded, float32 copies in the trainer and the analyzer);
* the parameters, P·4·(4 + slots) (trainer and analyzer copies, gradients, θ_t, optimizer slots);
* the Hessian probes, P·8·(probes + lanczos_steps), when a ``hessian`` block is set;
* the eigenvector images of 2-D data, nI·(R² + F²)·8.

P and Σ_l (n_in + 1 + K·n_out) have closed forms for the fully-connected ``model`` block; a
``model.factory`` network is known only once built, so its parameter terms are left out — except
a :class:`~nsa_dist.Tracker`'s, whose spec records the network's P (``kwargs.n_params``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from nsa_dist.config import DataName, ExperimentSpec, Layout, ModelSpec, OptimizerName
from nsa_dist.errors import ResourceError
from nsa_dist.linalg.eigenpairs import dense_chosen
from nsa_dist.linalg.quadrature import quadrature_basis_bytes
from nsa_dist.ntk.blocks import ROW_CHUNK
from nsa_dist.ntk.shards import CHUNK_BYTES
from nsa_dist.pipeline import layout as _layout
from nsa_dist.pipeline.plan import constant_gram_applies, energy_route

__all__ = ["Footprint", "fc_sizes", "footprint", "check_fits"]


def fc_sizes(m: ModelSpec) -> tuple[int, int]:
    """(P, feature width) of a fully-connected net, by arithmetic over its layer widths d → w → …
    → w → K (``depth`` Linear layers, each with a bias).  The width is the structured features'
    numbers per point, Σ_l (pad8(n_in + 1) + K·pad8(n_out)) — the block features are zero-padded
    to multiples of 8 columns (:func:`~nsa_dist.ntk.blocks.feature_width` measures the same)."""
    d, w, K, L = m.input_dim, m.width, m.output_dim, m.depth
    shapes = [(d, K, 1)] if L == 1 else [(d, w, 1), (w, w, L - 2), (w, K, 1)]  # (n_in, n_out, how many)
    pad8 = lambda n: -(-n // 8) * 8  # noqa: E731
    P = sum(c * (n_in + 1) * n_out for n_in, n_out, c in shapes)
    width = sum(c * (pad8(n_in + 1) + K * pad8(n_out)) for n_in, n_out, c in shapes)
    return P, width


@dataclass(frozen=True)
class Footprint:
    """A run's estimated bytes per worker, by part, in the layout it would use."""

    layout: Layout
    parts: dict[str, float]
    P: int | None  # parameters (None: a factory model, unknown before it is built)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        """``G 12.3 GB, eigenvectors 0.1 GB, …`` — the parts over 1 MB, largest first."""
        big = sorted(((v, k) for k, v in self.parts.items() if v >= 1e6), reverse=True)
        return ", ".join(f"{k} {_gb(v)}" for v, k in big) or "under 1 MB"


def footprint(
    spec: ExperimentSpec,
    gang_in_process: bool = False,
    *,
    layout: Layout | None = None,
    width: int | None = None,
    P: int | None = None,
) -> Footprint:
    """The estimate of one worker's bytes for ``spec`` (see the module docstring).

    ``gang_in_process``: a distributed layout's members all live in this process (``nsa run``),
    so its W members' parts of G are counted, not one.  ``layout``, ``width``, ``P``: what the run's
    plan knows (the layout it will run — the recorded one of a resumed run —, the measured feature
    width, the built network's parameter count) in place of what the spec alone gives."""
    N, s = spec.data.n, spec.spectrum
    P0, width0 = fc_sizes(spec.model) if isinstance(spec.model, ModelSpec) else (_counted_params(spec), 0)
    P, width = (P0 if P is None else P), (width0 if width is None else width)
    lay = layout or _layout.choose_layout(spec, N, width, in_process=gang_in_process).layout
    quadrature = energy_route(spec, lay) == "quadrature"
    q = s.quadrature
    k = (min(q.top, N) if quadrature else N) if s.k == "all" else min(int(s.k), N)
    G = _layout.layout_bytes(spec, N, width)[lay]
    parts = {f"G ({lay.value} layout)": G}
    W = s.workers
    if lay is not Layout.LOCAL:
        item = np.dtype(s.dtype).itemsize
        if gang_in_process and W > 1:
            parts[f"gang members in this process (W = {W}: {W - 1} × their own part more)"] = (
                _layout.held_bytes(spec, N, width, lay, True) - G
            )
        if isinstance(spec.model, ModelSpec) and lay is Layout.MATRIX_FREE:
            # the pass runs while earlier ranges' features are kept (block_rows: before any tile exists,
            # so below the tiles it is not counted on top of them)
            per_range = -(-N // W)  # a member's shard
            outs = (spec.model.depth - 1) * spec.model.width + spec.model.output_dim
            parts["feature pass (transient)"] = float(min(ROW_CHUNK, per_range) * (width + outs) * item)
        if lay is Layout.MATRIX_FREE:
            # each product's chunk temporary (J_s U: points × columns × outputs), capped by bytes
            members = W if gang_in_process else 1
            parts["matrix_free products (transient)"] = float(CHUNK_BYTES * members)
    parts["eigenvectors"] = 8.0 * N * k
    if lay is Layout.LOCAL and (s.k == "all" and not quadrature or dense_chosen(s.eig_method, k, N)):
        # the reduction's own temporaries beside G and V (LAPACK's workspace, the tridiagonal's
        # vectors): measured ~0.9·N² numbers at N = 8,000, k: all (2.09 GB above the process's
        # 0.31 GB against 1.64 GB counted without them — Audit B's "1.5–2× uncounted")
        parts["dense eigensolver (transient)"] = float(N) * N * np.dtype(s.dtype).itemsize
    parts.update(_test_points(spec, lay, width, k, gang_in_process))
    parts["data"] = 16.0 * (N + spec.data.n_test) * (spec.data.input_dim or spec.model.input_dim or 0)
    if quadrature:
        outputs = max(1, int(getattr(spec.model, "output_dim", 1)))
        parts["quadrature Lanczos basis"] = quadrature_basis_bytes(
            N, q.lanczos_steps, q.block_size, phi_steps=q.phi_steps, phi_columns=5 * outputs, probes=q.probes
        )
    if P is not None:
        slots = {OptimizerName.ADAM: 2, OptimizerName.SGD: 1}.get(OptimizerName(spec.optimizer.name), 0)
        parts[f"parameters (P = {P:,})"] = 4.0 * P * (4 + slots)
        if spec.hessian is not None:
            parts["Hessian probes"] = 8.0 * P * (spec.hessian.probes + spec.hessian.lanczos_steps)
    if DataName(spec.data.name) in (DataName.IMAGE2D, DataName.DENSITY2D):
        parts["eigenvector images"] = 8.0 * len(s.images) * (s.image_size**2 + s.fourier_size**2)
    return Footprint(lay, parts, P)


_log = logging.getLogger("nsa_dist")
_WARNED: set[tuple[str, str, float]] = set()  # (run, layout, budget) said over the budget once per process


def check_fits(spec: ExperimentSpec, gang_in_process: bool = False, **known: Any) -> Footprint:
    """Refuse a run that cannot fit before anything of it is allocated; its :class:`Footprint` otherwise.
    ``gang_in_process``: as in :func:`footprint` (``nsa run``: True; a Ray sweep's members each
    have a process of their own); ``known``: what the plan knows (:func:`footprint`'s ``layout``,
    ``width``, ``P``, as :func:`~nsa_dist.pipeline.session.prepare_run` passes them).

    Raises:
        ResourceError: the estimate exceeds this machine's memory, or (``layout: auto`` with
            ``memory_budget_gb``) the Gram exceeds the per-worker budget in every layout.  An explicit
            layout over the budget is run as set, with a warning.
    """
    fp = footprint(spec, gang_in_process, **known)
    machine = _layout._machine_bytes()
    if fp.total > machine:
        largest = max(fp.parts, key=fp.parts.get).split(" ")[0]
        gang = any(k.startswith("gang ") for k in fp.parts)
        where = "in this process" if gang else "on one worker"
        if gang and largest in ("G", "matrix_free"):  # in one process more workers do not help: the gang's advice
            largest = "gang"
        fix = _FIX[largest]
        if largest == "gang" and fp.layout is Layout.BLOCK_ROWS:
            fix = "use spectrum.layout 'matrix_free' (a member holds only its shard's features); " + fix
        raise ResourceError(
            f"run {spec.name!r} needs ~{_gb(fp.total)} {where} ({fp.describe()}), more than "
            f"this machine's {_gb(machine)}; {fix}"
        )
    budget = spec.spectrum.memory_budget_gb
    G = next(v for key, v in fp.parts.items() if key.startswith("G "))
    if budget and G > budget * 1e9 and Layout(spec.spectrum.layout) is not Layout.AUTO:
        # an explicit layout is run as set — a run recorded with it resumes, which a refusal would have
        # orphaned (every way out changes the run's id: a review) — but never in silence (Audit B: the
        # budget was ignored without a word)
        said = (spec.name, fp.layout.value, budget)
        if said not in _WARNED:
            _WARNED.add(said)
            more = "use a gang layout with more" if fp.layout is Layout.LOCAL else "raise"
            _log.warning(
                "run %r: its Gram needs ~%s per worker as %s, more than spectrum.memory_budget_gb=%g (%s): the "
                "layout set is run as it is (layout 'auto' chooses one within the budget; or %s spectrum.workers)",
                spec.name,
                _layout.size_text(G),
                fp.layout.value,
                budget,
                _layout.size_text(budget * 1e9),
                more,
            )
    elif budget and G > budget * 1e9:
        fix = "lower data.n, or raise spectrum.workers or the budget"
        if fp.layout is Layout.LOCAL:  # G stays whole on one worker: more workers cannot help
            fix = "raise the budget or lower data.n"
            if spec.spectrum.k == "all" and spec.spectrum.energy.value == "exact":
                fix += (
                    " (k: all with energy: exact needs the whole G on one worker; energy: quadrature "
                    "or auto takes k: all on every layout)"
                )
        raise ResourceError(
            f"run {spec.name!r}: its Gram needs ~{_layout.size_text(G)} per worker even as {fp.layout.value}, "
            f"more than spectrum.memory_budget_gb={budget:g} ({_layout.size_text(budget * 1e9)}); {fix}"
        )
    return fp


_FIX = {
    "G": "lower data.n, or use spectrum.layout 'matrix_free' (or 'auto') with more spectrum.workers",
    "gang": (
        "its gang's members all live in this process (nsa run): run it with `nsa sweep` on a Ray "
        "cluster of several machines (one process per member), or lower data.n"
    ),
    "feature": "raise spectrum.workers (smaller ranges per feature pass), or lower model.width",
    "matrix_free": "run it where a worker has more memory (a member's product temporaries take up to 32 MB)",
    "eigenvectors": "lower spectrum.k (or quadrature.top)",
    "dense": "lower data.n, take k: all by spectrum.energy 'quadrature', or a top-k below N/3 (Lanczos)",
    "quadrature": "lower spectrum.quadrature.lanczos_steps, block_size or phi_steps",
    "data": "lower data.n",
    "test-point": "lower data.n_test, or set spectrum.test_points false",
    "test": "lower data.n_test, or set spectrum.test_points false",
    "parameters": "lower model.width / model.depth",
    "Hessian": "lower hessian.probes / hessian.lanczos_steps",
    "eigenvector": "lower spectrum.image_size / spectrum.fourier_size",
}


def _counted_params(spec: ExperimentSpec) -> int | None:
    """P of a network known only once built: a Tracker's spec records its count (``n_params``)."""
    n = spec.model.kwargs.get("n_params") if spec.model.source == "tracker" else None
    return int(n) if isinstance(n, int) else None


def _test_points(spec: ExperimentSpec, lay: Layout, width: int, k: int, gang_in_process: bool) -> dict[str, float]:
    """What ``spectrum.test_points`` adds to the train Gram's parts.  Held whole, the test Gram
    has a buffer of its own beside the train Gram's, kept from step to step (M·M numbers); where
    App. E is measured (GD without momentum on the L2 loss) it first assembles the (M, N) cross
    kernel there at t0, so M·max(M, N).  On a gang the test Gram is assembled after the train
    Gram is closed: only what it needs beyond G counts.  Its top min(k, M) eigenvectors too."""
    M, N, s = spec.data.n_test, spec.data.n, spec.spectrum
    if not (s.test_points and M):
        return {}
    if lay is Layout.LOCAL:
        held = M * (max(M, N) if constant_gram_applies(spec) else M) * np.dtype(s.dtype).itemsize
    else:
        held = max(
            0.0,
            _layout.held_bytes(spec, M, width, lay, gang_in_process)
            - _layout.held_bytes(spec, N, width, lay, gang_in_process),
        )
    return {"test-point Gram": float(held), "test eigenvectors": 8.0 * M * min(k, M)}


def _gb(b: float) -> str:
    return f"{b / 1e9:.3g} GB"
