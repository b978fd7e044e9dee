"""E(φ, k) = Σ_{i≤k} ⟨v_i, φ⟩² / ‖φ‖² and λ_k for every k from products with G only, with brackets.

The top K eigenpairs (λ_i, v_i) of G are known exactly (a top-k solve).  Beyond them:

* **Each φ's tail measure.**  With ``P = I − UUᵀ`` (U the top K eigenvectors) and the deflated
  operator ``A = P G P``, the spectral measure of ``φ' = Pφ`` is ``μ_φ = Σ_{i>K} ⟨v_i, φ⟩² δ_{λ_i}``,
  so ``E(φ, k) = (‖Uᵀφ‖² + Σ_{K<i≤k} ⟨v_i, φ⟩²) / ‖φ‖²`` and for λ_k the k-th eigenvalue

      μ_φ((λ_k, ∞)) ≤ Σ_{K<i≤k} ⟨v_i, φ⟩² ≤ μ_φ([λ_k, ∞)).

  m block-Lanczos steps of A from a block holding every φ' (and the probes below) give, per
  column, a discrete measure ν with the same moments 0 … 2m − 1 as μ
  (:func:`~nsa_dist.linalg.lanczos.block_gauss_quadrature`'s rule).  The m-point Gauss rule of
  those moments (nodes x_1 < … < x_m, weights w_j; the Stieltjes procedure on ν) bounds every
  measure with these moments, μ among them, by the Chebyshev–Markov–Stieltjes inequalities

      Σ_{x_i < x_j} w_i ≤ μ((−∞, x_j)),      μ((−∞, x_j]) ≤ Σ_{x_i ≤ x_j} w_i,

  hence at any t: ``μ([t, ∞)) ≤ Σ_{i ≥ j} w_i`` (x_j the largest node < t) and
  ``μ((t, ∞)) ≥ Σ_{i > j'} w_i`` (x_{j'} the smallest node ≥ t).  These are proofs (in exact
  arithmetic, for the operator the products apply).

* **G's counting function** ``n(t) = #{i : λ_i ≥ t}`` = #{i ≤ K : λ_i ≥ t} + Tr 1[A ≥ t] on
  range(P).  For Rademacher probes z, ``z' = Pz`` has ``E[μ_{z'}([t, ∞))] = #{i > K : λ_i ≥ t}``
  (t > 0); each probe's measure is bracketed as above and the mean over p probes gets a
  statistical margin ``q·√(2 n_tail / p)`` (q the normal quantile of the confidence; 2·n_tail
  bounds the variance of ``zᵀMz`` for a Rademacher z and M the rank-n_tail spectral
  projector).  The bracket of λ_k inverts it: ``λ_k ≥ sup{t : n_lower(t) ≥ k}`` and
  ``λ_k ≤ inf{t : n_upper(t) < k}``, and λ_k ≥ the (k − K)-th Ritz value of A on the block
  Krylov space (Cauchy interlacing, a proof for exact top eigenvectors; less ‖R‖₂ of the given
  ones, R = GU − UΛ', which moves A's eigenvalues off G's tail by at most that), λ_k ≤ λ_K + ‖R‖₂.
  The top λ_k themselves are the solver's Ritz values θ_k: G̃ = G − RUᵀ − URᵀ has them as
  eigenvalues and lies within ‖R‖₂ of G, so their bracket is θ_k ± ‖R‖₂ (Weyl), not a point.

* **G's scale.**  Everything runs on G / 2^e with λ_1 / 2^e ∈ [½, 1) (exact), λ_k's bracket and the
  density scaled back: the Lanczos recurrences and ‖G‖_F square G's entries.

* The value reported inside each bracket is the block rule's own estimate (the same
  inversion and tail sums with ν, which resolves the spectrum with b·m nodes), clipped into
  the bracket; the SLQ density of G comes from the same probes.

So the energy bracket is provable given λ_k's bracket, which is statistical at the stated
(pointwise) confidence beyond the top K.

* **Rounding, and a rank-deficient G.**  The brackets are for every value the exact route (a dense
  float64 eigh of the stored G) can return, not only for G's exact spectrum.  That route's
  eigenvalues are G's within its backward error ``δ = max(N·eps₆₄, 8·eps_products)·λ_1`` — or
  ``4·eps_G·‖G‖_F`` when larger: a float32 G's exact route reduces it in float32 — and
  among eigenvalues within ~δ of each other its eigenvectors are an arbitrary basis in an arbitrary
  order — above all in the null space of a G of rank r < N (fewer parameters than points, repeated
  inputs, dead units), whose eigenvalues are rounding of either sign.  There E(φ, k), r < k < N,
  can be anything from E(φ, r) to 1.  So λ_k's bracket is widened by δ on each side, its lower end
  where the counting function says nothing is ``bottom`` (the smallest Ritz value, ≤ 0, less
  ``4·eps_G·‖G‖_F`` for the storage rounding, less δ; below G's smallest eigenvalue under that
  rounding model, not a proof), E's thresholds are moved out by δ (so the whole null cluster
  counts on the upper side: upper = 1), the top part enters each threshold only with the
  eigenvalues above / at it, and top eigenpairs within 2δ of a neighbour (the top K reaching into
  the null space when K > r) get the bracket of their cluster instead of the solver's value — as do
  top eigenpairs within 4·‖R‖₂ of a neighbour (R the given eigenvectors' residual, ``leak``: a
  solver's eigenvectors rotate between such eigenvalues), and λ_K when the deflated operator's
  largest Ritz value comes within that of it (λ_{K+1} ≈ λ_K, a cluster straddling K: E(φ, K) may
  take any part of v_{K+1}'s energy).
  Eigenvalues a few δ apart are not a cluster, yet the exact route's eigenvectors rotate between them
  by ~δ/gap: beyond the top, E's bracket takes the tightest of ramp bounds (threshold moved by w,
  ± δ₆₄/w, :func:`_ramps`) and Davis–Kahan's sin Θ bounds over the same windows, which hold under
  a float64 reduction's backward error δ₆₄ — under a float32 G's, δ₃₂ = 4·eps₃₂·‖G‖_F (with δ₆₄
  there a float32 run's E lay 1.15·10⁻⁵ above its bracket, Audit Q3).  Not covered: such a rotation
  inside the top part (k ≤ K, E off by ≤ 1.1·10⁻⁵ on eigenvalue pairs 2.5–1000·δ apart against
  40-digit eigenvectors).  The solver's own rotation there is covered: its eigenvectors' residual ‖R‖ bounds
  it (Davis–Kahan, :func:`_energy_curve`; it put E 1.5·10⁻⁶ off on eigenvalues 500·‖R‖ apart), and
  its eigenvalues are G's to ‖R‖₂ (λ_k's top bracket).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nsa_dist.errors import NonFiniteError
from nsa_dist.linalg._backend import ArrayOps, Backend, TorchOps
from nsa_dist.linalg._inputs import _contiguous, _non_finite, as_symmetric_map, upcast_product
from nsa_dist.linalg.lanczos import _qr_r, _ritz, _State

log = logging.getLogger(__name__)

__all__ = [
    "CurveBracket",
    "SpectralCurves",
    "curve_ks",
    "spectral_curves",
    "quadrature_basis_bytes",
    "BRACKET_SENTENCE",
    "atoms_density",
    "describe_width",
]

BRACKET_SENTENCE = (
    "λ_k for k ≤ top is the top solve's, its bracket that value ± the solve's residual bound, and E(φ, k) "
    "for k ≤ top is exact (bracketed by the residual over the eigengap, Davis–Kahan, where that passes 10⁻⁸); "
    "beyond, λ_k's bracket is statistical "
    "(stochastic Lanczos quadrature of G's counting function, Rademacher probes, normal "
    "approximation with the variance bound 2·n(t), pointwise confidence {c:g}) tightened by "
    "Cauchy interlacing of Ritz values (provable, less the top eigenvectors' residual), and E(φ, k)'s "
    "bracket is provable "
    "(Chebyshev–Markov–Stieltjes bounds of φ's spectral measure) given λ_k's bracket; both widened by "
    "the exact route's rounding δ = max(N·eps₆₄·λ_1, 4·eps_G·‖G‖_F) (eps_G: the stored G's precision, "
    "in which the exact route reduces it), and where eigenvalues lie within it of each other (a "
    "rank-deficient G's null space, in the top part too) the bracket spans every value an eigensolver's "
    "choice of basis gives (E up to 1 beyond the rank); beyond the top, E's bracket also holds the "
    "rotation of eigenvectors among near-equal eigenvalues under the exact route's backward error "
    "δ₆₄ = N·eps₆₄·λ_1, or a float32 G's δ (ramp bounds ± δ/w over windows w)"
)

_RADAU_POINTS = 400  # breakpoints of the counting function where the probes' Gauss–Radau bounds are taken
_BASIS_BYTES = (
    1 << 30
)  # default cap of the Lanczos bases and products held at once (two (N, b·m) float64 blocks a group)


def curve_ks(N: int, points: int) -> np.ndarray:
    """The reported k: ``points`` log-spaced values from 1 to N rounded to distinct integers (1 and N included)."""
    if N < 1 or points < 2:
        raise ValueError(f"curve_ks needs N >= 1 and points >= 2, got N={N}, points={points}")
    k = np.unique(np.round(np.logspace(0.0, math.log10(N), points)).astype(np.int64))
    return np.unique(np.concatenate([[1], k, [N]])).astype(np.int64)


def quadrature_basis_bytes(
    N: int,
    lanczos_steps: int,
    block_size: int = 12,
    cap: float = _BASIS_BYTES,
    phi_steps: int | None = None,
    phi_columns: int = 5,
    probes: int = 24,
) -> float:
    """Bytes of the Lanczos bases the route holds at once (V and G·V, float64): the column groups that
    run side by side (one wave, :func:`_wave`) of the probes (with φ's columns where they share the
    probes' steps), or with ``phi_steps`` the larger of that and the φ columns' own wave (run after)."""
    m = max(2, min(int(lanczos_steps), N))
    per_col = 16.0 * N * m
    shared = int(probes) + (0 if phi_steps is not None else int(phi_columns))
    out = per_col * _held(max(1, shared), block_size, per_col, cap)
    if phi_steps is not None:
        per_phi = 16.0 * N * _phi_steps(phi_steps, m, block_size, phi_columns, N)
        out = max(out, per_phi * _held(max(1, int(phi_columns)), block_size, per_phi, cap))
    return out


def _wave(block_size: int, per_col: float, cap: float) -> tuple[int, int]:
    """``(columns per group, groups side by side)``: start columns run in groups of ``block_size``
    (fewer where one group's basis would pass ``cap``), and as many groups side by side as keep
    their bases under ``cap`` together (at least one).  A wave's groups share each pass over G,
    which a product pays once however many columns it has (an (N, 29) block cost 1.08× an
    (N, 14) one with a float32 G upcast in slabs at N = 10⁴)."""
    fit = int(cap // per_col)
    group = max(1, min(int(block_size), fit))
    return group, max(1, fit // group)


def _held(n_cols: int, block_size: int, per_col: float, cap: float) -> int:
    """Start columns whose bases are held at once (one wave) out of ``n_cols``."""
    group, side = _wave(block_size, per_col, cap)
    return min(n_cols, group * side)


@dataclass(frozen=True)
class CurveBracket:
    """A curve at the reported k: value, lower ≤ value ≤ upper (equal where exact)."""

    value: np.ndarray
    lower: np.ndarray
    upper: np.ndarray


@dataclass(frozen=True)
class SpectralCurves:
    """λ_k and E(φ, k) at ``k`` (1-based), G's SLQ density, and how they were obtained.

    Attributes:
        k: (nk,) reported k.
        eigenvalue: λ_k with its bracket.
        energy: E(φ, k) by φ name (NaN where φ is not finite or zero).
        density_grid, density: G's spectral density (∫ density dλ ≈ 1 over the grid).
        n_products: columns G was applied to.
        lanczos_steps: block steps taken (the Gauss rules have that many nodes).
        exact_from: k above which the brackets are estimates (K; N where everything is exact).
        notes: ``rounding_delta`` (δ), ``spectrum_bottom``, ``phi_lanczos_steps``,
            ``top_residual_bound``, ``delta64`` (a float64 reduction's δ, or the products' rounding
            when coarser), ``storage_eps`` (the precision of the stored G or of its products) and
            ``widest``: per φ, the largest width of E's bracket, its k and what it is made of there
            (:func:`describe_width`).
    """

    k: np.ndarray
    eigenvalue: CurveBracket
    energy: dict[str, CurveBracket]
    density_grid: np.ndarray
    density: np.ndarray
    n_products: int
    lanczos_steps: int
    exact_from: int
    notes: dict[str, Any] = field(default_factory=dict)


def spectral_curves(
    G: Any,
    evals: np.ndarray,
    evecs: Any,
    phis: Mapping[str, np.ndarray | None],
    ks: np.ndarray,
    *,
    lanczos_steps: int = 60,
    probes: int = 24,
    confidence: float = 0.95,
    density_grid: int = 200,
    seed: int = 0,
    block_size: int = 12,
    basis_bytes: float = _BASIS_BYTES,
    phi_steps: int | None = None,
    phi_width: float = 0.0,
    top_residual: float | None = None,
) -> SpectralCurves:
    """λ_k and E(φ, k) at every ``ks`` from the top eigenpairs and products with G (see the module docstring).

    Args:
        G: the symmetric PSD (N, N) matrix or operator (``shape`` + ``matmat``).
        evals: (K,) its top eigenvalues, descending; evecs: (N, K) the eigenvectors (NumPy or torch).
        phis: φ by name, (N,) or (N, C) (E sums the C columns); None or non-finite → NaN curves.
        ks: reported k, 1 ≤ k ≤ N, strictly increasing.
        lanczos_steps: m, block steps of A = PGP from the block of φ's and probes.
        probes: Rademacher probes of the counting function.
        confidence: pointwise confidence of the counting function's bracket.
        density_grid: points of the density grid.
        seed: seed of the probes.
        block_size: columns (φ's and probes) per block Lanczos run: larger blocks resolve the
            spectrum better (sharper values, tighter Ritz bounds) at a (b·m)² eigh and a
            b·m-column basis per run; the Gauss-rule brackets do not depend on it.
        basis_bytes: columns are run in groups, and groups side by side (sharing each product
            with G), whose Lanczos bases together stay under this.
        phi_steps: block steps of a separate run of the φ columns (None: φ's share the probes'
            blocks and their ``lanczos_steps``; 0: as many as keep its basis at one probe group's
            ``block_size · lanczos_steps`` columns, at most ``4 · lanczos_steps``; n: at most n).
            Longer runs narrow E's brackets where φ's energy is deep in the tail, at one more pass
            over G per step.  The probes run first, then φ's block.
        phi_width: with ``phi_steps``, φ's run stops early (checked every 20 steps) once, for each
            φ column, the Gauss–Radau part of E's bracket (the φ measure's bounds at λ_k's
            estimate, relative to ‖φ‖²) is at most this at every reported k beyond the top; 0:
            always ``phi_steps``.  What is left of the width is then λ_k's bracket.
        top_residual: ``max_i ‖G u_i − λ_i u_i‖`` of the given top eigenpairs (the solver's, e.g.
            Lanczos's); None: measured here, one product of G with the K eigenvectors.  The
            interlacing lower end of λ_k holds for PGP of exact eigenvectors; U's residual R moves
            the tail's eigenvalues by at most ‖R‖₂ ≤ √K·max‖r_i‖, which is taken off it.

    Raises:
        ValueError: sizes that do not match, ks outside 1 … N, top eigenvalues not finite or not
            descending, a knob out of its range (G is taken to be PSD; that is not checked).
        TypeError: ``phis`` not a mapping.
        NonFiniteError: NaN/inf in a dense torch G.
    """
    _check_knobs(lanczos_steps, probes, confidence, density_grid, block_size, basis_bytes, phi_steps, phi_width)
    A = _products(G)
    ops, N = A.ops, A.N
    lam = np.asarray(evals, dtype=np.float64).reshape(-1)
    K = lam.size
    U = np.asarray(evecs.detach().cpu().numpy() if hasattr(evecs, "detach") else evecs, dtype=np.float64)
    ks_in = np.asarray(ks)
    ks = ks_in.astype(np.int64)
    if U.shape != (N, K):
        raise ValueError(f"evecs must be (N, K) = ({N}, {K}), got {U.shape}")
    if ks.ndim != 1 or ks.size == 0 or ks.min() < 1 or ks.max() > N or np.any(ks != ks_in):
        raise ValueError(f"ks must be sorted integers in 1 … N = {N}, got {ks_in[:5]}…")
    if np.any(np.diff(ks) <= 0):
        bad = int(np.nonzero(np.diff(ks) <= 0)[0][0])
        raise ValueError(
            f"ks must be sorted integers in 1 … N = {N} without repeats (curve_ks gives such), got "
            f"k = {ks[bad]} then {ks[bad + 1]}"
        )
    if K < 1:
        raise ValueError("spectral_curves needs at least one exact eigenpair (K ≥ 1)")
    _check_top(lam, U)
    # the curves are those of G / 2^e, λ_1 / 2^e ∈ [½, 1) (exact: a power of 2), scaled back at the end —
    # squares of G's scale were left to the Lanczos recurrences and the rounding floor: a G of 10⁻¹⁷⁰
    # (its squares below the smallest double) put λ_k outside its bracket and E(φ, k) 0.67 outside
    # its own, and one of 10¹⁶⁰ (its squares inf) ended in an eigh_tridiagonal error
    g_exp = _exponent(lam)
    A, lam = _Scaled(A, g_exp), np.ldexp(lam, -g_exp)
    top_residual = None if top_residual is None else float(np.ldexp(float(top_residual), -g_exp))
    cols, owners, norms2, top2 = _phi_columns(phis, U)
    m = max(2, min(int(lanczos_steps), N))
    block_size = max(1, min(int(block_size), N - K)) if K < N else 1  # a block no wider than the tail
    rng = np.random.default_rng(seed)
    n_probe = int(probes) if K < N else 0
    Z = [np.asarray(cols[:, j]) for j in range(cols.shape[1])]
    Z += [rng.choice([-1.0, 1.0], size=N) for _ in range(n_probe)]
    Z = [z - U @ (U.T @ z) for z in Z]  # deflated start vectors
    Ub = ops.from_numpy(U)
    leak = _top_leak(A, Ub, lam, ops, top_residual) if K < N else 0.0
    asym = math.ldexp(_asymmetry(G), -g_exp)  # a dense G's own asymmetry (at G's scale / 2^e, as lam)

    def deflated(X: Any) -> Any:
        X = X - Ub @ (Ub.T @ X)
        W = A.matmat(X)
        return W - Ub @ (Ub.T @ W)

    n_phi_cols = cols.shape[1]
    # with phi_steps, φ's own block runs longer: its Gauss rule's nodes set E's bracket width (the
    # Christoffel weight at λ_k), at the cost of one more group's products; else φ's and probes share
    # blocks of lanczos_steps.  The probes run first: λ_k's bracket is where φ's rule is read, and
    # with phi_width φ's run stops once its own part of E's bracket there is below it.
    own = phi_steps is not None
    m_phi = _phi_steps(phi_steps, m, block_size, n_phi_cols, N) if own else m
    runs: dict[int, tuple[np.ndarray, np.ndarray, int, bool, np.ndarray]] = {}
    ritz: list[np.ndarray] = []

    def run(vectors: list[np.ndarray], steps_g: int, offset: int, done: Any = None) -> None:
        group, per_wave = _wave(block_size, 16.0 * N * steps_g, basis_bytes)
        starts = list(range(0, len(vectors), group))
        for w in range(0, len(starts), per_wave):
            gens = {}
            for s in starts[w : w + per_wave]:
                block = np.column_stack(vectors[s : s + group])
                gens[s] = _block_rule(
                    ops.from_numpy(block),
                    steps_g,
                    ops,
                    A.sym_rtol,
                    seed + offset + s,
                    float(lam[0]),
                    done=None if done is None else done(offset + s, block.shape[1]),
                )
            for s, out in sorted(_lockstep(gens, deflated, ops).items()):
                runs[offset + s] = out
                ritz.append(out[0])

    def rules_of(starts: list[int]) -> list[_Rule]:
        out = []
        for start in sorted(starts):
            theta, W, steps, exhausted, res = runs[start]
            out += [_Rule(theta, W[i], steps, exhausted, res) for i in range(W.shape[0])]
        return out

    if own:
        run(Z[n_phi_cols:], m, n_phi_cols)
        probe_rules = rules_of(list(runs))
    else:
        run(Z, m, 0)
        rules = rules_of(list(runs))
        phi_rules, probe_rules = rules[:n_phi_cols], rules[n_phi_cols:]
    floor = _rounding_floor(G, A, lam, N, probe_rules, ritz, leak, asym)
    counts = _counts(lam, N, probe_rules, confidence) if probe_rules and (ks > K).any() else None
    curve_at = lambda at, slack, quiet=True: _eigenvalue_curve(  # noqa: E731  λ_k's bracket at these k
        lam, N, at, probe_rules, ritz, confidence, slack, floor.bottom, floor.ritz_slack, counts, quiet
    )
    curve = lambda slack, quiet=False: curve_at(ks, slack, quiet)  # noqa: E731  at the reported k
    eig = curve(floor.delta)
    if own:
        done = None
        if phi_width > 0 and (ks > K).any():
            t = eig.value[ks > K]

            def done(start: int, width: int) -> Any:
                n2 = np.array([norms2[owners[j]] for j in range(start, start + width)])

                def check(theta: np.ndarray, W: np.ndarray, steps: int) -> bool:
                    # φ's part of E's bracket at λ_k's estimate, per column relative to its φ's ‖φ‖²
                    for i in range(W.shape[0]):
                        lo, hi = _Rule(theta, W[i], steps, False).radau(t)
                        if np.max(hi - lo) > phi_width * n2[i]:
                            return False
                    return True

                return check

        run(Z[:n_phi_cols], m_phi, 0, done)
        phi_rules = rules_of([r for r in runs if r < n_phi_cols])
        # φ's Ritz values interlace too (a lower bound of λ_k), and their smallest moves the floor
        floor = _rounding_floor(G, A, lam, N, probe_rules, ritz, leak, asym)
        eig = curve(floor.delta)
    steps_done = min([m] + [runs[r][2] for r in runs if r >= n_phi_cols or not own])
    phi_done = max([0] + [runs[r][2] for r in runs if r < n_phi_cols]) if n_phi_cols else 0
    # the deflated operator's largest Ritz value (≤ its largest eigenvalue): a tail eigenvalue at λ_K
    tail_top = max([-math.inf] + [float(np.max(r)) for r in ritz if r.size]) if K < N else -math.inf
    # an upper end of λ_{K+1}: the gap below λ_K that E(φ, K)'s Davis–Kahan bound needs (_energy_curve)
    next_upper = float(curve_at(np.array([K + 1]), floor.delta).upper[0]) if K < N and probe_rules else math.inf
    energy = {}
    for name in phis:
        idx = [j for j, o in enumerate(owners) if o == name]
        energy[name] = _energy_curve(
            lam,
            N,
            ks,
            eig,
            [phi_rules[j] for j in idx],
            norms2.get(name, np.nan),
            top2.get(name),
            16.0 * A.eps,
            floor.delta,
            floor.rotation,
            floor.leak,
            tail_top,
            next_upper,
            ramp_delta=floor.delta if floor.eps_g > 4.0 * float(np.finfo(np.float64).eps) else floor.rotation,
        )
    grid, dens = _density(lam, N, probe_rules, density_grid)
    widest: dict[str, dict[str, float]] = {}
    try:  # an account for choosing knobs: it must never cost the curves (a step, a run)
        plain = curve(0.0, quiet=True)
        for name in phis:
            idx = [j for j, o in enumerate(owners) if o == name]
            widest[name] = _widest(
                lam, N, ks, energy[name], plain, [phi_rules[j] for j in idx], norms2.get(name, np.nan), top2.get(name)
            )
    except Exception as e:  # noqa: BLE001
        log.warning(
            "the account of the brackets' widths failed (%s: %s); the curves are not affected", type(e).__name__, e
        )
        widest = {}
    up = lambda x: np.ldexp(np.asarray(x, dtype=np.float64), g_exp)  # noqa: E731  back to G's scale
    notes = {
        "rounding_delta": float(up(floor.delta)),
        "spectrum_bottom": float(up(floor.bottom)),
        "phi_lanczos_steps": phi_done,
        "top_residual_bound": float(up(floor.leak)),
        "delta64": float(up(floor.rotation)),
        "storage_eps": floor.eps_g,
        "widest": widest,
    }
    eig = CurveBracket(up(eig.value), up(eig.lower), up(eig.upper))
    grid, dens = up(grid), np.ldexp(dens, -g_exp)
    return SpectralCurves(ks, eig, energy, grid, dens, A.n_matvec, steps_done, K if K < N else N, notes)


def _exponent(lam: np.ndarray) -> int:
    """e with max |λ_i| / 2^e ∈ [½, 1) (0 for an all-zero top)."""
    top = float(np.max(np.abs(lam)))
    return math.frexp(top)[1] if top > 0.0 else 0


class _Scaled:
    """The products of G / 2^e: G's applied, then multiplied by 2^−e (exact for normal numbers)."""

    def __init__(self, A: Any, e: int) -> None:
        self.A, self.factor = A, math.ldexp(1.0, -e)
        self.N, self.ops, self.eps, self.sym_rtol = A.N, A.ops, A.eps, A.sym_rtol

    @property
    def n_matvec(self) -> int:
        return self.A.n_matvec

    def matmat(self, X: Any) -> Any:
        out = self.A.matmat(X)
        return out if self.factor == 1.0 else out * self.factor


def _check_knobs(
    lanczos_steps: int,
    probes: int,
    confidence: float,
    density_grid: int,
    block_size: int,
    basis_bytes: float,
    phi_steps: int | None,
    phi_width: float,
) -> None:
    """One ValueError naming the first knob out of its range."""
    bad = [
        (lanczos_steps < 1, f"lanczos_steps must be ≥ 1, got {lanczos_steps}"),
        (probes < 0, f"probes must be ≥ 0, got {probes}"),
        (not 0.0 < confidence < 1.0, f"confidence must lie in (0, 1) (0.95, not 95), got {confidence}"),
        (density_grid < 2, f"density_grid must be ≥ 2 points, got {density_grid}"),
        (block_size < 1, f"block_size must be ≥ 1, got {block_size}"),
        (not basis_bytes > 0, f"basis_bytes must be > 0, got {basis_bytes}"),
        (phi_steps is not None and phi_steps < 0, f"phi_steps must be None or ≥ 0, got {phi_steps}"),
        (not 0.0 <= phi_width < 1.0, f"phi_width must lie in [0, 1), got {phi_width}"),
        (phi_width > 0 and phi_steps is None, "phi_width needs phi_steps (φ's own run, which it stops)"),
    ]
    for failed, message in bad:
        if failed:
            raise ValueError(message)


def _check_top(lam: np.ndarray, U: np.ndarray) -> None:
    """The exact top part as the brackets need it: finite and descending."""
    if not (np.isfinite(lam).all() and np.isfinite(U).all()):
        raise ValueError("evals and evecs must be finite (NaN/inf in the top eigenpairs)")
    if np.any(np.diff(lam) > 0):
        raise ValueError(
            "evals must be descending, λ_1 ≥ … ≥ λ_K (with the eigenvectors in the same order; "
            "numpy.linalg.eigh returns them ascending)"
        )
    # a negative λ_1 is not refused: an all-zero G (every unit dead) has rounding of either sign there,
    # and this runs inside a training run, which a refusal would end


def _phi_steps(phi_steps: int | None, m: int, block_size: int, n_phi: int, N: int) -> int:
    """Block steps of the φ columns' run (see :func:`spectral_curves`)."""
    if phi_steps:
        return max(2, min(int(phi_steps), N))
    return max(m, min(4 * m, (max(1, int(block_size)) * m) // max(n_phi, 1), N))


@dataclass(frozen=True)
class _Floor:
    """The rounding scale of the brackets: ``delta`` bounds how far the exact route's eigenvalues of the
    stored G lie from G's (its backward error, N·eps·λ_1 in float64, or the products' 8·eps·λ_1 when
    larger); ``bottom`` is below G's smallest eigenvalue (0 for a PSD G in exact arithmetic, a rounding
    level below 0 for the stored one)."""

    delta: float
    bottom: float
    rotation: float = 0.0  # the float64 reduction's backward error ‖Δ‖ (products' when coarser): see _ramps
    leak: float = 0.0  # ‖R‖₂ of the top eigenvectors (_top_leak)
    eps_g: float = float(np.finfo(np.float64).eps)  # the stored G's (or its products') precision

    @property
    def ritz_slack(self) -> float:
        """What the interlacing lower end of λ_k gives up: the top eigenvectors' residual and 3·δ₆₄
        for the products' rounding (see :func:`_eigenvalue_curve`)."""
        return 3.0 * self.rotation + self.leak


def _top_leak(A: Any, Ub: Any, lam: np.ndarray, ops: ArrayOps, top_residual: float | None) -> float:
    """A bound of ‖R‖₂, R = G U − U Λ' (Λ' = UᵀGU): with G̃ = G − R Uᵀ − U Rᵀ, range(U) is invariant
    and PG̃P = PGP, so the tail eigenvalues of PGP are G̃'s and lie within ‖R‖₂ of G's (Weyl).  From
    the solver's largest residual (√K of it bounds ‖GU − UΛ‖_F ≥ ‖R‖₂), else measured (K products),
    with the given evals' largest distance from their vectors' Rayleigh quotients added.

    Raises:
        ValueError: (measured only) evecs not orthonormal, or evals not their Rayleigh quotients
            (another order, other pairs) beyond rounding."""
    K = lam.size
    if top_residual is not None:
        return math.sqrt(K) * float(top_residual)
    gram_u = np.asarray(ops.to_numpy(Ub.T @ Ub), dtype=np.float64)
    orth = float(np.abs(gram_u - np.eye(K)).max())
    if orth > _ORTHONORMAL_TOL:
        raise ValueError(
            f"evecs must have orthonormal columns (max |UᵀU − I| = {orth:.3g}): the exact top part's eigenvectors"
        )
    GU = A.matmat(Ub)  # (N, K)
    UtGU = Ub.T @ GU
    R = GU - Ub @ UtGU
    # the evals as given against the evecs' Rayleigh quotients: a top eigenpair is G's to ‖R‖₂ only where
    # its value is its vector's (evals 10⁻⁶ off their exact vectors' put λ_1 outside its bracket, the top
    # vectors in the wrong order E(y, 1) at 0.00054 for 0.00203 — an audit); a gross mismatch is refused, a
    # small one (evals rounded to float32 beside float64 vectors) widens the bracket by it
    theta = np.diagonal(np.asarray(ops.to_numpy(UtGU), dtype=np.float64))
    apart = np.abs(theta - lam)
    worst = int(np.argmax(apart))
    # judged on G's own scale (an all-zero G — every unit dead — has evals of rounding against θ = 0: no pairs
    # to refuse there, a run goes on), and within a float64 reduction's rounding not added
    scale = max(float(np.abs(theta).max()), float(np.max(ops.to_numpy(ops.colnorms(GU)))))
    if scale > 0 and apart[worst] > _EVALS_TOL * scale:
        raise ValueError(
            f"evals are not the Rayleigh quotients of evecs: λ_{worst + 1} = {lam[worst]:.9g} given, "
            f"u_{worst + 1}ᵀ G u_{worst + 1} = {theta[worst]:.9g} (evals and evecs must be the same pairs, in "
            "the same descending order)"
        )
    extra = float(apart.max()) if apart.max() > Ub.shape[0] * np.finfo(np.float64).eps * scale else 0.0
    return float(np.linalg.norm(ops.to_numpy(ops.colnorms(R)))) + extra  # ‖R‖_F + max |θ_i − λ_i|


_ORTHONORMAL_TOL = 1e-3  # the evecs' max |UᵀU − I| (a float32 eigh's at N = 10⁴: ~10⁻⁵)
_EVALS_TOL = 1e-4  # |u_iᵀGu_i − λ_i| refused beyond this fraction of λ_1 (a float32 eigh's: ~10⁻⁷)


def _asymmetry(G: Any) -> float:
    """‖G − Gᵀ‖_F / 2 of a dense G (NumPy or torch; 0 for an operator), a row block at a time in float64: the
    exact route reduces one triangle, a symmetric matrix within that of (G + Gᵀ)/2 in the 2-norm (Weyl),
    and the products apply G as stored — a G asymmetric by 4·10⁻¹⁰ of max|G| (within the 1.5·10⁻⁸ the
    symmetry check allows) put 8 of 300 eigh eigenvalues outside their brackets (an audit)."""
    import torch

    T = torch.from_numpy(G) if isinstance(G, np.ndarray) else G
    if not (isinstance(T, torch.Tensor) and T.ndim == 2 and T.shape[0] == T.shape[1] and T.is_floating_point()):
        return 0.0
    T, n, acc = T.detach(), int(T.shape[0]), 0.0
    rows = max(1, (1 << 22) // max(n, 1))  # 32 MB of float64 a block
    for s in range(0, n, rows):
        d = T[s : s + rows].double() - T[:, s : s + rows].T.double()
        acc += float((d * d).sum())
    return math.sqrt(acc) / 2


def _rounding_floor(
    G: Any,
    A: Any,
    lam: np.ndarray,
    N: int,
    probes: list[_Rule],
    ritz: list[np.ndarray],
    leak: float = 0.0,
    asym: float = 0.0,
) -> _Floor:
    """:class:`_Floor` of this G: the smallest Ritz value of the deflated operator (an upper bound of its
    smallest eigenvalue; negative when the stored G is indefinite by rounding), minus ``4·eps_G·‖G‖_F``
    (the storage rounding of a PSD G moves its eigenvalues by at most ‖δG‖_2 ≲ eps_G·‖G‖_F for
    independent roundings; ‖G‖_F² from the top eigenvalues and the probes' tail moment
    ``mean zᵀA²z``) and ``delta``; ``delta`` is at least ``4·eps_G·‖G‖_F`` too (the exact route of a
    float32 G reduces it in float32 — a rounding model, not a proof)."""
    eps64 = float(np.finfo(np.float64).eps)
    lam1 = float(lam[0])
    delta = max(8.0 * A.eps, N * eps64) * lam1
    dt = getattr(G, "dtype", None)
    try:
        import torch

        eps_g = float(torch.finfo(dt).eps) if isinstance(dt, torch.dtype) else float(np.finfo(dt).eps)
    except (TypeError, ValueError):
        eps_g = float(A.eps)
    eps_g = max(eps_g, float(A.eps))
    tail2 = float(np.mean([np.sum(r.theta**2 * r.nu) for r in probes])) if probes else 0.0
    fro = math.sqrt(float(np.sum(lam**2)) + max(tail2, 0.0))
    low_ritz = min([0.0] + [float(np.min(r)) for r in ritz if r.size])
    # a float32 G's exact route reduces it in float32: its eigenvalues carry that rounding too (the
    # top one 0.6·eps₃₂·λ_1 and the null space's ±1.2·eps₃₂·λ_1 off a float64 eigh's at N = 2,000)
    rotation = delta + asym  # ``asym``: a dense G's own ‖G − Gᵀ‖_F / 2 (:func:`_asymmetry`)
    delta = max(delta, 4.0 * eps_g * fro) + asym
    return _Floor(delta, low_ritz - 4.0 * eps_g * fro - delta, rotation, leak, eps_g)


# --------------------------------------------------------------------------- the quadrature rules


class _DenseProducts:
    """A dense torch G applied in float64 without a float64 copy of it
    (:func:`~nsa_dist.linalg._inputs.upcast_product`): the block rule's products are those of the
    stored matrix to float64 rounding.  (The whole copy was the route's largest block, 0.8 GB at
    N = 10⁴; float32 products instead blurred λ_k below ~10⁻⁶·λ_1 into the bracket — at N = 500
    the widths doubled.)"""

    def __init__(self, G: Any) -> None:
        n_bad = _non_finite(G.detach())
        if n_bad:
            raise NonFiniteError(
                f"G holds {n_bad} NaN/inf entries (of {G.shape[0] * G.shape[1]}); only finite matrices "
                "have an eigendecomposition"
            )
        self.G, self.N, self.ops = G.detach(), int(G.shape[0]), TorchOps(G.device)
        self.eps = float(np.finfo(np.float64).eps)
        self.sym_rtol, self.n_matvec = float(np.sqrt(self.eps)), 0
        self._apply = upcast_product(self.G)

    def matmat(self, X: Any) -> Any:
        self.n_matvec += X.shape[1]
        return self._apply(X)


def _products(G: Any) -> Any:
    """G as the block rule applies it: a dense torch matrix as it is, anything else through
    :func:`~nsa_dist.linalg._inputs.as_symmetric_map` on torch's BLAS (Cholesky QR and MKL's eigh;
    NumPy's LAPACK QR stalled behind the products' threads on 2 cores)."""
    import torch

    if isinstance(G, torch.Tensor) and G.ndim == 2 and G.shape[0] == G.shape[1] and G.is_floating_point():
        return _DenseProducts(G)
    return as_symmetric_map(G, Backend.TORCH, "G")


@dataclass
class _Rule:
    """One column's block rule ν (nodes θ, weights ν_w) and the m-point Gauss rule of its moments."""

    theta: np.ndarray
    nu: np.ndarray
    steps: int
    exhausted: bool
    residual: np.ndarray | None = None  # ‖G y_j − θ_j y_j‖ of each Ritz pair (None: not known)
    x: np.ndarray = None  # Gauss nodes ascending
    w: np.ndarray = None
    alpha: np.ndarray = None  # the Jacobi matrix of the moments (normalised measure)
    beta: np.ndarray = None

    def __post_init__(self) -> None:
        keep = self.nu > 0
        if self.exhausted:  # the Krylov space is invariant: ν is μ
            order = np.argsort(self.theta[keep])
            self.x, self.w = self.theta[keep][order], self.nu[keep][order]
        else:
            self.x, self.w, self.alpha, self.beta = _gauss_from_discrete(self.theta[keep], self.nu[keep], self.steps)
            if self.x.size < self.steps and self._converged(keep):
                # fewer atoms than nodes: the moments determine μ = ν — where the nodes carrying the
                # weight are eigenpairs (their Ritz residuals at rounding): a one-column run beside a
                # repeated eigenvalue spends a step on a second copy of it that φ does not see (weight
                # 3·10⁻²¹), so 49 nodes of 50 steps, and ν taken for μ missed E by 0.009–0.037
                self.exhausted = True

    def _converged(self, keep: np.ndarray) -> bool:
        """Whether every Ritz pair carrying weight (≥ 10⁻¹² of the mass) has a residual at rounding."""
        if self.residual is None:
            return True
        heavy = keep & (self.nu >= 1e-12 * self.mass)
        scale = float(np.abs(self.theta).max()) if self.theta.size else 0.0
        return bool(np.all(self.residual[heavy] <= 1e-8 * scale))

    def radau(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(≤ μ((t, ∞)), ≥ μ([t, ∞))) at each t from the canonical representation through t (Gauss–Radau
        with the m − 1 free nodes the moments 0 … 2m − 2 fix; Markov–Krein: its mass below, at and above
        t bounds every measure with those moments).  Its bracket is the Christoffel function at t,
        about half the two Gauss weights around t that :meth:`tail_lower` / :meth:`tail_upper` leave."""
        t = np.asarray(t, dtype=np.float64)
        if self.exhausted or self.alpha is None or self.alpha.size < 2:
            return self.tail_lower(t), self.tail_upper(t)
        from scipy.linalg import solve_banded

        a, b = self.alpha[:-1], self.beta  # J_{m−1} and β_{m−1}
        n = a.size
        lo, hi = self.tail_lower(t).astype(float), self.tail_upper(t).astype(float)
        # next to a Gauss node the Radau rule through t is the Gauss rule (Christoffel weight = the
        # node's weight, so both give the same bounds) and its solve is ill-conditioned: a t 4.6e-10
        # (relative) below a node lost 4e-5 of the node's weight from the Radau upper bound
        xs = self.x
        scale = float(np.abs(xs).max()) if xs.size else 0.0
        gaps = np.diff(xs)
        pos = np.clip(np.searchsorted(xs, t), 1, max(xs.size - 1, 1))
        local = gaps[np.minimum(pos - 1, gaps.size - 1)] if gaps.size else np.full(t.size, scale)
        near = np.abs(xs[None, :] - t[:, None]).min(axis=1) < np.maximum(1e-3 * local, 1e-6 * scale)
        for i, ti in enumerate(t):
            if near[i]:
                continue
            ab = np.zeros((3, n))
            ab[0, 1:], ab[1], ab[2, :-1] = b[: n - 1], a - ti, b[: n - 1]
            rhs = np.zeros(n)
            rhs[-1] = b[n - 1] ** 2
            try:
                delta = solve_banded((1, 1), ab, rhs)
            except np.linalg.LinAlgError:
                continue
            x, w = _jacobi_rule(np.append(a, ti + delta[-1]), b[:n])
            w = self.mass * w
            j = int(np.argmin(np.abs(x - ti)))
            above = (x > ti) & (np.arange(x.size) != j)
            lo[i], hi[i] = w[above].sum(), w[above].sum() + w[j]
        return np.maximum(lo, self.tail_lower(t)), np.minimum(hi, self.tail_upper(t))

    @property
    def mass(self) -> float:
        return float(self.nu.sum())

    def tail_upper(self, t: np.ndarray) -> np.ndarray:
        """≥ μ([t, ∞)): the weights of the nodes from the largest node < t up (every node when none)."""
        if self.exhausted:
            return self.tail_closed(t)
        c = np.concatenate([[0.0], np.cumsum(self.w)])  # c[j] = Σ_{i<j} w_i (ascending x)
        j = np.searchsorted(self.x, t, side="left") - 1  # index of the largest node < t (−1: none)
        return self.mass - c[np.maximum(j, 0)]

    def tail_lower(self, t: np.ndarray) -> np.ndarray:
        """≤ μ((t, ∞)): the weights of the nodes above the smallest node ≥ t (none when no node ≥ t)."""
        if self.exhausted:
            return self.tail_open(t)
        c = np.concatenate([[0.0], np.cumsum(self.w)])
        j = np.searchsorted(self.x, t, side="left")  # the smallest node ≥ t
        return np.where(j < self.x.size, self.mass - c[np.minimum(j + 1, self.x.size)], 0.0)

    def tail_closed(self, t: np.ndarray) -> np.ndarray:
        """ν([t, ∞)) of the block rule (or of the Gauss rule when exhausted)."""
        x, w = (self.x, self.w) if self.exhausted else (np.sort(self.theta), self.nu[np.argsort(self.theta)])
        c = np.concatenate([[0.0], np.cumsum(w)])
        return c[-1] - c[np.searchsorted(x, t, side="left")]

    def tail_open(self, t: np.ndarray) -> np.ndarray:
        """ν((t, ∞)) of the block rule (or of the Gauss rule when exhausted)."""
        x, w = (self.x, self.w) if self.exhausted else (np.sort(self.theta), self.nu[np.argsort(self.theta)])
        c = np.concatenate([[0.0], np.cumsum(w)])
        return c[-1] - c[np.searchsorted(x, t, side="right")]


def _jacobi_rule(d: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nodes (ascending) and weights (summing to 1) of the Gauss rule of the Jacobi matrix (d, e): the
    eigenvalues x of J, and the squared first eigenvector components from them and the eigenvalues y
    of J without its first row and column, ``w_j = Π_i (x_j − y_i) / Π_{i≠j} (x_j − x_i)`` (in logs;
    two O(n²) eigvalsh instead of the O(n³) eigenvectors — the Radau bounds at every reported k took
    2.7 s per φ at m = 240 that way)."""
    from scipy.linalg import eigh_tridiagonal, eigvalsh_tridiagonal

    if e.size == 0:
        return d.copy(), np.ones(d.size)
    x = eigvalsh_tridiagonal(d, e)
    y = eigvalsh_tridiagonal(d[1:], e[1:]) if d.size > 2 else d[1:].copy()
    dx = np.abs(x[:, None] - x[None, :])
    np.fill_diagonal(dx, 1.0)
    dy = np.abs(x[:, None] - y[None, :])
    # nodes closer than 10⁻⁶ of the scale: each computed node carries ~eps·‖J‖ of error, which the
    # products turn into that error over the gap — near-coincident nodes (a block rule's repeated
    # Ritz values for repeated φ columns) gave weights off by 8× (fuzz): the eigenvectors instead
    tiny = 1e-6 * max(float(np.abs(x).max()), float(np.abs(d).max()), 1e-300)
    if not (dx > tiny).all() or not (dy > tiny).all():
        x, Y = eigh_tridiagonal(d, e)
        return x, Y[0] ** 2
    lw = np.log(dy).sum(axis=1) - np.log(dx).sum(axis=1)
    w = np.exp(lw - lw.max())
    return x, w / w.sum() if np.isfinite(w).all() and w.sum() > 0 else eigh_tridiagonal(d, e)[1][0] ** 2


def _block_rule(
    Z: Any,
    n_steps: int,
    ops: ArrayOps,
    sym_rtol: float,
    seed: int,
    scale: float = 0.0,
    done: Callable[[np.ndarray, np.ndarray, int], bool] | None = None,
    every: int = 20,
) -> Generator[Any, Any, tuple[np.ndarray, np.ndarray, int, bool, np.ndarray]]:
    """:func:`~nsa_dist.linalg.lanczos.block_gauss_quadrature`'s rule on the same Krylov machinery,
    as a generator driven by :func:`_lockstep`: it yields each block P to be multiplied and is sent
    G·P back; it returns the rule (θ, W), the block steps taken and whether the basis became
    invariant (then the rule is exact for every f).  ``done(theta, W, steps)``, asked every
    ``every`` steps, ends the run early."""
    N, b = Z.shape
    Q, R = _qr_r(ops, Z)
    st = _State(ops, N, min(N, n_steps * b), b, np.random.default_rng(seed), sym_rtol)
    st.anorm = scale  # ‖G‖: the deflated operator's rounding is G's, whatever the size of its tail
    P, Bc, exhausted = Q, np.zeros((b, 0)), False

    last: list[Any] = [None, 0]  # the coupling B of the next block to the last one, and its width

    def rule() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        theta, Y = _ritz(st.H[: st.n, : st.n])  # descending, MKL's eigh on the products' threads
        B, bp = last
        # Ritz residuals ‖B · (Y's rows of the last block)‖ (0 where the basis is invariant)
        res = np.zeros(theta.size) if B is None else np.linalg.norm(np.atleast_2d(B) @ Y[st.n - bp : st.n], axis=0)
        return theta, (R.T @ Y[: Q.shape[1]]) ** 2, res  # (b, n): column i's weights, row sums ‖z_i‖²

    for _ in range(n_steps):
        GP = yield P
        B, P_next = st.extend(P, Bc, lambda _, GP=GP: GP)
        last[:] = [B, P.shape[1]]
        n = st.n
        if P_next is None:
            exhausted = True
            break
        if n + P_next.shape[1] > st.M:
            break
        if done is not None and st.steps % every == 0 and st.steps < n_steps and done(*rule()[:2], st.steps):
            break
        Bc = np.zeros((B.shape[0], n))
        Bc[:, n - P.shape[1] :] = B
        P = P_next
    theta, W, res = rule()
    return theta, W, st.steps, exhausted, res


def _lockstep(gens: dict[int, Generator[Any, Any, Any]], matmat: Callable[[Any], Any], ops: ArrayOps) -> dict[int, Any]:
    """Drive :func:`_block_rule` generators side by side: each round, one product of G with every
    running generator's block side by side, each sent its columns back; their results by key."""
    pending, out = {}, {}
    for key, gen in gens.items():
        try:
            pending[key] = next(gen)
        except StopIteration as stop:
            out[key] = stop.value
    while pending:
        keys = list(pending)
        X = pending[keys[0]]
        for key in keys[1:]:
            X = ops.hstack(X, pending[key])
        GX = matmat(X)
        at = 0
        for key in keys:
            b = pending[key].shape[1]
            part = GX if len(keys) == 1 else _contiguous(GX[:, at : at + b])
            at += b
            try:
                pending[key] = gens[key].send(part)
            except StopIteration as stop:
                out[key] = stop.value
                del pending[key]
    return out


def _gauss_from_discrete(
    theta: np.ndarray, w: np.ndarray, m: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The m-point Gauss rule (nodes ascending, weights) of the discrete measure Σ w_j δ_θj's moments
    0 … 2m − 1 (Lanczos on diag(θ) with full reorthogonalisation; fewer nodes when ν has fewer atoms,
    and then it is ν itself)."""
    mass = float(w.sum())
    if mass <= 0 or theta.size == 0:
        return np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0)
    n = theta.size
    m = min(m, n)
    V = np.zeros((m, n))
    alpha, beta = np.zeros(m), np.zeros(m)
    v = np.sqrt(w / mass)
    scale = max(np.abs(theta).max(), 1e-300)
    r = 0
    for j in range(m):
        V[j] = v
        u = theta * v
        alpha[j] = u @ v
        u = u - alpha[j] * v - (beta[j - 1] * V[j - 1] if j else 0.0)
        u -= V[: j + 1].T @ (V[: j + 1] @ u)  # full reorthogonalisation, twice
        u -= V[: j + 1].T @ (V[: j + 1] @ u)
        r = j + 1
        b = float(np.linalg.norm(u))
        if j + 1 == m or b <= 1e-13 * scale:
            break
        beta[j] = b
        v = u / b
    from scipy.linalg import eigh_tridiagonal

    x, Y = eigh_tridiagonal(alpha[:r], beta[: r - 1]) if r > 1 else (alpha[:1].copy(), np.ones((1, 1)))
    return x, mass * Y[0] ** 2, alpha[:r].copy(), beta[: r - 1].copy()


# --------------------------------------------------------------------------- the curves


def _phi_columns(
    phis: Mapping[str, np.ndarray | None], U: np.ndarray
) -> tuple[np.ndarray, list[str], dict[str, float], dict[str, np.ndarray]]:
    """The finite non-zero φ columns (N, c), their owners, ‖φ‖² and the cumulative top energies Σ_{i≤k}⟨v_i, φ⟩²."""
    N = U.shape[0]
    if not isinstance(phis, Mapping):
        raise TypeError(f"phis must map names to vectors φ, got {type(phis).__name__}")
    cols, owners, norms2, top2 = [], [], {}, {}
    for name, phi in phis.items():
        if phi is None:
            continue
        raw = np.asarray(phi.detach().cpu().numpy() if hasattr(phi, "detach") else phi)
        if np.iscomplexobj(raw) or raw.ndim not in (1, 2) or raw.shape[0] != N:
            raise ValueError(
                f"φ {name!r} must be real, (N,) or (N, C) with N = {N}, got {raw.dtype} {raw.shape}"
                + (" (a (C, N) φ: pass its transpose)" if raw.ndim == 2 and raw.shape[-1] == N else "")
            )
        P = raw.astype(np.float64).reshape(N, -1)
        if not np.isfinite(P).all():
            continue
        # E(φ, k) does not depend on φ's scale, its squares do: a φ of 1e-160 put ⟨v, φ⟩² and ‖φ‖² in
        # the subnormals (E off by 2·10⁻⁶ outside its bracket), 1e-200 made ‖φ‖² = 0 (NaN curves)
        # and 1e160 made it inf (an eigh_tridiagonal error) — scaled by a power of 2 (exact) to max |φ| ∈ [1, 2)
        top = float(np.max(np.abs(P))) if P.size else 0.0
        if top > 0.0:
            P = np.ldexp(P, -math.frexp(top)[1] + 1)
        n2 = float(np.sum(P * P))
        if n2 == 0.0:
            continue
        norms2[name] = n2
        top2[name] = np.cumsum(np.sum((U.T @ P) ** 2, axis=1))  # (K,)
        for c in range(P.shape[1]):
            cols.append(P[:, c])
            owners.append(name)
    return (np.column_stack(cols) if cols else np.zeros((N, 0))), owners, norms2, top2


def _eigenvalue_curve(
    lam: np.ndarray,
    N: int,
    ks: np.ndarray,
    probes: list[_Rule],
    ritz: list[np.ndarray],
    confidence: float,
    slack: float = 0.0,
    bottom: float = 0.0,
    leak: float = 0.0,
    counts: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
    quiet: bool = False,
) -> CurveBracket:
    """λ_k: exact for k ≤ K, else the inverted bracket of the counting function (module docstring,
    :func:`_counts`, computed here unless given; ``quiet``: a bracket that is not reported, whose
    fallbacks are not logged);
    ``slack``: the rounding of the products and of the exact route's eigenvalues, added to each
    side; ``bottom``: below G's smallest eigenvalue (:class:`_Floor`), the lower bound where the
    counting function does not reach k (G's numerical null space, whose rounded eigenvalues can be
    slightly negative)."""
    K = lam.size
    value, lower, upper = np.full(ks.size, np.nan), np.full(ks.size, np.nan), np.full(ks.size, np.nan)
    top = ks <= K
    value[top] = lower[top] = upper[top] = lam[ks[top] - 1]
    null = top & (np.abs(value) <= slack)  # top eigenvalues at G's rounding level: any such value
    lower[null], upper[null] = value[null] - slack, value[null] + slack
    if K < N:
        # a top-k solver's eigenvalues θ_k are G's to its residual: with R = GU − UΛ', G̃ = G − RUᵀ − URᵀ
        # has the θ_k as eigenvalues (U invariant) and lies within ‖R‖₂ of G (Weyl), so λ_k ∈ θ_k ± ‖R‖₂
        # where the θ_k are G̃'s top K; ``leak`` holds ‖R‖₂ and 3·δ₆₄ (Lanczos at tol 10⁻¹⁰ put λ_31 …
        # λ_40 = 10⁻⁸·λ_1 off a dense eigh's by 2.3·10⁻¹¹·λ_1 — 0.2 % — at zero width)
        lower[top], upper[top] = np.minimum(lower[top], value[top] - leak), np.maximum(upper[top], value[top] + leak)
    tail = ~top
    if not tail.any():
        return CurveBracket(value, lower, upper)
    if not probes:
        raise ValueError("k beyond the exact top part needs probes ≥ 1")
    bps, n_lo, n_hi, est = counts if counts is not None else _counts(lam, N, probes, confidence)
    ritz_desc = [np.sort(r)[::-1] for r in ritz]
    floor = min(bottom, 0.0)
    contradicted: list[int] = []
    for i in np.nonzero(tail)[0]:
        k = int(ks[i])
        # the counting function is the deflated operator's, read at its Ritz values and Gauss nodes: its
        # thresholds are off G's by ``leak`` too (its tail eigenvalues lie within ‖R‖₂ of G's, its nodes carry
        # the products' rounding — an exhausted probe rule's node sat 1.5·δ₆₄ below λ_35, its upper end
        # 1.5·10⁻¹⁴·λ_1 under it with δ = 3.3·10⁻¹⁴ at N = 150)
        lo = _last_at_least(bps, n_lo, k, floor) - leak
        j = k - K - 1  # Cauchy interlacing: λ_{K+j+1} ≥ the (j+1)-th Ritz value of PGP on any subspace
        # the Ritz values less ``leak``: the top eigenvectors' residual ‖R‖₂ (_top_leak) and 3·δ₆₄ for
        # the products' rounding — a Ritz value sat 2δ₆₄ above λ_{K+1} with the tail 12 decades
        # below λ_1 (fuzz); the interlacing proof holds for PGP of exact eigenvectors only
        # PGP's spectrum on the whole space is the tail's and K zeros (range(U)), so θ_j ≤ μ_j bounds
        # λ_{K+j} only where μ_j > 0 (the top j of PGP all the tail's); at or below 0 — a G
        # indefinite by more than rounding, its negative tail below those zeros — λ_{K+j} ≥ μ_{j+K}
        # ≥ θ_{j+K} (a Gram made in float32 and held in float64: the lower end passed λ_82…λ_150 by
        # up to 2.3·10⁻⁶ with the Krylov space the whole space, zero Ritz values on range(U))
        lo = max([lo] + [_interlaced(r, j, K, leak) for r in ritz_desc if j < r.size])
        hi = min(_last_at_least(bps, n_hi, k, float(bps[0]) if bps.size else 0.0), lam[-1]) + leak
        v = _last_at_least(bps, est, k, 0.0)
        lower[i], upper[i] = max(lo - slack, floor), hi + slack
        if upper[i] < lower[i]:
            # the statistical upper end fell below a proven lower end (Cauchy interlacing): the
            # probes missed here, so only the proof holds — λ_k ≤ λ_K
            upper[i] = max(float(lam[-1]) + leak + slack, lower[i])
            contradicted.append(k)
        value[i] = min(max(v, lower[i]), upper[i])
    if contradicted and not quiet:
        log.info(
            "λ_k's statistical upper end fell below its proven lower end at k = %s (of %d beyond the "
            "top): there the bracket's upper end is λ_K",
            contradicted[:10],
            int(tail.sum()),
        )
    # λ_k ≥ λ_k' ≥ lower_k' for k < k': the top's lower ends θ_k − ‖R‖₂ sat below λ_{K+1}'s interlacing
    # one (by 4.9·10⁻¹⁰·λ_1 with λ_31 … λ_40 = 10⁻⁸·λ_1 from a Lanczos solve at tol 10⁻¹⁰).  The upper
    # ends are not carried: where a statistical one fell below the proof, λ_K stays (a proof)
    lower = np.maximum.accumulate(lower[::-1])[::-1]
    crossed = lower > upper  # a statistical upper end below a later k's lower end: as above, λ_K
    upper[crossed] = np.maximum(float(lam[-1]) + leak + slack, lower[crossed])
    return CurveBracket(np.clip(value, lower, upper), lower, upper)


def _interlaced(ritz_desc: np.ndarray, j: int, K: int, leak: float) -> float:
    """A lower bound of λ_{K+j+1} from the Ritz values (descending) of PGP on a Krylov space, less
    ``leak``: the (j+1)-th where it is above 0 by more than ``leak``, else the (j+K+1)-th (PGP's K
    zeros on range(U) may sit above a negative tail), else −∞."""
    th = float(ritz_desc[j]) - leak
    if th > 0.0:
        return th
    return float(ritz_desc[j + K]) - leak if j + K < ritz_desc.size else -math.inf


def _counts(
    lam: np.ndarray, N: int, probes: list[_Rule], confidence: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """G's counting function at the breakpoints: its statistical lower and upper bounds and the block
    rules' estimate (what :func:`_eigenvalue_curve` inverts; independent of the rounding allowances)."""
    from scipy.stats import norm

    K = lam.size
    q = float(norm.ppf(0.5 + confidence / 2))
    p = len(probes)
    # breakpoints: every Gauss node and every block-rule node of the probes, the top eigenvalues (of
    # either sign: a rank-deficient G's null space holds rounded eigenvalues around 0)
    bps = np.unique(np.concatenate([lam] + [r.x for r in probes] + [np.sort(r.theta) for r in probes]))
    n_top = lambda t: np.searchsorted(-lam, -t, side="right")  # noqa: E731  #{i ≤ K: λ_i ≥ t}
    L = np.mean([r.tail_lower(bps) for r in probes], axis=0)  # ≤ mean of μ_z((t, ∞))
    Uu = np.mean([r.tail_upper(bps) for r in probes], axis=0)  # ≥ mean of μ_z([t, ∞))
    L, Uu = _with_radau(bps, L, Uu, probes)
    c = q * math.sqrt(2.0 / p)
    root_hi = (c + np.sqrt(c * c + 4 * np.maximum(Uu, 0))) / 2  # √n_tail ≤ this (n ≤ Ū + c√n)
    margin = c * root_hi
    n_lo = n_top(bps) + np.clip(L - margin, 0, N - K)
    n_hi = n_top(bps) + np.clip(Uu + margin, 0, N - K)
    est = n_top(bps) + np.mean([r.tail_closed(bps) for r in probes], axis=0)
    # n_lo, n_hi, est are non-increasing step functions of t, left-continuous at the breakpoints
    n_lo, n_hi, est = (np.minimum.accumulate(a) for a in (n_lo, n_hi, est))
    return bps, n_lo, n_hi, est


def _with_radau(
    bps: np.ndarray, L: np.ndarray, U: np.ndarray, probes: list[_Rule], points: int = _RADAU_POINTS
) -> tuple[np.ndarray, np.ndarray]:
    """The probes' mean tail bounds at the breakpoints tightened by their Gauss–Radau bounds (about half
    the Gauss ones' gap) at up to ``points`` of them (Radau costs a tridiagonal eigh per point): a
    tail bound at t' carries to every t on its side by monotonicity — μ((t, ∞)) ≥ μ((t', ∞)) for
    t ≤ t', μ([t, ∞)) ≤ μ([t', ∞)) for t ≥ t'.  The upper bound at a breakpoint holds on the whole
    interval from the breakpoint before it (what λ_k's upper end needs): it comes from a t' below
    that interval."""
    if bps.size == 0:
        return L, U
    T = bps[np.unique(np.linspace(0, bps.size - 1, min(points, bps.size)).round().astype(int))]
    rad = [r.radau(T) for r in probes]
    Lr, Ur = np.mean([a for a, _ in rad], axis=0), np.mean([b for _, b in rad], axis=0)
    j = np.searchsorted(T, bps, side="left")  # the smallest T ≥ t
    ok = j < T.size
    L = L.copy()
    L[ok] = np.maximum(L[ok], Lr[j[ok]])
    # the largest T < t (not ≤): the upper count at a breakpoint must hold on the whole interval
    # down to the breakpoint before it — λ_k's upper end is the last breakpoint where it is still
    # ≥ k — and a Radau bound at T says nothing about t just below T
    j = np.searchsorted(T, bps, side="left") - 1
    ok = j >= 0
    U = U.copy()
    U[ok] = np.minimum(U[ok], Ur[j[ok]])
    return L, U


def _last_at_least(t: np.ndarray, n: np.ndarray, k: int, default: float) -> float:
    """The largest t_j with n_j ≥ k (n non-increasing along ascending t), else ``default``."""
    j = np.searchsorted(-n, -k, side="right") - 1  # n ≥ k on t[:j+1]
    return float(t[j]) if j >= 0 else default


def _energy_curve(
    lam: np.ndarray,
    N: int,
    ks: np.ndarray,
    eig: CurveBracket,
    rules: list[_Rule],
    norm2: float,
    top2: np.ndarray | None,
    slack: float = 0.0,
    shift: float = 0.0,
    rotation: float = 0.0,
    leak: float = 0.0,
    tail_top: float = -math.inf,
    next_upper: float = math.inf,
    ramp_delta: float | None = None,
) -> CurveBracket:
    """E(φ, k) with its bracket: exact for k ≤ K, the tail measure's bounds at λ_k's bracket beyond;
    ``slack`` (16·eps of the products) widens each side for the products' rounding (float32: the
    bound holds for the rounded products' moments, which differ from G's by about eps); ``shift``
    (the exact route's eigenvalue rounding, :class:`_Floor`) moves the thresholds outwards, so that
    eigenvalues the rounding may reorder around λ_k — the whole null space of a rank-deficient G,
    whose eigenvectors the exact route orders arbitrarily — count on both sides.  ``leak`` (the top
    eigenvectors' residual bound ‖R‖₂, :func:`_top_leak`) widens what counts as a cluster in the top
    part: a solver's eigenvectors rotate between eigenvalues ‖R‖ apart; ``tail_top`` (the deflated
    operator's largest Ritz value) tells a cluster that straddles K: λ_{K+1} within it of λ_K.

    The top part's E(φ, k) = ‖U_kᵀφ‖² / ‖φ‖² is the given eigenvectors' (a top-k solve's, residual
    R = GU − UΛ', ‖R‖₂ ≤ ``leak``).  Davis–Kahan's sin Θ theorem (residual form) against G's top-k
    eigenvectors V_k: U_kᵀGU_k's eigenvalues are ≥ θ_k − ‖R‖₂ and G's (k+1)-th is ≤ θ_{k+1} + ‖R‖₂
    (Weyl on G̃ = G − RUᵀ − URᵀ, :func:`_top_leak`; for k = K, ``next_upper``, λ_{K+1}'s upper end),
    so with g the difference of the two (less δ₆₄ more, for margin), ‖U_kU_kᵀ − V_kV_kᵀ‖₂ = ‖sin Θ‖₂
    ≤ ‖R‖₂ / g, and E moves by at most that: each top k's bracket holds E ± it (none where g ≤ 0: a
    cluster, which the bounds at its ends carry over by monotonicity).  Where that bound is below
    ``_DK_POINT`` (10⁻⁸) E stays a point (a stated resolution: an exact top part is a point, as the
    pipeline and its readers take it).  Before, the top part was always a point: a Lanczos solve's
    eigenvectors (residual 10⁻¹³) between eigenvalues 5.9·10⁻¹¹ apart (λ_31 … λ_40 ≈ 10⁻⁸·λ_1,
    N = 200) put E 1.5·10⁻⁶ off a dense eigh's.  The exact route's own rotation there (its backward
    error δ₆₄ over those gaps) stays the module docstring's "not covered".  Beyond the top, the ramps'
    perturbation is δ₆₄ + √2·‖R‖_F (M − G̃ = Δ + RUᵀ + URᵀ, M the exact route's G + Δ: the tail's
    measure is G̃'s, whose top eigenvectors are U exactly)."""
    nk = ks.size
    if top2 is None or not np.isfinite(norm2):
        nan = np.full(nk, np.nan)
        return CurveBracket(nan, nan.copy(), nan.copy())
    K = lam.size
    value, lower, upper = np.zeros(nk), np.zeros(nk), np.zeros(nk)
    top = ks <= K
    value[top] = lower[top] = upper[top] = top2[ks[top] - 1] / norm2
    desc = -lam  # ascending, for searchsorted
    top2_at = lambda n: np.where(n > 0, top2[np.maximum(n, 1) - 1], 0.0)  # noqa: E731  Σ_{i≤n}⟨v_i, φ⟩²
    if shift > 0 and top.any():
        # top eigenvalues within the rounding 2·shift of a neighbour (G's null space above all), or
        # within 4·leak (a solver's eigenvectors, residual ‖R‖, rotate between such eigenvalues: E off by
        # 7·10⁻⁸ at Lanczos's tolerance 10⁻¹⁰ on pairs 10⁻¹¹·λ_1 apart): the exact route may rotate and
        # reorder their eigenvectors, so E(k) is only known between the energies before and after
        # the cluster — a cluster reaching K takes in the tail's eigenvalues within it of λ_K (the
        # largest Ritz value of the deflated operator, its top eigenvalue from below, there: a repeated
        # λ_K = λ_{K+1} put E(φ, K) at a zero-width value 0.996 from another eigh's)
        tie = 2 * shift + 4 * leak
        kt = ks[top]
        a = np.searchsorted(desc, -(lam[kt - 1] + tie), side="left")  # #{λ_i > λ_k + tie}
        b = np.searchsorted(desc, -(lam[kt - 1] - tie), side="right")  # #{λ_i ≥ λ_k − tie}
        cl = (a + 1 < kt) | (b > kt) | ((b == K) & (tail_top + leak >= lam[kt - 1] - tie))
        if cl.any():
            hi = top2_at(b[cl]) + np.where(
                b[cl] == K, sum(r.radau(lam[kt[cl] - 1] - tie)[1] for r in rules) if rules else 0.0, 0.0
            )
            idx = np.nonzero(top)[0][cl]
            lower[idx] = top2_at(a[cl]) / norm2
            upper[idx] = np.minimum(hi / norm2 + slack, 1.0)
    if top.any() and leak > 0:
        # Davis–Kahan at every top index (the docstring), carried by monotonicity over the indices
        # between reported k: where g ≤ 0 (a cluster) the bounds at the cluster's ends hold
        g = lam - rotation - leak - np.append(lam[1:] + leak + rotation, next_upper + rotation)
        h = np.where(g > 0, leak / np.where(g > 0, g, 1.0), np.inf)
        h[h < _DK_POINT] = 0.0  # a point where the bound is below any plotted resolution (docstring)
        e = top2 / norm2
        dk_lo = np.maximum.accumulate(e - h)  # E(k) ≥ E(i) ≥ e_i − h_i for i ≤ k
        dk_hi = np.minimum.accumulate((e + h)[::-1])[::-1]  # E(k) ≤ E(i) ≤ e_i + h_i for k ≤ i ≤ K
        kt = ks[top]
        lo_k, hi_k = dk_lo[kt - 1], dk_hi[kt - 1]
        lower[top] = np.where(lo_k < e[kt - 1], np.minimum(lower[top], lo_k - slack), lower[top])
        upper[top] = np.where(hi_k > e[kt - 1], np.maximum(upper[top], hi_k + slack), upper[top])
    tail = ~top
    if tail.any():
        v_t = eig.value[tail]
        low, high = np.full(v_t.size, -np.inf), np.full(v_t.size, np.inf)
        # ``ramp_delta``: the tail eigenvectors' rotation the ramps hold — the float64 reduction's δ₆₄, or a float32
        # G's δ₃₂ (its exact route reduces it in float32: with δ₆₄ there E(residual, 54) lay 1.15·10⁻⁵ above
        # its bracket, a GRU's and a cross-entropy MLP's float32 runs — Audit Q3; the readers' float32 exact
        # route already held that rotation)
        for w, turn in _ramps((rotation if ramp_delta is None else ramp_delta) + math.sqrt(2.0) * leak):
            lo_t, hi_t = eig.upper[tail] + shift + w, eig.lower[tail] - shift - w
            # the top part above each threshold (all of it unless the threshold reaches the top's eigenvalues)
            base_lo = top2_at(np.searchsorted(desc, -lo_t, side="left"))  # Σ over λ_i > lo_t
            base_hi = top2_at(np.searchsorted(desc, -hi_t, side="right"))  # Σ over λ_i ≥ hi_t
            above = (base_lo + sum(r.radau(lo_t)[0] for r in rules)) / norm2  # μ((lo_t, ∞)) ≥ above
            at = (base_hi + sum(r.radau(hi_t)[1] for r in rules)) / norm2  # μ([hi_t, ∞)) ≤ at
            # the products' rounding (slack, added to every end below) enters the sin Θ ends before them:
            # near a = 1 they move by ~2c√slack, not slack (a review: 9.8e-4 at float32's slack, c = 0.5)
            low = np.maximum(low, np.maximum(above - turn, _sin_theta_lower(above - slack, turn) + slack))
            high = np.minimum(high, np.minimum(at + turn, _sin_theta_upper(at + slack, turn) - slack))
        # E(φ, k) counts λ_k itself: λ_k's estimate is a node of the rules (of the same eigenvalue, in
        # another run's rounding), so the estimate takes the nodes within a rounding band below it too —
        # at the node itself, one ulp moved a whole node's weight in or out (0.07 between a run on 1
        # and on 2 BLAS threads, an audit)
        band = np.maximum(shift, 1e-6 * np.abs(v_t))
        val = top2[-1] + sum(r.tail_closed(v_t - band) for r in rules)
        lo_, hi_ = np.maximum(low - slack, 0.0), np.minimum(high + slack, 1.0)
        # bounds that cross (numerical trouble in a rule) keep both ends rather than collapse onto one
        lower[tail], upper[tail] = np.minimum(lo_, hi_), np.maximum(lo_, hi_)
        # E is non-decreasing in k: carry the bounds along the reported k
        lower[tail] = np.maximum.accumulate(np.maximum(lower[tail], lower[top].max(initial=0.0)))
        upper[tail] = np.minimum.accumulate(upper[tail][::-1])[::-1]
        value[tail] = np.clip(val / norm2, lower[tail], upper[tail])
        null = np.abs(eig.value[tail]) <= shift if shift > 0 else np.zeros(v_t.size, bool)
        if null.any():
            # λ_k's estimate within the rounding δ of 0 (G's numerical null space): the rules' nodes there all
            # sit at ~0, so the estimate counted every one — E = 1 at the bracket's top from the rank on (an
            # audit: 1.000 drawn where the exact route gave 0.926 … 0.977, inside [0.913, 1]).  There φ's
            # energy left is spread evenly over the k left (what a basis of the null space the exact route
            # may pick gives on average), inside the bracket
            kt, first = ks[tail], int(np.argmax(null))
            k0, v0 = (int(kt[first - 1]), float(value[tail][first - 1])) if first else (K, float(top2[-1] / norm2))
            ramp = v0 + (1.0 - v0) * (kt - k0) / max(N - k0, 1)
            value[tail] = np.where(null & (np.arange(kt.size) >= first), ramp, value[tail])
        value[tail] = np.clip(np.maximum.accumulate(value[tail]), lower[tail], upper[tail])
    last = ks == N
    value[last] = lower[last] = upper[last] = 1.0  # E(φ, N) = 1
    # E(φ, k) ≤ E(φ, k') for k < k': a top cluster's upper end (its window reaching into the tail: the
    # tail's whole measure down to λ_k − tie) is also bounded by the tail's upper ends after it — it
    # stood 0.22 above the next k's upper end with λ_31 … λ_40 = 10⁻⁸·λ_1 in the top part of a Lanczos solve
    upper = np.minimum.accumulate(upper[::-1])[::-1]
    lower = np.maximum.accumulate(lower)
    # rounding (‖Uᵀφ‖² can pass ‖φ‖² by an ulp) must not put a value outside [0, 1] or its bracket
    lower = np.clip(lower, 0.0, 1.0)
    upper = np.clip(upper, lower, 1.0)
    return CurveBracket(np.clip(value, lower, upper), lower, upper)


def _widest(
    lam: np.ndarray,
    N: int,
    ks: np.ndarray,
    got: CurveBracket,
    plain: CurveBracket,
    rules: list[_Rule],
    norm2: float,
    top2: np.ndarray | None,
) -> dict[str, float]:
    """Where φ's E bracket is widest and what it is made of there: ``rounding`` (the part the exact
    route's rounding δ adds — the bracket less the one with δ = 0, ``plain`` λ_k brackets and
    unshifted thresholds), ``phi`` (φ's own Gauss–Radau gap at λ_k's estimate: φ's Lanczos run) and
    ``eigenvalue`` (the rest: λ_k's bracket, i.e. the probes' resolution and their statistics).  An
    account for choosing knobs, not a bound; empty where E is not defined."""
    width = got.upper - got.lower
    if top2 is None or not np.isfinite(norm2) or not np.isfinite(width).any():
        return {}
    i = int(np.nanargmax(width))
    out = {"width": float(width[i]), "k": int(ks[i]), "energy": float(got.value[i])}
    if ks[i] <= lam.size or width[i] <= 0:
        return {**out, "rounding": float(width[i]), "phi": 0.0, "eigenvalue": 0.0}
    bare = _energy_curve(lam, N, ks, plain, rules, norm2, top2)
    w0 = float(min(max(bare.upper[i] - bare.lower[i], 0.0), width[i]))
    t = plain.value[i : i + 1]
    gap = sum(float(np.subtract(*r.radau(t)[::-1])[0]) for r in rules) / norm2 if rules else 0.0
    phi = float(min(max(gap, 0.0), w0))
    return {**out, "rounding": float(width[i]) - w0, "phi": phi, "eigenvalue": w0 - phi}


def _bracket_at(curves: SpectralCurves, k: int) -> tuple[float, float]:
    i = int(np.searchsorted(curves.k, k))
    return float(curves.eigenvalue.lower[i]), float(curves.eigenvalue.upper[i])


def describe_width(name: str, curves: SpectralCurves) -> str:
    """One sentence: where E(``name``, k)'s bracket is widest, what it is made of there and which knob
    narrows each part ("" when E is not defined)."""
    w = curves.notes.get("widest", {}).get(name) or {}
    if not w or w["width"] <= 0:
        return ""
    notes = curves.notes
    storage = notes.get("storage_eps", 0.0) > 4 * float(np.finfo(np.float64).eps)  # a float32 G or products
    knob = {
        "rounding": "the stored G's rounding δ = {:.3g} ({})".format(
            notes.get("rounding_delta", float("nan")),
            "a float32 G: only spectrum.dtype: float64 narrows it"
            if storage
            else "float64 already: no knob narrows it",
        ),
        "eigenvalue": "λ_k's bracket [{:.3g}, {:.3g}] (more quadrature.lanczos_steps, a larger quadrature.top "
        "or more probes narrow it, each at more products)".format(*_bracket_at(curves, w["k"])),
        "phi": "φ's own quadrature (quadrature.phi_steps narrows it)",
    }
    parts = sorted(((w.get(p, 0.0), p) for p in knob), reverse=True)
    body = "; ".join(f"{v:.3f} {knob[p]}" for v, p in parts if v > 0.0005 * max(w["width"], 1e-300))
    return f"E({name}, k)'s bracket is widest at k = {w['k']}: {w['width']:.3f}" + (f" — {body}" if body else "")


_DK_POINT = 1e-8  # E's top part stays a point where its Davis–Kahan half-width is below this (_energy_curve)
_RAMPS = tuple(2.0**j for j in range(1, 23, 2))  # ramp widths w / δ tried (δ/w: 0.5 … 4.8e-7)


def _ramps(delta: float) -> list[tuple[float, float]]:
    """``(w, δ/w)`` pairs for E's bracket where the exact route's eigenvectors are those of G + Δ,
    ‖Δ‖_F ≤ δ (a float64 reduction's backward error, ``_Floor.rotation``): near-equal eigenvalues
    rotate into each other there, so a threshold moved out by δ alone does not hold E (eigenvalue
    pairs 4δ apart put E outside by up to 8·10⁻⁴).  For a ramp r from 0 to 1 over a width w with
    r ≥ 1[x ≥ t] (or ≤), |φᵀ(r(G + Δ) − r(G))φ| ≤ ‖φ‖²·‖Δ‖_F / w (a function of slope 1/w is
    Lipschitz with that constant in the Frobenius norm of symmetric matrices), so
    E ≤ μ_φ([t − w, ∞))/‖φ‖² + δ/w and E ≥ μ_φ((t + w, ∞))/‖φ‖² − δ/w for every w: each w gives a
    bound, the tightest is kept — and the same windows give Davis–Kahan's bounds
    (:func:`_sin_theta_lower`, :func:`_sin_theta_upper`), tighter where φ's energy is almost all on
    one side of the threshold: y's widest bracket at N = 10⁴ lay there.  A float32 G's own storage
    rounding (``_Floor.delta`` beyond this) stays a threshold shift — its exact route's eigenvectors
    are those of a float32 reduction, a model (the worst case would blur E by ~0.1 over G's dense
    part at N = 10⁴).  δ = 0: the plain thresholds."""
    if delta <= 0:
        return [(0.0, 0.0)]
    return [(f * delta, 1.0 / f) for f in _RAMPS]


def _sin_theta_lower(a: np.ndarray, c: float) -> np.ndarray:
    """E's lower end from Davis–Kahan where the ramp's is loose: with P the exact route's projector on
    its eigenvalues above t (M = G + Δ, ‖Δ‖₂ ≤ δ) and Q G's on its eigenvalues above t + w, the sin Θ
    theorem gives ‖(I − P)Q‖₂ ≤ δ/w = ``c``, so ‖(I − P)φ‖ ≤ ‖(I − Q)φ‖ + c·‖Qφ‖ and
    E ≥ 1 − (√(1 − a) + c·√a)² for a = ‖Qφ‖²/‖φ‖² ≥ ``a`` (the bound falls with a only above
    c²/(1 + c²), its maximum 1 + c² there).  Where φ's energy is almost all above the threshold (y and
    f late in the curve) the loss is ≈ 2c·√(a(1 − a)) against the ramp's c: a tenth at a = 0.99."""
    a = np.clip(np.maximum(a, c * c / (1.0 + c * c)), 0.0, 1.0)
    return 1.0 - (np.sqrt(1.0 - a) + c * np.sqrt(a)) ** 2


def _sin_theta_upper(b: np.ndarray, c: float) -> np.ndarray:
    """E's upper end the same way: P the exact route's projector on its eigenvalues ≥ t, Q G's on
    its eigenvalues ≥ t − w, ‖P(I − Q)‖₂ ≤ c, so ‖Pφ‖ ≤ ‖Qφ‖ + c·‖(I − Q)φ‖ and
    E ≤ (√b + c·√(1 − b))² for b = ‖Qφ‖²/‖φ‖² ≤ ``b`` (the bound rises with b below 1/(1 + c²))."""
    b = np.clip(np.minimum(b, 1.0 / (1.0 + c * c)), 0.0, 1.0)
    return (np.sqrt(b) + c * np.sqrt(1.0 - b)) ** 2


def _density(lam: np.ndarray, N: int, probes: list[_Rule], n_grid: int) -> tuple[np.ndarray, np.ndarray]:
    """G's spectral density: the top eigenvalues and the probes' block rules (the tail's measure,
    E = Σ_{i>K} δ_λi) as atoms (:func:`atoms_density`)."""
    atoms = [lam], [np.ones(lam.size)]
    for r in probes:
        atoms[0].append(r.theta)
        atoms[1].append(r.nu / len(probes))
    return atoms_density(np.concatenate(atoms[0]), np.concatenate(atoms[1]), n_grid)


def atoms_density(x: np.ndarray, w: np.ndarray, n_grid: int) -> tuple[np.ndarray, np.ndarray]:
    """A density of λ on a log-spaced grid from atoms (x_j, w_j), each broadened log-normally by 0.05
    decades (G's spectrum spans decades), normalised so that the trapezoid rule over the grid gives 1;
    atoms ≤ 0 (G's null space) are left out."""
    keep = (x > 0) & (w > 0)
    x, w = x[keep], w[keep]
    if x.size == 0:
        return np.linspace(0.0, 1.0, n_grid), np.full(n_grid, np.nan)
    hi, lo = float(x.max()), float(max(x.min(), x.max() * 1e-12))
    s = 0.05
    grid = np.logspace(math.log10(lo) - 4 * s, math.log10(hi) + 4 * s, n_grid)
    lg, lx = np.log10(grid)[:, None], np.log10(x)[None, :]
    dens = (np.exp(-0.5 * ((lg - lx) / s) ** 2) * w).sum(axis=1) / (grid * math.log(10) * s * math.sqrt(2 * math.pi))
    total = float(np.trapezoid(dens, grid))
    return grid, dens / total if total > 0 else dens
