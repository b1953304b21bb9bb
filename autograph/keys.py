"""The key of a call: everything a captured graph bakes in about its arguments.

Two calls with equal keys may share a graph.  The key holds the pytree structure of the
arguments, each tensor's shape, strides, dtype, device and ``requires_grad``, and every
non-tensor leaf by type and value; the engine adds the global modes (grad, inference,
autocast, float32 matmul precision) and ``module.training``.  Anything that cannot be
keyed safely raises :class:`Uncapturable` with the reason the call must run eagerly.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch.utils import _pytree as pytree

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_strided = torch.strided
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_BY_VALUE = (
    type(None),
    bool,
    int,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    type(Ellipsis),
)


class Uncapturable(Exception):
    """A call that must run eagerly; ``str(exc)`` is the reason counted in stats."""


class Flat:
    """The flattened arguments of one call.

    ``leaves`` are the pytree leaves in order and ``structure`` a hashable description
    of the containers around them; ``rebuild(leaves)`` turns a (possibly substituted)
    leaf list back into ``(args, kwargs)``.
    """

    __slots__ = ("leaves", "structure", "nargs", "kw_names", "spec")

    def __init__(self, leaves: list[Any] | tuple[Any, ...], structure: Any, nargs: int,
                 kw_names: tuple[str, ...], spec: Any) -> None:
        self.leaves = leaves
        self.structure = structure
        self.nargs = nargs
        self.kw_names = kw_names
        self.spec = spec  # a torch TreeSpec, or None for the flat fast path

    @property
    def tensor_pos(self) -> tuple[int, ...]:
        """Indices of the tensor leaves."""
        return tuple(i for i, x in enumerate(self.leaves) if isinstance(x, _Tensor))

    def rebuild(self, leaves: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.spec is None:
            n = self.nargs
            return tuple(leaves[:n]), dict(zip(self.kw_names, leaves[n:]))
        return pytree.tree_unflatten(leaves, self.spec)  # type: ignore[no-any-return]


_FLAT = frozenset({torch.Tensor, torch.nn.Parameter, float, *_BY_VALUE}).__contains__


def flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Flat:
    """Flatten a call's arguments; tensors and scalars not nested in containers take a
    fast path that skips pytree."""
    if not kwargs:
        if all(map(_FLAT, map(type, args))):
            return Flat(args, len(args), len(args), (), None)
    elif all(map(_FLAT, map(type, args))) and all(map(_FLAT, map(type, kwargs.values()))):
        names = tuple(kwargs)
        return Flat((*args, *kwargs.values()), (len(args), names), len(args), names, None)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return Flat(leaves, _spec_key(spec), len(args), (), spec)


def _spec_key(spec: Any) -> Any:
    """A hashable stand-in for a TreeSpec (its type, context and children)."""
    if spec.is_leaf():
        return None
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    return (spec.type, _hashable(spec.context), tuple(_spec_key(c) for c in children))


def _hashable(context: Any) -> Any:
    if isinstance(context, list):
        return tuple(_hashable(c) for c in context)
    try:
        hash(context)
    except TypeError:
        return repr(context)
    return context


def leaf_key(x: Any) -> Any:
    """The key of one non-tensor leaf; raises :class:`Uncapturable` for what cannot be
    keyed."""
    if type(x) is float:
        return (float, x.hex())  # tells -0.0 from 0.0 and keys NaN stably
    if isinstance(x, _BY_VALUE) or isinstance(x, enum.Enum):
        return (type(x), x)
    if isinstance(x, _Tensor):
        raise Uncapturable(_tensor_reason(x))
    raise Uncapturable(
        f"argument of type {type(x).__qualname__} cannot be keyed "
        "(only tensors, numbers, strings, None, dtypes and devices are)"
    )


def _tensor_reason(x: torch.Tensor) -> str:
    if type(x) not in _PLAIN_TENSORS:
        return f"tensor subclass {type(x).__name__} argument"
    if x.is_nested:
        return "nested tensor argument"
    return f"{x.layout} tensor argument"


def key_call(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Flat, tuple[Any, ...], torch.device | None]:
    """Flatten a call and key its leaves: ``(flat, leaf keys, the tensors' one device)``.

    A tensor is keyed by shape, strides, dtype, device and ``requires_grad``.
    """
    if not kwargs and all(map(_FLAT, map(type, args))):
        flat = Flat(args, len(args), len(args), (), None)
    else:
        flat = flatten(args, kwargs)
    parts = []
    device = None
    for x in flat.leaves:
        tx = type(x)
        if tx is _Tensor or tx is _Parameter:
            if x.layout is not _strided:
                raise Uncapturable(_tensor_reason(x))
            try:
                part = (x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
            except (RuntimeError, NotImplementedError):  # nested tensors have no strides
                raise Uncapturable(_tensor_reason(x)) from None
            if device is None:
                device = part[3]
            elif part[3] != device:
                raise Uncapturable("tensor arguments on several devices")
            parts.append(part)
        else:
            parts.append(leaf_key(x))
    return flat, tuple(parts), device


_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
          torch.float64: "f64", torch.int64: "i64", torch.int32: "i32", torch.bool: "bool"}


def describe(key: Any) -> str:
    """A graph key in a few words, for logs: each tensor argument as dtype[shape] and
    other arguments by value, e.g. ``(f16[8, 1], i64[1], 3)``."""
    if len(key) == 2:
        key = key[0]  # drop the addresses of arguments written in place
    items = []
    for part in key[1]:
        if len(part) == 5 and isinstance(part[0], torch.Size):
            dtype = _SHORT.get(part[2], str(part[2]).replace("torch.", ""))
            items.append(f"{dtype}{list(part[0])}")
        elif part[0] is float:
            items.append(repr(float.fromhex(part[1])))
        else:
            items.append(repr(part[1]))
    return "(" + ", ".join(items) + ")"
