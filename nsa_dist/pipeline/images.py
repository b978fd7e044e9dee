"""Eigenvector images on a grid and their Fourier magnitudes, for 2-D inputs (NSA Figs. 4–6, App. G)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.metrics import fourier_transform_grid, frequency_grid
from nsa_dist.store.records import ImageStep

if TYPE_CHECKING:
    from nsa_dist.config import ExperimentSpec
    from nsa_dist.data import Dataset

__all__ = ["EigenImages", "image_indices", "unit_coordinates"]


def unit_coordinates(data: Dataset) -> np.ndarray:
    """The training inputs in their original [0, 1]² coordinates (undoing image2d's normalisation)."""
    X = np.asarray(data.X, dtype=np.float64)
    if "x_mean" in data.meta:
        X = X * np.asarray(data.meta["x_std"]) + np.asarray(data.meta["x_mean"])
    return X


class EigenImages:
    """Renders vectors sampled at the training points as (R, R) images and |φ̂| on a frequency grid.

    The image is a linear interpolation from the points to an R×R grid on [0, 1]² (as the paper's
    Fig. 4d), nearest-neighbour outside the points' convex hull; the Fourier magnitude is Eq. 27
    on [−limit, limit]² with F×F frequencies.
    """

    def __init__(self, X01: np.ndarray, indices: list[int], size: int, limit: float, n_freq: int) -> None:
        from scipy.spatial import Delaunay  # here, not at import: only runs with images load scipy

        self.X01, self.indices = X01, indices  # (N, 2), 1-based eigenvector indices
        self.tri = Delaunay(X01)
        g = (np.arange(size) + 0.5) / size
        gx, gy = np.meshgrid(g, g, indexing="xy")  # row = y, column = x
        self.grid = np.stack([gx.ravel(), gy.ravel()], axis=1)  # (R², 2)
        self.size = size
        self.freqs = frequency_grid(limit, n_freq, 2)

    def image(self, V: np.ndarray) -> np.ndarray:
        """V (N, m) → (m, R, R)."""
        from scipy.interpolate import LinearNDInterpolator, NearestNDInterpolator

        vals = LinearNDInterpolator(self.tri, V)(self.grid)  # (R², m)
        holes = np.isnan(vals).any(axis=1)
        if holes.any():
            vals[holes] = NearestNDInterpolator(self.X01, V)(self.grid[holes])
        return vals.T.reshape(-1, self.size, self.size)

    def fourier(self, V: np.ndarray) -> np.ndarray:
        """V (N, m) → |φ̂| (m, F, F) on the frequency grid (axis 0: ξ_x, axis 1: ξ_y)."""
        F = np.abs(fourier_transform_grid(V, self.X01, self.freqs))  # (F², m)
        return F.T.reshape((-1,) + self.freqs.shape)

    def render(self, V: np.ndarray, residual: np.ndarray) -> ImageStep:
        """V (N, nI): the eigenvectors of ``indices``, in that order; residual (N,)."""
        both = np.concatenate([V, residual[:, None]], axis=1)  # (N, nI + 1)
        img, four = self.image(both), self.fourier(both)
        return ImageStep(
            eigvec_images=img[:-1].astype(np.float32),
            eigvec_fourier=four[:-1].astype(np.float32),
            residual_image=img[-1].astype(np.float32),
            residual_fourier=four[-1].astype(np.float32),
        )


def image_indices(spec: ExperimentSpec, data: Dataset, K: int) -> tuple[int, ...]:
    """The eigenvectors drawn as images (1-based): the requested ones ≤ K, on 2-D points only (not
    (N, 2, H, W) images); empty otherwise.  Decided without building the renderer."""
    if data.X.ndim != 2 or data.X.shape[1] != 2:
        return ()
    chosen = spec.spectrum.images
    beyond = [i for i in chosen if i > K]
    default = type(spec.spectrum).model_fields["images"].default_factory()
    if beyond and chosen != default and (spec.name, tuple(beyond), K) not in _WARNED:  # the default: those ≤ K
        _WARNED.add((spec.name, tuple(beyond), K))
        import logging

        logging.getLogger("nsa_dist").warning(
            "run %r: spectrum.images %s are beyond the K = %d eigenpairs the run keeps (spectrum.k, or "
            "quadrature.top on the quadrature route): not drawn",
            spec.name,
            beyond,
            K,
        )
    return tuple(i for i in chosen if i <= K)


_WARNED: set[tuple] = set()
