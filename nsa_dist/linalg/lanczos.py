"""Thick-restart block Lanczos for the top-k eigenpairs of a symmetric operator.

The Krylov basis ``V = [X_0, X_1, ...]`` grows one block of ``b`` vectors per operator
application, each block orthogonalised against the whole basis twice (full reorthogonalisation,
classical Gram–Schmidt twice: BLAS-3 only).  The projected matrix ``H = Vᵀ G V`` comes out of
the orthogonalisation coefficients, so after ``n`` columns

    G V_n = V_n H_n + P B E_lastᵀ                                  (Lanczos relation)

with ``P`` the next block and ``B = Pᵀ G X_last`` its coupling.  A Ritz pair ``(θ_i, V_n y_i)``
of ``H_n y_i = θ_i y_i`` then has the residual ``‖G V_n y_i − θ_i V_n y_i‖ = ‖B y_i[last]‖``
at no cost.  When the basis is full, the best ``l`` Ritz vectors are kept (thick restart, Wu &
Simon 2000; Stathopoulos et al. 1998): ``V ← V Y_l``, ``H ← diag(θ_l)`` plus the coupling row
``B Y_l[last]``, and the recursion continues from ``P``.  The products ``G V`` are stored too, so
the returned residuals are the true ``‖G v − λ v‖`` (not estimates) without extra products.

Rank deficiency (an invariant subspace, e.g. an NTK Gram of rank < k) is handled by padding the
next block with random directions orthogonal to the basis.  An exact eigenvalue of multiplicity
greater than the block size may be found fewer times than it occurs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nsa_dist.linalg._backend import ArrayOps, HostWorkspace, TorchOps

__all__ = [
    "LanczosConvergenceWarning",
    "LanczosResult",
    "block_lanczos",
    "block_gauss_quadrature",
    "default_block_size",
]

_DEFLATE = 1e-13  # singular values below this (× ‖G‖) of a new block are treated as zero
_CLEAN = 1e-3  # below this (× ‖G X‖) a new block is re-orthogonalised once more


class LanczosConvergenceWarning(RuntimeWarning):
    """Lanczos stopped at ``max_iter`` before every residual met the tolerance."""


@dataclass(frozen=True)
class LanczosResult:
    """Output of :func:`block_lanczos`.

    Attributes:
        evals: (k,) float64 NumPy, descending Ritz values.
        evecs: (N, k) float64 Ritz vectors, orthonormal, in the backend's array type.
        residuals: (k,) float64 NumPy, ``‖G v_i − λ_i v_i‖`` from stored products.
        n_matvec: operator applications (columns).
        n_restarts: thick restarts.
        converged: every residual ≤ tol · |λ|_max.
    """

    evals: np.ndarray
    evecs: Any
    residuals: np.ndarray
    n_matvec: int
    n_restarts: int
    converged: bool


def default_block_size(N: int, k: int) -> int:
    """Block size ``b`` = 16 (≤ k, ≤ N/4): an (N, 16) product runs at BLAS-3 speed (≈ 4 matvecs' time
    for 16 columns on a dense G) while the Krylov space stays small (fewer matvecs than b = 32)."""
    return max(1, min(16, N // 4, k))


def block_lanczos(
    matmat: Callable[[Any], Any],
    N: int,
    k: int,
    ops: ArrayOps,
    *,
    tol: float = 1e-10,
    max_iter: int | None = None,
    seed: int = 0,
    block_size: int | None = None,
    max_basis: int | None = None,
    sym_rtol: float = 1.5e-8,
    start: Any = None,
    workspace: HostWorkspace | None = None,
    warn: bool = True,
) -> LanczosResult:
    """Top-k (largest algebraic) eigenpairs of a symmetric operator by thick-restart block Lanczos.

    Stops when every Ritz residual satisfies ``‖G v_i − θ_i v_i‖ ≤ tol · max|θ|``; by the
    Kato–Temple bound each eigenvalue is then accurate to ``‖r‖² / gap``.

    Args:
        matmat: ``X (N, b) ↦ G X (N, b)`` on ``ops`` arrays, float64.
        N: dimension.
        k: number of eigenpairs, 1 ≤ k ≤ N.
        ops: array backend of ``matmat``'s inputs and outputs.
        tol: residual tolerance relative to the largest |Ritz value|.
        max_iter: most block products (default ``max(100, 10·⌈N/b⌉)``); the solver always runs
            until it has at least k Ritz vectors.
        seed: seed of the random start block (NumPy generator, identical on every backend).
        block_size: ``b`` (default :func:`default_block_size`).
        max_basis: basis columns kept before a restart (default ``max(3k, k + 8b)``, ≤ N).
        sym_rtol: relative mismatch ``|xᵀ(Gy) − yᵀ(Gx)|`` above which G counts as non-symmetric.
        start: (N, s) NumPy or ``ops`` array, a warm start (e.g. the previous recorded step's
            eigenvectors): the first block is ``orth([start · Ω, r])`` with Ω (s, b − 1) Gaussian,
            random vectors of span(start), so that the Krylov space starts with the unwanted
            eigendirections damped by how well span(start) already holds the wanted ones, and r
            one random column, so that an eigenvector orthogonal to span(start) is not invisible
            (a block-diagonal G whose new top lies in the block the last step's vectors had exact
            zeros in was otherwise never found, "converged"); b = 1: the warm vector plus an
            equal-norm random one.  s < b columns: start and b − s random ones.  None: a random
            block.
        workspace: on torch's CPU, where the basis V and the products G V (N, M) live between
            calls (:class:`~nsa_dist.linalg._backend.HostWorkspace`); None: fresh memory.
        warn: False: no LanczosConvergenceWarning (a caller that reads ``converged`` itself) — not
            ``warnings.catch_warnings()``, which swaps the process's filters under every other thread
            (a Tracker's training thread beside its analysis: Audit TS).

    Returns:
        :class:`LanczosResult`.

    Raises:
        ValueError: G is not symmetric (mismatch above ``sym_rtol · ‖G‖``).

    Warns:
        LanczosConvergenceWarning: ``max_iter`` reached before convergence.
    """
    b = block_size or default_block_size(N, k)
    M = min(N, max_basis or max(3 * k, k + 8 * b))
    M = N if M < min(N, k + 2 * b) else M  # room for k Ritz vectors plus two blocks, or all of R^N
    max_iter = max_iter or max(100, 10 * -(-N // b))
    rng = np.random.default_rng(seed)
    st = _State(ops, N, M, b, rng, sym_rtol, workspace)
    P = _start_block(ops, N, b, rng, start)  # (N, b)
    Bc = np.zeros((b, 0))  # coupling rows of P to the basis
    since_check, restarts = 0, 0
    while True:
        B, P_next = st.extend(P, Bc, matmat)  # B: (b', bp) coupling of P_next to the last block
        since_check += 1
        n, bp = st.n, P.shape[1]
        full = P_next is None or n + P_next.shape[1] > M
        if n >= k and (full or st.steps >= max_iter or since_check >= _check_every(N, n, bp, k)):
            since_check = 0
            if not full and st.steps < max_iter and B is not None and _surely_unconverged(st.H[:n, :n], B, bp, k, tol):
                Bc = np.zeros((B.shape[0], n))
                Bc[:, n - bp :] = B
                P = P_next
                continue
            theta, Y = _ritz(st.H[:n, :n])
            res = np.zeros(k) if B is None else np.linalg.norm(B @ Y[n - bp :, :k], axis=0)
            scale = float(np.abs(theta).max())
            if res.max() <= tol * scale or P_next is None or st.steps >= max_iter:
                done = P_next is None or res.max() <= tol * scale
                return st.finish(theta, Y, k, tol, done or not warn, restarts, converged=done)
            if full:
                Bc = st.restart(theta, Y, B, bp, _keep(k, M, P_next.shape[1]))
                restarts += 1
                P = P_next
                continue
        Bc = np.zeros((B.shape[0], n))
        Bc[:, n - bp :] = B
        P = P_next


def _start_block(ops: ArrayOps, N: int, b: int, rng: np.random.Generator, start: Any) -> Any:
    """The first block (N, b), orthonormal: random, or a random combination of ``start``'s columns."""
    if start is None:
        return _qr(ops, ops.from_numpy(rng.standard_normal((N, b))))
    S = ops.asarray(start)  # (N, s)
    if S.ndim != 2 or S.shape[0] != N:
        raise ValueError(f"start must be an (N, s) block with N = {N}; got shape {tuple(S.shape)}")
    s = S.shape[1]
    R = ops.from_numpy(rng.standard_normal((N, max(1, b - s))))  # (N, ≥ 1) random: never none
    if b == 1:  # one column: the warm vector plus an equal-norm random one
        x = S @ ops.from_numpy(rng.standard_normal((s, 1)))
        return _qr(ops, x / float(ops.colnorms(x).max()) + R / float(ops.colnorms(R).max()))
    if s >= b:  # b − 1 warm columns and one random one
        return _qr(ops, ops.hstack(S @ ops.from_numpy(rng.standard_normal((s, b - 1))), R))
    return _qr(ops, ops.hstack(S, R))


def block_gauss_quadrature(
    matmat: Callable[[Any], Any], Z: Any, n_steps: int, ops: ArrayOps, *, sym_rtol: float = 1.5e-8, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, int]:
    """Block Gauss quadrature of ``zᵀ f(A) z`` for the columns z of Z, from the same Krylov machinery.

    ``n_steps`` block steps from Z = Q R (no restart) give the block-tridiagonal
    ``T = Vᵀ A V = Y diag(θ) Yᵀ``; then for every polynomial f of degree ≤ 2·n_steps − 1

        z_iᵀ f(A) z_i = Σ_j f(θ_j) · ((Rᵀ Y_1)_{ij})²,    Y_1 = the first b rows of Y,

    exactly (Golub & Meurant, block Gauss rules).  Stochastic Lanczos quadrature
    (:func:`nsa_dist.hessian.slq_density`) is this with Rademacher columns.

    Args:
        matmat: ``X (N, b) ↦ A X`` on ``ops`` arrays, float64.
        Z: (N, b) start block.
        n_steps: block steps (≥ 1); stops early when the basis spans R^N.
        ops: array backend.

    Returns:
        ``(theta (n,), W (b, n), n_matvec)``: the nodes θ_j and per-column weights
        ``W[i, j] = ((Rᵀ Y_1)_{ij})²`` (row i sums to ‖z_i‖²).
    """
    N, b = Z.shape
    Q, R = _qr_r(ops, Z)  # R: (b, b) host
    st = _State(ops, N, min(N, n_steps * b), b, np.random.default_rng(seed), sym_rtol)
    P, Bc = Q, np.zeros((b, 0))
    for _ in range(n_steps):
        B, P_next = st.extend(P, Bc, matmat)
        n = st.n
        if P_next is None or n + P_next.shape[1] > st.M:
            break
        Bc = np.zeros((B.shape[0], n))
        Bc[:, n - P.shape[1] :] = B
        P = P_next
    theta, Y = np.linalg.eigh((st.H[: st.n, : st.n] + st.H[: st.n, : st.n].T) / 2)
    W = (R.T @ Y[: Q.shape[1]]) ** 2  # (b, n)
    return theta, W, st.n_matvec


class _State:
    """Basis V (N, M), products AV = G V, projected H (host), counters."""

    def __init__(
        self,
        ops: ArrayOps,
        N: int,
        M: int,
        b: int,
        rng: np.random.Generator,
        sym_rtol: float,
        workspace: HostWorkspace | None = None,
    ):
        self.ops, self.N, self.M, self.b, self.rng, self.sym_rtol = ops, N, M, b, rng, sym_rtol
        # (N, M) each; only the first n columns are ever read, and they are written first (zeroing
        # two (10⁴, 1500) blocks took 0.1 s each)
        if workspace is not None and isinstance(ops, TorchOps) and ops.device.type == "cpu":
            self.V = workspace.empty("lanczos.V", (N, M), column_major=True)
            self.AV = workspace.empty("lanczos.AV", (N, M), column_major=True)
        else:
            self.V, self.AV = ops.empty((N, M)), ops.empty((N, M))
        self.H = np.zeros((M, M))
        self.n = self.steps = self.n_matvec = 0
        self.anorm = 0.0

    def extend(self, P: Any, Bc: np.ndarray, matmat: Callable[[Any], Any]) -> tuple[np.ndarray | None, Any]:
        """Append block P (coupling rows Bc to the basis), apply G, orthogonalise, make the next block.

        Returns ``(B, P_next)``: the next block (N, b') and its coupling (b', bp) to P; both None
        when the basis spans R^N.
        """
        ops, n, bp = self.ops, self.n, P.shape[1]
        m = n + bp
        self.V[:, n:m] = P
        self.H[n:m, :n], self.H[:n, n:m] = Bc, Bc.T
        W = matmat(P)  # (N, bp)
        self.steps += 1
        self.n_matvec += bp
        self.AV[:, n:m] = W
        w_scale = float(ops.colnorms(W).max())
        W, C = _orthogonalise(ops, self.V[:, :m], W, local=bp + self.b)  # C: (m, bp) = V_mᵀ G P
        self._check_symmetric(C[:n], Bc.T, w_scale)
        self.H[n:m, n:m] = (C[n:] + C[n:].T) / 2
        self.anorm = max(self.anorm, w_scale)
        self.n = m
        b_next = min(self.b, self.N - m)
        if b_next == 0:
            return None, None
        return self._next_block(W, b_next, w_scale)

    def _next_block(self, W: Any, b_next: int, w_scale: float) -> tuple[np.ndarray, Any]:
        """Orthonormal P (N, b') spanning W's part outside the basis (random where W has none)."""
        ops = self.ops
        if b_next == W.shape[1]:  # fast path: W well conditioned, P = Q and B = R of W = Q R
            Q, R = _qr_r(ops, W)
            if np.abs(np.diag(R)).min() > _CLEAN * w_scale:
                return R, Q
        U, S = ops.svd(_column_major(ops, W))
        S = ops.to_numpy(S)
        r = min(b_next, int((S > _DEFLATE * max(self.anorm, w_scale)).sum()))
        P = ops.zeros((self.N, b_next))
        P[:, :r] = U[:, :r]
        if r < b_next:
            P[:, r:] = ops.from_numpy(self.rng.standard_normal((self.N, b_next - r)))
        if r < b_next or S[:r].min(initial=np.inf) < _CLEAN * w_scale:
            P = _qr(ops, _orthogonalise(ops, self.V[:, : self.n], P)[0])
        return ops.to_numpy(P.T @ W), P  # (b', bp), (N, b')

    def _check_symmetric(self, C_old: np.ndarray, Bc_T: np.ndarray, w_scale: float) -> None:
        if C_old.size == 0:
            return
        asym = float(np.abs(C_old - Bc_T).max())
        scale = max(self.anorm, w_scale)
        if asym > self.sym_rtol * scale:
            raise ValueError(
                f"G_or_operator is not symmetric: |xᵀ(G y) − yᵀ(G x)| = {asym:.3g} for orthonormal "
                f"x, y, i.e. {asym / scale:.3g} relative to ‖G‖ (allowed ≤ {self.sym_rtol:.1e}); "
                "top_eigenpairs needs a symmetric G"
            )

    def restart(self, theta: np.ndarray, Y: np.ndarray, B: np.ndarray, bp: int, l: int) -> np.ndarray:
        """Keep the top-l Ritz vectors; return the coupling rows (b', l) of the pending block."""
        n, ops = self.n, self.ops
        Yl = ops.from_numpy(Y[:, :l])  # (n, l)
        self.V[:, :l] = self.V[:, :n] @ Yl
        self.AV[:, :l] = self.AV[:, :n] @ Yl
        self.H[:] = 0.0
        self.H[:l, :l] = np.diag(theta[:l])
        self.n = l
        return B @ Y[n - bp :, :l]

    def finish(
        self, theta: np.ndarray, Y: np.ndarray, k: int, tol: float, quiet: bool, restarts: int, converged: bool
    ) -> LanczosResult:
        ops, n = self.ops, self.n
        Yk = ops.from_numpy(Y[:, :k])  # (n, k)
        X = self.V[:, :n] @ Yk  # (N, k)
        R = self.AV[:, :n] @ Yk - X * ops.from_numpy(theta[:k])  # (N, k)
        res = ops.to_numpy(ops.colnorms(R))
        if not quiet:
            scale = float(np.abs(theta).max()) or 1.0
            warnings.warn(
                f"Lanczos stopped after max_iter={self.steps} block products ({self.n_matvec} "
                f"matvecs) with max residual {res.max() / scale:.2e}·|λ|_max > tol={tol:.1e}; "
                "raise max_iter or use method='dense'",
                LanczosConvergenceWarning,
                stacklevel=4,
            )
        return LanczosResult(theta[:k].copy(), X, res, self.n_matvec, restarts, converged)


def _orthogonalise(ops: ArrayOps, V: Any, W: Any, local: int = 0) -> tuple[Any, np.ndarray]:
    """W − V Vᵀ W and the coefficients Vᵀ W (host), by classical Gram–Schmidt (BLAS-3).

    ``local = 0``: two passes against all of V.  ``local > 0`` (Lanczos, W = G P): the last
    ``local`` columns of V — the current and previous blocks, which hold nearly all of W by the
    three-term recurrence — twice, then one pass against all of V, and a second only for a block
    where that pass took away more than half of a column's norm (Kahan–Parlett's "twice is
    enough" test, κ = 2: otherwise one more pass cannot improve orthogonality).  A full pass
    streams the (N, m) basis twice; at N = 10⁴, k = 500 the two passes were 0.6 s of a 4–5 s
    top-500.
    """
    m = V.shape[1]
    if local <= 0 or local >= m:
        C = V.T @ W  # (m, b)
        W = W - V @ C
        C2 = V.T @ W
        W = W - V @ C2
        return W, ops.to_numpy(C + C2)
    L = V[:, m - local :]
    C_loc = L.T @ W  # (local, b)
    W = W - L @ C_loc
    C_loc2 = L.T @ W
    W = W - L @ C_loc2
    before = ops.colnorms(W)
    C = V.T @ W  # (m, b)
    W = W - V @ C
    C = ops.to_numpy(C)
    C[m - local :] += ops.to_numpy(C_loc + C_loc2)
    if bool((ops.colnorms(W) < 0.5 * before).any()):
        C2 = V.T @ W
        W = W - V @ C2
        C += ops.to_numpy(C2)
    return W, C


def _qr(ops: ArrayOps, A: Any) -> Any:
    """Q of the thin QR of a tall (N, b) block (see :func:`_qr_r`)."""
    return _qr_r(ops, A)[0]


def _qr_r(ops: ArrayOps, A: Any) -> tuple[Any, np.ndarray]:
    """Thin QR ``A = Q R`` of a tall (N, b) block: Q (N, b) on the backend, R (b, b) on the host.

    On torch's CPU by Cholesky QR twice (Fukaya et al. 2014): ``R₁ = chol(AᵀA)``, ``Q₁ = A R₁⁻¹``,
    the same for Q₁, ``R = R₂ R₁`` — four GEMMs on the product's threads and two b × b host
    Choleskys.  LAPACK's Householder QR there ran its panel loop on threads that stalled behind
    the G·V product's (on 2 shared cores a (10⁴, 32) QR took 0.23–0.4 s after a product against
    8 ms alone; 28 % of a top-500).  The fast path proves its result: when a Cholesky
    fails or ``‖QᵀQ − I‖_max > 1e-12`` (A too ill-conditioned, cond ≳ 10⁸) LAPACK's QR runs instead.
    """
    if ops.name == "torch" and ops.device.type == "cpu":
        QR = _cholesky_qr2(ops, A)
        if QR is not None:
            return QR
    Q, R = ops.qr_r(_column_major(ops, A))
    return Q, ops.to_numpy(R)


def _cholesky_qr2(ops: ArrayOps, A: Any) -> tuple[Any, np.ndarray] | None:
    """Cholesky QR twice of A (N, b), or None where it is not accurate (see :func:`_qr_r`)."""
    Q, R = A, np.eye(A.shape[1])
    for _ in range(2):
        try:
            Rk = np.linalg.cholesky(ops.to_numpy(Q.T @ Q)).T  # (b, b) upper
        except np.linalg.LinAlgError:
            return None
        if not np.isfinite(Rk).all():
            return None
        Q = Q @ ops.from_numpy(np.linalg.inv(Rk))
        R = Rk @ R
    err = np.abs(ops.to_numpy(Q.T @ Q) - np.eye(A.shape[1])).max()
    return (Q, R) if err <= 1e-12 else None


def _column_major(ops: ArrayOps, A: Any) -> Any:
    """A tall (N, b) torch block in column-major order (a copy if it is not), the order LAPACK's
    QR and SVD work in: a row-major (10⁴, 32) float64 block took 0.41 s against 2.7 ms
    column-major in torch's CPU QR (2 threads, load 9 on 2 cores).  NumPy and CuPy blocks are
    returned as they are."""
    if ops.name == "torch" and A.ndim == 2 and A.stride(0) != 1:
        return A.T.contiguous().T
    return A


def _ritz(H: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenpairs of the projected H (n, n), descending.

    By torch's LAPACK (MKL, on the threads of the G·V products): 113 ms at n = 1024 on two cores
    against 218 ms for NumPy's on one thread.  NumPy's OpenBLAS is kept off its own threads
    (:func:`_one_blas_thread`) because they spin after a call and then fight torch's MKL threads
    over the cores for the next product — with both busy, a 1000² eigh took 2.2 s instead of
    0.17 s and the tall QRs 20× longer (N = 10⁴, 2 shared cores).
    """
    theta, Y = torch.linalg.eigh(torch.from_numpy((H + H.T) / 2))
    return theta.numpy()[::-1].copy(), np.ascontiguousarray(Y.numpy()[:, ::-1])


def _surely_unconverged(H: np.ndarray, B: np.ndarray, bp: int, k: int, tol: float, m: int = 8) -> bool:
    """Whether a convergence check would certainly fail, at ~40 % of its cost: the residuals of the
    m Ritz pairs at and above the k-th (the last of the top k to converge on a decaying spectrum)
    from a partial eigh (LAPACK ``evr``, m vectors), against ``tol · ‖H‖_∞`` ≥ ``tol · max|θ|``.

    A miss here is a miss of the full check (for the same vectors), so skipping that check changes
    no result; a pass proves nothing and the full check runs.  At k = 500, N = 10⁴ the checks are
    ~10 full (n, n) eighs per top-k (0.2 s each at n = 1024, one thread): this leaves one."""
    n = H.shape[0]
    m = min(m, k)
    Hs = (H + H.T) / 2
    import scipy.linalg as sl

    with _one_blas_thread():
        _, Y = sl.eigh(Hs, subset_by_index=[n - k, n - k + m - 1], driver="evr", check_finite=False)
    res = np.linalg.norm(B @ Y[n - bp :], axis=0)
    return bool(res.max() > tol * np.abs(Hs).sum(axis=1).max())


_BLAS: list[Any] = []  # the process's ThreadpoolController, made on first use (it scans loaded libraries)


def _one_blas_thread() -> Any:
    """Context manager: NumPy/SciPy's BLAS on one thread inside (threadpoolctl)."""
    if not _BLAS:
        from threadpoolctl import ThreadpoolController

        _BLAS.append(ThreadpoolController())
    return _BLAS[0].limit(limits=1, user_api="blas")


def _check_every(N: int, n: int, b: int, k: int) -> int:
    """Block steps between convergence checks: keep the (n, n) eigh (~8n³ flops) ≲ the 2N²b products,
    and let the basis grow by ≥ k/10 columns between checks (the top k need n ≈ 1.2–2k columns on
    decaying spectra; checking every block at n ≈ k cost more than the products at k = 500)."""
    return max(1, math.ceil(8 * n**3 / (2 * N * N * b)), math.ceil(k / (10 * b)))


def _keep(k: int, M: int, b_next: int) -> int:
    """Ritz vectors kept at a restart: k plus half the spare room (Wu & Simon), leaving room for a block."""
    return max(k, min(k + (M - k) // 2, M - b_next))
