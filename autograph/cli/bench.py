"""``python -m autograph bench``: autograph against eager, a hand-written CUDA graph,
``torch.compile(mode="reduce-overhead")`` and ``torch.cuda.make_graphed_callables``.

Workloads: a GPT-2-small-shaped decode step (static KV cache of 1024 positions written
in place) at each ``--batch``, a tiny 4-layer 256-wide MLP at batch 1 that shows the
per-call overhead, a variable-batch run (buckets against one graph per size), a
padded-bucket run (a call padded to its bucket against one of the bucket's size,
``bench_padded``), and,
where transformers is installed, ``generate()`` with a static cache (``bench_generate``).
The decode step also runs under ``verify_every=1000`` (the cost of verified replays) and
with ``outputs="reuse"`` (no clone of the output).
Every method gets the same inputs; its first three calls are timed together with its
setup (warmup and capture, or compilation), its outputs are checked against eager, and
the steady state is timed in rounds interleaved across methods (median microseconds per
step).  A method that fails or differs from eager is reported, never timed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from autograph import graphed, stats

from .cells import num, ratio
from .models import Decoder, mlp
from .peers import METHODS, Method, build

FIRST_CALLS = 3  # calls timed with the setup: autograph's two warmups and its capture
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Result:
    """One method on one workload."""

    workload: str
    batch: int
    method: str
    us_per_step: float | None  # median of the timed rounds; None if not timed
    first_calls_ms: float | None  # setup plus the first FIRST_CALLS calls
    note: str = ""


class Progress:
    """One line per stage on stderr, so a long run (compilation) shows where it is."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = time.perf_counter()

    def __call__(self, text: str) -> None:
        if self.enabled:
            print(f"[{time.perf_counter() - self.start:6.1f}s] {text}", file=sys.stderr,
                  flush=True)


def run_workload(workload: str, batch: int, model: torch.nn.Module,
                 inputs: Sequence[Sequence[torch.Tensor]],
                 persistent: Callable[[], list[torch.Tensor]], methods: Sequence[str],
                 rounds: int, tolerance: float, progress: Progress) -> list[Result]:
    """Set up, check and time every method on ``model(*inputs[i], *persistent())``."""
    results: dict[str, Result] = {}
    ready: dict[str, Method] = {}
    reference: list[Any] = []
    for name in methods:
        progress(f"{workload}: {name}: set-up and first calls")
        try:
            method, first, outs = _first_calls(name, model, inputs, persistent())
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            results[name] = Result(workload, batch, name, None, None,
                                   f"failed: {type(exc).__name__}: {text}"[:160])
            continue
        results[name] = Result(workload, batch, name, None, first * 1e3)
        if not reference:
            reference = outs
        elif not _close(outs, reference, tolerance):
            results[name].note = "WRONG: differs from eager; not timed"
            continue
        ready[name] = method
    progress(f"{workload}: timing {', '.join(ready)}")
    for name, seconds in _measure(ready, inputs, rounds).items():
        results[name].us_per_step = seconds * 1e6
    for name, method in ready.items():
        results[name].note = method.note()
    return [results[name] for name in methods]


def _first_calls(name: str, model: torch.nn.Module, inputs: Sequence[Sequence[torch.Tensor]],
                 persistent: list[torch.Tensor]) -> tuple[Method, float, list[Any]]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    method = build(name, model, inputs[0], persistent)
    # cloned at once: some methods hand out buffers that their next call overwrites
    outs = [method.step(*inputs[i]).clone() for i in range(FIRST_CALLS)]
    torch.cuda.synchronize()
    return method, time.perf_counter() - start, outs


def _close(outs: list[Any], reference: list[Any], tolerance: float) -> bool:
    try:
        for got, expect in zip(outs, reference):
            torch.testing.assert_close(got, expect, rtol=tolerance, atol=tolerance)
    except AssertionError:
        return False
    return True


def _measure(methods: dict[str, Method], inputs: Sequence[Sequence[torch.Tensor]],
             rounds: int) -> dict[str, float]:
    """Median seconds per step over ``rounds`` rounds, the methods interleaved."""
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for method in methods.values():
        for x in inputs[:4]:
            method.step(*x)
    for _ in range(rounds):
        for name, method in methods.items():
            step = method.step
            torch.cuda.synchronize()
            start = time.perf_counter()
            for x in inputs:
                step(*x)
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) / len(inputs))
    return {name: statistics.median(s) for name, s in samples.items()}


def bench_decode(batch: int, iters: int, rounds: int, methods: Sequence[str],
                 progress: Progress, layers: int = 12, width: int = 768, heads: int = 12,
                 dtype: torch.dtype = torch.float16) -> list[Result]:
    torch.manual_seed(0)
    model = Decoder(layers=layers, d=width, heads=heads).cuda().to(dtype).eval()
    vocab = model.lm_head.out_features
    inputs = [(torch.randint(0, vocab, (batch, 1), device="cuda"),
               torch.tensor([i % model.max_len], device="cuda")) for i in range(iters)]
    tolerance = 1e-3 if dtype == torch.float32 else 3e-2
    with torch.no_grad():
        return run_workload(f"decode B={batch}", batch, model, inputs,
                            lambda: list(model.new_cache(batch)), methods, rounds, tolerance,
                            progress)


def bench_mlp(iters: int, rounds: int, methods: Sequence[str], progress: Progress,
              dtype: torch.dtype = torch.float32) -> list[Result]:
    torch.manual_seed(0)
    model = mlp().cuda().to(dtype).eval()
    inputs = [(torch.randn(1, 256, device="cuda", dtype=dtype),) for _ in range(iters)]
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    with torch.no_grad():
        results = run_workload("MLP 4x256 B=1", 1, model, inputs, list, methods, rounds,
                               tolerance, progress)
    return results


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


def environment() -> dict[str, Any]:
    """The date and the plan fingerprint's fields: GPU, driver, CUDA, torch, autograph."""
    from autograph.plan import environment as fingerprint

    return {"date": datetime.date.today().isoformat(), **fingerprint()}


def format_table(results: list[Result]) -> str:
    """Per workload: each method's time, its ratio to eager and to the hand-written
    graph, and its first calls (set-up included)."""
    head = (f"{'workload':<14} {'method':<28} {'us/step':>9} {'eager/x':>8} "
            f"{'x/hand':>7} {'x-hand us':>9} {'first calls ms':>15}  note")
    lines = [head, "-" * len(head)]
    for workload in dict.fromkeys(r.workload for r in results):
        rows = [r for r in results if r.workload == workload]
        times = {r.method: r.us_per_step for r in rows}
        eager, hand = times.get("eager"), times.get("hand-graph")
        for r in rows:
            t = r.us_per_step
            lines.append(
                f"{workload:<14} {r.method:<28} {num(t, '9.1f')} "
                f"{ratio(eager, t):>8} {ratio(t, hand, 3):>7} "
                f"{num(t - hand if t is not None and hand else None, '9.1f')} "
                f"{num(r.first_calls_ms, '15.1f')}  {r.note}".rstrip())
    return "\n".join(lines)


def plot(results: list[Result], path: str, title: str) -> None:
    """Decode latency per batch size for each method (needs matplotlib: the ``plot``
    extra)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("autograph bench: --plot needs matplotlib "
                         "(pip install matplotlib: the 'plot' extra of torch-autograph)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    decode = [r for r in results if r.workload.startswith("decode")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r.method for r in decode):
        points = sorted((r.batch, r.us_per_step / 1e3) for r in decode
                        if r.method == method and r.us_per_step is not None)
        if points:
            ax.plot(*zip(*points), marker="o", label=method)
    ax.set_xlabel("batch size")
    ax.set_ylabel("ms per decode step (median)")
    ax.set_yscale("log")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


NO_CUDA = ("no CUDA device here, nothing to measure (autograph runs every call eagerly "
           "without CUDA)")


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograph bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=positive_int, default=200,
                        help="steps per timed sample (default 200; the MLP takes 5x as many)")
    parser.add_argument("--rounds", type=positive_int, default=15,
                        help="timed samples per method (default 15)")
    parser.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8],
                        help="decode batch sizes (default: 1 8)")
    parser.add_argument("--layers", type=positive_int, default=12,
                        help="decoder layers (default 12)")
    parser.add_argument("--width", type=positive_int, default=768,
                        help="decoder width (default 768)")
    parser.add_argument("--heads", type=positive_int, default=12,
                        help="attention heads (default 12)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16",
                        help="decoder dtype (default fp16; the MLP is fp32)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        metavar="METHOD", help=f"methods to run (default: all of {METHODS})")
    parser.add_argument("--no-variable", dest="variable", action="store_false",
                        help="skip the variable-batch and padded-bucket runs")
    parser.add_argument("--no-generate", dest="generate", action="store_false",
                        help="skip the transformers generate() workload (it runs only where "
                        "transformers is installed; the compiled path takes about 15 s)")
    parser.add_argument("--no-train", dest="train", action="store_false",
                        help="skip the training-step workload (bench_train)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON "
                        "('-' for standard output, replacing the tables)")
    parser.add_argument("--plot", metavar="PNG", help="draw decode latency per batch size "
                        "for each method (needs matplotlib)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    if args.width % args.heads:
        parser.error(f"--width {args.width} must be a multiple of --heads {args.heads}")
    if args.json not in (None, "-") and not os.path.isdir(os.path.dirname(
            os.path.abspath(args.json))):  # known before the run, not after it
        parser.error(f"--json {args.json}: its folder does not exist")
    env = environment()
    to_stdout = args.json == "-"
    if not torch.cuda.is_available():
        # standard output carries the JSON alone with --json -; the sentence goes to stderr
        print(f"autograph bench: {NO_CUDA}.", file=sys.stderr if to_stdout else sys.stdout)
        if args.json:
            write_json(args.json, {"cuda": False, "reason": NO_CUDA, "environment": env,
                                   "options": vars(args), "results": [], "variable": [],
                                   "train": [], "padded": []})
        if args.plot:
            print("autograph bench: --plot: nothing measured, nothing drawn", file=sys.stderr)
        return 0
    methods = ["eager"] + [m for m in args.methods if m != "eager"]  # eager is the reference
    def say(*text: str, flush: bool = False) -> None:
        if not to_stdout:  # with --json -, standard output carries the JSON alone
            print(*text, flush=flush)

    say("autograph bench: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    progress = Progress(not args.quiet)
    results: list[Result] = []
    for b in args.batch:
        results += bench_decode(b, args.iters, args.rounds, methods, progress, args.layers,
                                args.width, args.heads, DTYPES[args.dtype])
    results += bench_mlp(args.iters * 5, args.rounds, methods, progress)
    say(format_table(results), flush=True)
    variable: list[VariableRow] = []
    if args.variable:
        progress("variable batch: eager, buckets, one graph per size")
        variable = bench_variable(rounds=args.rounds)
        say(format_variable(variable))
    padded = _padded(args, progress, say)
    train: list[Any] = []
    if args.train:
        from . import bench_train

        train = bench_train.bench_train(rounds=args.rounds, progress=progress)
        say(bench_train.format_train(train), flush=True)
    generate: list[Any] = []
    if args.generate:
        generate = _generate(progress, say)
    if args.json:
        write_json(args.json, {"cuda": True, "environment": env, "options": vars(args),
                               "results": [asdict(r) for r in results],
                               "variable": [asdict(r) for r in variable],
                               "train": [asdict(r) for r in train],
                               "padded": [asdict(r) for r in padded],
                               "generate": [asdict(r) for r in generate]})
    if args.plot:
        plot(results, args.plot, f"autograph bench, {env['date']}: {env['gpu_name']} "
             f"({env['gpu_arch']}), torch {env['torch']}, CUDA {env['cuda_runtime']}")
    return 0


def _padded(args: argparse.Namespace, progress: Progress, say: Callable[..., None]
            ) -> list[Any]:
    """The padded-bucket rows (``bench_padded``), with the variable-batch run."""
    if not args.variable:
        return []
    from .bench_padded import bench_padded, format_padded

    progress("padded bucket: exact-size replay, padded call, hand-written graph")
    rows = bench_padded(calls=args.iters * 5, rounds=args.rounds)
    say(format_padded(rows))
    return rows


def _generate(progress: Progress, say: Callable[..., None]) -> list[Any]:
    """The transformers workload, or a line saying why it is skipped."""
    from . import bench_generate as gen

    why = gen.available()
    if why is not None:
        say(f"generate workload skipped: {why}")
        return []
    progress("generate: Llama-shaped, 4 layers, hidden 512, fp16, batch 1, static cache")
    rows = gen.bench_generate(progress=progress)
    say(gen.format_generate(rows, "generate, 128 new tokens (Llama 4L/512 fp16 b1)"))
    return rows


def write_json(path: str, payload: dict[str, Any]) -> None:
    """``payload`` as JSON to ``path``, or to standard output for ``-``."""
    text = json.dumps(payload, indent=2)
    if path == "-":
        print(text, flush=True)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
