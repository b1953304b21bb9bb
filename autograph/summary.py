"""``autograph.report()``: the counters of ``stats()`` as a table a person can read."""

from __future__ import annotations

from typing import Any

from .vocab import EagerReason

COLUMNS = ("calls", "replays", "hit rate", "captures", "eager", "graphs", "graph MiB",
           "capture s", "padding")


def format_report(stats: dict[str, dict[str, Any]]) -> str:
    """One row per graphed callable, then its eager runs by reason and its buckets."""
    if not stats:
        return "autograph: no graphed callables yet"
    name_width = max(len("callable"), *(len(n) for n in stats))
    head = f"{'callable':<{name_width}} " + " ".join(f"{c:>9}" for c in COLUMNS)
    lines = [head, "-" * len(head)]
    for name, s in stats.items():
        cells = [s["calls"], s["replays"], _percent(s["replays"], s["calls"]), s["captures"],
                 s["eager"], s["graphs"], f"{s['graph_memory_bytes'] / 2**20:.1f}",
                 f"{s['capture_seconds']:.2f}", _waste(s["buckets"])]
        lines.append(f"{name:<{name_width}} " + " ".join(f"{c!s:>9}" for c in cells))
        for reason, count in sorted(s["eager_reasons"].items(), key=lambda kv: -kv[1]):
            details = s.get("eager_details", {}).get(reason, {})
            text = _message(reason) + (f" ({'; '.join(details)})" if details else "")
            lines.append(f"    eager {count:>7}x  [{reason}] {text}")
        if s["buckets"]:
            buckets = ", ".join(f"{size}: {b['hits']} hits" for size, b in s["buckets"].items())
            lines.append(f"    buckets   {buckets}; {s['bucket_misses']} larger than the largest")
        if s["padding"]:
            lines.append(f"    {s['padding']}")
    return "\n".join(lines)


def _message(reason: str) -> str:
    try:
        return EagerReason(reason).message
    except ValueError:
        return reason


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _waste(buckets: dict[int, dict[str, int]]) -> str:
    """Padded rows per real row served by buckets."""
    real = sum(b["real_rows"] for b in buckets.values())
    padded = sum(b["padded_rows"] for b in buckets.values())
    return _percent(padded, real) if real else "-"
