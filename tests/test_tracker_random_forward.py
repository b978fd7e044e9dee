"""A forward that is random without an ``nn.Dropout`` module — ``F.dropout(…, training=self.training)``
(nanoGPT-style code), ``nn.MultiheadAttention(dropout=…)`` — at ``record(t)``: the Tracker took the step,
its analysis found "the model's forward is random", and every later Tracker call raised it — the
user's loop ended, the run failed with nothing stored (an audit).  Now ``record`` sees it (two
forwards of a few points), the recording stops with the reason and training goes on, on the same
random draws as without a Tracker."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nsa_dist import Client, Tracker


class FDrop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.b(F.dropout(torch.tanh(self.a(x)), 0.3, training=self.training))


class AttnDrop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.att, self.out = (
            nn.Linear(3, 8),
            nn.MultiheadAttention(8, 2, dropout=0.2, batch_first=True),
            nn.Linear(8, 1),
        )

    def forward(self, x):
        h = self.inp(x).unsqueeze(1)  # one token per point
        return self.out(self.att(h, h, h, need_weights=False)[0].squeeze(1))


def _train(model_cls: type[nn.Module], url: str | None) -> tuple[nn.Module, Tracker | None]:
    torch.manual_seed(0)
    model = model_cls().double().eval()
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(12, 3, generator=g, dtype=torch.float64), torch.randn(12, 1, generator=g, dtype=torch.float64)
    tr = None
    if url is not None:  # created in eval mode (accepted), then trained and recorded in train mode
        tr = Tracker(url, "r", model, X, y, steps=4, record={"every": 2}, spectrum={"k": 4, "images": []}, device="cpu")
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in range(4):
        if tr is not None and tr.due(t):
            tr.record(t, lr=opt)
        opt.zero_grad()
        (0.5 * ((model(X) - y) ** 2).mean()).backward()
        opt.step()
    if tr is not None:
        tr.close()
    return model, tr


@pytest.mark.parametrize("model_cls", [FDrop, AttnDrop])
def test_a_random_forward_without_a_dropout_module_stops_the_recording_not_the_training(tmp_path, model_cls) -> None:
    url = str(tmp_path / "s.zarr")
    tracked, tr = _train(model_cls, url)  # no exception: the loop ran to its end
    assert tr.stopped is not None and "forward is random at record(0)" in tr.stopped, tr.stopped
    run = Client(url).run("r")
    assert run.status == "interrupted" and "forward is random" in (run.reason or ""), (run.status, run.reason)
    alone, _ = _train(model_cls, None)  # the Tracker's two probe forwards drew nothing from the loop's stream
    for (k, a), b in zip(tracked.state_dict().items(), alone.state_dict().values()):
        assert torch.equal(a, b), f"{k}: the tracked loop trained on other random draws"
