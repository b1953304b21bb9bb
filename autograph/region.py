"""``autograph.capture_region()``: graph the module calls made inside a block of code.

Inside a region, in the thread that entered it, every top-level ``nn.Module`` call (one
not made from inside another module's call) runs through an autograph engine of that
module instance, as if the instance had been wrapped with ``autograph.graphed``; the
submodule calls inside it become part of its graph.  The engines belong to the module
instances, not to the region: a later region replays what an earlier one captured,
and a garbage-collected module takes its graphs with it.

Mechanism: while at least one region is open in any thread, ``nn.Module.__call__`` is
replaced by a function that routes top-level calls of threads inside a region and
passes every other call straight to the original.  When the last region closes, the
original is put back.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from .engine import Engine
from .options import Options

F = TypeVar("F", bound=Callable[..., Any])

_local = threading.local()
_lock = threading.Lock()
_open = 0  # regions open in all threads: the patch is installed while > 0
_original_call: Callable[..., Any] | None = None
# id(module) -> (weak reference, the module's region engine)
_engines: dict[int, tuple[weakref.ref[nn.Module], Engine]] = {}
_own_options: dict[type, bool] = {}


class Region:
    """A block (or decorated function) whose top-level module calls are graphed.

    Use it as a context manager (``with autograph.capture_region() as region:``) or as a
    decorator (``@autograph.capture_region(warmup=2)``).  ``region.stats()`` reports the
    calls made inside it, in the form of ``autograph.stats()``.
    """

    def __init__(self, options: Options) -> None:
        self.options = options
        self._counts: dict[str, dict[str, Any]] = {}
        self._counts_lock = threading.Lock()

    def __enter__(self) -> Region:
        stack = _stack()
        stack.append(self)
        try:
            _retain()
        except BaseException:
            stack.pop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        _stack().pop()
        _release()

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def inside(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return inside  # type: ignore[return-value]

    def stats(self) -> dict[str, dict[str, Any]]:
        """Counters of the module calls made inside this region, by module name."""
        with self._counts_lock:
            return {
                name: {**c, "eager_reasons": dict(c["eager_reasons"])}
                for name, c in self._counts.items()
            }

    def _count(self, engine: Engine, before: tuple[int, int, int, int, float]) -> None:
        """Add what one call did to the engine's counters to this region's counters."""
        s = engine.stats
        with self._counts_lock:
            c = self._counts.get(s.name)
            if c is None:
                c = self._counts[s.name] = {
                    "calls": 0, "replays": 0, "captures": 0, "eager": 0,
                    "eager_reasons": Counter(), "capture_seconds": 0.0,
                }
            c["calls"] += 1
            c["replays"] += s.replays - before[0]
            c["captures"] += s.captures - before[1]
            eager = s.eager - before[2]
            c["eager"] += eager
            if eager:
                c["eager_reasons"][s.last_reason] += eager
            c["capture_seconds"] += s.capture_seconds - before[4]
            c["graphs"] = s.graphs
            c["graph_memory_bytes"] = s.graph_bytes


def _stack() -> list[Region]:
    stack = getattr(_local, "regions", None)
    if stack is None:
        stack = _local.regions = []
        _local.depth = 0
    return stack


def _retain() -> None:
    """Install the ``nn.Module.__call__`` patch when the first region opens."""
    global _open, _original_call
    with _lock:
        if _open == 0:
            _original_call = nn.Module.__call__
            nn.Module.__call__ = _call  # type: ignore[method-assign]
        _open += 1


def _release() -> None:
    """Put the original ``nn.Module.__call__`` back when the last region closes."""
    global _open, _original_call
    with _lock:
        _open -= 1
        if _open == 0:
            if nn.Module.__call__ is _call:
                nn.Module.__call__ = _original_call  # type: ignore[method-assign,assignment]
            _original_call = None


def _call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``nn.Module.__call__`` while a region is open somewhere."""
    original = _original_call if _original_call is not None else _unpatched
    regions = getattr(_local, "regions", None)
    if not regions:  # this thread is in no region
        return original(self, *args, **kwargs)
    top = _local.depth == 0
    _local.depth += 1
    try:
        if not top or _has_own_engine(self):
            return original(self, *args, **kwargs)
        return _through_engine(regions[-1], self, args, kwargs)
    finally:
        _local.depth -= 1


def _unpatched(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return nn.Module._wrapped_call_impl(module, *args, **kwargs)


def _has_own_engine(module: nn.Module) -> bool:
    """A module whose forward is decorated with ``graphed`` keeps its own options."""
    cls = type(module)
    own = _own_options.get(cls)
    if own is None:
        from .wrappers import GraphedFunction

        forward = inspect.getattr_static(cls, "forward", None)  # the descriptor itself
        own = _own_options[cls] = isinstance(forward, GraphedFunction)
    return own


def _through_engine(region: Region, module: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
    engine = _engine_for(module)
    engine.set_options(region.options)  # the innermost region's options win
    s = engine.stats
    before = (s.replays, s.captures, s.eager, s.calls, s.capture_seconds)
    front = engine.front
    try:
        return engine(args, kwargs) if front is None else front(args, kwargs)
    finally:
        region._count(engine, before)


def _engine_for(module: nn.Module) -> Engine:
    item = _engines.get(id(module))
    if item is not None and item[0]() is module:
        return item[1]
    from .wrappers import make_module_engine

    key = id(module)

    def forget(ref: weakref.ref[nn.Module]) -> None:
        current = _engines.get(key)
        if current is not None and current[0] is ref:
            del _engines[key]
            current[1].watch.close()

    ref = weakref.ref(module, forget)

    def call(*args: Any, **kwargs: Any) -> Any:  # runs inside _call: nested calls pass
        return (_original_call or _unpatched)(ref(), *args, **kwargs)  # type: ignore[arg-type]

    engine = make_module_engine(module, Options(), call, weak=True)
    _engines[key] = (ref, engine)
    return engine


def nested(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the module calls it makes marked as not top-level for regions (for
    ``autograph.graphed(module)``, which graphs its module itself)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if not getattr(_local, "regions", None):
            return fn(*args, **kwargs)
        _local.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _local.depth -= 1

    return call
