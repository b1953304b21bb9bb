"""Where the per-call time of a replayed graph goes.

Prints the best-of-7 microseconds of each piece of autograph's call path for a tiny MLP
at batch 1, against a hand-written copy + replay + clone of the same graph (on a GPU).
Without CUDA it times the pieces that need none (keying, modes, guards) on the CPU.

    PYTHONPATH=. python tools/replay_breakdown.py
"""

import torch
from timing import best  # tools/timing.py (tools run as scripts)

import autograph
from autograph.cli.models import mlp
from autograph.keys import key_call
from autograph.modes import modes


def main():
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = mlp().to(device).eval()
    g = autograph.graphed(model)
    x = torch.randn(1, 256, device=device)
    with torch.no_grad():
        for _ in range(5):
            g(x)
        engine = g._self_engine
        rows = {
            "plain module(x)": lambda: model(x),
            "key_call": lambda: key_call((x,), {}, modes, engine.training),
            "key_call, memo hit": lambda: key_call((x,), {}, modes, engine.training,
                                                   engine.memo),
            "modes": lambda: modes(x.device),
            "watch.ok": engine.watch.ok,
            "watch.training": engine.watch.training,
        }
        if cuda:
            (entry,) = engine.cache.entries.values()
            key = next(iter(engine.cache.entries))
            static, graph = entry.graph.static.buffers[0], entry.graph.graph

            def hand():
                static.copy_(x)
                graph.replay()
                return static.clone()

            rows = {
                "g(x)": lambda: g(x),
                "hand copy+replay+clone": hand,
                "entry.run(leaves)": lambda: entry.run((x,)),
                "engine._key": lambda: engine._key((x,), {}),
                "cache.entries.get": lambda: engine.cache.entries.get(key),
                **rows,
            }
        for name, fn in rows.items():
            print(f"{name:<26} {best(fn):7.2f} us")


if __name__ == "__main__":
    main()
