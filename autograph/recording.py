"""Warming up and capturing a key: what an engine does before a key can replay.

``dispatch.Engine`` decides (key -> entry -> action); for the actions ``WARM`` and
``CAPTURE`` it calls :func:`warm` and :func:`capture` here, which run the call through
``lifecycle`` (or ``training`` for a call that autograd records), learn what it writes,
keep the graph within the memory budget and the ``min_speedup`` trial, and turn a
failed capture into an eager run with its reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import containers, gate, lifecycle, replay, rng, rotation, training
from .backward import Trained
from .cache import Entry, GraphCache
from .capture import Backend
from .flat import Flat
from .keys import GraphKey
from .known_types import keyer_for
from .modes import modes
from .mutation import storage_ptr
from .objects import ObjectKey
from .vocab import Action, EagerReason, State, Uncapturable, logger

if TYPE_CHECKING:  # the engine calls in; this module never calls it at import
    from .dispatch import Engine

CHANGED_DURING = "the modes or training flags changed while it was captured"
MOVED_AWAY = ("its entry was dropped (a reset, an eviction) or moved to another "
              "thread's written arguments while it waited")
# After this many keys given up after failed captures, with no replay ever, a callable
# stops trying (``Engine.given_up``).
GIVE_UP_FAILURES = 3
UNSEEN_GRAD = ("an output requires grad, but no argument or parameter does (a leaf the "
               "call makes, or a tensor requiring grad read from elsewhere)")
# a plain graph under grad mode whose parameters' requires_grad changed
# (replay.unless_flags_changed)
UNFROZEN = (EagerReason.WARMUP, "a parameter's requires_grad changed: capturing again")


def warm(engine: Engine, key: GraphKey, entry: Entry, flat: Flat, backend: Backend,
          device: torch.device) -> Any:
    options = engine.options
    if entry.hooked:  # backward hooks at its last warmup: one look, not a warmup
        why = training.backward_hooks(engine.watch)
        if why:
            engine.stats.count_eager(EagerReason.BACKWARD_UNSUPPORTED, why, warn=False)
            return engine.eager(*flat.call())
        entry.hooked = False
    timed = options.min_speedup is not None and (entry.runs > 0 or options.warmup == 1)
    engine.stats.count_eager(EagerReason.WARMUP, warn=False)  # counted first: may raise
    with lifecycle.capture_turn() as turn, engine.profiler_range("warmup"):
        if not turn:  # counted as a warmup above
            return engine.eager(*flat.call())
        trains = _trains(engine, key, entry, flat)
        run_warm = training.warm if trains else lifecycle.warm
        timeouts = lifecycle.lock_timeouts()
        learn = entry.runs == 0
        warmed = run_warm(engine.fn, flat, backend, device, engine.watch,
                          learn=learn, timed=timed)
        if learn:
            entry.backward_inside = warmed.backward
        if lifecycle.lock_timeouts() != timeouts and warmed.problem is None:
            warmed.problem = Uncapturable(EagerReason.CAPTURE_FAILED,
                                          lifecycle.WAITS_ON_THREADS)
    if warmed.problem is not None:
        warmed.problem = _unseen_grad(engine, key, warmed.problem)
    if (trains and warmed.problem is None and not lifecycle.requires_grad(warmed.out)
            and not flat.requires_grad()):
        # nothing autograd recorded leaves the call (and no argument gets a .grad,
        # which a static buffer standing in for it would take): one plain graph
        entry.contained = True
    # its learning warmup's own random operators moved the generator; this one left
    # it where it was: the call sets it (the same numbers every call)
    resets = warmed.drew is rng.Move.STILL and entry.rng_drew
    sets = warmed.problem is not None and warmed.problem.reason is EagerReason.RNG_SET
    if (resets or sets) and not entry.rng_set_once:
        # once may be another thread seeding meanwhile, or a draw made once (a lazy
        # random set-up): learn again; twice, the call sets the generator itself
        entry.rng_set_once, entry.rng_drew, entry.runs = True, False, 0
        return warmed.out
    if warmed.problem is not None:  # the call ran; graphs would get it wrong
        if isinstance(warmed.problem, training.HooksPresent):
            # eager while hooked, warming up again once they are removed
            engine.stats.reclassify(warmed.problem.reason, warmed.problem.detail)
            entry.hooked = True
            return warmed.out
        if lifecycle.changed_once(warmed.problem):
            # it left a module attribute, a global or a container changed, which other
            # keys' graphs baked in (a forward recalibrating per batch size): they are
            # captured again; with none, what it left is what the guard holds
            engine.own_change()
            if not entry.assigned_once:
                entry.assigned_once = True  # a global set once (a lazy set-up): learn again
                return warmed.out
        entry.give_up(warmed.problem.reason, warmed.problem.detail)
        return warmed.out
    if resets:
        entry.give_up(EagerReason.RNG_SET, rng.RESETS)
        return warmed.out
    if warmed.drew is rng.Move.DREW and warmed.seeded:  # its own operators moved it
        entry.rng_drew = True  # (not another thread's draws meanwhile)
    entry.runs += 1
    if entry.shaped:  # the structure of a key captured: its learning warmup is enough
        entry.runs = max(entry.runs, options.warmup)
    if warmed.seeded is not None:
        entry.draws = warmed.seeded or bool(entry.draws)
    if timed:
        entry.eager_s = min(entry.eager_s, warmed.seconds)
    if warmed.hidden:
        engine.watch.guard_hidden(warmed.hidden, device)
    if warmed.written:
        engine.cache.rekey(key, entry, flat, warmed.written)
    return warmed.out

def _trains(engine: Engine, key: GraphKey, entry: Entry, flat: Flat) -> bool:
    """Whether the key is warmed up and captured as a training graph (a whole step,
    ``entry.contained``, is one plain graph)."""
    return engine.for_backward(key, flat) and not entry.contained


def _undone_if_failed(run_capture: Callable[..., Any], engine: Engine, flat: Flat,
                      backend: Backend, device: torch.device, inplace: tuple[int, ...],
                      rng_free: bool) -> Any:
    """Capture; where the capture fails, undo what its Python set up
    (:class:`lifecycle.Undo`: a layer caching a tensor of the pool on itself, which
    the eager run would read; a hook it registered)."""
    watch = engine.watch
    undo = lifecycle.Undo(watch, engine.fn)
    try:
        return run_capture(engine.fn, flat, backend, device, watch, inplace,
                           engine.options.outputs == "reuse", rng_free=rng_free)
    except (Uncapturable, lifecycle.RandomFound, lifecycle.StateMade, lifecycle.WritesFound):
        undo()  # (the call runs again)
        raise
    except BaseException:  # the user's own error, which propagates
        undo(everything=False)
        raise


def _leaves(watch: Any) -> list[torch.Tensor]:
    """The watched tensors that may hold a ``.grad``: parameters and buffers, and the
    tensors the code names (a global weight a whole step trains)."""
    return [*watch.tensors(), *watch.named()]


def _grad_marks(tensors: Any) -> list[tuple[torch.Tensor, int] | None]:
    """Which ``.grad`` each tensor requiring grad holds (held: compared by identity),
    and its version: a backward run inside a call makes a new one or writes that one."""
    return [None if (g := t.grad) is None else (g, g._version)
            for t in tensors if t.requires_grad]


def _grads_moved(then: list[tuple[torch.Tensor, int] | None],
                 now: list[tuple[torch.Tensor, int] | None]) -> bool:
    return len(then) != len(now) or any(
        (a is None) != (b is None) or (a is not None and b is not None
                                       and (a[0] is not b[0] or a[1] != b[1]))
        for a, b in zip(then, now))


def _expected(then: list[tuple[torch.Tensor, int] | None],
              now: list[tuple[torch.Tensor, int] | None]) -> list[torch.Tensor | None] | None:
    """The ``.grad`` a whole step's graph replays right with, per tensor: what the
    capture left, unless the capture found none and made one (its backward writes a
    fresh gradient where eager's would add to the one there: a micro-batch captured
    first in its accumulation window) or found one and dropped it (its backward added
    into that one, which the next calls do not hold): then what it found.  None (what
    it left) where a tensor's ``requires_grad`` changed meanwhile."""
    if len(then) != len(now):
        return None
    out: list[torch.Tensor | None] = []
    for a, b in zip(then, now):
        pick = a if (a is None) != (b is None) else b
        out.append(None if pick is None else pick[0])
    return out


def capture(engine: Engine, key: GraphKey, entry: Entry, flat: Flat, backend: Backend,
             device: torch.device) -> Any:
    """Capture the call, replay it once for its result, and keep the graph."""
    stats = engine.stats
    with lifecycle.capture_turn() as turn:
        if not turn:
            stats.count_eager(EagerReason.WARMUP, lifecycle.LOCK_BUSY, warn=False)
            return engine.eager(*flat.call())
        if entry.run is not None:  # another thread captured it meanwhile
            return engine.replay_entry(entry, entry.run, flat)
        if entry.state is State.EAGER:  # another thread gave up on it meanwhile
            return engine.act(Action.EAGER, key, entry, flat, backend, device)
        if not engine.cache.holds(key, entry, flat):  # moved to another thread's address
            stats.count_eager(EagerReason.WARMUP, MOVED_AWAY, warn=False)
            return engine.eager(*flat.call())
        start = time.perf_counter()
        before = backend.memory_reserved(device)
        inplace = engine.cache.in_place(key, flat)
        changes = engine.watch.training_changes
        run_capture = (training.capturer(stats) if _trains(engine, key, entry, flat)
                       else lifecycle.capture)
        grads = _grad_marks(_leaves(engine.watch)) if entry.contained else []
        try:
            with engine.profiler_range("capture"):
                captured = _undone_if_failed(run_capture, engine, flat, backend, device,
                                             inplace, rng_free=entry.draws is False)
        except lifecycle.RandomFound:  # its warmup drew none, its capture did
            entry.draws = True
            return capture(engine, key, entry, flat, backend, device)
        except lifecycle.StateMade:  # (put back): made by an eager run, then learned
            if entry.state_made:  # again: made before every call (zero_grad outside)
                entry.give_up(EagerReason.ASSIGNS, STATE_MADE_AGAIN)
                stats.count_eager(EagerReason.ASSIGNS, STATE_MADE_AGAIN)
                return engine.eager(*flat.call())
            entry.state_made = True
            entry.runs, entry.direct, entry.warm_first = 0, False, True
            stats.count_eager(EagerReason.WARMUP, warn=False)
            return engine.eager(*flat.call())
        except lifecycle.WritesFound as found:
            engine.cache.rekey(key, entry, flat, found.positions)
            stats.count_eager(EagerReason.IN_PLACE, warn=False)
            return engine.eager(*flat.call())
        except Uncapturable as exc:
            if (entry.direct and exc.reason is EagerReason.CAPTURE_FAILED) or (
                    (entry.direct or not entry.runs) and lifecycle.changed_once(exc)):
                # captured without warming up (a key known before an invalidation, or
                # ``warmup=0``), where the call fails or sets something up once (an
                # RNN's flat weights after its parameters were replaced, a tensor
                # cached at the first call): warm up first, learning again
                entry.direct, entry.runs = False, 0
                return warm(engine, key, entry, flat, backend, device)
            return _capture_failed(engine, entry, flat, _unseen_grad(engine, key, exc))
        except BaseException as exc:  # the user's own error: it propagates, once
            stats.count_eager(EagerReason.CAPTURE_FAILED,
                              f"the call raised {type(exc).__name__}", warn=False)
            # a capture runs no kernel: what the call wrote before raising (a batch
            # norm's count) was not written. Later calls of the key run eagerly until
            # one succeeds (they write as eager does), then capture
            entry.runs, entry.direct, entry.warm_first = 0, False, True
            raise
        if entry.draws:  # drawn by an operator without the random tag (a custom one),
            captured.seeded = True  # found by its capture: no variants, no verification
        if modes(device) != key.modes or engine.watch.training_changes != changes:
            # another thread changed a process-wide flag (the default dtype, matmul
            # precision) or a module's training flag while this call was captured: the
            # graph may have baked in either; dropped, the next call captures again
            stats.count_eager(EagerReason.WARMUP, CHANGED_DURING, warn=False)
            return engine.eager(*flat.call())
        shared = _sharing_state(captured, flat, inplace)
        if shared:  # a copied argument is memory the graph writes as state: capture it
            engine.cache.rekey(key, entry, flat, shared)  # in place (the next call); this
            stats.count_eager(EagerReason.IN_PLACE, warn=False)  # graph read its copy
            return engine.eager(*flat.call())  # (a capture ran no kernel: nothing written)
        leaves = _leaves(engine.watch) if entry.contained else []
        after = _grad_marks(leaves)
        if entry.contained and (entry.backward_inside or _grads_moved(grads, after)):
            # a whole step (a backward inside made or wrote the .grad): its gradients
            # may live in the graph's pool, and its backward reads what .grad holds.
            # (A call that only runs under no_grad inside, an action chosen, touches
            # none: the next training step's new .grad must not drop its graph.)
            engine.watch.steps.add_grads(leaves, _expected(grads, after))
        elif run_capture is lifecycle.capture and engine.options.min_speedup is None:
            rotation.rotate(captured, engine.fn, flat, engine.watch, entry.draws is False)
        try:
            result = replay.in_inference_mode(captured.runner(), captured)(flat.leaves)
            if captured.syncs:
                result = containers.apply(captured.syncs, flat, result)
        except Exception as exc:  # noqa: BLE001 - a failed launch: eager is still right
            entry.graph = captured
            return engine.replay_failed(entry, exc, flat, counted=False)
        finally:
            if isinstance(captured, Trained):
                captured.release_bumps()
        missed = captured.static.differing(list(flat.leaves))
        if missed:  # written through something no operator declared (a raw kernel)
            engine.cache.rekey(key, entry, flat, set(missed))
            stats.count_eager(EagerReason.IN_PLACE, warn=False)
            if not inplace and not captured.state_written:  # nothing real was written
                return engine.eager(*flat.call())  # (a read copy may have been stale)
            lifecycle.hand_back(captured, list(flat.leaves), missed)
            return result
        # what the graph needs of the pool, even where it reuses memory an earlier graph
        # freed (the pool did not grow), plus its static inputs
        grown = max(0, backend.memory_reserved(device) - before)
        nbytes = max(grown, captured.footprint) + captured.static.nbytes()
        if captured.rotation is not None:  # output variants, once captured (rotation.py)
            nbytes += captured.rotation.nbytes
        # after an invalidation that keeps its behaviour, capture it again at once
        trains = engine.for_backward(key, flat)
        entry.repeat = not flat.objects and engine.options.min_speedup is None and not trains
        if flat.objects and engine.options.min_speedup is None and not trains:
            _learned(engine.cache, key)
        plain_under_grad = bool(key.modes[0]) and not isinstance(captured, Trained)
        return _keep(engine, key, entry, captured, result, nbytes, time.perf_counter() - start,
                     plain_under_grad)


def _unseen_grad(engine: Engine, key: GraphKey, problem: Uncapturable) -> Uncapturable:
    """``problem``, but where autograd records a call graphed for training although
    nothing it takes requires grad (a tensor read from elsewhere does), why it runs
    eagerly as such."""
    if engine.trains and key.modes[0] and problem.reason is EagerReason.AUTOGRAD:
        return Uncapturable(EagerReason.BACKWARD_UNSUPPORTED, UNSEEN_GRAD)
    return problem


def _sharing_state(captured: replay.Captured, flat: Flat, inplace: tuple[int, ...]
                   ) -> set[int]:
    """The copied arguments that share memory with state the capture writes or reads
    from elsewhere (a global the call writes, passed as the argument, under
    ``warmup=0``: no warmup learned that the write reaches the argument)."""
    state = [*captured.state_written, *captured.hidden]
    if not state:
        return set()
    bases = frozenset(storage_ptr(t) for t in state if t.numel())
    return {i for i in flat.sharers(bases) if i not in inplace}


def _learned(cache: GraphCache, key: GraphKey) -> None:
    """A key with object arguments captured: a later key of the same structure at other
    addresses is captured at its first call where every object is of a known type,
    else after one warmup (``GraphCache.shapes``; bounded, as keys are).  Not where an
    object holds a host tensor next to device work: its value, which the key does not
    hold, may steer the call's Python, and every warmup would find that."""
    parts = [part for part in key.leaves if type(part) is ObjectKey]
    if any(t.version is not None for part in parts for t in part.tensors):
        return
    shapes = cache.shapes
    if len(shapes) >= 8 * cache.options.max_graphs:
        shapes.clear()
    shapes[key.unaddressed()] = all(keyer_for(part.kind) is not None for part in parts)


def _keep(engine: Engine, key: GraphKey, entry: Entry, captured: replay.Captured, result: Any,
          nbytes: int, seconds: float, plain_under_grad: bool = False) -> Any:
    stats = engine.stats
    budget = engine.options.max_graph_memory
    if budget is not None and nbytes > budget:
        entry.give_up(EagerReason.MEMORY, f"{nbytes} bytes")
        stats.count_eager(EagerReason.MEMORY, f"needs {nbytes} bytes, budget {budget}")
        return result
    state = [*captured.state_written, *captured.hidden]  # written, or read from elsewhere
    if state:  # an argument sharing their memory is keyed as such (keys.Sharing)
        cache = engine.cache
        cache.state_bases = cache.state_bases | {storage_ptr(t) for t in state if t.numel()}
    if captured.hidden:
        engine.watch.guard_hidden(captured.hidden, captured.device)
        captured.hidden = []  # guarded by weak reference: the graph must not keep them
    if captured.grads_of:  # the .grad each holds, as the graph reads it
        engine.watch.steps.add_grads(captured.grads_of)
        captured.grads_of = []
    entry.graph = captured
    entry.syncs = captured.syncs
    run = replay.versioned(replay.in_inference_mode(captured.runner(), captured), captured)
    if plain_under_grad:  # until a parameter is frozen or unfrozen
        run = replay.unless_flags_changed(run, captured, engine.watch, UNFROZEN)
    if engine.options.min_speedup is not None:
        run = gate.trial(engine.cache, entry, run, engine.options.min_speedup, stats.name)
    entry.run = run
    stats.captures += 1
    if entry.runs:  # a key met again (warmed up) and captured: keys repeat here
        engine.keys_repeat()
    stats.capture_seconds += seconds
    engine.cache.keep(entry, nbytes)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s: captured %s in %.1f ms, %.2f MiB of graph memory", stats.name,
                     key.describe(), seconds * 1e3, nbytes / 2**20)
    stats.count_capture()
    return result


STATE_MADE_AGAIN = ("each capture makes a .grad or optimizer state that was not there "
                    "(dropped outside the step, as zero_grad() there does): a graph would "
                    "assign it where eager adds; zero the gradients inside the step")


def _capture_failed(engine: Engine, entry: Entry, flat: Flat, exc: Uncapturable) -> Any:
    """Run the call eagerly; if eager succeeds, the key stays eager for good (if eager
    raises too, the error is the user's own: it propagates unchanged and the key
    will be captured again)."""
    if exc.reason is not EagerReason.CAPTURE_FAILED:
        entry.give_up(exc.reason, exc.detail)
    try:
        out = engine.eager(*flat.call())
    except BaseException:
        engine.stats.count_eager(exc.reason, exc.detail, warn=False)
        raise
    entry.give_up(exc.reason, exc.detail)
    engine.stats.count_eager(exc.reason, exc.detail)
    if lifecycle.changed_once(exc):  # the capture's change, made again: other keys'
        engine.own_change()  # graphs baked in the old value
    if exc.reason is EagerReason.CAPTURE_FAILED:
        engine.failures += 1
        if engine.failures >= GIVE_UP_FAILURES and not engine.stats.replays:
            engine.give_up_all(f"{engine.failures} captures failed and none replayed")
    return out
