"""``graphed(obj)``: the wrapper for what is graphed (a module instance gets the proxy
of ``proxy``, a function or method the wrapper of ``functions``), and a clear
``TypeError`` for what cannot be graphed.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from .engines import check_argument_keys
from .functions import GraphedFunction, _bound_self, _graphed_parent, _rewrap_function
from .options import Options
from .proxy import GraphedModule, _rewrap
from .vocab import deferred_body

__all__ = ["wrap"]

# pickles made before functions.py and proxy.py were split out of this module name
# their rebuilders here (autograph.wrappers._rewrap, ._rewrap_function): they stay
_PICKLED_BY_NAME = (_rewrap, _rewrap_function)


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
    kind = deferred_body(fn)
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
        obj = _call_method(obj)
        fn = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
        # a function defined in a class body takes self first (a method); a bound
        # method's signature has no self
        check_argument_keys(options, fn, skip_self=_takes_self(fn, obj))
        return GraphedFunction(obj, options)
    raise TypeError(
        f"autograph.graphed expects a function, a method or an nn.Module instance, "
        f"got {type(obj).__qualname__}"
    )


def _call_method(obj: Any) -> Any:
    """An instance of a class that defines ``__call__`` in Python, as its bound
    ``__call__``: the graphs then guard the instance's attributes that the method reads,
    as for any bound method (the object itself, graphed, baked them in unguarded)."""
    if inspect.isroutine(obj) or isinstance(obj, (staticmethod, classmethod, type)):
        return obj
    call = inspect.getattr_static(type(obj), "__call__", None)
    if inspect.isfunction(call):
        return obj.__call__
    return obj


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
