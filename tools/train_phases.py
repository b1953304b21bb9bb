"""Where a training step's time goes: autograph against ``make_graphed_callables``.

``bench_train``'s policy MLP at one batch size, one AdamW step per step.  Prints, per
method, the host microseconds of each phase (``zero_grad``, forward, loss, backward,
optimizer step; host clock only, no synchronization inside a step), the wall time of
a step (synchronized over many steps), and from one profiled step the number of
device kernels and their summed device time.  Needs CUDA.

    PYTHONPATH=. python tools/train_phases.py [--batch 1] [--steps 300]
"""

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import autograph
from autograph.cli.bench_train import optimizer_for, policy

PHASES = ("zero_grad", "forward", "loss", "backward", "step")


def make(method, model, x):
    if method == "autograph":
        return autograph.graphed(model)
    if method == "autograph reuse":
        return autograph.graphed(model, outputs="reuse")
    return torch.cuda.make_graphed_callables(model, (x.clone(),))


def setup(batch, methods):
    """``bench_train``'s policy on CUDA from seed 0, an input and a target of ``batch``
    rows, and per method a graphed copy of the policy with its optimizer."""
    torch.manual_seed(0)
    base = policy().cuda()
    x = torch.randn(batch, 64, device="cuda")
    y = torch.randn(batch, 16, device="cuda")
    made = {}
    for method in methods:
        model = copy.deepcopy(base)
        opt, _ = optimizer_for(model.parameters())
        made[method] = (make(method, model, x), opt)
    return x, y, made


def run_step(forward, opt, x, y, clock, times, idle=False):
    t0 = clock()
    opt.zero_grad(set_to_none=True)
    if idle:  # the device idle when the forward starts (outside the phases' clocks)
        torch.cuda.synchronize()
    t1 = clock()
    out = forward(x)
    t2 = clock()
    loss = nn.functional.mse_loss(out, y)
    t3 = clock()
    loss.backward()
    t4 = clock()
    opt.step()
    t5 = clock()
    if times is not None:
        for name, a, b in zip(PHASES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
            times[name].append((b - a) * 1e6)


def profiled(methods, x, y, steps=300):
    """A cProfile of ``steps`` steps per method, the functions with the most own time."""
    import cProfile
    import pstats

    for name, (forward, opt) in methods.items():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            run_step(forward, opt, x, y, time.perf_counter, None)
        prof.disable()
        torch.cuda.synchronize()
        print(f"== cProfile, {name}, {steps} steps")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--idle", action="store_true",
                    help="let the device go idle before each forward (a forward that waits "
                         "for the device costs less then)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="first run 20 steps per method with torch.cuda.set_sync_debug_mode"
                         "('warn'): a call that synchronizes with the device warns")
    ap.add_argument("--profile", action="store_true",
                    help="also print a cProfile of 300 steps per method (top functions)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("train_phases: needs CUDA; nothing to measure here")
        return
    x, y, methods = setup(a.batch, ("autograph", "autograph reuse", "make_graphed_callables"))
    for forward, opt in methods.values():
        for _ in range(6):
            run_step(forward, opt, x, y, time.perf_counter, None)
    if a.sync_debug:
        for name, (forward, opt) in methods.items():
            print(f"sync debug: {name}", flush=True)
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(20):
                    run_step(forward, opt, x, y, time.perf_counter, None)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    host = {name: {p: [] for p in PHASES} for name in methods}
    wall = {name: [] for name in methods}
    for _ in range(a.rounds):
        for name, (forward, opt) in methods.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(a.steps):
                run_step(forward, opt, x, y, time.perf_counter, host[name], a.idle)
            torch.cuda.synchronize()
            wall[name].append((time.perf_counter() - start) / a.steps * 1e6)
    print(f"batch {a.batch}, {a.steps} steps x {a.rounds} rounds; host µs per phase "
          "(median), wall µs per step (median of rounds), device kernels of one step")
    print(f"{'method':24s} " + " ".join(f"{p:>9s}" for p in PHASES)
          + f" {'host sum':>9s} {'wall':>8s} {'kernels':>8s} {'device µs':>9s}")
    for name, (forward, opt) in methods.items():
        med = [statistics.median(host[name][p]) for p in PHASES]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run_step(forward, opt, x, y, time.perf_counter, None)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        device_us = sum(e.device_time for e in kernels)
        print(f"{name:24s} " + " ".join(f"{m:9.1f}" for m in med)
              + f" {sum(med):9.1f} {statistics.median(wall[name]):8.1f} {len(kernels):8d}"
              f" {device_us:9.1f}")
    if a.profile:
        profiled(methods, x, y)
    for name, (forward, _) in methods.items():
        if name.startswith("autograph"):
            s = autograph.stats(forward)
            print(name, {k: s[k] for k in ("replays", "backward_replays", "eager",
                                           "eager_reasons", "backward_spills")})


if __name__ == "__main__":
    main()
