"""The training workload of ``python -m autograph bench``: one optimizer step of a small
policy MLP (64 in, three 256-wide layers, 16 out, fp32) per step: ``zero_grad``,
forward, MSE loss, backward, ``AdamW`` step (``fused=True`` where torch has it for
CUDA, else ``foreach=True``), at batch 1 and 32.

Methods: eager, autograph (``graphed(model)``, and with ``outputs="reuse"``: the output
not copied), autograph step (the whole step graphed: ``graphed(step)``, with
``capturable=True``), ``torch.cuda.make_graphed_callables`` (``model`` with one sample)
and ``torch.compile(model, mode="reduce-overhead")``, each on its own copy of the same
initial weights, fed the same batches.  Per method: the set-up and the first three
steps (timed together), then more steps whose losses are compared with eager's (within
``tolerance``; a method that differs is not timed), then the median milliseconds per
step over rounds interleaved across methods.

    python -m autograph.cli.bench_train [--batch 1 32] [--rounds 15] [--steps 200]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

import autograph

from .cells import num, ratio

METHODS = ("eager", "autograph", "autograph outputs=reuse", "autograph step",
           "make_graphed_callables", "torch.compile")
FIRST_STEPS = 3  # timed with the set-up
CHECK_STEPS = 8  # losses compared with eager's (the first steps included)


@dataclass
class TrainRow:
    """One method at one batch size."""

    batch: int
    method: str
    ms_per_step: float | None  # median over the rounds; None if not timed
    first_ms: float | None  # set-up plus the first FIRST_STEPS steps
    max_loss_diff: float | None  # against eager, over the first CHECK_STEPS steps
    optimizer: str
    note: str = ""


def policy(inputs: int = 64, width: int = 256, outputs: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, width),
                         nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, outputs))


def optimizer_for(params: Any, capturable: bool = False) -> tuple[torch.optim.Optimizer, str]:
    """AdamW, fused where this torch supports it on CUDA, else foreach; ``capturable``
    (its step count on the device) for a step captured in a graph."""
    params = list(params)
    extra = " capturable" if capturable else ""
    try:
        return (torch.optim.AdamW(params, lr=1e-4, fused=True, capturable=capturable),
                "AdamW fused" + extra)
    except (RuntimeError, TypeError, ValueError):
        return (torch.optim.AdamW(params, lr=1e-4, foreach=True, capturable=capturable),
                "AdamW foreach" + extra)


def _wrap(name: str, model: nn.Module, sample: torch.Tensor
          ) -> tuple[Callable[[torch.Tensor], Any], Callable[[], str]]:
    """The forward of ``model`` as method ``name`` runs it, and a note for the table."""
    if name == "eager":
        return model, lambda: ""
    if name in ("autograph", "autograph outputs=reuse"):
        fast = autograph.graphed(model, outputs="reuse" if "reuse" in name else "clone")

        def note() -> str:
            s = autograph.stats(fast)
            return (f"fwd replays {s['replays']}, bwd replays {s['backward_replays']} "
                    f"(graphs {s['backward_captures']}), "
                    f"eager {s['eager']} {dict(s['eager_reasons'])}, "
                    f"spills {s['backward_spills']}")

        return fast, note
    if name == "make_graphed_callables":
        return torch.cuda.make_graphed_callables(model, (sample,)), lambda: ""
    if name == "torch.compile":
        compiled = torch.compile(model, mode="reduce-overhead")
        mark = getattr(torch.compiler, "cudagraph_mark_step_begin", None)
        if mark is None:
            return compiled, lambda: ""

        def step(x: torch.Tensor) -> Any:
            mark()
            return compiled(x)

        return step, lambda: ""
    raise ValueError(f"unknown method {name!r}")


class Trainer:
    """One method's model, optimizer and step ("autograph step": the step graphed)."""

    def __init__(self, name: str, base: nn.Module, sample: torch.Tensor) -> None:
        self.model = copy.deepcopy(base)
        whole = name == "autograph step"
        self.forward, self.note = _wrap("eager" if whole else name, self.model, sample)
        self.opt, self.optimizer = optimizer_for(self.model.parameters(), capturable=whole)
        self.step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self._step
        if whole:
            graphed_step = self.step = autograph.graphed(self._step)

            def note() -> str:
                s = autograph.stats(graphed_step)
                return f"replays {s['replays']}, eager {s['eager']} {dict(s['eager_reasons'])}"

            self.note = note

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.forward(x), y)
        loss.backward()
        self.opt.step()
        return loss.detach()


def bench_batch(batch: int, steps: int, rounds: int, methods: Sequence[str],
                tolerance: float = 1e-3, progress: Callable[[str], None] = lambda _: None
                ) -> list[TrainRow]:
    torch.manual_seed(0)
    base = policy().cuda()
    data = [(torch.randn(batch, 64, device="cuda"), torch.randn(batch, 16, device="cuda"))
            for _ in range(max(steps, CHECK_STEPS))]
    rows: dict[str, TrainRow] = {}
    ready: dict[str, Trainer] = {}
    reference: list[torch.Tensor] = []
    for name in methods:
        progress(f"train b{batch}: {name}: set-up and first steps")
        try:
            torch.cuda.synchronize()
            start = time.perf_counter()
            trainer = Trainer(name, base, data[0][0].clone())  # mgc keeps its sample
            losses = [trainer.step(*data[i]) for i in range(FIRST_STEPS)]
            torch.cuda.synchronize()
            first = (time.perf_counter() - start) * 1e3
            losses += [trainer.step(*data[i]) for i in range(FIRST_STEPS, CHECK_STEPS)]
        except Exception as exc:  # noqa: BLE001 - a method that cannot run is reported
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            rows[name] = TrainRow(batch, name, None, None, None, "",
                                  f"failed: {type(exc).__name__}: {text}"[:160])
            continue
        got = torch.stack(losses)
        if not reference:
            reference = [got]
        diff = float((got - reference[0]).abs().max())
        rows[name] = TrainRow(batch, name, None, first, diff, trainer.optimizer)
        if not torch.allclose(got, reference[0], rtol=tolerance, atol=tolerance):
            rows[name].note = "WRONG: losses differ from eager's; not timed"
            continue
        ready[name] = trainer
    progress(f"train b{batch}: timing {', '.join(ready)}")
    samples: dict[str, list[float]] = {name: [] for name in ready}
    for _ in range(rounds):
        for name, trainer in ready.items():
            step = trainer.step
            torch.cuda.synchronize()
            start = time.perf_counter()
            for x, y in data[:steps]:
                step(x, y)
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) / steps * 1e3)
    for name, trainer in ready.items():
        rows[name].ms_per_step = statistics.median(samples[name])
        rows[name].note = trainer.note()
    return [rows[name] for name in methods]


def bench_train(batches: Sequence[int] = (1, 32), steps: int = 200, rounds: int = 15,
                methods: Sequence[str] = METHODS,
                progress: Callable[[str], None] = lambda _: None) -> list[TrainRow]:
    """Every batch size in a process of its own: on the H200 (torch 2.11) a process
    running every method at batch 32 has died of an illegal memory access (see
    docs/usage.md, "Known problem"); if one dies, its methods run again, each beside
    eager in a process of its own (``_pairwise``), so the table still has them."""
    if len(batches) == 1:
        return bench_batch(batches[0], steps, rounds, methods, progress=progress)
    rows: list[TrainRow] = []
    for b in batches:
        got, code = _in_process(b, steps, rounds, methods)
        if got is None:  # the process died: each method again, beside eager, on its own
            got = _pairwise(b, steps, rounds, methods, code)
        rows += got
    return rows


def _in_process(batch: int, steps: int, rounds: int, methods: Sequence[str]
                ) -> tuple[list[TrainRow] | None, int]:
    """``bench_batch`` in a new process: its rows, or None and the exit code."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "autograph.cli.bench_train", "--batch", str(batch),
               "--steps", str(steps), "--rounds", str(rounds), "--json", path,
               "--methods", *methods]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, check=False)
        if done.returncode or not os.path.exists(path):
            return None, done.returncode
        with open(path, encoding="utf-8") as f:
            return [TrainRow(**r) for r in json.load(f)], 0


def _pairwise(batch: int, steps: int, rounds: int, methods: Sequence[str], code: int
              ) -> list[TrainRow]:
    """After the process running every method died (exit ``code``): eager and each other
    method in a process of their own, so a crash is pinned to the methods it needs."""
    rows: dict[str, TrainRow] = {}
    for name in [m for m in methods if m != "eager"] or ["eager"]:
        pair = ["eager", name] if name != "eager" else ["eager"]
        got, pair_code = _in_process(batch, steps, rounds, pair)
        for row in got or [TrainRow(batch, m, None, None, None, "", "") for m in pair]:
            if got is None:
                row.note = f"failed: exited with {pair_code} beside eager alone"
            else:
                row.note = ", ".join(x for x in (row.note, "timed beside eager alone") if x)
            if (row.method == name or row.method not in rows
                    or rows[row.method].ms_per_step is None):
                rows[row.method] = row
    note = f"all methods in one process exited with {code}"
    for row in rows.values():
        row.note = f"{row.note}; {note}" if row.note else note
    return [rows[m] for m in methods if m in rows]


def format_train(rows: list[TrainRow]) -> str:
    head = (f"{'train step':<11} {'method':<24} {'ms/step':>8} {'eager/x':>8} "
            f"{'x/mgc':>6} {'first ms':>9} {'loss diff':>9}  optimizer, note")
    lines = [head, "-" * len(head)]
    for b in dict.fromkeys(r.batch for r in rows):
        group = [r for r in rows if r.batch == b]
        times = {r.method: r.ms_per_step for r in group}
        eager, mgc = times.get("eager"), times.get("make_graphed_callables")
        for r in group:
            t = r.ms_per_step
            vs = f"{t / mgc:.3f}" if mgc and t else "-"
            lines.append(
                f"{'b' + str(b):<11} {r.method:<24} {num(t, '8.3f')} {ratio(eager, t):>8} {vs:>6} "
                f"{num(r.first_ms, '9.1f')} {num(r.max_loss_diff, '9.1e')}  "
                f"{', '.join(x for x in (r.optimizer, r.note) if x)}".rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograph.cli.bench_train",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=200, help="steps per timed sample")
    parser.add_argument("--rounds", type=int, default=15, help="timed samples per method")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("autograph bench: training workload skipped: no CUDA device")
        return 0
    methods = ["eager"] + [m for m in args.methods if m != "eager"]
    rows = bench_train(args.batch, args.steps, args.rounds, methods,
                       progress=lambda text: print(text, file=sys.stderr, flush=True))
    print(format_train(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
