"""Where a token of ``generate()`` goes: eager, autograph and transformers' compiled path.

For each path: wall milliseconds per new token, the device time per token (the sum of
kernel times in a torch.profiler trace of one generate, divided by the new tokens), and,
for autograph, the host time spent inside autograph per decode call (keying, guards,
launching the replay; the host time of one ``cudaGraphLaunch`` from the profiler
trace).  Wall minus device time is what the host adds (generate's own
loop waits on the device once per token to test for the end).

    PYTHONPATH=. python tools/generate_breakdown.py [--new 128]
"""

import argparse
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import autograph
from autograph.cli.bench_generate import build_model
from autograph.dispatch import Engine


def device_ms(fn, kernels=0, per=1):
    """(kernel milliseconds of one run of ``fn``, host microseconds per
    ``cudaGraphLaunch`` in it or NaN), from one torch.profiler trace; with ``kernels``,
    prints that many kernels with the most device time (µs per ``per``: a token)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total_us, launch_us = 0.0, float("nan")
    rows = []
    for evt in prof.key_averages():
        if evt.key == "cudaGraphLaunch" and evt.count:
            launch_us = evt.cpu_time_total / evt.count
        if evt.device_type == DeviceType.CUDA and not evt.key.startswith("autograph."):
            # kernels and copies: not the CPU ops, nor autograph's ranges around replays
            us = getattr(evt, "self_device_time_total", 0.0) or getattr(
                evt, "self_cuda_time_total", 0.0)
            total_us += us
            rows.append((us, evt.count, evt.key))
    for us, count, name in sorted(rows, reverse=True)[:kernels]:
        print(f"      {us / per:8.1f} us/token {count / per:6.1f}x  {name[:90]}")
    if kernels:
        print(f"      {len(rows)} kernels, {sum(r[1] for r in rows) / per:.1f} launches/token")
    return total_us / 1e3, launch_us


def wall_ms(fn, runs=3):
    best = float("inf")
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def profiled(fn):
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--kernels", type=int, default=0,
                   help="print this many kernels with the most device time per path")
    p.add_argument("--profile", action="store_true",
                   help="also print a cProfile of autograph's generate (top functions)")
    args = p.parse_args()
    model = build_model()
    ids = torch.randint(3, 32000, (1, 16), device="cuda")
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new, do_sample=False,
              pad_token_id=0, cache_implementation="static")
    fast = autograph.graphed(model)
    paths = {
        "eager": lambda: model.generate(ids, **kw, disable_compile=True),
        "autograph": lambda: fast.generate(ids, **kw, disable_compile=True),
        "transformers compiled": lambda: model.generate(ids, **kw),
    }
    host, keying = [], []
    dispatch, key = Engine.dispatch, Engine._key

    def timed_dispatch(self, a, k):
        start = time.perf_counter()
        try:
            return dispatch(self, a, k)
        finally:
            host.append(time.perf_counter() - start)

    def timed_key(self, a, k):
        start = time.perf_counter()
        try:
            return key(self, a, k)
        finally:
            keying.append(time.perf_counter() - start)

    with torch.inference_mode():
        for name, fn in paths.items():
            fn()  # set-up, capture, compilation
            wall = wall_ms(fn) / args.new
            dev, launch = device_ms(fn, args.kernels, args.new)
            dev /= args.new
            line = (f"{name:<24} wall {wall:7.3f} ms/token   device {dev:7.3f} ms/token   "
                    f"host-added {wall - dev:7.3f}")
            if name == "autograph":
                Engine.dispatch, Engine._key = timed_dispatch, timed_key
                try:
                    fn()
                finally:
                    Engine.dispatch, Engine._key = dispatch, key
                steps = sorted(host)[: max(1, len(host) - 2)]  # without the prefill
                keys = sorted(keying)
                median = 1e6 * steps[len(steps) // 2]
                line += (f"\n    autograph per decode call: median {median:6.1f} us, of "
                         f"which keying {1e6 * keys[len(keys) // 2]:6.1f} us")
            print(line, flush=True)
            if name == "autograph":
                print(f"    graph launch (host, per cudaGraphLaunch, profiled): {launch:6.1f} us")
            if name == "autograph" and args.profile:
                profiled(fn)


if __name__ == "__main__":
    main()
