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
from collections.abc import Callable
from typing import Any

from .vocab import QUIET, EagerReason

_QUIET = frozenset(reason.value for reason in QUIET)  # by identifier: str hashes in C

logger = logging.getLogger("autograph")
MAX_DETAILS = 8  # distinct details kept per reason (the newest replace the oldest)

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
        "eager_details",
        "verifications",
        "verify_failures",
        "outputs_protected",
        "backward_replays",
        "backward_eager",
        "backward_captures",
        "backward_spills",
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
        self.eager_details: dict[str, dict[str, int]] = {}
        self.verifications = 0
        self.verify_failures = 0
        self.outputs_protected = 0  # calls run eagerly to keep a held output intact
        self.backward_replays = 0  # backwards of training graphs served by a replay
        self.backward_eager = 0  # ... by the captured forward's autograd graph, eagerly
        self.backward_captures = 0  # backward graphs captured
        self.backward_spills = 0  # saved states copied out before a replay overwrote them
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        self.graphs = 0
        self.evictions = 0
        self.invalidations = 0
        self.last_reason: EagerReason | None = None
        self.buckets: dict[int, dict[str, int]] = {}
        self.bucket_misses = 0
        self.padding: str | None = None
        self._warned: set[tuple[str, str]] = set()

    def count_eager(self, reason: EagerReason, detail: str = "", *, warn: bool = True) -> None:
        """Count one eager call; log each new reason (and detail) once at WARNING."""
        self.eager += 1  # (Python-level in enum): the grad-mode eager path runs this
        value = self._note(reason, detail, warn)
        if _observers:
            _notify(self, value)

    def _note(self, reason: EagerReason, detail: str, warn: bool) -> str:
        """Count ``reason`` (and ``detail``) for one eager call, logging each new one
        once; the reason's value."""
        value = reason._value_  # not ``.value`` (a descriptor) nor the member's hash
        self.eager_reasons[value] += 1
        self.last_reason = reason
        if detail:
            details = self.eager_details.setdefault(value, {})
            if detail not in details and len(details) >= MAX_DETAILS:
                del details[next(iter(details))]
            details[detail] = details.get(detail, 0) + 1
        if warn and value not in _QUIET and (value, detail) not in self._warned:
            if len(self._warned) < 256:
                self._warned.add((value, detail))
                text = f"{reason.message}: {detail}" if detail else reason.message
                logger.warning("%s: running eagerly [%s]: %s", self.name, value, text)
        return value

    def reclassify(self, reason: EagerReason, detail: str = "") -> None:
        """The call just counted as a warmup ran eagerly for ``reason`` instead (its
        warmup found it: module backward hooks, which it learns again next call)."""
        warmup = EagerReason.WARMUP._value_
        if self.eager_reasons.get(warmup, 0) <= 0:
            return
        self.eager_reasons[warmup] -= 1
        if not self.eager_reasons[warmup]:
            del self.eager_reasons[warmup]
        self._note(reason, detail, warn=True)  # a region was told of this call already

    def count_replay(self) -> None:
        self.replays += 1
        if _observers:
            _notify(self, "replay")

    def notify(self, what: str) -> None:
        """Tell this thread's observer (a region) what a call did."""
        _notify(self, what)

    def count_capture(self) -> None:
        """Tell observers of a capture (``captures`` itself is counted by the engine)."""
        if _observers:
            _notify(self, "capture")

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
            "eager_details": {r: dict(d) for r, d in self.eager_details.items()},
            "verifications": self.verifications,
            "verify_failures": self.verify_failures,
            "outputs_protected": self.outputs_protected,
            "backward_replays": self.backward_replays,
            "backward_eager": self.backward_eager,
            "backward_captures": self.backward_captures,
            "backward_spills": self.backward_spills,
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


# -- observers: who wants to hear what one call did (a region counts its own calls) ---
_observers = 0  # observers set in any thread; the call path checks this int only
_local = threading.local()
# what one call did: "replay", "capture", or an eager reason's value
Observer = Callable[[Stats, str], None]


def _notify(stats: Stats, what: str) -> None:
    observer = getattr(_local, "observer", None)
    if observer is not None:
        observer(stats, what)


class observing:  # noqa: N801 - used like a function
    """Within the block, what this thread's calls do ("replay", "capture", or an eager
    reason's value) is also reported to ``observer``."""

    __slots__ = ("observer", "previous")

    def __init__(self, observer: Observer) -> None:
        self.observer = observer

    def __enter__(self) -> None:
        global _observers
        self.previous = getattr(_local, "observer", None)
        _local.observer = self.observer
        with _registry_lock:
            _observers += 1

    def __exit__(self, *exc: object) -> None:
        global _observers
        _local.observer = self.previous
        with _registry_lock:
            _observers -= 1
