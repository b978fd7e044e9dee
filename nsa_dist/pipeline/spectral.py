"""Spectral analysis of one recorded step: G_t, its eigenpairs and the NSA paper's metrics (no Ray, no store)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.nn.utils import vector_to_parameters

from nsa_dist.config import Layout
from nsa_dist.data import Dataset
from nsa_dist.hessian.moments import hutchpp_moments
from nsa_dist.linalg import HostWorkspace, SpectrumRoute, StepSpectrum, atoms_density, spectral_curves, step_spectrum
from nsa_dist.losses import is_nce, training_residual as loss_residual
from nsa_dist.metrics import (
    alignment_from_products,
    centered_sq_frobenius,
    energy_from_projections,
    first_order_accuracy,
    reconstruction_ks,
    top_k_reconstructions,
)
from nsa_dist.models import build_model
from nsa_dist.ntk import gram, jacobian_vector_product, prepare_model
from nsa_dist.ntk.kernel_change import gram_change
from nsa_dist.pipeline.checkpoint import Checkpoint
from nsa_dist.pipeline.diagnostics import StepNotes
from nsa_dist.pipeline.hessian_step import GramKnowledge, HessianAnalysis
from nsa_dist.pipeline.images import eigen_images
from nsa_dist.pipeline.layout import DenseGram, LocalPool, Pool, ShardedCurvature, ShardedGram, StepGram, TiledGram
from nsa_dist.pipeline.model_state import model_inputs
from nsa_dist.pipeline.nsa_extras import test_point_prediction
from nsa_dist.pipeline.plan import RunPlan
from nsa_dist.pipeline.step_extras import StepExtras, predicted_update
from nsa_dist.pipeline.trainer import CHUNK_POINTS
from nsa_dist.store import step_specs
from nsa_dist.store.records import GramStep, HessianStep, ImageStep, KernelExtras, StepResult, not_computed

__all__ = ["SpectralAnalyzer"]


class SpectralAnalyzer:
    """Computes every per-step quantity of a run from a :class:`Checkpoint`.

    ``analyze(ck, pool)`` returns a dict of numpy arrays keyed by store array name (see
    :mod:`nsa_dist.store.schema`); it holds a model whose parameters it overwrites with θ_t.
    With ``spectrum.layout`` ``block_rows`` or ``matrix_free`` (or ``auto`` resolving to one)
    G_t lives on a gang of :class:`~nsa_dist.pipeline.shard.SpectralShard` members (``pool``;
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
        self._local_pool: LocalPool | None = None
        self.timings: dict[str, float] = {}  # seconds of the last analysed step, by part (gram, eigenpairs, …)
        self.n_products: dict[str, int] = {}  # the last step's eigensolver products with G ("train", "test")
        # the last step's route by Gram: "tridiagonal" | "one_vector" | "eigenpairs"
        self.eig_route: dict[str, str] = {}
        self._workspace = HostWorkspace()  # the host solver's big blocks, reused by every step and Gram
        self._warm: dict[str, np.ndarray] = {}  # spectrum.warm_start: the last Lanczos eigenvectors, by Gram
        self._notes = StepNotes(plan.run_id, None)  # why the step being analysed has NaN diagnostics
        self.route, self.solver = SpectrumRoute(route), solver

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

    def _step_gram(self, which: str, theta: np.ndarray, pool: Pool | None) -> StepGram:
        """G at the training (or test) points in the run's layout: whole here, or on the gang."""
        if not self.distributed:
            return DenseGram(self._gram(self.X if which == "train" else self.X_test, which))
        n, s = (self.data.n if which == "train" else self.X_test.shape[0]), self.spec.spectrum
        gang, dtype = self._pool(pool, n), np.dtype(s.dtype)
        if self.plan.layout.layout is Layout.BLOCK_ROWS:
            return TiledGram(gang, self.plan, theta, which, n, dtype)
        return ShardedGram(gang, self.plan, theta, which, n, dtype, s.frobenius_probes, self.spec.seed)

    def _pool(self, pool: Pool | None, n: int) -> Pool:
        """The gang to use: the caller's, else an in-process one of ``spectrum.workers`` members."""
        if pool is not None:
            return pool
        if self._local_pool is None:
            from nsa_dist.pipeline.shard import SpectralShard

            self._local_pool = LocalPool(
                [SpectralShard(model=self.model, data=self.data) for _ in range(self.spec.spectrum.workers)]
            )
        return self._local_pool

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
        self.n_products[which], self.eig_route[which] = sp.n_matvec, sp.route
        return sp

    def _needs_vectors(self, ck: Checkpoint) -> bool:
        """Whether this step uses all K training eigenvectors: it stores them (the plan's
        eigenvector steps), or App. E's constant-Gram prediction at t = 0."""
        return self.plan.stores_eigenvectors(ck.index) or (ck.index == 0 and self.plan.has("constant_gram_f_test"))

    def _jvp_outputs(self, dtheta: np.ndarray) -> np.ndarray:
        """J_t · dθ at the training points (first-order change of f for any optimizer)."""
        X = self.X.to(self.dtype) if self.X.is_floating_point() else self.X  # token ids stay integers
        same = next(self.model.parameters()).dtype == self.dtype
        model = self.model if same else prepare_model(self.model, self.dtype)
        dtheta = torch.as_tensor(dtheta)
        c = X.shape[0] if self.plan.coupled else CHUNK_POINTS  # coupled: one batch
        return (
            torch.cat([jacobian_vector_product(model, X[s : s + c], dtheta) for s in range(0, X.shape[0], c)])
            .cpu()
            .numpy()
        )

    def analyze(self, ck: Checkpoint, pool: Pool | None = None) -> StepResult:
        """Every quantity of recorded step ``ck.index``; ``pool``: the gang of a distributed layout.

        G_t, its spectrum and the energies are the measurement; everything else is a diagnostic
        (:mod:`~nsa_dist.pipeline.diagnostics`): one that cannot be computed at this step is
        stored as NaN with its reason in ``step_notes``, and the step goes on."""
        p = next(self.model.parameters())
        vector_to_parameters(torch.as_tensor(ck.theta, dtype=p.dtype, device=self.device), self.model.parameters())
        if ck.model_state is not None:  # a Tracker's model: its buffers and modes at t, not at construction
            ck.model_state.apply(self.model)
        self.timings = {}
        notes = self._notes = StepNotes(self.plan.run_id, ck.step)
        with self._timed("gram"):
            G = self._step_gram("train", ck.theta, pool)
        known = None
        try:
            gram_step, extras, images = self._gram_metrics(G, ck, self.data.n)
            if self.hessian.wanted(ck.index):
                known = notes.guard(self._part_names(ck, HessianStep), self._gram_for_hessian, G, gram_step.eigenvalues)
        finally:
            G.close()
        if self.plan.has("eigenvalues_test"):
            with self._timed("test_points"):
                test = notes.guard(("eigenvalues_test", "energy_f_test"), self._test_spectrum, ck, pool)
            if test is not None:
                gram_step = dataclasses.replace(gram_step, **test)
        hessian = None
        if self.hessian.wanted(ck.index):
            with self._timed("hessian"):
                hessian = notes.guard(self._part_names(ck, HessianStep), self._hessian, ck, pool, known)
        return self._with_notes(StepResult(gram_step, extras, hessian, images), ck, notes)

    def _test_spectrum(self, ck: Checkpoint, pool: Pool | None) -> dict[str, np.ndarray]:
        """The test Gram's eigenvalues and E(f_test, k) (NSA Fig. 3e)."""
        G_t = self._step_gram("test", ck.theta, pool)
        try:
            sp_t = self._spectrum(G_t, self.plan.dims.k_test, "test", {"f_test": ck.f_test}, False)
        finally:
            G_t.close()
        return {
            "eigenvalues_test": sp_t.evals,
            "energy_f_test": energy_from_projections(sp_t.proj["f_test"], ck.f_test),
        }

    def _expected(self, ck: Checkpoint) -> set[str]:
        """The arrays this step must hand the writer."""
        return set(
            step_specs(
                self.plan.dims,
                eigenvectors=self.plan.stores_eigenvectors(ck.index),
                hessian=self.hessian.wanted(ck.index),
                first=ck.index == 0,
            )
        )

    def _part_names(self, ck: Checkpoint, part: type) -> tuple[str, ...]:
        """The arrays of record type ``part`` that this step writes."""
        expected = self._expected(ck)
        return tuple(f.name for f in dataclasses.fields(part) if f.name in expected)

    def _with_notes(self, result: StepResult, ck: Checkpoint, notes: StepNotes) -> StepResult:
        """``result`` with every noted array that this step writes as NaN, and ``step_notes``."""
        if not notes.reasons:
            return dataclasses.replace(result, gram=dataclasses.replace(result.gram, step_notes=""))
        expected = self._expected(ck)
        arrays = result.arrays()
        arrays.update({n: not_computed(n, self.plan.dims) for n in notes.reasons if n in expected})
        arrays["step_notes"] = notes.json()
        return StepResult.from_arrays(arrays)

    @contextmanager
    def _timed(self, part: str) -> Iterator[None]:
        """Add the wall time of the block to ``self.timings[part]`` (seconds of the last step's parts)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[part] = self.timings.get(part, 0.0) + time.perf_counter() - t0

    def _gram_for_hessian(self, G: StepGram, evals: np.ndarray) -> GramKnowledge | None:
        """What the Hessian step can reuse of G for the exact Tr(I^k) (one output, MSE, float64 G):
        its whole spectrum (k: all — the eigenvalues just computed — or one eigvalsh of the
        dense G), or with block_rows the exact tile trace and ‖G‖_F²; None otherwise."""
        if not self.hessian.gram_reusable:
            return GramKnowledge(distributed=True) if self.distributed else None
        if isinstance(G, DenseGram):
            if self.dtype != torch.float64:
                return None
            if self.spec.spectrum.k == "all" and self.plan.energy_route == "exact":
                return GramKnowledge(evals=np.asarray(evals, np.float64))
            return GramKnowledge(evals=torch.linalg.eigvalsh(G.G).detach().cpu().numpy().astype(np.float64))
        if isinstance(G, TiledGram):
            stats = G.trace_stats()
            return GramKnowledge(trace=stats["trace"], sq_frobenius=stats["sq_frobenius"], distributed=True)
        return GramKnowledge(distributed=True)

    def _gram_metrics(self, G: StepGram, ck: Checkpoint, N: int) -> tuple[GramStep, KernelExtras, ImageStep | None]:
        """Eigenpairs, energies, first-order prediction, alignment: products with G only.  The
        step's φ come first, so that a ``k: all`` step without stored eigenvectors projects them
        during the factorisation instead of forming V."""
        with self._timed("metrics"):
            residual = loss_residual(self.spec, self.data, ck.f)  # m_t = ∂ℓ/∂f (f_t − y for L2)
            Y = self.y.reshape(N, -1)
            probes = np.column_stack([Y, np.ones(N)] + ([residual] if residual.ndim == 1 else []))  # (N, C + 1 [+ 1])
            GP = np.asarray(G.matmat(probes), dtype=np.float64)  # one (distributed) product for all of them
            C = Y.shape[1]
            df_pred = self._notes.guard(
                ("df_pred", "energy_df_pred", "first_order_error", "first_order_cos"),
                predicted_update,
                self.spec,
                ck,
                residual,
                lambda v: GP[:, C + 1],
                self._jvp_outputs,
            )  # NSA Eq. 3
            phis = {"y": self.energy_target, "f": ck.f, "residual": residual, "df": ck.df, "df_pred": df_pred}
        with self._timed("eigenpairs"):
            sp = self._spectrum(
                G, self.K, "train", {k: v for k, v in phis.items() if v is not None}, self._needs_vectors(ck)
            )
        curves = {}
        if self.plan.has("curve_k"):
            with self._timed("quadrature"):
                curves = self._curves(G, sp, phis)
        with self._timed("metrics"):
            gram_step, extras, images = self._metrics(G, ck, N, sp, phis, GP[:, :C], GP[:, C])
        return (dataclasses.replace(gram_step, **curves) if curves else gram_step), extras, images

    def _curves(self, G: StepGram, sp: StepSpectrum, phis: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        """The quadrature route of ``k: all``: λ_k and E_t(φ, k) at every reported k with their brackets,
        and G's SLQ density, from the exact top K and products with G (:mod:`nsa_dist.linalg.quadrature`)."""
        q = self.spec.spectrum.quadrature
        if sp.evecs is None:  # K = N (quadrature.top ≥ N): every eigenpair is exact
            return _exact_curves(sp, phis, self.plan.curve_k(), q.density_grid)
        c = spectral_curves(
            G.G if isinstance(G, DenseGram) else G,
            sp.evals,
            sp.evecs,
            phis,
            self.plan.curve_k(),
            lanczos_steps=q.lanczos_steps,
            probes=q.probes,
            confidence=q.confidence,
            density_grid=q.density_grid,
            seed=self.spec.seed,
            block_size=q.block_size,
        )
        self.n_products["quadrature"] = c.n_products
        out = {
            "curve_eigenvalue": c.eigenvalue.value,
            "curve_eigenvalue_lower": c.eigenvalue.lower,
            "curve_eigenvalue_upper": c.eigenvalue.upper,
            "gram_density_grid": c.density_grid,
            "gram_density": c.density,
        }
        for name in ("y", "f", "residual", "df", "df_pred"):
            b = c.energy[name]
            out.update(
                {
                    f"curve_energy_{name}": b.value,
                    f"curve_energy_{name}_lower": b.lower,
                    f"curve_energy_{name}_upper": b.upper,
                }
            )
        return out

    def _metrics(
        self,
        G: StepGram,
        ck: Checkpoint,
        N: int,
        sp: StepSpectrum,
        phis: dict[str, np.ndarray],
        GY: np.ndarray,
        G1: np.ndarray,
    ) -> tuple[GramStep, KernelExtras, ImageStep | None]:
        residual, df_pred, notes = phis["residual"], phis["df_pred"], self._notes
        fro2, fro2_se = G.sq_frobenius()
        out: dict[str, Any] = {
            "loss": ck.loss,
            "lr": ck.lr,
            "f": ck.f,
            "df": ck.df,
            "f_test": ck.f_test,
            "eigenvalues": sp.evals,
            "gram_sq_frobenius": np.array([fro2, fro2_se]),
            **{
                f"energy_{name}": energy_from_projections(sp.proj[name], phi)
                for name, phi in phis.items()
                if phi is not None
            },
        }
        if df_pred is not None:
            out["df_pred"] = df_pred
            finite = np.isfinite(ck.df).all() and np.any(ck.df)  # df is NaN when update t diverged
            acc = (
                notes.guard(
                    ("first_order_error", "first_order_cos"),
                    first_order_accuracy,
                    ck.df.reshape(-1),
                    np.asarray(df_pred).reshape(-1),
                )
                if finite
                else None
            )
            out.update(first_order_error=acc.error if acc else np.nan, first_order_cos=acc.cos_alpha if acc else np.nan)
        out["alignment"] = notes.guard(("alignment",), alignment_from_products, self.y, GY, fro2)
        out["alignment_centered"] = notes.guard(
            ("alignment_centered",), self._centered_alignment, G, GY, G1, fro2, fro2_se
        )
        if self.plan.stores_eigenvectors(ck.index):
            out["eigenvectors"] = sp.evecs.astype(np.float32)
            out.update(self._at_eigenvector_step(ck, sp.evecs))
        if ck.index == 0 and self.plan.has("constant_gram_f_test"):  # App. E, Eq. 22
            out["constant_gram_f_test"] = notes.guard(
                ("constant_gram_f_test",), self._test_point_prediction, sp, residual, ck
            )
        extras = notes.guard(
            self._part_names(ck, KernelExtras),
            self.extras.analyze,
            self.model,
            self.X,
            ck,
            sp.proj["residual"],
            residual,
        )
        images = None
        if self.images is not None:
            V = np.column_stack([sp.columns[i - 1] for i in self.images.indices])  # (N, nI)
            images = notes.guard(self._part_names(ck, ImageStep), self.images.render, V, residual.reshape(N, -1)[:, 0])
        out = {k: v for k, v in out.items() if v is not None}
        return GramStep(**out), extras or KernelExtras(), images

    def _test_point_prediction(self, sp: StepSpectrum, residual: np.ndarray, ck: Checkpoint) -> np.ndarray:
        """App. E's Eq. 22 at t0; the steps where it diverges (δλ_i/N > 2 long enough to overflow
        float64) are NaN, and the step's notes say from which step on."""
        pred, diverged = test_point_prediction(
            self.model,
            self.X,
            self.X_test,
            sp.evals,
            sp.evecs,
            residual,
            ck.f_test,
            self.spec,
            self.dtype,
            out=self._cross_buffer(),
            route=self.plan.ntk_route,
        )
        if diverged is not None:
            self._notes.note(("constant_gram_f_test",), diverged)
        return pred

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

    def _at_eigenvector_step(self, ck: Checkpoint, evecs: np.ndarray) -> dict[str, Any]:
        """Fig. 4d's f̄_{t,k} (and their images on 2-D data), App. F's dG_t on the top Kg eigenvectors."""
        R = top_k_reconstructions(evecs, ck.f, reconstruction_ks(self.K))  # (nR, N[, Ko])
        out: dict[str, Any] = {"reconstructions": R.astype(np.float32)}
        if self.plan.has("reconstruction_images"):
            out["reconstruction_images"] = self.images.image(R.reshape(R.shape[0], self.data.n, -1)[..., 0].T).astype(
                np.float32
            )  # (nR, R, R)
        if self.plan.has("gram_change"):
            out.update(
                self._notes.guard(
                    ("gram_change", "gram_change_fro"),
                    gram_change,
                    self.model,
                    self.X,
                    ck.theta,
                    ck.dtheta,
                    evecs[:, : self.plan.dims.k_gram_change],
                    self.dtype,
                )
                or {}
            )
        return out

    def _centered_alignment(self, G: StepGram, GY: np.ndarray, G1: np.ndarray, fro2: float, fro2_se: float) -> float:
        """Centred alignment.  With an estimated ‖G‖_F (matrix_free: ``fro2_se`` > 0) ‖HGH‖_F² is
        estimated directly: ‖G‖_F² − 2‖G1‖²/N + (1ᵀG1)²/N² would cancel the estimate's error into it."""
        if fro2_se == 0.0:
            hgh2 = centered_sq_frobenius(fro2, G1)
        else:
            hgh2 = float(
                hutchpp_moments(
                    _Centered(G), self.spec.spectrum.frobenius_probes, max_order=2, seed=self.spec.seed
                ).estimate[1]
            )
        return alignment_from_products(self.y, GY, hgh2, centered=True, G1=G1)

    def _hessian(self, ck: Checkpoint, pool: Pool | None, gram: GramKnowledge | None = None) -> HessianStep:
        """H = I + S at this step: on the model here (local) or summed over the gang's data shards."""
        if not self.distributed:
            return self.hessian.analyze(self.model, gram=gram, step=ck.step, notes=self._notes)
        curv = ShardedCurvature(self._pool(pool, self.data.n), self.plan, ck.theta, self.data.n, self.n_params)
        try:
            return self.hessian.analyze(
                self.model,
                ops={p: curv.part(p) for p in ("H", "I", "S")},
                gram=gram or GramKnowledge(distributed=True),
                step=ck.step,
                notes=self._notes,
            )
        finally:
            curv.close()


def _exact_curves(
    sp: StepSpectrum, phis: dict[str, np.ndarray | None], ks: np.ndarray, n_grid: int
) -> dict[str, np.ndarray]:
    """The curve arrays when every eigenpair is known (lower = upper = value), the density of the eigenvalues."""
    lam = sp.evals[ks - 1]
    out = {"curve_eigenvalue": lam, "curve_eigenvalue_lower": lam, "curve_eigenvalue_upper": lam}
    for name in ("y", "f", "residual", "df", "df_pred"):
        phi = phis.get(name)
        E = (
            energy_from_projections(sp.proj[name], phi)[ks - 1]
            if phi is not None and name in sp.proj
            else np.full(ks.size, np.nan)
        )
        out.update({f"curve_energy_{name}": E, f"curve_energy_{name}_lower": E, f"curve_energy_{name}_upper": E})
    out["gram_density_grid"], out["gram_density"] = atoms_density(sp.evals, np.ones(sp.evals.size), n_grid)
    return out


class _Centered:
    """HGH with H = 1 − 11ᵀ/N, as an operator (for the Hutch++ estimate of ‖HGH‖_F²)."""

    def __init__(self, G: StepGram) -> None:
        self.G, self.shape = G, G.shape

    def matmat(self, V: np.ndarray) -> np.ndarray:
        V = V - V.mean(axis=0, keepdims=True)
        W = np.asarray(self.G.matmat(V), dtype=np.float64)
        return W - W.mean(axis=0, keepdims=True)
