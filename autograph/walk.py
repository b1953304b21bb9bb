"""The general walk of an object argument: its structure as a nested tuple, its tensors
listed in walk order (with where each sits, for messages).

``objects.object_key`` walks an object with :func:`walk` unless a keyer for its type is
registered (``known_types``).  Tensors leave a ``None`` slot (their keys come later, once
the call's device is known); Python scalars, strings, dtypes and devices are kept by
value (floats by their hex spelling); lists, tuples and dicts are walked; functions and
classes are kept themselves (with a function's closure and defaults), bound methods
and ``functools.partial`` by their parts; any other object by its attributes
(``__dict__`` and ``__slots__``, a callable object too).  The walk is bounded in
depth and size.
"""

from __future__ import annotations

import collections
import enum
import functools
import struct
import sys
import types
from typing import Any

import torch

from .vocab import EagerReason, Uncapturable

_Tensor = torch.Tensor
VALUES = (
    type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.layout,
    torch.memory_format, type(Ellipsis),
)
_MAX_DEPTH = 8


def float_bits(x: float) -> str:
    """A float's key: its ``hex()`` spelling (which tells -0.0 from 0.0), or for a NaN
    its bytes (``hex()`` spells every NaN alike; ``copysign`` and ``signbit`` tell a
    negative one apart)."""
    return x.hex() if x == x else "nan:" + struct.pack("<d", x).hex()


def number_key(x: Any) -> Any:
    """The key of a number that is no builtin int or float: a ``complex`` (by its
    parts' hex spellings) or a NumPy scalar (``np.float32(0.5)``: by its dtype and
    bits, so NaN keys stably); None for anything else."""
    if type(x) is complex:
        return (complex, float_bits(x.real), float_bits(x.imag))
    np = sys.modules.get("numpy")  # never imported for this: only if the caller has it
    if np is not None and isinstance(x, np.generic) and not isinstance(x, np.object_):
        return (type(x), x.dtype.str, x.tobytes())
    return None


_MAX_NODES = 20_000
# never opened: their state is not in attributes (sets), or is guarded elsewhere (modules)
_UNOPENED = (set, frozenset, torch.nn.Module)


class Walked:
    """One object argument as walked: the tensors it holds (with their paths)."""

    __slots__ = ("obj", "tensors", "paths", "counters", "memo", "bases")

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.tensors: list[torch.Tensor] = []
        # where each tensor sits, as text or as (layer, attribute) of a StaticCache
        # (formatted only for a message: most calls never need one)
        self.paths: list[Any] = []
        # Python ints keyed by phase, not value (``counters.Counter``; set by a keyer)
        self.counters: list[Any] | None = None
        # a keyer's record of this object's last keying (``known_types.Memo``), which
        # ``objects.finish`` reuses when the tensors' metadata is unchanged
        self.memo: Any = None
        # the storage addresses of ``tensors`` (set by ``objects.finish``): an argument
        # sharing one is told apart in the key and captured in place
        self.bases: frozenset[int] = frozenset()

    def path(self, k: int) -> str:
        """Where the ``k``-th tensor sits in the object, as text."""
        p = self.paths[k]
        return p if isinstance(p, str) else f"StaticCache.layers[{p[0]}].{p[1]}"


def walk(x: Any, walked: Walked, path: str, depth: int, counter: list[int]) -> Any:
    """The structure of ``x`` (tensors appended to ``walked``, their slot ``None``)."""
    counter[0] += 1
    if counter[0] > _MAX_NODES or depth > _MAX_DEPTH:
        raise Uncapturable(EagerReason.UNKEYABLE, f"argument object too deep or too large "
                           f"to key (at {path})")
    tx = type(x)
    if tx is _Tensor or isinstance(x, _Tensor):
        walked.tensors.append(x)
        walked.paths.append(path)
        return None
    if tx is float:
        return (float, float_bits(x))
    number = number_key(x)  # before VALUES: ``np.float64`` is a float (keyed by bits)
    if number is not None:
        return number
    if isinstance(x, VALUES) or isinstance(x, enum.Enum):
        return (tx, x)
    if tx is slice or tx is range:
        return (tx, tuple(walk(v, walked, path, depth + 1, counter)
                          for v in (x.start, x.stop, x.step)))
    if tx is list or tx is tuple:
        return ("seq", tx, tuple(walk(v, walked, f"{path}[{i}]", depth + 1, counter)
                                 for i, v in enumerate(x)))
    if tx is dict:
        return _mapping(x, list(x.items()), walked, path, depth, counter)
    if isinstance(x, (list, tuple, dict)):  # a subclass: its items and its attributes
        # what the container holds, past overridden ``__iter__``/``keys``/``items``
        # (an OrderedDict's in its order: ``move_to_end`` changes it)
        if isinstance(x, dict):
            items = _mapping(x, list(_items(x)), walked, path, depth, counter)
        else:
            held = list.__iter__(x) if isinstance(x, list) else tuple.__iter__(x)
            items = walk(tuple(held), walked, path, depth + 1, counter)
        own = {} if getattr(x, "__dict__", None) is x else (_attributes(x) or {})
        return ("subclass", tx, items, walk(own, walked, path, depth + 1, counter))
    if isinstance(x, _FUNCTIONS) or isinstance(x, type):
        return _function(x, walked, path, depth, counter)
    if tx is types.MethodType:  # a bound method: made anew at each attribute read
        return ("method", _function(x.__func__, walked, path, depth, counter),
                walk(x.__self__, walked, f"{path}.__self__", depth + 1, counter))
    if isinstance(x, functools.partial):
        return ("partial", walk(x.func, walked, f"{path}.func", depth + 1, counter),
                walk(x.args, walked, f"{path}.args", depth + 1, counter),
                walk(x.keywords, walked, f"{path}.keywords", depth + 1, counter))
    attrs = _attributes(x) if not isinstance(x, _UNOPENED) else None
    if attrs is None and callable(x) and not isinstance(x, _UNOPENED):
        return Held(x)  # a callable without attributes: itself, kept alive
    if attrs is None:
        where = f" (at {path})" if depth else ""
        raise Uncapturable(EagerReason.UNKEYABLE, f"argument of type {tx.__qualname__}{where} "
                           "(tensors, numbers, NumPy scalars, strings, None, dtypes, devices, "
                           "slices, ranges, containers "
                           "and objects with attributes are keyed)")
    names = tuple(attrs)
    return ("attrs", names, tuple(walk(v, walked, f"{path}.{k}", depth + 1, counter)
                                  for k, v in attrs.items()), tx)


MAX_ID_DICT_VALUES = 64  # values walked of a dict keyed by other than str and int


def _mapping(x: Any, pairs: list[tuple[Any, Any]], walked: Walked, path: str, depth: int,
             counter: list[int]) -> Any:
    """A dict's key: its string and int keys and walked values; a dict with other keys
    (looked up by identity maybe) by its identity, with the walked values of a small
    one (a config's ``{("q", 0): scale}``; not a table's)."""
    keys = tuple(k for k, _ in pairs)
    if all(type(k) is str or type(k) is int for k in keys):
        return ("map", keys, tuple(walk(v, walked, f"{path}[{k!r}]", depth + 1, counter)
                                   for k, v in pairs))
    if len(keys) > MAX_ID_DICT_VALUES:
        return ("id", type(x), id(x))
    return ("id", type(x), id(x), tuple(walk(v, walked, f"{path}[{k!r}]", depth + 1, counter)
                                         for k, v in pairs))


def _items(x: dict[Any, Any]) -> Any:
    """A dict subclass's items as the dict holds them, in its order."""
    return (collections.OrderedDict.items(x) if isinstance(x, collections.OrderedDict)
            else dict.items(x))


def slot_names(cls: type) -> tuple[str, ...]:
    """The attribute names of the slots of ``cls`` and its bases (``__slots__`` given
    as a string too; private ones as Python mangles them; not ``__dict__`` or
    ``__weakref__``)."""
    names: list[str] = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                owner = klass.__name__.lstrip("_")
                name = f"_{owner}{name}" if owner else name
            names.append(name)
    return tuple(names)


class Held:
    """An object in a key by identity, kept alive by it (so that no other object takes
    its id while the key lives), whether or not it hashes."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return type(other) is Held and other.obj is self.obj

    def __repr__(self) -> str:
        return f"Held({type(self.obj).__qualname__} at {id(self.obj):#x})"


_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodWrapperType,
              types.WrapperDescriptorType, types.MethodDescriptorType,
              types.ClassMethodDescriptorType)


def _function(fn: Any, walked: Walked, path: str, depth: int, counter: list[int]) -> Any:
    """A function or class for its key: itself (the key holds it: a new one cannot take
    a freed one's id and with it its graphs), a class with its plain values, a Python
    function by its code and what its closure cells, defaults and the globals its code
    names hold (Python modules left out), walked as an argument is (``lambda t: t * s``
    with another ``s``, or an object whose attribute changed, is another key; an
    ``nn.Module`` there makes the argument unkeyable)."""
    if isinstance(fn, type):  # a class: with the plain values it holds (``K.k = 5``)
        plain = tuple((k, walk(v, walked, f"{path}.{k}", depth + 1, counter))
                      for k, v in vars(fn).items()
                      if type(v) is float or isinstance(v, (*VALUES, enum.Enum)))
        return ("class", Held(fn), plain)
    code = getattr(fn, "__code__", None)
    if code is None or type(fn) is not types.FunctionType:
        return Held(fn)
    cells = tuple(walk(c.cell_contents, walked, f"{path}.<closure {i}>", depth + 1, counter)
                  if _filled(c) else MISSING_CELL for i, c in enumerate(fn.__closure__ or ()))
    defaults = walk((fn.__defaults__, fn.__kwdefaults__), walked, f"{path}.<defaults>",
                    depth + 1, counter)
    glb = fn.__globals__
    read = tuple((name, walk(glb[name], walked, f"{path}.<global {name}>", depth + 1, counter))
                 for name in code.co_names
                 if name in glb and not isinstance(glb[name], types.ModuleType))
    # by its code, not itself: a lambda made anew per call with the same values is the
    # same call
    return ("function", code, Held(glb), cells, defaults, read)


MISSING_CELL = ("empty cell",)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _attributes(x: Any) -> dict[str, Any] | None:
    """The instance attributes of ``x`` (``__dict__`` and filled ``__slots__``), or None
    for an object without any (keyed by identity then)."""
    d = getattr(x, "__dict__", None)
    out: dict[str, Any] = dict(d) if isinstance(d, dict) else {}
    for name in slot_names(type(x)):
        if name in out:
            continue
        try:
            out[name] = getattr(x, name)
        except AttributeError:
            continue
    if not out and not isinstance(d, dict):
        return None
    return out
