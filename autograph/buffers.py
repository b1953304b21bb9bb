"""Static input buffers and safe outputs.

A graph reads its inputs from fixed addresses.  Arguments the function only reads are
copied into private static buffers before each replay, in one batched copy; arguments
it writes in place are captured at the caller's own address and never copied (see
``mutation``).  Outputs living in the graph's pool are cloned out, so an output kept by
the caller is never overwritten by a later replay (with ``outputs="reuse"`` they are
handed out as aliases of the graph's own tensors instead, and the replay checks that
none is still held, see ``replay.Captured.runner``); outputs that alias an argument
are rebuilt as the same view of the caller's tensor, as eager mode would return them.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .flat import size_leaf
from .mutation import storage_ptr
from .objects import object_key
from .returned import Refused, Spliced, containers_of
from .sharing import Shared, _extent, is_clone
from .vocab import EagerReason, Uncapturable
from .walk import Walked

# non-tensor outputs that a replay may hand back as they were at capture
_CONSTANT_OUTPUTS = (
    type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
    torch.memory_format, enum.Enum, type(Ellipsis), torch.Size,
)

_foreach_copy = getattr(torch, "_foreach_copy_", None)


class StaticInputs:
    """The private buffers that stand for the read-only tensor arguments of one graph.

    Each buffer has its argument's shape and strides (a sliced or transposed argument
    gets a buffer of the same geometry), so the function sees the layout eager sees
    and an output that views an argument maps back onto the caller's tensor.  An
    argument passed at several positions (``mha(x, x, x)``) gets one buffer, passed at
    each of them: code that tests ``query is key`` takes the path eager takes.
    """

    __slots__ = ("positions", "buffers", "_unique", "_sources", "_single", "_batched")

    def __init__(self, leaves: list[Any], positions: list[int]) -> None:
        self.positions = positions
        self.buffers: list[torch.Tensor] = []
        self._unique: list[torch.Tensor] = []  # one per distinct argument object
        self._sources: list[int] = []  # the position each unique buffer is copied from
        first: dict[int, torch.Tensor] = {}
        for i in positions:
            buf = first.get(id(leaves[i]))
            if buf is None:
                buf = first[id(leaves[i])] = _static_like(leaves[i])
                self._unique.append(buf)
                self._sources.append(i)
            self.buffers.append(buf)
        self._single = len(self._unique) == 1
        # torch's batched copy refuses conjugate and negative destinations: one by one
        self._batched = not any(b.is_conj() or b.is_neg() for b in self._unique)

    def substitute(self, leaves: list[Any]) -> list[Any]:
        """The leaves with the static buffers in place of the copied arguments."""
        out = list(leaves)
        for i, buf in zip(self.positions, self.buffers):
            out[i] = buf
        return out

    def copy_in(self, leaves: list[Any]) -> None:
        """Copy the caller's arguments into the buffers, in one batched copy."""
        if self._single:
            self._unique[0].copy_(leaves[self._sources[0]])
        elif self._unique:
            src = [leaves[i] for i in self._sources]
            if _foreach_copy is not None and self._batched:
                _foreach_copy(self._unique, src)
            else:  # pragma: no cover - torch without _foreach_copy_
                for dst, s in zip(self._unique, src):
                    dst.copy_(s)

    def differing(self, leaves: list[Any]) -> list[int]:
        """Positions whose buffer no longer equals the caller's tensor (written by the
        graph although no operator declared the write)."""
        return [
            i for i, buf in zip(self.positions, self.buffers) if not _same_values(buf, leaves[i])
        ]

    def nbytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self._unique)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (a NaN input is not a write); another shape is
    not equal."""
    if a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return False


def _static_like(t: torch.Tensor) -> torch.Tensor:
    """A buffer with ``t``'s shape and strides (contiguous where ``t``'s elements
    overlap, as in an expanded tensor, which cannot be copied into) and its conjugate
    and negative bits (``z.conj()``: code may branch on ``is_conj()``; keyed apart)."""
    with torch.no_grad():
        if _overlaps(t):
            buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        else:
            buf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        if t.is_conj():
            buf = buf.conj()
        if t.is_neg():
            buf = buf._neg_view()
        buf.copy_(t.detach())
        return buf


def _overlaps(t: torch.Tensor) -> bool:
    """Whether some elements of ``t`` share memory (``expand``): a buffer of its strides
    cannot be copied into (an ``unfold``, which torch cannot judge, can)."""
    check = getattr(torch, "_debug_has_internal_overlap", None)
    if check is not None:
        return int(check(t)) == 1  # MemOverlap::Yes
    return any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape))  # pragma: no cover


def _clone_changes_layout(t: torch.Tensor) -> bool:
    """Whether ``t.clone()`` has other strides than ``t`` (overlapping or gapped
    elements: ``expand``, ``unfold``), at capture."""
    return bool(t.numel()) and t.clone().stride() != t.stride()


def output_builder(
    output: Any,
    leaves: list[Any],
    static: StaticInputs,
    inplace: tuple[int, ...],
    persistent: set[int],
    reuse: bool = False,
    aliases: bool = True,
    walks: tuple[tuple[int, Walked], ...] = (),
    themselves: set[int] | frozenset[int] = frozenset(),
    known: Callable[[], Iterable[Any]] = tuple,
) -> Callable[[list[Any]], Any]:
    """A function from the call's leaves to the call's result, made at capture.

    Each tensor of ``output`` is classified once:
    * a view of an argument (static buffer or in-place) becomes the same view of the
      caller's tensor for that argument;
    * a tensor inside an object argument (``return cache.k``; ``walks``: each
      object's position and walk) becomes that tensor of the call's own object, found
      by walking it again on every call (only for keys with such outputs);
    * a tensor that outlives the graph (a parameter, buffer or global, in
      ``persistent``) is returned as it is (the very object where it is one, ids in
      ``themselves``; a view of one, ``self.pos[:n]``, as a new alias per call, as
      eager makes a new view: a caller's ``unsqueeze_`` must not reach later calls);
    * anything else lives in the graph pool and is cloned on every call; with
      ``reuse``, handed out as a new alias of the graph's tensor (a tensor object of
      its own, so that the caller holding it shows in its storage's use count).
      Outputs that share a storage (the same tensor twice, a tensor and views of it)
      are cloned together and handed out as the same views of one copy, as eager
      returns them (:class:`sharing.Shared`; not with ``aliases=False``).

    Objects the call made (pytree does not open them) are made again per call around
    their tensors, treated as outputs like any other (returned.py); what existed
    before the call (``known()`` and what it reaches) is returned as itself.

    The function's ``pool_outputs`` lists the outputs that live in the pool.
    """
    flat, spec = pytree.tree_flatten(output, is_leaf=size_leaf)  # a Size: one constant
    arg_storage: dict[int, tuple[int, torch.Tensor]] = {}
    for i, buf in zip(static.positions, static.buffers):
        if _same_geometry(buf, leaves[i]):
            arg_storage[storage_ptr(buf)] = (i, buf)
    for i in inplace:
        arg_storage[storage_ptr(leaves[i])] = (i, leaves[i])

    # object arguments (passed through, objects.py) returned as they are
    objects = {id(v): i for i, v in enumerate(leaves)
               if not isinstance(v, (torch.Tensor, *_CONSTANT_OUTPUTS))}
    # objects the call made (a DynamicCache): their tensors stand in their place among
    # the outputs, and each call makes the object again around them (returned.py)
    try:
        spliced = Spliced.find(flat, objects, known, lambda: containers_of(output),
                               lambda: leaves)
    except Refused as refused:
        raise Uncapturable(EagerReason.OUTPUT, f"output of type "
                           f"{type(refused.value).__qualname__} cannot be made again by a "
                           f"replay: it holds {refused.why}") from None
    if spliced is not None:
        flat = spliced.splice(flat)
    inside = _object_storages(walks, arg_storage)
    makers: list[Callable[[list[Any]], Any]] = []
    for value in flat:
        if objects and id(value) in objects:
            makers.append(_argument_object(objects[id(value)]))
            continue
        if inside and isinstance(value, torch.Tensor) and storage_ptr(value) in inside:
            makers.append(_object_tensor(value, *inside[storage_ptr(value)]))
            continue
        makers.append(_leaf_maker(value, arg_storage, persistent, reuse, themselves))
    pool_outputs = [v for v, make in zip(flat, makers) if is_clone(make)]
    shared = Shared.find(flat, makers) if aliases and not reuse else []
    if any(not _plain_output(flat[k]) for group in shared for k in group.members):
        # views of one plain copy: a member's class or requires_grad would be lost
        raise Uncapturable(EagerReason.OUTPUT, "outputs sharing memory include a tensor "
                           "subclass or a tensor marked requires_grad_() by the call")
    for group in shared:
        for k in group.members:
            makers[k] = _filled_by_group

    if spliced is not None:
        return _with_objects(spec, makers, shared, spliced, pool_outputs)
    if spec.is_leaf() and isinstance(flat[0], torch.Tensor) and is_clone(makers[0]) \
            and not _faithful(flat[0]) and _plain_output(flat[0]):
        out0 = flat[0]
        hand_out = out0.detach if reuse else out0.clone

        def build_one(_leaves: list[Any]) -> Any:
            return hand_out()

        build_one.single_output = out0  # type: ignore[attr-defined]  # the engine's fast path
        build_one.pool_outputs = pool_outputs  # type: ignore[attr-defined]
        return build_one

    record = _record_maker(output, spec, flat)
    if shared:
        def build(call_leaves: list[Any]) -> Any:
            made = [make(call_leaves) for make in makers]
            for group in shared:
                group.fill(made)
            return record(made) if record is not None else pytree.tree_unflatten(made, spec)
    elif record is not None:
        def build(call_leaves: list[Any]) -> Any:
            return record([make(call_leaves) for make in makers])
    else:
        def build(call_leaves: list[Any]) -> Any:
            return pytree.tree_unflatten([make(call_leaves) for make in makers], spec)

    build.pool_outputs = pool_outputs  # type: ignore[attr-defined]
    return build


def _with_objects(spec: Any, makers: list[Callable[[list[Any]], Any]], shared: list[Shared],
                  spliced: Spliced, pool_outputs: list[Any]) -> Callable[[list[Any]], Any]:
    """The output builder of an output holding objects the call made."""
    def flat(call_leaves: list[Any]) -> list[Any]:
        made = [make(call_leaves) for make in makers]
        for group in shared:
            group.fill(made)
        return made

    def build(call_leaves: list[Any]) -> Any:
        return pytree.tree_unflatten(spliced.regroup(flat(call_leaves), call_leaves), spec)

    build.pool_outputs = pool_outputs  # type: ignore[attr-defined]
    # a training graph's Function returns the tensors; it makes the objects after it
    build.spliced, build.flat = spliced, flat  # type: ignore[attr-defined]
    return build


def _record_maker(output: Any, spec: Any, values: list[Any]
                  ) -> Callable[[list[Any]], Any] | None:
    """A faster ``tree_unflatten`` for an output that is a dataclass and an OrderedDict
    whose items are all leaves (a transformers ``ModelOutput``): pytree rebuilds it
    through its ``__init__`` and checks, about 10 µs on every replay; this makes the
    object without them, with the attributes and items unflatten gives.  Only where
    that object is nothing but its items: its attributes are its dataclass fields, each
    an item (the same value) or None; and where it gives exactly what unflatten gives
    for the capture's own values (type, items in order, attributes, by identity).
    None otherwise (pytree then)."""
    cls = type(output)
    if (not isinstance(output, OrderedDict) or not dataclasses.is_dataclass(output)
            or spec.type is not cls or not all(c.is_leaf() for c in _children(spec))):
        return None
    try:
        want = pytree.tree_unflatten(values, spec)
        names = list(want.keys())
        attrs = dict(want.__dict__)
        fields = {f.name for f in dataclasses.fields(cls)}
    except Exception:  # noqa: BLE001 - an unusual layout: pytree stays the one way
        return None
    if (len(names) != len(values) or attrs.keys() != fields
            or any(want[n] is not v or attrs.get(n) is not v for n, v in zip(names, values))
            or any(v is not None for k, v in attrs.items() if k not in names)):
        return None
    new, setitem = OrderedDict.__new__, OrderedDict.__setitem__

    def make(leaves: list[Any]) -> Any:
        obj = new(cls)
        d = obj.__dict__
        d.update(attrs)  # the None fields (the items' are set next)
        for name, value in zip(names, leaves):
            setitem(obj, name, value)
            d[name] = value
        return obj

    got = make(values)
    if (type(got) is not cls or list(got.keys()) != names
            or got.__dict__.keys() != attrs.keys()
            or any(v is not attrs[k] for k, v in got.__dict__.items())
            or any(a is not b for a, b in zip(got.values(), values))):
        return None
    # from now on every default None (the items are set per call): the capture's own
    # values are not kept (an object passed through, a cache, would stay alive with them)
    attrs = dict.fromkeys(attrs)
    return make


def _children(spec: Any) -> list[Any]:
    return spec.children() if hasattr(spec, "children") else spec.children_specs  # type: ignore


def _argument_object(i: int) -> Callable[[list[Any]], Any]:
    """An output that is an object argument: the call's own object at replay."""
    return lambda leaves: leaves[i]


def _object_storages(objects: tuple[tuple[int, Walked], ...],
                     arg_storage: dict[int, tuple[int, torch.Tensor]]
                     ) -> dict[int, tuple[int, int, torch.Tensor]]:
    """Storage address -> (the object's position, the tensor's index in its walk, the
    tensor) for the tensors inside object arguments (not those of a tensor argument)."""
    out: dict[int, tuple[int, int, torch.Tensor]] = {}
    for pos, walked in objects:
        for k, t in enumerate(walked.tensors):
            if t.numel():
                out.setdefault(storage_ptr(t), (pos, k, t))
    for ptr in arg_storage:
        out.pop(ptr, None)
    return out


def _object_tensor(value: torch.Tensor, pos: int, k: int, base: torch.Tensor
                   ) -> Callable[[list[Any]], Any]:
    """An output that is (a view of) the ``k``-th tensor of the object argument at
    ``pos``: the same view of that tensor of the call's own object, as eager returns it
    (the tensor itself for ``return cache.k``).  The key holds the object's structure
    and addresses, so its ``k``-th tensor is the one of the capture's geometry."""
    if value.dtype != base.dtype:
        raise Uncapturable(EagerReason.OUTPUT, "an output views an argument object's "
                           "tensor as another dtype")
    offset = value.storage_offset() - base.storage_offset()
    size, stride = value.shape, value.stride()
    whole = size == base.shape and stride == base.stride() and offset == 0
    itself = value is base

    def tensor(leaves: list[Any]) -> torch.Tensor:
        t = object_key(leaves[pos])[1].tensors[k]
        if whole:
            return t if itself else t.detach()  # type: ignore[no-any-return]
        return t.as_strided(size, stride, t.storage_offset() + offset)

    return tensor


def _leaf_maker(
    value: Any, arg_storage: dict[int, tuple[int, torch.Tensor]], persistent: set[int],
    reuse: bool = False, themselves: set[int] | frozenset[int] = frozenset(),
) -> Callable[[list[Any]], Any]:
    if not isinstance(value, torch.Tensor):
        if not isinstance(value, _CONSTANT_OUTPUTS):
            # an object pytree does not open may hold tensors of the pool, which the
            # next replay would overwrite: such a call cannot be graphed
            raise Uncapturable(
                EagerReason.OUTPUT,
                f"output of type {type(value).__qualname__} is not a tensor, a constant or "
                "a pytree container (register it with torch.utils._pytree)",
            )
        return lambda _leaves: value
    ptr = storage_ptr(value)
    if ptr in arg_storage:
        i, base = arg_storage[ptr]
        if value.dtype != base.dtype:  # the argument's bytes read as another dtype
            return _dtype_view(value, i, base)
        offset = value.storage_offset() - base.storage_offset()
        size, stride = value.shape, value.stride()
        whole = size == base.shape and stride == base.stride() and offset == 0
        itself = value is base  # ``return x``; else a tensor of its own (``x.detach()``)
        # a conjugate or negative view (``x.conj()``, ``x.conj().imag``): the same bits
        conj, neg = value.is_conj() != base.is_conj(), value.is_neg() != base.is_neg()

        def view(leaves: list[Any]) -> torch.Tensor:
            arg = leaves[i]
            if whole and not (conj or neg):  # a resize of the result must not resize x
                return arg if itself else arg.detach()  # type: ignore[no-any-return]
            made = arg.as_strided(size, stride, arg.storage_offset() + offset)
            if conj:
                made = made.conj()
            return made._neg_view() if neg else made

        return view
    if ptr in persistent:
        return _persistent_maker(value, themselves)

    clone: Callable[[list[Any]], torch.Tensor]
    if not _plain_output(value):
        clone = _as_made(value, _leaf_maker(
            value.as_subclass(torch.Tensor).detach(), {}, set(), reuse))
    elif reuse:
        def clone(_leaves: list[Any]) -> torch.Tensor:  # an alias: no copy
            return value.detach()
    elif _faithful(value):
        clone = _faithful_clone(value)
    else:
        def clone(_leaves: list[Any]) -> torch.Tensor:
            return value.clone()

    clone._clone = True  # type: ignore[attr-defined]
    return clone


def _plain_output(value: torch.Tensor) -> bool:
    """Whether a copy of the output is what eager returns: a plain tensor, not one
    marked ``requires_grad_()`` by the call (a leaf made under ``no_grad``), not a
    subclass (``nn.Parameter(x * 2)``, ``as_subclass``)."""
    return type(value) is torch.Tensor and not (value.requires_grad and value.is_leaf)


def _as_made(value: torch.Tensor, copy: Callable[[list[Any]], torch.Tensor]
             ) -> Callable[[list[Any]], torch.Tensor]:
    """``copy`` (of a plain tensor), made the class of ``value`` again with its
    ``requires_grad`` (one carrying Python attributes runs eagerly: ``lifecycle``)."""
    cls, grad = type(value), value.requires_grad and value.is_leaf

    def made(leaves: list[Any]) -> torch.Tensor:
        t = copy(leaves)
        if issubclass(cls, torch.nn.Parameter):
            return cls(t, requires_grad=grad)  # type: ignore[no-any-return]
        if cls is not torch.Tensor:
            t = t.as_subclass(cls)
        return t.requires_grad_() if grad and t.is_leaf and not t.requires_grad else t

    return made


def _persistent_maker(value: torch.Tensor, themselves: set[int] | frozenset[int]
                      ) -> Callable[[list[Any]], torch.Tensor]:
    """An output in memory that outlives the graph: the tensor itself where it is one
    (a parameter, buffer or named tensor), else a new view of that memory per call, as
    eager makes one (``self.pos[:n]``: made from its base as the same strided view,
    ``requires_grad`` as eager's under the call's mode; an alias without a base:
    ``detach``)."""
    base = value._base
    if id(value) in themselves or (base is None and value.requires_grad):
        return lambda _leaves: value
    if base is None or id(base) not in themselves:
        return lambda _leaves: value.detach()
    size, stride, offset = value.shape, value.stride(), value.storage_offset()
    conj, neg = value.is_conj() != base.is_conj(), value.is_neg() != base.is_neg()
    dtype_view = value.dtype != base.dtype

    def view(_leaves: list[Any]) -> torch.Tensor:
        if dtype_view:
            return value.detach()
        made = base.as_strided(size, stride, offset)
        made = made.conj() if conj else made
        return made._neg_view() if neg else made

    return view


def _faithful(value: torch.Tensor) -> bool:
    """Whether ``value.clone()`` would not give eager's tensor: another layout (overlapping
    or gapped elements: ``expand``, ``unfold``, ``.imag``) or the conjugate and negative
    bits resolved (``(x * 2).conj()``)."""
    return value.is_conj() or value.is_neg() or _clone_changes_layout(value)


def _faithful_clone(value: torch.Tensor) -> Callable[[list[Any]], torch.Tensor]:
    """The clone of an output that ``clone`` would change (:func:`_faithful`): a copy of
    the memory under it (the storage span it covers, where its layout is not dense),
    viewed with its sizes, strides and bits, as eager returns it (a dense, resolved
    copy would be another layout, writable where eager's raises)."""
    conj, neg = value.is_conj(), value.is_neg()
    plain = value.conj() if conj else value
    plain = plain._neg_view() if neg else plain  # pool memory, the bits undone
    size, stride = plain.shape, plain.stride()
    span = plain.as_strided((_extent(plain),), (1,), plain.storage_offset()) \
        if _clone_changes_layout(plain) else None

    def clone(_leaves: list[Any]) -> torch.Tensor:
        made = plain.clone() if span is None else span.clone().as_strided(size, stride, 0)
        made = made.conj() if conj else made
        return made._neg_view() if neg else made

    return clone


def _dtype_view(value: torch.Tensor, i: int, base: torch.Tensor
                ) -> Callable[[list[Any]], torch.Tensor]:
    """An output that views argument ``i`` as another dtype (``x.view(torch.int32)``,
    ``torch.view_as_real``): the same view of the call's argument, at the same byte
    offset, or Uncapturable where the argument cannot be viewed so."""
    dtype, size, stride = value.dtype, value.shape, value.stride()
    try:
        typed = _retyped(base, dtype)
    except RuntimeError:
        raise Uncapturable(EagerReason.OUTPUT, "an output views an argument as another "
                           "dtype in a way that cannot be rebuilt") from None
    offset = value.storage_offset() - typed.storage_offset()  # in elements of dtype
    neg = value.is_neg() != typed.is_neg()  # ``x.conj().imag``: a negative view

    def view(leaves: list[Any]) -> torch.Tensor:
        arg = _retyped(leaves[i], dtype)
        made = arg.as_strided(size, stride, arg.storage_offset() + offset)
        return made._neg_view() if neg else made

    return view


def _retyped(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A view of ``t`` as ``dtype`` (over the same memory): ``t.view(dtype)``, or for a
    complex ``t`` whose last dimension is not contiguous (``z.t()``, ``z[:, ::2]``),
    whose ``real`` and ``imag`` are still views, ``torch.view_as_real(t)``."""
    try:
        return t.view(dtype)
    except RuntimeError:
        if t.is_complex() and not t.is_conj() and t.real.dtype == dtype:
            return torch.view_as_real(t)
        raise


def _filled_by_group(_leaves: list[Any]) -> None:
    return None


def _same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride()
