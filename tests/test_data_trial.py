"""An adversarial trial of the data side, as researchers bring data: real files in their standard
formats (IDX / IDX.gz per LeCun's spec, CIFAR python batches and the .tar.gz as distributed,
PNG / JPEG / TIFF / NPY images) checked against an independent reading in this file (struct,
pickle, PIL, hand-written PNG chunks), and broken files that must give one error naming the file.
"""

from __future__ import annotations

import gzip
import logging
import os
import pickle
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from nsa_dist.data import cifar10, cifar100, image2d, image_function, load_image, mnist
from nsa_dist.data.density import density2d, gaussian_mixture

BT709 = np.array([0.2125, 0.7154, 0.0721])


def minmax(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    return (a - a.min()) / (a.max() - a.min())


def assert_same(got: np.ndarray, want: np.ndarray, what: str, atol: float = 1e-12) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    if diff.size and diff.max() > atol:
        i = np.unravel_index(np.argmax(diff), diff.shape)
        raise AssertionError(f"{what}: max |diff| {diff.max():.3g} at {i}: got {got[i]!r}, want {want[i]!r}")


# --------------------------------------------------------------------------- writers (by the spec)


def idx(path: Path, arr: np.ndarray, *, gz: bool = False, magic: int | None = None) -> Path:
    """IDX per LeCun: big-endian uint32 magic (0x0000 08 ndim), one big-endian uint32 per dim, bytes."""
    magic = magic if magic is not None else (0x0800 | arr.ndim)
    raw = struct.pack(">I", magic) + b"".join(struct.pack(">I", s) for s in arr.shape) + arr.tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(raw))
    else:
        path.write_bytes(raw)
    return path


def mnist_dir(d: Path, n: int = 40, n_test: int = 12, gz: bool = False) -> tuple[np.ndarray, ...]:
    """Train / test IDX files; image i carries its index in pixel [0, 0] (train) so order is visible."""
    rng = np.random.default_rng(7)
    img = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    img[:, 0, 0] = np.arange(n)
    lab = rng.integers(0, 10, n).astype(np.uint8)
    img_t = rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8)
    lab_t = rng.integers(0, 10, n_test).astype(np.uint8)
    d.mkdir(parents=True, exist_ok=True)
    idx(d / "train-images-idx3-ubyte", img, gz=gz)
    idx(d / "train-labels-idx1-ubyte", lab, gz=not gz)  # one of each kind
    idx(d / "t10k-images-idx3-ubyte", img_t, gz=gz)
    idx(d / "t10k-labels-idx1-ubyte", lab_t, gz=gz)
    return img, lab, img_t, lab_t


def draws(seed: int, n_avail: int, n: int, n_avail_t: int, n_test: int) -> tuple[np.ndarray, np.ndarray]:
    """The documented subset: train and test from the two streams SeedSequence(seed).spawn(2)."""
    r_tr, r_te = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    return r_tr.permutation(n_avail)[:n], r_te.permutation(n_avail_t)[:n_test]


def cifar_tree(root: Path, *, hundred: bool = False, per: int = 6) -> dict[str, tuple[np.ndarray, list[int]]]:
    """The official python-version layout, written as the tarball lays it out (protocol 2, bytes keys)."""
    rng = np.random.default_rng(3)
    folder = root / ("cifar-100-python" if hundred else "cifar-10-batches-py")
    folder.mkdir(parents=True)
    names = ["train", "test"] if hundred else [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    out = {}
    for name in names:
        m = per * (5 if hundred and name == "train" else 1)
        data = rng.integers(0, 256, (m, 3072), dtype=np.uint8)
        if hundred:
            fine = [int(c) for c in rng.integers(0, 100, m)]
            batch = {
                b"filenames": [b"x.png"] * m,
                b"batch_label": name.encode(),
                b"fine_labels": fine,
                b"coarse_labels": [c // 5 for c in fine],
                b"data": data,
            }
            out[name] = (data, fine)
        else:
            labels = [int(c) for c in rng.integers(0, 10, m)]
            batch = {b"batch_label": name.encode(), b"labels": labels, b"data": data, b"filenames": [b"x.png"] * m}
            out[name] = (data, labels)
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    meta_name, meta = (
        ("meta", {b"fine_label_names": [b"c"] * 100, b"coarse_label_names": [b"s"] * 20})
        if hundred
        else ("batches.meta", {b"num_cases_per_batch": per, b"label_names": [b"c"] * 10, b"num_vis": 3072})
    )
    (folder / meta_name).write_bytes(pickle.dumps(meta, protocol=2))
    return out


def png(path: Path, arr: np.ndarray, bitdepth: int, colortype: int) -> Path:
    """A PNG written chunk by chunk (filter 0 on every row), independent of PIL's encoder."""
    H, W = arr.shape[:2]
    rows = b"".join(b"\x00" + arr[i].astype(">u2" if bitdepth == 16 else "u1").tobytes() for i in range(H))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", W, H, bitdepth, colortype, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    )
    return path


# --------------------------------------------------------------------------- MNIST: read right


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_pixels_labels_subsets_and_targets(tmp_path: Path, gz: bool) -> None:
    img, lab, img_t, lab_t = mnist_dir(tmp_path / "m", gz=gz)
    tr, te = draws(5, 40, 17, 12, 5)
    ds = mnist(17, n_test=5, path=tmp_path / "m", seed=5)
    assert ds.X.dtype == np.float64 and ds.X.shape == (17, 784)
    assert_same(ds.X, img[tr].reshape(17, 784) / 255.0, "train pixels / 255 (seeded subset)")
    assert_same(ds.X[:, 0] * 255, tr, "pixel [0,0] = the image's index: label order kept")
    assert_same(ds.y, lab[tr], "train labels")
    assert_same(ds.X_test, img_t[te].reshape(5, 784) / 255.0, "test pixels")
    assert_same(ds.y_test, lab_t[te], "test labels")
    # test split independent of n; train of n a prefix of a larger n; deterministic
    big = mnist(30, n_test=5, path=tmp_path / "m", seed=5)
    assert_same(big.X_test, ds.X_test, "test set does not depend on n")
    assert_same(big.X[:17], ds.X, "train of n=17 is the first 17 of n=30")
    assert mnist(17, n_test=5, path=tmp_path / "m", seed=5).fingerprint() == ds.fingerprint()
    ovr = mnist(17, path=tmp_path / "m", seed=5, target="one_vs_rest", positive_class=int(lab[tr][0]))
    assert_same(ovr.y, np.where(lab[tr] == lab[tr][0], 1.0, -1.0), "one-vs-rest")
    oh = mnist(17, path=tmp_path / "m", seed=5, target="onehot")
    assert_same(oh.y, np.eye(10)[lab[tr]], "onehot")
    pooled = mnist(17, path=tmp_path / "m", seed=5, pool=True)
    want = img[tr].astype(np.float64).reshape(17, 14, 2, 14, 2).mean(axis=(2, 4)) / 255
    assert_same(pooled.X, want.reshape(17, 196), "2x2 average pool")
    assert mnist(1, path=tmp_path / "m").X.shape == (1, 784)
    assert mnist(40, path=tmp_path / "m").X.shape == (40, 784)  # all of them
    with pytest.raises(ValueError, match=r"asked for 41 .* only 40"):
        mnist(41, path=tmp_path / "m")
    with pytest.raises(ValueError, match=r"n >= 1"):
        mnist(0, path=tmp_path / "m")


def test_mnist_non_28x28_images_refused_naming_the_file(tmp_path: Path) -> None:
    """Before: 27×27 images with pool=True died in a reshape naming no file; without pool they
    loaded as d = 729 while data.input_dim said 784; 0×28 images loaded as d = 0."""
    labels = np.arange(6, dtype=np.uint8)
    for shape in [(27, 27), (0, 28), (28, 30)]:
        d = tmp_path / f"m{shape[0]}x{shape[1]}"
        d.mkdir()
        idx(d / "train-images-idx3-ubyte", np.zeros((6, *shape), np.uint8))
        idx(d / "train-labels-idx1-ubyte", labels)
        for pool in (False, True):
            with pytest.raises(ValueError, match=rf"train-images-idx3-ubyte' holds {shape[0]}×{shape[1]} images"):
                mnist(3, path=d, pool=pool)


@pytest.mark.parametrize(
    "case, match",
    [
        ("gzip_named_plain", r"gzip magic bytes 1f 8b .*gunzip it or add \.gz"),
        ("swapped", r"train-images-idx3-ubyte'.*got an IDX label file \(2049\): images and labels swapped"),
        ("empty", r"train-images-idx3-ubyte'.*got an empty file"),
    ],
)
def test_idx_wrong_files_say_what_they_are(tmp_path: Path, case: str, match: str) -> None:
    """Before: 'got magic 529205256' / 'got magic 2049' / 'got magic 0 bytes' — the cause unnamed."""
    img, lab = np.zeros((4, 28, 28), np.uint8), np.zeros(4, np.uint8)
    p = tmp_path / "train-images-idx3-ubyte"
    if case == "gzip_named_plain":
        idx(p, img, gz=True).rename(p)
    elif case == "swapped":
        idx(p, lab)
    else:
        p.write_bytes(b"")
    idx(tmp_path / "train-labels-idx1-ubyte", lab)
    with pytest.raises(ValueError, match=match):
        mnist(2, path=tmp_path)


@pytest.mark.parametrize(
    "case",
    ["count_vs_size", "truncated", "extra_bytes", "gz_truncated", "gz_crc", "gz_wrong_magic", "label_10", "dims_lie"],
)
def test_idx_broken_files_one_error_naming_the_file(tmp_path: Path, case: str) -> None:
    img, lab = np.zeros((5, 28, 28), np.uint8), np.arange(5, dtype=np.uint8)
    ip, lp = tmp_path / "train-images-idx3-ubyte", tmp_path / "train-labels-idx1-ubyte"
    idx(lp, lab)
    gz = case.startswith("gz")
    ip = idx(ip, img, gz=gz)
    raw = ip.read_bytes()
    bad = ip
    if case == "count_vs_size":
        ip.write_bytes(struct.pack(">IIII", 2051, 6, 28, 28) + raw[16:])  # header says 6, file holds 5
    elif case == "truncated":
        ip.write_bytes(raw[:-1])
    elif case == "extra_bytes":
        ip.write_bytes(raw + b"\0")
    elif case == "gz_truncated":
        ip.write_bytes(raw[: len(raw) // 2])
    elif case == "gz_crc":
        ip.write_bytes(raw[:-8] + bytes([raw[-8] ^ 1]) + raw[-7:])
    elif case == "gz_wrong_magic":
        ip.write_bytes(b"\x1f\x8c" + raw[2:])
    elif case == "label_10":
        idx(lp, np.array([0, 1, 2, 3, 10], np.uint8))
        bad = lp
    elif case == "dims_lie":
        ip.write_bytes(struct.pack(">IIII", 2051, 5, 28, 29) + raw[16:])  # 5·28·29 > bytes present
    with pytest.raises(ValueError) as err:
        mnist(2, path=tmp_path)
    assert str(bad) in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_idx_symlinks_unicode_paths_and_a_directory_in_place(tmp_path: Path) -> None:
    img, lab, _, _ = mnist_dir(tmp_path / "données ü 数据", gz=True)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "données ü 数据", target_is_directory=True)
    a = mnist(5, path=tmp_path / "données ü 数据")
    b = mnist(5, path=link)
    assert a.fingerprint() == b.fingerprint()
    (tmp_path / "données ü 数据" / "t10k-labels-idx1-ubyte.gz").unlink()
    (tmp_path / "données ü 数据" / "t10k-labels-idx1-ubyte").mkdir()
    with pytest.raises(ValueError, match=r"link/t10k-labels-idx1-ubyte' is a directory"):
        mnist(5, n_test=2, path=link)
    with pytest.raises(ValueError, match=r"is not a directory"):
        mnist(5, path=tmp_path / "données ü 数据" / "train-images-idx3-ubyte.gz")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"dangling' does not exist"):
        mnist(5, path=dangling)


def test_a_replaced_file_changes_the_fingerprint_a_recompressed_one_does_not(tmp_path: Path) -> None:
    """The resume check compares Dataset.fingerprint (the arrays): a file swapped at the same path
    with the same size and mtime must change it; the same pixels gzipped must not."""
    img, lab, _, _ = mnist_dir(tmp_path / "m")
    before = mnist(20, path=tmp_path / "m").fingerprint()
    p = tmp_path / "m" / "train-images-idx3-ubyte"
    st = p.stat()
    changed = img.copy()
    changed[3, 14, 14] ^= 1
    idx(p, changed)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert p.stat().st_size == st.st_size and p.stat().st_mtime_ns == st.st_mtime_ns
    after = mnist(20, path=tmp_path / "m").fingerprint()
    assert after != before, "a changed pixel left the fingerprint unchanged: a resumed run would mix data"
    idx(p, changed, gz=True)
    p.unlink()
    assert mnist(20, path=tmp_path / "m").fingerprint() == after


def test_a_process_that_loads_the_data_after_it_changed_is_refused(tmp_path: Path) -> None:
    """A gang member started after the data file changed (a replaced member of a ``block_rows``
    run) reloaded it without a check and measured G of the new pixels against the old run's f
    and y (λ_max 11,875 against 10,762, status done).  The plan now carries the run's
    fingerprint, and every load from the source for it compares."""
    import torch

    from nsa_dist.config import ExperimentSpec
    from nsa_dist.pipeline.materials import RunMaterials
    from nsa_dist.pipeline.member import SpectralShard
    from nsa_dist.pipeline.session import RunSession
    from nsa_dist.store import RunRefused, SpectrumStore

    img, _, _, _ = mnist_dir(tmp_path / "m")
    spec = ExperimentSpec(
        name="fp", data={"name": "mnist", "n": 12, "path": str(tmp_path / "m")}, model={"depth": 2, "width": 4}, steps=2
    )
    session = RunSession.open(spec, SpectrumStore(str(tmp_path / "s.zarr")))
    plan = session.plan
    try:
        assert plan.data_fingerprint == session.data.fingerprint()
        theta = torch.nn.utils.parameters_to_vector(RunMaterials.load(plan).prototype.parameters()).detach().numpy()
        RunMaterials.forget(plan.run_id)  # a fresh process: nothing of the run loaded yet
        SpectralShard()._model(plan, theta)  # the same data: the member is built
        RunMaterials.forget(plan.run_id)
        changed = img.copy()
        changed[:, 10:18, 10:18] = 255 - changed[:, 10:18, 10:18]
        idx(tmp_path / "m" / "train-images-idx3-ubyte", changed)
        opened = r"now loads as sha256:\w+, the run was opened on " + plan.data_fingerprint
        with pytest.raises(RunRefused, match=opened):
            SpectralShard()._model(plan, theta)
    finally:
        RunMaterials.forget(plan.run_id)
        session.lease.release()


# --------------------------------------------------------------------------- CIFAR: read right


def test_cifar10_from_the_tarball_layout_exact(tmp_path: Path) -> None:
    src = tmp_path / "src"
    truth = cifar_tree(src)
    tgz = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(tgz, "w:gz") as t:
        t.add(src / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    with tarfile.open(tgz) as t:
        t.extractall(tmp_path / "x", filter="data")
    d = tmp_path / "x" / "cifar-10-batches-py"
    data = np.concatenate([truth[f"data_batch_{i}"][0] for i in range(1, 6)])  # batch order 1..5
    labels = np.concatenate([truth[f"data_batch_{i}"][1] for i in range(1, 6)])
    tdata, tlabels = truth["test_batch"][0], np.array(truth["test_batch"][1])
    tr, te = draws(2, 30, 11, 6, 4)
    rgb = cifar10(11, n_test=4, path=d, grayscale=False, seed=2)
    assert_same(rgb.X, data[tr] / 255.0, "RGB planes / 255")
    assert_same(rgb.y, labels[tr], "labels across batches 1..5")
    assert_same(rgb.X_test, tdata[te] / 255.0, "test pixels")
    assert_same(rgb.y_test, tlabels[te], "test labels")
    # pixel (row 3, col 5) of image 0: R at 3*32+5, G at 1024 + …, B at 2048 + … (the format's planes)
    planes = data[tr[0]].reshape(3, 32, 32)
    assert_same(rgb.X[0, [101, 1024 + 101, 2048 + 101]] * 255, planes[:, 3, 5], "R, G, B planes row-major")
    gray = cifar10(11, path=d, seed=2)
    assert_same(gray.X, np.einsum("c,ncp->np", BT709, data[tr].reshape(-1, 3, 1024) / 255.0), "BT.709 luminance")
    ovr = cifar10(11, path=d, seed=2, target="one_vs_rest", positive_class=3)
    assert_same(ovr.y, np.where(labels[tr] == 3, 1.0, -1.0), "one-vs-rest")
    with pytest.raises(ValueError, match=r"asked for 31 .* only 30"):
        cifar10(31, path=d)
    with pytest.raises(ValueError, match=r"cifar-10-python.tar.gz' is the archive, not the directory: extract it"):
        cifar10(2, path=tgz)  # before: only "is not a directory"
    with pytest.raises(FileNotFoundError, match=r"'cifar-10-batches-py' directory .*is there: pass that directory"):
        cifar10(2, path=tmp_path / "x")  # the folder the tarball was extracted into


def test_cifar100_fine_labels_not_coarse(tmp_path: Path) -> None:
    truth = cifar_tree(tmp_path, hundred=True)
    d = tmp_path / "cifar-100-python"
    data, fine = truth["train"][0], np.array(truth["train"][1])
    tr, te = draws(0, 30, 30, 6, 6)
    ds = cifar100(30, n_test=6, path=d, grayscale=False, target="onehot")
    assert_same(ds.X, data[tr] / 255.0, "pixels")
    assert_same(ds.y, np.eye(100)[fine[tr]], "fine labels, onehot (N, 100)")
    assert_same(ds.y_test.argmax(1), np.array(truth["test"][1])[te], "test fine labels")


@pytest.mark.parametrize(
    "labels, match",
    [
        ([1.5, 2.0, 3.7, 0.2, 1.0, 2.0], r"'labels' holds float64 values \(e.g. 1.5\), expected integer classes"),
        ([True, False, True, True, False, True], r"'labels' holds bool values"),
        ([0, 1, 2, 3, 4, 10], r"'labels' holds values outside 0..9 \(the first at index 5: 10\)"),
        ([0, 1, 2, 3, 4, -1], r"'labels' holds values outside 0..9 \(the first at index 5: -1\)"),
        ([0, 1, None, 3, 4, 5], r"'labels' holds object values \(e.g. None\)"),  # was an AttributeError
        ([0, 1, 2, 2**70, 4, 5], r"holds values outside 0..9 \(the first at index 3: 1180591620717411303424\)"),
    ],
)
def test_cifar_labels_that_are_not_classes_are_refused(tmp_path: Path, labels: list, match: str) -> None:
    """Before: float labels were truncated (1.5 → 1, 3.7 → 3) and bools read as 0/1, silently."""
    cifar_tree(tmp_path)
    p = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    batch = pickle.loads(p.read_bytes(), encoding="bytes")
    batch[b"labels"] = labels
    p.write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(ValueError, match=r"^cifar10: .*data_batch_3'.*" + match):
        cifar10(5, path=tmp_path / "cifar-10-batches-py")


@pytest.mark.parametrize("case", ["truncated", "gzipped", "empty", "directory", "wrong_shape"])
def test_cifar_broken_batches_one_error_naming_the_file(tmp_path: Path, case: str) -> None:
    cifar_tree(tmp_path)
    p = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    raw = p.read_bytes()
    if case == "truncated":
        p.write_bytes(raw[: len(raw) // 2])
    elif case == "gzipped":
        p.write_bytes(gzip.compress(raw))
    elif case == "empty":
        p.write_bytes(b"")
    elif case == "directory":
        p.unlink()
        p.mkdir()
    else:
        p.write_bytes(pickle.dumps({b"data": np.zeros((6, 32, 32, 3), np.uint8), b"labels": [0] * 6}, protocol=2))
    with pytest.raises(ValueError) as err:
        cifar10(5, path=tmp_path / "cifar-10-batches-py")
    assert str(p) in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("how", ["protocol 5", "NumPy scalar labels", "empty bytes"])
def test_cifar_batches_numpy_and_python_write_today_read_as_the_same_batch(tmp_path: Path, how: str) -> None:
    """Refused as "can run code" (an audit): a batch pickled with protocol 5 (Python 3.14's default:
    NumPy's ``_frombuffer``), labels kept as ``list(labels_array)`` (NumPy scalars), an empty
    ``batch_label`` at protocol 2 (``bytes()``)."""
    truth = cifar_tree(tmp_path)
    d = tmp_path / "cifar-10-batches-py"
    before = cifar10(11, n_test=4, path=d, grayscale=False, seed=2)
    p = d / "data_batch_2"
    batch = pickle.loads(p.read_bytes(), encoding="bytes")
    if how == "protocol 5":
        p.write_bytes(pickle.dumps(batch, protocol=5))
    elif how == "NumPy scalar labels":
        batch[b"labels"] = list(np.asarray(truth["data_batch_2"][1], np.int64))
        p.write_bytes(pickle.dumps(batch, protocol=2))
    else:
        batch[b"batch_label"] = b""
        p.write_bytes(pickle.dumps(batch, protocol=2))
    after = cifar10(11, n_test=4, path=d, grayscale=False, seed=2)
    for name in ("X", "y", "X_test", "y_test"):
        np.testing.assert_array_equal(getattr(after, name), getattr(before, name), err_msg=name)


class _Made:
    """A pickle calling ``fn(*args)`` when loaded (what a crafted batch can ask of the admitted names)."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


@pytest.mark.parametrize(
    "extra", ["a second pickle", "appended bytes", "bytes(n)", "bytes(NumPy n)", "void scalar", "object scalar"]
)
def test_cifar_batch_with_more_than_one_pickle_or_a_bytes_bomb_is_refused(tmp_path: Path, extra: str) -> None:
    """Two pickles in one batch file gave the first one's images alone (an audit), silently while n
    fitted; ``bytes(n)`` and NumPy's ``scalar`` — admitted now for protocol 2's empty bytes and NumPy
    integer labels — made 10⁹ zeroed bytes from a 142–217-byte file (a review: ``bytes(np.int64(n))``,
    ``scalar(dtype('V1000000000'))``)."""
    cifar_tree(tmp_path)
    p = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    raw = p.read_bytes()
    if extra == "a second pickle":
        p.write_bytes(raw + raw)
        match = "bytes follow its pickle"
    elif extra == "appended bytes":
        p.write_bytes(raw + b"\0" * 100)
        match = "bytes follow its pickle"
    elif extra == "bytes(n)":  # protocol 2: GLOBAL __builtin__ bytes, (1,410,065,408,), REDUCE, STOP
        p.write_bytes(b"\x80\x02c__builtin__\nbytes\nJ\x00\xe4\x0bT\x85R.")
        match = r"refused bytes\(int\)"
    elif extra == "bytes(NumPy n)":
        p.write_bytes(pickle.dumps({b"data": _Made(bytes, np.int64(10**9)), b"labels": []}, protocol=2))
        match = r"refused bytes\(int64\)"
    else:
        scalar = np._core.multiarray.scalar
        dtype = np.dtype(("V", 10**9)) if extra == "void scalar" else np.dtype("O")
        p.write_bytes(pickle.dumps({b"data": _Made(scalar, dtype), b"labels": []}, protocol=2))
        match = r"refused a NumPy scalar of dtype"
    with pytest.raises(ValueError, match=match) as err:
        cifar10(5, path=tmp_path / "cifar-10-batches-py")
    assert str(p) in str(err.value), str(err.value)


# --------------------------------------------------------------------------- images: read right


def ref_luminance(path: Path) -> np.ndarray:
    """PIL's own reading: the image as shown (EXIF applied), converted to RGB, BT.709, min-max."""
    im = ImageOps.exif_transpose(Image.open(path))
    if im.mode in ("L", "I", "I;16", "F", "1"):
        return minmax(np.asarray(im))
    if im.mode in ("LA",):
        return minmax(np.asarray(im.convert("L")))
    return minmax(np.asarray(im.convert("RGB"), dtype=np.float64) @ BT709)


_RNG = np.random.default_rng(4)
_RGB = _RNG.integers(0, 256, (5, 7, 3), dtype=np.uint8)
IMAGES = {
    "L.png": lambda: Image.fromarray(_RGB[..., 0]),
    "RGB.png": lambda: Image.fromarray(_RGB),
    "RGB.jpg": lambda: Image.fromarray(_RGB),
    "RGBA.png": lambda: Image.fromarray(np.dstack([_RGB, _RGB[..., :1]])),
    "P.png": lambda: Image.fromarray(_RGB).convert("P"),
    "1.png": lambda: Image.fromarray(_RGB[..., 0]).convert("1"),
    "I16.png": lambda: Image.fromarray(_RGB[..., 0].astype(np.uint16) * 257 + 3),
    "F.tif": lambda: Image.fromarray(_RGB[..., 1].astype(np.float32) / 7),
    "P.tif": lambda: Image.fromarray(_RGB).convert("P"),  # before: its palette indices, off by 0.58
    "CMYK.jpg": lambda: Image.fromarray(_RGB).convert("CMYK"),  # before: inks read as RGB, off by 1.0
    "CMYK.tif": lambda: Image.fromarray(_RGB).convert("CMYK"),  # before: off by 1.0
    "LA.png": lambda: Image.fromarray(np.dstack([_RGB[..., :2]]), "LA"),  # before: a matmul error, no file
}


@pytest.mark.parametrize("name", list(IMAGES))
def test_image_modes_match_pil(tmp_path: Path, name: str) -> None:
    """Every mode as PIL shows it (converted to RGB, BT.709 luminance, min-max)."""
    IMAGES[name]().save(tmp_path / name)
    assert_same(load_image(tmp_path / name), ref_luminance(tmp_path / name), name)


def test_16bit_png_by_hand(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """16-bit gray is read to the last bit; 16-bit RGB keeps 8 bits (PIL's limit) — said, not silent
    (before: no word)."""
    rng = np.random.default_rng(5)
    g = rng.integers(0, 300, (6, 9)).astype(np.uint16)  # small values: a 16→8 bit cut would zero them
    assert_same(load_image(png(tmp_path / "g16.png", g, 16, 0)), minmax(g), "16-bit gray PNG")
    c = rng.integers(0, 65536, (6, 9, 3)).astype(np.uint16)
    with caplog.at_level(logging.WARNING, logger="nsa_dist.data.image2d"):
        got = load_image(png(tmp_path / "c16.png", c, 16, 2))
    assert_same(got, minmax(c @ BT709), "16-bit RGB PNG (8 bits kept)", atol=1 / 255)
    assert any("16-bit RGB PNG" in r.getMessage() and "c16.png" in r.getMessage() for r in caplog.records)
    g8 = rng.integers(0, 256, (6, 9)).astype(np.uint8)
    assert_same(load_image(png(tmp_path / "g8.png", g8, 8, 0)), minmax(g8), "8-bit gray PNG")


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied(tmp_path: Path, orientation: int) -> None:
    """A phone photo stores the sensor's rows and an EXIF orientation; the image is what viewers
    show. Before: the tag was ignored — a portrait photo read landscape (x and y transposed)."""
    a = np.random.default_rng(6).integers(0, 256, (6, 9), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    for ext in ("png", "jpg"):
        p = tmp_path / f"o{orientation}.{ext}"
        Image.fromarray(a).save(p, exif=exif.tobytes(), **({"quality": 100} if ext == "jpg" else {}))
        assert_same(load_image(p), ref_luminance(p), f"orientation {orientation} {ext}")


@pytest.mark.parametrize("mode", ["L", "RGB", "P", "CMYK", "LA"])
def test_tiff_orientation_tag_is_applied(tmp_path: Path, mode: str) -> None:
    """TIFF tag 274 (6: rotate 90° clockwise to show, 8: counter-clockwise, 3: 180°); before: ignored.
    PIL's own TIFF reader scrambles an oriented P / CMYK / LA file, so the truth here is numpy's
    rotation of the stored pixels (converted as PIL converts them unrotated)."""
    rgb = np.random.default_rng(9).integers(0, 256, (4, 6, 3), dtype=np.uint8)  # 4 rows: skimage's axis guess
    im = Image.fromarray(rgb).convert(mode)
    stored = np.asarray(im.convert("RGB"), dtype=np.float64) @ BT709
    for tag, shown in ((6, np.rot90(stored, -1)), (8, np.rot90(stored, 1)), (3, stored[::-1, ::-1])):
        im.save(tmp_path / f"t{tag}.tif", tiffinfo={274: tag})
        assert_same(load_image(tmp_path / f"t{tag}.tif"), minmax(shown), f"{mode} TIFF orientation {tag}")


def test_multi_frame_images_are_refused(tmp_path: Path) -> None:
    """Before: a multi-page TIFF silently gave page 0, an animated GIF died naming no file."""
    frames = [Image.fromarray(np.full((5, 7), v, np.uint8)) for v in (0, 100, 200)]
    for name in ("anim.gif", "pages.tif"):
        frames[0].save(tmp_path / name, save_all=True, append_images=frames[1:])
        with pytest.raises(ValueError, match=rf"{name}' holds 3 frames"):
            load_image(tmp_path / name)


def test_npy_images(tmp_path: Path) -> None:
    """A .npy array of intensities, rows first (before: 'not a readable PNG/JPEG image')."""
    a = np.random.default_rng(8).random((5, 8))
    np.save(tmp_path / "a.npy", a)
    assert_same(load_image(tmp_path / "a.npy"), minmax(a), ".npy")
    a[2, 6] = np.nan
    np.save(tmp_path / "nan.npy", a)
    with pytest.raises(ValueError, match=r"nan.npy' has 1 non-finite pixel.*row 2, column 6"):
        load_image(tmp_path / "nan.npy")
    np.save(tmp_path / "obj.npy", np.array([[1, "x"]], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"obj.npy' is not a readable .npy array of intensities \(Object arrays"):
        load_image(tmp_path / "obj.npy")  # never unpickled
    for shape in [(3, 5, 8), (5, 8, 2), (5,)]:
        np.save(tmp_path / "odd.npy", np.ones(shape))
        with pytest.raises(ValueError, match=r"odd.npy' holds an array of shape"):
            load_image(tmp_path / "odd.npy")
    rgb = np.random.default_rng(8).random((5, 8, 3))
    np.save(tmp_path / "rgb.npy", rgb)
    assert_same(load_image(tmp_path / "rgb.npy"), minmax(rgb @ BT709), "(H, W, 3) .npy")
    # a header that promises 10¹⁰ floats in a small file: named, nothing allocated ("Unable to allocate 74.5 GiB")
    big = (tmp_path / "rgb.npy").read_bytes().replace(b"(5, 8, 3)", b"(100000, 100000)")
    (tmp_path / "big.npy").write_bytes(big)
    with pytest.raises(ValueError, match=r"big.npy' is a damaged .npy: its header says float64 \(100000, 100000\)"):
        load_image(tmp_path / "big.npy")
    (tmp_path / "short.npy").write_bytes((tmp_path / "rgb.npy").read_bytes()[:-8])
    with pytest.raises(ValueError, match=r"short.npy' is a damaged .npy: .* \(960 bytes\), the file holds 952"):
        load_image(tmp_path / "short.npy")
    with open(tmp_path / "two.npy", "wb") as f:  # two arrays np.save'd into one file: np.load reads the first
        np.save(f, rgb)
        np.save(f, np.zeros(3))
    assert_same(load_image(tmp_path / "two.npy"), minmax(rgb @ BT709), "the first of two arrays")


@pytest.mark.parametrize("name", ["xy.npz", "xy.png"])
def test_an_npz_is_refused_not_read_as_an_image(tmp_path: Path, name: str) -> None:
    """An .npz of (X, y) ran to 'done' with X as a 50×2 grayscale picture (imageio reads .npz)."""
    np.savez(tmp_path / "xy.npz", X=np.random.default_rng(0).random((50, 2)), y=np.arange(50.0))
    (tmp_path / name).write_bytes((tmp_path / "xy.npz").read_bytes())
    with pytest.raises(ValueError, match=rf"{name}' is a zip archive \(a NumPy .npz\?\), not an image"):
        image2d(20, image=str(tmp_path / name))


def test_an_image_past_pils_pixel_limit_is_named_with_its_size(tmp_path: Path) -> None:
    """A 196 Mpx PNG (its header; the pixels never decode) got PIL's 'could be decompression bomb DOS
    attack' inside a 'not a readable PNG/JPEG image' line."""
    big = png(tmp_path / "huge.png", np.zeros((2, 3)), 8, 0).read_bytes()
    i = big.index(b"IHDR")
    ihdr = struct.pack(">IIBBBBB", 14_000, 14_000, 8, 0, 0, 0, 0)
    header = big[: i - 4] + struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    (tmp_path / "huge.png").write_bytes(header + big[i + 4 + 13 + 4 :])
    with pytest.raises(ValueError, match=r"huge.png' is 196 Mpx, above the 179 Mpx PIL decodes") as err:
        image2d(20, image=str(tmp_path / "huge.png"))
    assert "downscale it" in str(err.value) and "DOS attack" not in str(err.value), str(err.value)


def test_a_cifar_batch_that_is_no_pickle_is_refused_before_it_is_read_whole(tmp_path: Path) -> None:
    """A 600 MiB garbage ``data_batch_1`` was read into memory whole (868 MiB peak) before the
    unpickler looked at its first byte."""
    import tracemalloc

    from nsa_dist.data._formats import read_pickle_batch

    p = tmp_path / "data_batch_1"
    with open(p, "wb") as f:
        f.write(b"\xff\xfe garbage")  # no pickle opcode
        f.truncate(64 << 20)  # 64 MiB (sparse)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"data_batch_1' is not a pickled dict with keys"):
            read_pickle_batch(p, ("data", "labels"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 2**20:.0f} MiB allocated to refuse a 64 MiB file that is no pickle"


@pytest.mark.parametrize("case", ["truncated_png", "half_png", "text", "directory", "one_pixel_row", "missing"])
def test_bad_images_one_error_naming_the_file(tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture) -> None:
    """One line naming the file; a PNG cut in half (header and EXIF read, pixels not) first warned
    of 'an unreadable EXIF block … read as stored', then gave the truncation."""
    p = tmp_path / "im ü.png"
    Image.fromarray(np.arange(35, dtype=np.uint8).reshape(5, 7)).save(p)
    if case == "truncated_png":
        p.write_bytes(p.read_bytes()[:40])
    elif case == "half_png":
        noise = np.random.default_rng(0).integers(0, 256, (64, 64), dtype=np.uint8)
        Image.fromarray(noise).save(p)
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    elif case == "text":
        p.write_text("not an image")
    elif case == "directory":
        p.unlink()
        p.mkdir()
    elif case == "one_pixel_row":
        Image.fromarray(np.arange(7, dtype=np.uint8).reshape(1, 7)).save(p)
    else:
        p.unlink()
    with caplog.at_level(logging.WARNING), pytest.raises((ValueError, FileNotFoundError)) as err:
        load_image(p)
    assert str(p) in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_image2d_axes_pixel_centres_and_normalisation(tmp_path: Path) -> None:
    """x = X[:, 0] runs along the columns (left → right), y = X[:, 1] down the rows (row 0 at
    y = 0, as the eigenvector images draw it); pixel (i, j)'s centre is at (j/(W−1), i/(H−1))."""
    H, W = 5, 8
    a = (np.arange(H)[:, None] * 10 + np.arange(W)[None, :] * 3).astype(np.uint8)  # asymmetric
    Image.fromarray(a).save(tmp_path / "ramp.png")
    img = load_image(tmp_path / "ramp.png")
    assert img.shape == (H, W)
    ii, jj = np.meshgrid(np.arange(H), np.arange(W), indexing="ij")
    X = np.stack([jj.ravel() / (W - 1), ii.ravel() / (H - 1)], axis=1)
    assert_same(image_function(img, X), minmax(a).ravel(), "y at pixel centres")
    mid = image_function(img, np.array([[0.5 / (W - 1), 0.0]]))  # half way between columns 0 and 1
    assert_same(mid, [(img[0, 0] + img[0, 1]) / 2], "bilinear between columns")
    ds = image2d(50, n_test=7, image=tmp_path / "ramp.png", seed=3)
    U = np.random.default_rng(3).random((57, 2))
    m = ds.meta
    assert_same(ds.X * m["x_std"] + m["x_mean"], U[:50], "inputs, unnormalised")
    assert_same(ds.X_test * m["x_std"] + m["x_mean"], U[50:], "test inputs, training constants")
    assert_same(ds.y * m["y_std"] + m["y_mean"], image_function(img, U[:50]), "targets")
    assert_same(m["x_mean"], U[:50].mean(0), "x_mean from the training points")
    assert image2d(50, n_test=7, image=tmp_path / "ramp.png", seed=3).fingerprint() == ds.fingerprint()
    assert image2d(2, image=tmp_path / "ramp.png").n == 2


def test_a_replaced_image_is_read_anew_and_changes_the_fingerprint(tmp_path: Path) -> None:
    p = tmp_path / "a.png"
    a = np.arange(35, dtype=np.uint8).reshape(5, 7)
    Image.fromarray(a).save(p)
    before = image2d(20, image=p).fingerprint()
    a[2, 3] += 1
    Image.fromarray(a).save(p)
    assert image2d(20, image=p).fingerprint() != before, "same fingerprint after the image changed"


def test_an_unreadable_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As root every file is readable, so os.access is made to say no for the one file."""
    mnist_dir(tmp_path / "m")
    locked = tmp_path / "m" / "train-labels-idx1-ubyte.gz"
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == locked else real(path, mode))
    with pytest.raises(PermissionError, match=r"train-labels-idx1-ubyte.gz' is not readable by this user"):
        mnist(5, path=tmp_path / "m")


def test_image2d_one_point_is_refused_not_nan(tmp_path: Path) -> None:
    """Before: n=1 normalised by a std of 0 — X was NaN, y 0, silently."""
    Image.fromarray(np.arange(35, dtype=np.uint8).reshape(5, 7)).save(tmp_path / "a.png")
    with pytest.raises(ValueError, match=r"n=1 training point cannot be normalised"):
        image2d(1, image=tmp_path / "a.png")
    ds = image2d(1, image=tmp_path / "a.png", normalize=False)
    assert np.isfinite(ds.X).all() and np.isfinite(ds.y).all()


# --------------------------------------------------------------------------- densities (NCE)


def test_density_with_one_data_sample_is_refused_not_nan(tmp_path: Path) -> None:
    """Before: n=2, ratio 1 → 1 data sample; the noise box had volume 0 (uniform) or the covariance
    was NaN (gaussian): X, y and log_noise all NaN/inf, silently."""
    Image.fromarray(np.arange(35, dtype=np.uint8).reshape(5, 7)).save(tmp_path / "a.png")
    with pytest.raises(ValueError, match=r"give 1 data sample.*needs at least 2"):
        density2d(2, image=tmp_path / "a.png")
    with pytest.raises(ValueError, match=r"give 1 data sample.*needs at least 2"):
        gaussian_mixture(2, d=3)
    ds = gaussian_mixture(4, d=3)
    assert all(np.isfinite(v).all() for v in (ds.X, ds.y, *ds.extra.values()))


def test_density2d_gaussian_noise_is_refused(tmp_path: Path) -> None:
    """Before: gaussian noise put ~11% of the points outside [0, 1]², where y = log p = −inf: every
    energy of y NaN, silently."""
    with pytest.raises(ValueError, match=r"noise='gaussian' .* -inf"):
        density2d(400, noise="gaussian")
    ds = density2d(400, n_test=100)
    assert all(np.isfinite(v).all() for v in (ds.X, ds.y, ds.y_test, *ds.extra.values()))
    from pydantic import ValidationError

    from nsa_dist.config import ExperimentSpec

    spec = {"name": "d", "data": {"name": "density2d", "n": 40, "noise": "gaussian"}, "loss": "nce"}
    with pytest.raises(ValidationError, match=r"noise='gaussian' with density2d"):  # refused as a spec, not at load
        ExperimentSpec.model_validate(spec)
    ExperimentSpec.model_validate(spec, context={"stored": True})  # a stored run stays readable


def test_a_missing_relative_path_names_the_directory_it_was_looked_for_in(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        image2d(10, image="pics/nope.npy")
    assert f"'pics/nope.npy' does not exist, relative to the current directory {str(tmp_path)!r}" in str(e.value)
    with pytest.raises(FileNotFoundError) as e:
        image2d(10, image="~/nope-nsa.npy")
    assert str(e.value).endswith("'~' is not expanded: write the home directory out"), str(e.value)


def test_a_dangling_link_and_a_link_loop_are_named(tmp_path: Path, monkeypatch) -> None:
    """A data path that is a symbolic link to nothing said only "does not exist", and a link to itself
    gave a bare "[Errno 40] Too many levels of symbolic links" (audit D)."""
    monkeypatch.chdir(tmp_path)
    os.symlink("nothere.npy", "dangling.npy")
    os.symlink("loop.npy", "loop.npy")
    with pytest.raises(FileNotFoundError, match=r"'dangling.npy' does not exist \(a symbolic link to 'nothere.npy'"):
        image2d(10, image="dangling.npy")
    with pytest.raises(OSError, match=r"^image2d: 'loop.npy' cannot be read: Too many levels of symbolic links"):
        image2d(10, image="loop.npy")


def test_a_gz_with_bytes_appended_says_so(tmp_path: Path) -> None:
    """A .gz whole but followed by other bytes was refused in gzip's own words only: "is not a readable
    gzip file (Not a gzipped file (b'ga'))" for a file that is one (audit D)."""
    mnist_dir(tmp_path, gz=True)
    f = tmp_path / "train-images-idx3-ubyte.gz"
    f.write_bytes(f.read_bytes() + b"garbage!")
    with pytest.raises(ValueError, match="holds other bytes after its gzip stream") as e:
        mnist(10, path=tmp_path)
    assert "download it again" in str(e.value)


def test_an_npz_given_to_nsa_run_makes_no_store(tmp_path: Path, capsys) -> None:
    """`nsa run` made the store's folders (zarr.json, leases/, runs/) before the load refused the .npz."""
    from nsa_dist.cli import main

    np.savez(tmp_path / "xy.npz", X=np.zeros((4, 2)), y=np.zeros(4))
    spec = tmp_path / "s.yaml"
    data = f"{{name: image2d, n: 16, path: {tmp_path / 'xy.npz'}}}"
    spec.write_text(f"name: x\ndata: {data}\nmodel: {{depth: 2, width: 4}}\nsteps: 2\n")
    rc = main(["run", str(spec), "--store", str(tmp_path / "s.zarr"), "--plain"])
    assert rc != 0 and "is a zip archive" in capsys.readouterr().err
    assert not (tmp_path / "s.zarr").exists(), "a store was made for a spec whose data is refused"
