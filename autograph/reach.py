"""What a call of the user's code reaches besides its arguments, walked once.

Two learners need the same walk: ``rng.host_generators`` (a ``random.Random`` whose
draws decide what the call runs) and ``containers.held`` (a list the call appends to).
Both look where a call reads Python objects a replay would not read again: what a
``functools.partial`` or a default argument binds, the graphed method's object, and what
the code names as globals or closure cells, followed into the user's helper functions
it names (once each, at most :data:`MAX_FUNCTIONS`).  :func:`reach` computes that once,
as a :class:`Reach`, and each learner picks the values it cares about.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Iterable
from typing import Any, NamedTuple

from torch import nn

from .coderefs import (
    _attribute_loads,
    _attribute_names,
    _cell_getter,
    _codes_of,
    _global_names,
    _unwrapped,
    _user_class,
    user_function,
)

MAX_FUNCTIONS = 64  # the functions read: the code and the helpers it names


class Named(NamedTuple):
    """A value that a function's code names: a global it loads or a closure cell."""

    label: str
    value: Any
    reads: frozenset[str]  # the attributes the code reads of it directly (``cfg.items``)


@dataclasses.dataclass(frozen=True)
class Reach:
    """The Python objects a call reaches besides its arguments."""

    bound: list[tuple[str, Any]]  # what a partial or a default argument binds
    owner: Any  # the graphed method's object, or None
    owner_named: list[tuple[str, Any]]  # its attributes under names its code uses
    named: list[Named]  # globals and cells of the code, its helpers, modules' forwards
    codes: tuple[types.CodeType, ...] = ()  # the code of each of those functions


def reach(fn: Any, modules: Iterable[nn.Module], owner: Any = None) -> Reach:
    """What a call of ``fn`` (a function, a partial, a bound method; ``owner``: the
    object whose method it is, where ``fn`` is no bound method) reaches by name, with the
    ``forward`` of each of ``modules`` of a user's class."""
    bound: list[tuple[str, Any]] = []
    while isinstance(fn, functools.partial):  # what it binds, then its function
        bound += [("partial", v) for v in (*fn.args, *fn.keywords.values())]
        fn = fn.func
    if owner is None:
        owner = getattr(fn, "__self__", None)
    inner = _unwrapped(fn)
    bound += [("default", v) for v in (
        *(getattr(inner, "__defaults__", None) or ()),
        *(getattr(inner, "__kwdefaults__", None) or {}).values())]
    owner_named: list[tuple[str, Any]] = []
    if owner is not None and isinstance(getattr(owner, "__dict__", None), dict):
        names = _attribute_names(type(owner), _codes_of(inner))  # ``self.history``
        owner_named = [(f"{type(owner).__name__}.{k}", v) for k, v in vars(owner).items()
                       if k in names]
    else:
        owner = None
    codes = [inner] + [_unwrapped(type(m).forward) for m in modules
                       if _user_class(type(m)) and getattr(type(m), "forward", None)]
    walked: list[types.CodeType] = []
    named = named_values(codes, walked)
    return Reach(bound, owner, owner_named, named, tuple(walked))


def named_values(functions: Iterable[Any], codes: list[types.CodeType] | None = None
                 ) -> list[Named]:
    """The globals and closure cells that ``functions`` name, and those that the user's
    functions they name (helpers, held as globals or cells) name in turn; the code of
    each function walked is appended to ``codes``."""
    out: list[Named] = []
    codes = [] if codes is None else codes
    todo, seen = list(functions), set[int]()
    for f in todo:  # grows by the helpers named
        code, glb = getattr(f, "__code__", None), getattr(f, "__globals__", None)
        if code is None or glb is None or id(f) in seen or len(seen) >= MAX_FUNCTIONS:
            continue
        seen.add(id(f))
        codes.append(code)
        reads = _attribute_loads(code)
        found = [Named(name, glb.get(name), reads.get(name, frozenset()))
                 for name in sorted(_global_names(code)[0])]
        found += [Named(name, _cell_getter(cell)(), reads.get(name, frozenset()))
                  for name, cell in zip(code.co_freevars, getattr(f, "__closure__", None) or ())]
        out += found
        todo += [n.value for n in found if user_function(n.value)]
    return out
