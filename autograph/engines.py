"""Making engines, and the handle callers hold: the engine with what a call goes through.

A :class:`Handle` is one graphed callable as wrappers and regions hold it: its
:class:`~autograph.dispatch.Engine`, and ``call``, the engine itself or a
:class:`~autograph.buckets.Bucketer` composed in front of it (the outermost counts the
call).  Every live engine is listed weakly here, for ``reset()``, ``stats()`` and plans.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from .buckets import Bucketer, positional_names
from .dispatch import Engine
from .guards import Watch
from .options import Options
from .stats import register as register_stats

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
                hooks_of_roots: bool, method: bool) -> Handle:
    """A handle on a new engine for ``fn``, guarding the modules ``roots`` returns and
    what ``code`` names in its globals and closures."""
    if code is not None:
        check_argument_keys(options, code, skip_self=method)
    stats = register_stats(name)
    names = positional_names(code, skip_self=method) if code is not None else []
    watch = Watch(roots, code, hooks_of_roots)
    engine = Engine(fn, options, stats, watch, watch.training, names)
    handle = Handle(engine, code, method)
    _handles.add(handle)
    return handle


def check_argument_keys(options: Options, fn: Callable[..., Any], skip_self: bool) -> None:
    """Raise ``ValueError`` if ``batch_dims`` or ``pad_values`` name an argument that
    ``fn`` does not have: a name that is not one of its parameters, or a position past
    its positional parameters (unless it takes ``*args``/``**kwargs``)."""
    keys = [(what, key) for what, mapping in (("batch_dims", options.batch_dims),
                                              ("pad_values", options.pad_values))
            for key in (mapping or {})]
    if not keys:
        return
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # no signature to check against (a builtin, a C extension)
    kinds = inspect.Parameter
    if skip_self and params and params[0].kind in (kinds.POSITIONAL_ONLY,
                                                   kinds.POSITIONAL_OR_KEYWORD):
        params = params[1:]
    positional = [p.name for p in params
                  if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    named = [p.name for p in params
             if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
    var_args = any(p.kind is kinds.VAR_POSITIONAL for p in params)
    var_kwargs = any(p.kind is kinds.VAR_KEYWORD for p in params)
    fn_name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    listed = ", ".join(p.name if p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
                       else ("*" if p.kind is kinds.VAR_POSITIONAL else "**") + p.name
                       for p in params) or "none"
    for what, key in keys:
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise ValueError(f"autograph: {what} keys are argument names or positions, "
                             f"got {key!r}")
        if isinstance(key, str):
            if key in named or key in positional or var_kwargs:
                continue
            raise ValueError(f"autograph: {what} names {key!r}, which is not a parameter of "
                             f"{fn_name}; its parameters are: {listed}")
        if key < 0:
            raise ValueError(f"autograph: {what} position {key} is negative; positions count "
                             f"from 0 (the first argument after self)")
        if key >= len(positional) and not var_args:
            raise ValueError(
                f"autograph: {what} names position {key}, but {fn_name} takes "
                f"{len(positional)} positional argument(s) ({', '.join(positional) or 'none'});"
                f" its parameters are: {listed}")


def make_module_engine(module: nn.Module, options: Options, fn: Callable[..., Any],
                       weak: bool) -> Handle:
    """The handle that graphs calls of a module instance (its forward and hooks).

    ``weak``: hold the module by a weak reference only (region engines, which must not
    keep their module alive); a wrapper holds it anyway.
    """
    ref: Callable[[], nn.Module | None] = weakref.ref(module) if weak else (lambda: module)

    def roots() -> list[nn.Module]:
        m = ref()
        return [m] if m is not None else []

    forward = getattr(type(module), "forward", None)
    return make_engine(fn, options, type(module).__qualname__, roots, forward, True,
                       method=True)


def live_handles() -> list[Handle]:
    """Every live graphed callable (functions, methods, wrappers and region modules)."""
    return list(_handles)


def live_engines() -> list[Engine]:
    return [h.engine for h in live_handles()]
