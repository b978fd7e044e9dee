"""The sizes of a run's arrays (what exists is decided from them by :mod:`nsa_dist.store.records`)."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields, replace

__all__ = ["RunDims"]


@dataclass(frozen=True)
class RunDims:
    """Sizes of a run's arrays (what exists is decided from them by :mod:`nsa_dist.store.records`).

    N/M train/test points, d inputs, Ko outputs, P parameters, S recorded steps, T training
    steps, K eigenpairs kept; the others are named for what they count or switch.
    """

    N: int
    M: int
    d: int
    Ko: int
    P: int
    S: int
    T: int
    K: int
    k_test: int  # test-point eigenpairs (0: none)
    n_images: int  # eigenvector images (NSA Fig. 4–5; 0: none) …
    image_size: int  # … of image_size² pixels
    fourier_size: int  # … and fourier_size² frequencies
    n_slots: int  # optimizer state vectors of the resume state
    rng_bytes: int  # the trainer's RNG state of the resume state
    store_eigenvectors: bool
    hessian: bool = False  # the run has a hessian block
    hessian_top_k: int = 0
    hessian_rayleigh_k: int = 0
    hessian_density_bins: int = 0
    k_full: int = 0  # full-kernel eigenvalues of a K-output network
    k_class: int = 0  # per-class (diagonal block) eigenvalues of a K-output network
    hessian_moments: bool = True  # hessian.moments: the Hutch++ moment arrays exist
    hessian_orthogonality: bool = True
    hessian_I_k: int = 0  # eigenvalues of I stored per analysed step, measured and limit: N·Ko
    hessian_additivity: bool = True  # Theorem 1's gap
    hessian_trace_G: bool = True  # the per-point traces G and Tr(S) = ∇Cᵀ·G
    k_gram_change: int = 0  # App. F: eigenvectors dG_t is projected on
    constant_gram: bool = False  # App. E: the constant-Gram prediction of the test outputs
    curve_points: int = 0  # k: all on the quadrature route: the reported k of the curves (0: exact route / top-k)
    gram_density_bins: int = 0  # … and the grid of G's SLQ spectral density
    curve_points_test: int = 0  # … and the reported k of E_t(f_test, k) beyond the test Gram's top k_test (0: none)
    # θ_t and the optimizer slots of the resume state: a float64 Tracker model's in float64 (in float32 they
    # were θ_t rounded to 6·10⁻⁸: theta_at's resume left the recorded trajectory, a reader's own kernel at the
    # stored θ_t missed the stored spectrum in the 7th digit); the float32 trainer's and a runs' before it float32
    state_dtype: str = "float32"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> RunDims:
        """The sizes as stored; a run written before the fields were named (``Hm``, ``Kt``, …) reads too."""
        return cls(**{_OLD_NAMES.get(k, k): v for k, v in d.items()})

    def as_recorded(self, stored: dict) -> RunDims:
        """These sizes with every field that the run's ``stored`` sizes lack (named since an earlier
        nsa-dist recorded it) as the run reads it, at its default: a resumed run goes on with the
        arrays it was created with (today's plan of a run with test points has App. E's
        constant-Gram arrays, which a run of 2026-11-29 has not: its resume was refused as corrupt)."""
        named = {_OLD_NAMES.get(k, k) for k in stored}
        return replace(
            self, **{f.name: f.default for f in fields(self) if f.name not in named and f.default is not MISSING}
        )


_OLD_NAMES = {
    "Kt": "k_test",
    "nI": "n_images",
    "R": "image_size",
    "F": "fourier_size",
    "L": "rng_bytes",
    "Hk": "hessian_top_k",
    "Hr": "hessian_rayleigh_k",
    "Hg": "hessian_density_bins",
    "Kf": "k_full",
    "Kc": "k_class",
    "Hm": "hessian_moments",
    "Ho": "hessian_orthogonality",
    "HI": "hessian_I_k",
    "Ha": "hessian_additivity",
    "Ht": "hessian_trace_G",
    "Kg": "k_gram_change",
    "Cg": "constant_gram",
}
