"""The NSA paper's 2-D regression: a grayscale image as a function y(X) on [0, 1]² (§6 Setup)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from nsa_dist.data._dataset import Dataset
from nsa_dist.data._paths import is_url, read_bytes, regular_file

__all__ = ["image2d", "load_image", "image_function"]


def load_image(path: str | Path | None = None) -> np.ndarray:
    """A grayscale image as float64 (H, W) in [0, 1].

    Args:
        path: a PNG/JPEG file, a local path or an fsspec URL (``s3://bucket/mona_lisa.png``); None →
            scikit-image's bundled ``camera`` photograph (a stand-in for the paper's Mona Lisa, which no
            package ships).

    Raises:
        FileNotFoundError: ``path`` does not exist (the message names it, URL included).
        ValueError: ``path`` is a directory, not a regular file, or not a readable PNG/JPEG image.
    """
    if path is None:
        from skimage.data import camera

        img = camera()
    else:
        p = regular_file(path, "image2d", "a PNG or JPEG image file")
        from skimage.io import imread

        try:
            img = imread(io.BytesIO(read_bytes(p)) if is_url(p) else p)
        except Exception as exc:  # noqa: BLE001 - any decoder failure means "not an image"
            raise ValueError(f"image2d: {str(p)!r} is not a readable PNG/JPEG image ({exc})") from exc
    img = np.asarray(img, dtype=np.float64)
    if img.ndim == 3:  # RGB(A) → luminance
        img = img[..., :3] @ np.array([0.2125, 0.7154, 0.0721])
    if img.ndim != 2 or min(img.shape) < 2:
        raise ValueError(f"image2d: expected a 2-D grayscale or RGB image, got shape {img.shape}")
    bad = ~np.isfinite(img)
    if bad.any():  # a float TIFF/EXR-like decode: NaN or inf pixels would read as a constant image
        where = np.argwhere(bad)[0].tolist()
        raise ValueError(
            f"image2d: {str(path) if path is not None else 'the image'!r} has {int(bad.sum())} non-finite "
            f"pixel(s) (NaN/inf, the first at row {where[0]}, column {where[1]}); give an image "
            "whose pixels are numbers"
        )
    lo, hi = img.min(), img.max()
    return (img - lo) / (hi - lo) if hi > lo else np.zeros_like(img)


def image_function(img: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Bilinear lookup y(X) of ``img`` (H, W) at X (N, 2) ∈ [0, 1]²; X[:, 0] is the column (x), X[:, 1] the row (y)."""
    H, W = img.shape
    rows = X[:, 1] * (H - 1)
    cols = X[:, 0] * (W - 1)
    from scipy.ndimage import map_coordinates  # here, not at import: scipy.ndimage costs every process 0.2 s

    return map_coordinates(img, [rows, cols], order=1, mode="nearest")  # (N,)


def image2d(
    n: int = 10_000, *, n_test: int = 0, image: str | Path | None = None, seed: int = 0, normalize: bool = True
) -> Dataset:
    """N points sampled uniformly on [0, 1]² with targets from the image (NSA §6).

    Inputs and targets are normalised to mean 0, std 1 with the TRAINING statistics
    (the test split uses the same constants, stored in ``meta``).

    Args:
        n: number of training points N.
        n_test: number of test points.
        image: image path, or None for the bundled ``camera`` photograph.
        seed: sampling seed.
        normalize: apply the normalisation above.
    """
    if n < 1 or n_test < 0:
        raise ValueError(f"image2d: need n >= 1 and n_test >= 0, got n={n}, n_test={n_test}")
    img = load_image(image)
    rng = np.random.default_rng(seed)
    U = rng.random((n + n_test, 2))  # (N+M, 2) in [0,1]²
    Y = image_function(img, U)
    meta = {
        "source": "image2d",
        "image": str(image) if image is not None else "skimage:camera",
        "image_shape": list(img.shape),
        "seed": seed,
    }
    if normalize:
        mx, sx = U[:n].mean(0), U[:n].std(0)
        my, sy = Y[:n].mean(), Y[:n].std() or 1.0
        U, Y = (U - mx) / sx, (Y - my) / sy
        meta.update(x_mean=mx.tolist(), x_std=sx.tolist(), y_mean=float(my), y_std=float(sy))
    return Dataset(U[:n], Y[:n], U[n:], Y[n:], meta)
