"""scikit-learn's bundled 8×8 handwritten digits (1,797 images, d = 64): small enough for exact NTKs."""

from __future__ import annotations

import numpy as np

from nsa_dist.data._dataset import Dataset
from nsa_dist.data._targets import Target, check_sizes, make_targets, parse_target, split
from nsa_dist.errors import MissingDependencyError

__all__ = ["digits"]

K = 10


def digits(
    n: int | None = None, *, n_test: int = 0, target: str | Target = "label", positive_class: int = 0, seed: int = 0
) -> Dataset:
    """N digits from ``sklearn.datasets.load_digits`` as x ∈ [0, 1]^64 (pixel counts 0..16 divided by 16).

    One seeded permutation of the 1,797 images: train = its first n, test = its last n_test (disjoint).

    Args:
        n: training points N; None → all that the test split leaves, 1797 − n_test.
        n_test: test points M.
        target: ``"label"`` y = c (N,), ``"one_vs_rest"`` y = ±1 (N,), ``"onehot"`` y = e_c (N, 10).
        positive_class: the +1 digit of ``one_vs_rest``.
        seed: shuffle seed.

    Returns:
        Dataset with X (N, 64), X_test (M, 64) float64; y, y_test float64 as above.

    Raises:
        MissingDependencyError: scikit-learn is not installed.
        ValueError: n + n_test > 1797; bad target.
    """
    t = parse_target(target, K, positive_class, "digits")
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise MissingDependencyError(
            "digits() reads scikit-learn's bundled 8x8 digits: `pip install scikit-learn`"
        ) from exc
    bunch = load_digits()
    images, labels = np.asarray(bunch.data, dtype=np.float64), np.asarray(bunch.target)  # (1797, 64), (1797,)
    if n is None:
        if n_test >= len(labels):
            raise ValueError(f"digits: n_test={n_test} leaves none of the {len(labels)} images for training")
        n = len(labels) - n_test
    check_sizes(n, n_test, "digits")
    tr, te = split(np.random.default_rng(seed), len(labels), n, n_test, "digits")
    X, X_test = images[tr] / 16.0, images[te] / 16.0
    meta = {
        "source": "digits",
        "path": "sklearn:load_digits",
        "n": n,
        "n_test": n_test,
        "seed": seed,
        "d": 64,
        "image_shape": [8, 8],
        "scale": "pixel / 16",
        "target": t.value,
        "classes": K,
    }
    if t is Target.ONE_VS_REST:
        meta["positive_class"] = positive_class
    return Dataset(
        X, make_targets(labels[tr], t, K, positive_class), X_test, make_targets(labels[te], t, K, positive_class), meta
    )
