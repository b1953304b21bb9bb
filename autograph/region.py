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

import contextvars
import dataclasses
import functools
import inspect
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from .dispatch import _compiling
from .engines import Handle, make_module_engine
from .options import Options
from .stats import Stats, observing
from .vocab import deferred_body

F = TypeVar("F", bound=Callable[..., Any])

# The regions open in the running code, innermost last.  A context variable, so a
# region follows the code that entered it (asyncio tasks, threads started with a copy
# of the context); a region closed elsewhere (a generator resumed on another thread)
# is removed from the closing context's stack, where it is one (see ``__exit__``).
_regions: contextvars.ContextVar[tuple[Region, ...]] = contextvars.ContextVar(
    "autograph_regions", default=())
_local = threading.local()  # module-call depth of this thread (calls do not interleave)
_lock = threading.Lock()
_open = 0  # regions open anywhere: the patch is installed while > 0
_original_call: Callable[..., Any] | None = None
# id(module) -> (weak reference, the module's region handle)
_handles: dict[int, tuple[weakref.ref[nn.Module], Handle]] = {}
_handles_lock = threading.Lock()  # held while a module's handle is made
_own_options: dict[type, bool] = {}
# The module instances whose top-level calls (and their submodules') go through a given
# handle while one of their own methods runs (``graphed(model).generate(...)``)
_routes: contextvars.ContextVar[tuple[routing, ...]] = contextvars.ContextVar(
    "autograph_routes", default=())


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
        _retain()
        _regions.set((*_regions.get(), self))
        return self

    def __exit__(self, *exc: object) -> None:
        """Leave this context's last entry into the region, and only it: another
        region entered meanwhile and still open (an interleaved generator's) stays, and
        one left meanwhile is not put back, as restoring the stack seen at entry would."""
        stack = _regions.get()
        for k in range(len(stack) - 1, -1, -1):
            if stack[k] is self:
                _regions.set(stack[:k] + stack[k + 1:])
                break
        _release()

    def __call__(self, fn: F) -> F:
        kind = deferred_body(fn)
        if kind is not None:
            raise TypeError(
                f"autograph.capture_region cannot decorate {kind} "
                f"({getattr(fn, '__qualname__', fn)!r}): its body runs after the call "
                f"returns, outside the region; open the region inside it "
                f"(`with autograph.capture_region():`) around the module calls")

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

    def _counter(self, stats: Stats) -> dict[str, Any]:
        c = self._counts.get(stats.name)
        if c is None:
            c = self._counts[stats.name] = {
                "calls": 0, "replays": 0, "captures": 0, "eager": 0,
                "eager_reasons": Counter(), "capture_seconds": 0.0,
            }
        return c

    def _call(self, handle: Handle, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One module call inside this region, counted here from what it did."""
        own = handle.engine.stats
        capture_seconds = own.capture_seconds

        def observe(stats: Stats, what: str) -> None:
            if stats is not own:  # a graphed callable called inside the module
                return
            with self._counts_lock:
                c = self._counter(stats)
                if what == "replay":
                    c["replays"] += 1
                elif what == "capture":
                    c["captures"] += 1
                    c["capture_seconds"] += stats.capture_seconds - capture_seconds
                else:
                    c["eager"] += 1
                    c["eager_reasons"][what] += 1

        try:
            with observing(observe):
                return handle.call(args, kwargs)
        finally:
            with self._counts_lock:
                c = self._counter(own)
                c["calls"] += 1
                c["graphs"] = own.graphs
                c["graph_memory_bytes"] = own.graph_bytes


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


def passes_through(call: Any, module_call: Any) -> bool:
    """Whether ``call`` is the region's patch of ``nn.Module.__call__`` put over
    ``module_call`` (torch's own): the module is called as that would call it."""
    return call is _call and _original_call is module_call


def _depth() -> int:
    return getattr(_local, "depth", 0)  # type: ignore[no-any-return]


def _call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``nn.Module.__call__`` while a region is open somewhere."""
    original = _original_call if _original_call is not None else _unpatched
    regions = _regions.get()
    routes = _routes.get()
    if not regions and not routes:  # the running code is in no region and no method
        return original(self, *args, **kwargs)
    top = _depth() == 0
    _local.depth = _depth() + 1
    try:
        if not top:
            return original(self, *args, **kwargs)
        for route in routes:  # a graphed module's own method calls the module
            if route.mid == id(self):
                return route.handle.call(args, kwargs)
        if _has_own_engine(self):
            return original(self, *args, **kwargs)
        if regions:
            return _through_engine(regions[-1], self, args, kwargs)
        for route in routes:  # ... or one of its submodules (``get_text_features``)
            if route.holds(self):
                handle = _handle_for(self)
                handle.set_options(_submodule_options(route.handle.engine.options))
                return handle.call(args, kwargs)
        return original(self, *args, **kwargs)
    finally:
        _local.depth -= 1


# per wrapper's options (by id, with the options kept): those its routed methods'
# submodule calls are graphed with (no per-argument options: they name the forward's)
_derived: dict[int, tuple[Options, Options]] = {}


def _submodule_options(options: Options) -> Options:
    """``options`` without what names the wrapped forward's arguments (buckets, batch
    dimensions, padding): the options of the submodule calls its methods make."""
    known = _derived.get(id(options))
    if known is not None and known[0] is options:
        return known[1]
    derived = dataclasses.replace(options, buckets=None, batch_dims={}, pad_values={},
                                  pad_writes={})
    if len(_derived) > 64:
        _derived.clear()
    _derived[id(options)] = (options, derived)
    return derived


class routing:  # noqa: N801 - used like a function
    """While open, top-level calls of ``module`` (made by the running code, e.g. by one
    of its methods such as ``generate``) run through ``handle``: the per-instance use of
    the ``nn.Module.__call__`` patch that regions install.  Top-level calls of its
    submodules (``self.text_model(...)`` in CLIP's ``get_text_features``, the encoder
    in ``generate``) are graphed as a region graphs its calls, with the wrapper's
    options less the per-argument ones."""

    __slots__ = ("module", "mid", "handle", "token", "inside")

    def __init__(self, module: nn.Module, handle: Handle) -> None:
        self.module = module
        self.mid = id(module)
        self.handle = handle
        self.inside: set[int] | None = None  # ids of its submodules, once needed

    def holds(self, module: nn.Module) -> bool:
        """Whether ``module`` is one of the routed module's submodules."""
        if self.inside is None:
            self.inside = {id(m) for m in self.module.modules()}
        return id(module) in self.inside

    def __enter__(self) -> None:
        _retain()
        self.token = _routes.set((*_routes.get(), self))

    def __exit__(self, *exc: object) -> None:
        try:
            _routes.reset(self.token)
        except ValueError:  # exited in another context than it was entered in
            _routes.set(tuple(r for r in _routes.get() if r is not self))
        _release()


def _unpatched(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return nn.Module._wrapped_call_impl(module, *args, **kwargs)


def _has_own_engine(module: nn.Module) -> bool:
    """A module whose forward is decorated with ``graphed`` keeps its own options."""
    cls = type(module)
    own = _own_options.get(cls)
    if own is None:
        forward = inspect.getattr_static(cls, "forward", None)  # the descriptor itself
        own = _own_options[cls] = bool(getattr(type(forward), "_autograph_graphed", False))
    return own


def _through_engine(region: Region, module: nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
    handle = _handle_for(module)
    handle.set_options(region.options)  # the innermost region's options win
    return region._call(handle, args, kwargs)


def _handle_for(module: nn.Module) -> Handle:
    item = _handles.get(id(module))
    if item is not None and item[0]() is module:
        return item[1]
    with _handles_lock:  # one engine per module, however many threads call it first
        item = _handles.get(id(module))
        if item is not None and item[0]() is module:
            return item[1]
        return _new_handle(module)


def _new_handle(module: nn.Module) -> Handle:
    key = id(module)

    def forget(ref: weakref.ref[nn.Module], handles: dict[int, Any] = _handles) -> None:
        # (``handles`` bound now: at interpreter exit the module global may be None)
        current = handles.get(key)
        if current is not None and current[0] is ref:
            del handles[key]
            current[1].engine.watch.close()

    ref = weakref.ref(module, forget)

    def call(*args: Any, **kwargs: Any) -> Any:  # runs inside _call: nested calls pass
        return (_original_call or _unpatched)(ref(), *args, **kwargs)  # type: ignore[arg-type]

    handle = make_module_engine(module, Options(), call, weak=True)
    _handles[key] = (ref, handle)
    return handle


def nested(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the module calls it makes marked as not top-level for regions (for
    ``autograph.graphed(module)``, which graphs its module itself)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        # (torch.compile traces this on its way to the original: no context variables)
        if _compiling() or (not _regions.get() and not _routes.get()):
            return fn(*args, **kwargs)
        _local.depth = _depth() + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _local.depth -= 1

    return call
