"""Host microseconds autograph adds per decode call of ``generate()``, on the CPU.

Graphs are captured by a null backend (capture runs the function once; replays do
nothing), so the time inside the engine per decode call is autograph's own Python:
keying the call (the ``StaticCache`` object and the keyword arguments), the entry,
copying inputs into static buffers and building the outputs.  Also prints the time
of the eager decode call on the CPU (its kernels included, for scale) and, with
``--profile``, a cProfile of the engine's decode calls.

    PYTHONPATH=.:tests python tools/generate_host.py [--layers 4 --hidden 128]
"""

import argparse
import cProfile
import pstats
import sys
import time

import torch

import autograph
from autograph.capture import use_backend
from autograph.dispatch import Engine

sys.path.insert(0, "tests")
from standin import NullBackend  # noqa: E402


def build(layers, hidden, vocab):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 4,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 128), max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    use_backend(NullBackend())
    model = build(args.layers, args.hidden, args.vocab)
    ids = torch.randint(3, args.vocab, (1, 16))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new, do_sample=False,
              pad_token_id=0, cache_implementation="static", disable_compile=True)
    fast = autograph.graphed(model)

    host: list[float] = []
    dispatch = Engine.dispatch

    prof = cProfile.Profile() if args.profile else None
    profiling = [False]

    def timed(self, a, k):
        on = profiling[0] and len(host) > 4  # the decode replays only
        if on:
            prof.enable()
        start = time.perf_counter()
        try:
            return dispatch(self, a, k)
        finally:
            host.append(time.perf_counter() - start)
            if on:
                prof.disable()

    eager_calls: list[float] = []
    forward = type(model).forward

    def timed_forward(self, *a, **k):
        start = time.perf_counter()
        try:
            return forward(self, *a, **k)
        finally:
            eager_calls.append(time.perf_counter() - start)

    with torch.inference_mode():
        fast.generate(ids, **kw)  # capture
        medians = []
        Engine.dispatch = timed
        try:
            for _ in range(args.rounds):
                host.clear()
                fast.generate(ids, **kw)
                steps = sorted(host[1:])  # without the prefill
                medians.append(steps[len(steps) // 2])
            if prof is not None:
                host.clear()
                profiling[0] = True
                fast.generate(ids, **kw)
        finally:
            Engine.dispatch = dispatch
        type(model).forward = timed_forward
        try:
            eager_med = []
            for _ in range(args.rounds):
                eager_calls.clear()
                model.generate(ids, **kw)
                steps = sorted(eager_calls[1:])
                eager_med.append(steps[len(steps) // 2])
        finally:
            type(model).forward = forward
    s = autograph.stats(fast)
    print(f"replays {s['replays']} of {s['calls']} calls")
    print(f"autograph per decode call (null graph): {1e6 * min(medians):7.1f} us "
          f"(median of a generate, best of {args.rounds})")
    print(f"eager decode call (CPU kernels included): {1e6 * min(eager_med):7.1f} us")
    if args.profile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(35)


if __name__ == "__main__":
    main()
