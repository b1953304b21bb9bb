"""The graphs of one callable: one dict of entries keyed by :class:`GraphKey`, bounded
by ``max_graphs`` and ``max_graph_memory`` (least recently used go first).

An :class:`Entry` is one key: warming up, ready (with the bound replay in ``run``), or
eager for a reason.  Arguments a key's calls write in place are learned per base key
(``inplace``) and from then on keyed by address (``GraphKey.written``).  So are the
bucketer's persistent padded buffers (``padslots``) while a padded call passes them
(:func:`pinned`): captured at their own address, a padded replay copies nothing more.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from .flat import Flat
from .keys import GraphKey, sharing
from .memo import KeyMemo
from .objects import ObjectKey
from .options import Options
from .stats import Stats
from .vocab import EagerReason, State

# Past this many entries that hold no graph, the oldest are forgotten: callers whose
# keys never repeat must not grow the dict without bound.
IDLE_SLACK = 64
MOVING = 2  # keys of one structure in a row that never replayed: the next runs cold

# The padded buffers of the call this thread is making: (the cache, their ids).
_pins = threading.local()


class pinned:  # noqa: N801 - used like a function
    """While a bucketer passes its persistent padded buffers (``ids``: their ids) to the
    engine of ``cache``, they are keyed by address and captured in place."""

    __slots__ = ("of",)

    def __init__(self, cache: GraphCache, ids: frozenset[int]) -> None:
        # (the cache, the ids, the keys made for these buffers: they live as long)
        self.of: tuple[GraphCache, frozenset[int], dict[GraphKey, Any]] = (cache, ids, {})
        cache.pinning = True

    def __enter__(self) -> None:
        # an enclosing bucketer's pins (a bucketed call inside one), put back at exit
        _pins.__dict__.setdefault("outer", []).append(getattr(_pins, "of", None))
        _pins.of = self.of

    def __exit__(self, *exc: object) -> None:
        _pins.of = _pins.outer.pop()


class Entry:
    """One key of one callable."""

    __slots__ = (
        "state", "runs", "reason", "detail", "graph", "nbytes", "run", "eager_s", "speedup",
        "used", "digest", "repeat", "direct", "contained", "backward_inside", "warm_first",
        "state_made",
        "draws", "shaped", "syncs", "assigned_once", "kept_at", "cold", "hooked", "rng_drew",
        "rng_set_once",
    )

    def __init__(self) -> None:
        self.state = State.WARMING
        self.runs = 0  # warmup runs so far
        self.reason: EagerReason | None = None
        self.detail = ""
        self.graph: Any = None  # a replay.Captured once READY
        self.nbytes = 0
        self.run: Callable[[Any], Any] | None = None  # the bound replay, once READY
        self.eager_s = float("inf")  # fastest timed warmup run (under min_speedup)
        self.speedup: float | None = None  # eager / replay time, once judged
        self.used = 0  # the cache's use stamp at this entry's last use (for LRU)
        self.digest: int | None = None  # the key's digest for the ranks, once computed
        self.repeat = False  # its graph may be captured again without warming up
        self.direct = False  # captured again without warming up (see GraphCache.known)
        # autograd records the call, but its work begins and ends inside it (a whole
        # training step: backward and optimizer step inside): one plain graph
        self.contained = False
        # its learning warmup ran a backward inside (the .grad it makes or writes: guarded)
        self.backward_inside = False
        # warm up at least once before capturing (its last capture raised)
        self.warm_first = False
        self.state_made = False  # a capture made state or a .grad once (StateMade)
        # whether the call draws random numbers on the device, as its warmup found
        # (None: unknown); a call known to draw none is captured without the generator
        self.draws: bool | None = None
        # its key has the structure of a key captured (``GraphCache.shapes``): captured
        # after the warmup that learns what the call does to this object
        self.shaped = False
        # container arguments each replay changes as the call did (containers.Sync)
        self.syncs: tuple[Any, ...] = ()
        # a warmup found the call changing a global or class attribute it reads: once
        # is a set-up (learned again), twice makes the key eager
        self.assigned_once = False
        self.kept_at = 0  # the use stamp when its graph was kept (used past it: replayed)
        # its first call runs plainly eagerly: its arguments' addresses moved again and
        # the last addresses of its structure never replayed (see GraphCache.entry)
        self.cold = False
        # its last warmup found module backward hooks (training.HooksPresent): eager,
        # without warming up, while they are registered
        self.hooked = False
        # its learning warmup's own random operators moved the device's generator: a
        # later warmup that leaves it still shows the call setting it (rng.py)
        self.rng_drew = False
        self.rng_set_once = False  # a warmup saw the generator set: learned again once

    def replayed(self) -> bool:
        """Whether this entry's graph was used after it was kept (replayed)."""
        return 0 < self.kept_at < self.used

    def give_up(self, reason: EagerReason, detail: str = "") -> None:
        """This key runs eagerly from now on."""
        self.state = State.EAGER
        self.reason = reason
        self.detail = detail


class GraphCache:
    """Entries of one callable, their least-recently-used order and memory budget."""

    def __init__(self, options: Options, stats: Stats) -> None:
        self.options = options
        self.stats = stats
        self.entries: dict[GraphKey, Entry] = {}
        self.inplace: dict[GraphKey, tuple[int, ...]] = {}
        self.uses = 0
        # storage addresses of the parameters, buffers and named tensors that a graph of
        # this callable writes, and of the tensors it reads from outside the arguments,
        # parameters and named tensors (which it may write too): an argument sharing one
        # is keyed as such (``keys.Sharing``)
        self.state_bases: frozenset[int] = frozenset()
        self.lock = threading.Lock()
        self.pinning = False  # whether padded buffers were ever pinned (see pinned)
        # keys whose graphs an invalidation dropped while what warming up learns still
        # holds (``Watch.moved_only``): their next call captures without warming up
        self.known: set[GraphKey] = set()
        # keys with object arguments whose graph was captured, without addresses
        # (``GraphKey.unaddressed``), each with whether a new key of that structure (a
        # new cache of the same shapes) is captured at its first call: True where every
        # object is of a known type (``known_types``: transformers' caches), else after
        # one warmup, which learns what the call does to this very object (code may
        # keep state of its own per object: a first call that differs)
        self.shapes: dict[GraphKey, bool] = {}
        # per structure of keys with addresses (``GraphKey.unaddressed``), the entry of
        # its latest key and how many keys in a row never replayed: a new key after
        # MOVING of those (beam search moves its cache every step) runs its first call
        # plainly eagerly (``Entry.cold``)
        self.lasts: dict[GraphKey, tuple[Entry, int]] = {}
        # called whenever a graph is freed: a bucketer's routes hold graphs' runners
        self.on_forget: Callable[[], None] | None = None
        # the engine's key memo, whose shortcuts hold runners (of freed graphs too);
        # weakly: its shortcuts hold this cache (a cycle would outlive its engine)
        self.memo: Callable[[], KeyMemo | None] = lambda: None

    def address(self, key: GraphKey, flat: Flat) -> GraphKey:
        """``key`` with the addresses of the arguments this key's calls write in place
        (and of the padded buffers this call passes)."""
        pins = getattr(_pins, "of", None) if self.pinning else None
        memo = pins[2] if pins is not None and pins[0] is self else None
        written = self.inplace.get(key)
        known = memo.get(key) if memo is not None else None
        if known is not None and known[0] is written:
            if not written:  # only the buffers, whose addresses are the slot's: made once
                return known[1]  # type: ignore[no-any-return]
            positions = known[2]
        else:
            positions = self.in_place(key, flat)
        if not positions:
            return key
        leaves = flat.leaves
        addressed = key._replace(written=tuple([_address(leaves[i]) for i in positions]))
        if memo is not None and len(memo) < 16:  # per slot: its keys, by what is written
            memo[key] = (written, addressed, positions)
        return addressed

    def in_place(self, key: GraphKey, flat: Flat) -> tuple[int, ...]:
        """The argument positions this call captures at their own address: those its
        key writes in place, those sharing memory the call may write otherwise
        (``keys.Sharing``) and the padded buffers it passes (``pinned``)."""
        positions = self.inplace.get(key.base(), ())
        shared = sharing(key)
        if shared:
            positions = tuple(sorted({*positions, *shared}))
        pins = getattr(_pins, "of", None) if self.pinning else None
        if pins is None or pins[0] is not self:
            return positions
        ids, leaves = pins[1], flat.leaves
        mine = [i for i in flat.tensor_pos if id(leaves[i]) in ids]
        return tuple(sorted({*positions, *mine})) if mine else positions

    def entry(self, key: GraphKey, flat: Flat | None = None) -> Entry:
        """The entry of ``key`` (for the call ``flat``), made (and the cache trimmed) if
        it is new."""
        entry = self.entries.get(key)
        if entry is not None:
            return entry
        with self.lock:
            entry = self.entries.get(key)
            if entry is None:
                entry = self.entries[key] = Entry()
                if key in self.known:
                    self.known.discard(key)
                    entry.runs = self.options.warmup
                    entry.direct = True
                elif self._moving(key, entry):
                    entry.cold = True
                elif self.shapes:
                    known = self.shapes.get(key.unaddressed())
                    # known types: no warmup at all, unless an argument shares memory
                    # with the object (the warmup learns that the call writes it)
                    if known and (flat is None or not _shares(flat)):
                        entry.runs = max(self.options.warmup, 1)  # (objects learn once)
                        entry.direct = True
                    elif known is not None:
                        entry.shaped = True
                self.uses = entry.used = self.uses + 1
                self.trim()
            return entry

    def _moving(self, key: GraphKey, entry: Entry) -> bool:
        """Whether ``key`` (new) has addresses that moved from those of the structure's
        latest keys, the last MOVING of which never replayed (two caches used in turn
        are not that): capturing it would likely be wasted too."""
        if not key.written and not any(type(p) is ObjectKey for p in key.leaves):
            return False
        family = key.unaddressed()
        lasts = self.lasts
        last, misses = lasts.get(family, (None, 0))
        misses = misses + 1 if last is not None and not last.replayed() else 0
        if len(lasts) >= 8 * self.options.max_graphs:
            lasts.clear()
        lasts[family] = (entry, misses)
        return misses >= MOVING

    def keep(self, entry: Entry, nbytes: int) -> None:
        """``entry`` now holds a graph: count it and evict what exceeds the bounds (an
        entry dropped meanwhile, by a ``reset()`` in another thread, keeps no graph)."""
        with self.lock:
            if not any(e is entry for e in self.entries.values()):
                entry.graph = entry.run = None
                return
            entry.state = State.READY
            entry.nbytes = nbytes
            self.uses = entry.used = entry.kept_at = self.uses + 1  # the newest: evicted last
            self.stats.graphs += 1
            self.stats.graph_bytes += nbytes
            self.trim()

    def trim(self) -> None:
        """Evict least recently used entries: ready graphs past ``max_graphs`` or the
        memory budget, and idle entries past a bound."""
        limit, budget = self.options.max_graphs, self.options.max_graph_memory
        by_use = sorted(self.entries.items(), key=lambda item: item[1].used)  # stable
        ready = [(k, e.nbytes) for k, e in by_use if e.state is State.READY]
        total = sum(n for _, n in ready)
        evict: list[GraphKey] = []
        for k, n in ready[:-1]:  # oldest first; the newest graph is the one just kept
            if len(ready) - len(evict) <= limit and (budget is None or total <= budget):
                break
            evict.append(k)
            total -= n
        self.drop(evict)
        self.stats.evictions += len(evict)
        excess = len(self.entries) - 8 * limit - IDLE_SLACK
        if excess > 0:
            idle = [k for k, e in by_use if e.state is not State.READY]
            self.drop(idle[:excess])

    def drop(self, keys: list[GraphKey]) -> None:
        """Forget these entries.  Before ready graphs go, wait for work in flight: a
        replay on another stream may still read their static buffers."""
        entries = [self.entries.pop(k) for k in keys if k in self.entries]
        synced: set[Any] = set()
        for entry in entries:
            if entry.state is State.READY:
                captured = entry.graph
                if captured.device not in synced:
                    synced.add(captured.device)
                    captured.synchronize()
                self.forget_graph(entry, sync=False)

    def forget_graph(self, entry: Entry, sync: bool = True) -> None:
        """Free a ready entry's graph, once work in flight that may read its buffers is
        done (``sync``)."""
        if entry.graph is None:
            return
        if sync:
            with contextlib.suppress(Exception):  # after a failed replay it may fail too
                entry.graph.synchronize()
        self.stats.graphs -= 1
        self.stats.graph_bytes -= entry.nbytes
        entry.graph = entry.run = None
        memo = self.memo()
        if memo is not None:
            memo.unbind(entry)
        if self.on_forget is not None:
            self.on_forget()
        entry.nbytes = 0
        if entry.state is State.READY:
            entry.state = State.WARMING

    def rekey(self, key: GraphKey, entry: Entry, flat: Flat, inplace: set[int]) -> None:
        """Arguments at ``inplace`` are written by the call: key them by address, with
        every argument that shares storage with one of them (a read argument that
        overlaps a written one must see the write, so it cannot be a private copy)."""
        leaves = flat.leaves
        empty = [i for i in inplace if not leaves[i].numel()]
        if empty:  # no address to key it by: a call resizing it (out=) writes elsewhere
            entry.give_up(EagerReason.ASSIGNS, f"the call writes empty tensor argument "
                          f"{empty[0]} (out=, resize_): it cannot be captured in place")
            return
        inplace = _sharing(flat, inplace)
        base = key.base()
        with self.lock:
            self.inplace[base] = tuple(sorted(set(self.inplace.get(base, ())) | inplace))
            mine = self.address(base, flat)
            if self.entries.get(key) is entry:
                del self.entries[key]
                self.entries[mine] = entry
                entry.state = State.WARMING
            elif self.entries.get(mine) is not entry:
                # another thread learned first and moved this entry to its own address
                # (its tensors'): this call's address gets an entry of its own
                self.entries.setdefault(mine, Entry())

    def holds(self, key: GraphKey, entry: Entry, flat: Flat) -> bool:
        """Whether ``entry`` is still the one filed for this call's key and addresses
        (another thread's call may have learned, since this one was keyed, that the
        key writes arguments in place, and moved the entry to its arguments' address)."""
        with self.lock:
            now = self.address(key.base(), flat) if self.inplace or self.pinning else key
            return self.entries.get(now) is entry

    def clear(self, keep_known: bool = False) -> None:
        """Drop every graph and forget what was learned about the arguments; with
        ``keep_known``, remember it and which keys held a graph that may be captured
        again without warming up (``known``), those of earlier such invalidations too
        (``.half()`` then ``.float()``: the float keys were dropped at the first)."""
        with self.lock:
            known = {k for k, e in self.entries.items() if e.graph is not None and e.repeat}
            self.drop(list(self.entries))
            if keep_known and len(self.known) < 4 * self.options.max_graphs:
                known |= self.known
            self.known = known if keep_known else set()
            self.lasts.clear()
            if not keep_known:
                self.shapes.clear()
                self.inplace.clear()
                self.state_bases = frozenset()

    def graph_keys(self) -> list[tuple[GraphKey, tuple[int, ...]]]:
        """The keys that hold a graph, with their in-place positions (for plans)."""
        return [(k, self.inplace.get(k.base(), ())) for k, e in list(self.entries.items())
                if e.graph is not None]



def _shares(flat: Flat) -> bool:
    """Whether a tensor argument shares storage with a tensor inside an object argument."""
    return bool(flat.sharers(flat.object_storages()))


def _sharing(flat: Flat, positions: set[int]) -> set[int]:
    """``positions`` and every tensor argument whose storage shares memory with one of
    theirs: the same storage, or another over overlapping memory (``from_numpy`` or
    ``from_dlpack`` of overlapping slices of one buffer)."""
    leaves = flat.leaves
    spans = [_storage_span(leaves[i]) for i in positions if leaves[i].numel()]
    return positions | {i for i in flat.tensor_pos if leaves[i].numel() and any(
        lo < hi_w and lo_w < hi for lo, hi in [_storage_span(leaves[i])] for lo_w, hi_w in spans)}


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    """The memory ``t``'s storage covers: [start, end) (at least one byte)."""
    storage = t.untyped_storage()
    start = storage.data_ptr()
    return start, start + max(1, storage.nbytes())


def _address(t: torch.Tensor) -> Any:
    """A tensor captured in place, by address, with its conjugate and negative bits
    where set: a graph writing ``c`` would write ``c.conj()`` (same address, strides
    and dtype) with the wrong sign."""
    if t.is_conj() or t.is_neg():
        return (t.data_ptr(), t.is_conj(), t.is_neg())
    return t.data_ptr()
