"""Would the probes' blocks give tighter counting-function bounds?  An experiment, not the product.

docs/curves.md, "(4) The probes' blocks do not narrow the bounds": the quadrature route bounds each
probe's spectral measure with that column's own m-node Gauss rule.  A block of b columns resolves
the spectrum with b·m Ritz values; this script checks whether the block's rules keep the
Chebyshev–Markov–Stieltjes inequalities (they have no proof), and what they would give.

    python benchmarks/block_bounds.py random [--seeds 3 5 6] [--trials 400] [--bmax 12]
        worst violation over random spectra, in trace, per column and in the Loewner order, of the
        block Gauss–Radau rule at t (t an eigenvalue of multiplicity b of the extended block
        Jacobi matrix): M((−∞,t)) ⪰ Σ_{θ<t} W and M((−∞,t]) ⪯ Σ_{θ≤t} W;
    python benchmarks/block_bounds.py gram G.npy EXACT.npz [--top 100] [--m 60] [--blocks 2] [--b 12]
        the block rule's bracket of the deflated tail count at a few exact λ_k of a stored G
        (EXACT.npz: ``w`` every eigenvalue descending, ``V`` at least ``top`` eigenvectors).
"""

from __future__ import annotations

import argparse

import numpy as np


def block_lanczos(matmat, Z: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(T, R0): the (m+1)-block Jacobi matrix of ``matmat`` from Z = Q1·R0 (full reorthogonalisation)."""
    b = Z.shape[1]
    Q, R0 = np.linalg.qr(Z)
    Qs, Qp, Bp = [Q], np.zeros_like(Q), np.zeros((b, b))
    T = np.zeros((b * (m + 1), b * (m + 1)))
    for j in range(m + 1):
        W = matmat(Q) - Qp @ Bp.T
        Aj = Q.T @ W
        W = W - Q @ Aj
        Qa = np.hstack(Qs)
        for _ in range(2):
            W -= Qa @ (Qa.T @ W)
        Qn, Bj = np.linalg.qr(W)
        T[j * b : (j + 1) * b, j * b : (j + 1) * b] = (Aj + Aj.T) / 2
        if j < m:
            T[(j + 1) * b : (j + 2) * b, j * b : (j + 1) * b] = Bj
            T[j * b : (j + 1) * b, (j + 1) * b : (j + 2) * b] = Bj.T
        Qp, Bp, Q = Q, Bj, Qn
        Qs.append(Q)
    return T, R0


def radau(T: np.ndarray, R0: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The block Gauss–Radau rule at t: nodes, their weight vectors (rows), and which b nodes are t."""
    b = R0.shape[0]
    m = T.shape[0] // b - 1
    Tm, Bm = T[: b * m, : b * m], T[b * m :, b * m - b : b * m]
    Em = np.zeros((b * m, b))
    Em[-b:] = np.eye(b)
    X = np.linalg.solve(Tm - t * np.eye(b * m), Em @ Bm.T)
    Om = t * np.eye(b) + Bm @ Em.T @ X
    Tt = T.copy()
    Tt[b * m :, b * m :] = (Om + Om.T) / 2
    th, S = np.linalg.eigh(Tt)
    at = np.zeros(th.size, bool)
    at[np.argsort(np.abs(th - t))[:b]] = True  # the b eigenvalues at t (by construction)
    return th, S[:b, :].T @ R0, at


def random_cases(seed: int, trials: int, bmax: int) -> tuple[float, float, float, float]:
    rng = np.random.default_rng(seed)
    worst = [0.0, 0.0, 0.0, 0.0]  # Radau: Loewner, trace, per column; block Gauss nodes: trace (of tr(ZᵀZ))
    for trial in range(trials):
        N, b = int(rng.integers(30, 200)), int(rng.integers(1, bmax + 1))
        m = int(rng.integers(1, max(2, N // (3 * b))))
        kind = trial % 4  # uniform; 20 decades; 6 clusters; two groups 10³ apart
        if kind == 0:
            lam = rng.random(N)
        elif kind == 1:
            lam = np.exp(-rng.random(N) * 20)
        elif kind == 2:
            lam = np.round(rng.random(N) * 5) / 5 + 1e-3 * rng.random(N)
        else:
            lam = np.concatenate([rng.random(N // 2) * 1e-3, 1 + rng.random(N - N // 2)])
        V = np.linalg.qr(rng.standard_normal((N, N)))[0]
        A = (V * lam) @ V.T
        Z = rng.choice([-1.0, 1.0], size=(N, b)) if trial % 2 else rng.standard_normal((N, b))
        T, R0 = block_lanczos(lambda X: A @ X, Z, m)  # noqa: B023
        a, scale = V.T @ Z, float(np.trace(Z.T @ Z))
        b_m = b * m  # the block Gauss rule (T's leading m blocks) at its own nodes
        th_g, S_g = np.linalg.eigh(T[:b_m, :b_m])
        w_g = ((S_g[:b, :].T @ R0) ** 2).sum(1)
        for x in th_g:
            below, at_or_below = (a[lam < x] ** 2).sum(), (a[lam <= x] ** 2).sum()
            gap = min(below - w_g[th_g < x].sum(), w_g[th_g <= x].sum() - at_or_below)
            worst[3] = min(worst[3], gap / scale)
        for t in rng.uniform(lam.min() - 0.01, lam.max() + 0.01, 10):
            th, C, at = radau(T, R0, t)
            lt = (th < t) & ~at
            le = lt | at
            d1 = a[lam < t].T @ a[lam < t] - C[lt].T @ C[lt]
            d2 = C[le].T @ C[le] - a[lam <= t].T @ a[lam <= t]
            worst[0] = min(worst[0], np.linalg.eigvalsh(d1).min() / scale, np.linalg.eigvalsh(d2).min() / scale)
            worst[1] = min(worst[1], np.trace(d1) / scale, np.trace(d2) / scale)
            worst[2] = min(worst[2], np.diag(d1).min() / scale, np.diag(d2).min() / scale)
    return worst[0], worst[1], worst[2], worst[3]


def gram(path: str, exact: str, top: int, m: int, blocks: int, b: int) -> None:
    G, z = np.load(path), np.load(exact)
    w, U = z["w"], z["V"][:, :top]
    N = G.shape[0]

    def defl(X: np.ndarray) -> np.ndarray:
        return X - U @ (U.T @ X)

    rng = np.random.default_rng(0)
    starts = [defl(rng.choice([-1.0, 1.0], size=(N, b))) for _ in range(blocks)]
    runs = [block_lanczos(lambda X: defl(G @ defl(X)), Z, m) for Z in starts]
    p = blocks * b
    for k in (top + N // 10, int(0.2057 * N), int(0.3 * N), int(0.4 * N)):
        t = w[k - 1]
        lo = hi = 0.0
        for T, R0 in runs:
            th, C, at = radau(T, R0, t)
            mass = (C**2).sum(1)
            lo += mass[(th > t) & ~at].sum()
            hi += mass[((th > t) & ~at) | at].sum()
        count = f"[{lo / p:.1f}, {hi / p:.1f}] (mean of {p} probes)"
        print(f"k = {k}, λ_k = {t:.4g}: tail count in {count}, exact {k - top}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("random")
    r.add_argument("--seeds", type=int, nargs="+", default=[3, 5, 6])
    r.add_argument("--trials", type=int, default=400)
    r.add_argument("--bmax", type=int, default=12)
    g = sub.add_parser("gram")
    g.add_argument("G")
    g.add_argument("exact")
    g.add_argument("--top", type=int, default=100)
    g.add_argument("--m", type=int, default=60)
    g.add_argument("--blocks", type=int, default=2)
    g.add_argument("--b", type=int, default=12)
    a = ap.parse_args()
    if a.cmd == "random":
        for s in a.seeds:
            lw, tr, col, gauss = random_cases(s, a.trials, a.bmax)
            print(
                f"seed {s}: {a.trials} spectra × 10 t: block Gauss–Radau worst Loewner {lw:.3g}, trace {tr:.3g}, "
                f"per column {col:.3g}; block Gauss nodes, trace {gauss:.3g}"
            )
    else:
        gram(a.G, a.exact, a.top, a.m, a.blocks, a.b)


if __name__ == "__main__":
    main()
