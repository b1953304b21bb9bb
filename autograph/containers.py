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

import dataclasses
from collections.abc import MutableMapping, MutableSequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .coderefs import same
from .flat import Flat, size_leaf, unopened
from .vocab import EagerReason, Uncapturable

Where = int | str  # a positional argument's index, or a keyword argument's name
Snapshot = list[tuple[Where, Any, Any, list[Any]]]  # (where, container, spec, leaves)


@dataclasses.dataclass(frozen=True)
class Sync:
    """A container argument the function changes and returns: ``arg`` says where the
    caller passed it, ``slot`` where the output holds it (None: it is the output)."""

    arg: Where
    slot: int | None


def snapshot(flat: Flat, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Snapshot:
    """Each top-level container argument and how it flattens now (before the call).
    Empty where the call opened no container."""
    if flat.spec is None:
        return []
    tops: list[tuple[Where, Any]] = [*enumerate(args), *kwargs.items()]
    out: Snapshot = []
    for where, value in tops:
        if not unopened(type(value)):  # a container pytree opens
            leaves, spec = pytree.tree_flatten(value, is_leaf=size_leaf)
            out.append((where, value, spec, leaves))
    return out


def changes(snap: Snapshot, out: Any) -> tuple[Sync, ...]:
    """What the call changed in its container arguments, as :class:`Sync` entries;
    raises :class:`Uncapturable` for a change a replay cannot repeat."""
    found: list[Sync] = []
    for where, value, spec, leaves in snap:
        now, spec_now = pytree.tree_flatten(value, is_leaf=size_leaf)
        if spec_now == spec and len(now) == len(leaves) and all(
                a is b or (not isinstance(a, torch.Tensor) and same(a, b))
                for a, b in zip(now, leaves)):
            continue
        if not isinstance(value, (MutableMapping, MutableSequence)):
            raise Uncapturable(EagerReason.ASSIGNS, f"an item inside a "
                               f"{type(value).__name__} argument")
        found.append(Sync(where, _slot(value, out)))
    return tuple(found)


def _slot(value: Any, out: Any) -> int | None:
    if out is value:
        return None
    if isinstance(out, (tuple, list)):
        for k, item in enumerate(out):
            if item is value:
                return k
    raise Uncapturable(EagerReason.ASSIGNS, "an item of a dict or list argument that the "
                       "call does not return")


def apply(syncs: tuple[Sync, ...], flat: Flat, result: Any) -> Any:
    """After a replay: the caller's containers given the items of the returned ones,
    and returned in their place."""
    original = flat.original
    if original is None:  # pragma: no cover - a Sync is only learned with containers
        return result
    args, kwargs = original
    for sync in syncs:
        mine = args[sync.arg] if isinstance(sync.arg, int) else kwargs[sync.arg]
        theirs = result if sync.slot is None else result[sync.slot]
        if theirs is mine:  # an eager run's result (verify.py): changed already
            continue
        if isinstance(mine, MutableMapping):
            mine.clear()
            mine.update(theirs)
        else:
            mine[:] = theirs
        if sync.slot is None:
            result = mine
        elif isinstance(result, list):
            result[sync.slot] = mine
        else:
            result = type(result)(*[mine if k == sync.slot else v  # a named tuple too
                                    for k, v in enumerate(result)]) \
                if hasattr(result, "_fields") else \
                tuple(mine if k == sync.slot else v for k, v in enumerate(result))
    return result
