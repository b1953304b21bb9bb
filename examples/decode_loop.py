"""Greedy decoding with a static KV cache, graphed by autograph.

Runs on a GPU (graphs) or on the CPU (autograph falls back to eager and says why).
    python examples/decode_loop.py [--layers 12] [--steps 64]
"""

import argparse
import time

import torch

import autograph
from autograph.cli.models import Decoder


def generate(step, model, prompt, steps):
    """Feed ``prompt`` one token at a time, then sample greedily for ``steps`` tokens."""
    k_cache, v_cache = model.new_cache(prompt.shape[0])
    tokens = [prompt[:, i : i + 1] for i in range(prompt.shape[1])]
    out = []
    with torch.inference_mode():
        for pos in range(prompt.shape[1] + steps):
            tok = tokens[pos] if pos < len(tokens) else out[-1]
            p = torch.tensor([pos], device=prompt.device)
            logits = step(tok, p, k_cache, v_cache)
            if pos >= prompt.shape[1] - 1:
                out.append(logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(out, dim=1)


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
    dtype = torch.float16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Decoder(layers=args.layers).to(device, dtype).eval()
    fast = autograph.graphed(model)
    prompt = torch.randint(0, 50257, (1, 8), device=device)

    timings = {}
    results = {}
    for name, step in (("eager", model), ("autograph", fast)):
        generate(step, model, prompt, 4)  # warm up (autograph captures here; the timed
        # run's new caches are other addresses, so its first steps warm up again)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        results[name] = generate(step, model, prompt, args.steps)
        if device == "cuda":
            torch.cuda.synchronize()
        timings[name] = (time.perf_counter() - start) / (prompt.shape[1] + args.steps)
    same = torch.equal(results["eager"], results["autograph"])
    print(f"device {device}: eager {timings['eager'] * 1e3:.2f} ms/token, "
          f"autograph {timings['autograph'] * 1e3:.2f} ms/token "
          f"({speedup(timings['eager'], timings['autograph'], autograph.stats(fast)['replays'])})"
          f", tokens identical: {same}")
    print(autograph.stats(fast))
    if not same:
        raise SystemExit("generated tokens differ")


if __name__ == "__main__":
    main()
