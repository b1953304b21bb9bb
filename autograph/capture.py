"""The seam between autograph's orchestration and the graph mechanics of a device.

A *backend* knows how to warm up, capture and replay on one kind of device.  The CUDA
backend wraps ``torch.cuda.CUDAGraph``; the test suite registers a CPU stand-in with
the same contract, so the whole orchestration runs in CI without a GPU.

Contract of a backend:

* ``accepts(device)``: whether calls on this device can be graphed here.
* ``is_capturing(device)``: whether the calling thread's current stream is capturing
  (then a graphed call must run eagerly: it becomes part of the outer capture).
* ``warmup(device)``: a context manager for eager warmup runs, on the stream the
  capture will use (cuBLAS/cuDNN workspaces are per stream).
* ``capture(device, fn)``: capture ``fn()`` into a new graph in the device's shared
  pool and return ``(graph, output)``.  On any error the capture is ended cleanly and
  the error propagates.  Nothing has run yet when it returns: ``graph.replay()`` runs it.
* ``memory_reserved(device)``: bytes the allocator holds, to measure graph memory.
* ``pool(device)``: the :class:`Pool` shared by every graph of the device.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
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

    The allocator frees a graph pool with its last graph, after which its id must not
    be used again.  So the pool handle is held while at least one kept graph is alive
    (counted by finalizers, however the graph dies) and minted anew after that.
    """

    def __init__(self, mint: Callable[[], Any] = lambda: None) -> None:
        self._mint = mint
        self._handle: Any = None
        self._count_lock = threading.Lock()
        self.graphs = 0
        self.lock = threading.Lock()
        self.last_stream: Any = None

    def acquire(self) -> Any:
        """The pool handle for a new capture."""
        with self._count_lock:
            if self._handle is None:
                self._handle = self._mint()
            return self._handle

    def adopt(self, graph: Any) -> None:
        """A kept graph holds the pool until it is garbage collected."""
        with self._count_lock:
            self.graphs += 1
        try:
            weakref.finalize(graph, self._release)
        except TypeError:  # not weak-referenceable: hold the pool for good
            pass

    def _release(self) -> None:
        with self._count_lock:
            self.graphs -= 1
            if self.graphs <= 0:
                self.graphs = 0
                self._handle = None

    def settle(self) -> None:
        """After a capture that was not kept: forget a handle that no graph holds."""
        with self._count_lock:
            if self.graphs == 0:
                self._handle = None


class Backend(Protocol):
    def accepts(self, device: torch.device) -> bool: ...
    def is_capturing(self, device: torch.device) -> bool: ...
    def warmup(self, device: torch.device) -> contextlib.AbstractContextManager[None]: ...
    def capture(self, device: torch.device, fn: Callable[[], T]) -> tuple[Graph, T]: ...
    def memory_reserved(self, device: torch.device) -> int: ...
    def pool(self, device: torch.device) -> Pool: ...
    def order_replay(self, device: torch.device, pool: Pool) -> None: ...
    def after_warmup(self, device: torch.device, output: Any) -> None: ...


class CudaBackend:
    """Real CUDA graphs: one side stream and one memory pool per device."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._pools: dict[int, Pool] = {}

    def accepts(self, device: torch.device) -> bool:
        return device.type == "cuda" and torch.cuda.is_available()

    def is_capturing(self, device: torch.device) -> bool:
        return _stream_capturing()

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
            with self._lock, torch.cuda.device(index):
                pool = self._pools.setdefault(index, Pool(_minter(index)))
        return pool

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
                leaf.record_stream(caller)

    def capture(self, device: torch.device, fn: Callable[[], T]) -> tuple[Graph, T]:
        index = _index(device)
        pool = self.pool(device)
        side = self._stream(index)
        graph = torch.cuda.CUDAGraph()
        gc_was_enabled = gc.isenabled()
        with torch.cuda.device(index):
            caller = torch.cuda.current_stream()
            torch.cuda.synchronize()
            side.wait_stream(caller)
            gc.disable()  # a collection during capture could free tensors mid-graph
            try:
                with torch.cuda.stream(side):
                    graph.capture_begin(
                        pool=_pool_id(pool.acquire()), capture_error_mode="thread_local"
                    )
                    try:
                        output = fn()
                    except BaseException:
                        _end_quietly(graph)
                        raise
                    graph.capture_end()
            finally:
                if gc_was_enabled:
                    gc.enable()
                caller.wait_stream(side)
        return graph, output

    def memory_reserved(self, device: torch.device) -> int:
        return torch.cuda.memory_reserved(_index(device))

    def order_replay(self, device: torch.device, pool: Pool) -> None:
        """Make a replay on the current stream wait for the previous one on another."""
        current = _current_stream_key(_index(device))
        last = pool.last_stream
        if last is not None and last != current:
            _stream_of(current).wait_stream(_stream_of(last))
        pool.last_stream = current


def _current_stream_key(index: int) -> tuple[int, int, int]:
    """(stream id, device index, device type) of the current stream, without making a
    Python ``Stream`` object on every replay."""
    return torch._C._cuda_getCurrentStream(index)  # type: ignore[attr-defined,no-any-return]


def _stream_of(key: tuple[int, int, int]) -> torch.cuda.Stream:
    return torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])


_stream_capturing = getattr(
    torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing
)


def _minter(index: int) -> Callable[[], Any]:
    """A new pool for device ``index``: a ``torch.cuda.MemPool`` (which keeps its pool
    alive while we hold it) where torch has one, else a bare pool handle."""

    def mint() -> Any:
        with torch.cuda.device(index):
            mempool = getattr(torch.cuda, "MemPool", None)
            if mempool is not None:
                return mempool()
            return torch.cuda.graph_pool_handle()

    return mint


def _pool_id(handle: Any) -> Any:
    return handle if isinstance(handle, tuple) else handle.id


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _end_quietly(graph: torch.cuda.CUDAGraph) -> None:
    """End a capture that failed; the first error is the one worth reporting."""
    with contextlib.suppress(Exception):
        graph.capture_end()


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
