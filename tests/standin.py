"""A CPU stand-in for CUDA graphs, so CI can test autograph's orchestration.

Capture records every ATen operator the function runs, with the very tensors it ran
on; replay runs the recorded operators again on those same tensors and writes each
result into the tensor recorded at capture.  Like a real graph, a replay therefore
reads only the buffers captured (a forgotten copy-in shows stale data), replays the
Python decisions taken at capture (attribute values are baked in), and overwrites its
outputs in place.  Like a real capture, capturing executes no writes (in-place
operators run on scratch copies) and host synchronizations such as ``.item()`` fail.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autograph.capture import Pool
from autograph.mutation import pass_higher_order, written_args

T = TypeVar("T")
aten = torch.ops.aten

# operators that need the host to wait for the device: not allowed during capture
HOST_SYNCS = {
    aten._local_scalar_dense.default,
    aten.item.default,  # under inference mode ``.item()`` reaches a mode as this
    aten.nonzero.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.masked_select.default,
}


# operators whose output size depends on the data: the host reads it on the device
for _name in ("_unique2", "unique_dim", "unique_consecutive", "_unique", "bincount",
              # a nested tensor made from a mask (``nn.TransformerEncoder``'s fast path
              # with a padding mask): CUDA reads the mask on the host
              "_nested_tensor_from_mask", "_nested_tensor_from_mask_left_aligned"):
    if hasattr(aten, _name):
        HOST_SYNCS.add(getattr(aten, _name).default)
# operators of other libraries that read device data on the host (by name: the library
# may not be imported)
_HOST_SYNC_NAMES = frozenset({"torchvision::nms"})


def _sized_by_data(func: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` sizes its output from the data on the host (``nms``;
    ``repeat_interleave`` of a repeats tensor without ``output_size``)."""
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return getattr(func, "name", lambda: "")() in _HOST_SYNC_NAMES


_MASK_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                  aten._index_put_impl_.default}


def _mask_indexed(func: Any, args: Any) -> bool:
    """Whether ``func`` indexes with a boolean mask (``x[x > 0]``), which on the device
    counts the mask's true entries on the host."""
    if func not in _MASK_INDEXING or len(args) < 2:
        return False
    masks = [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype in (
        torch.bool, torch.uint8)]
    if masks and func is not aten.index.Tensor and _masked_fill(args):
        return False
    return bool(masks)


def _masked_fill(args: Any) -> bool:
    """Whether ATen runs this ``index_put_`` as ``masked_fill_`` (``x[mask] = 0``: one
    mask, the only index, and a one-element value on the host; ATen's
    ``canDispatchToMaskedFill``), which counts nothing on the host."""
    value, indices = args[2], [i for i in args[1] if i is not None]
    accumulate = len(args) > 3 and bool(args[3])
    return (not accumulate and len(indices) == 1 and isinstance(value, torch.Tensor)
            and value.numel() == 1 and value.device.type == "cpu")


_INPLACE_VIEW = getattr(torch.Tag, "inplace_view", None)


class CaptureError(RuntimeError):
    pass


_capturing: set[int] = set()  # the threads capturing (for _refuse_host_reads)


def _refuse_host_reads() -> None:
    """``Tensor.tolist()`` and ``.numpy()`` read a CPU tensor without reaching the
    dispatcher: on the device they synchronize, which a capture refuses.  Patched on
    the class once, refusing in capturing threads only (a torch function mode would
    turn off fast paths that check for one, as ``nn.MultiheadAttention``'s does)."""
    for name in ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args: Any, _name: str = name,
                 _original: Any = original, **kwargs: Any) -> Any:
            if _capturing and threading.get_ident() in _capturing:
                raise CaptureError(f"Tensor.{_name} is not permitted while the stream is "
                                   "capturing")
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, read)


_refuse_host_reads()


@contextlib.contextmanager
def _host_reads_refused() -> Iterator[None]:
    me = threading.get_ident()
    _capturing.add(me)
    try:
        yield
    finally:
        _capturing.discard(me)


@pass_higher_order  # a higher-order operator reaches the mode as on CUDA none would
class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []
        self.nbytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in HOST_SYNCS or _mask_indexed(func, args) or _sized_by_data(func, kwargs):
            raise CaptureError(f"{func} is not permitted while the stream is capturing")
        if _INPLACE_VIEW is not None and _INPLACE_VIEW in func.tags:
            # a metadata change (``transpose_``): no kernel; the replay puts back the
            # metadata it left, so later operators see the tensor as they saw it here
            out = func(*args, **kwargs)
            t = args[0]
            self.ops.append((_Restride(t.size(), t.stride(), t.storage_offset()), (t,), {},
                             None))
            return out
        written = _written_args(func, args, kwargs)
        if written:
            # a capture executes nothing: run the write on scratch copies
            scratch = {id(t): t.clone() for t in written}
            sargs, skwargs = pytree.tree_map(
                lambda a: scratch.get(id(a), a) if isinstance(a, torch.Tensor) else a,
                (args, kwargs),
            )
            out = func(*sargs, **skwargs)
            back = {id(c): orig for orig, c in ((t, scratch[id(t)]) for t in written)}
            out = pytree.tree_map(
                lambda o: back.get(id(o), o) if isinstance(o, torch.Tensor) else o, out
            )
        else:
            out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        for o in pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor):
                self.nbytes += o.numel() * o.element_size()
        return out


class _Restride:
    """Replays a metadata change: the tensor takes the geometry it had after it."""

    def __init__(self, size: Any, stride: Any, offset: int) -> None:
        self.geometry = (size, stride, offset)

    def __call__(self, t: torch.Tensor) -> None:
        t.as_strided_(*self.geometry)


def _written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    values = written_args(func, args, kwargs)
    return [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]


class RecordedGraph:
    """Replays recorded operators on the recorded tensors."""

    def __init__(self, ops: list[Any], delay: float = 0.0) -> None:
        self.ops = ops
        self.replays = 0
        self.delay = delay

    def replay(self) -> None:
        self.replays += 1
        if self.delay:
            time.sleep(self.delay)
        # a graph's replay writes memory behind autograd's back: no version counter moves
        written = {id(t): t for _, args, kwargs, recorded in self.ops
                   for t in pytree.tree_leaves((args, kwargs, recorded))
                   if isinstance(t, torch.Tensor) and not t.is_inference()}
        tensors = tuple(written.values())
        versions = tuple(t._version for t in tensors)
        try:
            self._run()
        finally:
            _set_versions(tensors, versions)

    def _run(self) -> None:
        with torch.inference_mode(), torch.autocast("cpu", enabled=False):
            for func, args, kwargs, recorded in self.ops:
                if func in _ALLOCATIONS:  # no kernel: the memory keeps what it held
                    continue
                fresh = _training_run(func, args, kwargs) if func in _TRAINING_RESULTS \
                    else func(*args, **kwargs)
                for leaf in pytree.tree_leaves(fresh):
                    if not isinstance(leaf, torch.Tensor) and hasattr(leaf, "wait"):
                        leaf.wait()  # a collective's work: done before the next operator
                for old, new in _pairs(recorded, fresh):
                    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) \
                            and _storage(old) != _storage(new):
                        if old.shape != new.shape:  # changed in place since (``squeeze_``)
                            old = old.as_strided(new.size(), new.stride())
                        old.copy_(new)


# operators that allocate and run no kernel (a graph's replay runs nothing for them; a
# host copy into their memory, ``at::tensor(list)``, is no operator the capture saw)
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default}
# operators whose results differ under inference mode: ``mkldnn_rnn_layer`` gives no
# workspace there, which an LSTM's backward reads
_RNN_LAYER = getattr(aten, "mkldnn_rnn_layer", None)
_TRAINING_RESULTS = {_RNN_LAYER.default} if _RNN_LAYER is not None else set()


def _training_run(func: Any, args: Any, kwargs: Any) -> Any:
    """``func`` run as a training call runs it (a replay of a CUDA graph runs the
    kernels captured, the training ones included)."""
    with torch.inference_mode(False), torch.enable_grad():
        args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        out = func(*args, **kwargs)
    return tuple(None if o is None else o.detach() for o in out)


def _pairs(recorded: Any, fresh: Any) -> Any:
    """The recorded and fresh results of an operator, paired: output by output where it
    returns several (an inference-mode run may give None for one, ``mkldnn_rnn_layer``'s
    workspace, which flattening would drop and misalign the rest)."""
    if isinstance(recorded, (tuple, list)) and isinstance(fresh, (tuple, list)) \
            and len(recorded) == len(fresh):
        return [p for old, new in zip(recorded, fresh) for p in _pairs(old, new)]
    return zip(pytree.tree_leaves(recorded), pytree.tree_leaves(fresh))


_set_versions = torch._C._autograd._unsafe_set_version_counter


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


_CPU = torch.device("cpu")


class StandinBackend:
    """Graphs for CPU tensors, with the contract of ``autograph.capture.CudaBackend``."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._pool = Pool()
        self.reserved = 0
        # With share_pool, captures reuse the pool as CUDA graphs of one pool do: the
        # pool grows only past the largest capture so far (a smaller one reads 0).
        self.share_pool = False
        self._pool_size = 0
        self.captures = 0
        self.fail_next: BaseException | None = None
        self.replay_delay = 0.0  # seconds each replay sleeps (to test min_speedup)
        self.pools_used: list[Pool] = []  # the pool of each capture, in order
        self.rng_free: list[bool] = []  # each capture's rng_free, in order
        # each capture's graph, in order (weakly: dropped graphs must be freed)
        self.graphs: list[weakref.ref[RecordedGraph]] = []

    def accepts(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def is_capturing(self, device: torch.device) -> bool:
        return getattr(self._local, "capturing", False)

    def capturing(self, device: torch.device) -> Callable[[], bool]:
        return lambda: self.is_capturing(device)

    @contextlib.contextmanager
    def warmup(self, device: torch.device) -> Iterator[None]:
        yield

    def after_warmup(self, device: torch.device, output: Any) -> None:
        pass

    def capture(self, device: torch.device, fn: Callable[[], T],
                pool: Pool | None = None, rng_free: bool = False) -> tuple[RecordedGraph, T]:
        recorder = _Recorder()
        self.rng_free.append(rng_free)
        self.pools_used.append(pool if pool is not None else self._pool)
        self._local.capturing = True
        # a CUDA capture advances no generator: its first replay draws what eager would
        generator = torch.random.get_rng_state()
        try:
            with recorder, _host_reads_refused(), self._stream_capturing():
                if self.fail_next is not None:
                    exc, self.fail_next = self.fail_next, None
                    raise exc
                out = fn()
            if rng_free and not torch.equal(torch.random.get_rng_state(), generator):
                # as CUDA: the generator was left out of the capture (capture._begin),
                # and a draw from it raises
                raise RuntimeError("Attempt to increase offset for a CUDA generator not in "
                                   "capture mode.")
        finally:
            self._local.capturing = False
            torch.random.set_rng_state(generator)
        self.captures += 1
        if self.share_pool:
            self.reserved += max(0, recorder.nbytes - self._pool_size)
            self._pool_size = max(self._pool_size, recorder.nbytes)
        else:
            self.reserved += recorder.nbytes
        graph = RecordedGraph(recorder.ops, self.replay_delay)
        self.graphs.append(weakref.ref(graph))
        return graph, out

    @contextlib.contextmanager
    def _stream_capturing(self) -> Iterator[None]:
        """``torch.cuda.is_current_stream_capturing()`` is True on this thread while it
        captures, as on CUDA: libraries skip their host syncs then (transformers'
        ``is_tracing()``: an attention mask's ``.all()``), which a capture could not run."""
        before = torch.cuda.is_current_stream_capturing
        torch.cuda.is_current_stream_capturing = lambda: self.is_capturing(_CPU)
        try:
            yield
        finally:
            torch.cuda.is_current_stream_capturing = before

    def memory_reserved(self, device: torch.device) -> int:
        return self.reserved

    def pool(self, device: torch.device) -> Pool:
        return self._pool

    def private_pool(self, device: torch.device) -> Pool:
        return Pool(lock=self._pool.lock)  # one replay lock per device, as on CUDA

    def order_replay(self, device: torch.device, pool: Pool) -> None:
        pass

    def synchronize(self, device: torch.device) -> None:
        pass


class NullGraph:
    """A graph whose replay does nothing (for timing the host work around replays)."""

    def replay(self) -> None:
        pass


class NullBackend(StandinBackend):
    """The stand-in with null graphs: a capture runs the function once, replays do
    nothing, so what remains is the Python and the operators around the graphs (the
    tools' host-cost measurements; results are not those of a replay)."""

    def capture(self, device: torch.device, fn: Any, pool: Pool | None = None,
                rng_free: bool = False) -> Any:
        self._local.capturing = True
        try:
            out = fn()
        finally:
            self._local.capturing = False
        return NullGraph(), out


class Tally:
    """What a test's graphed function counts or notes as it runs (Python that replays
    skip): a list or dict named by the function would be a change autograph makes the
    call eager for, a method of an object is not."""

    def __init__(self) -> None:
        self.n = 0
        self.seen: list[Any] = []

    def tick(self) -> int:
        self.n += 1
        return self.n

    def add(self, value: Any) -> None:
        self.seen.append(value)
