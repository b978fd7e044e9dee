"""The held-parameter check on a copy while another thread runs the original.

A Tracker analyses a copy of the user's model in a thread while the training thread runs the model
itself, and the Tracker's own record-time checks there (the coupling probe) swap temporaries into
its parameter slots (``torch.func.functional_call``).  The check read the original's parameters from
those slots: a temporary read there and freed a moment later gave its id to one of the check's own
tensors — a parameter "held" on a model that holds none (twice in fresh-clone CI: a Tracker step
lost, a df_pred NaN) — and a parameter really held (a global hook reading the user's weight) was
missed whenever the look fell inside a swap: the NTK would take it as a constant.  The original's
parameters are now those it had when the copy was made."""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

from nsa_dist.models import copy_model
from nsa_dist.ntk.state import _held_parameters

_HELD: dict[str, torch.Tensor] = {}


def _reads_the_users_bias(module: nn.Module, inputs: tuple) -> tuple:
    """A global hook function: a copy takes it along as itself, still reading the user's parameter."""
    return (inputs[0] * _HELD["b"].sum(),)


class _Net(nn.Module):
    """The user's network; ``during`` (a plain attribute, None in copies made before it is set) runs in
    its forward: another thread's look, taken while a functional call has the slots swapped."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
        self.__dict__["during"] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.during is not None:
            self.during()
        return self.net(x).squeeze(-1)


def test_a_held_parameter_is_found_while_the_original_runs_swapped() -> None:
    """A copy whose forward reads the user's real parameter through a global hook: found at a look taken
    inside the original's functional call (it was not: the real parameter was out of its slot)."""
    torch.manual_seed(0)
    user = _Net()
    _HELD["b"] = user.net[0].bias
    user.net[2].register_forward_pre_hook(_reads_the_users_bias)
    copy = copy_model(user)
    x = torch.randn(6, 2)
    assert _held_parameters(copy, x) == ["net.0.bias"]
    looks: list[list[str]] = []
    user.__dict__["during"] = lambda: looks.append(_held_parameters(copy, x))
    temps = {n: p.detach().clone().requires_grad_(True) for n, p in user.named_parameters()}
    torch.func.functional_call(user, temps, (x,))
    assert looks == [["net.0.bias"]], looks


def _race(copy: nn.Module, user: nn.Module, x: torch.Tensor, seconds: float) -> tuple[int, list[list[str]]]:
    """The main thread runs ``functional_call(user, temporaries)`` in a loop while a second thread checks
    ``copy``: (looks, what each look found)."""
    stop, found = threading.Event(), []

    def analysis() -> None:
        while not stop.is_set():
            found.append(_held_parameters(copy, x))

    t = threading.Thread(target=analysis)
    t.start()
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end and t.is_alive():
            temps = {n: p.detach().clone().requires_grad_(True) for n, p in user.named_parameters()}
            torch.func.functional_call(user, temps, (x,))
            del temps  # freed at once: its ids free for the check's own tensors
    finally:
        stop.set()
        t.join()
    return len(found), found


def test_no_parameter_is_held_because_another_thread_swaps_the_original() -> None:
    """No hook: no look finds a parameter held (the code before this fix: 1,482 of 23,934 looks did)."""
    torch.manual_seed(0)
    user = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
    copy, x = copy_model(user), torch.randn(8, 2)
    looks, found = _race(copy, user, x, 3.0)
    false = [f for f in found if f]
    assert looks > 50 and not false, f"{len(false)} of {looks} looks found a parameter held: {false[:3]}"


def test_a_held_parameter_is_found_at_every_look_while_another_thread_swaps_the_original() -> None:
    """The global hook: every look finds it (the code before this fix missed 9,844 of 16,395)."""
    torch.manual_seed(1)
    user = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
    _HELD["b"] = user[0].bias
    user[2].register_forward_pre_hook(_reads_the_users_bias)
    copy, x = copy_model(user), torch.randn(8, 2)
    looks, found = _race(copy, user, x, 3.0)
    missed = [f for f in found if f != ["0.bias"]]
    assert looks > 50 and not missed, f"{len(missed)} of {looks} looks missed it: {missed[:3]}"
