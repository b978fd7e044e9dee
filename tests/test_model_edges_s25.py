"""Models from an audit of everyday modules (session 25): a data-dependent initialisation on the first
forward (Glow's ActNorm), a forward that counts its calls, an LSTM over a packed sequence."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from nsa_dist.errors import UnsupportedModelError
from nsa_dist.hessian import hessian_operator
from nsa_dist.ntk import gram, jacobian_vector_product

F64 = torch.float64


class ActNormNet(nn.Module):
    """ActNorm as Glow writes it: loc and log-scale set from the first batch, behind a flag."""

    def __init__(self, flag_as_buffer: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 6), nn.Linear(6, 1)
        self.loc, self.logs = nn.Parameter(torch.zeros(6)), nn.Parameter(torch.zeros(6))
        if flag_as_buffer:
            self.register_buffer("initialized", torch.tensor(False))
        else:
            self.initialized = False

    def forward(self, x):
        h = self.a(x)
        if not bool(self.initialized):
            with torch.no_grad():
                self.loc.data.copy_(-h.mean(0))
                self.logs.data.copy_(-torch.log(h.std(0) + 1e-6))
            if isinstance(self.initialized, torch.Tensor):
                self.initialized.fill_(True)
            else:
                self.initialized = True
        return self.b(torch.tanh((h + self.loc) * torch.exp(self.logs))).squeeze(-1)


def _reference_gram(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        g = torch.autograd.grad(model(x[i : i + 1]).sum(), params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if t is None else t).reshape(-1) for p, t in zip(params, g)]))
    J = torch.stack(rows)
    return J @ J.T


@pytest.mark.parametrize("buffer", [False, True], ids=["python-flag", "buffer-flag"])
def test_a_forward_that_initialises_its_parameters_is_refused_and_the_model_left_as_it_was(buffer: bool) -> None:
    torch.manual_seed(0)
    m = ActNormNet(buffer).double()
    x = torch.randn(16, 3, dtype=F64)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match=r"writes its own parameters \('loc', 'logs'"):
        gram(m, x)
    with pytest.raises(UnsupportedModelError, match=r"writes its own parameters \('loc', 'logs'"):
        hessian_operator(m, x, torch.randn(16, 1, dtype=F64))  # its setup's first forward (a review)
    changed = [k for k, v in m.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed and not bool(m.initialized), f"gram changed the model: {changed}, initialized={m.initialized}"
    # the user's own first batch initialises it, then the kernel is measured (against per-sample autograd)
    m(x)
    assert bool(m.initialized)
    G = gram(m, x)
    ref = _reference_gram(m, x)
    err = float((torch.as_tensor(G) - ref).abs().max() / ref.abs().max())
    assert err < 1e-12, f"gram off by {err:.3g} after the initialisation"


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.calls = nn.Linear(3, 6), nn.Linear(6, 1), 0

    def forward(self, x):
        self.calls += 1
        return self.b(torch.tanh(self.a(x)) * min(1.0, self.calls / 100)).squeeze(-1)


def test_a_forward_reading_a_counter_it_increments_is_named_not_called_random() -> None:
    m = Counting().double().eval()
    with pytest.raises(UnsupportedModelError) as e:
        gram(m, torch.randn(8, 3, dtype=F64))
    assert "attribute 'calls' (Counting)" in str(e.value) and "random" not in str(e.value), str(e.value)


class Packed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(4, 3, batch_first=True), nn.Linear(3, 1)

    def forward(self, x):
        lengths = (x[:, :, 0].abs() > 0).sum(1).cpu()
        _, (h, _) = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
        return self.head(h[-1]).squeeze(-1)


def _packed_data():
    torch.manual_seed(0)
    x = torch.randn(6, 5, 4, dtype=F64)
    for i, n in enumerate([5, 3, 4, 2, 5, 1]):
        x[i, n:] = 0
    return x, torch.randn(6, 1, dtype=F64)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_packed_lstm_gets_its_hessian_and_j_dtheta_by_plain_autograd() -> None:
    """torch.func cannot run the packed LSTM kernel ("Cannot access data pointer of Tensor that doesn't
    have storage"): the Hessian and J·dθ failed with that message; plain autograd computes both."""
    torch.manual_seed(0)
    m = Packed().double()
    x, y = _packed_data()
    params = list(m.parameters())
    P = sum(p.numel() for p in params)
    # J·dθ against the per-sample autograd Jacobian
    J = torch.stack(
        [torch.cat([g.reshape(-1) for g in torch.autograd.grad(m(x)[i], params)]) for i in range(x.shape[0])]
    )
    dtheta = torch.randn(P, dtype=F64)
    got = torch.as_tensor(jacobian_vector_product(m, x, dtheta)).reshape(-1)
    err = float((got - J @ dtheta).abs().max() / (J @ dtheta).abs().max())
    assert err < 1e-10, f"J·dθ off by {err:.3g}"
    # H against a dense double-backward Hessian of C = (1/2N) Σ (f − y)²
    C = 0.5 * ((m(x) - y[:, 0]) ** 2).sum() / x.shape[0]
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(C, params, create_graph=True)])
    H = torch.stack(
        [torch.cat([t.reshape(-1) for t in torch.autograd.grad(gi, params, retain_graph=True)]) for gi in g]
    )
    Hm = torch.as_tensor(hessian_operator(m, x, y).matmat(torch.eye(P, dtype=F64)))
    err = float((Hm - H).abs().max() / H.abs().max())
    assert err < 1e-10, f"H off by {err:.3g} of max|H|"
