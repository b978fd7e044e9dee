"""The layout of a run in the spectrum store, and the one contract of what a step writes.

Every per-step array has the recording schedule as its first axis (S entries) and its own
chunks per step (the writer of (run, step) touches its own chunks only); a step's chunk is
split along its last axes (eigenvectors: along k) so that no chunk exceeds ``CHUNK_BYTES``.
:class:`StepRecord` is what an analysis hands the writer: it is checked here, key by key,
against :func:`run_arrays` before anything of the step is written (docs/store.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from nsa_dist.metrics.reconstruction import reconstruction_ks
from nsa_dist.store.dims import RunDims
from nsa_dist.store.records import PHIS, step_array_specs

__all__ = [
    "SCHEMA_VERSION",
    "CHUNK_BYTES",
    "ArraySpec",
    "RunDims",
    "StepRecord",
    "run_arrays",
    "PHIS",
    "STATE_ARRAYS",
    "dimension_names",
    "step_specs",
    "AXIS_LABELS",
]

SCHEMA_VERSION = 1
# arrays schema 1 gained after stores were written, each with the time (Unix seconds) from which every
# line of development writes it: that of the last merge bringing in a branch without it (runs recorded
# there lack it too), else of the commit that first wrote it.  A run created before then was recorded
# without it (not damage; reopening the run makes it), a run created after that lacks it is damaged.
# Found by recording runs (images, test points, a Hessian, k: all) with the code of earlier
# commits from e6faf4d on and reading them with this one's
ADDED_ARRAYS = {
    # 3175a55 (ct 1796122748), 830078d (1796122486), ac71bbd (1796123213): merge 37fcf23
    **dict.fromkeys(("gram_sq_frobenius", "loss_test", "projections_residual"), 1796136184.0),
    # eigenvector_steps 11c67fa (1796160336), the Hessian paper's predictions 43183ad (1796159700): merge 3e8eee8
    **dict.fromkeys(
        (
            "eigenvector_steps",
            "hessian_additivity",
            "hessian_I_limit_moments",
            "hessian_G",
            "hessian_G_stderr",
            "hessian_trace_S_G",
            "hessian_S_op",
        ),
        1796164303.0,
    ),
    # the limits of S 5da1c4e (1796181406), NSA Fig. 4d 8561a12 (1796181190): merge 89b0b9e
    **dict.fromkeys(("hessian_S_limit", "reconstruction_k", "reconstructions", "reconstruction_images"), 1796186364.0),
    "step_notes": 1796313424.0,  # 6fdc329
}
CHUNK_BYTES = 8 << 20  # the largest chunk written (8 MiB before compression): cheap to fetch from s3://
STATE_ARRAYS = ("theta", "opt_slots", "rng_state")  # the resume state, written from the checkpoint's state


@dataclass(frozen=True)
class ArraySpec:
    """One array of a run.  ``at``: which recorded steps write it — "every" step, only the
    "eigenvectors" steps (static ``eigenvector_steps``), only the "hessian" steps (static
    ``hessian_steps``), only the "first" recorded step (index 0); "" for static arrays."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    per_step: bool
    at: str = ""

    @property
    def dims(self) -> tuple[str, ...]:
        """Zarr v3 ``dimension_names`` (xarray reads them): see :func:`dimension_names`."""
        return dimension_names(self.name, len(self.shape))

    @property
    def chunks(self) -> tuple[int, ...]:
        """One step per chunk, split along the last axes (eigenvectors: k) to ≤ CHUNK_BYTES."""
        if self.per_step:
            return _split((1,) + tuple(max(1, s) for s in self.shape[1:]), np.dtype(self.dtype).itemsize)
        if self.name == "loss_trace":
            return (min(max(1, self.shape[0]), 65536),)
        return tuple(max(1, s) for s in self.shape)

    @property
    def fill(self) -> object:
        kind = np.dtype(self.dtype).kind
        return np.nan if kind == "f" else (False if kind == "b" else ("" if kind in "TU" else 0))


def added_since(name: str, created: object) -> bool:
    """Whether array ``name`` joined schema 1 after a run created at ``created`` (its ``created``
    attribute; a run without a readable one predates them all): such a run was recorded without it."""
    return name in ADDED_ARRAYS and (not isinstance(created, (int, float)) or created < ADDED_ARRAYS[name])


def _split(chunk: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Shrink the chunk's trailing axes (the last first) until it holds at most CHUNK_BYTES."""
    c = list(chunk)
    for ax in range(len(c) - 1, 0, -1):
        rest = itemsize * int(np.prod(c[:ax] + c[ax + 1 :]))
        if rest * c[ax] <= CHUNK_BYTES:
            break
        c[ax] = max(1, CHUNK_BYTES // rest)
    return tuple(c)


def _at(a: ArraySpec, at: str) -> ArraySpec:
    return ArraySpec(a.name, a.shape, a.dtype, a.per_step, at)


def run_arrays(D: RunDims) -> list[ArraySpec]:
    """Every array of a run, sized up front (per-step arrays tagged with the steps that write them)."""
    return [_at(a, "every") if a.per_step and not a.at else a for a in _run_arrays(D)]


def _run_arrays(D: RunDims) -> list[ArraySpec]:
    """The static arrays, the resume state, then every per-step array the step records define."""
    out_shape = lambda n: (n,) if D.Ko == 1 else (n, D.Ko)  # noqa: E731
    a = [
        ArraySpec("X", (D.N, D.d), "float64", False),
        ArraySpec("y", out_shape(D.N), "float64", False),
        ArraySpec("X_test", (D.M, D.d), "float64", False),
        ArraySpec("y_test", out_shape(D.M), "float64", False),
        ArraySpec("steps", (D.S,), "int64", False),
        ArraySpec("image_indices", (D.n_images,), "int64", False),
        ArraySpec("loss_trace", (D.T,), "float64", False),
        ArraySpec("done", (D.S,), "bool", True),
        ArraySpec("theta", (D.S, D.P), D.state_dtype, True),
        ArraySpec("opt_slots", (D.S, D.n_slots, D.P), D.state_dtype, True),
        ArraySpec("rng_state", (D.S, D.rng_bytes), "uint8", True),
    ]
    if D.store_eigenvectors:
        a += [
            ArraySpec("eigenvector_steps", (D.S,), "bool", False),
            ArraySpec("reconstruction_k", (len(reconstruction_ks(D.K)),), "int64", False),
        ]
    if D.hessian:
        a.append(ArraySpec("hessian_steps", (D.S,), "bool", False))
    if D.curve_points:
        a.append(ArraySpec("curve_k", (D.curve_points,), "int64", False))
    if D.curve_points_test:
        a.append(ArraySpec("curve_k_test", (D.curve_points_test,), "int64", False))
    return a + [ArraySpec(name, (D.S,) + shape, dtype, True, at) for name, shape, dtype, at in step_array_specs(D)]


# --------------------------------------------------------------------------- the step contract
def step_specs(D: RunDims, *, eigenvectors: bool, hessian: bool, first: bool = False) -> dict[str, ArraySpec]:
    """The arrays a step's analysis must hand over (the resume state and ``done`` excluded);
    ``first``: the first recorded step (index 0)."""
    want = (
        {"every"}
        | ({"eigenvectors"} if eigenvectors else set())
        | ({"hessian"} if hessian else set())
        | ({"first"} if first else set())
    )
    return {
        a.name: a
        for a in run_arrays(D)
        if a.per_step and a.at in want and a.name not in STATE_ARRAYS and a.name != "done"
    }


@dataclass(frozen=True)
class StepRecord:
    """The checked result of one recorded step: exactly the arrays :func:`step_specs` names, each
    of its per-step shape and of a dtype that casts to the stored one without changing kind."""

    index: int
    values: dict[str, np.ndarray]

    @classmethod
    def build(
        cls, D: RunDims, index: int, result: dict[str, Any], *, eigenvectors: bool, hessian: bool, where: str = ""
    ) -> StepRecord:
        """Check ``result`` against the contract; ValueError naming every unknown, missing or
        mis-shaped key (``where``: the run, for the message)."""
        from nsa_dist.errors import StoreError

        specs = step_specs(D, eigenvectors=eigenvectors, hessian=hessian, first=index == 0)
        result = {k: v for k, v in result.items() if k not in STATE_ARRAYS}
        problems = []
        unknown, missing = sorted(set(result) - set(specs)), sorted(set(specs) - set(result))
        if unknown:
            problems.append("unknown key(s) " + ", ".join(unknown) + _why_unknown(unknown, D, eigenvectors, hessian))
        if missing:
            problems.append("missing key(s) " + ", ".join(missing))
        values = {}
        for name in sorted(set(result) & set(specs)):
            a, v = specs[name], np.asarray(result[name])
            if tuple(v.shape) != a.shape[1:]:
                problems.append(f"{name} has shape {tuple(v.shape)}, the store holds {a.shape[1:]} per step")
            elif not _casts(v.dtype, np.dtype(a.dtype)):
                problems.append(f"{name} has dtype {v.dtype}, the store holds {a.dtype}")
            else:
                values[name] = v.astype(a.dtype, copy=False)
        if problems:
            raise StoreError(
                f"{where}step index {index}: the analysis result does not match the store schema: "
                + "; ".join(problems)
                + " (nothing of this step was written)"
            )
        return cls(index, values)


def _why_unknown(unknown: list[str], D: RunDims, eigenvectors: bool, hessian: bool) -> str:
    known = {a.name for a in run_arrays(D)}
    later = [k for k in unknown if k in known]
    return f" ({', '.join(later)} not written at this step)" if later else ""


def _casts(src: np.dtype, dst: np.dtype) -> bool:
    if dst.kind == "f":
        return src.kind in "fiub"
    if dst.kind in "iu":
        return src.kind in "iub"
    if dst.kind == "T":  # variable-length strings take any string
        return src.kind in "TU"
    return src.kind == dst.kind


# --------------------------------------------------------------------------- dimension names
_OUT = ("output",)
# the names of the entries of the short axes whose entries are named quantities: the coordinates of
# Run.to_xarray and the TensorBoard export's tags (one table: the two named gram_change_norm's second
# entry and along's differently, a review)
AXIS_LABELS: dict[str, tuple[str, ...]] = {
    "value_stderr": ("value", "stderr"),
    "hessian_part": ("H", "I", "S"),
    "S_prediction": ("trace_S_init", "trace_S", "trace_S2"),  # as HessianView.S_limit names them
    "predicted_measured": ("predicted", "measured"),
    "gram_change_norm": ("measured", "first_order", "difference"),
    "measured_first_order": ("measured", "first_order"),
    "along": ("along_I", "along_S"),  # Hessian-paper Fig. 3: along I's / S's top eigenvectors …
    "quotient": ("vIv", "vSv"),  # … the Rayleigh quotients vᵀIv and vᵀSv
}

_DIMS: dict[str, tuple[str, ...]] = {
    "X": ("point", "input"),
    "y": ("point",) + _OUT,
    "X_test": ("test_point", "input"),
    "y_test": ("test_point",) + _OUT,
    "steps": ("step",),
    "image_indices": ("image",),
    "loss_trace": ("train_step",),
    "theta": ("step", "param"),
    "opt_slots": ("step", "slot", "param"),
    "rng_state": ("step", "rng_byte"),
    "f": ("step", "point") + _OUT,
    "df": ("step", "point") + _OUT,
    "df_pred": ("step", "point") + _OUT,
    "f_test": ("step", "test_point") + _OUT,
    "eigenvalues": ("step", "k"),
    "eigenvectors": ("step", "point", "k"),
    "eigenvalues_test": ("step", "k_test"),
    "energy_f_test": ("step", "k_test"),
    "eigenvalues_full": ("step", "k_full"),
    "eigenvalues_per_class": ("step", "output", "k_class"),
    "projections_residual": ("step", "k"),
    "eigvec_images": ("step", "image", "pixel_y", "pixel_x"),
    "eigvec_fourier": ("step", "image", "freq_y", "freq_x"),
    "residual_image": ("step", "pixel_y", "pixel_x"),
    "residual_fourier": ("step", "freq_y", "freq_x"),
    "preservation": ("preservation_row", "k"),
    "hessian_moments": ("step", "hessian_part", "moment"),
    "hessian_moments_stderr": ("step", "hessian_part", "moment"),
    "hessian_moments_I_exact": ("step", "moment"),
    "hessian_orthogonality": ("step", "value_stderr"),
    "gram_sq_frobenius": ("step", "value_stderr"),
    "hessian_rayleigh": ("step", "along", "quotient", "hessian_k"),
    "hessian_rayleigh_evals": ("step", "along", "hessian_k"),
    "hessian_top": ("step", "hessian_part", "hessian_top_k"),
    "hessian_density_grid": ("step", "density_bin"),
    "hessian_density": ("step", "density_bin"),
    "hessian_additivity": ("step", "value_stderr", "moment"),
    "hessian_I_limit_moments": ("step", "moment"),
    "hessian_G": ("step", "point") + _OUT,
    "hessian_G_stderr": ("step", "point") + _OUT,
    "hessian_trace_S_G": ("step", "value_stderr"),
    "hessian_I_eigenvalues": ("step", "hessian_I_k"),
    "hessian_I_limit_eigenvalues": ("step", "hessian_I_k"),
    "hessian_S_op": ("step",),
    "hessian_S_limit": ("step", "S_prediction"),
    "reconstruction_k": ("reconstruction",),
    "reconstructions": ("step", "reconstruction", "point") + _OUT,
    "reconstruction_images": ("step", "reconstruction", "pixel_y", "pixel_x"),
    "gram_change": ("step", "measured_first_order", "k_gram_change"),
    "gram_change_fro": ("step", "gram_change_norm"),
    "constant_gram_f_test": ("step", "predicted_step", "test_point") + _OUT,
    "constant_gram_residual": ("step", "predicted_measured"),
    "constant_gram_energy": ("step", "k"),
    "curve_k": ("curve",),
    "curve_k_test": ("curve_test",),
    "curve_energy_f_test": ("step", "curve_test"),
    "curve_energy_f_test_lower": ("step", "curve_test"),
    "curve_energy_f_test_upper": ("step", "curve_test"),
    "gram_density_grid": ("step", "density"),
    "gram_density": ("step", "density"),
}


def dimension_names(name: str, ndim: int) -> tuple[str, ...]:
    """Named axes of array ``name`` with ``ndim`` axes (written as Zarr v3 ``dimension_names``).

    Per-step arrays start with "step" (the S recorded steps), then e.g. "point" (N), "k" (K),
    "output" (Ko, present only when Ko > 1); energies are ("step", "k"); any other array is
    ("step",) + ("<name>_dim<j>", …).
    """
    dims = _DIMS.get(name) or (
        ("step", "k") if name.startswith("energy_") else ("step", "curve") if name.startswith("curve_") else ("step",)
    )
    dims = dims[:ndim]
    return dims + tuple(f"{name}_dim{j}" for j in range(len(dims), ndim))
