"""Density-estimation data for NCE (NSA §6 "Scope"): data samples, noise samples and the truth.

A dataset for ``loss: nce`` holds N = n_data + n_noise points X (data first, then noise) with

* ``y``: the true log-density log p(x) at every point (the function f_θ should learn, φ = y in
  every energy / alignment metric and Fig. 1a),
* ``extra["label"]``: c = 1 for data points, 0 for noise points,
* ``extra["log_noise"]``: log(ν q(x)), the NCE logit offset (h = f − log(ν q)),

and the same for the test split ("label_test", "log_noise_test").  Inputs are standardised
with the training data's mean and std; log p and log q are densities in those coordinates
(both shifted by Σ_j log s_j).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from nsa_dist.data._dataset import Dataset
from nsa_dist.data.image2d import image_function, load_image

__all__ = ["density2d", "gaussian_mixture", "nce_dataset", "FLOOR"]

FLOOR = 0.05
"""density2d: p ∝ intensity + FLOOR, so log p is finite on black pixels."""

_LogDensity = Callable[[np.ndarray], np.ndarray]
_Sampler = Callable[[np.random.Generator, int], np.ndarray]


def _image_density(image: str | Path | None) -> tuple[_LogDensity, _Sampler, float]:
    """log p (N, 2) → (N,) on [0, 1]² with p ∝ img + FLOOR (bilinear, :func:`image_function`) and
    ∫ p = 1, a rejection sampler, log of the box volume."""
    img = load_image(image) + FLOOR
    Z = _integral(img)  # ∫_[0,1]² of the bilinear interpolant that log_p evaluates
    hi = float(img.max())

    def log_p(X: np.ndarray) -> np.ndarray:
        inside = np.all((X >= 0) & (X <= 1), axis=1)
        return np.where(inside, np.log(image_function(img, np.clip(X, 0, 1)) / Z), -np.inf)

    def sample(rng: np.random.Generator, n: int) -> np.ndarray:
        out = np.zeros((0, 2))
        while len(out) < n:
            U = rng.random((4 * n, 2))
            keep = rng.random(4 * n) * hi < image_function(img, U)
            out = np.concatenate([out, U[keep]])
        return out[:n]

    return log_p, sample, 0.0


def _integral(img: np.ndarray) -> float:
    """∫_[0,1]² of :func:`image_function`'s bilinear interpolant of ``img`` (H, W), exactly: pixel
    (i, j) sits at (j/(W−1), i/(H−1)), so the integral is the trapezoid rule — edge pixels weigh ½,
    corners ¼ — not the pixel mean (which misses by the edges' share: 34% for a bright-framed
    6×9 image, 5e-4 for a 512² photograph)."""
    H, W = img.shape
    wr, wc = np.ones(H), np.ones(W)
    wr[[0, -1]] = wc[[0, -1]] = 0.5
    return float(wr @ img @ wc / ((H - 1) * (W - 1)))


def _mixture(d: int, seed: int) -> tuple[_LogDensity, _Sampler]:
    """A 4-component isotropic Gaussian mixture in d dims (means ~ N(0, 4 I), std 0.5 … 1)."""
    g = np.random.default_rng(10_000 + seed)
    mu = 2.0 * g.standard_normal((4, d))  # (4, d)
    sd = np.array([0.5, 0.7, 0.85, 1.0])
    w = np.full(4, 0.25)

    def log_p(X: np.ndarray) -> np.ndarray:
        r2 = ((X[:, None, :] - mu[None]) ** 2).sum(-1) / sd**2  # (N, 4)
        comp = np.log(w) - 0.5 * r2 - d * np.log(sd) - 0.5 * d * np.log(2 * np.pi)
        m = comp.max(1, keepdims=True)
        return (m + np.log(np.exp(comp - m).sum(1, keepdims=True)))[:, 0]

    def sample(rng: np.random.Generator, n: int) -> np.ndarray:
        c = rng.choice(4, size=n, p=w)
        return mu[c] + sd[c, None] * rng.standard_normal((n, d))

    return log_p, sample


def _noise(kind: str, data: np.ndarray) -> tuple[_LogDensity, _Sampler]:
    """q: uniform over the data's bounding box, or the Gaussian with the data's mean and covariance."""
    if kind == "uniform":
        lo, hi = data.min(0), data.max(0)
        log_vol = float(np.sum(np.log(hi - lo)))

        def log_q(X: np.ndarray) -> np.ndarray:
            inside = np.all((X >= lo) & (X <= hi), axis=1)
            return np.where(inside, -log_vol, -np.inf)

        return log_q, lambda rng, n: lo + (hi - lo) * rng.random((n, data.shape[1]))
    if kind != "gaussian":
        raise ValueError(f"nce.noise={kind!r} is not one of 'uniform', 'gaussian'")
    mean, cov = data.mean(0), np.cov(data.T).reshape(data.shape[1], data.shape[1])
    L = np.linalg.cholesky(cov + 1e-9 * np.eye(len(mean)))
    logdet = 2 * np.sum(np.log(np.diag(L)))

    def log_qg(X: np.ndarray) -> np.ndarray:
        z = np.linalg.solve(L, (X - mean).T)  # (d, N)
        return -0.5 * (z**2).sum(0) - 0.5 * logdet - 0.5 * len(mean) * np.log(2 * np.pi)

    return log_qg, lambda rng, n: mean + rng.standard_normal((n, len(mean))) @ L.T


def nce_dataset(
    log_p: _LogDensity, sample: _Sampler, n: int, n_test: int, ratio: int, noise: str, seed: int, meta: dict
) -> Dataset:
    """N = ``n`` points, n // (1 + ν) from p and the rest from q (the same split for the test points).

    Raises:
        ValueError: n < 1 + ν (no data point or no noise point).
    """
    if n < 1 + ratio or (n_test and n_test < 1 + ratio):
        raise ValueError(
            f"nce: data.n={n} and data.n_test={n_test} must be >= 1 + ratio = {1 + ratio} "
            "(at least one data and one noise point)"
        )
    nd, ndt = n // (1 + ratio), n_test // (1 + ratio)
    if nd + ndt < 2:
        raise ValueError(
            f"nce: data.n={n} and data.n_test={n_test} with ratio {ratio} give {nd + ndt} data sample(s); "
            f"the noise q ({noise}) is fitted to the data samples and needs at least 2 (one has a box of "
            "volume 0 and no covariance: every log q and X would be inf/NaN) — raise data.n"
        )
    rng = np.random.default_rng(seed)
    data = sample(rng, nd + ndt)  # (nd + ndt, d)
    log_q, sample_q = _noise(noise, data)  # q from all data samples: its box holds the test data too
    noise_pts = sample_q(rng, (n - nd) + (n_test - ndt))
    X = np.concatenate([data[:nd], noise_pts[: n - nd]])
    Xt = np.concatenate([data[nd:], noise_pts[n - nd :]])
    mx, sx = X.mean(0), X.std(0)
    shift = float(np.sum(np.log(sx)))  # densities in standardised coordinates
    out = {}
    for tag, P, k in (("", X, nd), ("_test", Xt, ndt)):
        out["y" + tag] = log_p(P) + shift
        out["label" + tag] = (np.arange(len(P)) < k).astype(np.float64)
        out["log_noise" + tag] = np.log(ratio) + log_q(P) + shift
    arrays = {"X": X, "X_test": Xt, **out}
    bad = [f"{k}: {int((~np.isfinite(v)).sum())} of {v.size} non-finite" for k, v in arrays.items()]
    bad = [b for b, v in zip(bad, arrays.values()) if not np.isfinite(v).all()]
    bad += [] if np.all(sx > 0) else ["X: an input coordinate of std 0 (standardising divides by it)"]
    if bad:
        raise ValueError(
            f"nce ({meta.get('source')}): {'; '.join(bad)} with n={n}, n_test={n_test}, ratio={ratio}, "
            f"noise={noise!r} — the losses and every energy of y would be NaN"
        )
    meta = {**meta, "nce_noise": noise, "nce_ratio": ratio, "n_data": nd, "x_mean": mx.tolist(), "x_std": sx.tolist()}
    extra = {k: v for k, v in out.items() if k.startswith(("label", "log_noise"))}
    return Dataset((X - mx) / sx, out["y"], (Xt - mx) / sx, out["y_test"], meta, extra)


def density2d(
    n: int, *, n_test: int = 0, ratio: int = 1, noise: str = "uniform", image: str | Path | None = None, seed: int = 0
) -> Dataset:
    """An image as a 2-D density on [0, 1]²: p(x) ∝ intensity(x) + FLOOR; NCE data + noise points.

    The noise is uniform over the data's box: p is 0 outside [0, 1]², so Gaussian noise would put
    points where y = log p = −inf (every energy of y NaN) and is refused.

    Raises:
        ValueError: ``noise="gaussian"``; fewer than 2 data samples; the image's errors.
    """
    if noise == "gaussian":
        raise ValueError(
            "density2d: noise='gaussian' puts noise points outside [0, 1]², where the image's density "
            "is 0 and y = log p = -inf (every energy of y would be NaN); use noise: uniform (the "
            "data's box, inside [0, 1]²)"
        )
    log_p, sample, _ = _image_density(image)
    meta = {"source": "density2d", "image": str(image) if image is not None else "skimage:camera", "seed": seed}
    return nce_dataset(log_p, sample, n, n_test, ratio, noise, seed, meta)


def gaussian_mixture(
    n: int, *, d: int = 5, n_test: int = 0, ratio: int = 1, noise: str = "gaussian", seed: int = 0
) -> Dataset:
    """A 4-component Gaussian mixture in d dimensions (known log p); NCE data + noise points."""
    log_p, sample = _mixture(d, seed)
    return nce_dataset(log_p, sample, n, n_test, ratio, noise, seed, {"source": "gaussian_mixture", "seed": seed})
