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
import torch.optim.optimizer as _optimizer

_register = getattr(_optimizer, "register_optimizer_step_pre_hook", None)


class Stepped:
    """While open, collects the optimizers whose ``step()`` runs in this thread."""

    __slots__ = ("optimizers", "_thread", "_handle")

    def __init__(self) -> None:
        self.optimizers: list[torch.optim.Optimizer] = []
        self._thread = threading.get_ident()
        self._handle: Any = None

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
        return [p for o in self.optimizers for group in o.param_groups for p in group["params"]]

    def _seen(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if threading.get_ident() == self._thread and not any(
                o is optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)


def snapshot(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """What a captured step baked in of ``optimizer``: per parameter group its
    hyper-parameters (tensors by identity) and which of its parameters require grad
    (a frozen one gets no step), and the addresses of its state tensors (the graph
    steps the momentum it captured: ``load_state_dict`` gives others)."""
    groups = tuple(
        (tuple([p.requires_grad for p in group["params"]]),) + tuple(
            (name, _value(value)) for name, value in group.items() if name != "params")
        for group in optimizer.param_groups)
    state = tuple([v.data_ptr() if isinstance(v, torch.Tensor) else _value(v)
                   for per in optimizer.state.values() for v in per.values()])
    return groups, state


def _value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value.data_ptr())
    if isinstance(value, list):
        return tuple(value)
    return value


class StepGuard:
    """The optimizers stepped by captured graphs, with their snapshots."""

    __slots__ = ("_items", "_grads", "active")

    def __init__(self) -> None:
        # weak references: a guard must not keep an optimizer (and its state) alive
        self._items: list[tuple[weakref.ref[torch.optim.Optimizer], tuple[Any, ...]]] = []
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

    def add(self, optimizers: list[torch.optim.Optimizer]) -> None:
        for optimizer in optimizers:
            if not any(ref() is optimizer for ref, _ in self._items):
                self._items.append((weakref.ref(optimizer), snapshot(optimizer)))
                self.active = True

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
