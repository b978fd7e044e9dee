"""Edges of the quadrature route's brackets found by fuzzing ``spectral_curves``: λ_k's upper end
where a Gauss–Radau bound sat on a breakpoint, a statistical upper end below the proven lower end,
blocks wider than the tail, and arguments out of range.  A diagonal G makes every Rademacher probe's
measure the tail's counting measure exactly, so there a miss cannot be chance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nsa_dist.errors import NonFiniteError
from nsa_dist.linalg.quadrature import curve_ks, spectral_curves


def _exact(G: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w, V = np.linalg.eigh(G)
    return w[::-1].copy(), V[:, ::-1].copy()


def _misses(G: np.ndarray, K: int, ks: np.ndarray, **kw) -> list[str]:
    w, V = _exact(G)
    c = spectral_curves(torch.from_numpy(G), w[:K], V[:, :K], {"x": np.ones(G.shape[0])}, ks, **kw)
    e, lk = c.eigenvalue, w[ks - 1]
    out = np.nonzero((lk < e.lower) | (lk > e.upper))[0]
    return [f"k={ks[i]}: λ_k={lk[i]:.12g} outside [{e.lower[i]:.12g}, {e.upper[i]:.12g}]" for i in out]


@pytest.mark.parametrize(
    "N, spectrum, K, kw",
    [
        (157, "1/i", 20, dict(lanczos_steps=7, probes=30, block_size=6, confidence=0.99, seed=10)),
        (171, "3.4 decades", 13, dict(lanczos_steps=2, probes=8, block_size=3, confidence=0.99, seed=0)),
        (120, "3.4 decades", 10, dict(lanczos_steps=5, probes=4, block_size=2, seed=3)),
    ],
)
def test_a_diagonal_g_never_misses_lambda_k(N, spectrum, K, kw):
    """Zero-variance probes: every λ_k inside its bracket, at every k (the upper end once took a
    Gauss–Radau bound at a breakpoint for the interval below it and missed λ_{K+1} by 5·10⁵ widths)."""
    lam = np.arange(1, N + 1) ** -1.0 if spectrum == "1/i" else 10.0 ** (-3.428 * np.arange(N) / (N - 1))
    perm = np.random.default_rng(1).permutation(N)
    misses = _misses(np.diag(lam[perm]), K, np.arange(1, N + 1), **kw)
    assert not misses, f"{len(misses)} of {N - K} tail k outside: " + "; ".join(misses[:4])


def test_lambda_after_the_top_inside_for_probe_seeds_of_a_rotated_g():
    """λ_{K+1} of a non-diagonal G at 99 %: inside for (nearly) every seed — it missed for 20 of 20."""
    N, K = 157, 20
    Q, _ = np.linalg.qr(np.random.default_rng(1).standard_normal((N, N)))
    G = (Q * np.arange(1, N + 1) ** -1.0) @ Q.T
    G = (G + G.T) / 2
    ks = np.array([1, K, K + 1, K + 2, N])
    missed = [
        s for s in range(10) if _misses(G, K, ks, lanczos_steps=7, probes=30, block_size=6, confidence=0.99, seed=s)
    ]
    assert len(missed) <= 1, f"λ_k outside its 99 % bracket for probe seeds {missed} of 10"


def test_a_statistical_upper_end_below_the_proof_keeps_the_proof():
    """Where the probes' upper end falls below the Ritz (Cauchy interlacing) lower end, the bracket
    keeps the proven side and widens to λ_K, never collapsing onto the wrong value (seed 18: k = 10…15
    were zero-width brackets below λ_k)."""
    N, K = 38, 6
    rng = np.random.default_rng(1450)
    d = rng.uniform(2, 14)
    lam = 10.0 ** (-d * np.arange(N) / (N - 1))
    Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    G = (Q * lam) @ Q.T
    G = (G + G.T) / 2
    misses = _misses(G, K, np.arange(1, N + 1), lanczos_steps=47, probes=23, block_size=5, seed=18)
    assert not misses, "; ".join(misses[:4])


@pytest.mark.parametrize("N", [5, 11, 12, 13])
def test_n_below_the_block_size_runs(N):
    """The default block (12) wider than the tail: clamped, not a broadcast error."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((N, N))
    G = X @ X.T
    w, V = _exact(G)
    ks = curve_ks(N, 5)
    c = spectral_curves(G, w[:2], V[:, :2], {"y": rng.standard_normal(N)}, ks)
    lk = w[ks - 1]
    assert np.all(lk >= c.eigenvalue.lower - 1e-9) and np.all(lk <= c.eigenvalue.upper + 1e-9)


def _problem(N: int = 40, K: int = 5):
    rng = np.random.default_rng(0)
    Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    G = (Q * 10.0 ** (-4 * np.arange(N) / (N - 1))) @ Q.T
    G = (G + G.T) / 2
    w, V = _exact(G)
    return G, w[:K], V[:, :K], curve_ks(N, 20)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(confidence=95), ValueError, "confidence"),
        (dict(confidence=-0.5), ValueError, "confidence"),
        (dict(lanczos_steps=0), ValueError, "lanczos_steps"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(probes=-1), ValueError, "probes"),
        (dict(density_grid=-1), ValueError, "density_grid"),
        (dict(basis_bytes=0), ValueError, "basis_bytes"),
        (dict(phi_steps=-2), ValueError, "phi_steps"),
        (dict(phi_steps=10, phi_width=5.0), ValueError, "phi_width"),
        (dict(phi_width=0.01), ValueError, "phi_width needs phi_steps"),
        (dict(evals="ascending"), ValueError, "descending"),
        (dict(evals="nan"), ValueError, "finite"),
        (dict(phis="transposed"), ValueError, "transpose"),
        (dict(phis="list"), TypeError, "phis must map"),
        (dict(ks="fractional"), ValueError, "ks must be sorted integers"),
        (dict(G="nan torch"), NonFiniteError, "NaN"),
    ],
)
def test_bad_arguments_get_one_clear_error(change, error, match):
    G, w, V, ks = _problem()
    args = dict(G=G, evals=w, evecs=V, phis={"p": np.ones(G.shape[0])}, ks=ks)
    kw = dict(lanczos_steps=10, probes=8)
    for key, val in change.items():
        if key == "evals":
            args["evals"], args["evecs"] = {
                "ascending": (w[::-1].copy(), V[:, ::-1].copy()),
                "nan": (np.full_like(w, np.nan), V),
            }[val]
        elif key == "phis":
            P = np.random.default_rng(1).standard_normal((G.shape[0], 2))
            args["phis"] = {"p": P.T.copy()} if val == "transposed" else [P]
        elif key == "ks":
            args["ks"] = ks.astype(float) + 0.5
        elif key == "G":
            Gt = torch.from_numpy(G.copy())
            Gt[0, 0] = float("nan")
            args["G"] = Gt
        else:
            kw[key] = val
    with pytest.raises(error, match=match):
        spectral_curves(args["G"], args["evals"], args["evecs"], args["phis"], args["ks"], **kw)


@pytest.mark.parametrize("seed", range(12))
def test_energy_brackets_hold_across_near_equal_eigenvalues(seed):
    """Pairs of eigenvalues 2.5–1000 δ apart (δ the exact route's rounding): eigh's eigenvectors
    rotate within a pair by ~δ/gap, so a threshold moved out by δ alone missed E by up to 8·10⁻⁴;
    the ramp bound (E ± δ/w over a window w) holds at every k."""
    rng = np.random.default_rng(seed)
    N, K, g = int(rng.integers(5, 30)), int(rng.integers(1, 4)), float(rng.choice([2.5, 4, 10, 100, 1000]))
    lam = 10.0 ** (-3 * np.arange(N) / (N - 1))
    delta = max(8, N) * np.finfo(float).eps * lam[0]
    for i in range(1, N - 1, 2):
        lam[i + 1] = lam[i] - g * delta
    Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    G = (Q * lam) @ Q.T
    G = (G + G.T) / 2
    w, V = _exact(G)
    c = np.zeros(N)
    c[K:] = rng.standard_normal(N - K)
    phi = Q @ c
    ks = np.arange(1, N + 1)
    out = spectral_curves(
        torch.from_numpy(G), w[:K], V[:, :K], {"p": phi}, ks, lanczos_steps=40, probes=16, block_size=4, seed=seed
    )
    b = out.energy["p"]
    E = np.cumsum((V.T @ phi) ** 2) / (phi @ phi)
    miss = np.nonzero((E < b.lower - 1e-10) | (E > b.upper + 1e-10))[0]
    assert not miss.size, "; ".join(
        f"k={ks[i]}: E={E[i]:.10f} outside [{b.lower[i]:.10f}, {b.upper[i]:.10f}]" for i in miss[:4]
    )


def test_a_phi_in_the_top_eigenspace_stays_inside_zero_one_and_its_bracket():
    """φ in span(top K): ‖Uᵀφ‖² may pass ‖φ‖² by an ulp — no value above 1 nor outside its bracket
    (seen up to 2·10⁻¹⁵ by the fuzz)."""
    G, w, V, ks = _problem(N=60, K=8)
    rng = np.random.default_rng(4)
    phis = {f"top{j}": V @ rng.standard_normal(8) for j in range(6)} | {"v1": V[:, 0] * 3.0}
    c = spectral_curves(torch.from_numpy(G), w, V, phis, ks, lanczos_steps=10, probes=8)
    for name, b in c.energy.items():
        assert np.all(0.0 <= b.lower) and np.all(b.upper <= 1.0), f"{name}: bracket leaves [0, 1]"
        assert np.all(b.lower <= b.value) and np.all(b.value <= b.upper), f"{name}: value outside its bracket"


def test_repeated_phi_columns_on_a_staircase_spectrum_keep_e_inside():
    """φ with repeated columns (x, x, 2x) in its own run: the block rule repeats Ritz values, and the
    Gauss–Radau weights from the two-eigvalsh product formula were off by 8× on those near-coincident
    nodes — a zero-width E bracket 0.017 above the exact E at k = 44 (second fuzz)."""
    rng = np.random.default_rng(479)
    N = 376
    steps = curve_ks(N, int(rng.integers(5, 30)))
    lam, prev = np.empty(N), 0
    for j, k in enumerate(steps):  # a staircase 2^-j with its jumps at reported k
        lam[prev:k] = 2.0 ** (-j)
        prev = k
    lam *= 8.935474110498441e-05
    Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    G = (Q * lam) @ Q.T
    G = (G + G.T) / 2
    w, V = _exact(G)
    K = 3
    x = rng.standard_normal(N)
    P = np.column_stack([x, x, 2 * x])
    ks = curve_ks(N, 34)
    E = (np.cumsum(np.sum((V.T @ P) ** 2, axis=1)) / np.sum(P * P))[ks - 1]
    c = spectral_curves(
        torch.from_numpy(G), w[:K], V[:, :K], {"p": P}, ks,
        lanczos_steps=48, probes=8, block_size=3, seed=266, phi_steps=0, phi_width=0.05,
    )  # fmt: skip
    b = c.energy["p"]
    miss = np.nonzero((E < b.lower - 1e-10) | (E > b.upper + 1e-10))[0]
    assert not miss.size, "; ".join(
        f"k={ks[i]}: E={E[i]:.10f} outside [{b.lower[i]:.10f}, {b.upper[i]:.10f}]" for i in miss[:4]
    )


def test_ritz_lower_ends_hold_when_the_tail_sits_twelve_decades_below_the_top():
    """Outliers up to ~10⁷ over a flat cluster at 2.4·10⁻⁶ (K = 6 inside it): rounded products and
    top eigenvectors leak into PGP and put a Ritz value 2δ₆₄ above λ_{K+1}, so the interlacing lower
    end passed λ_7…λ_10 (zero width at k = 7; third fuzz)."""
    N, K = 82, 6
    rng = np.random.default_rng(121)
    o = int(rng.integers(1, 5))
    lam = np.ones(N) * 10.0 ** rng.uniform(-8, 0)
    lam[:o] = 10.0 ** rng.uniform(2, 8, o)
    lam = np.sort(lam)[::-1]
    Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    G = (Q * lam) @ Q.T
    G = (G + G.T) / 2
    misses = _misses(G, K, curve_ks(N, 40), lanczos_steps=29, probes=16, block_size=10, seed=793)
    assert not misses, "; ".join(misses[:4])


def test_an_inexact_top_eigenvector_does_not_break_the_interlacing_lower_end():
    """u_K tilted 10⁻³ towards v_{K+1} (a solver's tolerance): PGP keeps −sin·v_K + cos·v_{K+1},
    whose Rayleigh quotient passes λ_{K+1} by sin²·(λ_K − λ_{K+1}), 10⁻⁷ here, far above rounding.
    The interlacing lower end takes U's measured residual off (top_residual=None measures it); told
    the residual is 0, it claims λ_{K+1} ≥ a Ritz value above it."""
    N, K = 120, 10
    rng = np.random.default_rng(7)
    lam = np.linspace(1.0, 0.01, N) ** 2
    Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    G = (Q * lam) @ Q.T
    G = (G + G.T) / 2
    w, V = _exact(G)
    U = V[:, :K].copy()
    s = 1e-3
    U[:, K - 1] = np.sqrt(1 - s * s) * V[:, K - 1] + s * V[:, K]
    ks = np.arange(1, N + 1)
    kw = dict(lanczos_steps=40, probes=12, block_size=6, seed=1)

    def outside(**extra):
        c = spectral_curves(torch.from_numpy(G), w[:K], U, {}, ks, **kw, **extra).eigenvalue
        lk = w[ks - 1]
        return [int(k) for k, a, x, b in zip(ks, c.lower, lk, c.upper, strict=True) if k > K and not a <= x <= b]

    assert outside() == [], "the measured residual did not cover the tilted eigenvector"
    assert K + 1 in outside(top_residual=0.0), "without the residual the lower end should pass λ_{K+1}"


def test_an_all_zero_gram_gives_curves_not_an_error():
    """Every unit dead: G = 0, its top eigenvalues rounding of either sign — curves, not a refusal
    (this runs inside a training run)."""
    N, K = 50, 5
    G = np.zeros((N, N))
    w = np.array([-1e-31, -2e-31, -3e-31, -4e-31, -5e-31])
    V = np.eye(N)[:, :K]
    c = spectral_curves(torch.from_numpy(G), w, V, {"y": np.ones(N)}, curve_ks(N, 10), lanczos_steps=5, probes=4)
    assert np.isfinite(c.eigenvalue.lower).all() and np.isfinite(c.energy["y"].upper).all()


def _energy_above(w: np.ndarray, V: np.ndarray, phi: np.ndarray, t: float, strict: bool = True) -> float:
    keep = w > t if strict else w >= t
    return float(((V[:, keep].T @ phi) ** 2).sum() / (phi @ phi))


@pytest.mark.parametrize("seed", range(6))
def test_sin_theta_bounds_hold_for_any_perturbation_of_the_norm(seed):
    """E's Davis–Kahan ends (``_sin_theta_lower`` / ``_upper``) against the exact projectors of M = G + Δ,
    ‖Δ‖₂ ≤ δ: random Δ, and the worst kind — a rotation between an eigenvector above the window and
    one below it, φ in their span — where sin Θ's bound is all but attained; φ with almost all its
    energy on one side (where the bound is used) and spread.  No case outside, and the worst cases
    come within 5 % of the bound's loss: a bound too loose by a factor fails too."""
    from nsa_dist.linalg.quadrature import _sin_theta_lower, _sin_theta_upper

    rng = np.random.default_rng(seed)
    N = 40
    lam = np.sort(rng.uniform(0.0, 1.0, N))[::-1]
    Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    G = (Q * lam) @ Q.T
    used = {"lower": [], "upper": []}
    for case in range(300):
        worst = case % 3 == 0
        up = int(rng.integers(0, N - 2))
        dn = int(rng.integers(up + 1, N))
        if worst:  # the window just inside the pair's gap, φ = cos α·u ∓ sin α·d, Δ = ε(udᵀ + duᵀ)
            t, width = float(lam[dn]), float(lam[up] - lam[dn]) * (1 - 1e-9)
            delta = float(rng.uniform(1e-3, 3e-2)) * width
            D = np.outer(Q[:, up], Q[:, dn])
            D = D + D.T
            alpha = float(rng.uniform(0.05, 1.5))
            sign = rng.choice([-1.0, 1.0])
            phi = np.cos(alpha) * Q[:, up] + sign * np.sin(alpha) * Q[:, dn]
        else:
            t = float(lam[up + 1])
            width = float(rng.uniform(0.2, 3.0)) * float(lam[up] - lam[min(up + 2, N - 1)] + 1e-3)
            delta = float(rng.uniform(0.01, 0.5)) * width
            D = rng.standard_normal((N, N))
            D = D + D.T
            c = np.where(lam > t, 1.0, rng.choice([0.05, 1.0])) * rng.standard_normal(N)
            phi = Q @ c
        D *= delta / np.linalg.norm(D, 2)
        wm, Vm = np.linalg.eigh(G + D)
        cw = delta / width
        # the lower end: M's energy above t against G's above t + w; the upper: M's at or above t
        # against G's at or above t − w
        a = _energy_above(lam, Q, phi, t + width)
        e_low = _energy_above(wm, Vm, phi, t)
        lo = float(_sin_theta_lower(np.array([a]), cw)[0])
        assert lo <= e_low + 1e-12, f"case {case}: lower {lo:.12f} above M's {e_low:.12f} (a = {a:.6f}, c = {cw:.3g})"
        t_up = t
        if worst:  # M's eigenvalues at or above u's (moved up by ~ε²/gap) against G's down to just above d's
            t_up = float(wm[np.argmin(np.abs(wm - lam[up]))])
            width = (t_up - float(lam[dn])) * (1 - 1e-9)
            cw = delta / width
        b = _energy_above(lam, Q, phi, t_up - width, strict=False)
        e_up = _energy_above(wm, Vm, phi, t_up, strict=False)
        hi = float(_sin_theta_upper(np.array([b]), cw)[0])
        assert e_up <= hi + 1e-12, f"case {case}: upper {hi:.12f} below M's {e_up:.12f} (b = {b:.6f}, c = {cw:.3g})"
        if worst:
            used["lower"].append((a - e_low) / (a - lo))
            used["upper"].append((e_up - b) / (hi - b))
    assert max(used["lower"]) > 0.95 and max(used["upper"]) > 0.95, {k: max(v) for k, v in used.items()}
