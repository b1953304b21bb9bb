"""What one captured graph needs of its memory pool, however little the pool grew.

Graphs of a device share one pool, so a graph captured after a larger one reuses the
memory that one's intermediates freed, and the growth of the allocator's reserved
memory reads 0 for it.  Its replays still need that memory, though, and a budget per
callable must count it.  :class:`Footprint` is a dispatch mode active during a capture
(only then): every tensor an operator returns in storage that is no argument,
parameter, buffer or static input counts as allocated until the last tensor object
seen on that storage is freed; ``peak`` is the most bytes live at once (on CUDA, each
storage rounded up to the caching allocator's 512-byte blocks).  Memory an operator
allocates for itself and frees before returning (a workspace) is not seen; the
engine takes the larger of this and the pool's growth.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .mutation import pass_higher_order

BLOCK = 512  # the CUDA caching allocator's smallest block


@pass_higher_order
class _Footprint(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # see mutation._Recorder
        return False

    def __init__(self, known: set[int], block: int = 1) -> None:
        super().__init__()
        self.known = known  # storages that were there before the capture
        self.block = block
        self.live = 0
        self.peak = 0
        self._count: dict[int, int] = {}  # storage -> tensor objects seen alive on it
        self._size: dict[int, int] = {}
        self._refs: dict[int, Any] = {}  # id(tensor) -> its weak reference

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in self._refs:
                self._note(t)
        return out

    def _note(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
            key = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage (a meta tensor)
            return
        if not key or key in self.known:
            return
        count = self._count.get(key, 0)
        if not count:
            size = -(-storage.nbytes() // self.block) * self.block
            self._size[key] = size
            self.live += size
            self.peak = max(self.peak, self.live)
        self._count[key] = count + 1
        ident = id(t)
        self._refs[ident] = weakref.ref(t, functools.partial(self._gone, ident, key))

    def _gone(self, ident: int, key: int, _ref: Any = None) -> None:
        self._refs.pop(ident, None)
        count = self._count.get(key, 0) - 1
        if count > 0:
            self._count[key] = count
            return
        self._count.pop(key, None)
        self.live -= self._size.pop(key, 0)

    def close(self) -> int:
        """Stop counting (the weak references go) and return the peak in bytes."""
        self._refs.clear()
        self._count.clear()
        self._size.clear()
        return self.peak


@pass_higher_order  # torch looks a mode's rule up by its exact class
class _DynamoSafeFootprint(_Footprint):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return True

    __torch_dispatch__ = _Footprint.__torch_dispatch__


def Footprint(known: set[int], device: torch.device) -> _Footprint:  # noqa: N802
    """A mode measuring the peak bytes of the tensors made while it is active."""
    block = BLOCK if device.type == "cuda" else 1
    if "torch._dynamo" in sys.modules:
        return _DynamoSafeFootprint(known, block)
    return _Footprint(known, block)
