"""The engine behind every graphed callable: one dict of entries, warmup, capture, replay.

Each call is keyed (``keys``); a new key runs ``warmup`` times eagerly on the capture
stream, is then captured into the device's shared pool, and later calls with that key
replay it.  Anything that cannot be graphed safely runs eagerly, counted with its
reason.  The replay path is short on purpose: guard check, key, one batched copy,
replay, clone out.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import ranks
from . import switch as _switch
from .buckets import Bucketer
from .buffers import StaticInputs, output_builder
from .capture import Backend, Pool, backend_for
from .guards import Watch, running
from .keys import Flat, Uncapturable, describe, key_call
from .mutation import WriteRecorder, watch_map
from .options import Options
from .ranks import Ranks
from .stats import Stats

logger = logging.getLogger("autograph")

_grad_enabled = torch.is_grad_enabled
_inference_mode = torch.is_inference_mode_enabled
_autocast = torch.is_autocast_enabled
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_PLAIN = frozenset({bool, int, str, type(None)})
_matmul_precision = getattr(
    torch._C, "_get_float32_matmul_precision", torch.get_float32_matmul_precision
)

def _modes(device: torch.device) -> tuple[bool, bool, Any, str]:
    """The global modes a graph bakes in: grad, inference, autocast dtype, matmul
    precision.  (``_quick_key`` computes the same tuple inline.)"""
    return (_grad_enabled(), _inference_mode(), _any_autocast() and _autocast_of(device),
            _matmul_precision())


def _autocast_of(device: torch.device) -> Any:
    """The autocast dtype for ``device``'s type, or False when autocast is off there."""
    kind = device.type
    return _autocast(kind) and torch.get_autocast_dtype(kind)


_profiling: Callable[[], bool] = getattr(torch._C._autograd, "_profiler_enabled",
                                         lambda: False)
_NO_RANGE = contextlib.nullcontext()
record_function = torch.autograd.profiler.record_function

# Warmups and captures are serialized process-wide: capture must not interleave with
# another capture into the same pool, and it keeps warmup and capture on one stream.
_capture_lock = threading.RLock()
_local = threading.local()
_count_lock = threading.Lock()

WARMING, READY, EAGER = 0, 1, 2
IN_PLACE = "argument written in place: capturing it at its address"
NOT_WORTH = "graph not faster than eager by min_speedup"
TRIALS = 3  # timed replays of a new graph under min_speedup (the first launch is not one)


class Entry:
    """One key of one callable: warming up, ready to replay, or eager for a reason."""

    __slots__ = (
        "state", "runs", "reason", "graph", "static", "build", "pool", "nbytes", "device",
        "backend", "run", "eager_s", "speedup", "used",
    )

    def __init__(self) -> None:
        self.state = WARMING
        self.runs = 0
        self.reason = ""
        self.graph: Any = None
        self.static: StaticInputs | None = None
        self.build: Callable[[list[Any]], Any] | None = None
        self.pool: Pool | None = None
        self.nbytes = 0
        self.device: torch.device | None = None
        self.backend: Any = None
        self.run: Callable[[Any], Any] | None = None  # set once the entry is READY
        self.eager_s = float("inf")  # fastest timed warmup run (under min_speedup)
        self.speedup: float | None = None  # eager / replay time, once judged
        self.used = 0  # the engine's use count at this entry's last replay (for LRU)


class Engine:
    """Graphs of one callable (a function, or one module instance's forward).

    ``fn`` is called as ``fn(*args, **kwargs)``.  ``watch`` guards the Python state the
    graphs bake in; ``training`` returns the module's training flag (or None).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        options: Options,
        stats: Stats,
        watch: Watch,
        training: Callable[[], bool | None],
        names: list[str] | None = None,
    ) -> None:
        self.fn = fn
        self.stats = stats
        self.watch = watch
        self.training = training
        self.names = names or []
        self.entries: dict[Any, Entry] = {}
        self.uses = 0  # stamps entries for least-recently-used eviction
        self.inplace: dict[Any, tuple[int, ...]] = {}
        self.lock = threading.Lock()
        self._device: tuple[Any, Any, Callable[[], bool]] = (None, None, bool)
        self.options = options
        self.labels = {what: f"autograph.{what} {stats.name}"
                       for what in ("replay", "capture", "warmup", "eager")}
        # what callers call instead of the engine when buckets are on (holds the engine
        # weakly, so an engine and its graphs die without waiting for the cycle collector)
        self.front: Bucketer | None = None
        self.ranks: Ranks | None = None
        self.quick = True  # the replay fast path applies (not with ranks to agree with)
        if options.buckets or options.group is not None:
            self.set_options(options, force=True)

    def set_options(self, options: Options, force: bool = False) -> None:
        """Use these options from the next call on (a region passes its own)."""
        if not force and (options is self.options or _same_options(options, self.options)):
            return  # a new region per step passes equal options: keep what was learned
        self.options = options
        self.ranks = Ranks(options.group) if options.group is not None else None
        self.quick = self.ranks is None
        if options.buckets:
            me = weakref.proxy(self)
            self.front = Bucketer(options, me, lambda a, k: me._eager(a, k), self.stats,
                                  self.names, lambda: me._module_state(), self.ranks,
                                  lambda: me._module_changed())
        else:
            self.front = None

    def _module_changed(self) -> bool:
        """Bring the guard up to date before a bucketed call: True (and the graphs
        dropped) if module state changed since it was last checked."""
        watch = self.watch
        if watch.ok():
            return False
        if watch.stale:
            watch.refresh()
            return False
        self._invalidate()
        return True

    def _module_state(self) -> list[torch.Tensor]:
        if self.watch.stale:
            self.watch.refresh()
        return list(self.watch.tensors())

    # -- the call ------------------------------------------------------------------
    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        stats = self.stats
        stats.calls += 1
        if (_switch._active or _switch.env_set()) and _switch.is_disabled():
            stats.count_eager("disabled", warn=False)
            return self.fn(*args, **kwargs)
        if not kwargs and not _warming.active and self.quick:
            key = self._quick_key(args)
            if key is not None:
                entry = self.entries.get(key)
                if entry is not None:
                    run = entry.run
                    if run is not None:
                        return self._replay(entry, run, args)
        return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The general path: key the call with reasons, then replay, warm up or capture
        (what the ranks agree on, with ``group``)."""
        stats = self.stats
        try:
            flat, key, backend = self._key(args, kwargs)
        except Uncapturable as exc:
            if self.ranks is not None and not _nested():
                self.ranks.agree(ranks.EAGER, 0, stats.name)
            stats.count_eager(str(exc))
            return self._eager(args, kwargs)
        base = key
        if self.inplace:
            inplace = self.inplace.get(base)
            if inplace:
                key = (base, tuple([flat.leaves[i].data_ptr() for i in inplace]))
        entry = self.entries.get(key)
        if entry is None:
            entry = self._new_entry(key)
        run = entry.run
        action = (ranks.REPLAY if run is not None else ranks.EAGER if entry.state == EAGER
                  else ranks.WARM if entry.runs < self.options.warmup else ranks.CAPTURE)
        if self.ranks is not None and not _nested():
            agreed = self.ranks.agree(action, ranks.digest(base), stats.name)
            if agreed != action:
                return self._follow(agreed, key, base, entry, flat, backend)
        if run is not None:
            return self._replay(entry, run, flat.leaves, flat)
        if action == ranks.EAGER:
            stats.count_eager(entry.reason)
            return self._eager(args, kwargs)
        if action == ranks.WARM:
            return self._warm(key, base, entry, flat, backend)
        return self._capture(key, base, entry, flat, backend)

    def _follow(self, agreed: int, key: Any, base: Any, entry: Entry, flat: Flat,
                backend: Backend) -> Any:
        """Do what the ranks agreed on instead of what this rank proposed (a step behind
        the others, never ahead: the agreed action is the least advanced proposal)."""
        if agreed == ranks.WARM:
            return self._warm(key, base, entry, flat, backend)
        if agreed == ranks.CAPTURE:  # another rank lost its graph: capture again with it
            with self.lock:
                if entry.state == READY:
                    self._forget_graph(entry)
                    entry.state = WARMING
            return self._capture(key, base, entry, flat, backend)
        differ = self.ranks is not None and self.ranks.keys_differ
        self.stats.count_eager(ranks.DISAGREE if differ else ranks.BEHIND)
        return self._eager(*flat.rebuild(list(flat.leaves)))

    def _key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Flat, Any, Any]:
        """Key the call, or raise Uncapturable with the reason it must run eagerly."""
        if _warming.active and getattr(_local, "warming", 0):
            raise Uncapturable("called inside another graphed call's warmup or capture")
        flat, parts, device = key_call(args, kwargs)
        if device is None:
            raise Uncapturable("no tensor arguments")
        last = self._device
        if last[0] != device:
            last = self._device = self._find_backend(device)
        if last[2]():
            raise Uncapturable("called while the current stream is capturing")
        watch = self.watch
        if not watch.ok():
            if watch.stale:
                watch.refresh()
            else:
                self._invalidate()
        if watch.hook_reason:
            raise Uncapturable(watch.hook_reason)
        modes = _modes(device)
        if modes[0] and self._autograd_records(flat.leaves, flat.tensor_pos):
            raise Uncapturable("autograd would record this call (use torch.no_grad())")
        return flat, (flat.structure, parts, modes, self.training()), last[1]

    def _quick_key(self, args: tuple[Any, ...]) -> Any:
        """The key of a call of plain positional arguments when nothing is unusual, or
        None: then ``_call`` decides, with the reason for anything that runs eagerly.

        Equal to the key ``_key`` gives the same call (plus the addresses of arguments
        written in place); it only skips building a :class:`Flat`."""
        parts: list[Any] = []
        device = None
        try:
            for x in args:
                tx = type(x)
                if tx is _Tensor or tx is _Parameter:
                    d = x.device
                    if device is None:
                        device = d
                    elif d != device:
                        return None
                    parts.append((x.shape, x.stride(), x.dtype, d, x.requires_grad))
                elif tx is float:
                    parts.append((float, x.hex()))
                elif tx in _PLAIN:
                    parts.append((tx, x))
                else:
                    return None
        except (RuntimeError, NotImplementedError):  # no strides: sparse, nested, ...
            return None
        last = self._device
        if device is None or last[0] != device or last[2]():
            return None
        watch = self.watch
        if watch.hook_reason is not None or not watch.ok():
            return None
        grad = _grad_enabled()
        if grad and self._autograd_records(args, range(len(args))):
            return None
        modes = (grad, _inference_mode(), _any_autocast() and _autocast_of(device),
                 _matmul_precision())
        key: Any = (len(args), tuple(parts), modes, self.training())
        if self.inplace:
            inplace = self.inplace.get(key)
            if inplace:
                key = (key, tuple([args[i].data_ptr() for i in inplace]))
        return key

    @staticmethod
    def _find_backend(device: torch.device) -> tuple[Any, Any, Callable[[], bool]]:
        """(device, its backend, the backend's is-capturing probe), cached per engine."""
        backend = backend_for(device)
        if backend is None:
            raise Uncapturable(f"inputs on {device.type}, not on a device that can be graphed")
        return device, backend, backend.capturing(device)

    def _autograd_records(self, leaves: Any, positions: Any) -> bool:
        if any(getattr(leaves[i], "requires_grad", False) for i in positions):
            return True
        return any(t.requires_grad for t in self.watch.tensors())

    def _eager(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with running(self.watch), self._range("eager"):
            return self.fn(*args, **kwargs)

    # -- entries ---------------------------------------------------------------------
    def _new_entry(self, key: Any) -> Entry:
        with self.lock:
            entry = self.entries.get(key)
            if entry is None:
                entry = self.entries[key] = Entry()
                self.uses = entry.used = self.uses + 1
                self._trim()
            return entry

    def _trim(self) -> None:
        """Evict least recently used entries: ready graphs past ``max_graphs``, and any
        entries past a bound that keeps ever-new keys from growing the dict."""
        limit, budget = self.options.max_graphs, self.options.max_graph_memory
        by_use = sorted(self.entries.items(), key=lambda item: item[1].used)  # stable
        ready = [(k, e.nbytes) for k, e in by_use if e.state == READY]
        total = sum(n for _, n in ready)
        evict: list[Any] = []
        for k, n in ready[:-1]:  # oldest first; the newest graph is the one just kept
            if len(ready) - len(evict) <= limit and (budget is None or total <= budget):
                break
            evict.append(k)
            total -= n
        self._drop(evict)
        self.stats.evictions += len(evict)
        excess = len(self.entries) - 8 * limit - 64
        if excess > 0:
            idle = [k for k, e in by_use if e.state != READY]
            self._drop(idle[:excess])

    def _drop(self, keys: list[Any]) -> None:
        """Forget these entries.  Before ready graphs go, wait for work in flight: a
        replay on another stream may still read their static buffers."""
        entries = [self.entries.pop(k) for k in keys]
        for device, backend in {(e.device, e.backend) for e in entries if e.state == READY}:
            backend.synchronize(device)
        for entry in entries:
            if entry.state == READY:
                self._forget_graph(entry, sync=False)

    def _rekey(self, key: Any, base: Any, entry: Entry, flat: Flat, inplace: set[int]) -> None:
        """Arguments at ``inplace`` are written by the function: key them by address."""
        with self.lock:
            positions = tuple(sorted(set(self.inplace.get(base, ())) | inplace))
            self.inplace[base] = positions
            self.entries.pop(key, None)
            new_key = (base, tuple([flat.leaves[i].data_ptr() for i in positions]))
            self.entries[new_key] = entry
            entry.state = WARMING

    def reset(self) -> None:
        """Drop every graph and forget what was learned about the arguments."""
        with self.lock:
            self._drop(list(self.entries))
            self.inplace.clear()
            self.watch.stale = True

    def _invalidate(self) -> None:
        self.stats.invalidations += 1
        logger.debug("%s: module state changed, dropping %d graphs", self.stats.name,
                     self.stats.graphs)
        self.reset()
        self.watch.refresh()

    # -- warmup --------------------------------------------------------------------
    def _warm(self, key: Any, base: Any, entry: Entry, flat: Flat,
              backend: Backend) -> Any:
        device = flat.leaves[flat.tensor_pos[0]].device
        args, kwargs = flat.rebuild(list(flat.leaves))
        recorder = WriteRecorder(watch_map(list(flat.leaves), flat.tensor_pos)) if entry.runs == 0 \
            else None
        watch = self.watch
        watch.assigned = None
        timed = self.options.min_speedup is not None and (entry.runs > 0 or
                                                          self.options.warmup == 1)
        self.stats.count_eager("warmup", warn=False)  # counted first: the run may raise
        with _capture_lock, _warming(), running(watch), self._range("warmup"):
            if timed:
                backend.synchronize(device)
                start = time.perf_counter()
            with backend.warmup(device):
                if recorder is not None:
                    with recorder:
                        out = self.fn(*args, **kwargs)
                else:
                    out = self.fn(*args, **kwargs)
            if timed:
                backend.synchronize(device)
                entry.eager_s = min(entry.eager_s, time.perf_counter() - start)
        backend.after_warmup(device, out)
        entry.runs += 1
        if watch.assigned:
            self._give_up(entry, f"forward assigns module attribute {watch.assigned}")
        elif recorder is not None and recorder.written:
            self._rekey(key, base, entry, flat, recorder.written)
        return out

    def _give_up(self, entry: Entry, reason: str) -> None:
        entry.state = EAGER
        entry.reason = reason

    # -- capture -------------------------------------------------------------------
    def _capture(self, key: Any, base: Any, entry: Entry, flat: Flat,
                 backend: Backend) -> Any:
        """Capture the call, replay it once for its result, and keep the graph."""
        leaves = list(flat.leaves)
        device = leaves[flat.tensor_pos[0]].device
        with _capture_lock:
            run = entry.run
            if run is not None:  # another thread captured it meanwhile
                return self._replay(entry, run, flat.leaves, flat)
            if entry.state == EAGER:  # another thread's capture of it failed meanwhile
                self.stats.count_eager(entry.reason)
                return self._eager(*flat.rebuild(leaves))
            inplace = self.inplace.get(base, ())
            start = time.perf_counter()
            static = StaticInputs(leaves, [i for i in flat.tensor_pos if i not in inplace])
            before = backend.memory_reserved(device)  # static buffers are counted apart
            try:
                graph, out, written = self._record(flat, static, device, backend)
            except Exception as exc:  # noqa: BLE001 - any capture problem means eager
                return self._capture_failed(entry, flat, exc)
            if self.watch.assigned:
                self._give_up(entry, f"forward assigns module attribute {self.watch.assigned}")
                self.stats.count_eager(entry.reason)
                return self._eager(*flat.rebuild(leaves))
            if written:  # an argument thought read-only is written: capture it in place
                self._rekey(key, base, entry, flat, written)
                self.stats.count_eager(IN_PLACE, warn=False)
                return self._eager(*flat.rebuild(leaves))
            try:
                build = output_builder(out, leaves, static, inplace, self.watch.storage_ptrs())
            except Uncapturable as exc:  # the graph could not hand its outputs back safely
                self._give_up(entry, str(exc))
                self.stats.count_eager(entry.reason)
                return self._eager(*flat.rebuild(leaves))
            entry.graph, entry.static, entry.device = graph, static, device
            entry.backend, entry.pool, entry.build = backend, backend.pool(device), build
            result = _runner(entry)(leaves)
            missed = static.differing(leaves)
            if missed:
                self._hand_back(key, base, entry, flat, leaves, missed)
                return result
            nbytes = max(0, backend.memory_reserved(device) - before) + static.nbytes()
            budget = self.options.max_graph_memory
            if budget is not None and nbytes > budget:
                entry.graph = entry.static = entry.build = None
                self._give_up(entry, f"graph needs {nbytes} bytes, over max_graph_memory")
                self.stats.count_eager(entry.reason)
                return result
            self._keep(key, entry, time.perf_counter() - start, nbytes)
        return result

    def _record(self, flat: Flat, static: StaticInputs, device: torch.device,
                backend: Backend) -> tuple[Any, Any, set[int]]:
        """Capture ``fn`` on the static buffers; also report which of them it writes."""
        leaves = static.substitute(list(flat.leaves))
        args, kwargs = flat.rebuild(leaves)
        recorder = WriteRecorder(watch_map(leaves, tuple(static.positions)))
        self.watch.assigned = None
        with self._range("capture"), _warming(), running(self.watch), recorder, \
                _no_autocast_cache():
            graph, out = backend.capture(device, lambda: self.fn(*args, **kwargs))
        return graph, out, recorder.written

    def _hand_back(self, key: Any, base: Any, entry: Entry, flat: Flat, leaves: list[Any],
                   missed: list[int]) -> None:
        """The graph wrote arguments through something no operator declared (a raw
        kernel): give the caller its write now and capture them in place next time."""
        static = entry.static
        with torch.inference_mode():
            for i, buf in zip(static.positions, static.buffers):  # type: ignore[union-attr]
                if i in missed:
                    leaves[i].copy_(buf)
        self._rekey(key, base, entry, flat, set(missed))
        entry.graph = entry.static = entry.build = None
        self.stats.count_eager(IN_PLACE, warn=False)

    def _keep(self, key: Any, entry: Entry, seconds: float, nbytes: int) -> None:
        stats = self.stats
        with self.lock:
            entry.state = READY
            self.uses = entry.used = self.uses + 1  # the newest graph: evicted last
            entry.run = _runner(entry)
            if self.options.min_speedup is not None:
                entry.run = self._trial(entry, entry.run)
            entry.nbytes = nbytes
            stats.captures += 1
            stats.graphs += 1
            stats.capture_seconds += seconds
            stats.graph_bytes += nbytes
            self._trim()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s: captured %s in %.1f ms, %.2f MiB of graph memory", stats.name,
                         describe(key), seconds * 1e3, nbytes / 2**20)

    # -- the cost gate (min_speedup) ------------------------------------------------
    def _trial(self, entry: Entry, run: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``run``, timed on its first TRIALS calls; then the graph is judged."""
        samples: list[float] = []
        backend, device, engine = entry.backend, entry.device, weakref.ref(self)

        def timed(leaves: Any) -> Any:
            backend.synchronize(device)
            start = time.perf_counter()
            out = run(leaves)
            backend.synchronize(device)
            samples.append(time.perf_counter() - start)
            me = engine()
            if len(samples) >= TRIALS and me is not None:
                me._judge(entry, timed, run, min(samples))
            return out

        return timed

    def _judge(self, entry: Entry, timed: Callable[[Any], Any], run: Callable[[Any], Any],
               replay_s: float) -> None:
        """Keep the graph if it beats eager by ``min_speedup``; else the key runs eagerly."""
        speedup = entry.eager_s / max(replay_s, 1e-9)
        with self.lock:
            if entry.run is not timed or entry.state != READY:  # judged, dropped or evicted
                return
            entry.speedup = speedup
            if speedup >= self.options.min_speedup:  # type: ignore[operator]
                entry.run = run
                return
            self._forget_graph(entry)
            self._give_up(entry, NOT_WORTH)
        logger.info("%s: graph replays in %.1f us, eager runs in %.1f us (%.2fx < "
                    "min_speedup %.2f): this key runs eagerly", self.stats.name,
                    replay_s * 1e6, entry.eager_s * 1e6, speedup, self.options.min_speedup)

    def _capture_failed(self, entry: Entry, flat: Flat, exc: Exception) -> Any:
        """Run the call eagerly; if eager succeeds, the key stays eager for good (if eager
        raises too, the error is the user's own: it propagates unchanged and the key
        will be captured again)."""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = f"capture failed: {type(exc).__name__}: {first}"[:200]
        try:
            out = self._eager(*flat.rebuild(list(flat.leaves)))
        except BaseException:
            self.stats.count_eager(reason, warn=False)
            raise
        self._give_up(entry, reason)
        self.stats.count_eager(reason)
        return out

    # -- replay --------------------------------------------------------------------
    def _replay(self, entry: Entry, run: Callable[[Any], Any], leaves: Any,
                flat: Flat | None = None) -> Any:
        """Replay ``entry`` for these leaves (the positional arguments, when ``flat`` is
        None); if the replay itself fails, drop the graph and run eagerly."""
        try:
            if _profiling():
                with record_function(self.labels["replay"]):
                    result = run(leaves)
            else:
                result = run(leaves)
        except Exception as exc:  # noqa: BLE001 - a failed launch: eager is still right
            return self._replay_failed(entry, exc, leaves, flat)
        self.stats.replays += 1
        self.uses = entry.used = self.uses + 1  # (a stamp, not a count: races are harmless)
        return result

    def _replay_failed(self, entry: Entry, exc: Exception, leaves: Any,
                       flat: Flat | None) -> Any:
        reason = f"replay failed: {type(exc).__name__}: {str(exc).strip()[:120]}"
        with self.lock:
            if entry.state == READY:
                self._forget_graph(entry)
            self._give_up(entry, reason)
        self.stats.count_eager(reason)
        args, kwargs = flat.rebuild(list(leaves)) if flat is not None else (tuple(leaves), {})
        return self._eager(args, kwargs)

    def _forget_graph(self, entry: Entry, sync: bool = True) -> None:
        """Free a ready entry's graph, once work in flight that may read its buffers is
        done (``sync``)."""
        if sync:
            with contextlib.suppress(Exception):  # after a failed replay it may fail too
                entry.backend.synchronize(entry.device)
        self.stats.graphs -= 1
        self.stats.graph_bytes -= entry.nbytes
        entry.graph = entry.static = entry.build = entry.run = None

    def _range(self, what: str) -> contextlib.AbstractContextManager[Any]:
        """A named range in torch.profiler traces (and Nsight, under ``emit_nvtx``)
        while a profiler runs; nothing otherwise."""
        return record_function(self.labels[what]) if _profiling() else _NO_RANGE


def _runner(entry: Entry) -> Callable[[Any], Any]:
    """The replay of a ready entry, with everything it needs bound: copy the arguments
    in, replay, build the outputs.  Serialized per device, since the graphs of a pool
    share memory and a capture must not overlap a replay."""
    lock, pool, device = entry.pool.lock, entry.pool, entry.device  # type: ignore[union-attr]
    order = entry.backend.order_replay
    replay = entry.graph.replay
    static, build = entry.static, entry.build
    single = getattr(build, "single_output", None)
    if single is not None and len(static.positions) == 1:  # type: ignore[union-attr]
        # one tensor in, one tensor out: the common case, with no call in between
        pos, copy, clone = static.positions[0], static.buffers[0].copy_, single.clone  # type: ignore[union-attr]

        def run_one(leaves: Any) -> Any:
            with lock:
                order(device, pool)
                copy(leaves[pos])
                replay()
                return clone()

        return run_one
    copy_in = static.copy_in  # type: ignore[union-attr]

    def run(leaves: Any) -> Any:
        with lock:
            order(device, pool)
            copy_in(leaves)
            replay()
            return build(leaves)  # type: ignore[misc]

    return run


def _same_options(a: Options, b: Options) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. a tensor as a pad value: compare as different
        return False


@contextlib.contextmanager
def _no_autocast_cache() -> Iterator[None]:
    """No autocast cache during a capture: a weight cast cached by an earlier eager call
    would be read by the graph from memory the cache frees when its autocast block ends;
    uncached, the cast is captured and redone on every replay."""
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


def _nested() -> bool:
    """True inside another graphed call's warmup or capture (which the ranks agreed on)."""
    return bool(_warming.active and getattr(_local, "warming", 0))


class _warming:
    """Marks this thread as inside a warmup or capture: nested graphed calls run eagerly.

    ``active`` counts such blocks in all threads, so the call path reads the
    thread-local only while some thread is warming up."""

    __slots__ = ()
    active = 0

    def __enter__(self) -> None:
        with _count_lock:
            _warming.active += 1
        _local.warming = getattr(_local, "warming", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _local.warming -= 1
        with _count_lock:
            _warming.active -= 1
