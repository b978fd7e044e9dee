"""What one recorded step's analysis produces: one frozen record per part, combined in a StepResult.

Each field of a record is one per-step array of the store, named as stored.  Its metadata says
its per-step shape, its stored dtype, whether a run has it at all (``when``, from the run's
sizes) and which recorded steps write it (``at``).  :func:`step_array_specs` turns the records
into the schema's per-step array specs, so the one place that decides whether an array exists
is its field here: the producers ask the run's plan whether it has an array, never their own
copy of the switches.

Records hold numpy arrays (or Python scalars for 0-d arrays); a field is None when the run or
the step does not have that array.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from nsa_dist.metrics.reconstruction import reconstruction_ks
from nsa_dist.store.dims import RunDims

__all__ = [
    "CURVE_ARRAYS",
    "GramStep",
    "KernelExtras",
    "HessianStep",
    "ImageStep",
    "StepResult",
    "PHIS",
    "NOTES_DTYPE",
    "step_array_specs",
    "not_computed",
]

PHIS = ("y", "f", "residual", "df", "df_pred")  # the φ of E_t(φ, k) stored every step
NOTES_DTYPE = "T"  # numpy's variable-length UTF-8 strings (np.dtype("T")); Zarr's vlen-utf8


def _array(
    shape: Callable[[RunDims], tuple[int, ...]],
    dtype: str = "float64",
    when: Callable[[RunDims], bool] | None = None,
    at: str = "every",
) -> Any:
    """A record field that is a stored per-step array (None when absent)."""
    return field(default=None, metadata={"shape": shape, "dtype": dtype, "when": when, "at": at})


def _out(n: Callable[[RunDims], int]) -> Callable[[RunDims], tuple[int, ...]]:
    """Per-point outputs: (n,) for one output, (n, Ko) for several."""
    return lambda D: (n(D),) if D.Ko == 1 else (n(D), D.Ko)


_SCALAR = lambda D: ()  # noqa: E731
_K = lambda D: (D.K,)  # noqa: E731
_N, _M = (lambda D: D.N), (lambda D: D.M)  # noqa: E731
_n_rec = lambda D: len(reconstruction_ks(D.K))  # noqa: E731
_evecs = lambda D: D.store_eigenvectors  # noqa: E731
_CURVE = lambda D: (D.curve_points,)  # noqa: E731
_curve = lambda D: D.curve_points > 0  # noqa: E731
_CURVE_TEST = lambda D: (D.curve_points_test,)  # noqa: E731
_curve_test = lambda D: D.curve_points_test > 0  # noqa: E731
CURVE_ARRAYS = ("curve_eigenvalue",) + tuple(f"curve_energy_{p}" for p in ("y", "f", "residual", "df", "df_pred"))


@dataclass(frozen=True)
class GramStep:
    """G_t's spectrum and the NSA paper's metrics at one recorded step (NSA §3–§6, App. E–F)."""

    loss: float = _array(_SCALAR)
    lr: float = _array(_SCALAR)
    f: np.ndarray = _array(_out(_N), "float32")
    df: np.ndarray = _array(_out(_N), "float32")
    df_pred: np.ndarray = _array(_out(_N), "float32")
    f_test: np.ndarray = _array(_out(_M), "float32")
    eigenvalues: np.ndarray = _array(_K)
    first_order_error: float = _array(_SCALAR)
    first_order_cos: float = _array(_SCALAR)
    alignment: float = _array(_SCALAR)
    alignment_centered: float = _array(_SCALAR)
    gram_sq_frobenius: np.ndarray = _array(lambda D: (2,))  # ‖G‖_F², its stderr (0: exact)
    energy_y: np.ndarray = _array(_K)
    energy_f: np.ndarray = _array(_K)
    energy_residual: np.ndarray = _array(_K)
    energy_df: np.ndarray = _array(_K)
    energy_df_pred: np.ndarray = _array(_K)
    eigenvectors: np.ndarray = _array(lambda D: (D.N, D.K), "float32", _evecs, "eigenvectors")
    eigenvalues_test: np.ndarray = _array(lambda D: (D.k_test,), when=lambda D: D.k_test > 0)
    energy_f_test: np.ndarray = _array(lambda D: (D.k_test,), when=lambda D: D.k_test > 0)
    # k: all on the quadrature route with test points: E_t(f_test, k) at the reported k of the test
    # Gram (static curve_k_test), with its bracket (NSA Fig. 3e to M)
    curve_energy_f_test: np.ndarray = _array(_CURVE_TEST, when=_curve_test)
    curve_energy_f_test_lower: np.ndarray = _array(_CURVE_TEST, when=_curve_test)
    curve_energy_f_test_upper: np.ndarray = _array(_CURVE_TEST, when=_curve_test)
    # Fig. 4d's f̄_{t,k} and App. F's dG_t, at the eigenvector steps
    reconstructions: np.ndarray = _array(lambda D: (_n_rec(D),) + _out(_N)(D), "float32", _evecs, "eigenvectors")
    reconstruction_images: np.ndarray = _array(
        lambda D: (_n_rec(D), D.image_size, D.image_size),
        "float32",
        lambda D: D.store_eigenvectors and D.n_images > 0,
        "eigenvectors",
    )
    gram_change: np.ndarray = _array(
        lambda D: (2, D.k_gram_change),  # v_iᵀ dG v_i: measured, first order
        when=lambda D: D.store_eigenvectors and D.k_gram_change > 0,
        at="eigenvectors",
    )
    gram_change_fro: np.ndarray = _array(
        lambda D: (3,),  # ‖VᵀdGV‖_F: measured, predicted, difference
        when=lambda D: D.store_eigenvectors and D.k_gram_change > 0,
        at="eigenvectors",
    )
    # App. E, Eq. 22 (Nyström): f_test of every recorded step predicted at the first
    constant_gram_f_test: np.ndarray = _array(
        lambda D: (D.S,) + _out(_M)(D), when=lambda D: D.constant_gram and D.M > 0, at="first"
    )
    # k: all on the quadrature route: λ_k and E_t(φ, k) at the reported k (static curve_k), each
    # with its bracket (lower ≤ value ≤ upper, equal for k ≤ K), and G_t's SLQ spectral density
    curve_eigenvalue: np.ndarray = _array(_CURVE, when=_curve)
    curve_eigenvalue_lower: np.ndarray = _array(_CURVE, when=_curve)
    curve_eigenvalue_upper: np.ndarray = _array(_CURVE, when=_curve)
    curve_energy_y: np.ndarray = _array(_CURVE, when=_curve)
    curve_energy_y_lower: np.ndarray = _array(_CURVE, when=_curve)
    curve_energy_y_upper: np.ndarray = _array(_CURVE, when=_curve)
    curve_energy_f: np.ndarray = _array(_CURVE, when=_curve)
    curve_energy_f_lower: np.ndarray = _array(_CURVE, when=_curve)
    curve_energy_f_upper: np.ndarray = _array(_CURVE, when=_curve)
    curve_energy_residual: np.ndarray = _array(_CURVE, when=_curve)
    curve_energy_residual_lower: np.ndarray = _array(_CURVE, when=_curve)
    curve_energy_residual_upper: np.ndarray = _array(_CURVE, when=_curve)
    curve_energy_df: np.ndarray = _array(_CURVE, when=_curve)
    curve_energy_df_lower: np.ndarray = _array(_CURVE, when=_curve)
    curve_energy_df_upper: np.ndarray = _array(_CURVE, when=_curve)
    curve_energy_df_pred: np.ndarray = _array(_CURVE, when=_curve)
    curve_energy_df_pred_lower: np.ndarray = _array(_CURVE, when=_curve)
    curve_energy_df_pred_upper: np.ndarray = _array(_CURVE, when=_curve)
    gram_density_grid: np.ndarray = _array(lambda D: (D.gram_density_bins,), when=lambda D: D.gram_density_bins > 0)
    gram_density: np.ndarray = _array(lambda D: (D.gram_density_bins,), when=lambda D: D.gram_density_bins > 0)
    # why some of this step's diagnostics are NaN: JSON {array name: reason}, "" when none
    step_notes: str = _array(_SCALAR, NOTES_DTYPE)


@dataclass(frozen=True)
class KernelExtras:
    """Per-step quantities of the NSA paper's later figures: Fig. 4a's projections, the test loss, K-output kernels."""

    projections_residual: np.ndarray = _array(_K)
    loss_test: float = _array(_SCALAR, when=lambda D: D.M > 0)
    eigenvalues_full: np.ndarray = _array(lambda D: (D.k_full,), when=lambda D: D.k_full > 0)
    eigenvalues_per_class: np.ndarray = _array(lambda D: (D.Ko, D.k_class), when=lambda D: D.k_class > 0)


def _h(
    shape: Callable[[RunDims], tuple[int, ...]], when: Callable[[RunDims], bool] | None = None, dtype: str = "float64"
) -> Any:
    """A Hessian array: only in runs with a hessian block, written at its analysed steps."""
    return _array(shape, dtype, lambda D: D.hessian and (when is None or when(D)), "hessian")


_moments = lambda D: D.hessian_moments  # noqa: E731


@dataclass(frozen=True)
class HessianStep:
    """H = I + S at one analysed step (the Hessian paper): moments, orthogonality, spectra, limits."""

    hessian_products: int = _h(_SCALAR, dtype="int64")
    hessian_moments: np.ndarray = _h(lambda D: (3, 4), _moments)  # Hutch++ Tr(A^k)/P for H, I, S
    hessian_moments_stderr: np.ndarray = _h(lambda D: (3, 4), _moments)
    hessian_moments_I_exact: np.ndarray = _h(lambda D: (4,), _moments)
    hessian_orthogonality: np.ndarray = _h(lambda D: (2,), lambda D: D.hessian_orthogonality)
    hessian_rayleigh: np.ndarray = _h(lambda D: (2, 2, D.hessian_rayleigh_k), lambda D: D.hessian_rayleigh_k > 0)
    hessian_rayleigh_evals: np.ndarray = _h(lambda D: (2, D.hessian_rayleigh_k), lambda D: D.hessian_rayleigh_k > 0)
    hessian_top: np.ndarray = _h(lambda D: (3, D.hessian_top_k), lambda D: D.hessian_top_k > 0)
    hessian_density_grid: np.ndarray = _h(lambda D: (D.hessian_density_bins,), lambda D: D.hessian_density_bins > 0)
    hessian_density: np.ndarray = _h(lambda D: (D.hessian_density_bins,), lambda D: D.hessian_density_bins > 0)
    hessian_additivity: np.ndarray = _h(lambda D: (2, 4), lambda D: D.hessian_additivity)  # gap, stderr
    hessian_I_limit_moments: np.ndarray = _h(lambda D: (4,), _moments)  # Tr(I^k) of the Θ∞ limit
    hessian_S_limit: np.ndarray = _h(lambda D: (3,), _moments)  # E Tr S at init, along GD; Tr S²
    hessian_G: np.ndarray = _h(_out(_N), lambda D: D.hessian_trace_G)  # Σ_p ∂²f(x_i)/∂θ_p²
    hessian_G_stderr: np.ndarray = _h(_out(_N), lambda D: D.hessian_trace_G)
    hessian_trace_S_G: np.ndarray = _h(lambda D: (2,), lambda D: D.hessian_trace_G)  # Tr(S) = ∇Cᵀ·G, stderr
    hessian_I_eigenvalues: np.ndarray = _h(lambda D: (D.hessian_I_k,), lambda D: D.hessian_I_k > 0 and _moments(D))
    hessian_I_limit_eigenvalues: np.ndarray = _h(
        lambda D: (D.hessian_I_k,), lambda D: D.hessian_I_k > 0 and _moments(D)
    )
    hessian_S_op: float = _h(_SCALAR, lambda D: D.hessian_top_k > 0)  # ‖S‖_op = max |λ(S)|


@dataclass(frozen=True)
class ImageStep:
    """NSA Fig. 4–5: eigenvectors and the residual drawn over 2-D inputs, with their Fourier moduli."""

    eigvec_images: np.ndarray = _array(
        lambda D: (D.n_images, D.image_size, D.image_size), "float32", lambda D: D.n_images > 0
    )
    eigvec_fourier: np.ndarray = _array(
        lambda D: (D.n_images, D.fourier_size, D.fourier_size), "float32", lambda D: D.n_images > 0
    )
    residual_image: np.ndarray = _array(lambda D: (D.image_size, D.image_size), "float32", lambda D: D.n_images > 0)
    residual_fourier: np.ndarray = _array(
        lambda D: (D.fourier_size, D.fourier_size), "float32", lambda D: D.n_images > 0
    )


_PARTS = (GramStep, KernelExtras, HessianStep, ImageStep)


@dataclass(frozen=True)
class StepResult:
    """Everything one recorded step's analysis hands the writer: one record per part."""

    gram: GramStep
    extras: KernelExtras
    hessian: HessianStep | None = None
    images: ImageStep | None = None

    def arrays(self) -> dict[str, Any]:
        """The arrays present, by stored name."""
        return {
            f.name: getattr(part, f.name)
            for part in (self.gram, self.extras, self.hessian, self.images)
            if part is not None
            for f in fields(part)
            if getattr(part, f.name) is not None
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any]) -> StepResult:
        """The result holding ``arrays`` (stored names; e.g. a step read back from the store).

        Raises:
            ValueError: a name that no step record has.
        """
        unknown = sorted(set(arrays) - {f.name for part in _PARTS for f in fields(part)})
        if unknown:
            raise ValueError(f"not arrays of a step result: {', '.join(unknown)}")
        parts = [part(**{f.name: arrays[f.name] for f in fields(part) if f.name in arrays}) for part in _PARTS]
        hessian, images = (p if any(getattr(p, f.name) is not None for f in fields(p)) else None for p in parts[2:])
        return cls(parts[0], parts[1], hessian, images)

    @property
    def lambda_max(self) -> float:
        """The λ_max that sets GD's stability: of the full NK×NK kernel for a K-output run, else of
        the (traced) Gram — what progress displays show."""
        lam = self.extras.eigenvalues_full if self.extras.eigenvalues_full is not None else self.gram.eigenvalues
        return float(lam[0])

    def energy_y_at(self, k: int) -> float:
        """E_t(y, k) (k capped at K: :attr:`summary_k` says which k the progress line's E(y, 10) is)."""
        E = self.gram.energy_y
        return float(E[min(k, len(E)) - 1])

    @property
    def summary_k(self) -> int:
        """The k of the progress line's E(y, k): 10, or K where the run keeps fewer (E(y, 5) was labelled
        E(y,10), an audit)."""
        return min(10, len(self.gram.energy_y))


def step_array_specs(D: RunDims) -> list[tuple[str, tuple[int, ...], str, str]]:
    """(name, per-step shape, dtype, at) of every per-step analysis array the run ``D`` has."""
    out = []
    for part in _PARTS:
        for f in fields(part):
            m = f.metadata
            if m["when"] is None or m["when"](D):
                out.append((f.name, tuple(m["shape"](D)), m["dtype"], m["at"]))
    return out


def not_computed(name: str, D: RunDims) -> Any:
    """The value a step stores for array ``name`` when it could not be computed: NaN of its
    per-step shape (integers: −1), for a diagnostic that failed at this step (its reason goes
    into the step's ``step_notes``)."""
    for part in _PARTS:
        for f in fields(part):
            if f.name == name:
                dtype = np.dtype(f.metadata["dtype"])
                shape = tuple(f.metadata["shape"](D))
                return np.full(shape, np.nan if dtype.kind == "f" else -1, dtype)
    raise KeyError(f"{name!r} is not an array of a step result")
