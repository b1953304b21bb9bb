"""Graphed functions and methods: ``wrapt`` function wrappers.

Names, docstrings, signatures, ``inspect`` and ``isinstance`` behave as on the
original.  A method (``nn.Module.forward`` decorated in the class body) gets one engine
per instance, held weakly: a garbage-collected module takes its graphs with it.  They
copy and pickle as the original function or bound method does.
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

from .dispatch import Engine
from .engines import Handle, make_engine
from .options import Options

__all__ = ["BoundGraphedFunction", "GraphedFunction"]


MAX_HELD = 16  # instances without weak references held per graphed method


class _Held:
    """A strong reference with ``weakref.ref``'s call (for an instance taking none)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


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
        # a partial over a bound method (``functools.partialmethod`` gives one) carries
        # the instance as ``__self__``, so wrapt passes it, but the partial binds it
        # already: it is called without it
        self.prebound = not self.bound and getattr(fn, "__self__", None) is not None
        self.handle: Handle | None = None
        self.instances: dict[int, tuple[Callable[[], Any], Handle]] = {}
        # a classmethod decorated in the class body: one engine per class it is called
        # on (``B.scale`` binds ``cls=B``; its class values are guarded per class)
        self.classes: dict[type, Handle] = {}
        self.lock = threading.Lock()

    def __call__(self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        if instance is None:
            handle = self.handle
            if handle is None:
                handle = self._function_engine(wrapped)
        elif isinstance(instance, type):
            handle = self.classes.get(instance)  # type: ignore[assignment]
            if handle is None:
                handle = self._class_engine(wrapped, instance)
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
                code, method = _code_of(self.fn)
                self.handle = make_engine(wrapped, self.options, name, list, code,
                                          False, method=method)
            return self.handle

    def _class_engine(self, wrapped: Callable[..., Any], cls: type) -> Handle:
        """The engine of calls bound to ``cls``: ``wrapped`` is the method wrapt bound
        to it (a classmethod's ``cls``, fixed), so the values its code reads of the
        class are guarded as for ``graphed(A.scale)``."""
        with self.lock:
            handle = self.classes.get(cls)
            if handle is None:
                fn_name = getattr(_code_of(self.fn)[0], "__name__", "call")
                handle = self.classes[cls] = make_engine(
                    wrapped, self.options, f"{cls.__qualname__}.{fn_name}", list, wrapped,
                    False, method=False)
            return handle

    def _instance_engine(self, instance: Any) -> tuple[Callable[[], Any], Handle]:
        key = id(instance)
        instances = self.instances

        def forget(_ref: Any) -> None:
            item = instances.get(key)
            if item is not None and item[0] is _ref:
                del instances[key]
                item[1].engine.watch.close()

        try:
            ref: Callable[[], Any] = weakref.ref(instance, forget)
        except TypeError:  # ``__slots__`` without ``__weakref__``, a NamedTuple
            ref = self._hold(instance)
        fn = self.func

        def call(*args: Any, **kwargs: Any) -> Any:
            return fn(ref(), *args, **kwargs)

        if self.prebound:
            call = fn  # noqa: F811 - the partial binds the instance itself

        is_module = isinstance(instance, nn.Module)

        def roots() -> list[nn.Module]:
            obj = ref()
            if obj is None:
                return []
            if is_module:
                return [obj]
            # a plain object (a trainer): the modules its attributes hold
            return [v for v in getattr(obj, "__dict__", {}).values() if isinstance(v, nn.Module)]

        name = f"{type(instance).__qualname__}.{getattr(fn, '__name__', 'call')}"
        # a module's method: its forward, without the module's hooks; a plain object's:
        # its modules are called, hooks and all
        handle = make_engine(call, self.options, name, roots, fn, not is_module,
                             method=not self.prebound,
                             owner=None if is_module else ref)
        with self.lock:
            item = instances[key] = (ref, handle)
        return item

    def _hold(self, instance: Any) -> Callable[[], Any]:
        """A strong reference to an instance that takes no weak one, for its engine:
        the last :data:`MAX_HELD` such instances are held (their ids cannot be reused
        meanwhile), the oldest one's engine is let go."""
        held = [k for k, (r, _) in self.instances.items() if isinstance(r, _Held)]
        for key in held[:max(0, len(held) - MAX_HELD + 1)]:
            item = self.instances.pop(key, None)
            if item is not None:
                item[1].engine.watch.close()
        return _Held(instance)

    def engines(self) -> list[Engine]:
        out = [item[1].engine for item in list(self.instances.values())]
        out += [handle.engine for handle in list(self.classes.values())]
        return out + ([self.handle.engine] if self.handle is not None else [])


def _code_of(fn: Any) -> tuple[Any, bool]:
    """The function whose parameters a call made without an instance binds, and whether
    the call leaves its first parameter out (a classmethod's ``cls``, which wrapt binds):
    per-argument options are resolved against what follows it."""
    if isinstance(fn, classmethod):
        return fn.__func__, True
    if isinstance(fn, staticmethod):
        return fn.__func__, False
    return fn, False


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

    @property
    def _self_bound_to(self) -> Any:
        """The instance this method is bound to, the class for a classmethod (wrapt
        binds ``@graphed @classmethod`` with no instance, the class as owner), or None
        (a method looked up on its class)."""
        if self._self_instance is None and self._self_binding == "classmethod":
            return self._self_owner
        return self._self_instance

    def reset(self) -> None:
        """Drop the graphs of this instance's method (of every instance, looked up on the
        class)."""
        instance = self._self_bound_to
        dispatch = self._self_parent._self_dispatch
        if instance is None:
            self._self_parent.reset()
            return
        if isinstance(instance, type):  # a classmethod looked up on a class
            handle = dispatch.classes.get(instance)
            if handle is not None:
                handle.engine.reset()
            return
        item = dispatch.instances.get(id(instance))
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


def _graphed_parent(obj: Any) -> GraphedFunction | None:
    """The graphed function behind ``obj`` if it is one bound to an instance
    (``model.forward`` where ``forward`` is decorated), else None."""
    if isinstance(obj, BoundGraphedFunction):
        return obj._self_parent  # type: ignore[no-any-return]
    return None
