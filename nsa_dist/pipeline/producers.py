"""One producer per per-step quantity, composed by :class:`~nsa_dist.pipeline.spectral.SpectralAnalyzer`.

:func:`step_gram` makes a step's G in the plan's layout (whole, by the analyzer, or on the gang
of :func:`step_gang`), :func:`spectrum` its eigenvalues and projections;
:func:`step_context` builds a step's :class:`StepContext` once (G, the checkpoint, the residual,
G times the probes, the φ and the spectrum); each producer below takes it and returns its record
(or the arrays of its part of :class:`~nsa_dist.store.records.GramStep`):

* :func:`gram_spectrum` — the eigenvalues, ‖G‖_F² and the energies E_t(φ, k);
* :func:`first_order` — df̄_t and its accuracy against df_t;
* :func:`kernel_alignment` — the plain and centred kernel–target alignment;
* :func:`quadrature_curves` — the ``k: all`` quadrature route's curves and density;
* :func:`stored_eigenvectors`, :func:`reconstructions` (Fig. 4d), :func:`eigenbasis_gram_change` (App. F);
* :func:`constant_gram_prediction` — App. E's Eq. 22 at t0;
* :func:`kernel_extras` — :class:`~nsa_dist.store.records.KernelExtras`;
* :func:`eigenvector_images` — :class:`~nsa_dist.store.records.ImageStep`;
* :func:`test_spectrum`, :func:`gram_knowledge` and :func:`hessian` — the test Gram, what the
  Hessian reuses of G, and :class:`~nsa_dist.store.records.HessianStep`.

:class:`StepCost` is the diagnostics record of a step's cost (wall time by part, products, route).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.nn.utils import vector_to_parameters

from nsa_dist.config import Layout, OptimizerName
from nsa_dist.hessian.moments import hutchpp_moments
from nsa_dist.linalg import StepSpectrum, atoms_density, describe_width, spectral_curves, step_spectrum
from nsa_dist.losses import is_nce, training_residual as loss_residual
from nsa_dist.metrics import (
    alignment_from_products,
    centered_sq_frobenius,
    energy_from_projections,
    first_order_accuracy,
    reconstruction_ks,
    top_k_reconstructions,
)
from nsa_dist.ntk import jacobian_vector_product, prepare_model
from nsa_dist.ntk.kernel_change import gram_change
from nsa_dist.ntk.state import cast_copy, preserved
from nsa_dist.pipeline.checkpoint import Checkpoint
from nsa_dist.pipeline.diagnostics import StepNotes
from nsa_dist.pipeline.hessian_step import GramKnowledge
from nsa_dist.pipeline.layout import DenseGram, Gang, LocalGang, ShardedCurvature, ShardedGram, StepGram, TiledGram
from nsa_dist.pipeline.nsa_extras import test_point_prediction
from nsa_dist.pipeline.step_extras import predicted_update
from nsa_dist.pipeline.trainer import CHUNK_POINTS
from nsa_dist.store import step_specs
from nsa_dist.store.records import HessianStep, ImageStep, KernelExtras, StepResult, not_computed

log = logging.getLogger(__name__)

WIDE_BRACKET = 0.02  # E's bracket wider than this is logged with what it is made of (issue 37's target)

if TYPE_CHECKING:
    from nsa_dist.pipeline.spectral import SpectralAnalyzer

__all__ = [
    "StepContext",
    "StepCost",
    "constant_gram_prediction",
    "cross_buffer",
    "eigenvector_images",
    "first_order",
    "eigenbasis_gram_change",
    "gram_knowledge",
    "gram_spectrum",
    "hessian",
    "kernel_alignment",
    "kernel_extras",
    "part_names",
    "quadrature_curves",
    "reconstructions",
    "spectrum",
    "step_context",
    "step_gang",
    "step_gram",
    "stored_eigenvectors",
    "test_spectrum",
    "with_notes",
]


@dataclasses.dataclass
class StepCost:
    """A step's cost diagnostics: ``timings`` (seconds of the last analysed step, by part: gram,
    eigenpairs, …), ``n_products`` (eigensolver products with G by Gram, "train" / "test", and
    the quadrature's) and ``eig_route`` (the spectrum's route by Gram: "tridiagonal" |
    "one_vector" | "eigenpairs"); the last two keep earlier steps' entries."""

    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    n_products: dict[str, int] = dataclasses.field(default_factory=dict)
    eig_route: dict[str, str] = dataclasses.field(default_factory=dict)

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Add the wall time of the block to ``timings[part]``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[part] = self.timings.get(part, 0.0) + time.perf_counter() - t0


@dataclasses.dataclass
class StepContext:
    """What every producer of a step reads, built once by :func:`step_context`."""

    run: SpectralAnalyzer  # the run's materials (model, inputs, plan, renderer, workspace)
    ck: Checkpoint
    G: StepGram
    notes: StepNotes
    residual: np.ndarray  # m_t = ∂ℓ/∂f (f_t − y for L2)
    GP: np.ndarray  # G · [Y, 1 (, residual)], one product
    C: int  # output columns of Y
    phis: dict[str, np.ndarray | None]
    sp: StepSpectrum

    @property
    def N(self) -> int:
        return self.run.data.n

    @cached_property
    def sq_frobenius(self) -> tuple[float, float]:
        """‖G‖_F² and its standard error (0 when exact), computed at first use."""
        return self.G.sq_frobenius()


def step_gram(run: SpectralAnalyzer, which: str, theta: np.ndarray, gang: Gang | None) -> StepGram:
    """G at the training (or test) points in the plan's layout: whole here, or on the gang."""
    plan = run.plan
    # test points whose forward decides over their batch take the batch kernel, which a gang would
    # split: formed here (a training set that couples samples gets no gang at all)
    if not plan.distributed or (which == "test" and run.test_route.coupled):
        return DenseGram(run._gram(run.X if which == "train" else run.X_test, which))
    n, s = (run.data.n if which == "train" else run.X_test.shape[0]), run.spec.spectrum
    gang, dtype = step_gang(run, gang), np.dtype(s.dtype)
    if plan.layout.layout is Layout.BLOCK_ROWS:
        return TiledGram(gang, plan, theta, which, n, dtype)
    return ShardedGram(gang, plan, theta, which, n, dtype, s.frobenius_probes, run.spec.seed)


def step_gang(run: SpectralAnalyzer, gang: Gang | None) -> Gang:
    """The gang to use: the caller's, else the analyzer's in-process one of ``spectrum.workers``
    members, each handed the analyzer's materials and network."""
    if gang is not None:
        return gang
    if run._local_gang is None:
        from nsa_dist.pipeline.member import SpectralShard

        members = [SpectralShard(materials=run.materials, model=run.model) for _ in range(run.spec.spectrum.workers)]
        run._local_gang = LocalGang(members)
    return run._local_gang


def spectrum(
    run: SpectralAnalyzer, G: StepGram, k: int, which: str, phis: dict[str, np.ndarray], vectors: bool
) -> StepSpectrum:
    """Eigenvalues and ⟨v_i, φ⟩ of the step's φ by :func:`~nsa_dist.linalg.step_spectrum`: at a
    `k: all` step that needs no eigenvectors from one tridiagonalisation (the cost of eigvalsh),
    else from the eigenpairs, where Lanczos starts from this Gram's last eigenvectors with
    ``spectrum.warm_start``.  ``vectors``: the step needs all of V."""
    s = run.spec.spectrum
    idx = tuple(i - 1 for i in run.images.indices) if run.images is not None and which == "train" else ()
    sp = step_spectrum(
        G.G if isinstance(G, DenseGram) else G,
        k,
        phis,
        vectors=vectors,
        indices=idx,
        route=run.route,
        solver=run.solver,
        method=s.eig_method,
        start=run._warm.get(which) if s.warm_start else None,
        workspace=run._workspace,
    )
    if s.warm_start and sp.method is not None and sp.method.value == "lanczos":
        run._warm[which] = sp.evecs
    run.cost.n_products[which], run.cost.eig_route[which] = sp.n_matvec, sp.route
    return sp


def cross_buffer(run: SpectralAnalyzer) -> torch.Tensor | None:
    """Where App. E's cross kernel g(X_test, 𝒳) (M, N) is assembled whole: on the host with G
    held whole and the test Gram measured, that Gram's workspace buffer — free until the test
    half, which overwrites it later in the step (reallocated there when M ≠ N, once per run:
    App. E runs at t0 only), so the training points' features are computed once and no fresh
    pages are touched; None (blocks of rows, transient) without test Grams (a buffer would stay
    held for nothing), on a gang, where G is too large to hold, or on a GPU."""
    if run.plan.distributed or run.device.type != "cpu" or not run.plan.has("eigenvalues_test"):
        return None
    return run._workspace.empty("gram.test", (run.X_test.shape[0], run.data.n), run.dtype)


def _jvp_outputs(run: SpectralAnalyzer, dtheta: np.ndarray) -> np.ndarray:
    """J_t · dθ at the training points (first-order change of f for any optimizer)."""
    X = run.X.to(run.dtype) if run.X.is_floating_point() else run.X  # token ids stay integers
    same = next(run.model.parameters()).dtype == run.dtype
    model = run.model if same else prepare_model(run.model, run.dtype)
    dtheta = torch.as_tensor(dtheta)
    c = X.shape[0] if run.plan.coupled else CHUNK_POINTS  # coupled: one batch
    return (
        torch.cat([jacobian_vector_product(model, X[s : s + c], dtheta) for s in range(0, X.shape[0], c)]).cpu().numpy()
    )


def float64_change(run: SpectralAnalyzer, ck: Checkpoint) -> np.ndarray:
    """Δf_t = f(θ_t + Δθ_t) − f(θ_t) with the network evaluated in float64 at its (float32) parameters,
    or ``ck.df`` where that is not the same function.

    The trainer's Δf_t is f_{t+1} − f_t of two float32 forwards: at a small rate their difference is
    rounding (an audit: lr 1e-5 stored Δf_t 0.61 % off, the first order's error 6.2e-3 where the
    float64 change gives 1.03e-3, and 1 − E(Δf, 20) 3.96e-5 for 4.38e-6).  The float64 forward is
    used only where it is the trainer's function: both its outputs agree with the float32 ones to
    1e-4 of max|f| (not so for a 16-bit model or a Tracker's model whose forward reads other state) —
    else the float32 change is kept (logged once per run)."""
    f0, df = np.asarray(ck.f), np.asarray(ck.df)
    if f0.dtype == np.float64 or not df.size or not (np.isfinite(df).all() and np.isfinite(ck.dtheta).all()):
        return df
    try:
        model = prepare_model(run.model, torch.float64)
        model = cast_copy(model, torch.float64) if model is run.model else model  # never the analyzer's own
        X = run.X
        wide = (lambda v: v.to(torch.float64)) if X.is_floating_point() else (lambda v: v)  # noqa: E731 - ids stay
        p = next(model.parameters())
        theta = torch.as_tensor(np.asarray(ck.theta), dtype=torch.float64, device=p.device)
        step = torch.as_tensor(np.asarray(ck.dtheta), dtype=torch.float64, device=p.device)
        c = X.shape[0] if run.plan.coupled else CHUNK_POINTS
        outs = []
        with torch.no_grad(), preserved(model):  # a hook's writes to the user's objects put back
            for point in (theta, theta + step):
                vector_to_parameters(point, model.parameters())
                outs.append(torch.cat([model(wide(X[s : s + c])) for s in range(0, X.shape[0], c)]).cpu().numpy())
        g0, g1 = (np.asarray(o, np.float64).reshape(f0.shape) for o in outs)
        # the trainer's function to its float32 rounding (~1e-6 of max|f| for the paper's nets; 25× that)
        tol = 1e-4 * max(float(np.max(np.abs(f0))), float(np.finfo(np.float32).tiny))
        e0 = float(np.max(np.abs(g0 - f0)))
        e1 = float(np.max(np.abs(g1 - (f0.astype(np.float64) + df.astype(np.float64)))))
        if not (e0 <= tol and e1 <= tol):
            raise ValueError(f"the float64 forward differs from the trainer's outputs by {max(e0, e1):.3g}")
    except Exception as e:  # noqa: BLE001 — a diagnostic's refinement: the float32 change stays
        if "float64_change" not in run.logged:
            run.logged.add("float64_change")
            log.warning("run %r: Δf_t stays the trainer's float32 f_{t+1} − f_t: %s", run.spec.name, e)
        return df
    return g1 - g0


def step_context(run: SpectralAnalyzer, ck: Checkpoint, G: StepGram, notes: StepNotes) -> StepContext:
    """The residual, one product of G with all probes, df̄_t (NSA Eq. 3) and the spectrum.  The
    step's φ come first, so that a ``k: all`` step without stored eigenvectors projects them
    during the factorisation instead of forming V."""
    N = run.data.n
    if not np.isfinite(ck.dtheta).any():  # why the update's quantities are NaN: said with them
        made_of_update = ("df", "energy_df", "df_pred", "energy_df_pred", "first_order_error", "first_order_cos")
        notes.note(
            [n for n in (*made_of_update, "gram_change", "gram_change_fro") if run.plan.has(n)],
            f"step {ck.step}'s update Δθ_t is not known: the training loop's step {ck.step + 1} was not seen "
            f"after record({ck.step}) with the model moved (the loop ended, was interrupted, went on from another "
            "step, or updates every few steps — gradient accumulation counted in micro-batches: count optimizer "
            "steps), or the update diverged — Δf_t and what is made of Δθ_t are NaN",
        )
    elif not np.isfinite(ck.dtheta).all():  # Δθ finite in part: the update diverged at some parameters
        made_of_update = ("df", "energy_df", "df_pred", "energy_df_pred", "first_order_error", "first_order_cos")
        bad = int(np.size(ck.dtheta) - np.isfinite(ck.dtheta).sum())
        notes.note(
            [n for n in made_of_update if run.plan.has(n)],
            f"step {ck.step}'s update Δθ_t is not finite at {bad} of {np.size(ck.dtheta)} parameters (the update "
            "diverged) — Δf_t and what is made of Δθ_t are NaN",
        )
    elif not np.isfinite(ck.df).all():  # Δθ finite, f(θ_{t+1}) not: the update overflowed the outputs
        bad = int(np.size(ck.df) - np.isfinite(ck.df).sum())
        notes.note(
            [n for n in ("df", "energy_df", "first_order_error", "first_order_cos") if run.plan.has(n)],
            f"f(θ_{{t+1}}) after step {ck.step}'s update is not finite at {bad} of {np.size(ck.df)} outputs (the "
            "update diverged: its Δθ_t is finite, the outputs it leads to overflow) — Δf_t and what is compared "
            "with it are NaN; df̄_t = J_t Δθ_t is kept",
        )
    if not np.isfinite(ck.lr) and np.isfinite(ck.dtheta).all() and run.plan.has("lr"):
        notes.note(  # the Tracker's log said it once; the store says it at every such step
            ["lr"],
            f"δ_t of step {ck.step} is not known: the learning rate given is ambiguous (groups with different "
            "rates), or under optimizer='gd' the update made is not full-batch gradient descent at it (another "
            "optimizer, weight decay, clipping, mini-batches, another rate, a reduced-precision loop's rounding) — "
            "Δf_t is predicted as J_t Δθ_t of the update made",
            quiet=True,  # logged once by the Tracker (it was logged again at every such step: Audit K4)
        )
    with run.cost.timed("metrics"):
        ck = dataclasses.replace(ck, df=float64_change(run, ck))
        residual = loss_residual(run.spec, run.data, ck.f)
        Y = run.y.reshape(N, -1)
        probes = np.column_stack([Y, np.ones(N)] + ([residual] if residual.ndim == 1 else []))  # (N, C + 1 [+ 1])
        GP = np.asarray(G.matmat(probes), dtype=np.float64)  # one (distributed) product for all of them
        C = Y.shape[1]
        df_pred = notes.guard(
            ("df_pred", "energy_df_pred", "first_order_error", "first_order_cos"),
            predicted_update,
            run.spec,
            ck,
            residual,
            lambda v: GP[:, C + 1],
            lambda d: _jvp_outputs(run, d),
        )
        stored = np.abs(np.nan_to_num(np.asarray(df_pred, np.float64), nan=np.inf)) if df_pred is not None else None
        if stored is not None and not (stored <= _F32_MAX).all():  # J_t Δθ_t overflowed, or float32 storage would
            bad = int((~(stored <= _F32_MAX)).sum())
            notes.note(
                [n for n in ("df_pred", "energy_df_pred", "first_order_error", "first_order_cos") if run.plan.has(n)],
                f"df̄_t = J_t Δθ_t of step {ck.step} is not finite in float32 (as stored) at {bad} of {stored.size} "
                "outputs: an update that large overflows the first-order prediction",
            )
            df_pred = None
        phis = {"y": run.energy_target, "f": ck.f, "residual": residual, "df": ck.df, "df_pred": df_pred}
    _zero_phis(run, ck, phis, notes)
    with run.cost.timed("eigenpairs"):
        given = {k: v for k, v in phis.items() if v is not None}
        sp = run._spectrum(G, run.plan.K, "train", given, run.plan.needs_eigenvectors(ck.index))
    return StepContext(run, ck, G, notes, residual, GP, C, phis, sp)


_F32_MAX = float(np.finfo(np.float32).max)  # df̄_t is stored in float32: beyond this it would read ±inf
_ZERO_WHY = {
    "df": "the update changed no output (a zero learning rate, or no parameter moved)",
    "df_pred": "J_t Δθ_t is 0 (Δθ_t = 0: a zero learning rate, or no parameter moved)",
    "residual": "the loss's gradient in f is 0 (the outputs fit the targets exactly)",
    "f": "the network's outputs are 0 (e.g. a zero-initialised last layer)",
    "y": "the target is 0 (an NCE run's centred log-density: constant over the points)",
}


def _zero_phis(run: SpectralAnalyzer, ck: Checkpoint, phis: dict[str, Any], notes: StepNotes) -> None:
    """Note each φ that is 0 at every point: E(φ, k) = ‖V_kᵀφ‖²/‖φ‖² is 0/0 there (and, for Δf_t, the
    first order's relative error and cos α) — they were stored NaN with no reason (an audit)."""
    for name, phi in phis.items():
        phi = None if phi is None else np.asarray(phi.detach().cpu() if hasattr(phi, "detach") else phi)
        if phi is None or not np.isfinite(phi).all() or np.any(phi):
            continue
        names = [f"energy_{name}", f"curve_energy_{name}", f"curve_energy_{name}_lower", f"curve_energy_{name}_upper"]
        names += {"df": ["first_order_error", "first_order_cos"], "df_pred": ["first_order_cos"]}.get(name, [])
        also = {"df": " and the first order's relative error and cos α", "df_pred": " and the first order's cos α"}
        notes.note(
            [n for n in names if run.plan.has(n)],
            f"φ = {name} is 0 at every point at step {ck.step}: {_ZERO_WHY[name]} — E({name}, k) is 0/0"
            + (f"{also[name]} are undefined" if name in also else ""),
        )


def gram_spectrum(ctx: StepContext) -> dict[str, Any]:
    """The step's record values, G's eigenvalues, ‖G‖_F² and E_t(φ, k) of every φ."""
    ck, sp = ctx.ck, ctx.sp
    fro2, fro2_se = ctx.sq_frobenius
    return {
        "loss": ck.loss,
        "lr": ck.lr,
        "f": ck.f,
        "df": ck.df,
        "f_test": ck.f_test,
        "eigenvalues": sp.evals,
        "gram_sq_frobenius": np.array([fro2, fro2_se]),
        **{
            f"energy_{name}": energy_from_projections(sp.proj[name], phi)
            for name, phi in ctx.phis.items()
            if phi is not None
        },
    }


def first_order(ctx: StepContext) -> dict[str, Any]:
    """df̄_t and its error and cos α against df_t (NaN when update t diverged)."""
    df_pred, ck = ctx.phis["df_pred"], ctx.ck
    if df_pred is None:
        return {}
    finite = np.isfinite(ck.df).all() and np.any(ck.df)  # df is NaN when update t diverged
    acc = (
        ctx.notes.guard(
            ("first_order_error", "first_order_cos"),
            first_order_accuracy,
            ck.df.reshape(-1),
            np.asarray(df_pred).reshape(-1),
        )
        if finite
        else None
    )
    if acc is not None and np.isfinite(acc.error) and acc.error < 1e-2:
        ctx.notes.guard((), _say_update_rounding, ctx, acc.error)
    return {
        "df_pred": df_pred,
        "first_order_error": acc.error if acc else np.nan,
        "first_order_cos": acc.cos_alpha if acc else np.nan,
    }


def _say_update_rounding(ctx: StepContext, error: float) -> None:
    """Log once per run where GD's first order is compared with an update that is not GD's: the trainer's
    float32 parameters absorb each part of −δ g_t below half their spacing, so at a small rate J_t Δθ_t
    leaves df̄_t = −(δ/N) G_t m_t (an audit at lr 1e-5: Δθ_t 4 % from −δ g_t, the stored first-order
    error 1.03e-3 where the linearisation's own, Δf_t against J_t Δθ_t, is 6.8e-7)."""
    run, ck = ctx.run, ctx.ck
    gd = OptimizerName(run.spec.optimizer.name) is OptimizerName.GD and ctx.residual.ndim == 1
    if "update_rounding" in run.logged or not gd or not np.isfinite(ck.lr) or np.asarray(ck.theta).dtype == np.float64:
        return
    # one J_t Δθ_t (a full pass over the N points) per tenfold fall of the rate, not one per step (a review)
    if run.rounding_checked_lr is not None and ck.lr > run.rounding_checked_lr / 10:
        return
    run.rounding_checked_lr = float(ck.lr)
    made = np.asarray(_jvp_outputs(run, ck.dtheta), np.float64).reshape(-1)
    pred, df = np.asarray(ctx.phis["df_pred"], np.float64).reshape(-1), np.asarray(ck.df, np.float64).reshape(-1)
    off = float(np.linalg.norm(made - pred) / np.linalg.norm(pred))
    if off > 0.1 * error:
        run.logged.add("update_rounding")
        log.warning(
            "run %r step %d: the update made is not GD's −δ g_t to %.2g (J_t Δθ_t against df̄_t = −(δ/N) G_t m_t): "
            "float32 parameters absorb what rounds below half their spacing; first_order_error %.3g includes it "
            "(Δf_t against J_t Δθ_t: %.3g). Said once per run",
            run.spec.name,
            ck.step,
            off,
            error,
            float(np.linalg.norm(df - made) / np.linalg.norm(df)),
        )


def kernel_alignment(ctx: StepContext) -> dict[str, Any]:
    """Kernel–target alignment, plain and centred, from G·Y and G·1; the plain one of the φ = y of the
    energies (for NCE the log-density centred over the points: G ȳ = G y − (G 1) ȳᵀ — its arbitrary
    constant carried 0.81 of a run's alignment against 0.12 of the centred one)."""
    y, GY, G1 = ctx.run.y, ctx.GP[:, : ctx.C], ctx.GP[:, ctx.C]
    fro2, fro2_se = ctx.sq_frobenius
    yp, GYp = y, GY  # the plain alignment's; the centred one centres y and G·y itself
    if is_nce(ctx.run.spec):
        Y = np.asarray(y, np.float64).reshape(len(y), -1)
        ybar = Y.mean(axis=0)
        GYp = np.asarray(GY, np.float64).reshape(Y.shape) - np.asarray(G1, np.float64).reshape(-1, 1) * ybar
        yp = Y - ybar
    return {
        "alignment": ctx.notes.guard(("alignment",), _plain_alignment, yp, GYp, fro2, is_nce(ctx.run.spec)),
        "alignment_centered": ctx.notes.guard(("alignment_centered",), _centered_alignment, ctx, GY, G1, fro2, fro2_se),
    }


def _plain_alignment(y: np.ndarray, GY: np.ndarray, fro2: float, centred: bool) -> float:
    """The plain alignment; ``centred``: NCE's y is the log-density centred over the points, 0 where
    that density is one value at every point."""
    if centred and not np.any(y):
        raise ValueError("the target log-density is one value at every point (the centred y is 0): alignment 0/0")
    return alignment_from_products(y, GY, fro2)


def _centered_alignment(ctx: StepContext, GY: np.ndarray, G1: np.ndarray, fro2: float, fro2_se: float) -> float:
    """Centred alignment.  With an estimated ‖G‖_F (matrix_free: ``fro2_se`` > 0) ‖HGH‖_F² is
    estimated directly: ‖G‖_F² − 2‖G1‖²/N + (1ᵀG1)²/N² would cancel the estimate's error into it."""
    spec = ctx.run.spec
    if fro2_se == 0.0:
        hgh2, hgh2_se = centered_sq_frobenius(fro2, G1), 0.0
    else:
        m = hutchpp_moments(_Centered(ctx.G), spec.spectrum.frobenius_probes, max_order=2, seed=spec.seed)
        hgh2, hgh2_se = float(m.estimate[1]), float(m.stderr[1])
    # G ≈ c·11ᵀ (every unit dead, a constant kernel): HGH is zero but for rounding — or, estimated, for
    # the estimate's spread — and the ratio was noise: −8e-10 local, NaN on block_rows ×2, 0.325 on
    # matrix_free for one network, status done and nothing said
    if not hgh2 > max(_CENTERED_FLOOR * fro2, 3.0 * hgh2_se):
        raise ValueError(
            f"the centred Gram HGH is zero to {'rounding' if hgh2_se == 0.0 else 'its estimate’s spread'} "
            f"(‖HGH‖_F² = {hgh2:.3g}{f' ± {hgh2_se:.2g}' if hgh2_se else ''} against ‖G‖_F² = {fro2:.3g}: G is "
            "a constant kernel c·11ᵀ to that precision, e.g. every unit dead), so the centred alignment is 0/0"
        )
    _not_constant(ctx.run.y)
    return alignment_from_products(ctx.run.y, GY, hgh2, centered=True, G1=G1)


def _not_constant(y: np.ndarray) -> None:
    """Raise where the target is one value at every point: y − ȳ = 0, and the centred alignment is 0/0
    (a one-vs-rest class with no point among the N: NaN was stored with no reason, an audit)."""
    Y = np.asarray(y, np.float64).reshape(len(y), -1)
    if not np.any(Y - Y.mean(axis=0)):
        raise ValueError(
            f"the target y is constant over the {len(Y)} points ({np.unique(Y)[:3].tolist()}: y − ȳ = 0), so the "
            "centred alignment is 0/0 — e.g. a one-vs-rest class with no point among them"
        )


_CENTERED_FLOOR = 1e-8  # ‖HGH‖_F² below this part of ‖G‖_F² is the cancellation's rounding, not HGH


def quadrature_curves(ctx: StepContext) -> dict[str, np.ndarray]:
    """The quadrature route of ``k: all``: λ_k and E_t(φ, k) at every reported k with their brackets,
    and G's SLQ density, from the exact top K and products with G (:mod:`nsa_dist.linalg.quadrature`)."""
    run, sp, phis, G = ctx.run, ctx.sp, ctx.phis, ctx.G
    if sp.evecs is None:  # K = N (quadrature.top ≥ N): every eigenpair is exact
        return _exact_curves(sp, phis, run.plan.curve_k(), run.spec.spectrum.quadrature.density_grid)
    c = _curves(run, G, sp, phis, run.plan.curve_k())
    run.cost.n_products["quadrature"] = c.n_products
    for name in ("y", "residual"):
        w = c.notes.get("widest", {}).get(name) or {}
        if w.get("width", 0.0) > WIDE_BRACKET:
            try:  # a sentence for the log: it must never cost the step
                log.info("step %d: %s", ctx.ck.step, describe_width(name, c))
            except Exception as e:  # noqa: BLE001
                log.warning("step %d: the widths' sentence failed (%s: %s)", ctx.ck.step, type(e).__name__, e)
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


def _curves(run: SpectralAnalyzer, G: StepGram, sp: StepSpectrum, phis: dict, ks: np.ndarray) -> Any:
    """:func:`~nsa_dist.linalg.spectral_curves` of a Gram (training or test) from its top
    eigenpairs ``sp``, with the run's quadrature knobs."""
    q = run.spec.spectrum.quadrature
    return spectral_curves(
        G.G if isinstance(G, DenseGram) else G,
        sp.evals,
        sp.evecs,
        phis,
        ks,
        lanczos_steps=q.lanczos_steps,
        probes=q.probes,
        confidence=q.confidence,
        density_grid=q.density_grid,
        seed=run.spec.seed,
        block_size=q.block_size,
        phi_steps=q.phi_steps,
        phi_width=q.phi_width,
        top_residual=sp.max_residual,
    )


def stored_eigenvectors(ctx: StepContext) -> dict[str, Any]:
    """The top K training eigenvectors, as stored (float32)."""
    return {"eigenvectors": ctx.sp.evecs.astype(np.float32)}


def reconstructions(ctx: StepContext) -> dict[str, Any]:
    """Fig. 4d's f̄_{t,k} (and their images on 2-D data)."""
    run = ctx.run
    R = top_k_reconstructions(ctx.sp.evecs, ctx.ck.f, reconstruction_ks(run.plan.K))  # (nR, N[, Ko])
    out: dict[str, Any] = {"reconstructions": R.astype(np.float32)}
    if run.plan.has("reconstruction_images"):
        out["reconstruction_images"] = run.images.image(R.reshape(R.shape[0], ctx.N, -1)[..., 0].T).astype(
            np.float32
        )  # (nR, R, R)
    return out


def eigenbasis_gram_change(ctx: StepContext) -> dict[str, Any]:
    """App. F's dG_t on the top Kg eigenvectors, in float64 whatever the run's dtype: G_{t+1} − G_t of
    two float32 products is rounding at a small rate (an audit at lr 1e-5: ‖D − D̄‖_F 860–1,670×
    the float64 value, v₁ᵀΔG v₁ 4.6 % off — a disagreement with the first order that is not there)."""
    run, ck = ctx.run, ctx.ck
    if not run.plan.has("gram_change"):
        return {}
    return (
        ctx.notes.guard(
            ("gram_change", "gram_change_fro"),
            gram_change,
            run.model,
            run.X,
            ck.theta,
            ck.dtheta,
            ctx.sp.evecs[:, : run.plan.dims.k_gram_change],
            torch.float64,
        )
        or {}
    )


def constant_gram_prediction(ctx: StepContext) -> np.ndarray | None:
    """App. E's Eq. 22 at t0; the steps where it diverges (δλ_i/N > 2 long enough to overflow
    float64) are NaN, and the step's notes say from which step on."""
    return ctx.notes.guard(("constant_gram_f_test",), _test_point_prediction, ctx)


def _test_point_prediction(ctx: StepContext) -> np.ndarray:
    run, sp = ctx.run, ctx.sp
    pred, diverged = test_point_prediction(
        run.model,
        run.X,
        run.X_test,
        sp.evals,
        sp.evecs,
        ctx.residual,
        ctx.ck.f_test,
        run.spec,
        run.dtype,
        out=run._cross_buffer(),
        route=run.test_route,
    )
    if diverged is not None:
        ctx.notes.note(("constant_gram_f_test",), diverged)
    return pred


def kernel_extras(ctx: StepContext) -> KernelExtras:
    """Fig. 4a's projections, the test loss, the full-kernel and per-class eigenvalues."""
    run, ck = ctx.run, ctx.ck
    extras = ctx.notes.guard(
        part_names(run, ck, KernelExtras),
        run.extras.analyze,
        run.model,
        run.X,
        ck,
        ctx.sp.proj["residual"],
        ctx.residual,
    )
    return extras or KernelExtras()


def eigenvector_images(ctx: StepContext) -> ImageStep | None:
    """The rendered eigenvectors and residual on 2-D data; None without a renderer."""
    run = ctx.run
    if run.images is None:
        return None
    V = np.column_stack([ctx.sp.columns[i - 1] for i in run.images.indices])  # (N, nI)
    return ctx.notes.guard(
        part_names(run, ctx.ck, ImageStep), run.images.render, V, ctx.residual.reshape(ctx.N, -1)[:, 0]
    )


def test_spectrum(run: SpectralAnalyzer, ck: Checkpoint, gang: Gang | None) -> dict[str, np.ndarray]:
    """The test Gram's eigenvalues and E(f_test, k) (NSA Fig. 3e): its top k_test, and on the
    quadrature route every k beyond them with brackets, from the same knobs as the training Gram's."""
    G_t = step_gram(run, "test", ck.theta, gang)
    ks = run.plan.curve_k_test()
    try:
        sp_t = run._spectrum(G_t, run.plan.dims.k_test, "test", {"f_test": ck.f_test}, bool(ks.size))
        out = {
            "eigenvalues_test": sp_t.evals,
            "energy_f_test": energy_from_projections(sp_t.proj["f_test"], ck.f_test),
        }
        if ks.size:
            c = _curves(run, G_t, sp_t, {"f_test": ck.f_test}, ks)
            run.cost.n_products["quadrature_test"] = c.n_products
            b = c.energy["f_test"]
            out.update({"curve_energy_f_test": b.value})
            out.update({"curve_energy_f_test_lower": b.lower, "curve_energy_f_test_upper": b.upper})
    finally:
        G_t.close()
    return out


def gram_knowledge(run: SpectralAnalyzer, G: StepGram, evals: np.ndarray) -> GramKnowledge | None:
    """What the Hessian step can reuse of G for the exact Tr(I^k) (one output, MSE, float64 G):
    its whole spectrum (k: all — the eigenvalues just computed — or one eigvalsh of the
    dense G), or with block_rows the exact tile trace and ‖G‖_F²; None otherwise."""
    if not run.hessian.gram_reusable:
        return GramKnowledge(distributed=True) if run.plan.distributed else None
    if isinstance(G, DenseGram):
        if run.dtype != torch.float64:
            return None
        if run.plan.whole_spectrum:
            return GramKnowledge(evals=np.asarray(evals, np.float64))
        return GramKnowledge(evals=torch.linalg.eigvalsh(G.G).detach().cpu().numpy().astype(np.float64))
    if isinstance(G, TiledGram):
        stats = G.trace_stats()
        return GramKnowledge(trace=stats["trace"], sq_frobenius=stats["sq_frobenius"], distributed=True)
    return GramKnowledge(distributed=True)


def hessian(
    run: SpectralAnalyzer, ck: Checkpoint, gang: Gang | None, notes: StepNotes, gram: GramKnowledge | None = None
) -> HessianStep:
    """H = I + S at this step: on the model here (local) or summed over the gang's data shards."""
    if not run.plan.distributed:
        return run.hessian.analyze(run.model, gram=gram, step=ck.step, notes=notes)
    trainable = sum(q.numel() for q in run.model.parameters() if q.requires_grad)  # H is over θ's trainable part
    curv = ShardedCurvature(step_gang(run, gang), run.plan, ck.theta, run.data.n, trainable)
    try:
        return run.hessian.analyze(
            run.model,
            ops={p: curv.part(p) for p in ("H", "I", "S")},
            gram=gram or GramKnowledge(distributed=True),
            step=ck.step,
            notes=notes,
        )
    finally:
        curv.close()


def expected_arrays(run: SpectralAnalyzer, ck: Checkpoint) -> set[str]:
    """The arrays this step must hand the writer."""
    return set(
        step_specs(
            run.plan.dims,
            eigenvectors=run.plan.stores_eigenvectors(ck.index),
            hessian=run.hessian.wanted(ck.index),
            first=ck.index == 0,
        )
    )


def part_names(run: SpectralAnalyzer, ck: Checkpoint, part: type) -> tuple[str, ...]:
    """The arrays of record type ``part`` that this step writes."""
    expected = expected_arrays(run, ck)
    return tuple(f.name for f in dataclasses.fields(part) if f.name in expected)


def with_notes(run: SpectralAnalyzer, result: StepResult, ck: Checkpoint, notes: StepNotes) -> StepResult:
    """``result`` with every noted array that this step writes as NaN, and ``step_notes`` — where an
    array came out NaN in every entry with no diagnostic's reason (a 0/0 or an overflow inside it that
    raised nothing), that is said too: no NaN is stored unexplained."""
    expected = expected_arrays(run, ck)
    arrays = result.arrays()
    unexplained = sorted(n for n in expected - set(notes.reasons) if _all_nan(arrays.get(n)))
    if unexplained:
        notes.note(unexplained, "computed as NaN in every entry with no reason raised (a 0/0 or an overflow inside it)")
    if not notes.reasons:
        return dataclasses.replace(result, gram=dataclasses.replace(result.gram, step_notes=""))
    arrays.update({n: not_computed(n, run.plan.dims) for n in notes.reasons if n in expected})
    arrays["step_notes"] = notes.json()
    return StepResult.from_arrays(arrays)


def _all_nan(v: Any) -> bool:
    """Whether ``v`` is a non-empty float array (or float) that is NaN in every entry."""
    if v is None or isinstance(v, (str, bytes)):
        return False
    a = np.asarray(v.detach().cpu() if hasattr(v, "detach") else v)  # (a tensor on a GPU too)
    return a.dtype.kind in "fc" and a.size > 0 and bool(np.isnan(a).all())


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
