"""Dict and list arguments that the function changes, and how a replay repeats it.

A graphed function receives containers rebuilt from the flattened arguments (a capture
substitutes static buffers for the tensors), and a replay runs no Python at all.  A
function that adds an item to a dict argument (sentence-transformers' modules do:
``features.update(...)``; ``return features``) would leave the caller's dict as it was.

Eager runs get the caller's own containers (``Flat.original``).  For a graph, the
change is learned where it happens (a warmup or the capture compares each top-level
container argument before and after the call): a changed top-level mutable mapping or
sequence (a ``dict``, a ``list``, transformers' ``BatchEncoding``) that the function
returns (as its output, or an item of a returned tuple or list) is a :class:`Sync`;
each replay then gives the caller's container the returned one's items and returns the
caller's container in its place, as eager mode does.  Any other change (a container
not returned, or nested in another argument) makes the key run eagerly
(``assigns_attribute``).
"""

from __future__ import annotations

import collections
import collections.abc
import copy
import dataclasses
import io
import itertools
import threading
import types
import warnings
from collections.abc import Iterable, Mapping, MutableMapping, MutableSequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .coderefs import _namespace, _user_class, same
from .coderefs import attributes as _attributes
from .flat import Flat, size_leaf, unopened
from .reach import Named
from .vocab import EagerReason, Uncapturable

Where = int | str  # a positional argument's index, or a keyword argument's name


@dataclasses.dataclass(frozen=True)
class Top:
    """A top-level container argument before the call: how it flattens, and the
    mutable containers it holds directly (key or index: the container, its leaves)."""

    where: Where
    value: Any
    spec: Any
    leaves: list[Any]
    nested: dict[Any, tuple[Any, Any, list[Any]]]


Snapshot = list[Top]


@dataclasses.dataclass(frozen=True)
class Sync:
    """A container argument the function changes and returns: ``arg`` says where the
    caller passed it, ``slots`` where the output holds it (None: it is the output),
    ``keep`` the keys of the dicts it holds, which keep the caller's own objects."""

    arg: Where
    slots: tuple[int, ...] | None
    keep: tuple[Any, ...] = ()


def shared(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether one mutable container (a dict, a list, a mapping or sequence pytree
    opens) is passed more than once (``f(d, d)``, or inside another argument): the
    function would get one rebuilt container per place, so a change made through one
    would not show through the other, as it does in eager mode."""
    seen: set[int] = set()
    stack: list[Any] = [*args, *kwargs.values()]
    while stack:
        value = stack.pop()
        if unopened(type(value)):
            continue
        if isinstance(value, (MutableMapping, MutableSequence)):
            if id(value) in seen:
                return True
            seen.add(id(value))
        if isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return False


def snapshot(flat: Flat, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Snapshot:
    """Each top-level container argument and how it flattens now (before the call).
    Empty where the call opened no container."""
    if flat.spec is None:
        return []
    out: Snapshot = []
    tops: list[tuple[Where, Any]] = [*enumerate(args), *kwargs.items()]
    for where, value in tops:
        if not unopened(type(value)):  # a container pytree opens
            spec, leaves = _flatten(value)
            items = value.items() if isinstance(value, Mapping) else \
                enumerate(value) if isinstance(value, (list, tuple)) else ()
            nested = {k: (v, *_flatten(v)) for k, v in items
                      if isinstance(v, (MutableMapping, MutableSequence))}
            out.append(Top(where, value, spec, leaves, nested))
    return out


def _flatten(value: Any) -> tuple[Any, list[Any]]:
    leaves, spec = pytree.tree_flatten(value, is_leaf=size_leaf)
    return spec, leaves


def _same(value: Any, spec: Any, leaves: list[Any]) -> bool:
    spec_now, now = _flatten(value)
    return spec_now == spec and len(now) == len(leaves) and all(
        a is b or (not isinstance(a, torch.Tensor) and same(a, b))
        for a, b in zip(now, leaves))


def changes(snap: Snapshot, out: Any) -> tuple[Sync, ...]:
    """What the call changed in its container arguments, as :class:`Sync` entries;
    raises :class:`Uncapturable` for a change a replay cannot repeat."""
    found: list[Sync] = []
    for top in snap:
        if _same(top.value, top.spec, top.leaves):
            continue
        if not isinstance(top.value, (MutableMapping, MutableSequence)):
            raise Uncapturable(EagerReason.ASSIGNS, f"an item inside a "
                               f"{type(top.value).__name__} argument")
        if top.nested and not isinstance(top.value, MutableMapping):
            raise Uncapturable(EagerReason.ASSIGNS, "a list argument holding dicts or lists")
        mapping: Any = top.value
        keep = []  # the nested containers the call left in place (a key rebound to a
        # new list, ``d["parts"] = [...]``, takes the returned one)
        for key, (inner, spec, leaves) in top.nested.items():
            if not _same(inner, spec, leaves):
                raise Uncapturable(EagerReason.ASSIGNS, "an item of a dict or list inside "
                                   "an argument")
            if mapping.get(key) is inner:
                keep.append(key)
        found.append(Sync(top.where, _slots(top.value, out), tuple(keep)))
    return tuple(found)


def _slots(value: Any, out: Any) -> tuple[int, ...] | None:
    if out is value:
        return None
    if isinstance(out, (tuple, list)):
        slots = tuple(k for k, item in enumerate(out) if item is value)
        if slots:
            return slots
    raise Uncapturable(EagerReason.ASSIGNS, "an item of a dict or list argument that the "
                       "call does not return")


def apply(syncs: tuple[Sync, ...], flat: Flat, result: Any) -> Any:
    """After a replay: the caller's containers given the items of the returned ones
    (the dicts they held kept as the caller's own objects), and returned in their
    place."""
    original = flat.original
    if original is None:  # pragma: no cover - a Sync is only learned with containers
        return result
    args, kwargs = original
    for sync in syncs:
        mine = args[sync.arg] if isinstance(sync.arg, int) else kwargs[sync.arg]
        theirs = result if sync.slots is None else result[sync.slots[0]]
        if theirs is mine:  # an eager run's result (verify.py): changed already
            continue
        if isinstance(mine, MutableMapping):
            kept = {key: mine[key] for key in sync.keep}
            mine.clear()
            mine.update(theirs)
            mine.update(kept)
        else:
            mine[:] = theirs
        result = _put(result, sync.slots, mine)
    return result


def _put(result: Any, slots: tuple[int, ...] | None, mine: Any) -> Any:
    """``result`` with ``mine`` at ``slots`` (None: ``mine`` is the result)."""
    if slots is None:
        return mine
    if isinstance(result, list):
        for k in slots:
            result[k] = mine
        return result
    items = [mine if k in slots else v for k, v in enumerate(result)]
    return type(result)(*items) if hasattr(result, "_fields") else tuple(items)


# -- containers that modules hold -------------------------------------------------------
# what ``nn.Module.__init__`` puts in a module's ``__dict__`` (parameters, hooks, ...)
MODULE_INTERNALS = frozenset(vars(nn.Module()))
_HELD_TYPES = (list, dict, set, collections.deque)  # and their subclasses
MAX_HELD = 100_000  # items compared per call's modules (past it: the rest unchecked)

# ("Module.name" or a global's name, a container or plain object it holds (or one
# inside it), what that holds now (:func:`_contents`), a shallow copy (for an object:
# its attributes))
Held = list[tuple[str, Any, tuple[Any, ...], Any]]
MODULE_CONTAINER = "a list, dict or set that a module holds or the code names"
MODULE_OBJECT = "an attribute of an object that a module holds"
# a container inside an object, or an iterator's pickled state, longer than this: by
# its length and ends
_LARGE = 256


def held(modules: Iterable[nn.Module], named: Iterable[tuple[str, Any]] = ()) -> Held:
    """The lists, dicts, sets and deques (``OrderedDict``, ``defaultdict`` too), the
    plain objects (a ``SimpleNamespace``, a dataclass, an object of the user's class)
    and the iterators (``itertools.count``, ``cycle``), that ``modules`` hold as plain
    attributes (``self.maps = []``, ``self.state = State()``), those ``named``
    (globals and closure cells the code names, :func:`named_by`), and the containers
    inside them, with what each holds now."""
    out: Held = []
    budget = [MAX_HELD]
    seen: set[int] = set()  # each once (transformers' layers all hold one config)
    for m in modules:
        for name, value in vars(m).items():
            if name not in MODULE_INTERNALS and _holds(value):
                _hold(f"{type(m).__name__}.{name}", value, out, budget, seen)
    for label, value in named:
        if _holds(value):
            _hold(label, value, out, budget, seen)
    return out


def _holds(value: Any) -> bool:
    """A container or plain object whose contents :func:`held` compares."""
    return isinstance(value, _HELD_TYPES) or _object(value)


def _object(value: Any) -> bool:
    return _iterator(value) or (
        _namespace(value) and not isinstance(value, (types.ModuleType, threading.local)))


def _iterator(value: Any) -> bool:
    """An iterator of the standard library's a call may advance (``next(self.counter)``;
    not a file; one of the user's class is an object, compared by its attributes)."""
    return isinstance(value, collections.abc.Iterator) and not isinstance(
        value, (io.IOBase, torch.Tensor, nn.Module)) and not _namespace(value)


def _hold(label: str, value: Any, out: Held, budget: list[int], seen: set[int]) -> None:
    """Add ``value`` and the containers inside it to ``out`` (``budget``: the items left
    to compare; no object inside a container)."""
    stack = [value]
    while stack and budget[0] > 0:
        c = stack.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        contents = _contents(c)
        budget[0] -= len(contents)
        if isinstance(c, _HELD_TYPES):
            out.append((label, c, contents, copy.copy(c)))
            inner: Any = c.values() if isinstance(c, dict) else c
            stack.extend(v for v in inner if isinstance(v, _HELD_TYPES))
            continue
        attributes = {} if _iterator(c) else dict(_attributes(c))
        out.append((label, c, contents, attributes))
        for v in attributes.values():
            if isinstance(v, _HELD_TYPES) and len(v) > _LARGE and id(v) not in seen:
                # an object's large container (a tokenizer's vocabulary): by its length
                # and ends, no copy (an append is seen; a change in the middle is not)
                seen.add(id(v))
                out.append((label, v, _ends(v), _ENDS_ONLY))
            elif isinstance(v, _HELD_TYPES):
                stack.append(v)


def named_by(named: Iterable[Named]) -> list[tuple[str, Any]]:
    """The lists, dicts, sets and deques among the values the code names as globals or
    closure cells (``reach.named_values``: ``SEEN.append(y)`` with ``SEEN = []`` global,
    a ``log(y)`` helper appending to it), and those that the namespaces and user classes
    it names hold under the attributes it reads (``cfg.items.append(y)``): a change the
    call makes to one is Python a replay would not repeat."""
    out: list[tuple[str, Any]] = []
    for n in named:
        if isinstance(n.value, _HELD_TYPES):
            out.append((n.label, n.value))
        elif _namespace(n.value) or (isinstance(n.value, type) and _user_class(n.value)):
            attributes = _attributes(n.value)
            out += [(f"{n.label}.{a}", attributes[a]) for a in sorted(n.reads)
                    if isinstance(attributes.get(a), _HELD_TYPES)]
    return out


def held_change(before: Held) -> str | None:
    """What the call changed of the containers in ``before`` (``self.maps.append(y)``,
    ``self.feats["a"]["last"] = y``), or None: a replay runs no Python, so it would not
    repeat the change, and a tensor the capture stored there would be the graph's,
    overwritten by every replay."""
    for label, value, contents, saved in before:
        if (_ends(value) if saved is _ENDS_ONLY else _contents(value)) != contents:
            what = MODULE_CONTAINER if isinstance(value, _HELD_TYPES) else MODULE_OBJECT
            return f"{what} ({label})"
    return None


_ENDS_ONLY = object()  # what a large container inside an object saves: nothing


def _ends(value: Any) -> tuple[Any, ...]:
    """A large container's length and the items at its ends (a dict's last items, a
    set's length only), read in constant time."""
    if isinstance(value, dict):
        last = itertools.islice(reversed(value.items()), 8)
        return (len(value), *map(id, itertools.chain.from_iterable(last)))
    if isinstance(value, (list, collections.deque)):
        return (len(value), *map(id, itertools.islice(value, 8)),
                *map(id, itertools.islice(reversed(value), 8)))
    return (len(value),)


def restore(before: Held) -> None:
    """Give the containers and objects in ``before`` that a capture changed what they
    held: the call then runs eagerly and changes them once, as eager mode does, and
    the graph's tensors, which later replays would overwrite, are not left there.
    While other threads run, only the tensors new since ``before`` are taken out of a
    container (what another thread put there meanwhile stays; an object's attributes
    are all put back).  An iterator cannot be put back."""
    alone = threading.active_count() == 1
    for _, value, contents, saved in before:
        if saved is _ENDS_ONLY:
            _restore_appended(value, contents[0], alone)
            continue
        if _contents(value) == contents:
            continue
        if isinstance(value, dict):
            _restore_dict(value, saved, alone)
        elif isinstance(value, (list, collections.deque)):
            _restore_sequence(value, saved, alone)
        elif isinstance(value, set):
            if alone:
                value.clear()
                value.update(saved)
        elif not _iterator(value):  # an object's attributes: all (threads or not)
            now = _attributes(value)
            for k in [k for k in now if k not in saved]:
                _quietly(object.__delattr__, value, k)
            for k, v in saved.items():
                if now.get(k, _GONE) is not v:  # (past a frozen dataclass's __setattr__)
                    _quietly(object.__setattr__, value, k, v)


def _restore_dict(value: dict[Any, Any], saved: dict[Any, Any], alone: bool) -> None:
    if alone:
        value.clear()
        value.update(saved)
        return
    for k in [k for k, v in value.items() if isinstance(v, torch.Tensor)
              and (k not in saved or saved[k] is not v)]:
        if k in saved:
            value[k] = saved[k]
        else:
            del value[k]


def _restore_appended(value: Any, length: int, alone: bool) -> None:
    """Take out what was appended to a large list or deque (of which no copy is kept)
    past ``length`` (only tensors while other threads run)."""
    if isinstance(value, (list, collections.deque)) and len(value) > length:
        for i in reversed(range(length, len(value))):
            if alone or isinstance(value[i], torch.Tensor):
                del value[i]


def _restore_sequence(value: Any, saved: Any, alone: bool) -> None:
    if alone:
        value.clear()
        value.extend(saved)
        return
    old = {id(v) for v in saved}
    fresh = [i for i, v in enumerate(value) if isinstance(v, torch.Tensor) and id(v) not in old]
    for i in reversed(fresh):  # by position: tensors do not compare as values
        del value[i]


_GONE = object()


def _quietly(put: Any, *args: Any) -> None:
    try:
        put(*args)
    except Exception:  # noqa: BLE001 - a read-only attribute: the call runs eagerly anyway
        pass


def _contents(value: Any) -> tuple[Any, ...]:
    """What ``value`` holds, by identity (its items; an object's attribute names and
    values; where an iterator stands, :func:`_where`)."""
    if isinstance(value, dict):
        return tuple(map(id, (*value.keys(), *value.values())))
    if isinstance(value, _HELD_TYPES):
        return tuple(map(id, value))
    if _iterator(value):
        return (_where(value),)
    attributes = _attributes(value)
    return tuple(map(id, (*attributes.keys(), *attributes.values())))


def _where(value: Any, depth: int = 6) -> Any:
    """Where an iterator stands, comparable with ``==``: its pickling state (``count``'s
    number, a range or list iterator's index, a ``cycle``'s saved items and the
    iterator it draws from, followed ``depth`` levels; a long list of the items left by
    its length and ends); a new object (changed) for a generator, whose position its
    frame does not show (a loop's iterator is on its stack); None where it shows none
    (not seen)."""
    if isinstance(value, types.GeneratorType):
        return object()
    if depth and _iterator(value):
        try:
            with warnings.catch_warnings():  # (itertools' pickling is deprecated in 3.12)
                warnings.simplefilter("ignore")
                state = value.__reduce__()
        except Exception:  # noqa: BLE001
            return None
        return (type(value), _where(state, depth - 1))
    if depth and isinstance(value, (tuple, list)):
        if len(value) > _LARGE:  # (a dict iterator's items left, listed anew)
            return (len(value), _where(value[0], depth - 1), _where(value[-1], depth - 1))
        return tuple(_where(v, depth - 1) for v in value)
    return value if isinstance(value, _PLAIN) else id(value)


_PLAIN = (int, float, str, bytes, bool, type(None), type, range, slice)
