"""Persistent padded inputs: per bucket, buffers that padded calls write in place.

A padded call used to allocate a padded copy of each batch argument, copy the real rows
in and fill the padded rows, every call.  Here each bucket keeps, per layout of its
batch arguments, one buffer per argument at the bucket's size, allocated once (in the
argument's dimension order, as ``padding.empty_in_layout`` makes it).  A call copies
its real rows in, with one batched copy into views made once per real size, and passes
the buffers on; nothing else is allocated.  The engine captures the buffers at their own
address (``cache.pinned``), as it does arguments written in place, so that copy is the
only one a padded replay makes (a call of the bucket's own size goes through the
buffers too, and replays the same graph).

The padded rows hold the pad value on every call: they are filled when the buffer is
made, and filled again only where a larger batch left real rows behind (each buffer
set remembers from which row on it is clean) or after the function wrote into a buffer
in place; measured on the CPU, filling lazily costs nothing on calls of one size, while
filling on every call costs one ``fill_`` per argument (``tools/pad_overhead.py``).

The caller's tensors are only read, except that rows the function wrote in place into
a padded argument are copied back into the caller's tensor, as eager would have
written them.  Outputs that view a buffer are cloned, so a later call never changes a
result already returned.  The buffers serve one call at a time (a lock taken without
waiting: a concurrent or nested call pads into fresh tensors instead), only calls made
without grad mode (autograd could keep a buffer for a backward that a later call would
then break), and, made in inference mode, only calls in inference mode (they are
inference tensors).  On CUDA a call on another stream than the last one first waits
for it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .cache import GraphCache, pinned
from .capture import _current_stream, _stream_of
from .flat import size_leaf
from .padding import Batch, empty_in_layout, out_dim

_foreach_copy = getattr(torch, "_foreach_copy_", None)
_NO_PIN = contextlib.nullcontext()

# layouts and real sizes kept per bucketer, past which the oldest sets are dropped
MAX_SLOTS = 128


class Buffers:
    """The padded buffers of one bucket for one layout of the batch arguments."""

    __slots__ = ("tensors", "dims", "fills", "clean", "stream", "ptrs", "ids")

    def __init__(self, batch: Batch, size: int, fills: list[Any]) -> None:
        self.tensors: list[torch.Tensor] = []
        self.dims = [d for _, _, d in batch]
        self.fills = fills  # the pad value of each argument
        for (_, t, dim), value in zip(batch, fills):
            shape = list(t.shape)
            shape[dim] = size
            buf = empty_in_layout(t, shape)
            buf.fill_(value)
            self.tensors.append(buf)
        self.clean = 0  # rows from here on hold the pad value
        self.stream: Any = None  # (CUDA) the stream of the last call
        self.ptrs = frozenset(b.untyped_storage().data_ptr() for b in self.tensors)
        self.ids = frozenset(id(b) for b in self.tensors)  # for ``cache.pinned``

    def refill(self, real: int) -> None:
        """Fill rows ``real`` on with the pad value (real rows of a larger batch were
        left there, or the function wrote into the buffers)."""
        for buf, dim, value in zip(self.tensors, self.dims, self.fills):
            size = buf.shape[dim]
            buf.narrow(dim, real, size - real).fill_(value)
        self.clean = real


class Slot:
    """Buffers seen through one real size: the views the real rows are copied into."""

    __slots__ = ("buffers", "views", "real", "out_dim", "ptrs", "ids", "pinned", "same")

    def __init__(self, buffers: Buffers, real: int, batch: Batch,
                 cache: GraphCache | None = None) -> None:
        self.buffers = buffers
        self.real = real
        # (a call of the bucket's size copies into the buffer itself: on the CPU a copy
        # into a view of all of it costs 0.4 us more)
        self.views = [b if b.shape[d] == real else b.narrow(d, 0, real)
                      for b, d in zip(buffers.tensors, buffers.dims)]
        self.out_dim = out_dim(batch)  # the dimension outputs are sliced back along
        self.ptrs = buffers.ptrs
        self.ids = buffers.ids
        # whether each real-rows view has its argument's strides (the layout of a slot
        # holds them): then an output viewing a buffer maps back onto the caller's tensor
        self.same = all(v.stride() == t.stride() for v, (_, t, _) in zip(self.views, batch))
        # while the call runs, the engine captures the buffers at their own address
        self.pinned: Any = pinned(cache, buffers.ids) if cache is not None else _NO_PIN


class PadSlots:
    """The persistent padded buffers of one bucketer, by bucket, layout and real size."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._slots: dict[Any, Slot] = {}
        self._buffers: dict[Any, Buffers] = {}

    def slot(self, batch: Batch, size: int, real: int,
             fills: Callable[[Batch], list[Any]], cache: GraphCache | None = None) -> Slot:
        """The slot of this call's layout, made on first use with the pad values
        ``fills(batch)`` returns (its buffers pinned in ``cache``).  Holding ``lock``."""
        layout = tuple([(k, d, t.shape, t.stride(), t.dtype, t.device) for k, t, d in batch])
        # buffers made in inference mode are inference tensors: written only in it
        size_mode = (size, torch.is_inference_mode_enabled())
        slot = self._slots.get((size_mode, layout))
        if slot is None:
            if len(self._slots) >= MAX_SLOTS:
                self._slots.clear()
                self._buffers.clear()
            shape = tuple((k, d, _without(t.shape, d), _order(t), t.dtype, t.device)
                          for k, t, d in batch)
            buffers = self._buffers.get((size_mode, shape))
            if buffers is None:
                buffers = self._buffers[(size_mode, shape)] = Buffers(batch, size, fills(batch))
            slot = self._slots[(size_mode, layout)] = Slot(buffers, real, batch, cache)
        return slot

    def clear(self) -> None:
        with self.lock:
            self._slots.clear()
            self._buffers.clear()


def fill(slot: Slot, args: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy the call's real rows (``args``: the batch arguments, in the batch's order)
    into the slot's buffers (refilling padded rows a larger batch left dirty) and return
    the buffers, in the same order."""
    buffers = slot.buffers
    first = buffers.tensors[0]
    if first.is_cuda:
        current = _current_stream(first.device.index)
        if buffers.stream is not None and buffers.stream != current:
            _stream_of(current).wait_stream(_stream_of(buffers.stream))
        buffers.stream = current
    if buffers.clean > slot.real:
        buffers.refill(slot.real)
    buffers.clean = slot.real
    views = slot.views
    if len(views) == 1:
        views[0].copy_(args[0])
    elif _foreach_copy is not None:
        _foreach_copy(views, args)
    else:  # pragma: no cover - torch without _foreach_copy_
        for view, t in zip(views, args):
            view.copy_(t)
    return buffers.tensors


def hand_back(slot: Slot, args: list[torch.Tensor], written: list[int]) -> None:
    """After a call that wrote in place into the padded arguments at ``written`` (indexes
    into the batch arguments ``args``): their real rows go to the caller's tensors, and
    the buffers' padded rows are refilled before the next call."""
    for i in written:
        args[i].copy_(slot.views[i])
    slot.buffers.clean = slot.buffers.tensors[0].shape[slot.buffers.dims[0]]


def unshared(out: Any, ptrs: frozenset[int]) -> Any:
    """``out`` with every tensor that lives in a padded buffer cloned: the next call
    writes the buffers, and must not change a result already returned."""
    if type(out) is torch.Tensor:  # the common case, without a pytree walk
        return out.clone() if out.untyped_storage().data_ptr() in ptrs else out

    def own(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() in ptrs:
            return x.clone()
        return x

    return pytree.tree_map(own, out, is_leaf=size_leaf)


def rebased(out: Any, slot: Slot, args: list[torch.Tensor]) -> Any:
    """``out`` of a call of the bucket's own size, with every tensor that views a buffer
    made the same view of the caller's tensor in ``args`` (the batch arguments, in the
    batch's order), as eager returns it (``slot.same``)."""
    ptrs = slot.ptrs
    if type(out) is torch.Tensor and out.untyped_storage().data_ptr() not in ptrs:
        return out
    index = {b.untyped_storage().data_ptr(): i for i, b in enumerate(slot.buffers.tensors)}

    def back(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        i = index.get(x.untyped_storage().data_ptr())
        if i is None:
            return x
        buf, arg = slot.buffers.tensors[i], args[i]
        if x.shape == arg.shape and x.stride() == arg.stride() and \
                x.storage_offset() == buf.storage_offset():
            return arg
        offset = arg.storage_offset() + x.storage_offset() - buf.storage_offset()
        return arg.as_strided(x.shape, x.stride(), offset)

    return pytree.tree_map(back, out, is_leaf=size_leaf)


def _without(shape: torch.Size, dim: int) -> tuple[int, ...]:
    return (*shape[:dim], -1, *shape[dim + 1:])


def _order(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s dimensions from outermost to innermost (what ``empty_in_layout`` keeps)."""
    strides = t.stride()
    return tuple(sorted(range(t.dim()), key=lambda d: (-strides[d], d)))
