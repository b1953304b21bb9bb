"""Counters for every graphed callable, and the registry behind ``autograph.stats()``.

Counters are plain integers bumped on the call path; ``Stats.snapshot()`` turns them
into the dictionary users see.  The registry holds its callables weakly, so a module
that is garbage collected disappears from ``stats()`` together with its graphs.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import Counter
from typing import Any

logger = logging.getLogger("autograph")

_registry_lock = threading.Lock()
_registry: weakref.WeakValueDictionary[int, Stats] = weakref.WeakValueDictionary()
_order = itertools.count()
_names: Counter[str] = Counter()


class Stats:
    """What happened to one graphed callable.

    ``calls`` = ``replays`` + ``captures`` + ``eager``: every call either replays a
    graph, captures one (and replays it to produce its result), or runs eagerly for
    the reason counted in ``eager_reasons``.
    """

    __slots__ = (
        "name",
        "calls",
        "replays",
        "captures",
        "eager",
        "eager_reasons",
        "capture_seconds",
        "graph_bytes",
        "graphs",
        "evictions",
        "invalidations",
        "last_reason",
        "buckets",
        "bucket_misses",
        "padding",
        "_warned",
        "__weakref__",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0
        self.replays = 0
        self.captures = 0
        self.eager = 0
        self.eager_reasons: Counter[str] = Counter()
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        self.graphs = 0
        self.evictions = 0
        self.invalidations = 0
        self.last_reason = ""
        self.buckets: dict[int, dict[str, int]] = {}
        self.bucket_misses = 0
        self.padding: str | None = None
        self._warned: set[str] = set()

    def count_eager(self, reason: str, *, warn: bool = True) -> None:
        """Count one eager call; log each new reason once at WARNING."""
        self.eager += 1
        self.eager_reasons[reason] += 1
        self.last_reason = reason
        if warn and reason not in self._warned:
            self._warned.add(reason)
            logger.warning("%s: running eagerly: %s", self.name, reason)

    def count_bucket(self, size: int, rows: int, eager: bool) -> None:
        """One call served by bucket ``size`` with ``rows`` real rows."""
        b = self.buckets.get(size)
        if b is None:
            b = self.buckets[size] = {"hits": 0, "real_rows": 0, "padded_rows": 0, "eager": 0}
        b["hits"] += 1
        b["real_rows"] += rows
        b["padded_rows"] += size - rows
        b["eager"] += eager

    def snapshot(self) -> dict[str, Any]:
        """The counters as a plain dictionary (a copy)."""
        return {
            "calls": self.calls,
            "replays": self.replays,
            "captures": self.captures,
            "eager": self.eager,
            "eager_reasons": dict(self.eager_reasons),
            "graphs": self.graphs,
            "graph_memory_bytes": self.graph_bytes,
            "capture_seconds": self.capture_seconds,
            "evictions": self.evictions,
            "invalidations": self.invalidations,
            "buckets": {size: dict(b) for size, b in sorted(self.buckets.items())},
            "bucket_misses": self.bucket_misses,
            "padding": self.padding,
        }


def register(base_name: str) -> Stats:
    """Create the counters of a new graphed callable under a unique readable name.

    The first callable of a name keeps it; later ones get ``name#2``, ``name#3``...
    The caller must keep the returned object alive for as long as it should be listed.
    """
    with _registry_lock:
        _names[base_name] += 1
        n = _names[base_name]
        stats = Stats(base_name if n == 1 else f"{base_name}#{n}")
        _registry[next(_order)] = stats
    return stats


def collect() -> dict[str, dict[str, Any]]:
    """Snapshots of every live graphed callable, in creation order."""
    with _registry_lock:
        items = sorted(_registry.items())
    return {s.name: s.snapshot() for _, s in items}
