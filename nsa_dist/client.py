"""Read-only access to a spectrum store: ``Client(url).runs()``, ``Client(url).run(id)``.

The client never talks to live actors: it reads the Zarr store, also while runs are still
writing — a :class:`Run` sees every step finished when it was opened (``refresh()`` to update).
Everything comes out as plain NumPy arrays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from nsa_dist.config import ExperimentSpec
from nsa_dist.errors import StoreError
from nsa_dist.metrics import flow_speed, lr_eigen_product, spectrum_preservation, stability_bound
from nsa_dist.store import PHIS, RunDims, SpectrumStore

if TYPE_CHECKING:
    import pandas
    import xarray

    from nsa_dist.sweep_view import Sweep

__all__ = ["Client", "Run", "PHI_NAMES"]

PHI_NAMES = PHIS + ("f_test",)


class Run:
    """One run's recorded spectra, read from the store.

    Arrays are indexed by the finished recorded steps (``steps``, S entries).
    """

    def __init__(self, store: SpectrumStore, run_id: str) -> None:
        self._store, self.id = store, run_id
        self._r = store.reader(run_id)
        if "spec" not in self._r.attrs:
            raise StoreError(f"corrupt run {run_id!r}: {self._r.path}/zarr.json has no 'spec' attribute")
        self.spec = ExperimentSpec.model_validate(self._r.attrs["spec"])
        self._set_state()

    def refresh(self) -> "Run":
        """Re-read the status and the set of finished steps (for watching a live run)."""
        self._r.refresh()
        self._set_state()
        return self

    def _set_state(self) -> None:
        attrs = self._r.attrs
        self.status, self.reason = self._r.status()
        self.failed_step = attrs.get("failed_step")
        self.attrs: dict[str, Any] = dict(attrs)
        self._idx = np.flatnonzero(self._r.done)

    @property
    def g(self) -> Any:
        """The run's Zarr group, read-only (prefer the typed properties: their reads are checked)."""
        return self._r.g

    def has(self, name: str) -> bool:
        """Whether the run holds array ``name``."""
        return self._r.has(name)

    def array(self, name: str) -> np.ndarray:
        """A whole stored array (every recorded step, finished or not: unfinished steps are NaN)."""
        return self._r.read(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of array ``name`` (all S recorded steps)."""
        return self._r.shape(name)

    def array_names(self) -> list[str]:
        return self._r.names()

    def _read(self, name: str) -> np.ndarray:
        return self._r.read(name)

    def _at(self, name: str, i: int) -> np.ndarray:
        return self._r.read_step(name, i)

    def _per_step(self, name: str) -> np.ndarray:
        return self._r.read_steps(name, self._idx)

    def _index_of(self, step: int) -> int:
        steps = self.steps
        where = np.flatnonzero(steps == step)
        if not len(where):
            raise KeyError(f"step {step} is not a finished recorded step of run {self.id!r}; "
                           f"finished: {steps.tolist()[:20]}{' …' if len(steps) > 20 else ''}")
        return int(self._idx[where[0]])

    # ------------------------------------------------------------------ static
    @property
    def dims(self) -> RunDims:
        """The sizes the run's arrays were created with (N, K, P, S, …)."""
        return RunDims.from_json(self.attrs["dims"])

    @property
    def data_fingerprint(self) -> str | None:
        """``"sha256:…"`` of the data the run was created from (X, y, X_test, y_test as loaded;
        :meth:`nsa_dist.data.Dataset.fingerprint`); None for runs recorded before fingerprints."""
        return self.attrs.get("data_fingerprint")

    @property
    def schedule(self) -> np.ndarray:
        """(S_all,) every step that will be recorded."""
        return self._read("steps")

    @property
    def X(self) -> np.ndarray:
        return self._read("X")

    @property
    def y(self) -> np.ndarray:
        return self._read("y")

    @property
    def X_test(self) -> np.ndarray:
        return self._read("X_test")

    @property
    def N(self) -> int:
        return int(self._r.shape("X")[0])

    # ------------------------------------------------------------------ per step
    @property
    def steps(self) -> np.ndarray:
        """(S,) the finished recorded steps t."""
        return self.schedule[self._idx]

    @property
    def eigenvalues(self) -> np.ndarray:
        """(S, K) top eigenvalues λ_i^t of G_t, descending."""
        return self._per_step("eigenvalues")

    @property
    def eigenvector_steps(self) -> np.ndarray:
        """(Se,) the finished steps whose eigenvectors are stored (``spectrum.store_eigenvectors``)."""
        if not self.has("eigenvectors"):
            return np.zeros(0, dtype=np.int64)
        return np.array([t for t in self.steps if self.spec.spectrum.eigenvectors_at(int(t))], dtype=np.int64)

    def eigenvectors(self, step: int) -> np.ndarray:
        """(N, K) eigenvectors of G_t at recorded step ``step``.

        Raises:
            KeyError: ``step`` is not finished, or its eigenvectors were not stored.
        """
        i = self._index_of(step)
        if self.has("eigenvectors") and not self.spec.spectrum.eigenvectors_at(int(step)):
            raise KeyError(f"run {self.id!r} stores eigenvectors only at steps {self.eigenvector_steps.tolist()}, "
                           f"not at {step} (spectrum.store_eigenvectors)")
        return np.asarray(self._at("eigenvectors", i), dtype=np.float64)

    def reconstructions(self, step: int) -> dict[str, np.ndarray]:
        """NSA Fig. 4d at eigenvector step ``step``: {"k": (nR,), "f": (nR, N[, Ko]) f̄_{t,k} =
        Σ_{i≤k} ⟨v_i, f̄_t⟩ v_i, and on 2-D data "images": (nR, R, R) on [0, 1]²}.

        Raises:
            KeyError: ``step`` is not finished, or not one of the eigenvector steps.
        """
        i = self._index_of(step)
        if not self.has("reconstructions") or not self.spec.spectrum.eigenvectors_at(int(step)):
            raise KeyError(f"run {self.id!r} stores reconstructions only at its eigenvector steps "
                           f"{self.eigenvector_steps.tolist()}, not at {step}")
        out = {"k": self._read("reconstruction_k"), "f": self._at("reconstructions", i)}
        if self.has("reconstruction_images"):
            out["images"] = self._at("reconstruction_images", i)
        return out

    def constant_gram_test(self) -> np.ndarray:
        """App. E, Eq. 22: (S, M[, Ko]) the test outputs f_t(X') at every recorded step predicted at the
        first one by GD with G_{t0} fixed, through the Nyström extension of its eigenvectors (the
        measured ones: ``outputs(t, "f_test")``)."""
        return np.asarray(self._at("constant_gram_f_test", 0), dtype=np.float64)

    def gram_change(self) -> dict[str, np.ndarray]:
        """NSA App. F along the eigenvector steps: {"steps": (Se,), "measured", "first_order": (Se, Kg)
        v_iᵀ dG_t v_i, "fro": (Se, 3) ‖VᵀdG_tV‖_F measured, first order, their difference}."""
        idx = [self._index_of(int(t)) for t in self.eigenvector_steps]
        gc = np.asarray(self._r.read_steps("gram_change", np.asarray(idx, dtype=np.int64)))  # (Se, 2, Kg)
        fro = np.asarray(self._r.read_steps("gram_change_fro", np.asarray(idx, dtype=np.int64)))
        return {"steps": self.eigenvector_steps, "measured": gc[:, 0], "first_order": gc[:, 1], "fro": fro}

    def residual_projections(self, step: int) -> np.ndarray:
        """(K,) ⟨v_i^t, m_t⟩² summed over outputs (NSA Fig. 4a), stored at every recorded step."""
        return np.asarray(self._at("projections_residual", self._index_of(step)), dtype=np.float64)

    def energy(self, phi: str = "y", k: int | None = None) -> np.ndarray:
        """E_t(φ, k) along t: (S,) for one k, (S, K) for all k ≤ K.

        phi: "y" labels, "f" outputs f_t, "residual" m_t, "df" real update, "df_pred" first-order
        update −(δ/N) G m, "f_test" outputs at the test points (eigenvectors of the test Gram).
        """
        if phi not in PHI_NAMES:
            raise ValueError(f"phi={phi!r} is not one of {', '.join(PHI_NAMES)}")
        E = self._per_step(f"energy_{phi}")
        if k is None:
            return E
        if not 1 <= k <= E.shape[1]:
            raise ValueError(f"k={k} outside 1..{E.shape[1]} (the eigenpairs kept for {phi!r})")
        return E[:, k - 1]

    @property
    def train_loss(self) -> np.ndarray:
        """(S,) L(θ_t) at the recorded steps."""
        return self._per_step("loss")

    @property
    def loss_trace(self) -> np.ndarray:
        """(T,) the loss of every training step (NaN where not trained yet)."""
        return self._read("loss_trace")

    @property
    def lr(self) -> np.ndarray:
        """(S,) learning rate δ_t."""
        return self._per_step("lr")

    @property
    def first_order(self) -> dict[str, np.ndarray]:
        """{"error": ‖df − df_pred‖/‖df‖, "cos": cos α_t} along t (NSA Fig. 1d)."""
        return {"error": self._per_step("first_order_error"), "cos": self._per_step("first_order_cos")}

    @property
    def alignment(self) -> dict[str, np.ndarray]:
        """{"raw": yᵀGy/(‖G‖_F‖y‖²), "centered": …} along t."""
        return {"raw": self._per_step("alignment"), "centered": self._per_step("alignment_centered")}

    @property
    def stability_eigenvalues(self) -> np.ndarray:
        """(S, K') the eigenvalues that set GD's dynamics of the stacked residual m (N·Ko,).

        One output: λ_i^t of G_t (``eigenvalues``).  Ko > 1 outputs: the top Kf eigenvalues of
        the full (N·Ko)×(N·Ko) kernel J Jᵀ (``eigenvalues_full``) — NOT the output-traced Gram
        Σ_a J_a J_aᵀ stored in ``eigenvalues``, whose λ_max is up to Ko times larger.
        """
        if self.has("eigenvalues_full"):
            return self._per_step("eigenvalues_full")
        if self.Ko > 1:
            raise StoreError(f"run {self.id!r} has Ko={self.Ko} outputs but no 'eigenvalues_full' (written by an "
                             "older nsa-dist): its stability quantities would use the traced Gram; re-run it")
        return self.eigenvalues

    @property
    def Ko(self) -> int:
        """Number of network outputs."""
        y = self._r.shape("y")
        return 1 if len(y) == 1 else int(y[1])

    @property
    def lambda_max(self) -> np.ndarray:
        """(S,) λ_max^t of the kernel that sets GD's stability (see :attr:`stability_eigenvalues`)."""
        return self.stability_eigenvalues[:, 0]

    def lr_eigen_product(self) -> np.ndarray:
        """(S, K') δ_t λ_i^t / N (NSA Fig. 2d), λ of :attr:`stability_eigenvalues`; a GD formula."""
        return lr_eigen_product(self.stability_eigenvalues, self.lr[:, None], self.N)

    def flow_speed(self) -> np.ndarray:
        """(S, K') s_i^t = 1 − |1 − δ_t λ_i^t / N| (NSA Fig. 2c), λ of :attr:`stability_eigenvalues`; a GD formula."""
        return flow_speed(self.stability_eigenvalues, self.lr[:, None], self.N)

    def stability_bound(self) -> np.ndarray:
        """(S,) 2N/λ_max^t, the largest stable learning rate of GD (NSA Fig. 1e), λ_max = :attr:`lambda_max`."""
        return stability_bound(self.lambda_max, self.N)

    @property
    def per_class_eigenvalues(self) -> np.ndarray:
        """(S, Ko, Kc) top eigenvalues of each diagonal block J_a J_aᵀ of the full kernel (one-hot:
        the per-class spectra), if ``spectrum.per_class_k`` > 0."""
        return self._per_step("eigenvalues_per_class")

    @property
    def test_loss(self) -> np.ndarray:
        """(S,) L_test(θ_t): the run's loss at the test points (NSA Fig. 7c) — (1/M) Σ_j ½‖f_t(x_j) − y_j‖²
        for L2, the NCE loss over the held-out data and noise points for ``loss: nce``."""
        return self._per_step("loss_test")

    def to_xarray(self, *, state: bool = False) -> "xarray.Dataset":
        """The run's finished steps as an :class:`xarray.Dataset` (dims step, k, point, output, …).

        ``step`` is a coordinate (the recorded t), ``k`` / ``k_full`` / ``k_test`` run from 1;
        ``state=True`` adds the resume state (theta, opt_slots, rng_state).  Needs xarray.
        """
        from nsa_dist.frames import run_to_xarray

        return run_to_xarray(self, state=state)

    def outputs(self, step: int, which: str = "f") -> np.ndarray:
        """f_t ("f"), df_t ("df"), the first-order df ("df_pred") or f_t at test points ("f_test")."""
        if which not in ("f", "df", "df_pred", "f_test"):
            raise ValueError(f"which={which!r} is not one of f, df, df_pred, f_test")
        return np.asarray(self._at(which, self._index_of(step)), dtype=np.float64)

    def residual(self, step: int) -> np.ndarray:
        """m_t = ∂ℓ/∂f at the training points: f_t − y (l2), softmax(f_t) − y (cross_entropy)."""
        if getattr(self.spec, "loss", None) is not None and getattr(self.spec.loss, "value", self.spec.loss) == "cross_entropy":
            from nsa_dist.losses import softmax

            return softmax(self.outputs(step)) - self.y
        return self.outputs(step) - self.y

    def images(self, step: int) -> dict[str, np.ndarray]:
        """2-D data: eigenvector images (nI, R, R), their |Fourier| (nI, F, F), the residual's, the indices."""
        i = self._index_of(step)
        return {"indices": self._read("image_indices"), "eigvec_images": self._at("eigvec_images", i),
                "eigvec_fourier": self._at("eigvec_fourier", i), "residual_image": self._at("residual_image", i),
                "residual_fourier": self._at("residual_fourier", i)}

    def spectrum_preservation(self, t1: int | None = None, t2: int | None = None,
                              i: list[int] | None = None) -> tuple[np.ndarray, int, int, list[int]]:
        """E_{t1}(v_i^{t2}, k) for every k (NSA Fig. 7d): (rows, K) with t1, t2 and the rows i.

        Default: what the run stored when it finished (second vs last recorded step), else
        computed from the stored eigenvectors.
        """
        if t1 is None and t2 is None and i is None and self.has("preservation"):
            a = self._r.array_attrs("preservation")
            return self._read("preservation"), int(a["t1"]), int(a["t2"]), list(a["rows"])
        steps = self.eigenvector_steps
        if len(steps) < 2 and (t1 is None or t2 is None):
            raise ValueError(f"run {self.id!r} has eigenvectors at {len(steps)} finished step(s); preservation needs two")
        t1 = int(steps[1 if len(steps) > 2 and not isinstance(self.spec.spectrum.store_eigenvectors, list) else 0]) \
            if t1 is None else t1
        t2 = int(steps[-1]) if t2 is None else t2
        V1, V2 = self.eigenvectors(t1), self.eigenvectors(t2)
        rows = i or [j for j in (1, 2, 3, 5, 10, 20, 50, 100) if j <= V2.shape[1]]
        return spectrum_preservation(V1, V2, i=rows), t1, t2, rows

    # ------------------------------------------------------------------ Hessian (H = I + S)
    def _hessian_index(self) -> np.ndarray:
        """Positions (into ``steps``) of the finished steps whose Hessian was analysed."""
        mask = self._read("hessian_steps")[self._idx]
        return np.flatnonzero(mask)

    @property
    def hessian_steps(self) -> np.ndarray:
        """(Sh,) the finished recorded steps with Hessian measurements."""
        return self.steps[self._hessian_index()]

    def _hessian(self, name: str) -> np.ndarray:
        return self._per_step(name)[self._hessian_index()]

    def hessian_moments(self, part: str = "H") -> dict[str, np.ndarray]:
        """Tr(A^k), k = 1..4, along the analysed steps: {"estimate": (Sh, 4), "stderr": (Sh, 4)}.

        part: "H", "I" or "S" (Hutch++ estimates); "I_exact" for Tr(I^k) from the NTK Gram;
        "I_limit" for the infinite-width prediction from Θ∞ (NaN where it does not apply).
        """
        if part in ("I_exact", "I_limit"):
            est = self._hessian("hessian_moments_I_exact" if part == "I_exact" else "hessian_I_limit_moments")
            return {"estimate": est, "stderr": np.zeros_like(est)}
        j = _part(part)
        return {"estimate": self._hessian("hessian_moments")[:, j], "stderr": self._hessian("hessian_moments_stderr")[:, j]}

    @property
    def hessian_orthogonality(self) -> dict[str, np.ndarray]:
        """‖IS‖_F / (‖I‖_F ‖S‖_F) along the analysed steps: {"value": (Sh,), "stderr": (Sh,)}."""
        o = self._hessian("hessian_orthogonality")
        return {"value": o[:, 0], "stderr": o[:, 1]}

    def hessian_rayleigh(self, step: int | None = None) -> dict[str, np.ndarray]:
        """The Hessian paper's Fig. 3 at ``step`` (default: the last analysed).

        {"I": (2, k) [vᵀIv; vᵀSv] over the top-k eigenvectors of I, "S": the same over S's,
        "evals_I", "evals_S": their eigenvalues}.
        """
        i = self._hessian_pos(step)
        R, E = self._at("hessian_rayleigh", i), self._at("hessian_rayleigh_evals", i)
        return {"I": R[0], "S": R[1], "evals_I": E[0], "evals_S": E[1]}

    def hessian_top(self, part: str = "H") -> np.ndarray:
        """(Sh, k) the largest eigenvalues of H, I or S along the analysed steps."""
        return self._hessian("hessian_top")[:, _part(part)]

    def edge_of_stability(self) -> np.ndarray:
        """(Sh,) λ_max(H)·δ_t / 2 (:func:`nsa_dist.hessian.edge_of_stability`): GD on the local
        quadratic model is stable while it stays below 1."""
        from nsa_dist.hessian import edge_of_stability

        lr = self.lr[self._hessian_index()]
        return np.array([edge_of_stability(lam, d) for lam, d in zip(self.hessian_top("H")[:, 0], lr)], dtype=np.float64)

    def hessian_density(self, step: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(grid, density) of the SLQ spectral density of H at ``step`` (default: the last analysed)."""
        i = self._hessian_pos(step)
        return self._at("hessian_density_grid", i), self._at("hessian_density", i)

    def hessian_I_eigenvalues(self, limit: bool = False) -> np.ndarray:
        """(Sh, N·K) eigenvalues of I outside its null space, descending: measured exactly (from the
        NTK Gram; NaN with a distributed layout) or, ``limit=True``, the kernel PCA of Θ∞
        weighted by HC (NaN where the limit does not apply, see docs/store.md)."""
        return self._hessian("hessian_I_limit_eigenvalues" if limit else "hessian_I_eigenvalues")

    def hessian_additivity(self) -> dict[str, np.ndarray]:
        """Theorem 1's gap Tr(H^k) − Tr(I^k) − Tr(S^k), k = 1..4 (shared probes):
        {"estimate": (Sh, 4), "stderr": (Sh, 4)}."""
        a = self._hessian("hessian_additivity")
        return {"estimate": a[:, 0], "stderr": a[:, 1]}

    def hessian_trace_S(self) -> dict[str, np.ndarray]:
        """Tr(S) two independent ways along the analysed steps: "G" = ∇Cᵀ·G (per-point traces of the
        model Hessian) with "G_stderr", and "hutchpp" (Hutch++ on S) with "hutchpp_stderr"."""
        g, m = self._hessian("hessian_trace_S_G"), self.hessian_moments("S")
        return {"G": g[:, 0], "G_stderr": g[:, 1], "hutchpp": m["estimate"][:, 0], "hutchpp_stderr": m["stderr"][:, 0]}

    def hessian_S_limit(self) -> dict[str, np.ndarray]:
        """The infinite-width predictions for S along the analysed steps (the Hessian paper,
        Proposition 4 and Theorem 1; :mod:`nsa_dist.hessian.s_limit`), (Sh,) each, NaN where a
        prediction does not apply: "trace_S_init" E[Tr S] at initialisation (MSE: K Tr(Φ̃)/N),
        "trace_S" E[Tr S_t] along plain GD (MSE), "trace_S2" Tr(S²) = ∇C_tᵀ (Υ̃ ⊗ Id) ∇C_t."""
        a = self._hessian("hessian_S_limit")
        return {"trace_S_init": a[:, 0], "trace_S": a[:, 1], "trace_S2": a[:, 2]}

    def hessian_G(self, step: int | None = None) -> dict[str, np.ndarray]:
        """G_i = Σ_p ∂²f(x_i)/∂θ_p² at ``step`` (default: the last analysed): {"estimate", "stderr"} (N,) or (N, K)."""
        i = self._hessian_pos(step)
        return {"estimate": self._read("hessian_G")[i], "stderr": self._read("hessian_G_stderr")[i]}

    def hessian_S_norms(self) -> dict[str, np.ndarray]:
        """‖S‖_op (Lanczos, "op") beside the paper's bounds Tr(S^k)^{1/k} for k = 2 ("k2" = ‖S‖_F)
        and k = 4 ("k4"), from the Hutch++ moments: (Sh,) each; ‖S‖_op ≤ k4 ≤ k2."""
        m = self.hessian_moments("S")["estimate"]
        with np.errstate(invalid="ignore"):
            return {"op": self._hessian("hessian_S_op"), "k2": np.sqrt(np.clip(m[:, 1], 0, None)),
                    "k4": np.clip(m[:, 3], 0, None) ** 0.25}

    def _hessian_pos(self, step: int | None) -> int:
        steps = self.hessian_steps
        if not len(steps):
            raise ValueError(f"run {self.id!r} has no finished step with Hessian measurements")
        return self._index_of(int(steps[-1]) if step is None else step)

    def __repr__(self) -> str:
        return f"Run({self.id!r}, status={self.status!r}, steps={len(self._idx)}/{len(self.schedule)})"


def _part(part: str) -> int:
    if part not in ("H", "I", "S"):
        raise ValueError(f"part={part!r} is not one of 'H', 'I', 'S'")
    return "HIS".index(part)


class Client:
    """Reads a spectrum store at a local path or fsspec URL (``memory://``, ``s3://``, …)."""

    def __init__(self, url: str = "nsa-results.zarr") -> None:
        self.url = url
        self.store = SpectrumStore(url, mode="r")

    @classmethod
    def of(cls, store: SpectrumStore) -> "Client":
        """A client of a store opened already (``nsa serve`` holds one for all its pages)."""
        c = cls.__new__(cls)
        c.url, c.store = store.url, store
        return c

    def runs(self, sweep: str | None = None, **where: Any) -> "pandas.DataFrame":
        """Every run (or a sweep's) as a DataFrame: id, sweep, status, reason, steps_done,
        steps_total, last_step, data_fingerprint and each spec field as a dotted column ("model.depth", …).

        ``where`` filters on equality, dots written "__": ``runs(model__depth=6)``.  Needs pandas.
        """
        from nsa_dist.frames import runs_frame

        return runs_frame(self.store, sweep, **where)

    def sweeps(self) -> list[str]:
        """Names of the sweeps recorded in the store."""
        return sorted(self.store.sweeps())

    def sweep(self, name: str) -> "Sweep":
        """The runs of sweep ``name`` with its grid (:class:`nsa_dist.sweep_view.Sweep`)."""
        from nsa_dist.sweep_view import Sweep

        return Sweep(self, name)

    def _name_of(self, rid: str) -> str | None:
        try:
            return self.store.run_attrs(rid).get("spec", {}).get("name")
        except StoreError:
            return None  # a damaged run: never matched by name

    def verify(self, mark: bool = False) -> list:
        """Every damaged chunk or metadata file of the store (:func:`nsa_dist.store.verify_store`);
        ``mark``: delete the damaged chunks and mark their steps not done (needs a writable store)."""
        from nsa_dist.store import mark_damaged, verify_store

        damage = verify_store(self.store)
        if mark and damage:
            mark_damaged(SpectrumStore(self.url), damage)
        return damage

    def run(self, run_id: str) -> Run:
        """A run by id, by a unique id prefix, or by its name when only one run has it."""
        ids = self.store.run_ids()
        if run_id in ids:
            return Run(self.store, run_id)
        hits = [r for r in ids if r.startswith(run_id)] or [r for r in ids if self._name_of(r) == run_id]
        if len(hits) == 1:
            return Run(self.store, hits[0])
        if not hits:
            raise StoreError(f"no run {run_id!r} in {self.url!r} (runs: {', '.join(ids[:10]) or 'none'})")
        raise StoreError(f"{run_id!r} matches several runs: {', '.join(hits[:10])}; give the full id")
