"""NSA quantities of App. E: the constant-Gram predictions.

(Fig. 4d's reconstructions are :func:`nsa_dist.metrics.top_k_reconstructions`, App. F's dG_t is
:func:`nsa_dist.ntk.kernel_change.gram_change`.)
* :func:`test_point_prediction` — at the first recorded step: App. E's Eq. 22, the test outputs of every
  recorded step under G_{t0} fixed, through the Nyström extension of its eigenvectors (Eq. 9).
* :func:`write_constant_gram` — after the run: Eqs. 4–5's constant-Gram residual beside the measured one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.losses import residual
from nsa_dist.ntk.kernel_change import cross_gram_times

if TYPE_CHECKING:
    import torch
    from torch import nn

    from nsa_dist.config import ExperimentSpec
    from nsa_dist.metrics import Decays
    from nsa_dist.ntk import NTKRoute
    from nsa_dist.store import RunWriter

__all__ = ["divergence", "run_decays", "test_point_prediction", "write_constant_gram"]


def run_decays(spec: ExperimentSpec, steps: list[int] | np.ndarray, evals: np.ndarray, n: int) -> Decays:
    """r_i(t_j) = Π_{s=t_0}^{t_j−1} (1 − δ_s λ_i/N) at the recorded steps t_j, from the run's own rates.

    Returns:
        :class:`~nsa_dist.metrics.Decays` (S, K): finite in log space beyond the stability bound.
    """
    from nsa_dist.metrics import constant_gram_log_decays

    t0, t_end = int(steps[0]), int(steps[-1])
    lrs = np.array([spec.lr_at(s) for s in range(t0, t_end)])
    return constant_gram_log_decays(evals, lrs, np.asarray(steps, np.int64) - t0, n)


def divergence(spec: ExperimentSpec, steps: list[int] | np.ndarray, lam_max: float, n: int, decays: Decays) -> dict:
    """Where the constant-Gram prediction diverges: GD on G_{t0} is stable only while δ_t < 2N/λ_max
    (NSA Sec. 5); above it the prediction grows geometrically.  Attrs for the stored prediction:
    ``stability_bound`` 2N/λ_max(G_{t0}), ``lr_max`` the largest rate it is applied with,
    ``diverges`` (bool), ``first_unstable_step`` (a recorded step, or −1) and ``overflow_step``
    (the first recorded step whose prediction overflows float64, or −1)."""
    t0, t_end = int(steps[0]), int(steps[-1])
    lrs = np.array([spec.lr_at(s) for s in range(t0, max(t_end, t0 + 1))])
    bound = 2.0 * n / lam_max if lam_max > 0 else float("inf")
    unstable = np.flatnonzero(lrs > bound)
    over = np.flatnonzero(decays.overflows())
    return {
        "stability_bound": float(bound),
        "lr_max": float(lrs.max()),
        "diverges": bool(unstable.size),
        "first_unstable_step": int(t0 + unstable[0]) if unstable.size else -1,
        "overflow_step": int(np.asarray(steps)[over[0]]) if over.size else -1,
    }


def test_point_prediction(
    model: nn.Module,
    X: torch.Tensor,
    X_test: torch.Tensor,
    evals: np.ndarray,
    evecs: np.ndarray,
    residual: np.ndarray,
    f_test: np.ndarray,
    spec: ExperimentSpec,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    route: NTKRoute | None = None,
) -> tuple[np.ndarray, str | None]:
    """App. E, Eq. 22 at the first recorded step t0: the test outputs at every recorded step predicted
    by GD with G_{t0} fixed, through the Nyström extension ṽ_i(X') = g_{t0}(X', 𝒳) v_i / λ_i (Eq. 9).

    Eigenpairs with λ_i ≤ 1e-10 λ_1 are left out (Eq. 22 sums over λ_i ≠ 0; dividing by round-off
    would amplify noise).

    Args:
        model: the network at θ_{t0}.
        X, X_test: (N, …), (M, …); evals, evecs: (K,), (N, K) of G_{t0};
        residual: m̄_{t0}, (N,) or (N, Ko); f_test: f_{t0}(X'), (M,) or (M, Ko);
        spec: the run's spec (its recorded steps and learning rates); dtype: the products' dtype.
        out: an (M, N) buffer of ``dtype`` for the cross kernel g_{t0}(X', 𝒳) whole (see
            :func:`~nsa_dist.ntk.kernel_change.cross_gram_times`); None: blocks of rows.
        route: the run's resolved NTK route (:attr:`RunPlan.ntk_route
            <nsa_dist.pipeline.plan.RunPlan.ntk_route>`: no probe of the forward pass); None:
            ``spectrum.ntk_method``, resolved by each block of rows.

    Returns:
        (S, M) or (S, M, Ko) float64 — NaN at the steps where the prediction overflows (beyond the
        stability bound) — and None, or why those steps are NaN.
    """
    from nsa_dist.metrics import constant_gram_test_outputs, nystrom_from_products

    lam = np.asarray(evals, np.float64)
    keep = lam > 1e-10 * lam[0]
    V = np.asarray(evecs, np.float64)[:, keep]  # (N, K')
    sp = spec.spectrum
    method = sp.ntk_method if route is None else route
    gV = cross_gram_times(model, X_test, X, V, dtype, method, sp.block_size, out=out)  # (M, K')
    ext = nystrom_from_products(gV, lam[keep])  # (M, K')
    coef = V.T @ np.asarray(residual, np.float64)  # (K',) or (K', Ko)
    N = V.shape[0]
    steps = spec.record_steps()
    decays = run_decays(spec, steps, lam[keep], N)  # (S, K')
    pred = constant_gram_test_outputs(ext, coef, f_test, decays)
    d = divergence(spec, steps, float(lam[0]), N, decays)
    if d["overflow_step"] < 0:
        return pred, None
    return pred, (
        f"diverges: the rate {d['lr_max']:.4g} exceeds GD's stability bound 2N/λ_max(G_t0) = "
        f"{d['stability_bound']:.4g} from step {d['first_unstable_step']} on; the prediction overflows "
        f"float64 from recorded step {d['overflow_step']} on (stored as NaN there)"
    )


def write_constant_gram(writer: RunWriter, spec: ExperimentSpec) -> None:
    """After the last step: Eqs. 4–5's constant-Gram prediction of the residual beside the measured one.

    From the first recorded step t0 (its eigenvalues, ⟨v_i, m_{t0}⟩² and m_{t0}) and the run's
    learning rates δ_s, writes ``constant_gram_residual`` (S, 2) = [predicted ‖m̄_t‖, measured
    ‖m_t‖] and ``constant_gram_energy`` (S, K) = predicted E(m̄_t, k) in G_{t0}'s eigenbasis (the
    measured E_t(m_t, k) is ``energy_residual``).  Only for the paper's setting, full-batch GD
    without momentum on the L2 loss, one output (:func:`~nsa_dist.pipeline.plan.constant_gram_applies`);
    with K < N the rest of G_{t0}'s spectrum counts as 0.  Above the stability bound the energies
    stay exact (log space) and the predicted norm is +inf where it overflows; the arrays' attrs say
    where it diverges (:func:`divergence`).
    """
    from nsa_dist.metrics import constant_gram_residual

    if not writer.dims.constant_gram:
        return
    reader = writer.store.reader(writer.run_id)
    steps = reader.read("steps")
    y = np.asarray(reader.read("y"), np.float64)
    f = np.asarray(reader.read("f"), np.float64)  # (S, N[, Ko])
    m = np.stack([residual(spec.loss, f_t, y) for f_t in f]).reshape(len(steps), -1)  # (S, N·Ko): L2, f_t − y
    lam, p = reader.read_step("eigenvalues", 0), reader.read_step("projections_residual", 0)
    t0, N = int(steps[0]), writer.dims.N
    decays = run_decays(spec, steps, lam, N)
    pred = constant_gram_residual(lam, p, float(m[0] @ m[0]), decays)
    d = divergence(spec, steps, float(lam[0]), N, decays)
    writer.write_array(
        "constant_gram_residual",
        np.stack([pred.norm, np.linalg.norm(m, axis=1)], axis=1),
        {"t0": t0, "truncated": bool(writer.dims.K < writer.dims.N), **d},
    )
    writer.write_array("constant_gram_energy", pred.energy, {"t0": t0, **d})
