"""The models people bring: every pattern exact against a float64 ``jacrev`` of the full-batch
forward, through ``gram`` (trace and full), and each on the path it must take (so the fast path
cannot silently become the fallback, nor the fallback silently take a fast path that is wrong).
The user's model — buffers, training modes — is the same after every call."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_close_rel, dense_ntk
from torch import nn

from nsa_dist.errors import ModelForwardError, UnsupportedModelError
from nsa_dist.ntk import explain_method, gram, ntk_operator

F64 = torch.float64


class InplaceMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(3, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 1)
        )

    def forward(self, x):
        return self.net(x).squeeze(-1)


class InplaceCNN(nn.Module):
    def __init__(self, k=1):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 3, stride=2)
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(4, k)  # 4×4 → 4×4 → 1×1

    def forward(self, x):
        return self.fc(self.act(self.c2(self.act(self.c1(x)))).flatten(1))


class TiedLinear(nn.Module):
    """An autoencoder-style tied weight: the decoder uses the encoder's weight transposed."""

    def __init__(self):
        super().__init__()
        self.enc, self.mid, self.head = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(4, 1)

    def forward(self, x):
        h = torch.tanh(self.mid(torch.tanh(self.enc(x))))
        return self.head(torch.tanh(h @ self.enc.weight)).squeeze(-1)


class TiedModules(nn.Module):
    """Two Linear modules sharing one Parameter object (weight tying as in language models)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 1)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x))))).squeeze(-1)


class TiedConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(2, 2, 3, padding=1)
        self.fc = nn.Linear(2 * 4 * 4, 1)

    def forward(self, x):
        return self.fc(torch.tanh(self.c(torch.tanh(self.c(x)))).flatten(1)).squeeze(-1)


def bn_cnn(track=True, train=False):
    m = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3, track_running_stats=track),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 2),
    )
    with torch.no_grad():  # non-trivial running statistics
        m[1].weight.uniform_(0.5, 1.5)
        m[1].bias.uniform_(-0.5, 0.5)
        if track:
            m[1].running_mean.uniform_(-0.2, 0.2)
            m[1].running_var.uniform_(0.5, 2.0)
    return m.train(train)


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: BatchNorm, ReLU(inplace=True), out += identity."""

    def __init__(self, c, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


def resnet(k=1):
    m = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        BasicBlock(4),
        BasicBlock(4),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, k),
    )
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            with torch.no_grad():
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.3, 0.3)
                mod.running_mean.uniform_(-0.2, 0.2)
                mod.running_var.uniform_(0.5, 2.0)
    return m.eval()


class Recurrent(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn = getattr(nn, kind)(3, 5, batch_first=True)
        self.head = nn.Linear(5, 1)

    def forward(self, x):  # x (n, T, 3)
        out, _ = self.rnn(x)
        return self.head(out[:, -1]).squeeze(-1)


class TokenBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.fc = nn.Linear(4, 2)

    def forward(self, ids):  # ids (n, T) int64
        return self.fc(torch.tanh(self.emb(ids)).mean(1))


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.enc(self.emb(ids)).mean(1))


class Attention(nn.Module):
    """Self-attention; ``mode``: "plain" (returns weights, batch_first), "seq_first" (sequence-first
    layout, weights per head), "causal" (a mask: generic path), "cross" (query ≠ key: generic path),
    "weights" (the model uses the attention weights: the decomposition returns them too)."""

    def __init__(self, mode="plain"):
        super().__init__()
        self.mode = mode
        self.att = nn.MultiheadAttention(4, 2, batch_first=mode != "seq_first")
        self.head = nn.Linear(4, 1)

    def forward(self, x):  # x (n, T, 4)
        if self.mode == "seq_first":
            out, _ = self.att(*(x.transpose(0, 1),) * 3, average_attn_weights=False)
            out = out.transpose(0, 1)
        elif self.mode == "causal":
            T = x.shape[1]
            out, _ = self.att(x, x, x, attn_mask=torch.triu(torch.ones(T, T, dtype=torch.bool), 1))
        elif self.mode == "cross":
            out, _ = self.att(x, torch.tanh(x), torch.tanh(x))
        elif self.mode == "weights":
            out, w = self.att(x, x, x)
            out = out * w.sum(-1, keepdim=True) + w @ x
        else:
            out, _ = self.att(x, x, x)
        return self.head(out.mean(1)).squeeze(-1)


def _img(n, c=2, s=4):
    return torch.randn(n, c, s, s, dtype=F64)


# name → (model factory, inputs, the path every parameter takes or a {param: path} subset)
PATTERNS = {
    "mlp_inplace_relu": (InplaceMLP, lambda: torch.randn(9, 3, dtype=F64), "structured"),
    "cnn_inplace_relu": (lambda: InplaceCNN(2), lambda: _img(7), "per_layer_or_structured"),
    "tied_transpose": (
        TiedLinear,
        lambda: torch.randn(8, 4, dtype=F64),
        {"enc.weight": "jacobian", "enc.bias": "jacobian", "mid.weight": "structured", "head.weight": "structured"},
    ),
    "tied_modules": (
        TiedModules,
        lambda: torch.randn(8, 5, dtype=F64),
        {"a.weight": "jacobian", "a.bias": "jacobian", "b.bias": "jacobian", "head.weight": "structured"},
    ),
    "tied_conv": (TiedConv, lambda: _img(6), {"c.weight": "jacobian", "fc.weight": "structured"}),
    "bn_no_running_stats": (lambda: bn_cnn(track=False), lambda: _img(6), "batch"),
    "bn_train": (lambda: bn_cnn(train=True), lambda: _img(6), "batch"),
    "bn_eval": (
        lambda: bn_cnn(),
        lambda: _img(6),
        {"1.weight": "per_layer", "0.weight": "per_layer", "4.weight": "structured"},
    ),
    "resnet_block": (lambda: resnet(2), lambda: _img(5), "per_layer_or_structured"),
    "resnet_train": (lambda: resnet(1).train(), lambda: _img(5), "batch"),
    "lstm": (
        lambda: Recurrent("LSTM"),
        lambda: torch.randn(6, 4, 3, dtype=F64),
        {"rnn.weight_ih_l0": "jacobian", "head.weight": "structured"},
    ),
    "gru": (lambda: Recurrent("GRU"), lambda: torch.randn(6, 4, 3, dtype=F64), {"rnn.weight_hh_l0": "jacobian"}),
    "rnn": (lambda: Recurrent("RNN"), lambda: torch.randn(6, 4, 3, dtype=F64), {"rnn.bias_hh_l0": "jacobian"}),
    "embedding_tokens": (
        TokenBag,
        lambda: torch.randint(0, 11, (7, 5)),
        {"emb.weight": "per_layer", "fc.weight": "structured"},
    ),
    "transformer_tokens": (
        lambda: TinyTransformer().eval(),
        lambda: torch.randint(0, 13, (5, 6)),
        {
            "emb.weight": "per_layer",
            "enc.self_attn.in_proj_weight": "per_layer",
            "enc.self_attn.out_proj.weight": "per_layer",
            "enc.linear1.weight": "per_layer",
            "enc.norm1.weight": "per_layer",
            "head.weight": "structured",
        },
    ),
    "multihead_attention": (Attention, lambda: torch.randn(5, 3, 4, dtype=F64), "per_layer_or_structured"),
    "attention_seq_first": (
        lambda: Attention("seq_first"),
        lambda: torch.randn(5, 3, 4, dtype=F64),
        "per_layer_or_structured",
    ),
    "attention_weights_used": (
        lambda: Attention("weights"),
        lambda: torch.randn(5, 3, 4, dtype=F64),
        "per_layer_or_structured",
    ),
    "attention_causal_mask": (
        lambda: Attention("causal"),
        lambda: torch.randn(5, 3, 4, dtype=F64),
        {"att.in_proj_weight": "jacobian", "att.out_proj.weight": "jacobian", "head.weight": "structured"},
    ),
    "cross_attention": (
        lambda: Attention("cross"),
        lambda: torch.randn(5, 3, 4, dtype=F64),
        {"att.in_proj_bias": "jacobian", "att.out_proj.bias": "jacobian"},
    ),
    "conv1d_groupnorm": (
        lambda: nn.Sequential(
            nn.Conv1d(2, 4, 3, stride=2, dilation=1, padding=1),
            nn.GroupNorm(2, 4),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(4 * 4, 1),
        ),
        lambda: torch.randn(6, 2, 8, dtype=F64),
        {"0.weight": "per_layer", "1.weight": "per_layer"},
    ),
    "conv3d_rmsnorm": (
        lambda: nn.Sequential(
            nn.Conv3d(1, 2, 2, groups=1), nn.Flatten(), nn.RMSNorm(2 * 8), nn.Tanh(), nn.Linear(2 * 8, 1)
        ),
        lambda: torch.randn(5, 1, 3, 3, 3, dtype=F64),
        {"0.weight": "per_layer", "2.weight": "per_layer"},
    ),
    "layernorm_frozen": (
        lambda: nn.Sequential(nn.Linear(3, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 1)).requires_grad_(True),
        lambda: torch.randn(7, 3, dtype=F64),
        {"1.weight": "per_layer", "0.weight": "structured"},
    ),
}


def _state(model):
    return ({k: v.clone() for k, v in model.state_dict().items()}, [m.training for m in model.modules()])


def _assert_unchanged(model, before, what):
    sd, modes = before
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k]), f"{what}: the call changed the model's {k!r}"
    assert [m.training for m in model.modules()] == modes, f"{what}: the call changed a module's training mode"


def _autograd_ntk(model, x, full=False):
    """J of the full-batch forward row by row with plain autograd (one reverse pass per output):
    independent of torch.func, and valid when the forward updates running statistics."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = model(x)
    out = out.unsqueeze(-1) if out.ndim == 1 else out  # (n, K)
    n, K = out.shape
    rows = [
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(out[i, a], params, retain_graph=True)])
        for i in range(n)
        for a in range(K)
    ]
    J = torch.stack(rows)  # (n K, P)
    Gf = (J @ J.T).reshape(n, K, n, K)
    return Gf if full else Gf.diagonal(dim1=1, dim2=3).sum(-1)


def _reference(model, x, full=False):
    twin = copy.deepcopy(model)  # the reference's own forward may update running statistics
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in twin.modules()):
        return _autograd_ntk(twin, x, full)
    return dense_ntk(twin, x, full=full)


@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern_exact_on_its_path(name):
    make, inputs, path = PATTERNS[name]
    torch.manual_seed(0)
    model, x = make().double(), inputs()
    before = _state(model)
    method, routes = explain_method(model, x)
    if path == "per_layer_or_structured":
        assert {p for p, _ in routes.values()} <= {"per_layer", "structured"}, routes
    elif isinstance(path, str):
        assert {p for p, _ in routes.values()} == {path}, f"{name}: routes {routes}"
    else:
        for pname, want in path.items():
            assert routes[pname][0] == want, f"{name}: {pname} took {routes[pname]}, expected {want}"
    for full in (False, True):
        G = gram(model, x, kernel="full" if full else "trace")
        _assert_unchanged(model, before, f"{name} gram")
        assert_close_rel(
            G, _reference(model, x, full), 1e-10, f"{name} ({'full' if full else 'trace'}, {method.value})"
        )
    x2 = x[:3].clone()
    if method.value != "batch":  # the cross kernel of a coupling model depends on the batch it is taken in
        assert_close_rel(
            gram(model, x, x2),
            dense_ntk(copy.deepcopy(model), torch.cat([x, x2]))[: x.shape[0], x.shape[0] :],
            1e-10,
            f"{name} cross kernel",
        )


@pytest.mark.parametrize(
    "name",
    [
        "mlp_inplace_relu",
        "cnn_inplace_relu",
        "tied_modules",
        "bn_train",
        "lstm",
        "embedding_tokens",
        "transformer_tokens",
        "resnet_block",
    ],
)
def test_pattern_operator_exact(name):
    make, inputs, _ = PATTERNS[name]
    model, x = make().double(), inputs()
    before = _state(model)
    op = ntk_operator(model, x, block_size=3)
    V = torch.randn(x.shape[0], 2, dtype=F64)
    got = op.matmat(V)
    _assert_unchanged(model, before, f"{name} operator")
    assert_close_rel(got, _reference(model, x) @ V, 1e-10, f"{name} operator")


def test_float32_model_in_place_relu_matches_float64_reference():
    """The issue's 29–32 % case: a float32 MLP with ReLU(inplace=True), default method."""
    model = InplaceMLP()
    x = torch.randn(40, 3)
    G = gram(model, x)
    assert_close_rel(G, _reference(model.double(), x.double()), 1e-5, "float32 in-place ReLU MLP")


def test_dropout_in_train_mode_is_one_clear_error():
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 1)).double().train()
    with pytest.raises(UnsupportedModelError, match=r"random.*dropout in train mode: '1'.*model.eval\(\)"):
        gram(model, torch.randn(6, 3, dtype=F64))


@pytest.mark.parametrize("how", ["gram", "jacobian", "operator", "jvp"])
def test_a_forward_that_draws_random_numbers_is_refused_every_time(how):
    """Train-mode dropout was refused only when two probe forwards happened to differ: with few droppable
    elements (one channel, N = 1) they often drew the same mask and the kernel of that one mask came
    back (an audit: 19 of 30 seeds, 0.18–0.91 off the eval-mode kernel).  A forward that draws random
    numbers (an op tagged nondeterministic_seeded, seen in this thread) is now refused for that, always."""
    from nsa_dist.ntk import jacobian_vector_product

    for seed in range(30):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), nn.Dropout2d(0.1), nn.Flatten(), nn.Linear(16, 1))
        model = model.double().train()
        x = torch.randn(1, 1, 4, 4, dtype=F64)
        with pytest.raises(UnsupportedModelError, match=r"random \(it draws from torch's random numbers; dropout"):
            if how == "operator":
                ntk_operator(model, x).matmat(torch.ones(1, 1, dtype=F64))
            elif how == "jvp":
                jacobian_vector_product(model, x, torch.zeros(sum(p.numel() for p in model.parameters()), dtype=F64))
            else:
                gram(model, x, method="auto" if how == "gram" else how)


def test_measuring_draws_nothing_from_the_generators_and_rewinds_no_other_threads_draws():
    """A deterministic model's kernel leaves the global generator as it was (the probe's stand-in values
    for a zero readout come from a generator of its own), and nothing is written back to it: a restore
    of its state from an analysis thread (a Tracker's) repeated the training thread's draws (a review:
    28,213 of 37,805), and a draw in that thread must not make the analysed model look random."""
    import threading

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    nn.init.zeros_(model[2].weight)  # a zero readout: the probe puts fixed random values there meanwhile
    x = torch.randn(64, 3, dtype=F64)
    state = torch.get_rng_state()
    gram(model, x)
    assert torch.equal(state, torch.get_rng_state()), "a deterministic model's gram moved the generator"
    errors: list[BaseException] = []

    def analyse() -> None:
        try:
            for _ in range(3):
                gram(model, x)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=analyse)
    thread.start()
    draws = []
    while thread.is_alive():
        draws += torch.randint(0, 2**62, (64,)).tolist()
    thread.join()
    assert not errors, errors
    assert len(draws) > 64 and len(set(draws)) == len(draws), f"{len(draws) - len(set(draws))} repeated draws"


@pytest.mark.parametrize("kind", ["mha", "encoder_layer"])
def test_a_fully_padded_sequence_is_measured_by_every_route_and_the_hessian(kind):
    """A sample whose keys are all masked (a fully padded sequence) gets zero attention from the fused
    and math kernels, so the model's output there is finite; the explicit softmax the composite path
    computed weights by was NaN there, and ntk_operator, J·dθ and the Hessian operators came out NaN
    where gram was exact (two audits).  Now each equals its reference: gram (checked against jacrev
    elsewhere), J from jacrev, H by plain autograd under the math kernel."""
    from torch.func import functional_call, jacrev
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from nsa_dist.hessian import hessian_parts
    from nsa_dist.ntk import jacobian_vector_product

    class Padded(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = (
                nn.MultiheadAttention(4, 2, batch_first=True)
                if kind == "mha"
                else nn.TransformerEncoderLayer(4, 2, dim_feedforward=6, dropout=0.0, batch_first=True)
            )
            self.out = nn.Linear(4, 1)

        def forward(self, x):
            e = x.reshape(x.shape[0], 3, 4)
            pad = e[..., 0] > 0.9  # read from the data: a sample with every position flagged is all padding
            if kind == "mha":
                e = self.att(e, e, e, key_padding_mask=pad, need_weights=False)[0]
            else:
                e = self.att(e, src_key_padding_mask=pad)
            return self.out(e.mean(1))

    torch.manual_seed(0)
    model = Padded().double().eval()
    x = torch.randn(4, 12, dtype=F64) * 0.3
    x[2, 0::4] = 1.0  # sample 2: all three positions padded
    assert torch.isfinite(model(x)).all()
    G = gram(model, x)
    op = ntk_operator(model, x).matmat(torch.eye(4, dtype=F64))
    assert_close_rel(op, G, 1e-12, f"{kind}: ntk_operator against gram")
    params = {n: p.detach() for n, p in model.named_parameters()}
    J = torch.cat([j.reshape(4, -1) for j in jacrev(lambda p: functional_call(model, p, (x,)))(params).values()], 1)
    dt = torch.randn(J.shape[1], dtype=F64)
    assert_close_rel(jacobian_vector_product(model, x, dt).reshape(-1), J @ dt, 1e-12, f"{kind}: J·dθ")
    y = torch.randn(4, 1, dtype=F64)
    names, sizes = list(params), [p.numel() for p in params.values()]
    theta = torch.cat([p.reshape(-1) for p in params.values()])

    def loss(t):
        p = dict(zip(names, (a.view_as(q) for a, q in zip(t.split(sizes), params.values()))))
        return 0.5 * ((functional_call(model, p, (x,)) - y) ** 2).sum() / 4

    with sdpa_kernel(SDPBackend.MATH):
        H_ref = torch.autograd.functional.hessian(loss, theta)
    H, _, _ = hessian_parts(model, x, y)
    assert_close_rel(H.to_dense(), H_ref, 1e-10, f"{kind}: the loss Hessian")


def test_ops_tagged_random_that_draw_nothing_here_are_not_a_random_forward():
    """``rrelu_with_noise`` in eval mode (nn.RReLU) carries the nondeterministic_seeded tag and draws
    nothing: the randomness check refused it (a review); its kernel is measured again."""
    from nsa_dist.ntk import jacobian_vector_product

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.RReLU(), nn.Linear(8, 1)).double().eval()
    x = torch.randn(6, 3, dtype=F64)
    assert_close_rel(gram(model, x), dense_ntk(model, x), 1e-12, "eval-mode RReLU")
    P = sum(p.numel() for p in model.parameters())
    assert torch.isfinite(jacobian_vector_product(model, x, torch.ones(P, dtype=F64))).all()
    with pytest.raises(UnsupportedModelError, match="random"):
        gram(model.train(), x)  # in training it draws: refused


def test_a_causal_encoder_over_padded_sequences_and_a_per_head_mask():
    """nn.TransformerEncoder passes is_causal with its causal mask: a left-padded or fully padded
    sequence then has rows with every key masked, which ntk_operator gave as NaN (a review); now
    equal to gram.  A per-head (3-D) mask with such a row is not lifted: said, not NaN."""
    from nsa_dist.errors import NonFiniteError

    L, E = 3, 4

    class Causal(nn.Module):
        def __init__(self, per_head: bool):
            super().__init__()
            self.per_head = per_head
            layer = nn.TransformerEncoderLayer(E, 2, 6, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
            self.att = nn.MultiheadAttention(E, 2, batch_first=True)
            self.out = nn.Linear(E, 1)

        def forward(self, x):
            e = x.reshape(x.shape[0], L, E)
            pad = e[..., 0] > 0.9
            if self.per_head:
                am = torch.zeros(x.shape[0] * 2, L, L, dtype=x.dtype)
                return self.out(self.att(e, e, e, key_padding_mask=pad, attn_mask=am, need_weights=False)[0].mean(1))
            causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=x.dtype)
            return self.out(self.enc(e, mask=causal, src_key_padding_mask=pad).mean(1))

    torch.manual_seed(0)
    x = torch.randn(4, L * E, dtype=F64) * 0.3
    x[2, 0::E] = 1.0  # sample 2 fully padded
    x[1, 0] = 1.0  # sample 1 left-padded: its first row sees only masked keys under the causal mask
    model = Causal(False).double().eval()
    G = gram(model, x)
    assert_close_rel(G, dense_ntk(model, x), 1e-12, "causal encoder: gram")
    assert_close_rel(ntk_operator(model, x).matmat(torch.eye(4, dtype=F64)), G, 1e-12, "causal encoder: operator")
    with pytest.raises(NonFiniteError, match="composite"):
        ntk_operator(Causal(True).double().eval(), x).matmat(torch.eye(4, dtype=F64))
    from nsa_dist.hessian import hessian_parts

    H, _, _ = hessian_parts(Causal(True).double().eval(), x, torch.randn(4, 1, dtype=F64))
    with pytest.raises(NonFiniteError, match="composite"):  # numpy's "eigenvalues did not converge" before
        H.to_dense()


def test_a_failing_module_is_named_not_a_torch_traceback():
    class Picky(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            if x.shape[0] == 1:  # fine on batches, fails on single points (per-sample paths)
                raise RuntimeError("picky: needs a batch")
            return x

    model = nn.Sequential(nn.Linear(3, 3), Picky(), nn.Linear(3, 1)).double()
    with pytest.raises(ModelForwardError, match=r"module '1' \(Picky\).*picky: needs a batch"):
        gram(model, torch.randn(5, 3, dtype=F64), method="jacobian")


@pytest.mark.parametrize("name", ["bn_train", "lstm", "transformer_tokens", "embedding_tokens", "tied_modules"])
def test_pattern_hessian_operators(name):
    """I = (1/N) Jᵀ J for MSE from the full-batch autograd Jacobian, and H = I + S, on the patterns;
    the user's model unchanged."""
    from nsa_dist.hessian import hessian_parts

    make, inputs, _ = PATTERNS[name]
    model, x = make().double(), inputs()
    before = _state(model)
    twin = copy.deepcopy(model)
    out = twin(x)
    out = out.unsqueeze(-1) if out.ndim == 1 else out
    Y = torch.randn_like(out.detach())
    params = [p for p in twin.parameters() if p.requires_grad]
    J = torch.stack(
        [
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(out[i, a], params, retain_graph=True)])
            for i in range(out.shape[0])
            for a in range(out.shape[1])
        ]
    )  # (N K, P)
    H, I, S = hessian_parts(model, x, Y.squeeze(-1) if Y.shape[1] == 1 else Y, loss="mse", block_size=2)
    V = torch.randn(J.shape[1], 3, dtype=F64)
    IV, HV, SV = I.matmat(V), H.matmat(V), S.matmat(V)
    _assert_unchanged(model, before, f"{name} hessian")
    assert_close_rel(IV, J.T @ (J @ V) / x.shape[0], 1e-10, f"{name} I·V")
    assert_close_rel(HV, IV + SV, 1e-9, f"{name} H·V = I·V + S·V")


def test_factory_resnet_in_a_sweep_is_exact_and_says_its_paths(tmp_path):
    """A user's in-place ResNet as a ``model.factory`` in a sweep: every stored spectrum equals the
    float64 dense reference at the stored θ, and the run's attributes say which path each
    parameter took."""
    import numpy as np

    from nsa_dist.client import Client
    from nsa_dist.config import SweepSpec
    from nsa_dist.models import build_model
    from nsa_dist.pipeline import run_experiment, run_id
    from nsa_dist.store import SpectrumStore

    base = dict(
        data={"name": "digits", "n": 24, "target": "one_vs_rest"},
        steps=4,
        record={"every": 3},
        schedule={"lr": 0.05},
        spectrum={"k": 6, "dtype": "float64"},
        model={"factory": "user_models:inplace_resnet", "kwargs": {"channels": 2}},
    )
    sweep = SweepSpec(name="userres", base=base, grid={"model.kwargs.channels": [2, 3]})
    url = str(tmp_path / "s.zarr")
    for spec in sweep.expand():
        assert run_experiment(spec, SpectrumStore(url)).status == "done"
        run = Client(url).run(run_id(spec))
        paths = run.g.attrs["ntk_paths"]
        assert paths["method"] == "per_layer", paths
        assert paths["routes"]["2.weight"].startswith(
            "per_layer: BatchNorm2d used once; its output is modified in place"
        )
        model = build_model(spec.model, dtype=torch.float64)
        for i in range(run.g["theta"].shape[0]):
            torch.nn.utils.vector_to_parameters(torch.as_tensor(run.g["theta"][i], dtype=F64), model.parameters())
            X = torch.as_tensor(run.g["X"][:])
            ref = torch.linalg.eigvalsh(_reference(model, X)).flip(0)[:6]
            assert_close_rel(
                torch.as_tensor(np.asarray(run.g["eigenvalues"][i])),
                ref,
                1e-8,
                f"{spec.name} eigenvalues at record {i}",
            )


def test_a_coupling_model_is_refused_by_distributed_layouts_and_local_under_auto():
    from nsa_dist.config import ExperimentSpec
    from nsa_dist.pipeline.layout import choose_layout

    why = "batch statistics in '1' (BatchNorm2d, train mode)"
    for layout in ("block_rows", "matrix_free"):
        spec = ExperimentSpec.model_validate(
            {"data": {"n": 20}, "model": {"depth": 2, "width": 4}, "spectrum": {"layout": layout, "workers": 2}}
        )
        with pytest.raises(ValueError, match=r"couples samples.*use layout 'local'"):
            choose_layout(spec, 20, 10, coupled=why)
    auto = ExperimentSpec.model_validate(
        {
            "data": {"n": 20},
            "model": {"depth": 2, "width": 4},
            "spectrum": {"layout": "auto", "workers": 2, "memory_budget_gb": 1e-9},
        }
    )
    assert choose_layout(auto, 20, 10, coupled=why).layout.value == "local"


def test_tracker_on_a_transformer_over_token_ids_with_adam(tmp_path):
    """The issue's Transformer under the Tracker's default optimizer ("custom": the first-order
    prediction J·Δθ is a forward-mode product through attention): every step stored, exact."""
    import numpy as np

    from nsa_dist import Tracker
    from nsa_dist.client import Client

    torch.manual_seed(0)
    model = TinyTransformer().eval()
    X = torch.randint(0, 13, (16, 6))
    y = torch.randn(16, 3)
    url = str(tmp_path / "t.zarr")
    tr = Tracker(url, "tf", model, X, y, steps=4, record={"every": 2}, spectrum={"k": 4, "images": []})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    thetas = {}
    for t in range(4):
        if tr.due(t):
            thetas[t] = copy.deepcopy(model)
            tr.record(t, lr=1e-2)
        opt.zero_grad()
        loss = ((model(X) - y) ** 2).mean()
        loss.backward()
        opt.step()
    tr.close()
    run = Client(url).run("tf")
    assert run.status == "done"
    for i, t in enumerate(sorted(thetas)):
        ref = torch.linalg.eigvalsh(_reference(thetas[t].double(), X)).flip(0)[:4]
        assert_close_rel(torch.as_tensor(np.asarray(run.g["eigenvalues"][i])), ref, 1e-4, f"eigenvalues at t={t}")
    fo = np.asarray(run.g["first_order_error"][:])
    assert np.isfinite(fo).all() and (fo < 0.5).all(), f"J·Δθ through attention: first-order errors {fo}"
