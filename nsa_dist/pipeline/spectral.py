"""Spectral analysis of one recorded step: G_t, its eigenpairs and the NSA paper's metrics (no Ray, no store)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.func import functional_call, jvp
from torch.nn.utils import vector_to_parameters

from nsa_dist.config import ExperimentSpec
from nsa_dist.data import Dataset
from nsa_dist.errors import NonFiniteError
from nsa_dist.linalg import top_eigenpairs
from nsa_dist.losses import residual as loss_residual
from nsa_dist.metrics import first_order_accuracy, kernel_target_alignment, spectral_projections
from nsa_dist.models import build_model
from nsa_dist.ntk import gram
from nsa_dist.pipeline.checkpoint import Checkpoint
from nsa_dist.pipeline.hessian_step import HessianAnalysis
from nsa_dist.pipeline.images import eigen_images
from nsa_dist.pipeline.step_extras import StepExtras, predicted_update

__all__ = ["SpectralAnalyzer", "energy_curve", "spectrum_size"]


def spectrum_size(spec: ExperimentSpec, n: int) -> int:
    """K, the number of eigenpairs kept at n points."""
    return n if spec.spectrum.k == "all" else min(int(spec.spectrum.k), n)


def energy_curve(evecs: np.ndarray, phi: np.ndarray) -> np.ndarray:
    """E(φ, k) for k = 1..K; a K-output φ (N, K_out) counts the energy of all its columns.

    E(φ, k) = Σ_c Σ_{i≤k} ⟨v_i, φ_c⟩² / Σ_c ‖φ_c‖² (NSA §6 for one column).  NaN for φ = 0
    or a non-finite φ (the update of a diverging step).
    """
    phi2 = np.asarray(phi, dtype=np.float64).reshape(evecs.shape[0], -1)  # (N, C)
    norm2 = float(np.sum(phi2**2))
    if norm2 == 0.0 or not np.isfinite(norm2):
        return np.full(evecs.shape[1], np.nan)
    return np.cumsum(spectral_projections(evecs, phi2).sum(0)) / norm2  # (K,)


class SpectralAnalyzer:
    """Computes every per-step quantity of a run from a :class:`Checkpoint`.

    ``analyze(ck)`` returns a dict of numpy arrays keyed by store array name (see
    :mod:`nsa_dist.store.schema`); it holds a model whose parameters it overwrites with θ_t.
    """

    def __init__(self, spec: ExperimentSpec, data: Dataset) -> None:
        self.spec, self.data = spec, data
        self.device = torch.device(spec.torch_device())
        self.model = build_model(spec.model, seed=spec.seed).to(self.device)
        self.dtype = torch.float64 if spec.spectrum.dtype == "float64" else torch.float32
        self.X = torch.as_tensor(data.X, dtype=torch.float32, device=self.device)
        self.X_test = torch.as_tensor(data.X_test, dtype=torch.float32, device=self.device).reshape(-1, data.X.shape[1])
        self.y = np.asarray(data.y, dtype=np.float64)
        self.K = spectrum_size(spec, data.n)
        self.images = eigen_images(spec, data, self.K)
        self.hessian = HessianAnalysis(spec, self.X, self.y, sum(p.numel() for p in self.model.parameters()))
        self.extras = StepExtras(spec, data, self.dtype)

    def _gram(self, X: torch.Tensor) -> torch.Tensor:
        """G at X on the analysis device (eigenpairs are computed there: cuSOLVER/CuPy on a GPU)."""
        s = self.spec.spectrum
        return gram(self.model, X, method=s.ntk_method, block_size=s.block_size, dtype=self.dtype)

    def _eig(self, G: torch.Tensor, k: int):
        return top_eigenpairs(G, k, self.spec.spectrum.eig_method)

    def _jvp_outputs(self, dtheta: np.ndarray) -> np.ndarray:
        """J_t · dθ at the training points (first-order change of f for any optimizer)."""
        params = dict(self.model.named_parameters())
        tangents, offset = {}, 0
        for name, p in params.items():
            tangents[name] = torch.as_tensor(dtheta[offset:offset + p.numel()], device=self.device).view_as(p).to(self.dtype)
            offset += p.numel()
        model = self.model.to(self.dtype)
        X = self.X.to(self.dtype)
        primals = {k: v.detach() for k, v in model.named_parameters()}
        _, out = jvp(lambda p: functional_call(model, p, (X,)), (primals,), (tangents,))
        self.model.to(torch.float32)
        return out.detach().cpu().numpy()

    def analyze(self, ck: Checkpoint) -> dict[str, Any]:
        vector_to_parameters(torch.as_tensor(ck.theta, device=self.device), self.model.parameters())
        N = self.data.n
        G_dev = self._gram(self.X)  # (N, N) on the analysis device
        eig = self._eig(G_dev, self.K)
        G = G_dev.cpu().numpy()
        del G_dev
        residual = loss_residual(self.spec, self.data, ck.f)  # m_t = ∂ℓ/∂f (f_t − y for L2)
        df_pred = predicted_update(self.spec, ck, residual, lambda v: G @ v, self._jvp_outputs)
        out: dict[str, Any] = {
            "loss": ck.loss, "lr": ck.lr, "theta": ck.theta, "f": ck.f, "df": ck.df, "df_pred": df_pred,
            "eigenvalues": eig.evals, "f_test": ck.f_test,
        }
        if self.spec.spectrum.eigenvectors_at(ck.step):
            out["eigenvectors"] = eig.evecs.astype(np.float32)
        phis = {"y": self.y, "f": ck.f, "residual": residual, "df": ck.df, "df_pred": df_pred}
        for name, phi in phis.items():
            out[f"energy_{name}"] = energy_curve(eig.evecs, phi)
        finite = np.isfinite(ck.df).all() and np.any(ck.df)  # df is NaN when update t diverged
        acc = first_order_accuracy(ck.df.reshape(-1), np.asarray(df_pred).reshape(-1)) if finite else None
        out["first_order_error"] = acc.error if acc else np.nan
        out["first_order_cos"] = acc.cos_alpha if acc else np.nan
        out["alignment"] = _safe(kernel_target_alignment, G, self.y)
        out["alignment_centered"] = _safe(kernel_target_alignment, G, self.y, centered=True)
        if self.spec.spectrum.test_points and self.X_test.shape[0] > 0:
            eig_t = self._eig(self._gram(self.X_test), min(self.K, self.X_test.shape[0]))
            out["eigenvalues_test"] = eig_t.evals
            out["energy_f_test"] = energy_curve(eig_t.evecs, ck.f_test)
        out.update(self.extras.analyze(self.model, self.X, ck, eig.evecs, residual))
        if self.images is not None:
            out.update(self.images.render(eig.evecs, residual.reshape(N, -1)[:, 0]))
        if self.hessian.wanted(ck.index):
            out.update(self.hessian.analyze(self.model))
        del G
        return out


def _safe(fn, *args, **kw) -> float:
    try:
        return float(fn(*args, **kw))
    except NonFiniteError:
        return float("nan")
