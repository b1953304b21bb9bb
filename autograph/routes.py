"""Routes: the short path of a bucketed call whose key was seen and replayed before.

A bucketed call used to key its arguments twice (the bucketer's context, then the
engine's key of the padded call) and resolve its batch arguments, its slot and its
in-place arguments anew every call.  Once a call has replayed through a bucket's
buffers, a :class:`Route` remembers, under the engine's key of the *caller's* call, all
that follows from that key: the batch arguments' leaf positions, the slot, the entry
whose graph the padded call replays, the arguments it writes back, and the addresses of
the arguments the graph was captured at.  The next call with that key is keyed once
(``keys.key_call``), fills the buffers and replays the entry directly.

Why the key decides all that: it holds every tensor argument's shape, strides, dtype
and device (so the batch size, the bucket and the slot's layout), every other argument
by value, the module's training flag and grad and inference mode (so the bucketer's
context, what was learned for it, and whether the buffers may be used).  What the key
does not hold is checked per call, as the engine's own path does: the kill switch and
the guards (by the bucketer first), a given-up callable, nesting, a capture in
progress, hooks, the addresses of arguments captured in place, and the entry still
holding the graph the route was made with (an evicted, dropped or recaptured graph, or
a rekeyed entry, has another runner).  The bucketer drops its routes whenever what it
learned changes (guards, padding switched off) and whenever its engine frees a graph
(``GraphCache.on_forget``): a route holds its graph's runner, and must not keep an
evicted graph's memory.  Calls with object arguments, nested
containers or a process group never take a route.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import lifecycle, notify, padslots
from .cache import Entry
from .flat import FLAT, Flat
from .keys import GraphKey, key_call
from .memo import KeyMemo
from .modes import modes
from .padding import Batch, slice_back
from .vocab import Uncapturable

MISS: Any = object()  # what :meth:`Routes.run` returns when no route applies
MAX_ROUTES = 64  # caller keys kept per bucketer; past it the table starts again

_nesting = lifecycle.nested_block
_is_nested = lifecycle.is_nested


class Route:
    """What follows from one caller key: where its batch goes and which graph replays."""

    __slots__ = ("entry", "run", "rows", "slot", "positions", "written", "addressed", "size",
                 "real", "capturing")

    def __init__(self, entry: Entry, slot: padslots.Slot, positions: list[int],
                 written: list[int], addressed: tuple[tuple[int, int], ...], size: int,
                 real: int, capturing: Callable[[], bool],
                 rows: Callable[[Any], Any] | None) -> None:
        self.entry = entry
        self.run = entry.run  # the runner of the graph this route was made with
        # the same graph's replay cloning only the real rows of its one output (None:
        # the output is sliced and checked for views of the buffers after ``run``)
        self.rows = rows
        self.slot = slot
        self.positions = positions  # leaf position of each batch argument
        self.written = written  # batch indexes the function writes in place
        self.addressed = addressed  # (leaf position, address) captured in place
        self.size = size
        self.real = real
        self.capturing = capturing  # the backend's is-capturing probe


class Routes:
    """The routes of one bucketer, by the engine's key of the caller's call."""

    __slots__ = ("table", "memo")

    def __init__(self) -> None:
        self.table: dict[GraphKey, list[Route]] = {}
        self.memo = KeyMemo()  # leaf keys of the callers' recent calls (memo.py)

    def clear(self) -> None:
        self.table = {}

    def run(self, bucketer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call on its route (counted as the bucketer counts it), or :data:`MISS`
        when it has none or anything the route assumed no longer holds."""
        if not _plain(args, kwargs):
            return MISS  # never routed, and keying objects costs: not keyed twice
        engine = bucketer.engine
        try:
            key, flat, _ = key_call(args, kwargs, modes, engine.training, self.memo)
        except Uncapturable:
            return MISS
        found = self.table.get(key)
        if found is None:
            return MISS
        leaves = flat.leaves
        for route in found:  # the one made with these arguments captured in place
            if all(leaves[pos].data_ptr() == ptr for pos, ptr in route.addressed):
                break
        else:
            return MISS
        entry, run = route.entry, route.run
        if entry.run is not run or engine.given_up is not None or engine.watch.hook_reason \
                or notify.global_hooks() or notify.global_backward_hooks() \
                or engine.watch.backward_recheck or engine.watch.marks_grad \
                or (engine.watch.collects and notify.collector()) \
                or route.capturing() or (_nesting.active and _is_nested()):
            return MISS
        lock = bucketer.slots.lock
        if not lock.acquire(blocking=False):
            return MISS  # another call is using the buffers: the bucketer's own path
        stats = engine.stats
        eager_before = stats.eager
        slot, positions = route.slot, route.positions
        try:
            tensors = [leaves[p] for p in positions]
            padded = list(leaves)
            for p, buf in zip(positions, padslots.fill(slot, tensors)):
                padded[p] = buf
            rows = route.rows if engine.verify_every is None else None
            filled = Flat(padded, flat.nargs, flat.kw_names, None, flat.tensor_pos)
            filled.original = flat.original  # the caller's containers (containers.py)
            out = engine.replay_entry(entry, rows or run, filled)
            if route.written:
                padslots.hand_back(slot, tensors, route.written)
        finally:
            lock.release()
        size, real = route.size, route.real
        eager = stats.eager != eager_before
        stats.count_bucket(size, real, eager)
        if rows is not None and not eager:  # a fresh tensor of the real rows
            return out
        if size == real:
            return padslots.rebased(out, slot, tensors)
        return padslots.unshared(slice_back(out, size, real, slot.out_dim), slot.ptrs)

    def make(self, bucketer: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
             padded: tuple[tuple[Any, ...], dict[str, Any]], batch: Batch,
             slot: padslots.Slot, written: list[int], size: int, real: int) -> None:
        """After a call that replayed on ``slot``'s buffers (``padded``: its arguments
        with the buffers in): remember its route, when it may have one."""
        if not _plain(args, kwargs):
            return  # containers and objects: told apart by type before keying anything
        engine = bucketer.engine
        try:
            key, flat, _ = key_call(args, kwargs, modes, engine.training, self.memo)
            with slot.pinned:  # the padded call's key, as the engine made it
                padded_key, padded_flat, _, _ = engine._key(*padded)
        except Uncapturable:
            return
        if flat.spec is not None or padded_flat.spec is not None or flat.objects \
                or padded_flat.objects:
            return
        entry = engine.cache.entries.get(padded_key)
        if entry is None or entry.run is None:
            return
        nargs, names = flat.nargs, flat.kw_names
        positions = [k if isinstance(k, int) else nargs + names.index(k) for k, _, _ in batch]
        inplace = engine.cache.inplace.get(padded_key.base(), ())
        leaves = flat.leaves
        addressed = tuple((i, leaves[i].data_ptr()) for i in inplace if i not in positions)
        capturing = engine._device[2]
        rows_runner = getattr(entry.graph, "rows_runner", None)
        rows = rows_runner(slot.out_dim, size, real) if rows_runner is not None and \
            engine.options.min_speedup is None else None  # (its trial times entry.run)
        route = Route(entry, slot, positions, written, addressed, size, real, capturing, rows)
        # per key, a few routes by the addresses of the arguments captured in place (a
        # step alternating between two caches keeps both)
        found = [r for r in self.table.get(key, ()) if r.addressed != addressed][-3:]
        if key not in self.table and len(self.table) >= MAX_ROUTES:
            self.table = {}
        self.table[key] = [*found, route]


def _plain(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether every argument is a tensor or a plain value (no container, no object)."""
    return all(map(FLAT, map(type, args))) and (
        not kwargs or all(map(FLAT, map(type, kwargs.values()))))
