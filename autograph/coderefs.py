"""What a function names in its globals and closure cells, re-read on every call.

A graph replays the decisions its function took from module-level state: a global
flag, a scale in a closure, a module it calls by name.  :func:`code_refs` lists, for the
modules, tensors and plain scalars that the function's code names (in its globals,
including nested functions' names, and its closure cells), a getter and the value seen;
:func:`owner_refs` and :func:`class_refs` do the same for the attributes of a graphed
method's object and the class attributes a module's ``forward`` reads;
:func:`same` tells whether a value read again is still the one seen (the same object,
or an equal scalar of the same type).  ``guards.Watch`` compares them per call.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import dis
import enum
import functools
import inspect
import itertools
import math
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .returned import DISTRIBUTIONS
from .walk import slot_names


def _numpy_scalar_type() -> type:
    """numpy's scalar base class (``np.int64(5)`` is a value too), or bool without numpy."""
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is optional
        return bool
    return numpy.generic  # type: ignore[no-any-return]


_numpy_scalar = _numpy_scalar_type()
_SCALARS = (bool, int, float, complex, str, bytes, type(None), range, slice, _numpy_scalar)
MISSING = object()  # a name or cell that holds nothing (any more)


def same(now: Any, then: Any) -> bool:
    """Whether a value a graph baked in is still the same: the very object, or a
    scalar of the same type and value, the sign of a zero included (``x / eps`` with
    ``eps`` 0.0 or -0.0 gives infinities of either sign), an equal device, or a tuple
    of the same length whose items are the same."""
    if now is then:
        return True
    if isinstance(then, _SCALARS) and type(now) is type(then):
        try:
            if now != now and then != then:  # NaN set again
                return True
            return bool(now == then) and _signs(now) == _signs(then)
        except (TypeError, ValueError):  # a numpy scalar of no plain truth value
            return False
    if type(now) is not type(then):
        return False
    if isinstance(then, frozenset):
        return bool(now == then)
    if isinstance(then, torch.device):  # ``x.device``: a new object each time
        return bool(now == then)
    if isinstance(then, tuple):  # ``(x.shape[0], 8)`` set again every step
        return len(now) == len(then) and all(map(same, now, then))
    return False


def _signs(value: Any) -> Any:
    """The signs of a float's or complex's zero parts (others: None)."""
    if isinstance(value, float):
        return math.copysign(1.0, value) if value == 0 else None
    if isinstance(value, complex):
        return _signs(value.real), _signs(value.imag)
    kind = getattr(getattr(value, "dtype", None), "kind", None)  # a numpy scalar's
    if kind == "f":
        return _signs(float(value))
    if kind == "c":
        return _signs(complex(value))
    return None


def same_items(now: Mapping[str, Any], then: Mapping[str, Any]) -> bool:
    """Whether two attribute dictionaries hold the same values (:func:`same` for
    scalars, so a zero's sign counts; ``==`` for the rest)."""
    if now.keys() != then.keys():
        return False
    for k, v in now.items():
        w = then[k]
        if v is w:
            continue
        if isinstance(w, _SCALARS):
            if not same(v, w):
                return False
        elif not bool(v == w):
            return False
    return True


def _chain(fn: Any) -> list[Any]:
    """The function and those it wraps (``__wrapped__``: ``functools.wraps``,
    ``@torch.no_grad()``, transformers' layer decorators), outermost first: each one's
    code runs on a call.  A bound method's function stands for the method."""
    fn = getattr(fn, "__func__", fn)
    out = [fn]
    while (inner := getattr(out[-1], "__wrapped__", None)) is not None and len(out) < 16:
        out.append(getattr(inner, "__func__", inner))
    return out


def _unwrapped(fn: Any) -> Any:
    """The innermost function (see :func:`_chain`)."""
    return _chain(fn)[-1]


def code_refs(fn: Callable[..., Any]) -> list[tuple[Callable[[], Any], Any]]:
    """Getters for the modules, tensors and plain values that ``fn`` (and each function
    it wraps, see :func:`_chain`) names in its globals and closure cells, with their
    current values; the globals it assigns, of any value (a replay would not assign
    them); and the plain values held by the classes it names as globals under an
    attribute name its code uses (``Cfg.flag``).  torch's own wrappers are skipped."""
    if isinstance(fn, functools.partial):
        return _partial_refs(fn)
    out: list[tuple[Callable[[], Any], Any]] = []
    inner = _unwrapped(fn)
    for f in _chain(fn):
        code = getattr(f, "__code__", None)
        if code is None or (f is not inner and not _user_module(f)):
            continue
        out += _function_refs(f, code, cells=f is inner)  # a decorator's cells: its set-up
    defaults = (*(getattr(inner, "__defaults__", None) or ()),
                *(getattr(inner, "__kwdefaults__", None) or {}).values())
    out += [_fixed(v) for v in defaults if isinstance(v, nn.Module)]  # watched as roots
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, type) and _user_class(owner):  # a classmethod: ``cls.flag``
        out += _class_values(owner, _attribute_names(owner, _codes_of(fn)))
    return out


def _partial_refs(fn: functools.partial[Any]) -> list[tuple[Callable[[], Any], Any]]:
    """:func:`code_refs` of a ``functools.partial``: its function's, the modules it binds
    (watched as roots: a weight replaced, ``eval()``), and the attributes its code reads
    of the plain objects it binds (an instance, as a method's ``self``)."""
    func = fn.func
    out = code_refs(func)
    bound = [*fn.args, *fn.keywords.values()]
    owner = getattr(func, "__self__", None)
    if owner is not None and not isinstance(owner, type):
        bound.append(owner)
    for value in bound:
        if isinstance(value, nn.Module):
            out.append(_fixed(value))
        elif _plain_object(value):
            out += owner_refs(value, func)
    return out


def _held_modules(value: Any, depth: int = 0) -> list[nn.Module]:
    """The modules a plain tuple, list or dict holds as items, or inside such items
    (an ensemble, ``[(encoder, decoder)]``), or none: each is watched as a root
    (``eval()``, an attribute, a hook on a member)."""
    if type(value) not in (tuple, list, dict) or not value or depth > 1:
        return []
    items = value.values() if isinstance(value, dict) else value
    out: list[nn.Module] = []
    for v in items:
        out += [v] if isinstance(v, nn.Module) else _held_modules(v, depth + 1)
    return out


def _fixed(value: Any) -> tuple[Callable[[], Any], Any]:
    """A reference that never changes (a module held by a partial or a default): the
    watch takes its modules as roots."""
    return (lambda: value), value


def _plain_object(value: Any) -> bool:
    return isinstance(_safe_getattr(value, "__dict__"), dict) and not isinstance(
        value, (nn.Module, torch.Tensor, type, types.FunctionType, types.MethodType))


def _function_refs(fn: Any, code: types.CodeType, cells: bool = True
                   ) -> list[tuple[Callable[[], Any], Any]]:
    out: list[tuple[Callable[[], Any], Any]] = []
    glb = getattr(fn, "__globals__", {})
    loads, stores = _global_names(code)
    attributes: set[str] | None = None
    for name in sorted(loads | stores):
        value = glb.get(name, MISSING)
        if name in stores or _trackable(value) or _function(value):
            out.append((_global_getter(glb, name), value))
        elif held := _held_modules(value):  # an ensemble in a tuple or list: watched
            out += [_fixed(m) for m in held]
            # rebinding the name is seen (compared by identity); a list's items are not
            out.append((_global_getter(glb, name), value))
        elif isinstance(value, type) and _user_class(value):
            if attributes is None:
                attributes = _code_names(code)
            # the name itself (rebound to another class), then the values it holds
            out.append((_global_getter(glb, name), value))
            out += _class_values(value, attributes)
        elif _namespace(value):
            reads = _attribute_loads(code)
            out.append((_global_getter(glb, name), value))
            out += _namespace_values(value, reads.get(name, ()), reads, name)
        elif _rebindable(value):  # a dict, list, array, type...: rebinding it is seen
            out.append((_global_getter(glb, name), value))
    closure = (getattr(fn, "__closure__", None) or ()) if cells else ()
    for name, cell in zip(code.co_freevars, closure):
        try:
            value = cell.cell_contents
        except ValueError:  # empty cell
            continue
        if _trackable(value) or _function(value):
            out.append((_cell_getter(cell), value))
        elif held := _held_modules(value):
            out += [_fixed(m) for m in held]
            out.append((_cell_getter(cell), value))
        elif _namespace(value):
            reads = _attribute_loads(code)
            out.append((_cell_getter(cell), value))
            out += _namespace_values(value, reads.get(name, ()), reads, name)
        elif _rebindable(value):
            out.append((_cell_getter(cell), value))
    return out


def _rebindable(value: Any) -> bool:
    """A value a name holds that is compared by identity only (``CFG = {...}`` rebound
    to another dict, a list, a numpy array, ``float`` for ``int``): what it holds is
    not watched, but the name given another object is.  Not a module (``torch``, ``F``:
    never rebound, and read by every forward) or a builtin the name does not hold."""
    return value is not MISSING and not isinstance(value, types.ModuleType)


def _namespace(value: Any) -> bool:
    """A user's module or plain object named as a global for the settings it holds
    (``import config; config.SCALE``, a ``SimpleNamespace``, a dataclass instance):
    not the standard library's, torch's or numpy's."""
    if isinstance(value, types.ModuleType):
        top = value.__name__.partition(".")[0]
    elif isinstance(value, threading.local):  # settings per thread (read as each sees them)
        return True
    elif isinstance(value, types.SimpleNamespace) or (
            type(value).__name__ == "Namespace" and type(value).__module__ == "argparse"):
        return True  # (``args = parser.parse_args()``)
    elif (_plain_object(value) or slotted(value)) and not isinstance(value, type):
        top = type(value).__module__.partition(".")[0]
        if type(value).__module__.startswith(DISTRIBUTIONS):  # a transform's cache
            return True
    else:
        return False
    return top not in sys.stdlib_module_names and top not in _LIBRARIES


is_namespace = _namespace  # (for the watch)


def slotted(value: Any) -> bool:
    """An object of a user's class with ``__slots__`` and no ``__dict__`` (a
    ``@dataclass(slots=True)``): its attributes are read through its slots."""
    return (_safe_getattr(value, "__dict__") is MISSING and hasattr(type(value), "__slots__")
            and _user_class(type(value)) and not isinstance(value, type))


class AttributesView(Mapping[str, Any]):
    """An object with slots: its attributes as a live mapping, as its ``__dict__`` would
    be (its slots, an unset one absent, then its ``__dict__`` if it has one)."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj
        self._names = slot_names(type(obj))
        self._dict = _safe_getattr(obj, "__dict__")

    def __getitem__(self, name: str) -> Any:
        value = _safe_getattr(self._obj, name) if name in self._names else MISSING
        if value is MISSING:
            if isinstance(self._dict, dict):
                return self._dict[name]
            raise KeyError(name)
        return value

    def __iter__(self) -> Iterator[str]:
        own = list(self._dict) if isinstance(self._dict, dict) else []
        return itertools.chain((n for n in self._names
                                if _safe_getattr(self._obj, n) is not MISSING), own)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _safe_getattr(obj: Any, name: str) -> Any:
    """``getattr(obj, name)``, or :data:`MISSING` where that raises anything (a
    property of the user's)."""
    try:
        return getattr(obj, name)
    except Exception:  # noqa: BLE001
        return MISSING


def attributes(value: Any) -> Mapping[str, Any]:
    """An object's attributes, live: its ``__dict__`` (a class's: a mapping proxy), or
    where its class has slots an :class:`AttributesView` (slots and ``__dict__``)."""
    if slot_names(type(value)):
        return AttributesView(value)
    own = _safe_getattr(value, "__dict__")
    return own if isinstance(own, Mapping) else {}


_LIBRARIES = frozenset({"torch", "numpy", "builtins", "autograph", "typing_extensions", "wrapt"})


def user_function(value: Any) -> bool:
    """A function of the user's (not the standard library's, torch's or numpy's), whose
    globals and cells a call naming it reaches too."""
    top = str(getattr(value, "__module__", "")).partition(".")[0]
    return (isinstance(value, types.FunctionType) and top not in sys.stdlib_module_names
            and top not in _LIBRARIES)


@functools.lru_cache(maxsize=1024)
def _attribute_loads(code: types.CodeType) -> dict[str, frozenset[str]]:
    """For each global or closure name that ``code`` (and the code nested in it) reads
    an attribute of directly (``config.SCALE``), the attribute names read so: only
    those are guarded (a namespace's other attributes may change every step)."""
    found: dict[str, set[str]] = {}
    stack = [code]
    while stack:
        c = stack.pop()
        path = None  # the dotted name loaded so far (``mypkg.consts``)
        for ins in dis.get_instructions(c):
            if path is not None and ins.opname in _ATTRIBUTE_STORES:
                # ``NS.last = y``: guarded, the value changes at each call (eagerly)
                found.setdefault(path, set()).add(ins.argval)
                path = None
            elif path is not None and ins.opname in _ATTRIBUTE_LOADS:
                found.setdefault(path, set()).add(ins.argval)
                path = f"{path}.{ins.argval}"
            elif path is not None and ins.opname in _KEEPS_TOP:
                continue  # ``NS.calls += 1``: the name copied, then its attribute read
            else:
                path = ins.argval if ins.opname in _NAME_LOADS else None
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return {name: frozenset(attrs) for name, attrs in found.items()}


@functools.lru_cache(maxsize=1024)
def reads_attribute(code: types.CodeType, name: str, unless_of: str) -> bool:
    """Whether ``code`` (or the code nested in it) reads, sets or names the attribute
    ``name`` of some object (``w.grad``, ``getattr(w, "grad")``), not counting it where
    it is read from a name or attribute ``unless_of`` (``torch.autograd.grad``)."""
    stack = [code]
    while stack:
        c = stack.pop()
        before = None  # the name the previous instruction loaded
        for ins in dis.get_instructions(c):
            if ins.opname == "LOAD_CONST" and ins.argval == name:
                return True
            if (ins.opname in _ATTRIBUTE_LOADS or ins.opname in _ATTRIBUTE_STORES) \
                    and ins.argval == name and before != unless_of:
                return True
            if ins.opname not in _KEEPS_TOP:
                loads = ins.opname in _NAME_LOADS or ins.opname in _ATTRIBUTE_LOADS
                before = ins.argval if loads else None
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return False


_NAME_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF"})
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_ATTRIBUTE_STORES = frozenset({"STORE_ATTR", "DELETE_ATTR"})
_KEEPS_TOP = frozenset({"COPY", "DUP_TOP", "CACHE", "EXTENDED_ARG", "NOP"})


def _namespace_values(obj: Any, names: Iterable[str], loads: dict[str, frozenset[str]],
                     path: str, depth: int = 2) -> list[tuple[Callable[[], Any], Any]]:
    """Getters for the plain values, tensors, modules and functions a namespace holds
    under ``names`` (read from its ``__dict__``: no property runs), and, ``depth``
    levels down, those of the namespaces it holds that the code reads further
    (``mypkg.consts.SCALE``, ``cfg.sub.k``; ``loads`` by dotted ``path``)."""
    if isinstance(obj, threading.local):  # each thread's own values, as it reads them
        return [(_local_getter(obj, n), getattr(obj, n, MISSING)) for n in sorted(names)
                if not n.startswith("__") and not callable(
                    inspect.getattr_static(type(obj), n, None))]  # (methods: new at reads)
    d = attributes(obj)
    out: list[tuple[Callable[[], Any], Any]] = []
    for n in sorted(names):
        if n.startswith("__") or n not in d:
            continue
        value = d[n]
        if _trackable(value) or _function(value):
            out.append((_global_getter(d, n), value))
        elif depth and _namespace(value):
            out.append((_global_getter(d, n), value))
            inner = f"{path}.{n}"
            out += _namespace_values(value, loads.get(inner, ()), loads, inner, depth - 1)
    return out


def _function(value: Any) -> bool:
    """A function the code calls by name (``ACT = torch.relu``, rebound to another)."""
    return isinstance(value, _FUNCTIONS)


# (``ACT = torch.Tensor.relu``, ``ACT = model.act``: methods and slot wrappers too)
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, functools.partial,
              types.MethodType, types.MethodDescriptorType, types.WrapperDescriptorType,
              types.MethodWrapperType)


def _user_module(fn: Any) -> bool:
    return str(getattr(fn, "__module__", "")).partition(".")[0] != "torch"


class _EveryName(dict):  # type: ignore[type-arg]
    """Attribute reads by path where the paths are not followed (an owner object's
    attributes): every path reads every name the code uses."""

    def __init__(self, names: frozenset[str] | set[str]) -> None:
        super().__init__()
        self.names = frozenset(names)

    def get(self, key: Any, default: Any = None) -> Any:
        return self.names


def owner_refs(obj: Any, fn: Callable[..., Any]) -> list[tuple[Callable[[], Any], Any]]:
    """Getters for the attributes of ``obj``, a plain object (not a module) whose method
    ``fn`` is graphed, that the method may read: the modules, tensors and plain values
    held in ``obj.__dict__`` (or its slots) under a name its code (or a method of ``obj``'s class it
    names) uses, and its class's plain values under such names; and the number of
    attributes (one added may shadow a class attribute)."""
    d = attributes(obj)  # its __dict__, or its slots (``dataclass(slots=True)``)
    codes = _codes_of(fn)
    if not isinstance(d, (dict, AttributesView)) or not codes:
        return []
    names = _attribute_names(type(obj), codes)
    out: list[tuple[Callable[[], Any], Any]] = []
    every = _EveryName(names)  # (a namespace's attributes read: any name the code uses)
    for n in sorted(names):
        value = d[n] if n in d else MISSING
        if value is MISSING or n.startswith("__"):
            continue
        if _trackable(value) or _function(value):
            out.append((_global_getter(d, n), value))
            continue
        held = _held_modules(value)
        out += [_fixed(m) for m in held]
        if held or _rebindable(value):  # rebinding it is seen, as a global's
            out.append((_global_getter(d, n), value))
        if _namespace(value):  # (``self.opts.bias``: as a global namespace's values)
            out += _namespace_values(value, names, every, n)
    if _user_class(type(obj)):
        out += _class_values(type(obj), {n for n in names if n not in d})
    out.append((d.__len__, len(d)))
    return out


def class_refs(objects: Iterable[Any]) -> list[tuple[Callable[[], Any], Any]]:
    """Getters for the class attributes that the ``forward`` of each object's class
    may read: the plain values its class, or a base, holds under a name that its code,
    a method of the class it names (``super()`` included), or a method named by
    another object's code (a parent calling ``self.sub.helper()``) uses, unless every
    object shadows the name with its own.  A flag flipped on the class (``Gate.fused =
    False``) changes every instance at once and sets no attribute of any, so it is read
    again on every call.  torch's own classes are left out: their class attributes are
    no switches."""
    by_class: dict[type, list[Any]] = {}
    for obj in objects:
        by_class.setdefault(type(obj), []).append(obj)
    forwards: dict[type, list[types.CodeType]] = {}
    for cls in by_class:
        if _user_class(cls):
            codes = _codes_of(inspect.getattr_static(cls, "forward", None))
            if codes:
                forwards[cls] = codes
    named: set[str] = set()
    for cls, codes in forwards.items():
        named |= _attribute_names(cls, codes)
    out: list[tuple[Callable[[], Any], Any]] = []
    for cls, codes in forwards.items():
        helpers = [c for n in named for c in _codes_of(_static(cls, n))]
        names = _attribute_names(cls, [*codes, *helpers])
        objs = by_class[cls]
        out += _class_values(cls, {n for n in names
                                   if not all(n in getattr(o, "__dict__", ()) for o in objs)})
    return out


def forward_refs(objects: Iterable[Any], skip: Any = None
                 ) -> list[tuple[Callable[[], Any], Any]]:
    """:func:`code_refs` of the ``forward`` of each object's class (a submodule's
    forward reading a global), each function once, but ``skip`` (the callable's own,
    whose references are taken already).  torch's own classes are left out."""
    seen = {id(_unwrapped(skip))} if skip is not None else set()
    out: list[tuple[Callable[[], Any], Any]] = []
    for cls in {type(obj): None for obj in objects}:
        if not _user_class(cls):
            continue
        fn = inspect.getattr_static(cls, "forward", None)
        fn = getattr(fn, "__func__", fn)
        if not callable(fn) or id(_unwrapped(fn)) in seen:
            continue
        seen.add(id(_unwrapped(fn)))
        out += code_refs(fn)
    return out


def _user_class(cls: type) -> bool:
    """A class of the user's (not torch's, not a builtin)."""
    return cls.__module__.partition(".")[0] not in ("torch", "builtins")


def _class_values(cls: type, names: Iterable[str]) -> list[tuple[Callable[[], Any], Any]]:
    """Getters for the plain values, tensors and modules ``cls`` (or a base) holds
    under ``names`` (``cls.codebook``, ``cls.proj``: rebinding one is seen, and a
    module's are watched as any module the code names)."""
    out: list[tuple[Callable[[], Any], Any]] = []
    for name in sorted(names):
        if name.startswith("__"):
            continue
        value = inspect.getattr_static(cls, name, MISSING)
        if value is not MISSING and _trackable(value) and not (  # enum members: constants
                isinstance(value, enum.Enum) and isinstance(value, cls)):
            out.append((_class_getter(cls, name), value))
    return out


def _static(cls: type, name: str) -> Any:
    return inspect.getattr_static(cls, name, None)


def _codes_of(attr: Any) -> list[types.CodeType]:
    """The code of each function in the :func:`_chain` of a function, method, property
    or staticmethod found on a class."""
    attr = getattr(attr, "fget", None) or getattr(attr, "__func__", attr)
    if attr is None:
        return []
    codes = (getattr(f, "__code__", None) for f in _chain(attr))
    return [c for c in codes if isinstance(c, types.CodeType)]


def _class_getter(cls: type, name: str) -> Callable[[], Any]:
    def get() -> Any:
        return getattr(cls, name, MISSING)

    def put(value: Any) -> None:
        # the class's own entry only (a base's value changed is the base's to put back;
        # set here, it would shadow the base's from now on)
        if name not in cls.__dict__:
            return
        delattr(cls, name)
        if value is not MISSING and getattr(cls, name, MISSING) is not value:
            setattr(cls, name, value)

    get.put = put  # type: ignore[attr-defined]
    return get


def _code_names(code: types.CodeType) -> set[str]:
    """The attribute and global names ``code`` (and the code nested in it) uses, and
    its string constants that are identifiers (``getattr(self, "flag")``)."""
    names: set[str] = set()
    stack = [code]
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                stack.append(c)
            elif isinstance(c, str) and c.isidentifier():
                names.add(c)
    return names


def _attribute_names(cls: type, codes: list[types.CodeType]) -> set[str]:
    """The names ``codes`` use (see :func:`_code_names`), with those of the methods and
    properties of ``cls`` and its bases that they name, transitively (``super()``
    calls reach a base's method of the same name)."""
    names: set[str] = set()
    seen: set[types.CodeType] = set()
    stack = list(codes)
    while stack:
        code = stack.pop()
        if code in seen:
            continue
        seen.add(code)
        found = _code_names(code)
        names |= found
        for name in found:
            for klass in cls.__mro__:
                stack += _codes_of(klass.__dict__.get(name))
    return names


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple[frozenset[str], frozenset[str]]:
    """The global names ``code`` (and the code nested in it) loads, and those it
    assigns or deletes.  Not ``co_names``: that also lists attribute names (``self.out``
    next to a global ``out``, rebound by the caller every call, would drop the graphs
    every call)."""
    loads: set[str] = set()
    stores: set[str] = set()
    for ins in dis.get_instructions(code):
        if ins.opname in _GLOBAL_LOADS:
            loads.add(ins.argval)
        elif ins.opname in _GLOBAL_STORES:
            stores.add(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner_loads, inner_stores = _global_names(const)
            loads |= inner_loads
            stores |= inner_stores
    return frozenset(loads), frozenset(stores)


_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_GLOBAL_STORES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL", "STORE_NAME", "DELETE_NAME"})


def _plain(value: Any) -> bool:
    """A value a branch may be taken on, compared by equality or identity: None, a
    number, a string, an enum member, a dtype or device, or a tuple of such."""
    if isinstance(value, _PLAIN):
        return True
    return isinstance(value, (tuple, frozenset)) and len(value) <= 16 and all(
        _plain(v) for v in value)


_PLAIN = (*_SCALARS, enum.Enum, torch.dtype, torch.device, torch.memory_format, torch.layout)


def _trackable(value: Any) -> bool:
    return isinstance(value, (nn.Module, torch.Tensor)) or _plain(value)


def _local_getter(obj: threading.local, name: str) -> Callable[[], Any]:
    """A getter of ``obj.name`` as the calling thread reads it (``threading.local``:
    its own value, or its class's default or property)."""
    def get() -> Any:
        return getattr(obj, name, MISSING)

    def put(value: Any) -> None:
        if value is MISSING:
            with contextlib.suppress(AttributeError):
                delattr(obj, name)
        else:
            setattr(obj, name, value)

    get.put = put  # type: ignore[attr-defined]
    return get


def _global_getter(glb: Mapping[str, Any], name: str) -> Callable[[], Any]:
    def get() -> Any:
        return glb.get(name, MISSING)

    def put(value: Any) -> None:  # (into the dict: no ``__setattr__`` of the owner runs)
        if isinstance(glb, AttributesView):
            obj = glb._obj
            if value is MISSING:
                with contextlib.suppress(AttributeError):
                    object.__delattr__(obj, name)
            else:
                object.__setattr__(obj, name, value)
        elif isinstance(glb, dict):
            if value is MISSING:
                glb.pop(name, None)
            else:
                glb[name] = value

    get.where = (id(glb), name)  # type: ignore[attr-defined]
    get.put = put  # type: ignore[attr-defined]
    return get


def new_refs(refs: list[tuple[Callable[[], Any], Any]],
             known: list[tuple[Callable[[], Any], Any]]) -> list[tuple[Callable[[], Any], Any]]:
    """``refs`` without the globals read already (by ``known`` or an earlier one of
    ``refs``): several forwards name the same global."""
    seen = {w for get, _ in known if (w := getattr(get, "where", None)) is not None}
    out = []
    for get, value in refs:
        where = getattr(get, "where", None)
        if where is None or where not in seen:
            out.append((get, value))
            if where is not None:
                seen.add(where)
    return out


def _cell_getter(cell: Any) -> Callable[[], Any]:
    def get() -> Any:
        try:
            return cell.cell_contents
        except ValueError:
            return MISSING

    def put(value: Any) -> None:
        if value is MISSING:
            with contextlib.suppress(ValueError):
                del cell.cell_contents
        else:
            cell.cell_contents = value

    get.put = put  # type: ignore[attr-defined]
    return get


def put_back(get: Callable[[], Any], value: Any) -> None:
    """Give the name ``get`` reads back ``value`` (a failed capture's Python assigned
    it), where the getter knows how (a global, a closure cell, a class attribute, an
    owner's attribute); a count of attributes has nothing to put back."""
    put = getattr(get, "put", None)
    if put is not None:
        with contextlib.suppress(Exception):  # (a read-only class, a frozen object)
            put(value)


def changed_attribute(before: list[tuple[str, Any]], now: list[tuple[str, Any]] | None
                      ) -> str | None:
    """The attribute assigned between two views of an object's ``__dict__``, or None."""
    if now is None or len(now) != len(before):
        return "an attribute added or deleted"
    for (name, then), (other, value) in zip(before, now):
        if name != other or not same(value, then):
            return other
    return None


def config_dicts(modules: Iterable[nn.Module]) -> list[Mapping[str, Any]]:
    """The attributes (``__dict__``, or an :class:`AttributesView`) of each plain
    configuration object the modules hold: the object at a module's ``config`` or
    ``_config`` attribute (transformers' models and layers read their flags there:
    ``self.config.output_hidden_states``) and dataclass instances in module attributes
    (under any name: a helper function may read ``mod.opts``; slotted ones too), once
    each.  A graph replays the decisions taken from them at capture, and changing them
    sets no module attribute, so ``guards.Watch`` compares each with a shallow copy on
    every call."""
    found: dict[int, Mapping[str, Any]] = {}
    for m in modules:
        for name, value in vars(m).items():
            if isinstance(value, (nn.Module, torch.Tensor, type)):
                continue
            if name in ("config", "_config") or dataclasses.is_dataclass(value):
                d = attributes(value)
                if d:
                    found.setdefault(id(value), d)
    return list(found.values())


# what ``nn.Module.__init__`` sets: its own bookkeeping, not state a forward reads
_MODULE_OWN = frozenset(vars(nn.Module()))
_CONTAINERS = (list, dict, set, collections.OrderedDict, collections.deque,
               collections.defaultdict, collections.Counter)
MAX_VALUES = 256  # items per container compared per call; a larger one is left out


def held_values(modules: Iterable[nn.Module], code: Any = None
                ) -> tuple[list[Any], list[Any]]:
    """The lists, dicts, sets and deques of plain values (numbers, strings, dtypes and
    such containers of them) that the modules of the user's classes hold as attributes
    under a name their ``forward`` (the methods and properties it names, transitively)
    or ``code`` uses, and a deep copy of each: PEFT's ``merged_adapters`` (read by its
    ``merged`` property) and ``scaling``, an ``active`` list.  A graph replays the
    branches taken on them, and changing one in place (``merged_adapters.append``) sets
    no attribute, so ``guards.Watch`` compares the two lists on every call (one C-level
    ``==``; item identity first, so a NaN is equal to itself).  A list no such code
    names (a loss history the training loop appends to) is not compared, nor
    containers of tensors, modules or other objects."""
    modules = list(modules)
    named = set(_attribute_names(object, _codes_of(code))) if code is not None else set()
    for m in modules:
        named |= _forward_names(type(m))  # type: ignore[arg-type]
    by_class: dict[type, frozenset[str]] = {}
    found: dict[int, Any] = {}
    for m in modules:
        cls = type(m)
        if cls not in by_class:  # with what the methods the others name read of it
            by_class[cls] = frozenset(named | _named_members(cls, named)) \
                if _user_class(cls) else frozenset()
        names = by_class[cls]
        if not names:
            continue
        for name, value in vars(m).items():
            if type(value) in _CONTAINERS and name in names and name not in _MODULE_OWN \
                    and _plain_values(value, [MAX_VALUES], 0):
                found.setdefault(id(value), value)
    live = list(found.values())
    return live, copy.deepcopy(live)


def _named_members(cls: type, named: set[str]) -> set[str]:
    """The names the methods and properties of ``cls`` that ``named`` names use (a
    parent calling ``self.child.factor()`` reads what ``factor`` reads; a name shared
    with a tensor's method, ``h.mean()``, counts too: which object it is called on is
    not known)."""
    codes = [c for name in named for klass in cls.__mro__
             if klass is not object and name in vars(klass)
             for c in _codes_of(vars(klass)[name])]
    return _attribute_names(cls, codes) if codes else set()


@functools.lru_cache(maxsize=1024)
def _forward_names(cls: Any) -> frozenset[str]:
    """The names the ``forward`` of a class of the user's uses, with those of the
    methods and properties it names (:func:`_attribute_names`); none for torch's."""
    if not _user_class(cls):
        return frozenset()
    return frozenset(_attribute_names(cls, _codes_of(inspect.getattr_static(cls, "forward",
                                                                              None))))


def _plain_values(value: Any, budget: list[int], depth: int) -> bool:
    """Whether ``value`` holds plain values only (within ``budget`` items, 4 deep)."""
    if isinstance(value, _PLAIN):
        return True
    if depth > 3 or not isinstance(value, (*_CONTAINERS, tuple, frozenset)):
        return False
    budget[0] -= len(value)
    if budget[0] < 0:
        return False
    items = itertools.chain.from_iterable(value.items()) if isinstance(value, dict) else value
    return all(_plain_values(v, budget, depth + 1) for v in items)
