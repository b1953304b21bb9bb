"""A key's life before its first replay: warm up, capture, hand back.

:func:`warm` runs the call eagerly on the capture stream and learns what a graph would
get wrong: arguments written in place, module attributes assigned, host random numbers
drawn (their first values would be frozen into the graph), autograd recording through
tensors that are not arguments, and tensors read from outside the arguments,
parameters and buffers (guarded from then on).  :func:`capture` records the call into
the device's shared pool on static buffers and returns a :class:`Captured` graph
(``replay``), whose runner is the replay that the engine calls from then on.

Problems that mean "this key runs eagerly" raise :class:`Uncapturable`; an argument
found written only at capture raises :class:`WritesFound`; a user's own exception
propagates unchanged, once.
"""

from __future__ import annotations

import contextlib
import functools
import random
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from . import coderefs, containers, counters, rng
from .buffers import StaticInputs, output_builder
from .capture import Backend, OnPool
from .flat import Flat
from .footprint import Footprint
from .guards import Watch, running
from .modes import _any_autocast, modes
from .mutation import WriteRecorder, storage_ptr, watch_map
from .reach import Reach
from .replay import Bumps, Captured, use_count
from .returned import opened
from .steps import (
    Grads,
    Kept,
    Stepped,
    grads_of,
    parameters_of,
    put_back_grads,
    training_object,
)
from .versions import versions
from .vocab import EagerReason, Uncapturable

# Warmups and captures are serialized process-wide: capture must not interleave with
# another capture into the same pool, and it keeps warmup and capture on one stream.
CAPTURE_LOCK = threading.RLock()
# How long a warmup or capture waits for another thread's: a call whose Python waits on
# a worker thread that calls a graphed callable (a branch in a thread pool) holds the
# lock while the worker waits for it; past this the worker runs eagerly instead
LOCK_WAIT = 10.0
LOCK_BUSY = "another thread was warming up or capturing (its call may wait on this one)"
WAITS_ON_THREADS = ("the call waits on another thread's graphed call (a worker thread), "
                    "which cannot warm up while this one does")
_holder: list[int | None] = [None]  # the thread holding the lock through capture_turn
_blamed: dict[int, int] = {}  # per thread: waits for the lock it held that ran out


def lock_timeouts() -> int:
    """How many waits for ``CAPTURE_LOCK`` held by this thread ran out: one that runs
    out during a call's warmup shows that call waiting on another thread's graphed
    call (or warming up for longer than ``LOCK_WAIT``)."""
    return _blamed.get(threading.get_ident(), 0)


class capture_turn:  # noqa: N801 - used like a function
    """``CAPTURE_LOCK``, waited for at most ``LOCK_WAIT`` seconds (``wait``: another
    bound; 0 tries once, for work that can wait for a later call): entered, it says
    whether this thread holds it (if not, run the call eagerly, or skip the work)."""

    __slots__ = ("held", "wait", "before")

    def __init__(self, wait: float | None = None) -> None:
        self.wait = wait
        self.held = False
        self.before: int | None = None

    def __enter__(self) -> bool:
        wait = LOCK_WAIT if self.wait is None else self.wait
        self.held = CAPTURE_LOCK.acquire(timeout=wait) if wait > 0 \
            else CAPTURE_LOCK.acquire(blocking=False)
        if self.held:
            self.before, _holder[0] = _holder[0], threading.get_ident()
        elif self.wait is None and (holder := _holder[0]) is not None:
            _blamed[holder] = _blamed.get(holder, 0) + 1
        return self.held

    def __exit__(self, *exc: object) -> None:
        if self.held:
            _holder[0] = self.before
            CAPTURE_LOCK.release()

# Exceptions that a failed capture raises (torch's own, and the CPU stand-in's
# RuntimeError subclass).  Anything else comes from the user's code: it propagates.
CAPTURE_ERRORS = (RuntimeError, MemoryError)


class AttributeSet(Uncapturable):
    """The call assigned an attribute of a watched module (or of the plain object whose
    method it is) and left it changed."""


class ScriptFirstRun(Uncapturable):
    """TorchScript code raised under the recording mode, and ran unrecorded (see
    :func:`_scripted`): the next warmup learns again (its interpreter has run the
    graph once by then)."""


class RandomFound(Exception):
    """A capture without the device's generator (``rng_free``) found the call drawing
    random numbers after all: capture it again with the generator."""


class StateMade(Exception):
    """The capture made an optimizer's state (its first step, under ``warmup=0`` or
    after ``state.clear()``) or a ``.grad`` where there was none: the graph would
    replay the first step's branch (assign where later calls add).  The call runs
    eagerly (it makes the state) and the key warms up once before capturing."""


class WritesFound(Exception):
    """The capture found arguments written through no declared operator write."""

    def __init__(self, positions: set[int]) -> None:
        super().__init__(sorted(positions))
        self.positions = positions


class Warmed:
    """What one warmup run learned."""

    __slots__ = ("out", "written", "hidden", "seeded", "seconds", "problem", "drew",
                 "backward")

    def __init__(self, out: Any, written: set[int], hidden: list[torch.Tensor],
                 seeded: bool | None, seconds: float, problem: Uncapturable | None,
                 drew: rng.Move = rng.Move.STILL) -> None:
        self.out = out
        self.written = written
        self.hidden = hidden
        self.seeded = seeded  # whether it drew random numbers on the device (None: not learned)
        self.seconds = seconds
        self.problem = problem  # why graphs would get this call wrong, or None
        self.drew = drew  # what it did to the device's generator
        self.backward = False  # it ran a backward inside (a whole step; training.warm)


def warm(fn: Callable[..., Any], flat: Flat, backend: Backend, device: torch.device,
         watch: Watch, *, learn: bool, timed: bool) -> Warmed:
    """Run the call eagerly on the capture stream; with ``learn``, record what it
    writes and reads, and whether graphs would get it wrong (``Warmed.problem``)."""
    args, kwargs = flat.call()
    shapes = _geometry(flat.leaves, flat.tensor_pos)
    snap = containers.snapshot(flat, args, kwargs) if learn else []
    reached = watch.reach(fn) if learn else None
    held = watch.held(reached) if reached is not None else []
    refs = watch.ref_values() if learn else None
    state = list(watch.tensors()) if learn else []
    tags = [_attributes(t) for t in state]
    recorder = WriteRecorder(watch_map(list(flat.leaves), flat.tensor_pos),
                             _known(flat, watch, device)) if learn else None
    watch.forget_assignments()
    gens = watch.host_generators(reached, flat.leaves) if reached is not None else ()
    host = _host_random_state(device, gens) if learn else None
    kept = _kept(watch, reached, flat) if reached is not None else None
    stepped = Stepped(kept) if kept is not None else None
    hosts = counters.hold(flat)
    reads = StateReads(device) if learn else None
    flags = modes(device) if learn else None
    gen = rng.generator(device)
    before = rng.mark(gen)
    if recorder is not None and gen is not None:
        recorder.rng, recorder.rng_last = functools.partial(rng.mark, gen), before
    with call_scope(watch):  # as a capture: no stale casts read
        if timed:
            backend.synchronize(device)
        start = time.perf_counter()
        failed: Exception | None = None
        with backend.warmup(device), recorder if recorder is not None else _NO_BLOCK, \
                reads if reads is not None else _NO_BLOCK, hosts.constants(recorder), \
                stepped if stepped is not None else _NO_BLOCK:
            try:
                out = fn(*args, **kwargs)
            except RuntimeError as exc:
                if recorder is None or recorder.written or not _scripted(watch, fn) \
                        or _SCRIPT_FIRST_RUN not in str(exc):
                    raise
                failed = exc.with_traceback(None)
        if failed is not None:  # again, unrecorded: TorchScript may fail under a mode
            with backend.warmup(device):
                out = fn(*args, **kwargs)
        if timed:
            backend.synchronize(device)
        seconds = time.perf_counter() - start
    drew = rng.move(before, rng.mark(gen))
    backend.after_warmup(device, out)
    hosts.rewind()  # their advance is no structural change (counters.py)
    try:
        if failed is not None:
            raise ScriptFirstRun(EagerReason.CAPTURE_FAILED, f"TorchScript code raised "
                                 f"under autograph's recording mode "
                                 f"({str(failed).splitlines()[0]})")
        if reads is not None and recorder is not None:  # first: training ignores AUTOGRAD
            _check_followed(recorder)
            reads.check(recorder.seeded)
        if drew is rng.Move.SET or (recorder is not None and recorder.rng_set):
            # (not: tagged random operators ran and the generator stands still; some
            # draw nothing in some calls, as a GRU's with dropout 0 while training)
            raise Uncapturable(EagerReason.RNG_SET, rng.SETS)
        tensors = _tensor_leaves(out)
        _check(watch, tensors, host, device, gens)
        _check_objects(flat)
        _check_geometry(flat.leaves, flat.tensor_pos, shapes, requires_grad=True)
        if learn:
            _check_attributes(tensors, flat, state, tags)
        if snap:
            containers.changes(snap, out)  # raises for a change no replay can repeat
        if refs is not None and watch.refs_assigned(refs):
            raise Uncapturable(EagerReason.ASSIGNS, REF_ASSIGNED)
        if stepped is not None:
            watch.steps.stepped(stepped.optimizers)
        changed = kept.changed() if kept is not None else None
        if changed:  # a scheduler stepped inside the call: no replay steps it (once
            raise AttributeSet(EagerReason.ASSIGNS, changed)  # may be a lazy set-up)
        if flags is not None and modes(device) != flags:
            # the call leaves a process-wide flag changed (``set_float32_matmul_precision``
            # and no restore): every capture would see the flags move under it and run
            # the call again; eager, unless it was a set-up made once
            raise AttributeSet(EagerReason.ASSIGNS, FLAGS_CHANGED)
        _check_held(held, restore=False)
        _check_autograd(tensors, out)
        problem = None
    except Uncapturable as exc:
        # kept without its traceback: its frames (these locals hold the outputs, the
        # callers' the engine) would make a cycle that keeps the engine and its graphs
        # alive until a collection, which may come during another capture
        problem = exc.with_traceback(None)
    hosts.settle()
    if recorder is None:
        return Warmed(out, set(), [], None, seconds, problem, drew)
    return Warmed(out, recorder.written, list(recorder.hidden.values()), recorder.seeded,
                  seconds, problem, drew)


# what TorchScript's interpreter raises then (a cast of its own arguments, before the
# graph's operators run: a call that raises otherwise, a user's error, is not run again)
_SCRIPT_FIRST_RUN = "Expected a value of type"


def _scripted(watch: Watch, fn: Callable[..., Any]) -> bool:
    """Whether the call runs TorchScript (a scripted or traced module or function),
    whose interpreter raises on some graphs' first run under a dispatch mode, before
    it runs an operator (``aten::equal() Expected a value of type 'Tensor'``): run
    again unrecorded, the next warmup learns."""
    script = (torch.jit.ScriptModule, torch.jit.ScriptFunction)
    return isinstance(getattr(fn, "__self__", fn), script) or any(
        isinstance(m, torch.jit.ScriptModule) for m in watch.every_module())


def _check_followed(recorder: Any) -> None:
    """A call running one of torch's higher-order operators (``torch.cond``,
    ``while_loop``, ``flex_attention`` called eagerly) runs eagerly: their inner
    operators run unseen by the recorder (what they write, read or draw)."""
    if recorder.opaque is not None:
        raise Uncapturable(EagerReason.CAPTURE_FAILED, f"it runs torch's higher-order "
                           f"operator {recorder.opaque}, whose inner operators cannot be "
                           f"followed")


def _tensor_leaves(out: Any) -> list[torch.Tensor]:
    """The tensors among a call's outputs (one walk serves every check of them)."""
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


OUTPUT_REQUIRES_GRAD = "an output requires grad (a tensor the call reads requires grad)"


def _check(watch: Watch, outs: list[torch.Tensor], host: Any, device: torch.device,
           gens: tuple[Any, ...] = ()) -> None:
    """Raise for what a warmup run showed a graph would get wrong (``outs``: the
    output tensors)."""
    assigned = watch.assigned_and_kept()
    if assigned:
        raise AttributeSet(EagerReason.ASSIGNS, assigned)
    if watch.script_assigns:
        raise Uncapturable(EagerReason.ASSIGNS, watch.script_assigns)
    if host is not None and _host_random_state(device, gens) != host:
        raise Uncapturable(EagerReason.HOST_RANDOM)
    if any(t.layout is not torch.strided or t.is_nested for t in outs):
        raise Uncapturable(EagerReason.OUTPUT, "a sparse or nested output")


def _check_autograd(outs: list[torch.Tensor], out: Any) -> None:
    """Raise where autograd records the call (an output requires grad or has a
    history): last, since a call that autograd records is checked for all the rest
    first (``training.warm`` takes this one for a training graph's)."""
    if torch.is_grad_enabled() and (any(t.requires_grad for t in outs) or requires_grad(out)):
        raise Uncapturable(EagerReason.AUTOGRAD, OUTPUT_REQUIRES_GRAD)
    if any(t.grad_fn is not None for t in outs):  # grad turned on inside, under no_grad
        raise Uncapturable(EagerReason.AUTOGRAD, "an output has autograd history (the call "
                           "enables grad inside)")


def requires_grad(out: Any) -> bool:
    """Whether a tensor among the outputs requires grad, one of an object the call
    made included (``Box(self.l(x))``, a ``Normal``: pytree does not open them)."""
    return any(isinstance(t, torch.Tensor) and t.requires_grad
               for t in opened(pytree.tree_leaves(out)))


def _geometry(leaves: Any, positions: tuple[int, ...]) -> list[tuple[Any, ...]]:
    """Each tensor argument's sizes, strides and address, to tell a call that resizes
    or re-points one (``out=`` an empty tensor, ``resize_``, ``set_``, ``.data =``), and
    its Python attributes (``x.tag = ...``), ``requires_grad`` and ``.grad`` (a replay
    would not set them)."""
    return [(leaves[i].shape, leaves[i].stride(), leaves[i].data_ptr(),
             _attributes(leaves[i]), leaves[i].requires_grad, id(_grad(leaves[i])))
            for i in positions]


def _grad(t: torch.Tensor) -> torch.Tensor | None:
    """``t.grad`` of a leaf; None for a tensor autograd made (reading its ``.grad``
    warns, an error under ``-W error``, and it has none)."""
    return t.grad if t.is_leaf else None


def _attributes(t: torch.Tensor) -> tuple[tuple[str, int], ...]:
    """A tensor's Python attributes, by name and object identity."""
    return tuple((k, id(v)) for k, v in t.__dict__.items())


def _check_geometry(leaves: Any, positions: tuple[int, ...], before: list[tuple[Any, ...]],
                    flags: bool = False, requires_grad: bool = False) -> None:
    """Raise if the call resized or re-pointed a tensor argument (a graph keeps the
    geometry and the address it captured: a later call's tensor would not be written)
    or set a Python attribute on one (a replay would not); with ``flags``, also its
    ``requires_grad`` or ``.grad``; with ``requires_grad``, its ``requires_grad`` (a
    warmup: ``x.requires_grad_()`` in a forward; a backward inside may give it a
    ``.grad``, judged by the training warmup)."""
    for i, was in zip(positions, before):
        t = leaves[i]
        if (t.shape, t.stride(), t.data_ptr()) != was[:3]:
            raise Uncapturable(EagerReason.ASSIGNS, f"the call resizes or re-points tensor "
                               f"argument {i} (out=, resize_, set_)")
        if _attributes(t) != was[3]:
            raise Uncapturable(EagerReason.ASSIGNS, f"the call sets a Python attribute of "
                               f"tensor argument {i}")
        if requires_grad and t.requires_grad != was[4]:
            raise Uncapturable(EagerReason.ASSIGNS, f"the call sets requires_grad of "
                               f"tensor argument {i}")
        if flags and (t.requires_grad, id(_grad(t))) != was[4:]:
            raise Uncapturable(EagerReason.ASSIGNS, f"the call sets .grad or requires_grad "
                               f"of tensor argument {i}")


def _check_attributes(outs: list[torch.Tensor], flat: Flat, state: list[torch.Tensor],
                      before: list[tuple[tuple[str, int], ...]]) -> None:
    """Raise if the call set a Python attribute on a parameter or buffer
    (``w.calls += 1``) or on an output it made (``y.tag = ...``): a replay would not,
    and hands out copies of its outputs."""
    for t, then in zip(state, before):
        if _attributes(t) != then:
            raise Uncapturable(EagerReason.ASSIGNS, "the call sets a Python attribute of a "
                               "parameter or buffer")
    given = {id(flat.leaves[i]) for i in flat.tensor_pos} | {id(t) for t in state}
    for t in outs:
        if id(t) not in given and t.__dict__:
            raise Uncapturable(EagerReason.OUTPUT, "an output carries Python attributes "
                               "(a replay hands out copies without them)")


def _before_the_call(watch: Watch, flat: Flat, refs: list[Any]) -> list[Any]:
    """What a call's returned objects may hold that existed before the call (returned
    as itself, with what it reaches): the watched modules' plain attributes and
    tensors, the arguments, and the values of the names the code reads."""
    internals = containers.MODULE_INTERNALS
    attributes = [v for m in watch.every_module() for k, v in vars(m).items()
                  if k not in internals]
    args, kwargs = flat.call()
    return [*attributes, *watch.tensors(), *flat.leaves, *args, *kwargs.values(), *refs]


def _check_held(held: containers.Held, restore: bool) -> None:
    """Raise if the call changed a list, dict or set a module holds (with ``restore``,
    at a capture, after giving it back what it held: the call then runs eagerly)."""
    change = containers.held_change(held)
    if change is not None:
        if restore:
            containers.restore(held)
        raise Uncapturable(EagerReason.ASSIGNS, change)


def _check_objects(flat: Flat) -> None:
    """Raise if the call changed the structure of an object argument (objects.py)."""
    if flat.objects:
        changed = flat.object_changes()
        if changed:
            raise Uncapturable(EagerReason.ASSIGNS, changed)


def _known(flat: Flat, watch: Watch, device: torch.device) -> set[int]:
    """Storages a graph may read without a guard of its own: the arguments' (with the
    tensors of object arguments, keyed by address), and the parameters', buffers' and
    named globals' (guarded by the watch)."""
    known = {storage_ptr(flat.leaves[i]) for i in flat.tensor_pos}
    if flat.objects:
        known.update(flat.object_storages())
    known.update(watch.storage_ptrs(device))
    return known


class StateReads:
    """Notes whether the call, on this thread, reads the state of the generator its
    graph would draw from (``torch.cuda.get_rng_state``; the CPU one on the CPU
    stand-in), as activation checkpointing does to redraw the same numbers in the
    backward.  A graph would keep the value read at capture, while its replays draw on:
    with random numbers drawn too, the call must run eagerly (:meth:`check`)."""

    def __init__(self, device: torch.device) -> None:
        owner = torch.cuda if device.type == "cuda" else torch
        names = ("get_rng_state", "get_rng_state_all") if device.type == "cuda" \
            else ("get_rng_state",)
        self._spied = [(owner, n, getattr(owner, n)) for n in names if hasattr(owner, n)]
        self._thread = threading.get_ident()
        self.read = False

    def _spy(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def read(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self._thread:
                self.read = True
            return original(*args, **kwargs)
        return read

    def __enter__(self) -> StateReads:
        for owner, name, original in self._spied:
            setattr(owner, name, self._spy(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in self._spied:
            setattr(owner, name, original)

    def check(self, seeded: bool) -> None:
        if self.read and seeded:
            raise Uncapturable(EagerReason.RNG_STATE)


def _host_random_state(device: torch.device, gens: tuple[Any, ...] = ()) -> tuple[Any, ...]:
    """The host generators a forward might draw from to decide what to run (torch's
    CPU generator is the device's own when the graph runs on the CPU stand-in), and
    the generator objects it reaches by name (``gens``, ``rng.host_generators``)."""
    state: list[Any] = [random.getstate()]
    if device.type != "cpu":
        state.append(bytes(torch.random.default_generator.get_state().numpy()))
    np = sys.modules.get("numpy")
    if np is not None:
        with contextlib.suppress(Exception):  # all of it (a draw of 624 words comes
            # back to the position; another bit generator has no legacy state)
            state.append(hash(rng._frozen(np.random.get_state(legacy=False))))
    return (*state, *rng.host_state(gens))


class Undo:
    """What a capture's Python may set up that the capture's failure must take back
    (its Python ran once, and runs again: eagerly, in a warmup, or captured over the
    parameters instead of their stand-ins), taken before the capture: the attributes
    the watched modules get (``Watch.undo_assignments``), the containers they and the
    code hold, the names the code reads (globals, closure cells, class attributes, the
    owner's), names added to the owner, to the watched modules' classes and to the
    watched tensors' ``__dict__``, and Python's and numpy's global random state.  A
    table cached lazily in any of them is memory of the capture's that no kernel
    filled; a counter would count twice.  The hooks registered since (on the watched
    modules, their tensors, the tensors the code names, globally on modules) are
    removed where something else was taken back (their flag, which the call's next run
    finds unset: registered twice otherwise); a hook whose flag lies elsewhere (a
    closure) stays, as the flag does."""

    __slots__ = ("watch", "hook_id", "refs", "held", "dicts", "names", "host")

    def __init__(self, watch: Watch, fn: Callable[..., Any]) -> None:
        watch.forget_assignments()
        self.watch = watch
        self.hook_id = watch.hook_mark()
        self.refs = watch.ref_values()
        self.held = watch.held(watch.reach(fn))
        self.dicts = watch.tensor_dicts()
        self.names = watch.namespaces()
        self.host = _host_state()

    def __call__(self, everything: bool = True) -> None:
        """Take it back (``everything=False``: the call raised an error of its own,
        which propagates with the call's side effects kept, as in eager mode, but the
        tensors it assigned to modules, memory no kernel filled)."""
        watch = self.watch
        undone = watch.undo_assignments(tensors_only=not everything)
        if everything:
            if containers.held_change(self.held) is not None:
                containers.restore(self.held)
                undone = True
            undone = watch.put_back_refs(self.refs) | undone
            undone = watch.put_back_tensor_dicts(self.dicts) | undone
            undone = watch.drop_new_names(self.names) | undone
            _put_host_state(self.host)
        if undone:
            watch.remove_hooks_since(self.hook_id)


def _host_state() -> tuple[Any, Any]:
    """Python's and numpy's global random state (a draw a failed capture made, a
    stochastic depth's coin, would shift eager's numbers)."""
    np = sys.modules.get("numpy")
    legacy = None
    if np is not None:
        with contextlib.suppress(Exception):
            legacy = np.random.get_state()
    return random.getstate(), legacy


def _put_host_state(state: tuple[Any, Any]) -> None:
    if random.getstate() != state[0]:
        random.setstate(state[0])
    np = sys.modules.get("numpy")
    if np is not None and state[1] is not None:
        with contextlib.suppress(Exception):
            np.random.set_state(state[1])


def capture(fn: Callable[..., Any], flat: Flat, backend: Backend, device: torch.device,
            watch: Watch, inplace: tuple[int, ...], reuse: bool = False,
            rng_free: bool = False, aliases: bool = True, records: bool = False) -> Captured:
    """Capture the call on static buffers (arguments at ``inplace`` at the caller's own
    address).  Nothing has run when it returns: the first replay produces the result.
    ``rng_free``: its warmup drew no random numbers; capture it without the device's
    generator (``Backend.capture``), or raise :class:`RandomFound` if it draws some.
    ``reuse``: the outputs are handed out, so the graph gets a pool of its own (in the
    shared one, a later graph could place its outputs in memory this one writes).
    ``records``: a training graph's forward, whose outputs autograd records (else a
    plain graph, which fails where an output requires grad)."""
    reached = watch.reach(fn)
    objects = _kept(watch, reached, flat)  # put back where the capture fails
    grads = _grads(watch, objects)
    try:
        captured = _capture(fn, flat, backend, device, watch, inplace, reached, objects,
                            reuse=reuse, rng_free=rng_free, aliases=aliases,
                            records=records)
        if any(grad is None and t.grad is not None for t, grad in grads):
            # a .grad made where there was none: the graph assigns it, where a later
            # call that finds it there adds to it (a step that zeroes none itself)
            raise StateMade()
        return captured
    except BaseException:  # its Python ran once, and runs again (eager, or captured)
        objects.restore()
        put_back_grads(grads)
        raise


def _kept(watch: Watch, reached: Reach, flat: Flat) -> Kept:
    """torch's training objects the call reaches, and the optimizers its warmups
    stepped (:class:`autograph.steps.Kept`)."""
    found = rng.reached_by(reached, watch.every_module(), flat.leaves, _training_or_method)
    return Kept([*(getattr(v, "__self__", v) for v in found), *watch.steps.stepped()])


def _training_or_method(value: Any) -> bool:
    """A training object, or a bound method of one (``callbacks = [sched.step]``)."""
    return training_object(value) or training_object(getattr(value, "__self__", None))


def _grads(watch: Watch, objects: Kept) -> Grads:
    """The ``.grad`` of the tensors a whole step may give one (parameters, buffers,
    named tensors, its optimizers' parameters): a failed capture's backward left
    tensors no kernel wrote there, put back before its eager run."""
    return grads_of((*watch.tensors(), *watch.named(), *parameters_of(objects.optimizers())))


def _capture(fn: Callable[..., Any], flat: Flat, backend: Backend, device: torch.device,
             watch: Watch, inplace: tuple[int, ...], reached: Reach, objects: Kept, *,
             reuse: bool, rng_free: bool, aliases: bool, records: bool) -> Captured:
    reuse = reuse and use_count is not None  # no use counts in this torch: clone
    if reuse:
        backend = OnPool(backend, backend.private_pool(device))
    leaves = list(flat.leaves)
    copied = [i for i in flat.tensor_pos if i not in inplace]
    reads_grad = _reads_grad(reached, watch)
    _check_argument_state(leaves, copied, reads_grad)
    static = StaticInputs(leaves, copied)
    _show_requires_grad(static, leaves)
    substituted = static.substitute(leaves)
    args, kwargs = flat.rebuild(substituted)
    shapes = _geometry(substituted, flat.tensor_pos)
    snap = containers.snapshot(flat, args, kwargs)
    held = watch.held(reached)
    refs = watch.ref_values()
    state = [*watch.tensors(), *watch.named()]  # written in place: state_written
    watched = watch_map(static.substitute(leaves), tuple(static.positions))
    for n, t in enumerate(state):  # parameters, buffers, named tensors: negative positions
        if t.numel():
            watched.setdefault(storage_ptr(t), []).append(-1 - n)
    hosts = counters.hold(flat)  # host counters: learned, put back, advanced by replays
    known = (_known(flat, watch, device) | hosts.prepare(device)
             | {storage_ptr(b) for b in static.buffers if b.numel()})
    recorder = WriteRecorder(watched, known)
    footprint = Footprint(known, device)  # what the graph needs of the pool
    watch.forget_assignments()
    gens = watch.host_generators(reached, flat.leaves)
    host = _host_random_state(device, gens)
    stepped = Stepped(objects)  # optimizers the call steps (a whole training step, steps.py)

    reads = StateReads(device)

    def recorded() -> Any:  # the recorder innermost: it sees the very tensors written
        with stepped, footprint, reads, recorder:
            return fn(*args, **kwargs)

    # what replays bump (replay.Bumps): arguments written in place, state, and tensors
    # held as plain attributes of the watched modules
    counted = [leaves[i] for i in inplace] + state + watch.attribute_tensors()
    before = versions(counted)

    with call_scope(watch), hosts.constants(recorder):
        try:
            hosts.stand_in()
            graph, out = backend.capture(device, recorded, rng_free=rng_free)
        except CAPTURE_ERRORS as exc:
            if rng_free and (recorder.seeded or "not in capture mode" in str(exc)):
                raise RandomFound() from exc
            raise Uncapturable(EagerReason.CAPTURE_FAILED, _first_line(exc)) from exc
        except TypeError as exc:
            if "HostCounter" not in str(exc):
                raise
            raise Uncapturable(EagerReason.ASSIGNS, f"a host counter of an argument object "
                               f"reached {_first_line(exc)}") from exc
        finally:
            needs = footprint.close()
            hosts.rewind()
    _check_followed(recorder)
    if rng_free and recorder.seeded:  # its numbers would be frozen into the graph
        raise RandomFound()
    reads.check(recorder.seeded)
    _check(watch, [], host, device, gens)
    _check_held(held, restore=True)
    _check_objects(flat)
    if not records:  # a plain graph: autograd records nothing leaving it (``warmup=0``:
        # no warmup found a tensor read from elsewhere that requires grad)
        _check_autograd(_tensor_leaves(out), out)
    changed = objects.changed()
    if changed:  # (put back by ``capture``)
        raise Uncapturable(EagerReason.ASSIGNS, changed)
    if objects.grew():
        raise StateMade()
    # (a warmup's changes reach the caller's tensors; under grad mode a training
    # capture gives its buffers requires_grad itself)
    _check_geometry(substituted, flat.tensor_pos, shapes, flags=not torch.is_grad_enabled())
    syncs = containers.changes(snap, out) if snap else ()
    if watch.refs_assigned(refs):
        raise Uncapturable(EagerReason.ASSIGNS, REF_ASSIGNED)
    watch.steps.add(stepped.optimizers)
    effects = hosts.effects(out)
    written = {i for i in recorder.written if i >= 0}
    if written:  # an argument thought read-only is written: capture it in place
        raise WritesFound(written)
    # tensors that outlive the graph, returned as they are: parameters, buffers, named
    # tensors, a module's plain tensor attributes, and tensors read from elsewhere
    kept = [*watch.attribute_tensors(), *recorder.hidden.values()]
    persistent = watch.storage_ptrs() | {storage_ptr(t) for t in kept if t.numel()}
    themselves = {id(t) for t in (*watch.tensors(), *watch.named(), *kept)}
    build = output_builder(out, leaves, static, inplace, persistent, reuse, aliases,
                           tuple((pos, walked) for pos, walked, _, _ in flat.objects),
                           themselves, lambda: _before_the_call(watch, flat, refs))
    _try_build(build, leaves)
    _check_inference(getattr(build, "pool_outputs", ()))
    state_written = [state[-1 - i] for i in recorder.written if i < 0]
    owners = [*watch.tensors(), *watch.named(), *(leaves[i] for i in inplace)]
    grads_of = [*stepped.parameters(), *(
        [t for t in owners if t.is_leaf and t.requires_grad] if reads_grad
        else _grads_read(recorder.hidden.values(), owners))]
    captured = Captured(graph, static, build, backend, device, recorder.seeded,
                        list(recorder.hidden.values()), state_written, inplace, reuse)
    captured.footprint = needs
    captured.grads_of = grads_of
    captured.effects = effects
    captured.syncs = syncs
    captured.bumps = _bumps(counted, before, len(inplace), inplace)
    written_hidden = _hidden_bumps(recorder, {id(_root(t)) for t in counted})
    if written_hidden:
        captured.bumps = captured.bumps._replace(hidden=written_hidden)
    return captured


REF_ASSIGNED = "a global or class attribute that it reads"
FLAGS_CHANGED = ("a process-wide mode or numerics flag (matmul precision, the default "
                 "dtype, grad mode) that it leaves changed")


def _check_argument_state(leaves: list[Any], copied: list[int], reads_grad: bool) -> None:
    """What a static buffer cannot stand in for: a tensor argument with a ``.grad``, or
    one that could have one where the code names ``.grad`` (a gradient-clipping or
    optimizer helper reads it): captured in place, by address, its ``.grad`` guarded."""
    if torch.is_grad_enabled():  # a training capture: its inputs' .grad is autograd's
        return
    graded = {i for i in copied if _grad(leaves[i]) is not None
              or (reads_grad and leaves[i].requires_grad and leaves[i].is_leaf)}
    if graded:
        raise WritesFound(graded)


def _show_requires_grad(static: StaticInputs, leaves: list[Any]) -> None:
    """Give the static buffers their arguments' ``requires_grad`` where autograd records
    nothing (``[p for p in params if p.requires_grad]`` under ``no_grad``; the key
    holds the flag, so every call of the graph passes the same) and their Python
    attributes (``_is_hf_initialized`` on a loaded weight; read at capture, not keyed)."""
    grad_off = not torch.is_grad_enabled()
    for i, buf in zip(static.positions, static.buffers):
        if grad_off and leaves[i].requires_grad and not buf.requires_grad and buf.is_leaf:
            buf.requires_grad_(True)
        if leaves[i].__dict__ and not buf.__dict__:
            buf.__dict__.update(leaves[i].__dict__)


def _reads_grad(reached: Reach, watch: Watch) -> bool:
    """Whether the user's code (the function and the helpers it names:
    :class:`autograph.reach.Reach`) or a watched module's ``forward`` names ``.grad``
    (``if w.grad is not None``; ``torch.autograd.grad`` does not count): then every
    parameter's and pinned argument's ``.grad``, None included, is guarded, not only
    those a graph read."""
    codes = [*reached.codes, *(getattr(getattr(type(m), "forward", None), "__code__", None)
                               for m in watch.every_module())]
    return any(code is not None and coderefs.reads_attribute(code, "grad", "autograd")
               for code in codes)


def _grads_read(hidden: Any, owners: list[torch.Tensor]) -> list[torch.Tensor]:
    """Those of ``owners`` whose ``.grad`` the capture read (a graph would read that
    tensor for ever, while ``zero_grad(set_to_none=True)`` and a backward give the
    owner another): their ``.grad`` is guarded as it is now (``StepGuard.add_grads``)."""
    read = {storage_ptr(t) for t in hidden if t.numel()}
    if not read:
        return []
    return [t for t in owners if (g := _grad(t)) is not None and g.numel()
            and storage_ptr(g) in read]


def changed_once(problem: Uncapturable) -> bool:
    """Whether a learning warmup's problem may be a lazy set-up, made once (a global
    set, a module's dict filled or an attribute set at its first call, as a layer
    caching its normalised adjacency): the next warmup learns again."""
    detail = problem.detail or ""
    return (isinstance(problem, (AttributeSet, ScriptFirstRun)) or detail == REF_ASSIGNED
            or detail.startswith((containers.MODULE_CONTAINER, containers.MODULE_OBJECT)))


def _hidden_bumps(recorder: Any, counted: set[int]) -> tuple[Any, ...]:
    """Weak references to the tensors read from elsewhere (a plain object's) that the
    capture advanced the version counter of, once per advance (not those ``counted``
    otherwise: ids of their roots)."""
    out: list[Any] = []
    for k, then in recorder.hidden_versions.items():
        t = recorder.hidden[k]
        if id(_root(t)) not in counted:
            out += [weakref.ref(t)] * max(0, t._version - then)
    return tuple(out)


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose version counter ``t`` shares (its base, for a view)."""
    return t._base if t._base is not None else t


def _bumps(tensors: list[torch.Tensor], before: list[int | None], n_args: int,
           inplace: tuple[int, ...]) -> Bumps:
    """What the capture advanced the version counters of: the first ``n_args`` tensors
    are the arguments at ``inplace``, the rest state."""
    positions: list[int] = []
    state: list[torch.Tensor] = []
    counters: set[int] = set()  # a view and its base share one counter: bumped once
    for k, (t, then, now) in enumerate(zip(tensors, before, versions(tensors))):
        if then is None or now is None or now <= then:
            continue
        root = _root(t)
        if id(root) in counters:
            continue
        counters.add(id(root))
        if k < n_args:
            positions += [inplace[k]] * (now - then)
        else:
            state += [t] * (now - then)
    return Bumps(tuple(positions), tuple(state))


def _check_inference(outputs: Any) -> None:
    """Raise where a replay could not hand out copies of the outputs as eager's are:
    some made in inference mode and some not (``replay.in_inference_mode`` copies all
    in one mode), or made outside inference mode by a call made inside it (the
    function turned it off)."""
    kinds = {t.is_inference() for t in outputs if isinstance(t, torch.Tensor)}
    if len(kinds) > 1:
        raise Uncapturable(EagerReason.OUTPUT, "outputs made both in and out of "
                           "inference mode")
    if kinds == {False} and torch.is_inference_mode_enabled():
        raise Uncapturable(EagerReason.OUTPUT, "outputs made outside inference mode by "
                           "a call made inside it")


def _try_build(build: Callable[[list[Any]], Any], leaves: list[Any]) -> None:
    """Build the outputs once before the first replay: a build that fails after a
    replay could only run the call eagerly again, writing its arguments and buffers a
    second time."""
    try:
        build(leaves)
    except Exception as exc:  # noqa: BLE001 - any failure: the call runs eagerly
        raise Uncapturable(EagerReason.OUTPUT, f"its outputs cannot be rebuilt: "
                           f"{_first_line(exc)}") from exc


def hand_back(captured: Captured, leaves: list[Any], missed: list[int]) -> None:
    """After the first replay of a graph that also wrote arguments in place: give the
    caller the values the graph wrote, through something no operator declared (a raw
    kernel), into the static buffers at ``missed``."""
    static = captured.static
    with torch.inference_mode():
        for i, buf in zip(static.positions, static.buffers):
            if i in missed:
                leaves[i].copy_(buf)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:200]


_NO_BLOCK = contextlib.nullcontext()


@contextlib.contextmanager
def call_scope(watch: Watch) -> Iterator[None]:
    """What every warmup and capture of a graphed call runs under (output variants'
    captures too): nested graphed calls run eagerly (``nested_block``), the watch sees
    what the call reads (``running``), and autocast caches no casts."""
    with nested_block(), running(watch), _no_autocast_cache():
        yield


@contextlib.contextmanager
def _no_autocast_cache() -> Iterator[None]:
    """No autocast cache during a capture under autocast: a weight cast cached by an
    earlier eager call would be read by the graph from memory the cache frees when its
    autocast block ends; uncached, the cast is captured and redone on every replay.
    Outside autocast the cache holds nothing and is left alone: a ``torch.compile``'d
    submodule guards on the setting, and would compile again for a warmup."""
    enabled = torch.is_autocast_cache_enabled()
    if not enabled or not (_any_autocast() or _autocast_nesting()):
        yield
        return
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


def _autocast_nesting() -> int:
    """How many autocast blocks are open (those disabled too: the cache lives until
    the outermost ends), read by entering and leaving one more level."""
    depth = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return int(depth) - 1


class nested_block:  # noqa: N801 - used like a function
    """Marks this thread as inside a warmup or capture: nested graphed calls run
    eagerly.  ``active`` counts such blocks in all threads, so the call path reads the
    thread-local only while some thread is warming up."""

    __slots__ = ()
    active = 0
    _local = threading.local()
    _lock = threading.Lock()

    def __enter__(self) -> None:
        with nested_block._lock:
            nested_block.active += 1
        local = nested_block._local
        local.depth = getattr(local, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        nested_block._local.depth -= 1
        with nested_block._lock:
            nested_block.active -= 1


def is_nested() -> bool:
    """True inside a graphed call's warmup or capture (in this thread)."""
    return bool(nested_block.active and getattr(nested_block._local, "depth", 0))
