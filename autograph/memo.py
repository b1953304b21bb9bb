"""A memo in front of the key function: the tensor part of recent keys, found by one check.

Keying a call reads each tensor argument's shape, strides, dtype, device and
``requires_grad`` in Python, about 0.7 µs a tensor on the replay path.  For calls of
plain positional tensors, :class:`KeyMemo` keeps the tensor part of the last few keys
with torch's own tensor check (``torch._C._dynamo.guards.TensorGuards``, what Dynamo
guards compiled frames with): one C++ call compares every tensor's Python type,
dispatch keys (layout, inference tensors, conjugate and negative bits), dtype, device,
``requires_grad``, sizes and strides with the ones the entry was made from.  A call that
passes one check has the very leaf keys :func:`~autograph.keys.key_call` would compute;
the rest of the key (modes, the training flag, aliasing, addresses of written
arguments) is read on every call as before.  Where this torch lacks the check, or
builds it differently, the memo stays empty and every call takes the full path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _find_check() -> Any:
    try:
        from torch._C._dynamo import guards
    except ImportError:  # pragma: no cover - a torch without Dynamo's guards
        return None
    return getattr(guards, "TensorGuards", None)


_TensorGuards: Any = _find_check()

# One C++ pass comparing tensors' data pointers with expected ones (CUDA builds)
_ptrs_equal: Any = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)

MAX_REMEMBERED = 8  # keys per memo; past it the oldest goes


class Remembered:
    """The tensor part of one key, with the check that recognises it."""

    __slots__ = ("check", "n", "parts", "tensor_pos", "device", "shortcut", "bound")

    def __init__(self, check: Callable[..., bool], parts: tuple[Any, ...],
                 device: torch.device) -> None:
        self.check = check  # TensorGuards.check: True for tensors keyed as ``parts``
        self.n = len(parts)
        self.parts = parts
        self.tensor_pos = tuple(range(self.n))
        self.device = device
        # the replay of the last key replayed with these tensors (shortcut.py), and
        # what it was made from: (entry, runner, key)
        self.shortcut: Callable[[tuple[Any, ...]], Any] | None = None
        self.bound: tuple[Any, Any, Any] | None = None


class KeyMemo:
    """The last few tensor parts keyed for one callable's plain positional calls."""

    __slots__ = ("recent", "__weakref__")

    def __init__(self) -> None:
        self.recent: list[Remembered] = []

    def find(self, args: tuple[Any, ...]) -> Remembered | None:
        """The remembered part for these arguments, or None (the full path keys them)."""
        n = len(args)
        for known in self.recent:
            if known.n == n and known.check(*args):
                return known
        return None

    def unbind(self, entry: Any) -> None:
        """Drop the shortcuts that replay ``entry``'s graph, which is being freed: they
        would keep its buffers (and rotation slots) alive until these tensors key again."""
        for known in self.recent:
            if known.bound is not None and known.bound[0] is entry:
                known.shortcut = known.bound = None

    def learn(self, args: tuple[Any, ...], parts: tuple[Any, ...],
              device: torch.device) -> None:
        """Remember the leaf keys ``parts`` that the full path gave these arguments
        (every one a plain tensor)."""
        if _TensorGuards is None:
            return
        try:
            guards = _TensorGuards(*args, dynamic_dims_sizes=[list(p[0]) for p in parts],
                                   dynamic_dims_strides=[list(p[1]) for p in parts])
        except Exception:  # noqa: BLE001 - a check built otherwise here: no memo
            return
        recent = self.recent
        if len(recent) >= MAX_REMEMBERED:
            del recent[0]
        recent.append(Remembered(guards.check, parts, device))


def same_tensors(tensors: list[torch.Tensor]) -> Callable[[list[torch.Tensor]], bool]:
    """A check that a list of tensors has, one by one, the Python type, the metadata (as
    the memo's check reads it) and the addresses that ``tensors`` have now: what an object
    argument's finished key holds of its tensors (``objects.finish``)."""
    ptrs = [t.data_ptr() for t in tensors]
    n = len(ptrs)
    guards = None
    if _TensorGuards is not None:
        try:
            guards = _TensorGuards(*tensors,
                                   dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                   dynamic_dims_strides=[list(t.stride()) for t in tensors])
        except Exception:  # noqa: BLE001 - a check built otherwise here: read them all
            guards = None
    if guards is None:
        meta = _metadata(tensors)
        return lambda now: _metadata(now) == meta
    check = guards.check
    if _ptrs_equal is not None:
        every = list(range(n))
        return lambda now: len(now) == n and check(*now) and _ptrs_equal(now, ptrs, every)
    return lambda now: len(now) == n and check(*now) and [t.data_ptr() for t in now] == ptrs


def _metadata(tensors: list[torch.Tensor]) -> list[tuple[Any, ...]]:
    return [(type(t), t.shape, t.stride(), t.dtype, t.device, t.data_ptr()) for t in tensors]
