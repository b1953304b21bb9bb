"""The backward graph of a training graph (see ``backward``): gradients in, replay,
gradients out.

A backward graph is ``torch.autograd.grad`` of the captured forward's autograd graph,
captured into the forward's pool.  It gives autograd its gradients in one of two ways:

* *Hand-out* (a key's first backward graph, as ``make_graphed_callables`` does): each
  call hands out aliases of the graph's own gradient buffers, and autograd's
  ``AccumulateGrad`` adopts them as ``.grad`` (after ``zero_grad(set_to_none=True)``)
  or adds them into ``.grad``: no allocation and no copy per call.  The buffers are
  allocated outside the pool and the graph ends by copying its gradients into them: a
  block of the pool may be scratch memory of the forward graph, which its next replay
  would overwrite while ``.grad`` still holds it.  Before a replay, the use count of
  each buffer's storage tells whether something still holds an earlier call's
  gradient (a ``.grad`` that was not zeroed in between, as when accumulating over
  micro-batches, or a gradient that ``torch.autograd.grad`` returned): the replay would
  overwrite it, so the call uses another graph (:meth:`GradGraph.held`).
* *Copy* (the spare, captured once the hand-out graph was found held): its gradients
  are copied out to fresh tensors after each replay, so nothing it owns is ever held.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import lifecycle
from .buffers import _foreach_copy
from .vocab import EagerReason, logger

use_count = getattr(torch._C, "_storage_Use_Count", None)
_lt = int.__lt__
_refcount = sys.getrefcount


@contextlib.contextmanager
def hooks_held(tensors: list[torch.Tensor]) -> Iterator[None]:
    """The gradient hooks of ``tensors`` (``Tensor.register_hook`` on a parameter) held
    back: ``torch.autograd.grad`` runs an input's hooks on the gradient it returns, and
    autograd runs them again when that gradient reaches the parameter through the
    replayed Function (a hook ``g * 3`` applied twice; baked into a captured graph, it
    would also outlive its removal).  Held back, they run once, eagerly, as in eager
    mode."""
    held = []
    for t in tensors:
        hooks = getattr(t, "_backward_hooks", None)
        if hooks:
            held.append((hooks, list(hooks.items())))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, items in held:
            hooks.update(items)


def grad_of(outs: list[torch.Tensor], targets: list[torch.Tensor], wanted: list[Any],
            retain_graph: bool | None = None, create_graph: bool = False
            ) -> list[torch.Tensor | None]:
    """``torch.autograd.grad`` of ``outs`` to ``targets``, run eagerly, with the targets'
    hooks held back (they run when autograd accumulates these).  A target that no
    longer requires grad (a parameter frozen between the call and its backward) gets
    None, as eager's ``AccumulateGrad`` of a frozen leaf does nothing."""
    live = [t for t in targets if t.requires_grad]
    got: list[torch.Tensor | None] = [None] * len(targets)
    if not live:
        return got
    with hooks_held(live):
        found = iter(torch.autograd.grad(outs, live, wanted, retain_graph=retain_graph,
                                         create_graph=create_graph, allow_unused=True))
    return [next(found) if t.requires_grad else None for t in targets]


def folded(got: list[Any], fold: tuple[tuple[int, int], ...]) -> list[Any]:
    """``got`` (gradients per target of ``Trained.grad_targets``) with each later
    target's gradient added to the one it is folded into, and the later ones dropped."""
    if not fold:
        return got
    got = list(got)
    for k, extra in fold:
        a, b = got[k], got[extra]
        # (a sparse gradient, ``Embedding(sparse=True)``, added to a dense one)
        got[k] = b if a is None else a if b is None else b + a if a.is_sparse else a + b
    return got[:len(got) - len(fold)]


def copy_all(dst: list[torch.Tensor], src: list[Any]) -> None:
    """``dst[i].copy_(src[i])`` for all i, batched where torch can."""
    if _foreach_copy is not None and len(dst) > 1:
        _foreach_copy(dst, src)
    else:
        for d, s in zip(dst, src):
            d.copy_(s)


class GradGraph:
    """A captured backward graph and the buffers it reads and writes."""

    __slots__ = ("graph", "grad_in", "grad_out", "handout", "holders", "counts", "storages",
                 "refs")

    def __init__(self, graph: Any, grad_in: list[torch.Tensor],
                 grad_out: list[torch.Tensor | None], handout: bool) -> None:
        self.graph = graph
        self.grad_in = grad_in  # the gradients of the outputs, copied in per call
        self.grad_out = grad_out  # one per target; None: no gradient reaches it
        # the storage handles of the buffers handed out, and their use counts with
        # nothing handed out
        self.holders: tuple[int, ...] = ()
        self.counts: tuple[int, ...] = ()
        # the storage objects too (``g.untyped_storage()`` hands back this very object):
        # a caller keeping an earlier gradient's storage only adds a Python reference
        self.storages: tuple[Any, ...] = ()
        self.refs: tuple[int, ...] = ()
        if handout and use_count is not None:
            self.storages = tuple(g.untyped_storage() for g in grad_out if g is not None)
            self.holders = tuple(s._cdata for s in self.storages)
            self.counts = tuple(map(use_count, self.holders))
            self.refs = tuple(map(_refcount, self.storages))
        else:
            handout = False
        self.handout = handout

    def held(self) -> bool:
        """Whether a replay would overwrite a gradient handed out earlier and still held."""
        counts = map(use_count, self.holders)  # type: ignore[arg-type]
        return any(map(_lt, self.counts, counts)) \
            or any(map(_lt, self.refs, map(_refcount, self.storages)))

    def run(self, wanted: list[Any]) -> list[torch.Tensor | None] | None:
        """Copy the output gradients in, replay, hand out the targets' gradients; None
        where the gradients cannot be copied in (batched by the legacy vmap of
        ``torch.autograd.grad(..., is_grads_batched=True)``: eagerly, then)."""
        try:
            copy_all(self.grad_in, wanted)
        except RuntimeError:
            return None
        self.graph.replay()
        if self.handout:  # new aliases: AccumulateGrad adopts an alias nothing else holds
            return [None if g is None else g.detach() for g in self.grad_out]
        got = [g for g in self.grad_out if g is not None]
        fresh = [torch.empty_like(g) for g in got]
        copy_all(fresh, got)
        it = iter(fresh)
        return [None if g is None else next(it) for g in self.grad_out]


def capture(backend: Any, device: torch.device, outs: list[torch.Tensor],
            targets: list[torch.Tensor], handout: bool,
            fold: tuple[tuple[int, int], ...] = ()) -> GradGraph:
    """Capture the backward of ``outs`` to ``targets``, ``fold`` applied (see
    :func:`folded`; raises what the capture raises)."""
    grad_in = [torch.zeros_like(t).detach() for t in outs]
    kept = targets[:len(targets) - len(fold)]
    bufs = [torch.empty_like(t).detach() for t in kept] if handout else None

    lent = [bufs is not None]

    def backward() -> Any:
        with torch.autocast(device.type, enabled=False), hooks_held(targets):
            got = folded(list(torch.autograd.grad(outs, targets, grad_in, retain_graph=True,
                                                  allow_unused=True)), fold)
        if any(g is not None and g.layout is not torch.strided for g in got):
            # a sparse gradient (``Embedding(sparse=True)``): its indices and values are
            # new tensors each time in eager mode, whose number a graph would fix
            raise RuntimeError("a sparse gradient: backwards run eagerly")
        if bufs is None:
            lent[0] = False
            return got
        pairs = [(b, g) for b, g in zip(bufs, got) if g is not None]
        copy_all([b for b, _ in pairs], [g for _, g in pairs])
        return [None if g is None else b for b, g in zip(bufs, got)]

    run: Callable[[], Any] = backward
    graph, got = backend.capture(device, run)
    return GradGraph(graph, grad_in, list(got), lent[0])


def nodes(outs: list[torch.Tensor]) -> Iterator[Any]:
    """Each node of the autograd graph behind ``outs``, once.  The nodes visited are
    kept alive until the walk ends: node objects are made on access, and a freed one's
    id may be reused by the next, which would then be skipped."""
    seen: dict[int, Any] = {}
    stack = [t.grad_fn for t in outs]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        yield node
        stack.extend(nxt for nxt, _ in node.next_functions)


def leaves(outs: list[torch.Tensor]) -> set[int]:
    """The ids of the leaves (``AccumulateGrad``'s variables) the autograd graph behind
    ``outs`` reaches; the graph keeps them alive."""
    return {id(v) for node in nodes(outs) if (v := getattr(node, "variable", None)) is not None}


class Backwards:
    """The backward graphs of one training graph for one set of used outputs (a loss
    that uses some outputs takes the gradients of those only, as eager's backward
    does): the hand-out graph, captured at the call after the set's first backward,
    and the spare, at the call after a backward that found the first one's gradients
    held (as ``.grad`` when accumulating over micro-batches)."""

    __slots__ = ("used", "graph", "spare", "spare_due")

    def __init__(self, used: tuple[int, ...]) -> None:
        self.used = used  # indexes of the training graph's differentiable outputs
        self.graph: GradGraph | None = None
        self.spare: GradGraph | None = None
        # whether a backward finding the first graph's gradients held may ask for the
        # spare; until it is tried once
        self.spare_due: Callable[[], bool] | None = None

    def due(self) -> bool:
        """Whether a graph of this set is still to be captured."""
        return self.graph is None or self.spare_due is not None


# A captured autograd graph that may be backpropagated once only: selective activation
# checkpointing's regions raise at a second backward, retain_graph or not
_ONCE = ("backward an extra time", "backward through the graph a second time")
ONCE = "the forward's autograd graph may be backpropagated once only (selective " \
       "activation checkpointing)"


def capture_next(trained: Any) -> None:
    """Capture the backward graph a training graph's (``backward.Trained``) last
    backward asked for (``want_backward``: its set of used outputs).  Forward calls do
    not look for held gradients themselves: that would cost every call a use-count
    pass."""
    if torch.is_anomaly_enabled():  # its checks read values on the host: a later call
        return
    with lifecycle.capture_turn(wait=0) as turn:
        if not turn:  # another thread is capturing (it may wait on this one): next call
            return
        wanted: Backwards | None = trained.want_backward
        trained.want_backward = None
        if wanted is None or not wanted.due():
            return  # captured by another thread, or the spare already tried
        first = wanted.graph is None
        wanted.spare_due = None  # one try
        try:
            with lifecycle.nested_block():
                outs = [trained.static_diff[k] for k in wanted.used]
                graph = capture(trained.backend, trained.device, outs, trained.grad_targets,
                                handout=first, fold=trained.fold)
        except lifecycle.CAPTURE_ERRORS as exc:
            trained.capture_failed = True  # never again into this pool (see Trained)
            if any(s in str(exc) for s in _ONCE):  # later backwards would raise: eager
                trained.unsupported = (EagerReason.BACKWARD_UNSUPPORTED, ONCE)
                return
            name = trained.stats.name if trained.stats is not None else "autograph"
            logger.warning("%s: the backward graph could not be captured (%s): "
                           "backwards run the captured forward's autograd graph "
                           "eagerly", name, lifecycle._first_line(exc))
            return
        if first:
            wanted.graph = graph
            wanted.spare_due = graph.held if graph.handout else None
        else:
            wanted.spare = graph
        if trained.stats is not None:
            trained.stats.backward_captures += 1
