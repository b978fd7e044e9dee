"""The plan of one run, built once from its validated spec, its data and its network.

A :class:`RunPlan` is what every role of a run receives — the trainer, the analyzer, a gang's
shards, the writer, the sweep coordinator and the Tracker — instead of each rebuilding the run
from its spec: the run id, the spec (validated once), every array size (:class:`RunDims`), the
recording schedule, the Hessian steps, the eigenpair count, the eigenvector images, the
analysis layout with its reason, and the NTK route (the forward-pass probe's result).  It is
frozen and small (no arrays, no network), so it crosses Ray by value.  Building it needs the
data's shapes and one network (for the parameter count and the NTK route that decides the
layout), never a Trainer or an analyzer.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass

import numpy as np
import torch
from pydantic import BaseModel

from nsa_dist.config import EnergyRoute, ExperimentSpec, Layout, LossName, OptimizerName, is_id_neutral
from nsa_dist.data import Dataset
from nsa_dist.metrics import reconstruction_ks
from nsa_dist.ntk import NTKMethod, NTKRoute, resolve_route
from nsa_dist.ntk.blocks import feature_width
from nsa_dist.pipeline.images import image_indices
from nsa_dist.pipeline.layout import BATCH_ASKED, COUPLES, LayoutChoice, choose_layout
from nsa_dist.pipeline.materials import RunMaterials
from nsa_dist.pipeline.model_state import model_inputs
from nsa_dist.store import RunDims, run_arrays

__all__ = [
    "RunPlan",
    "plan_run",
    "run_id",
    "id_json",
    "spec_json",
    "spectrum_size",
    "slot_names",
    "energy_route",
    "TRACKED_RNG_BYTES",
]

TRACKED_RNG_BYTES = 1  # a tracked run has no trainer RNG; its resume state is θ alone
_TRAINER_RNG_BYTES = int(torch.Generator().get_state().numel())  # the trainer's minibatch RNG state


def _tracked(spec: ExperimentSpec) -> bool:
    """Whether ``spec`` is a Tracker's (its network is the user's, ``model.source: tracker``)."""
    return getattr(spec.model, "source", "factory") == "tracker"


def spec_json(spec: ExperimentSpec) -> dict:
    """The spec as plain JSON (enums as their values)."""
    return json.loads(spec.model_dump_json())


def id_json(spec: BaseModel) -> dict:
    """The spec as hashed by :func:`run_id`: :func:`spec_json` less every field marked
    :data:`~nsa_dist.config.ID_NEUTRAL` that holds its default.

    A field added after runs were stored is marked so: a spec that leaves it at its default keeps
    the id it had before the field existed (its stored runs are found and resumed), and a spec that
    sets it gets a new id, as any change of what is measured must."""
    out = json.loads(spec.model_dump_json())
    _prune_neutral(spec, out)
    return out


def _prune_neutral(m: BaseModel, out: dict) -> None:
    for name, field in type(m).model_fields.items():
        value = getattr(m, name)
        if isinstance(value, BaseModel) and isinstance(out.get(name), dict):
            _prune_neutral(value, out[name])
        elif is_id_neutral(field) and value == field.get_default(call_default_factory=True):
            out.pop(name, None)


def run_id(spec: ExperimentSpec) -> str:
    """Stable id: the run name and a hash of the spec (same spec → same id; :func:`id_json`).  A
    tracked run (``model.source: tracker``) is named by its user: its id is its name (reopening
    continues)."""
    if _tracked(spec):
        return spec.name
    digest = hashlib.sha1(json.dumps(id_json(spec), sort_keys=True).encode()).hexdigest()[:10]
    return f"{spec.name}-{digest}"


def constant_gram_applies(spec: ExperimentSpec) -> bool:
    """Whether App. E / Eqs. 4–5 describe the run: full-batch GD without momentum on the L2 loss,
    one output.  With Ko > 1 outputs GD moves the stacked residual by the full (N·Ko)×(N·Ko)
    kernel J Jᵀ, not by the output-traced Gram Σ_a J_a J_aᵀ whose eigenpairs the run records (its
    λ_max is up to Ko times larger): the prediction from them would decay too fast, and call runs
    divergent that are not, so it is not made (as for SGD, Adam, momentum and other losses).  Nor
    for a Tracker's run: the prediction needs δ_s at every update s, and a Tracker sees δ_t only at
    its recorded steps (its spec's schedule is a placeholder: a run recorded at δ = 0.1 was predicted
    at 0.25, 6.6–10 % off)."""
    opt = spec.optimizer
    return (
        not _tracked(spec)
        and LossName(spec.loss) is LossName.L2
        and OptimizerName(opt.name) is OptimizerName.GD
        and opt.momentum == 0
        and spec.model.output_dim == 1
    )


def energy_route(spec: ExperimentSpec, layout: Layout) -> str:
    """How E_t(φ, k) is measured: "quadrature" for ``k: all`` on a gang layout or with ``energy:
    quadrature`` (the top ``quadrature.top`` exactly, brackets beyond), else "exact"."""
    s = spec.spectrum
    if s.k != "all":
        return "exact"
    energy = EnergyRoute(s.energy)
    if energy is EnergyRoute.QUADRATURE or (energy is EnergyRoute.AUTO and Layout(layout) is not Layout.LOCAL):
        return "quadrature"
    return "exact"


def spectrum_size(spec: ExperimentSpec, n: int, layout: Layout = Layout.LOCAL) -> int:
    """K, the number of eigenpairs kept at n points; ``spectrum.k`` > n keeps n, with a warning.
    ``k: all`` keeps n on the exact route, ``quadrature.top`` (≤ n) on the quadrature route."""
    if spec.spectrum.k == "all":
        return min(spec.spectrum.quadrature.top, n) if energy_route(spec, layout) == "quadrature" else n
    k = int(spec.spectrum.k)
    if k > n and (spec.name, k, n) not in _WARNED:
        _WARNED.add((spec.name, k, n))
        import logging

        # the default k (a spec without `spectrum.k`) is only noted: a warning naming
        # "spectrum.k=100" blamed the user for a number they never wrote
        default = "k" not in spec.spectrum.model_fields_set
        logging.getLogger("nsa_dist").log(
            logging.INFO if default else logging.WARNING,
            "run %r: spectrum.k=%d%s is larger than the %d training points; keeping all K=%d eigenpairs",
            spec.name,
            k,
            " (the default)" if default else "",
            n,
            n,
        )
    return min(k, n)


_WARNED: set[tuple] = set()


def slot_names(spec: ExperimentSpec) -> tuple[str, ...]:
    """Names of the per-parameter optimizer state tensors a spec run's resume state keeps."""
    o = spec.optimizer
    if _tracked(spec):
        return ()  # the user's own update: θ alone
    if OptimizerName(o.name) is OptimizerName.ADAM:
        return ("exp_avg", "exp_avg_sq")
    return ("momentum_buffer",) if o.momentum > 0 else ()


@dataclass(frozen=True)
class RunPlan:
    """Everything a role needs to know about a run besides its data and network.

    Attributes:
        run_id: the store's name of the run.
        spec: the validated experiment spec.
        spec_json: ``spec`` as plain JSON (what the store records and compares).
        dims: every array size of the run (the store's schema is derived from it).
        record: the recorded training steps, in order.
        hessian_indices: the recorded-step indices whose Hessian is measured.
        K: eigenpairs kept per step.
        image_indices: the eigenvectors drawn as images (1-based; empty without 2-D data).
        layout: where G_t lives (local, block_rows, matrix_free) and why.
        feature_width: the block features' numbers per point, measured on the network (what the
            layout and the memory check weigh; 0 for a network that couples samples).
        ntk_route: the NTK route the network takes, resolved once by the forward-pass probe
            (:func:`~nsa_dist.ntk.resolve_route`): every Gram of the run — training, test and
            cross kernels, on any process — is computed on it, never probing again.
        data_fingerprint: the fingerprint of the data the run holds, set when the run is opened
            (:func:`~nsa_dist.pipeline.session.prepare_run`): a process that loads the data
            again from its source for this plan — a Ray worker, a replaced gang member — is
            refused other data (:meth:`~nsa_dist.pipeline.materials.RunMaterials.load`).
    """

    run_id: str
    spec: ExperimentSpec
    spec_json: dict
    dims: RunDims
    record: tuple[int, ...]
    hessian_indices: frozenset[int]
    K: int
    image_indices: tuple[int, ...]
    layout: LayoutChoice
    ntk_route: NTKRoute
    feature_width: int = 0  # numbers per point of the block features (0: no per-layer features)
    data_fingerprint: str | None = None  # the run's data (Dataset.fingerprint), once the run is opened

    @property
    def ntk_method(self) -> str:
        """The NTK method the network takes (an ``NTKMethod`` value)."""
        return self.ntk_route.method.value

    @property
    def ntk_paths(self) -> dict:
        """Which parameter took which NTK path, and why (recorded with the run)."""
        r = self.ntk_route
        return {"method": r.method.value, "routes": {k: f"{p}: {why}" for k, (p, why) in r.routes.items()}}

    @functools.cached_property
    def eigenvector_steps(self) -> tuple[bool, ...]:
        """Per recorded step (``record``'s order), whether it stores its eigenvectors: the mask the
        store keeps as ``eigenvector_steps``, and the analyzer's one answer to "does step t store them"."""
        s = self.spec.spectrum
        return tuple(bool(s.eigenvectors_at(int(t))) for t in self.record)

    def stores_eigenvectors(self, index: int) -> bool:
        """Whether recorded step ``index`` (0-based, into ``record``) stores its eigenvectors."""
        return self.eigenvector_steps[index]

    def needs_eigenvectors(self, index: int) -> bool:
        """Whether recorded step ``index`` uses all K training eigenvectors: it stores them, or it
        is t0 with App. E's constant-Gram prediction."""
        return self.stores_eigenvectors(index) or (index == 0 and self.has("constant_gram_f_test"))

    @property
    def device(self) -> str:
        """Where the run trains and is analysed ("cuda" only when torch sees a GPU)."""
        return self.spec.torch_device()

    @property
    def whole_spectrum(self) -> bool:
        """Whether every step computes all N eigenvalues of the dense G (``k: all`` on the exact route)."""
        return self.spec.spectrum.k == "all" and self.energy_route == "exact"

    @functools.cached_property
    def arrays(self) -> frozenset[str]:
        """The names of the run's arrays (:func:`~nsa_dist.store.run_arrays` of its sizes)."""
        return frozenset(a.name for a in run_arrays(self.dims))

    def has(self, array: str) -> bool:
        """Whether the run stores ``array`` — the one answer to "is this quantity measured", decided
        by its step record's field (:mod:`nsa_dist.store.records`)."""
        return array in self.arrays

    @property
    def energy_route(self) -> str:
        """ "exact" | "quadrature" (:func:`energy_route` of the run's layout)."""
        return energy_route(self.spec, self.layout.layout)

    def curve_k(self) -> np.ndarray:
        """The reported k of the quadrature route's curves (empty on the exact route)."""
        if not self.dims.curve_points:
            return np.zeros(0, dtype=np.int64)
        from nsa_dist.linalg.quadrature import curve_ks

        return curve_ks(self.dims.N, self.spec.spectrum.quadrature.curve_points)

    def curve_k_test(self) -> np.ndarray:
        """The reported k of E_t(f_test, k) on the quadrature route (the test Gram's log grid to M;
        empty when its top k_test is all of it or there are no test points)."""
        if not self.dims.curve_points_test:
            return np.zeros(0, dtype=np.int64)
        from nsa_dist.linalg.quadrature import curve_ks

        return curve_ks(self.dims.M, self.spec.spectrum.quadrature.curve_points)

    def energy_attrs(self) -> dict:
        """The run attributes saying how E_t(φ, k) was measured and how its brackets are guaranteed."""
        if self.energy_route != "quadrature":
            return {
                "energy_route": "exact",
                "curve_bracket": "exact: every eigenvalue and projection of the whole G (lower = upper = value)",
            }
        from nsa_dist.linalg.quadrature import BRACKET_SENTENCE

        q = self.spec.spectrum.quadrature
        return {
            "energy_route": "quadrature",
            "curve_bracket": BRACKET_SENTENCE.format(c=q.confidence),
            "curve_confidence": float(q.confidence),
        }

    @property
    def distributed(self) -> bool:
        """Whether G_t is analysed on a gang (block_rows / matrix_free) rather than held whole."""
        return self.layout.layout is not Layout.LOCAL

    @property
    def coupled(self) -> bool:
        """Whether the network couples samples (its kernel is that of one whole batch)."""
        return self.ntk_method == NTKMethod.BATCH.value

    @property
    def torch_dtype(self) -> torch.dtype:
        """The analysis precision (``spectrum.dtype``)."""
        return self.spec.spectrum.torch_dtype()

    def with_layout(self, layout: str, reason: str) -> RunPlan:
        """The plan with the layout the run was created with (``auto`` is resolved once, by whoever
        created the run, and stored), not the one this machine's memory would choose."""
        return dataclasses.replace(self, layout=LayoutChoice(Layout(layout), reason))

    def static_arrays(self, data: Dataset) -> dict[str, np.ndarray]:
        """The arrays written once when the run is created: the data (X flattened to (N, d)) and
        which recorded steps write what (steps, eigenvector_steps with Fig. 4d's reconstruction_k,
        hessian_steps)."""
        N, M, d = self.dims.N, self.dims.M, self.dims.d
        out = {
            "X": np.asarray(data.X).reshape(N, d),
            "y": data.y,
            "X_test": np.asarray(data.X_test).reshape(M, d),
            "y_test": data.y_test,
            "image_indices": np.asarray(self.image_indices, dtype=np.int64),
            "steps": np.asarray(self.record, dtype=np.int64),
        }
        if self.has("eigenvector_steps"):
            out["eigenvector_steps"] = np.array(self.eigenvector_steps, dtype=bool)
            out["reconstruction_k"] = np.asarray(reconstruction_ks(self.K), dtype=np.int64)
        if self.has("hessian_steps"):
            out["hessian_steps"] = np.isin(np.arange(len(self.record)), sorted(self.hessian_indices))
        if self.has("curve_k"):
            out["curve_k"] = self.curve_k()
        if self.has("curve_k_test"):
            out["curve_k_test"] = self.curve_k_test()
        return out


def plan_run(
    spec: ExperimentSpec,
    data: Dataset | None = None,
    model: torch.nn.Module | None = None,
    *,
    materials: RunMaterials | None = None,
    gang_in_process: bool = False,
) -> RunPlan:
    """The plan of ``spec`` on ``data``.

    Args:
        spec: a validated spec (a Tracker's ``model.source: tracker`` spec for a tracked run).
        data: the run's points (only shapes and, for eigenvector images, the 2-D coordinates are read).
        model: the run's network (a Tracker's, or one the caller built and keeps); else the run's
            prototype from :class:`~nsa_dist.pipeline.materials.RunMaterials` (built once per
            process).  Only its parameter count and NTK route are read.
        materials: the run's materials already loaded (they give ``data``, ``model`` and the id).
        gang_in_process: a gang layout's members will all live in this process (``layout: auto``
            weighs their sum, :func:`~nsa_dist.pipeline.layout.choose_layout`).

    Raises:
        ValueError: ``spectrum.layout`` names a distributed layout for a network that couples samples.
    """
    if materials is None:
        materials = RunMaterials.load(spec, data=data, model=model)
    data, model = materials.data, materials.prototype
    N, M = data.n, int(np.asarray(data.X_test).shape[0])
    P = sum(p.numel() for p in model.parameters())
    record = tuple(spec.record_steps())
    # the probe takes the first distinct points among the first 64 (repeated points hide a coupling), and
    # compares every point alone with the batch of all of them (a decision over the whole batch)
    X4 = model_inputs(np.asarray(data.X[:64]), model)  # on the network's device, as it is
    X_all = model_inputs(np.asarray(data.X), model)
    route = resolve_route(model, X_all, spec.spectrum.ntk_method)  # the run's one probe of the forward pass
    coupled = next(iter(route.routes.values()))[1] if route.method is NTKMethod.BATCH else None
    asked = NTKMethod(spec.spectrum.ntk_method) is NTKMethod.BATCH
    if coupled is not None and asked and not coupled.startswith(COUPLES):
        # asked for, not found by the probe: the route's reason is then a layer's ("Linear used once; …"), which
        # the layout's error and reason read as the model's coupling (an audit)
        coupled = BATCH_ASKED
    width = 0 if coupled else feature_width(model, X4[:2], route)
    layout = choose_layout(spec, N, width, coupled, in_process=gang_in_process)
    K = spectrum_size(spec, N, layout.layout)
    images = image_indices(spec, data, K)
    nI = len(images)
    s, h, Ko = spec.spectrum, spec.hessian, spec.model.output_dim
    curve = energy_route(spec, layout.layout) == "quadrature"
    if curve:
        from nsa_dist.linalg.quadrature import curve_ks
    k_test = min(K, M) if spec.spectrum.test_points and M else 0
    dims = RunDims(
        N=N,
        M=M,
        d=int(np.prod(np.asarray(data.X).shape[1:])),
        Ko=spec.model.output_dim,
        P=P,
        S=len(record),
        T=spec.steps,
        K=K,
        k_test=k_test,
        n_images=nI,
        image_size=spec.spectrum.image_size if nI else 0,
        fourier_size=spec.spectrum.fourier_size if nI else 0,
        n_slots=len(slot_names(spec)),
        rng_bytes=TRACKED_RNG_BYTES if _tracked(spec) else _TRAINER_RNG_BYTES,
        store_eigenvectors=bool(s.store_eigenvectors),
        k_full=min(int(s.full_k), N * Ko) if Ko > 1 else 0,  # the full NK×NK kernel's top eigenvalues
        k_class=min(int(s.per_class_k), N) if Ko > 1 else 0,  # per diagonal block Θ_aa
        k_gram_change=min(int(s.gram_change_k), K),  # App. F: dG_t on the top eigenvectors
        constant_gram=constant_gram_applies(spec),
        hessian=h is not None,
        hessian_I_k=N * Ko if h else 0,  # eigenvalues of I: measured and limit
        hessian_top_k=min(h.top_k, P - 1) if h else 0,
        hessian_rayleigh_k=min(h.rayleigh_k, P - 1) if h else 0,
        hessian_density_bins=h.density_grid if h and h.density else 0,
        hessian_moments=h is None or bool(h.moments),
        hessian_orthogonality=h is None or bool(h.orthogonality),
        hessian_additivity=h is None or bool(h.additivity),
        hessian_trace_G=h is None or bool(h.trace_G),
        curve_points=len(curve_ks(N, s.quadrature.curve_points)) if curve else 0,
        gram_density_bins=s.quadrature.density_grid if curve else 0,
        # the test Gram on the same route: its top k_test exact, brackets beyond (Fig. 3e to M)
        curve_points_test=len(curve_ks(M, s.quadrature.curve_points)) if curve and 0 < k_test < M else 0,
        state_dtype="float64"
        if _tracked(spec) and any(p.dtype == torch.float64 for p in model.parameters())
        else "float32",
    )
    return RunPlan(
        run_id=materials.run_id,
        spec=spec,
        spec_json=spec_json(spec),
        dims=dims,
        record=record,
        hessian_indices=frozenset(h.indices(list(record))) if h else frozenset(),
        K=K,
        image_indices=images,
        layout=layout,
        ntk_route=route,
        feature_width=width,
    )
