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
  ``retain_graph``), and the outputs are clones, safe to keep (with ``outputs="reuse"``
  a single output is lent uncopied, see :meth:`Trained.lend`).
* The backward graph is captured lazily, as torch's ``make_graphed_callables`` captures
  it (``torch.autograd.grad`` of the captured forward's autograd graph, on the calling
  thread, outside the autograd engine): the first backward of a key runs that autograd
  graph eagerly (it reads the static memory the replay just wrote), and the key's next
  call captures it; later backwards replay it, handing out its own gradient buffers
  for ``AccumulateGrad`` to adopt, with a spare graph for calls that find them still
  held (``gradgraph``).  A forward whose outputs are never backpropagated never
  captures one.
* A replay overwrites what the previous call of the graph saved for its backward (the
  *spill set*: every tensor the captured autograd graph saved that is no parameter or
  buffer: static inputs, activations, outputs).  One call at a time *owns* the spill
  set.  Before a replay overwrites it, an owner whose backward may still run (a token
  it saved for backward is alive: its outputs are alive and were not backpropagated,
  or were with ``retain_graph=True``) gets a copy of it (a *spill*, ``backward_spills``).
  A backward whose call does not own the spill set first spills the owner (if pending),
  copies its own state back and becomes the owner; its copy is then dropped.  Memory
  thus grows like eager's only while outputs are held.  Where the spill set cannot be
  known, such a call runs eagerly instead (``backward_pending``).  A backward asked
  for gradients with a history (``create_graph=True``) runs the forward again eagerly
  instead (``recompute``), and the key runs eagerly from then on.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
from torch.utils import _pytree as pytree

from . import gradgraph, recompute, replay, versions
from .capture import Backend, OnPool
from .flat import size_leaf
from .gradgraph import copy_all
from .guards import Watch
from .returned import Spliced
from .stats import Stats
from .vocab import EagerReason

_HELD = replay.HELD
_TOKEN = torch.empty(0)  # each call saves a new alias of it (cheaper than a new tensor)


class OutputView(NamedTuple):
    """An output that is another output of the call, or a view of it (``return h,
    h[:, :2]``): made after the Function from that output's copy, so that the two alias
    as in eager mode (a write to one shows in the other; autograd's view tracking
    carries the view's gradient into its base's).  ``base`` indexes the Function's
    outputs; ``geometry`` is None for the very tensor, else (size, stride, offset) in
    the base's copy."""

    position: int
    base: int
    geometry: tuple[tuple[int, ...], tuple[int, ...], int] | None
    detached: bool = False  # (``h.detach()``: no gradient, the base's version counter)

    def of(self, base: torch.Tensor) -> torch.Tensor:
        if self.detached:
            base = base.detach()
        if self.geometry is None:
            return base
        size, stride, offset = self.geometry
        return base.as_strided(size, stride, base.storage_offset() + offset)


def output_views(flat_out: list[Any], pooled: list[int]) -> tuple[list[int], list[OutputView]]:
    """Split the pooled outputs (positions in ``flat_out``) into those the Function
    returns and those that alias one of them (see :class:`OutputView`); larger outputs
    are taken as bases first, and of equal size those that require grad (``return
    h.detach(), h``: ``h`` is the base, its detached alias the view)."""
    order = sorted(pooled, key=lambda j: (-flat_out[j].numel(), not flat_out[j].requires_grad))
    bases: list[int] = []
    found: dict[int, tuple[int, Any]] = {}
    for j in order:
        for i in bases:
            geometry = _within(flat_out[j], flat_out[i])
            if geometry is not False:
                found[j] = (i, geometry)
                break
        else:
            bases.append(j)
    kept = [j for j in pooled if j not in found]
    index = {j: k for k, j in enumerate(kept)}
    views = [OutputView(j, index[i], geometry,
                        flat_out[i].requires_grad and not flat_out[j].requires_grad)
             for j, (i, geometry) in found.items()]
    return kept, views


def _within(t: torch.Tensor, base: torch.Tensor) -> Any:
    """``t``'s geometry in a dense copy of ``base`` (None: ``t`` is ``base``), or False
    where ``t`` is no view inside ``base`` that such a copy can stand for."""
    if t is base or (base.requires_grad and not t.requires_grad and _same_geometry(t, base)):
        return None
    if t.numel() == 0 or t.dtype != base.dtype or (t.requires_grad and not base.requires_grad) \
            or t.layout is not torch.strided or base.layout is not torch.strided \
            or t.is_conj() or base.is_conj() or t.is_neg() or base.is_neg() \
            or t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() \
            or torch.empty_like(base).stride() != base.stride():  # a copy keeps its strides
        return False
    low = t.storage_offset()
    high = low + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    start = base.storage_offset()
    if low < start or high >= start + base.numel():
        return False
    return tuple(t.shape), tuple(t.stride()), low - start


def _same_geometry(t: torch.Tensor, base: torch.Tensor) -> bool:
    return t.shape == base.shape and t.stride() == base.stride() and \
        t.storage_offset() == base.storage_offset() and t.dtype == base.dtype and \
        t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


class _Call:
    """One call of a training graph: whether its backward may still run (``alive``, a
    weak reference to a token it saved for backward) and its spilled state."""

    __slots__ = ("alive", "spilled", "done", "saved")

    def __init__(self, alive: Callable[[], Any]) -> None:
        self.alive = alive
        self.spilled: list[torch.Tensor] | None = None
        self.done: frozenset[int] = frozenset()  # the outputs backpropagated (indexes)
        # what the call saved and its version counters at its last backward that found
        # them (autograd frees them then): a later backward through other outputs
        # checks them as autograd would have
        self.saved: tuple[tuple[torch.Tensor, ...], list[int | None]] | None = None

    def keep_versions(self, saved: tuple[torch.Tensor, ...]) -> None:
        self.saved = (saved, versions.versions(saved))

    def unchanged(self) -> None:
        """Raise as autograd does where a tensor the call saved was written in place
        since its last checked backward."""
        if self.saved is not None:
            tensors, then = self.saved
            if versions.versions(tensors) != then:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been "
                    "modified by an inplace operation (saved by a graphed call whose "
                    "earlier backward went through other outputs)")


class Trained(replay.Captured):
    """A forward graph captured for training, with its backward (captured lazily)."""

    __slots__ = ("watch", "stats", "spec", "leaf", "pool_idx", "nondiff", "diff", "static_diff",
                 "sources", "targets", "inputs_state", "state", "flags", "saved_state",
                 "spill_set", "owner", "held_reason", "diff_set", "want_backward",
                 "grad_targets", "fold", "backwards", "single", "recompute", "unsupported",
                 "capture_failed", "saved_outputs", "saved_args", "bump_before",
                 "bump_after", "views", "bumps_held", "spliced", "flat", "needs")

    def __init__(self, base: replay.Captured, backend: OnPool, watch: Watch,
                 stats: Stats | None, out: Any, saved_state: list[torch.Tensor],
                 spill_set: list[torch.Tensor] | None, reuse: bool = False) -> None:
        super().__init__(base.graph, base.static, base.build, cast(Backend, backend),
                         base.device, base.seeded, base.hidden, base.state_written,
                         base.inplace, reuse)
        self.syncs = base.syncs
        self.grads_of = base.grads_of  # the .grad it reads: guarded (recording._keep)
        # the state a call writes, its version counters advanced inside the Function,
        # around the save for backward as the call's writes were (see ``split_bumps``)
        self.bump_before: list[torch.Tensor] = list(base.bumps.state)
        self.bump_after: list[torch.Tensor] = []
        # the two lists while the capture's own call replays (its capture advanced them)
        self.bumps_held: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.watch = watch
        self.stats = stats
        flat_out, self.spec = pytree.tree_flatten(out, is_leaf=size_leaf)
        # objects the call made (returned.py): their tensors stand in their place
        self.spliced: Spliced | None = getattr(base.build, "spliced", None)
        self.flat = getattr(base.build, "flat", None)
        if self.spliced is not None:
            flat_out = self.spliced.splice(flat_out)
        # how a call's outputs are flattened as the spec has them (a Size one leaf);
        # without a Size, pytree's plain walk, which tests no node
        self.leaf = size_leaf if any(isinstance(v, torch.Size) for v in flat_out) else None
        pool_ids = {id(t) for t in getattr(base.build, "pool_outputs", ())}
        # the outputs the Function returns, and those made from them after it
        self.pool_idx, self.views = output_views(
            flat_out, [j for j, v in enumerate(flat_out) if id(v) in pool_ids])
        pooled = [flat_out[j] for j in self.pool_idx]
        self.diff = [k for k, t in enumerate(pooled) if t.requires_grad]
        self.nondiff = [k for k, t in enumerate(pooled) if not t.requires_grad]
        self.diff_set = frozenset(self.diff)
        self.static_diff = [pooled[k] for k in self.diff]  # with the captured grad_fn
        # one tensor out, in the pool: no flattening per call (not one object around it);
        # handed out as a dense clone, a tensor of its own (a view made inside the
        # Function could not be written in place), the conjugate and negative bits of a
        # view such as ``.conj()`` resolved (docs/semantics.md)
        self.single = pooled[0] if self.spec.num_leaves == 1 and len(pooled) == 1 \
            and self.spec.is_leaf() and self.spliced is None else None
        # one target per distinct static buffer that requires grad, then the state
        first: dict[int, int] = {}
        for i, buf in zip(base.static.positions, base.static.buffers):
            if buf.requires_grad:
                first.setdefault(id(buf), i)
        self.sources = list(first.values())  # argument positions, one per target buffer
        self.state = list(watch.tensors())
        self.flags = tuple(t.requires_grad for t in self.state)
        # each tensor once: a parameter tied between modules (a language model's
        # embedding and output layer) is held twice, and autograd would add its
        # gradient once per input
        self.inputs_state = list({id(t): t for t in self.state if t.requires_grad}.values())
        self.targets = [base.static.buffers[base.static.positions.index(i)]
                        for i in self.sources] + self.inputs_state
        # what the backward differentiates to: the targets, parameters replaced by the
        # capture's stand-ins and parameters read directly after them, their gradients
        # added to their stand-ins' (``training.StandIns``)
        self.grad_targets: list[torch.Tensor] = self.targets
        self.fold: tuple[tuple[int, int], ...] = ()
        self.saved_state = saved_state
        self.spill_set = spill_set  # None: unknown, a pending call holds the graph
        self.owner: _Call | None = None  # the call whose state the spill set holds
        self.held_reason: tuple[EagerReason, str] | None = None
        # the backward graphs per set of differentiable outputs a backward used (their
        # indexes in ``diff``; at most MAX_OUTPUT_SETS sets, the others run eagerly)
        self.backwards: dict[tuple[int, ...], gradgraph.Backwards] = {}
        # the set whose next graph the next call captures (set by a backward that ran
        # eagerly, see ``replay_backward``)
        self.want_backward: gradgraph.Backwards | None = None
        # a backward graph's capture failed: its pool may be left recording, so no other
        # is captured into it (backwards run the autograd graph eagerly from then on)
        self.capture_failed = False
        # the outputs (indexes among those in the pool) that the captured graph saved
        # for its backward: each call saves its own copy of them, so that writing one in
        # place before the backward raises as in eager mode (see ``find_saved_outputs``)
        self.saved_outputs: list[int] = []
        # the argument positions whose static buffers the captured graph saved: each
        # call saves the caller's tensors there, so that writing one in place before
        # the backward raises as in eager mode (the backward reads the static copy)
        self.saved_args: list[int] = []
        # the call's function and how to rebuild its arguments from leaves, for
        # gradients that are differentiated again (recompute.py); set by the capture
        self.recompute: tuple[Callable[..., Any], recompute.Rebuild] | None = None
        # why every later call runs eagerly (recompute.DIFFERENTIATED), once it does
        self.unsupported: tuple[EagerReason, str] | None = None
        # several outputs: per differentiable output (as ``diff``), the indexes of the
        # saved tensors (``saved_state``, the saved arguments, the saved outputs) its
        # backward reads, set by the capture; a backward checks those only, as eager's
        # nodes each check their own (None: every one, autograd's check)
        self.needs: list[frozenset[int]] | None = None

    # -- forward ---------------------------------------------------------------------
    def runner(self) -> Callable[[Any], Any]:
        """The call: a replay inside :class:`_Replay`, or :data:`replay.HELD` (the
        engine then runs the call eagerly for ``held_reason``).  With ``reuse`` (see
        :meth:`lend`) a call that finds an earlier output held returns HELD too."""
        lock = self.pool.lock
        sources, spec, pool_idx, views = self.sources, self.spec, self.pool_idx, self.views
        spliced = self.spliced
        state, inputs_state = self.state, self.inputs_state

        def run(leaves: Any) -> Any:
            if [t.requires_grad for t in state] != flags_list or self.unsupported:
                return self._hold()
            if self.want_backward is not None:  # by a backward run eagerly (_backward)
                gradgraph.capture_next(self)
                if self.unsupported:
                    return self._hold()
            inputs = [leaves[i] for i in sources] + inputs_state if sources \
                else inputs_state
            flat_box: list[list[Any]] = []
            with lock:
                if self.spill_set is None and self._pending():
                    return self._hold()
                if self.reuse and self.outputs_held():
                    self.held_reason = None  # the engine counts it as outputs_protected
                    return _HELD
                outs = _apply(self, leaves, flat_box, *inputs)
            if self.bump_after:  # after autograd saved what the Function saves
                versions.bump(self.bump_after)
            if self.single is not None:
                return outs[0]
            # each output a node of its own, as eager's separate operators make them: a
            # hook on an output the loss does not use is not called (with None) then
            outs = [o.view_as(o) if o.requires_grad else o for o in outs]
            flat = flat_box[0]
            for k, j in enumerate(pool_idx):
                flat[j] = outs[k]
            for view in views:
                flat[view.position] = view.of(outs[view.base])
            if spliced is not None:
                flat = spliced.regroup(flat, leaves)
            return pytree.tree_unflatten(flat, spec)

        flags_list = list(self.flags)
        return run

    def lend(self) -> None:
        """``outputs="reuse"``: hand the single output out as an alias of the graph's own
        tensor (no copy, as ``make_graphed_callables`` does); a call that finds an
        earlier one still held runs eagerly.  Not where the captured graph saved the
        output (a backward's restore of a spilled call would write under the alias),
        nor for several outputs: those are cloned."""
        single = self.single
        if single is None or self.spill_set is None or replay.use_count is None:
            self.reuse = False
            return
        where = single.untyped_storage()._cdata
        saved = self.spill_set + self.saved_state
        self.reuse = all(t.untyped_storage()._cdata != where for t in saved)

    def split_bumps(self, offsets: dict[int, int]) -> None:
        """Split each written state tensor's version advances into those before the
        call saves it (``offsets``: the writes the forward made before saving it) and
        those after: autograd then finds a saved counter that the call wrote after
        saving it changed, as in eager mode, and one written before saving unchanged."""
        before: list[torch.Tensor] = []
        after: list[torch.Tensor] = []
        counts = Counter(id(t) for t in self.bump_before)
        for t in {id(t): t for t in self.bump_before}.values():
            n = counts[id(t)]
            first = min(offsets.get(id(t), n), n)
            before += [t] * first
            after += [t] * (n - first)
        # the capture's own call: its capture advanced every counter already, so none
        # is advanced before its save; those it advanced after saving are taken back
        # now and advanced again after the save, as for a later call
        self.bump_before, self.bump_after = [], after
        self.bumps_held = (before, after)
        versions.take_back(after)

    def release_bumps(self) -> None:
        """After the capture's own call: later calls advance every counter (see
        :meth:`split_bumps`)."""
        if self.bumps_held is not None:
            self.bump_before, self.bump_after = self.bumps_held
            self.bumps_held = None

    def find_saved_outputs(self) -> None:
        """Note which outputs the captured graph saved for its backward (a sigmoid's
        result): the graph's backward reads its own static output, so a caller writing
        its copy in place would otherwise get gradients where eager raises."""
        if self.spill_set is None:
            return
        saved = {t.untyped_storage()._cdata for t in self.spill_set}
        self.saved_outputs = [k for k, t in zip(self.diff, self.static_diff)
                              if t.untyped_storage()._cdata in saved]

    def _pending(self) -> bool:
        owner = self.owner
        return owner is not None and owner.alive() is not None

    def _hold(self) -> Any:
        """Why this call must run eagerly: a parameter's requires_grad changed (the
        graphs are dropped at the next call), or the previous call's backward may still
        need what the replay would overwrite and it cannot be spilled."""
        if self.unsupported is not None:
            self.held_reason = self.unsupported
        elif [t.requires_grad for t in self.state] != list(self.flags):
            self.watch.dirty = True
            # a state change like a replaced parameter: quiet, the next call captures
            self.held_reason = (EagerReason.WARMUP,
                                "a parameter's requires_grad changed: capturing again")
        else:
            self.held_reason = (EagerReason.BACKWARD_PENDING, "")
        return _HELD

    def replay_forward(self, leaves: Any, box: list[list[Any]], alive: Callable[[], Any]
                       ) -> tuple[_Call, tuple[torch.Tensor, ...]]:
        """Spill the pending owner, copy in, replay; this call becomes the owner.  The
        clones of the outputs in the pool (the rest of the flat outputs go to ``box``).
        Runs inside :meth:`_Replay.forward`, under the pool's lock."""
        self.backend.order_replay(self.device, self.pool)
        if self.spill_set is not None and self._pending():
            self._spill()
        self.static.copy_in(leaves)
        self.graph.replay()
        call = self.owner = _Call(alive)
        single = self.single
        if single is not None:
            return call, (single.detach() if self.reuse else single.clone(),)
        flat = self.flat(leaves) if self.flat is not None else \
            pytree.tree_leaves(self.build(leaves), is_leaf=self.leaf)
        box.append(flat)
        return call, tuple(flat[j] for j in self.pool_idx)

    def _spill(self) -> None:
        """Copy the spill set out to the owner (whose backward may still run)."""
        owner, spill = self.owner, self.spill_set
        assert owner is not None and spill is not None
        copies = [torch.empty_like(t) for t in spill]
        copy_all(copies, spill)
        owner.spilled = copies
        self.owner = None
        if self.stats is not None:
            self.stats.backward_spills += 1

    def holds(self, call: _Call, grads: tuple[Any, ...]) -> bool:
        """Whether a backward of ``call`` for ``grads`` may run after autograd freed
        what the call saved (an earlier backward through other outputs): its state is
        still at hand (the graph's, or spilled), and no output that takes a gradient
        now took one then (eager's backward through that output raises)."""
        if call is not self.owner and call.spilled is None:
            return False
        return not any(grads[k] is not None for k in call.done)

    def _own(self, call: _Call) -> None:
        """Put ``call``'s spilled state back into the spill set (under the lock)."""
        if call is self.owner:
            return
        spilled, spill = call.spilled, self.spill_set
        if spilled is None or spill is None:
            raise RuntimeError("autograph: a later call of this graph overwrote what this "
                               "call's backward needs (a bug in autograph; please report it)")
        self.backend.order_replay(self.device, self.pool)
        if self._pending():
            self._spill()
        # putting back what was there is no write autograd should see: a saved
        # ``chunk`` of an output shares that output's version counter, and autograd
        # refuses a multi-output view whose base changed
        counters = versions.versions(spill)
        copy_all(spill, spilled)
        versions.set_versions(spill, counters)
        if self.device.type == "cuda":  # freed below: not reused before the copy ran
            stream = torch.cuda.current_stream(self.device)
            for t in spilled:
                t.record_stream(stream)
        call.spilled = None
        self.owner = call

    # -- backward --------------------------------------------------------------------
    def replay_backward(self, call: _Call, grads: tuple[Any, ...], fresh: bool = True
                        ) -> list[torch.Tensor | None]:
        """The gradients of the targets for ``call``: the hand-out backward graph's,
        the spare's while an earlier call's gradients are held, else (no graph
        captured yet, or one for other outputs) those of the captured autograd graph,
        run eagerly.  Outputs the loss does not use (autograd passes None) take no part,
        as in eager mode: a zero gradient through their branch could make NaN (a
        ``sqrt`` at 0) and give targets only they reach a gradient."""
        diff = self.diff
        if len(diff) == 1:  # one differentiable output (the usual loss): no set to find
            g = grads[diff[0]]
            if g is not None:
                call.done = self.diff_set if fresh else call.done | self.diff_set
                return self._backward(call, [g], _FIRST, eager=_functorch_active())
        wanted = [grads[k] for k in diff]
        used = tuple(k for k, g in enumerate(wanted) if g is not None)
        # the outputs backpropagated since what the call saved was last at hand (a
        # backward that found it may have freed it, ``retain_graph`` or not)
        now = frozenset(self.diff[k] for k in used)
        call.done = now if fresh else call.done | now
        if len(used) < len(wanted):
            wanted = [wanted[k] for k in used]
        # gradients batched by a torch.func transform: a graph cannot take them
        return self._backward(call, wanted, used, eager=_functorch_active())

    def _backward(self, call: _Call, wanted: list[torch.Tensor], used: tuple[int, ...],
                  eager: bool = False) -> list[torch.Tensor | None]:
        with self.pool.lock:
            self._own(call)
            mine = self.backwards.get(used) if not eager else None
            if mine is None and len(self.backwards) < MAX_OUTPUT_SETS and not eager:
                mine = self.backwards[used] = gradgraph.Backwards(used)
            graph = mine.graph if mine is not None else None
            if graph is not None and graph.holders and graph.held():
                graph = mine.spare  # type: ignore[union-attr]
            if graph is None:  # the graph is captured at the next call (outside autograd)
                if mine is not None and mine.due() and not self.capture_failed:
                    self.want_backward = mine
            else:
                self.backend.order_replay(self.device, self.pool)
                out = graph.run(wanted)
                if out is not None:
                    if self.stats is not None:
                        self.stats.backward_replays += 1
                    return out
            if self.stats is not None:
                self.stats.backward_eager += 1
            outs = self.static_diff if len(used) == len(self.static_diff) \
                else [self.static_diff[k] for k in used]
            got = gradgraph.grad_of(outs, self.grad_targets, wanted, retain_graph=True)
            if any(g is not None and g.layout is not torch.strided for g in got):
                # a sparse gradient (``Embedding(sparse=True)``): its size is the
                # call's, and no hand-out buffer holds it; backwards stay eager
                self.capture_failed = True
                self.want_backward = None
            return gradgraph.folded(got, self.fold)


MAX_OUTPUT_SETS = 4  # sets of used outputs with backward graphs, per training graph
_FIRST = (0,)


class _Replay(torch.autograd.Function):
    """One call of a training graph, as autograd sees it."""

    @staticmethod
    def forward(ctx: Any, graph: Trained, leaves: Any, box: list[list[Any]],
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        token = _TOKEN.detach()  # alive while this call's backward may still run
        call, outs = graph.replay_forward(leaves, box, weakref.ref(token))
        if graph.bump_before:  # the state the replay wrote, as the call's writes count
            versions.bump(graph.bump_before)
        ctx.set_materialize_grads(False)  # unused outputs: None, not zeros
        ctx.graph = graph
        ctx.call = call
        ctx.leaves = leaves  # for gradients differentiated again (recompute.py)
        # what the captured graph saved, version-checked by autograd as in eager mode:
        # parameters and buffers, the caller's arguments, outputs
        if graph.needs is not None:  # checked per output by the backward (_check_needed)
            ctx.save_for_backward(token)
            # (an output as an alias: its version counter, and no cycle through ctx)
            checked = [*graph.saved_state, *[leaves[i] for i in graph.saved_args],
                       *[outs[k].detach() for k in graph.saved_outputs]]
            ctx.checked = (checked, versions.versions(checked))
        elif graph.saved_outputs or graph.saved_args:
            ctx.save_for_backward(token, *graph.saved_state,
                                  *[leaves[i] for i in graph.saved_args],
                                  *[outs[k] for k in graph.saved_outputs])
        else:
            ctx.save_for_backward(token, *graph.saved_state)
        if graph.nondiff:
            ctx.mark_non_differentiable(*[outs[k] for k in graph.nondiff])
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        graph, call = ctx.graph, ctx.call
        try:
            saved = ctx.saved_tensors  # autograd's check: a saved parameter changed raises
        except RuntimeError as exc:
            # freed by an earlier backward through other outputs (``a.sum().backward();
            # b.sum().backward()``, eager's way with branches that share no saved
            # tensor): fine while the graph still holds this call's state and nothing
            # saved changed since (checked as autograd would have)
            if "second time" not in str(exc) or not graph.holds(call, grads):
                raise
            if graph.needs is None:
                call.unchanged()
            fresh = False
        else:
            fresh = True
            if len(graph.diff) > 1 and graph.needs is None:  # a later backward may come
                call.keep_versions(saved[1:])
        if graph.needs is not None:
            _check_needed(ctx.checked, graph, grads)
        if torch.is_grad_enabled():  # create_graph=True: gradients with a history
            return (None, None, None, *recompute.gradients(graph, ctx.leaves, grads))
        got = graph.replay_backward(call, grads, fresh)
        if any(g is None for g in got):
            _quiet_hooks(graph, ctx, got)
        return (None, None, None, *got)


def _quiet_hooks(graph: Trained, ctx: Any, got: list[Any]) -> None:
    """Autograd runs an input's gradient hooks even where the Function gives it no
    gradient (None: a parameter only outputs the loss does not use reach, an
    actor-critic's value head, Inception's auxiliary logits), and eager mode never
    calls them then.  While a backward that gives such an input None runs, its hooks
    (``register_hook``) skip a call without a gradient, and its post-accumulate hooks
    run only when a gradient arrived (a tied parameter's, from elsewhere); put back
    when the backward ends (``queue_callback``), or when its autograd graph goes if it
    raised.  Several such backwards at once share one quieting per tensor."""
    leaves = ctx.leaves
    inputs = [leaves[i] for i in graph.sources] + graph.inputs_state
    mine: list[_Quiet] = []
    with _QUIET_LOCK:
        for t, g in zip(inputs, got):
            if g is None and (getattr(t, "_backward_hooks", None)
                              or getattr(t, "_post_accumulate_grad_hooks", None)):
                quiet = _QUIETED.get(id(t))
                if quiet is None:
                    quiet = _QUIETED[id(t)] = _Quiet(t)
                quiet.users += 1
                mine.append(quiet)
    if mine:
        done = _Release(mine)
        torch.autograd.Variable._execution_engine.queue_callback(done)
        weakref.finalize(ctx, done)


_QUIET_LOCK = threading.Lock()
_QUIETED: dict[int, _Quiet] = {}  # a tensor's id: its hooks' quieting, while used


class _Quiet:
    """One tensor's hooks, quieted (see :func:`_quiet_hooks`) until its last user is
    done: a hook of its own, first of its pre-hooks, notes whether the accumulation
    running has a gradient and wraps every hook not wrapped yet (those registered
    since, during the backward too: autograd reads the hook dicts as it calls them)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.id = id(t)
        self.users = 0
        self.arrived = [False]  # whether the accumulation running now has a gradient
        self.wrapped: list[tuple[dict[Any, Any], Any, Any, Any]] = []
        self.mine: set[int] = set()  # ids of the wrappers
        self.tensor = weakref.ref(t)
        self.handle = t.register_hook(self._first)
        hooks: Any = t._backward_hooks  # (an OrderedDict: called in its order)
        if hasattr(hooks, "move_to_end"):
            hooks.move_to_end(self.handle.id, last=False)
        self._wrap_new()

    def _first(self, grad: Any) -> None:
        self.arrived[0] = grad is not None
        self._wrap_new()

    def _wrap_new(self) -> None:
        t = self.tensor()
        if t is None:
            return
        for hooks, quiet in ((t._backward_hooks, _unless_none),
                             (getattr(t, "_post_accumulate_grad_hooks", None), _if_arrived)):
            if not hooks:
                continue
            for k, hook in list(hooks.items()):
                if k == self.handle.id or id(hook) in self.mine:
                    continue
                wrapper = quiet(hook, self.arrived)
                hooks[k] = wrapper
                self.mine.add(id(wrapper))
                self.wrapped.append((hooks, k, hook, wrapper))

    def put_back(self) -> None:
        self.handle.remove()
        for hooks, k, hook, wrapper in self.wrapped:
            if hooks.get(k) is wrapper:  # (one removed or replaced meanwhile stays so)
                hooks[k] = hook


class _Release:
    """The end of one backward's use of its quietings (called once)."""

    __slots__ = ("quiets", "__weakref__")

    def __init__(self, quiets: list[_Quiet]) -> None:
        self.quiets = quiets

    def __call__(self) -> None:
        with _QUIET_LOCK:
            quiets, self.quiets = self.quiets, []
            for quiet in quiets:
                quiet.users -= 1
                if quiet.users == 0 and _QUIETED.get(quiet.id) is quiet:
                    del _QUIETED[quiet.id]
                    quiet.put_back()


def _unless_none(hook: Callable[[Any], Any], arrived: list[bool]) -> Callable[[Any], Any]:
    def quiet(grad: Any) -> Any:
        return None if grad is None else hook(grad)

    return quiet


def _if_arrived(hook: Callable[[Any], Any], arrived: list[bool]) -> Callable[[Any], Any]:
    def quiet(param: Any) -> Any:
        return hook(param) if arrived[0] else None

    return quiet


def _check_needed(checked: tuple[list[Any], list[int | None]], graph: Trained,
                  grads: tuple[Any, ...]) -> None:
    """Raise as autograd does where a tensor that the backward of an output taking a
    gradient now reads was written in place since the call (``Trained.needs``); what
    only other outputs' backwards read may change, as in eager mode (an optimizer
    stepping a critic head between the critic's backward and the actor's)."""
    refs, then = checked
    assert graph.needs is not None
    wanted: set[int] = set()
    for j, k in enumerate(graph.diff):
        if grads[k] is not None:
            wanted |= graph.needs[j]
    for i in sorted(wanted):
        t = refs[i]
        if then[i] is None or t._version == then[i]:
            continue
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by "
            f"an inplace operation: [{t.type()} {list(t.shape)}] is at version "
            f"{t._version}; expected version {then[i]} instead (saved by a graphed call)")


_functorch_active = torch._C._are_functorch_transforms_active
_raw_apply = super(torch.autograd.Function, _Replay).apply  # the C entry point


def _apply(*args: Any) -> Any:
    """``_Replay.apply`` without its Python wrapper's per-argument pass (functorch
    transforms aside, where the wrapper is needed)."""
    if _functorch_active():
        return _Replay.apply(*args)
    return _raw_apply(*args)
