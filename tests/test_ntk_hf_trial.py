"""NTK trial on Hugging Face ``transformers`` patterns, rebuilt in plain torch (no transformers import).

The trial measured tiny random Llama / Mistral / Qwen2 / GPT-NeoX / DistilBERT / RoBERTa / BERT /
ALBERT / DeBERTa-v2 / … models (float64, eval mode, padded batches) through every ``gram`` route,
``kernel="full"`` and ``ntk_operator(...).matmat(eye)`` against the dense float64 reference —
``torch.func.jacrev`` of ``functional_call`` over the trainable parameters, contracted by einsum.

Found and fixed:

* Hugging Face (v5) builds its attention masks as booleans (True: attend) and hands them to
  ``F.scaled_dot_product_attention``.  Every forward-mode product (``ntk_operator``, the Hessian
  products, ``jacobian_vector_product``) runs attention by the aten math kernel
  (``composite_attention``), which does not convert a boolean mask as
  ``F.scaled_dot_product_attention`` does before it dispatches: a padded Llama's operator was
  0.28 off the reference (the ``gram`` routes were exact), silently.
* An embedding with ``padding_idx`` whose weight is also the output head (``tie_word_embeddings``,
  Llama / Qwen2 / Gemma build the embedding with ``padding_idx = pad_token_id``): the operator's
  forward-mode pass moved the pad lookups with the tangent's padding row, which reverse mode (the
  Gram routes, the reference) leaves without derivative — 0.08 off (``kernel="full"``), silently.
* A model whose outputs are NaN at some points (a left-padded BLOOM: fully masked attention rows)
  was refused as "the model's forward is random": now a NonFiniteError that says so.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev

from nsa_dist.errors import NonFiniteError
from nsa_dist.ntk import gram, ntk_operator
from nsa_dist.ntk.state import exact_kernels

D = torch.float64
TOL = 1e-12


def _reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(N, K, N, K) float64 J Jᵀ of ``model`` (float64), dense, by torch.func.jacrev."""
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    n = x.shape[0]
    jac = jacrev(lambda p: functional_call(model, p, (x,)))(params)
    K = next(iter(jac.values())).shape[1]
    J = torch.cat([j.reshape(n, K, -1) for j in jac.values()], 2)
    return torch.einsum("iap,jbp->iajb", J, J)


def _err(G: torch.Tensor, R: torch.Tensor) -> float:
    return float((torch.as_tensor(G) - R).abs().max() / R.abs().max())


class PaddedSdpaLM(nn.Module):
    """A Hugging Face style decoder block on token ids: the padding mask (token 0) and the causal
    mask combined into one boolean (n, 1, T, T) mask handed to ``F.scaled_dot_product_attention``
    (as transformers' ``sdpa_mask`` does), grouped-query heads (``enable_gqa``) when ``kv_heads``
    is fewer than ``heads``; the last token's first K logits."""

    def __init__(self, V: int = 20, E: int = 8, heads: int = 2, kv_heads: int = 2, K: int = 2) -> None:
        super().__init__()
        self.h, self.kvh, self.dh = heads, kv_heads, E // heads
        self.emb = nn.Embedding(V, E)
        self.q = nn.Linear(E, E, bias=False)
        self.kv = nn.Linear(E, 2 * kv_heads * self.dh, bias=False)
        self.o = nn.Linear(E, E, bias=False)
        self.head = nn.Linear(E, K)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n, T = ids.shape
        h = self.emb(ids)
        q = self.q(h).view(n, T, self.h, self.dh).transpose(1, 2)
        k, v = self.kv(h).view(n, T, 2, self.kvh, self.dh).permute(2, 0, 3, 1, 4)
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        mask = causal[None, None] & (ids != 0)[:, None, None, :]  # (n, 1, T, T) booleans
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kvh != self.h)
        h = h + self.o(a.transpose(1, 2).reshape(n, T, -1))
        return self.head(torch.tanh(h[:, -1]))


def _padded_ids() -> torch.Tensor:
    ids = torch.randint(1, 20, (5, 6), generator=torch.Generator().manual_seed(3))
    ids[1, :2] = 0  # left padding: the last token still attends
    ids[3, :4] = 0
    ids[4, 2] = 0  # a pad inside
    return ids


def _operator_and_grams_exact(model: nn.Module, x: torch.Tensor, kernel: str, methods: tuple[str, ...]) -> None:
    """``ntk_operator(...).matmat(eye)`` and ``gram`` by each of ``methods`` against the jacrev reference."""
    R = _reference(model, x)
    N, K = R.shape[:2]
    R = R.diagonal(dim1=1, dim2=3).sum(-1) if kernel == "trace" else R.reshape(N * K, N * K)
    op = ntk_operator(model, x, kernel=kernel)
    G = op.matmat(torch.eye(op.shape[0], dtype=D))
    assert _err(G, R) < TOL, f"operator off the reference by {_err(G, R):.3e} (relative)"
    for method in methods:  # the Gram routes agree with it
        Gg = gram(model, x, method=method, kernel=kernel)
        Gg = Gg if kernel == "trace" else Gg.reshape(N * K, N * K)
        assert _err(Gg, R) < TOL, f"gram(method={method!r}) off the reference by {_err(Gg, R):.3e}"


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["mha", "gqa"])
@pytest.mark.parametrize("kernel", ["trace", "full"])
def test_operator_through_a_boolean_sdpa_mask_is_exact(kv_heads, kernel):
    torch.manual_seed(0)
    model = PaddedSdpaLM(kv_heads=kv_heads).double().eval()
    x = _padded_ids()
    _operator_and_grams_exact(model, x, kernel, ("auto", "jacobian", "per_layer"))


def test_composite_attention_takes_a_boolean_mask_as_sdpa_does():
    """Inside ``exact_kernels`` (every forward-mode product) the model computes its own function:
    a boolean mask with a fully masked row (a padded query row) included."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, dtype=D) for _ in range(3))
    mask = torch.rand(2, 1, 5, 5, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[..., 0] = True
    mask[1, 0, 3] = False  # a row that attends nowhere: zeros, as the fused kernels give
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with exact_kernels(nn.Identity()):
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        got_gqa = F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], attn_mask=mask, enable_gqa=True)
    want_gqa = F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], attn_mask=mask, enable_gqa=True)
    for name, a, b in (("mha", got, want), ("gqa", got_gqa, want_gqa)):
        d = float((a - b).nan_to_num(float("inf")).abs().max())
        assert d < 1e-13, f"{name}: composite attention differs from F.scaled_dot_product_attention by {d:.3e}"


class TiedPaddedLM(nn.Module):
    """A language model whose output head is its token embedding (``tie_word_embeddings``), the
    embedding with a ``padding_idx`` (Hugging Face sets it to ``pad_token_id``): the padding row
    is read by the head (it has a gradient) and looked up at the pads (autograd gives that lookup
    none); the logits of every position, flattened."""

    def __init__(self, V: int = 12, E: int = 6, K: int = 3) -> None:
        super().__init__()
        self.K = K
        self.emb = nn.Embedding(V, E, padding_idx=0)
        with torch.no_grad():
            self.emb.weight[0].normal_()  # a trained model's pad row need not be zero
        self.mix = nn.Linear(E, E)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(ids)))
        h = h + h.cumsum(1) / 4  # a causal mixing of positions
        return F.linear(h, self.emb.weight)[..., : self.K].flatten(1)  # the tied head


@pytest.mark.parametrize("kernel", ["trace", "full"])
def test_operator_of_a_tied_embedding_with_padding_idx_is_the_grams_kernel(kernel):
    """The operator's forward-mode pass (J u) moved the padding row's lookups with u's padding row,
    which the head's gradient fills when the head is tied; reverse mode (every Gram route, the
    reference) gives those lookups no gradient: a tied, padded Llama's operator was 0.08 off
    (kernel="full")."""
    torch.manual_seed(0)
    model = TiedPaddedLM().double().eval()
    x = _padded_ids() % 12
    _operator_and_grams_exact(model, x, kernel, ("auto", "jacobian"))


def test_first_order_prediction_through_a_boolean_sdpa_mask_is_exact():
    """``jacobian_vector_product`` (forward mode under the same composite attention) is J·dθ with
    J the reference Jacobian of the padded, boolean-masked forward."""
    from nsa_dist.ntk import jacobian_vector_product

    torch.manual_seed(0)
    model = PaddedSdpaLM(kv_heads=1).double().eval()
    x = _padded_ids()
    params = dict(model.named_parameters())
    dtheta = torch.randn(sum(p.numel() for p in params.values()), dtype=D, generator=torch.Generator().manual_seed(2))
    jac = jacrev(lambda p: functional_call(model, p, (x,)))({k: p.detach() for k, p in params.items()})
    n, K = x.shape[0], 2
    want = torch.cat([j.reshape(n, K, -1) for j in jac.values()], 2) @ dtheta
    got = jacobian_vector_product(model, x, dtheta)
    assert _err(got, want) < TOL, f"J·dθ off the reference by {_err(got, want):.3e} (relative)"


def test_first_order_prediction_of_a_tied_padded_head_moves_the_padding_lookups():
    """``jacobian_vector_product`` predicts how f moves under an update, so it keeps forward mode's
    true derivative of the padding row's lookups (the operator and the Hessian take reverse mode's
    convention, none): against the central difference of f along dθ it is exact, while J·dθ by
    reverse mode's Jacobian misses the lookups' part (a GD step whose head gradient moved the pad
    row: 2.3·10⁻⁵ of Δf, docs/design-notes.md)."""
    from conftest import flat_model

    from nsa_dist.ntk import jacobian_vector_product

    torch.manual_seed(0)
    model = TiedPaddedLM().double().eval()
    x = _padded_ids() % 12
    assert (x == 0).any(), "the batch must hold padding tokens"
    params = dict(model.named_parameters())
    flat, f = flat_model(model)
    dtheta = torch.randn(flat.numel(), dtype=D, generator=torch.Generator().manual_seed(3))
    eps = 1e-5
    want = (f(flat + eps * dtheta, x) - f(flat - eps * dtheta, x)) / (2 * eps)  # O(eps²) ≈ 1e-10
    got = jacobian_vector_product(model, x, dtheta)
    assert _err(got, want) < 1e-8, f"J·dθ off the central difference by {_err(got, want):.3e} (relative)"
    jac = jacrev(lambda p: functional_call(model, p, (x,)))({k: p.detach() for k, p in params.items()})
    reverse = torch.cat([j.reshape(*want.shape, -1) for j in jac.values()], -1) @ dtheta
    assert _err(reverse, want) > 1e-4, "the pad row's lookups should move f here (else this test shows nothing)"


@pytest.mark.parametrize("model_of", [lambda: PaddedSdpaLM(kv_heads=1), TiedPaddedLM], ids=["bool-mask", "tied-pad"])
def test_loss_hessian_of_both_patterns_is_the_dense_one(model_of):
    """The loss Hessian's products run the same forward mode (composite attention, the padding rows'
    convention, now ``ntk.state.padding_rows_constant``): H = I + S against the dense float64
    Hessian of C(θ) = (1/2N) Σ ‖f − y‖², ``jacrev`` twice with ``F.scaled_dot_product_attention``
    held to PyTorch's own math backend (the fused CPU kernel has no double backward)."""
    from conftest import flat_model
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from nsa_dist.hessian import hessian_operator

    torch.manual_seed(0)
    model = model_of().double().eval()
    x = _padded_ids() % 12
    y = torch.randn(model(x).shape, dtype=D, generator=torch.Generator().manual_seed(5))
    theta, f = flat_model(model)

    def C(v: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((f(v, x) - y) ** 2).sum() / x.shape[0]

    with sdpa_kernel(SDPBackend.MATH):
        dense = jacrev(jacrev(C))(theta)
    eye = torch.eye(theta.numel(), dtype=D)
    H, I, S = (hessian_operator(model, x, y, part=p) for p in "HIS")
    for name, got in (("H", H.matmat(eye)), ("I + S", I.matmat(eye) + S.matmat(eye))):
        assert _err(got, dense) < 1e-11, f"{name} off the dense Hessian by {_err(got, dense):.3e} (relative)"


class MaskedPool(nn.Module):
    """Attention pooling over the non-pad tokens: a sequence of pads only has every key masked,
    and its softmax (as a padded Hugging Face attention row's) is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.score = nn.Linear(4, 1)
        self.out = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        s = self.score(h)[..., 0].masked_fill(ids == 0, float("-inf"))
        return self.out((s.softmax(-1)[..., None] * h).sum(1))


@pytest.mark.parametrize("how", ["auto", "jacobian", "operator"])
def test_nan_outputs_are_named_not_taken_for_randomness(how):
    torch.manual_seed(0)
    model = MaskedPool().double().eval()
    x = torch.tensor([[1, 2, 3], [0, 0, 0], [4, 5, 0], [6, 7, 8], [2, 2, 1]])
    assert model(x)[1].isnan().all() and not model(x)[[0, 2, 3, 4]].isnan().any()
    with pytest.raises(NonFiniteError, match="NaN or inf at 1 of the 4 probe points"):
        if how == "operator":
            ntk_operator(model, x)
        else:
            gram(model, x, method=how)


def test_a_nan_weight_is_named_as_the_cause():
    """A NaN parameter made every output NaN and was reported as NaN outputs at the probe points with
    the advice to check attention masks (audit O): the parameter is named, for the NTK and the Hessian."""
    from nsa_dist.hessian import hessian_operator, hutchpp_moments

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    x, y = torch.randn(6, 3, dtype=D), torch.randn(6, 2, dtype=D)
    for measure in (lambda: gram(model, x), lambda: hutchpp_moments(hessian_operator(model, x, y), 4)):
        with pytest.raises(
            NonFiniteError, match=r"parameters hold NaN or inf, or its buffers NaN — 0\.weight \(1 of 24 entries\)"
        ):
            measure()


def test_an_inf_mask_buffer_is_not_blamed_for_nan_outputs():
    """A −inf padding-mask buffer is what attention masks hold: a fully masked row's NaN output was
    blamed on it as "a diverged training step" (a review's repro); the masking advice stays."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.score, self.out = nn.Linear(2, 1), nn.Linear(2, 1)
            self.register_buffer("pad", torch.tensor([0.0, float("-inf"), float("-inf")]))

        def forward(self, x):  # x (n, 3, 2): a row whose unmasked entry is -inf too is all masked
            s = self.score(x)[..., 0] + self.pad + torch.where(x[..., 0, :1] > 5, float("-inf"), 0.0)
            return self.out((s.softmax(-1)[..., None] * x).sum(1))

    torch.manual_seed(0)
    model = Masked().double()
    x = torch.randn(5, 3, 2, dtype=D)
    x[1, 0, 0] = 9.0
    with pytest.raises(NonFiniteError, match="an attention row whose every key is masked") as e:
        gram(model, x)
    assert "buffers" not in str(e.value), e.value
