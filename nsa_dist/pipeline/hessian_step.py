"""The loss-Hessian measurements of one recorded step (H = I + S), for the SpectralAnalyzer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from nsa_dist.config import Activation, ExperimentSpec, Init, LossName, ModelSpec
from nsa_dist.hessian import (
    additivity_gap,
    extreme_eigenpairs,
    gauss_newton_eigenvalues,
    hessian_parts,
    hutchpp_moments,
    limit_gauss_newton_eigenvalues,
    orthogonality,
    output_hessian_traces,
    power_moments,
    prepare_targets,
    rayleigh_quotients,
    slq_density,
    trace_S_from_G,
)
from nsa_dist.linalg import Materialised
from nsa_dist.losses import parse_loss, residual as loss_gradient
from nsa_dist.ntk import preserved
from nsa_dist.ntk.inputs import as_2d, prepare_model
from nsa_dist.store.records import HessianStep

if TYPE_CHECKING:
    from nsa_dist.pipeline.diagnostics import StepNotes
    from nsa_dist.pipeline.plan import RunPlan

__all__ = ["GramKnowledge", "HessianAnalysis", "hessian_loss", "limit_reason"]

PARTS = ("H", "I", "S")
# H, I and S of at most this many parameters are formed as dense matrices (P columns each, 32 a
# product) at their first product, and the estimates multiply those (linalg.Materialised;
# benchmarks/README.md, "The Hessian step of a small network").  Above it, forming once an
# operator had made P products cost more products than it saved in some runs (audit H)
DENSE_P = 512


def hessian_loss(spec: ExperimentSpec) -> LossName:
    """The run's loss as the Hessian takes it (l2, cross_entropy).

    Raises:
        ValueError: loss 'nce' (the spec refuses a hessian block with it).
    """
    if LossName(spec.loss) is LossName.NCE:
        raise ValueError("the Hessian measurements support loss 'l2' and 'cross_entropy', not 'nce'")
    return parse_loss(spec.loss)


def limit_reason(spec: ExperimentSpec) -> str | None:
    """Why the infinite-width limit of I does not apply to ``spec``'s model (None: it does).

    ``limit_ntk`` is the NTK limit of a fully-connected net in the NTK parametrisation; the
    active regime's NTK moves during training (the Hessian paper, §"active regime") and a
    residual, Xavier or user-built network has another (or no) limit.
    """
    m = spec.model
    if not isinstance(m, ModelSpec):
        return "a user-built (factory) network: limit_ntk is the limit of the fully-connected ModelSpec nets"
    if Init(m.init) is not Init.NTK:
        return f"init={Init(m.init).value!r}: the limit is that of the NTK parametrisation (init='ntk')"
    if m.regime != "ntk":
        return "regime='active': the NTK is not constant during training in the active regime"
    if m.residual:
        return "residual=True: limit_ntk has no shortcut connections"
    return None


@dataclass(frozen=True)
class GramKnowledge:
    """What the step's spectral analysis already knows of its NTK Gram G = J Jᵀ, reused by the
    Hessian step for the exact Tr(I^k) instead of a new Gram.

    Attributes:
        evals: G's whole spectrum (float64), from a local layout.
        trace, sq_frobenius: Tr(G) and ‖G‖_F², exact tile reductions (block_rows).
        distributed: G lives on a gang; nothing more of it is computable here.
    """

    evals: np.ndarray | None = None
    trace: float | None = None
    sq_frobenius: float | None = None
    distributed: bool = False


class HessianAnalysis:
    """Computes the Hessian quantities the spec asks for at its analysed recorded steps.

    Everything is matrix-free (Hessian-vector products with torch.func, float64) but for a small
    network (P ≤ ``DENSE_P``), whose H, I, S are formed once as dense matrices and multiplied
    after that (``linalg.Materialised``: the same estimates, to rounding): moments by
    Hutch++ with standard errors plus exact Tr(I^k) from the NTK Gram, orthogonality of I and S,
    the Fig. 3 Rayleigh quotients, top eigenvalues by Lanczos, and the SLQ density of H.
    """

    def __init__(self, plan: RunPlan, X: torch.Tensor, y: np.ndarray) -> None:
        spec = plan.spec
        self.plan, self.h = plan, spec.hessian
        self.X, self.y = X, y
        self.indices = plan.hessian_indices
        D = plan.dims
        self.top_k, self.rayleigh_k, self.grid = D.hessian_top_k, D.hessian_rayleigh_k, D.hessian_density_bins
        self.seed = spec.seed
        self.spec = spec
        self.loss = hessian_loss(spec) if self.h else LossName.L2
        self.limit_reason = limit_reason(spec) if self.h and self.h.limit else "hessian.limit is off"
        self._theta_inf: torch.Tensor | None = None  # Θ̃∞ at the training points, computed once per run
        self._lam_inf: float | None = None  # its largest eigenvalue (trained_reason), once per run
        self._said: set[str] = set()  # the run-wide reasons already logged (_note_once)
        self._s_kernels: Any = None  # Σ̃, Θ̃∞, Φ̃, Υ̃, Λ̃ (the limits of S), computed once per run

    def limit_gram(self) -> torch.Tensor:
        """Θ̃∞ (N, N) at the training points (:func:`~nsa_dist.ntk.limit_ntk`), cached.

        Raises:
            ValueError: the limit does not apply to this run's model (the reason is named).
        """
        if self.limit_reason is not None:
            raise ValueError(f"no infinite-width limit of I for run {self.spec.name!r}: {self.limit_reason}")
        if self._theta_inf is None:
            from nsa_dist.ntk import limit_ntk

            m = self.spec.model
            self._theta_inf = limit_ntk(
                self.X.detach().cpu().double().reshape(self.X.shape[0], -1),
                depth=m.depth,
                activation=m.activation,
                negative_slope=m.negative_slope,
                bias_scale=m.bias_scale,
            )
        return self._theta_inf

    def _note_once(self, notes: StepNotes, names: list[str], reason: str) -> None:
        """``notes.note``, logged at the first step it is noted at only (a reason of the whole run, e.g. a
        Xavier init's: every Hessian step of a default run logged it twice, a review)."""
        notes.note(names, reason, quiet=reason in self._said)
        self._said.add(reason)

    def trained_reason(self, step: int | None) -> str | None:
        """Why the limits, which hold at initialisation, do not hold at training step ``step`` (None: they
        do): the NTK stays at Θ∞ along training only for gradient descent (plain, momentum, SGD) below the
        limiting kernel's stability bound — Adam moves every parameter by ~lr whatever the width (its NTK
        change grew with width in an audit: 0.02–0.07 at width 256, 0.13–0.23 at 2048, GD's fell to 0.005),
        and a rate past lr·c·λ_max(Θ̃∞)/N = 2(1 + momentum) (c the loss's largest curvature in f: 1 for the
        L2 loss, ½ cross-entropy, ¼ NCE) throws the net out of the lazy regime (a catapult: the audit's
        E[Tr S_t] prediction −1.5·10¹⁹ where wide nets converged to 7·10⁻⁴)."""
        if not step or self.limit_reason is not None:
            return None
        opt = self.spec.optimizer
        if opt.name == "adam":
            return (
                "optimizer='adam': Adam's updates do not keep the NTK at its limit Θ∞ along training at any "
                "width (the limits hold at initialisation, step 0)"
            )
        curvature = {LossName.L2: 1.0, LossName.CROSS_ENTROPY: 0.5}.get(self.loss, 0.25)
        if self._lam_inf is None:
            try:  # called outside the notes' guard (why_S): a limit that cannot be computed is a reason, not an end
                self._lam_inf = float(torch.linalg.eigvalsh(self.limit_gram())[-1])
            except (ValueError, RuntimeError, ArithmeticError) as exc:
                return f"the limiting kernel Θ̃∞ could not be computed ({type(exc).__name__}: {exc})"
        rate = self.spec.lr_at(0)  # the schedule's largest (decay ≤ 1)
        x = rate * curvature * self._lam_inf / self.X.shape[0]
        bound = 2.0 * (1.0 + opt.momentum)
        if x >= bound:
            return (
                f"the learning rate {rate:.4g} passes the limiting kernel's stability "
                f"bound (lr·c·λ_max(Θ̃∞)/N = {x:.3g} ≥ {bound:g}, c = {curvature:g} the loss's curvature): the "
                "network leaves the lazy regime, where Θ∞ holds (the limits hold at initialisation, step 0)"
            )
        return None

    def s_limit_reason(self) -> str | None:
        """Why the limits of S do not apply (None: they do): those of I, plus a smooth σ."""
        if self.limit_reason is not None:
            return self.limit_reason
        act = Activation(self.spec.model.activation)
        if act in (Activation.RELU, Activation.LEAKY_RELU):
            return f"activation={act.value!r}: the limits of S need σ̈ (a smooth σ)"
        return None

    def _limit_S(self, F: torch.Tensor, step: int | None) -> np.ndarray:
        """(3,) the limits of S at this step (the Hessian paper, Proposition 4, Theorem 1):
        [E[Tr S] at initialisation (MSE: K Tr(Φ̃)/N), E[Tr S_t] along GD (MSE, plain full-batch GD,
        :func:`~nsa_dist.hessian.s_limit.limit_trace_S_gd`), Tr(S²) = ∇C_tᵀ (Υ̃ ⊗ Id_K) ∇C_t at this
        step's outputs]; NaN where one does not apply (see :meth:`s_limit_reason`)."""
        out = np.full(3, np.nan)
        if self.s_limit_reason() is not None:
            return out
        from nsa_dist.hessian.s_limit import limit_S_kernels, limit_trace_S2, limit_trace_S_gd, limit_trace_S_init

        m, N, K = self.spec.model, F.shape[0], F.shape[1]
        if self._s_kernels is None:
            self._s_kernels = limit_S_kernels(
                self.X.detach().cpu().double().reshape(N, -1),
                depth=m.depth,
                activation=m.activation,
                bias_scale=m.bias_scale,
            )
        k = self._s_kernels
        Y = prepare_targets(self.y, self.loss, N, K, torch.float64, torch.device("cpu"))
        out[2] = limit_trace_S2(k.upsilon, loss_gradient(self.loss, F.cpu(), Y).numpy() / N)
        if self.loss is LossName.L2:
            out[0] = limit_trace_S_init(k, K)
            opt = self.spec.optimizer
            if step is not None and opt.name == "gd" and opt.momentum == 0:
                lrs = [self.spec.lr_at(s) for s in range(step)]  # the rates the trainer used
                out[1] = limit_trace_S_gd(k, Y.numpy(), lrs, [step])[0]
        return out

    def wanted(self, index: int) -> bool:
        return index in self.indices

    @property
    def gram_reusable(self) -> bool:
        """Whether the step's NTK Gram G (N, N) gives I: one output, MSE (I = Jᵀ J / N ~ G / N)."""
        return self.loss is LossName.L2 and self.spec.model.output_dim == 1

    def _exact_I(
        self, model: nn.Module, gram: GramKnowledge | None
    ) -> tuple[np.ndarray, np.ndarray, tuple[tuple[str, ...], str] | None]:
        """(eigenvalues of I outside its null space (N·K,), Tr(I^k) k = 1..4, why some are NaN) —
        exact, NaN where unknown; the reason names the arrays it leaves NaN (in part or whole).

        ``gram``: what the step's spectral analysis already has of G = J Jᵀ (K = 1, MSE): its whole
        spectrum or, with a distributed layout, its exact trace and ‖G‖_F² — Tr(I) = Tr(G)/N and
        Tr(I²) = ‖G‖_F²/N², orders 3–4 NaN.
        Without it (K > 1, cross-entropy, a float32 Gram) the full Gram is recomputed.
        """
        N = self.X.shape[0]
        nk = N * self.spec.model.output_dim
        layout = self.plan.layout.layout.value  # auto resolved
        if gram is not None and self.gram_reusable and gram.evals is not None:
            mu = np.sort(np.asarray(gram.evals, np.float64))[::-1] / N
            return mu, power_moments(mu), None
        if gram is not None and self.gram_reusable and gram.trace is not None:
            moments = np.array([gram.trace / N, gram.sq_frobenius / N**2, np.nan, np.nan])
            why = (
                f"the NTK Gram is split across the {layout} gang, which reduces Tr(G) and ‖G‖_F² exactly "
                "(Tr(I), Tr(I²) stored) but never holds G whole: I's eigenvalues and Tr(I³), Tr(I⁴) of "
                "hessian_moments_I_exact are NaN "
                "(hessian_moments' I row estimates every Tr(I^k) by Hutch++)"
            )
            # noted on the eigenvalues alone: a noted array is stored NaN whole, and Tr(I), Tr(I²) are known
            return np.full(nk, np.nan), moments, (("hessian_I_eigenvalues",), why)
        if gram is not None and gram.distributed:
            why = (
                f"the NTK Gram is never whole on one process on the {layout} gang, and I's exact moments and "
                "eigenvalues need it (hessian_moments' I row estimates Tr(I^k) by Hutch++)"
            )
            return np.full(nk, np.nan), np.full(4, np.nan), (("hessian_moments_I_exact", "hessian_I_eigenvalues"), why)
        mu = gauss_newton_eigenvalues(model, self.X, self.y, loss=self.loss)
        return mu, power_moments(mu), None

    def _limit_I(self, F: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(limiting eigenvalues of I (N·K,), limiting Tr(I^k)), NaN when the limit does not apply."""
        nk = F.shape[0] * F.shape[1]
        if self.limit_reason is not None:
            return np.full(nk, np.nan), np.full(4, np.nan)
        Y = prepare_targets(self.y, self.loss, F.shape[0], F.shape[1], torch.float64, torch.device("cpu"))
        mu = limit_gauss_newton_eigenvalues(self.limit_gram(), F.detach().cpu(), Y.numpy(), loss=self.loss)
        return mu, power_moments(mu)

    def analyze(
        self,
        model: nn.Module,
        ops: dict[str, Any] | None = None,
        gram: GramKnowledge | None = None,
        step: int | None = None,
        notes: StepNotes | None = None,
    ) -> HessianStep:
        """The step's Hessian quantities on ``model`` at its θ (training step ``step``: θ_step).

        ``ops``: H, I, S as operators summed over a gang's data shards (distributed layouts);
        every estimate then runs on them.  ``gram``: what the step already knows of its NTK
        Gram (see :meth:`_exact_I`), reused for the exact Tr(I^k) instead of a new Gram.
        ``notes``: each quantity is then a diagnostic of its own — one that cannot be computed is
        left out (NaN, its reason noted) and the others are still computed.
        """
        h = self.h
        if ops is None:
            H, I, S = hessian_parts(model, self.X, self.y, loss=self.loss, block_size=h.block_size, dtype=torch.float64)
            ops = {"H": H, "I": I, "S": S}
        made = ops  # the products the step spends are those of these operators
        if ops["H"].shape[0] <= DENSE_P:
            ops = {p: Materialised(op) for p, op in ops.items()}
        H, I, S = ops["H"], ops["I"], ops["S"]
        m64 = prepare_model(model, torch.float64)
        X64 = self.X.to(torch.float64) if self.X.is_floating_point() else self.X  # token ids stay integers
        with torch.no_grad(), preserved(m64):
            F = as_2d(m64(X64)).detach()  # (N, K) outputs at θ
        has = self.plan.has
        out: dict[str, Any] = {}

        def part(names: tuple[str, ...], fn: Any) -> None:
            names = tuple(n for n in names if has(n))
            if names:
                got = notes.guard(names, fn) if notes is not None else fn()
                out.update({k: v for k, v in (got or {}).items() if has(k)})

        def moments() -> dict[str, Any]:
            est = [hutchpp_moments(ops[p], h.probes, max_order=4, seed=self.seed) for p in PARTS]
            if notes is not None and has("hessian_moments_stderr") and np.isnan([m.stderr for m in est]).all():
                g = h.probes - h.probes // 2
                self._note_once(
                    notes,
                    ["hessian_moments_stderr"],
                    f"Hutch++'s standard error needs at least 2 Hutchinson probes beside its sketch: hessian.probes = "
                    f"{h.probes} leaves {g} (the moments themselves are estimated; 4 probes or more give it)",
                )
            return {
                "hessian_moments": np.stack([m.estimate for m in est]),  # (3, 4)
                "hessian_moments_stderr": np.stack([m.stderr for m in est]),
            }  # (3, 4)

        def exact_I() -> dict[str, Any]:
            mu, exact, why = self._exact_I(model, gram)
            if why is not None and notes is not None:
                notes.note([n for n in why[0] if has(n)], why[1])
            return {"hessian_moments_I_exact": exact, "hessian_I_eigenvalues": mu}  # (4,), (N·K,)

        def limit_I() -> dict[str, Any]:
            why = self.limit_reason or self.trained_reason(step)
            if why is not None and notes is not None:
                names = [n for n in ("hessian_I_limit_moments", "hessian_I_limit_eigenvalues") if has(n)]
                self._note_once(notes, names, f"the infinite-width limit of I does not apply: {why}")
            if why is not None:
                nan = np.full(F.shape[0] * F.shape[1], np.nan)
                return {"hessian_I_limit_moments": np.full(4, np.nan), "hessian_I_limit_eigenvalues": nan}
            mu_inf, limit = self._limit_I(F.cpu())
            return {"hessian_I_limit_moments": limit, "hessian_I_limit_eigenvalues": mu_inf}

        def trace_G() -> dict[str, Any]:
            Y = prepare_targets(self.y, self.loss, F.shape[0], F.shape[1], torch.float64, F.device)
            R = loss_gradient(self.loss, F, Y).cpu().numpy()  # (N, K) ∇_f c_i
            tr = output_hessian_traces(m64, X64, h.probes, seed=self.seed + 2, block_size=h.block_size)
            shape = (F.shape[0],) if F.shape[1] == 1 else tuple(F.shape)
            return {
                "hessian_G": tr.estimate.reshape(shape),
                "hessian_G_stderr": tr.stderr.reshape(shape),
                "hessian_trace_S_G": np.array(trace_S_from_G(R, tr)),
            }

        def additivity() -> dict[str, Any]:
            g = additivity_gap(H, I, S, h.probes, max_order=4, seed=self.seed + 1)
            return {"hessian_additivity": np.stack([g.estimate, g.stderr])}  # (2, 4)

        def orthogonal() -> dict[str, Any]:
            o = orthogonality(I, S, n_probes=h.probes, seed=self.seed)
            return {"hessian_orthogonality": np.array([o.value, o.stderr])}

        def rayleigh() -> dict[str, Any]:
            along_I, along_S = rayleigh_quotients(I, S, self.rayleigh_k, tol=h.eig_tol, seed=self.seed)
            return {
                "hessian_rayleigh": np.array([[along_I.vIv, along_I.vSv], [along_S.vIv, along_S.vSv]]),
                "hessian_rayleigh_evals": np.stack([along_I.evals, along_S.evals]),
            }  # (2, 2, k), (2, k)

        def top() -> dict[str, Any]:
            top = np.stack(
                [
                    extreme_eigenpairs(ops[p], self.top_k, which="largest", tol=h.eig_tol, seed=self.seed).evals
                    for p in PARTS
                ]
            )  # (3, k)
            s_op = float(abs(extreme_eigenpairs(S, 1, which="magnitude", tol=h.eig_tol, seed=self.seed).evals[0]))
            return {"hessian_top": top, "hessian_S_op": s_op}  # ‖S‖_op

        def density() -> dict[str, Any]:
            d = slq_density(H, n_probes=h.density_probes, n_steps=h.lanczos_steps, n_grid=self.grid, seed=self.seed)
            return {"hessian_density_grid": d.grid, "hessian_density": d.density}

        part(("hessian_moments", "hessian_moments_stderr"), moments)
        part(("hessian_moments_I_exact", "hessian_I_eigenvalues"), exact_I)
        part(("hessian_I_limit_moments", "hessian_I_limit_eigenvalues"), limit_I)
        why_S = self.s_limit_reason() or self.trained_reason(step)
        if why_S is not None and notes is not None and has("hessian_S_limit"):
            self._note_once(notes, ["hessian_S_limit"], f"the infinite-width limits of S do not apply: {why_S}")
        if why_S is None:
            part(("hessian_S_limit",), lambda: {"hessian_S_limit": self._limit_S(F, step)})  # (3,)
        elif has("hessian_S_limit"):
            out["hessian_S_limit"] = np.full(3, np.nan)
        part(("hessian_additivity",), additivity)
        part(("hessian_G", "hessian_G_stderr", "hessian_trace_S_G"), trace_G)
        part(("hessian_orthogonality",), orthogonal)
        part(("hessian_rayleigh", "hessian_rayleigh_evals"), rayleigh)
        part(("hessian_top", "hessian_S_op"), top)
        part(("hessian_density_grid", "hessian_density"), density)
        out["hessian_products"] = sum(op.n_products for op in made.values())
        return HessianStep(**out)
