"""The hooks on ``nn.Module`` that tell watches (``guards.Watch``) what changed.

Installed once, the first time a module is watched: a wrapper of
``nn.Module.__setattr__``/``__delattr__`` and torch's global registration hooks report
attribute assignments (a float scale, a flag, a swapped submodule, a parameter
replaced); wrappers of the hook registration methods report hooks registered later
(forward hooks: the watch reads them again at the next call; backward hooks: the
graphs are dropped); wrappers of the container methods that write ``_modules``
directly (``ModuleList.insert``, ``ModuleDict.clear``) report those changes.
``watched`` maps the id of every watched module to its watches.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .coderefs import same

if TYPE_CHECKING:
    from .guards import Watch

_Module = nn.Module
_MISSING = object()

# id(module) -> the watches whose trees contain it
watched: dict[int, weakref.WeakSet[Watch]] = {}
# re-entrant: a garbage collection inside a locked block can run a module's weak
# reference callback that closes its watch (region.py), which takes the lock again
watched_lock = threading.RLock()
_installed = False

RECHECK = "hooks registered since the last check"
MISSING = _MISSING
CHANGED = object()  # what a container held before a change in place: not known


def current(module: nn.Module, name: str) -> Any:
    """What ``module.name`` holds (a plain attribute, a parameter, a buffer or a
    submodule), or ``MISSING``."""
    d = module.__dict__
    old = d.get(name, _MISSING)
    if old is _MISSING:
        for holder in ("_parameters", "_buffers", "_modules"):
            inner = d.get(holder)
            if inner is not None and name in inner:
                return inner[name]
    return old


def _changes(module: nn.Module, name: str, value: Any) -> bool:
    old = current(module, name)
    if old is _MISSING and hasattr(type(inspect.getattr_static(module, name, None)), "__set__"):
        # a property with a setter (transformers' ``kernels_mode``, set by every
        # ``eval()``): set to what it reads, no change; what a setter writes on the
        # module comes through here again on its own
        try:
            old = getattr(module, name)
        except Exception:  # noqa: BLE001 - a getter that fails: a change
            return True
    return not same(value, old)


def _swap(module: nn.Module, name: str, value: Any) -> bool:
    """Whether assigning ``value`` replaces a parameter or buffer by a tensor of the same
    shape and dtype (as ``load_state_dict(assign=True)`` does)."""
    if not isinstance(value, torch.Tensor):
        return False
    d = module.__dict__
    for holder in ("_parameters", "_buffers"):
        old = d.get(holder, {}).get(name)
        if old is not None:
            return bool(old.shape == value.shape and old.dtype == value.dtype)
    return False


def _hooks_added(module: nn.Module | None, backward: bool = False) -> None:
    """A hook was registered on ``module`` (None: a global one, every watch): hooks are
    read again at the next call (backward hooks: at the next call autograd records)."""
    with watched_lock:
        if module is None:
            found = [w for ws in watched.values() for w in ws]
        else:
            found = list(watched.get(id(module), ()))
    for watch in found:
        if backward:
            watch.backward_recheck = True
        else:
            watch.hook_reason = RECHECK


def _wrap_registration(owner: Any, name: str, backward: bool, on_module: bool) -> None:
    """Make ``owner.name`` (a hook registration) report through :func:`_hooks_added`."""
    original = getattr(owner, name, None)
    if original is None:
        return

    @functools.wraps(original)
    def register(*args: Any, **kwargs: Any) -> Any:
        handle = original(*args, **kwargs)
        module = args[0] if on_module else None
        if module is None or id(module) in watched:
            _hooks_added(module, backward)
        return handle

    setattr(owner, name, register)


# container methods that write ``_modules`` directly, past ``__setattr__`` and the
# registration hooks (``layers.insert(0, block)``, ``heads.clear()``)
_DIRECT_WRITES = ((nn.ModuleList, "insert"), (nn.Sequential, "insert"),
                  (nn.ModuleDict, "clear"), (nn.ModuleDict, "__delitem__"))


def _wrap_container(owner: Any, name: str) -> None:
    """Make ``owner.name`` report the change of its module's submodules."""
    original = getattr(owner, name, None)
    if original is None:
        return

    @functools.wraps(original)
    def changed(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if id(self) in watched:
            _notify(self, "_modules", changed=True)
        return out

    setattr(owner, name, changed)


def _wrap_script_setattr() -> None:
    """A scripted module (``torch.jit.script``) keeps its attributes and ``training``
    in its C++ object, set past ``nn.Module.__setattr__``: report those too."""
    script = getattr(torch.jit, "RecursiveScriptModule", None)
    if script is None or script.__setattr__ is _Module.__setattr__:
        return
    original = script.__setattr__

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if id(self) in watched and not self.__dict__.get("_initializing", True):
            try:
                old = getattr(self, name)
            except AttributeError:
                old = _MISSING
            if not same(value, old):
                _notify(self, name, value)
        original(self, name, value)

    __setattr__.__wrapped__ = original  # type: ignore[attr-defined]
    script.__setattr__ = __setattr__  # type: ignore[union-attr,method-assign]


def script_assigns(modules: Any) -> str | None:
    """Which scripted module's code assigns one of its attributes (``prim::SetAttr``:
    ``self.steps += 1`` in TorchScript, which no Python hook sees), or None."""
    script = getattr(torch.jit, "ScriptModule", None)
    for m in modules:
        if script is not None and isinstance(m, script):
            try:
                text = str(m.inlined_graph)
            except Exception:  # noqa: BLE001 - no graph to read: judged by its calls
                continue
            if "prim::SetAttr" in text:
                return f"the scripted {m.original_name} assigns an attribute"
    return None


def _notify(module: nn.Module, name: str, value: Any = _MISSING, changed: bool = False
            ) -> None:
    """Tell the watches of ``module`` that ``name`` is set to ``value`` (or deleted);
    ``changed``: reported after the change, in place (a container's ``insert``), so no
    value before it is known."""
    ws = watched.get(id(module))
    if ws:
        swap = value is not _MISSING and _swap(module, name, value)
        was = CHANGED if changed else current(module, name)
        for watch in list(ws):
            watch._on_assign(module, name, swap, was, value)


def install() -> None:
    """Install the assignment and registration hooks once (at import: a registration
    bound by name later, ``register = nn.Module.register_forward_hook``, is ours)."""
    global _installed
    if _installed:
        return
    with watched_lock:
        if _installed:
            return
        original_set = _Module.__setattr__
        original_del = _Module.__delattr__

        def __setattr__(self: nn.Module, name: str, value: Any) -> None:
            if id(self) in watched and _changes(self, name, value):
                _notify(self, name, value)
            original_set(self, name, value)

        def __delattr__(self: nn.Module, name: str) -> None:
            if id(self) in watched:
                _notify(self, name)
            original_del(self, name)

        _wrap_script_setattr()
        __setattr__.__wrapped__ = original_set  # type: ignore[attr-defined]
        __delattr__.__wrapped__ = original_del  # type: ignore[attr-defined]
        _Module.__setattr__ = __setattr__  # type: ignore[method-assign]
        _Module.__delattr__ = __delattr__  # type: ignore[method-assign]

        from torch.nn.modules import module as mm

        def registered(module: nn.Module, name: str, value: Any) -> None:
            # ``self.n += 1`` on a buffer registers the very tensor again: no change
            if id(module) in watched and _changes(module, name, value):
                _notify(module, name, value)

        for hook in ("parameter", "buffer", "module"):
            register = getattr(mm, f"register_module_{hook}_registration_hook", None)
            if register is not None:
                register(registered)
        for owner, name in _DIRECT_WRITES:
            _wrap_container(owner, name)
        for name in ("register_forward_hook", "register_forward_pre_hook"):
            _wrap_registration(_Module, name, backward=False, on_module=True)
        for name in ("register_full_backward_hook", "register_full_backward_pre_hook",
                     "register_backward_hook"):
            _wrap_registration(_Module, name, backward=True, on_module=True)
        for name in ("register_module_forward_hook", "register_module_forward_pre_hook"):
            _wrap_registration(mm, name, backward=False, on_module=False)
        for name in ("register_module_full_backward_hook",
                     "register_module_full_backward_pre_hook", "register_module_backward_hook"):
            _wrap_registration(mm, name, backward=True, on_module=False)
        _installed = True


GLOBAL = "global"  # what a hook reason names when the hooks are global


def hooks_reason(modules: list[nn.Module], skip: set[int]) -> tuple[str | None, Any]:
    """Why module hooks forbid capture (a hook's Python side effects would not replay;
    the hooks of the modules in ``skip`` run outside the graphs), and what has them: a
    weak reference to the module, or GLOBAL."""
    if global_hooks():
        return "global module forward hooks are registered", GLOBAL
    for m in modules:
        if id(m) in skip:
            continue
        if _hooked(m):
            return f"{type(m).__name__} has forward hooks", weakref.ref(m)
    return None, None


# torch's own hooks that a replay may skip: ``torch.export``'s unlifted module checks
# its inputs against the exported shapes (a key a graph serves passed them) and
# enables module-typed inputs around the call (an enter and its exit)
_CHECKS_ONLY = frozenset({"torch.export._unlift"})


def _hooked(m: nn.Module) -> bool:
    """Whether ``m`` has forward hooks whose side effects a replay would skip."""
    return any(getattr(hook, "__module__", None) not in _CHECKS_ONLY and not _collects(hook)
               and not _marks_grad(hook)
               for hooks in (m._forward_hooks, m._forward_pre_hooks)
               for hook in hooks.values())


def marks_grad(modules: list[nn.Module], skip: set[int], frozen: bool = False) -> bool:
    """Whether any of ``modules`` (but those in ``skip``) has transformers' hook that
    marks the input embeddings' output as requiring grad (:func:`_marks_grad`); with
    ``frozen``, only where that changes something: the module's own parameters require
    no grad (a frozen embedding, PEFT's; a trainable one's output requires grad
    already, and ``gradient_checkpointing_disable()`` leaves the hook there)."""
    return any(_marks_grad(hook) and not (frozen and any(
        p.requires_grad for p in m.parameters(recurse=False)))
        for m in modules if id(m) not in skip for hook in m._forward_hooks.values())


def _marks_grad(hook: Any) -> bool:
    """transformers' hook on the input embeddings (``enable_input_require_grads``, which
    ``gradient_checkpointing_enable()`` calls): it marks their output as requiring grad,
    which under no_grad changes no output, so calls without autograd are graphed past
    it; calls that autograd records run eagerly while it is there (``Watch.marks_grad``:
    checkpointing's recomputation of a captured forward would not match it)."""
    return getattr(hook, "__module__", None) == "transformers.modeling_utils" and \
        getattr(hook, "__name__", None) == "make_inputs_require_grads"


# transformers (5.x) puts a hook on each layer whose outputs a model may return
# (``output_hidden_states=True``, asked once, by the user or by a multimodal model's
# own code), left there for good: it does nothing unless a collector is active
_COLLECTING = "transformers.utils.output_capturing"


def _collects(hook: Any) -> bool:
    return getattr(hook, "__module__", None) == _COLLECTING and \
        getattr(hook, "__name__", None) == "output_capturing_hook"


def collecting(modules: list[nn.Module], skip: set[int]) -> bool:
    """Whether any of ``modules`` (but those in ``skip``) has transformers' collecting
    hook: a call is graphed only while no collector is active (:func:`collector`)."""
    return any(_collects(hook) for m in modules if id(m) not in skip
               for hook in m._forward_hooks.values())


def collector() -> bool:
    """Whether transformers collects layer outputs in this context now (a model's
    ``output_hidden_states`` call around this one): the hooks of the layers a call
    runs append to it, which a replay would not do.  A collector the call itself sets
    up (a model asked for its hidden states) is the call's own: its outputs."""
    capturing = sys.modules.get(_COLLECTING)
    active = getattr(capturing, "_active_collector", None)
    return active is not None and bool(active.get())  # (every model's forward sets {})


def _global_dicts() -> tuple[dict[Any, Any], dict[Any, Any]]:
    from torch.nn.modules import module as mm

    return (getattr(mm, "_global_forward_hooks", {}),
            getattr(mm, "_global_forward_pre_hooks", {}))


# the dictionaries of global module forward (pre-)hooks, read on every call: a hook
# registered through a name imported before the registration wrappers were installed
# reports nothing
GLOBAL_HOOKS, GLOBAL_PRE_HOOKS = _global_dicts()


def global_hooks() -> bool:
    """Whether global module forward hooks are registered (two dictionary reads)."""
    return bool(GLOBAL_HOOKS or GLOBAL_PRE_HOOKS)


def _global_backward_dicts() -> tuple[dict[Any, Any], dict[Any, Any]]:
    from torch.nn.modules import module as mm

    return (getattr(mm, "_global_backward_hooks", {}),
            getattr(mm, "_global_backward_pre_hooks", {}))


# the same for global module backward (pre-)hooks, read on every call autograd records:
# a module sets them up as it is called, so a graph captured without them misses them
GLOBAL_BACKWARD_HOOKS, GLOBAL_BACKWARD_PRE_HOOKS = _global_backward_dicts()
GLOBAL_BACKWARD = "global module backward hooks are registered"


def global_backward_hooks() -> bool:
    """Whether global module backward hooks are registered (two dictionary reads)."""
    return bool(GLOBAL_BACKWARD_HOOKS or GLOBAL_BACKWARD_PRE_HOOKS)


def still_hooked(hooked: Any) -> bool:
    """Whether what a hook reason named (see hooks_reason) still has forward hooks."""
    if hooked is GLOBAL:
        return global_hooks()
    m = hooked() if hooked is not None else None
    return m is not None and _hooked(m)


install()
