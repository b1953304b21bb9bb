"""The key of a call: everything a captured graph bakes in about its inputs.

Two calls with equal keys may share a graph.  The key holds the pytree structure of the
arguments, each tensor's shape, strides, dtype, device and ``requires_grad``, every
non-tensor leaf by type and value, and the global modes that change which kernels run
(grad mode, inference mode, autocast, float32 matmul precision).  Anything that cannot
be keyed safely raises :class:`Uncapturable` with the reason the call must run eagerly.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

_Tensor = torch.Tensor
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


@dataclass(frozen=True)
class Flat:
    """The flattened arguments of one call.

    ``leaves`` are the pytree leaves in order, ``tensor_pos`` the indices of the tensor
    leaves, and ``rebuild(leaves)`` turns a (possibly substituted) leaf list back into
    ``(args, kwargs)``.
    """

    leaves: list[Any]
    tensor_pos: tuple[int, ...]
    structure: Any
    nargs: int
    kw_names: tuple[str, ...]
    spec: Any  # a torch TreeSpec, or None for the flat fast path

    def rebuild(self, leaves: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.spec is None:
            n = self.nargs
            return tuple(leaves[:n]), dict(zip(self.kw_names, leaves[n:]))
        return pytree.tree_unflatten(leaves, self.spec)


def _is_flat_leaf(x: Any) -> bool:
    return isinstance(x, _Tensor) or isinstance(x, _BY_VALUE) or type(x) is float


def flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Flat:
    """Flatten a call's arguments; tuples of tensors and scalars take a fast path."""
    if all(map(_is_flat_leaf, args)) and all(map(_is_flat_leaf, kwargs.values())):
        names = tuple(kwargs)
        leaves = [*args, *kwargs.values()]
        structure: Any = (len(args), names)
        spec = None
    else:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        names = ()
        structure = _spec_key(spec)
    pos = tuple(i for i, x in enumerate(leaves) if isinstance(x, _Tensor))
    return Flat(leaves, pos, structure, len(args), names, spec)


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
    """The key of one leaf; raises :class:`Uncapturable` for what cannot be keyed."""
    if isinstance(x, _Tensor):
        if type(x) not in _PLAIN_TENSORS:
            raise Uncapturable(f"tensor subclass {type(x).__name__} argument")
        if x.layout is not torch.strided:
            raise Uncapturable(f"{x.layout} tensor argument")
        return (x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
    if type(x) is float:
        return (float, x.hex())  # tells -0.0 from 0.0 and keys NaN stably
    if isinstance(x, _BY_VALUE) or isinstance(x, enum.Enum):
        return (type(x), x)
    raise Uncapturable(
        f"argument of type {type(x).__qualname__} cannot be keyed "
        "(only tensors, numbers, strings, None, dtypes and devices are)"
    )


def call_device(flat: Flat) -> torch.device | None:
    """The one device of the tensor arguments (None without tensors)."""
    leaves = flat.leaves
    pos = flat.tensor_pos
    if not pos:
        return None
    device = leaves[pos[0]].device
    for i in pos[1:]:
        if leaves[i].device != device:
            raise Uncapturable("tensor arguments on several devices")
    return device


def mode_key(device_type: str) -> tuple[Any, ...]:
    """Global modes that decide which kernels a call runs."""
    autocast = torch.is_autocast_enabled(device_type)
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        autocast and torch.get_autocast_dtype(device_type),
        torch.get_float32_matmul_precision(),
    )


def make_key(flat: Flat, extra: Any) -> tuple[Any, ...]:
    """The full key of a call: structure, leaves, modes, and the caller's ``extra``."""
    return (flat.structure, tuple(map(leaf_key, flat.leaves)), extra)
