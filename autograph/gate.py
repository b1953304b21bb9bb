"""The cost gate (``min_speedup``): keep a graph only if it pays.

Eager is timed on a key's warmup runs (synchronized wall clock, the fastest run); the
graph on its first :data:`TRIALS` replays.  A graph that is not ``min_speedup`` times
faster is freed, and its key runs eagerly from then on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .cache import Entry, GraphCache
from .replay import HELD
from .vocab import EagerReason, State, logger

TRIALS = 3  # timed replays of a new graph (the first launch, at capture, is not one)


def trial(cache: GraphCache, entry: Entry, run: Callable[[Any], Any],
          min_speedup: float, name: str) -> Callable[[Any], Any]:
    """``run``, timed on its first TRIALS calls; then the graph is judged."""
    samples: list[float] = []
    captured = entry.graph

    def timed(leaves: Any) -> Any:
        captured.synchronize()
        start = time.perf_counter()
        out = run(leaves)
        if out is HELD:  # no replay ran (an earlier output or backward held): no sample
            return out
        captured.synchronize()
        samples.append(time.perf_counter() - start)
        if len(samples) >= TRIALS:
            judge(cache, entry, timed, run, min(samples), min_speedup, name)
        return out

    return timed


def judge(cache: GraphCache, entry: Entry, timed: Callable[[Any], Any],
          run: Callable[[Any], Any], replay_s: float, min_speedup: float, name: str) -> None:
    """Keep the graph if it beats eager by ``min_speedup``; else the key runs eagerly."""
    speedup = entry.eager_s / max(replay_s, 1e-9)
    with cache.lock:
        if entry.run is not timed or entry.state is not State.READY:  # judged or dropped
            return
        entry.speedup = speedup
        if speedup >= min_speedup:
            entry.run = run
            return
        cache.forget_graph(entry)
        entry.give_up(EagerReason.NOT_WORTH, f"{speedup:.2f}x < {min_speedup:.2f}")
    logger.info("%s: graph replays in %.1f us, eager runs in %.1f us (%.2fx < "
                "min_speedup %.2f): this key runs eagerly", name, replay_s * 1e6,
                entry.eager_s * 1e6, speedup, min_speedup)
