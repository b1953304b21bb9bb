"""The user-facing wrappers: a decorated function or method, and a wrapped module.

Both are ``wrapt`` proxies, so names, docstrings, signatures, ``inspect`` and
``isinstance`` behave as on the original.  A method (``nn.Module.forward`` decorated in
the class body) gets one engine per instance, held weakly: a garbage-collected module
takes its graphs with it.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any, SupportsIndex

import wrapt
from torch import nn

from . import stats as _stats
from .buckets import positional_names
from .engine import Engine
from .guards import Watch
from .options import Options
from .region import nested

# every live engine, for autograph.reset()
_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


def _make_engine(fn: Callable[..., Any], options: Options, name: str,
                 roots: Callable[[], list[nn.Module]], code: Callable[..., Any] | None,
                 hooks_of_roots: bool, training: Callable[[], bool | None],
                 method: bool) -> Engine:
    if code is not None:
        check_argument_keys(options, code, skip_self=method)
    stats = _stats.register(name)
    names = positional_names(code, skip_self=method) if code is not None else []
    engine = Engine(fn, options, stats, Watch(roots, code, hooks_of_roots), training, names)
    _engines.add(engine)
    return engine


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


def _no_training() -> None:
    return None


def make_module_engine(module: nn.Module, options: Options, fn: Callable[..., Any],
                       weak: bool) -> Engine:
    """The engine that graphs calls of a module instance (its forward and hooks).

    ``weak``: hold the module by a weak reference only (region engines, which must not
    keep their module alive); a wrapper holds it anyway.
    """
    ref: Callable[[], nn.Module | None] = weakref.ref(module) if weak else (lambda: module)

    def roots() -> list[nn.Module]:
        m = ref()
        return [m] if m is not None else []

    def training() -> bool | None:
        m = ref()
        return m.training if m is not None else None

    forward = getattr(type(module), "forward", None)
    return _make_engine(fn, options, type(module).__qualname__, roots, forward, True, training,
                        method=True)


class _Dispatch:
    """The wrapt wrapper function: finds the engine for the call and runs it."""

    def __init__(self, fn: Callable[..., Any], options: Options) -> None:
        self.fn = fn
        self.options = options
        # a bound method (``graphed(lin.forward)``): wrapt calls with ``instance`` set to
        # its ``__self__``, whose engine it is; the call passes the instance once, to the
        # underlying function, and a module's parameters are watched as for a forward
        self.bound = _bound_self(fn) is not None
        self.func: Callable[..., Any] = fn.__func__ if self.bound else fn  # type: ignore
        self.engine: Engine | None = None
        self.instances: dict[int, tuple[weakref.ref[Any], Engine]] = {}
        self.lock = threading.Lock()

    def __call__(self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        if instance is None or isinstance(instance, type):
            engine = self.engine
            if engine is None:
                engine = self._function_engine(wrapped)
        else:
            item = self.instances.get(id(instance))
            if item is None or item[0]() is not instance:
                item = self._instance_engine(instance)
            engine = item[1]
        front = engine.front
        return engine(args, kwargs) if front is None else front(args, kwargs)

    def _function_engine(self, wrapped: Callable[..., Any]) -> Engine:
        with self.lock:
            if self.engine is None:
                name = getattr(self.fn, "__qualname__", repr(self.fn))
                self.engine = _make_engine(wrapped, self.options, name, list, self.fn,
                                           False, _no_training, method=False)
            return self.engine

    def _instance_engine(self, instance: Any) -> tuple[weakref.ref[Any], Engine]:
        key = id(instance)
        instances = self.instances

        def forget(_ref: Any) -> None:
            item = instances.get(key)
            if item is not None and item[0] is _ref:
                del instances[key]
                item[1].watch.close()

        ref = weakref.ref(instance, forget)
        fn = self.func

        def call(*args: Any, **kwargs: Any) -> Any:
            return fn(ref(), *args, **kwargs)

        is_module = isinstance(instance, nn.Module)

        def roots() -> list[nn.Module]:
            obj = ref()
            return [obj] if is_module and obj is not None else []

        def training() -> bool | None:
            return ref().training if is_module else None  # type: ignore[union-attr]

        name = f"{type(instance).__qualname__}.{getattr(fn, '__name__', 'call')}"
        engine = _make_engine(call, self.options, name, roots, fn, False, training, method=True)
        with self.lock:
            item = instances[key] = (ref, engine)
        return item

    def engines(self) -> list[Engine]:
        out = [item[1] for item in list(self.instances.values())]
        return out + ([self.engine] if self.engine is not None else [])


def _bound_self(fn: Any) -> Any:
    """The instance of a bound method (not of a classmethod bound to its class), or None."""
    if inspect.ismethod(fn) and not isinstance(fn.__self__, type):
        return fn.__self__
    return None


class BoundGraphedFunction(wrapt.BoundFunctionWrapper):  # type: ignore[misc]
    """A graphed method bound to an instance (``model.forward``) or looked up on its
    class: it pickles and copies as a bound method does, by instance and name."""

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        instance = self._self_instance
        owner = instance if instance is not None else self._self_owner
        return (getattr, (owner, self.__wrapped__.__name__))

    def __reduce__(self) -> Any:
        return self.__reduce_ex__(2)

    def reset(self) -> None:
        """Drop the graphs of this instance's method (of every instance, looked up on the
        class)."""
        if self._self_instance is None:
            self._self_parent.reset()
        else:
            reset(self)

    @property
    def __func__(self) -> Any:  # as for a method: what the class holds, the graphed function
        return self._self_parent


class GraphedFunction(wrapt.FunctionWrapper):  # type: ignore[misc]
    """A function or method whose calls run through autograph."""

    __bound_function_wrapper__ = BoundGraphedFunction

    def __init__(self, fn: Callable[..., Any], options: Options) -> None:
        dispatch = _Dispatch(fn, options)
        super().__init__(fn, dispatch)
        self._self_dispatch = dispatch

    def reset(self) -> None:
        """Drop every graph of this function (of every instance, for a method)."""
        for engine in self._self_dispatch.engines():
            engine.reset()

    # -- copies and pickles behave as the original function's ---------------------------
    def __copy__(self) -> GraphedFunction:
        return self  # like a function: a copy is the function itself (and its graphs)

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphedFunction:
        wrapped = copy.deepcopy(self.__wrapped__, memo)  # a bound method copies its self
        if wrapped is self.__wrapped__:
            return self
        return GraphedFunction(wrapped, self._self_dispatch.options)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        if _importable_as(self, self.__wrapped__):
            return self.__wrapped__.__qualname__  # decorated at module level: by reference
        return (_rewrap_function, (self.__wrapped__, self._self_dispatch.options))

    def __reduce__(self) -> Any:
        return self.__reduce_ex__(2)

    def __prepare_scriptable__(self) -> Any:
        raise TypeError(_SCRIPT_ERROR.format(what="function"))

    @property
    def _torchscript_modifier(self) -> Any:
        # read by torch.jit.script, and only there, on a module whose forward is decorated
        raise TypeError(_SCRIPT_ERROR.format(what="forward (decorated with @autograph.graphed)"))


_SCRIPT_ERROR = (
    "autograph: torch.jit.script cannot script a graphed {what}: autograph captures and "
    "replays CUDA graphs in Python, which TorchScript cannot compile. Script the original "
    "(`wrapper.__wrapped__`, or the module without the decorator), which then runs without "
    "autograph; see docs/compatibility.md (torch.jit.script, torch.compile, torch.export)."
)


def _importable_as(obj: Any, original: Any) -> bool:
    """True if ``obj`` is what its module and qualified name look up (pickle by name)."""
    module_name = getattr(original, "__module__", None)
    qualname = getattr(original, "__qualname__", None)
    if not module_name or not qualname or "<locals>" in qualname:
        return False
    try:  # as pickle looks it up
        found: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return False
    return found is obj


def _rewrap_function(fn: Callable[..., Any], options: Options) -> GraphedFunction:
    return GraphedFunction(fn, options)


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
        self._self_engine = make_module_engine(module, options, nested(module), weak=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        engine = self._self_engine
        front = engine.front
        return engine(args, kwargs) if front is None else front(args, kwargs)

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

    def __prepare_scriptable__(self) -> Any:
        raise TypeError(_SCRIPT_ERROR.format(what="module"))


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


def _graphed_parent(obj: Any) -> GraphedFunction | None:
    """The graphed function behind ``obj`` if it is one bound to an instance
    (``model.forward`` where ``forward`` is decorated), else None."""
    if isinstance(obj, BoundGraphedFunction):
        return obj._self_parent  # type: ignore[no-any-return]
    return None


def _refuse(obj: Any) -> None:
    """A clear ``TypeError`` for what ``graphed`` cannot graph."""
    if isinstance(obj, (GraphedModule, GraphedFunction)) or _graphed_parent(obj) is not None:
        raise TypeError("autograph.graphed: this object is already graphed")
    if inspect.isclass(obj):
        hint = (f"wrap an instance, `autograph.graphed({obj.__name__}(...))`, or decorate "
                f"its forward in the class body" if issubclass(obj, nn.Module) else
                "decorate the method that does the tensor work, or wrap an instance's "
                "bound method (`autograph.graphed(obj.method)`)")
        raise TypeError(f"autograph.graphed cannot graph a class ({obj.__qualname__}): it "
                        f"would wrap the constructor, not the instances' calls; {hint}")
    if isinstance(obj, nn.Module):
        forward = inspect.getattr_static(type(obj), "forward", None)
        if isinstance(forward, GraphedFunction):
            raise TypeError(
                f"autograph.graphed: {type(obj).__qualname__}.forward is already decorated "
                f"with @autograph.graphed, so calls of this module are graphed already (with "
                f"the decorator's options); call the module as it is, or remove the "
                f"decorator to wrap the instance with other options")
    fn = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    kind = ("an async generator function" if inspect.isasyncgenfunction(fn) else
            "a generator function" if inspect.isgeneratorfunction(fn) else
            "an async function" if inspect.iscoroutinefunction(fn) else None)
    if kind is not None:
        raise TypeError(
            f"autograph.graphed cannot graph {kind} ({getattr(fn, '__qualname__', fn)!r}): "
            f"its body runs after the call returns, outside any graph; graph the ordinary "
            f"function that each step calls, and call that from the "
            f"{'generator' if 'generator' in kind else 'coroutine'}")


def wrap(obj: Any, options: Options) -> Any:
    """``graphed(obj)``: a module instance gets a proxy, a callable a function wrapper."""
    _refuse(obj)
    if isinstance(obj, nn.Module):
        return GraphedModule(obj, options)
    if isinstance(obj, (staticmethod, classmethod)) or callable(obj):
        fn = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
        # a function defined in a class body takes self first (a method); a bound
        # method's signature has no self
        check_argument_keys(options, fn, skip_self=_takes_self(fn, obj))
        return GraphedFunction(obj, options)
    raise TypeError(
        f"autograph.graphed expects a function, a method or an nn.Module instance, "
        f"got {type(obj).__qualname__}"
    )


def _takes_self(fn: Any, obj: Any) -> bool:
    if isinstance(obj, staticmethod) or _bound_self(fn) is not None:
        return False
    if isinstance(obj, classmethod):
        return True
    try:
        first = next(iter(inspect.signature(fn).parameters), None)
    except (TypeError, ValueError):
        return False
    return first in ("self", "cls")


def _bound_engine(obj: Any, make: bool) -> Engine | None:
    """The engine of a graphed function bound to an instance: ``model.forward`` where
    forward is decorated, or ``graphed(lin.forward)``; made now if ``make``."""
    parent = _graphed_parent(obj)
    if parent is not None and obj._self_instance is not None:
        dispatch, instance = parent._self_dispatch, obj._self_instance
    elif isinstance(obj, GraphedFunction) and obj._self_dispatch.bound:
        dispatch, instance = obj._self_dispatch, _bound_self(obj.__wrapped__)
    else:
        return None
    item = dispatch.instances.get(id(instance))
    if item is None or item[0]() is not instance:
        if not make:
            return None
        item = dispatch._instance_engine(instance)
    return item[1]


def live_engines() -> list[Engine]:
    """Every live engine (functions, methods, wrappers and region engines)."""
    return list(_engines)


def _is_graphed(obj: Any) -> bool:
    return isinstance(obj, GraphedFunction) or _graphed_parent(obj) is not None


def _engines_of(obj: Any) -> list[Engine]:
    if isinstance(obj, GraphedModule):
        return [obj._self_engine]
    parent = _graphed_parent(obj)
    if parent is not None:
        if obj._self_instance is None:  # looked up on the class: every instance's
            return parent._self_dispatch.engines()
        engine = _bound_engine(obj, make=False)
        return [engine] if engine is not None else []
    if isinstance(obj, GraphedFunction):
        return obj._self_dispatch.engines()
    return [e for e in list(_engines) if any(r is obj for r in e.watch._roots())]


def engine_of(obj: Any) -> Engine:
    """The engine that a call of ``obj`` runs through, made now if it does not exist yet
    (a graphed function, a wrapper, or a module whose forward is graphed)."""
    if isinstance(obj, GraphedModule):
        return obj._self_engine  # type: ignore[no-any-return]
    bound = _bound_engine(obj, make=True)
    if bound is not None:
        return bound
    if isinstance(obj, GraphedFunction):
        dispatch = obj._self_dispatch
        return dispatch.engine or dispatch._function_engine(obj.__wrapped__)
    forward = inspect.getattr_static(type(obj), "forward", None)
    if isinstance(forward, GraphedFunction):
        dispatch = forward._self_dispatch
        item = dispatch.instances.get(id(obj))
        if item is None or item[0]() is not obj:
            item = dispatch._instance_engine(obj)
        return item[1]
    engines = _engines_of(obj)
    if len(engines) == 1:  # a module a region has graphed
        return engines[0]
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
        for engine in list(_engines):
            engine.reset()
        return
    engines = _engines_of(obj)
    if not engines and not _is_graphed(obj):
        raise TypeError(f"autograph.reset: {type(obj).__qualname__} is not graphed")
    for engine in engines:
        engine.reset()
