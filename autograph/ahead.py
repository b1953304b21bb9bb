"""``autograph.warmup()``: capture graphs ahead of traffic.

Capturing costs milliseconds to seconds per graph; a server would rather pay it at
start than on its first requests.  ``warmup`` drives a graphed callable through its
ordinary call path with example arguments until each wanted key is captured, largest
first (smaller graphs then reuse the pool memory of larger ones), and reports what
each capture cost.  With a plan saved by :func:`autograph.save_plan`, it first checks
the plan's fingerprints against this process and captures the recorded keys only if
every field matches, each under the grad, inference and autocast modes it recorded
(``keymodes.py``).
"""

from __future__ import annotations

import logging
import math
import os
import struct
from collections.abc import Sequence
from typing import Any

import torch

from . import keymodes
from . import plan as _plan
from .buckets import Bucketer
from .dispatch import Engine
from .engines import Handle
from .padding import empty_in_layout
from .stats import Stats
from .vocab import EagerReason

logger = logging.getLogger("autograph")


def warmup(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], handle: Handle,
           batch_sizes: Sequence[int] | None,
           plan: str | os.PathLike[str] | None) -> list[dict[str, Any]]:
    """Capture ``fn`` for the example call, at each batch size, and from the plan."""
    engine = handle.engine
    bucketer = handle.call if isinstance(handle.call, Bucketer) else None
    if batch_sizes is not None:
        _check_sizes(batch_sizes, bucketer, engine.stats.name)
    report: list[dict[str, Any]] = []
    if plan is not None:
        report += _from_plan(fn, args, engine, plan)
    sizes = batch_sizes if batch_sizes is not None else (engine.options.buckets or ())
    if sizes and bucketer is not None:  # (sizes without buckets: refused above)
        if bucketer.written is None:
            fn(*args, **kwargs)  # the first call learns which arguments carry the batch
        for size in sorted(set(sizes), reverse=True):
            call_args, call_kwargs = _resized(bucketer, args, kwargs, size)
            report.append(_capture(fn, engine, call_args, call_kwargs, f"batch {size}"))
    elif plan is None or args or kwargs:
        report.append(_capture(fn, engine, args, kwargs, "example"))
    return report


def _check_sizes(sizes: Sequence[int], bucketer: Bucketer | None, name: str) -> None:
    """A clear ``ValueError`` for ``batch_sizes`` that cannot be warmed up, before any
    call is made."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes):
        raise ValueError(f"autograph.warmup: batch_sizes must be a list of ints >= 1, "
                         f"got {sizes!r}")
    if bucketer is None and sizes:
        raise ValueError(
            f"autograph.warmup: batch_sizes={list(sizes)!r} needs a callable graphed with "
            f"buckets= (they say which arguments carry the batch, and which graph serves "
            f"each size); {name} has none, so it gets one graph per exact shape: warm it "
            f"up with one example call of each batch size instead")


def _capture(fn: Any, engine: Engine, args: tuple[Any, ...], kwargs: dict[str, Any],
             label: str) -> dict[str, Any]:
    """Call ``fn`` until this call's key is captured, replays a graph captured before,
    or has run eagerly for good; report what happened (and, with buckets, the bucket
    whose graph serves the call: None where it ran unpadded)."""
    stats = engine.stats
    captures, seconds, memory = stats.captures, stats.capture_seconds, stats.graph_bytes
    calls = engine.options.warmup + 3  # warmups, the capture, and a first-call probe
    reason, bucket = "", None
    known = {id(e.graph) for e in engine.cache.entries.values()}
    for _ in range(calls):
        eager, replays, hits = stats.eager, stats.replays, _hits(stats)
        fn(*args, **kwargs)
        bucket = next((size for size, n in _hits(stats).items() if n > hits.get(size, 0)),
                      None)
        if stats.captures > captures:
            break
        last = stats.last_reason
        if stats.eager > eager and last is not None and last not in _WARMUP_REASONS:
            reason = last.value
            break
        if stats.replays > replays:  # a graph captured before serves it: nothing to do
            reason = "already captured"
            break
    captured = stats.captures > captures
    if captured:
        _fill_variants(engine, known)
    entry: dict[str, Any] = {"what": label}
    if engine.options.buckets:
        entry["bucket"] = bucket
    entry.update(captured=captured, capture_seconds=stats.capture_seconds - seconds,
                 graph_memory_bytes=stats.graph_bytes - memory)
    if not captured:
        entry["reason"] = reason or "not captured"
    logger.debug("%s: warmup %s: %s", stats.name, label, entry)
    return entry


def _fill_variants(engine: Engine, known: set[int]) -> None:
    """Capture the output variants (rotation.py) of the graphs this call captured, under
    its modes, so that traffic does not capture them later."""
    for entry in list(engine.cache.entries.values()):
        graph = entry.graph
        if graph is not None and id(graph) not in known and graph.rotation is not None:
            graph.rotation.fill()


def _hits(stats: Stats) -> dict[int, int]:
    """Calls served so far by each bucket."""
    return {size: b["hits"] for size, b in stats.buckets.items()}


# eager runs that are part of getting a key captured, not a reason to give up on it
_WARMUP_REASONS = {EagerReason.WARMUP, EagerReason.LEARNING, EagerReason.IN_PLACE}


def _resized(bucketer: Bucketer, args: tuple[Any, ...], kwargs: dict[str, Any],
             size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example call with ``size`` rows in every batch argument (rows repeated)."""
    batch = bucketer.batch_args(args, kwargs)
    sizes = {key: int(t.shape[dim]) for key, t, dim in batch}
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"autograph.warmup: the example's batch arguments disagree on the batch size "
            f"({sizes}); give the others batch_dims=None"
        )
    if 0 in sizes.values():
        raise ValueError("autograph.warmup: the example's batch arguments have no rows; "
                         "give an example with at least one row")
    new_args, new_kwargs = list(args), dict(kwargs)
    for key, t, dim in batch:
        rows = torch.arange(size, device=t.device) % t.shape[dim]
        shape = list(t.shape)
        shape[dim] = size
        value = empty_in_layout(t, shape)  # the example's memory format, as padding keeps
        torch.index_select(t, dim, rows, out=value)
        if isinstance(key, int):
            new_args[key] = value
        else:
            new_kwargs[key] = value
    return tuple(new_args), new_kwargs


def _from_plan(fn: Any, args: tuple[Any, ...], engine: Engine,
               path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Capture the keys the plan recorded for this callable, if every fingerprint
    matches; otherwise capture nothing from it and say which fields differ."""
    document = _plan.load(path)
    name = engine.stats.name
    section = document["callables"].get(name)
    if section is None:
        logger.warning("%s: the plan %s has nothing for this callable", name, os.fspath(path))
        return []
    differ = _plan.differences(document["environment"], _plan.environment())
    differ += _plan.differences(section.get("model", {}),
                                _plan.model_fingerprint(engine.watch.modules()))
    if differ:
        logger.warning("%s: not using the plan %s, it differs in %s", name,
                       os.fspath(path), "; ".join(differ))
        return []
    engine.check_guards()  # a wrapper not called yet: read its modules' training flags
    hits = section.get("bucket_hits", {})
    keyed = list(zip(section.get("keys", []), section.get("inplace", [])))
    keyed.sort(key=lambda kp: (-hits.get(str(_rows(kp[0])), 0), -_elements(kp[0])))
    return [_plan_key(fn, engine, key, inplace, args) for key, inplace in keyed]


def _plan_key(fn: Any, engine: Engine, key: dict[str, Any], inplace: list[int],
              example: tuple[Any, ...]) -> dict[str, Any]:
    """Capture one plan key under the grad, inference and autocast modes it recorded;
    not where its numerics or training flags differ from this process's, and reported
    as captured only if the graph captured has the plan's key."""
    refused = keymodes.refusal(key, engine.training())
    if refused is not None:
        return {"what": "plan key", "captured": False, "reason": refused}
    with torch.inference_mode(False):  # plain tensors, whatever the caller's mode
        call = _call_from_key(key, inplace, example)
    if call is None:
        return {"what": "plan key", "captured": False,
                "reason": "needs the example's in-place arguments"}
    before = {k for k, _ in engine.cache.graph_keys()}
    with keymodes.entered(key):
        entry = _capture(fn, engine, call[0], call[1], "plan key")
    if entry["captured"]:
        fields = _other_key(engine, key, before)
        if fields:
            entry.update(captured=False, reason=f"the key captured differs from the plan's "
                                                f"in {', '.join(fields)}")
    return entry


def _other_key(engine: Engine, key: dict[str, Any], before: set[Any]) -> list[str]:
    """The fields of the plan key that no graph captured since ``before`` matches (the
    fields of the closest one); none where one has the plan's key."""
    new = [keymodes.as_json(k.to_json()) for k, _ in engine.cache.graph_keys()
           if k not in before]
    misses = [[f for f, v in key.items() if (k or {}).get(f) != v and not (
        f == "training" and keymodes.same_training(v, (k or {}).get(f)))] for k in new]
    return min(misses, key=len) if misses and all(misses) else []


def _rows(key: dict[str, Any]) -> int:
    for leaf in key["leaves"]:
        if "tensor" in leaf and leaf["tensor"]["shape"]:
            return int(leaf["tensor"]["shape"][0])
    return 0


def _elements(key: dict[str, Any]) -> int:
    return sum(math.prod(leaf["tensor"]["shape"]) for leaf in key["leaves"] if "tensor" in leaf)


def _call_from_key(key: dict[str, Any], inplace: list[int], example: tuple[Any, ...]
                   ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Arguments that produce this key: zeros of the recorded layout; arguments written
    in place must be the caller's own tensors, taken from the example call."""
    leaves = []
    for i, leaf in enumerate(key["leaves"]):
        if i in inplace:
            if i >= len(example):
                return None
            leaves.append(example[i])
        elif "tensor" in leaf:
            spec = leaf["tensor"]
            t = torch.empty_strided(spec["shape"], spec["stride"],
                                    dtype=_plan.parse_dtype(spec["dtype"]), device=spec["device"])
            t.zero_()
            if spec["requires_grad"] and t.is_floating_point():
                t.requires_grad_(True)
            leaves.append(t)
        else:
            (kind, value), = leaf.items()
            leaves.append(_scalar(kind, value))
    n = key["nargs"]
    return tuple(leaves[:n]), dict(zip(key["kwargs"], leaves[n:]))


def _scalar(kind: str, value: Any) -> Any:
    if kind == "float":  # as ``walk.float_bits`` spells it
        if value.startswith("nan:"):
            return struct.unpack("<d", bytes.fromhex(value[4:]))[0]
        return float.fromhex(value)
    if kind == "dtype":
        return _plan.parse_dtype(value)
    if kind == "device":
        return torch.device(value)
    if kind == "Size":
        return torch.Size(value)
    return value
