"""``run.hessian``: the loss Hessian H = I + S of a run at its analysed steps (the Hessian paper).

Every array is along the finished steps whose Hessian was analysed (:attr:`HessianView.steps`,
Sh entries); moments are Tr(A^k), k = 1..4, of A = H, I (the Gauss–Newton part) or S.
"""

from __future__ import annotations

import numpy as np

from nsa_dist.client._arrays import RunArrays, flag
from nsa_dist.errors import StoreError

__all__ = ["HessianView"]


_MOMENT_PARTS = ("H", "I", "S", "I_exact", "I_limit")

# the hessian block's switch that leaves each array out of a run
_SWITCH = {
    **dict.fromkeys(
        (
            "hessian_moments",
            "hessian_moments_stderr",
            "hessian_moments_I_exact",
            "hessian_I_limit_moments",
            "hessian_S_limit",
            "hessian_I_eigenvalues",
            "hessian_I_limit_eigenvalues",
        ),
        "hessian.moments: false",
    ),
    "hessian_orthogonality": "hessian.orthogonality: false",
    **dict.fromkeys(("hessian_rayleigh", "hessian_rayleigh_evals"), "hessian.rayleigh_k: 0"),
    **dict.fromkeys(("hessian_top", "hessian_S_op"), "hessian.top_k: 0"),
    **dict.fromkeys(("hessian_density", "hessian_density_grid"), "hessian.density: false"),
    "hessian_additivity": "hessian.additivity: false",
    **dict.fromkeys(("hessian_G", "hessian_G_stderr", "hessian_trace_S_G"), "hessian.trace_G: false"),
}


def _part(part: str, allowed: tuple[str, ...] = ("H", "I", "S")) -> int:
    """The row of ``part`` (H, I, S) in a stored (…, 3, …) array, or a ValueError naming ``allowed``."""
    if part not in allowed:
        raise ValueError(f"part={part!r} is not one of {', '.join(map(repr, allowed))}")
    return "HIS".index(part)


class HessianView:
    """The Hessian measurements of one run (``run.hessian``), read from its stored arrays."""

    def __init__(self, arrays: RunArrays) -> None:
        self._a = arrays

    def _index(self) -> np.ndarray:
        """Positions (into the run's ``steps``) of the finished steps whose Hessian was analysed."""
        if not self._a.has("hessian_steps") and self._a.spec.hessian is None:
            # the store's "has no array 'hessian_steps'; did you mean 'eigenvector_steps'?" (an audit)
            raise StoreError(
                f"run {self._a.id!r} did not measure the Hessian: its spec has no hessian: block (it has no array "
                "'hessian_steps')"
            )
        mask = self._a.array("hessian_steps")[self._a.finished]
        return np.flatnonzero(mask)

    @property
    def steps(self) -> np.ndarray:
        """(Sh,) the finished recorded steps with Hessian measurements."""
        return self._a.steps[self._index()]

    def _along(self, name: str) -> np.ndarray:
        return self._a.per_step(self._recorded(name))[self._index()]

    def _recorded(self, name: str) -> str:
        """``name``, or a KeyError saying which setting of the run's spec left it out (the store's
        "has no array …; did you mean …" named none)."""
        if self._a.has(name) or name not in _SWITCH:
            return name
        h = self._a.spec.hessian
        if h is not None:
            field, off = _SWITCH[name].removeprefix("hessian.").split(": ")
            if str(getattr(h, field)).lower() != off:  # switched on: the array is lost, the store says so
                return name
        why = "its spec has no hessian: block" if h is None else f"its spec says {_SWITCH[name]}"
        raise KeyError(f"run {self._a.id!r} did not measure {name!r}: {why}")

    def _pos(self, step: int | None) -> int:
        steps = self.steps
        if not len(steps):
            raise ValueError(f"run {self._a.id!r} has no finished step with Hessian measurements")
        i = self._a.index_of(int(steps[-1]) if step is None else step)  # KeyError: not a finished step
        if step is not None and not np.any(steps == step):  # a finished step never analysed: its rows are
            # the arrays' fill (NaN), not a measurement that failed
            raise KeyError(
                f"step {step} is not a finished step with Hessian measurements of run {self._a.id!r}; "
                f"analysed: {steps.tolist()[:20]}{' …' if len(steps) > 20 else ''} (hessian.every / hessian.steps)"
            )
        return i

    def moments(self, part: str = "H") -> dict[str, np.ndarray]:
        """Tr(A^k), k = 1..4, along the analysed steps: {"estimate": (Sh, 4), "stderr": (Sh, 4)}.

        part: "H", "I" or "S" (Hutch++ estimates); "I_exact" for Tr(I^k) from the NTK Gram;
        "I_limit" for the infinite-width prediction from Θ∞ (NaN where it does not apply).

        Raises:
            ValueError: an unknown part.
        """
        if part in ("I_exact", "I_limit"):
            est = self._along("hessian_moments_I_exact" if part == "I_exact" else "hessian_I_limit_moments")
            return {"estimate": est, "stderr": np.zeros_like(est)}
        j = _part(part, _MOMENT_PARTS)
        return {"estimate": self._along("hessian_moments")[:, j], "stderr": self._along("hessian_moments_stderr")[:, j]}

    @property
    def orthogonality(self) -> dict[str, np.ndarray]:
        """‖IS‖_F / (‖I‖_F ‖S‖_F) along the analysed steps: {"value": (Sh,), "stderr": (Sh,)}."""
        o = self._along("hessian_orthogonality")
        return {"value": o[:, 0], "stderr": o[:, 1]}

    def rayleigh(self, step: int | None = None) -> dict[str, np.ndarray]:
        """The Hessian paper's Fig. 3 at ``step`` (default: the last analysed).

        {"I": (2, k) [vᵀIv; vᵀSv] over the top-k eigenvectors of I, "S": the same over S's,
        "evals_I", "evals_S": their eigenvalues}.

        Raises:
            KeyError: ``step`` is not a finished step with Hessian measurements (they are named).
        """
        i = self._pos(step)
        R, E = (
            self._a.row(self._recorded("hessian_rayleigh"), i),
            self._a.row(self._recorded("hessian_rayleigh_evals"), i),
        )
        return {"I": R[0], "S": R[1], "evals_I": E[0], "evals_S": E[1]}

    def top(self, part: str = "H") -> np.ndarray:
        """(Sh, k) the largest eigenvalues of H, I or S along the analysed steps."""
        j = _part(part)  # an unknown part is named before the run is read
        return self._along("hessian_top")[:, j]

    def edge_of_stability(self) -> np.ndarray:
        """(Sh,) λ_max(H)·δ_t / 2 (:func:`nsa_dist.hessian.edge_of_stability`): GD on the local
        quadratic model is stable while it stays below 1."""
        from nsa_dist.hessian import edge_of_stability

        lr = self._a.per_step("lr")[self._index()]
        return np.array(  # NaN at a step whose δ_t is unknown (a Tracker's update that was not GD at one rate)
            [edge_of_stability(lam, d) if np.isfinite(d) else np.nan for lam, d in zip(self.top("H")[:, 0], lr)],
            dtype=np.float64,
        )

    def density(self, step: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(grid, density) of the SLQ spectral density of H at ``step`` (default: the last analysed;
        KeyError for a step without Hessian measurements, as :meth:`rayleigh`)."""
        i = self._pos(step)
        return self._a.row(self._recorded("hessian_density_grid"), i), self._a.row(self._recorded("hessian_density"), i)

    def I_eigenvalues(self, limit: bool = False) -> np.ndarray:
        """(Sh, N·K) eigenvalues of I outside its null space, descending: measured exactly (from the
        NTK Gram; NaN with a distributed layout) or, ``limit=True``, the kernel PCA of Θ∞
        weighted by HC (NaN where the limit does not apply, see docs/store.md)."""
        return self._along("hessian_I_limit_eigenvalues" if flag(limit, "limit") else "hessian_I_eigenvalues")

    def additivity(self) -> dict[str, np.ndarray]:
        """Theorem 1's gap Tr(H^k) − Tr(I^k) − Tr(S^k), k = 1..4 (shared probes):
        {"estimate": (Sh, 4), "stderr": (Sh, 4)}."""
        a = self._along("hessian_additivity")
        return {"estimate": a[:, 0], "stderr": a[:, 1]}

    def trace_S(self) -> dict[str, np.ndarray]:
        """Tr(S) two independent ways along the analysed steps: "G" = ∇Cᵀ·G (per-point traces of the
        model Hessian) with "G_stderr", and "hutchpp" (Hutch++ on S) with "hutchpp_stderr"."""
        g, m = self._along("hessian_trace_S_G"), self.moments("S")
        return {"G": g[:, 0], "G_stderr": g[:, 1], "hutchpp": m["estimate"][:, 0], "hutchpp_stderr": m["stderr"][:, 0]}

    def S_limit(self) -> dict[str, np.ndarray]:
        """The infinite-width predictions for S along the analysed steps (the Hessian paper,
        Proposition 4 and Theorem 1; :mod:`nsa_dist.hessian.s_limit`), (Sh,) each, NaN where a
        prediction does not apply: "trace_S_init" E[Tr S] at initialisation (MSE: K Tr(Φ̃)/N),
        "trace_S" E[Tr S_t] along plain GD (MSE), "trace_S2" Tr(S²) = ∇C_tᵀ (Υ̃ ⊗ Id) ∇C_t."""
        a = self._along("hessian_S_limit")
        return {"trace_S_init": a[:, 0], "trace_S": a[:, 1], "trace_S2": a[:, 2]}

    def G(self, step: int | None = None) -> dict[str, np.ndarray]:
        """G_i = Σ_p ∂²f(x_i)/∂θ_p² at ``step`` (default: the last analysed): {"estimate", "stderr"} (N,) or (N, K)."""
        i = self._pos(step)
        g, se = self._recorded("hessian_G"), self._recorded("hessian_G_stderr")
        return {"estimate": self._a.array(g)[i], "stderr": self._a.array(se)[i]}

    def S_norms(self) -> dict[str, np.ndarray]:
        """‖S‖_op (Lanczos, "op") beside the paper's bounds Tr(S^k)^{1/k} for k = 2 ("k2" = ‖S‖_F)
        and k = 4 ("k4"), from the Hutch++ moments: (Sh,) each; ‖S‖_op ≤ k4 ≤ k2.  "k2_stderr",
        "k4_stderr": their standard errors to first order (s.e.(Tr S^k) / (k·Tr(S^k)^{1 − 1/k}));
        an estimate of Tr(S^k) at or below 0 gives 0 (its standard error says how far it may be)."""
        m = self.moments("S")
        est, se = m["estimate"], m["stderr"]
        with np.errstate(invalid="ignore", divide="ignore"):
            k2 = np.sqrt(np.clip(est[:, 1], 0, None))
            k4 = np.clip(est[:, 3], 0, None) ** 0.25
            return {
                "op": self._along("hessian_S_op"),
                "k2": k2,
                "k4": k4,
                "k2_stderr": np.where(k2 > 0, se[:, 1] / (2 * k2), np.sqrt(np.abs(se[:, 1]))),
                "k4_stderr": np.where(k4 > 0, se[:, 3] / (4 * k4**3), np.abs(se[:, 3]) ** 0.25),
            }

    def __repr__(self) -> str:
        return f"HessianView({self._a.id!r})"
