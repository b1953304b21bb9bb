"""The flattened arguments of one call, and how they are flattened.

``keys.key_call`` flattens a call's ``(args, kwargs)`` into leaves.  A call of plain
positional and keyword arguments whose values pytree would keep whole (tensors, values,
objects of types it does not open) skips pytree; anything else goes through
``torch.utils._pytree``, and :func:`spec_key` makes its TreeSpec hashable for the key.
:class:`Flat` keeps the leaves and how to rebuild ``(args, kwargs)`` from a (possibly
substituted) leaf list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .objects import ObjectKey, Walked, cache_hint, finish, object_key
from .objects import changes as objects_changes
from .vocab import Uncapturable

BY_VALUE = (
    type(None), bool, int, str, bytes, torch.dtype, torch.device, torch.layout,
    torch.memory_format, type(Ellipsis), torch.Size,
)
# types keyed without opening anything: tensors and values
FLAT = frozenset({torch.Tensor, torch.nn.Parameter, float, *BY_VALUE}).__contains__
# pytree's ``is_leaf`` for arguments and outputs: a ``torch.Size`` stays one leaf, handed back whole
# (pytree opens it as a tuple and ``tree_unflatten`` rebuilds a plain tuple); a builtin,
# so a walk pays no Python call per node for it
size_leaf: Callable[[Any], bool] = torch.Size.__instancecheck__


class Flat:
    """The flattened arguments of one call: ``leaves`` in order, and how to put a
    (possibly substituted) leaf list back into ``(args, kwargs)``."""

    __slots__ = ("leaves", "nargs", "kw_names", "spec", "tensor_pos", "objects", "original")

    def __init__(self, leaves: list[Any] | tuple[Any, ...], nargs: int,
                 kw_names: tuple[str, ...], spec: Any, tensor_pos: tuple[int, ...],
                 objects: tuple[tuple[int, Walked, ObjectKey, torch.device], ...] = ()
                 ) -> None:
        self.leaves = leaves
        self.nargs = nargs
        self.kw_names = kw_names
        self.spec = spec  # a torch TreeSpec, or None when no container was opened
        self.tensor_pos = tensor_pos
        # object arguments (``objects.py``): (position, its walk, its key, the device)
        self.objects = objects
        # the caller's own (args, kwargs) where containers were opened (``spec``): eager
        # runs get them, so that an item the function adds to a dict argument reaches
        # the caller's dict, as in eager mode
        self.original: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    def requires_grad(self) -> bool:
        """Whether a tensor argument requires grad."""
        leaves = self.leaves
        return any(leaves[i].requires_grad for i in self.tensor_pos)

    def inference(self) -> bool:
        """Whether a tensor argument is an inference tensor."""
        leaves = self.leaves
        return any(leaves[i].is_inference() for i in self.tensor_pos)

    def object_storages(self) -> frozenset[int]:
        """Storage addresses of the tensors inside object arguments (keyed by address:
        a graph may read them without a guard of its own)."""
        objects = self.objects
        if len(objects) == 1:
            return objects[0][1].bases
        return frozenset(base for _, walked, _, _ in objects for base in walked.bases)

    def sharers(self, bases: frozenset[int]) -> tuple[int, ...]:
        """The tensor arguments whose storage address is in ``bases``."""
        return sharers(self.leaves, self.tensor_pos, bases)

    def object_changes(self) -> str | None:
        """What the call changed in its object arguments' structure, or None."""
        for pos, _walked, before, device in self.objects:
            try:
                after, again = object_key(self.leaves[pos])
                after = finish(after, again, device)
            except Uncapturable as exc:  # (its reason is not this call's)
                why = f" ({exc.detail})" if exc.detail else ""
                hint = cache_hint(self.leaves[pos])
                return (f"the call changed an argument object so that it can no longer be "
                        f"keyed{why}{'' if hint in why else hint}")
            problem = objects_changes(before, after, again)
            if problem:
                return problem + cache_hint(self.leaves[pos])
        return None

    def rebuild(self, leaves: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.spec is None:
            n = self.nargs
            return tuple(leaves[:n]), dict(zip(self.kw_names, leaves[n:]))
        return pytree.tree_unflatten(leaves, self.spec)  # type: ignore[no-any-return]

    def call(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments: the caller's own where containers were opened."""
        if self.original is not None:
            return self.original
        return self.rebuild(list(self.leaves))

    def rebuilder(self) -> Callable[[list[Any]], tuple[tuple[Any, ...], dict[str, Any]]]:
        """:meth:`rebuild` for calls of this structure, without keeping these leaves."""
        shape = Flat([], self.nargs, self.kw_names, self.spec, self.tensor_pos, self.objects)
        return shape.rebuild


def sharers(leaves: Any, positions: Any, bases: frozenset[int]) -> tuple[int, ...]:
    """The positions of the tensors in ``leaves`` whose storage address is in ``bases``
    (computed from the data pointer: no storage object is made)."""
    return tuple(i for i in positions if leaves[i].numel() and leaves[i].data_ptr()
                 - leaves[i].storage_offset() * leaves[i].element_size() in bases)


# type -> whether pytree leaves it closed (tensors, values, and objects of types it does
# not open: a cache object, a tokenizer's output before it is registered); dropped
# whenever pytree registers another type
_closed: dict[type, bool] = {}
_nodes_known = [0]


def unopened(tp: type) -> bool:
    """Whether pytree would keep an argument of type ``tp`` whole (a leaf)."""
    if len(pytree.SUPPORTED_NODES) != _nodes_known[0]:
        _closed.clear()
        _nodes_known[0] = len(pytree.SUPPORTED_NODES)
    closed = _closed.get(tp)
    if closed is None:  # tuples (named ones, structseqs) are containers to pytree
        closed = _closed[tp] = FLAT(tp) or (
            tp not in pytree.SUPPORTED_NODES and not issubclass(tp, (tuple, list, dict)))
    return closed



def spec_key(spec: Any) -> Any:
    """A hashable stand-in for a TreeSpec (its type, context and children)."""
    if spec.is_leaf():
        return None
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    return (spec.type, _hashable(spec.context), tuple(spec_key(c) for c in children))


def _hashable(context: Any) -> Any:
    if isinstance(context, list):
        return tuple(_hashable(c) for c in context)
    try:
        hash(context)
    except TypeError:
        return repr(context)
    return context
