"""Options of ``autograph.graphed`` and ``capture_region``, validated when given."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

OUTPUT_MODES = ("clone", "reuse")


def _int_at_least(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"autograph: {name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class Options:
    """How one graphed callable warms up, captures and bounds its graphs.

    warmup: eager runs of a new key before it is captured (on the capture stream), so
        lazy initialisation (cuBLAS handles, autotuning, workspaces) happens outside
        the capture.
    max_graphs: live graphs kept per callable; past it the least recently used go.
    max_graph_memory: bytes of graph memory (measured at capture) kept per callable;
        past it the least recently used graphs go, and a graph that alone needs more
        is not kept (the call runs eagerly).  None: no bound.
    buckets: batch sizes to capture; a call whose batch is not one of them is padded
        up to the next one and its outputs sliced back.  None: one graph per shape.
    batch_dims: per argument (name or position), the dimension that carries the
        batch, or None for an argument that does not carry it.  Unlisted tensor
        arguments carry it in dim 0, except those the function writes in place.
    pad_values: per argument (name or position), the value padded rows are filled with
        (default 0).
    pad_writes: per argument (name or position) that the function writes in place, the
        part padded rows may write: ``(dim, index)`` with an int, a slice or a list of
        ints, e.g. ``{"cache": (0, DUMMY_SLOT)}``.  The padding check ignores differences
        there (and only there); writes elsewhere still turn padding off.
    min_speedup: keep a graph only if its replays are at least this many times faster
        than eager (a number >= 1), timed on the key's warmup runs and its first replays
        (wall clock, synchronized).  None: keep every graph.
    group: a ``torch.distributed`` process group whose ranks make the same calls: each
        call is agreed across them (see ``ranks``).  None: no agreement.
    verify_every: check every Nth replay of a graph against eager (see ``verify``).
        None: ``AUTOGRAPH_VERIFY_EVERY``, else never.
    outputs: ``"clone"``: outputs in the graph pool are never overwritten once handed
        out (cloned, or a buffer of the key's variants that nothing holds: rotation.py);
        ``"reuse"``: the call returns the graph's own output tensors, and a call made
        while an earlier output (or a view of it) is still held runs eagerly instead
        of overwriting it (see ``Captured.runner``).
    backward: a call that autograd records (grad mode on and an argument or parameter
        requiring grad) is captured as a forward graph and a backward graph (see
        ``backward``); False: such calls run eagerly (reason ``autograd``).
    """

    warmup: int = 2
    max_graphs: int = 32
    max_graph_memory: int | None = None
    buckets: Sequence[int] | None = None
    batch_dims: Mapping[str | int, int | None] | None = field(default_factory=dict)
    pad_values: Mapping[str | int, Any] | None = field(default_factory=dict)
    min_speedup: float | None = None
    group: Any = None
    verify_every: int | None = None
    outputs: str = "clone"
    pad_writes: Mapping[str | int, tuple[int, Any]] | None = field(default_factory=dict)
    backward: bool = True

    def __post_init__(self) -> None:
        _int_at_least("warmup", self.warmup, 0)
        _int_at_least("max_graphs", self.max_graphs, 1)
        if self.max_graph_memory is not None:
            _int_at_least("max_graph_memory", self.max_graph_memory, 1)
        if self.buckets is not None:
            sizes = self.buckets
            if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
                raise ValueError(
                    f"autograph: buckets must be a non-empty list of batch sizes, got {sizes!r}"
                )
            for size in sizes:
                _int_at_least("every bucket", size, 1)
            object.__setattr__(self, "buckets", tuple(sorted(set(sizes))))
        for name, mapping in (("batch_dims", self.batch_dims), ("pad_values", self.pad_values),
                              ("pad_writes", self.pad_writes)):
            if mapping is None:
                mapping = {}
            if not isinstance(mapping, Mapping):
                raise ValueError(f"autograph: {name} must be a dict, got {mapping!r}")
            object.__setattr__(self, name, dict(mapping))
        if self.min_speedup is not None:
            speedup = self.min_speedup
            if isinstance(speedup, bool) or not isinstance(speedup, (int, float)) \
                    or not speedup >= 1:
                raise ValueError(
                    f"autograph: min_speedup must be >= 1, got {speedup!r}: it is how many "
                    f"times faster than eager a graph must replay to be kept, and a value "
                    f"below 1 would keep graphs slower than eager (None keeps every graph)")
            if self.warmup < 1:
                raise ValueError("autograph: min_speedup needs warmup >= 1 (eager runs are "
                                 "what the graph is timed against)")
        if self.outputs not in OUTPUT_MODES:
            raise ValueError(f"autograph: outputs must be 'clone' or 'reuse', "
                             f"got {self.outputs!r}")
        if not isinstance(self.backward, bool):
            raise ValueError(f"autograph: backward must be True or False, got {self.backward!r}")
        if self.verify_every is not None:
            _int_at_least("verify_every", self.verify_every, 1)
        if self.group is not None:
            import torch.distributed as dist

            if not (dist.is_available() and isinstance(self.group, dist.ProcessGroup)):
                raise ValueError("autograph: group must be a torch.distributed ProcessGroup "
                                 f"(e.g. torch.distributed.group.WORLD), got {self.group!r}")
        for arg, dim in self.batch_dims.items():  # type: ignore[union-attr]
            if dim is not None:
                _int_at_least(f"batch_dims[{arg!r}]", dim, 0)
        for arg, value in self.pad_values.items():  # type: ignore[union-attr]
            _pad_value(arg, value)
        writes = {arg: _region(arg, where)
                  for arg, where in self.pad_writes.items()}  # type: ignore[union-attr]
        object.__setattr__(self, "pad_writes", writes)


def _pad_value(arg: Any, value: Any) -> None:
    """A pad value is a number or a 0-dim tensor: padded rows are filled with it."""
    import torch

    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return
    if not isinstance(value, (bool, int, float, complex)):
        raise ValueError(f"autograph: pad_values[{arg!r}] must be a number (padded rows are "
                         f"filled with it), got {value!r}")


def _region(arg: Any, where: Any) -> tuple[int, int | slice | tuple[int, ...]]:
    """A ``pad_writes`` entry as ``(dim, index)``, the index an int, a slice or a tuple of
    ints (a list is made a tuple, so that options compare and pickle as values)."""
    name = f"pad_writes[{arg!r}]"
    if not isinstance(where, tuple) or len(where) != 2:
        raise ValueError(f"autograph: {name} must be a (dim, index) pair, e.g. (0, 7) for "
                         f"index 7 of dim 0, got {where!r}")
    dim, index = where
    _int_at_least(f"{name}'s dim", dim, 0)
    if isinstance(index, (list, tuple)):
        index = tuple(index)
        ok = bool(index) and all(isinstance(i, int) and not isinstance(i, bool) for i in index)
    else:
        ok = isinstance(index, slice) or (isinstance(index, int) and not isinstance(index, bool))
    if not ok:
        raise ValueError(f"autograph: {name}'s index must be an int, a slice or a non-empty "
                         f"list of ints, got {index!r}")
    return dim, index


def same_options(a: Options, b: Options) -> bool:
    """Whether two options are equal (a tensor pad value compares as different)."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. a tensor as a pad value: compare as different
        return False
