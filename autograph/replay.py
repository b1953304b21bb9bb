"""A captured graph and its replay: :class:`Captured` holds everything a replay needs,
and :meth:`Captured.runner` binds it into the function the engine calls on every replay
(copy the arguments in, replay, build the outputs).  With ``outputs="reuse"`` the
runner hands out the graph's own tensors and first checks that no earlier output is
still held (:data:`HELD`).  ``lifecycle.capture`` makes a :class:`Captured`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import versions
from .buffers import StaticInputs
from .capture import Backend, Pool

# What a runner with ``outputs="reuse"`` returns instead of replaying when an earlier
# call's output is still held: the engine runs that call eagerly (``outputs_protected``).
HELD: Any = object()

use_count: Any = getattr(torch._C, "_storage_Use_Count", None)  # None: clones only
refcount = sys.getrefcount


class Holder:
    """What shows that a storage handed out is still held outside autograph: its use
    count (tensors and views of it) and the Python references of its storage object
    (``t.untyped_storage()`` hands back this very object), each above what it was
    with nothing handed out."""

    __slots__ = ("storage", "cdata", "free", "refs", "ptr", "nbytes")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.storage = tensor.untyped_storage()  # kept: a caller's reference shows
        self.cdata = self.storage._cdata
        self.free = use_count(self.cdata)
        self.refs = refcount(self.storage)
        self.ptr, self.nbytes = self.storage.data_ptr(), self.storage.nbytes()

    def held(self) -> bool:
        return use_count(self.cdata) > self.free or refcount(self.storage) > self.refs \
            or self.moved()

    def moved(self) -> bool:
        """Whether a caller resized the storage (``untyped_storage().resize_(0)``, a
        larger ``resize_``): the graph still writes the memory it had."""
        storage = self.storage
        return storage.data_ptr() != self.ptr or storage.nbytes() != self.nbytes


class Bumps(NamedTuple):
    """What a call advances the version counter of, once per in-place write that
    autograd would count in eager mode (as its capture counted them): the arguments at
    ``positions`` (the caller's tensors, captured in place) and the ``state`` tensors
    (parameters, buffers, named tensors).  A tensor written twice is listed twice."""

    positions: tuple[int, ...]
    state: tuple[torch.Tensor, ...]
    # tensors read from elsewhere (a plain object's), held weakly as their guard holds
    # them: a graph must not keep them alive
    hidden: tuple[Any, ...] = ()


class Captured:
    """A captured graph with everything its replay needs."""

    __slots__ = ("graph", "static", "build", "pool", "device", "backend", "seeded", "hidden",
                 "state_written", "inplace", "reuse", "_holders", "footprint", "effects",
                 "held_reason", "rotation", "syncs", "bumps", "grads_of")

    def __init__(self, graph: Any, static: StaticInputs, build: Callable[[list[Any]], Any],
                 backend: Backend, device: torch.device, seeded: bool,
                 hidden: list[torch.Tensor], state_written: list[torch.Tensor],
                 inplace: tuple[int, ...], reuse: bool = False) -> None:
        self.graph = graph
        self.static = static
        self.build = build
        self.backend = backend
        self.device = device
        self.pool: Pool = backend.pool(device)
        self.seeded = seeded  # random operators ran: replays draw new numbers
        self.hidden = hidden
        self.state_written = state_written  # parameters and buffers the graph writes
        self.inplace = inplace  # argument positions captured at the caller's address
        self.reuse = reuse  # outputs handed out without a copy (outputs="reuse")
        self._holders: tuple[Holder, ...] | None = None
        self.footprint = 0  # peak bytes of the tensors the capture made (footprint.py)
        # host counters of object arguments: filled before, advanced after a replay
        self.effects: Any = None
        # why the runner returned HELD, when not outputs="reuse" (see ``unless_flags_changed``)
        self.held_reason: Any = None
        self.rotation: Any = None  # rotation.Rotation: outputs without a host copy
        # container arguments the call changes and returns (containers.Sync)
        self.syncs: tuple[Any, ...] = ()
        # the version counters a call advances, as its capture did (:func:`versioned`)
        self.bumps = Bumps((), ())
        # tensors whose .grad the graph reads (lifecycle._grads_read): guarded, then []
        self.grads_of: list[torch.Tensor] = []

    def holders(self) -> tuple[Holder, ...]:
        """A :class:`Holder` per pool storage that an output lives in.  Taken on the
        first call, before the first replay hands anything out: from then on a count
        above it is a tensor or storage outside autograph (an output of an earlier
        call, a view of it) that the next replay would overwrite.  The outputs kept by
        ``build`` keep the storages alive."""
        if self._holders is None:
            storages = {t.untyped_storage()._cdata: t
                        for t in getattr(self.build, "pool_outputs", ())}
            self._holders = tuple(Holder(t) for t in storages.values())
        return self._holders

    def outputs_held(self) -> bool:
        """With ``reuse``: whether an output of an earlier call is still held."""
        if not self.reuse:
            return False
        return any(h.held() for h in self.holders())

    def outputs_moved(self) -> bool:
        """With ``reuse``: whether a caller resized the storage of an output handed out
        (:meth:`Holder.moved`): the graph writes the memory it had, so only a new
        capture can hand out such an output again."""
        return self.reuse and any(h.moved() for h in self.holders())

    def synchronize(self) -> None:
        self.backend.synchronize(self.device)

    def runner(self) -> Callable[[Any], Any]:
        """The replay (:meth:`_runner`), with the host counters' effects around it when
        the call advances any (``counters.Effects``)."""
        run = self._runner()
        if self.effects is None:
            return run
        backend, device, pool = self.backend, self.device, self.pool
        return self.effects.wrap(run, HELD, lambda: backend.order_replay(device, pool))

    def _runner(self) -> Callable[[Any], Any]:
        """The replay, with everything it needs bound: copy the arguments in, replay,
        build the outputs.  Serialized per device, since the graphs of a pool share
        memory and a capture must not overlap a replay.

        With ``reuse`` the outputs are the graph's own tensors (new aliases, no copy),
        and the replay first reads the use count of each output storage: if one is
        above its count with nothing handed out, the caller still holds an earlier
        output (or a view of it) that the replay would overwrite, and the runner returns
        :data:`HELD` without replaying (the engine then runs the call eagerly)."""
        lock, pool, device = self.pool.lock, self.pool, self.device
        order = self.backend.order_replay
        replay = self.graph.replay
        static, build = self.static, self.build
        single = getattr(build, "single_output", None)
        if self.reuse:
            return self._reuse_runner()
        if single is not None and len(static.positions) == 1:
            # one tensor in, one tensor out: the common case, with no call in between
            pos, copy, clone = static.positions[0], static.buffers[0].copy_, single.clone

            def run_one(leaves: Any) -> Any:
                with lock:
                    order(device, pool)
                    copy(leaves[pos])
                    replay()
                    return clone()

            def prepare_one(leaves: Any) -> None:
                order(device, pool)
                copy(leaves[pos])

            return self._rotating(run_one, prepare_one)
        if single is not None and not static.positions:
            # every argument at its own address (a padded call's buffers): no copy in
            clone_only = single.clone

            def run_none(leaves: Any) -> Any:
                with lock:
                    order(device, pool)
                    replay()
                    return clone_only()

            return self._rotating(run_none, lambda _leaves: order(device, pool))
        copy_in = static.copy_in

        def run(leaves: Any) -> Any:
            with lock:
                order(device, pool)
                copy_in(leaves)
                replay()
                return build(leaves)

        def prepare(leaves: Any) -> None:
            order(device, pool)
            copy_in(leaves)

        return self._rotating(run, prepare) if single is not None else run

    def _rotating(self, run: Callable[[Any], Any], prepare: Callable[[Any], None]
                  ) -> Callable[[Any], Any]:
        """``run``, or where the graph has output variants (``rotation``) their runner,
        with ``run`` where no variant is free."""
        if self.rotation is None:
            return run
        return self.rotation.runner(run, prepare, self.pool.lock)  # type: ignore[no-any-return]

    def rows_runner(self, dim: int, size: int, real: int) -> Callable[[Any], Any] | None:
        """For a call padded from ``real`` rows to ``size``: the replay that clones only
        the real rows of its one output (from a view made once here, instead of a view
        of a clone made every call), or None where the graph has no such runner (several
        outputs, an output viewing an argument, ``reuse``, host counters)."""
        single = getattr(self.build, "single_output", None)
        if single is None or self.reuse or self.effects is not None or self.bumps:
            return None
        rows = single.narrow(dim, 0, real) if single.dim() > dim and \
            single.shape[dim] == size else single
        lock, pool, device = self.pool.lock, self.pool, self.device
        order, replay, clone = self.backend.order_replay, self.graph.replay, rows.clone
        copy_in = self.static.copy_in if self.static.positions else None

        def run_rows(leaves: Any) -> Any:
            with lock:
                order(device, pool)
                if copy_in is not None:
                    copy_in(leaves)
                replay()
                return clone()

        return run_rows

    def _reuse_runner(self) -> Callable[[Any], Any]:
        lock, pool, device = self.pool.lock, self.pool, self.device
        order = self.backend.order_replay
        replay = self.graph.replay
        static, build = self.static, self.build
        holders = self.holders()
        use: Callable[[int], int] = use_count  # type: ignore[assignment]
        single = getattr(build, "single_output", None)
        if single is not None and len(static.positions) == 1 and len(holders) == 1:
            pos, copy, alias = static.positions[0], static.buffers[0].copy_, single.detach
            (holder,) = holders  # its storage read as an attribute, as its count was taken
            cdata, free, refs, moved = holder.cdata, holder.free, holder.refs, holder.moved

            def run_one(leaves: Any) -> Any:
                with lock:
                    if use(cdata) > free or refcount(holder.storage) > refs or moved():
                        return HELD
                    order(device, pool)
                    copy(leaves[pos])
                    replay()
                    return alias()

            return run_one
        copy_in = static.copy_in

        def run(leaves: Any) -> Any:
            with lock:
                for h in holders:
                    if h.held():
                        return HELD
                order(device, pool)
                copy_in(leaves)
                replay()
                return build(leaves)

        return run


def unless_flags_changed(run: Callable[[Any], Any], captured: Captured, watch: Any,
                         reason: Any) -> Callable[[Any], Any]:
    """``run`` for a plain graph captured under grad mode (a frozen model called without
    ``no_grad``, a whole training step): once a parameter or buffer that ``watch``
    guards requires grad otherwise than at the capture (``requires_grad_()`` calls no
    hook), autograd records the call otherwise (an output needs a history, a module
    outside the optimizer a ``.grad``), so the runner returns :data:`HELD` (the call
    runs eagerly, counted as ``reason``) and marks the watch dirty: the next call drops
    the graphs and captures again."""
    flags = watch.grad_flags()
    now = watch.grad_flags

    def run_checked(leaves: Any) -> Any:
        if now() != flags:
            watch.dirty = True
            captured.held_reason = reason
            return HELD
        return run(leaves)

    return run_checked


def in_inference_mode(run: Callable[[Any], Any], captured: Captured) -> Callable[[Any], Any]:
    """``run`` under ``torch.inference_mode()`` where the captured function entered it
    itself (a forward decorated with ``@torch.inference_mode()``, called outside it):
    its outputs were inference tensors, as eager's are, so the copies handed out are
    made in inference mode too.  Otherwise ``run`` itself."""
    pooled = getattr(captured.build, "pool_outputs", ())
    if torch.is_inference_mode_enabled() or not any(
            isinstance(t, torch.Tensor) and t.is_inference() for t in pooled):
        return run

    def run_inference(leaves: Any) -> Any:
        with torch.inference_mode():
            return run(leaves)

    return run_inference


def versioned(run: Callable[[Any], Any], captured: Captured) -> Callable[[Any], Any]:
    """``run``, then the version counters of what the call wrote advanced as eager's
    in-place operators advance them (a replay writes memory behind autograd's back):
    a tensor that autograd saved before the call, then written by it, makes that
    backward raise as in eager mode.  ``run`` itself where the call writes nothing
    counted (most calls)."""
    positions, state, hidden = captured.bumps
    if not (positions or state or hidden) or versions.increment is None:
        return run
    bump = versions.increment
    fixed = list(state)

    def run_versioned(leaves: Any) -> Any:
        out = run(leaves)
        if out is not HELD:
            tensors = [leaves[i] for i in positions] + fixed if positions else fixed
            if hidden:  # one freed: the graphs go at the next call (its guard)
                tensors = tensors + [t for r in hidden if (t := r()) is not None]
            bump(tensors)
        return out

    return run_versioned
