"""The kill switch: ``AUTOGRAPH_DISABLE=1`` and ``autograph.disabled()``.

Both make every graphed callable run its original code and capture nothing.  The
environment variable is read on every call, so it can be flipped at run time; the
context manager is thread-local, like ``torch.no_grad``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

ENV_VAR = "AUTOGRAPH_DISABLE"
_FALSE = ("", "0", "false", "no", "off")
_local = threading.local()
_lock = threading.Lock()


# os.environ keeps its values in a plain dict keyed by the encoded name; reading it
# directly costs a dict lookup instead of a Mapping.get that raises KeyError inside.
_environ = getattr(os.environ, "_data", None)
_env_key = os.environ.encodekey(ENV_VAR) if _environ is not None else None  # type: ignore[attr-defined]
_active = 0  # disabled() blocks open in any thread: the thread-local check is skipped at 0


def _env_set_fallback() -> bool:
    return ENV_VAR in os.environ


# A cheap pre-check for the call path: False means the variable is certainly unset.
env_set = (
    (lambda: _environ.get(_env_key) is not None)  # type: ignore[union-attr]
    if _environ is not None
    else _env_set_fallback
)


def is_disabled() -> bool:
    """True when graphs are switched off for the calling thread."""
    if _active and getattr(_local, "depth", 0):
        return True
    value = _environ.get(_env_key) if _environ is not None else os.environ.get(ENV_VAR)
    if value is None:
        return False
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return value.strip().lower() not in _FALSE


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run every graphed callable eagerly inside the block (this thread only).

    Example::

        with autograph.disabled():
            reference = model(x)   # plain eager PyTorch, nothing captured
    """
    global _active
    with _lock:
        _active += 1
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        with _lock:
            _active -= 1
