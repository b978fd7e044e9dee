"""Datasets: each loader returns a :class:`Dataset` with train X (N, d), y and test X, y."""

from nsa_dist.data._dataset import Dataset
from nsa_dist.data._paths import Location, is_url
from nsa_dist.data.image2d import image2d, image_function, load_image
from nsa_dist.data.cifar import cifar10, cifar100
from nsa_dist.data.digits import digits
from nsa_dist.data.mnist import mnist
from nsa_dist.data.registry import load_dataset

__all__ = ["Dataset", "Location", "cifar10", "cifar100", "digits", "image2d", "image_function", "is_url", "load_dataset",
           "load_image", "mnist"]
