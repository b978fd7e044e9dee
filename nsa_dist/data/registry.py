"""``load_dataset(DataSpec)``: the one place a dataset name becomes a loader call."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nsa_dist.data._dataset import Dataset

if TYPE_CHECKING:
    from nsa_dist.config import DataSpec

__all__ = ["load_dataset"]


def load_dataset(spec: "DataSpec", seed: int = 0) -> Dataset:
    """The train/test split that ``spec`` describes, sampled with ``seed``.

    Raises:
        FileNotFoundError: a data file or directory named by ``spec.path`` is missing.
        ValueError: a file in the wrong format, or more points asked than the data has.
    """
    from nsa_dist.config import DataName

    name = DataName(spec.name)
    target = getattr(spec.target, "value", spec.target)
    if name is DataName.IMAGE2D:
        from nsa_dist.data.image2d import image2d

        return image2d(spec.n, n_test=spec.n_test, image=spec.path, seed=seed)
    if name is DataName.MNIST:
        from nsa_dist.data.mnist import mnist

        return mnist(spec.n, n_test=spec.n_test, path=spec.path, pool=spec.pool, target=target,
                     positive_class=spec.positive_class, seed=seed)
    if name in (DataName.CIFAR10, DataName.CIFAR100):
        from nsa_dist.data import cifar

        fn = cifar.cifar10 if name is DataName.CIFAR10 else cifar.cifar100
        if spec.path is None:
            raise FileNotFoundError(f"data.path: {name.value} needs the directory of its python pickle batches "
                                    f"({'cifar-10-batches-py/' if name is DataName.CIFAR10 else 'cifar-100-python/'})")
        return fn(spec.n, n_test=spec.n_test, path=spec.path, grayscale=spec.grayscale, target=target,
                  positive_class=spec.positive_class, seed=seed)
    if name in (DataName.DENSITY2D, DataName.GAUSSIAN_MIXTURE):
        from nsa_dist.data.density import density2d, gaussian_mixture

        if name is DataName.DENSITY2D:
            return density2d(spec.n, n_test=spec.n_test, ratio=spec.noise_ratio, noise=spec.noise, image=spec.path,
                             seed=seed)
        return gaussian_mixture(spec.n, d=spec.dim, n_test=spec.n_test, ratio=spec.noise_ratio, noise=spec.noise,
                                seed=seed)
    from nsa_dist.data.digits import digits

    return digits(spec.n, n_test=spec.n_test, target=target, positive_class=spec.positive_class, seed=seed)
