"""Gradients of a training graph that can be differentiated again (``create_graph=True``).

A backward graph replays fixed kernels: its gradients carry no autograd history, so a
second backward through them (a gradient penalty, a physics-informed loss on
``d u / d x``) cannot be taken from a replay.  When autograd asks a graphed call for
differentiable gradients, the call's forward runs again eagerly, under grad mode, on
the very tensors of that call (they are still those of the call: autograd's version
check on the saved parameters raised otherwise), and its gradients are taken with
``create_graph=True``: exactly what eager mode gives.  Buffers the forward writes (a
batch norm's running statistics) are stood in for by copies meanwhile, so they advance
once, as in eager mode (and keep the versions autograd saved).
A forward that draws random numbers cannot be run again with the same numbers: that
raises.  From then on the key runs eagerly (``backward_unsupported``), so its later
calls are differentiated twice by autograd itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from . import gradgraph, lifecycle
from .vocab import EagerReason

if TYPE_CHECKING:
    from .backward import Trained

DIFFERENTIATED = (EagerReason.BACKWARD_UNSUPPORTED,
                  "its gradients were differentiated (create_graph=True)")


def gradients(graph: Trained, leaves: list[Any], grads: tuple[Any, ...]
              ) -> list[torch.Tensor | None]:
    """The gradients of the call with ``leaves`` for ``grads``, with autograd history."""
    graph.unsupported = DIFFERENTIATED  # later calls of the key run eagerly
    if graph.seeded:
        raise RuntimeError(
            "autograph: the gradients of a graphed call that draws random numbers cannot "
            "be differentiated (create_graph=True): its forward cannot be run again with "
            "the same numbers. Graph it with backward=False, or call it under "
            "autograph.disabled().")
    assert graph.recompute is not None, "set by training.capture"
    fn, rebuild = graph.recompute
    args, kwargs = rebuild(list(leaves))
    written = {id(t) for t in graph.state_written if not t.requires_grad}
    swaps = [(d, name, d[name]) for d, name in graph.watch.slots() if id(d[name]) in written]
    for d, name, t in swaps:  # straight into the dict: no assignment for the watch to see
        d[name] = t.detach().clone()
    try:
        with lifecycle.nested_block(), torch.enable_grad():  # graphed calls inside: eager
            out = fn(*args, **kwargs)
    finally:
        for d, name, t in swaps:
            d[name] = t
    flat = pytree.tree_leaves(out, is_leaf=graph.leaf)  # as the graph's spec
    pooled = [flat[j] for j in graph.pool_idx]
    pairs = [(pooled[k], grads[k]) for k in graph.diff if grads[k] is not None]
    inputs = [leaves[i] for i in graph.sources] + graph.inputs_state
    if not pairs:
        return [None] * len(inputs)
    outs, wanted = zip(*pairs)  # outputs the loss does not use give no gradient
    # a tensor passed as an argument and also held as state (``functional_call`` with a
    # module's own parameter) takes its gradient once: autograd adds what the backward
    # returns for each of its places
    place = {id(t): k for k, t in reversed(list(enumerate(inputs)))}
    unique = [t for k, t in enumerate(inputs) if place[id(t)] == k]
    got = dict(zip([id(t) for t in unique],
                   gradgraph.grad_of(list(outs), unique, list(wanted), create_graph=True)))
    return [got[id(t)] if place[id(t)] == k else None for k, t in enumerate(inputs)]


Rebuild = Callable[[list[Any]], tuple[tuple[Any, ...], dict[str, Any]]]
