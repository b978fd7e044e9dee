"""Issue 19: full-size MNIST / CIFAR-10 stand-ins in the real file formats, read by the real
loaders, and the full-size recipes run on them with block_rows on a gang (N cut down here; the
full-size steps are benchmarks/full_size.py's)."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest

from nsa_dist.config import ExperimentSpec
from nsa_dist.data import load_dataset
from nsa_dist.data.cifar import cifar10, load_cifar_batches
from nsa_dist.data.mnist import TEST_FILES, TRAIN_FILES, load_idx, mnist
from nsa_dist.data.standins import CIFAR10_CLASSES, cifar10_standin, mnist_standin, write_cifar_batch, write_idx
from nsa_dist.pipeline import run_experiment, run_id
from nsa_dist.specfile import load_sweep
from nsa_dist.store import SpectrumStore

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_writers_round_trip_through_the_readers(tmp_path):
    rng = np.random.default_rng(0)
    img, lab = rng.integers(0, 256, (7, 28, 28), dtype=np.uint8), rng.integers(0, 10, 7).astype(np.uint8)
    for gz in (True, False):
        d = tmp_path / f"gz{gz}"
        d.mkdir()
        assert write_idx(d / TRAIN_FILES[0], img, gz=gz).name.endswith(".gz") == gz
        write_idx(d / TRAIN_FILES[1], lab, gz=gz)
        got_img, got_lab = load_idx(d)
        np.testing.assert_array_equal(got_img, img)
        np.testing.assert_array_equal(got_lab, lab)
    with gzip.open(tmp_path / "gzTrue" / (TRAIN_FILES[0] + ".gz")) as f:
        assert f.read(16) == bytes.fromhex("00000803 00000007 0000001c 0000001c")  # LeCun's header, big-endian
    data = rng.integers(0, 256, (5, 3072), dtype=np.uint8)
    write_cifar_batch(tmp_path / "data_batch_1", data, np.arange(5), "b1")
    with open(tmp_path / "data_batch_1", "rb") as f:
        raw = pickle.load(f, encoding="bytes")  # how the downloaded (Python 2) batches are read
    assert set(raw) == {b"batch_label", b"labels", b"data", b"filenames"} and raw[b"labels"] == [0, 1, 2, 3, 4]
    x, c = load_cifar_batches([tmp_path / "data_batch_1"], "labels", 10)
    np.testing.assert_array_equal(x, data)
    np.testing.assert_array_equal(c, np.arange(5))
    with pytest.raises(ValueError, match="uint8 labels.*images"):
        write_idx(tmp_path / "x", img.astype(np.float32))
    with pytest.raises(ValueError, match="labels must be in 0..9"):
        write_cifar_batch(tmp_path / "y", data, np.full(5, 10), "bad")


def test_small_standins_load_with_every_class_and_real_image_statistics(tmp_path):
    mn = mnist_standin(tmp_path / "mnist", n_train=400, n_test=60, seed=3)
    d = mnist(400, n_test=60, path=mn, target="label")
    assert d.X.shape == (400, 784) and d.X_test.shape == (60, 784)
    assert set(np.unique(d.y)) == set(range(10))
    ink = (d.X > 0.5).mean()
    assert 0.05 < ink < 0.3, f"digit images should be mostly background with strokes; ink fraction {ink:.3f}"
    again = mnist_standin(tmp_path / "again", n_train=400, n_test=60, seed=3)
    for name in TRAIN_FILES + TEST_FILES:  # seeded: the same bytes
        with gzip.open(mn / (name + ".gz")) as a, gzip.open(again / (name + ".gz")) as b:
            assert a.read() == b.read(), name
    cf = cifar10_standin(tmp_path / "cifar-10-batches-py", per_batch=40, n_test=20, seed=1)
    c = cifar10(200, n_test=20, path=cf, grayscale=False, target="label")
    assert c.X.shape == (200, 3072) and c.X_test.shape == (20, 3072) and set(np.unique(c.y)) <= set(range(10))
    with open(cf / "batches.meta", "rb") as f:
        assert [n.decode() for n in pickle.load(f, encoding="bytes")[b"label_names"]] == list(CIFAR10_CLASSES)
    # class structure: each class's mean image is nearer its own images than the other classes' means
    means = np.stack([c.X[c.y == k].mean(0) for k in np.unique(c.y)])
    own = np.argmin(((c.X[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    assert (np.unique(c.y)[own] == c.y).mean() > 0.5


@pytest.mark.slow
def test_full_size_standins_have_the_real_sizes(tmp_path):
    mn = mnist_standin(tmp_path / "mnist")
    assert load_idx(mn)[0].shape == (60_000, 28, 28) and load_idx(mn, TEST_FILES)[0].shape == (10_000, 28, 28)
    d = mnist(60_000, n_test=10_000, path=mn, target="one_vs_rest", positive_class=0)
    assert d.X.shape == (60_000, 784) and d.X_test.shape == (10_000, 784)
    assert 0.08 < (d.y > 0).mean() < 0.12  # digit 0 is about a tenth
    cf = cifar10_standin(tmp_path / "cifar-10-batches-py")
    assert sorted(p.name for p in cf.iterdir()) == [
        "batches.meta",
        "data_batch_1",
        "data_batch_2",
        "data_batch_3",
        "data_batch_4",
        "data_batch_5",
        "test_batch",
    ]
    c = cifar10(50_000, n_test=10_000, path=cf, grayscale=False, target="label")
    assert c.X.shape == (50_000, 3072) and c.X_test.shape == (10_000, 3072)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["mnist_full.yaml", "cifar10_full.yaml"])
def test_full_size_recipe_runs_on_the_standin_with_block_rows_as_local(tmp_path, recipe):
    """The recipe as written (its data through the real loader, its model, block_rows on 4
    members) with N cut to 192 and three steps: done, and its numbers equal the local layout's."""
    sweep = load_sweep(EXAMPLES / recipe)
    first = sweep.expand()[0].model_dump(mode="json")
    assert first["spectrum"]["layout"] == "block_rows" and first["spectrum"]["workers"] == 4
    writer = mnist_standin if recipe.startswith("mnist") else cifar10_standin
    kw = {"n_train": 300, "n_test": 20} if recipe.startswith("mnist") else {"per_batch": 60, "n_test": 20}
    first["data"].update(path=str(writer(tmp_path / "data", **kw)), n=192)
    first.update(steps=3, record={"steps": [0, 2]})
    first["spectrum"].update(k=10, dtype="float64")
    out = {}
    for layout in ("block_rows", "local"):
        spec = ExperimentSpec.model_validate({**first, "spectrum": {**first["spectrum"], "layout": layout}})
        url = str(tmp_path / f"{layout}.zarr")
        assert run_experiment(spec, SpectrumStore(url)).status == "done"
        g = SpectrumStore(url).group(run_id(spec))
        assert g.attrs["layout"] == layout
        out[layout] = {k: g[k][:] for k in ("eigenvalues", "energy_y", "loss")}
    assert load_dataset(spec.data).X.shape == (192, 784 if recipe.startswith("mnist") else 3072)
    for k, ref in out["local"].items():
        err = np.max(np.abs(out["block_rows"][k] - ref)) / np.max(np.abs(ref))
        assert err < 1e-9, f"{recipe}: {k} on block_rows differs from local by {err:.2e} relative"
