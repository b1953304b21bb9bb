"""A decode loop made fast by ``autograph.capture_region()`` alone: the model is a plain
GPT-style module with a static KV cache, and neither it nor its code is touched.

    python examples/region_decode.py [--layers 12] [--steps 64]
"""

import argparse
import contextlib
import time

import torch

import autograph
from autograph.cli.models import Decoder


def decode(model, prompt, steps, region=None):
    """Greedy decoding; every model call inside ``region`` is graphed."""
    k_cache, v_cache = model.new_cache(prompt.shape[0])
    tokens = list(prompt.unbind(1))
    with torch.inference_mode(), region or contextlib.nullcontext():
        for pos in range(prompt.shape[1] + steps - 1):
            p = torch.tensor([pos], device=prompt.device)
            logits = model(tokens[pos][:, None], p, k_cache, v_cache)
            if pos >= prompt.shape[1] - 1:
                tokens.append(logits[:, -1].argmax(-1))
    return torch.stack(tokens, 1)


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def replays_of(region):
    return sum(s["replays"] for s in region.stats().values())


def speedup(eager_s, graphed_s, replays):
    """The ratio, or why there is none: without replayed graphs both runs were eager."""
    if not replays:
        return "no speedup to report: nothing was graphed here, both runs were eager"
    return f"{eager_s / graphed_s:.1f}x"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = Decoder(layers=args.layers).to(device, torch.float16 if device == "cuda" else None)
    model.eval()
    prompt = torch.randint(0, 50257, (1, 8), device=device)
    region = autograph.capture_region()
    decode(model, prompt, 4, region)  # warm up (the timed run's new caches warm up again)
    eager, t_eager = timed(lambda: decode(model, prompt, args.steps))
    fast, t_fast = timed(lambda: decode(model, prompt, args.steps, region))
    n = prompt.shape[1] + args.steps - 1
    print(f"device {device}: eager {t_eager / n * 1e3:.2f} ms/step, region "
          f"{t_fast / n * 1e3:.2f} ms/step ({speedup(t_eager, t_fast, replays_of(region))}), "
          f"tokens identical: {torch.equal(eager, fast)}")
    print(region.stats())
    if not torch.equal(eager, fast):
        raise SystemExit("generated tokens differ")


if __name__ == "__main__":
    main()
