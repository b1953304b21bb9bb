"""Where a training step's host time goes, per autograd node and operator: autograph
against ``make_graphed_callables``, from the torch profiler's CPU events (every thread:
the autograd engine's device thread runs the backward nodes).

``bench_train``'s policy MLP at one batch size, one AdamW step per step.  Prints, per
method, the events with the most CPU time per step (``self`` and total), so that a
difference between methods names the node or operator it comes from.  The profiler
adds about a microsecond per event to every method alike; autograph's forward takes
its full path under a profiler (profiler ranges, no shortcut).  Needs CUDA.

With ``--runtime``, the CUDA runtime calls per step instead (``cudaEventRecord``,
``cudaStreamWaitEvent``, launches: the profiler's CUDA activity), which show stream
synchronizations that no operator names.

    PYTHONPATH=. python tools/train_trace.py [--batch 1] [--steps 200] [--top 18] [--runtime]
"""

import argparse

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from train_phases import setup  # tools/train_phases.py (tools run as scripts)

METHODS = ("autograph", "autograph reuse", "make_graphed_callables")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--runtime", action="store_true", help="CUDA runtime calls per step")
    a = ap.parse_args()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.runtime else [])
    x, y, made = setup(a.batch, METHODS)
    runs = {}
    for method, (forward, opt) in made.items():

        def step(forward=forward, opt=opt):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(forward(x), y).backward()
            opt.step()

        runs[method] = step
    for step in runs.values():
        for _ in range(20):
            step()
    torch.cuda.synchronize()
    tables = {}
    for method, step in runs.items():
        with profile(activities=activities) as prof:
            for _ in range(a.steps):
                step()
            torch.cuda.synchronize()
        rows = {}
        for ev in prof.key_averages():
            if a.runtime and not ev.key.startswith("cuda"):
                continue
            rows[ev.key] = (ev.self_cpu_time_total / a.steps, ev.cpu_time_total / a.steps,
                            ev.count / a.steps)
        tables[method] = rows
    names = set()
    for rows in tables.values():
        names |= set(sorted(rows, key=lambda k: -rows[k][1])[:a.top])
    print(f"per step, µs of CPU time (self / total) and calls; batch {a.batch}")
    print(f"{'event':60s} " + " ".join(f"{m[:22]:>24s}" for m in METHODS))
    for name in sorted(names, key=lambda k: -max(t.get(k, (0, 0, 0))[1] for t in tables.values())):
        cells = []
        for m in METHODS:
            s, t, c = tables[m].get(name, (0.0, 0.0, 0.0))
            cells.append(f"{s:7.1f} /{t:7.1f} x{c:4.1f}")
        print(f"{name[:60]:60s} " + " ".join(f"{c:>24s}" for c in cells))


if __name__ == "__main__":
    main()
