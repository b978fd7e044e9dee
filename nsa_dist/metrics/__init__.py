"""Spectral metrics of the NTK Gramian during training (the Neural Spectrum Alignment paper, "NSA").

One function per formula of the paper; all take NumPy arrays (float32/float64) or torch CPU
tensors and return NumPy.  Eigenvectors are columns of an (N, K) ``evecs`` ordered by
descending eigenvalue.

* energy: :func:`relative_energy` E_t(φ, k) (from eigenvectors, or :func:`energy_from_projections`
  from coordinates already computed), :func:`spectral_projections` ⟨v_i, φ⟩² (§6).
* preservation: :func:`spectrum_preservation` E_{t1}(v_i^{t2}, k) (Fig. 7d).
* alignment: :func:`kernel_target_alignment` (raw or centred).
* flow: :func:`lr_eigen_product` δλ/N, :func:`flow_speed` s_i, :func:`stability_bound` 2N/λ_max (§4).
* first_order: :func:`first_order_update` −(δ/N) G m (Eq. 3), :func:`first_order_accuracy` (Fig. 1d).
* dynamics: :func:`constant_gram_dynamics` f̄_t, m̄_t (Eqs. 4–5, App. D), :func:`constant_gram_residual`
  ‖m̄_t‖, E(m̄_t, k) under a learning-rate schedule.
* nystrom: :func:`nystrom_extension` g(X, 𝒳) v_k / λ_k (App. A, Eq. 9).
* reconstruction: :func:`top_k_reconstructions` Σ_{i≤k} ⟨v_i, φ⟩ v_i (Fig. 4d).
* fourier: :func:`fourier_transform` φ̂(ξ) (App. G, Eq. 27), :func:`frequency_grid`.

Owns: every formula of the paper on eigenpairs and vectors — the one home of the relative energy
(the pipeline's energy curves are :func:`relative_energy`).  May import: NumPy, torch (CPU
tensors in), ``errors`` and ``_checks`` — no model, no solver, nothing else of nsa_dist.
"""

from __future__ import annotations

from nsa_dist.metrics.alignment import alignment_from_products, centered_sq_frobenius, kernel_target_alignment
from nsa_dist.metrics.dynamics import (
    ConstantGramResidual,
    ConstantGramTrajectory,
    Decays,
    constant_gram_decay,
    constant_gram_decays,
    constant_gram_dynamics,
    constant_gram_log_decays,
    constant_gram_residual,
    constant_gram_test_outputs,
)
from nsa_dist.metrics.energy import energy_from_projections, relative_energy, spectral_projections
from nsa_dist.metrics.first_order import FirstOrderAccuracy, first_order_accuracy, first_order_update
from nsa_dist.metrics.flow import flow_speed, lr_eigen_product, stability_bound
from nsa_dist.metrics.fourier import FrequencyGrid, fourier_transform, fourier_transform_grid, frequency_grid
from nsa_dist.metrics.nystrom import nystrom_extension, nystrom_from_products
from nsa_dist.metrics.preservation import spectrum_preservation
from nsa_dist.metrics.reconstruction import RECONSTRUCTION_KS, reconstruction_ks, top_k_reconstructions

__all__ = [
    "relative_energy",
    "energy_from_projections",
    "spectral_projections",
    "spectrum_preservation",
    "kernel_target_alignment",
    "alignment_from_products",
    "centered_sq_frobenius",
    "lr_eigen_product",
    "flow_speed",
    "stability_bound",
    "first_order_update",
    "first_order_accuracy",
    "FirstOrderAccuracy",
    "constant_gram_dynamics",
    "ConstantGramTrajectory",
    "constant_gram_decay",
    "constant_gram_decays",
    "constant_gram_log_decays",
    "Decays",
    "constant_gram_residual",
    "ConstantGramResidual",
    "constant_gram_test_outputs",
    "nystrom_extension",
    "nystrom_from_products",
    "fourier_transform",
    "fourier_transform_grid",
    "frequency_grid",
    "RECONSTRUCTION_KS",
    "reconstruction_ks",
    "top_k_reconstructions",
    "FrequencyGrid",
]
