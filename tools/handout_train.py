"""How much of the default mode's gap to ``outputs="reuse"`` in the per-layer training
step is its output copy (issue 17): ``train_ratio``'s measurement with the default
mode's per-call clone of the output swapped, for measuring only, for an alias
(unsafe: the upper bound of any hand-out), a copy into a buffer kept from call to
call, and a one-node copy graph into such a buffer.  Needs CUDA.

    PYTHONPATH=.:tools python tools/handout_train.py [--rounds 120]
"""

import argparse
import statistics

import torch
from handout import copy_graph  # tools/handout.py
from train_gap import timed as burst  # tools/train_gap.py (tools run as scripts)
from train_phases import setup
from train_ratio import quantile

import autograph

MGC = "make_graphed_callables"


def trained_single(graphed):
    (entry,) = graphed._self_engine.cache.entries.values()
    return entry.graph.single


def swap(graphed, how):
    single = trained_single(graphed)
    buf = torch.empty_like(single)
    if how == "alias":
        single.clone = single.detach
    elif how == "kept buffer":
        def copied():
            buf.copy_(single)
            return buf.detach()
        single.clone = copied
    elif how == "copy graph":
        replay = copy_graph(single, buf).replay

        def replayed():
            replay()
            return buf.detach()
        single.clone = replayed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--burst", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=120)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("handout_train: needs CUDA; nothing to measure here")
        return
    variants = ("alias", "kept buffer", "copy graph")
    methods = ("autograph", "autograph reuse", MGC, *variants)
    x, y, made = setup(1, ("autograph", "autograph reuse", MGC))
    for v in variants:
        made[v] = setup(1, ("autograph",))[2]["autograph"]
    xs = [torch.randn_like(x) for _ in range(a.burst)]
    ys = [torch.randn_like(y) for _ in range(a.burst)]
    for forward, opt in made.values():
        for _ in range(3):
            burst(forward, opt, xs, ys)
    for v in variants:
        swap(made[v][0], v)
    times = {m: [] for m in methods}
    order = list(methods)
    for r in range(a.rounds):
        for m in order[r % len(order):] + order[:r % len(order)]:
            times[m].append(burst(*made[m], xs, ys))
    for m in methods:
        ratios = [t / b for t, b in zip(times[m], times[MGC])]
        print(f"{m:24s} {statistics.median(times[m]):8.1f}   {statistics.median(ratios):.3f} "
              f"[{quantile(ratios, 0.1):.3f}, {quantile(ratios, 0.9):.3f}]")
    for m in ("autograph", *variants):
        s = autograph.stats(made[m][0])
        print(f"{m}: replays {s['replays']}, backward replays {s['backward_replays']}, "
              f"eager {s['eager']}")


if __name__ == "__main__":
    main()
