"""Whether gradient accumulation crosses streams in a graphed training step, and what it
costs: the parameters' ``AccumulateGrad`` nodes take the stream current when they are
made, and a node kept alive by a captured autograd graph (made on the capture stream)
makes every later backward synchronize the caller's stream with it, per parameter.

``bench_train``'s policy MLP, one AdamW step per step, at each ``--batch``.  Methods:
eager, autograph, autograph with the captured autograd graphs released after the
first steps (``released``: an experiment that shows what the crossing costs; a new set
of used outputs could not be captured then), and ``make_graphed_callables``.  Prints
per method the median milliseconds per step over interleaved rounds and the CUDA
runtime's event records and stream waits per step (profiler).  Needs CUDA.

    PYTHONPATH=. python tools/accumulate_streams.py [--batch 1 32] [--rounds 9]
"""

import argparse
import copy
import json
import statistics
import time

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import autograph
from autograph.backward import Trained
from autograph.cli.bench_train import optimizer_for, policy


def release(model):
    """Detach the captured outputs of ``model``'s training graphs in place, so that
    their autograd graphs (and the parameters' AccumulateGrad nodes made at capture)
    are freed."""
    engine = model._self_engine
    n = 0
    for entry in engine.cache.entries.values():
        if isinstance(entry.graph, Trained):
            for t in entry.graph.static_diff:
                t.detach_()
                n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    for batch in a.batch:
        torch.manual_seed(0)
        base = policy().cuda()
        data = [(torch.randn(batch, 64, device="cuda"), torch.randn(batch, 16, device="cuda"))
                for _ in range(a.steps)]
        runs = {}
        for name in ("eager", "autograph", "released", "make_graphed_callables"):
            model = copy.deepcopy(base)
            opt, _ = optimizer_for(model.parameters())
            if name in ("autograph", "released"):
                fwd = autograph.graphed(model)
            elif name == "make_graphed_callables":
                fwd = torch.cuda.make_graphed_callables(model, (data[0][0].clone(),))
            else:
                fwd = model

            def step(x, y, fwd=fwd, opt=opt):
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(fwd(x), y)
                loss.backward()
                opt.step()
                return loss.detach()

            runs[name] = (step, fwd)
        losses = {}
        for name, (step, fwd) in runs.items():
            losses[name] = torch.stack([step(x, y) for x, y in data[:10]])
            if name == "released":
                print(f"b{batch} released {release(fwd)} captured outputs", flush=True)
                losses[name] = torch.cat([losses[name], torch.stack(
                    [step(x, y) for x, y in data[10:20]])])[:10]
        diffs = {n: float((v - losses["eager"]).abs().max()) for n, v in losses.items()}
        samples = {n: [] for n in runs}
        for _ in range(a.rounds):
            for name, (step, _) in runs.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for x, y in data:
                    step(x, y)
                torch.cuda.synchronize()
                samples[name].append((time.perf_counter() - t0) / len(data) * 1e3)
        counts = {}
        for name, (step, _) in runs.items():
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for x, y in data[:50]:
                    step(x, y)
                torch.cuda.synchronize()
            got = {ev.key: ev.count / 50 for ev in prof.key_averages()
                   if ev.key in ("cudaEventRecord", "cudaStreamWaitEvent",
                                 "cudaEventRecordWithFlags")}
            counts[name] = got
        med = {n: round(statistics.median(s), 4) for n, s in samples.items()}
        mgc = med["make_graphed_callables"]
        print(json.dumps({"batch": batch, "ms": med,
                          "x_mgc": {n: round(v / mgc, 3) for n, v in med.items()},
                          "paired_vs_autograph": {n: round(statistics.median(
                              b - c for b, c in zip(samples[n], samples["autograph"])), 4)
                              for n in runs},
                          "events_per_step": counts, "loss_diff": diffs,
                          "stats": {k: v for k, v in autograph.stats(runs["released"][1]).items()
                                    if k in ("replays", "backward_replays", "eager",
                                             "backward_eager")}}), flush=True)


if __name__ == "__main__":
    main()
