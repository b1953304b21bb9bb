"""Arguments that are objects holding tensors: caches, dataclasses, plain objects.

``keys.key_call`` keys tensors, scalars and pytree containers itself; an argument it
cannot key by value (a transformers ``StaticCache``, a dataclass that is no pytree node,
any object with attributes) comes here.  Such an object is *passed through*: the
function receives the caller's own object, and a graph reads and writes its tensors
at their own addresses.  So the object is keyed by its structure:

* its type and, recursively, its attributes (``__dict__`` and ``__slots__``), and the
  items of the lists, tuples and dicts it holds;
* Python scalars, strings, dtypes and devices by value;
* each tensor by its metadata and its address (a graph bakes the address in);
* a tensor on the host while the call runs on a device (a CPU counter next to CUDA
  caches) also by its version counter: a kernel that reads it bakes its value in, so a
  write to it makes another key;
* anything else (a function, a class, an object with no attributes) by identity.

Mutations.  In-place writes to the object's device tensors (a KV cache's
``index_copy_``, a device counter's ``add_``) are captured like any other kernel and
replayed.  A call that changes the object's *structure* (rebinds an attribute, changes
a scalar, allocates a tensor on first use, advances a host tensor) is found by keying the
object again after the warmup run: that key runs eagerly, with the changed attributes
in its reason, and the next call, which sees the new structure, has a key of its own.

A keyer may key a Python int by its phase instead (a sliding-window cache's count): the
capture then proves that a graph is right for every value of the phase, and the replay
advances the int as the call does (``counters``).

Known types have a faster keyer (``known_types``: transformers' caches, registered
when ``transformers.cache_utils`` is already imported: autograph never imports it); any
other object is walked (``walk``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from .known_types import keyer_for
from .memo import same_tensors
from .vocab import EagerReason, Uncapturable
from .walk import VALUES, Walked, number_key, walk

# quantized tensors are strided, but no buffer of their kind can be made to copy into
QUANTIZED = frozenset(getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2",
                                                  "quint2x4") if hasattr(torch, n))

_Tensor = torch.Tensor
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_strided = torch.strided
_new = tuple.__new__  # a NamedTuple without its Python-level __new__


class ObjectKey(NamedTuple):
    """The key of one object argument: its type, its structure (a nested tuple of the
    parts listed in the module docstring, with ``None`` for a tensor's slot) and, per
    tensor in walk order, its :class:`ObjectTensor` key."""

    kind: type
    state: tuple[Any, ...]
    tensors: tuple[Any, ...]
    # the hash of the three above, computed once by ``finish`` (0 before, in a part no
    # key holds): a cache's key is a large tuple, and a repeat decode step's key holds
    # this very object (``known_types.Memo``)
    hashed: int = 0

    def __hash__(self) -> int:
        return self.hashed

    @property
    def value(self) -> str:  # as ``ValueKey.value``, for ``GraphKey.describe``
        return f"<{self.kind.__name__} with {len(self.tensors)} tensors>"

    def to_json(self) -> None:
        return None  # holds addresses: plans cannot carry it


class ObjectTensor(NamedTuple):
    """A tensor inside an object argument: metadata, address and (for a host tensor
    next to device work) its version counter."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    ptr: int
    version: int | None


def is_object(x: Any) -> bool:
    """Whether ``x`` is an object this module keys (not a tensor, not a value)."""
    return (not isinstance(x, (_Tensor, *VALUES, enum.Enum, slice, range))
            and number_key(x) is None)


def object_key(x: Any) -> tuple[ObjectKey, Walked]:
    """The structural key of ``x`` without its tensors' device-dependent parts (see
    :func:`finish`), and the walk (its tensors)."""
    walked = Walked(x)
    keyer = keyer_for(type(x))
    if keyer is not None:
        state = keyer(x, walked)
    else:
        counter = [0]
        state = walk(x, walked, type(x).__name__, 0, counter)
    return _new(ObjectKey, (type(x), state, (), 0)), walked  # hashed once finished


def finish(part: ObjectKey, walked: Walked, device: torch.device) -> ObjectKey:
    """Complete ``part`` once the call's device is known: each tensor's key, with the
    version counter of a host tensor when the call runs elsewhere.

    A keyer's record of the object's last keying (``walked.memo``: the same object
    with nothing rebound, see ``known_types.Memo``) gives the key it finished last when
    every tensor's shape, strides, dtype, device and address are as then (one C++
    check, ``memo.same_tensors``; no host tensor next to device work, not under grad
    mode).  Its type is the record's to check
    (``__class__`` can be assigned); its layout cannot change (a strided tensor's
    ``set_``/``.data =`` take strided tensors only)."""
    memo = walked.memo
    grad = torch.is_grad_enabled()
    if memo is not None and not grad:
        done = memo.done
        if (done is not None and done[0] == device and part.state is memo.state
                and done[2](walked.tensors)):
            walked.bases = done[3]
            return done[1]  # type: ignore[no-any-return]
    keys = []
    bases: set[int] = set()
    host = device.type != "cpu"
    versions = False
    for k, t in enumerate(walked.tensors):
        if type(t) not in _PLAIN or t.layout is not _strided or t.dtype in QUANTIZED:
            raise Uncapturable(EagerReason.UNKEYABLE, f"{walked.path(k)}: a {t.layout} or "
                               "quantized tensor or a tensor subclass inside an argument "
                               "object")
        if grad and t.requires_grad:
            # (a training graph takes tensors that require grad as arguments only)
            raise Uncapturable(EagerReason.BACKWARD_UNSUPPORTED,
                               f"{walked.path(k)}, inside an argument object, requires "
                               f"grad{cache_hint(walked.obj)}")
        tdev = t.device
        if tdev == device:
            version = None
        elif host and tdev.type == "cpu":
            version = _host_version(t, walked.path(k))
            versions = True
        else:
            raise Uncapturable(EagerReason.SEVERAL_DEVICES, f"{walked.path(k)} is on {tdev}, "
                               f"the call on {device}")
        ptr = 0
        if t.numel():
            ptr = t.data_ptr()
            bases.add(ptr - int(t.storage_offset()) * t.element_size())
        keys.append(_new(ObjectTensor, (t.shape, t.stride(), t.dtype, tdev, ptr, version)))
    tensors = tuple(keys)
    walked.bases = frozenset(bases)
    finished = _new(ObjectKey, (part.kind, part.state, tensors,
                                hash((part.kind, part.state, tensors))))
    if memo is not None and not grad and not versions and part.state is memo.state:
        memo.done = (device, finished, same_tensors(walked.tensors), walked.bases)
    return finished


def unaddressed(part: ObjectKey) -> ObjectKey:
    """``part`` with every tensor's address left out (see ``GraphKey.unaddressed``)."""
    tensors = tuple(t._replace(ptr=0) for t in part.tensors)
    return _new(ObjectKey, (part.kind, part.state, tensors,
                            hash((part.kind, part.state, tensors))))


GROWING_CACHE = ("; a cache the call appends to (transformers' DynamicCache, made when "
                 "use_cache is left on) is never graphed: pass use_cache=False, or a "
                 "StaticCache")


def cache_hint(value: Any) -> str:
    """A hint for a transformers key-value cache argument the call changes (per-layer
    graphs handed the model's ``DynamicCache``), else ''."""
    kind = type(value)
    return GROWING_CACHE if (kind.__module__.startswith("transformers.")
                             and kind.__name__.endswith("Cache")) else ""


def changes(before: ObjectKey, after: ObjectKey, walked: Walked) -> str | None:
    """What the call changed in an object's structure (None if nothing), for a reason."""
    if before == after:
        return None
    name = before.kind.__name__
    if before.state != after.state:
        diff = _state_diff(before.state, after.state, name)
        return f"the call changes {diff} (a graph replays only device work)"
    for k, (old, new) in enumerate(zip(before.tensors, after.tensors)):
        if old != new:
            what = ("writes host tensor" if old.version is not None and old[:5] == new[:5]
                    else "rebinds")
            return f"the call {what} {walked.path(k)} (a graph replays only device work)"
    return f"the call changes {name}"


def portable_state(state: Any) -> Any:
    """``state`` without identities (equal on every rank for equal structures)."""
    if isinstance(state, tuple):
        if len(state) == 3 and state[0] == "id":
            return ("id", getattr(state[1], "__qualname__", "?"))
        return tuple(portable_state(s) for s in state)
    return state


def _state_diff(a: Any, b: Any, path: str) -> str:
    if (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 4
            and a[0] == b[0] == "attrs" and a[1] == b[1]):
        for name, x, y in zip(a[1], a[2], b[2]):
            if x != y:
                return _state_diff(x, y, f"{path}.{name}")
    if (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 3
            and a[0] == b[0] == "static_cache"):
        for i, (x, y) in enumerate(zip(a[1], b[1])):
            if x == y:
                continue
            where = f"{path}.layers[{i}]"
            if x[0] == "attrs" or x[0] != y[0]:  # walked, or its attribute names changed
                return _state_diff(x, y, where)
            for name, *pair in zip(x[0], x[1], y[1], x[2], y[2]):  # (names, kinds, values)
                if pair[0] is not pair[1] or pair[2] != pair[3]:
                    return f"{where}.{name}"
            return where
        return path
    if (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 3
            and a[0] == b[0] and a[0] in ("seq", "map") and a[1] == b[1]):
        for i, (x, y) in enumerate(zip(a[2], b[2])):
            if x != y:
                return _state_diff(x, y, f"{path}[{i}]")
    return path


# -- mappings that are no dict (BatchEncoding, UserDict) -----------------------------
_opened: dict[type, bool] = {}


def open_mapping(x: Any) -> bool:
    """Make pytree open ``x``'s type if it is a mapping that is no dict and rebuilds
    from its items (``type(x)(dict)``, as ``BatchEncoding`` and ``UserDict`` do): its
    tensors are then arguments like a dict's (copied into static buffers), and the
    function receives a mapping of the same type.  True if the type is now opened."""
    cls = type(x)
    known = _opened.get(cls)
    if known is not None:
        return known
    ok = False
    if isinstance(x, Mapping) and not isinstance(x, dict):
        try:
            again = cls(dict(x.items()))  # type: ignore[call-arg]
            ok = type(again) is cls and list(again.keys()) == list(x.keys())
        except Exception:  # noqa: BLE001 - any failure: keyed as an object instead
            ok = False
    if ok:
        def flatten(m: Any) -> tuple[list[Any], Any]:
            return list(m.values()), list(m.keys())

        def unflatten(values: Any, keys: Any) -> Any:
            return cls(dict(zip(keys, values)))  # type: ignore[call-arg]

        try:
            pytree.register_pytree_node(cls, flatten, unflatten,
                                        serialized_type_name=f"autograph.{cls.__qualname__}")
        except ValueError:  # registered meanwhile
            pass
    _opened[cls] = ok
    return ok


def _host_version(t: torch.Tensor, path: str) -> Any:
    """What tells a host tensor's contents apart between calls: its version counter, or,
    for an inference tensor (which has none), its value when it is a scalar."""
    if not t.is_inference():
        return t._version
    if t.numel() <= 1:
        return ("value", t.item())
    raise Uncapturable(EagerReason.UNKEYABLE, f"{path}: a host inference tensor of "
                       f"{t.numel()} elements (its changes cannot be seen)")
