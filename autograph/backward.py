"""Training graphs: a call that autograd records replays a forward graph, and its
backward replays a backward graph, with gradients exactly as eager computes them.

With ``graphed(..., backward=True)`` (the default), a key whose call autograd records
(grad mode on, an argument, parameter or buffer requiring grad) is captured for
training:

* The forward is captured with grad enabled on static buffers (those standing for
  arguments that require grad are leaves that require grad), in a memory pool of its
  own (``Backend.private_pool``): its saved activations must survive from the call to
  its backward whatever other graphs of the device replay meanwhile, which the shared
  pool does not promise.  Saved tensors are packed without autograd's version check
  (``saved_tensors_hooks``): replays rewrite them in place, and an optimizer step
  updates the parameters in place, as the graph expects.
* Every call runs :class:`_Replay`, an ``autograd.Function`` whose inputs are the
  caller's tensors that require grad and the parameters that do: autograd accumulates
  into ``.grad`` as in eager mode (``set_to_none``, accumulation, hooks on parameters,
  ``retain_graph``), and the outputs are clones, safe to keep.
* The backward graph is captured lazily, as torch's ``make_graphed_callables`` captures
  it (``torch.autograd.grad`` of the captured forward's autograd graph, on the calling
  thread, outside the autograd engine): the first backward of a key runs that autograd
  graph eagerly (it reads the static memory the replay just wrote), and the key's next
  call captures it; later backwards replay it.  A forward whose outputs are never
  backpropagated never captures one.
* A replay overwrites what the previous call of the graph saved.  While that call's
  backward may still run (its outputs are alive and were not backpropagated, or were
  with ``retain_graph=True``: a token it saved for backward is still alive), the new
  call runs eagerly instead (``backward_pending``); a generation counter checked in
  backward is the last guard.  Double backward raises (``once_differentiable``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.autograd.function import once_differentiable
from torch.utils import _pytree as pytree

from . import lifecycle, replay
from .capture import Backend, Pool
from .guards import Watch
from .stats import Stats
from .vocab import EagerReason, logger

_HELD = replay.HELD


class _OnPool:
    """A backend whose captures and replays use one given pool (a training graph's own)."""

    def __init__(self, backend: Backend, pool: Pool) -> None:
        self._backend = backend
        self._pool = pool

    def capture(self, device: torch.device, fn: Callable[[], Any],
                pool: Pool | None = None) -> Any:
        return self._backend.capture(device, fn, self._pool)

    def pool(self, device: torch.device) -> Pool:
        return self._pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


class Trained(replay.Captured):
    """A forward graph captured for training, with its backward (captured lazily)."""

    __slots__ = ("watch", "stats", "spec", "pool_idx", "nondiff", "diff", "static_diff",
                 "sources", "targets", "inputs_state", "state", "flags", "saved_state",
                 "generation", "pending", "held_reason", "want_backward", "backward_graph",
                 "grad_in", "grad_out")

    def __init__(self, base: replay.Captured, backend: _OnPool, watch: Watch,
                 stats: Stats | None, out: Any, saved_state: list[torch.Tensor]) -> None:
        super().__init__(base.graph, base.static, base.build, cast(Backend, backend),
                         base.device, base.seeded, base.hidden, base.state_written,
                         base.inplace)
        self.watch = watch
        self.stats = stats
        flat_out, self.spec = pytree.tree_flatten(out)
        pool_ids = {id(t) for t in getattr(base.build, "pool_outputs", ())}
        self.pool_idx = [j for j, v in enumerate(flat_out) if id(v) in pool_ids]
        pooled = [flat_out[j] for j in self.pool_idx]
        self.diff = [k for k, t in enumerate(pooled) if t.requires_grad]
        self.nondiff = [k for k, t in enumerate(pooled) if not t.requires_grad]
        self.static_diff = [pooled[k] for k in self.diff]  # with the captured grad_fn
        # one target per distinct static buffer that requires grad, then the state
        first: dict[int, int] = {}
        for i, buf in zip(base.static.positions, base.static.buffers):
            if buf.requires_grad:
                first.setdefault(id(buf), i)
        self.sources = list(first.values())  # argument positions, one per target buffer
        self.state = list(watch.tensors())
        self.flags = tuple(t.requires_grad for t in self.state)
        self.inputs_state = [t for t in self.state if t.requires_grad]
        self.targets = [base.static.buffers[base.static.positions.index(i)]
                        for i in self.sources] + self.inputs_state
        self.saved_state = saved_state
        self.generation = 0
        self.pending: Callable[[], Any] | None = None  # a weak ref to the last call's token
        self.held_reason: tuple[EagerReason, str] | None = None
        self.want_backward = False
        self.backward_graph: Any = None
        self.grad_in: list[torch.Tensor] = []
        self.grad_out: list[torch.Tensor | None] = []

    # -- forward ---------------------------------------------------------------------
    def runner(self) -> Callable[[Any], Any]:
        """The call: a replay inside :class:`_Replay`, or :data:`replay.HELD` (the
        engine then runs the call eagerly for ``held_reason``)."""
        lock, apply = self.pool.lock, _Replay.apply
        sources, spec, pool_idx = self.sources, self.spec, self.pool_idx

        def run(leaves: Any) -> Any:
            if self._held():
                return _HELD
            if self.want_backward:
                self._capture_backward()
            inputs = [leaves[i] for i in sources]
            inputs.extend(self.inputs_state)
            box: list[list[Any]] = []
            with lock:
                if self._held():  # another thread's call got there first
                    return _HELD
                outs = apply(self, leaves, box, *inputs)
            flat = box[0]
            for k, j in enumerate(pool_idx):
                flat[j] = outs[k]
            return pytree.tree_unflatten(flat, spec)

        return run

    def _held(self) -> bool:
        """Whether this call must run eagerly: the previous call's backward may still
        need what the replay would overwrite, or a parameter's requires_grad changed
        (then the graphs are dropped at the next call)."""
        pending = self.pending
        if pending is not None and pending() is not None:
            self.held_reason = (EagerReason.BACKWARD_PENDING, "")
            return True
        if tuple(t.requires_grad for t in self.state) != self.flags:
            self.watch.dirty = True
            self.held_reason = (EagerReason.BACKWARD_UNSUPPORTED,
                                "a parameter's requires_grad changed: capturing again")
            return True
        return False

    def replay_forward(self, leaves: Any, box: list[list[Any]]) -> tuple[torch.Tensor, ...]:
        """Copy in, replay, and the clones of the outputs in the pool (the rest of the
        flat outputs go to ``box``).  Runs inside :meth:`_Replay.forward`."""
        self.backend.order_replay(self.device, self.pool)
        self.static.copy_in(leaves)
        self.graph.replay()
        self.generation += 1
        flat = pytree.tree_leaves(self.build(leaves))
        box.append(flat)
        return tuple(flat[j] for j in self.pool_idx)

    # -- backward --------------------------------------------------------------------
    def replay_backward(self, generation: int, grads: tuple[Any, ...]
                        ) -> list[torch.Tensor | None]:
        """The gradients of the targets for the call of ``generation``."""
        if generation != self.generation:  # the pending check makes this unreachable
            raise RuntimeError("autograph: a later call of this graph overwrote what this "
                               "call's backward needs (a bug in autograph; please report it)")
        wanted = [grads[k] for k in self.diff]
        if self.backward_graph is None:  # not captured yet: the captured autograd graph
            self.want_backward = True
            if self.stats is not None:
                self.stats.backward_eager += 1
            got = torch.autograd.grad(self.static_diff, self.targets, wanted,
                                      retain_graph=True, allow_unused=True)
            return list(got)
        with self.pool.lock:
            self.backend.order_replay(self.device, self.pool)
            for buf, g in zip(self.grad_in, wanted):
                buf.copy_(g)
            self.backward_graph.replay()
            # clones: AccumulateGrad would otherwise adopt a static tensor as ``.grad``
            out = [None if g is None else g.clone() for g in self.grad_out]
        if self.stats is not None:
            self.stats.backward_replays += 1
        return out

    def _capture_backward(self) -> None:
        """Capture the backward graph (at the call after the first backward)."""

        with lifecycle.CAPTURE_LOCK:
            if not self.want_backward:
                return
            self.want_backward = False
            grad_in = [torch.zeros_like(t).detach() for t in self.static_diff]
            device, targets, outs = self.device, self.targets, self.static_diff

            def backward() -> Any:
                with torch.autocast(device.type, enabled=False):
                    return torch.autograd.grad(outs, targets, grad_in, retain_graph=True,
                                               allow_unused=True)

            try:
                with lifecycle.nested_block():
                    graph, got = self.backend.capture(device, backward)
            except lifecycle.CAPTURE_ERRORS as exc:
                name = self.stats.name if self.stats is not None else "autograph"
                logger.warning("%s: the backward graph could not be captured (%s): "
                               "backwards run the captured forward's autograd graph "
                               "eagerly", name, lifecycle._first_line(exc))
                return
            self.grad_in, self.grad_out = grad_in, list(got)
            self.backward_graph = graph
            if self.stats is not None:
                self.stats.backward_captures += 1


class _Replay(torch.autograd.Function):
    """One call of a training graph, as autograd sees it."""

    @staticmethod
    def forward(ctx: Any, graph: Trained, leaves: Any, box: list[list[Any]],
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = graph.replay_forward(leaves, box)
        ctx.graph = graph
        ctx.generation = graph.generation
        token = torch.empty(0)  # alive while this call's backward may still run
        graph.pending = weakref.ref(token)
        ctx.save_for_backward(token, *graph.saved_state)
        if graph.nondiff:
            ctx.mark_non_differentiable(*[outs[k] for k in graph.nondiff])
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.saved_tensors  # noqa: B018 - autograd's check: a saved parameter changed raises
        return (None, None, None, *ctx.graph.replay_backward(ctx.generation, grads))
