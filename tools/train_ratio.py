"""The per-layer training step's ratio to ``make_graphed_callables``, measured so that a
noisy host cannot fake it: the methods alternate in short bursts of steps over many
rounds, each round gives a paired ratio per method (its burst against mgc's burst of
the same round), and a second ``make_graphed_callables`` model (the *control*) is
timed like the others, so its ratio to the first shows what the measurement can
resolve.  Prints, per method, the median µs per step, the median paired ratio and the
spread (10th to 90th percentile) of the paired ratios.  Needs CUDA.

    PYTHONPATH=.:tools python tools/train_ratio.py [--batch 1] [--burst 25] [--rounds 200]
"""

import argparse
import statistics

import torch
from train_gap import timed as burst  # tools/train_gap.py (tools run as scripts)
from train_phases import setup

MGC = "make_graphed_callables"
METHODS = ("autograph", "autograph reuse", MGC, "mgc control")


def quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--burst", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=200)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("train_ratio: needs CUDA; nothing to measure here")
        return
    x, y, made = setup(a.batch, METHODS)
    xs = [torch.randn_like(x) for _ in range(a.burst)]
    ys = [torch.randn_like(y) for _ in range(a.burst)]
    for forward, opt in made.values():
        for _ in range(3):
            burst(forward, opt, xs, ys)
    times = {m: [] for m in METHODS}
    order = list(METHODS)
    for r in range(a.rounds):
        # the order turns each round: no method always follows the same one
        for m in order[r % len(order):] + order[:r % len(order)]:
            times[m].append(burst(*made[m], xs, ys))
    print(f"batch {a.batch}; {a.rounds} rounds of a {a.burst}-step burst per method; "
          "µs per step (median), paired ratio to mgc: median [10th, 90th percentile]")
    for m in METHODS:
        ratios = [t / b for t, b in zip(times[m], times[MGC])]
        print(f"{m:24s} {statistics.median(times[m]):8.1f}   {statistics.median(ratios):.3f} "
              f"[{quantile(ratios, 0.1):.3f}, {quantile(ratios, 0.9):.3f}]")
    import autograph
    for m in ("autograph", "autograph reuse"):
        s = autograph.stats(made[m][0])
        print(f"{m}: replays {s['replays']}, backward replays {s['backward_replays']}, "
              f"eager {s['eager']} {dict(s['eager_reasons'])}")


if __name__ == "__main__":
    main()
