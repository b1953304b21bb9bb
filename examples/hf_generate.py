"""``model.generate(..., cache_implementation="static")`` with autograph: a Llama-shaped
model built from a config with random weights (nothing is downloaded), generated
greedily eagerly and through ``autograph.graphed(model).generate(...)``; the tokens are
compared and the milliseconds per token printed (and, with ``--compiled``,
transformers' own compiled static-cache path).

The static cache is an argument object autograph keys by structure: its KV tensors and
its device-side length are written in place by each decode step, so the step is
captured at their addresses and replayed; the prefill, which allocates the cache on first
use, runs eagerly.  ``disable_compile=True`` keeps transformers from compiling the
forward itself (it does so for static caches on CUDA).

    python examples/hf_generate.py [--layers 4 --hidden 512 --new 128 --batch 1]
"""

import argparse
import time

import torch

import autograph

try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:  # pragma: no cover
    raise SystemExit("this example needs transformers (pip install transformers)") from None


def build(layers, hidden, device, dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 4,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 128), max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    return model


def timed(generate, ids, kw, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = generate(ids, **kw)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--compiled", action="store_true", help="also time transformers' "
                   "compiled static-cache path")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = build(args.layers, args.hidden, device, dtype)
    ids = torch.randint(3, 32000, (args.batch, args.prompt), device=device)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new, do_sample=False,
              pad_token_id=0, cache_implementation="static", disable_compile=True)
    rows = {}
    with torch.inference_mode():
        want, first = timed(model.generate, ids, kw, device)
        best = min(timed(model.generate, ids, kw, device)[1] for _ in range(args.runs))
        rows["eager"] = (first, best, True)
        g = autograph.graphed(model)
        got, first = timed(g.generate, ids, kw, device)
        same = torch.equal(got, want)
        times = []
        for _ in range(args.runs):
            got, t = timed(g.generate, ids, kw, device)
            same = same and torch.equal(got, want)
            times.append(t)
        rows["autograph"] = (first, min(times), same)
        if args.compiled and device.type == "cuda":
            ckw = {**kw, "disable_compile": False}
            got, first = timed(model.generate, ids, ckw, device)
            times = [timed(model.generate, ids, ckw, device)[1] for _ in range(args.runs)]
            rows["compiled (transformers)"] = (first, min(times), torch.equal(got, want))
    s = autograph.stats(g)
    print(f"autograph: {s['calls']} calls, {s['replays']} replays, {s['captures']} captures, "
          f"eager {s['eager_reasons']}")
    print(f"Llama-shaped, {args.layers} layers, hidden {args.hidden}, {dtype}, batch "
          f"{args.batch}, {args.new} new tokens, {device}:")
    eager_ms = rows["eager"][1] / args.new * 1e3
    for name, (first, best, same) in rows.items():
        ms = best / args.new * 1e3
        print(f"  {name:24s} {ms:7.3f} ms/token  x{eager_ms / ms:5.2f} vs eager   first "
              f"generate {first * 1e3:8.1f} ms  tokens {'identical' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
