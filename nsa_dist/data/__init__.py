"""Datasets: each loader returns a :class:`Dataset` with train X (N, d), y and test X, y.

Owns: the loaders and generators (MNIST, CIFAR, digits, 2-D images, densities for NCE, the
stand-ins), their file formats and what a data path is (:data:`Location`, :func:`is_url`: local
or fsspec URL).  May import: NumPy, SciPy, scikit-learn / scikit-image (optional loaders),
:mod:`nsa_dist.config` (the data spec), ``errors``, ``_fsspec`` and ``_faults`` — the bottom layer beside
``config``: never a model, the numerics, the pipeline or the store.
"""

from nsa_dist.data._dataset import Dataset
from nsa_dist.data._paths import Location, is_url
from nsa_dist.data.cifar import cifar10, cifar100
from nsa_dist.data.digits import digits
from nsa_dist.data.image2d import image2d, image_function, load_image
from nsa_dist.data.mnist import mnist
from nsa_dist.data.registry import load_dataset

__all__ = [
    "Dataset",
    "Location",
    "cifar10",
    "cifar100",
    "digits",
    "image2d",
    "image_function",
    "is_url",
    "load_dataset",
    "load_image",
    "mnist",
]
