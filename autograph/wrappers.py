"""The user-facing wrappers: a decorated function or method, and a wrapped module.

Both are ``wrapt`` proxies, so names, docstrings, signatures, ``inspect`` and
``isinstance`` behave as on the original.  A method (``nn.Module.forward`` decorated in
the class body) gets one engine per instance, held weakly: a garbage-collected module
takes its graphs with it.
"""

from __future__ import annotations

import copy
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any, SupportsIndex

import wrapt
from torch import nn

from . import stats as _stats
from .dispatch import Engine
from .engines import Handle, live_engines, live_handles, make_engine, make_module_engine
from .options import Options
from .region import nested

__all__ = ["GraphedFunction", "GraphedModule", "live_engines", "make_module_engine", "wrap"]


class _Dispatch:
    """The wrapt wrapper function: finds the engine for the call and runs it."""

    def __init__(self, fn: Callable[..., Any], options: Options) -> None:
        self.fn = fn
        self.options = options
        self.handle: Handle | None = None
        self.instances: dict[int, tuple[weakref.ref[Any], Handle]] = {}
        self.lock = threading.Lock()

    def __call__(self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        if instance is None or isinstance(instance, type):
            handle = self.handle
            if handle is None:
                handle = self._function_engine(wrapped)
        else:
            item = self.instances.get(id(instance))
            if item is None or item[0]() is not instance:
                item = self._instance_engine(instance)
            handle = item[1]
        return handle.call(args, kwargs)

    def _function_engine(self, wrapped: Callable[..., Any]) -> Handle:
        with self.lock:
            if self.handle is None:
                name = getattr(self.fn, "__qualname__", repr(self.fn))
                self.handle = make_engine(wrapped, self.options, name, list, self.fn,
                                          False, method=False)
            return self.handle

    def _instance_engine(self, instance: Any) -> tuple[weakref.ref[Any], Handle]:
        key = id(instance)
        instances = self.instances

        def forget(_ref: Any) -> None:
            item = instances.get(key)
            if item is not None and item[0] is _ref:
                del instances[key]
                item[1].engine.watch.close()

        ref = weakref.ref(instance, forget)
        fn = self.fn

        def call(*args: Any, **kwargs: Any) -> Any:
            return fn(ref(), *args, **kwargs)

        is_module = isinstance(instance, nn.Module)

        def roots() -> list[nn.Module]:
            obj = ref()
            return [obj] if is_module and obj is not None else []

        name = f"{type(instance).__qualname__}.{getattr(fn, '__name__', 'call')}"
        handle = make_engine(call, self.options, name, roots, fn, False, method=True)
        with self.lock:
            item = instances[key] = (ref, handle)
        return item

    def engines(self) -> list[Engine]:
        out = [item[1].engine for item in list(self.instances.values())]
        return out + ([self.handle.engine] if self.handle is not None else [])


class GraphedFunction(wrapt.FunctionWrapper):  # type: ignore[misc]
    """A function or method whose calls run through autograph."""

    _autograph_graphed = True  # what regions look for on a decorated forward

    def __init__(self, fn: Callable[..., Any], options: Options) -> None:
        dispatch = _Dispatch(fn, options)
        super().__init__(fn, dispatch)
        self._self_dispatch = dispatch

    def reset(self) -> None:
        """Drop every graph of this function (of every instance, for a method)."""
        for engine in self._self_dispatch.engines():
            engine.reset()


_RETURNS_SELF = (
    "to", "cuda", "cpu", "xpu", "half", "float", "double", "bfloat16", "type", "train",
    "eval", "requires_grad_", "apply", "to_empty", "share_memory",
)


class GraphedModule(wrapt.ObjectProxy):  # type: ignore[misc]
    """An ``nn.Module`` whose calls run through autograph; everything else is the module.

    Calling it runs the module's ``__call__`` (forward and its hooks) graphed.
    Attributes, submodules, ``state_dict()``, ``parameters()`` and
    ``isinstance(wrapper, type(module))`` are the module's own; methods that return the
    module (``to``, ``half``, ``eval``, ...) return the wrapper.
    """

    def __init__(self, module: nn.Module, options: Options) -> None:
        super().__init__(module)
        self._self_options = options
        # the module's calls made by this engine are not top-level calls for a region
        self._self_handle = make_module_engine(module, options, nested(module), weak=False)
        self._self_engine = self._self_handle.engine

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._self_handle.call(args, kwargs)

    def reset(self) -> None:
        """Drop every graph of this module."""
        self._self_engine.reset()

    def __repr__(self) -> str:
        return f"autograph.graphed({self.__wrapped__!r})"

    def __copy__(self) -> GraphedModule:
        return GraphedModule(copy.copy(self.__wrapped__), self._self_options)

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphedModule:
        return GraphedModule(copy.deepcopy(self.__wrapped__, memo), self._self_options)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return (_rewrap, (self.__wrapped__, self._self_options))


def _returns_self(name: str) -> Callable[..., Any]:
    def method(self: GraphedModule, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.__wrapped__, name)(*args, **kwargs)
        return self if result is self.__wrapped__ else result

    method.__name__ = name
    method.__doc__ = f"``module.{name}(...)``, returning the wrapper instead of the module."
    return method


for _name in _RETURNS_SELF:
    setattr(GraphedModule, _name, _returns_self(_name))


def _rewrap(module: nn.Module, options: Options) -> GraphedModule:
    return GraphedModule(module, options)


def wrap(obj: Any, options: Options) -> Any:
    """``graphed(obj)``: a module instance gets a proxy, a callable a function wrapper."""
    if isinstance(obj, (GraphedModule, GraphedFunction)):
        raise TypeError("autograph.graphed: this object is already graphed")
    if isinstance(obj, nn.Module):
        return GraphedModule(obj, options)
    if isinstance(obj, (staticmethod, classmethod)) or callable(obj):
        return GraphedFunction(obj, options)
    raise TypeError(
        f"autograph.graphed expects a function, a method or an nn.Module instance, "
        f"got {type(obj).__qualname__}"
    )


def _engines_of(obj: Any) -> list[Engine]:
    if isinstance(obj, GraphedModule):
        return [obj._self_engine]
    if isinstance(obj, GraphedFunction):
        return obj._self_dispatch.engines()
    return [e for e in live_engines() if any(r is obj for r in e.watch.roots())]


def handle_of(obj: Any) -> Handle:
    """The handle that a call of ``obj`` runs through, made now if it does not exist yet
    (a graphed function, a wrapper, or a module whose forward is graphed)."""
    if isinstance(obj, GraphedModule):
        return obj._self_handle  # type: ignore[no-any-return]
    if isinstance(obj, GraphedFunction):
        dispatch = obj._self_dispatch
        return dispatch.handle or dispatch._function_engine(obj.__wrapped__)
    forward = inspect.getattr_static(type(obj), "forward", None)
    if isinstance(forward, GraphedFunction):
        dispatch = forward._self_dispatch
        item = dispatch.instances.get(id(obj))
        if item is None or item[0]() is not obj:
            item = dispatch._instance_engine(obj)
        return item[1]
    handles = [h for h in live_handles() if any(r is obj for r in h.engine.watch.roots())]
    if len(handles) == 1:  # a module a region has graphed
        return handles[0]
    raise TypeError(f"autograph: {type(obj).__qualname__} is not graphed")


def name_of(obj: Any) -> str:
    """The name ``stats()`` lists a graphed object under (its qualified name when its
    counters are summed over several instances)."""
    engines = _engines_of(obj)
    if len(engines) == 1:
        return engines[0].stats.name
    return getattr(obj, "__qualname__", type(obj).__qualname__)


def stats_of(obj: Any) -> dict[str, Any]:
    """The counters of one graphed object (summed over instances for a method)."""
    engines = _engines_of(obj)
    if not engines:
        if isinstance(obj, GraphedFunction):  # not called yet
            return _stats.Stats("").snapshot()
        raise TypeError(f"autograph.stats: {type(obj).__qualname__} is not graphed")
    if len(engines) == 1:
        return engines[0].stats.snapshot()
    total: dict[str, Any] = {}
    for engine in engines:
        for k, v in engine.stats.snapshot().items():
            if isinstance(v, dict):
                merged = total.setdefault(k, {})
                for r, n in v.items():
                    merged[r] = merged.get(r, 0) + n
            else:
                total[k] = total.get(k, 0) + v
    return total


def reset(obj: Any = None) -> None:
    """Drop graphs: of ``obj`` (a graphed function, module, or a module whose forward is
    graphed), or of every graphed callable when ``obj`` is None."""
    if obj is None:
        for engine in live_engines():
            engine.reset()
        return
    engines = _engines_of(obj)
    if not engines and not isinstance(obj, GraphedFunction):
        raise TypeError(f"autograph.reset: {type(obj).__qualname__} is not graphed")
    for engine in engines:
        engine.reset()
