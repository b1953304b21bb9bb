"""Per-call microseconds of a tiny MLP (4x256, batch 1, under ``no_grad`` as ``bench``)
for the autograph found on ``PYTHONPATH``, against a hand-written CUDA graph in the
same process.  Besides the difference of the medians it prints the median of the
per-round differences ("paired": each round times every method back to back, in an
order that turns from round to round, so the host's drift between rounds cancels), and
the same for a second hand-written graph (the control: what the host lets it resolve).

Run it for two checkouts in turn to compare them on one machine (issue 11's "before and
after"): each process prints one JSON line with the medians of rounds interleaved across
its methods (hand-written copy + replay + clone; ``make_graphed_callables`` without an
output copy; autograph; autograph with ``outputs="reuse"`` where that checkout has it).

    for tree in old new; do PYTHONPATH=$tree python tools/per_call.py --label $tree; done
"""

import argparse
import inspect
import json
import statistics
import time

import torch
from torch import nn

import autograph


def mlp(width=256, layers=4):
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def hand_graph(model, x):
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(static)

    def step(x):
        static.copy_(x)
        graph.replay()
        return out.clone()

    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default="")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--steps", type=int, default=250)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = mlp().cuda().eval()
    inputs = [torch.randn(1, 256, device="cuda") for _ in range(args.steps)]
    with torch.no_grad():
        reference = model(inputs[0])
        methods = {"hand": hand_graph(model, inputs[0]),
                   # a second hand-written graph, timed like the others: its difference
                   # from the first is what the measurement can resolve on this host
                   "hand (control)": hand_graph(model, inputs[0]),
                   # a function: given the module, it would replace the module's forward
                   "make_graphed_callables": torch.cuda.make_graphed_callables(
                       lambda x: model(x), (inputs[0].clone(),))}
        methods["autograph"] = autograph.graphed(mlp().cuda().eval())
        methods["autograph"].load_state_dict(model.state_dict())
        if "outputs" in inspect.signature(autograph.graphed).parameters:
            reuse = autograph.graphed(mlp().cuda().eval(), outputs="reuse")
            reuse.load_state_dict(model.state_dict())
            methods["reuse"] = reuse
        samples = {name: [] for name in methods}
        for step in methods.values():
            for x in inputs[:5]:
                step(x)
            torch.testing.assert_close(step(inputs[0]), reference)
        order = list(methods)
        for r in range(args.rounds):
            # the order turns each round: no method always follows the same one
            for name in order[r % len(order):] + order[:r % len(order)]:
                step = methods[name]
                torch.cuda.synchronize()
                start = time.perf_counter()
                for x in inputs:
                    step(x)
                torch.cuda.synchronize()
                samples[name].append((time.perf_counter() - start) / len(inputs) * 1e6)
    medians = {name: round(statistics.median(s), 2) for name, s in samples.items()}
    replays = autograph.stats(methods["autograph"])["replays"]
    pairs = {"control - hand": ("hand (control)", "hand"),
             "autograph - hand": ("autograph", "hand"),
             "reuse - make_graphed_callables": ("reuse", "make_graphed_callables")}
    paired = {f"{label} (paired)": round(statistics.median(
        a - b for a, b in zip(samples[x], samples[y])), 2)
        for label, (x, y) in pairs.items() if x in samples}
    print(json.dumps({"label": args.label, **medians,
                      "autograph - hand": round(medians["autograph"] - medians["hand"], 2),
                      **paired, "autograph replays": replays}), flush=True)


if __name__ == "__main__":
    main()
