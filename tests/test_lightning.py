"""``nsa_dist.lightning.SpectrumCallback`` under a real Lightning ``Trainer``, against an independent
float64 reference of every recorded step.

The reference does not trust Lightning's counters: torch step hooks on the optimizer itself note θ
and every group's learning rate when ``optimizer.step`` is entered (θ_t, δ_t) and θ when it returns
(θ_{t+1}); the test recomputes J_t by ``torch.func.jacrev`` at θ_t, G_t = J_t J_tᵀ and its eigenpairs by
``torch.linalg.eigh``, f_t, Δf_t, J_t Δθ_t and the energies E(φ, k), and compares them with the store.
"""

from __future__ import annotations

import copy
import signal
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from nsa_dist import Client, Tracker  # noqa: E402
from nsa_dist.lightning import SpectrumCallback  # noqa: E402

N, K = 64, 4
TRAINER = dict(
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    X = torch.randn(N, 3, generator=g, dtype=torch.float64)
    return X, torch.sin(X.sum(1)) + 0.1 * torch.randn(N, generator=g, dtype=torch.float64)


class Probe:
    """θ and every group's lr as ``optimizer.step`` is entered, θ as it returns: keyed by the number of
    steps this optimizer made (``start`` + calls), so nothing here reads Lightning's counters."""

    def __init__(self, start: int = 0) -> None:
        self.start, self.pre, self.post = start, {}, {}

    def attach(self, module: nn.Module, opt: torch.optim.Optimizer) -> None:
        def vec() -> torch.Tensor:
            return torch.nn.utils.parameters_to_vector(module.parameters()).detach().clone()

        def pre(o, args, kwargs):
            t = self.start + len(self.pre)
            self.pre[t] = (vec(), [float(g["lr"]) for g in o.param_groups])

        def post(o, args, kwargs):
            self.post[self.start + len(self.post)] = vec()

        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)


class Reg(pl.LightningModule):
    """A researcher's regression module: ½‖f − y‖² mean, the network in ``self.net``."""

    def __init__(self, opt: str = "sgd", lr: float = 0.05, sched=None, warmup: int = 0, crash_at: int = -1) -> None:
        super().__init__()
        self.net = _net()
        self.opt, self.lr, self.sched, self.warmup, self.crash_at = opt, lr, sched, warmup, crash_at
        self.probe = Probe()
        self.losses: dict[int, list[float]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.crash_at:
            raise RuntimeError("user crash")
        x, y = batch
        loss = 0.5 * ((self(x).squeeze(-1) - y) ** 2).mean()
        self.losses.setdefault(self.global_step, []).append(float(loss))  # every micro-batch's loss
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val", 0.5 * ((self(x).squeeze(-1) - y) ** 2).mean())

    def optimizers_for(self, params):
        if self.opt == "adam":
            return torch.optim.Adam(params, lr=self.lr)
        return torch.optim.SGD(params, lr=self.lr, momentum=0.5 if self.opt == "momentum" else 0.0)

    def configure_optimizers(self):
        opt = self.optimizers_for(self.parameters())
        self.probe.attach(self, opt)
        if self.sched is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": self.sched(opt)}

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        if self.warmup:  # Lightning's documented manual warm-up, here set before the step it applies to
            for g in optimizer.param_groups:
                g["lr"] = self.lr * min(1.0, (self.trainer.global_step + 1) / self.warmup)
        optimizer.step(closure=optimizer_closure)


def _loader(batch_size: int = N, shuffle: bool = False, dtype: torch.dtype = torch.float64) -> DataLoader:
    X, y = (a.to(dtype) for a in _data())
    g = torch.Generator().manual_seed(3)
    return DataLoader(TensorDataset(X, y), batch_size=batch_size, shuffle=shuffle, generator=g)


def _tracker(url: str, name: str, model: nn.Module, steps: int, **kw) -> Tracker:
    X, y = _data()
    kw.setdefault("record", {"every": 1})
    return Tracker(url, name, model, X, y, steps=steps, spectrum={"k": K}, device="cpu", **kw)


def _fit(module: pl.LightningModule, tracker, loader=None, val=None, ckpt_path=None, extra=(), **kw):
    """``trainer.fit`` with a SpectrumCallback of ``tracker`` (or that callback itself) and ``extra``."""
    cb = tracker if isinstance(tracker, SpectrumCallback) else SpectrumCallback(tracker)
    trainer = pl.Trainer(callbacks=[cb, *extra], **{**TRAINER, **kw})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's hints about workers and logging intervals
        trainer.fit(module, loader or _loader(), val, ckpt_path=ckpt_path)
    return trainer


def _reference(net: nn.Module, theta: torch.Tensor, X: torch.Tensor):
    """f and J (N, P) of ``net`` at the parameter vector ``theta``, in float64."""
    m = copy.deepcopy(net).double()
    torch.nn.utils.vector_to_parameters(theta.double(), m.parameters())
    params = {k: v.detach() for k, v in m.named_parameters()}
    J = jacrev(lambda p: functional_call(m, p, (X,)).reshape(-1))(params)
    J = torch.cat([j.reshape(X.shape[0], -1) for j in J.values()], 1)
    with torch.no_grad():
        f = m(X).reshape(-1)
    return f, J


def _energy(V: torch.Tensor, phi: torch.Tensor) -> np.ndarray:
    """E(φ, k) for k = 1..K: the share of ‖φ‖² on G's top-k eigenvectors."""
    return (torch.cumsum((V.T @ phi) ** 2, 0) / (phi @ phi)).numpy()


def _close32(stored, ref: torch.Tensor, tol: float = 2e-6) -> None:
    """A float32 array of the store against its float64 reference (to float32's rounding)."""
    ref = ref.numpy()
    np.testing.assert_allclose(stored.reshape(-1), ref, rtol=tol, atol=0.1 * tol * np.abs(ref).max())


def _check(url: str, name: str, net: nn.Module, probe: Probe, steps: list[int], status: str = "done") -> None:
    """Every stored step against the float64 reference at the θ_t, δ_t, θ_{t+1} the optimizer saw."""
    X, y = _data()
    run = Client(url).run(name)
    assert run.status == status
    f32 = next(net.parameters()).dtype == torch.float32  # analysed in float32: float32's rounding
    rtol, etol, ftol = (3e-5, 1e-6, 3e-5) if f32 else (1e-9, 1e-10, 2e-6)
    g = run.g
    assert [int(s) for s in run.steps] == steps
    assert sorted(probe.pre) == list(range(probe.start, probe.start + len(probe.pre)))
    index = {int(s): i for i, s in enumerate(g["steps"][:])}
    for t in steps:
        i = index[t]
        theta, lrs = probe.pre[t]
        # the resume state keeps θ in the module's own dtype (a float64 one's was rounded to float32)
        assert g["theta"].dtype == (np.float64 if theta.dtype == torch.float64 else np.float32), g["theta"].dtype
        np.testing.assert_array_equal(g["theta"][i], theta.numpy().astype(g["theta"].dtype))
        if len(set(lrs)) == 1:
            assert float(g["lr"][i]) == lrs[0], (t, float(g["lr"][i]), lrs[0])
        else:  # groups at different rates: no one δ_t
            assert np.isnan(g["lr"][i]), (t, float(g["lr"][i]), lrs)
        theta = theta.double()
        f, J = _reference(net, theta, X)
        G = J @ J.T
        lam, V = torch.linalg.eigh(G)
        lam, V = lam.flip(0)[:K], V.flip(1)[:, :K]
        _close32(g["f"][i], f, ftol)
        np.testing.assert_allclose(g["eigenvalues"][i][:K], lam.numpy(), rtol=rtol)
        np.testing.assert_allclose(g["loss"][i], float(0.5 * ((f - y) ** 2).mean()), rtol=rtol)
        for name, phi in (("y", y), ("f", f), ("residual", f - y)):
            np.testing.assert_allclose(g[f"energy_{name}"][i][:K], _energy(V, phi), rtol=100 * rtol, atol=etol)
        if t in probe.post:  # the optimizer finished update t: the callback must have taken it
            theta1 = probe.post[t].double()
            f1, _ = _reference(net, theta1, X)
            df, dfp = f1 - f, J @ (theta1 - theta)
            _close32(g["df"][i], df, 100 * ftol if f32 else ftol)  # a float32 net's Δf: a difference of f's
            _close32(g["df_pred"][i], dfp, ftol)
            np.testing.assert_allclose(g["energy_df"][i][:K], _energy(V, df), rtol=1e-3 if f32 else 1e-7, atol=etol)
            np.testing.assert_allclose(g["energy_df_pred"][i][:K], _energy(V, dfp), rtol=100 * rtol, atol=etol)
        else:
            assert np.isnan(g["df"][i]).all(), t


# A docstring starting "Was:" says what the first version of the callback (recording at
# on_train_batch_start with the first group's lr, nothing on an exception) got wrong there; each such
# test fails on it.  The others passed on it too.


def test_full_batch_gd_every_step_matches_the_reference(tmp_path):
    url, m = str(tmp_path / "s.zarr"), Reg()
    tr = _tracker(url, "gd", m.net, 5)
    _fit(m, tr, max_steps=5)
    _check(url, "gd", m.net, m.probe, list(range(5)))


def test_sgd_minibatches_over_epochs_with_validation_between(tmp_path):
    """Shuffled mini-batches of 16 over two epochs (max_epochs: 8 updates), validation every 2 batches."""
    url, m = str(tmp_path / "s.zarr"), Reg(opt="momentum")
    tr = _tracker(url, "sgd", m.net, 8)
    _fit(m, tr, _loader(16, shuffle=True), _loader(), max_epochs=2, val_check_interval=2)
    _check(url, "sgd", m.net, m.probe, list(range(8)))


def test_the_loss_curve_holds_each_updates_batch_loss(tmp_path):
    """Was: only the recorded steps' full-batch L(θ_t) (steps 0, 3, 6, 7 of 8), NaN between.  Now every
    update's loss as ``training_step`` returned it (a mini-batch's, as ``nsa run``'s SGD curve)."""
    url, m = str(tmp_path / "s.zarr"), Reg(opt="momentum")
    tr = _tracker(url, "curve", m.net, 8, record={"every": 3})
    _fit(m, tr, _loader(16, shuffle=True), max_epochs=2)
    want = np.array([m.losses[t][0] for t in range(8)])
    got = Client(url).run("curve").loss_trace
    np.testing.assert_array_equal(got, want, err_msg=f"stored {got} against the batches' {want}")
    _check(url, "curve", m.net, m.probe, [0, 3, 6, 7])  # the recorded steps' own loss stays L(θ_t) over N


def test_under_gradient_accumulation_the_curve_keeps_the_recorded_full_batch_loss(tmp_path):
    url, m = str(tmp_path / "s.zarr"), Reg()
    _fit(m, _tracker(url, "acc", m.net, 4, record={"every": 2}), _loader(16), max_steps=4, accumulate_grad_batches=2)
    run = Client(url).run("acc")
    got, recorded = run.loss_trace, [int(s) for s in run.steps]
    assert recorded == [0, 2, 3] and np.isnan(got[1]) and np.isfinite(got[recorded]).all(), got
    np.testing.assert_allclose(got[recorded], run.train_loss, rtol=1e-12)  # L(θ_t) over all N points


def test_adam_with_a_per_step_scheduler_records_the_lr_of_each_update(tmp_path):
    def sched(opt):
        return {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.6), "interval": "step"}

    url, m = str(tmp_path / "s.zarr"), Reg(opt="adam", lr=0.02, sched=sched)
    tr = _tracker(url, "adam", m, 6)  # the Tracker holds the LightningModule itself
    _fit(m, tr, _loader(32), max_steps=6)
    lrs = [m.probe.pre[t][1][0] for t in range(6)]
    assert len(set(lrs)) == 6
    _check(url, "adam", m.net, m.probe, list(range(6)))


def test_gradient_accumulation_records_once_per_optimizer_step(tmp_path):
    def sched(opt):
        return {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), "interval": "step"}

    url, m = str(tmp_path / "s.zarr"), Reg(sched=sched)
    tr = _tracker(url, "acc", m.net, 4)
    _fit(m, tr, _loader(16), max_steps=4, accumulate_grad_batches=2)
    assert len(m.probe.pre) == 4
    _check(url, "acc", m.net, m.probe, list(range(4)))


def test_manual_warmup_set_before_the_step_is_the_lr_of_that_step(tmp_path):
    """Was: δ_t one step late (δ_0 stored 0.05 for 0.0125 applied; Δf̄_0 4× too large).  A warm-up
    written into the groups in ``optimizer_step`` before ``optimizer.step`` (δ_0 = lr/4):
    with ``optimizer="gd"`` the stored Δf̄_t = −δ_t/N·G_t m_t is right only with the δ_t applied."""
    url, m = str(tmp_path / "s.zarr"), Reg(warmup=4)
    tr = _tracker(url, "warm", m.net, 5, optimizer="gd")
    _fit(m, tr, max_steps=5)
    _check(url, "warm", m.net, m.probe, list(range(5)))


def test_a_crash_in_training_step_keeps_the_recorded_steps(tmp_path):
    """Was: the Tracker left open — status ``running``, steps still in flight not stored, the lease
    held (a new Tracker of the run refused with LeaseHeld while the process lives)."""
    url, m = str(tmp_path / "s.zarr"), Reg(crash_at=3)
    tr = _tracker(url, "crash", m.net, 6)
    with pytest.raises(RuntimeError, match="user crash"):
        _fit(m, tr, max_steps=6)
    # steps 0-2 are kept, each with its update; step 3 raised before its optimizer step (θ_3 is not recorded)
    _check(url, "crash", m.net, m.probe, [0, 1, 2], status="interrupted")
    with pytest.raises(ValueError, match="closed"):
        tr.record(4, lr=0.05)  # the lease is given back: another process may continue the run


def test_a_keyboard_interrupt_ends_the_run_interrupted(tmp_path):
    """Was: status ``running`` (as a crash).  Ctrl-C: Lightning calls on_exception, then sys.exit(1)
    (it never reaches on_train_end)."""

    class Stop(Reg):
        def training_step(self, batch, batch_idx):
            if self.global_step == 2:
                raise KeyboardInterrupt
            return super().training_step(batch, batch_idx)

    url, m = str(tmp_path / "s.zarr"), Stop()
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):
            _fit(m, _tracker(url, "ctrlc", m.net, 6), max_steps=6)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT from then on
    _check(url, "ctrlc", m.net, m.probe, [0, 1], status="interrupted")


def test_bf16_mixed_precision_is_measured_on_the_float32_parameters(tmp_path):
    url, m = str(tmp_path / "s.zarr"), Reg()
    m.net.float()
    _fit(m, _tracker(url, "bf16", m.net, 3), _loader(dtype=torch.float32), max_steps=3, precision="bf16-mixed")
    _check(url, "bf16", m.net, m.probe, list(range(3)))


def test_a_second_fit_with_a_closed_tracker_is_refused_before_it_trains(tmp_path):
    """Was: the second fit trained until its first recorded step, then raised "this Tracker is closed"."""
    url, m = str(tmp_path / "s.zarr"), Reg()
    cb = SpectrumCallback(_tracker(url, "twice", m.net, 6, record={"every": 4}))
    _fit(m, cb, max_steps=2)
    with pytest.raises(ValueError, match="new Tracker of the same run name"):
        _fit(m, cb, max_steps=6)
    assert len(m.probe.pre) == 2  # not a step of the second fit was taken
    _check(url, "twice", m.net, m.probe, [0], status="pending")  # the store as the first fit left it


def test_a_tracker_longer_than_the_training_keeps_the_last_update(tmp_path):
    """Was: the last trained step's Δθ, Δf and first-order values NaN (close() takes an update only for
    step T − 1 of the Tracker), though the model was at t + 1."""
    url, m = str(tmp_path / "s.zarr"), Reg()
    tr = _tracker(url, "short", m.net, 10)
    _fit(m, tr, max_steps=4)
    _check(url, "short", m.net, m.probe, list(range(4)), status="pending")


def test_resuming_from_a_checkpoint_continues_the_run(tmp_path):
    """Was: step 2 (the last before the checkpoint) without its update.  Three Adam steps, a
    checkpoint, then a new process's module and Tracker resume from it: the run
    holds steps 0-5, step 2 with its update (taken at the end of the first fit)."""
    url, ck = str(tmp_path / "s.zarr"), tmp_path / "ck"
    first = Reg(opt="adam", lr=0.02)
    save = pl.callbacks.ModelCheckpoint(dirpath=ck, save_last=True)
    _fit(first, _tracker(url, "res", first.net, 6), max_steps=3, extra=[save], enable_checkpointing=True)
    assert Client(url).run("res").status == "pending"
    again = Reg(opt="adam", lr=0.02)
    again.probe = Probe(start=3)
    _fit(again, _tracker(url, "res", again.net, 6), max_steps=6, ckpt_path=str(ck / "last.ckpt"))
    assert torch.equal(again.probe.pre[3][0], first.probe.post[2])  # θ_3 restored from the checkpoint
    probe = Probe()
    probe.pre, probe.post = {**first.probe.pre, **again.probe.pre}, {**first.probe.post, **again.probe.post}
    _check(url, "res", first.net, probe, list(range(6)))


class _Groups(Reg):
    def __init__(self, lrs):
        super().__init__()
        self.lrs = lrs

    def configure_optimizers(self):
        a, b = self.net[0], self.net[2]
        opt = torch.optim.SGD(
            [
                {"params": a.parameters(), "lr": self.lrs[0], "weight_decay": 0.1},
                {"params": b.parameters(), "lr": self.lrs[1]},
            ]
        )
        self.probe.attach(self, opt)
        return opt if self.sched is None else {"optimizer": opt, "lr_scheduler": self.sched(opt)}


def test_param_groups_with_one_lr_are_measured(tmp_path):
    url, m = str(tmp_path / "s.zarr"), _Groups([0.05, 0.05])
    _fit(m, _tracker(url, "g1", m.net, 3), max_steps=3)
    _check(url, "g1", m.net, m.probe, list(range(3)))


def test_param_groups_with_different_lrs_are_measured_with_no_one_rate(tmp_path, caplog):
    """A backbone and a head at their own rates (fine-tuning's usual set-up): every step is recorded,
    its spectra and J_t Δθ_t prediction against the reference, δ_t NaN with one warning — as
    Tracker.record records such an optimizer.  Was: δ_t = 0.05 stored (the first group's) for a net
    whose last layer trained at 0.01; then: refused before training."""
    url, m = str(tmp_path / "s.zarr"), _Groups([0.05, 0.01])
    with caplog.at_level("WARNING", logger="nsa_dist"):
        _fit(m, _tracker(url, "g2", m.net, 3), max_steps=3)
    said = [r.getMessage() for r in caplog.records if "different learning rates [0.05, 0.01]" in r.getMessage()]
    assert len(said) == 1 and "δ_t is stored as NaN" in said[0], said
    _check(url, "g2", m.net, m.probe, list(range(3)))


def test_group_rates_that_part_mid_run_are_measured_on(tmp_path):
    """Was: the ValueError at step 2's record ended the user's training there (2 of 5 steps trained);
    then: the recording stopped at step 2 (the run interrupted).  Now every step is measured, δ_t NaN
    from the step the rates part."""

    def sched(opt):  # the groups' rates agree at steps 0, 1 and part at step 2
        lam = [lambda t: 1.0, lambda t: 1.0 if t < 2 else 0.5]
        return {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lam), "interval": "step"}

    url, m = str(tmp_path / "s.zarr"), _Groups([0.05, 0.05])
    m.sched = sched
    _fit(m, _tracker(url, "part", m.net, 5), max_steps=5)
    assert sorted(m.probe.pre) == list(range(5))  # the training ran to its end
    _check(url, "part", m.net, m.probe, list(range(5)))
    lr = Client(url).run("part").g["lr"][:]
    assert lr[:2].tolist() == [0.05, 0.05] and np.isnan(lr[2:]).all(), lr


class _Manual(Reg):
    """Manual optimization: ``n_opt`` optimizers (on the two layers, lrs 0.05 and 0.02), each stepped
    ``steps_per_batch`` times in every batch."""

    def __init__(self, n_opt: int, steps_per_batch: int = 1):
        super().__init__()
        self.automatic_optimization = False
        self.n_opt, self.spb = n_opt, steps_per_batch

    def training_step(self, batch, batch_idx):
        x, y = batch
        opts = self.optimizers()
        for opt in opts if isinstance(opts, list) else [opts]:
            for _ in range(self.spb):
                opt.zero_grad()
                self.manual_backward(0.5 * ((self(x).squeeze(-1) - y) ** 2).mean())
                opt.step()

    def configure_optimizers(self):
        if self.n_opt == 1:
            return super().configure_optimizers()
        opts = [torch.optim.SGD(self.net[0].parameters(), lr=0.05), torch.optim.SGD(self.net[2].parameters(), lr=0.02)]
        for opt in opts:
            self.probe.attach(self, opt)  # one count over both: global_step counts every optimizer's steps
        return opts


def test_manual_optimization_with_one_step_per_batch_is_measured(tmp_path):
    url, m = str(tmp_path / "s.zarr"), _Manual(1)
    _fit(m, _tracker(url, "man", m.net, 4), max_steps=4)
    _check(url, "man", m.net, m.probe, list(range(4)))


def test_several_optimizer_steps_in_one_batch_are_each_a_step(tmp_path):
    """Was: steps 1, 3, 5 never recorded (run ``pending``) and 0, 2, 4 with NaN updates: the callback
    saw only each batch's first global_step.  Two steps of one optimizer per batch: global_step
    counts both, and so does the Tracker."""
    url, m = str(tmp_path / "s.zarr"), _Manual(1, steps_per_batch=2)
    _fit(m, _tracker(url, "twice", m.net, 6), max_steps=6)
    assert len(m.probe.pre) == 6
    _check(url, "twice", m.net, m.probe, list(range(6)))


def test_two_optimizers_each_step_with_its_own_lr(tmp_path):
    """Was: only the first optimizer's steps recorded, with NaN updates; the second's (lr 0.02) lost.
    Manual optimization, two optimizers: each ``opt.step()`` is a step, at its own optimizer's lr."""
    url, m = str(tmp_path / "s.zarr"), _Manual(2)
    _fit(m, _tracker(url, "two", m.net, 6), max_steps=6)
    assert [m.probe.pre[t][1][0] for t in range(6)] == [0.05, 0.02] * 3
    _check(url, "two", m.net, m.probe, list(range(6)))


def test_a_trainer_that_casts_the_tracked_model_is_refused(tmp_path):
    """Was: ``RuntimeError: mat1 and mat2 must have the same dtype`` from the Tracker's forward at the
    first record.  precision="64-true" makes a float32 module float64 after the Tracker was made for it."""
    url, m = str(tmp_path / "s.zarr"), Reg()
    m.net.float()
    with pytest.raises(ValueError, match="64-true.*float32 on cpu to float64 on cpu"):
        _fit(m, _tracker(url, "p64", m.net, 3), max_steps=3, precision="64-true")
    assert Client(url).run("p64").status == "interrupted"


def test_double_precision_trainer_on_a_float64_module(tmp_path):
    url, m = str(tmp_path / "s.zarr"), Reg()
    _fit(m, _tracker(url, "p64", m.net, 3), max_steps=3, precision="64-true")
    _check(url, "p64", m.net, m.probe, list(range(3)))


# ---------------------------------------------------------------------- DDP
# Was: every process Lightning's ``strategy="ddp"`` starts runs the script again, so rank 1 created a
# second Tracker of the run and died of LeaseHeld, and Lightning then killed rank 0: the user's
# training and the run lost to the recording.  Now rank 0 records, the others write nothing.
_DDP_SCRIPT = """
import sys, warnings
import torch
sys.path.insert(0, {tests!r})
import test_lightning as T
from nsa_dist.tracker import distributed_rank

url, out = sys.argv[1], sys.argv[2]
m = T.Reg(opt="momentum")
tr = T._tracker(url, "ddp", m.net, 5)
# each of the 2 ranks takes half of the N points per step (DistributedSampler), DDP averages the gradients
trainer = T._fit(m, tr, T._loader(T.N // 2), max_steps=5, devices=2, strategy="ddp")
torch.save({{"rank": trainer.global_rank, "tracker_rank": tr.rank, "pre": m.probe.pre, "post": m.probe.post,
            "losses": m.losses}}, f"{{out}}.{{trainer.global_rank}}")
"""


@pytest.mark.slow
def test_ddp_rank_zero_records_the_run_and_the_other_rank_writes_nothing(tmp_path):
    import pathlib
    import subprocess
    import sys

    script = tmp_path / "ddp_fit.py"
    script.write_text(_DDP_SCRIPT.format(tests=str(pathlib.Path(__file__).parent)))
    url, out = str(tmp_path / "s.zarr"), str(tmp_path / "probe")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "LOCAL_RANK", "NODE_RANK")}
    done = subprocess.run([sys.executable, str(script), url, out], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = {r: torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1)}
    assert [seen[r]["tracker_rank"] for r in (0, 1)] == [0, 1]
    for t in range(5):  # the two ranks stepped the same θ_t (DDP's averaged gradient)
        torch.testing.assert_close(seen[0]["pre"][t][0], seen[1]["pre"][t][0], rtol=0, atol=1e-14)
    probe = Probe()
    probe.pre, probe.post = seen[0]["pre"], seen[0]["post"]
    _check(url, "ddp", _net(), probe, list(range(5)))  # rank 0's θ_t, δ_t, θ_{t+1} against jacrev
    # the loss curve: the global batch's (the ranks' mean), not rank 0's shard's (0.68 for 0.52 at step 0)
    trace = Client(url).run("ddp").loss_trace
    for t in range(5):
        want = np.mean([seen[r]["losses"][t][0] for r in (0, 1)])
        assert abs(trace[t] - want) <= 1e-6 * abs(want), (t, trace[t], want, [seen[r]["losses"][t] for r in (0, 1)])


def test_ddp_spawn_is_refused_before_training_and_the_run_ends_interrupted(tmp_path):
    """Was: ``TypeError: cannot pickle '_thread.lock' object`` from multiprocessing."""
    url, m = str(tmp_path / "s.zarr"), Reg()
    with pytest.raises(TypeError, match="cannot be sent to another process.*strategy='ddp'"):
        _fit(m, _tracker(url, "spawn", m.net, 3), max_steps=3, devices=2, strategy="ddp_spawn")
    assert m.probe.pre == {}  # not a step was taken
    assert Client(url).run("spawn").status == "interrupted"
