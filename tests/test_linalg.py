"""Every eigensolver path against the dense float64 reference ``torch.linalg.eigh`` (STYLE 9, 10).

One abstract suite, :class:`EigenSuite`, runs on every backend: NumPy on the CPU, the torch
array module on the CPU (the GPU code path, minus the GPU), and — marked ``gpu``, skipped
cleanly without CUDA — torch on CUDA and CuPy.  A failing comparison names the entries that
differ and by how much.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import numpy as np
import pytest
import torch
from scipy.sparse.linalg import aslinearoperator

from nsa_dist.errors import MissingDependencyError, NonFiniteError, ShapeError
from nsa_dist.linalg import Eigenpairs, EigMethod, LanczosConvergenceWarning, top_eigenpairs

TOL = 1e-10  # top_eigenpairs' default residual tolerance
RTOL_EVALS = 1e-8  # eigenvalues, relative
RTOL_RESIDUAL = 1e-6  # ‖G v − λ v‖ / λ_max
HAS_CUDA = torch.cuda.is_available()
HAS_CUPY = importlib.util.find_spec("cupy") is not None


# ---------------------------------------------------------------- matrices and references


def decaying(N: int) -> np.ndarray:
    """NTK-like power-law spectrum λ_i = i⁻²."""
    return np.arange(1, N + 1, dtype=np.float64) ** -2.0


def repeated(N: int) -> np.ndarray:
    """Clusters of multiplicity 3, 2 and 4 at the top, then a decaying tail."""
    head = np.array([4.0, 4.0, 4.0, 2.0, 1.5, 1.5, 1.0, 1.0, 1.0, 1.0])
    return np.concatenate([head, 0.5 * decaying(N - len(head))])


@functools.cache
def psd(N: int, spectrum: str = "decaying", seed: int = 0) -> np.ndarray:
    """(N, N) float64 ``Q diag(λ) Qᵀ`` with Haar-random Q (read-only, cached)."""
    lam = {"decaying": decaying, "repeated": repeated}[spectrum](N)
    Q, R = np.linalg.qr(np.random.default_rng(seed).standard_normal((N, N)))
    Q *= np.sign(np.diag(R))
    G = (Q * lam) @ Q.T
    G = (G + G.T) / 2
    G.setflags(write=False)
    return G


@functools.cache
def reference(N: int, spectrum: str = "decaying", seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """torch.linalg.eigh of :func:`psd`, descending: evals (N,), evecs (N, N)."""
    w, V = torch.linalg.eigh(torch.tensor(psd(N, spectrum, seed)))
    return w.numpy()[::-1].copy(), V.numpy()[:, ::-1].copy()


def low_rank(N: int, rank: int, seed: int = 1) -> np.ndarray:
    """(N, N) PSD ``A Aᵀ`` of the given rank (a Gram with fewer features than points)."""
    A = np.random.default_rng(seed).standard_normal((N, rank))
    return A @ A.T


def clusters(evals: np.ndarray, rtol: float = 1e-6) -> list[slice]:
    """Index ranges of (near-)equal eigenvalues, gap ≤ rtol·λ_max within a cluster."""
    cuts = np.nonzero(np.abs(np.diff(evals)) > rtol * np.abs(evals).max())[0] + 1
    edges = [0, *cuts.tolist(), len(evals)]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


# ---------------------------------------------------------------- assertions with diagnostics


def assert_evals_close(got: np.ndarray, want: np.ndarray, rtol: float = RTOL_EVALS) -> None:
    assert got.shape == want.shape, f"evals shape {got.shape}, want {want.shape}"
    floor = 1e-4 * np.abs(want).max()  # below 1e-4·λ_max the test is absolute, 1e-12·λ_max: rounding
    err = np.abs(got - want) / np.maximum(np.abs(want), floor)
    bad = np.nonzero(err > rtol)[0]
    assert bad.size == 0, (
        f"{bad.size} eigenvalues differ (rel. err > {rtol:g}) at indices {bad[:10].tolist()}: "
        f"got {got[bad[:10]]}, want {want[bad[:10]]}, rel. err {err[bad[:10]]}"
    )


def residuals(G: np.ndarray, ep: Eigenpairs) -> np.ndarray:
    """‖G v_i − λ_i v_i‖ per column."""
    return np.linalg.norm(G @ ep.evecs - ep.evecs * ep.evals, axis=0)


def assert_residuals_small(G: np.ndarray, ep: Eigenpairs, rtol: float = RTOL_RESIDUAL) -> None:
    res = residuals(G, ep) / np.abs(ep.evals).max()
    bad = np.nonzero(res > rtol)[0]
    assert bad.size == 0, (
        f"{bad.size} residuals ‖Gv − λv‖/λ_max > {rtol:g} at columns {bad[:10].tolist()}: {res[bad[:10]]}"
    )


def assert_orthonormal(V: np.ndarray, atol: float = 1e-10) -> None:
    err = np.abs(V.T @ V - np.eye(V.shape[1]))
    i, j = np.unravel_index(err.argmax(), err.shape)
    assert err.max() <= atol, f"VᵀV − I has entry ({i}, {j}) = {err.max():.2e} > {atol:g}"


def assert_subspaces_close(G: np.ndarray, ep: Eigenpairs, ref_evals: np.ndarray, ref_evecs: np.ndarray) -> None:
    """Per cluster of equal reference eigenvalues inside the top k: the largest principal angle
    between computed and reference eigenvectors within 10× the Davis–Kahan bound ‖R‖ / gap at the
    solvers' default tolerance, ‖R‖ = TOL·λ_max·√(cluster size), plus rounding."""
    k = len(ep.evals)
    lam_max = np.abs(ref_evals).max()
    for c in clusters(ref_evals):
        if c.stop > k:  # a cluster cut by k has no well-defined top-k part
            break
        rest = np.delete(ref_evals, np.arange(c.start, c.stop))
        gap = np.min(np.abs(rest[:, None] - ref_evals[c][None, :])) if rest.size else lam_max
        bound = 10 * TOL * lam_max * np.sqrt(c.stop - c.start) / gap + 1e-9
        V, U = ep.evecs[:, c], ref_evecs[:, c]  # (N, c) each
        dist = np.linalg.norm(V - U @ (U.T @ V), 2)  # = ‖VVᵀ − UUᵀ‖₂ = sin of the largest principal angle
        assert dist <= bound, (
            f"eigenvectors {c.start}..{c.stop - 1} (λ ≈ {ref_evals[c.start]:.4g}) span a "
            f"different subspace: sin∠(V, U) = {dist:.2e} > bound {bound:.2e} (gap {gap:.2e})"
        )


def assert_matches_reference(G: np.ndarray, ep: Eigenpairs, ref: tuple[np.ndarray, np.ndarray]) -> None:
    k = len(ep.evals)
    assert isinstance(ep.evecs, np.ndarray) and ep.evecs.dtype == np.float64 and ep.evecs.shape == (G.shape[0], k)
    assert_evals_close(ep.evals, ref[0][:k])
    assert_orthonormal(ep.evecs)
    assert_residuals_small(G, ep)
    assert_subspaces_close(G, ep, *ref)


# ---------------------------------------------------------------- operators


class TorchOperator:
    """An NTKOperator look-alike: torch ``dtype``, ``matmat`` on torch tensors (numpy in → numpy out)."""

    def __init__(self, G: torch.Tensor, dtype: torch.dtype = torch.float64) -> None:
        self.G = G.to(dtype)  # (N, N) torch
        self.shape, self.dtype, self.n_matvec = tuple(self.G.shape), dtype, 0

    def matmat(self, V: Any) -> Any:
        is_np = not isinstance(V, torch.Tensor)
        Vt = torch.as_tensor(np.asarray(V) if is_np else V, dtype=self.dtype, device=self.G.device)
        self.n_matvec += Vt.shape[1]
        out = self.G @ Vt
        return out.cpu().numpy() if is_np else out


class MatvecOnly:
    """Only ``shape`` and ``matvec`` on NumPy vectors."""

    def __init__(self, G: np.ndarray) -> None:
        self.G, self.shape = G, G.shape

    def matvec(self, v: np.ndarray) -> np.ndarray:
        if not isinstance(v, np.ndarray) or v.ndim != 1:
            raise TypeError(f"matvec takes a NumPy (N,) vector, got {type(v).__name__}")
        return self.G @ v


class NativeOperator:
    """``matmat`` in the backend's own array type (NumPy, torch on a device, CuPy), no dtype attribute."""

    def __init__(self, G: Any) -> None:
        self.G, self.shape = G, tuple(G.shape)

    def matmat(self, V: Any) -> Any:
        if type(V) is not type(self.G) or getattr(V, "device", None) != getattr(self.G, "device", None):
            raise TypeError(f"fed {type(V).__name__}, wants {type(self.G).__name__} like G")
        return self.G @ V


class BadOperator:
    def __init__(self, N: int, out: Any) -> None:
        self.shape, self.out = (N, N), out

    def matmat(self, V: np.ndarray) -> np.ndarray:
        return self.out(V)


# ---------------------------------------------------------------- the suite


class EigenSuite:
    """The tests every backend must pass; subclasses set ``backend`` and :meth:`native`."""

    backend: str = "numpy"
    torch_device: str = "cpu"  # where torch-tensor operators keep their matrix

    def native(self, G: np.ndarray) -> Any:
        """G as this backend's native array."""
        raise NotImplementedError

    def solve(self, G: Any, k: Any, method: str = "auto", **kw: Any) -> Eigenpairs:
        backend = "numpy" if method == "arpack" else self.backend  # ARPACK runs on the host
        ep = top_eigenpairs(G, k, method, backend=backend, **kw)
        assert ep.backend == backend
        return ep

    @pytest.mark.parametrize("method", ["dense", "lanczos", "arpack"])
    @pytest.mark.parametrize("k", [1, 7, 25])
    def test_decaying_spectrum(self, method: str, k: int) -> None:
        G = psd(240)
        ep = self.solve(self.native(G), k, method)
        assert ep.method is EigMethod(method)
        assert_matches_reference(G, ep, reference(240))

    @pytest.mark.parametrize("method", ["dense", "lanczos", "arpack"])
    @pytest.mark.parametrize("k", [3, 10, 12])
    def test_repeated_eigenvalues(self, method: str, k: int) -> None:
        G = psd(200, "repeated")
        ep = self.solve(self.native(G), k, method)
        assert_matches_reference(G, ep, reference(200, "repeated"))

    @pytest.mark.parametrize("method", ["dense", "lanczos"])
    def test_k_all(self, method: str) -> None:
        G = psd(90)
        ep = self.solve(self.native(G), "all", method)
        assert ep.evals.shape == (90,)
        assert_matches_reference(G, ep, reference(90))

    def test_low_rank_lanczos(self) -> None:
        """rank 5 < k = 12: the Krylov space is exhausted and refilled with random directions."""
        G = low_rank(150, 5)
        ep = self.solve(self.native(G), 12, "lanczos")
        w, V = torch.linalg.eigh(torch.from_numpy(G))
        ref = (w.numpy()[::-1].copy(), V.numpy()[:, ::-1].copy())
        assert_evals_close(ep.evals, ref[0][:12])
        assert_orthonormal(ep.evecs)
        assert_residuals_small(G, ep)
        assert_subspaces_close(G, Eigenpairs(ep.evals[:5], ep.evecs[:, :5]), *ref)

    @pytest.mark.parametrize("kind", ["scipy", "torch", "matvec", "native"])
    @pytest.mark.parametrize("method", ["dense", "lanczos", "arpack"])
    def test_operator_inputs(self, kind: str, method: str) -> None:
        G = psd(240)
        op = {
            "scipy": lambda: aslinearoperator(G),
            "torch": lambda: TorchOperator(torch.tensor(G, device=self.torch_device)),
            "matvec": lambda: MatvecOnly(G),
            "native": lambda: NativeOperator(self.native(G)),
        }[kind]()
        ep = self.solve(op, 9, method)
        assert_matches_reference(G, ep, reference(240))
        assert ep.n_matvec >= (240 if method == "dense" else 9)
        if kind == "torch":
            assert op.n_matvec == ep.n_matvec

    def test_float32_torch_operator(self) -> None:
        """float32 products: tol is raised to 100·eps32; eigenvalues to ~1e-5."""
        G = psd(240)
        ep = self.solve(TorchOperator(torch.tensor(G, device=self.torch_device), torch.float32), 9, "lanczos")
        assert_evals_close(ep.evals, reference(240)[0][:9], rtol=1e-4)
        assert_residuals_small(G, ep, rtol=1e-4)
        assert ep.converged

    @pytest.mark.parametrize(("N", "k", "want"), [(600, 10, "lanczos"), (600, 250, "dense"), (120, 5, "dense")])
    def test_auto_method(self, N: int, k: int, want: str) -> None:
        G = psd(N) if N == 600 else psd(120)
        ep = self.solve(self.native(G), k)
        assert ep.method is EigMethod(want)
        assert_evals_close(ep.evals, reference(N)[0][:k])
        assert_residuals_small(G, ep)

    @pytest.mark.parametrize("method", ["dense", "lanczos", "arpack"])
    def test_deterministic_signs(self, method: str) -> None:
        G = self.native(psd(240))
        a, b = self.solve(G, 6, method, seed=3), self.solve(G, 6, method, seed=3)
        np.testing.assert_array_equal(a.evecs, b.evecs)
        peak = a.evecs[np.abs(a.evecs).argmax(axis=0), np.arange(6)]
        assert (peak > 0).all(), f"largest-|entry| components {peak} must be positive"

    def test_lanczos_diagnostics(self) -> None:
        G = psd(240)
        ep = self.solve(self.native(G), 8, "lanczos", tol=1e-12)
        assert ep.converged and ep.max_residual is not None
        true = residuals(G, ep).max()
        assert ep.max_residual == pytest.approx(true, rel=1e-3, abs=1e-14)
        assert true <= 1e-11 * ep.evals[0]

    def test_not_converged_warns(self) -> None:
        with pytest.warns(LanczosConvergenceWarning, match="max_iter"):
            ep = self.solve(self.native(psd(240)), 25, "lanczos", max_iter=2)
        assert not ep.converged and ep.evals.shape == (25,)

    # ------------------------------------------------------------ bad input

    @pytest.mark.parametrize("shape", [(5, 4), (6,), (2, 3, 3)])
    def test_shape_error(self, shape: tuple[int, ...]) -> None:
        with pytest.raises(ShapeError, match=r"square"):
            self.solve(self.native(np.ones(shape)), 1)

    def test_operator_shape_error(self) -> None:
        op = BadOperator(3, lambda V: V)
        op.shape = (3, 4)
        with pytest.raises(ShapeError, match=r"square"):
            self.solve(op, 1)

    @pytest.mark.parametrize("k", [0, -1, 31, 2.5, "some", True, None])
    def test_bad_k(self, k: Any) -> None:
        with pytest.raises(ValueError, match=r"k.*N = 30"):
            self.solve(self.native(psd(30)), k)

    @pytest.mark.parametrize("bad", [np.nan, np.inf])
    def test_non_finite(self, bad: float) -> None:
        G = psd(30).copy()
        G[3, 7] = G[7, 3] = bad
        with pytest.raises(NonFiniteError, match="2 NaN/inf"):
            self.solve(self.native(G), 2)

    def test_non_finite_operator_output(self) -> None:
        op = BadOperator(600, lambda V: np.full(V.shape, np.nan))
        with pytest.raises(NonFiniteError, match="operator returned NaN"):
            self.solve(op, 2, "lanczos")

    def test_operator_wrong_output_shape(self) -> None:
        op = BadOperator(600, lambda V: V[:-1])
        with pytest.raises(ShapeError, match=r"returned shape \(599, 1\)"):
            self.solve(op, 2, "lanczos")

    @pytest.mark.parametrize("arg", ["method", "backend"])
    def test_unknown_choice(self, arg: str) -> None:
        with pytest.raises(ValueError, match=rf"{arg}='qr' is not one of 'auto', .*"):
            top_eigenpairs(self.native(psd(30)), 2, **{"method": "auto", "backend": self.backend, arg: "qr"})

    def test_non_symmetric(self) -> None:
        G = psd(30).copy()
        G[0, 5] += 1e-3
        with pytest.raises(ValueError, match=r"symmetric; max \|G - Gᵀ\| = 0.001"):
            self.solve(self.native(G), 2)

    @pytest.mark.parametrize("method", ["dense", "lanczos", "arpack"])
    def test_non_symmetric_operator(self, method: str) -> None:
        A = np.random.default_rng(0).standard_normal((600, 600))
        with pytest.raises(ValueError, match="symmetric"):
            self.solve(aslinearoperator(A @ A.T + np.triu(A)), 4, method)

    @pytest.mark.parametrize(
        ("kw", "match"),
        [({"tol": 0.0}, "tol"), ({"tol": float("nan")}, "tol"), ({"max_iter": 0}, "max_iter"), ({"seed": 1.5}, "seed")],
    )
    def test_bad_options(self, kw: dict, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            self.solve(self.native(psd(30)), 2, "lanczos", **kw)

    def test_arpack_limits(self) -> None:
        with pytest.raises(ValueError, match="k < N"):
            self.solve(self.native(psd(30)), "all", "arpack")
        with pytest.raises(ValueError, match="host only"):
            top_eigenpairs(self.native(psd(30)), 2, "arpack", backend="torch")


class TestNumpyCPU(EigenSuite):
    backend = "numpy"

    def native(self, G: np.ndarray) -> np.ndarray:
        return G


class TestTorchCPU(EigenSuite):
    """The torch array module on the CPU: the GPU code path (TorchOps) without a GPU."""

    backend = "torch"

    def native(self, G: np.ndarray) -> torch.Tensor:
        return torch.tensor(G)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
class TestTorchCUDA(EigenSuite):
    backend = "torch"
    torch_device = "cuda"

    def native(self, G: np.ndarray) -> torch.Tensor:
        return torch.tensor(G, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_CUPY), reason="needs CUDA and CuPy")
class TestCuPy(EigenSuite):
    backend = "cupy"
    torch_device = "cuda"

    def native(self, G: np.ndarray) -> Any:
        import cupy

        return cupy.asarray(G)


# ---------------------------------------------------------------- not backend-specific


@pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed")
def test_cupy_missing_names_the_extra() -> None:
    with pytest.raises(MissingDependencyError, match=r"nsa-dist\[gpu\].*cupy-cuda12x"):
        top_eigenpairs(psd(30), 2, backend="cupy")


def test_float32_dense_input() -> None:
    G = psd(240)
    ep = top_eigenpairs(G.astype(np.float32), 5, "lanczos")
    assert ep.evecs.dtype == np.float64
    assert_evals_close(ep.evals, np.linalg.eigvalsh(G.astype(np.float32).astype(np.float64))[::-1][:5])


def test_eig_method_docstring_says_when_each_wins() -> None:
    for m in EigMethod:
        assert f"{m.name}:" in EigMethod.__doc__


def test_ntk_operator() -> None:
    """The real matrix-free NTK operator (torch in, torch out) against eigh of its dense Gram."""
    try:
        from nsa_dist.ntk import ntk_operator
    except ImportError as err:  # pragma: no cover - the ntk package is optional here
        pytest.skip(f"nsa_dist.ntk unavailable: {err}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()
    x = torch.randn(600, 3, dtype=torch.float64)
    op = ntk_operator(model, x, dtype=torch.float64)
    G = op.to_dense().numpy()
    G = (G + G.T) / 2
    w, V = torch.linalg.eigh(torch.from_numpy(G))
    ep = top_eigenpairs(op, 8)
    assert ep.method is EigMethod.LANCZOS
    assert_matches_reference(G, ep, (w.numpy()[::-1].copy(), V.numpy()[:, ::-1].copy()))


def test_block_gauss_quadrature_is_exact_to_degree_2m_minus_1():
    """The SLQ rule and the eigensolver share one Krylov code; its quadrature must be exact."""
    from nsa_dist.linalg import ArrayOps
    from nsa_dist.linalg.lanczos import block_gauss_quadrature

    rng = np.random.default_rng(3)
    A = rng.standard_normal((200, 200))
    A = (A + A.T) / 2
    Z = rng.standard_normal((200, 3))
    m = 4
    theta, W, n_matvec = block_gauss_quadrature(lambda X: A @ X, Z, m, ArrayOps(np))
    assert n_matvec == 3 * m and W.shape == (3, theta.size)
    np.testing.assert_allclose(W.sum(axis=1), np.sum(Z * Z, axis=0), rtol=1e-10)
    Ak = np.eye(200)
    for k in range(1, 2 * m):
        Ak = Ak @ A
        exact = np.einsum("ni,nm,mi->i", Z, Ak, Z)
        rule = W @ theta**k
        err = np.abs(rule - exact).max() / np.abs(exact).max()
        assert err < 1e-9, f"degree {k}: quadrature off by {err:.2e} relative"


def _perturbed(N: int, rel: float, seed: int = 3) -> np.ndarray:
    """psd(N) plus a symmetric perturbation of relative size ``rel`` (the next recorded step's G)."""
    E = np.random.default_rng(seed).standard_normal((N, N))
    return psd(N) + rel * decaying(N)[0] * (E + E.T) / (2 * np.sqrt(N))


def test_warm_start_saves_products() -> None:
    """The previous G's eigenvectors as the start block: same accuracy, no more products (issue 22) — the
    saving (156 against 192 here) now pays for the check a warm start takes for an eigenvalue its
    invariant start hid (≤ 36 products; tests/test_eigensolve_misses.py)."""
    G0, G1 = psd(600), _perturbed(600, 1e-6)
    prev = top_eigenpairs(G0, 40, "lanczos")
    cold = top_eigenpairs(G1, 40, "lanczos")
    warm = top_eigenpairs(G1, 40, "lanczos", start=prev.evecs)
    w, V = np.linalg.eigh(G1)
    ref = (w[::-1].copy(), V[:, ::-1].copy())
    for ep in (cold, warm):
        assert_matches_reference(G1, ep, ref)
    assert warm.n_matvec <= cold.n_matvec, (warm.n_matvec, cold.n_matvec)


def test_gated_checks_change_nothing_but_the_number_of_full_checks(monkeypatch) -> None:
    """Lanczos skips a full convergence check when a partial eigh already shows the weakest of the
    top k unconverged (issue 22): the same eigenpairs and products as checking every time, fewer
    full (n, n) eighs, and the answer still matches dense eigh."""
    import nsa_dist.linalg.lanczos as lanczos

    # a dense host G of N ≥ 2048: the torch route, block 16 (48 only from N = 4096)
    G = torch.from_numpy(psd(2400).copy())
    calls = {"full": 0}
    ritz = lanczos._ritz

    def counted(H):
        calls["full"] += 1
        return ritz(H)

    monkeypatch.setattr(lanczos, "_ritz", counted)
    gated = top_eigenpairs(G, 200, "lanczos")
    n_gated, calls["full"] = calls["full"], 0
    with monkeypatch.context() as m:
        m.setattr(lanczos, "_surely_unconverged", lambda *a, **kw: False)
        every = top_eigenpairs(G, 200, "lanczos")
    assert n_gated < calls["full"], f"the gate skipped no check ({n_gated} full checks vs {calls['full']})"
    assert gated.n_matvec == every.n_matvec
    np.testing.assert_array_equal(gated.evals, every.evals)
    w, V = np.linalg.eigh(G.numpy())
    assert_matches_reference(G.numpy(), gated, (w[::-1].copy(), V[:, ::-1].copy()))


def test_warm_start_narrow_block_and_bad_shape() -> None:
    """A start block narrower than the Lanczos block is topped up with random vectors; a wrong N is named."""
    G = psd(240)
    ep = top_eigenpairs(G, 9, "lanczos", start=reference(240)[1][:, :3])
    assert_matches_reference(G, ep, reference(240))
    with pytest.raises(ValueError, match=r"start must be an \(N, s\) block with N = 240"):
        top_eigenpairs(G, 9, "lanczos", start=np.ones((200, 9)))


def test_large_host_matrix_runs_on_torch_blas() -> None:
    """AUTO puts a dense host G of N ≥ 2048 on torch's CPU BLAS (block 16; 48 only from N = 4096); results as eigh's."""
    N, k = 2048, 64
    lam = decaying(N)
    Q, _ = np.linalg.qr(np.random.default_rng(5).standard_normal((N, N)))
    G = (Q * lam) @ Q.T
    G = (G + G.T) / 2
    ep = top_eigenpairs(G.astype(np.float32), k, "lanczos")
    assert ep.backend == "torch"
    G32 = G.astype(np.float32).astype(np.float64)
    w = np.linalg.eigvalsh(G32)[::-1][:k]
    assert_evals_close(ep.evals, w)
    assert_orthonormal(ep.evecs)
    assert_residuals_small(G32, ep)


def _tall_qr_check(A: torch.Tensor, Q: torch.Tensor, R: np.ndarray) -> None:
    """Q orthonormal, R upper triangular, Q R = A, all to float64 rounding."""
    b = A.shape[1]
    assert np.abs(Q.T.numpy() @ Q.numpy() - np.eye(b)).max() < 1e-13
    assert np.abs(np.tril(R, -1)).max() == 0.0
    assert np.abs(Q.numpy() @ R - A.numpy()).max() < 1e-12 * np.abs(A.numpy()).max()


def test_tall_qr_cholesky_path_and_its_fallback() -> None:
    """Lanczos's tall QR on torch's CPU: Cholesky QR twice where it is accurate; an ill-conditioned
    block (cond 1e12, beyond Cholesky QR's ~1e8) is refused by its own check and LAPACK's QR runs
    (issue 22)."""
    from nsa_dist.linalg._backend import TorchOps
    from nsa_dist.linalg.lanczos import _cholesky_qr2, _qr_r

    ops, rng = TorchOps("cpu"), np.random.default_rng(3)
    good = torch.from_numpy(rng.standard_normal((800, 12)))
    assert _cholesky_qr2(ops, good) is not None
    U, _ = np.linalg.qr(rng.standard_normal((800, 12)))
    W, _ = np.linalg.qr(rng.standard_normal((12, 12)))
    bad = torch.from_numpy((U * np.logspace(0, -12, 12)) @ W.T)  # singular values 1 … 1e-12, mixed columns
    assert _cholesky_qr2(ops, bad) is None
    for A in (good, bad, good.T.contiguous().T):  # row- and column-major
        Q, R = _qr_r(ops, A)
        _tall_qr_check(A, Q, R)


def test_lanczos_on_torch_cpu_matches_numpy() -> None:
    """The torch CPU route (Cholesky QR) and the NumPy route (LAPACK QR) give the same top-k to the
    solver's tolerance, each checked against eigh."""
    G = psd(400)
    ref = reference(400)
    eps = [top_eigenpairs(G, 30, "lanczos", backend=be) for be in ("numpy", "torch")]
    for ep in eps:
        assert_matches_reference(G, ep, ref)
    assert_evals_close(eps[1].evals, eps[0].evals)


def test_asymmetry_found_in_a_far_tile_on_torch_cpu() -> None:
    """The symmetry check of a host G on torch's CPU (512-tiles) compares every tile with its
    transposed partner: a single asymmetric pair far off the diagonal is found and named."""
    N = 1100  # 3 tiles per side, a partial last one
    G = psd(N).copy()
    G[1090, 7] += 1e-3
    with pytest.raises(ValueError, match=r"symmetric; max \|G - Gᵀ\| = 0.001"):
        top_eigenpairs(G, 10, "lanczos", backend="torch")


def test_a_float32_host_tensor_is_checked_as_it_is() -> None:
    """A float32 torch G of N ≥ 2048 (the pipeline's Gram) is checked for symmetry before its
    float64 copy is used: one asymmetric pair in a far tile is named; a symmetric one solves."""
    N = 2100
    G = torch.from_numpy(psd(N).astype(np.float32))
    G[2090, 7] += 1e-3
    with pytest.raises(ValueError, match=r"symmetric; max \|G - Gᵀ\| = 0.001"):
        top_eigenpairs(G, 10, "lanczos")
    G[2090, 7] = G[7, 2090]
    ep = top_eigenpairs(G, 10, "lanczos")
    w = np.linalg.eigvalsh(G.double().numpy())[::-1][:10]
    assert np.abs(ep.evals - w).max() <= 1e-9 * w[0], (ep.evals, w)


def test_orthogonalise_local_first_then_one_pass_or_two() -> None:
    """Lanczos's re-orthogonalisation (issue 22): the last blocks first, then one pass against the
    whole basis, and a second only where that pass took away more than half of a column.  Both
    cases give W ⟂ V to float64 rounding and coefficients with W_in = V C + W_out."""
    from nsa_dist.linalg._backend import TorchOps
    from nsa_dist.linalg.lanczos import _orthogonalise

    ops, rng = TorchOps("cpu"), np.random.default_rng(11)
    V = torch.from_numpy(np.linalg.qr(rng.standard_normal((3000, 256)))[0])
    local_part = V[:, -64:] @ torch.from_numpy(rng.standard_normal((64, 16))) * 1e3
    small_new = torch.from_numpy(rng.standard_normal((3000, 16)))
    cases = {
        "recurrence-like: W in the last blocks plus new directions": local_part + small_new,
        "after a restart: W mostly along old columns": V[:, :64] @ torch.from_numpy(rng.standard_normal((64, 16))) * 1e6
        + small_new,
    }
    for name, W in cases.items():
        out, C = _orthogonalise(ops, V, W, local=64)
        orth = float((V.T @ out).abs().max() / out.abs().max())
        rebuilt = float((V @ torch.from_numpy(C) + out - W).abs().max() / W.abs().max())
        assert orth < 1e-14, f"{name}: |Vᵀ W_out| / |W_out| = {orth:.2e}"
        assert rebuilt < 1e-14, f"{name}: |V C + W_out − W_in| / |W_in| = {rebuilt:.2e}"


@pytest.mark.parametrize("order", ["C", "F"])
def test_sign_fix_in_place_equals_the_copying_one(order: str) -> None:
    """The in-place sign fix of a solver's own V (max/min per column, argmax only on ties) flips
    exactly the columns the copying one (NumPy argmax of |V|) flips: ties go to the first entry,
    a zero column and a NaN column stay as they are."""
    from nsa_dist.linalg.eigenpairs import _fix_signs

    V = np.random.default_rng(0).standard_normal((300, 12))
    V[:, 3] = 0.0
    V[[5, 7], 3] = (-1.0, 1.0)  # tie, the negative one first: flipped
    V[:, 4] = 0.0
    V[[5, 7], 4] = (1.0, -1.0)  # tie, the positive one first: kept
    V[:, 6] = 0.0
    V[9, 8] = np.nan
    V = np.asarray(V, order=order)
    copied = _fix_signs(V)
    own = V.copy(order=order)
    fixed = _fix_signs(own, owned=True)
    assert fixed is own, "an owned contiguous float64 V is flipped in place, not copied"
    np.testing.assert_array_equal(fixed, copied)
    assert fixed[5, 3] == 1.0 and fixed[5, 4] == 1.0 and fixed[7, 3] == -1.0
    assert copied is not V and copied.flags.f_contiguous


# ---------------------------------------------------------------- a step's spectrum: the one front door
def _step_problem(N: int = 120, seed: int = 0) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((N, 30))
    G = A @ A.T + np.diag(np.linspace(0.0, 1.0, N))  # distinct eigenvalues
    return G, {"y": rng.standard_normal(N), "F": rng.standard_normal((N, 2))}


@pytest.mark.parametrize(
    "route, k, vectors, names, ran",
    [
        ("auto", "all", False, ("y",), "one_vector"),
        ("auto", "all", False, ("y", "F"), "tridiagonal"),
        ("tridiagonal", "all", False, ("y",), "tridiagonal"),
        ("eigenpairs", "all", False, ("y",), "eigenpairs"),
        ("auto", "all", True, ("y",), "eigenpairs"),  # the step needs V
        ("auto", 10, False, ("y",), "eigenpairs"),  # top-k
    ],
)
def test_step_spectrum_routes_against_eigh(route: str, k: Any, vectors: bool, names: tuple, ran: str) -> None:
    """step_spectrum takes the route its argument allows and the step admits; every route gives the
    float64 eigh's eigenvalues and |⟨v_i, φ⟩| (eigenvectors up to sign)."""
    from nsa_dist.linalg import step_spectrum

    G, phis = _step_problem()
    N = G.shape[0]
    kk = N if k == "all" else k
    sp = step_spectrum(G, kk, {n: phis[n] for n in names}, vectors=vectors, route=route)
    assert sp.route == ran, f"route {sp.route!r}, expected {ran!r}"
    assert (sp.evecs is not None) == (ran == "eigenpairs")
    w, V = np.linalg.eigh(G)
    w, V = w[::-1][:kk], V[:, ::-1][:, :kk]
    np.testing.assert_allclose(sp.evals, w, rtol=0, atol=1e-11 * w[0])
    for n in names:
        ref = V.T @ phis[n].reshape(N, -1)
        got = sp.proj[n]
        err = float(np.abs(np.abs(got) - np.abs(ref)).max())
        assert err <= 1e-8 * np.abs(phis[n]).max(), f"{n}: max ||⟨v, φ⟩| − ref| = {err:.2e}"


def test_step_spectrum_operator_solver_and_columns() -> None:
    """An operator takes Lanczos (method "auto" or "dense"); the tridiagonal routes with SciPy's
    dstevd (solver "lapack") give what the default solver gives; ``indices`` are eigenvector columns."""
    from nsa_dist.linalg import step_spectrum

    G, phis = _step_problem()
    N = G.shape[0]
    op = aslinearoperator(G)
    sp = step_spectrum(op, 5, {"y": phis["y"]}, method="dense")
    assert sp.route == "eigenpairs" and sp.method is EigMethod.LANCZOS and sp.n_matvec > 0
    np.testing.assert_allclose(sp.evals, np.linalg.eigvalsh(G)[::-1][:5], rtol=1e-9)
    for route in ("auto", "tridiagonal"):
        a = step_spectrum(G, N, {"y": phis["y"]}, route=route)
        b = step_spectrum(G, N, {"y": phis["y"]}, route=route, solver="lapack")
        np.testing.assert_allclose(a.evals, b.evals, rtol=0, atol=1e-12 * a.evals[0])
        np.testing.assert_allclose(np.abs(a.proj["y"]), np.abs(b.proj["y"]), rtol=0, atol=1e-9)
    cols = step_spectrum(G, N, phis, indices=(0, 3))
    w, V = np.linalg.eigh(G)
    for i in (0, 3):
        np.testing.assert_allclose(np.abs(cols.columns[i]), np.abs(V[:, ::-1][:, i]), rtol=0, atol=1e-9)


def test_step_spectrum_bad_route_named() -> None:
    from nsa_dist.linalg import step_spectrum

    G, phis = _step_problem(20)
    with pytest.raises(ValueError, match="route"):
        step_spectrum(G, 20, phis, route="qr")
    with pytest.raises(ValueError, match="solver"):
        step_spectrum(G, 20, phis, solver="qr")


def test_a_float32_matrix_float64_copy_is_freed_with_its_map_not_by_the_cycle_collector():
    """The solvers' map of a float32 G makes a float64 copy for its products (0.8 GB at N = 10⁴);
    it must go with the map, by reference counting: a closure over the map held it in a cycle,
    alive until the cyclic collector ran (measured: through most of a quadrature step)."""
    import gc
    import weakref

    from nsa_dist.linalg._backend import Backend
    from nsa_dist.linalg._inputs import as_symmetric_map

    G = torch.randn(64, 64, dtype=torch.float32)
    G = G + G.T
    A = as_symmetric_map(G, Backend.TORCH)
    out = A.matmat(torch.eye(64, dtype=torch.float64)[:, :3])
    assert torch.equal(out, G.double()[:, :3])
    copy = weakref.ref(A.dense)
    gc.disable()
    try:
        del A
        assert copy() is None, "the float64 copy outlived its map"
    finally:
        gc.enable()


def test_a_float32_matrix_applied_in_slabs_needs_no_float64_copy_and_solves_the_same():
    """A float32 host G's float64 products are formed a slab of rows at a time — the same products
    to float64 rounding, the (N, N) float64 copy never made (0.8 GB at N = 10⁴, and slower) — and
    its top eigenpairs agree with those of the same matrix stored in float64."""
    from nsa_dist.linalg._backend import Backend
    from nsa_dist.linalg._inputs import as_symmetric_map, upcast_product

    rng = np.random.default_rng(3)
    N = 2100  # ≥ the host-torch threshold, several slabs and a partial last one
    Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    lam = 1e4 * 0.9 ** np.arange(N)  # a decaying spectrum, like a Gram's
    G = torch.from_numpy(((Q * lam) @ Q.T).astype(np.float32))
    G = (G + G.T) / 2
    X = torch.from_numpy(rng.standard_normal((N, 5)))
    for given in (G, G.numpy()):  # torch or NumPy float32
        A = as_symmetric_map(given, Backend.AUTO)
        ref = G.double() @ X
        out = A.matmat(X)
        err = float((out - ref).abs().max() / ref.abs().max())
        assert err < 1e-13, f"slab products differ from the float64 copy's by {err:.2e} (relative)"
        assert A._dense is None, "a float32 host G was copied to float64 for its products"
    small = upcast_product(G[:300, :300], slab_bytes=1)  # 64-row slabs, the last one of 44 rows
    part = small(X[:300])
    np.testing.assert_allclose(part.numpy(), (G[:300, :300].double() @ X[:300]).numpy(), rtol=1e-12, atol=1e-9)

    a = top_eigenpairs(G.double(), 20, "lanczos", seed=1)
    b = top_eigenpairs(G, 20, "lanczos", seed=1)
    gap = np.abs(a.evals - b.evals).max() / a.evals[0]
    assert gap < 1e-12, f"eigenvalues of the float32 G and of its float64 copy differ by {gap:.2e}·λ_1"
    cos = np.abs(np.sum(a.evecs[:, :10] * b.evecs[:, :10], axis=0)).min()
    assert cos > 1 - 1e-9, f"top-10 eigenvectors differ: smallest |cos| {cos:.12f}"


def test_a_read_only_or_reversed_float32_numpy_gram_solves_without_a_warning():
    """np.load's memory map is read-only (torch warns when viewing it) and a reversed view has
    negative strides (torch cannot view it: the float64 copy instead): both solve, silently."""
    import warnings

    rng = np.random.default_rng(0)
    A = rng.standard_normal((2200, 30)).astype(np.float32)
    G = A @ A.T
    G.setflags(write=False)
    ref = np.linalg.eigvalsh(G.astype(np.float64))[::-1][:5]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for given in (G, G[::-1, ::-1]):
            e = top_eigenpairs(given, 5, "lanczos")
            gap = np.abs(e.evals - ref).max() / ref[0]
            assert gap < 1e-12, f"top-5 off by {gap:.2e}·λ_1"
