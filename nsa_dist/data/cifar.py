"""CIFAR-10 and CIFAR-100 from their "python version" pickle directories (no download)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nsa_dist.data._dataset import Dataset
from nsa_dist.data._formats import read_pickle_batch
from nsa_dist.data._paths import Location, directory, exists, is_url, join, regular_file
from nsa_dist.data._targets import Target, check_sizes, draw, make_targets, parse_target

__all__ = ["cifar10", "cifar100", "load_cifar_batches", "batch_files"]

LUMINANCE = np.array([0.2125, 0.7154, 0.0721])  # ITU-R BT.709, as skimage.color.rgb2gray; sums to 1
D_RGB = 3 * 32 * 32


@dataclass(frozen=True)
class _Layout:
    """File names and label key of one CIFAR variant."""

    name: str
    folder: str  # the archive's directory name, for messages
    train: tuple[str, ...]
    test: str
    label_key: str
    K: int

    @property
    def expected(self) -> str:
        return (
            f"expected the '{self.folder}' directory with {list(self.train)} and {self.test!r} "
            "(the CIFAR python pickle format)"
        )


_CIFAR10 = _Layout(
    "cifar10", "cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "labels", 10
)
_CIFAR100 = _Layout("cifar100", "cifar-100-python", ("train",), "test", "fine_labels", 100)


def load_cifar_batches(
    paths: list[Location], label_key: str, K: int, who: str = "cifar"
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated CIFAR batches: pixels uint8 (N, 3072) — R, G, B planes of 32×32, row-major — and labels (N,).

    Raises:
        ValueError: a file is not a pickled dict with ``data`` (m, 3072) uint8 and ``label_key`` (m,)
            in 0..K−1.
    """
    data, labels = [], []
    for p in paths:
        batch = read_pickle_batch(p, ("data", label_key))
        x, c = np.asarray(batch["data"]), np.asarray(batch[label_key])
        if x.ndim != 2 or x.shape[1] != D_RGB or x.dtype != np.uint8 or c.shape != (len(x),):
            raise ValueError(
                f"{who}: {str(p)!r}: expected 'data' uint8 (m, {D_RGB}) and {label_key!r} (m,), got "
                f"data {x.dtype} {x.shape} and labels {c.shape}"
            )
        whole = [_plain(v) for v in c.reshape(-1)] if c.size and c.dtype.kind not in "iu" else []
        if not all(type(v) is int for v in whole):  # an object array holds Python's values (None, 2**70);
            # floats would be truncated (1.7 → 1), bools read as 0/1
            first = next(v for v in whole if type(v) is not int)
            raise ValueError(
                f"{who}: {str(p)!r}: {label_key!r} holds {c.dtype} values (e.g. {first!r}), expected "
                f"integer classes 0..{K - 1}"
            )
        if c.size and not (c.min() >= 0 and c.max() < K):
            i = int(np.flatnonzero((c < 0) | (c >= K))[0])
            raise ValueError(
                f"{who}: {str(p)!r}: {label_key!r} holds values outside 0..{K - 1} "
                f"(the first at index {i}: {_plain(c[i])})"
            )
        data.append(x)
        labels.append(c.astype(np.int64))
    return np.concatenate(data), np.concatenate(labels)


def _plain(v: object) -> object:
    """A NumPy scalar as Python's value; anything else as it is."""
    return v.item() if isinstance(v, np.generic) else v


def _features(pixels: np.ndarray, grayscale: bool) -> np.ndarray:
    """uint8 (N, 3072) → float64 (N, 1024) luminance Σ_c w_c x_c, or (N, 3072) RGB, in [0, 1]."""
    x = pixels.astype(np.float64).reshape(-1, 3, 32 * 32)  # (N, 3, 1024)
    x /= 255.0  # in place: no second (N, 3072) float64 copy
    return np.einsum("c,ncp->np", LUMINANCE, x) if grayscale else x.reshape(len(x), D_RGB)


def _files(folder: Location, names: tuple[str, ...], layout: _Layout, why: str) -> list[Location]:
    """The paths of ``names`` in ``folder``; FileNotFoundError naming the missing ones, ValueError
    naming one that is a directory or not a regular file."""
    missing = [name for name in names if not exists(join(folder, name))]
    if missing:
        inner = join(folder, layout.folder)
        hint = f" — {str(inner)!r} is there: pass that directory" if exists(inner) else ""
        raise FileNotFoundError(
            f"{layout.name}: {missing} not found in {str(folder)!r} ({why}); {layout.expected}{hint}"
        )
    return [regular_file(join(folder, name), layout.name, "a CIFAR python batch file") for name in names]


def _directory(path: Location, layout: _Layout) -> Location:
    """``path`` checked to be a directory; the downloaded archive itself is named as such."""
    if str(path).endswith((".tar.gz", ".tgz", ".tar")) and not is_url(path) and Path(path).is_file():
        raise ValueError(
            f"{layout.name}: {str(path)!r} is the archive, not the directory: extract it (tar xzf) and "
            f"pass the {layout.folder!r} directory inside"
        )
    return directory(path, layout.name, layout.expected.removeprefix("expected "))


def batch_files(name: str, path: Location, n_test: int) -> list[Location]:
    """The batch files ``cifar10`` / ``cifar100`` (``name``) read from ``path`` — the training
    batches, and the test batch when n_test > 0 — each checked to be a readable regular file;
    nothing is read.

    Raises:
        FileNotFoundError: ``path`` or a batch is missing.
        ValueError: ``path`` is not a directory, or a batch is not a regular file.
    """
    layout = {_CIFAR10.name: _CIFAR10, _CIFAR100.name: _CIFAR100}[name]
    d = _directory(path, layout)
    train = _files(d, layout.train, layout, "training batches")  # first: a folder of another set misses these
    return train + (_files(d, (layout.test,), layout, f"n_test={n_test} needs the test batch") if n_test > 0 else [])


def _cifar(
    layout: _Layout,
    path: str | Path,
    n: int,
    n_test: int,
    grayscale: bool,
    target: str | Target,
    positive_class: int,
    seed: int,
) -> Dataset:
    """A seeded subset of one CIFAR variant; train and test drawn from independent streams."""
    check_sizes(n, n_test, layout.name)
    t = parse_target(target, layout.K, positive_class, layout.name)
    d = _directory(path, layout)
    rng_train, rng_test = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    pixels, labels = load_cifar_batches(
        _files(d, layout.train, layout, "training batches"), layout.label_key, layout.K, layout.name
    )
    tr = draw(rng_train, len(labels), n, layout.name, f"training images (n) from {str(d)!r}")
    if n_test > 0:
        pixels_t, labels_t = load_cifar_batches(
            _files(d, (layout.test,), layout, f"n_test={n_test} needs the test batch"),
            layout.label_key,
            layout.K,
            layout.name,
        )
        te = draw(rng_test, len(labels_t), n_test, layout.name, f"test images (n_test) from {str(d)!r}")
    else:
        pixels_t, labels_t, te = pixels, labels, np.arange(0)
    X, X_test = _features(pixels[tr], grayscale), _features(pixels_t[te], grayscale)
    meta = {
        "source": layout.name,
        "path": str(d),
        "n": n,
        "n_test": n_test,
        "seed": seed,
        "grayscale": grayscale,
        "d": int(X.shape[1]),
        "image_shape": [32, 32] if grayscale else [3, 32, 32],
        "scale": "pixel / 255" + (", luminance 0.2125 R + 0.7154 G + 0.0721 B" if grayscale else ""),
        "target": t.value,
        "classes": layout.K,
    }
    if t is Target.ONE_VS_REST:
        meta["positive_class"] = positive_class
    return Dataset(
        X,
        make_targets(labels[tr], t, layout.K, positive_class),
        X_test,
        make_targets(labels_t[te], t, layout.K, positive_class),
        meta,
    )


def cifar10(
    n: int = 1000,
    *,
    path: str | Path,
    n_test: int = 0,
    grayscale: bool = True,
    target: str | Target = "label",
    positive_class: int = 0,
    seed: int = 0,
) -> Dataset:
    """N CIFAR-10 images as flat vectors in [0, 1]: luminance (d = 1024) or RGB (d = 3072).

    Train is a seeded subset of the 50,000 images in ``data_batch_1..5``, test of the 10,000 in
    ``test_batch`` (read only when n_test > 0; independent stream, so it does not depend on n).
    RGB vectors keep CIFAR's layout: the R, G, B 32×32 planes one after the other, row-major.

    Args:
        n: training points N.
        path: the extracted ``cifar-10-batches-py`` directory (a local path or an fsspec URL).
        n_test: test points M.
        grayscale: x = 0.2125 R + 0.7154 G + 0.0721 B per pixel (BT.709) instead of RGB.
        target: ``"label"`` y = c (N,), ``"one_vs_rest"`` y = ±1 (N,), ``"onehot"`` y = e_c (N, 10).
        positive_class: the +1 class of ``one_vs_rest``.
        seed: subset seed.

    Returns:
        Dataset with X (N, d), X_test (M, d) float64; y, y_test float64 as above.

    Raises:
        FileNotFoundError: ``path`` or a batch file is missing.
        ValueError: a batch is not a CIFAR pickle; n or n_test exceeds the images available; bad target.
    """
    return _cifar(_CIFAR10, path, n, n_test, grayscale, target, positive_class, seed)


def cifar100(
    n: int = 1000,
    *,
    path: str | Path,
    n_test: int = 0,
    grayscale: bool = True,
    target: str | Target = "label",
    positive_class: int = 0,
    seed: int = 0,
) -> Dataset:
    """N CIFAR-100 images with their 100 fine labels; as :func:`cifar10` (files ``train``, ``test``).

    Args:
        n: training points N (of 50,000).
        path: the extracted ``cifar-100-python`` directory (a local path or an fsspec URL).
        n_test: test points M (of 10,000).
        grayscale: luminance (d = 1024) instead of RGB (d = 3072).
        target: ``"label"`` (N,), ``"one_vs_rest"`` (N,), ``"onehot"`` (N, 100).
        positive_class: the +1 class of ``one_vs_rest``.
        seed: subset seed.

    Raises:
        FileNotFoundError: ``path`` or a batch file is missing.
        ValueError: a batch is not a CIFAR pickle; n or n_test exceeds the images available; bad target.
    """
    return _cifar(_CIFAR100, path, n, n_test, grayscale, target, positive_class, seed)
