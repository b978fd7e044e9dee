"""An adversarial trial of the data a job trains on: a folder holding both an IDX file and a
different ``.gz`` of the same name, images whose alpha channel hides pixels, and relative data
paths written as people write them (``./data/x.png``, ``data//mnist/``) shipped with ``nsa submit``.
Each number is checked against an independent reading in this file (struct, PIL)."""

from __future__ import annotations

import gzip
import logging
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from nsa_dist.cluster.job_data import prepare_job_data
from nsa_dist.config import DataSpec, SweepSpec
from nsa_dist.data import load_dataset, load_image, mnist
from nsa_dist.data.mnist import TEST_FILES, TRAIN_FILES
from nsa_dist.data.registry import data_files
from nsa_dist.pipeline import run_id
from nsa_dist.specfile import SpecError, load_sweep

BT709 = np.array([0.2125, 0.7154, 0.0721])


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    diff = np.abs(got - want)
    if diff.size and diff.max() > 1e-12:
        i = np.unravel_index(np.argmax(diff), diff.shape)
        raise AssertionError(f"{what}: max |diff| {diff.max():.3g} at {i}: got {got[i]!r}, want {want[i]!r}")


def idx_raw(arr: np.ndarray) -> bytes:
    """IDX per LeCun: big-endian uint32 magic 0x000008nn, big-endian uint32 dims, the bytes."""
    return struct.pack(">I", 0x0800 | arr.ndim) + b"".join(struct.pack(">I", s) for s in arr.shape) + arr.tobytes()


def minmax(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    return (a - a.min()) / (a.max() - a.min())


# --------------------------------------------------------------------------- MNIST: plain and .gz side by side
def test_mnist_plain_and_gz_that_differ_are_refused_not_one_silently_read(tmp_path: Path) -> None:
    """A folder with ``train-images-idx3-ubyte`` (one dataset) and ``train-images-idx3-ubyte.gz``
    (another: a Fashion-MNIST download, a re-downloaded file) — before, the plain one was read
    silently; now both are compared and different data are refused, naming both files."""
    rng = np.random.default_rng(0)
    A = rng.integers(0, 256, (20, 28, 28), dtype=np.uint8)
    lab = rng.integers(0, 10, 20).astype(np.uint8)
    d = tmp_path / "mnist ü"
    d.mkdir()
    (d / TRAIN_FILES[0]).write_bytes(idx_raw(A))
    (d / f"{TRAIN_FILES[0]}.gz").write_bytes(gzip.compress(idx_raw(A)))  # gunzip -k: the same data
    (d / TRAIN_FILES[1]).write_bytes(idx_raw(lab))
    ds = mnist(20, path=d, seed=4)
    perm = np.random.default_rng(np.random.SeedSequence(4).spawn(2)[0]).permutation(20)
    assert_same(ds.X, A[perm].reshape(20, -1) / 255.0, "identical plain and .gz: the pixels")
    assert_same(ds.y, lab[perm], "identical plain and .gz: the labels")

    B = A.copy()
    B[7, 3, 5] ^= 0xFF  # one pixel of one image differs
    (d / f"{TRAIN_FILES[0]}.gz").write_bytes(gzip.compress(idx_raw(B)))
    at = 16 + 7 * 784 + 3 * 28 + 5  # its byte in the decompressed stream
    for path in (d, f"file://{d}"):  # a local folder and a URL alike
        with pytest.raises(ValueError) as err:
            mnist(20, path=path)
        msg = str(err.value)
        assert "hold different data" in msg and f"differ at byte {at:,}" in msg, msg
        assert f"{TRAIN_FILES[0]}'" in msg and f"{TRAIN_FILES[0]}.gz'" in msg and "\n" not in msg, msg
    with pytest.raises(ValueError, match=rf"differ at byte {at:,}"):  # the check before a run or a submission
        data_files(DataSpec(name="mnist", path=str(d)))

    (d / f"{TRAIN_FILES[0]}.gz").write_bytes(gzip.compress(idx_raw(A) + b"\0"))  # one byte more
    with pytest.raises(ValueError, match=r"ends at byte .*the other goes on"):
        mnist(5, path=d)
    (d / f"{TRAIN_FILES[0]}.gz").write_bytes(gzip.compress(idx_raw(A))[:-100])  # a cut-off download
    with pytest.raises(ValueError, match=r"exist and the \.gz is not a readable gzip file"):
        mnist(5, path=d)


def test_mnist_test_split_plain_and_gz_that_differ_refuse_the_submission(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(1)
    d = tmp_path / "data" / "mnist"
    d.mkdir(parents=True)
    imgs = rng.integers(0, 256, (12, 28, 28), dtype=np.uint8)
    labs = rng.integers(0, 10, 12).astype(np.uint8)
    for name, a in zip(TRAIN_FILES + TEST_FILES, (imgs, labs, imgs[:6], labs[:6]), strict=True):
        (d / name).write_bytes(idx_raw(a))
    other = labs[:6].copy()
    other[2] = (other[2] + 1) % 10
    (d / f"{TEST_FILES[1]}.gz").write_bytes(gzip.compress(idx_raw(other)))
    sweep = {
        "name": "both",
        "base": {"model": {"depth": 2, "width": 8}, "steps": 4, "record": {"every": 2}, "spectrum": {"k": 4}},
        "variants": [{"data": {"name": "mnist", "path": "data/mnist", "n": 8, "n_test": 4}}],
    }
    Path("sweep.yaml").write_text(yaml.safe_dump(sweep))
    (tmp_path / "work").mkdir()
    with pytest.raises(SpecError, match=r"t10k-labels-idx1-ubyte.gz' exist and hold different data \(they differ at"):
        prepare_job_data("sweep.yaml", tmp_path / "work")
    assert not any((tmp_path / "work").iterdir()), "data shipped although refused"


# --------------------------------------------------------------------------- images: alpha said
def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "alpha" in r.getMessage()]


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "RGB_tRNS"])
def test_transparent_pixels_are_said_and_the_stored_values_read(tmp_path, caplog, mode) -> None:
    """Transparent pixels' stored colours become targets (often black where a viewer shows the
    background); the values are the stored ones (independent luminance below) and a warning counts
    them.  Before: nothing was said."""
    H, W = 4, 6
    rng = np.random.default_rng(2)
    alpha = np.full((H, W), 255, np.uint8)
    alpha[0, :] = 0  # the top row fully transparent
    alpha[1, 2] = 128  # one half transparent
    p = tmp_path / f"logo {mode}.png"
    if mode == "RGBA":
        rgb = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
        Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(p)
        want = minmax(rgb @ BT709)
    elif mode == "LA":
        gray = rng.integers(0, 256, (H, W), dtype=np.uint8)
        Image.fromarray(np.dstack([gray, alpha]), "LA").save(p)
        want = minmax(gray)
    elif mode == "RGB_tRNS":  # an RGB PNG whose colour (1, 2, 3) is transparent (a tRNS colour key)
        rgb = rng.integers(4, 256, (H, W, 3), dtype=np.uint8)
        rgb[0, :] = (1, 2, 3)
        Image.fromarray(rgb).save(p, transparency=(1, 2, 3))
        alpha = np.where(np.arange(H)[:, None] == 0, 0, np.full((H, W), 255))
        want = minmax(rgb @ BT709)
    else:  # a palette image whose index 0 is transparent (tRNS), gray palette c → (c, c, c)
        ind = rng.integers(1, 256, (H, W), dtype=np.uint8)
        ind[0, :] = 0
        im = Image.fromarray(ind, "P")
        im.putpalette([v for c in range(256) for v in (c, c, c)])
        im.save(p, transparency=0)
        alpha = np.where(ind == 0, 0, 255)
        want = minmax(ind)
    with caplog.at_level(logging.WARNING, logger="nsa_dist"):
        got = load_image(p)
    assert_same(got, want, f"{mode}: the stored values")
    said = _warnings(caplog)
    n_not_opaque, n_clear = int((alpha < 255).sum()), int((alpha == 0).sum())
    assert len(said) == 1, f"{mode}: expected one warning about the {n_not_opaque} transparent pixels, got {said}"
    assert str(p) in said[0] and f"{n_not_opaque} of {H * W} pixels are not fully opaque ({n_clear} fully" in said[0]

    caplog.clear()  # an alpha channel that hides nothing says nothing
    if mode == "RGBA":
        Image.fromarray(np.dstack([rgb, np.full((H, W), 255, np.uint8)]), "RGBA").save(p)
        with caplog.at_level(logging.WARNING, logger="nsa_dist"):
            assert_same(load_image(p), want, "opaque RGBA")
        assert not _warnings(caplog), _warnings(caplog)


def test_npy_with_an_alpha_plane_is_said(tmp_path, caplog) -> None:
    rgba = np.random.default_rng(3).random((5, 7, 4))
    rgba[..., 3] = 1.0
    np.save(tmp_path / "opaque.npy", rgba)
    with caplog.at_level(logging.WARNING, logger="nsa_dist"):
        assert_same(load_image(tmp_path / "opaque.npy"), minmax(rgba[..., :3] @ BT709), "opaque .npy")
    assert not _warnings(caplog), _warnings(caplog)
    rgba[2, 3, 3] = 0.0
    np.save(tmp_path / "hole.npy", rgba)
    with caplog.at_level(logging.WARNING, logger="nsa_dist"):
        load_image(tmp_path / "hole.npy")
    assert any("1 of 35 pixels are not fully opaque (1 fully transparent)" in m for m in _warnings(caplog)), caplog.text


# --------------------------------------------------------------------------- relative paths as written
def test_relative_paths_written_with_dot_or_double_slash_keep_their_run_ids(tmp_path, monkeypatch) -> None:
    """``./data/face.png``, ``data//mnist/`` and ``sub/../data/face.png`` name the same files inside
    the job's working_dir: before, the job's sweep said ``data/face.png`` and ``data/mnist``, so the
    job's run ids were not the local ones (a run begun locally was started over, not resumed, on the
    cluster), and ``sub/../data/face.png`` beside ``data/face.png`` crashed the submission (a bare
    "zip() argument 2 is shorter than argument 1")."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "mnist").mkdir(parents=True)
    (tmp_path / "sub").mkdir()
    yy, xx = np.mgrid[0:12, 0:16]
    Image.fromarray(((xx * 13 + yy * 7) % 256).astype(np.uint8)).save(tmp_path / "data" / "face.png")
    rng = np.random.default_rng(5)
    imgs, labs = rng.integers(0, 256, (30, 28, 28), dtype=np.uint8), rng.integers(0, 10, 30).astype(np.uint8)
    (tmp_path / "data" / "mnist" / TRAIN_FILES[0]).write_bytes(idx_raw(imgs))
    (tmp_path / "data" / "mnist" / TRAIN_FILES[1]).write_bytes(idx_raw(labs))
    paths = {"image2d": "./data/face.png", "mnist": "data//mnist/"}
    sweep = {
        "name": "dots",
        "base": {"model": {"depth": 2, "width": 8}, "steps": 4, "record": {"every": 2}, "spectrum": {"k": 4}},
        "variants": [{"data": {"name": k, "path": p, "n": 10}} for k, p in paths.items()]
        + [{"data": {"name": "image2d", "path": p, "n": 10}} for p in ("sub/../data/face.png", "data/face.png")],
    }
    Path("sweep.yaml").write_text(yaml.safe_dump(sweep))
    work = tmp_path / "work"
    work.mkdir()
    job = prepare_job_data("sweep.yaml", work)
    mine, theirs = load_sweep("sweep.yaml").expand(), SweepSpec.model_validate(job).expand()
    got_paths = [r.data.path for r in theirs]
    assert got_paths == [*paths.values(), "sub/../data/face.png", "data/face.png"], got_paths
    assert (work / "sub").is_dir(), "the job's working_dir lacks the sub/ that sub/../data steps out of"
    got_ids, want_ids = [run_id(r) for r in theirs], [run_id(r) for r in mine]
    assert got_ids == want_ids, f"job run ids {got_ids} != local {want_ids}"
    want = [load_dataset(r.data, seed=r.seed) for r in mine]
    os.chdir(work)  # where the job runs
    for r, w in zip(theirs, want, strict=True):
        g = load_dataset(r.data, seed=r.seed)
        assert_same(g.X, w.X, f"{r.data.path}: X in the job")
        assert_same(g.y, w.y, f"{r.data.path}: y in the job")
        assert g.fingerprint() == w.fingerprint()


def test_two_data_paths_that_normalise_alike_but_name_other_files_both_travel(tmp_path, monkeypatch) -> None:
    """``link/../face.png`` (``link`` a symlink into another tree: the OS reads ``<tree>/face.png``)
    and ``face.png`` normalise to the same place in the working_dir; before, the second copy
    overwrote the first and one run trained on the other's image, silently."""
    (tmp_path / "tree" / "deep").mkdir(parents=True)
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    Path("link").symlink_to(tmp_path / "tree" / "deep", target_is_directory=True)
    yy, xx = np.mgrid[0:12, 0:16]
    Image.fromarray(((xx * 13 + yy * 7) % 256).astype(np.uint8)).save(tmp_path / "tree" / "face.png")
    Image.fromarray(((xx * 3 + yy * 19) % 256).astype(np.uint8)).save(tmp_path / "here" / "face.png")
    sweep = {
        "name": "twins",
        "base": {"model": {"depth": 2, "width": 8}, "steps": 4, "record": {"every": 2}, "spectrum": {"k": 4}},
        "variants": [{"data": {"name": "image2d", "path": p, "n": 10}} for p in ("link/../face.png", "face.png")],
    }
    Path("sweep.yaml").write_text(yaml.safe_dump(sweep))
    work = tmp_path / "work"
    work.mkdir()
    job = prepare_job_data("sweep.yaml", work)
    mine, theirs = load_sweep("sweep.yaml").expand(), SweepSpec.model_validate(job).expand()
    got_paths = [r.data.path for r in theirs]
    assert len(theirs) == len(mine) == 2, f"the job's sweep has runs with data {got_paths}, the local one 2 runs"
    want = [load_dataset(r.data, seed=r.seed) for r in mine]
    assert want[0].fingerprint() != want[1].fingerprint(), "the two images should differ"
    os.chdir(work)
    for r, w in zip(theirs, want, strict=True):
        g = load_dataset(r.data, seed=r.seed)
        assert_same(g.y, w.y, f"job's {r.data.path!r} vs local {w.meta['image']!r}: the targets")


# --------------------------------------------------------------------------- nsa submit --max-runs
def test_submit_max_runs_reaches_the_data_step(tmp_path, monkeypatch, capsys) -> None:
    """``nsa submit --max-runs 1001`` of a 1,001-run sweep: before, the data step read the sweep
    again with the default limit and refused it ("more than the limit 1,000 … raise the limit
    explicitly (… nsa submit --max-runs N)"), the flag the user had given.  Now it gets as far as
    the cluster (here: none listening, said as such)."""
    import socket

    from nsa_dist.cli import main as nsa

    monkeypatch.chdir(tmp_path)
    sweep = {
        "name": "big",
        "base": {
            "model": {"depth": 2, "width": 8},
            "steps": 4,
            "record": {"every": 2},
            "spectrum": {"k": 4},
            "data": {"name": "digits", "n": 16},
        },
        "grid": {"seed": list(range(1001))},
    }
    Path("sweep.yaml").write_text(yaml.safe_dump(sweep))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    capsys.readouterr()
    rc = nsa(
        ["submit", "sweep.yaml", "--address", f"http://127.0.0.1:{port}", "--store", "s.zarr", "--max-runs", "1001"]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "more than the limit" not in err, f"--max-runs 1001 was not honoured: {err}"
    assert f"no Ray cluster answers at http://127.0.0.1:{port}" in err, err


def test_npy_spanning_the_float64_range_reads_its_values_not_nan(tmp_path) -> None:
    """An array from −1e308 to 1e308: hi − lo overflows, and min-max scaling gave NaN targets
    (numpy's RuntimeWarning only; y = NaN passed the loader).  Reference: the same min-max in
    exact rational arithmetic (fractions), rounded once."""
    from fractions import Fraction

    a = np.array([[-1e308, 0.0, 1e308], [1e308, -1e308, 5e307], [3.0, -2.5e307, 7e306]])
    np.save(tmp_path / "wide.npy", a)
    lo, hi = Fraction(a.min()), Fraction(a.max())
    want = np.array([[float((Fraction(v) - lo) / (hi - lo)) for v in row] for row in a])
    got = load_image(tmp_path / "wide.npy")
    assert np.isfinite(got).all(), f"non-finite pixels: {got}"
    assert_same(got, want, "min-max of a ±1e308 array")


# --------------------------------------------------------------------------- density2d: log p integrates to 1
def _bilinear(img: np.ndarray, U: np.ndarray) -> np.ndarray:
    """img (H, W) at U (N, 2) ∈ [0, 1]², pixel (i, j) at (j/(W−1), i/(H−1)); written out by hand."""
    H, W = img.shape
    c, r = U[:, 0] * (W - 1), U[:, 1] * (H - 1)
    c0, r0 = np.minimum(np.floor(c).astype(int), W - 2), np.minimum(np.floor(r).astype(int), H - 2)
    fc, fr = c - c0, r - r0
    return (
        img[r0, c0] * (1 - fr) * (1 - fc)
        + img[r0, c0 + 1] * (1 - fr) * fc
        + img[r0 + 1, c0] * fr * (1 - fc)
        + img[r0 + 1, c0 + 1] * fr * fc
    )


def test_density2d_log_p_is_a_normalised_density(tmp_path) -> None:
    """y = log p(x) with p ∝ intensity + FLOOR must integrate to 1 over [0, 1]²; before, Z was the
    pixel mean instead of the bilinear interpolant's integral, and for this bright-framed 6×9 image
    ∫ p was 0.659 (every y off by log 0.659 = −0.42).  Reference: Z by a 1200² midpoint rule of a
    hand-written bilinear interpolant."""
    from nsa_dist.data.density import FLOOR, density2d

    H, W = 6, 9
    yy, xx = np.mgrid[0:H, 0:W]
    a = np.where((yy == 0) | (xx == 0) | (yy == H - 1) | (xx == W - 1), 255, 0).astype(np.uint8)
    Image.fromarray(a).save(tmp_path / "frame.png")
    img = a / 255.0 + FLOOR
    m = 1200
    g = (np.arange(m) + 0.5) / m
    gx, gy = np.meshgrid(g, g)
    Z = _bilinear(img, np.stack([gx.ravel(), gy.ravel()], 1)).mean()
    ds = density2d(400, n_test=40, image=tmp_path / "frame.png", seed=2)
    sx, mx = np.asarray(ds.meta["x_std"]), np.asarray(ds.meta["x_mean"])
    U = ds.X * sx + mx  # back to [0, 1]²
    got = ds.y - np.sum(np.log(sx))  # y is log p in the standardised coordinates
    want = np.log(_bilinear(img, U) / Z)
    diff = np.abs(got - want)
    assert diff.max() < 1e-5, (
        f"log p off by {diff.max():.4g} (mean {np.mean(got - want):+.4g} = log of ∫p over [0, 1]²)"
    )
