"""Spectral analysis of one recorded step: G_t, its eigenpairs and the NSA paper's metrics (no Ray, no store).

The analyzer holds a run's analysis state in one process (its network copy, the prepared inputs,
the renderer, the solver's workspace and warm starts) and composes the producers of
:mod:`nsa_dist.pipeline.producers`, each quantity of a step made from one
:class:`~nsa_dist.pipeline.producers.StepContext`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import numpy as np
import torch
from torch.nn.utils import vector_to_parameters

from nsa_dist.config import NTKMethod
from nsa_dist.data import Dataset
from nsa_dist.linalg import HostWorkspace, SpectrumRoute
from nsa_dist.losses import is_nce
from nsa_dist.ntk import NTKRoute, batch_decides, gram
from nsa_dist.pipeline import producers as P
from nsa_dist.pipeline.checkpoint import Checkpoint
from nsa_dist.pipeline.diagnostics import StepNotes
from nsa_dist.pipeline.hessian_step import HessianAnalysis
from nsa_dist.pipeline.layout import Gang, LocalGang
from nsa_dist.pipeline.materials import RunMaterials
from nsa_dist.pipeline.plan import RunPlan
from nsa_dist.pipeline.step_extras import StepExtras
from nsa_dist.store.records import GramStep, HessianStep, ImageStep, KernelExtras, StepResult

log = logging.getLogger(__name__)

__all__ = ["SpectralAnalyzer"]


class SpectralAnalyzer:
    """Computes every per-step quantity of a run from a :class:`Checkpoint`.

    ``analyze(ck, gang)`` returns the step's :class:`~nsa_dist.store.records.StepResult`.  The
    network is the caller's (``model``: a Tracker's copy) or a copy of the run's own
    (:class:`~nsa_dist.pipeline.materials.RunMaterials`); its parameters are overwritten with θ_t.
    On a distributed layout (the plan's) G_t lives on a gang of
    :class:`~nsa_dist.pipeline.member.SpectralShard` members (``gang``; in-process when none is
    given) and every metric is computed from products, never from G.

    ``route`` and ``solver``: the routes a step's spectrum may take and T's divide and conquer
    (:func:`~nsa_dist.linalg.step_spectrum`; "auto", what a run uses: the fastest that applies;
    benchmarks compare the others).
    """

    def __init__(
        self,
        plan: RunPlan,
        data: Dataset,
        model: torch.nn.Module | None = None,
        *,
        route: str | SpectrumRoute = "auto",
        solver: str = "auto",
    ) -> None:
        self.plan, self.spec, self.data = plan, plan.spec, data
        self.device, self.dtype, self.K = torch.device(plan.device), plan.torch_dtype, plan.K
        self.materials = RunMaterials.load(plan, data=data, model=model)
        self.model = (model if model is not None else self.materials.network()).to(self.device)
        self.X = self.materials.inputs("train", self.model, self.device)  # (N, …): float in the model's dtype, or ids
        self.X_test = self.materials.inputs("test", self.model, self.device)  # (M, …) like X
        self.y = np.asarray(data.y, dtype=np.float64)
        # φ = y of E_t(y, k): for NCE the log-density centred over the points (its additive constant,
        # arbitrary for an unnormalised density, would otherwise carry most of ‖y‖²)
        self.energy_target = self.y - self.y.mean(axis=0) if is_nce(self.spec) else self.y
        self.images = self.materials.renderer(plan) if plan.has("eigvec_images") else None
        self.hessian, self.extras = HessianAnalysis(plan, self.X, self.y), StepExtras(plan, data)
        self.cost = P.StepCost()  # the last step's timings, eigensolver products and routes
        self.route, self.solver = SpectrumRoute(route), solver
        self._workspace = HostWorkspace()  # the host solver's big blocks, reused by every step and Gram
        self._warm: dict[str, np.ndarray] = {}  # spectrum.warm_start: the last Lanczos eigenvectors, by Gram
        self._local_gang: LocalGang | None = None  # the in-process gang, made at the first distributed step
        self.logged: set[str] = set()  # the run-wide remarks already logged (once per run)
        self.rounding_checked_lr: float | None = None  # the rate the float32 update's rounding was last checked at

    timings = property(lambda self: self.cost.timings, doc="Seconds of the last analysed step, by part.")
    n_products = property(lambda self: self.cost.n_products, doc="Eigensolver products with G, by Gram.")
    eig_route = property(lambda self: self.cost.eig_route, doc="The spectrum's route, by Gram.")
    distributed = property(lambda self: self.plan.distributed, doc="Whether G_t lives on a gang.")

    # a step's spectrum and App. E's cross-kernel buffer: producers bound to this analyzer's state
    # (its workspace and warm starts), called (or replaced) on one analyzer
    _spectrum, _cross_buffer = P.spectrum, P.cross_buffer

    def _gram(self, X: torch.Tensor, which: str | None = None) -> torch.Tensor:
        """G at X on the analysis device, on the plan's NTK route (eigenpairs are computed there:
        cuSOLVER/CuPy on a GPU).  ``which`` ("train" / "test"): on the host, in the workspace's
        buffer for that Gram, reused at every step (valid until the next step's); None: a new tensor."""
        n, block = X.shape[0], self.spec.spectrum.block_size
        out = (
            self._workspace.empty(f"gram.{which}", (n, n), self.dtype) if which and self.device.type == "cpu" else None
        )
        route = self.test_route if which == "test" else self.plan.ntk_route
        return gram(self.model, X, method=route, block_size=block, dtype=self.dtype, out=out)

    @functools.cached_property
    def test_route(self) -> NTKRoute:
        """The NTK route at the test points: the run's (probed on the training points), or the batch
        route when a forward over the test points decides over their batch (``if x.max() > 1``)
        where the training points' did not — each test point alone is then another function
        (:func:`~nsa_dist.ntk.batch_decides`; checked once, at the first test Gram, as the training
        points' at the probe).  App. E's cross kernel takes it too."""
        route = self.plan.ntk_route
        if route.method is NTKMethod.BATCH or self.X_test is None or self.X_test.shape[0] < 2:
            return route
        why = batch_decides(self.model, self.X_test)
        if why is None:
            return route
        log.info("run %r: at the test points %s: their Gram is the batch forward's", self.spec.name, why)
        return route.whole_batch(why)

    def analyze(self, ck: Checkpoint, gang: Gang | None = None) -> StepResult:
        """Every quantity of recorded step ``ck.index``; ``gang``: the gang of a distributed layout.

        G_t, its spectrum and the energies are the measurement; everything else is a diagnostic
        (:mod:`~nsa_dist.pipeline.diagnostics`): one that cannot be computed at this step is
        stored as NaN with its reason in ``step_notes``, and the step goes on."""
        p = next(self.model.parameters())
        vector_to_parameters(torch.as_tensor(ck.theta, dtype=p.dtype, device=self.device), self.model.parameters())
        if ck.model_state is not None:  # a Tracker's model: its buffers and modes at t, not at construction
            ck.model_state.apply(self.model)
        self.cost.timings = {}
        notes, hessian_names = StepNotes(self.plan.run_id, ck.step), P.part_names(self, ck, HessianStep)
        wants_hessian = self.hessian.wanted(ck.index)
        with self.cost.timed("gram"):
            G = P.step_gram(self, "train", ck.theta, gang)
        known = None
        try:
            gram_step, extras, images = self._compose(P.step_context(self, ck, G, notes))
            if wants_hessian:
                known = notes.guard(hessian_names, P.gram_knowledge, self, G, gram_step.eigenvalues)
        finally:
            G.close()
        if self.plan.has("eigenvalues_test"):
            with self.cost.timed("test_points"):
                names = ("eigenvalues_test", "energy_f_test") + (
                    ("curve_energy_f_test", "curve_energy_f_test_lower", "curve_energy_f_test_upper")
                    if self.plan.has("curve_k_test")
                    else ()
                )
                test = notes.guard(names, P.test_spectrum, self, ck, gang)
            if test is not None:
                gram_step = dataclasses.replace(gram_step, **test)
        hessian = None
        if wants_hessian:
            with self.cost.timed("hessian"):
                hessian = notes.guard(hessian_names, P.hessian, self, ck, gang, notes, known)
        return P.with_notes(self, StepResult(gram_step, extras, hessian, images), ck, notes)

    def _compose(self, ctx: P.StepContext) -> tuple[GramStep, KernelExtras, ImageStep | None]:
        """The step's records from its producers, in the order their float results depend on."""
        curves, plan, index = {}, self.plan, ctx.ck.index
        if plan.has("curve_k"):
            with self.cost.timed("quadrature"):
                curves = P.quadrature_curves(ctx)
        with self.cost.timed("metrics"):
            out = {**P.gram_spectrum(ctx), **P.first_order(ctx), **P.kernel_alignment(ctx)}
            if plan.stores_eigenvectors(index):
                out.update({**P.stored_eigenvectors(ctx), **P.reconstructions(ctx), **P.eigenbasis_gram_change(ctx)})
            if index == 0 and plan.has("constant_gram_f_test"):  # App. E, Eq. 22
                out["constant_gram_f_test"] = P.constant_gram_prediction(ctx)
            extras, images = P.kernel_extras(ctx), P.eigenvector_images(ctx)
            gram_step = GramStep(**{k: v for k, v in out.items() if v is not None})
        return (dataclasses.replace(gram_step, **curves) if curves else gram_step), extras, images
