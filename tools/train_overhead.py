"""Host cost of a training call: forward + backward of a small MLP under grad mode.

Graphs are captured by a null backend (capture runs the function once; replays do
nothing), so what remains is autograph's Python and autograd bookkeeping per call.
Prints best-of-7 microseconds per ``y = g(x); y.sum().backward()`` against:

* ``floor``: the same loop through a bare ``autograd.Function`` whose forward clones a
  fixed tensor and whose backward returns fixed gradients (what any graph-in-a-Function
  design costs at least);
* ``eager``: the model itself on the CPU (its kernels included, for scale).

    PYTHONPATH=.:tests python tools/train_overhead.py [--width 16]
"""

import argparse
import sys

import torch
from timing import best  # tools/timing.py (tools run as scripts)

import autograph
from autograph.capture import use_backend
from autograph.cli.models import mlp

sys.path.insert(0, "tests")
from standin import StandinBackend  # noqa: E402


class _Null:
    def replay(self):
        pass


class NullBackend(StandinBackend):
    """Captures by running the function once; replays do nothing."""

    def capture(self, device, fn, pool=None):
        self._local.capturing = True
        try:
            out = fn()
        finally:
            self._local.capturing = False
        return _Null(), out


class _Floor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, *params):
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        return (None, *[torch.zeros_like(p) for p in ctx.params])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = mlp(a.width, 3)
    x = torch.randn(1, a.width)
    params = list(model.parameters())
    grads = [torch.zeros_like(p) for p in params]

    def eager():
        model(x).sum().backward()

    fixed = torch.randn(1, a.width)

    class Floor(_Floor):
        @staticmethod
        def backward(ctx, grad):
            return (None, *[g.clone() for g in grads])

    def floor():
        Floor.apply(fixed, *params).sum().backward()

    undo = use_backend(NullBackend())
    try:
        g = autograph.graphed(model, warmup=1)

        def graphed():
            g(x).sum().backward()

        for _ in range(5):
            graphed()
        s = autograph.stats(g)
        assert s["backward_replays"] >= 2, s
        rows = {"autograph (null replay)": graphed, "floor: bare Function": floor,
                "eager model (CPU kernels)": eager}
        times = {name: [] for name in rows}
        for _ in range(a.rounds):  # interleaved: a shared machine's load hits all rows
            for name, fn in rows.items():
                times[name].append(best(fn, a.n, rounds=1))
        for name in rows:
            print(f"{name:28s} {min(times[name]):8.1f} us")
        over = min(times["autograph (null replay)"]) - min(times["floor: bare Function"])
        print(f"{'autograph above the floor':28s} {over:8.1f} us")
        model.zero_grad()
    finally:
        undo()


if __name__ == "__main__":
    main()
