"""Python state a captured graph bakes in, and how autograph notices it change.

A graph reads parameters and buffers at the addresses they had at capture, and it
replays the Python decisions (attribute values, flags, which submodule is called) that
were taken while it was captured.  A :class:`Watch` guards one graphed callable:

* Parameters, buffers and tensors reached through globals and closures are checked on
  every call by address (one pass over the module's ``_parameters``/``_buffers``
  entries).  ``model.half()``, ``param.data = ...``, a new ``nn.Parameter`` or a
  ``.to()`` all change an address, so the graphs are dropped and recaptured.  In-place
  updates (``load_state_dict``, an optimizer step) keep addresses and are simply seen
  by the next replay.
* Attribute assignment on any module of the watched trees (a float scale, a flag, a
  swapped submodule) is reported by a hook on ``nn.Module.__setattr__``/``__delattr__``
  (installed when the first module is watched) and by torch's global registration
  hooks; it marks the watch dirty.  An assignment made *by the forward itself* while
  autograph runs it is reported instead, so that key runs eagerly.
* Modules, tensors and plain scalars named by the function's globals and closure cells
  are re-read on every call and compared with what they were at capture, and so are
  the scalar class attributes a module's ``forward`` names (``Gate.fused = False``
  flips every instance at once; ``coderefs.class_refs``).

* Forward hooks registered later (``register_forward_hook``, ``..._pre_hook``, the
  global ones) are reported by a wrapper of those methods: the callable's calls run
  eagerly while a hook is registered, and replay again once it is removed.  A backward
  hook registered later drops the graphs (a training graph checks for them at capture).

* Plain configuration objects held by the watched modules (the object at a module's
  ``config`` attribute, dataclass instances) are compared with a shallow copy on every
  call (``coderefs.config_dicts``), and so are the lists, dicts and sets of plain
  values they hold (PEFT's ``merged_adapters``, a ``scaling`` dict: changed in place,
  they set no attribute; ``coderefs.held_values``).

What cannot be seen: state reached through other objects (``self.helper.scale``;
nested values inside a configuration object), globals read by helper functions,
writes straight into ``module.__dict__``, into ``_parameters`` at the same address
with another shape, or into a module's hook dictionaries.  ``reset()`` drops a
callable's graphs by hand.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import containers, notify
from .coderefs import (
    changed_attribute,
    class_refs,
    code_refs,
    config_dicts,
    forward_refs,
    held_values,
    is_namespace,
    new_refs,
    owner_refs,
    put_back,
    same,
    same_items,
)
from .reach import Reach, reach
from .rng import host_generators, torch_generators
from .steps import StepGuard

_Module = nn.Module
_ptr: Callable[[Any], int] = torch.Tensor.data_ptr


_Lazy = getattr(torch.nn.parameter, "UninitializedTensorMixin", ())


def _held_ptr(t: Any) -> int:
    """``t``'s address; -1 for a lazy module's parameter not yet initialised
    (``nn.LazyLinear`` before its first call, which has no memory; its module runs
    eagerly then, through its initialising hook)."""
    return -1 if isinstance(t, _Lazy) else _ptr(t)


def _strided(t: torch.Tensor) -> bool:
    return t.layout is torch.strided


UNKEYABLE_NAMED = "a sparse tensor the code names (no storage a graph can read or guard)"


def _unkeyable(module: nn.Module, name: str, t: torch.Tensor) -> str:
    return (f"{type(module).__name__}.{name} is a {t.layout} tensor (no storage a graph "
            "can read or guard)")


def _set_quietly(module: nn.Module, name: str, value: Any) -> None:
    """``nn.Module.__setattr__`` past the assignment hook (``notify.install``)."""
    setter = nn.Module.__setattr__
    getattr(setter, "__wrapped__", setter)(module, name, value)


def _del_quietly(module: nn.Module, name: str) -> None:
    deleter = nn.Module.__delattr__
    getattr(deleter, "__wrapped__", deleter)(module, name)


_getitem = operator.getitem
_grad_enabled = torch.is_grad_enabled
_requires_grad = operator.attrgetter("requires_grad")
# One C++ pass comparing tensors' data pointers with expected ones (CUDA builds; the
# same check CUDA graph trees make), else a Python pass.
_ptrs_equal: Callable[[list[Any], list[int], list[int]], bool] | None = getattr(
    torch._C, "_tensors_data_ptrs_at_indices_equal", None)

_local = threading.local()


def _host_stamp(t: torch.Tensor) -> Any:
    """What tells a host tensor's contents apart between calls: its version counter,
    or for an inference tensor (which has none: a model built under
    ``torch.inference_mode()``) a copy of it."""
    return t.detach().clone() if t.is_inference() else t._version


def _same_stamp(t: torch.Tensor, stamp: Any) -> bool:
    if isinstance(stamp, int):
        return t._version == stamp
    if t.shape != stamp.shape:
        return False
    if t.is_floating_point() or t.is_complex():  # NaN equal to NaN
        nan = t.isnan()
        return bool(torch.equal(nan, stamp.isnan())
                    and torch.equal(t.masked_fill(nan, 0), stamp.masked_fill(nan, 0)))
    return bool(torch.equal(t, stamp))


class Watch:
    """Guards the Python-side state of one graphed callable."""

    def __init__(self, roots: Callable[[], list[nn.Module]], code: Callable[..., Any] | None,
                 hooks_of_roots: bool, owner: Callable[[], Any] | None = None) -> None:
        self._roots = roots
        self._owner = owner  # the plain object whose method ``code`` is, if any
        self._code = code
        self._hooks_of_roots = hooks_of_roots
        self.stale = True
        self.dirty = False
        # an assignment since the last refresh other than a parameter or buffer replaced
        # by a tensor of its shape and dtype (see ``moved_only``)
        self.altered = False
        self.assigned: str | None = None
        # (module, name, what it held) at the first assignment of each attribute by the
        # running call since ``forget_assignments``: to tell a set-and-reset from a
        # change, and to undo what a failed capture's Python assigned
        self.assignments: list[tuple[nn.Module, str, Any]] = []
        # a running call gave a watched module a submodule or a parameter (a head built
        # at the first call), or a sparse tensor: the watch reads its trees again
        # (``Engine.own_change``)
        self.grown = False
        # why the state the call reads cannot be graphed (a sparse tensor a module
        # holds or the code names: no storage to guard, key or capture), or None
        self.unkeyable: str | None = None
        self._unkeyable_state: str | None = None  # (the modules' part, at refresh)
        # why module hooks forbid graphs now (or notify.RECHECK: a hook was registered since)
        self.hook_reason: str | None = None
        # a module backward hook was registered since: calls autograd records look for
        # them (``training.backward_hooks``) and run eagerly while there are any; the
        # graphs, right without them, replay again once they are removed
        self.backward_recheck = False
        # transformers' collecting hooks are on the modules (notify.collecting)
        self.collects = False
        # transformers' hook marking the input embeddings' output as requiring grad is on
        # them (notify.marks_grad): calls autograd records run eagerly
        self.marks_grad = False
        # a scripted module whose code assigns an attribute (notify.script_assigns)
        self.script_assigns: str | None = None
        self._own: set[int] = set()  # modules whose own hooks run outside the graphs
        self._hooked: Any = None  # what hook_reason names: a module, or notify.GLOBAL
        self._holders: list[Any] = []
        self._names: list[Any] = []
        self._ptrs: list[int] = []
        # the watched tensors' ids: another tensor object at the same address
        # (``torch.func.functional_call``'s leaves over the same memory) is another
        # parameter, whose requires_grad and .grad a graph's autograd edges must follow
        # (checked under grad mode only)
        self._idents: list[int] = []
        self._all: list[int] = []  # every index of _ptrs, for the C++ check
        self._refs: list[tuple[Callable[[], Any], Any]] = []
        self._named_ptrs: list[tuple[torch.Tensor, int]] = []
        # whether each named tensor required grad at the last look (checked under grad
        # mode only): one frozen or unfrozen since changes what autograd records, which
        # a graph does not follow (parameters: :meth:`grad_flags`, per graph)
        self._named_flags: list[bool] = []
        self._configs: list[tuple[Mapping[str, Any], dict[str, Any]]] = []  # (live, copy)
        self._values: list[Any] = []  # plain containers the modules hold, and copies
        self._value_copies: list[Any] = []
        self._owned = 0
        self._ids: list[int] = []
        self._hidden: list[tuple[Any, int, int | None, bool]] = []
        self.steps = StepGuard()  # optimizers stepped inside graphs (steps.py)
        # the position (in ``tensors()``) of one found requiring grad: no weak reference,
        # which ``torch.utils.swap_tensors`` (``.to()`` under the swap future) refuses
        self._last_grad: int | None = None
        self._modules: list[Any] = []  # weak references to the watched modules
        self._training: tuple[bool, ...] | None = None
        self.training_changes = 0  # assignments of a watched module's training flag
        # flags set between calls that select graphs, as ``training`` does (_keys_flag):
        # (module, attribute name), kept across refreshes
        self._flags: list[tuple[Callable[[], Any], str]] = []
        # flags that took a list value (its items may change in place): not cached
        self._live_flags: list[tuple[Callable[[], Any], str]] = []
        # per flag, the values it took; None once it took more than MAX_FLAG_VALUES
        self._flag_values: dict[tuple[int, str], set[Any] | None] = {}
        self.__weakref__: Any

    # -- building -----------------------------------------------------------------
    def refresh(self) -> None:
        """Enumerate the watched state anew (after creation or an invalidation)."""
        notify.install()
        self._unregister()
        refs = code_refs(self._code) if self._code is not None else []
        self._owned = 0  # the last refs: the owner's attributes
        if self._owner is not None and self._code is not None:
            owned = owner_refs(self._owner(), self._code)
            refs, self._owned = refs + owned, len(owned)
        roots = list(self._roots()) + [v for _, v in refs if isinstance(v, _Module)]
        modules: dict[int, nn.Module] = {}
        for root in roots:
            for m in root.modules():
                modules.setdefault(id(m), m)
        # class attributes the forwards read, before the owner's (the last ``_owned``)
        n = len(refs) - self._owned
        refs[n:n] = new_refs(class_refs(modules.values())
                             + forward_refs(modules.values(), self._code), refs)
        holders, names = [], []
        unkeyable = None
        for m in modules.values():
            for d in (m._parameters, m._buffers):
                for name, t in d.items():
                    if t is None:
                        continue
                    if _strided(t):
                        holders.append(d)
                        names.append(name)
                    else:
                        unkeyable = unkeyable or _unkeyable(m, name, t)
            for name, t in vars(m).items():
                if isinstance(t, torch.Tensor) and not _strided(t):
                    unkeyable = unkeyable or _unkeyable(m, name, t)
        self._unkeyable_state = unkeyable
        self._holders, self._names = holders, names
        self._refs = refs
        # a named tensor given other memory in place (``K.data = ...``, ``set_``) is the
        # same object at another address, which a graph does not follow
        self._take_named()
        self._configs = [(d, dict(d)) for d in config_dicts(modules.values())]
        self._values, self._value_copies = held_values(modules.values(), self._code)
        self._ptrs = self._current_ptrs()
        self._idents = list(map(id, map(_getitem, holders, names)))
        self._all = list(range(len(self._ptrs)))
        # a method's own module runs no hooks of its own (its forward is called, not
        # the module); every other module does, the ones the code names included
        self._own = set() if self._hooks_of_roots else {id(m) for m in self._roots()}
        self.hook_reason, self._hooked = notify.hooks_reason(list(modules.values()), self._own)
        self.collects = notify.collecting(list(modules.values()), self._own)
        self.marks_grad = notify.marks_grad(list(modules.values()), self._own)
        self.script_assigns = notify.script_assigns(modules.values())
        self._register(list(modules))
        self._modules = [weakref.ref(m) for m in modules.values()]
        self._training = None
        self._hidden = []
        self.steps.clear()
        self.dirty = self.altered = False
        self.stale = False

    def _current_ptrs(self) -> list[int]:
        return list(map(_held_ptr, map(_getitem, self._holders, self._names)))

    # -- the per-call check --------------------------------------------------------
    def ok(self) -> bool:
        """True while nothing a graph baked in has changed."""
        if self.dirty or self.stale:
            return False
        try:  # has any watched parameter or buffer another address (or is it gone)?
            tensors = list(map(_getitem, self._holders, self._names))
            if _ptrs_equal is not None:
                if not _ptrs_equal(tensors, self._ptrs, self._all):
                    return False
            elif list(map(_ptr, tensors)) != self._ptrs:
                return False
            # another object over the same memory matters where autograd records (its
            # requires_grad, its .grad): under no_grad the graph reads the same memory
            # (a parameter frozen or unfrozen is each graph's own check: a GAN's
            # discriminator toggled every step keeps a graph per state)
            grad = _grad_enabled()
            if grad and list(map(id, tensors)) != self._idents:
                return False
        except Exception:  # noqa: BLE001 - a tensor gone or replaced by another object
            return False
        for get, value in self._refs:
            if not same(get(), value):
                return False
        for t, ptr in self._named_ptrs:
            if t.data_ptr() != ptr:
                return False
        if grad and self._named_flags and self._named_flags_changed():
            return False
        if self._configs and not self._configs_same():
            return False
        if self._values and not self._values_same():
            return False
        if self.steps.active and not self.steps.ok():
            return False
        return not self._hidden or self._hidden_same(grad)

    def _values_same(self) -> bool:
        """Whether the plain containers the modules hold (``held_values``) still hold
        what they held; a comparison that raises (a tensor put in) counts as a change."""
        try:
            return bool(self._values == self._value_copies)
        except Exception:  # noqa: BLE001
            return False

    def values_same(self) -> bool:
        """:meth:`_values_same`, True where none are compared."""
        return not self._values or self._values_same()

    def accept_values(self) -> None:
        """Take what the containers hold now as what they hold (``Engine.own_change``,
        after a call's own change where no graph baked the old values in)."""
        if self._values and not self._values_same():
            try:
                self._value_copies = copy.deepcopy(self._values)
            except Exception:  # noqa: BLE001 - no longer plain: the next call drops
                self.dirty = True

    def _configs_same(self) -> bool:
        """Whether each configuration object still holds what it held (``config_dicts``;
        a value whose comparison raises, a tensor, counts as changed)."""
        try:
            return all(same_items(live, copy) for live, copy in self._configs)
        except Exception:  # noqa: BLE001
            return False

    def slots(self) -> list[tuple[dict[str, Any], str]]:
        """Where each watched parameter and buffer is held: its module's dict, its name."""
        return list(zip(self._holders, self._names))

    def hooks(self) -> str | None:
        """Why module hooks forbid graphs (called while ``hook_reason`` is set): while
        what it names still has hooks, the same; else (that hook was removed, or a hook
        was registered since) all modules are read again, so that a removed hook gives
        the graphs back."""
        if self.hook_reason is not notify.RECHECK and notify.still_hooked(self._hooked):
            return self.hook_reason
        modules = [m for m in (ref() for ref in self._modules) if m is not None]
        self.hook_reason, self._hooked = notify.hooks_reason(modules, self._own)
        self.collects = notify.collecting(modules, self._own)
        self.marks_grad = notify.marks_grad(modules, self._own)
        return self.hook_reason

    def still_marks_grad(self) -> bool:
        """Whether the hook of :attr:`marks_grad` is still there (it may have been
        removed since: then it is no longer looked for) on an embedding whose weight
        requires no grad (where it changes what autograd records; a weight frozen or
        unfrozen later is seen, as this is read at every call where the hook is)."""
        modules = self.every_module()
        self.marks_grad = notify.marks_grad(modules, self._own)
        return self.marks_grad and notify.marks_grad(modules, self._own, frozen=True)

    def _hidden_same(self, grad: bool = False) -> bool:
        """Whether each hidden tensor is alive at its address and version (and, with
        ``grad``, requires grad as it did)."""
        for ref, ptr, version, flag in self._hidden:
            t = ref()
            if t is None or t.data_ptr() != ptr or (version is not None
                                                    and not _same_stamp(t, version)):
                return False
            if grad and t.requires_grad is not flag:
                return False
        return True

    def moved_only(self) -> bool:
        """After a failed check: whether only parameters or buffers changed, by address
        (``model.half()``, ``.data =``, ``.to()``) or replaced by tensors of their shape and
        dtype (``load_state_dict(assign=True)``), and nothing a forward could decide on
        (an attribute, a submodule, a named global, a hidden tensor read)."""
        if self.stale or self.altered:
            return False
        try:
            if any(not same(get(), value) for get, value in self._refs):
                return False
            # a named tensor frozen or unfrozen: autograd records otherwise (warmups
            # find how)
            if self._named_flags_changed():
                return False
        except Exception:  # noqa: BLE001 - a global gone: be conservative
            return False
        return self._hidden_same(grad=True)

    def _named_flags_changed(self) -> bool:
        """Whether a named tensor requires grad otherwise than at the last look."""
        return [t.requires_grad for t, _ in self._named_ptrs] != self._named_flags

    def grad_flags(self) -> list[bool]:
        """Whether each watched parameter and buffer requires grad now."""
        return list(map(_requires_grad, self.tensors()))

    def requires_grad(self) -> bool:
        """Whether a watched parameter or buffer requires grad (the one found last time
        is tried first: with a trainable model under grad mode this is one check)."""
        last = self._last_grad
        if last is not None and last < len(self._names):
            try:  # a scripted module's dicts (``OrderedDictWrapper``) have no ``get``
                t = self._holders[last][self._names[last]]
            except KeyError:
                t = None
            if t is not None and t.requires_grad:
                return True
        for i, t in enumerate(self.tensors()):
            if t.requires_grad:
                self._last_grad = i
                return True
        self._last_grad = None
        return False

    def guard_hidden(self, tensors: list[torch.Tensor], device: torch.device) -> None:
        """Also guard tensors a graph reads that are no argument, parameter, buffer or
        named global (a cached weight, a tensor held by a plain object): the graphs go
        when one is freed or moves; one on another device than the graph's (a host
        tensor read at capture, baked into the graph) also when it is written in place."""
        for t in tensors:
            try:
                ref = weakref.ref(t)
            except TypeError:  # pragma: no cover - tensors support weak references
                continue
            version = _host_stamp(t) if t.device != device else None
            self._hidden.append((ref, t.data_ptr(), version, t.requires_grad))

    def forget_assignments(self) -> None:
        """Start noting the running call's assignments afresh."""
        self.assigned = None
        self.assignments = []

    def assigned_and_kept(self) -> str | None:
        """The first attribute the running call assigned and left changed (one set and
        put back, as a layer's ``self._alpha = a ... self._alpha = None``, is no
        change), or None."""
        if self.assigned is None or not self.assignments:
            return self.assigned
        for module, name, was in self.assignments:
            if not same(notify.current(module, name), was):
                return f"{type(module).__name__}.{name}"
        return None

    def undo_assignments(self, tensors_only: bool = False) -> bool:
        """Put back what the running call assigned (a capture that failed: its Python
        ran, and what it set, tensors of the pool, must not reach the eager run);
        ``tensors_only``: only where it assigned a tensor (a call that raised, whose
        other changes stand, as in eager mode).  Whether it put anything back."""
        put = False
        for module, name, was in reversed(self.assignments):
            if was is notify.CHANGED:
                continue  # changed in place: what it held is not known
            if tensors_only and not isinstance(notify.current(module, name), torch.Tensor):
                continue
            if was is notify.MISSING:
                _del_quietly(module, name)
            else:
                _set_quietly(module, name, was)
            put = True
        self.forget_assignments()
        return put

    @staticmethod
    def hook_mark() -> int:
        """The id the next hook registered gets (torch numbers every hook handle, module
        and tensor hooks alike, from one counter): :meth:`remove_hooks_since` removes
        those registered since."""
        return int(getattr(RemovableHandle, "next_id", 0))

    def remove_hooks_since(self, mark: int) -> None:
        """Remove the hooks registered since ``mark`` on the watched modules (forward,
        backward and state-dict hooks), their parameters and buffers, the tensors the
        code names, and globally on modules (a capture that failed: its Python ran, and
        a hook it installed once, as transformers' output-capturing hooks with their
        flag, would be installed again by the next run: every output twice; a gradient
        hook on a parameter, gradients scaled twice)."""
        owners: list[tuple[Any, tuple[str, ...]]] = [
            *((m, _HOOK_DICTS) for m in self.every_module()),
            *((t, _TENSOR_HOOK_DICTS) for t in (*self.tensors(), *self.named(),
                                                *self.attribute_tensors())),
            (_module_module(), _GLOBAL_HOOK_DICTS)]
        for owner, names in owners:
            for name in names:
                d = getattr(owner, name, None)
                if not isinstance(d, dict):
                    continue
                for k in [k for k in d if isinstance(k, int) and k >= mark]:
                    del d[k]
                    for extra in _HOOK_EXTRAS:  # what the hook's handle removes with it
                        extra_d = getattr(owner, extra, None)
                        if isinstance(extra_d, dict):
                            extra_d.pop(k, None)

    def put_back_refs(self, before: list[Any]) -> bool:
        """Give the guarded names (globals, closure cells, class attributes, the owner's
        attributes) the values in ``before`` (:meth:`ref_values`) where the running call
        changed them (a capture that failed: a table it cached in a global is memory
        no kernel filled), and take those as the values seen.  Whether any changed."""
        refs = self._refs
        if len(before) != len(refs):
            return False
        changed = False
        for (get, _), then in zip(refs, before):
            if not same(get(), then):
                put_back(get, then)
                changed = True
        if changed:
            self.accept_refs()
        return changed

    def tensor_dicts(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """The attributes each watched and named tensor holds (``w._hooked``, a table
        cached on a parameter), for :meth:`put_back_tensor_dicts`."""
        return [(t, _own_attributes(t)) for t in (*self.tensors(), *self.named())]

    @staticmethod
    def put_back_tensor_dicts(before: list[tuple[torch.Tensor, dict[str, Any]]]) -> bool:
        """Give each tensor the attributes it held in ``before`` (its hook dictionaries
        aside: :meth:`remove_hooks_since`); whether any changed."""
        changed = False
        for t, then in before:
            now = _own_attributes(t)
            if now.keys() != then.keys() or any(now[k] is not v for k, v in then.items()):
                d = t.__dict__
                for k in now:
                    if k not in then:
                        del d[k]
                d.update(then)
                changed = True
        return changed

    def namespaces(self) -> list[tuple[Any, frozenset[str]]]:
        """The names the method's object and the watched modules' classes hold, for
        :meth:`drop_new_names`: a name the call adds (``self._table = ...`` where there
        was none, ``type(self)._table``) has no guard of its own to put it back."""
        out: list[tuple[Any, frozenset[str]]] = []
        owner = self._owner() if self._owner is not None else None
        if isinstance(getattr(owner, "__dict__", None), dict):
            out.append((owner, frozenset(owner.__dict__)))
        classes = {id(type(m)): type(m) for m in self.every_module()}
        if owner is not None:
            classes.setdefault(id(type(owner)), type(owner))
        out += [(c, frozenset(vars(c))) for c in classes.values()]
        spaces = {id(v): v for _, v in self._refs
                  if is_namespace(v) and isinstance(getattr(v, "__dict__", None), dict)
                  and not isinstance(v, threading.local)}
        out += [(v, frozenset(vars(v))) for v in spaces.values()]
        return out

    @staticmethod
    def drop_new_names(before: list[tuple[Any, frozenset[str]]]) -> bool:
        """Delete the names added since ``before``; whether there were any."""
        changed = False
        for obj, names in before:
            for name in [n for n in list(vars(obj)) if n not in names]:
                with contextlib.suppress(Exception):
                    if isinstance(obj, (type, types.ModuleType)):
                        delattr(obj, name)
                    else:
                        object.__delattr__(obj, name)
                    changed = True
        return changed

    def owner_assigned(self, name: str) -> None:
        """The call running assigned an attribute of the plain object (as the hook tells
        of a module's): its key runs eagerly, and the values it left are the ones seen
        (not a change between calls that would drop the graphs)."""
        self.assigned = name
        n = self._owned
        if n:
            self._refs[-n:] = [(get, get()) for get, _ in self._refs[-n:]]
            self._take_named()

    def ref_values(self) -> list[Any]:
        """What the guarded names (globals, closure cells, class attributes, the
        owner's attributes) hold now, for :meth:`refs_assigned` after a call."""
        return [get() for get, _ in self._refs]

    def refs_assigned(self, before: list[Any]) -> bool:
        """After a call: whether the call itself changed a name it reads (``global
        n; n += 1``, ``type(self).calls += 1``) from the values in ``before``.  The
        guard then takes the values it left: the change is the call's own, as an
        attribute its forward assigns, not a change between calls to drop graphs for."""
        refs = self._refs
        if len(before) != len(refs) or all(
                same(get(), then) for (get, _), then in zip(refs, before)):
            return False
        self.accept_refs()
        return True

    def accept_refs(self) -> None:
        """Take the values the guarded names hold now as the ones seen (after an eager
        run of a call that changes one)."""
        self._refs = [(get, get()) for get, _ in self._refs]
        self._take_named()

    def _take_named(self) -> None:
        """Note the address and requires_grad of each tensor a guarded name holds."""
        named = [v for _, v in self._refs if isinstance(v, torch.Tensor)]
        self.unkeyable = self._unkeyable_state or (
            UNKEYABLE_NAMED if any(not _strided(v) for v in named) else None)
        self._named_ptrs = [(v, v.data_ptr()) for v in named if _strided(v)]
        self._named_flags = [t.requires_grad for t, _ in self._named_ptrs]

    def refs_moved(self) -> bool:
        """Whether a guarded name holds another value than the one seen."""
        return any(not same(get(), value) for get, value in self._refs)

    def owner_items(self) -> list[tuple[str, Any]] | None:
        """The attributes of the plain object whose method is graphed, or None."""
        obj = self._owner() if self._owner is not None else None
        d = getattr(obj, "__dict__", None)
        return list(d.items()) if isinstance(d, dict) else None

    def roots(self) -> list[nn.Module]:
        """The callable's own modules (the wrapped module, or the method's instance)."""
        return list(self._roots())

    def modules(self) -> list[nn.Module]:
        """The roots of the watched module trees: the callable's own modules and those
        its globals and closure cells name."""
        refs = code_refs(self._code) if self._code is not None else []
        return list(self._roots()) + [v for _, v in refs if isinstance(v, _Module)]

    def tensors(self) -> Iterable[torch.Tensor]:
        """The parameters and buffers of the watched trees."""
        return map(_getitem, self._holders, self._names)

    def every_module(self) -> list[nn.Module]:
        """Every watched module (the trees of :meth:`modules`, each module once)."""
        return [m for ref in self._modules if (m := ref()) is not None]

    def reach(self, fn: Callable[..., Any]) -> Reach:
        """What a call of ``fn`` reaches by name (:func:`autograph.reach.reach`), from
        the user's code (an instance method's function rather than the engine's
        closure) and object, and the watched modules' forwards."""
        owner = self._owner() if self._owner is not None else None
        code = self._code if self._code is not None else fn
        return reach(code, self.every_module(), owner)

    def host_generators(self, reached: Reach, arguments: Any) -> tuple[Any, ...]:
        """The host generator objects a call with ``arguments`` reaches
        (:func:`autograph.rng.host_generators`)."""
        return host_generators(reached, self.every_module(), arguments)

    def torch_generators(self, fn: Callable[..., Any], arguments: Any
                         ) -> tuple[torch.Generator, ...]:
        """The ``torch.Generator`` objects a call of ``fn`` reaches by name
        (:func:`autograph.rng.torch_generators`)."""
        return torch_generators(self.reach(fn), self.every_module(), arguments)

    def held(self, reached: Reach) -> containers.Held:
        """The containers a call may change (:func:`containers.held`): those the watched
        modules hold, those a partial or a default binds, those the graphed method's
        object holds under a name its code uses, and those the user's code, its helpers
        and the modules' forwards name (:func:`containers.named_by`)."""
        named = reached.bound + reached.owner_named + containers.named_by(reached.named)
        return containers.held(self.every_module(), named)

    def attribute_tensors(self) -> list[torch.Tensor]:
        """Tensors held as plain attributes of the watched modules (``self.table =
        torch.zeros(3)``: no parameter or buffer); assigning one is seen as any
        attribute assignment is."""
        return [v for ref in self._modules if (m := ref()) is not None
                for v in vars(m).values() if isinstance(v, torch.Tensor) and _strided(v)]

    def named(self) -> list[torch.Tensor]:
        """The tensors the code names (a global, a closure's, ``self.k`` of no module)."""
        return [v for _, v in self._refs if isinstance(v, torch.Tensor) and _strided(v)]

    def storage_ptrs(self, device: torch.device | None = None) -> set[int]:
        """Storage addresses of the watched parameters, buffers and named tensors (with
        ``device``, those that a graph on it reads at replay).  A host tensor read by a
        device graph is left out: its value is baked in at capture (a 0-dim CPU tensor is
        a kernel's scalar argument), so it is guarded as a hidden read, by version too."""
        host = device is not None and device.type != "cpu"
        return {t.untyped_storage().data_ptr() for t in (*self.tensors(), *self.named())
                if not (host and t.device.type == "cpu")}

    # -- assignment hook plumbing ----------------------------------------------------
    def _register(self, ids: list[int]) -> None:
        """Watch these module ids (ids, not modules: the watch must not keep them alive)."""
        with notify.watched_lock:
            self._ids = ids
            # the sets of watches collected without ``close`` (a dropped wrapper's)
            for i in [i for i, ws in notify.watched.items() if not ws]:
                del notify.watched[i]
            for i in ids:
                # a collection in between may close another watch (same thread, hence
                # the RLock) and drop the set it emptied: ours must be the set kept
                while True:
                    ws = notify.watched.setdefault(i, weakref.WeakSet())
                    ws.add(self)
                    if notify.watched.get(i) is ws:
                        break

    def _unregister(self) -> None:
        with notify.watched_lock:
            for i in self._ids:
                ws = notify.watched.get(i)
                if ws is not None:
                    ws.discard(self)
                    if not ws:
                        del notify.watched[i]
            self._ids = []

    def close(self) -> None:
        self._unregister()

    def training(self) -> tuple[bool, ...]:
        """The training flag of every watched module (part of the key: ``train()`` and
        ``eval()`` select other graphs instead of dropping them)."""
        flags = self._training
        if flags is None:
            modules = [ref() for ref in self._modules]
            flags = tuple(getattr(m, "training", False) for m in modules
                          if m is not None)  # (a frozen script: none)
            if self._flags:
                flags += tuple(_flag_value(ref(), name) for ref, name in self._flags)
            self._training = flags
        if self._live_flags:  # a list flag may change in place: read at every call
            return flags + tuple(_live_value(ref(), name) for ref, name in self._live_flags)
        return flags

    def _on_assign(self, module: nn.Module, name: str, swap: bool = False,
                   was: Any = notify.MISSING, value: Any = notify.MISSING) -> None:
        if name == "training":
            self._training = None  # read again at the next call: it is in the key
            self.training_changes += 1  # (a capture under way compares it)
            return
        if name == _HOOK_KIND:  # torch's note of a backward hook's kind (the hook counts)
            return
        if self in getattr(_local, "running", ()):
            self.assigned = self.assigned or f"{type(module).__name__}.{name}"
            if isinstance(value, (nn.Module, nn.Parameter)) or any(
                    isinstance(v, torch.Tensor) and not _strided(v) for v in (value, was)):
                self.grown = True  # (a sparse tensor made dense: keyable again)
            if not any(m is module and n == name for m, n, _ in self.assignments):
                self.assignments.append((module, name, was))
        elif not self._keys_flag(module, name, was, value):
            self.dirty = True
            self.altered = self.altered or not swap

    def _keys_flag(self, module: nn.Module, name: str, was: Any, value: Any) -> bool:
        """Whether the assignment of a flag between calls (a bool, a string or None, or a
        short list of them, set over another such value: PEFT's ``disable_adapter()``
        and ``set_adapter()``, a mode name; :func:`flag_key`) selects
        graphs as ``train()``/``eval()`` do, its value part of the key from now on,
        instead of dropping the graphs at every switch.  Its first switch drops them
        once (their keys do not carry it); one that takes more than
        :data:`MAX_FLAG_VALUES` values (a request id) drops them at every new value
        again, as other attributes do, rather than keep a graph per value."""
        was, value = flag_key(was), flag_key(value)
        if was is _NO_FLAG or value is _NO_FLAG:
            return False
        where = (id(module), name)
        known = [r for r, n in self._flags if n == name and r() is module]
        if where in self._flag_values and not known and self._flag_values[where] is not None:
            del self._flag_values[where]  # another module, at a freed one's address
        values = self._flag_values.get(where, set())
        if values is None:  # too many values: not a flag
            return False
        self._training = None
        self.training_changes += 1
        if where not in self._flag_values:
            self._flag_values[where] = {was, value}
            self._flags.append((weakref.ref(module), name))
            self.dirty = self.altered = True
        else:
            values.add(value)
        if len(self._flag_values[where] or ()) > MAX_FLAG_VALUES:
            self._flag_values[where] = None
            self._flags = [(r, n) for r, n in self._flags if (id(r()), n) != where]
            self._live_flags = [(r, n) for r, n in self._live_flags if (id(r()), n) != where]
            return False
        if type(value) is tuple and not any(  # a list's: read per call from now on
                n == name and r() is module for r, n in self._live_flags):
            self._live_flags.append((weakref.ref(module), name))
        return True


# a module's hook dictionaries, and those keyed by the same hook ids alongside
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
_TENSOR_HOOK_DICTS = ("_backward_hooks", "_post_accumulate_grad_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                      "_global_backward_hooks", "_global_backward_pre_hooks")
_HOOK_EXTRAS = ("_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                "_forward_pre_hooks_with_kwargs", "_global_forward_hooks_with_kwargs",
                "_global_forward_hooks_always_called")


def _own_attributes(t: torch.Tensor) -> dict[str, Any]:
    """A tensor's attributes but its hook dictionaries."""
    return {k: v for k, v in t.__dict__.items() if k not in _TENSOR_HOOK_DICTS}


def _module_module() -> Any:
    """``torch.nn.modules.module``, which holds the global module hooks."""
    from torch.nn.modules import module

    return module


_HOOK_KIND = "_is_full_backward_hook"  # set by nn.Module's backward hook registration
_FLAG_TYPES = frozenset({bool, str, type(None)})
MAX_FLAG_VALUES = 8  # values of a flag keyed; past them it drops the graphs per value
_ABSENT = "<autograph: no such attribute>"  # a flag deleted, or its module gone


_NO_FLAG = object()
MAX_FLAG_ITEMS = 8  # the strings of a list flag (PEFT's active adapters)


def flag_key(value: Any) -> Any:
    """A flag's value as keyed: a bool, a string or None itself; a short list or tuple
    of them (PEFT's ``_active_adapter = ["default"]``, a new list at each
    ``set_adapter``) as a tuple of its type and items; anything else ``_NO_FLAG``."""
    kind = type(value)
    if kind in _FLAG_TYPES:
        return value
    if (kind is list or kind is tuple) and len(value) <= MAX_FLAG_ITEMS and all(
            type(v) in _FLAG_TYPES for v in value):
        return (kind, *value)
    return _NO_FLAG


def _live_value(module: nn.Module | None, name: str) -> Any:
    """A list flag's value as keyed at a call: :func:`flag_key`'s, or where the list no
    longer is one (grown long, given another kind of item in place) its items where
    they hash, else a new object (a key no graph has: that call captures anew)."""
    value: Any = getattr(module, name, _ABSENT) if module is not None else _ABSENT
    key = flag_key(value)
    if key is not _NO_FLAG:
        return key
    try:
        out = (type(value), *value)
        hash(out)
        return out
    except TypeError:
        return object()


def _flag_value(module: nn.Module | None, name: str) -> Any:
    return flag_key(getattr(module, name, _ABSENT)) if module is not None else _ABSENT


def running_stack() -> list[Watch]:
    """This thread's watches running their forward (innermost last): the assignment hook
    reads it; the eager path pushes and pops on it directly (no context manager)."""
    stack = getattr(_local, "running", None)
    if stack is None:
        stack = _local.running = []
    return stack  # type: ignore[no-any-return]


class running:
    """Marks ``watch`` as running its forward in this thread (for the assignment hook)."""

    __slots__ = ("watch", "before")

    def __init__(self, watch: Watch) -> None:
        self.watch = watch
        self.before: list[tuple[str, Any]] | None = None

    def __enter__(self) -> None:
        running_stack().append(self.watch)
        self.before = self.watch.owner_items()

    def __exit__(self, *exc: object) -> None:
        _local.running.pop()
        if self.before is not None:  # a plain object has no assignment hook: compare
            name = changed_attribute(self.before, self.watch.owner_items())
            if name is not None:
                self.watch.owner_assigned(name)
