"""Shape buckets: pad a call's batch up to the next captured size, slice the outputs back.

The rule, precisely:

* The *batch arguments* are the top-level tensor arguments (positional or keyword, not
  nested in containers) that carry the batch: dimension 0 by default, another one or
  none where ``batch_dims`` says so.  Arguments the function writes in place (learned on
  the first call) never carry it by default: caches and tables pass untouched.
* All batch arguments must agree on the batch size B; otherwise the call runs with its
  own shapes (no padding).  The bucket is the smallest size >= B; a call larger than
  the largest bucket runs eagerly and counts as a miss.
* Each batch argument is padded along its batch dimension up to the bucket with its
  ``pad_values`` entry (default 0), into buffers kept per bucket (``padslots``); every
  tensor output whose batch dimension has the bucket's size is sliced back to B rows.
* Padding is only correct when rows do not interact: row-wise ops (linear layers,
  layer norm, attention within a sequence, embedding look-ups) are safe; ops that mix
  rows (batch norm in training mode, reductions or softmax over the batch dimension,
  sorting or top-k across the batch) and writes that depend on the batch (padded rows
  writing into a cache) are not.  Before the first padded replay of each bucket,
  autograph runs the call both ways, eagerly, on copies of the arguments; if the real
  rows or the non-tensor outputs (``x.shape[0]``) differ, or the padded run changes
  anything the real run did not (outside the argument's ``pad_writes`` region, where
  padded rows are allowed to write), padding is switched off for that context (one
  graph per exact shape), with a counted reason.

Per-argument options are read through one resolver (``arguments.Arguments``): names and
positions find the same entry however the call passes the argument.  A call whose key
already replayed through a bucket's buffers skips all of this: it takes its route
(``routes``), keyed once.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

import torch
from torch.utils import _pytree as pytree

from . import padcheck, padslots, routes
from . import switch as _switch
from .arguments import Arguments, Key
from .dispatch import Engine, _compiling, _functorch_active, _tracing
from .keys import leaf_key
from .mutation import WriteRecorder, storage_ptr, watch_map
from .options import Options
from .padding import (
    Batch,
    advanced,
    arg_of,
    copy_back,
    graphable,
    out_dim,
    padded_call,
    rows_of,
    shares_memory,
    slice_back,
    versions_of,
)
from .vocab import EagerReason, Uncapturable, logger


class Learned:
    """What was learned for one context (non-tensor arguments, module mode, grad)."""

    __slots__ = ("written", "verified", "unsafe")

    def __init__(self, written: set[Key]) -> None:
        self.written = written  # canonical keys (see arguments) of arguments written
        # (real rows, bucket) pairs whose padding was checked: code may branch on the
        # real batch size (``if x.shape[0] > 5``), so each real size is checked once
        # (with ranks, (0, bucket): every rank checks a bucket at the same step)
        self.verified: set[tuple[int, int]] = set()
        self.unsafe: str | None = None  # why padding is off in this context


class Bucketer:
    """Pads calls up to ``options.buckets`` in front of an engine; counts the calls."""

    def __init__(self, engine: Engine, options: Options) -> None:
        self.engine = engine
        self.stats = engine.stats
        self.names = engine.names
        self.ranks = engine.ranks  # with a process group: the batch size is agreed
        self.sizes = options.buckets or ()
        self.args = Arguments(engine.names)
        self.dims = self.args.normalize(options.batch_dims)
        self.pads = self.args.normalize(options.pad_values)
        self.writes = self.args.normalize(options.pad_writes)
        self.slots = padslots.PadSlots()
        self.routes = routes.Routes()  # calls whose key replayed before: the short path
        engine.cache.on_forget = self.routes.clear  # a freed graph is not kept by a route
        self._learned: dict[Any, Learned] = {}
        self._plans: dict[Any, list[tuple[Key, int, Key | None]]] = {}

    @property
    def written(self) -> set[Key] | None:
        """The arguments written in place, as learned on the last context (or None)."""
        if not self._learned:
            return None
        return next(reversed(self._learned.values())).written

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        engine = self.engine
        if _compiling() or _tracing() is not None:  # traced: the original, as Engine does
            return engine.fn(*args, **kwargs)
        self.stats.calls += 1
        if kwargs and engine.positional is not None:  # one spelling: by position
            args, kwargs = engine.positional(args, kwargs)
        if (_switch._active or _switch.env_set()) and _switch.is_disabled() \
                or _functorch_active():  # (inside vmap & co: eager, keyed no further)
            return engine.dispatch(args, kwargs)
        if engine.check_guards():  # module state changed: learn and check again
            self._forget()
        if self.routes.table:
            out = self.routes.run(self, args, kwargs)
            if out is not routes.MISS:
                return out
        context = self._context(args, kwargs)
        learned = self._learned.get(context) if context is not None else None
        learning = learned is None and context is not None
        batch = self._batch_args(args, kwargs, learned) if learned and not learned.unsafe else []
        real = rows_of(batch) if batch and graphable(batch[0][1].device) else 0
        if self.ranks is None:
            if learning:
                return self._learn(context, args, kwargs)
            target = real
        else:  # every rank agrees every call, learning or not (the same collectives)
            target, anyone_learning = self.ranks.agree_batch(real, learning)
            if anyone_learning:
                return self._learn(context, args, kwargs) if learning \
                    else engine.dispatch(args, kwargs)
        if not real or not target or learned is None:
            return engine.dispatch(args, kwargs)  # not bucketed (here or on some rank)
        return self._bucketed(args, kwargs, batch, learned, real, target)

    def _bucketed(self, args: tuple[Any, ...], kwargs: dict[str, Any], batch: Batch,
                  learned: Learned, real: int, target: int) -> Any:
        i = bisect.bisect_left(self.sizes, target)
        if i == len(self.sizes):
            self.stats.bucket_misses += 1
            self.stats.count_eager(EagerReason.BUCKET_MISS,
                                   f"largest bucket {self.sizes[-1]}")
            return self.engine.eager(args, kwargs)
        size = self.sizes[i]
        if shares_memory(args, kwargs, batch):  # padding would copy one of the two apart
            return self.engine.dispatch(args, kwargs)
        if size != real and self.ranks is None and self._records(args, kwargs):
            # the padded rows would run through the backward too: a derivative infinite
            # at a padding value (``sqrt`` of a zero row) times their zero gradient is a
            # NaN in every parameter's gradient.  A call of its own size instead
            return self.engine.dispatch(args, kwargs)
        if self.ranks is not None and logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s: rank %d step %d: batch %d, largest of the ranks %d, bucket %d",
                         self.stats.name, self.ranks.rank(), self.ranks.step + 1, real,
                         target, size)
        # with ranks, every rank checks a new bucket at the same step (the check runs
        # the function, and its collectives, eagerly), even where it pads nothing
        checked = (0 if self.ranks is not None else real, size)
        if checked not in learned.verified and (size != real or self.ranks is not None):
            if not self._padding_is_safe(args, kwargs, batch, checked, learned):
                return self.engine.dispatch(args, kwargs)
        eager_before = self.stats.eager
        # a call of the bucket's size too goes through the buffers: one graph per bucket
        if not torch.is_grad_enabled() and self.slots.lock.acquire(blocking=False):
            try:
                out = self._padded(args, kwargs, batch, size, real, learned)
            finally:
                self.slots.lock.release()
        elif size == real:
            out = self.engine.dispatch(args, kwargs)
        else:  # another call (a thread, a nested call) is using the buffers, or grad mode
            # is on (autograd may keep the padded inputs for a backward): new tensors
            padded = padded_call(args, kwargs, batch, size, self._fills(batch))
            tensors = [arg_of(*padded, k) for k, _, _ in batch]
            before = versions_of(tensors)
            out = slice_back(self.engine.dispatch(*padded), size, real, out_dim(batch))
            copy_back(padded, batch, advanced(tensors, before, self._written(batch, learned)),
                      real)
        self.stats.count_bucket(size, real, eager=self.stats.eager != eager_before)
        return out

    def _records(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether autograd records the call: grad mode, and a tensor argument, a
        parameter, buffer, named global or tensor attribute of a module that requires
        grad."""
        if not torch.is_grad_enabled():
            return False
        watch = self.engine.watch
        return watch.requires_grad() or any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for t in (*pytree.tree_leaves((args, kwargs)), *watch.named(),
                      *watch.attribute_tensors()))

    def _padded(self, args: tuple[Any, ...], kwargs: dict[str, Any], batch: Batch,
                size: int, real: int, learned: Learned) -> Any:
        """The call on the bucket's persistent padded buffers (holding ``slots.lock``)."""
        slot = self.slots.slot(batch, size, real, self._fills, self.engine.cache)
        exact = size == real
        if exact and not slot.same:  # an output viewing it could not be mapped back
            return self.engine.dispatch(args, kwargs)
        tensors = [t for _, t, _ in batch]
        buffers = padslots.fill(slot, tensors)
        new_args, new_kwargs = list(args), dict(kwargs)
        for (key, _, _), buf in zip(batch, buffers):
            if isinstance(key, int):
                new_args[key] = buf
            else:
                new_kwargs[key] = buf
        replays = self.stats.replays
        before = versions_of(buffers)
        with slot.pinned:  # captured at their own address: no second copy at replay
            out = self.engine.dispatch(tuple(new_args), new_kwargs)
            if self.stats.replays == replays and self.engine.gave_up(tuple(new_args),
                                                                    new_kwargs):
                # (its Python reads tensor values, say: a branch the padding check saw
                # one way may mix rows the other way)
                self._turn_off(learned, "its padded calls run eagerly")
        written = advanced(buffers, before, self._written(batch, learned))
        if written:
            padslots.hand_back(slot, tensors, written)
        if self.stats.replays != replays and self.ranks is None:  # the next call: its route
            self.routes.make(self, args, kwargs, (tuple(new_args), new_kwargs), batch, slot,
                             written, size, real)
        if exact:  # outputs viewing a buffer: the same views of the caller's tensors
            return padslots.rebased(out, slot, tensors)
        return padslots.unshared(slice_back(out, size, real, slot.out_dim), slot.ptrs)

    def _written(self, batch: Batch, learned: Learned) -> list[int]:
        """Indexes of the batch arguments the function writes in place."""
        canonical = self.args.canonical
        return [i for i, (k, _, _) in enumerate(batch) if canonical(k) in learned.written]

    def _fills(self, batch: Batch) -> list[Any]:
        """The pad value of each batch argument."""
        return [self.pads.get(self.args.canonical(k), 0) for k, _, _ in batch]

    # -- what is learned, per context ---------------------------------------------------
    def _context(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What decides which arguments are written and whether padding is safe besides
        the tensors' rows: the non-tensor arguments by value, the tensor arguments'
        dtypes, the module's mode and grad mode.  None: a call that cannot be keyed."""
        parts: list[Any] = [self.engine.training(), torch.is_grad_enabled()]
        try:
            for x in (*args, *kwargs.values()):
                parts.append(x.dtype if isinstance(x, torch.Tensor) else leaf_key(x))
        except Uncapturable:
            # (a list of caches: the padding check could not see padded rows write
            # into them) one graph per batch size, said once
            if self.stats.padding is None:
                kind = _unkeyed_kind(args, kwargs)
                self.stats.padding = (f"padding off for calls with an argument it cannot "
                                      f"check ({kind}: padded rows' writes into it cannot "
                                      f"be checked); one graph per batch size")
                logger.info("%s: %s", self.stats.name, self.stats.padding)
            return None
        return (len(args), tuple(kwargs), tuple(parts))

    def _learn(self, context: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The first call of a context: run it as it is, eagerly, noting the arguments it
        writes in place and whether it writes module state (then padding is off in this
        context: the check's extra runs would update that state)."""
        self._plan_dims(args, kwargs)  # a batch_dims past an argument's dims raises now
        leaves = list(args) + list(kwargs.values())
        tensors = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
        watched = watch_map(leaves, tensors)
        state = -1  # a position no argument has
        for t in (*self.engine.module_tensors(), *self.engine.watch.named()):
            if t.numel():  # parameters, buffers and the tensors the code names
                watched.setdefault(storage_ptr(t), []).append(state)
        recorder = WriteRecorder(watched)
        # through the engine, whose agreement the ranks join, or which counts a call whose
        # arguments do not fit (eager raises their TypeError) as no learning
        if self.ranks is not None or self.engine.misfit(args, kwargs) is not None:
            with recorder:
                out = self.engine.dispatch(args, kwargs)
        else:  # eagerly: a replay would hide its writes from the recorder
            self.stats.count_eager(EagerReason.LEARNING, warn=False)
            with recorder:
                out = self.engine.eager(args, kwargs)
        keys = self.args.keys_of(args, kwargs)
        # and those ``pad_writes`` declares written (a first call that returned early,
        # on an empty batch, wrote nothing)
        learned = self._learned[context] = Learned(
            {keys[i] for i in recorder.written if i != state} | (set(self.writes) & set(keys)))
        if len(self._learned) > 256:  # ever new non-tensor values: keep it bounded
            self._learned.pop(next(iter(self._learned)))
            self.routes.clear()
        if state in recorder.written:
            self._turn_off(learned, "the call updates module state in place")
        return out

    def batch_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Batch:
        """The arguments that carry the batch in this call (as learned for its context;
        by ``batch_dims`` and the defaults before anything was learned)."""
        context = self._context(args, kwargs)
        learned = self._learned.get(context) if context is not None else None
        return self._batch_args(args, kwargs, learned or Learned(set()))

    def _forget(self) -> None:
        """Learn and check everything again from the next call."""
        self._learned = {}
        self._plans = {}
        self.routes.clear()
        self.slots.clear()
        self.stats.padding = None

    def _turn_off(self, learned: Learned, why: str) -> None:
        learned.unsafe = f"padding off: {why}; one graph per batch size"
        self.routes.clear()
        self.stats.padding = learned.unsafe
        logger.warning("%s: %s", self.stats.name, learned.unsafe)

    def _batch_args(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                    learned: Learned) -> Batch:
        """(position or name, tensor, batch dim) of every argument carrying the batch."""
        shape = (len(args), *kwargs) if kwargs else len(args)
        plan = self._plans.get((shape, id(learned)))
        if plan is None:
            plan = self._plan(args, kwargs, learned.written)
            if len(self._plans) > 64:  # calls of ever new keyword sets: keep it bounded
                self._plans.clear()
            self._plans[(shape, id(learned))] = plan
        return self._dims_of(plan, args, kwargs)

    def _plan_dims(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Batch:
        """The batch arguments by ``batch_dims`` and the defaults alone (nothing learned)."""
        return self._dims_of(self._plan(args, kwargs, set()), args, kwargs)

    @staticmethod
    def _dims_of(plan: list[tuple[Key, int, Key | None]], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Batch:
        out = []
        for key, dim, named in plan:
            value = args[key] if isinstance(key, int) else kwargs[key]
            if isinstance(value, torch.Tensor):
                if dim < value.dim():
                    out.append((key, value, dim))
                elif named is not None:
                    raise ValueError(f"autograph: batch_dims gives argument {named!r} batch "
                                     f"dimension {dim}, but it has {value.dim()} dimensions")
        return out

    def _plan(self, args: tuple[Any, ...], kwargs: dict[str, Any], written: set[Key]
              ) -> list[tuple[Key, int, Key | None]]:
        """(position or name, batch dim, the ``batch_dims`` key that set it or None) of
        the arguments that carry the batch when they are tensors, for calls of this many
        positional arguments and these keywords."""
        plan: list[tuple[Key, int, Key | None]] = []
        for key, canon in zip((*range(len(args)), *kwargs), self.args.keys_of(args, kwargs)):
            dim = self.dims.get(canon, None if canon in written else 0)
            if dim is not None:
                plan.append((key, dim, canon if canon in self.dims else None))
        return plan

    # -- the safety check ---------------------------------------------------------------
    def _padding_is_safe(self, args: tuple[Any, ...], kwargs: dict[str, Any], batch: Batch,
                         checked: tuple[int, int], learned: Learned) -> bool:
        """Run the call eagerly as it is and padded to ``checked``'s bucket, on copies;
        compare what it computes."""
        gens = self.engine.watch.torch_generators(self.engine.fn, (*args, *kwargs.values()))
        problem = padcheck.problem(self.engine.eager, args, kwargs, batch, checked[1],
                                   learned.written, self.args, self._fills(batch), self.writes,
                                   gens)
        if problem is None:
            learned.verified.add(checked)
            return True
        if problem is padcheck.UNCHECKED:  # checked again at the bucket's next call
            return False
        self._turn_off(learned, f"padding changes results ({problem})")
        return False


def _unkeyed_kind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The type of the first argument the padding context cannot key by value (a
    cache object): the calls themselves are keyed and replay, unpadded."""
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            continue
        try:
            leaf_key(x)
        except Uncapturable:
            return f"an argument of type {type(x).__qualname__}"
    return "an argument"
