"""The user-facing wrappers: a decorated function or method, and a wrapped module.

Both are ``wrapt`` proxies, so names, docstrings, signatures, ``inspect`` and
``isinstance`` behave as on the original.  A method (``nn.Module.forward`` decorated in
the class body) gets one engine per instance, held weakly: a garbage-collected module
takes its graphs with it.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any, SupportsIndex

import wrapt
from torch import nn

from .dispatch import Engine
from .engines import (
    Handle,
    check_argument_keys,
    live_engines,
    make_engine,
    make_module_engine,
)
from .options import Options
from .region import nested, routing

__all__ = ["GraphedFunction", "GraphedModule", "live_engines", "make_module_engine", "wrap"]


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
        fn = self.func

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
        instance = self._self_instance
        if instance is None:
            self._self_parent.reset()
            return
        item = self._self_parent._self_dispatch.instances.get(id(instance))
        if item is not None and item[0]() is instance:
            item[1].engine.reset()

    @property
    def __func__(self) -> Any:  # as for a method: what the class holds, the graphed function
        return self._self_parent


class GraphedFunction(wrapt.FunctionWrapper):  # type: ignore[misc]
    """A function or method whose calls run through autograph."""

    _autograph_graphed = True  # what regions look for on a decorated forward
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
        self._self_handle = make_module_engine(module, options, nested(module), weak=False)
        self._self_engine = self._self_handle.engine

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._self_handle.call(args, kwargs)

    def __getattr__(self, name: str) -> Any:
        """The module's attribute; a method of the module's own class (``generate``, a
        custom ``predict``) comes wrapped so that the calls it makes of the module run
        through this wrapper's engine, as ``wrapper(...)`` does."""
        if name.startswith("_self_"):
            raise AttributeError(name)
        value = getattr(self.__wrapped__, name)
        if (inspect.ismethod(value) and value.__self__ is self.__wrapped__
                and name not in _MODULE_API and not name.startswith("__")):
            return _routed(value, self.__wrapped__, self._self_handle)
        return value

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


# nn.Module's own methods: none calls the module, so they are returned unwrapped
_MODULE_API = frozenset(name for name in dir(nn.Module) if callable(getattr(nn.Module, name)))


def _routed(method: Callable[..., Any], module: Any, handle: Handle) -> Callable[..., Any]:
    """``method`` with the module calls it makes routed through ``handle``."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with routing(module, handle):
            return method(*args, **kwargs)

    return call


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
