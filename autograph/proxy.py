"""A graphed module: a ``wrapt`` proxy of an ``nn.Module`` instance.

Calling it runs the module graphed; everything else is the module's own (attributes,
``isinstance``), methods that return the module return the proxy, and the module's own
methods come routed through the proxy's engine.  It copies and pickles as a proxy.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from typing import Any, SupportsIndex

import wrapt
from torch import nn

from .engines import Handle, make_module_engine
from .functions import _SCRIPT_ERROR
from .options import Options
from .region import nested, routing

__all__ = ["GraphedModule"]


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
        module = self.__wrapped__
        value = getattr(module, name)
        if (inspect.ismethod(value) and value.__self__ is module and name not in _MODULE_API
                and not name.startswith("__") and not _forward(module, value)):
            return _routed(value, module, self._self_handle, self)
        return value

    @property
    def reset(self) -> Callable[..., Any]:
        """The module's own ``reset`` where it has one (a recurrent policy's, starting
        an episode: ``autograph.reset(wrapper)`` drops the graphs then), else a function
        that drops every graph of this module."""
        if hasattr(self.__wrapped__, "reset"):
            return self.__getattr__("reset")  # type: ignore[no-any-return]
        return self._self_drop_graphs

    @reset.setter
    def reset(self, value: Any) -> None:
        self.__wrapped__.reset = value

    @reset.deleter
    def reset(self) -> None:
        delattr(self.__wrapped__, "reset")

    def _self_drop_graphs(self) -> None:
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


def _forward(module: Any, method: Any) -> bool:
    """Whether ``method`` is the module's class ``forward`` (stored under another name,
    as accelerate's ``_old_forward``): given unrouted, as ``wrapper.forward`` is (put
    back as the module's ``forward``, a routed one would hold the wrapper)."""
    return getattr(method, "__func__", None) is getattr(type(module), "forward", None)


def _routed(method: Callable[..., Any], module: Any, handle: Handle, proxy: Any
            ) -> Callable[..., Any]:
    """``method`` with the module calls it makes routed through ``handle``; a method
    returning the module itself (``model = graphed(net).prepare()``) returns the proxy,
    and a generator method's calls are routed while it runs (each step of it)."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def steps(*args: Any, **kwargs: Any) -> Any:
            return _routed_steps(method(*args, **kwargs), module, handle)

        return steps

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with routing(module, handle):
            result = method(*args, **kwargs)
        return proxy if result is module else result

    return call


def _routed_steps(inner: Any, module: Any, handle: Handle) -> Any:
    """The generator ``inner``, each of its steps run with the module's calls routed
    (a ``with`` around the whole generator would route the caller's code between
    steps too); values sent and exceptions thrown in pass through."""
    sent: Any = None
    thrown: BaseException | None = None
    while True:
        with routing(module, handle):
            try:
                value = inner.send(sent) if thrown is None else inner.throw(thrown)
            except StopIteration as stop:
                return stop.value
        sent, thrown = None, None
        try:
            sent = yield value
        except GeneratorExit:
            inner.close()
            raise
        except BaseException as exc:  # noqa: BLE001 - thrown in: the inner generator's
            thrown = exc


def _returns_self(name: str) -> property:
    """``wrapper.name``: the module's method of that name, returning the wrapper where
    it returns the module; or the module's own attribute of that name (a config's
    ``self.type = "relu"``), which is read, set and deleted on the module."""
    def get(self: GraphedModule) -> Any:
        module = self.__wrapped__
        value = getattr(module, name)
        if not (inspect.ismethod(value) and value.__self__ is module):
            return value
        if value.__func__ is not getattr(nn.Module, name, None):  # the user's own method
            return _routed(value, module, self._self_handle, self)

        @functools.wraps(value)
        def method(*args: Any, **kwargs: Any) -> Any:
            result = value(*args, **kwargs)
            return self if result is module else result

        return method

    def set(self: GraphedModule, value: Any) -> None:
        setattr(self.__wrapped__, name, value)

    def delete(self: GraphedModule) -> None:
        delattr(self.__wrapped__, name)

    return property(get, set, delete,
                    f"``module.{name}(...)``, returning the wrapper instead of the module.")


for _name in _RETURNS_SELF:
    setattr(GraphedModule, _name, _returns_self(_name))


def _rewrap(module: nn.Module, options: Options) -> GraphedModule:
    return GraphedModule(module, options)
