"""The key of a call: everything a captured graph bakes in about its arguments.

Two calls with equal :class:`GraphKey` may share a graph.  The key holds the pytree
structure of the arguments; per leaf a :class:`TensorKey` (shape, strides, dtype,
device, ``requires_grad``) or a :class:`ValueKey` (type and value); the aliasing
pattern of the tensor arguments (which are the same object, which share storage);
the global modes (``modes.Modes``); ``module.training``; and, for arguments written in
place, their addresses.  :func:`key_call` is the one function that computes it; a call
of plain positional tensors and scalars skips pytree but takes the same per-leaf path.
Anything that cannot be keyed safely raises :class:`Uncapturable` with its reason.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from . import containers
from .flat import BY_VALUE, FLAT, Flat, size_leaf, spec_key, unopened
from .memo import KeyMemo
from .modes import USER_MODE
from .objects import (
    QUANTIZED,
    ObjectKey,
    Walked,
    finish,
    is_object,
    object_key,
    open_mapping,
    portable_state,
    unaddressed,
)
from .vocab import EagerReason, Uncapturable
from .walk import float_bits, number_key

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_strided = torch.strided
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_new = tuple.__new__
_PLAIN_BITS = (False, False)


class TensorKey(NamedTuple):
    """What a graph bakes in about one tensor argument."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    # conjugate and negative bits (``z.conj()``, ``z.conj().imag``): the same memory
    # read otherwise, so another graph (a conjugate argument is copied resolved)
    bits: tuple[bool, bool] = (False, False)

    def to_json(self) -> dict[str, Any]:
        out = {"shape": list(self.shape), "stride": list(self.stride),
               "dtype": str(self.dtype), "device": str(self.device),
               "requires_grad": self.requires_grad}
        if self.bits != _PLAIN_BITS:
            out["conj_neg"] = list(self.bits)
        return {"tensor": out}


class ValueKey(NamedTuple):
    """A non-tensor argument, by type and value (floats by their hex spelling)."""

    kind: type
    value: Any

    def to_json(self) -> dict[str, Any] | None:
        if self.kind in (float, bool, int, str, type(None)):
            return {self.kind.__name__: self.value}
        if self.kind in (torch.dtype, torch.device):
            return {self.kind.__name__: str(self.value)}
        if self.kind is torch.Size:
            return {"Size": list(self.value)}
        return None


LeafKey = Any  # a TensorKey or a ValueKey


class GraphKey(NamedTuple):
    """Everything one graph bakes in.  ``written`` holds the addresses of the
    arguments captured in place (empty until the call is known to write any)."""

    structure: Any
    leaves: tuple[LeafKey, ...]
    aliases: tuple[Any, ...]
    modes: tuple[Any, ...]
    training: bool | None
    written: tuple[Any, ...] = ()  # addresses (with conjugate and negative bits)

    def base(self) -> GraphKey:
        """The key without the addresses of arguments written in place."""
        return self._replace(written=()) if self.written else self

    def unaddressed(self) -> GraphKey:
        """The key without addresses: those of arguments written in place and of the
        tensors inside object arguments.  A call passing a new object of the same
        structure (the cache of the next ``generate()``, allocated elsewhere) has
        another key but this one (``GraphCache.shapes``)."""
        leaves = tuple(unaddressed(p) if type(p) is ObjectKey else p for p in self.leaves)
        return self._replace(leaves=leaves, written=())

    def digest(self) -> int:
        """A digest equal on every rank for equal calls: device indexes and addresses
        left out (each rank has its own GPU and allocator)."""
        portable = (self.structure, self.leaves, self.aliases, self.modes, self.training)
        text = repr(_portable(portable)).encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 2

    def to_json(self) -> dict[str, Any] | None:
        """The key as JSON for plans, or None when it cannot be written (containers
        other than plain positional and keyword arguments, aliased arguments, enums)."""
        nargs, names = _plain_structure(self.structure)
        if nargs is None or any(self.aliases):
            return None
        leaves = [leaf.to_json() for leaf in self.leaves]
        if any(leaf is None for leaf in leaves):
            return None
        return {"nargs": nargs, "kwargs": list(names), "leaves": leaves,
                "modes": [_json_value(m) for m in self.modes], "training": self.training}

    def describe(self) -> str:
        """The key in a few words, for logs: tensors as dtype[shape], other arguments
        by value, e.g. ``(f16[8, 1], i64[1], 3)``."""
        items = []
        for leaf in self.leaves:
            if type(leaf) is TensorKey:
                dtype = _SHORT.get(leaf.dtype, str(leaf.dtype).replace("torch.", ""))
                items.append(f"{dtype}{list(leaf.shape)}")
            elif leaf.kind is float:
                nan = leaf.value.startswith("nan")
                items.append("nan" if nan else repr(float.fromhex(leaf.value)))
            else:
                items.append(repr(leaf.value))
        return "(" + ", ".join(items) + ")"



def _checked(modes: tuple[Any, ...]) -> tuple[Any, ...]:
    """``modes``, or :class:`Uncapturable` where a user's function mode is active
    (the last part: ``modes.function_modes``)."""
    if modes[-1] and USER_MODE in modes[-1]:
        raise Uncapturable(EagerReason.UNKEYABLE, USER_MODE)
    return modes


def key_call(args: tuple[Any, ...], kwargs: dict[str, Any], modes: Any, training: Any,
             memo: KeyMemo | None = None) -> tuple[GraphKey, Flat, torch.device]:
    """Key a call: ``(key, flat arguments, the tensors' one device)``.

    ``modes(device)`` returns the global modes for the tensors' device.  With ``memo``,
    a call of positional tensors whose leaf keys it remembers skips reading them (the
    same key; see ``memo.py``).  Raises :class:`Uncapturable` for calls that cannot be
    graphed.
    """
    if memo is not None and not kwargs and memo.recent:
        known = memo.find(args)
        if known is not None:
            aliases = _aliases(args, known.tensor_pos) if known.n > 1 else ()
            key = _new(GraphKey, (known.n, known.parts, aliases,
                                  _checked(modes(known.device)), training(), ()))
            return key, Flat(args, known.n, (), None, known.tensor_pos), known.device
    if not kwargs and all(map(FLAT, map(type, args))):
        leaves: Any = args
        structure: Any = len(args)
        names: tuple[str, ...] = ()
        spec = None
    elif all(map(unopened, map(type, args))) and all(map(unopened, map(type, kwargs.values()))):
        names = tuple(kwargs)
        leaves, structure, spec = (*args, *kwargs.values()), (len(args), names), None
    else:
        leaves, spec = pytree.tree_flatten((args, kwargs), is_leaf=size_leaf)
        structure, names = spec_key(spec), ()
    try:
        parts, tensor_pos, device, objs = _leaf_keys(leaves)
    except _Reopen:  # a mapping type pytree opens from now on: flatten again
        leaves, spec = pytree.tree_flatten((args, kwargs), is_leaf=size_leaf)
        structure, names = spec_key(spec), ()
        parts, tensor_pos, device, objs = _leaf_keys(leaves)
    if objs:
        parts, device = _finish_objects(parts, objs, device)
    if device is None:
        raise Uncapturable(EagerReason.NO_TENSORS)
    aliases = _aliases(leaves, tensor_pos) if len(tensor_pos) > 1 else ()
    if memo is not None and type(structure) is int and len(tensor_pos) == structure:
        memo.learn(args, parts, device)  # plain positional tensors only
    flat = Flat(leaves, len(args), names, spec, tensor_pos)
    if spec is not None:
        if containers.shared(args, kwargs):
            raise Uncapturable(EagerReason.UNKEYABLE, "one dict or list passed more than once")
        flat.original = (args, kwargs)
    key = _new(GraphKey, (structure, parts, aliases, _checked(modes(device)), training(), ()))
    if objs:
        flat.objects = tuple((i, walked, parts[i], device) for i, walked in objs)
        if tensor_pos:
            key = with_sharing(key, flat, flat.object_storages())
    return key, flat, device


class Sharing(NamedTuple):
    """Last in ``GraphKey.aliases``: the tensor arguments that share storage with a
    tensor the call may write without writing the argument itself (a tensor inside an
    object argument, ``f(cache.k, cache)``; a parameter, buffer or named tensor that a
    graph of the callable writes), with their addresses.  Eager mode reads such an
    argument after the write; a private copy made before the replay would not, so they
    are captured at their own address (``GraphCache.in_place``)."""

    positions: tuple[int, ...]
    ptrs: tuple[int, ...]


def with_sharing(key: GraphKey, flat: Flat, bases: frozenset[int]) -> GraphKey:
    """``key`` with the tensor arguments sharing a storage in ``bases`` (storage
    addresses) in its :class:`Sharing` (merged with one it has)."""
    found = flat.sharers(bases)
    if not found:
        return key
    aliases = key.aliases
    if aliases and type(aliases[-1]) is Sharing:
        found = tuple(sorted({*aliases[-1].positions, *found}))
        aliases = aliases[:-1]
    leaves = flat.leaves
    mark = Sharing(found, tuple(leaves[i].data_ptr() for i in found))
    return key._replace(aliases=(*aliases, mark))


def sharing(key: GraphKey) -> tuple[int, ...]:
    """The argument positions of ``key``'s :class:`Sharing`, if it has one."""
    aliases = key.aliases
    return aliases[-1].positions if aliases and type(aliases[-1]) is Sharing else ()


class _Reopen(Exception):
    """A leaf's mapping type is now a pytree node: the arguments are flattened again."""


def _finish_objects(parts: tuple[Any, ...], objs: list[tuple[int, Walked]], device: Any
                    ) -> tuple[tuple[Any, ...], Any]:
    """Complete the object parts once the call's device is known (the tensor
    arguments', else the first device tensor inside an object)."""
    if device is None:
        found = [t.device for _, w in objs for t in w.tensors if t.device.type != "cpu"]
        found = found or [t.device for _, w in objs for t in w.tensors]
        device = found[0] if found else None
        if device is None:
            return parts, None
    out = list(parts)
    for i, walked in objs:
        out[i] = finish(out[i], walked, device)
    return tuple(out), device


def _leaf_keys(leaves: Any) -> tuple[tuple[Any, ...], tuple[int, ...], Any, Any]:
    parts: list[Any] = []
    tensor_pos = []
    device = None
    objs: list[tuple[int, Walked]] | None = None
    for i, x in enumerate(leaves):
        tx = type(x)
        if tx is _Tensor or tx is _Parameter:
            if x.layout is not _strided:
                raise Uncapturable(EagerReason.UNKEYABLE, _tensor_kind(x))
            try:
                shape, stride = x.shape, x.stride()
                if 1 in shape and len(shape) < 4 and x.is_contiguous():
                    stride = outer_unit_strides(shape, stride)
                part = _new(TensorKey, (shape, stride, x.dtype, x.device, x.requires_grad,
                                        (x.is_conj(), x.is_neg())))
            except (RuntimeError, NotImplementedError):  # nested tensors have no strides
                raise Uncapturable(EagerReason.UNKEYABLE, _tensor_kind(x)) from None
            if part[2] in QUANTIZED:
                raise Uncapturable(EagerReason.UNKEYABLE, _tensor_kind(x))
            if device is None:
                device = part[3]
            elif part[3] != device:
                raise Uncapturable(EagerReason.SEVERAL_DEVICES)
            parts.append(part)
            tensor_pos.append(i)
        elif FLAT(tx) or not is_object(x):  # a value (or unkeyable: leaf_key says why)
            parts.append(leaf_key(x))
        else:  # what leaf_key refuses and is no tensor (no exception on every call)
            if open_mapping(x):
                raise _Reopen()
            opart, walked = object_key(x)  # an object holding tensors (objects.py)
            parts.append(opart)
            if objs is None:
                objs = []
            objs.append((i, walked))
    return tuple(parts), tuple(tensor_pos), device, objs


def outer_unit_strides(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor as keyed: a leading size-1 dimension's stride
    (before any other dimension), which no element's address depends on, as the
    contiguous one where it is at least that (the last token of a growing sequence,
    ``ids[:, -1:]`` with stride ``(L, 1)``, ``h[:, -1:]`` of a batch of one, keys alike
    at every length); every other stride as it is: a smaller one, or one of a size-1
    dimension after another, decides layouts inside the call once permuted
    (``suggest_memory_format``, a pool's output; checked by brute force over
    permutes, unsqueezes, pools, convs and copies).  Below 4 dimensions only.  The
    key memo checks exact strides, so such a tensor takes the full key path."""
    out = list(stride)
    lead = 0
    while lead < len(shape) and shape[lead] == 1:
        lead += 1
    inner = 1
    for n in shape[lead:]:
        inner *= n
    for i in range(lead):
        if stride[i] >= inner:
            out[i] = inner
    return tuple(out)


def _aliases(leaves: Any, tensor_pos: tuple[int, ...]) -> tuple[Any, ...]:
    """Per tensor leaf, which earlier tensor leaf it *is* or shares storage with:
    ``()`` when none do (the common case), else one entry per tensor leaf, None or
    ``(j, same_object)``.  Graphs see aliasing (``mha(x, x, x)`` takes another path)
    and static buffers keep it, so it is part of the key (with, last, the
    :class:`Sharing` of a call whose arguments share memory the call may write)."""
    seen: dict[int, int] = {}
    out: list[Any] = []
    shared = False
    for i in tensor_pos:
        x = leaves[i]
        if not x.numel():
            out.append(None)
            continue
        base = x.data_ptr() - x.storage_offset() * x.element_size()
        j = seen.get(base)
        if j is None:
            seen[base] = i
            out.append(None)
        else:
            shared = True
            out.append((j, x is leaves[j]))
    return tuple(out) if shared else ()


def leaf_key(x: Any) -> ValueKey:
    """The key of one non-tensor leaf; raises :class:`Uncapturable` for what cannot be
    keyed."""
    if type(x) is float:
        return _new(ValueKey, (float, float_bits(x)))  # by its bits
    if isinstance(x, BY_VALUE) or isinstance(x, enum.Enum):
        return _new(ValueKey, (type(x), x))
    number = number_key(x)  # a complex, a NumPy scalar
    if number is not None:
        return _new(ValueKey, (type(x), number))
    if isinstance(x, float):  # a subclass of float's (as one of int's): by type and bits
        return _new(ValueKey, (type(x), float_bits(x)))
    if type(x) is range or type(x) is slice:  # by their parts (slices hash from 3.12 on)
        return _new(ValueKey, (type(x), tuple(leaf_key(v) for v in (x.start, x.stop, x.step))))
    if isinstance(x, _Tensor):
        raise Uncapturable(EagerReason.UNKEYABLE, _tensor_kind(x))
    raise Uncapturable(EagerReason.UNKEYABLE, f"argument of type {type(x).__qualname__} "
                       "(only tensors, numbers, NumPy scalars, strings, None, dtypes, "
                       "devices, slices and ranges are keyed)")


def _tensor_kind(x: torch.Tensor) -> str:
    if type(x) not in _PLAIN_TENSORS:
        return f"tensor subclass {type(x).__name__} argument"
    if x.is_nested:
        return "nested tensor argument"
    if x.is_quantized:
        return "quantized tensor argument"
    return f"{x.layout} tensor argument"


def _plain_structure(structure: Any) -> tuple[int | None, tuple[str, ...]]:
    if isinstance(structure, int):
        return structure, ()
    if (isinstance(structure, tuple) and len(structure) == 2
            and isinstance(structure[0], int) and isinstance(structure[1], tuple)):
        return structure[0], structure[1]
    return None, ()


def _portable(part: Any) -> Any:
    if type(part) is Sharing:  # the addresses are this rank's own
        return ("sharing", part.positions)
    if isinstance(part, ObjectKey):  # its structure, without addresses
        return ("object", part.kind.__qualname__, _portable(portable_state(part.state)),
                tuple((tuple(t.shape), str(t.dtype), t.device.type) for t in part.tensors))
    if isinstance(part, torch.device):
        return part.type
    if isinstance(part, (torch.dtype, torch.layout, torch.memory_format)):
        return str(part)
    if isinstance(part, type):
        return part.__qualname__
    if isinstance(part, tuple):
        return tuple(_portable(p) for p in part)
    return part


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    return str(value)


_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
          torch.float64: "f64", torch.int64: "i64", torch.int32: "i32", torch.bool: "bool"}
