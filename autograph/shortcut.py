"""Shortcuts: the replay path of a call whose very key replayed just before.

Most replayed calls repeat the last one exactly: the same tensor shapes, strides and
dtypes, the same modes.  The full path (``Engine.dispatch``) keys such a call from
scratch, builds a :class:`~autograph.keys.GraphKey`, hashes it and looks its entry up.
A shortcut is made after a replay of plain positional tensors, and kept on the key
memo's :class:`~autograph.memo.Remembered` that recognised the tensors: it holds what
the rest of that key was (modes, training flags, aliasing) and the entry's runner, so
that the next call the memo recognises compares those few values and replays the same
runner directly.

What a shortcut checks is what the full path would read for that call, in one
function: the kill switch, a given-up callable, nesting, ``torch.func`` transforms, a
profiler (its ranges are the full path's), the guards (``Watch.ok``: parameter
addresses, attributes, hidden reads), hooks, a capture in progress on the caller's
stream, the modes and flags (``modes.modes``), the training flags, the aliasing of
the tensors, no argument keyed by its address (``GraphCache.inplace``/``pinning``), and
the entry still holding the runner (an evicted, dropped or recaptured graph has
another).  When anything differs it answers :data:`MISS` and the full path runs, which
may make a new shortcut; so does a runner that returns :data:`~autograph.replay.HELD`
(an output or saved state still held) or raises.  Calls with keyword arguments,
containers, objects, a process group, buckets or ``verify_every`` never take one, nor
calls under grad mode where training graphs are off (``backward=False``: the full path
runs those eagerly while a parameter requires grad) or with an inference tensor (the
memo's check tells inference tensors apart, so a shortcut made without one is never
taken with one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

import autograph.stats as _counting

from . import lifecycle, notify, replay
from . import switch as _switch
from .flat import sharers
from .keys import _aliases, sharing
from .modes import reader, saved_hooks

if TYPE_CHECKING:
    from .cache import Entry
    from .dispatch import Engine
    from .flat import Flat
    from .keys import GraphKey
    from .memo import Remembered

MISS: Any = object()  # what a shortcut returns when the full path must run the call

_nesting = lifecycle.nested_block
_is_nested = lifecycle.is_nested
_profiling: Callable[[], bool] = getattr(torch._C._autograd, "_profiler_enabled", lambda: False)
_functorch: Callable[[], bool] = getattr(
    torch._C, "_are_functorch_transforms_active", lambda: False)
_fwad = torch.autograd.forward_ad


def _functorch_active() -> bool:
    """Whether a torch.func transform or a forward-mode AD level (``dual_level``) is
    active: a graph would drop the transform's wrappers or the tangents."""
    return _functorch() or _fwad._current_level >= 0
_HELD = replay.HELD


def learn(engine: Engine, args: tuple[Any, ...], key: GraphKey, flat: Flat, entry: Entry,
          run: Callable[[Any], Any]) -> None:
    """After a replay of ``key`` by the full path: leave its shortcut on the memo's
    record of these tensors, where one applies and it is not there already."""
    if ((key.modes[0] and (not engine.trains or flat.inference()))
            or engine.ranks is not None or engine.verify_every is not None
            or engine.options.buckets  # a bucketer calls ``dispatch``: never a shortcut
            or flat.spec is not None or flat.kw_names or flat.objects or key.written
            or type(key.structure) is not int or len(flat.tensor_pos) != key.structure
            or engine.cache.inplace or engine.cache.pinning or sharing(key)):
        return
    known = engine.memo.find(args)
    if known is None or known.parts != key.leaves:
        return
    bound = known.bound
    if bound is not None and bound[0] is entry and bound[1] is run and bound[2] == key:
        return
    known.bound = (entry, run, key)
    known.shortcut = make(engine, known, key, entry, run)


def make(engine: Engine, known: Remembered, key: GraphKey, entry: Entry,
         run: Callable[[Any], Any]) -> Callable[[tuple[Any, ...]], Any]:
    """The shortcut of ``key`` (recognised by ``known``) replaying ``entry``'s ``run``:
    a function of the call's positional arguments returning the call's result, or
    :data:`MISS` (then the full path runs it).  It holds no reference to the engine
    (the memo holding it is the engine's); the engine checks ``given_up`` before it."""
    n, tensor_pos, aliases = known.n, known.tensor_pos, key.aliases
    expected_modes, expected_training = key.modes, key.training
    training_key = bool(key.modes[0])  # autograd records it: saved-tensor hooks matter
    read_modes, training = reader(known.device), engine.training
    watch, cache, counts = engine.watch, engine.cache, engine.stats
    ok, capturing = watch.ok, engine._device[2]
    switch, env_set, nesting, is_nested = _switch, _switch.env_set, _nesting, _is_nested
    profiling, functorch, held, observed = _profiling, _functorch, _HELD, _counting
    fwad = _fwad
    hooks, pre_hooks, collector = notify.GLOBAL_HOOKS, notify.GLOBAL_PRE_HOOKS, notify.collector
    backward_hooks = notify.GLOBAL_BACKWARD_HOOKS, notify.GLOBAL_BACKWARD_PRE_HOOKS

    def shortcut(args: tuple[Any, ...]) -> Any:
        if (switch._active or env_set() or entry.run is not run
                or watch.hook_reason is not None or hooks or pre_hooks
                or (watch.collects and collector())
                or (nesting.active and is_nested()) or functorch() or profiling()
                or fwad._current_level >= 0
                or not ok() or read_modes() != expected_modes
                or training() != expected_training or capturing()
                or cache.inplace or cache.pinning
                or (n > 1 and _aliases(args, tensor_pos) != aliases)
                or (cache.state_bases and sharers(args, tensor_pos, cache.state_bases))
                or (training_key and (saved_hooks() or any(backward_hooks)
                                      or watch.backward_recheck or watch.marks_grad))):
            return MISS
        try:
            result = run(args)
        except Exception:  # noqa: BLE001 - the full path handles a failed launch
            return MISS
        if result is held:  # an earlier output is still held: the full path protects it
            return MISS
        counts.replays += 1
        if observed._observers:
            counts.notify("replay")
        cache.uses = entry.used = cache.uses + 1  # a stamp: races are harmless
        return result

    return shortcut
