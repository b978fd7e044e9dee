"""``load_dataset(DataSpec)``: the one place a dataset name becomes a loader call."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from nsa_dist.data._dataset import Dataset
from nsa_dist.data._paths import Location, is_url, regular_file

if TYPE_CHECKING:
    from nsa_dist.config import DataSpec

__all__ = ["load_dataset", "data_files"]

log = logging.getLogger(__name__)


def load_dataset(spec: DataSpec, seed: int = 0) -> Dataset:
    """The train/test split that ``spec`` describes, sampled with ``seed``.

    Raises:
        FileNotFoundError: a data file or directory named by ``spec.path`` is missing.
        ValueError: a path that is a directory or not a regular file, a file in the wrong format,
            more points asked than the data has, or a training target that is 0 everywhere.
    """
    data = _load(spec, seed)
    _check_target(data, spec)
    return data


def data_files(spec: DataSpec) -> list[Location]:
    """The files ``load_dataset(spec)`` reads from ``spec.path``, each checked — it exists, is a
    regular file, a local one is readable — without reading any (cheap: a stat per file, or one
    request per object for a URL), except an MNIST file present both plain and ``.gz``: the two are
    read and compared (different data under one name are refused).  [] for data that has no path
    (bundled or generated).

    Returns:
        the files, local paths or fsspec URLs: the image (image2d, density2d), the IDX files
        (mnist), the pickle batches (cifar10/100); test files only when ``spec.n_test > 0``.

    Raises:
        FileNotFoundError: the path or a file in it is missing (the message names it).
        ValueError: a directory where a file is expected or the reverse, or not a regular file;
            an MNIST file whose plain and .gz copies hold different data.
        PermissionError: a local file this user may not read.
    """
    from nsa_dist.config import DataName

    name = DataName(spec.name)
    if name in (DataName.CIFAR10, DataName.CIFAR100):
        from nsa_dist.data.cifar import batch_files

        if spec.path is None:
            raise FileNotFoundError(_CIFAR_NEEDS_PATH[name.value])
        return batch_files(name.value, spec.path, spec.n_test)
    if spec.path is None:
        return []
    if name in (DataName.IMAGE2D, DataName.DENSITY2D):
        found = regular_file(spec.path, name.value, "an image file (PNG, JPEG, TIFF …) or a .npy array")
        if not is_url(found):
            from nsa_dist.data.image2d import refuse_zip

            refuse_zip(found)
        return [found]
    if name is DataName.MNIST:
        from nsa_dist.data.mnist import idx_files

        return idx_files(spec.path, spec.n_test)
    return []


_CIFAR_NEEDS_PATH = {
    "cifar10": "data.path: cifar10 needs the directory of its python pickle batches (cifar-10-batches-py/)",
    "cifar100": "data.path: cifar100 needs the directory of its python pickle batches (cifar-100-python/)",
}


def _check_target(data: Dataset, spec: DataSpec) -> None:
    """Refuse y ≡ 0: every energy E(y, k) = ‖P_k y‖² / ‖y‖² would be 0/0 (a constant image
    normalises to it); warn about another constant target (nothing to learn but an offset)."""
    y = np.asarray(data.y)
    if not y.size:
        return
    name = getattr(spec.name, "value", spec.name)
    what = f"data.path {str(spec.path)!r}" if spec.path else f"the {name} data"
    if not np.any(y):
        raise ValueError(
            f"{what}: every training target y is 0 (a constant image or target normalises to 0), "
            "so every energy E(y, k) = ‖P_k y‖²/‖y‖² would be 0/0 — give data whose target varies"
        )
    if len(y) > 1 and np.all(y == y[:1]):
        log.warning(
            "%s: every training target y equals %s: a constant target, nothing to learn but an offset",
            what,
            y[0].tolist(),
        )


def _load(spec: DataSpec, seed: int) -> Dataset:
    from nsa_dist.config import DataName

    name = DataName(spec.name)
    target = getattr(spec.target, "value", spec.target)
    if name is DataName.IMAGE2D:
        from nsa_dist.data.image2d import image2d

        return image2d(spec.n, n_test=spec.n_test, image=spec.path, seed=seed)
    if name is DataName.MNIST:
        from nsa_dist.data.mnist import mnist

        return mnist(
            spec.n,
            n_test=spec.n_test,
            path=spec.path,
            pool=spec.pool,
            target=target,
            positive_class=spec.positive_class,
            seed=seed,
        )
    if name in (DataName.CIFAR10, DataName.CIFAR100):
        from nsa_dist.data import cifar

        fn = cifar.cifar10 if name is DataName.CIFAR10 else cifar.cifar100
        if spec.path is None:
            raise FileNotFoundError(_CIFAR_NEEDS_PATH[name.value])
        return fn(
            spec.n,
            n_test=spec.n_test,
            path=spec.path,
            grayscale=spec.grayscale,
            target=target,
            positive_class=spec.positive_class,
            seed=seed,
        )
    if name in (DataName.DENSITY2D, DataName.GAUSSIAN_MIXTURE):
        from nsa_dist.data.density import density2d, gaussian_mixture

        if name is DataName.DENSITY2D:
            return density2d(
                spec.n, n_test=spec.n_test, ratio=spec.noise_ratio, noise=spec.noise, image=spec.path, seed=seed
            )
        return gaussian_mixture(
            spec.n, d=spec.dim, n_test=spec.n_test, ratio=spec.noise_ratio, noise=spec.noise, seed=seed
        )
    if name is DataName.DIGITS:
        from nsa_dist.data.digits import digits

        return digits(spec.n, n_test=spec.n_test, target=target, positive_class=spec.positive_class, seed=seed)
    raise ValueError(
        f"data.name={name.value!r}: a Tracker's arrays, handed to it in memory, cannot be loaded from a spec"
        if name is DataName.ARRAYS
        else f"data.name={name.value!r} has no loader"
    )
