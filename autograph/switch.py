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


def is_disabled() -> bool:
    """True when graphs are switched off for the calling thread."""
    if getattr(_local, "depth", 0):
        return True
    value = os.environ.get(ENV_VAR)
    return value is not None and value.strip().lower() not in _FALSE


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run every graphed callable eagerly inside the block (this thread only).

    Example::

        with autograph.disabled():
            reference = model(x)   # plain eager PyTorch, nothing captured
    """
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
