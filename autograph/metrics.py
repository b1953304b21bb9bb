"""Prometheus metrics: a collector that reads ``autograph.stats()`` at scrape time.

Nothing is counted twice and nothing runs per call: each scrape turns the live
counters into metric families labelled by callable.  ``prometheus-client`` is an
optional extra (``pip install 'torch-autograph[prometheus]'`` or
``pip install prometheus-client``); it is imported only here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .stats import collect as _collect

_COUNTERS = (
    ("calls", "calls", "Calls of the graphed callable"),
    ("replays", "replays", "Calls served by replaying a graph"),
    ("captures", "captures", "Graphs captured"),
    ("capture_seconds", "capture_seconds", "Seconds spent capturing graphs"),
    ("evictions", "evictions", "Graphs freed to stay within max_graphs or max_graph_memory"),
    ("invalidations", "invalidations", "Times module state changed and graphs were dropped"),
    ("bucket_misses", "bucket_misses", "Calls larger than the largest bucket"),
    ("verifications", "verifications", "Replays checked against eager (verify_every)"),
    ("verify_failures", "verify_failures", "Checked replays that differed from eager"),
    ("outputs_protected", "outputs_protected",
     "Calls run eagerly because an earlier reused output was still held"),
    ("backward_replays", "backward_replays", "Backwards served by replaying a backward graph"),
    ("backward_captures", "backward_captures", "Backward graphs captured"),
    ("backward_spills", "backward_spills",
     "Saved states of pending backwards copied out before a replay overwrote them"),
)
_GAUGES = (
    ("graphs", "graphs", "Live graphs"),
    ("graph_memory_bytes", "graph_memory_bytes", "Graph memory measured at capture, in bytes"),
)


class Collector:
    """A ``prometheus_client`` collector of every live graphed callable's counters."""

    def __init__(self, prefix: str = "autograph") -> None:
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshot = _collect()
        p = self.prefix
        for key, name, text in _COUNTERS:
            family = CounterMetricFamily(f"{p}_{name}", text, labels=["callable"])
            for callable_name, s in snapshot.items():
                family.add_metric([callable_name], s[key])
            yield family
        for key, name, text in _GAUGES:
            gauge = GaugeMetricFamily(f"{p}_{name}", text, labels=["callable"])
            for callable_name, s in snapshot.items():
                gauge.add_metric([callable_name], s[key])
            yield gauge
        eager = CounterMetricFamily(f"{p}_eager", "Calls run eagerly, by reason",
                                    labels=["callable", "reason"])
        rows = CounterMetricFamily(f"{p}_bucket_rows", "Rows served by each bucket, real "
                                   "or padding", labels=["callable", "bucket", "kind"])
        for callable_name, s in snapshot.items():
            for reason, count in s["eager_reasons"].items():
                eager.add_metric([callable_name, reason], count)
            for size, b in s["buckets"].items():
                rows.add_metric([callable_name, str(size), "real"], b["real_rows"])
                rows.add_metric([callable_name, str(size), "padded"], b["padded_rows"])
        yield eager
        yield rows


def register(registry: Any = None, prefix: str = "autograph") -> Collector:
    try:
        import prometheus_client
    except ImportError:
        raise ImportError("autograph.register_prometheus needs prometheus-client: "
                          "pip install 'torch-autograph[prometheus]' (or prometheus-client)"
                          ) from None
    collector = Collector(prefix)
    (registry if registry is not None else prometheus_client.REGISTRY).register(collector)
    return collector
