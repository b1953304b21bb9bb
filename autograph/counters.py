"""Host counters: Python ints inside an object argument that each call advances.

transformers' sliding-window cache layers keep the number of tokens seen as a Python int
(``cumulative_length_int``) next to their device tensors; ``update()`` branches on it
(filling the window or rolling it) and ``get_seq_length()`` returns it, from which the
model computes its positions.  Keyed by value, every decode step would be a new key.

A keyer (``known_types``) keys such an int by its *phase*, an interval of values
(``Walked.counters`` lists them), and a graph is shared by every value in that interval
when a capture proves it may be:

* the capture runs the Python with a :class:`HostCounter` in the int's place, which
  behaves like the int and records what the call does with it: comparisons (each must
  have the same outcome for every value of the phase, checked at the interval's ends:
  the counter only ever appears as ``value + constant``), additions of constants, and
  additions to int64 tensors, which the graph then reads from a device scalar filled
  before each replay instead of baking the value in;
* whatever else reads its value (``int()``, ``__index__``, a hash, an output holding
  it, another arithmetic) makes the key eager, naming the attribute;
* the int the call leaves must be the counter plus a constant: the replay applies that
  effect (:class:`Effects`) after the graph ran, so the object is left as eager leaves it.

Warmup runs are eager with plain ints: :func:`hold` only puts the values back around
the structural check (``lifecycle``) so that the advance alone is no structural change.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .constants import constants
from .vocab import EagerReason, Uncapturable

_CMP: dict[str, Callable[[int, int], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
    "==": operator.eq, "!=": operator.ne,
}
_REFLECT = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


class Counter:
    """A Python int attribute of an object argument keyed by its phase: where it sits
    (``steps`` from the argument to the holder, then ``attr``) and the phase's values,
    ``lo`` to ``hi`` (None: unbounded)."""

    __slots__ = ("steps", "attr", "lo", "hi", "label")

    def __init__(self, steps: tuple[Any, ...], attr: str, lo: int, hi: int | None,
                 label: str) -> None:
        self.steps, self.attr, self.lo, self.hi, self.label = steps, attr, lo, hi, label

    def holder(self, root: Any) -> Any:
        for step in self.steps:
            root = root[step] if type(step) is int else getattr(root, step)
        return root


def holds(x: Any) -> bool:
    """Whether ``x`` (an output leaf) is a :class:`HostCounter`."""
    return type(x) is HostCounter


class _Use:
    """What one capture saw a counter do."""

    __slots__ = ("counter", "value", "compared", "buffer", "used", "problem")

    def __init__(self, counter: Counter, value: int, device: torch.device) -> None:
        self.counter, self.value = counter, value
        self.compared: list[tuple[int, str, int]] = []  # (offset, op, other)
        # the value on the device, for the tensors the call adds it to (filled here:
        # nothing is allocated or filled inside the capture)
        self.buffer = torch.full((), value, dtype=torch.int64, device=device)
        self.used = False
        self.problem: str | None = None

    def leak(self, what: str) -> None:
        if self.problem is None:
            self.problem = (f"{self.counter.label}: the call {what} (a graph would bake "
                            "its value in)")

    def constant(self) -> str | None:
        """The first comparison whose outcome varies over the phase, as text."""
        lo, hi = self.counter.lo, self.counter.hi
        for off, op, other in self.compared:
            f = _CMP[op]
            at = other - off  # the value where the outcome may change
            if op in ("==", "!="):
                same = lo == hi or not (lo <= at and (hi is None or at <= hi))
            else:
                top = hi if hi is not None else max(lo, at + 1)
                same = f(lo + off, other) == f(top + off, other)
            if not same:
                span = f"{lo}..{hi if hi is not None else ''}"
                return (f"{self.counter.label}: the call compares it ({op} {at}) with an outcome "
                        f"that varies within its phase ({span})")
        return None


class HostCounter:
    """A counter's value plus a constant, standing in for the int during a capture."""

    __slots__ = ("_use", "_off")

    def __init__(self, use: _Use, off: int) -> None:
        self._use, self._off = use, off

    def _value(self) -> int:
        return self._use.value + self._off

    def _plain(self, what: str) -> int:
        self._use.leak(what)
        return self._value()

    def __add__(self, other: Any) -> Any:
        if type(other) is int:
            return HostCounter(self._use, self._off + other)
        if isinstance(other, torch.Tensor):
            return self._tensor(other, "adds it to")
        return self._plain("adds it to a non-int") + other

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        if type(other) is int:
            return HostCounter(self._use, self._off - other)
        if type(other) is HostCounter and other._use is self._use:
            return self._off - other._off
        return self._plain("subtracts from it") - other

    def __rsub__(self, other: Any) -> Any:
        if isinstance(other, torch.Tensor):
            out = self._tensor(-other, "subtracts it from")
            return -out
        return other - self._plain("subtracts it from a value")

    def _tensor(self, t: torch.Tensor, what: str) -> torch.Tensor:
        use = self._use
        if t.dtype is not torch.int64 or t.device != use.buffer.device:
            return t + self._plain(f"{what} a {t.dtype} tensor on {t.device}")
        use.used = True
        return t + (use.buffer + self._off if self._off else use.buffer)

    def _compare(self, op: str, other: Any) -> bool:
        if type(other) is HostCounter and other._use is self._use:
            return bool(_CMP[op](self._off, other._off))
        if type(other) is not int:
            return bool(_CMP[op](self._plain(f"compares it with a {type(other).__name__}"),
                                 other))
        self._use.compared.append((self._off, op, other))
        return _CMP[op](self._value(), other)

    def __lt__(self, o: Any) -> bool:
        return self._compare("<", o)

    def __le__(self, o: Any) -> bool:
        return self._compare("<=", o)

    def __gt__(self, o: Any) -> bool:
        return self._compare(">", o)

    def __ge__(self, o: Any) -> bool:
        return self._compare(">=", o)

    def __eq__(self, o: object) -> bool:
        return self._compare("==", o)

    def __ne__(self, o: object) -> bool:
        return self._compare("!=", o)

    def __bool__(self) -> bool:
        return self._compare("!=", 0)

    def __hash__(self) -> int:
        return hash(self._plain("hashes it"))

    def __index__(self) -> int:
        return self._plain("uses it as an index or a size")

    def __int__(self) -> int:
        return self._plain("converts it to int")

    def __float__(self) -> float:
        return float(self._plain("converts it to float"))

    def __repr__(self) -> str:
        return repr(self._plain("formats it"))

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return format(self._plain("formats it"), spec)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # probes (``__torch_function__``): an int has none
            raise AttributeError(name)
        return getattr(self._plain(f"reads its attribute {name}"), name)


def _leaking(name: str) -> Callable[..., Any]:
    """An int operator on the counter's value, marking the value as read."""
    def op(self: HostCounter, *args: Any) -> Any:
        return getattr(self._plain(f"applies {name} to it"), name)(*args)
    op.__name__ = name
    return op


for _name in ("__mul__", "__rmul__", "__floordiv__", "__rfloordiv__", "__truediv__",
              "__rtruediv__", "__mod__", "__rmod__", "__neg__", "__pos__", "__abs__",
              "__pow__", "__rpow__", "__and__", "__or__", "__xor__", "__lshift__",
              "__rshift__", "__invert__", "__divmod__", "__round__", "__trunc__"):
    setattr(HostCounter, _name, _leaking(_name))

class Effects:
    """What a replay does to an object argument's counters: fill the device scalars the
    graph reads, then, once it has replayed, advance each counter as the call does."""

    __slots__ = ("items", "keep")

    def __init__(self, items: list[tuple[int, Counter, int, torch.Tensor | None]],
                 keep: list[torch.Tensor]) -> None:
        self.items = items  # (argument position, counter, delta, device scalar or None)
        self.keep = keep  # host constants the graph copies from (constants)

    def wrap(self, run: Callable[[Any], Any], held: Any, order: Callable[[], None]
             ) -> Callable[[Any], Any]:
        """``run`` with the effects around it; ``order()`` first makes the current stream
        wait for the graph's last replay on another (which may still read a scalar).
        Calls of one key share one object (its tensors' addresses are in the key), and
        the object is not safe to advance from two threads at once, eager or not."""
        items = self.items

        def run_with_counters(leaves: Any) -> Any:
            order()
            todo = []
            for pos, counter, delta, buffer in items:
                holder = counter.holder(leaves[pos])
                value = getattr(holder, counter.attr)
                if buffer is not None:
                    buffer.fill_(value)
                todo.append((holder, counter.attr, value + delta))
            out = run(leaves)
            if out is not held:  # not replayed: the engine runs the call eagerly
                for holder, attr, value in todo:
                    setattr(holder, attr, value)
            return out

        return run_with_counters


class Held:
    """The counters of one call's object arguments (see :func:`hold`)."""

    __slots__ = ("found", "before", "after", "uses", "keep")

    def __init__(self, found: list[tuple[int, Any, Counter]]) -> None:
        self.found = found  # (argument position, holder, counter)
        self.before = [getattr(h, c.attr) for _, h, c in found]
        self.after: list[Any] = []
        self.uses: list[_Use] = []
        self.keep: list[torch.Tensor] = []  # the constants a capture made (constants)

    def constants(self, recorder: Any) -> Any:
        """:class:`constants` while a recorder with ``known`` storages is active."""
        known = getattr(recorder, "known", None)
        return _NOTHING_TO_DO if known is None else constants(known, self.keep)

    # -- warmup: plain ints, put back around the structural check ---------------------
    def rewind(self) -> None:
        """After the call: keep what it left, and put the values it started from back."""
        self.after = [getattr(h, c.attr) for _, h, c in self.found]
        for (_, h, c), v in zip(self.found, self.before):
            setattr(h, c.attr, v)

    def settle(self) -> None:
        """Leave the counters as the call left them."""
        for (_, h, c), v in zip(self.found, self.after):
            setattr(h, c.attr, v)

    # -- capture: stand-ins, then the effects -----------------------------------------
    def prepare(self, device: torch.device) -> set[int]:
        """Before a capture: a device scalar per counter (storage addresses returned: the
        graph reads them as it reads its arguments)."""
        self.uses = [_Use(c, v, device) for (_, _, c), v in zip(self.found, self.before)]
        return {u.buffer.untyped_storage().data_ptr() for u in self.uses}

    def stand_in(self) -> None:
        """The capture's stand-ins in place of the ints (:meth:`rewind` puts them back)."""
        for (_, h, c), use in zip(self.found, self.uses):
            setattr(h, c.attr, HostCounter(use, 0))

    def effects(self, out: Any) -> Effects:
        """After the capture (the values it started from put back): the replay's
        effects, or :class:`Uncapturable` naming what the graph would get wrong."""
        items = []
        if any(map(holds, pytree.tree_leaves(out))):
            raise Uncapturable(EagerReason.ASSIGNS, "the call returns a host counter of an "
                               "argument object (a graph would bake its value in)")
        for (pos, _, c), use, left in zip(self.found, self.uses, self.after):
            problem = use.problem or use.constant()
            if problem is None and not (type(left) is HostCounter and left._use is use):
                problem = f"{c.label}: the call sets it to a value not derived from it"
            if problem is not None:
                raise Uncapturable(EagerReason.ASSIGNS, problem)
            items.append((pos, c, left._off, use.buffer if use.used else None))
        return Effects(items, self.keep)


class _Nothing:
    """:func:`hold` for a call without counters: every step does nothing."""

    found: list[Any] = []

    def rewind(self) -> None: ...
    def settle(self) -> None: ...
    def stand_in(self) -> None: ...

    def prepare(self, device: torch.device) -> set[int]:
        return set()

    def constants(self, recorder: Any) -> Any:
        return _NOTHING_TO_DO

    def effects(self, out: Any) -> None:
        return None


NOTHING: Any = _Nothing()
_NOTHING_TO_DO = contextlib.nullcontext()


def hold(flat: Any) -> Any:
    """The counters of the object arguments of ``flat`` (a :class:`Held`), or
    :data:`NOTHING` when there are none (every call without object arguments)."""
    if not flat.objects:
        return NOTHING
    found: list[tuple[int, Any, Counter]] = []
    for pos, walked, _key, _device in flat.objects:
        if walked.counters:
            root = flat.leaves[pos]
            found.extend((pos, c.holder(root), c) for c in walked.counters)
    return Held(found) if found else NOTHING

