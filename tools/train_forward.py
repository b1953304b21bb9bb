"""Host cost of the forward alone of a training call: autograph against
``make_graphed_callables`` (``bench_train``'s policy MLP, grad mode on, the output
dropped at once, no backward), medians of interleaved rounds, then a cProfile of each
method's forward calls (the functions with the most own time), so that a difference in
``train_phases``' forward column names the function it comes from.  Needs CUDA.

    PYTHONPATH=.:tools python tools/train_forward.py [--batch 1] [--calls 2000]
"""

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from torch import nn
from train_phases import setup  # tools/train_phases.py (tools run as scripts)

METHODS = ("autograph", "autograph reuse", "make_graphed_callables")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("train_forward: needs CUDA; nothing to measure here")
        return
    x, y, made = setup(a.batch, METHODS)
    forwards = {m: forward for m, (forward, _) in made.items()}
    opts = {m: opt for m, (_, opt) in made.items()}
    for forward, opt in made.values():
        for _ in range(10):  # warm up, capture, backward graphs
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(forward(x), y).backward()
            opt.step()
    torch.cuda.synchronize()
    times = {m: [] for m in METHODS}
    for _ in range(a.rounds):
        for m, forward in forwards.items():
            t0 = time.perf_counter()
            for _ in range(a.calls):
                forward(x)
            times[m].append((time.perf_counter() - t0) / a.calls * 1e6)
            torch.cuda.synchronize()
    for m in METHODS:
        print(f"{m:28s} forward {statistics.median(times[m]):7.2f} µs "
              f"(rounds {', '.join(f'{t:.1f}' for t in times[m])})")
    for m, forward in forwards.items():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            forward(x)
        prof.disable()
        torch.cuda.synchronize()
        print(f"== cProfile, {m}, {a.calls} forward calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)
    # the same forward inside whole steps (zero_grad, loss, backward, optimizer step):
    # autograph's functions only, by cumulative time
    for m, forward in forwards.items():
        if not m.startswith("autograph"):
            continue
        opt = opts[m]
        prof = cProfile.Profile()
        for _ in range(a.calls // 4):
            opt.zero_grad(set_to_none=True)
            prof.enable()
            out = forward(x)
            prof.disable()
            nn.functional.mse_loss(out, y).backward()
            opt.step()
        torch.cuda.synchronize()
        print(f"== cProfile, {m}, {a.calls // 4} forward calls inside steps")
        pstats.Stats(prof).sort_stats("cumulative").print_stats("autograph|apply|clone", a.top)


if __name__ == "__main__":
    main()
