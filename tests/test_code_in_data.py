"""Code in data (issue 18): a CIFAR batch is unpickled admitting only what the format contains,
so a crafted batch that would run code is refused — naming the file — without running it."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from nsa_dist.data import cifar10
from nsa_dist.data.cifar import load_cifar_batches


class _Payload:
    """Unpickled by the full machinery, this calls os.system and creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _batch(labels: list[int]) -> dict:
    rng = np.random.default_rng(0)
    return {
        b"batch_label": b"testing batch",
        b"labels": labels,
        b"filenames": [b"x.png"] * len(labels),
        b"data": rng.integers(0, 256, (len(labels), 3072), dtype=np.uint8),
    }


def _cifar_dir(tmp_path: Path, first: dict) -> Path:
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    for i in range(1, 6):
        (d / f"data_batch_{i}").write_bytes(pickle.dumps(first if i == 1 else _batch([i, i + 1])))
    return d


@pytest.mark.parametrize("where", ["data", "key"])
def test_a_crafted_cifar_batch_is_refused_without_running(tmp_path, where):
    marker = tmp_path / "ran"
    crafted = _batch([0, 1])
    if where == "data":
        crafted[b"data"] = _Payload(marker)
    else:
        crafted[_Payload(marker)] = b"x"
    d = _cifar_dir(tmp_path, crafted)
    with pytest.raises(ValueError) as e:
        cifar10(4, path=d)
    msg = str(e.value)
    assert not marker.exists(), "unpickling the crafted batch ran its code"
    assert str(d / "data_batch_1") in msg and "refused posix.system" in msg and "nothing of it was run" in msg, msg


def test_real_cifar_batches_still_load_as_numpy_1_and_2_and_python_2_wrote_them(tmp_path):
    """The format's own names: numpy 2's ``numpy._core`` and numpy 1's ``numpy.core`` (the files
    from the CIFAR site), bytes keys, lists, and protocol 2 as Python 3 writes it."""
    batch = _batch([3, 1, 4])
    new = pickle.dumps(batch, protocol=2)
    old = new.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")  # as numpy 1.x pickled it
    assert old != new
    for i, raw in enumerate((new, old, pickle.dumps(batch))):
        p = tmp_path / f"batch_{i}"
        p.write_bytes(raw)
        pixels, labels = load_cifar_batches([p], "labels", 10)
        np.testing.assert_array_equal(pixels, batch[b"data"])
        assert labels.tolist() == [3, 1, 4]
