"""Padding a batch and checking that padding is safe: the tensor work behind buckets."""

from __future__ import annotations

import reprlib
from collections import Counter
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .capture import backend_for
from .flat import size_leaf
from .returned import opened
from .verify import tolerance

Batch = list[tuple[str | int, torch.Tensor, int]]  # (position or name, tensor, batch dim)


def out_dim(batch: Batch) -> int:
    dims = {d for _, _, d in batch}
    return dims.pop() if len(dims) == 1 else 0


def empty_in_layout(t: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """An empty tensor of ``shape`` whose dimensions are laid out in ``t``'s order
    (a channels-last batch pads to a channels-last batch, and keeps its key)."""
    strides_now = t.stride()
    order = sorted(range(t.dim()), key=lambda d: (-strides_now[d], d))
    strides = [0] * t.dim()
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(shape[d], 1)
    return torch.empty_strided(shape, strides, dtype=t.dtype, device=t.device)


def pad_copy(t: torch.Tensor, dim: int, size: int, value: Any) -> torch.Tensor:
    """A new tensor: ``t`` padded along ``dim`` to ``size`` with ``value`` (for the padding
    check, and for calls that cannot use the persistent buffers of ``padslots``)."""
    real = t.shape[dim]
    shape = list(t.shape)
    shape[dim] = size
    padded = empty_in_layout(t, shape)
    padded.narrow(dim, 0, real).copy_(t)
    padded.narrow(dim, real, size - real).fill_(value)
    return padded


def padded_call(args: tuple[Any, ...], kwargs: dict[str, Any], batch: Batch, size: int,
                values: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with each batch argument padded into a new tensor (with its
    pad value from ``values``, in the batch's order)."""
    new_args, new_kwargs = list(args), dict(kwargs)
    for (key, t, dim), value in zip(batch, values):
        padded = pad_copy(t, dim, size, value)
        if isinstance(key, int):
            new_args[key] = padded
        else:
            new_kwargs[key] = padded
    return tuple(new_args), new_kwargs


def copy_back(padded: tuple[tuple[Any, ...], dict[str, Any]], batch: Batch, written: list[int],
              real: int) -> None:
    """After a call on new padded tensors (``padded_call``): the real rows of the batch
    arguments at ``written`` (indexes into ``batch``) go back to the caller's tensors."""
    new_args, new_kwargs = padded
    with torch.no_grad():  # (a leaf requiring grad, written under no_grad inside the call)
        for i in written:
            key, t, dim = batch[i]
            src = new_args[key] if isinstance(key, int) else new_kwargs[key]
            t.copy_(src.narrow(dim, 0, real))


def versions_of(tensors: list[torch.Tensor]) -> list[int | None]:
    """Each tensor's version counter (None for an inference tensor, which has none)."""
    out: list[int | None] = []
    for t in tensors:
        try:
            out.append(t._version)
        except RuntimeError:
            out.append(None)
    return out


def advanced(tensors: list[torch.Tensor], before: list[int | None],
             written: list[int]) -> list[int]:
    """``written`` (indexes into ``tensors``) with every tensor whose version counter
    moved since ``before``: a padded call that wrote an argument the context's first
    call did not (a write on a branch, or one for some batch sizes only) hands it back
    too (a replay advances the counters its capture saw advance)."""
    moved = [i for i, (t, v) in enumerate(zip(tensors, before))
             if v is not None and i not in written and t._version != v]
    return sorted([*written, *moved]) if moved else written


def shares_memory(args: tuple[Any, ...], kwargs: dict[str, Any], batch: Batch) -> bool:
    """Whether a batch argument shares memory with another tensor argument (the same
    tensor passed twice, a view of another argument): padding copies a batch argument,
    so a write through one of them would not reach the other as it does eagerly."""
    slots = [*args, *kwargs.values()]
    if any(isinstance(x, (list, tuple, dict)) for x in slots):
        slots = pytree.tree_leaves((args, kwargs))
    tensors = [x for x in slots if isinstance(x, torch.Tensor) and x.numel()]
    if len(tensors) < 2:
        return False
    counts = Counter(t.untyped_storage().data_ptr() for t in tensors)
    return any(counts[t.untyped_storage().data_ptr()] > 1 for _, t, _ in batch if t.numel())


def rows_of(batch: list[tuple[str | int, torch.Tensor, int]]) -> int:
    """The batch size all batch arguments agree on, or 0 when they disagree."""
    real = batch[0][1].shape[batch[0][2]]
    return real if all(t.shape[d] == real for _, t, d in batch) else 0


def graphable(device: torch.device) -> bool:
    """Whether calls on ``device`` can be graphed at all (padding for an eager run would
    only cost time)."""
    return backend_for(device) is not None


def size_of(t: torch.Tensor, dim: int) -> int:
    return int(t.shape[dim])


def arg_of(args: tuple[Any, ...], kwargs: dict[str, Any], key: str | int) -> Any:
    return args[key] if isinstance(key, int) else kwargs[key]


def slice_back(out: Any, size: int, real: int, dim: int) -> Any:
    """Every tensor in ``out`` whose ``dim`` has the bucket's ``size``, cut to ``real``:
    a view where that is dense (rows of a contiguous output), else a dense copy in the
    same dimension order, the layout eager gives a batch of ``real`` (a view with the
    bucket's strides would fail a ``.view()`` that eager's output takes)."""
    if type(out) is torch.Tensor:  # the common case, without a pytree walk
        if out.dim() > dim and out.shape[dim] == size:
            return _dense(out[:real] if dim == 0 else out.narrow(dim, 0, real))  # [:n]: cheaper
        return out

    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > dim and x.shape[dim] == size:
            return _dense(x.narrow(dim, 0, real))
        return x

    return pytree.tree_map(cut, out, is_leaf=size_leaf)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t``, or where its elements leave gaps (rows cut from a batch that is not the
    outermost dimension in memory), a dense copy in the same dimension order."""
    if t.is_contiguous():
        return t
    expected = 1
    for stride, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return t.clone()  # (clone keeps the order of a tensor that is not dense)
        expected *= n
    return t


def copies(args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def copy(x: Any) -> Any:
        return x.detach().clone() if isinstance(x, torch.Tensor) else x

    return tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}


Region = tuple[int, Any]  # a pad_writes entry: (dim, int, slice or tuple of ints)


def compare(expect: Any, got: Any) -> str | None:
    """What differs between the real call's outputs and the padded call's (sliced back),
    or None: the structure, every tensor's shape and real rows, and every other leaf
    (a number derived from the batch size, ``x.shape``), which a replay would return as
    the padded capture saw it."""
    a, spec_a = pytree.tree_flatten(expect)
    b, spec_b = pytree.tree_flatten(got)
    a, b = opened(a), opened(b)  # returned objects (a DynamicCache): by their tensors
    if spec_a != spec_b:
        return "outputs differ in structure"
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.shape != y.shape:
                return "an output changes shape"
            if not _close(x, y):
                return "real rows of an output change"
        elif not _same_value(x, y):
            return f"a non-tensor output changes ({reprlib.repr(x)} becomes {reprlib.repr(y)})"
    return None


def _same_value(x: Any, y: Any) -> bool:
    """Whether two non-tensor output leaves are the same value (NaN equal to NaN; a
    value that cannot be compared counts as changed)."""
    if x is y:
        return True
    if type(x) is not type(y):
        return False
    try:
        return bool(x == y) or bool(x != x and y != y)  # noqa: PLR0124 - NaN
    except Exception:  # noqa: BLE001 - an object without a plain equality
        return False


def compare_writes(plain: list[tuple[Any, torch.Tensor]], padded: list[torch.Tensor],
                   regions: dict[Any, Region]) -> str | None:
    """Arguments must end up exactly as the real call leaves them (padded ones on their
    real rows): padded rows may not write into a cache or table, except inside the
    argument's ``pad_writes`` region, where differences are ignored (and only there).
    ``plain``: (canonical key, tensor) per argument of the real call."""
    for (key, p), q in zip(plain, padded):
        if p.shape != q.shape:
            continue
        region = regions.get(key)
        if region is not None:
            dim, index = region
            where = (slice(None),) * dim + (list(index) if isinstance(index, tuple) else index,)
            q = q.clone()
            try:
                q[where] = p[where]
            except (IndexError, RuntimeError) as exc:
                return f"pad_writes[{key!r}] does not index the argument ({exc})"
        if not _close(p, q):
            outside = " outside its pad_writes region" if region is not None else ""
            return f"padded rows write into argument {key!r}{outside}"
    return None


def _close(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.dtype != y.dtype:
        return False
    if x.is_floating_point() or x.is_complex():
        tol = tolerance(x.dtype)
        return bool(torch.allclose(x, y, rtol=tol, atol=tol, equal_nan=True))
    return bool(torch.equal(x, y))
