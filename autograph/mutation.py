"""Which arguments a function writes in place.

A graph replays into fixed addresses.  An argument the function only reads can be
copied into a private static buffer before each replay; an argument it *writes* (a KV
cache updated with ``index_copy_``, a running statistic) must instead be captured in
place, at the caller's own address, so the caller sees the write and no copy of the
whole tensor is made per call.

:class:`WriteRecorder` finds those arguments by watching every ATen operator during a
warmup run or a capture and checking its schema for written (``Tensor(a!)``) arguments.
Writes it cannot see (a raw Triton kernel, a graph replayed inside the call) are caught
after capture by comparing the static buffers with the caller's tensors.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .rng import went_back

# torch's higher-order operators by name (``cond``, ``while_loop``, ``flex_attention``)
_HIGHER_ORDER: dict[str, Any] = getattr(torch._ops, "_higher_order_ops", {})
_handled: set[str] = set()


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# Operators that write arguments their schema does not mark as written (``Tensor?``
# where ``Tensor(a!)?`` is meant): argument positions written when ``training`` (the
# sixth argument; ``use_input_stats`` for instance norm) is set.  A mode sees the
# composite ``batch_norm`` and ``instance_norm`` themselves under inference mode, and
# cuDNN's or MIOpen's kernels on those devices.
_aten = torch.ops.aten
UNDECLARED_WRITES: dict[Any, tuple[int, ...]] = {
    getattr(_aten, name).default: (3, 4)
    for name in ("native_batch_norm", "batch_norm", "_batch_norm_impl_index",
                 "instance_norm", "cudnn_batch_norm", "miopen_batch_norm")
    if hasattr(_aten, name)
}


def written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The argument values ``func`` writes: those its schema marks ``(a!)``, and the
    known undeclared ones."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append(args[i] if i < len(args) else kwargs.get(arg.name))
    undeclared = UNDECLARED_WRITES.get(func)
    if undeclared and len(args) > 5 and args[5]:  # training
        out.extend(args[i] for i in undeclared)
    return out


class _Recorder(TorchDispatchMode):
    """Records what a call does to tensors it did not create.

    ``watched`` maps a storage address to the argument positions that live in it;
    after the run, ``written`` holds the positions whose storage was written.  With
    ``known`` (storage addresses of the arguments, parameters and buffers), tensors
    read that are none of those and were not made during the call are kept in
    ``hidden`` (a graph would read them at their capture address for ever), and
    ``seeded`` says whether a random operator ran.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable, whose first
        # call imports Dynamo (seconds).  Without Dynamo imported, nothing can compile
        # these frames, so this class is left unwrapped; see WriteRecorder().
        return False

    def __init__(self, watched: dict[int, list[int]], known: set[int] | None = None) -> None:
        super().__init__()
        self.watched = watched
        self.written: set[int] = set()
        self.known = known
        self.made: set[int] = set()
        self.hidden: dict[int, torch.Tensor] = {}
        # each hidden tensor's version counter when first seen (before an operator's
        # write advances it): what the call advanced it by is known after the call
        self.hidden_versions: dict[int, int] = {}
        self.seeded = False
        # with ``rng`` (a learning warmup's ``rng.mark`` of the device's generator, and
        # ``rng_last`` its mark when the call began): ``rng_set`` says whether the
        # generator was set before a random operator, since the last one or the start
        self.rng: Callable[[], Any] | None = None
        self.rng_set = False
        self.rng_last: Any = None
        # a higher-order operator the call ran (``torch.cond``, ``while_loop``,
        # ``flex_attention``): it runs unrecorded, its inner operators unseen
        self.opaque: str | None = None

    def __enter__(self) -> Any:
        _EAGER.begin()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            _EAGER.end()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.watched:
            for value in written_args(func, args, kwargs):
                self._note(value)
        if self.known is not None:
            if func in _LIFTS:  # torch.tensor(data): a tensor the call made from Python
                self.made.add(_storage_key(args[0]))
            self._reads(func, args, kwargs)
        if self.rng is not None and _SEEDED is not None and _SEEDED in func.tags:
            out = self._between_draws(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if self.known is not None:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.made.add(_storage_key(t))
        return out

    def _between_draws(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run a random operator, noting whether the generator was set since the last
        one (``rng.went_back``)."""
        now = self.rng()  # type: ignore[misc]
        last = self.rng_last
        if last is not None and now is not None and went_back(last, now):
            self.rng_set = True
        out = func(*args, **kwargs)
        self.rng_last = self.rng()  # type: ignore[misc]
        return out

    def _reads(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if _SEEDED is not None and _SEEDED in func.tags and _draws(func, args, kwargs):
            self.seeded = True
        known, made = self.known, self.made
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and not _is_fake(t):
                k = _storage_key(t)
                if k and k not in made and k not in known:  # type: ignore[operator]
                    if k not in self.hidden:
                        self.hidden[k] = t
                        if not t.is_inference():
                            self.hidden_versions[k] = t._version

    def _note(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            positions = self.watched.get(storage_ptr(value))
            if positions:
                self.written.update(positions)
        elif isinstance(value, (list, tuple)):
            for v in value:
                self._note(v)


# ``torch.tensor(...)`` builds its tensor outside the dispatcher and then lifts it: the
# lifted tensor is the call's own (its values come from Python, keyed or guarded), not a
# hidden read of state from outside the call
_LIFTS = frozenset(op.default for op in (getattr(torch.ops.aten, name, None)
                                         for name in ("lift_fresh", "lift_fresh_copy"))
                   if op is not None)
_MISSING = object()
_SEEDED = getattr(torch.Tag, "nondeterministic_seeded", None)
# arguments that switch a seeded operator's randomness off: a dropout probability of 0
# (attention's ``dropout_p``, dropout's ``p``) or ``train=False``
_NO_DRAW = {"dropout_p": 0.0, "p": 0.0, "train": False}


def _draws(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a seeded operator draws random numbers in this call.  Attention kernels
    are tagged seeded for their dropout, which inference runs with ``dropout_p=0``."""
    try:
        schema = func._schema.arguments
    except AttributeError:
        return True
    for i, arg in enumerate(schema):
        off = _NO_DRAW.get(arg.name, _MISSING)
        if off is _MISSING:
            continue
        if arg.name in kwargs:
            value = kwargs[arg.name]
        elif i < len(args):
            value = args[i]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            continue
        if type(value) in (float, int, bool) and value == off:
            return False
    return True


def _storage_key(t: torch.Tensor) -> int:
    try:
        return storage_ptr(t)
    except (RuntimeError, NotImplementedError):  # tensors without storage
        return 0


def _is_fake(t: torch.Tensor) -> bool:
    return t.device.type == "meta"


def watch_map(leaves: list[Any], positions: tuple[int, ...]) -> dict[int, list[int]]:
    """Storage address -> argument positions, for the tensor leaves at ``positions``."""
    watched: dict[int, list[int]] = {}
    for i in positions:
        t = leaves[i]
        if t.numel():
            watched.setdefault(storage_ptr(t), []).append(i)
    return watched


class _DynamoSafeRecorder(_Recorder):
    """The same, with __torch_dispatch__ kept out of Dynamo (torch's default for modes)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return True

    __torch_dispatch__ = _Recorder.__torch_dispatch__


class _EagerStance:
    """Dynamo's ``force_eager`` stance (``torch.compile``'d code runs eagerly) while any
    recorder is active in the process, where Dynamo is imported: a recorder must see
    every operator a call runs, and Dynamo, meeting a frame under a dispatch mode,
    would run it uncompiled and mark its code skipped for ever (never compiled again).

    The stance is process-wide, so it is counted: set by the first recorder entered,
    and put back by the last one left only if it is still the one set (a stance the
    user set meanwhile stays); one put back by another's context exit is taken for the
    stance that stood before, at the next recording.  Where Dynamo was imported only
    while recording (``torch.cond`` imports it), the code it skipped is reset at the
    end (:func:`_unskip`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._set: Any = None  # the ``set_stance`` made at the first entry, if any
        self._ours: Any = None  # the stance it installed
        self._prior: Any = None  # and what stood before it

    def begin(self) -> None:
        with self._lock:
            self._depth += 1
            if self._depth > 1:
                return
            dynamo = sys.modules.get("torch._dynamo")
            set_stance = getattr(dynamo, "set_stance", None)
            self._set = None
            if set_stance is None:
                return
            try:
                made = set_stance("force_eager")
            except RuntimeError:  # inside a torch.compile region: none can be set
                return
            if made.prev is self._ours:  # ours, left by another's exit: what stood before
                made.prev = self._prior
            self._set, self._ours, self._prior = made, made.stance, made.prev

    def end(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth:
                return
            made, self._set = self._set, None
            if made is None:
                _unskip()
                return
            frame = sys.modules.get("torch._dynamo.eval_frame")
            if getattr(frame, "_stance", None) is self._ours:
                try:
                    made.__exit__(None, None, None)  # puts back what stood before
                except RuntimeError:  # pragma: no cover - inside a compile region
                    pass


_EAGER = _EagerStance()


def _unskip() -> None:
    """Let Dynamo compile again the code objects it skipped while recorders were active
    with Dynamo imported only meanwhile (``torch.cond`` imports it): with a dispatch mode
    active, Dynamo runs a frame uncompiled and marks its code skipped for ever (a later
    ``torch.cond`` would fail to trace).  Those hold nothing compiled: resetting the
    code objects Dynamo met that hold nothing compiled loses nothing.  Dynamo meets
    code only inside torch.compile, so the list is short, and empty without it."""
    frames = sys.modules.get("torch._dynamo.convert_frame")
    if frames is None or not frames.input_codes.seen:
        return
    native = sys.modules.get("torch._C._dynamo.eval_frame")
    reset = getattr(native, "reset_code", None)
    entries = getattr(native, "_debug_get_cache_entry_list", None)
    if reset is None or entries is None:  # pragma: no cover - a torch without them
        return
    for ref in list(frames.input_codes.seen):
        code = ref()
        if code is not None and not entries(code):
            reset(code)


def _run_unrecorded(name: str) -> Callable[..., Any]:
    """The rule of autograph's dispatch modes for the higher-order operator ``name``:
    it runs (under the modes outside), and a recorder is marked ``opaque``: it cannot
    follow the operator's inner operators.  Without a rule the operator would raise
    under the mode."""
    def rule(mode: TorchDispatchMode, *args: Any, **kwargs: Any) -> Any:
        if isinstance(mode, _Recorder):
            mode.opaque = mode.opaque or name
        return _HIGHER_ORDER[name](*args, **kwargs)

    # kept from Dynamo, as torch keeps modes' __torch_dispatch__: an operator run eagerly
    # (``torch.cond``) is inside a compile whose frames the mode made it skip
    return torch._disable_dynamo(rule, recursive=True)


_MODES: list[type] = []  # autograph's dispatch modes (:func:`pass_higher_order`)


def pass_higher_order(mode: type) -> type:
    """Register ``mode``, a dispatch mode of autograph's, for :func:`_run_unrecorded`'s
    rule for each higher-order operator (made as they appear)."""
    _MODES.append(mode)
    _handled.clear()
    return mode


pass_higher_order(_Recorder)
pass_higher_order(_DynamoSafeRecorder)


def _handle_higher_order() -> None:
    """Give autograph's modes a rule for each higher-order operator not yet handled
    (torch makes some when a module is first imported)."""
    for name, op in list(_HIGHER_ORDER.items()):
        if name not in _handled:
            _handled.add(name)
            for cls in _MODES:
                if cls not in op.python_key_table:
                    try:
                        op.py_impl(cls)(_run_unrecorded(name))
                    except Exception:  # noqa: BLE001 - one refusing a rule keeps torch's way
                        continue


def WriteRecorder(watched: dict[int, list[int]],  # noqa: N802 - a class to callers
                  known: set[int] | None = None) -> _Recorder:
    """A mode recording the watched storages written while it is active (and, given
    ``known``, hidden reads and random operators).  Dynamo-safe once Dynamo is imported
    (torch.compile may then run inside the recorded call)."""
    if len(_handled) != len(_HIGHER_ORDER):
        _handle_higher_order()
    if "torch._dynamo" in sys.modules:
        return _DynamoSafeRecorder(watched, known)
    return _Recorder(watched, known)
