"""Why ``bench_train`` shows autograph's per-layer step further from
``make_graphed_callables`` than ``train_phases`` does: the same policy step timed with
the same input every step and with a fresh input every step (as ``bench_train``), with
Python's garbage collector on and off, interleaved, then a cProfile of each method's
fresh-input steps.  Needs CUDA.

    PYTHONPATH=.:tools python tools/train_gap.py [--batch 1] [--steps 200] [--rounds 7]
"""

import argparse
import cProfile
import gc
import pstats
import statistics
import time

import torch
from torch import nn
from train_phases import setup  # tools/train_phases.py (tools run as scripts)

METHODS = ("autograph", "autograph reuse", "make_graphed_callables")


class Refill:
    """The fresh inputs copied into one tensor in turn (new data, same object)."""

    def __init__(self, buf, xs):
        self.buf, self.xs = buf.clone(), xs

    def __iter__(self):
        for x in self.xs:
            self.buf.copy_(x)
            yield self.buf

    def __len__(self):
        return len(self.xs)


def step(forward, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(forward(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def timed(forward, opt, xs, ys):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x, y in zip(xs, ys):
        step(forward, opt, x, y)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / len(xs) * 1e6


def runtime_calls(made, cases, steps=50):
    """Per method and case, the CUDA runtime calls of ``steps`` steps (count and host µs
    per step, the costliest first): a wait on the device shows as a synchronize or a
    long launch."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for c, (cx, cy, _) in cases.items():
        for m, (forward, opt) in made.items():
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=acts) as prof:
                for n, (xi, yi) in enumerate(zip(cx, cy)):
                    if n == steps:
                        break
                    step(forward, opt, xi, yi)
                torch.cuda.synchronize()
            rows = [e for e in prof.key_averages() if e.key.startswith("cuda")]
            rows.sort(key=lambda e: -e.self_cpu_time_total)
            device = sum(e.self_device_time_total for e in prof.key_averages())
            text = ", ".join(f"{e.key} {e.count / steps:.1f}x {e.self_cpu_time_total / steps:.1f}"
                             for e in rows[:6])
            print(f"trace {c:14s} {m:24s} device {device / steps:6.1f} µs/step; {text}")


def kernels(made, xs, ys, steps=20, top=40):
    """Per method, the device work of ``steps`` fresh-input steps grouped by kernel
    name (count and device µs per step), then each autograph method's difference from
    ``make_graphed_callables``: where extra device time comes from."""
    per = {}
    for m, (forward, opt) in made.items():
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for xi, yi in list(zip(xs, ys))[:steps]:
                step(forward, opt, xi, yi)
            torch.cuda.synchronize()
        rows = {}
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            n, t = rows.get(e.name, (0, 0.0))
            rows[e.name] = (n + 1, t + e.device_time)
        per[m] = {k: (n / steps, t / steps) for k, (n, t) in rows.items()}
        total = sum(t for _, t in per[m].values())
        count = sum(n for n, _ in per[m].values())
        print(f"kernels {m}: {count:.1f} per step, {total:.1f} device µs per step")
        for k, (n, t) in sorted(per[m].items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"   {n:5.1f}x {t:7.2f} µs  {k[:110]}")
    differences(per, "kernels", "µs per step", top, quiet=True)


def differences(per, what, unit, top, quiet=False):
    """Each autograph method's rows (``per[method][name] = (count, µs)`` per step) less
    ``make_graphed_callables``', the largest differences in µs first; ``quiet`` leaves
    out rows that differ by less than 0.01 in count and 0.5 µs."""
    base = per["make_graphed_callables"]
    for m in per:
        if m == "make_graphed_callables":
            continue
        print(f"{what} {m} minus make_graphed_callables (count, {unit}):")
        names = set(per[m]) | set(base)
        diff = [(k, per[m].get(k, (0, 0))[0] - base.get(k, (0, 0))[0],
                 per[m].get(k, (0, 0))[1] - base.get(k, (0, 0))[1]) for k in names]
        for k, dn, dt in sorted(diff, key=lambda r: -abs(r[2]))[:top]:
            if not quiet or abs(dn) > 0.01 or abs(dt) > 0.5:
                print(f"   {dn:+5.1f}x {dt:+7.2f} µs  {k[:110]}")


def host_diff(made, xs, ys, steps=50, top=30):
    """Per method, every host event of ``steps`` fresh-input steps (torch operators and
    CUDA runtime calls: count and own host µs per step), as each autograph method's
    difference from ``make_graphed_callables``: which calls its extra host time is in."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    per = {}
    for m, (forward, opt) in made.items():
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=acts) as prof:
            for xi, yi in list(zip(xs, ys))[:steps]:
                step(forward, opt, xi, yi)
            torch.cuda.synchronize()
        per[m] = {e.key: (e.count / steps, e.self_cpu_time_total / steps)
                  for e in prof.key_averages()}
        print(f"host {m}: {sum(t for _, t in per[m].values()):.1f} own host µs per step "
              "in profiled events")
    differences(per, "host", "own host µs per step", top)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--host", action="store_true",
                    help="also the host events of 50 steps per method, as differences")
    ap.add_argument("--kernels", action="store_true",
                    help="also the device kernels of 20 steps per method, and the difference")
    ap.add_argument("--profile", action="store_true", help="also a cProfile per method")
    ap.add_argument("--trace", action="store_true",
                    help="also the CUDA runtime calls of 50 steps per method and case")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("train_gap: needs CUDA; nothing to measure here")
        return
    x, y, made = setup(a.batch, METHODS)
    xs = [torch.randn_like(x) for _ in range(a.steps)]
    ys = [torch.randn_like(y) for _ in range(a.steps)]
    same_x, same_y = [x] * a.steps, [y] * a.steps
    for forward, opt in made.values():
        for i in range(10):
            step(forward, opt, xs[i], ys[i])
    cases = {"same input": (same_x, same_y, True), "fresh input": (xs, ys, True),
             "fresh, gc off": (xs, ys, False), "fresh, one tensor": (Refill(x, xs), ys, True)}
    times = {(m, c): [] for m in METHODS for c in cases}
    for _ in range(a.rounds):
        for c, (cx, cy, collect) in cases.items():
            for m, (forward, opt) in made.items():
                if not collect:
                    gc.disable()
                try:
                    times[m, c].append(timed(forward, opt, cx, cy))
                finally:
                    gc.enable()
    mgc = "make_graphed_callables"
    print(f"batch {a.batch}; µs per step, median of {a.rounds} rounds of {a.steps} steps")
    print(f"{'method':24s} " + " ".join(f"{c:>22s}" for c in cases))

    for m in METHODS:
        cells = []
        for c in cases:
            t = statistics.median(times[m, c])
            cells.append(f"{t:8.1f} ({t / statistics.median(times[mgc, c]):.3f}x)")
        print(f"{m:24s} " + " ".join(f"{s:>22s}" for s in cells))
    print("gc counts", gc.get_count(), "thresholds", gc.get_threshold())
    if a.trace:
        runtime_calls(made, cases)
    if a.kernels:
        kernels(made, xs, ys)
    if a.host:
        host_diff(made, xs, ys)
    for m, (forward, opt) in made.items() if a.profile else ():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            for xi, yi in zip(xs, ys):
                step(forward, opt, xi, yi)
        prof.disable()
        torch.cuda.synchronize()
        print(f"== cProfile, {m}, {3 * len(xs)} fresh-input steps")
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
