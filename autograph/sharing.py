"""Outputs that share memory, handed out sharing it as in eager mode.

A graph's outputs in the pool are cloned on every call.  Outputs that share one
storage (the same tensor twice, a tensor and a slice or transpose of it, a tensor and a
view of its bytes as another dtype) are cloned together: one copy of the span they
cover, and each output the same view of that copy, so that writing through one shows
in the others (``buffers.output_builder`` uses :class:`Shared`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .mutation import storage_ptr


def is_clone(maker: Callable[..., Any]) -> bool:
    """Whether an output maker clones a pool tensor (``buffers._leaf_maker``)."""
    return getattr(maker, "_clone", False)


class Shared:
    """Pool outputs that share one storage, cloned together on every call: one copy of
    the span of the storage they cover, and each output that view of it (the same
    tensor object for an output that was the same object), so that writing through
    one shows in the others as in eager mode.  Outputs of several dtypes over the same
    bytes (``y`` and ``y.view(torch.int32)``) share a copy of the bytes."""

    __slots__ = ("span", "members", "views", "first", "dtypes", "bits")

    def __init__(self, values: list[torch.Tensor], members: list[int]) -> None:
        sizes = {values[k].element_size() for k in members}
        dtypes = {values[k].dtype for k in members}
        unit = 1 if len(dtypes) > 1 else sizes.pop()  # bytes, or elements of one dtype
        starts = [values[k].storage_offset() * values[k].element_size() // unit
                  for k in members]
        lo = min(starts)
        lo -= lo % 16 if unit == 1 else 0  # every member's bytes aligned in the copy
        hi = max(st + _extent(values[k]) * values[k].element_size() // unit
                 for st, k in zip(starts, members))
        first = _plain(values[members[0]])
        # pool memory (without conjugate or negative bits), read per call
        self.span = first.as_strided((hi - lo,), (1,), lo) if unit > 1 else torch.empty(
            0, dtype=torch.uint8, device=first.device).set_(
            first.untyped_storage(), lo, (hi - lo,), (1,))
        self.members = members
        self.dtypes = [values[k].dtype for k in members] if unit == 1 else None
        self.views = [(k, values[k].shape, values[k].stride(),
                       (st - lo) // (values[k].element_size() // unit))
                      for st, k in zip(starts, members)]
        ids: dict[int, int] = {}  # the first member that is the same object as member k
        self.first = [ids.setdefault(id(values[k]), k) for k in members]
        # each member's conjugate and negative bits (``y, y.mH``), put back on its view
        bits = [(values[k].is_conj(), values[k].is_neg()) for k in members]
        self.bits = bits if any(c or n for c, n in bits) else None

    @staticmethod
    def find(values: list[Any], makers: list[Callable[..., Any]]) -> list[Shared]:
        by_storage: dict[int, list[int]] = {}
        for k, (v, make) in enumerate(zip(values, makers)):
            if is_clone(make) and v.numel():
                by_storage.setdefault(storage_ptr(v), []).append(k)
        return [Shared(values, ks) for ks in by_storage.values() if len(ks) > 1]

    def fill(self, made: list[Any]) -> None:
        copy = self.span.clone()
        if self.dtypes is None:
            for (k, size, stride, offset), first in zip(self.views, self.first):
                made[k] = made[first] if first != k else copy.as_strided(size, stride, offset)
        else:
            storage = copy.untyped_storage()
            for (k, size, stride, offset), first, dtype in zip(self.views, self.first,
                                                               self.dtypes):
                made[k] = made[first] if first != k else torch.empty(
                    0, dtype=dtype, device=copy.device).set_(storage, offset, size, stride)
        if self.bits is not None:
            for k, first, (conj, neg) in zip(self.members, self.first, self.bits):
                if first == k:
                    view = made[k].conj() if conj else made[k]
                    made[k] = view._neg_view() if neg else view


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its conjugate and negative bits: the memory as stored."""
    t = t.conj() if t.is_conj() else t
    return t._neg_view() if t.is_neg() else t


def _extent(t: torch.Tensor) -> int:
    """Elements of storage ``t`` spans from its offset (1 + the last element's index)."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
