"""The layout of a run in the spectrum store (documented in docs/store.md).

Every per-step array has the recording schedule as its first axis (S entries) and one chunk
per step, so the writer of (run, step) touches its own chunks only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["SCHEMA_VERSION", "ArraySpec", "RunDims", "run_arrays", "PHIS"]

SCHEMA_VERSION = 1
PHIS = ("y", "f", "residual", "df", "df_pred")


@dataclass(frozen=True)
class RunDims:
    """Sizes of a run's arrays.

    N/M train/test points, d inputs, Ko outputs, P parameters, S recorded steps, T training
    steps, K eigenpairs kept, Kt test eigenpairs (0: none), nI eigenvector images of R×R
    pixels and F×F frequencies (0: none), n_slots optimizer state vectors, L RNG bytes.
    """

    N: int
    M: int
    d: int
    Ko: int
    P: int
    S: int
    T: int
    K: int
    Kt: int
    nI: int
    R: int
    F: int
    n_slots: int
    L: int
    store_eigenvectors: bool
    hessian: bool = False
    Hk: int = 0
    Hr: int = 0
    Hg: int = 0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ArraySpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    per_step: bool

    @property
    def chunks(self) -> tuple[int, ...]:
        if self.per_step:
            return (1,) + tuple(max(1, s) for s in self.shape[1:])
        if self.name == "loss_trace":
            return (min(max(1, self.shape[0]), 65536),)
        return tuple(max(1, s) for s in self.shape)

    @property
    def fill(self) -> object:
        kind = np.dtype(self.dtype).kind
        return np.nan if kind == "f" else (False if kind == "b" else 0)


def run_arrays(D: RunDims) -> list[ArraySpec]:
    """Every array of a run, sized up front."""
    out_shape = lambda n: (n,) if D.Ko == 1 else (n, D.Ko)  # noqa: E731
    a = [
        ArraySpec("X", (D.N, D.d), "float64", False),
        ArraySpec("y", out_shape(D.N), "float64", False),
        ArraySpec("X_test", (D.M, D.d), "float64", False),
        ArraySpec("y_test", out_shape(D.M), "float64", False),
        ArraySpec("steps", (D.S,), "int64", False),
        ArraySpec("image_indices", (D.nI,), "int64", False),
        ArraySpec("loss_trace", (D.T,), "float64", False),
        ArraySpec("done", (D.S,), "bool", True),
        ArraySpec("loss", (D.S,), "float64", True),
        ArraySpec("lr", (D.S,), "float64", True),
        ArraySpec("theta", (D.S, D.P), "float32", True),
        ArraySpec("opt_slots", (D.S, D.n_slots, D.P), "float32", True),
        ArraySpec("rng_state", (D.S, D.L), "uint8", True),
        ArraySpec("f", (D.S,) + out_shape(D.N), "float32", True),
        ArraySpec("df", (D.S,) + out_shape(D.N), "float32", True),
        ArraySpec("df_pred", (D.S,) + out_shape(D.N), "float32", True),
        ArraySpec("f_test", (D.S,) + out_shape(D.M), "float32", True),
        ArraySpec("eigenvalues", (D.S, D.K), "float64", True),
        ArraySpec("first_order_error", (D.S,), "float64", True),
        ArraySpec("first_order_cos", (D.S,), "float64", True),
        ArraySpec("alignment", (D.S,), "float64", True),
        ArraySpec("alignment_centered", (D.S,), "float64", True),
        ArraySpec("gram_sq_frobenius", (D.S, 2), "float64", True),  # ‖G‖_F², its stderr (0: exact)
    ]
    a += [ArraySpec(f"energy_{phi}", (D.S, D.K), "float64", True) for phi in PHIS]
    if D.store_eigenvectors:
        a.append(ArraySpec("eigenvectors", (D.S, D.N, D.K), "float32", True))
    if D.Kt:
        a += [ArraySpec("eigenvalues_test", (D.S, D.Kt), "float64", True),
              ArraySpec("energy_f_test", (D.S, D.Kt), "float64", True)]
    if D.hessian:
        a += [ArraySpec("hessian_steps", (D.S,), "bool", False),
               ArraySpec("hessian_moments", (D.S, 3, 4), "float64", True),
               ArraySpec("hessian_moments_stderr", (D.S, 3, 4), "float64", True),
               ArraySpec("hessian_moments_I_exact", (D.S, 4), "float64", True),
               ArraySpec("hessian_orthogonality", (D.S, 2), "float64", True),
               ArraySpec("hessian_products", (D.S,), "int64", True)]
        if D.Hr:
            a += [ArraySpec("hessian_rayleigh", (D.S, 2, 2, D.Hr), "float64", True),
                  ArraySpec("hessian_rayleigh_evals", (D.S, 2, D.Hr), "float64", True)]
        if D.Hk:
            a.append(ArraySpec("hessian_top", (D.S, 3, D.Hk), "float64", True))
        if D.Hg:
            a += [ArraySpec("hessian_density_grid", (D.S, D.Hg), "float64", True),
                  ArraySpec("hessian_density", (D.S, D.Hg), "float64", True)]
    if D.nI:
        a += [ArraySpec("eigvec_images", (D.S, D.nI, D.R, D.R), "float32", True),
              ArraySpec("eigvec_fourier", (D.S, D.nI, D.F, D.F), "float32", True),
              ArraySpec("residual_image", (D.S, D.R, D.R), "float32", True),
              ArraySpec("residual_fourier", (D.S, D.F, D.F), "float32", True)]
    return a
