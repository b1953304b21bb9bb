"""Where the per-call time of a replayed graph goes, on a GPU.

Prints the best-of-7 microseconds of each piece of autograph's call path for a tiny MLP
at batch 1, against a hand-written copy + replay + clone of the same graph.

    PYTHONPATH=. python tools/replay_breakdown.py
"""

import time

import torch

import autograph
from autograph.cli.models import mlp
from autograph.keys import key_call


def best(fn, n=20000, rounds=7):
    """Best per-call microseconds over ``rounds`` loops of ``n`` calls."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / n * 1e6)
    return min(times)


def main():
    if not torch.cuda.is_available():
        print("replay_breakdown: needs CUDA")
        return
    model = mlp().cuda().eval()
    g = autograph.graphed(model)
    x = torch.randn(1, 256, device="cuda")
    with torch.no_grad():
        for _ in range(5):
            g(x)
        engine = g._self_engine
        (entry,) = engine.entries.values()
        key = next(iter(engine.entries))
        static, graph = entry.static.buffers[0], entry.graph

        def hand():
            static.copy_(x)
            graph.replay()
            return static.clone()

        rows = {
            "g(x)": lambda: g(x),
            "hand copy+replay+clone": hand,
            "entry.run(leaves)": lambda: entry.run((x,)),
            "key_call": lambda: key_call((x,), {}),
            "engine._key": lambda: engine._key((x,), {}),
            "engine._quick_key": lambda: engine._quick_key((x,)),
            "watch.ok": engine.watch.ok,
            "entries.get": lambda: engine.entries.get(key),
        }
        for name, fn in rows.items():
            print(f"{name:<26} {best(fn):7.2f} us")


if __name__ == "__main__":
    main()
