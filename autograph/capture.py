"""The seam between autograph's orchestration and the graph mechanics of a device.

A *backend* knows how to warm up, capture and replay on one kind of device.  The CUDA
backend wraps ``torch.cuda.CUDAGraph``; the test suite registers a CPU stand-in with
the same contract, so the whole orchestration runs in CI without a GPU.

Contract of a backend:

* ``accepts(device)``: whether calls on this device can be graphed here.
* ``is_capturing(device)``: whether the calling thread's current stream is capturing
  (then a graphed call must run eagerly: it becomes part of the outer capture);
  ``capturing(device)`` returns that check as a cheap zero-argument callable.
* ``warmup(device)``: a context manager for eager warmup runs, on the stream the
  capture will use (cuBLAS/cuDNN workspaces are per stream).
* ``capture(device, fn)``: capture ``fn()`` into a new graph in the device's shared
  pool and return ``(graph, output)``.  On any error the capture is ended cleanly and
  the error propagates.  Nothing has run yet when it returns: ``graph.replay()`` runs it.
  With ``rng_free=True`` (the call is known to draw no random numbers on the device)
  the device's random number generator is left out of the capture, so other threads
  keep drawing from it meanwhile (see :func:`_begin`).
* ``memory_reserved(device)``: bytes the allocator holds, to measure graph memory.
* ``pool(device)``: the :class:`Pool` shared by every graph of the device;
  ``private_pool(device)``: a new pool of its own (sharing the device's replay lock),
  for graphs whose memory must outlive a replay (a training forward's saved
  activations, read by its backward graph later); ``capture(device, fn, pool)``
  captures into it.
* ``order_replay(device, pool)``: make a replay on the current stream wait for the
  previous replay of the pool if that ran on another stream.
* ``after_warmup(device, output)`` and ``synchronize(device)``: stream bookkeeping
  for warmup outputs, and a full wait before graphs and their buffers are freed.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")


class Graph(Protocol):
    def replay(self) -> None: ...


class Pool:
    """What the graphs of one device share: one memory pool and one replay lock.

    Graphs that share a pool overlap in memory, so they must never run concurrently:
    replays are serialized by ``lock``, and a replay issued on another stream than the
    previous one first waits for that stream (``last_stream``).
    """

    def __init__(self, handle: Any = None, anchor: Any = None,
                 lock: threading.Lock | None = None) -> None:
        self.handle = handle
        self._anchor = anchor  # keeps the pool alive while it has no other graph
        self.lock = lock if lock is not None else threading.Lock()
        self.last_stream: Any = None


class Backend(Protocol):
    def accepts(self, device: torch.device) -> bool: ...
    def is_capturing(self, device: torch.device) -> bool: ...
    def capturing(self, device: torch.device) -> Callable[[], bool]: ...
    def warmup(self, device: torch.device) -> contextlib.AbstractContextManager[None]: ...
    def capture(self, device: torch.device, fn: Callable[[], T],
                pool: Pool | None = None, rng_free: bool = False) -> tuple[Graph, T]: ...
    def memory_reserved(self, device: torch.device) -> int: ...
    def pool(self, device: torch.device) -> Pool: ...
    def private_pool(self, device: torch.device) -> Pool: ...
    def order_replay(self, device: torch.device, pool: Pool) -> None: ...
    def after_warmup(self, device: torch.device, output: Any) -> None: ...
    def synchronize(self, device: torch.device) -> None: ...


class OnPool:
    """A backend whose captures and replays use one given pool: a training graph's own,
    or an ``outputs="reuse"`` graph's (its outputs are handed out, so no other graph
    may reuse their memory, as graphs sharing a pool do with what an earlier one freed)."""

    def __init__(self, backend: Backend, pool: Pool) -> None:
        self._backend = backend
        self._pool = pool
        self.order_replay = backend.order_replay  # per call: not through __getattr__

    def capture(self, device: torch.device, fn: Callable[[], Any],
                pool: Pool | None = None, rng_free: bool = False) -> Any:
        return self._backend.capture(device, fn, self._pool, rng_free=rng_free)

    def pool(self, device: torch.device) -> Pool:
        return self._pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


class CudaBackend:
    """Real CUDA graphs: one side stream and one memory pool per device."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._pools: dict[int, Pool] = {}
        # One replay lock per device, shared by its pools (old and new) and held by a
        # capture: torch flags the device's default generator as capturing for the
        # whole process, and a replay meanwhile would fail on it.
        self._gates: dict[int, threading.Lock] = {}
        self._cublas_cleared: set[int] = set()  # devices whose workspaces were freed

    def accepts(self, device: torch.device) -> bool:
        return device.type == "cuda" and torch.cuda.is_available()

    def is_capturing(self, device: torch.device) -> bool:
        return bool(_stream_capturing())

    def capturing(self, device: torch.device) -> Callable[[], bool]:
        return _stream_capturing  # type: ignore[no-any-return]

    def _stream(self, index: int) -> torch.cuda.Stream:
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
            return stream

    def pool(self, device: torch.device) -> Pool:
        index = _index(device)
        pool = self._pools.get(index)
        if pool is None:
            side = self._stream(index)
            with self._lock:
                pool = self._pools.get(index)
                if pool is None:
                    pool = self._pools[index] = _new_pool(index, side, self._gate(index))
        return pool

    def private_pool(self, device: torch.device) -> Pool:
        """A new pool for ``device``, apart from the shared one, with its replay lock."""
        index = _index(device)
        side = self._stream(index)
        with self._lock:
            gate = self._gate(index)
        return _new_pool(index, side, gate)

    def _gate(self, index: int) -> threading.Lock:
        """The replay lock of device ``index`` (call under ``self._lock``)."""
        gate = self._gates.get(index)
        if gate is None:
            gate = self._gates[index] = threading.Lock()
        return gate

    @contextlib.contextmanager
    def warmup(self, device: torch.device) -> Iterator[None]:
        index = _index(device)
        side = self._stream(index)
        with torch.cuda.device(index):
            caller = torch.cuda.current_stream()
            side.wait_stream(caller)
            try:
                with torch.cuda.stream(side):
                    yield
            finally:
                caller.wait_stream(side)

    def after_warmup(self, device: torch.device, output: Any) -> None:
        """Tell the allocator that warmup outputs (made on the side stream) are used on
        the caller's stream, so their memory is not reused too early."""
        caller = torch.cuda.current_stream(_index(device))
        for leaf in torch.utils._pytree.tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
                if leaf.layout is torch.strided and not leaf.is_nested:
                    leaf.record_stream(caller)
                else:  # sparse or nested: no record_stream of their own (such a call
                    for part in _parts(leaf):  # runs eagerly from now on)
                        part.record_stream(caller)

    def capture(self, device: torch.device, fn: Callable[[], T],
                pool: Pool | None = None, rng_free: bool = False) -> tuple[Graph, T]:
        index = _index(device)
        if pool is None:
            pool = self.pool(device)
        side = self._stream(index)
        graph = torch.cuda.CUDAGraph()
        gc_was_enabled = gc.isenabled()
        with torch.cuda.device(index):
            caller = torch.cuda.current_stream()
            rng = torch.cuda.get_rng_state(index)
            torch.cuda.synchronize()
            if index not in self._cublas_cleared:  # see _clear_cublas_workspaces
                self._cublas_cleared.add(index)
                _clear_cublas_workspaces()
            _blas_ready(index)
            side.wait_stream(caller)
            gc.disable()  # a collection during capture could free tensors mid-graph
            try:
                with torch.cuda.stream(side), pool.lock:
                    _begin(graph, pool.handle, index, rng_free)
                    try:
                        output = fn()
                        graph.capture_end()
                    except BaseException:
                        _end_quietly(graph)
                        self._recover(index, rng)
                        raise
            finally:
                if gc_was_enabled:
                    gc.enable()
                caller.wait_stream(side)
        return graph, output

    def _recover(self, index: int, rng: torch.Tensor) -> None:
        """Clean up after a capture that failed.

        A failed ``capture_end`` skips its bookkeeping: the pool stays marked as being
        recorded into (a later capture into it fails), and the default generator stays
        flagged as capturing (every later random op fails with "Offset increment outside
        graph capture").  So the pool is retired (its graphs keep working) and a new one
        is made, whose anchor capture completes and clears the generator's flag; then
        the generator state saved before the capture is restored.
        """
        side = self._stream(index)
        with self._lock:
            self._pools.pop(index, None)
            with contextlib.suppress(Exception):
                self._pools[index] = _new_pool(index, side, self._gate(index), rng_free=False)
        with contextlib.suppress(Exception):
            torch.cuda.set_rng_state(rng, index)

    def memory_reserved(self, device: torch.device) -> int:
        return torch.cuda.memory_reserved(_index(device))

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(_index(device))

    def order_replay(self, device: torch.device, pool: Pool) -> None:
        """Make a replay on the current stream wait for the previous one on another."""
        current = _current_stream(device.index)  # CUDA tensors always carry an index
        last = pool.last_stream
        if last is not None and last != current:
            _stream_of(current).wait_stream(_stream_of(last))
        pool.last_stream = current


# (stream id, device index, device type) of the current stream, without making a
# Python ``Stream`` object on every replay.
_current_stream: Any = getattr(torch._C, "_cuda_getCurrentStream", None)


def _stream_of(key: tuple[int, int, int]) -> torch.cuda.Stream:
    return torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])


_stream_capturing = getattr(
    torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing
)


def _new_pool(index: int, stream: torch.cuda.Stream, gate: threading.Lock,
              rng_free: bool = True) -> Pool:
    """A graph memory pool for device ``index`` that lives as long as the process.

    The allocator frees a graph pool together with its last graph, and its id must not
    be used after that.  A tiny anchor graph captured into the pool keeps it alive, so
    graphs can come and go (evicted, invalidated, garbage collected) and the pool, with
    the memory it caches for the next capture, stays valid.  ``rng_free=False``: the
    anchor is captured with the device's generator, which it clears of the capturing
    flag a failed capture left (``CudaBackend._recover``).
    """
    with torch.cuda.device(index):
        handle = torch.cuda.graph_pool_handle()
        scratch = torch.zeros(1, device=index)
        anchor = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _begin(anchor, handle, index, rng_free)
            scratch.add_(1)
            anchor.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
    return Pool(handle, anchor, gate)


def _begin(graph: torch.cuda.CUDAGraph, handle: Any, index: int, rng_free: bool) -> None:
    """Begin capturing ``graph`` on the current stream into pool ``handle``.

    ``capture_begin`` registers the device's default generator with the graph and
    flags its state as capturing until ``capture_end``: meanwhile a random operator on
    any other thread raises ("Offset increment outside graph capture encountered
    unexpectedly"), where eager runs it.  For a call known to draw no random numbers
    (``rng_free``), the generator holds a state of its own while the capture begins:
    that state is registered and flagged, and the real one is back before the call
    runs, so other threads draw as usual.  A random operator of the call itself would
    then find the real state unflagged: torch raises, or the engine's recorder sees
    it, and the call is captured again the usual way (``lifecycle.RandomFound``).

    What is left is the start of the capture (about 50 µs on an H200): a draw by
    another thread then fails as before, or (in its first microseconds) draws from the
    stand-in state, whose own random seed repeats none of the real state's numbers.
    """
    gen = torch.cuda.default_generators[index] if rng_free and _GRAPHSAFE else None
    if gen is None:
        graph.capture_begin(pool=handle, capture_error_mode="thread_local")
        return
    live = gen.graphsafe_get_state()
    apart = torch.Generator(device=gen.device)
    apart.seed()
    gen.graphsafe_set_state(apart)
    try:
        graph.capture_begin(pool=handle, capture_error_mode="thread_local")
    finally:
        gen.graphsafe_set_state(live)


# torch's graph-safe generator states (swapped without a copy of the state tensor)
_GRAPHSAFE = all(hasattr(torch.Generator, name)
                 for name in ("graphsafe_get_state", "graphsafe_set_state", "clone_state"))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _end_quietly(graph: torch.cuda.CUDAGraph) -> None:
    """End a capture that failed; the first error is the one worth reporting."""
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The CUDA Graph is empty": it failed early
        graph.capture_end()


_blas_threads = threading.local()  # per thread: the devices whose handles it made


def _blas_ready(index: int) -> None:
    """Make this thread's cuBLAS and cuBLASLt handles for the device before its first
    capture: torch makes them per thread at first use, and creating one inside a
    capture fails (``CUBLAS_STATUS_NOT_INITIALIZED``), as it did for a thread that
    captures a key other threads warmed up.  Made on the caller's stream, so the side
    stream's workspace is still made by the capture, in the pool (see below)."""
    made = getattr(_blas_threads, "devices", None)
    if made is None:
        made = _blas_threads.devices = set()
    if index in made:
        return
    made.add(index)
    with torch.no_grad():
        torch.cuda.current_blas_handle()
        a = torch.ones(2, 2, device=f"cuda:{index}")
        torch.nn.functional.linear(a, a, a[0])  # cuBLASLt (a matmul with a bias)
        torch.mm(a, a)


# cuBLAS keeps one workspace per (handle, stream), made at first use: one made by an
# eager warmup on the side stream lives in the general memory, and every graph
# captured after it keeps its address.  torch.compile's CUDA graph trees free every
# workspace before and after they record (``clear_cublass_cache``); a workspace our
# graphs use would then go back to the allocator while our replays still write into it.
# So before a device's first capture the workspaces are freed once: the capture makes
# the side stream's workspace in the pool, where it stays (held by cuBLAS) for every
# later warmup and capture.  Not freed again: freeing one that earlier graphs use would
# let a later capture place its tensors there.
_clear_cublas_workspaces: Callable[[], None] = getattr(
    torch._C, "_cuda_clearCublasWorkspaces", lambda: None)

_backends: list[Backend] = [CudaBackend()]
_by_device: dict[torch.device, Backend | None] = {}


def backend_for(device: torch.device) -> Backend | None:
    """The backend that graphs calls on ``device``, or None (then calls run eagerly)."""
    try:
        return _by_device[device]
    except KeyError:
        pass
    found = next((b for b in _backends if b.accepts(device)), None)
    _by_device[device] = found
    return found


def use_backend(backend: Backend) -> Callable[[], None]:
    """Put ``backend`` first (tests use it for the CPU stand-in); returns an undo."""
    _backends.insert(0, backend)
    _by_device.clear()

    def undo() -> None:
        _backends.remove(backend)
        _by_device.clear()

    return undo


def _parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors a sparse or nested tensor keeps its memory in (none where
    this torch does not say: every later use of the side stream waits for the caller's
    first, so recording is a precaution)."""
    getters = {torch.sparse_coo: ("_indices", "_values"),
               torch.sparse_csr: ("crow_indices", "col_indices", "values"),
               torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
               torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
               torch.sparse_bsc: ("ccol_indices", "row_indices", "values")}
    names = getters.get(t.layout, ())
    try:
        if t.is_nested:
            return [t.values()] if t.layout is torch.jagged else []
        return [getattr(t, name)() for name in names]
    except (RuntimeError, NotImplementedError, AttributeError):
        return []
