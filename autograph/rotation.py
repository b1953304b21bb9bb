"""Outputs without a host copy in the default mode: a key's graph captured again, at
most :data:`SLOTS` times, each time ending with a copy of its output into a buffer of
its own, allocated outside the pool (the copy is a node of the graph: no allocation
and no launch on the host, the part of a clone that costs).

A replay hands out such a buffer, as a new alias of it, when no earlier call's output
still holds it: its storage's use count, and the Python references of its storage
object, are what they were with nothing handed out (an alias or a view of it, kept
anywhere, or the storage object on its own, raise one of them).  A loop that drops or
rebinds each output (``y = model(x)``) alternates between two buffers; one that keeps
every output gets clones from the key's first graph, as before.  The buffers are
outside the pool, so no other graph's replay writes them, and a held one is never
written by this key's graphs.

Only for graphs with one output that lives in the pool (up to :data:`MAX_BYTES`) and
nothing else to hand back: no host counters, no random numbers, no state written, no
object arguments, no tensor read from outside the arguments and parameters.
The first replay hands out a clone; the second captures the first variant, and the
first call that finds every buffer held captures the next (``Rotation.grow``).  A
variant that cannot be captured ends the rotation: clones from then on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .buffers import _overlaps, _same_values
from .flat import Flat
from .guards import Watch
from .lifecycle import call_scope, capture_turn
from .replay import Captured, Holder, refcount, use_count
from .vocab import EagerReason, Uncapturable, logger

SLOTS = 2  # variants per key: what a loop rebinding its output needs
# Larger outputs are cloned: their clone's host cost is small beside their kernels, and
# the variants would hold four more copies of them.
MAX_BYTES = 64 << 20


class Slot(Holder):
    """One variant: its graph, the graph's own output (kept: it lives in the pool) and
    the buffer its last node copies that output into (held while its use count or
    its storage object's references are above those with nothing handed out)."""

    __slots__ = ("graph", "out", "buffer")

    def __init__(self, graph: Any, out: torch.Tensor, buffer: torch.Tensor) -> None:
        super().__init__(buffer)
        self.graph, self.out, self.buffer = graph, out, buffer


class Rotation:
    """The variants of one graph, grown on demand (``grow``); ``room``: whether another
    may still be captured.  ``armed`` is set by the first replay (keys replayed once
    never pay for a variant)."""

    __slots__ = ("slots", "room", "armed", "_capture", "_agrees", "nbytes")

    def __init__(self, capture: Callable[[], Slot], agrees: Callable[[Slot], bool],
                 nbytes: int) -> None:
        self.slots: tuple[Slot, ...] = ()
        self.room = True
        self.armed = False
        self._capture = capture
        self._agrees = agrees  # whether a new variant gives what the key's graph gives
        self.nbytes = nbytes  # what all variants together may hold: outputs and buffers

    def grow(self) -> bool:
        """Capture one more variant (under the capture lock), or end the rotation if it
        cannot be captured or does not give what the key's graph gives; False where the
        capture lock was busy (nothing changed: the caller must not wait for it)."""
        with capture_turn(wait=0) as turn:  # busy: a later call grows it (the holder
            if not turn:  # may wait on this thread: never block here)
                return False
            if not self.room:  # another thread grew it meanwhile
                return True
            try:
                slot = self._capture()
                same = self._agrees(slot)
            except Exception as exc:  # noqa: BLE001 - clones stay right
                self.end(f"{type(exc).__name__}: {exc}")
                return True
            if not same:  # state no guard sees changed since the key's capture
                self.end("its result differs from the key's graph")
                return True
            self.slots = (*self.slots, slot)
            self.room = len(self.slots) < SLOTS
            return True

    def end(self, why: str) -> None:
        """No variants from now on: the key's graph and clones, as without them."""
        self.slots, self.room = (), False
        logger.debug("autograph: no output variants (%s); outputs are cloned", why)

    def fill(self) -> None:
        """Capture every variant now (``autograph.warmup``), in the key's modes."""
        self.armed = True
        while self.room and self.grow():
            pass

    def runner(self, fallback: Callable[[Any], Any], prepare: Callable[[Any], None],
               lock: Any) -> Callable[[Any], Any]:
        """The replay: under ``lock``, the first free variant's replay after
        ``prepare(leaves)`` (order the stream, copy the arguments in), and a new alias
        of its buffer.  Where none is free, ``fallback(leaves)`` (the first graph's
        replay and clone, which takes ``lock`` itself), after capturing another variant
        where there is room."""
        rotation = self

        def run(leaves: Any) -> Any:  # a loop, not a recursion: no cycle through a cell
            while True:
                with lock:
                    for slot in rotation.slots:
                        # (the storage read as an attribute, as when its count was taken)
                        if use_count(slot.cdata) <= slot.free and \
                                refcount(slot.storage) <= slot.refs:
                            if slot.storage.data_ptr() != slot.ptr or \
                                    slot.storage.nbytes() != slot.nbytes:  # a caller resized it
                                rotation.end("a caller resized an output's storage")
                                break
                            prepare(leaves)
                            slot.graph.replay()
                            return slot.buffer.detach()
                if not (rotation.room and rotation.armed) or not rotation.grow():
                    rotation.armed = True  # (lock busy: the holder may wait on this
                    return fallback(leaves)  # thread; a later call grows it)
                # then the new variant's buffer is free

        return run


def rotate(captured: Captured, fn: Callable[..., Any], flat: Flat, watch: Watch,
           rng_free: bool) -> None:
    """Give a plain graph output variants (``rotation.py``) where it can have them: one
    output in the pool, and nothing a second capture could change or repeat (host
    counters, random numbers, parameters or arguments written, object arguments), nor
    that a replay more than the calls' could write (a tensor read from outside the
    arguments and parameters, a closure's or a plain object's, written in place: the
    check of each new variant replays the graphs once more)."""
    single = getattr(captured.build, "single_output", None)
    if (single is None or captured.reuse or captured.effects is not None or captured.seeded
            or captured.state_written or captured.inplace or flat.objects
            or captured.hidden  # state read from elsewhere may be written: no extra replay
            or use_count is None or _overlaps(single)  # (a buffer cannot be written so)
            or single.numel() * single.element_size() > MAX_BYTES):
        return
    args, kwargs = flat.rebuild(captured.static.substitute(list(flat.leaves)))
    backend, device = captured.backend, captured.device
    shape, stride, dtype = single.shape, single.stride(), single.dtype

    def capture_variant() -> Slot:
        buffer = torch.empty_strided(shape, stride, dtype=dtype, device=device)

        def body() -> Any:
            out = fn(*args, **kwargs)
            if not (isinstance(out, torch.Tensor) and out.shape == shape
                    and out.stride() == stride and out.dtype == dtype):
                raise Uncapturable(EagerReason.OUTPUT, "a variant's output differs")
            buffer.copy_(out)
            return out

        with call_scope(watch):
            graph, out = backend.capture(device, body, rng_free=rng_free)
        return Slot(graph, out, buffer)

    pool, order, replay = captured.pool, backend.order_replay, captured.graph.replay

    def agrees(slot: Slot) -> bool:
        """Both graphs replayed on the same static inputs give the same values, NaN
        equal to NaN (one host sync per variant): a variant captured after a change that
        no guard sees (a nested configuration value) would otherwise alternate with the
        key's graph."""
        with pool.lock:
            order(device, pool)
            replay()
            slot.graph.replay()
            return _same_values(single, slot.buffer)

    nbytes = 2 * SLOTS * single.numel() * single.element_size()  # outputs and buffers
    captured.rotation = Rotation(capture_variant, agrees, nbytes)
