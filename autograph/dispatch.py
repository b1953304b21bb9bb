"""The engine behind every graphed callable: key the call, find its entry, act.

A call is keyed (``keys.key_call``); its entry (``cache``) says what to do: replay a
ready graph, warm up a new key, capture it (``lifecycle``), or run eagerly for the
entry's reason (warming up and capturing are in ``recording``).  With ``group``, the
ranks agree on that action first (``ranks``).  The replay path is short on purpose:
kill switch, key, entry, bound replay.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import (
    containers,
    lifecycle,
    notify,
    recording,
    replay,
    shortcut,
    training,
    verify,
    vocab,
)
from . import stats as _stats
from . import switch as _switch
from .arguments import Misfit, Positional, no_misfit
from .cache import Entry, GraphCache
from .capture import Backend, backend_for
from .flat import Flat
from .guards import Watch, running_stack
from .keys import GraphKey, key_call, with_sharing
from .memo import KeyMemo
from .modes import modes, saved_hooks
from .options import Options, same_options
from .ranks import Ranks
from .stats import Stats
from .verify import every_from_env
from .vocab import Action, EagerReason, State, Uncapturable, logger

_profiling = shortcut._profiling  # the probes the shortcut reads, read here too
_NO_RANGE = contextlib.nullcontext()
record_function = torch.autograd.profiler.record_function
_is_nested = lifecycle.is_nested
_grad_enabled = torch.is_grad_enabled
_nesting = lifecycle.nested_block
_HELD = replay.HELD
_MISS = shortcut.MISS
# True while torch.compile traces (Dynamo evaluates it so); False when code runs
_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", lambda: False)
_saved_hooks_enabled: Callable[[], bool] = getattr(
    torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: True)
# ``torch.jit.trace`` under way (its tracing state, else None): a trace must record the
# original's operators, not a replay of buffers it would keep as constants
_tracing: Callable[[], Any] = getattr(torch._C, "_get_tracing_state", lambda: None)
_functorch_active = shortcut._functorch_active

# When a callable stops trying: this many new keys (or ``max_graphs`` if more) in a row
# without a replay or a capture (keys that never repeat); after failed captures,
# ``recording.GIVE_UP_FAILURES``.
GIVE_UP_FRESH_KEYS = 64
RESIZED = "a caller resized an output's storage (outputs='reuse'): capturing again"
MOVED = "its arguments' addresses moved and the last ones never replayed"


def argument_kinds(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The types of a call's arguments, keywords by name: what tells a new kind of
    call (a ``StaticCache`` where a ``DynamicCache`` was) from more of the same."""
    return (tuple(map(type, args)), tuple((k, type(v)) for k, v in kwargs.items()))


COLLECTED = "transformers collects the layers' outputs through their hooks (a caller's " \
    "output_hidden_states)"
MARKS_GRAD = ("transformers' gradient-checkpointing hook on the input embeddings marks "
              "their output as requiring grad (graphed past where autograd records nothing)")


CHURN_WARNING = 8  # invalidations in a row without a replay, before a warning


class Engine:
    """Graphs of one callable (a function, or one module instance's forward).

    ``fn`` is called as ``fn(*args, **kwargs)``.  ``watch`` guards the Python state the
    graphs bake in; ``training`` returns the module's training flag (or None); ``misfit``
    says why a call's arguments do not bind to its parameters, if they do not."""

    def __init__(self, fn: Callable[..., Any], options: Options, stats: Stats, watch: Watch,
                 training: Callable[[], Any], names: list[str] | None = None,
                 misfit: Misfit = no_misfit) -> None:
        self.fn = fn
        self.stats = stats
        self.watch = watch
        self.training = training
        self.names = names or []  # positional parameter names, for per-argument options
        self.misfit = misfit
        # keyword arguments that name the next positional parameters, passed by position
        self.positional: Positional | None = None
        self.options = options
        self.cache = GraphCache(options, stats)
        self.ranks: Ranks | None = None
        self._device: tuple[Any, Backend | None, Callable[[], bool]] = (None, None, bool)
        self.labels = {what: f"autograph.{what} {stats.name}"
                       for what in ("replay", "capture", "warmup", "eager")}
        self._use_options(options)

    def set_options(self, options: Options) -> None:
        """Use these options from the next call on (a region passes its own)."""
        if options is self.options or same_options(options, self.options):
            return  # a new region per step passes equal options: keep what was learned
        if options.outputs != self.options.outputs:
            self.reset()  # the graphs hand out their outputs the other way
        self._use_options(options)

    def _use_options(self, options: Options) -> None:
        self.options = self.cache.options = options
        self.ranks = Ranks(options.group) if options.group is not None else None
        self.trains = options.backward and self.ranks is None  # graphs under autograd
        self.memo = KeyMemo()  # its shortcuts were made under the options before
        self.cache.memo = weakref.ref(self.memo)
        every = options.verify_every
        self.verify_every = every if every is not None else every_from_env()
        self.given_up: str | None = None  # why this callable stopped trying, if it did
        # the kinds of arguments of the calls that made it stop (``argument_kinds``):
        # calls of other kinds (a generate switched to a static cache) try again
        self._given_up_kinds: set[Any] = set()
        self.failures = 0  # keys given up after a failed capture
        self._churn = 0  # invalidations in a row with no replay between (``invalidate``)
        self._replays_seen = -1
        self._fresh = 0  # new keys since the last replay or capture

    # -- the call ----------------------------------------------------------------------
    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call of the graphed callable, counted; traced by ``torch.compile`` or
        ``torch.jit.trace``, the original (traced with its caller, not counted)."""
        if _compiling() or _tracing() is not None:
            return self.fn(*args, **kwargs)
        self.stats.calls += 1
        if kwargs and self.positional is not None:  # one spelling: by position
            args, kwargs = self.positional(args, kwargs)
        if not kwargs and self.given_up is None:
            n = len(args)
            for known in self.memo.recent:  # memo.find: were these tensors keyed lately?
                if known.n == n and known.check(*args):
                    short = known.shortcut  # and did their last key replay?
                    if short is not None and (out := short(args)) is not _MISS:
                        self._fresh = 0
                        return out
                    break
            # the graphs these hold may be dropped below: they must not outlive that
            # (a training graph's autograd nodes would be linked into the eager call's)
            known = short = None  # type: ignore[assignment]
        return self.dispatch(args, kwargs)

    def dispatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one call (counted by the caller): replay, warm up, capture or eager."""
        if (_switch._active or _switch.env_set()) and _switch.is_disabled():
            self.stats.count_eager(EagerReason.DISABLED, warn=False)
            return self.fn(*args, **kwargs)
        if self.ranks is None:  # the cheap eager paths: no key needed to know
            if self.given_up is not None:
                kinds, kind = self._given_up_kinds, argument_kinds(args, kwargs)
                if not kinds or kind in kinds:
                    self.stats.count_eager(EagerReason.GIVEN_UP, self.given_up, warn=False)
                    return self.fn(*args, **kwargs)
                kinds.add(kind)  # a kind that never tried: it tries once
                self.given_up, self._fresh = None, 0
            watch = self.watch
            if _grad_enabled() and not watch.stale and not self.trains \
                    and watch.requires_grad():
                self.stats.count_eager(EagerReason.AUTOGRAD)
                return self.eager(args, kwargs)
        try:
            key, flat, backend, device = self._key(args, kwargs)
            entry = self.cache.entries.get(key)
            if entry is None:
                entry = self._new_entry(key, args, kwargs, flat)
        except Uncapturable as exc:
            if self.ranks is not None and not _is_nested():
                self.ranks.agree(Action.EAGER, 0, self.stats.name)
            self.stats.count_eager(exc.reason, exc.detail)
            out = self.eager(args, kwargs)  # a call that does not fit raises its TypeError
            if exc.reason is EagerReason.BAD_ARGUMENTS:  # it ran (a pre-hook, a replaced
                self.misfit = no_misfit  # forward): the signature cannot judge calls
            return out
        run = entry.run
        if run is not None and self.ranks is None:
            out = self.replay_entry(entry, run, flat)
            shortcut.learn(self, args, key, flat, entry, run)
            return out
        if entry.cold and self.ranks is None:  # (ranks agree on every action instead)
            entry.cold = False
            self.stats.count_eager(EagerReason.WARMUP, MOVED, warn=False)
            return self.eager(*flat.call())
        # an object argument (objects.py) is learned by one warmup run even under
        # warmup=0: a capture runs the Python once, and its changes must be known first
        action = (Action.REPLAY if run is not None
                  else Action.EAGER if entry.state is State.EAGER
                  else Action.WARM if entry.runs < self.options.warmup or (
                      (flat.objects or entry.warm_first) and not entry.runs)
                  else Action.CAPTURE)
        if self.ranks is not None and not _is_nested():
            digest = entry.digest
            if digest is None:  # hashing the key's text costs tens of µs: once per entry
                digest = entry.digest = key.digest()
            agreed = Action(self.ranks.agree(action, digest, self.stats.name))
            if agreed is not action:
                return self._follow(agreed, key, entry, flat, backend, device)
        return self.act(action, key, entry, flat, backend, device)

    def act(self, action: Action, key: GraphKey, entry: Entry, flat: Flat, backend: Backend,
             device: torch.device) -> Any:
        if action is Action.REPLAY:
            return self.replay_entry(entry, entry.run, flat)  # type: ignore[arg-type]
        if action is Action.EAGER:
            self.stats.count_eager(entry.reason or EagerReason.CAPTURE_FAILED, entry.detail)
            return self.eager(*flat.call())
        if action is Action.WARM:
            return recording.warm(self, key, entry, flat, backend, device)
        return recording.capture(self, key, entry, flat, backend, device)

    def _follow(self, agreed: Action, key: GraphKey, entry: Entry, flat: Flat,
                backend: Backend, device: torch.device) -> Any:
        """Do what the ranks agreed on instead of what this rank proposed (a step behind
        the others, never ahead: the agreed action is the least advanced proposal)."""
        if agreed is Action.CAPTURE:  # another rank lost its graph: capture again with it
            with self.cache.lock:
                if entry.state is State.READY:
                    self.cache.forget_graph(entry)
        if agreed in (Action.WARM, Action.CAPTURE):
            return self.act(agreed, key, entry, flat, backend, device)
        ranks = self.ranks
        if ranks is not None and ranks.closed:
            self.stats.count_eager(EagerReason.RANKS_BEHIND, "its process group was destroyed")
        else:
            self.stats.count_eager(EagerReason.RANKS_DISAGREE if ranks is not None and
                                   ranks.keys_differ else EagerReason.RANKS_BEHIND)
        return self.eager(*flat.call())

    def _key(self, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[GraphKey, Flat, Backend, torch.device]:
        """Key the call, or raise Uncapturable with the reason it must run eagerly."""
        if _nesting.active and _is_nested():
            raise Uncapturable(EagerReason.NESTED)
        if _functorch_active():  # its tensors are wrappers without storage to copy
            raise Uncapturable(EagerReason.UNKEYABLE, vocab.IN_TRANSFORM)
        watch = self.watch
        if not watch.ok():  # first: the key reads the watched modules' training flags
            self.check_guards()
        if watch.unkeyable is not None:
            raise Uncapturable(EagerReason.UNKEYABLE, watch.unkeyable)
        key, flat, device = key_call(args, kwargs, modes, self.training, self.memo)
        last = self._device
        if last[0] != device:
            last = self._device = _find_backend(device)
        if last[2]():
            raise Uncapturable(EagerReason.CAPTURING)
        if watch.hook_reason or notify.global_hooks():
            hooked = watch.hooks()
            if hooked:
                raise Uncapturable(EagerReason.HOOKS, hooked)
        if watch.collects and notify.collector():
            raise Uncapturable(EagerReason.HOOKS, COLLECTED)
        if key.modes[0] and self._autograd_records(flat):
            if watch.marks_grad and watch.still_marks_grad():
                raise Uncapturable(EagerReason.HOOKS, MARKS_GRAD)
            # backward hooks: set up as modules run, where autograd records
            if notify.global_backward_hooks():
                raise Uncapturable(EagerReason.BACKWARD_UNSUPPORTED, notify.GLOBAL_BACKWARD)
            if watch.backward_recheck:
                watch.backward_recheck = False  # (before the look: one registered meanwhile)
                why = training.backward_hooks(watch)
                if why:
                    watch.backward_recheck = True
                    raise Uncapturable(EagerReason.BACKWARD_UNSUPPORTED, why)
            if not self.trains:
                raise Uncapturable(EagerReason.AUTOGRAD)
            if flat.inference():  # eager mode raises when autograd saves one
                raise Uncapturable(EagerReason.BACKWARD_UNSUPPORTED, vocab.INFERENCE_ARGUMENT)
            if saved_hooks():
                raise Uncapturable(EagerReason.BACKWARD_UNSUPPORTED, vocab.SAVED_HOOKS)
            if not _saved_hooks_enabled():
                raise Uncapturable(EagerReason.BACKWARD_UNSUPPORTED, vocab.HOOKS_DISABLED)
        cache = self.cache
        if cache.state_bases and flat.tensor_pos:  # an argument sharing written state
            key = with_sharing(key, flat, cache.state_bases)
        if cache.inplace or cache.pinning:
            key = cache.address(key, flat)
        return key, flat, last[1], device  # type: ignore[return-value]

    def for_backward(self, key: GraphKey, flat: Flat) -> bool:
        """Whether this key is captured for training (``training``, ``backward``)."""
        return self.trains and bool(key.modes[0]) and self._autograd_records(flat)

    def _autograd_records(self, flat: Flat) -> bool:
        return flat.requires_grad() or self.watch.requires_grad()

    def _new_entry(self, key: GraphKey, args: tuple[Any, ...], kwargs: dict[str, Any],
                   flat: Flat) -> Entry:
        misfit = self.misfit(args, kwargs)  # arguments that do not bind: eager raises
        if misfit is not None:  # their TypeError, with no warmup counted and no entry made
            raise Uncapturable(EagerReason.BAD_ARGUMENTS, misfit)
        entry = self.cache.entry(key, flat)
        if entry.cold:  # the addresses of a known structure moved: no new kind of call
            return entry
        self._fresh += 1
        if self._fresh >= max(GIVE_UP_FRESH_KEYS, self.options.max_graphs) \
                and self.ranks is None:  # (a sampler's 100 steps, max_graphs=256: they repeat)
            self.give_up_all(f"{self._fresh} new keys in a row without a replay")
            self._given_up_kinds.add(argument_kinds(args, kwargs))
        return entry

    def keys_repeat(self) -> None:
        """A key came back (a capture after warmups): no reason to give up yet."""
        self._fresh = 0

    def give_up_all(self, why: str) -> None:
        """Stop warming up and capturing: every later call runs eagerly at once."""
        self.given_up = why
        logger.warning("%s: %s; graphs do not pay here, so it runs eagerly from now on "
                       "(autograph.reset() tries again)", self.stats.name, why)

    def check_guards(self) -> bool:
        """Bring the guard up to date: True (and the graphs dropped) if state that the
        graphs bake in changed since the last check."""
        watch = self.watch
        if watch.ok():
            return False
        if watch.stale:
            watch.refresh()
            return False
        self.invalidate()
        return True

    def module_tensors(self) -> list[torch.Tensor]:
        """The parameters and buffers the callable's graphs read."""
        if self.watch.stale:
            self.watch.refresh()
        return list(self.watch.tensors())

    def gave_up(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether the key of these arguments runs eagerly for good because its capture
        failed (its Python reads tensor values, say): a bucketer then stops padding, as
        a padded call that never replays only risks its results.  Not for what holds
        for one call only (a hook, a mode) or reasons padding has no part in."""
        try:
            entry = self.cache.entries.get(self._key(args, kwargs)[0])
        except Uncapturable:
            return False
        return entry is not None and entry.state is State.EAGER \
            and entry.reason is EagerReason.CAPTURE_FAILED

    def eager(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The original call, uncounted (under the watch, in a profiler range)."""
        stack = running_stack()  # ``with running(watch)``, without its two calls
        watch = self.watch
        unchanged = not watch.refs_moved() and watch.values_same()
        watch.forget_assignments()  # (what this call assigns, below)
        stack.append(watch)
        try:
            if _profiling():
                with record_function(self.labels["eager"]):
                    return self.fn(*args, **kwargs)
            return self.fn(*args, **kwargs)
        finally:
            stack.pop()
            # a module attribute it left changed: its own change (the watch keeps none
            # of what it assigned alive)
            assigned = watch.assigned_and_kept()
            watch.forget_assignments()
            if assigned is not None:
                self.own_change()
            if watch.refs_moved() or not watch.values_same():
                # a name it reads or a container a module holds changed: its own change
                # only where nothing had changed before the call (no guard may have
                # checked on the way here), and then dropping graphs that baked it in
                if unchanged:
                    self.own_change()
                else:
                    watch.dirty = True

    def own_change(self) -> None:
        """A call (run eagerly, or captured: its change made twice) changed state that
        graphs bake in: a module attribute, a name its code reads, a container a module
        holds.  Graphs of other keys may have baked the old value in: dropped (at the
        next call); with none, the guard takes what the call left (a submodule or a
        parameter it made, as a head built at the first call: read at the next call,
        whose graph reads it)."""
        watch = self.watch
        if any(e.graph is not None for e in list(self.cache.entries.values())):
            watch.dirty = True
        else:
            watch.accept_refs()
            watch.accept_values()
            if watch.grown:
                watch.stale = True
        watch.grown = False

    def reset(self, keep_known: bool = False) -> None:
        """Drop every graph and forget what was learned about the arguments (and try
        graphs again if this callable had stopped trying); ``cache.clear``."""
        self.cache.clear(keep_known)
        self.watch.stale = True
        self.given_up = None
        self._given_up_kinds = set()
        self.failures = self._fresh = 0

    def invalidate(self) -> None:
        stats = self.stats
        stats.invalidations += 1
        logger.debug("%s: module state changed, dropping %d graphs", stats.name, stats.graphs)
        # dropped again before any replay: state that changes between every two calls
        # (a global rebuilt per step); said once, as the eager calls count as warmups
        self._churn = self._churn + 1 if stats.replays == self._replays_seen else 0
        self._replays_seen = stats.replays
        if self._churn == CHURN_WARNING:
            logger.warning("%s: the graphs were dropped %d times in a row without a replay "
                           "between: something the call reads (a parameter, an attribute, a "
                           "global it names) changes between calls, so every call warms up "
                           "eagerly; keep it fixed, or pass it as an argument",
                           stats.name, CHURN_WARNING)
        self.reset(keep_known=self.watch.moved_only())  # same behaviour: no new warmup
        self.watch.refresh()

    # -- replay ------------------------------------------------------------------------
    def replay_entry(self, entry: Entry, run: Callable[[Any], Any], flat: Flat) -> Any:
        """Replay ``entry`` for these arguments; if the replay itself fails, drop the
        graph and run eagerly."""
        graph = entry.graph  # once: another thread's reset may drop it meanwhile (None)
        if self.verify_every is not None:
            entry.runs += 1
            # not verified: graphs that draw random numbers (their replays differ from
            # eager by design) and calls with object arguments (an eager rerun would
            # advance the object's own state, a cache's, a second time)
            if entry.runs % self.verify_every == 0 and graph is not None \
                    and not (graph.seeded or flat.objects):
                result = verify.verified(self, entry, run, flat)
                return containers.apply(entry.syncs, flat, result) if entry.syncs \
                    else result
        try:
            if _profiling():
                with record_function(self.labels["replay"]):
                    result = run(flat.leaves)
            else:
                result = run(flat.leaves)
        except Exception as exc:  # noqa: BLE001 - a failed launch: eager is still right
            return self.replay_failed(entry, exc, flat)
        if result is _HELD:
            if graph is not None and graph.outputs_moved():
                return self.recapture_moved(entry, flat)
            return self.protect(flat, graph.held_reason if graph is not None else None)
        if entry.syncs:  # container arguments the call changes (containers.py)
            result = containers.apply(entry.syncs, flat, result)
        self.replayed(entry)
        return result

    def replayed(self, entry: Entry) -> None:
        """Count a replay of ``entry``: the callable's replays, its entry last used
        (the least recently used goes first), no new keys since."""
        self.stats.replays += 1
        if _stats._observers:
            self.stats.notify("replay")
        self._fresh = 0
        cache = self.cache
        cache.uses = entry.used = cache.uses + 1  # a stamp: races are harmless

    def protect(self, flat: Flat, held: tuple[EagerReason, str] | None = None) -> Any:
        """An earlier output of the graph is still held (``outputs="reuse"``), or what
        an earlier call saved for its backward (``held``): run the call eagerly rather
        than overwrite it."""
        if held is not None:
            self.stats.count_eager(*held)
            return self.eager(*flat.call())
        self.stats.outputs_protected += 1
        self.stats.count_eager(EagerReason.OUTPUTS_HELD, warn=False)
        return self.eager(*flat.call())

    def recapture_moved(self, entry: Entry, flat: Flat) -> Any:
        """A caller resized an output's storage (``outputs="reuse"``): the graph would
        write memory it no longer owns, so it is dropped, this call runs eagerly and
        the key is captured again."""
        with self.cache.lock:
            if entry.state is State.READY:
                self.cache.forget_graph(entry)
        self.stats.count_eager(EagerReason.WARMUP, RESIZED)
        return self.eager(*flat.call())

    def replay_failed(self, entry: Entry, exc: Exception, flat: Flat,
                       counted: bool = True) -> Any:
        detail = lifecycle._first_line(exc)
        with self.cache.lock:
            if entry.state is State.READY:
                self.cache.forget_graph(entry)
            elif entry.graph is not None and not counted:
                entry.graph = None
            entry.give_up(EagerReason.REPLAY_FAILED, detail)
        self.stats.count_eager(EagerReason.REPLAY_FAILED, detail)
        return self.eager(*flat.call())

    def profiler_range(self, what: str) -> contextlib.AbstractContextManager[Any]:
        """A named range in torch.profiler traces (and Nsight, under ``emit_nvtx``)
        while a profiler runs; nothing otherwise."""
        return record_function(self.labels[what]) if _profiling() else _NO_RANGE


def _find_backend(device: torch.device) -> tuple[Any, Backend, Callable[[], bool]]:
    """(device, its backend, the backend's is-capturing probe), cached per engine."""
    backend = backend_for(device)
    if backend is None:
        raise Uncapturable(EagerReason.DEVICE, f"inputs on {device.type}")
    return device, backend, backend.capturing(device)

