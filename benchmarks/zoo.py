"""The model zoo: ``gram()`` against a float64 ``torch.func.jacrev`` reference on every torchvision
classification model and on tiny Hugging Face ``transformers`` models (``make zoo``).

Run: ``python benchmarks/zoo.py [--only NAME ...] [--n 3] [--outputs 2] [--limit 25e6] [--json FILE]``
in a venv with torchvision and transformers (``make zoo`` makes ``.venv-zoo``: torchvision needs
another torch build than the project's CPU venv, so this never runs in ``make test``).

Each model is built without weights, in eval mode, in float64, with ``--outputs`` classes, at the
smallest input it takes (32×32 images; 64 for AlexNet, 75 for Inception v3); a constructor whose
model has more than ``--limit`` parameters is built in a tiny configuration of its own class (fewer
blocks, narrower layers — the same modules and code paths; the table says "tiny").  ``gram(model, X)``
(default method) is compared with ``J Jᵀ`` where J is the float64 ``torch.func.jacrev`` of the
full-batch forward w.r.t. every trainable parameter.  Printed per model: parameters, the max
relative error ``max|G − R| / max|R|``, the routes (how many parameter tensors take each; for
the exact route, the assumptions that failed), the time of ``gram`` and of the reference.

The Hugging Face rows (GPT-2, BERT, ViT, a T5 encoder: 2 layers, width 32, random weights, no
download) measure one tensor of the model's output: through ``gram(..., output=...)`` where that
selector exists, otherwise a wrapper module that returns it (the table says which).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import time
import warnings
from collections import Counter
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call, jacrev

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nsa_dist.errors import UnsupportedModelError  # noqa: E402
from nsa_dist.ntk import explain_method, gram  # noqa: E402

warnings.filterwarnings("ignore")
F64 = torch.float64
EXACT = 1e-10  # max relative error of an exact row


# ------------------------------------------------------------------ torchvision: tiny configurations


def _tiny_resnet(name: str, k: int) -> nn.Module:
    from torchvision.models import resnet as R

    block = R.BasicBlock if name in ("resnet18", "resnet34") else R.Bottleneck
    groups, width = {
        "resnext50_32x4d": (32, 4),
        "resnext101_32x8d": (32, 8),
        "resnext101_64x4d": (64, 4),
        "wide_resnet50_2": (1, 128),
        "wide_resnet101_2": (1, 128),
    }.get(name, (1, 64))
    return R.ResNet(block, [1, 1, 1, 1], num_classes=k, groups=groups, width_per_group=width)


def _small_classifier(m: nn.Module, width: int, k: int, features: int | None = None) -> nn.Module:
    """VGG / AlexNet with their 4096-wide classifier (100M+ parameters) narrowed to ``width``
    (``features``: its input width, default the original's)."""
    first = next(mod for mod in m.classifier if isinstance(mod, nn.Linear))
    m.classifier = nn.Sequential(
        nn.Dropout(0.5),
        nn.Linear(features or first.in_features, width),
        nn.ReLU(inplace=True),
        nn.Dropout(0.5),
        nn.Linear(width, width),
        nn.ReLU(inplace=True),
        nn.Linear(width, k),
    )
    return m


def _tiny_vgg(name: str, k: int) -> nn.Module:
    from torchvision.models import vgg as V

    letter = {"vgg11": "A", "vgg13": "B", "vgg16": "D", "vgg19": "E"}[name.replace("_bn", "")]
    cfg = [c if c == "M" else c // 8 for c in V.cfgs[letter]]
    m = V.VGG(V.make_layers(cfg, batch_norm=name.endswith("_bn")), num_classes=k)
    return _small_classifier(m, 32, k, features=[c for c in cfg if c != "M"][-1] * 7 * 7)


def _tiny_densenet(name: str, k: int) -> nn.Module:
    from torchvision.models.densenet import DenseNet

    return DenseNet(growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16, num_classes=k)


def _tiny_efficientnet(name: str, k: int) -> nn.Module:
    from torchvision.models import efficientnet as E

    if name.startswith("efficientnet_b"):
        setting, last = E._efficientnet_conf(name, width_mult=0.5, depth_mult=0.5)
        return E.EfficientNet(setting, 0.2, last_channel=last, num_classes=k)
    setting, last = E._efficientnet_conf(name)
    narrow, prev = [], -(-setting[0].input_channels // 32) * 8
    for c in setting:  # a quarter of the channels (multiples of 8, as the configs round them), one layer per stage
        narrow.append(
            dataclasses.replace(c, input_channels=prev, out_channels=-(-c.out_channels // 32) * 8, num_layers=1)
        )
        prev = narrow[-1].out_channels
    setting = narrow
    return E.EfficientNet(setting, 0.2, last_channel=256, num_classes=k, norm_layer=partial(nn.BatchNorm2d, eps=1e-03))


def _tiny_regnet(name: str, k: int) -> nn.Module:
    from torchvision.models import regnet as G

    params = G.BlockParams.from_init_params(
        depth=4, w_0=16, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25 if "_y_" in name else None
    )
    return G.RegNet(params, num_classes=k, norm_layer=partial(nn.BatchNorm2d, eps=1e-05, momentum=0.1))


def _tiny_convnext(name: str, k: int) -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    setting = [CNBlockConfig(8, 16, 1), CNBlockConfig(16, 32, 1), CNBlockConfig(32, 64, 1), CNBlockConfig(64, None, 1)]
    return ConvNeXt(setting, num_classes=k)


def _tiny_swin(name: str, k: int) -> nn.Module:
    from torchvision.models import swin_transformer as S

    v2 = "_v2_" in name
    extra = {"block": S.SwinTransformerBlockV2, "downsample_layer": S.PatchMergingV2} if v2 else {}
    return S._swin_transformer(
        patch_size=[4, 4],
        embed_dim=16,
        depths=[2, 2, 2, 2],
        num_heads=[2, 2, 4, 4],
        window_size=[4, 4],
        stochastic_depth_prob=0.0,
        weights=None,
        progress=False,
        num_classes=k,
        **extra,
    )


def _tiny_maxvit(name: str, k: int) -> nn.Module:
    from torchvision.models import MaxVit

    return MaxVit(
        input_size=(32, 32),
        stem_channels=8,
        partition_size=2,
        block_channels=[16, 32],
        block_layers=[1, 1],
        head_dim=8,
        stochastic_depth_prob=0.0,
        num_classes=k,
    )


def _tiny_vit(name: str, k: int) -> nn.Module:
    from torchvision.models import VisionTransformer

    patch = int(name.rsplit("_", 1)[1])
    return VisionTransformer(
        image_size=2 * patch, patch_size=patch, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=k
    )


TINY = {
    "resnet": _tiny_resnet,
    "resnext": _tiny_resnet,
    "wide_resnet": _tiny_resnet,
    "vgg": _tiny_vgg,
    "densenet": _tiny_densenet,
    "efficientnet": _tiny_efficientnet,
    "regnet": _tiny_regnet,
    "convnext": _tiny_convnext,
    "swin": _tiny_swin,
    "maxvit": _tiny_maxvit,
    "vit": _tiny_vit,
    "alexnet": lambda name, k: _small_classifier(__import__("torchvision").models.alexnet(num_classes=k), 32, k),
}
SIZE = {"alexnet": 64, "inception_v3": 75}
KWARGS = {
    "googlenet": {"aux_logits": False, "init_weights": True},
    "inception_v3": {"aux_logits": False, "init_weights": True},
}


def _family(name: str) -> str:
    for f in sorted(TINY, key=len, reverse=True):
        if name.startswith(f):
            return f
    return ""


CPB_ONLY = "swin_v2_t, only cpb_mlp trainable"


def torchvision_model(name: str, k: int, limit: float) -> tuple[nn.Module, torch.Tensor, str]:
    """(model, 3 images, "default" | "tiny") for one torchvision constructor (or ``CPB_ONLY``: Swin V2
    with only its continuous-position-bias MLPs trainable, the case that was 17.8× off)."""
    from torchvision import models

    if name == CPB_ONLY:
        model, x, config = torchvision_model("swin_v2_t", k, limit)
        for n, p in model.named_parameters():
            p.requires_grad_("cpb_mlp" in n)
        return model, x, config

    fam = _family(name)
    config = "default"
    model = None
    if not name.startswith("vit_") and name != "maxvit_t":  # these two need their image size up front
        model = models.get_model(name, weights=None, num_classes=k, **KWARGS.get(name, {}))
    if model is None or sum(p.numel() for p in model.parameters()) > limit:
        if not fam:
            raise RuntimeError(f"{name}: no tiny configuration and over the parameter limit")
        model, config = TINY[fam](name, k), "tiny"
    side = 2 * int(name.rsplit("_", 1)[1]) if name.startswith("vit_") else SIZE.get(name, 32)
    return model, torch.randn(3, 3, side, side, dtype=F64), config


# ------------------------------------------------------------------ Hugging Face: tiny configurations


class Selected(nn.Module):
    """One tensor of a Hugging Face model's output: ``pick(model(ids))`` (used when ``gram`` has no
    output selector)."""

    def __init__(self, model: nn.Module, pick, key: str) -> None:
        super().__init__()
        self.model, self.pick, self.key = model, pick, key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        arg = {"pixel_values": x} if x.is_floating_point() else {"input_ids": x}
        return self.pick(self.model(**arg))


def hf_models(k: int) -> dict[str, tuple]:
    """name → (builder ↦ model, points, pick (output ↦ tensor), what it picks)."""
    import transformers as T

    small = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_positions=16)
    ids = torch.randint(0, 50, (3, 8), generator=torch.Generator().manual_seed(0))
    return {
        "hf_gpt2_sequence_classification": (
            lambda: T.GPT2ForSequenceClassification(T.GPT2Config(**small, num_labels=k, pad_token_id=0)),
            ids,
            lambda o: o.logits,
            "logits",
        ),
        "hf_gpt2_lm_head": (
            lambda: T.GPT2LMHeadModel(T.GPT2Config(**small)),
            ids,
            lambda o: o.logits[:, -1, :k],
            f"logits[:, -1, :{k}]",
        ),
        "hf_bert_sequence_classification": (
            lambda: T.BertForSequenceClassification(
                T.BertConfig(
                    vocab_size=50,
                    hidden_size=32,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    intermediate_size=64,
                    max_position_embeddings=16,
                    num_labels=k,
                )
            ),
            ids,
            lambda o: o.logits,
            "logits",
        ),
        "hf_vit_image_classification": (
            lambda: T.ViTForImageClassification(
                T.ViTConfig(
                    image_size=16,
                    patch_size=8,
                    num_channels=3,
                    hidden_size=32,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    intermediate_size=64,
                    num_labels=k,
                )
            ),
            torch.randn(3, 3, 16, 16, dtype=F64),
            lambda o: o.logits,
            "logits",
        ),
        "hf_t5_encoder": (
            lambda: T.T5EncoderModel(
                T.T5Config(vocab_size=50, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2)
            ),
            ids,
            lambda o: o.last_hidden_state.mean(1)[:, :k],
            f"last_hidden_state.mean(1)[:, :{k}]",
        ),
    }


def _has_selector() -> bool:
    return "output" in inspect.signature(gram).parameters


# ------------------------------------------------------------------ the comparison


def reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``J Jᵀ`` traced over outputs, J the float64 ``jacrev`` of the full-batch forward (one parameter
    tensor's block at a time, so J is never held whole)."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    rest = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    n = x.shape[0]
    J = jacrev(lambda p: functional_call(model, {**p, **rest}, (x,)).reshape(n, -1))(params)
    G = None
    for j in J.values():
        j = j.reshape(n, j.shape[1], -1)  # (n, K, P_p)
        part = torch.einsum("akp,bkp->ab", j, j)
        G = part if G is None else G + part
    return G


def _routes(routes: dict[str, tuple[str, str]]) -> str:
    """ "structured 12, per_layer 40, jacobian 3 (sample axis 2, known layer 1)": parameter tensors per route."""
    paths = Counter(p for p, _ in routes.values())
    why = Counter(w.split(":")[0] for p, w in routes.values() if p == "jacobian")
    text = ", ".join(f"{p} {c}" for p, c in sorted(paths.items()))
    return text + (f" ({', '.join(f'{w} {c}' for w, c in why.most_common())})" if why else "")


def measure(name: str, model: nn.Module, x: torch.Tensor, config: str, selector=None) -> dict:
    model = model.to(F64).eval()
    row = {"model": name, "config": config, "P": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    kw = {} if selector is None else {"output": selector}
    try:
        method, routes = explain_method(model, x, **kw)
        t = time.perf_counter()
        G = gram(model, x, **kw)
        row["gram_s"] = time.perf_counter() - t
    except UnsupportedModelError as e:
        row.update(result="refused", why=str(e)[:200])
        return row
    except Exception as e:  # noqa: BLE001 — a zoo row reports what broke
        row.update(result="FAILED", why=f"{type(e).__name__}: {str(e)[:300]}")
        return row
    ref_model = model if selector is None else Selected(model, selector, "")
    t = time.perf_counter()
    R = reference(ref_model, x)
    row["func_s"] = time.perf_counter() - t
    err = float(((G - R).abs().max() / R.abs().max()).item()) if torch.isfinite(G).all() else float("inf")
    row.update(method=method.value, err=err, routes=_routes(routes), result="exact" if err <= EXACT else "WRONG")
    return row


def _print(row: dict) -> None:
    if row["result"] in ("refused", "FAILED"):
        print(f"| {row['model']} | {row['config']} | {row['P']:,} | {row['result']} | {row['why']} | | |", flush=True)
        return
    print(
        f"| {row['model']} | {row['config']} | {row['P']:,} | {row['err']:.1e} {row['result']} | {row['method']}: "
        f"{row['routes']} | {row['gram_s']:.2f} | {row['func_s']:.2f} |",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", default=None, help="model names (default: every one)")
    p.add_argument("--outputs", type=int, default=2)
    p.add_argument("--limit", type=float, default=25e6, help="parameters above which the tiny configuration is built")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="append one JSON line per model here")
    a = p.parse_args()
    torch.manual_seed(0)
    from torchvision import models

    names = models.list_models(module=models) + [CPB_ONLY]
    hf = {} if a.skip_hf else hf_models(a.outputs)
    todo = [n for n in names + list(hf) if a.only is None or n in a.only]
    print(
        "| model | config | parameters | max rel. error | method: parameter tensors per route | gram s | "
        "torch.func s |\n|---|---|---|---|---|---|---|",
        flush=True,
    )
    for name in todo:
        torch.manual_seed(0)
        if name in hf:
            build, x, pick, what = hf[name]
            model = build()
            if _has_selector():
                row = measure(name, model, x, f"output={what}", selector=pick)
            else:
                row = measure(name, Selected(model, pick, what), x, f"wrapper: {what}")
        else:
            try:
                model, x, config = torchvision_model(name, a.outputs, a.limit)
            except Exception as e:  # noqa: BLE001
                row = {"model": name, "config": "-", "P": 0, "result": "FAILED", "why": f"build: {e}"[:300]}
                _print(row)
                continue
            row = measure(name, model, x, config)
        _print(row)
        if a.json:
            with a.json.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
