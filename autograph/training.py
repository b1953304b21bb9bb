"""Warming up and capturing a key that autograd records (see ``backward``).

:func:`warm` is ``lifecycle.warm`` that accepts outputs requiring grad and also learns
what a backward graph would get wrong: hooks registered on tensors by the forward, and
module backward hooks (their Python side effects would run once, at capture).
:func:`capture` records the forward with grad enabled into a pool of its own and
returns a :class:`backward.Trained` graph; a call whose gradients a graph cannot give
exactly as eager does (an argument written in place, an output that requires grad
and is a view of an argument or parameter, a tensor that requires grad read from
outside the arguments and parameters) raises :class:`Uncapturable`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import types
import weakref
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn.utils import parametrize
from torch.utils import _pytree as pytree

from . import gradgraph, lifecycle, notify, replay
from .backward import Trained
from .buffers import _overlaps
from .capture import Backend, OnPool
from .flat import Flat
from .guards import Watch
from .mutation import storage_ptr
from .returned import opened
from .stats import Stats
from .vocab import EagerReason, Uncapturable

UNSUPPORTED = EagerReason.BACKWARD_UNSUPPORTED


def warm(fn: Callable[..., Any], flat: Flat, backend: Backend, device: torch.device,
         watch: Watch, *, learn: bool, timed: bool) -> lifecycle.Warmed:
    """``lifecycle.warm`` for a call that autograd records."""
    hooks: list[str] = []
    inner: list[str] = []  # backward passes run inside the call
    call = _spying(fn, hooks, inner) if learn else fn
    warmed = lifecycle.warm(call, flat, backend, device, watch, learn=learn, timed=timed)
    problem = warmed.problem
    if problem is not None and problem.reason is EagerReason.AUTOGRAD:
        # outputs that require grad: what a training graph is for (``lifecycle.warm``
        # checks everything else before this one)
        problem = None
        if inner:  # its own backward would run once, at capture
            problem = Uncapturable(UNSUPPORTED, "the call runs a backward inside and "
                                   "returns a tensor that requires grad")
    if problem is None and inner and flat.requires_grad():
        # a whole step (nothing leaves the call) whose backward gives an argument a
        # .grad: a static buffer standing in for the argument would take it
        problem = Uncapturable(UNSUPPORTED, "the call runs a backward inside that reaches "
                               "an argument requiring grad")
    if problem is None:
        why = hooks[0] if hooks else backward_hooks(watch)
        if why:
            problem = Uncapturable(UNSUPPORTED, why) if hooks else HooksPresent(UNSUPPORTED, why)
    warmed.problem = problem
    warmed.backward = "backward" in inner  # (``autograd.grad`` leaves .grad alone)
    return warmed


def _spying(fn: Callable[..., Any], found: list[str], inner: list[str]
            ) -> Callable[..., Any]:
    """``fn``, noting whether it registers a hook on a tensor (``Tensor.register_hook``
    is replaced while any spied call runs) and whether it runs a backward pass
    (``torch.autograd.backward`` and ``grad``, which ``Tensor.backward`` calls).  Only
    the call's own thread is spied on (another's backward is not the call's); calls on
    several threads share one installation of the spies (:class:`_Spies`)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _SPIES.on(found, inner):
            return fn(*args, **kwargs)

    return call


class _Spies:
    """The spies of :func:`_spying`, installed while at least one spied call runs (on
    any thread) and removed when the last ends; each thread's spied call notes into
    its own lists (a thread-local), so that calls overlapping on two threads neither
    note each other's backward nor put back each other's spies as the originals."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.originals: tuple[Any, Any, Any] | None = None
        self.local = threading.local()

    @contextlib.contextmanager
    def on(self, found: list[str], inner: list[str]) -> Iterator[None]:
        with self.lock:
            if self.running == 0:
                self._install()
            self.running += 1
        before = getattr(self.local, "lists", None)
        self.local.lists = (found, inner)
        try:
            yield
        finally:
            self.local.lists = before
            with self.lock:
                self.running -= 1
                if self.running == 0:
                    self._remove()

    def _install(self) -> None:
        hook, backward, grad = originals = (
            torch.Tensor.register_hook, torch.autograd.backward, torch.autograd.grad)
        self.originals = originals
        local = self.local

        def register_hook(tensor: torch.Tensor, fn: Any) -> Any:
            lists = getattr(local, "lists", None)
            if lists is not None:
                lists[0].append("the forward registers a hook on a tensor")
            real = getattr(local, "real", None)  # a stand-in's: its parameter's
            if real:
                tensor = real.get(id(tensor), tensor)
            return hook(tensor, fn)

        def spied_backward(*a: Any, **k: Any) -> Any:
            lists = getattr(local, "lists", None)
            if lists is not None:
                lists[1].append("backward")
            return backward(*a, **k)

        def spied_grad(*a: Any, **k: Any) -> Any:
            lists = getattr(local, "lists", None)
            if lists is not None:
                lists[1].append("grad")
            return grad(*a, **k)

        torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]
        torch.autograd.backward, torch.autograd.grad = spied_backward, spied_grad

    def _remove(self) -> None:
        assert self.originals is not None
        hook, backward, grad = self.originals
        torch.Tensor.register_hook = hook  # type: ignore[method-assign]
        torch.autograd.backward, torch.autograd.grad = backward, grad
        self.originals = None


_SPIES = _Spies()


class HooksPresent(Uncapturable):
    """Module backward hooks are registered now: the call runs eagerly while they are,
    and warms up again on its next call (a removed hook gives the graphs back)."""


def backward_hooks(watch: Watch) -> str | None:
    """Why module backward hooks forbid a backward graph, or None."""
    if notify.global_backward_hooks():
        return notify.GLOBAL_BACKWARD
    for root in watch.modules():
        for m in root.modules():
            if m._backward_hooks or m._backward_pre_hooks:
                return f"{type(m).__name__} has backward hooks"
    return None


def capture(fn: Callable[..., Any], flat: Flat, backend: Backend, device: torch.device,
            watch: Watch, inplace: tuple[int, ...], stats: Stats | None = None,
            reuse: bool = False, rng_free: bool = False, stand_ins: bool = True) -> Trained:
    """Capture the forward of a call that autograd records (see ``backward``), over
    stand-ins of the parameters (:class:`StandIns`); a call that runs a backward
    inside or sets a ``.grad`` (a whole step captured without warming up) is captured
    again over the parameters themselves, whose ``.grad`` it reads."""
    if inplace:
        raise Uncapturable(UNSUPPORTED, "the call writes an argument in place")
    why = backward_hooks(watch)
    if why:
        raise Uncapturable(UNSUPPORTED, why)
    leaves = flat.leaves
    wants = [i for i in flat.tensor_pos if leaves[i].requires_grad]
    # the parameters, buffers and named tensors the forward may save for its backward
    # (per storage every tensor: parameters that are views of one flat buffer)
    state: dict[int, list[torch.Tensor]] = {}
    for t in {id(t): t for t in (*watch.tensors(), *watch.named(),
                                 *watch.attribute_tensors()) if t.numel()}.values():
        state.setdefault(storage_ptr(t), []).append(t)
    own = set(state)  # not overwritten by a replay
    saved: dict[int, torch.Tensor] = {}
    # per state tensor saved: the fewest in-place writes the call made to it before
    # saving it (a counter saved before the call adds to it: eager's check raises then)
    offsets: dict[int, int] = {}
    start: dict[int, int] = {}
    saved_args: dict[int, None] = {}  # positions of arguments saved (their static buffers)
    statics: dict[int, list[int]] = {}  # a static buffer's storage: its positions
    spill: dict[tuple[Any, ...], torch.Tensor] | None = {}  # what a replay overwrites
    seen: dict[str, Any] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal spill
        where = _storage_key(t)
        for s in _holding(state.get(where, ()), t):
            saved.setdefault(id(s), s)
            if id(s) in start:
                offset = s._version - start[id(s)]
                offsets[id(s)] = min(offsets.get(id(s), offset), offset)
        for i in statics.get(where, ()):
            saved_args.setdefault(i)
        d = t.detach()  # no version check at unpack: replays rewrite saved tensors
        if where not in own and spill is not None and (d.numel() or not _plain(d)):
            # (an empty tensor, a batch norm's statistics in eval mode, holds nothing)
            if where == 0 or not _plain(d):
                spill = None  # unknown memory: a pending call holds the graph instead
            elif d.numel():
                spill.setdefault((d.data_ptr(), d.dtype, d.shape, d.stride()), d)
        return d

    @functools.wraps(fn)  # (``__wrapped__``: what the watch reads for the user's code)
    def forward(*args: Any, **kwargs: Any) -> Any:
        static = list(args) + list(kwargs.values()) if flat.spec is None else \
            pytree.tree_leaves((args, kwargs))
        for i in wants:
            static[i].requires_grad_(True)
        seen["targets"] = [static[i] for i in wants]
        seen["arguments"] = {id(static[i]) for i in flat.tensor_pos}
        for i in flat.tensor_pos:
            if static[i] is not leaves[i]:  # a static buffer, not the caller's tensor
                statics.setdefault(_storage_key(static[i]), []).append(i)
        seen["start"] = _sequence_now()
        start.update((id(s), s._version) for same in state.values() for s in same
                     if not s.is_inference())
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _unpack), \
                stand.standing():
            out = call(*args, **kwargs)
        out = seen["out"] = stand.returned(out)
        return out

    stand = StandIns(watch if stand_ins and not _parametrize_cached() else None)
    inner: list[str] = []  # backward passes run inside the call, with stand-ins
    hooked: list[str] = []  # hooks it registered on tensors (a stand-in's: its parameter's)
    call = _spying(fn, hooked, inner) if stand.of else fn

    on_pool = OnPool(backend, backend.private_pool(device))
    # outputs cloned one by one: views of one copy returned by the autograd Function
    # would be views created inside a custom Function (in-place on them raises)
    # (made again over the parameters only where there are stand-ins)
    undo = lifecycle.Undo(watch, fn) if stand.of else None
    try:
        base = lifecycle.capture(forward, flat, on_pool, device, watch, (),  # type: ignore[arg-type]
                                 rng_free=rng_free, aliases=False, records=True)
    except Exception:
        if not stand.of:
            raise
        # over stand-ins: code that finds a parameter by identity (``id(w)`` as a key,
        # ``torch.autograd.grad`` imported before the spies) may fail on them where it
        # works on the parameters; the capture over the parameters decides
        base = None
    if hooked:  # as a warmup finds (a capture without one: ``warmup=0``); maybe a
        # set-up made once (``lifecycle.changed_once``: a warmup learns it)
        raise lifecycle.AttributeSet(UNSUPPORTED, hooked[0])
    if base is None or inner or stand.grads_set:  # (a backward inside gave the
        # stand-ins the gradients). The first capture's Python ran: what it set up (a
        # tensor cached lazily, filled by no kernel; a hook) is undone first
        assert undo is not None
        undo()
        return capture(fn, flat, backend, device, watch,
                       inplace, stats, reuse, rng_free, stand_ins=False)
    assert base is not None
    if base.effects is not None:  # Trained's replay does not apply them
        raise Uncapturable(UNSUPPORTED, "the call advances a host counter of an argument "
                           "object (counters.py)")
    out = seen["out"]
    _check_outputs(out, base, leaves, watch)
    trained = Trained(base, on_pool, watch, stats, out, list(saved.values()),
                      None if spill is None else list(spill.values()))
    trained.saved_args = list(saved_args)
    reached = _drop_unreached(trained)
    graph_leaves = gradgraph.leaves(trained.static_diff)
    _inputs_reached(trained, stand, graph_leaves)
    trained.split_bumps(offsets)
    trained.recompute = (fn, flat.rebuilder())
    trained.grad_targets, trained.fold = stand.targets(trained, graph_leaves)
    problem = _foreign(trained.static_diff, trained.grad_targets, seen["start"],
                       _takes_capture_for_tracing(watch), set(statics), seen["arguments"])
    if problem:
        raise Uncapturable(UNSUPPORTED, problem)
    if trained.spill_set is not None:
        trained.spill_set = _with_ctx_tensors(trained.spill_set, trained.static_diff, own)
    if trained.spill_set is not None:
        trained.spill_set = [_spillable(t) for t in trained.spill_set]
    trained.find_saved_outputs()
    if reached is not None:  # (an output saved by a node no output reaches: unchecked)
        trained.saved_outputs = [k for k, t in zip(trained.diff, trained.static_diff)
                                 if k in trained.saved_outputs
                                 and _storage_key(t) in reached]
    trained.needs = _needs(trained)
    if any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
           for m in watch.every_module()):
        # sparse gradients: sized by the call's indices, and no hand-out buffer holds
        # them; the backwards run the captured autograd graph eagerly
        trained.capture_failed = True
    if reuse:
        trained.lend()
    return trained


class StandIns:
    """Per parameter of the watched modules that requires grad, a stand-in for the
    capture: a new leaf over the same memory.  Autograd makes a leaf's gradient
    accumulator once and keeps it while any autograd graph holds it, with the stream
    current when it was made.  The captured forward's autograd graph lives as long as
    the training graph: over the parameters themselves, it would hold their
    accumulators, made on the capture's stream, and every backward through a replay
    would accumulate on that stream (an event and a wait per parameter, as with
    ``make_graphed_callables``).  Over stand-ins, each call's autograd graph makes the
    parameters' accumulators anew on the caller's stream, as eager mode does.  Tensor
    subclasses other than ``nn.Parameter`` keep no stand-in, nor the parameters of
    a scripted module (its code reads its own) or of a recurrent layer (its forward
    notices parameters swapped and rebuilds its ``_flat_weights``)."""

    def __init__(self, watch: Watch | None) -> None:
        """Stand-ins for ``watch``'s parameters (none for None)."""
        self.modules: list[nn.Module] = []  # those holding a parameter with a stand-in
        self.of: dict[int, torch.Tensor] = {}  # a parameter's id: its stand-in
        self.real: dict[int, torch.Tensor] = {}  # a stand-in's id: its parameter
        self.grads_set = False  # the block set a stand-in's .grad (see standing)
        if watch is None:
            return
        modules = watch.every_module()
        known = _known_by_identity(modules)
        if known is None:
            return
        for m in modules:
            d = m.__dict__.get("_parameters")
            if not isinstance(d, dict) or isinstance(m, nn.RNNBase):
                continue
            held = False
            for t in d.values():
                if t is None or not (t.requires_grad and t.is_leaf) \
                        or type(t) not in (torch.Tensor, nn.Parameter) or id(t) in known:
                    continue
                held = True
                if id(t) not in self.of:
                    alias = t.detach()
                    s = nn.Parameter(alias) if type(t) is nn.Parameter \
                        else alias.requires_grad_()
                    # its parameter's attributes, the very dict (``w.lr_mult``, a
                    # flag the forward sets: on the parameter, as in eager mode)
                    s.__dict__ = t.__dict__
                    self.of[id(t)] = s
                    self.real[id(s)] = t
            if held:
                self.modules.append(m)

    @contextlib.contextmanager
    def standing(self) -> Iterator[None]:
        """The watched modules show the stand-ins in their parameters' places to this
        thread for the block (the capture's one forward), and their parameters to every
        other thread (:class:`_Viewed`).  A stand-in holds its parameter's ``.grad``
        meanwhile (code that reads it reads the same tensor); one that holds another at
        the end was given a gradient by the block (``grads_set``: the capture is made
        again over the parameters)."""
        me = threading.get_ident()
        swapped = []
        try:
            for m in self.modules:
                own = m.__dict__["_parameters"]
                stand = {k: self.of[id(t)] for k, t in own.items()
                         if t is not None and id(t) in self.of}
                view = _Viewed(own, stand, self.real, me)
                m.__dict__["_parameters"] = view
                swapped.append((m, own, view))
            for s in self.of.values():
                s.grad = self.real[id(s)].grad
            _SPIES.local.real = self.real  # hooks registered on a stand-in: its parameter's
            yield
        finally:
            _SPIES.local.real = None
            for m, own, view in reversed(swapped):
                if m.__dict__.get("_parameters") is view:
                    m.__dict__["_parameters"] = own
            for s in self.of.values():
                self.grads_set = self.grads_set or s.grad is not self.real[id(s)].grad
                s.grad = None

    def returned(self, out: Any) -> Any:
        """``out`` with each stand-in the call returned (``return self.weight``) replaced
        by its parameter, which the caller gets in eager mode; one inside an object
        pytree does not open cannot be replaced: the call runs eagerly."""
        real = self.real
        if not real:
            return out
        if any(id(v) in real for v in pytree.tree_leaves(out)):
            out = pytree.tree_map(lambda v: real.get(id(v), v), out)
        if any(id(v) in real for v in opened(pytree.tree_leaves(out))):
            raise Uncapturable(UNSUPPORTED, "the call returns a parameter inside an object")
        return out

    def targets(self, trained: Trained, reached: set[int]
                ) -> tuple[list[torch.Tensor], tuple[tuple[int, int], ...]]:
        """What the backward differentiates to: the targets with the stand-ins in the
        parameters' places; a parameter the captured graph also reads itself (through a
        reference of its own, not its module; ``reached``: the ids of the graph's
        leaves) is a target too, after them, and its gradient is added to its
        stand-in's (``fold``: pairs of positions)."""
        targets = [self.of.get(id(t), t) for t in trained.targets]
        fold = []
        for k, t in enumerate(trained.targets):
            if id(t) in self.of and id(t) in reached:
                fold.append((k, len(targets)))
                targets.append(t)
        return targets, tuple(fold)


def _parametrize_cached() -> bool:
    """Whether ``torch.nn.utils.parametrize.cached()`` is active: its cache would keep a
    weight computed from the stand-ins, which the caller's own code would then read."""
    return bool(getattr(parametrize, "_cache_enabled", 0))


_CONTAINERS = (list, tuple, set, frozenset, dict, collections.deque, types.MappingProxyType,
               weakref.WeakSet)
# containers, and items in them, looked into in the modules' attributes; past either,
# no parameter takes a stand-in
MAX_HELD = 10_000
MAX_ITEMS = 200_000
# nn.Module's own attributes (its hook dicts, ``_parameters``...): not the user's
_MODULE_OWN = frozenset(vars(nn.Module()))


def _known_by_identity(modules: list[nn.Module]) -> set[int] | None:
    """The ids of what the modules hold in plain containers of their own, at any depth
    (``self.no_decay = {self.bias}``, ``self.masks = {w: m}``), and the integers their
    dicts and sets hold (``{id(w): m}``): code that finds a parameter by identity there
    would not find its stand-in, so such parameters keep none (their accumulators stay
    on the capture's stream, as before stand-ins).  None where the containers are too
    many or too large to look through (then no parameter takes a stand-in)."""
    ids: set[int] = set()
    todo: list[Any] = []
    for m in modules:
        todo += [v for k, v in vars(m).items()
                 if k not in _MODULE_OWN and isinstance(v, _CONTAINERS) and v]
    seen: set[int] = set()
    budget = MAX_ITEMS
    while todo:
        box = todo.pop()
        if id(box) in seen:
            continue
        seen.add(id(box))
        budget -= len(box)
        if budget < 0 or len(seen) > MAX_HELD:
            return None
        items = [*box.keys(), *box.values()] if isinstance(box, (dict, types.MappingProxyType)) \
            else list(box)
        ids.update(map(id, items))
        for v in items:
            if type(v) is int:  # (``[id(w)]``, ``{id(w): m}``)
                ids.add(v)
            elif isinstance(v, _CONTAINERS):
                if v:
                    todo.append(v)
            elif type(v) is weakref.ref:  # (``[weakref.ref(w)]``)
                ids.add(id(v()))
    return ids


class _Viewed(dict):  # type: ignore[type-arg]
    """A module's parameter dict while a capture runs over stand-ins (``StandIns``):
    the capturing thread reads the stand-ins, every other thread the parameters, as
    nothing had changed; what the forward sets or deletes reaches the module's own
    dict too."""

    def __init__(self, own: dict[str, Any], stand: dict[str, torch.Tensor],
                 real: dict[int, torch.Tensor], thread: int) -> None:
        super().__init__(own)
        self.own, self.stand, self.real, self.thread = own, stand, real, thread

    def __getitem__(self, name: str) -> Any:
        if name in self.stand and threading.get_ident() == self.thread:
            return self.stand[name]
        return dict.__getitem__(self, name)

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return self[name] if name in self else default

    def values(self) -> Any:  # type: ignore[override]
        return [self[k] for k in self]

    def items(self) -> Any:  # type: ignore[override]
        return [(k, self[k]) for k in self]

    def __setitem__(self, name: str, value: Any) -> None:
        real = self.real.get(id(value)) if value is not None else None
        if real is not None:  # a stand-in put back (``functional_call``'s way out)
            self.stand[name] = value
            value = real
        else:
            self.stand.pop(name, None)
        dict.__setitem__(self, name, value)
        self.own[name] = value

    def __delitem__(self, name: str) -> None:
        dict.__delitem__(self, name)
        del self.own[name]
        self.stand.pop(name, None)


def _inputs_reached(trained: Trained, stand: StandIns, leaves: set[int]) -> None:
    """Keep, of the arguments and parameters the replays' Function takes as inputs,
    those the captured graph reaches (``leaves``: the ids of its leaves; an argument's
    static buffer, a parameter itself or its stand-in): autograd runs the gradient
    accumulator of every input and the graph behind it, which eager mode never reaches
    from an unused one (an unused head's hooks would be called with None; an unused
    argument carrying a freed graph, a previous step's output, would raise)."""
    def reached(p: torch.Tensor) -> bool:
        s = stand.of.get(id(p))
        return id(p) in leaves or (s is not None and id(s) in leaves)

    n = len(trained.sources)
    used = [k for k in range(n) if id(trained.targets[k]) in leaves]
    kept = [p for p in trained.inputs_state if reached(p)]
    if len(used) < n or len(kept) < len(trained.inputs_state):
        trained.sources = [trained.sources[k] for k in used]
        trained.inputs_state = kept
        trained.targets = [trained.targets[k] for k in used] + kept


def _drop_unreached(trained: Trained) -> set[int] | None:
    """Keep, of the state and arguments the capture saw saved, what a node the outputs
    reach saved: a tensor saved by a node that no output reaches (a distance matrix
    feeding only an ``argmax``) is read by no backward, and eager's backward does not
    check it (a codebook updated in place after the save, as VQ-VAE's moving average
    does, raises nowhere).  Where a reached node's saved tensors cannot be read,
    everything stays checked (None; else the storages saved by reached nodes)."""
    reached: set[int] = set()
    for node in gradgraph.nodes(trained.static_diff):
        keys = _saved_keys(node)
        if keys is None:
            return None
        reached |= keys
    statics = dict(zip(trained.static.positions, trained.static.buffers))
    trained.saved_state = [t for t in trained.saved_state if _storage_key(t) in reached]
    trained.saved_args = [i for i in trained.saved_args
                          if _storage_key(statics[i]) in reached]
    return reached


def _needs(trained: Trained) -> list[frozenset[int]] | None:
    """Per differentiable output of a graph with several, the saved tensors (indexes
    as ``_Replay.forward`` lists them: state, arguments, outputs) that the autograd
    graph behind it saved: its backward reads those only.  None (check them all, as
    autograd does) for one output, or where a node's saved tensors cannot be read (a
    custom Function keeps them its own way)."""
    if len(trained.diff) < 2:
        return None
    statics = dict(zip(trained.static.positions, trained.static.buffers))
    outputs = dict(zip(trained.diff, trained.static_diff))
    keys = [_storage_key(t) for t in trained.saved_state]
    keys += [_storage_key(statics[i]) for i in trained.saved_args]
    keys += [_storage_key(outputs[k]) for k in trained.saved_outputs]
    needs = []
    for out in trained.static_diff:
        read: set[int] = set()
        for node in gradgraph.nodes([out]):
            saved = _saved_keys(node)
            if saved is None:
                return None
            read |= saved
        needs.append(frozenset(i for i, key in enumerate(keys) if key in read))
    return needs


def _saved_keys(node: Any) -> set[int] | None:
    """The storages of the tensors an autograd node saved (its ``_saved_*``
    attributes), or None where they cannot be read: a custom Function's; an in-place
    write into a view (``CopySlices`` hides the node that saved); a tensor saved
    through another hook than the capture's (activation checkpointing, whose unpack
    would run the forward again)."""
    if isinstance(node, torch.autograd.function.BackwardCFunction) \
            or type(node).__name__ == "CopySlices":
        return None
    keys: set[int] = set()
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            if _foreign_unpack(getattr(node, "_raw" + name, None)):
                return None
            value = getattr(node, name)
        except Exception:  # noqa: BLE001 - one freed or unreadable: judge it unknown
            return None
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor):
                keys.add(_storage_key(t))
    return keys


def capturer(stats: Stats) -> Callable[..., Trained]:
    """:func:`capture` with the callable's counters, in ``lifecycle.capture``'s form."""
    def capture_for(fn: Callable[..., Any], flat: Flat, backend: Backend,
                    device: torch.device, watch: Watch, inplace: tuple[int, ...],
                    reuse: bool = False, rng_free: bool = False) -> Trained:
        return capture(fn, flat, backend, device, watch, inplace, stats, reuse, rng_free)

    return capture_for


def _plain(t: torch.Tensor) -> bool:
    """A plain strided tensor (whose memory a spill can copy)."""
    return type(t) is torch.Tensor and t.layout is torch.strided


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _holding(tensors: Collection[torch.Tensor], t: torch.Tensor) -> Collection[torch.Tensor]:
    """Of the state tensors over one storage, the tightest whose memory holds all of
    ``t``'s (the one parameter of a flat buffer that an operator saved, not the buffer
    holding them all); all of them where none does (a saved tensor spanning several)."""
    if len(tensors) < 2:
        return tensors
    lo = t.data_ptr()
    hi = lo + _span(t)
    inside = [s for s in tensors if s.data_ptr() <= lo and hi <= s.data_ptr() + _span(s)]
    if not inside:
        return tensors
    tightest = min(_span(s) for s in inside)  # (the parameter, not the flat buffer)
    return [s for s in inside if _span(s) == tightest]


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to just past its last (strides non-negative)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


def _storage_key(t: torch.Tensor) -> int:
    try:
        return storage_ptr(t)
    except (RuntimeError, NotImplementedError):
        return 0


def _sequence_now() -> int:
    """The sequence number of an autograd node made now (on this thread): the nodes a
    capture makes come after it."""
    probe = torch.zeros((), requires_grad=True) * 1
    return int(probe.grad_fn._sequence_nr())  # type: ignore[union-attr]


def _check_outputs(out: Any, base: replay.Captured, leaves: Any, watch: Watch) -> None:
    """An output that requires grad must live in the pool (it is cloned and connected
    to autograd per call), or be a parameter or argument itself (returned as it is)."""
    pooled = {id(t) for t in getattr(base.build, "pool_outputs", ())}
    own = {id(t) for t in watch.tensors()} | {id(b) for b in base.static.buffers}
    own.update(id(t) for t in leaves if isinstance(t, torch.Tensor))
    for t in opened(pytree.tree_leaves(out)):
        if not isinstance(t, torch.Tensor) or not t.requires_grad or id(t) in own:
            continue
        if t.is_leaf:  # ``torch.zeros(..., requires_grad=True)``: eager's is a leaf
            raise Uncapturable(UNSUPPORTED, "an output is a tensor requiring grad that "
                               "the call made (a leaf, whose .grad a replay cannot fill)")
        if id(t) not in pooled:
            raise Uncapturable(UNSUPPORTED, "an output that requires grad is a view of "
                               "an argument or parameter")


_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size,
          slice, type(Ellipsis))


def _with_ctx_tensors(spill: list[torch.Tensor], outs: list[torch.Tensor], own: set[int]
                      ) -> list[torch.Tensor] | None:
    """``spill`` and the tensors that custom ``autograd.Function`` nodes of the captured
    graph keep as ``ctx`` attributes (no saved-tensor hook sees those), or None if such
    a node keeps something whose tensors cannot be known (then nothing is spilled)."""
    extra = {id(t): t for t in spill}
    for node in gradgraph.nodes(outs):
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            for leaf in pytree.tree_leaves(vars(node)):
                if isinstance(leaf, torch.Tensor):
                    if type(leaf) is not torch.Tensor or leaf.layout is not torch.strided:
                        return None
                    if _storage_key(leaf) not in own and leaf.numel():
                        extra.setdefault(id(leaf), leaf.detach())
                elif not isinstance(leaf, _PLAIN):
                    return None
    return list(extra.values())


def _spillable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or where elements of it share memory (an expanded view, BERT's default
    ``token_type_ids``) the dense span of its storage it covers: a copy cannot be
    written back into a tensor that overlaps itself."""
    if not _overlaps(t):
        return t
    low = t.storage_offset()
    high = low + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    span = torch.empty(0, dtype=t.dtype, device=t.device)
    return span.set_(t.untyped_storage(), low, (high - low + 1,), (1,))


# torch.utils.checkpoint's reentrant Function (use_reentrant=True)
_REENTRANT: Any = getattr(torch.utils.checkpoint, "CheckpointFunction", None)


def _takes_capture_for_tracing(watch: Watch) -> bool:
    """Whether the watched modules include transformers' (whose code takes a stream
    capture for tracing, ``is_tracing``, and builds its attention masks otherwise)."""
    return any(type(m).__module__.startswith("transformers.") for m in watch.every_module())


def _recomputes(node: Any) -> bool:
    """Whether ``node`` saved a tensor through another hook than the capture's
    (activation checkpointing's: its unpack runs the forward again, eagerly, outside
    the capture)."""
    for name in dir(node):
        if name.startswith("_raw_saved_"):
            try:
                raw = getattr(node, name, None)
            except Exception:  # noqa: BLE001 - freed: not one to judge by
                continue
            if _foreign_unpack(raw):
                return True
    return False


def _foreign_unpack(raw: Any) -> bool:
    """Whether a node's raw saved value (or tuple of them) unpacks through another hook
    than the capture's (activation checkpointing's)."""
    return any(r is not None and getattr(r, "unpack_hook", _unpack) not in (None, _unpack)
               for r in (raw if isinstance(raw, (tuple, list)) else (raw,)))


def _foreign(outs: list[torch.Tensor], targets: list[torch.Tensor], start: int,
             capture_branches: bool = False, local: Collection[int] = (),
             arguments: Collection[int] = ()) -> str | None:
    """Why the captured autograd graph reaches beyond the call (a tensor that requires
    grad and is no argument or parameter, or one computed with autograd before the
    call): gradients would not reach it; or why its backward cannot run (checkpointing
    in code that branches on a capture: its recomputation, outside the capture, takes
    the other branch and fails checkpointing's check).  None if neither.

    A leaf over the memory of an argument's static buffer (storages in ``local``) was
    made by the call: wav2vec2's feature encoder sets ``requires_grad`` on a view of its
    input, whose ``.grad`` no one outside the call can read (the gradient stops there in
    eager mode too); the backward graph leaves it out.  Not the argument itself (ids in
    ``arguments``: the caller holds it), nor a returned one."""
    allowed = {id(t) for t in targets}
    returned = {id(t) for t in outs} | set(arguments)
    for node in gradgraph.nodes(outs):
        if _REENTRANT is not None and getattr(node, "_forward_cls", None) is _REENTRANT:
            return "reentrant activation checkpointing (use_reentrant=True) runs a " \
                   "backward of its own, which torch.autograd.grad refuses"
        if capture_branches and _recomputes(node):
            return "activation checkpointing in transformers' code, which builds other " \
                   "tensors while a capture runs than in the recomputation"
        var = getattr(node, "variable", None)
        if var is not None:  # AccumulateGrad: a leaf
            if id(var) not in allowed and (
                    _storage_key(var) not in local or id(var) in returned):
                return "the forward reads a tensor that requires grad and is no argument, " \
                       "parameter or buffer"
            continue
        if node._sequence_nr() < start:
            return "the forward reads a tensor computed with autograd before the call"
    return None
