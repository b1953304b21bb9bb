"""Objects a call returns that pytree does not open: a transformers ``DynamicCache``
that a causal language model's forward makes (``model(ids)`` returns one while
``use_cache`` is on), an object of the user's own holding tensors.

A replay runs no Python, so such an object cannot be made by the call; it is made by
the output builder instead, on every call, with the same structure as the objects the
capture returned and the call's own output tensors in them (clones of the graph's, as
for every output).  One walk covers every returned object, so an object returned
twice, or reached from two of them, is made once per call.  What existed before the
call (a module's plain attributes, the arguments, what the code names, parameters and
buffers, and everything reachable from them) is returned as itself, as eager returns
it.  Only plain objects are made again: instances of classes that copy as plain
objects do (no ``__deepcopy__``, ``__reduce__``, ``__getstate__`` or ``__setstate__`` of
their own), holding tensors, constants, lists, tuples, dicts and other such objects.
Anything else (a module, a function, a lock), a tuple in a cycle, or a container the
output also holds outside the objects keeps the key eager, as before.
"""

from __future__ import annotations

import enum
import types
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .walk import slot_names

MAX_NODES = 10_000  # objects, containers and values walked in a call's returned objects

_ATOMS = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device,
          torch.Size, slice, range, type(Ellipsis), type, enum.Enum)
# object's own: classes that define none of these copy as plain objects
_PROTOCOL = ("__deepcopy__", "__copy__", "__reduce__", "__reduce_ex__", "__getstate__",
             "__setstate__", "__getnewargs__", "__getnewargs_ex__")
_UNMADE = object()
_IN_PROGRESS = ("in progress",)


class Spliced:
    """The objects among a call's flat outputs, walked together: how the flat outputs
    look with each object's tensors in its place (:meth:`splice`), and back
    (:meth:`regroup`, the objects made again around other tensors)."""

    __slots__ = ("spans", "tensors", "_nodes")

    def __init__(self, spans: list[tuple[int, int, int, int]], tensors: list[torch.Tensor],
                 nodes: list[Any]) -> None:
        self.spans = spans  # per object: (flat index, root node, first tensor, end)
        self.tensors = tensors
        self._nodes = nodes  # ("tensor", i) | ("atom", v) | (kind, cls, children...)

    @staticmethod
    def find(flat: list[Any], skip: Any = (),
             known: Callable[[], Iterable[Any]] = tuple,
             outside: Callable[[], Any] = tuple,
             leaves: Callable[[], Sequence[Any]] = tuple, any_tensor: bool = False
             ) -> Spliced | None:
        """The objects among ``flat`` (none whose id is in ``skip``: object arguments
        returned as they are), walked, or None if there is none.  ``known()``: values
        that existed before the call (returned as themselves, with what they reach);
        ``outside()``: the output's containers outside the objects (pytree's: reached
        from inside an object, the key runs eagerly); both asked for only where a leaf
        may be an object; ``leaves()``: the call's flat leaves (an object argument held
        by a returned object is the next call's own, as eager returns it);
        ``any_tensor``: a walk for comparing outputs, which takes a parameter or a
        strided tensor subclass as a tensor.  Raises :class:`Refused` where an object cannot
        be made again."""
        candidates = [k for k, value in enumerate(flat) if id(value) not in skip
                      and not isinstance(value, (torch.Tensor, *_ATOMS))]
        if not candidates:
            return None
        walk = _Walk(known(), outside(), leaves(), any_tensor)
        spans = []
        for k in candidates:
            value = flat[k]
            if walk.is_known(value):
                continue
            first = len(walk.tensors)
            root = walk.node(value)
            if root is None:
                raise Refused(value, walk.why)
            spans.append((k, root, first, len(walk.tensors)))
        return Spliced(spans, walk.tensors, walk.nodes) if spans else None

    def splice(self, flat: list[Any]) -> list[Any]:
        """The captured flat outputs ``flat`` with each object replaced by its tensors."""
        out: list[Any] = []
        at = 0
        for k, _, first, end in self.spans:
            out += flat[at:k]
            out += self.tensors[first:end]
            at = k + 1
        return out + flat[at:]

    def regroup(self, made: list[Any], leaves: Any = ()) -> list[Any]:
        """The leaves of an output spliced so, each object made again around its
        tensors (each part once per call; the call's arguments, ``leaves``, where the
        capture's were), in pytree's order."""
        tensors: list[Any] = []
        out: list[Any] = []
        at = 0  # in ``made``
        prev = 0  # in the output's own leaves
        for k, _, first, end in self.spans:
            plain = k - prev
            out += made[at:at + plain]
            at += plain
            tensors += made[at:at + end - first]
            out.append(None)  # the object, made below
            at += end - first
            prev = k + 1
        out += made[at:]
        built: list[Any] = [_UNMADE] * len(self._nodes)
        for k, root, _, _ in self.spans:
            out[k] = self._make(root, tensors, built, leaves)
        return out

    def _make(self, k: int, tensors: list[Any], made: list[Any], leaves: Any) -> Any:
        if made[k] is not _UNMADE:
            return made[k]
        node = self._nodes[k]
        kind = node[0]
        if kind == "tensor":
            out = tensors[node[1]]
        elif kind == "atom":
            out = node[1]
        elif kind == "leaf":
            out = leaves[node[1]]
        elif kind == "list":
            out = made[k] = []
            out.extend(self._make(c, tensors, made, leaves) for c in node[2])
        elif kind == "dict":
            out = made[k] = node[1]()
            out.update((self._make(a, tensors, made, leaves),
                        self._make(b, tensors, made, leaves)) for a, b in node[2])
        elif kind == "tuple":
            items = [self._make(c, tensors, made, leaves) for c in node[2]]
            out = tuple(items) if node[1] is tuple else node[1](*items)
        elif kind == "structseq":  # a torch.return_types tuple: made from a sequence
            out = node[1](tuple(self._make(c, tensors, made, leaves) for c in node[2]))
        else:  # an object: made first (a cycle back to it finds it), then filled
            cls, names, slots = node[1], node[2], node[3]
            out = made[k] = cls.__new__(cls)
            if names:
                vars(out).update((n, self._make(c, tensors, made, leaves)) for n, c in names)
            for n, c in slots:
                object.__setattr__(out, n, self._make(c, tensors, made, leaves))
        made[k] = out
        return out


class Refused(Exception):
    """A returned object that cannot be made again (``why`` says what it holds)."""

    def __init__(self, value: Any, why: str) -> None:
        super().__init__(why)
        self.value = value
        self.why = why


class _Walk:
    """Numbers every value reachable from the returned objects once (by identity)."""

    def __init__(self, known: Iterable[Any], outside: Any, leaves: Sequence[Any] = (),
                 any_tensor: bool = False) -> None:
        self.any_tensor = any_tensor
        self.nodes: list[Any] = []
        self.tensors: list[torch.Tensor] = []
        self.ids: dict[int, int] = {}
        # (not all found: an object that is none of them may still be one, held as is)
        self.known, self.complete = reachable(known)
        self.outside = outside
        # the call's own leaves (by id: their position), which a replay takes from the
        # call it makes
        self.leaves = {id(v): i for i, v in enumerate(leaves) if not isinstance(v, _ATOMS)}
        self.why = ""

    def is_known(self, value: Any) -> bool:
        return id(value) in self.known

    def node(self, value: Any) -> int | None:
        k = self.ids.get(id(value))
        if k is not None:
            if self.nodes[k] is _IN_PROGRESS and isinstance(value, tuple):
                return self._refuse("a tuple in a cycle")
            return k
        if len(self.nodes) >= MAX_NODES:
            return self._refuse("too many values")
        k = len(self.nodes)
        self.ids[id(value)] = k
        self.nodes.append(_IN_PROGRESS)
        node = self._describe(value)
        if node is None:
            return None
        self.nodes[k] = node
        return k

    def _refuse(self, why: str) -> Any:
        """Nothing (the walk fails), noting the first reason why."""
        self.why = self.why or why
        return None

    def _describe(self, value: Any) -> Any:
        if isinstance(value, _ATOMS):
            return ("atom", value)
        if id(value) in self.leaves:
            return ("leaf", self.leaves[id(value)])
        if id(value) in self.known:
            return ("atom", value)  # made before the call, or a constant: itself
        if id(value) in self.outside:
            return self._refuse("a container the output also holds outside the object")
        if isinstance(value, torch.Tensor):
            if value.layout is not torch.strided or (not self.any_tensor
                                                     and type(value) is not torch.Tensor):
                return self._refuse(f"a {type(value).__name__} that is no plain tensor")
            self.tensors.append(value)
            return ("tensor", len(self.tensors) - 1)
        if not self.complete:
            return self._refuse("more values reachable from the modules than are walked")
        if type(value) is list:
            return self._children("list", list, value)
        if type(value) is dict or type(value) is OrderedDict:
            pairs = []
            for a, b in value.items():
                ka, kb = self.node(a), self.node(b)
                if ka is None or kb is None:
                    return None
                pairs.append((ka, kb))
            return ("dict", type(value), pairs)
        if isinstance(value, tuple) and (type(value) is tuple or hasattr(value, "_fields")):
            return self._children("tuple", type(value), value)
        if isinstance(value, tuple) and getattr(type(value), "n_fields", -1) == getattr(
                type(value), "n_sequence_fields", None):  # ``x.topk(2)``: no hidden fields
            return self._children("structseq", type(value), value)
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
        if not _plain_class(cls) or not (hasattr(value, "__dict__") or slot_names(cls)):
            return self._refuse(f"a {cls.__qualname__}, which is made otherwise")
        names = []
        for name, item in getattr(value, "__dict__", {}).items():
            c = self.node(item)
            if c is None:
                return None
            names.append((name, c))
        slots = []
        for name in slot_names(cls):
            if not hasattr(value, name):
                continue
            c = self.node(getattr(value, name))
            if c is None:
                return None
            slots.append((name, c))
        return ("object", cls, names, slots)


# torch's classes whose instances are plain objects of tensors (a policy's ``Normal``)
DISTRIBUTIONS = "torch.distributions."


def _plain_class(cls: type) -> bool:
    """A class whose instances copy as plain objects: defined in Python (not a builtin,
    not torch's but its distributions), no module or function, no copy protocol of its
    own."""
    top = cls.__module__.partition(".")[0]  # (torchvision's, torchaudio's are plain)
    if top == "builtins" or (top == "torch" and not cls.__module__.startswith(DISTRIBUTIONS)):
        return False
    if issubclass(cls, (torch.nn.Module, types.FunctionType, types.MethodType,
                        types.ModuleType, BaseException)):
        return False
    for klass in cls.__mro__[:-1]:
        if klass.__module__ == "builtins" and klass is not object:
            return False  # a dict or list subclass: its items are not in __dict__
        own = vars(klass)
        if any(name in own and own[name] not in _PLAIN_PROTOCOL for name in _PROTOCOL):
            return False
    return True


def _plain_protocol() -> frozenset[Any]:
    """Copy protocols that copy plainly: a distribution transform's ``__getstate__``
    only drops the weak reference to its inverse (a ``TanhTransform`` in SAC's policy
    distribution; a transform that holds one is refused by the walk)."""
    transform = getattr(getattr(torch.distributions, "transforms", None), "Transform", None)
    state = vars(transform).get("__getstate__") if transform is not None else None
    return frozenset({state} if state is not None else ())


_PLAIN_PROTOCOL = _plain_protocol()


def reachable(roots: Iterable[Any], limit: int = MAX_NODES) -> tuple[set[int], bool]:
    """The ids of ``roots`` and of the containers and plain objects they reach (not
    into tensors or modules' internals): what a call's output may hold that existed
    before the call; and whether that is all of them (past ``limit`` it stops)."""
    seen: set[int] = set()
    stack = list(roots)
    while stack and len(seen) < limit:
        value = stack.pop()
        if id(value) in seen or isinstance(value, (torch.Tensor, *_ATOMS)):
            if isinstance(value, torch.Tensor):
                seen.add(id(value))
            continue
        if type(value) is tuple and all(isinstance(v, _ATOMS) for v in value):
            continue  # (a merges table's pairs: made again, they are equal tuples)
        seen.add(id(value))
        if isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, torch.nn.Module):
            continue  # its attributes are roots of their own (the watched modules')
        else:
            stack.extend(getattr(value, "__dict__", {}).values())
    return seen, not stack


def containers_of(output: Any) -> set[int]:
    """The ids of the lists, tuples and dicts that pytree opens in ``output`` (outside
    any object): such a container reached from inside an object would be two."""
    ids: set[int] = set()
    stack = [output]
    while stack:
        value = stack.pop()
        if isinstance(value, (list, tuple)):
            ids.add(id(value))
            stack.extend(value)
        elif isinstance(value, dict):
            ids.add(id(value))
            stack.extend(value.values())
    return ids


def open_leaf(value: Any) -> list[Any] | None:
    """The tensors of an output leaf that is an object made again per call (for
    comparisons of outputs), or None if it is none."""
    if isinstance(value, (torch.Tensor, *_ATOMS)):
        return None
    try:
        found = Spliced.find([value], any_tensor=True)
    except Refused:
        return None
    return found.tensors if found is not None else None


def opened(leaves: list[Any]) -> list[Any]:
    """``leaves`` with each object that is made again replaced by its tensors (what
    comparisons of outputs look at: two caches are equal by their tensors)."""
    out: list[Any] = []
    for leaf in leaves:
        found = open_leaf(leaf)
        out.extend(found if found is not None else [leaf])
    return out
