"""``run.images``: on 2-D data, the eigenvector images v_i^t on the input grid and their |Fourier|
(NSA Figs. 5–6), with the residual's."""

from __future__ import annotations

import numpy as np

from nsa_dist.client._arrays import RunArrays

__all__ = ["ImagesView"]


class ImagesView:
    """The eigenvector and residual images of one run (``run.images``), read from its stored arrays."""

    def __init__(self, arrays: RunArrays) -> None:
        self._a = arrays

    @property
    def indices(self) -> np.ndarray:
        """(nI,) the 1-based eigenvector indices i drawn (``spectrum.images``)."""
        return self._a.array("image_indices")

    def at(self, step: int) -> dict[str, np.ndarray]:
        """At recorded step ``step``: eigenvector images (nI, R, R), their |Fourier| (nI, F, F), the
        residual's, the indices.

        Raises:
            KeyError: ``step`` is not a finished recorded step.
        """
        a = self._a
        i = a.index_of(step)
        return {
            "indices": self.indices,
            "eigvec_images": a.row("eigvec_images", i),
            "eigvec_fourier": a.row("eigvec_fourier", i),
            "residual_image": a.row("residual_image", i),
            "residual_fourier": a.row("residual_fourier", i),
        }

    def __repr__(self) -> str:
        return f"ImagesView({self._a.id!r})"
