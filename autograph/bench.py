"""``python -m autograph bench``: eager vs autograph vs a hand-written CUDA graph.

Workloads: a GPT-2-small-shaped decode step (fp16, static KV cache of 1024 positions
written in place) at batch 1 and 8, and a tiny 4-layer 256-wide MLP at batch 1 that
shows the per-call overhead.  Every method is timed in the same run, interleaved round
by round; the table shows the median microseconds per step and the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import graphed, stats
from .models import Decoder, mlp

Step = Callable[[int], Any]


@dataclass
class Row:
    workload: str
    times: dict[str, float]  # method -> median seconds per step


def _hand_graph(fn: Callable[..., Any], static: list[torch.Tensor],
                persistent: list[torch.Tensor]) -> tuple[Callable[..., Any], Any]:
    """The hand-written reference: warm up on a side stream, capture once, then per
    step copy the inputs in, replay, and clone the output out."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*static, *persistent)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static, *persistent)

    def step(*inputs: torch.Tensor) -> torch.Tensor:
        for dst, src in zip(static, inputs):
            dst.copy_(src)
        graph.replay()
        return out.clone()

    return step, graph


def _time(step: Step, iters: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(iters):
        step(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def _measure(steps: dict[str, Step], iters: int, rounds: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():  # warm every method (autograph captures here)
        for i in range(4):
            step(i)
    for _ in range(rounds):
        for name, step in steps.items():
            samples[name].append(_time(step, iters))
    return {name: statistics.median(s) for name, s in samples.items()}


def bench_decode(batch: int, iters: int, rounds: int, layers: int = 12) -> Row:
    torch.manual_seed(0)
    model = Decoder(layers=layers).cuda().half().eval()
    vocab = model.lm_head.out_features
    tokens = [torch.randint(0, vocab, (batch, 1), device="cuda") for _ in range(iters)]
    positions = [torch.tensor([i % model.max_len], device="cuda") for i in range(iters)]
    caches = {name: model.new_cache(batch) for name in ("eager", "hand", "autograph")}
    fast = graphed(model)

    with torch.no_grad():
        hand, _ = _hand_graph(model, [tokens[0].clone(), positions[0].clone()],
                              list(caches["hand"]))
        _check_decode(model, fast, tokens, positions, batch)
        steps: dict[str, Step] = {
            "eager": lambda i: model(tokens[i], positions[i], *caches["eager"]),
            "hand graph": lambda i: hand(tokens[i], positions[i]),
            "autograph": lambda i: fast(tokens[i], positions[i], *caches["autograph"]),
        }
        times = _measure(steps, iters, rounds)
    return Row(f"decode step B={batch}", times)


def _check_decode(model: Decoder, fast: Any, tokens: list[torch.Tensor],
                  positions: list[torch.Tensor], batch: int) -> None:
    """Refuse to time a wrong result: autograph must match eager step by step."""
    ref_cache, cache = model.new_cache(batch), model.new_cache(batch)
    for i in range(6):
        expect = model(tokens[i], positions[i], *ref_cache)
        got = fast(tokens[i], positions[i], *cache)
        torch.testing.assert_close(got, expect, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cache[0], ref_cache[0], rtol=2e-2, atol=2e-2)


def bench_mlp(iters: int, rounds: int) -> Row:
    torch.manual_seed(0)
    model = mlp().cuda().eval()
    xs = [torch.randn(1, 256, device="cuda") for _ in range(iters)]
    fast = graphed(model)
    with torch.no_grad():
        hand, graph = _hand_graph(model, [xs[0].clone()], [])
        for x in xs[:4]:
            torch.testing.assert_close(fast(x), model(x))
        steps: dict[str, Step] = {
            "eager": lambda i: model(xs[i]),
            "hand graph": lambda i: hand(xs[i]),
            "autograph": lambda i: fast(xs[i]),
            "replay alone": lambda i: graph.replay(),
        }
        times = _measure(steps, iters, rounds)
    return Row("MLP 4x256 B=1", times)


@dataclass
class VariableRow:
    method: str
    seconds: float  # median per step
    graphs: int
    graph_bytes: int
    padding_waste: float  # padded rows / real rows


def bench_variable(steps: int = 400, rounds: int = 7, device: str = "cuda", width: int = 1024,
                   seed: int = 0) -> list[VariableRow]:
    """Batch sizes drawn at random in 1..16 (fixed seed), on a 4-layer MLP: eager, one
    graph per bucket of [1, 2, 4, 8, 16], and one graph per exact batch size."""
    sizes = torch.randint(1, 17, (steps,), generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    model = mlp(width).to(device).eval()
    xs = {n: torch.randn(n, width, device=device) for n in range(1, 17)}
    methods = {
        "eager": model,
        "buckets [1,2,4,8,16]": graphed(model, buckets=[1, 2, 4, 8, 16]),
        "one graph per size": graphed(model, max_graphs=16),
    }
    order = [int(n) for n in sizes]

    def run(fn: Callable[..., Any]) -> None:
        for n in order:
            fn(xs[n])

    with torch.no_grad():
        for fn in methods.values():  # warm: every graph is captured here
            for _ in range(4):
                run(fn)
        times: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(rounds):
            for name, fn in methods.items():
                _sync(device)
                start = time.perf_counter()
                run(fn)
                _sync(device)
                times[name].append((time.perf_counter() - start) / steps)
    rows = []
    for name, fn in methods.items():
        s = stats(fn) if fn is not model else None
        waste = 0.0
        if s and s["buckets"]:
            real = sum(b["real_rows"] for b in s["buckets"].values())
            padded = sum(b["padded_rows"] for b in s["buckets"].values())
            waste = padded / real if real else 0.0
        rows.append(VariableRow(name, statistics.median(times[name]),
                                s["graphs"] if s else 0, s["graph_memory_bytes"] if s else 0,
                                waste))
    return rows


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def format_variable(rows: list[VariableRow]) -> str:
    head = (f"{'variable batch 1..16':<22} {'us/step':>9} {'eager/x':>8} {'graphs':>7} "
            f"{'graph MB':>9} {'padding waste':>14}")
    lines = [head, "-" * len(head)]
    eager = rows[0].seconds
    for r in rows:
        lines.append(f"{r.method:<22} {r.seconds * 1e6:>9.1f} {eager / r.seconds:>7.2f}x "
                     f"{r.graphs:>7} {r.graph_bytes / 2**20:>9.1f} {r.padding_waste:>13.1%}")
    return "\n".join(lines)


def environment() -> str:
    props = torch.cuda.get_device_properties(0)
    return (
        f"{datetime.date.today().isoformat()}, {props.name} (sm_{props.major}{props.minor}), "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    )


def format_table(rows: list[Row]) -> str:
    head = (f"{'workload':<20} {'eager us':>10} {'hand graph us':>14} {'autograph us':>13} "
            f"{'eager/autograph':>16} {'autograph/hand':>15} {'autograph-hand us':>18}")
    lines = [head, "-" * len(head)]
    for r in rows:
        e, h, a = (r.times[k] * 1e6 for k in ("eager", "hand graph", "autograph"))
        lines.append(f"{r.workload:<20} {e:>10.1f} {h:>14.1f} {a:>13.1f} {e / a:>15.2f}x "
                     f"{a / h:>14.3f}x {a - h:>18.1f}")
        if "replay alone" in r.times:
            alone = r.times["replay alone"] * 1e6
            lines.append(f"{'  (replay alone)':<20} {'':>10} {alone:>14.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograph bench", description=__doc__)
    parser.add_argument("--iters", type=int, default=200, help="steps per timed sample")
    parser.add_argument("--rounds", type=int, default=15, help="timed samples per method")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8],
                        help="decode batch sizes")
    parser.add_argument("--layers", type=int, default=12, help="decoder layers")
    parser.add_argument("--variable", action="store_true",
                        help="also time a variable-batch run: buckets vs one graph per size")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("autograph bench: no CUDA device here, nothing to measure "
              "(autograph runs every call eagerly without CUDA).")
        return 0
    print(f"autograph bench: {environment()}", flush=True)
    rows = [bench_decode(b, args.iters, args.rounds, args.layers) for b in args.batch]
    rows.append(bench_mlp(args.iters * 5, args.rounds))
    print(format_table(rows))
    if args.variable:
        print(format_variable(bench_variable(rounds=args.rounds)))
    return 0
