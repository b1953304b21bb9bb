"""Whole training steps: a graphed call that runs its own backward and optimizer step.

``graphed(train_step)`` where ``train_step`` zeroes the gradients, runs forward and
``loss.backward()`` and steps an optimizer, returning tensors that do not require grad,
is captured as one graph (torch's "whole network capture"): autograd's work begins and
ends inside the call, so no backward graph is needed.  The graph bakes in what the
optimizer's Python reads, its hyper-parameters above all (``lr``, betas, weight decay):
a learning-rate schedule that assigns a new ``lr`` would be ignored by the replays.
:class:`Stepped` finds the optimizers a capture steps (torch's global step pre-hook,
this thread only) and :class:`StepGuard` checks, on every call, that their
hyper-parameters, parameter groups and state are the ones captured, and that each
parameter's ``.grad`` is the tensor it was after the capture (a gradient made in the
capture lives in the graph's pool); otherwise the graphs go (``Watch.ok``).  An ``lr``
that is a tensor updated in place (``capturable=True`` optimizers accept one) is read
by the graph and keeps it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.optim.lr_scheduler as _schedulers
import torch.optim.optimizer as _optimizer

_register = getattr(_optimizer, "register_optimizer_step_pre_hook", None)
_SCHEDULERS = tuple(t for t in (getattr(_schedulers, "LRScheduler", None),
                                getattr(_schedulers, "_LRScheduler", None),
                                getattr(_schedulers, "ReduceLROnPlateau", None)) if t is not None)
_SCALERS = tuple(t for t in (getattr(getattr(torch, "amp", None), "GradScaler", None),
                             getattr(torch.cuda.amp, "GradScaler", None)) if t is not None)


class Stepped:
    """While open, collects the optimizers whose ``step()`` runs in this thread."""

    __slots__ = ("optimizers", "_thread", "_handle", "_kept")

    def __init__(self, kept: Kept | None = None) -> None:
        self.optimizers: list[torch.optim.Optimizer] = []
        self._thread = threading.get_ident()
        self._handle: Any = None
        self._kept = kept  # given each optimizer as it is before its first step

    def __enter__(self) -> Stepped:
        if _register is not None:
            self._handle = _register(self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def parameters(self) -> list[torch.Tensor]:
        """The parameters of the optimizers stepped: each step reads their ``.grad``
        (and skips those that have none)."""
        return parameters_of(self.optimizers)

    def _seen(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if threading.get_ident() == self._thread and not any(
                o is optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
            if self._kept is not None:
                self._kept.add(optimizer)


def parameters_of(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The parameters of ``optimizers``, group by group."""
    return [p for o in optimizers for group in o.param_groups for p in group["params"]]


Grads = list[tuple[torch.Tensor, Any]]


def grads_of(tensors: Iterable[Any]) -> Grads:
    """Each of ``tensors`` that requires grad (once), with its ``.grad`` now."""
    kept = {id(t): t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad}
    return [(t, t.grad) for t in kept.values()]


def put_back_grads(grads: Grads) -> None:
    """Give each tensor the ``.grad`` :func:`grads_of` found (a capture's, or a
    verifying eager run's, replaced it)."""
    for t, grad in grads:
        if t.grad is not grad:
            try:
                t.grad = grad
            except RuntimeError:  # the tensor was reshaped meanwhile: drop its gradient
                t.grad = None


def snapshot(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """What a captured step baked in of ``optimizer``: per parameter group its
    hyper-parameters (tensors by identity) and its parameters, each by identity and
    whether it requires grad (a frozen one gets no step); the optimizer's own plain
    public attributes (a custom optimizer's ``self.scale``), and the addresses of its
    state tensors (the graph steps the momentum it captured: ``load_state_dict`` gives
    others)."""
    return settings(optimizer), tuple([
        v.data_ptr() if isinstance(v, torch.Tensor) else _value(v)
        for per in optimizer.state.values() if isinstance(per, dict) for v in per.values()])


def settings(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """The settings of ``optimizer`` a step reads (see :func:`snapshot`)."""
    groups = tuple(
        (tuple([(id(p), p.requires_grad) for p in group["params"]]),) + tuple(
            (name, _value(value)) for name, value in group.items() if name != "params")
        for group in optimizer.param_groups)
    return groups, _plain(optimizer, public=True)


def _value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value.data_ptr())
    if isinstance(value, (list, tuple)):
        return tuple([_value(v) for v in value])
    return value


_PLAIN = (int, float, bool, str, type(None))


def _plain(obj: Any, public: bool = False) -> tuple[tuple[str, Any], ...]:
    """``obj``'s attributes that hold plain values (or lists and tuples of them)."""
    return tuple((k, tuple(v) if isinstance(v, list) else v)
                 for k, v in getattr(obj, "__dict__", {}).items()
                 if not (public and k.startswith("_")) and (isinstance(v, _PLAIN) or (
                     isinstance(v, (list, tuple)) and all(isinstance(i, _PLAIN) for i in v))))


def training_object(value: Any) -> bool:
    """Whether ``value`` is one of torch's training objects that :class:`Kept` keeps:
    an optimizer, a learning-rate scheduler or a gradient scaler."""
    return isinstance(value, (torch.optim.Optimizer, *_SCHEDULERS, *_SCALERS))


class Kept:
    """The Python state of torch's training objects a call reaches (optimizers,
    learning-rate schedulers with the schedulers and optimizer they drive, gradient
    scalers), taken before the call runs.

    A replay runs none of their Python: a call that changes an optimizer's settings or
    steps a scheduler itself cannot be replayed (:meth:`changed`, after a warmup or a
    capture), nor can a capture that made an optimizer's state (:meth:`grew`: its
    first step's branch).  A capture that fails runs its Python before the eager run
    runs it again: :meth:`restore` puts back what the first run changed (a scheduler
    stepped twice, a scaler's ``unscale_`` marked done, an optimizer's state made in
    the capture)."""

    __slots__ = ("_items",)

    def __init__(self, objects: Iterable[Any] = ()) -> None:
        self._items: list[tuple[Any, Any, Any, Any]] = []
        for obj in objects:
            self.add(obj)

    def add(self, obj: Any) -> None:
        if any(o is obj for o, _, _, _ in self._items):
            return
        self._items.append((obj, _compared(obj), _saved(obj), _grown(obj)))
        if isinstance(obj, _SCHEDULERS):  # a chained or sequential one's, its optimizer
            for inner in (*getattr(obj, "_schedulers", ()), getattr(obj, "optimizer", None)):
                if training_object(inner):
                    self.add(inner)

    def changed(self) -> str | None:
        """What the call changed that a replay would not change again, or None: a
        setting, or a state tensor replaced by another (``st["m"] = st["m"] * 0.9``:
        the graph would read the one it replaced at every replay)."""
        for obj, then, _, grown in self._items:
            try:
                same = then is None or (_compared(obj) == then and _kept_state(
                    grown, _grown(obj)))
            except Exception:  # noqa: BLE001 - not comparable: not known to be the same
                same = False
            if not same:
                return f"the call changes the settings of its {type(obj).__name__}, " \
                       f"which a replay would not"
        return None

    def grew(self) -> bool:
        """Whether an optimizer got state or parameter groups during the call."""
        return any(then is not None and _grown(obj) != then for obj, _, _, then in self._items)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o, _, _, _ in self._items if isinstance(o, torch.optim.Optimizer)]

    def restore(self) -> None:
        for obj, _, saved, _ in self._items:
            _put_back(obj, saved)


def _compared(obj: Any) -> Any:
    if isinstance(obj, torch.optim.Optimizer):  # (a tensor written in place is the same;
        return settings(obj)  # one made anew may be made from the one it replaces)
    if isinstance(obj, _SCHEDULERS):  # its step count, last learning rates
        return _plain(obj)
    return None  # a scaler: ``update()`` leaves it as it found it


def _grown(obj: Any) -> Any:
    """An optimizer's groups and state: per state entry (a parameter's dict, or any
    other value the optimizer keeps there) its keys and what each holds
    (:func:`_state_value`)."""
    if not isinstance(obj, torch.optim.Optimizer):
        return None
    return len(obj.param_groups), {
        id(p): {k: _state_value(v) for k, v in s.items()} if isinstance(s, dict)
        else {None: _state_value(s)} for p, s in obj.state.items()}


def _state_value(value: Any, depth: int = 2) -> Any:
    """What a state value holds, comparable with ``==``: tensors by identity, plain
    values (numpy's scalars too) as they are, lists, tuples and dicts opened (two
    levels), other objects by identity."""
    if isinstance(value, torch.Tensor):
        return "tensor", id(value)
    if isinstance(value, _PLAIN):
        return value
    if depth and isinstance(value, (list, tuple)):
        return tuple([_state_value(v, depth - 1) for v in value])
    if depth and isinstance(value, dict):
        return tuple([(k, _state_value(v, depth - 1)) for k, v in value.items()])
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "shape", None) == ():  # a numpy scalar
        return "scalar", item()
    return "object", id(value)


def _kept_state(then: Any, now: Any) -> bool:
    """Whether every state value there was is still there, unchanged (new ones:
    ``grew``; a NaN kept is the same object)."""
    if then is None:
        return True
    for p, per in then[1].items():
        current = now[1].get(p)
        if current is None:
            continue
        for k, v in per.items():
            c = current.get(k, v)
            if c is not v and c != v:
                return False
    return True


def _saved(obj: Any) -> Any:
    if isinstance(obj, torch.optim.Optimizer):
        groups = list(obj.param_groups)
        return (groups, [dict(g) for g in groups],
                {p: dict(s) if isinstance(s, dict) else s for p, s in obj.state.items()},
                _plain(obj, public=True))
    saved = {k: list(v) if isinstance(v, list) else v
             for k, v in getattr(obj, "__dict__", {}).items()}
    per = saved.get("_per_optimizer_states")  # a scaler's: {id: {"stage": ..., ...}}
    if isinstance(per, dict):
        saved["_per_optimizer_states"] = (per, {k: {n: dict(v) if isinstance(v, dict) else v
                                                    for n, v in s.items()}
                                                if isinstance(s, dict) else s
                                                for k, s in per.items()})
    return saved


def _put_back(obj: Any, saved: Any) -> None:
    if isinstance(obj, torch.optim.Optimizer):
        groups, contents, state, plain = saved
        obj.param_groups[:] = groups
        for group, then in zip(groups, contents):
            group.clear()
            group.update(then)
        obj.state.clear()
        obj.state.update(state)
        vars(obj).update(plain)
        return
    if not hasattr(obj, "__dict__"):
        return
    attributes = dict(saved)
    per = attributes.pop("_per_optimizer_states", None)
    if per is not None:
        per, items = per
        per.clear()
        per.update(items)
        attributes["_per_optimizer_states"] = per
    vars(obj).clear()
    vars(obj).update(attributes)


class StepGuard:
    """The optimizers stepped by captured graphs, with their snapshots."""

    __slots__ = ("_items", "_grads", "active", "_stepped")

    def __init__(self) -> None:
        # weak references: a guard must not keep an optimizer (and its state) alive
        self._items: list[tuple[weakref.ref[torch.optim.Optimizer], tuple[Any, ...]]] = []
        # the optimizers warmups stepped: kept (``Kept``) from the start of a capture,
        # before a scheduler the call steps first changes them
        self._stepped: list[weakref.ref[torch.optim.Optimizer]] = []
        # (parameter, its .grad after a capture, or None): a gradient made during a
        # capture lives in the graph's pool and is rewritten by every replay, so the
        # parameter must still hold that very tensor (``zero_grad(set_to_none=True)``
        # outside the step drops it: eager would make a new one, the replay would not)
        self._grads: list[tuple[weakref.ref[torch.Tensor], Any]] = []
        self.active = False  # anything guarded (read on every call: no method call)

    def add_grads(self, tensors: Iterable[torch.Tensor],
                  expected: Iterable[torch.Tensor | None] | None = None) -> None:
        """Guard the ``.grad`` of each of ``tensors`` that requires grad: as it is now,
        or as ``expected`` gives it (one per tensor requiring grad)."""
        wanted = iter(expected) if expected is not None else None
        for t in tensors:
            if t.requires_grad:
                grad = t.grad if wanted is None else next(wanted)
                self._grads.append((weakref.ref(t), None if grad is None else weakref.ref(grad)))
                self.active = True

    def stepped(self, optimizers: Iterable[torch.optim.Optimizer] = ()
                ) -> list[torch.optim.Optimizer]:
        """Remember ``optimizers`` as stepped by a warmup; all those remembered, alive."""
        for optimizer in optimizers:
            if not any(ref() is optimizer for ref in self._stepped):
                self._stepped.append(weakref.ref(optimizer))
        alive = [ref() for ref in self._stepped]
        return [o for o in alive if o is not None]

    def add(self, optimizers: list[torch.optim.Optimizer]) -> None:
        for optimizer in optimizers:
            if not any(ref() is optimizer for ref, _ in self._items):
                self._items.append((weakref.ref(optimizer), snapshot(optimizer)))
                self.active = True

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The guarded optimizers, alive."""
        alive = [ref() for ref, _ in self._items]
        return [o for o in alive if o is not None]

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors the guarded optimizers keep as state (a fused kernel writes
        them without advancing their version)."""
        return [v for o in self.optimizers() for per in o.state.values()
                if isinstance(per, dict) for v in per.values() if isinstance(v, torch.Tensor)]

    def parameters(self) -> list[torch.Tensor]:
        """The parameters of the guarded optimizers."""
        return parameters_of(self.optimizers())

    def ok(self) -> bool:
        """True while every guarded optimizer is alive and as captured."""
        try:
            for ref, then in self._items:
                optimizer = ref()
                if optimizer is None or snapshot(optimizer) != then:
                    return False
            for param, grad in self._grads:
                t = param()
                if t is None:
                    return False
                if grad is None:
                    if t.grad is not None:
                        return False
                elif (g := grad()) is None or t.grad is not g:
                    return False
            return True
        except Exception:  # noqa: BLE001 - a group changed shape: not as captured
            return False

    def clear(self) -> None:
        self._items = []
        self._grads = []
        self.active = False
