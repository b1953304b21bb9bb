"""Models users did not write, graphed as users would graph them: per model and mode, the
largest difference from eager over several calls with new random inputs, and how many
calls replayed (a case whose calls all ran eagerly proves nothing: its reasons are
printed).  timm, torchvision and transformers models (those installed), small inputs.

Modes: ``no_grad`` and ``inference_mode`` (eval), ``grad`` (eval, grad mode on: code
that forgot ``no_grad``), ``train`` (a forward, backward and SGD step against an eager
twin: losses and gradients compared).  Needs CUDA (``--device cpu`` runs on the CPU
stand-in of the tests, for the harness itself).

    PYTHONPATH=. python tools/zoo.py [--calls 6] [--only resnet18 vit]
"""

from __future__ import annotations

import argparse
import copy
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import autograph

CALLS = 6


def _timm(name: str, **kw: Any) -> Callable[[], tuple[nn.Module, Callable[[int], Any]]]:
    def make() -> tuple[nn.Module, Callable[[int], Any]]:
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=10, **kw)
        size = model.default_cfg.get("input_size", (3, 224, 224))[-1]
        size = min(size, 64) if "vit" not in name and "deit" not in name else size
        return model, lambda b: torch.randn(b, 3, size, size)

    return make


def _tv(name: str, size: int = 64) -> Callable[[], tuple[nn.Module, Callable[[int], Any]]]:
    def make() -> tuple[nn.Module, Callable[[int], Any]]:
        import torchvision

        model = getattr(torchvision.models, name)(weights=None, num_classes=10)
        return model, lambda b: torch.randn(b, 3, size, size)

    return make


def _hf(kind: str) -> Callable[[], tuple[nn.Module, Callable[[int], Any]]]:
    def make() -> tuple[nn.Module, Callable[[int], Any]]:
        import transformers as T

        small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128)
        quiet = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        if kind == "gpt2":
            model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=512, n_embd=64, n_layer=2,
                                                   n_head=4, n_positions=128,
                                                   resid_pdrop=0.0, embd_pdrop=0.0,
                                                   attn_pdrop=0.0))
        elif kind == "llama":
            model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=512, num_key_value_heads=2,
                                                     **small))
        elif kind == "bert":
            model = T.BertModel(T.BertConfig(vocab_size=512, **small, **quiet))
        elif kind == "vit":
            model = T.ViTForImageClassification(T.ViTConfig(image_size=32, patch_size=8,
                                                            num_labels=10, **small,
                                                            **quiet))
            return model, lambda b: {"pixel_values": torch.randn(b, 3, 32, 32)}
        else:
            model = T.T5ForConditionalGeneration(T.T5Config(
                vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                decoder_start_token_id=0, dropout_rate=0.0))
            return model, lambda b: {"input_ids": torch.randint(1, 512, (b, 12)),
                                     "decoder_input_ids": torch.randint(1, 512, (b, 5))}
        return model, lambda b: {"input_ids": torch.randint(1, 512, (b, 12))}

    return make


MODELS: dict[str, Callable[[], tuple[nn.Module, Callable[[int], Any]]]] = {
    "timm resnet18": _timm("resnet18"),
    "timm efficientnet_b0": _timm("efficientnet_b0"),
    "timm mobilenetv3_small_100": _timm("mobilenetv3_small_100"),
    "timm convnext_atto": _timm("convnext_atto"),
    "timm vit_tiny_patch16_224": _timm("vit_tiny_patch16_224"),
    "timm regnetx_002": _timm("regnetx_002"),
    "tv resnet18": _tv("resnet18"),
    "tv mobilenet_v3_small": _tv("mobilenet_v3_small"),
    "tv efficientnet_b0": _tv("efficientnet_b0"),
    "tv squeezenet1_1": _tv("squeezenet1_1"),
    "tv shufflenet_v2_x0_5": _tv("shufflenet_v2_x0_5"),
    "tv vit_b_16": _tv("vit_b_16", 224),
    "hf gpt2": _hf("gpt2"),
    "hf llama": _hf("llama"),
    "hf bert": _hf("bert"),
    "hf vit": _hf("vit"),
    "hf t5": _hf("t5"),
}


def _to(value: Any, device: str) -> Any:
    if isinstance(value, dict):
        return {k: v.to(device) for k, v in value.items()}
    return value.to(device)


def _call(model: Any, x: Any) -> Any:
    return model(**x) if isinstance(x, dict) else model(x)


def _main_output(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    return out[0]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def run_case(name: str, mode: str, device: str, calls: int, batch: int,
             control: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    model, sample = MODELS[name]()
    model = model.to(device)
    twin = copy.deepcopy(model)
    if mode == "train":
        model.train()
        twin.train()
        for m in (model, twin):
            for sub in m.modules():  # dropout off: the graphs draw other numbers
                if "Drop" in type(sub).__name__ or "Stochastic" in type(sub).__name__:
                    for attr in ("p", "drop_prob"):
                        if isinstance(getattr(sub, attr, None), float):
                            setattr(sub, attr, 0.0)
    else:
        model.eval()
        twin.eval()
    # ``control``: a second eager copy in autograph's place (the harness's own noise:
    # kernels that accumulate in no fixed order, cuDNN's convolution backward)
    g = copy.deepcopy(model) if control else autograph.graphed(model)
    if control:
        model = g  # the copy is the one trained
    worst = 0.0
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (model, twin)]
    for _ in range(calls):
        x = _to(sample(batch), device)
        if mode == "train":
            got, want = _main_output(_call(g, x)), _main_output(_call(twin, x))
            got.float().square().mean().backward()
            want.float().square().mean().backward()
            worst = max(worst, _diff(got, want))
            for p, q in zip(model.parameters(), twin.parameters()):
                if p.grad is not None or q.grad is not None:
                    worst = max(worst, _diff(p.grad, q.grad))
            for opt in opts:
                opt.step()
                opt.zero_grad()
            continue
        context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
                   "grad": torch.enable_grad}[mode]
        with context():
            got, want = _main_output(_call(g, x)), _main_output(_call(twin, x))
        worst = max(worst, _diff(got, want))
    s = autograph.stats(g) if not control else {
        "calls": calls, "replays": 0, "backward_replays": 0, "eager_reasons": {},
        "eager_details": {}}
    return {"model": name, "mode": mode, "max_diff": worst, "calls": s["calls"],
            "replays": s["replays"], "backward_replays": s["backward_replays"],
            "eager": dict(s["eager_reasons"]), "details": s["eager_details"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=CALLS)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--modes", nargs="*", default=["no_grad", "inference_mode", "grad", "train"])
    ap.add_argument("--control", action="store_true",
                    help="eager against eager: the differences the kernels make alone")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True)")
    a = ap.parse_args()
    if a.device == "cpu":  # the tests' stand-in, for the harness itself
        sys.path.insert(0, ".")
        from autograph.capture import use_backend
        from tests.standin import StandinBackend

        use_backend(StandinBackend())
    if a.deterministic:
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    names = [n for n in MODELS if a.only is None or any(o in n for o in a.only)]
    rows = []
    for name in names:
        for mode in a.modes:
            try:
                row = run_case(name, mode, a.device, a.calls, a.batch, a.control)
            except ImportError as exc:
                print(f"{name:28} {mode:15} skipped: {exc}", flush=True)
                break
            except Exception as exc:  # noqa: BLE001 - reported, the next case runs
                print(f"{name:28} {mode:15} FAILED {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc(limit=3)
                continue
            rows.append(row)
            flag = "" if row["replays"] or a.control else \
                "  NO REPLAY " + str(row["details"])[:300]
            print(f"{name:28} {mode:15} diff {row['max_diff']:.2e} calls {row['calls']:3} "
                  f"replays {row['replays']:3} bwd {row['backward_replays']:3} "
                  f"eager {row['eager']}{flag}", flush=True)
    none = [f"{r['model']}/{r['mode']}" for r in rows if not r["replays"]]
    print(f"summary: {len(rows)} cases, {len(rows) - len(none)} replayed; none replayed: "
          f"{none}", flush=True)


if __name__ == "__main__":
    main()
