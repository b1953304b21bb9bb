"""The general walk of an object argument: its structure as a nested tuple, its tensors
listed in walk order (with where each sits, for messages).

``objects.object_key`` walks an object with :func:`walk` unless a keyer for its type is
registered (``known_types``).  Tensors leave a ``None`` slot (their keys come later, once
the call's device is known); Python scalars, strings, dtypes and devices are kept by
value (floats by their hex spelling); lists, tuples and dicts are walked; functions and
classes are kept by identity; any other object by its attributes (``__dict__`` and
``__slots__``).  The walk is bounded in depth and size.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from .vocab import EagerReason, Uncapturable

_Tensor = torch.Tensor
VALUES = (
    type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.layout,
    torch.memory_format, type(Ellipsis),
)
_MAX_DEPTH = 8
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
        return (float, x.hex())
    if isinstance(x, VALUES) or isinstance(x, enum.Enum):
        return (tx, x)
    if tx is list or tx is tuple:
        return ("seq", tx, tuple(walk(v, walked, f"{path}[{i}]", depth + 1, counter)
                                 for i, v in enumerate(x)))
    if tx is dict:
        keys = tuple(x)
        if not all(isinstance(k, (str, int)) for k in keys):
            return ("id", tx, id(x))
        return ("map", keys, tuple(walk(v, walked, f"{path}[{k!r}]", depth + 1, counter)
                                   for k, v in x.items()))
    if isinstance(x, type) or (callable(x) and not isinstance(x, torch.nn.Module)):
        return ("id", tx, id(x))  # a function or a class: by identity
    attrs = _attributes(x) if not isinstance(x, _UNOPENED) else None
    if attrs is None:
        where = f" (at {path})" if depth else ""
        raise Uncapturable(EagerReason.UNKEYABLE, f"argument of type {tx.__qualname__}{where} "
                           "(tensors, numbers, strings, None, dtypes, devices, containers "
                           "and objects with attributes are keyed)")
    names = tuple(attrs)
    return ("attrs", names, tuple(walk(v, walked, f"{path}.{k}", depth + 1, counter)
                                  for k, v in attrs.items()), tx)


def _attributes(x: Any) -> dict[str, Any] | None:
    """The instance attributes of ``x`` (``__dict__`` and filled ``__slots__``), or None
    for an object without any (keyed by identity then)."""
    d = getattr(x, "__dict__", None)
    out: dict[str, Any] = dict(d) if isinstance(d, dict) else {}
    for cls in type(x).__mro__:
        for name in cls.__dict__.get("__slots__", ()):
            if name in ("__dict__", "__weakref__") or name in out:
                continue
            try:
                out[name] = getattr(x, name)
            except AttributeError:
                continue
    if not out and not isinstance(d, dict):
        return None
    return out
