"""Finding what a user's object graphs: the engines behind a graphed function, method,
wrapper or region-graphed module, for ``stats()``, ``reset()``, ``report()`` and
``warmup()``."""

from __future__ import annotations

import inspect
from typing import Any

from . import stats as _stats
from .dispatch import Engine
from .engines import Handle, live_engines, live_handles
from .functions import GraphedFunction, _bound_self, _graphed_parent
from .proxy import GraphedModule


def _static(parent: Any) -> bool:
    """Whether ``parent`` (a graphed function, or None) graphs a ``staticmethod``: read
    from an instance, it is called unbound."""
    return parent is not None and isinstance(parent.__wrapped__, staticmethod)


def _bound_handle(obj: Any, make: bool) -> Handle | None:
    """The handle of a graphed function bound to an instance: ``model.forward`` where
    forward is decorated, or ``graphed(lin.forward)``; made now if ``make``.  A graphed
    ``staticmethod`` read from an instance is called unbound: none."""
    parent = _graphed_parent(obj)
    if _static(parent):
        return None
    if parent is not None and obj._self_bound_to is not None:
        dispatch, instance = parent._self_dispatch, obj._self_bound_to
    elif isinstance(obj, GraphedFunction) and obj._self_dispatch.bound:
        dispatch, instance = obj._self_dispatch, _bound_self(obj.__wrapped__)
    else:
        return None
    if isinstance(instance, type):  # a classmethod bound to its class: that class's
        handle = dispatch.classes.get(instance)
        if handle is None and make:
            handle = dispatch._class_engine(obj.__wrapped__, instance)
        return handle
    item = dispatch.instances.get(id(instance))
    if item is None or item[0]() is not instance:
        if not make:
            return None
        item = dispatch._instance_engine(instance)
    return item[1]


def _is_graphed(obj: Any) -> bool:
    return isinstance(obj, GraphedFunction) or _graphed_parent(obj) is not None \
        or _graphed_forward(obj) is not None


def _graphed_forward(obj: Any) -> GraphedFunction | None:
    """The graphed ``forward`` of ``obj``'s class (``@autograph.graphed`` on it), if any."""
    forward = inspect.getattr_static(type(obj), "forward", None)
    return forward if isinstance(forward, GraphedFunction) else None


def _engines_of(obj: Any) -> list[Engine]:
    if isinstance(obj, GraphedModule):
        return [obj._self_engine]
    parent = _graphed_parent(obj)
    if parent is not None:
        if obj._self_bound_to is None or _static(parent):
            # looked up on the class (every instance's), or a staticmethod's
            return parent._self_dispatch.engines()
        handle = _bound_handle(obj, make=False)
        return [handle.engine] if handle is not None else []
    if isinstance(obj, GraphedFunction):
        return obj._self_dispatch.engines()
    forward = _graphed_forward(obj)
    if forward is not None:  # an instance (made by copy.deepcopy too): its own engine
        item = forward._self_dispatch.instances.get(id(obj))
        return [item[1].engine] if item is not None and item[0]() is obj else []
    return [e for e in live_engines() if any(r is obj for r in e.watch.roots())]


def handle_of(obj: Any) -> Handle:
    """The handle that a call of ``obj`` runs through, made now if it does not exist yet
    (a graphed function, a wrapper, or a module whose forward is graphed)."""
    if isinstance(obj, GraphedModule):
        return obj._self_handle  # type: ignore[no-any-return]
    bound = _bound_handle(obj, make=True)
    if bound is not None:
        return bound
    parent = _graphed_parent(obj)
    if _static(parent):
        obj = parent  # read from an instance, called unbound
    if isinstance(obj, GraphedFunction):
        dispatch = obj._self_dispatch
        return dispatch.handle or dispatch._function_engine(obj.__wrapped__)
    forward = _graphed_forward(obj)
    if forward is not None:
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
        if _is_graphed(obj):  # not called yet
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
            elif isinstance(v, (int, float)):
                total[k] = total.get(k, 0) + v
            elif total.get(k) is None:  # a note such as "padding": the first one given
                total[k] = v
    return total


def reset(obj: Any = None) -> None:
    """Drop graphs: of ``obj`` (a graphed function, module, or a module whose forward is
    graphed), or of every graphed callable when ``obj`` is None."""
    if obj is None:
        for engine in live_engines():
            engine.reset()
        return
    engines = _engines_of(obj)
    if not engines and not _is_graphed(obj):
        raise TypeError(f"autograph.reset: {type(obj).__qualname__} is not graphed")
    for engine in engines:
        engine.reset()
