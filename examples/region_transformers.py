"""A transformers causal LM, built from a small config with random weights (nothing is
downloaded), decoded greedily inside ``autograph.capture_region()``.

Each step runs the model on a fixed-size window without a KV cache, so every step has
the same shapes and replays one graph: the logits at a position depend only on the
tokens before it, so the padding after the current token changes nothing.  (With a
``DynamicCache`` the cache object changes every step: autograph runs those calls eagerly
and says why.)

    python examples/region_transformers.py [--steps 32]
"""

import argparse
import contextlib
import time

import torch

import autograph

try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:  # pragma: no cover
    raise SystemExit("this example needs transformers (pip install transformers)") from None


def decode(model, prompt, steps, window, region=None):
    tokens = torch.zeros(1, window, dtype=torch.long, device=prompt.device)
    tokens[0, : prompt.shape[1]] = prompt[0]
    with torch.inference_mode(), region or contextlib.nullcontext():
        for n in range(prompt.shape[1], prompt.shape[1] + steps):
            logits = model(input_ids=tokens, use_cache=False).logits
            tokens[0, n] = logits[0, n - 1].argmax()
    return tokens


def speedup(eager_s, graphed_s, replays):
    """The ratio, or why there is none: without replayed graphs both runs were eager."""
    if not replays:
        return "no speedup to report: nothing was graphed here, both runs were eager"
    return f"{eager_s / graphed_s:.1f}x"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=256)
    model = LlamaForCausalLM(config).to(device).eval()
    prompt = torch.randint(0, config.vocab_size, (1, 8), device=device)
    window = prompt.shape[1] + args.steps
    region = autograph.capture_region()
    decode(model, prompt, 4, window, region)  # warm up: captures the step once

    def timed(region):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = decode(model, prompt, args.steps, window, region)
        if device == "cuda":
            torch.cuda.synchronize()
        return out, (time.perf_counter() - start) / args.steps

    eager, t_eager = timed(None)
    fast, t_fast = timed(region)
    same = torch.equal(eager, fast)
    replays = sum(s["replays"] for s in region.stats().values())
    print(f"device {device}: eager {t_eager * 1e3:.2f} ms/step, region {t_fast * 1e3:.2f} "
          f"ms/step ({speedup(t_eager, t_fast, replays)}), tokens identical: {same}")
    print(region.stats())
    if not same:
        raise SystemExit("generated tokens differ")


if __name__ == "__main__":
    main()
