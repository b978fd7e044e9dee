"""Spectrum preservation: energy of later eigenvectors in an earlier spectrum (NSA Fig. 7d)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from nsa_dist.errors import NonFiniteError, ShapeError
from nsa_dist.metrics._validate import as_real, check_rows, count
from nsa_dist.metrics.energy import relative_energy

__all__ = ["spectrum_preservation", "preservation_pair"]

T = TypeVar("T")


def spectrum_preservation(evecs_t1: Any, evecs_t2: Any, i: int | Sequence[int] | None = None) -> np.ndarray:
    """E_{t1}(v_i^{t2}, k) for every k: how much of each t2-eigenvector lies in t1's top-k (Fig. 7d).

    Row r, column k-1 holds E_{t1}(v_{i_r}^{t2}, k) = Σ_{j≤k} ⟨v_j^{t1}, v_{i_r}^{t2}⟩²
    (‖v_i^{t2}‖ = 1).  A basis against itself gives 1 for k >= i and 0 for k < i.

    Args:
        evecs_t1: (N, K1) orthonormal eigenvectors of G_{t1}, columns by descending eigenvalue.
        evecs_t2: (N, K2) orthonormal eigenvectors of G_{t2}, columns by descending eigenvalue.
        i: eigenvector number(s) of t2, 1-BASED as in the paper (1 = top), each in [1, K2];
            ``None`` means all of 1..K2.

    Returns:
        float64 array (len(i), K1); (K2, K1) when ``i`` is None; (K1,) for a single int ``i``.

    Raises:
        ShapeError: inputs not 2-D, different N, K1 > N, or an ``i`` outside [1, K2].
        NonFiniteError: NaN/inf input, or a zero column selected from ``evecs_t2``.
        TypeError: a non-integer ``i``.
    """
    V1 = as_real("evecs_t1", evecs_t1, (2,))  # (N, K1)
    V2 = as_real("evecs_t2", evecs_t2, (2,))  # (N, K2)
    check_rows("evecs_t2", V2, "evecs_t1", V1)
    K2 = V2.shape[1]
    if i is None:
        rows = np.arange(K2)
    elif np.ndim(i) == 0:
        rows = np.array([count("i", i, 1, K2) - 1], dtype=np.intp)
    else:
        rows = np.array([count("i", j, 1, K2) - 1 for j in i], dtype=np.intp)
        if rows.size == 0:
            raise ShapeError(f"i must name at least one eigenvector number in [1, {K2}], got {i!r}")
    norm2 = np.sum(np.square(V2[:, rows].astype(np.float64)), axis=0)  # (len(rows),)
    if np.any(norm2 == 0):
        zero = (rows[norm2 == 0] + 1)[:10].tolist()
        raise NonFiniteError(
            f"evecs_t2 has zero columns (eigenvector numbers {zero}, 1-based): their energy "
            "Σ⟨v_j,v_i⟩²/‖v_i‖² is 0/0; pass computed eigenvectors only"
        )
    out = relative_energy(V1, V2[:, rows])  # (len(rows), K1)
    return out[0] if np.ndim(i) == 0 and i is not None else out


def preservation_pair(eigenvector_steps: Sequence[T], *, listed: bool) -> tuple[T, T] | None:
    """The steps (t1, t2) that spectrum preservation compares by default (Fig. 7d: an early step
    against the last one), picked from a run's steps that hold eigenvectors.

    t2 is the last of them.  t1 is the first when the steps were listed by hand (``listed``:
    ``spectrum.store_eigenvectors`` is a list, so every one was asked for), else the second when
    there are more than two (the paper compares an early step after the start with the final one),
    else the first.  The rule only picks positions, so the items may equally be the steps'
    storage indices; the writer of the stored ``preservation`` array and ``Run.spectrum_preservation``
    both use it.

    Args:
        eigenvector_steps: the recorded steps (or their storage indices) holding eigenvectors, ascending.
        listed: whether the run's ``spectrum.store_eigenvectors`` is a list of steps.

    Returns:
        (t1, t2), two items of ``eigenvector_steps``; None when it has fewer than two.

    >>> preservation_pair([0, 10, 20, 30], listed=False), preservation_pair([0, 10, 20, 30], listed=True)
    ((10, 30), (0, 30))
    >>> preservation_pair([0, 30], listed=False), preservation_pair([30], listed=False)
    ((0, 30), None)
    """
    n = len(eigenvector_steps)
    if n < 2:
        return None
    return eigenvector_steps[1 if n > 2 and not listed else 0], eigenvector_steps[-1]
