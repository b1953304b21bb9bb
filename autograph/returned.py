"""Objects a call returns that pytree does not open: a transformers ``DynamicCache``
that a causal language model's forward makes (``model(ids)`` returns one while
``use_cache`` is on), an object of the user's own holding tensors.

A replay runs no Python, so such an object cannot be made by the call; it is made by
the output builder instead, on every call, with the same structure as the object the
capture returned and the call's own output tensors in it (clones of the graph's, as
for every output).  Only plain objects are opened: instances of classes that copy as
plain objects do (no ``__deepcopy__``, ``__reduce__``, ``__getstate__`` or
``__setstate__`` of their own), holding tensors, constants, lists, tuples, dicts and
other such objects.  Anything else (a module, a function, a lock) keeps the key eager,
as before.
"""

from __future__ import annotations

import types
from typing import Any

import torch

MAX_NODES = 10_000  # objects, containers and values walked in one returned object

_ATOMS = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device,
          torch.Size, slice, range, type(Ellipsis), type)
_CONTAINERS = (list, tuple, dict)
# object's own: classes that define none of these copy as plain objects
_PROTOCOL = ("__deepcopy__", "__copy__", "__reduce__", "__reduce_ex__", "__getstate__",
             "__setstate__", "__getnewargs__", "__getnewargs_ex__")


class Returned:
    """One returned object: its tensors (in walk order) and how to make the object again
    around other tensors (:meth:`rebuild`), keeping its structure, its constants, and
    which parts are one object (a layer listed twice stays one layer)."""

    __slots__ = ("tensors", "_nodes", "_root")

    def __init__(self, tensors: list[torch.Tensor], nodes: list[Any], root: int) -> None:
        self.tensors = tensors
        self._nodes = nodes  # per node: ("tensor", i) | ("atom", v) | (kind, cls, children)
        self._root = root

    @staticmethod
    def find(value: Any) -> Returned | None:
        """The walk of ``value``, or None where it holds what cannot be made again."""
        walker = _Walk()
        root = walker.node(value)
        if root is None:
            return None
        return Returned(walker.tensors, walker.nodes, root)

    def rebuild(self, tensors: list[Any]) -> Any:
        """The object again, with ``tensors`` in place of :attr:`tensors`."""
        made: list[Any] = [_UNMADE] * len(self._nodes)
        return self._make(self._root, tensors, made)

    def _make(self, k: int, tensors: list[Any], made: list[Any]) -> Any:
        if made[k] is not _UNMADE:
            return made[k]
        node = self._nodes[k]
        kind = node[0]
        if kind == "tensor":
            out = tensors[node[1]]
        elif kind == "atom":
            out = node[1]
        elif kind == "list":
            out = made[k] = []
            out.extend(self._make(c, tensors, made) for c in node[2])
        elif kind == "dict":
            out = made[k] = {}
            out.update((self._make(a, tensors, made), self._make(b, tensors, made))
                       for a, b in node[2])
        elif kind == "tuple":
            items = [self._make(c, tensors, made) for c in node[2]]
            out = tuple(items) if node[1] is tuple else node[1](*items)
        else:  # an object: made first (a cycle back to it finds it), then filled
            cls, names, slots = node[1], node[2], node[3]
            out = made[k] = cls.__new__(cls)
            if names:
                vars(out).update((n, self._make(c, tensors, made)) for n, c in names)
            for n, c in slots:
                object.__setattr__(out, n, self._make(c, tensors, made))
        made[k] = out
        return out


_UNMADE = object()


class _Walk:
    """Numbers every value reachable from a returned object once (by identity)."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.tensors: list[torch.Tensor] = []
        self.ids: dict[int, int] = {}

    def node(self, value: Any) -> int | None:
        known = self.ids.get(id(value))
        if known is not None:
            return known
        if len(self.nodes) >= MAX_NODES:
            return None
        k = len(self.nodes)
        self.ids[id(value)] = k
        self.nodes.append(None)
        node = self._describe(value)
        if node is None:
            return None
        self.nodes[k] = node
        return k

    def _describe(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor or value.layout is not torch.strided:
                return None
            self.tensors.append(value)
            return ("tensor", len(self.tensors) - 1)
        if isinstance(value, _ATOMS):
            return ("atom", value)
        if type(value) is list:
            return self._children("list", list, value)
        if type(value) is dict:
            pairs = []
            for a, b in value.items():
                ka, kb = self.node(a), self.node(b)
                if ka is None or kb is None:
                    return None
                pairs.append((ka, kb))
            return ("dict", dict, pairs)
        if isinstance(value, tuple) and (type(value) is tuple or hasattr(value, "_fields")):
            return self._children("tuple", type(value), value)
        return self._object(value)

    def _children(self, kind: str, cls: type, items: Any) -> Any:
        children = []
        for item in items:
            c = self.node(item)
            if c is None:
                return None
            children.append(c)
        return (kind, cls, children)

    def _object(self, value: Any) -> Any:
        cls = type(value)
        if not _plain_class(cls) or not (hasattr(value, "__dict__") or _slot_names(cls)):
            return None
        names = []
        for name, item in getattr(value, "__dict__", {}).items():
            c = self.node(item)
            if c is None:
                return None
            names.append((name, c))
        slots = []
        for name in _slot_names(cls):
            if name in ("__dict__", "__weakref__") or not hasattr(value, name):
                continue
            c = self.node(getattr(value, name))
            if c is None:
                return None
            slots.append((name, c))
        return ("object", cls, names, slots)


def _plain_class(cls: type) -> bool:
    """A class whose instances copy as plain objects: defined in Python (not a builtin,
    not torch's), no module or function, no copy protocol of its own."""
    if cls.__module__ in ("builtins",) or cls.__module__.startswith("torch"):
        return False
    if issubclass(cls, (torch.nn.Module, types.FunctionType, types.MethodType,
                        types.ModuleType, BaseException)):
        return False
    for klass in cls.__mro__[:-1]:
        if klass.__module__ == "builtins" and klass is not object:
            return False  # a dict or list subclass: its items are not in __dict__
        if any(name in vars(klass) for name in _PROTOCOL):
            return False
    return True


def _slot_names(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return names


class Spliced:
    """The objects among a call's flat outputs (their indexes and walks): how the flat
    outputs look with each object's tensors in its place (:meth:`splice`), and back
    (:meth:`regroup`, each object made again around its tensors)."""

    __slots__ = ("spans",)

    def __init__(self, spans: list[tuple[int, Returned]]) -> None:
        self.spans = spans

    @staticmethod
    def find(flat: list[Any], skip: Any = ()) -> Spliced | None:
        """The objects :class:`Returned` opens among ``flat`` (none whose id is in
        ``skip``: object arguments returned as they are), or None if there is none."""
        spans = []
        for k, value in enumerate(flat):
            if id(value) in skip:
                continue
            found = open_leaf(value)
            if found is not None:
                spans.append((k, found))
        return Spliced(spans) if spans else None

    def splice(self, flat: list[Any]) -> list[Any]:
        """The captured flat outputs ``flat`` with each object replaced by its tensors."""
        out: list[Any] = []
        at = 0
        for k, found in self.spans:
            out += flat[at:k]
            out += found.tensors
            at = k + 1
        return out + flat[at:]

    def regroup(self, made: list[Any]) -> list[Any]:
        """The leaves of an output spliced so, each object made again around its
        tensors, in pytree's order."""
        out: list[Any] = []
        at = 0  # in ``made``
        prev = 0  # in the output's own leaves
        for k, found in self.spans:
            plain = k - prev
            out += made[at:at + plain]
            at += plain
            n = len(found.tensors)
            out.append(found.rebuild(made[at:at + n]))
            at += n
            prev = k + 1
        return out + made[at:]


def open_leaf(value: Any) -> Returned | None:
    """The walk of an output leaf that is an object (not a tensor or a constant), or
    None if it is none or cannot be made again."""
    if isinstance(value, (torch.Tensor, *_ATOMS)):
        return None
    return Returned.find(value)


def opened(leaves: list[Any]) -> list[Any]:
    """``leaves`` with each object that :class:`Returned` opens replaced by its tensors
    (what comparisons of outputs look at: two caches are equal by their tensors)."""
    out: list[Any] = []
    for leaf in leaves:
        found = open_leaf(leaf)
        out.extend(found.tensors if found is not None else [leaf])
    return out

