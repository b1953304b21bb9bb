"""autograph: transparent, safe CUDA graphs for PyTorch inference.

Public API::

    @autograph.graphed                        # a function or nn.Module.forward
    @autograph.graphed(warmup=2, max_graphs=32)
    model = autograph.graphed(model)          # a module instance, transparently
    autograph.stats()                         # what happened, per graphed callable
    autograph.report()                        # the same, as a table
    autograph.reset(obj=None)                 # drop graphs by hand
    with autograph.disabled(): ...            # eager everywhere (also AUTOGRAPH_DISABLE=1)
    with autograph.capture_region(): ...      # graph the module calls made in a block
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Concatenate, ParamSpec, Protocol, TextIO, TypeVar, overload

from torch import nn

from . import stats as _stats
from .lookup import reset
from .lookup import stats_of as _stats_of
from .options import Options
from .region import Region
from .switch import disabled
from .vocab import EagerReason
from .wrappers import wrap

__version__ = "0.1.0"
__all__ = [
    "EagerReason", "__version__", "capture_region", "disabled", "graphed",
    "register_prometheus", "report", "reset", "save_plan", "stats", "warmup",
]

P = ParamSpec("P")
Q = ParamSpec("Q")
R = TypeVar("R", covariant=True)
S = TypeVar("S")
M = TypeVar("M", bound=nn.Module)


class Graphed(Protocol[P, R]):
    """What :func:`graphed` returns for a function or method: called like the original
    (the same parameters and return type), plus :meth:`reset`."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...

    def reset(self) -> None:
        """Drop every graph of this callable."""

    # A method decorated in a class body: looked up on the class it is this object; on an
    # instance its first parameter is bound, as for a function.  The bound method is
    # typed as a plain callable so that it can override ``nn.Module.forward`` (mypy
    # accepts only callables there); ``autograph.reset(model.forward)`` resets it.
    @overload
    def __get__(self, instance: None, owner: type, /) -> Graphed[P, R]: ...
    @overload
    def __get__(self: Graphed[Concatenate[S, Q], R], instance: S,
                owner: type | None = None, /) -> Callable[Q, R]: ...


class _Decorator(Protocol):
    """``graphed(**options)``: decorates a function or method, or wraps a module."""

    @overload
    def __call__(self, obj: M, /) -> M: ...  # type: ignore[overload-overlap]
    @overload
    def __call__(self, obj: Callable[P, R], /) -> Graphed[P, R]: ...


@overload
def graphed(  # type: ignore[overload-overlap]  # a module is callable: it keeps its type
    obj: M,
    /,
    *,
    warmup: int = 2,
    max_graphs: int = 32,
    max_graph_memory: int | None = None,
    buckets: Sequence[int] | None = None,
    batch_dims: Mapping[str | int, int | None] | None = None,
    pad_values: Mapping[str | int, Any] | None = None,
    pad_writes: Mapping[str | int, tuple[int, Any]] | None = None,
    min_speedup: float | None = None,
    group: Any = None,
    verify_every: int | None = None,
    outputs: str = "clone",
    backward: bool = True,
) -> M: ...
@overload
def graphed(
    obj: Callable[P, R],
    /,
    *,
    warmup: int = 2,
    max_graphs: int = 32,
    max_graph_memory: int | None = None,
    buckets: Sequence[int] | None = None,
    batch_dims: Mapping[str | int, int | None] | None = None,
    pad_values: Mapping[str | int, Any] | None = None,
    pad_writes: Mapping[str | int, tuple[int, Any]] | None = None,
    min_speedup: float | None = None,
    group: Any = None,
    verify_every: int | None = None,
    outputs: str = "clone",
    backward: bool = True,
) -> Graphed[P, R]: ...
@overload
def graphed(
    *,
    warmup: int = 2,
    max_graphs: int = 32,
    max_graph_memory: int | None = None,
    buckets: Sequence[int] | None = None,
    batch_dims: Mapping[str | int, int | None] | None = None,
    pad_values: Mapping[str | int, Any] | None = None,
    pad_writes: Mapping[str | int, tuple[int, Any]] | None = None,
    min_speedup: float | None = None,
    group: Any = None,
    verify_every: int | None = None,
    outputs: str = "clone",
    backward: bool = True,
) -> _Decorator: ...


def graphed(
    obj: Any = None,
    /,
    *,
    warmup: int = 2,
    max_graphs: int = 32,
    max_graph_memory: int | None = None,
    buckets: Sequence[int] | None = None,
    batch_dims: Mapping[str | int, int | None] | None = None,
    pad_values: Mapping[str | int, Any] | None = None,
    pad_writes: Mapping[str | int, tuple[int, Any]] | None = None,
    min_speedup: float | None = None,
    group: Any = None,
    verify_every: int | None = None,
    outputs: str = "clone",
    backward: bool = True,
) -> Any:
    """Run a function, method or module through CUDA graphs, one per input key.

    Use it bare (``@autograph.graphed``), with keyword options
    (``@autograph.graphed(warmup=2, max_graphs=32)``), or on a module instance
    (``autograph.graphed(model)``, a transparent wrapper).

    A call with a new key (argument structure, tensor shapes/strides/dtypes/devices,
    non-tensor values, grad/inference/autocast modes, ``module.training``) runs
    ``warmup`` times eagerly, is then captured, and later calls replay the graph.
    Calls that cannot be graphed safely (CPU inputs, autograd recording, a capture
    error, ...) run eagerly and are counted in :func:`stats` with the reason.

    Args:
        warmup: eager runs of a new key before its capture (default 2, at least 0).
        max_graphs: graphs kept per callable; past it the least recently used are
            freed (default 32).
        max_graph_memory: bytes of graph memory kept per callable, each graph counted at
            what it needs of the pool (measured at capture, even where it reuses memory
            that earlier graphs freed);
            the least recently used graphs are freed to stay under it, and a graph that
            alone needs more runs eagerly.  None (default): no bound.
        buckets: batch sizes to capture, e.g. ``[1, 2, 4, 8, 16]``.  A call whose batch
            is not a bucket is padded up to the next one and its outputs sliced back;
            a larger batch runs eagerly.  None (default): one graph per exact shape.
        batch_dims: per argument name (or position), the dimension carrying the batch,
            or None for an argument that does not carry it.  Default: dim 0 of every
            tensor argument that the function does not write in place.
        pad_values: per argument name (or position), the value of padded rows
            (default 0).
        pad_writes: per argument name (or position) written in place, where padded rows
            may write, as ``(dim, index)`` (an int, a slice or a list of ints), e.g.
            ``{"cache": (0, DUMMY_SLOT)}`` when padded rows get ``DUMMY_SLOT`` through
            ``pad_values``.  The padding check ignores differences there, and only there.
        min_speedup: keep a key's graph only if it replays at least this many times
            faster than the key ran eagerly (e.g. ``1.2``); otherwise the key runs
            eagerly, counted with its reason.  Eager is timed on the warmup runs after
            the first, the graph on its first three replays (synchronized wall clock).
            None (default): keep every graph.
        group: a ``torch.distributed`` process group (e.g. ``dist.group.WORLD``) whose
            ranks make the same calls, as tensor-parallel ranks do.  Each call is then
            agreed across the ranks on the host (no GPU work), so that all of them
            replay the same graph, capture together, or run eagerly together; with
            buckets, all pad to the bucket of the largest batch.  Collectives inside
            the forward are captured.  None (default): no agreement.
        verify_every: every this many replays of a graph, also run the call eagerly on
            copies of its arguments (and the state it writes) and compare outputs and
            writes within the dtype's tolerance; a mismatch drops the graph, runs the key
            eagerly from then on, logs a WARNING with the largest difference and counts
            ``verify_failures``.  Graphs that draw random numbers are not checked.  None
            (default): the environment variable ``AUTOGRAPH_VERIFY_EVERY``, else never.
        outputs: ``"clone"`` (default): outputs in the graph's memory are cloned (or a
            buffer no earlier output holds: docs/semantics.md), never overwritten.  ``"reuse"``:
            no copy; the call returns the graph's own output tensors.  Before a replay,
            autograph checks (storage use counts) whether the caller still holds an
            output of an earlier call (the tensor, a view of it, or either kept in a
            list or dict); if so, that call runs eagerly instead, so the held tensor is
            never overwritten, counted in ``outputs_protected`` (and as eager,
            ``outputs_held``).  Drop outputs (or copy what you keep) before the next
            call to replay every time.  Calls that autograd records always clone.
        backward: True (default): a call that autograd records (grad mode on and an
            argument or parameter requiring grad) replays a forward graph, and its
            backward replays a backward graph captured at the key's first backward;
            gradients accumulate into ``.grad`` as in eager mode.  A call made while an
            earlier call of the same graph may still be backpropagated first copies
            that call's saved state out (``backward_spills``); its backward copies it
            back.  False: such calls run eagerly (``autograd``).
    """
    options = Options(warmup, max_graphs, max_graph_memory, buckets, batch_dims, pad_values,
                      min_speedup, group, verify_every, outputs, pad_writes, backward)
    if obj is None:
        return lambda target: wrap(target, options)
    return wrap(obj, options)


def capture_region(
    *,
    warmup: int = 2,
    max_graphs: int = 32,
    max_graph_memory: int | None = None,
    buckets: Sequence[int] | None = None,
    batch_dims: Mapping[str | int, int | None] | None = None,
    pad_values: Mapping[str | int, Any] | None = None,
    pad_writes: Mapping[str | int, tuple[int, Any]] | None = None,
    min_speedup: float | None = None,
    group: Any = None,
    verify_every: int | None = None,
    outputs: str = "clone",
    backward: bool = True,
) -> Region:
    """Graph the module calls made inside a block, without touching the model.

    Inside ``with autograph.capture_region(**options) as region:``, in the thread that
    entered it, every top-level ``nn.Module`` call (one not made from inside another
    module's call) runs through autograph as if the instance had been wrapped with
    :func:`graphed`; its submodule calls become part of its graph.  Graphs belong to the
    module instance, so a later region replays them.  Regions nest (the inner options
    win); a module wrapped with :func:`graphed`, or whose forward is decorated, keeps
    its own options; the kill switch wins over any region.  Outside the block and in
    other threads modules run as before, and nothing stays patched once the last
    region has exited.  Also usable as a decorator; ``region.stats()`` reports the calls
    made inside it.

    Args: the options of :func:`graphed`.
    """
    return Region(Options(warmup, max_graphs, max_graph_memory, buckets, batch_dims, pad_values,
                          min_speedup, group, verify_every, outputs, pad_writes, backward))


def save_plan(path: str | os.PathLike[str]) -> None:
    """Write what the live graphed callables captured to ``path`` (JSON, atomically).

    Per callable: the keys of its graphs (argument shapes, strides, dtypes, devices,
    non-tensor values, modes), the argument positions it writes in place, its bucket hit
    counts, and a fingerprint of its model (structure, parameter names, shapes, dtypes
    and a content checksum); for the file, the environment (GPU name and architecture,
    driver, CUDA runtime, torch and autograph versions).  A later process checks all of
    it before trusting the plan.
    """
    from . import plan
    from .engines import live_engines

    plan.save(path, plan.describe(live_engines()))


def warmup(
    fn: Any,
    /,
    *args: Any,
    batch_sizes: Sequence[int] | None = None,
    plan: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """Capture graphs of ``fn`` before serving, and report what each capture cost.

    ``fn`` is a graphed function, a wrapper made by :func:`graphed`, or a module whose
    forward is graphed; ``*args``/``**kwargs`` are one example call, made through the
    ordinary call path until its key is captured (it runs eagerly meanwhile, like any
    warmup, so arguments the function writes in place are written).  With buckets, the
    example is captured at every bucket (or at ``batch_sizes``), largest first so that
    smaller graphs reuse the pool memory of larger ones: batch arguments are resized
    by repeating their rows; a size between buckets is served (and reported) by the next
    bucket.  Without buckets, ``batch_sizes`` raises ``ValueError`` (nothing says which
    arguments carry the batch).  With ``plan`` (a file written by :func:`save_plan`), the
    keys recorded for ``fn`` are captured first, most used first, each under its recorded
    grad/inference/autocast modes, if every environment and model fingerprint field
    matches (else nothing is, and the differing fields are logged) and its numerics and
    training flags match this process's.  Unreadable plans raise ``ValueError``.

    Returns one dict per capture: ``what``, with buckets ``bucket`` (the bucket whose
    graph serves the call, None where it ran unpadded), ``captured``,
    ``capture_seconds``, ``graph_memory_bytes`` and, when not captured, ``reason``
    (``"already captured"`` where a graph from before serves it, or the eager reason).
    """
    from .ahead import warmup as _warmup
    from .lookup import handle_of

    return _warmup(fn, args, kwargs, handle_of(fn), batch_sizes, plan)


def stats(obj: Any = None) -> dict[str, Any]:
    """Counters of every live graphed callable, keyed by a readable name; or, given a
    graphed function, wrapper or module whose forward is graphed, the counters of that
    one callable.

    Each value holds ``calls``, ``replays``, ``captures``, ``eager`` (calls run
    eagerly) with ``eager_reasons`` (reason -> count), ``graphs`` (live),
    ``graph_memory_bytes`` (measured at capture), ``capture_seconds``, ``evictions``
    and ``invalidations``.  ``calls == replays + captures + eager``.
    """
    if obj is not None:
        return _stats_of(obj)
    return _stats.collect()


def report(obj: Any = None, *, file: TextIO | None = None) -> None:
    """Print :func:`stats` as a table: per callable its calls, replays, hit rate,
    captures, eager runs (then each reason with its count), graphs, graph memory,
    capture time and padding waste (padded rows per real row).  ``obj`` limits it to
    one graphed object; ``file`` defaults to standard output."""
    from .summary import format_report

    table = format_report({_stats_name(obj): stats(obj)} if obj is not None else stats())
    print(table, file=file if file is not None else sys.stdout)


def _stats_name(obj: Any) -> str:
    from .lookup import name_of

    return name_of(obj)


def register_prometheus(registry: Any = None, *, prefix: str = "autograph") -> Any:
    """Expose the counters of every graphed callable to Prometheus.

    Registers a collector (returned) with ``registry`` (default: prometheus_client's
    global one) that reads :func:`stats` at each scrape: ``autograph_calls_total``,
    ``_replays_total``, ``_captures_total``, ``_eager_total{reason}``,
    ``_capture_seconds_total``, ``_evictions_total``, ``_invalidations_total``,
    ``_bucket_misses_total``, ``_bucket_rows_total{bucket,kind}`` and the gauges
    ``autograph_graphs`` and ``autograph_graph_memory_bytes``, labelled by callable.
    Needs ``prometheus-client`` (the ``prometheus`` extra); nothing runs per call.
    """
    from .metrics import register

    return register(registry, prefix)
