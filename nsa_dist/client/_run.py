"""``Run``: one run's NSA quantities along its finished recorded steps, with named views of the
other families — ``run.hessian`` (H = I + S), ``run.kernel`` (per-class spectra, projections,
reconstructions, dG_t, the constant-Gram prediction) and ``run.images`` (2-D data)."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from nsa_dist.client._arrays import RunArrays, flag
from nsa_dist.client._curves import EXACT_BRACKET, BracketedCurve, energy_route, read_curve, rounding_delta
from nsa_dist.client._frames import run_to_xarray
from nsa_dist.client._hessian import HessianView
from nsa_dist.client._images import ImagesView
from nsa_dist.client._kernel import KernelView
from nsa_dist.errors import StoreError
from nsa_dist.metrics import flow_speed, lr_eigen_product, spectrum_preservation, stability_bound
from nsa_dist.metrics.preservation import preservation_pair
from nsa_dist.store import PHIS

if TYPE_CHECKING:
    import pandas
    import xarray

__all__ = ["Run", "PHI_NAMES"]

PHI_NAMES = PHIS + ("f_test",)


class Run(RunArrays):
    """One run's recorded spectra, read from the store.

    Arrays are indexed by the finished recorded steps (``steps``, S entries).  The store-level
    reads (``has``, ``array``, ``per_step``, ``dims``, …) come from :class:`RunArrays`; the
    Hessian, kernel-extra and image families are the views :attr:`hessian`, :attr:`kernel` and
    :attr:`images`.
    """

    # ------------------------------------------------------------------ views
    @cached_property
    def hessian(self) -> HessianView:
        """The Hessian H = I + S at the analysed steps (:class:`~nsa_dist.client.HessianView`)."""
        return HessianView(self)

    @cached_property
    def kernel(self) -> KernelView:
        """Per-class spectra, residual projections, reconstructions, dG_t, the constant-Gram
        prediction (:class:`~nsa_dist.client.KernelView`)."""
        return KernelView(self)

    @cached_property
    def images(self) -> ImagesView:
        """2-D data: the eigenvector and residual images (:class:`~nsa_dist.client.ImagesView`)."""
        return ImagesView(self)

    # ------------------------------------------------------------------ the data
    @property
    def data_fingerprint(self) -> str | None:
        """``"sha256:…"`` of the data the run was created from (X, y, X_test, y_test as loaded;
        :meth:`nsa_dist.data.Dataset.fingerprint`); None for runs recorded before fingerprints."""
        return self.attrs.get("data_fingerprint")

    @property
    def data_meta(self) -> dict:
        """What the data's loader recorded: its source and, for data it standardised, the constants —
        ``x_mean``, ``x_std`` (X holds (x − x_mean) / x_std, the inputs the network saw; the images and
        Fourier transforms are taken at x = X·x_std + x_mean, e.g. on [0, 1]² for ``image2d``) and
        ``y_mean``, ``y_std``.  {} for a run recorded before it was kept and not reopened since."""
        return dict(self.attrs.get("data_meta") or {})

    @property
    def X(self) -> np.ndarray:
        """(N, d) the training inputs."""
        return self.array("X")

    @property
    def y(self) -> np.ndarray:
        """(N,) or (N, Ko) the training targets."""
        return self.array("y")

    @property
    def X_test(self) -> np.ndarray:
        """(M, d) the test inputs."""
        return self.array("X_test")

    @property
    def N(self) -> int:
        """Number of training points."""
        return int(self.shape("X")[0])

    @property
    def Ko(self) -> int:
        """Number of network outputs."""
        y = self.shape("y")
        return 1 if len(y) == 1 else int(y[1])

    # ------------------------------------------------------------------ the spectrum
    @property
    def eigenvalues(self) -> np.ndarray:
        """(S, K) top eigenvalues λ_i^t of G_t, descending."""
        return self.per_step("eigenvalues")

    def eigenvectors(self, step: int) -> np.ndarray:
        """(N, K) eigenvectors of G_t at recorded step ``step``.

        Raises:
            KeyError: ``step`` is not finished, or its eigenvectors were not stored.
        """
        i = self.index_of(step)
        if self.has("eigenvectors") and not self.stores_eigenvectors(step):
            raise KeyError(
                f"run {self.id!r} stores eigenvectors only at steps {self.eigenvector_steps.tolist()}, "
                f"not at {step} (spectrum.store_eigenvectors)"
            )
        return np.asarray(self.row("eigenvectors", i), dtype=np.float64)

    def energy(self, phi: str = "y", k: int | None = None, step: int | None = -1) -> Any:
        """E_t(φ, k) with its bracket: ``(value, lower, upper)`` at recorded step ``step``.

        phi: "y" labels (of an NCE run: the log-density centred over the points, ȳ = y − mean(y)),
        "f" outputs f_t, "residual" m_t, "df" real update, "df_pred" first-order update −(δ/N) G m,
        "f_test" outputs at the test points (eigenvectors of the test Gram).
        k: 1..N.  The exact route (``spectrum.k: all`` on one process) gives every k exactly
        (lower = upper = value) except inside a cluster of eigenvalues within the eigensolver's
        rounding (a rank-deficient G's null space: its eigenvectors are one arbitrary basis), where
        E is bracketed by the cluster's ends; the quadrature route gives the top part exactly and every other k
        within its bracket (:attr:`curve_bracket` says how it is guaranteed); a k between two
        measured k is bracketed by its neighbours (E is non-decreasing in k).
        step: a finished recorded step t, −1 for the last (floats back), or None for every finished
        step (three (S,) arrays back).

        Without ``k``: the stored top-K energies along t, (S, K) (``energy_<φ>``: every k on the
        exact route with ``k: all``, the exact top part on the quadrature route); with a ``step``
        other than −1 or None too, that step's row (K,).

        Raises:
            ValueError: an unknown phi; k outside 1..N, or beyond what the run measured (a run that
                kept K eigenpairs on the exact route: k ≤ K).
            KeyError: ``step`` is not a finished recorded step (the finished ones are named).
        """
        self._check_phi(phi)
        if k is None:
            rows = self.per_step(f"energy_{phi}")
            if step is None or (
                not isinstance(step, (bool, np.bool_)) and isinstance(step, int | np.integer) and step == -1
            ):
                return rows
            # a step was named: its row (it was ignored — energy("y", step=5) gave every step's, 5 unrecorded)
            return rows[int(np.flatnonzero(self.steps == self._step(step))[0])]
        return self._at(self.curve(f"energy_{phi}"), k, step)

    def eigenvalue(self, i: int, step: int | None = -1) -> Any:
        """λ_i^t of G_t with its bracket: ``(value, lower, upper)`` at ``step`` (as :meth:`energy`;
        λ is non-increasing in i, so an i between two measured ones is bracketed by them).

        Raises:
            ValueError: i outside 1..N or beyond what the run measured.  KeyError: an unfinished step.
        """
        return self._at(self.curve("eigenvalue"), i, step)

    def energy_curve(self, phi: str = "y") -> xarray.Dataset:
        """E_t(φ, k) at every k the run measured, along the finished steps: an
        :class:`xarray.Dataset` with variables ``value``, ``lower``, ``upper`` (dims step, k),
        coordinates ``step``, ``k`` and ``exact`` (k: True where the value is exact at every finished step), attributes
        ``route`` ("exact" / "quadrature"), ``bracket`` (how the brackets are guaranteed),
        ``confidence`` (statistical brackets), ``N`` and ``phi``.

        Exact route: k = 1..K (K = N with ``spectrum.k: all``), lower = upper = value.  Quadrature
        route: k = 1..top (exact), then the log grid ``curve_k`` to N.

        Raises:
            ValueError: an unknown phi.
        """
        self._check_phi(phi)
        return self.curve(f"energy_{phi}").to_xarray(phi)

    def eigenvalue_curve(self) -> xarray.Dataset:
        """λ_k^t (the k-th eigenvalue of G_t, descending) at every k the run measured, as
        :meth:`energy_curve` (variables value, lower, upper; dims step, k)."""
        return self.curve("eigenvalue").to_xarray()

    def curve(self, name: str) -> BracketedCurve:
        """The curve ``name`` ("eigenvalue" or "energy_<φ>") as NumPy arrays with its bracket
        (:class:`~nsa_dist.client.BracketedCurve`), read once per set of finished steps.

        Raises:
            ValueError: an unknown name.  KeyError: the run does not store it (e.g. f_test without test points).
        """
        if name != "eigenvalue":
            self._check_phi(name.removeprefix("energy_") if name.startswith("energy_") else name)
        key = (name, self.finished.tobytes())
        cache = self.__dict__.setdefault("_curve_cache", {})
        if key not in cache:
            if len(cache) > 16:
                cache.clear()
            n = int(self.shape("X_test")[0]) if name == "energy_f_test" and self.has("X_test") else self.N
            cache[key] = read_curve(self, name, n)  # f_test: in the eigenbasis of the M×M test Gram
        return cache[key]

    def bracket_widths(self, phis: str | tuple[str, ...] = PHI_NAMES) -> pandas.DataFrame:
        """Where each E_t(φ, k)'s bracket is widest, per finished step: columns ``step``, ``phi``,
        ``width``, ``k`` (``<NA>`` where the step's E is NaN), ``value``, ``lower``, ``upper`` (at that k).
        0 on the exact route but
        inside an eigenvalue cluster (a rank-deficient G's null space); on the quadrature route
        the step's log says what each width is made of (docs/curves.md).  ``phis``: the φ, or
        one φ as a string (default: every φ, f_test too).  A φ the run does not store is left out.

        Raises:
            ValueError: an unknown phi.
        """
        import pandas as pd

        rows = []
        for phi in (phis,) if isinstance(phis, str) else phis:
            self._check_phi(phi)
            try:
                c = self.curve(f"energy_{phi}")
            except KeyError:
                continue
            width, k = c.widest()
            j = np.searchsorted(c.k, k) if c.k.size else np.zeros(k.size, np.int64)
            for i, step in enumerate(c.steps):
                at = (c.value[i, j[i]], c.lower[i, j[i]], c.upper[i, j[i]]) if c.k.size else (np.nan,) * 3
                known = np.isfinite(width[i])  # a NaN step (its update not seen) has no widest k: it read k = 0
                rows.append((int(step), phi, float(width[i]), int(k[i]) if known else None, *map(float, at)))
        out = pd.DataFrame(rows, columns=["step", "phi", "width", "k", "value", "lower", "upper"])
        out["k"] = out["k"].astype("Int64")
        return out

    def numerical_rank(self, step: int | None = -1, *, among_stored: bool = False) -> Any:
        """#{i: λ_i^t > δ}, δ the reduction's rounding — max(N·eps₆₄·λ_1, and under ``spectrum.dtype:
        float32`` 4·eps₃₂·‖G_t‖_F): beyond it the eigenvalues are rounding and the eigenvectors one
        basis of many, so per-eigenvector arrays (``projections_residual``, ``constant_gram_energy``)
        there are that basis's values (float32 ones were 0.54 for 3.11, an audit).  An int at ``step``
        (−1: the last finished step); None: (S,) at every finished step.  ``among_stored``: the count
        among the K stored eigenvalues (K where all K lie above δ — a lower bound of the rank then).

        Raises:
            ValueError: (not ``among_stored``) the run kept K < N eigenvalues and all K at the step lie
                above δ: the rank is ≥ K, not known (it read K — an audit: 8 for a rank of 44).
            KeyError: ``step`` is not a finished recorded step.
        """
        lam = np.asarray(self.eigenvalues, np.float64)
        rank, steps = (lam > rounding_delta(self, lam, self.N)[:, None]).sum(axis=1), self.steps
        if step is not None:
            at = int(np.flatnonzero(steps == self._step(step))[0])
            rank, steps = rank[at : at + 1], steps[at : at + 1]
        K = lam.shape[1]
        if not flag(among_stored, "among_stored") and K < self.N and np.any(rank >= K):
            how = "the exact route, spectrum.energy: exact," if self.energy_route == "quadrature" else "spectrum.k: all"
            raise ValueError(
                f"run {self.id!r} kept the top {K} of N = {self.N} eigenvalues and all {K} lie above the "
                f"rounding at step(s) {steps[rank >= K].tolist()[:5]}: G_t's numerical rank "
                f"there is ≥ {K}, not known ({how} measures it; numerical_rank(among_stored=True) counts "
                "the stored ones)"
            )
        return rank if step is None else int(rank[0])

    @property
    def k_max(self) -> int:
        """The largest k at which :meth:`energy` answers: N on the quadrature route, else the
        eigenpairs kept (K; N with ``spectrum.k: all``)."""
        if self.energy_route == "quadrature" and self.has("curve_k"):
            return self.N
        return int(self.shape("eigenvalues")[1])

    @property
    def energy_route(self) -> str:
        """ "exact" or "quadrature": how the run measured E_t(φ, k) and λ_i beyond its top eigenpairs."""
        return energy_route(self)

    @property
    def curve_bracket(self) -> str:
        """How the curves' brackets are guaranteed (the run's ``curve_bracket``; exact on the exact route)."""
        if self.energy_route == "exact":
            return EXACT_BRACKET
        return str(self.attrs.get("curve_bracket", "quadrature bounds (the run names no bracket kind)"))

    def gram_density(self, step: int | None = -1) -> tuple[np.ndarray, np.ndarray]:
        """(grid, density) of the spectral density of G_t (stochastic Lanczos quadrature; it
        integrates to 1 over the grid) at ``step`` (−1: the last finished step; None: every
        finished step, (S, bins) each).  Under ``spectrum.dtype: float32`` the density is NaN
        where |λ| < 4·eps₃₂·‖G_t‖_F, below what the float32 reduction resolves (the mass there is
        1 − the integral of the rest).

        Raises:
            KeyError: the run stores no density of G (the exact route stores every eigenvalue
                instead: :meth:`eigenvalue_curve`), or an unfinished step.
        """
        if not self.has("gram_density"):
            raise KeyError(
                f"run {self.id!r} stores no gram_density (the quadrature route stores it; this run's "
                f"route is {self.energy_route!r}: its eigenvalues are eigenvalue_curve())"
            )
        if step is None:
            grid = np.asarray(self.per_step("gram_density_grid"), np.float64)
            dens = np.asarray(self.per_step("gram_density"), np.float64)
            return grid, self._resolved(grid, dens, np.arange(len(self.steps)))
        j = int(np.flatnonzero(self.steps == self._step(step))[0])
        i = self.index_of(self._step(step))
        grid = np.asarray(self.row("gram_density_grid", i), np.float64)
        dens = np.asarray(self.row("gram_density", i), np.float64)
        return grid, self._resolved(grid[None], dens[None], np.array([j]))[0]

    def _resolved(self, grid: np.ndarray, dens: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``dens`` (S', bins) NaN where λ lies below what a float32 reduction resolves, 4·eps₃₂·‖G_t‖_F
        (``spectrum.dtype: float32`` only): an audit's float32 density there was noise — 3.6e-5 against
        the float64 run's 3.2e5 at λ = 3.3e-8, 95 of 200 grid points below the resolution 6.4e-4 (the
        mass below it, 1 − the integral of the rest, was right: 0.34 against 0.29)."""
        if self.spec.spectrum.dtype != "float32" or not self.has("gram_sq_frobenius"):
            return dens
        fro2 = np.asarray(self.per_step("gram_sq_frobenius"), np.float64).reshape(len(self.steps), -1)[rows, 0]
        floor = 4.0 * float(np.finfo(np.float32).eps) * np.sqrt(np.abs(fro2))[:, None]
        return np.where(np.abs(grid) < floor, np.nan, dens)

    def _check_phi(self, phi: str) -> None:
        if phi not in PHI_NAMES:
            raise ValueError(f"phi={phi!r} is not one of {', '.join(PHI_NAMES)}")

    def _step(self, step: int) -> int:
        """``step`` as a finished recorded step (−1: the last), or KeyError naming the finished ones."""
        steps = self.steps
        if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
            raise KeyError(f"step={step!r} is not a recorded step t (an integer, -1 for the last, None for all)")
        if step == -1:
            if not len(steps):
                raise KeyError(f"run {self.id!r} has no finished recorded step yet (status {self.status!r})")
            return int(steps[-1])
        self.index_of(int(step))  # KeyError naming the finished steps
        return int(step)

    def _at(self, curve: BracketedCurve, k: int, step: int | None) -> Any:
        value, lower, upper = curve.at(k)
        if step is None:
            return value, lower, upper
        j = int(np.flatnonzero(curve.steps == self._step(step))[0])
        return float(value[j]), float(lower[j]), float(upper[j])

    def spectrum_preservation(
        self, t1: int | None = None, t2: int | None = None, i: list[int] | None = None
    ) -> tuple[np.ndarray, int, int, list[int]]:
        """E_{t1}(v_i^{t2}, k) for every k (NSA Fig. 7d): (rows, K) with t1, t2 and the rows i.

        Default: what the run stored when it finished, else computed from the stored eigenvectors;
        an omitted t1 or t2 is the writer's choice among the finished eigenvector steps
        (:func:`~nsa_dist.metrics.preservation.preservation_pair`: the second, or with a
        ``store_eigenvectors`` list the first, against the last).

        Raises:
            ValueError: t1 or t2 omitted and fewer than two eigenvector steps are finished.
        """
        if t1 is None and t2 is None and i is None and self.has("preservation"):
            a = self.array_attrs("preservation")
            return self.array("preservation"), int(a["t1"]), int(a["t2"]), list(a["rows"])
        if t1 is None or t2 is None:
            steps = self.eigenvector_steps
            pair = preservation_pair(steps, listed=isinstance(self.spec.spectrum.store_eigenvectors, list))
            if pair is None:
                raise ValueError(
                    f"run {self.id!r} has eigenvectors at {len(steps)} finished step(s); preservation needs two"
                )
            t1 = int(pair[0]) if t1 is None else t1
            t2 = int(pair[1]) if t2 is None else t2
        V1, V2 = self.eigenvectors(t1), self.eigenvectors(t2)
        rows = list(i) if i is not None else [j for j in (1, 2, 3, 5, 10, 20, 50, 100) if j <= V2.shape[1]]
        if not rows:  # i=[] gave the default rows (an audit)
            raise ValueError(f"i={i!r}: give the rows i (1..{V2.shape[1]}) of E_t1(v_i^t2, k), or None for the default")
        return spectrum_preservation(V1, V2, i=rows), t1, t2, rows

    # ------------------------------------------------------------------ training
    @property
    def train_loss(self) -> np.ndarray:
        """(S,) L(θ_t) at the recorded steps."""
        return self.per_step("loss")

    @property
    def loss_trace(self) -> np.ndarray:
        """(T,) the loss of every training step as the optimizer computed it (NaN where not trained
        yet): L(θ_t) over all N points for full-batch GD / Adam, the minibatch's loss for SGD and
        minibatch Adam (at t = 0 of an SGD b = 8 run 1.049 where L(θ_0) = 0.596); the full-data
        loss at the recorded steps is :attr:`train_loss`."""
        return self.array("loss_trace")

    @property
    def test_loss(self) -> np.ndarray:
        """(S,) L_test(θ_t): the run's loss at the test points (NSA Fig. 7c) — (1/M) Σ_j ½‖f_t(x_j) − y_j‖²
        for L2, the NCE loss over the held-out data and noise points for ``loss: nce``.

        Raises:
            KeyError: the run has no test points (data.n_test: 0)."""
        if not self.has("loss_test") and not int(getattr(self.dims, "M", 0) or 0):
            raise KeyError(f"run {self.id!r} has no test loss: it has no test points (data.n_test: 0)")
        return self.per_step("loss_test")

    @property
    def lr(self) -> np.ndarray:
        """(S,) learning rate δ_t."""
        return self.per_step("lr")

    @property
    def first_order(self) -> dict[str, np.ndarray]:
        """{"error": ‖df − df_pred‖/‖df‖, "cos": cos α_t} along t (NSA Fig. 1d)."""
        return {"error": self.per_step("first_order_error"), "cos": self.per_step("first_order_cos")}

    @property
    def alignment(self) -> dict[str, np.ndarray]:
        """{"raw": yᵀGy/(‖G‖_F‖y‖²), "centered": …} along t."""
        return {"raw": self.per_step("alignment"), "centered": self.per_step("alignment_centered")}

    def outputs(self, step: int, which: str = "f") -> np.ndarray:
        """f_t ("f"), df_t ("df"), the first-order df ("df_pred") or f_t at test points ("f_test").

        Raises:
            ValueError: an unknown ``which``.  KeyError: ``step`` is not finished.
        """
        if which not in ("f", "df", "df_pred", "f_test"):
            raise ValueError(f"which={which!r} is not one of f, df, df_pred, f_test")
        return np.asarray(self.row(which, self.index_of(step)), dtype=np.float64)

    def residual(self, step: int) -> np.ndarray:
        """m_t = ∂ℓ/∂f at the training points: f_t − y (l2), softmax(f_t) − y (cross_entropy).

        Raises:
            ValueError: an NCE run (its residual needs the labels and noise log-densities, not stored).
        """
        from nsa_dist.losses import residual

        if str(getattr(self.spec.loss, "value", self.spec.loss)) == "nce":
            raise ValueError(
                f"run {self.id!r} is an NCE run: its residual m_t = σ(f_t − log(ν q)) − c needs each point's label c "
                "(data or noise) and the noise log-density log(ν q), which the store does not keep — its energies "
                "E_t(m, k) and projections are stored (energy('residual', k), per_step('projections_residual'))"
            )
        return residual(self.spec.loss, self.outputs(step), self.y)

    # ------------------------------------------------------------------ GD's stability
    @property
    def stability_eigenvalues(self) -> np.ndarray:
        """(S, K') the eigenvalues that set GD's dynamics of the stacked residual m (N·Ko,).

        One output: λ_i^t of G_t (``eigenvalues``).  Ko > 1 outputs: the top Kf eigenvalues of
        the full (N·Ko)×(N·Ko) kernel J Jᵀ (``eigenvalues_full``) — NOT the output-traced Gram
        Σ_a J_a J_aᵀ stored in ``eigenvalues``, whose λ_max is up to Ko times larger.

        Raises:
            StoreError: a Ko > 1 run written before ``eigenvalues_full`` existed.
        """
        if self.has("eigenvalues_full"):
            return self.per_step("eigenvalues_full")
        if self.Ko > 1:
            raise StoreError(
                f"run {self.id!r} has Ko={self.Ko} outputs but no 'eigenvalues_full' (written by an "
                "older nsa-dist): its stability quantities would use the traced Gram; re-run it"
            )
        return self.eigenvalues

    @property
    def lambda_max(self) -> np.ndarray:
        """(S,) λ_max^t of the kernel that sets GD's stability (see :attr:`stability_eigenvalues`)."""
        return self.stability_eigenvalues[:, 0]

    def lr_eigen_product(self) -> np.ndarray:
        """(S, K') δ_t λ_i^t / N (NSA Fig. 2d), λ of :attr:`stability_eigenvalues`; a GD formula.  NaN
        at a step whose δ_t is unknown (a Tracker's step whose update was not GD at one rate)."""
        return self._per_known_lr(lr_eigen_product)

    def flow_speed(self) -> np.ndarray:
        """(S, K') s_i^t = 1 − |1 − δ_t λ_i^t / N| (NSA Fig. 2c), λ of :attr:`stability_eigenvalues`; a GD
        formula.  NaN at a step whose δ_t is unknown (as :meth:`lr_eigen_product`)."""
        return self._per_known_lr(flow_speed)

    def _per_known_lr(self, fn) -> np.ndarray:
        lam, lr = self.stability_eigenvalues, np.asarray(self.lr, np.float64)
        out = np.full(lam.shape, np.nan)
        # δ_t = 0 (a warmup from 0, an audit: the whole figure was refused, "lr must be > 0"): no flow, δλ/N
        # and s = 1 − |1 − 0| both 0; a negative or unknown δ_t: NaN
        out[lr == 0] = 0.0
        known = np.isfinite(lr) & (lr > 0)
        if known.any():
            out[known] = fn(lam[known], lr[known, None], self.N)
        return out

    def stability_bound(self) -> np.ndarray:
        """(S,) 2N/λ_max^t, the largest stable learning rate of GD on the L2 loss (NSA Fig. 1e),
        λ_max = :attr:`lambda_max`.  For cross-entropy it is not that bound: GD there moves by the
        softmax-curvature-weighted kernel, whose top eigenvalue is smaller (at N = 24 digits the
        weighted bound was 10.7× this one, and lr 0.5 trained stably above 0.097)."""
        return stability_bound(self.lambda_max, self.N)

    # ------------------------------------------------------------------ as data
    def to_xarray(self, *, state: bool = False) -> xarray.Dataset:
        """The run's finished steps as an :class:`xarray.Dataset` (dims step, k, point, output, …).

        ``step`` is a coordinate (the recorded t), ``k`` / ``k_full`` / ``k_test`` run from 1;
        ``state=True`` adds the resume state (theta, opt_slots, rng_state).  Needs xarray.
        """
        return run_to_xarray(self, state=flag(state, "state"))

    def __repr__(self) -> str:
        return f"Run({self.id!r}, status={self.status!r}, steps={len(self.finished)}/{len(self.schedule)})"
