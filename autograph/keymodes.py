"""The modes a plan key was recorded under: entered for its warmup, or why they cannot be.

A key bakes in the grad, inference and autocast modes of its call, the numerics flags
of the process (TF32, reduced-precision reductions, deterministic algorithms, the
default dtype; ``modes.py``) and the watched modules' training flags.  :func:`entered`
enters the first three as recorded, for the warmup of that one key.  The others are
the user's settings: :func:`refusal` names those that differ from this process, and the
key is then reported as not captured instead of flags or modules being changed behind
the user's back.  A key from an older plan without ``modes`` or ``training`` is warmed
up under the caller's modes, as before.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import torch

from .modes import flag_names, modes
from .plan import parse_dtype


def key_device(key: dict[str, Any]) -> torch.device | None:
    """The device of a plan key's tensors (its first tensor argument's), if it has any."""
    for leaf in key.get("leaves", ()):
        if "tensor" in leaf:
            return torch.device(leaf["tensor"]["device"])
    return None


def as_json(value: Any) -> Any:
    """``value`` as a JSON round trip gives it back (tuples as lists, dtypes as names)."""
    return json.loads(json.dumps(value, default=str))


def refusal(key: dict[str, Any], training: Any) -> str | None:
    """Why ``key`` cannot be captured here without changing the user's settings: its
    numerics flags or the modules' training flags (``training``, as the key reads them
    now) differ from this process's; None when they match or were not recorded."""
    return "; ".join(_flag_changes(key) + _training_changes(key.get("training"),
                                                            as_json(training))) or None


def _flag_changes(key: dict[str, Any]) -> list[str]:
    """``recorded with <flag> <then>, now <now>`` for each numerics flag that differs."""
    recorded, device = key.get("modes"), key_device(key)
    if not isinstance(recorded, list) or device is None:
        return []
    now = as_json(modes(device))
    if len(recorded) != len(now):
        return [f"recorded with modes {recorded}, this torch has {now}"]
    names = flag_names(device.type)
    return [f"recorded with {name} {then!r}, now {value!r}"
            for name, then, value in zip(names, recorded[3:], now[3:]) if then != value]


def same_training(recorded: Any, now: Any) -> bool:
    """Whether a key's recorded training part is this process's: equal, or the same
    modules' flags followed by the module flags the recording process had seen switch
    (``guards.Watch._keys_flag``), which this one keys once they switch here."""
    if recorded == now:
        return True
    return isinstance(recorded, list) and isinstance(now, list) \
        and len(recorded) > len(now) and recorded[:len(now)] == now


def _training_changes(recorded: Any, now: Any) -> list[str]:
    """How the modules' training flags recorded in a key differ from theirs now."""
    if recorded is None or same_training(recorded, now):
        return []
    if not (isinstance(recorded, list) and isinstance(now, list) and len(recorded) == len(now)):
        return [f"recorded with module training flags {recorded}, now {now}"]
    subject = "the module is" if len(now) == 1 else "the modules are"
    return [f"recorded in {_train_words(recorded)}, {subject} in {_train_words(now)}"]


def _train_words(flags: list[bool]) -> str:
    """``train mode``, ``eval mode``, or ``train mode for 2 of 3 modules``."""
    if all(flags):
        return "train mode"
    if not any(flags):
        return "eval mode"
    return f"train mode for {sum(map(bool, flags))} of {len(flags)} modules"


@contextlib.contextmanager
def entered(key: dict[str, Any]) -> Iterator[None]:
    """Run the block under the grad, inference and autocast modes recorded in ``key``
    (under the caller's own where the key has no modes)."""
    recorded, device = key.get("modes"), key_device(key)
    with contextlib.ExitStack() as stack:
        if isinstance(recorded, list) and len(recorded) >= 3 and device is not None:
            grad, inference, autocast = recorded[:3]
            stack.enter_context(torch.inference_mode(bool(inference)))
            if not inference:
                stack.enter_context(torch.set_grad_enabled(bool(grad)))
            stack.enter_context(_autocast(device.type, autocast))
        yield


def _autocast(kind: str, recorded: Any) -> contextlib.AbstractContextManager[Any]:
    """Autocast on ``kind`` with the recorded dtype, or off where it was off."""
    if recorded:
        return torch.autocast(kind, dtype=parse_dtype(recorded))
    if torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()
