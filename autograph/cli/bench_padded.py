"""The padded-bucket rows of ``python -m autograph bench``: what a call padded up to its
bucket costs against a replay of the bucket's own size, on one model.

A 4-layer MLP graphed with ``buckets=[8]`` is called with 8 rows (the bucket's size: the
rows are copied into the bucket's buffers and the graph replays) and with 7 rows
(padded to 8: the same graph), next to a hand-written CUDA graph of the model at batch 8
(copy in, replay, clone out) and eager at 7 rows.  Outputs are checked against eager;
times are medians of rounds interleaved across the rows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autograph import graphed, stats

from .models import mlp

BUCKET = 8


@dataclass
class PaddedRow:
    method: str
    rows: int  # real rows of the call
    us_per_call: float
    note: str = ""


def bench_padded(calls: int = 1000, rounds: int = 15, device: str = "cuda",
                 width: int = 256) -> list[PaddedRow]:
    torch.manual_seed(0)
    model = mlp(width).to(device).eval()
    bucketed = graphed(model, buckets=[BUCKET])
    xs = {n: [torch.randn(n, width, device=device) for _ in range(8)] for n in (BUCKET - 1,
                                                                              BUCKET)}
    methods: dict[str, tuple[Callable[[torch.Tensor], Any], int]] = {
        "eager": (model, BUCKET - 1),
        f"autograph exact ({BUCKET} rows)": (bucketed, BUCKET),
        f"autograph padded ({BUCKET - 1} rows)": (bucketed, BUCKET - 1),
    }
    if device.startswith("cuda"):
        methods = {f"hand-graph ({BUCKET} rows)": (_hand(model, xs[BUCKET][0]), BUCKET),
                   **methods}
    with torch.no_grad():
        for name, (fn, n) in methods.items():  # warm, capture, and check against eager
            for x in xs[n] * 2:
                got, want = fn(x), model(x)
                if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                    raise AssertionError(f"bench padded: {name} differs from eager")
        samples: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(rounds):
            for name, (fn, n) in methods.items():
                inputs = xs[n]
                _sync(device)
                start = time.perf_counter()
                for i in range(calls):
                    fn(inputs[i % 8])
                _sync(device)
                samples[name].append((time.perf_counter() - start) / calls)
    s = stats(bucketed)
    note = f"graphs {s['graphs']}, padding {s['padding'] or 'on'}"
    return [PaddedRow(name, n, statistics.median(samples[name]) * 1e6,
                      note if "autograph" in name else "")
            for name, (_, n) in methods.items()]


def _hand(model: torch.nn.Module, example: torch.Tensor) -> Callable[[torch.Tensor], Any]:
    from .peers import build

    return build("hand-graph", model, [example], []).step


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def format_padded(rows: list[PaddedRow]) -> str:
    """The rows, each with its difference to the exact-size replay and to the hand graph."""
    head = (f"{f'padded bucket (MLP, bucket {BUCKET})':<30} {'us/call':>9} "
            f"{'-exact us':>10} {'-hand us':>9}  note")
    lines = [head, "-" * len(head)]
    by = {r.method.split(" (")[0]: r.us_per_call for r in rows}
    exact, hand = by.get("autograph exact"), by.get("hand-graph")
    for r in rows:
        d_exact = f"{r.us_per_call - exact:+10.1f}" if exact is not None else f"{'-':>10}"
        d_hand = f"{r.us_per_call - hand:+9.1f}" if hand is not None else f"{'-':>9}"
        lines.append(f"{r.method:<30} {r.us_per_call:>9.1f} {d_exact} {d_hand}  "
                     f"{r.note}".rstrip())
    return "\n".join(lines)
