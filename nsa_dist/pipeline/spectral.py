"""Spectral analysis of one recorded step: G_t, its eigenpairs and the NSA paper's metrics (no Ray, no store).

The analyzer owns the run's materials and the eigensolver route; each quantity of a step is made by
a producer of :mod:`nsa_dist.pipeline.producers` from one :class:`~nsa_dist.pipeline.producers.StepContext`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch.nn.utils import vector_to_parameters

from nsa_dist.config import Layout
from nsa_dist.data import Dataset
from nsa_dist.linalg import HostWorkspace, SpectrumRoute, StepSpectrum, step_spectrum
from nsa_dist.losses import is_nce
from nsa_dist.models import build_model
from nsa_dist.ntk import gram
from nsa_dist.pipeline import producers as P
from nsa_dist.pipeline.checkpoint import Checkpoint
from nsa_dist.pipeline.diagnostics import StepNotes
from nsa_dist.pipeline.hessian_step import HessianAnalysis
from nsa_dist.pipeline.images import eigen_images
from nsa_dist.pipeline.layout import DenseGram, Gang, LocalGang, ShardedGram, StepGram, TiledGram
from nsa_dist.pipeline.model_state import model_inputs
from nsa_dist.pipeline.plan import RunPlan
from nsa_dist.pipeline.step_extras import StepExtras
from nsa_dist.store.records import GramStep, HessianStep, ImageStep, KernelExtras, StepResult

__all__ = ["SpectralAnalyzer"]


class SpectralAnalyzer:
    """Computes every per-step quantity of a run from a :class:`Checkpoint`.

    ``analyze(ck, gang)`` returns a dict of numpy arrays keyed by store array name (see
    :mod:`nsa_dist.store.schema`); it holds a model whose parameters it overwrites with θ_t.
    With ``spectrum.layout`` ``block_rows`` or ``matrix_free`` (or ``auto`` resolving to one)
    G_t lives on a gang of :class:`~nsa_dist.pipeline.member.SpectralShard` members (``gang``;
    in-process when none is given) and every metric is computed from products, never from G.

    ``route`` and ``solver``: the routes a step's spectrum may take and T's divide and conquer
    (:func:`~nsa_dist.linalg.step_spectrum`; "auto": the fastest that applies — at a ``k: all``
    step that needs no eigenvectors, one tridiagonalisation, without Q for one φ — which is what
    a run uses; benchmarks compare the others).
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
        spec = plan.spec
        self.plan, self.spec, self.data = plan, spec, data
        self.device = torch.device(spec.torch_device())
        # ``model``: a built network (a Tracker's; its parameters get overwritten), else built from the spec
        self.model = (model if model is not None else build_model(spec.model, seed=spec.seed)).to(self.device)
        self.dtype = plan.torch_dtype
        self.X = model_inputs(data.X, self.model, self.device)  # (N, …): the model's float dtype, or integer ids
        self.X_test = model_inputs(
            np.asarray(data.X_test).reshape((-1,) + tuple(data.X.shape[1:])), self.model, self.device
        )  # (M, …) like X
        self.y = np.asarray(data.y, dtype=np.float64)
        # φ = y of E_t(y, k): for NCE the log-density centred over the points (its additive constant,
        # arbitrary for an unnormalised density, would otherwise carry most of ‖y‖²)
        self.energy_target = self.y - self.y.mean(axis=0) if is_nce(spec) else self.y
        self.K = plan.K
        self.images = eigen_images(spec, data, self.K) if plan.has("eigvec_images") else None  # the renderer
        self.n_params = plan.dims.P
        self.hessian = HessianAnalysis(plan, self.X, self.y)
        self.extras = StepExtras(plan, data)
        self._local_gang: LocalGang | None = None
        self.cost = P.StepCost()  # the last step's timings, eigensolver products and routes
        self._workspace = HostWorkspace()  # the host solver's big blocks, reused by every step and Gram
        self._warm: dict[str, np.ndarray] = {}  # spectrum.warm_start: the last Lanczos eigenvectors, by Gram
        self._notes = StepNotes(plan.run_id, None)  # why the step being analysed has NaN diagnostics
        self.route, self.solver = SpectrumRoute(route), solver

    timings = property(lambda self: self.cost.timings, doc="Seconds of the last analysed step, by part.")
    n_products = property(lambda self: self.cost.n_products, doc="Eigensolver products with G, by Gram.")
    eig_route = property(lambda self: self.cost.eig_route, doc="The spectrum's route, by Gram.")

    @property
    def distributed(self) -> bool:
        """Whether G_t is analysed on a gang (block_rows / matrix_free) rather than held whole."""
        return self.plan.distributed

    def _gram(self, X: torch.Tensor, which: str | None = None) -> torch.Tensor:
        """G at X on the analysis device (eigenpairs are computed there: cuSOLVER/CuPy on a GPU).
        ``which`` ("train" / "test"): on the host, in the workspace's buffer for that Gram, reused
        at every step (valid until the next step's); None: a new tensor."""
        s = self.spec.spectrum
        n = X.shape[0]
        on_host = which is not None and self.device.type == "cpu"
        out = self._workspace.empty(f"gram.{which}", (n, n), self.dtype) if on_host else None
        return gram(self.model, X, method=self.plan.ntk_route, block_size=s.block_size, dtype=self.dtype, out=out)

    def _step_gram(self, which: str, theta: np.ndarray, gang: Gang | None) -> StepGram:
        """G at the training (or test) points in the run's layout: whole here, or on the gang."""
        if not self.distributed:
            return DenseGram(self._gram(self.X if which == "train" else self.X_test, which))
        n, s = (self.data.n if which == "train" else self.X_test.shape[0]), self.spec.spectrum
        gang, dtype = self._gang(gang, n), np.dtype(s.dtype)
        if self.plan.layout.layout is Layout.BLOCK_ROWS:
            return TiledGram(gang, self.plan, theta, which, n, dtype)
        return ShardedGram(gang, self.plan, theta, which, n, dtype, s.frobenius_probes, self.spec.seed)

    def _gang(self, gang: Gang | None, n: int) -> Gang:
        """The gang to use: the caller's, else an in-process one of ``spectrum.workers`` members."""
        if gang is not None:
            return gang
        if self._local_gang is None:
            from nsa_dist.pipeline.member import SpectralShard

            self._local_gang = LocalGang(
                [SpectralShard(model=self.model, data=self.data) for _ in range(self.spec.spectrum.workers)]
            )
        return self._local_gang

    def _spectrum(self, G: StepGram, k: int, which: str, phis: dict[str, np.ndarray], vectors: bool) -> StepSpectrum:
        """Eigenvalues and ⟨v_i, φ⟩ of the step's φ by :func:`~nsa_dist.linalg.step_spectrum`: at a
        `k: all` step that needs no eigenvectors from one tridiagonalisation (the cost of eigvalsh),
        else from the eigenpairs, where Lanczos starts from this Gram's last eigenvectors with
        ``spectrum.warm_start``.  ``vectors``: the step needs all of V."""
        s = self.spec.spectrum
        idx = tuple(i - 1 for i in self.images.indices) if self.images is not None and which == "train" else ()
        sp = step_spectrum(
            G.G if isinstance(G, DenseGram) else G,
            k,
            phis,
            vectors=vectors,
            indices=idx,
            route=self.route,
            solver=self.solver,
            method=s.eig_method,
            start=self._warm.get(which) if s.warm_start else None,
            workspace=self._workspace,
        )
        if s.warm_start and sp.method is not None and sp.method.value == "lanczos":
            self._warm[which] = sp.evecs
        self.cost.n_products[which], self.cost.eig_route[which] = sp.n_matvec, sp.route
        return sp

    def needs_vectors(self, ck: Checkpoint) -> bool:
        """Whether this step uses all K training eigenvectors: it stores them (the plan's
        eigenvector steps), or App. E's constant-Gram prediction at t = 0."""
        return self.plan.stores_eigenvectors(ck.index) or (ck.index == 0 and self.plan.has("constant_gram_f_test"))

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
        notes = self._notes = StepNotes(self.plan.run_id, ck.step)
        hessian_names = P.part_names(self, ck, HessianStep)
        with self.cost.timed("gram"):
            G = self._step_gram("train", ck.theta, gang)
        known = None
        try:
            gram_step, extras, images = self._compose(P.step_context(self, ck, G, notes))
            if self.hessian.wanted(ck.index):
                known = notes.guard(hessian_names, P.gram_knowledge, self, G, gram_step.eigenvalues)
        finally:
            G.close()
        if self.plan.has("eigenvalues_test"):
            with self.cost.timed("test_points"):
                test = notes.guard(("eigenvalues_test", "energy_f_test"), P.test_spectrum, self, ck, gang)
            if test is not None:
                gram_step = dataclasses.replace(gram_step, **test)
        hessian = None
        if self.hessian.wanted(ck.index):
            with self.cost.timed("hessian"):
                hessian = notes.guard(hessian_names, P.hessian, self, ck, gang, notes, known)
        return P.with_notes(self, StepResult(gram_step, extras, hessian, images), ck, notes)

    def _compose(self, ctx: P.StepContext) -> tuple[GramStep, KernelExtras, ImageStep | None]:
        """The step's records from its producers, in the order their float results depend on."""
        curves = {}
        if self.plan.has("curve_k"):
            with self.cost.timed("quadrature"):
                curves = P.quadrature_curves(ctx)
        with self.cost.timed("metrics"):
            out = {**P.gram_spectrum(ctx), **P.first_order(ctx), **P.kernel_alignment(ctx)}
            if self.plan.stores_eigenvectors(ctx.ck.index):
                out.update({**P.stored_eigenvectors(ctx), **P.reconstructions(ctx), **P.eigenbasis_gram_change(ctx)})
            if ctx.ck.index == 0 and self.plan.has("constant_gram_f_test"):  # App. E, Eq. 22
                out["constant_gram_f_test"] = P.constant_gram_prediction(ctx)
            extras, images = P.kernel_extras(ctx), P.eigenvector_images(ctx)
            gram_step = GramStep(**{k: v for k, v in out.items() if v is not None})
        return (dataclasses.replace(gram_step, **curves) if curves else gram_step), extras, images

    def _cross_buffer(self) -> torch.Tensor | None:
        """Where App. E's cross kernel g(X_test, 𝒳) (M, N) is assembled whole: on the host with G
        held whole and the test Gram measured, that Gram's workspace buffer — free until the test
        half, which overwrites it later in the step (reallocated there when M ≠ N, once per run:
        App. E runs at t0 only), so the training points' features are computed once and no fresh
        pages are touched; None (blocks of rows, transient) without test Grams (a buffer would stay
        held for nothing), on a gang, where G is too large to hold, or on a GPU."""
        if self.distributed or self.device.type != "cpu" or not self.plan.has("eigenvalues_test"):
            return None
        return self._workspace.empty("gram.test", (self.X_test.shape[0], self.data.n), self.dtype)
