"""Host cost of a training step: ``zero_grad``, forward, MSE loss, backward of
``bench_train``'s policy MLP (64 in, three 256-wide layers, 16 out) at batch 1.

Graphs are captured by a null backend (capture runs the function once; replays do
nothing), so what remains is the Python and the torch operators around the graphs.
Prints best-of-N microseconds per step and the torch operators each step launches
(views apart: no kernel on a GPU, where each other operator costs a launch) for:

* ``autograph``: ``graphed(model)``, and with ``outputs="reuse"`` (no output copy);
* ``make_graphed_callables``: an ``autograd.Function`` doing what torch's
  ``make_graphed_callables`` does per call (copy the input in, replay, hand out the
  static outputs; copy the output gradient in, replay, hand out the static gradients),
  with the same null graph: the floor for graphing forward and backward;
* ``eager``: the model itself on the CPU (its kernels included, for scale).

    PYTHONPATH=.:tests python tools/train_overhead.py [--batch 1] [--width 256] [--cpu-time]
"""

import argparse
import sys
import time

import torch
from timing import best  # tools/timing.py (tools run as scripts)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import autograph
from autograph.capture import use_backend
from autograph.cli.bench_train import policy

sys.path.insert(0, "tests")
from standin import NullBackend, NullGraph  # noqa: E402


def graphed_callable(model, sample):
    """``make_graphed_callables(model, (sample,))``'s per-call work on a null graph."""
    params = tuple(model.parameters())
    static_in = sample.clone()
    surface = (static_in, *params)
    static_out = model(static_in).detach()
    static_grad_out = torch.empty_like(static_out)
    static_grads = tuple(torch.zeros_like(p) for p in params)
    fwd, bwd = NullGraph(), NullGraph()

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for i in range(len(surface)):  # the parameters are their own buffers
                if surface[i].data_ptr() != inputs[i].data_ptr():
                    surface[i].copy_(inputs[i])
            fwd.replay()
            return static_out.detach()

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            for g in grads:
                if g is not None and static_grad_out.data_ptr() != g.data_ptr():
                    static_grad_out.copy_(g)
            bwd.replay()
            return (None, *(b.detach() for b in static_grads))

    def call(x):
        if model.training:  # the functionalized wrapper's check
            flat = torch.utils._pytree.tree_leaves((x,))
            return Graphed.apply(*(tuple(flat) + params))
        return model(x)

    return call


class Count(TorchDispatchMode):
    """Counts the operators run under it: launched (a kernel on a GPU) and views."""

    def __init__(self):
        super().__init__()
        self.launched, self.views = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.launched.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time this thread's CPU time (steadier on a loaded machine)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = policy(width=a.width)
    x, y = torch.randn(a.batch, 64), torch.randn(a.batch, 16)

    def stepper(forward):
        def step():
            model.zero_grad(set_to_none=True)
            nn.functional.mse_loss(forward(x), y).backward()
        return step

    clock = time.thread_time if a.cpu_time else time.perf_counter
    undo = use_backend(NullBackend())
    try:
        g = autograph.graphed(model, warmup=1)
        reuse = autograph.graphed(model, warmup=1, outputs="reuse")
        rows = {"autograph (null replay)": stepper(g),
                "autograph outputs=reuse": stepper(reuse),
                "make_graphed_callables-like": stepper(graphed_callable(model, x)),
                "eager model (CPU kernels)": stepper(model)}
        for _ in range(5):
            for step in rows.values():
                step()
        s = autograph.stats(g)
        assert s["backward_replays"] >= 2, s
        times = {name: [] for name in rows}
        for _ in range(a.rounds):  # interleaved: a shared machine's load hits all rows
            for name, step in rows.items():
                times[name].append(best(step, a.n, rounds=1, clock=clock))
        for name, step in rows.items():
            count = Count()
            with count:
                step()
            print(f"{name:28s} {min(times[name]):8.1f} us  {len(count.launched):3d} ops "
                  f"launched, {count.views} views: {' '.join(count.launched)}")
        over = min(times["autograph (null replay)"]) - min(times["make_graphed_callables-like"])
        print(f"{'autograph above the floor':28s} {over:8.1f} us")
        model.zero_grad()
    finally:
        undo()


if __name__ == "__main__":
    main()
