"""E_t(φ, k) and λ_i^t for every k a run measured, each with its bracket, whichever route measured them.

Two routes store the curves (``spectrum.energy``; the run attribute ``energy_route`` says which):

* **exact** — the whole G_t on one process, ``spectrum.k: all``: ``energy_<φ>`` (S, N) and
  ``eigenvalues`` (S, N) hold every k; lower = upper = value, except inside a cluster of
  eigenvalues within the eigensolver's rounding (a rank-deficient G's null space), where E is
  bracketed by the cluster's ends (:func:`_exact_clusters`), and — under float32 — λ_k ± the
  rounding δ = 4·eps₃₂·‖G‖_F of the reduction (:func:`_rounding`).  A run that kept only the
  top K eigenpairs has its curve at k = 1..K.
* **quadrature** — products with G_t only (gang layouts, or asked for): the top part
  (k ≤ ``spectrum.quadrature.top``) exact in ``energy_<φ>`` / ``eigenvalues``, beyond it
  ``curve_energy_<φ>`` / ``curve_eigenvalue`` with ``…_lower`` / ``…_upper`` at the k of
  ``curve_k`` (a log grid to N; E_t(f_test, k) at ``curve_k_test``, the test Gram's grid to M).
  The run attribute ``curve_bracket`` says how the brackets are guaranteed (provable quadrature
  bounds, or statistical at ``curve_confidence``).

:class:`BracketedCurve` joins the two parts: the exact top k = 1..K, then the grid beyond it.
Between two grid points k_a < k < k_b the bracket follows from monotonicity alone — E_t(φ, ·)
is non-decreasing and λ_· non-increasing in k — so ``E(k) ∈ [lower(k_a), upper(k_b)]`` and
``λ_k ∈ [lower(k_b), upper(k_a)]``; the value there is interpolated in log k, inside that bracket.
A curve is therefore never reported sharper than what was measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import xarray

    from nsa_dist.client._arrays import RunArrays

__all__ = ["BracketedCurve", "read_curve", "energy_route", "EXACT_BRACKET"]

EXACT_BRACKET = (
    "exact: from the eigendecomposition of G_t (lower = upper = value but where rounding leaves a value "
    "unresolved: E in a cluster of eigenvalues within 2δ; in float32 λ_k ± δ and the projections' rounding)"
)
TOP_RESOLUTION = 1e-8  # a top-part bracket narrower than this (relative for λ_k, absolute for E) reads as exact


def energy_route(run: RunArrays) -> str:
    """ "exact" or "quadrature": the route that measured the run's curves (the ``energy_route``
    attribute; runs written before it existed are exact)."""
    route = run.attrs.get("energy_route")
    if route is None:
        return "quadrature" if run.has("curve_k") else "exact"
    return str(route)


@dataclass(frozen=True)
class BracketedCurve:
    """One curve along the finished steps: ``value`` with ``lower ≤ value ≤ upper`` at each k.

    Attributes:
        name: "eigenvalue" (λ_k, non-increasing in k) or "energy_<φ>" (E_t(φ, k), non-decreasing).
        steps: (S,) the finished recorded steps t.
        k: (n,) the k (or i) measured, ascending, 1-based.
        value, lower, upper: (S, n) float64.
        exact: (n,) True where the value is exact (the top part; every k on the exact route but
            inside an eigenvalue cluster).
        n_points: N, the largest k there is.
        route: "exact" or "quadrature".
        bracket: how the brackets are guaranteed (the run's ``curve_bracket``, or exact).
        confidence: the confidence of a statistical bracket, else None.
    """

    name: str
    steps: np.ndarray
    k: np.ndarray
    value: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    exact: np.ndarray
    n_points: int
    route: str
    bracket: str
    confidence: float | None = None

    @property
    def increasing(self) -> bool:
        """True for an energy (non-decreasing in k), False for the eigenvalues."""
        return self.name != "eigenvalue"

    @property
    def degenerate(self) -> bool:
        """True when every bracket is a point (lower = upper = value wherever finite)."""
        ok = np.isfinite(self.value)
        return bool(np.all(self.lower[ok] == self.value[ok]) and np.all(self.upper[ok] == self.value[ok]))

    @property
    def width(self) -> np.ndarray:
        """(S, n) upper − lower."""
        return self.upper - self.lower

    def inexact_ranges(self) -> str:
        """The k where the value is bracketed rather than exact, as ranges ("41..63, 70"); "" when
        every k is exact."""
        ks = self.k[~np.asarray(self.exact, bool)].tolist()
        parts: list[list[int]] = []
        for k in ks:
            if parts and parts[-1][1] == k - 1:
                parts[-1][1] = k
            else:
                parts.append([k, k])
        return ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in parts)

    def widest(self) -> tuple[np.ndarray, np.ndarray]:
        """Per finished step, the largest bracket width and the (first) k where it is: (S,) float64
        and (S,) int64; NaN and 0 at a step with no finite bracket."""
        w = np.where(np.isfinite(self.width), self.width, -np.inf)
        j = np.argmax(w, axis=1) if w.size else np.zeros(w.shape[0], np.int64)
        best = w[np.arange(w.shape[0]), j] if w.size else np.full(w.shape[0], -np.inf)
        ok = np.isfinite(best)
        return np.where(ok, best, np.nan), np.where(ok, self.k[j] if self.k.size else 0, 0).astype(np.int64)

    def check_k(self, k: int) -> int:
        """``k`` as an int in 1..N that the curve covers, or a ValueError naming the range and why."""
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
            raise ValueError(f"k={k!r} is not an integer index 1..{self.n_points}")
        k = int(k)
        if not 1 <= k <= self.n_points:
            what = (
                "M, the number of test points" if self.name == "energy_f_test" else "N, the number of training points"
            )
            raise ValueError(f"k={k} outside 1..{self.n_points} ({what})")
        top = int(self.k[-1]) if len(self.k) else 0
        if k > top and self.route == "quadrature":
            raise ValueError(
                f"k={k}: this run measured {self.name} only for k ≤ {top}, its exact top part (a run "
                f"written before the quadrature route measured {self.name} beyond it)"
            )
        if k > top:
            raise ValueError(
                f"k={k}: this run measured {self.name} only for k ≤ {top} (the eigenpairs it kept, "
                f"spectrum.k); spectrum.k: all (layout local) or spectrum.energy: quadrature "
                f"measures every k up to N = {self.n_points}"
            )
        return k

    def at(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(value, lower, upper), each (S,), at ``k``: the stored column when k was measured, else
        the monotone bracket of its neighbours with the value interpolated in log k inside it.

        Raises:
            ValueError: k is not in 1..N, or beyond what the run measured (both named).
        """
        k = self.check_k(k)
        j = int(np.searchsorted(self.k, k))
        if self.k[j] == k:
            return self.value[:, j], self.lower[:, j], self.upper[:, j]
        a, b = j - 1, j  # k[a] < k < k[b]
        ka, kb = float(self.k[a]), float(self.k[b])
        w = (np.log(k) - np.log(ka)) / (np.log(kb) - np.log(ka))
        value = (1 - w) * self.value[:, a] + w * self.value[:, b]
        if self.increasing:
            lower, upper = self.lower[:, a], self.upper[:, b]
        else:
            lower, upper = self.lower[:, b], self.upper[:, a]
        with np.errstate(invalid="ignore"):
            value = np.minimum(np.maximum(value, lower), upper)
        return value, lower.copy(), upper.copy()

    def to_xarray(self, phi: str | None = None) -> xarray.Dataset:
        """``value``, ``lower``, ``upper`` with dims (step, k), coordinates step, k and ``exact`` (k);
        attributes: route, bracket, confidence (statistical brackets), N, phi (energies)."""
        import xarray as xr

        attrs: dict[str, Any] = {
            "route": self.route,
            "bracket": self.bracket,
            "N": self.n_points,
            "quantity": self.name,
        }
        if self.confidence is not None:
            attrs["confidence"] = self.confidence
        if phi is not None:
            attrs["phi"] = phi
        dims = ("step", "k")
        return xr.Dataset(
            {"value": (dims, self.value), "lower": (dims, self.lower), "upper": (dims, self.upper)},
            coords={"step": ("step", self.steps), "k": ("k", self.k), "exact": ("k", self.exact)},
            attrs=attrs,
        )


def _widen_top(
    run: RunArrays,
    curve_name: str,
    grid: np.ndarray,
    K: int,
    lower: np.ndarray,
    upper: np.ndarray,
    exact: np.ndarray,
    increasing: bool,
    grid_name: str = "curve_k",
) -> None:
    """The top part's brackets where the quadrature route widened them, in place: top eigenpairs
    within the rounding of a neighbour (a rank-deficient G's null space reaching into the top K)
    have eigenvectors an eigensolver orders and rotates arbitrarily, so ``energy_<φ>`` there is one
    basis's value, not *the* value; the route stores the cluster's bracket at the grid's k ≤ K.
    A top k between two grid points takes the monotone bracket of its neighbours when either of
    them is widened.  Each step is widened by its own clusters only (the rank of G_t changes along
    training); a k widened at any step is not ``exact`` (a flag per k: exact at every step).  A
    top-k solve's own brackets (λ_k ± its residual bound, E ± residual / gap) narrower than
    :data:`TOP_RESOLUTION` are read as the exact values they are to that resolution."""
    if grid.size == 0 or lower.shape[0] == 0:
        return
    where = np.isin(np.asarray(run.array(grid_name), np.int64), grid)
    lo = np.asarray(run.per_step(f"{curve_name}_lower"), np.float64)[:, where]
    hi = np.asarray(run.per_step(f"{curve_name}_upper"), np.float64)[:, where]
    # a point bracket (to the two routes' rounding) is no cluster, nor one narrower than TOP_RESOLUTION (of
    # λ_k, or of E's scale 1): a top-k solve's own bracket, its value ± the residual bound (λ) or the residual
    # over the eigengap (E), stays "exact" to that resolution; a cluster's bracket is far wider
    scale = np.fmax(np.abs(hi), 1.0) if increasing else np.abs(hi)  # E's scale is 1; λ_k's its own size
    with np.errstate(invalid="ignore"):
        wide = hi - lo > max(64 * np.finfo(np.float64).eps, TOP_RESOLUTION) * scale
    if not wide.any():
        return
    cols = grid - 1
    for g in np.nonzero(wide.any(axis=0))[0]:
        rows = wide[:, g]  # only the steps whose cluster reaches this k: the rank changes along training
        lower[rows, cols[g]] = np.fmin(lower[rows, cols[g]], lo[rows, g])
        upper[rows, cols[g]] = np.fmax(upper[rows, cols[g]], hi[rows, g])
        exact[cols[g]] = False  # ``exact`` is per k: exact at every step
    # neighbours along the merged axis: the grid's top columns, then the tail's (a cluster at the
    # top's end is bounded by the first tail column)
    at = np.concatenate([cols, np.arange(K, lower.shape[1])])
    flag = np.concatenate([wide, np.zeros((wide.shape[0], lower.shape[1] - K), bool)], axis=1)
    for a in range(len(at) - 1):
        rows = flag[:, a] | flag[:, a + 1]
        inner = np.arange(at[a] + 1, min(at[a + 1], K))
        if inner.size == 0 or not rows.any():
            continue
        first, last = (at[a], at[a + 1]) if increasing else (at[a + 1], at[a])
        block = np.ix_(rows, inner)
        lower[block] = np.fmin(lower[block], lower[rows, first][:, None])
        upper[block] = np.fmax(upper[block], upper[rows, last][:, None])
        exact[inner] = False


def read_curve(run: RunArrays, name: str, n_points: int) -> BracketedCurve:
    """The curve ``name`` ("eigenvalue" or "energy_<φ>") of ``run`` along its finished steps.

    Raises:
        StoreError: a damaged chunk (named).  KeyError: the run stores no ``name``.
    """
    top_name = "eigenvalues" if name == "eigenvalue" else name
    if not run.has(top_name):
        raise KeyError(f"run {run.id!r} stores no {top_name!r}")
    top = np.asarray(run.per_step(top_name), np.float64)
    if top.ndim == 1:
        top = top[:, None]
    S, K = top.shape
    route = energy_route(run)
    conf = run.attrs.get("curve_confidence")
    curve_name = f"curve_{name}"
    grid_name = "curve_k_test" if name == "energy_f_test" else "curve_k"  # the test Gram's own grid, to M
    if route == "quadrature" and run.has(curve_name) and run.has(grid_name):
        ck = np.asarray(run.array(grid_name), np.int64)
        beyond = ck > K
        kk = np.concatenate([np.arange(1, K + 1, dtype=np.int64), ck[beyond]])
        parts = [np.asarray(run.per_step(f"{curve_name}{s}"), np.float64)[:, beyond] for s in ("", "_lower", "_upper")]
        value = np.concatenate([top, parts[0]], axis=1)
        lower = np.concatenate([top, parts[1]], axis=1)
        upper = np.concatenate([top, parts[2]], axis=1)
        exact = np.concatenate(
            [np.ones(K, bool), np.all(parts[1] == parts[2], axis=0) if S else np.zeros(int(beyond.sum()), bool)]
        )
        _widen_top(run, curve_name, ck[~beyond], K, lower, upper, exact, name != "eigenvalue", grid_name)
        at_n = (lower[:, -1].copy(), upper[:, -1].copy(), exact[-1]) if kk.size and kk[-1] == n_points else None
        _rounding(run, name, value, lower, upper, exact, n_points, quadrature=True)
        if at_n is not None and name != "eigenvalue":  # E(φ, N) = 1 whatever the rounding, as on the exact route
            lower[:, -1], upper[:, -1], exact[-1] = at_n
        bracket = str(run.attrs.get("curve_bracket", "quadrature bounds (the run names no bracket kind)"))
        return BracketedCurve(
            name,
            np.asarray(run.steps),
            kk,
            value,
            lower,
            upper,
            exact,
            n_points,
            "quadrature",
            bracket,
            None if conf is None else float(conf),
        )
    lower, upper, exact = _exact_clusters(run, name, top, n_points)
    if name == "eigenvalue":
        lower, upper = top.copy(), top.copy()
        _rounding(run, name, top, lower, upper, exact, n_points, quadrature=False)
    for a in (top, lower, upper):
        a.flags.writeable = False
    return BracketedCurve(
        name,
        np.asarray(run.steps),
        np.arange(1, K + 1, dtype=np.int64),
        top,
        lower,
        upper,
        exact,
        n_points,
        "exact",
        EXACT_BRACKET,
        None,
    )


def rounding_delta(run: RunArrays, lam: np.ndarray, n_points: int) -> np.ndarray:
    """(S,) the rounding δ of each step's reduction of G_t from its stored eigenvalues ``lam`` (S, K):
    max(N·eps₆₄·|λ_1|, and under ``spectrum.dtype: float32`` 4·eps₃₂·‖G_t‖_F), ‖G_t‖_F the stored
    ``gram_sq_frobenius`` (else the stored eigenvalues')."""
    eps32 = float(np.finfo(np.float32).eps) if run.spec.spectrum.dtype == "float32" else 0.0
    with np.errstate(invalid="ignore"):
        top = np.nanmax(np.abs(lam), axis=1) if lam.shape[1] else np.zeros(len(lam))
        fro = np.sqrt(np.nansum(lam**2, axis=1))
        if run.has("gram_sq_frobenius"):
            stored = np.asarray(run.per_step("gram_sq_frobenius"), np.float64).reshape(len(lam), -1)[:, 0]
            fro = np.where(np.isfinite(stored) & (stored > 0), np.sqrt(np.abs(stored)), fro)
        return np.maximum(n_points * float(np.finfo(np.float64).eps) * top, 4.0 * eps32 * fro)


def _rounding(
    run: RunArrays,
    name: str,
    value: np.ndarray,
    lower: np.ndarray,
    upper: np.ndarray,
    exact: np.ndarray,
    n_points: int,
    *,
    quadrature: bool,
) -> None:
    """Widen the brackets, in place, by what the reduction's rounding leaves unresolved (an audit ran
    one spec in float32 and float64: the float32 brackets were points the float64 values lay outside).

    Under ``spectrum.dtype: float32`` only (a float64 run's λ and E stay points outside clusters):

    * λ_k (both routes): ± δ, δ = max(n·eps₆₄·|λ_1|, 4·eps₃₂·‖G‖_F) — Weyl's bound for a perturbation
      of G of that size, the δ of :func:`_exact_clusters`; float32's tail was stored to 2.6 % (λ₂₇₄)
      and with the wrong sign (λ₄₀₀ −4.1e-6 for −3e-14) at N = 400, where δ = 6e-4.  ‖G‖_F is the
      stored ``gram_sq_frobenius`` (else the stored eigenvalues').
    * E(φ, k) on the quadrature route: ± n·eps₃₂, the projections' rounding the exact route's
      brackets already carry (quadrature's missed the float64 values by up to 1.2e-6 at N = 400).

    A k whose bracket is wider than :data:`TOP_RESOLUTION` (relative for λ_k, absolute for E) at any
    step is not ``exact``."""
    S = value.shape[0]
    eps32 = float(np.finfo(np.float32).eps) if run.spec.spectrum.dtype == "float32" else 0.0
    if S == 0 or not eps32:  # float64: λ and E stay points but in clusters (docs/curves.md: below n·eps₆₄·λ_1)
        return
    if name != "eigenvalue":
        if quadrature:
            r = n_points * eps32
            keep = np.isfinite(value)
            lower[keep] = np.clip(lower[keep] - r, 0.0, 1.0)
            upper[keep] = np.clip(upper[keep] + r, 0.0, 1.0)
            exact &= ~np.any(upper - lower > TOP_RESOLUTION, axis=0)
        return
    delta = rounding_delta(run, np.asarray(run.per_step("eigenvalues"), np.float64).reshape(S, -1), n_points)[:, None]
    with np.errstate(invalid="ignore"):
        keep = np.isfinite(value) & np.isfinite(delta)
        lower[keep] = np.fmin(lower, value - delta)[keep]
        upper[keep] = np.fmax(upper, value + delta)[keep]
        exact &= ~np.any(upper - lower > TOP_RESOLUTION * np.abs(value), axis=0)


def _exact_clusters(
    run: RunArrays, name: str, top: np.ndarray, n_points: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The exact route's brackets of E_t(φ, k): a point (lower = upper = value) except where other
    eigenvalues lie within 2δ of λ_k, δ = n·eps₆₄·|λ_1| a float64 eigensolver's rounding — above all the
    null space of a rank-deficient G (fewer parameters than points).  There the dense eigh's
    eigenvectors are an arbitrary basis of that eigenspace in an arbitrary order, so E(φ, k) is one
    basis's value, not *the* value (docs/curves.md: "anything from E(φ, r) to 1" beyond the rank
    r).  The window is the quadrature route's for its top part (``linalg.quadrature``: thresholds
    λ_k ± 2δ, no chaining along a bulk whose spacing is below δ): with a = #{λ_i > λ_k + 2δ} and
    b = #{λ_i ≥ λ_k − 2δ}, the eigenvectors of 1..k mix with others only when b > k (an eigenvalue
    within 2δ below λ_k: those above λ_k + 2δ cannot reach past k), and then k gets
    ``[E(a), E(b)]`` (E(0) = 0; 1 when the window reaches the K < n eigenpairs a run kept) and is not
    ``exact`` — E(N) = 1 and the end of a cluster stay exact.  λ itself is left as it is (it is
    basis-independent, within δ)."""
    S, K = top.shape
    lower, upper, exact = top, top, np.ones(K, bool)
    if name == "eigenvalue" or S == 0 or K < 2:
        return lower, upper, exact
    lam_name = "eigenvalues_test" if name == "energy_f_test" else "eigenvalues"
    if not run.has(lam_name):
        return lower, upper, exact
    lam = np.asarray(run.per_step(lam_name), np.float64)
    if lam.ndim != 2 or lam.shape[1] != K:
        return lower, upper, exact
    # δ of a float64 reduction, and under spectrum.dtype: float32 the quadrature route's model of a
    # float32 reduction too, δ ≥ 4·eps₃₂·‖G‖_F (‖G‖_F from the stored eigenvalues): below it a
    # float32 eigh's eigenvectors are one basis of a null space as much as a float64 one's are
    # below n·eps₆₄·λ_1 — E off by up to 0.10 from a float64 eigh's at N = 64, rank 40
    # (tests/test_readers_trial.py) — though on a full-rank G it lies far closer (0.0033 at
    # N = 10⁴, benchmarks/kall_width.py floor): the stored G does not say which case it is
    eps = float(np.finfo(np.float64).eps)
    eps_g = float(np.finfo(np.float32).eps) if run.spec.spectrum.dtype == "float32" else 0.0
    lower, upper = top.copy(), top.copy()
    e_at = lambda s, n: np.where(n > 0, top[s, np.maximum(n, 1) - 1], 0.0)  # noqa: E731  E(φ, n), E(0) = 0
    for s in range(S):
        row = lam[s]
        if not np.isfinite(row).all():
            continue
        tie = 2.0 * max(n_points * eps * float(np.max(np.abs(row))), 4.0 * eps_g * float(np.sqrt(np.sum(row**2))))
        if eps_g:
            # a float32 reduction's eigenvectors turn between eigenvalues more than 2δ apart too, and its
            # projections round by ~n·eps₃₂: its E was reported exact where it lay 2.65·10⁻⁵ off a float64
            # eigh's at N = 64 (an audit).  Two bounds on the true E(k), both under ‖Δ‖ ≤ δ, intersected:
            # Davis–Kahan, |E − Ẽ| ≤ δ / (gap − δ) (tight where λ_k is isolated), and the ramps of
            # linalg.quadrature._ramps over windows w, E ∈ [Ẽ(#{λ̃ > λ̃_k + w + δ}) − δ/w,
            # Ẽ(#{λ̃ ≥ λ̃_k − w − δ}) + δ/w] (which hold where a gap near 2δ made the first one 44, a
            # review).  A float64 reduction's turn under its δ = n·eps₆₄·λ_1 stays unbracketed (docs/curves.md)
            delta = 0.5 * tie
            gap = np.full(K, np.inf)
            gap[:-1] = row[:-1] - row[1:]
            turn = np.where(gap > delta, delta / np.maximum(gap - delta, np.finfo(np.float64).tiny), np.inf)
            lo, hi = top[s] - turn, top[s] + turn
            desc = -row
            for f in 2.0 ** np.arange(1, 48):
                w = f * delta
                a = np.searchsorted(desc, -(row + w + delta), side="left")
                b = np.searchsorted(desc, -(row - w - delta), side="right")
                lo = np.maximum(lo, e_at(s, a) - 1.0 / f)
                hi = np.minimum(hi, np.where((b == K) & (K < n_points), 1.0, e_at(s, b)) + 1.0 / f)
            rounding = n_points * eps_g
            lo, hi = np.clip(lo - rounding, 0.0, 1.0), np.clip(hi + rounding, 0.0, 1.0)
            if K == n_points:
                lo[-1] = hi[-1] = top[s, -1]  # E(φ, N) = 1 whatever the basis
            lower[s], upper[s] = np.fmin(lower[s], lo), np.fmax(upper[s], hi)
            exact &= ~(hi - lo > TOP_RESOLUTION)
        desc = -row  # ascending (the stored eigenvalues descend)
        a = np.searchsorted(desc, -(row + tie), side="left")  # #{λ_i > λ_k + 2δ}
        b = np.searchsorted(desc, -(row - tie), side="right")  # #{λ_i ≥ λ_k − 2δ}
        k = np.arange(1, K + 1)
        # eigenvectors mix across k only with an eigenvalue within 2δ below λ_k (b > k); at the last
        # of K < n kept eigenpairs a window holding others may go on past it
        wide = (b > k) | ((b == K) & (K < n_points) & (a + 1 < k))
        if not wide.any():
            continue
        hi = np.where((b == K) & (K < n_points), 1.0, e_at(s, b))  # it may reach past the K kept
        lower[s, wide] = np.fmin(lower[s, wide], e_at(s, a)[wide])
        upper[s, wide] = np.fmax(upper[s, wide], hi[wide])
        exact[wide] = False
    return lower, upper, exact
