"""Making engines, and the handle callers hold: the engine with what a call goes through.

A :class:`Handle` is one graphed callable as wrappers and regions hold it: its
:class:`~autograph.dispatch.Engine`, and ``call``, the engine itself or a
:class:`~autograph.buckets.Bucketer` composed in front of it (the outermost counts the
call).  Every live engine is listed weakly here, for ``reset()``, ``stats()`` and plans.
"""

from __future__ import annotations

import functools
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from .arguments import (
    check_argument_keys,
    misfit_check,
    move_names,
    no_misfit,
    positional,
    positional_names,
)
from .buckets import Bucketer
from .coderefs import _namespace, attributes
from .dispatch import Engine
from .guards import Watch
from .notify import global_hooks
from .options import Options
from .stats import register as register_stats

_MODULE_CALL = nn.Module.__call__
_CALL_IMPL = nn.Module._call_impl

# every live graphed callable, for autograph.reset(), stats() and plans
_handles: weakref.WeakSet[Handle] = weakref.WeakSet()


class Handle:
    """One graphed callable: its engine, and ``call(args, kwargs)`` to run a call."""

    __slots__ = ("engine", "call", "code", "method", "__weakref__")

    def __init__(self, engine: Engine, code: Callable[..., Any] | None = None,
                 method: bool = False) -> None:
        self.engine = engine
        self.code = code  # the function whose parameters per-argument options name
        self.method = method
        self.call: Callable[[tuple[Any, ...], dict[str, Any]], Any] = _front(engine)

    def set_options(self, options: Options) -> None:
        """Use these options from the next call on (a region passes its own)."""
        engine = self.engine
        before = engine.options
        if options is not before and self.code is not None:
            check_argument_keys(options, self.code, skip_self=self.method)
        engine.set_options(options)
        if engine.options is not before:
            self.call = _front(engine)


def _front(engine: Engine) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
    if engine.options.buckets:
        return Bucketer(engine, engine.options)
    return engine


def make_engine(fn: Callable[..., Any], options: Options, name: str,
                roots: Callable[[], list[nn.Module]], code: Callable[..., Any] | None,
                hooks_of_roots: bool, method: bool,
                owner: Callable[[], Any] | None = None,
                trusted: Callable[[], bool] = lambda: True) -> Handle:
    """A handle on a new engine for ``fn``, guarding the modules ``roots`` returns and
    what ``code`` names in its globals and closures."""
    if code is not None:
        check_argument_keys(options, code, skip_self=method)
    stats = register_stats(name)
    names = positional_names(code, skip_self=method) if code is not None else []
    misfit = misfit_check(code, skip_self=method) if code is not None else no_misfit
    watch = Watch(roots, code, hooks_of_roots, owner)
    engine = Engine(fn, options, stats, watch, watch.training, names, misfit)
    if code is not None:
        engine.positional = positional(move_names(code, skip_self=method), trusted)
    handle = Handle(engine, code, method)
    _handles.add(handle)
    return handle


def make_module_engine(module: nn.Module, options: Options, fn: Callable[..., Any],
                       weak: bool) -> Handle:
    """The handle that graphs calls of a module instance (its forward and hooks).

    ``weak``: hold the module by a weak reference only (region engines, which must not
    keep their module alive); a wrapper holds it anyway.
    """
    ref: Callable[[], nn.Module | None] = weakref.ref(module) if weak else (lambda: module)

    def roots() -> list[nn.Module]:
        m = ref()
        return [m, *_bound_modules(m)] if m is not None else []

    forward = getattr(type(module), "forward", None)

    def trusted() -> bool:
        """The class's forward is the one called (none set on the instance, none
        patched into the class since), through ``nn.Module``'s own ``__call__`` (a class
        may override it and read ``kwargs``), and no forward hook sees the call's
        spelling (a pre-hook reading ``kwargs``)."""
        m = ref()
        if m is None:
            return False
        cls = type(m)
        return (cls.forward is forward and _plain_call(cls.__call__)
                and cls._call_impl is _CALL_IMPL and "forward" not in vars(m)
                and not m._forward_pre_hooks and not m._forward_hooks and not global_hooks())

    return make_engine(fn, options, type(module).__qualname__, roots, forward, True,
                       method=True, trusted=trusted)


def _plain_call(call: Any) -> bool:
    """``nn.Module``'s own ``__call__``, or a capture region's patch over it (open in
    some thread: it passes the call's spelling on as it came)."""
    if call is _MODULE_CALL:
        return True
    region = sys.modules.get("autograph.region")
    return region is not None and region.passes_through(call, _MODULE_CALL)


def _bound_modules(module: nn.Module) -> list[nn.Module]:
    """The other modules a ``forward`` set on the instance reaches by what it binds
    (``m.forward = other.forward``, a ``functools.partial`` over other modules, a plain
    object's method, a function's closure cells), four levels down through
    containers, plain objects and functions: the call reads their state too, so their
    trees are watched as the module's own."""
    modules: list[nn.Module] = []
    _collect([vars(module).get("forward")], modules, depth=4, seen=set())
    return [m for m in modules if m is not module and getattr(m, "__wrapped__", None)
            is not module]


def _collect(values: Any, modules: list[nn.Module], depth: int, seen: set[int]) -> None:
    """The modules among ``values`` and what they bind or hold, ``depth`` levels."""
    for value in values:
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, nn.Module):
            modules.append(value)
        elif depth:
            _collect(_bound(value), modules, depth - 1, seen)


def _bound(value: Any) -> list[Any]:
    """What ``value`` binds or holds: a partial's arguments and function, a method's
    object and function, a function's closure cells, a container's items, a plain
    object's attributes."""
    if isinstance(value, functools.partial):
        return [*value.args, *value.keywords.values(), value.func]
    if isinstance(value, types.MethodType):
        return [value.__self__, value.__func__]
    if isinstance(value, types.FunctionType):
        return [c.cell_contents for c in value.__closure__ or () if _filled(c)]
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, dict):
        return list(value.values())
    if _namespace(value) and not isinstance(value, types.ModuleType):
        return list(attributes(value).values())  # (slots too)
    return []


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def live_handles() -> list[Handle]:
    """Every live graphed callable (functions, methods, wrappers and region modules)."""
    return list(_handles)


def live_engines() -> list[Engine]:
    return [h.engine for h in live_handles()]
