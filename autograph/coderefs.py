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

import dataclasses
import dis
import functools
import inspect
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

_SCALARS = (bool, int, float, str, type(None))
MISSING = object()  # a name or cell that holds nothing (any more)


def same(now: Any, then: Any) -> bool:
    if now is then:
        return True
    if isinstance(then, _SCALARS) and type(now) is type(then):
        return bool(now == then)
    return False


def code_refs(fn: Callable[..., Any]) -> list[tuple[Callable[[], Any], Any]]:
    """Getters for the modules, tensors and scalars that ``fn`` names in its globals
    and closure cells, with their current values."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    out: list[tuple[Callable[[], Any], Any]] = []
    glb = getattr(fn, "__globals__", {})
    for name in sorted(_global_names(code)):
        value = glb.get(name, MISSING)
        if _trackable(value):
            out.append((_global_getter(glb, name), value))
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # empty cell
            continue
        if _trackable(value):
            out.append((_cell_getter(cell), value))
    return out


def owner_refs(obj: Any, fn: Callable[..., Any]) -> list[tuple[Callable[[], Any], Any]]:
    """Getters for the attributes of ``obj``, a plain object (not a module) whose method
    ``fn`` is graphed, that the method may read: the modules, tensors and scalars held
    in ``obj.__dict__`` under a name its code (or a method of ``obj``'s class it names)
    uses; and the number of attributes (one added may shadow a class attribute)."""
    d = getattr(obj, "__dict__", None)
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if not isinstance(d, dict) or code is None:
        return []
    names = _attribute_names(type(obj), code)
    out = [(_global_getter(d, n), d[n]) for n in sorted(names) if _trackable(d.get(n))]
    out.append((d.__len__, len(d)))
    return out


def class_refs(objects: Iterable[Any]) -> list[tuple[Callable[[], Any], Any]]:
    """Getters for the class attributes that the ``forward`` of each object's class
    may read (the scalars its class, or a base, holds under a name its code or a method
    of the class it names uses), unless every object shadows the name with its own.
    A flag flipped on the class (``Gate.fused = False``) changes every instance at once
    and sets no attribute of any, so it is read again on every call.  torch's own
    classes are left out: their class attributes are no switches."""
    by_class: dict[type, list[Any]] = {}
    for obj in objects:
        by_class.setdefault(type(obj), []).append(obj)
    out: list[tuple[Callable[[], Any], Any]] = []
    for cls, objs in by_class.items():
        if cls.__module__.partition(".")[0] == "torch":
            continue
        code = getattr(inspect.getattr_static(cls, "forward", None), "__code__", None)
        if not isinstance(code, types.CodeType):
            continue
        for name in sorted(_attribute_names(cls, code)):
            value = inspect.getattr_static(cls, name, MISSING)
            if isinstance(value, _SCALARS) and value is not None and \
                    not all(name in getattr(o, "__dict__", ()) for o in objs):
                out.append((_class_getter(cls, name), value))
    return out


def _class_getter(cls: type, name: str) -> Callable[[], Any]:
    return lambda: getattr(cls, name, MISSING)


def _attribute_names(cls: type, code: types.CodeType) -> set[str]:
    """The names ``code`` uses (``co_names``: attributes and globals), with those of the
    nested code and of the methods and properties of ``cls`` it names, transitively."""
    names: set[str] = set()
    seen: set[types.CodeType] = set()
    stack = [code]
    while stack:
        code = stack.pop()
        if code in seen:
            continue
        seen.add(code)
        names.update(code.co_names)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        for name in code.co_names:
            attr = inspect.getattr_static(cls, name, None)
            attr = getattr(attr, "fget", None) or getattr(attr, "__func__", attr)
            if isinstance(getattr(attr, "__code__", None), types.CodeType):
                stack.append(attr.__code__)
    return names


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> frozenset[str]:
    """The global names ``code`` (and the code nested in it) loads.  Not ``co_names``:
    that also lists attribute names (``self.out`` next to a global ``out``, rebound by
    the caller every call, would drop the graphs every call)."""
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in _GLOBAL_LOADS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return frozenset(names)


_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})


def _trackable(value: Any) -> bool:
    return isinstance(value, (nn.Module, torch.Tensor)) or (
        isinstance(value, _SCALARS) and value is not None
    )


def _global_getter(glb: dict[str, Any], name: str) -> Callable[[], Any]:
    return lambda: glb.get(name, MISSING)


def _cell_getter(cell: Any) -> Callable[[], Any]:
    def get() -> Any:
        try:
            return cell.cell_contents
        except ValueError:
            return MISSING

    return get


def changed_attribute(before: list[tuple[str, Any]], now: list[tuple[str, Any]] | None
                      ) -> str | None:
    """The attribute assigned between two views of an object's ``__dict__``, or None."""
    if now is None or len(now) != len(before):
        return "an attribute added or deleted"
    for (name, then), (other, value) in zip(before, now):
        if name != other or not same(value, then):
            return other
    return None


def config_dicts(modules: Iterable[nn.Module]) -> list[dict[str, Any]]:
    """The ``__dict__`` of each plain configuration object the modules hold: the object
    at a module's ``config`` attribute (transformers' models and layers read their flags
    there: ``self.config.output_hidden_states``) and dataclass instances in module
    attributes, once each.  A graph replays the decisions taken from them at capture,
    and changing them sets no module attribute, so ``guards.Watch`` compares each with
    a shallow copy on every call."""
    found: dict[int, dict[str, Any]] = {}
    for m in modules:
        for name, value in vars(m).items():
            if name.startswith("_") or isinstance(value, (nn.Module, torch.Tensor, type)):
                continue
            if name == "config" or dataclasses.is_dataclass(value):
                d = getattr(value, "__dict__", None)
                if isinstance(d, dict):
                    found.setdefault(id(value), d)
    return list(found.values())
