"""``run.kernel``: the kernel quantities a run records beyond its traced spectrum (NSA Fig. 4,
App. E and F; per-class spectra of a K-output network)."""

from __future__ import annotations

import numpy as np

from nsa_dist.client._arrays import RunArrays
from nsa_dist.errors import StoreError

__all__ = ["KernelView"]


class KernelView:
    """Per-class spectra, residual projections, reconstructions, dG_t and the constant-Gram
    prediction of one run (``run.kernel``), read from its stored arrays."""

    def __init__(self, arrays: RunArrays) -> None:
        self._a = arrays

    @property
    def per_class_eigenvalues(self) -> np.ndarray:
        """(S, Ko, Kc) top eigenvalues of each diagonal block J_a J_aᵀ of the full kernel (one-hot:
        the per-class spectra), if ``spectrum.per_class_k`` > 0."""
        return self._a.per_step("eigenvalues_per_class")

    def residual_projections(self, step: int) -> np.ndarray:
        """(K,) ⟨v_i^t, m_t⟩² summed over outputs (NSA Fig. 4a), stored at every recorded step."""
        return np.asarray(self._a.row("projections_residual", self._a.index_of(step)), dtype=np.float64)

    def reconstructions(self, step: int) -> dict[str, np.ndarray]:
        """NSA Fig. 4d at eigenvector step ``step``: {"k": (nR,), "f": (nR, N[, Ko]) f̄_{t,k} =
        Σ_{i≤k} ⟨v_i, f̄_t⟩ v_i, and on 2-D data "images": (nR, R, R) on [0, 1]²}.

        Raises:
            KeyError: ``step`` is not finished, or not one of the eigenvector steps.
        """
        a = self._a
        i = a.index_of(step)
        if not a.has("reconstructions") or not a.stores_eigenvectors(step):
            raise KeyError(
                f"run {a.id!r} stores reconstructions only at its eigenvector steps "
                f"{a.eigenvector_steps.tolist()}, not at {step}"
            )
        out = {"k": a.array("reconstruction_k"), "f": a.row("reconstructions", i)}
        if a.has("reconstruction_images"):
            out["images"] = a.row("reconstruction_images", i)
        return out

    def gram_change(self) -> dict[str, np.ndarray]:
        """NSA App. F along the eigenvector steps: {"steps": (Se,), "measured", "first_order": (Se, Kg)
        v_iᵀ dG_t v_i, "fro": (Se, 3) ‖VᵀdG_tV‖_F measured, first order, their difference}."""
        a = self._a
        if not a.has("gram_change"):  # "has no array 'gram_change'" said neither why nor how (a walk-through)
            raise StoreError(
                f"run {a.id!r} did not measure App. F's dG_t: its spec has spectrum.gram_change_k: 0 (or no "
                "stored eigenvectors); record a run with spectrum.gram_change_k: 10, say, and store_eigenvectors"
            )
        idx = np.asarray([a.index_of(int(t)) for t in a.eigenvector_steps], dtype=np.int64)
        gc = np.asarray(a.rows("gram_change", idx))  # (Se, 2, Kg)
        fro = np.asarray(a.rows("gram_change_fro", idx))
        return {"steps": a.eigenvector_steps, "measured": gc[:, 0], "first_order": gc[:, 1], "fro": fro}

    def constant_gram_test(self) -> np.ndarray:
        """App. E, Eq. 22: (S, M[, Ko]) the test outputs f_t(X') at every recorded step predicted at the
        first one by GD with G_{t0} fixed, through the Nyström extension of its eigenvectors (the
        measured ones: ``run.outputs(t, "f_test")``)."""
        return np.asarray(self._a.row("constant_gram_f_test", 0), dtype=np.float64)

    def __repr__(self) -> str:
        return f"KernelView({self._a.id!r})"
