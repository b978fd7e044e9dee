"""Helpers the classification loaders share: targets from labels, seeded subsets, 2×2 pooling."""

from __future__ import annotations

from enum import Enum

import numpy as np

__all__ = ["Target", "parse_target", "make_targets", "check_sizes", "draw", "split", "avg_pool2"]


class Target(str, Enum):
    """How integer class labels c ∈ {0, …, K−1} become regression targets.

    LABEL: y = c as a float, shape (N,) — one output; ordinal, so it suits scalar-output NTK demos.
    ONE_VS_REST: y = +1 if c = positive_class else −1, shape (N,) — a binary task for one output.
    ONEHOT: y = e_c ∈ {0, 1}^K, shape (N, K) — for multi-output models (full NTK blocks).
    """

    LABEL = "label"
    ONE_VS_REST = "one_vs_rest"
    ONEHOT = "onehot"


def parse_target(target: str | Target, K: int, positive_class: int, who: str) -> Target:
    """Validate ``target`` (and ``positive_class`` when it matters) once, at the loader's edge.

    Raises:
        ValueError: unknown target (the message lists the allowed values), or
            ``positive_class`` outside 0..K−1 for ``one_vs_rest``.
    """
    try:
        t = Target(target)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in Target)
        raise ValueError(f"{who}: target={target!r} is not one of {allowed}") from None
    if t is Target.ONE_VS_REST and not 0 <= positive_class < K:
        raise ValueError(f"{who}: positive_class={positive_class} must be a class in 0..{K - 1}")
    return t


def make_targets(labels: np.ndarray, target: Target, K: int, positive_class: int = 0) -> np.ndarray:
    """float64 targets from integer labels (N,): (N,) for LABEL / ONE_VS_REST, (N, K) for ONEHOT."""
    c = np.asarray(labels, dtype=np.int64)  # (N,)
    if target is Target.LABEL:
        return c.astype(np.float64)
    if target is Target.ONE_VS_REST:
        return np.where(c == positive_class, 1.0, -1.0)
    return np.eye(K, dtype=np.float64)[c]  # (N, K)


def check_sizes(n: int, n_test: int, who: str) -> None:
    """n ≥ 1 and n_test ≥ 0, else ValueError naming both."""
    if n < 1 or n_test < 0:
        raise ValueError(f"{who}: need n >= 1 and n_test >= 0, got n={n}, n_test={n_test}")


def draw(rng: np.random.Generator, available: int, n: int, who: str, what: str) -> np.ndarray:
    """n distinct indices of ``available`` items in random order (a seeded subset).

    Raises:
        ValueError: n > available, naming both numbers.
    """
    if n > available:
        raise ValueError(f"{who}: asked for {n} {what} but only {available} are available")
    return rng.permutation(available)[:n]


def split(rng: np.random.Generator, available: int, n: int, n_test: int, who: str) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint train / test indices from ONE pool: one permutation, train its first n, test its last n_test.

    The test indices do not depend on n (nor train on n_test), so growing N keeps the test set fixed.

    Raises:
        ValueError: n + n_test > available, naming the numbers.
    """
    if n + n_test > available:
        raise ValueError(f"{who}: n={n} + n_test={n_test} = {n + n_test} exceeds the {available} images available")
    perm = rng.permutation(available)
    return perm[:n], perm[available - n_test :]


def avg_pool2(x: np.ndarray) -> np.ndarray:
    """2×2 average pooling over the last two axes: (..., H, W) → (..., H/2, W/2); H, W even."""
    *lead, H, W = x.shape
    return x.reshape(*lead, H // 2, 2, W // 2, 2).mean(axis=(-3, -1))
