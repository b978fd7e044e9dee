"""NSA quantities that need the step's eigenvectors (issue 19), recorded at the eigenvector steps.

(Fig. 4d's reconstructions are :func:`nsa_dist.metrics.top_k_reconstructions`.)
* :func:`gram_change` — App. F: the change of the Gramian over update t, projected on the top
  eigenvectors, measured (G_{t+1} − G_t, from θ_{t+1} = θ_t + Δθ_t) and to first order
  (dG_t = ∂G/∂θ · Δθ_t = dJ Jᵀ + J dJᵀ, which for GD is −(δ/N)(Q_t + Q_tᵀ), Eq. 26).
  Both by products with the network (forward-over-reverse), never the dense G.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import nn

    from nsa_dist.config import ExperimentSpec

__all__ = ["gram_change_size", "gram_change"]

def gram_change_size(spec: "ExperimentSpec", K: int) -> int:
    """Kg, the top eigenvectors App. F's dG_t is projected on: min(spectrum.gram_change_k, K) (0: off)."""
    return min(int(spec.spectrum.gram_change_k), K)


def _gram_times(model: "nn.Module", X: "torch.Tensor", V: "torch.Tensor") -> Callable:
    """p ↦ G(p) V with G = Σ_a J_a J_aᵀ (the output-traced Gram), J = ∂f(X)/∂p, by VJP + JVP."""
    import torch
    from torch.func import functional_call, jvp, vjp

    def f(p):
        out = functional_call(model, p, (X,))
        return out.reshape(out.shape[0], -1)  # (N, Ko)

    def GV(p):
        fx, pull = vjp(f, p)
        cols = []
        for j in range(V.shape[1]):
            acc = 0.0
            for a in range(fx.shape[1]):
                cot = torch.zeros_like(fx)
                cot[:, a] = V[:, j]
                (u,) = pull(cot)  # J_aᵀ v_j, a dict like p
                acc = acc + jvp(f, (p,), (u,))[1][:, a]  # J_a J_aᵀ v_j, (N,)
            cols.append(acc)
        return torch.stack(cols, dim=1)  # (N, Kg)

    return GV


def gram_change(model: "nn.Module", X: "torch.Tensor", theta: np.ndarray, dtheta: np.ndarray, evecs: np.ndarray,
                dtype: "torch.dtype") -> dict[str, np.ndarray]:
    """App. F: dG_t projected on the top Kg eigenvectors V of G_t, measured and to first order.

    measured:    D = Vᵀ (G(θ_t + Δθ_t) − G(θ_t)) V
    first order: D̄ = Vᵀ (∂G/∂θ · Δθ_t) V, ∂G/∂θ·Δθ = dJ Jᵀ + J dJᵀ, dJ = ∂J/∂θ · Δθ;
                 for GD (Δθ = −(δ/N) Jᵀ m) this is −(δ/N) Vᵀ(Q_t + Q_tᵀ)V of Eq. 26, with the
                 i-th column of Q_t = Aᵀ ℋ_t(X^i) A m̄_t.

    diag(D̄)_i is the first-order change of λ_i (perturbation theory: dλ_i = v_iᵀ dG v_i).

    Args:
        model: the network (its parameters are left as they were).
        X: (N, d) training inputs.
        theta: (P,) θ_t; dtheta: (P,) Δθ_t = θ_{t+1} − θ_t (NaN: unknown, e.g. a Tracker's last step).
        evecs: (N, Kg) eigenvectors of G_t.
        dtype: the products' dtype (float64 for the paper's quantities).

    Returns:
        {"gram_change": (2, Kg) [diag D, diag D̄], "gram_change_fro": (3,) [‖D‖_F, ‖D̄‖_F, ‖D − D̄‖_F]};
        NaN when Δθ_t is not finite.
    """
    import torch
    from torch.func import jvp

    Kg = evecs.shape[1]
    if not np.all(np.isfinite(dtheta)):
        return {"gram_change": np.full((2, Kg), np.nan), "gram_change_fro": np.full(3, np.nan)}
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    dev = next(model.parameters()).device

    def unflat(vec: np.ndarray) -> dict[str, "torch.Tensor"]:
        t = torch.as_tensor(np.ascontiguousarray(vec, np.float64), device=dev).to(dtype)
        out, o = {}, 0
        for n, s in zip(names, shapes):
            k = int(np.prod(s))
            out[n] = t[o:o + k].view(s)
            o += k
        return out

    orig = next(model.parameters()).dtype
    model.to(dtype)
    try:
        Xd = X.to(dtype)
        V = torch.as_tensor(np.ascontiguousarray(evecs, np.float64), device=dev).to(dtype)  # (N, Kg)
        GV = _gram_times(model, Xd, V)
        p0, dp = unflat(theta), unflat(dtheta)
        p1 = {n: p0[n] + dp[n] for n in names}
        G0V, dGV = jvp(GV, (p0,), (dp,))  # G_t V and (∂G/∂θ·Δθ) V, (N, Kg) each
        G1V = GV(p1)
        D = (V.T @ (G1V - G0V)).detach().cpu().double().numpy()  # (Kg, Kg)
        Dbar = (V.T @ dGV).detach().cpu().double().numpy()
    finally:
        model.to(orig)
    fro = np.linalg.norm
    return {"gram_change": np.stack([np.diag(D), np.diag(Dbar)]),
            "gram_change_fro": np.array([fro(D), fro(Dbar), fro(D - Dbar)])}
