"""Host constants made while a call with host counters warms up or is captured.

transformers' full sliding-window layer indexes with ``torch.tensor([-1], device=...)``
on every step: a tensor made from Python data, which a CUDA capture refuses to copy from
pageable memory and which autograph's write recorder would otherwise take for a tensor
read from outside the call (a hidden read, guarded for ever).  :class:`constants` makes
such a tensor a constant of the graph (``counters`` turns it on for its calls).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes as _no_modes


class constants:  # noqa: N801 - used like a function
    """While a call with host counters warms up or is captured (in this thread only),
    ``torch.tensor(python data, device=...)`` (the full sliding layer's ``index =
    torch.tensor([-1], device=...)``) makes a constant the graph bakes in, like any
    Python scalar.  Made on the host, its storage is added to ``known`` (no hidden read:
    nothing outside the call holds it) and kept in ``keep``; for a CUDA device it is made
    in pinned memory and copied without a host sync (a capture refuses a pageable copy),
    so the graph copies the kept constant on every replay."""

    __slots__ = ("known", "keep", "thread", "original")

    def __init__(self, known: set[int], keep: list[torch.Tensor]) -> None:
        self.known, self.keep = known, keep
        self.thread = threading.get_ident()
        self.original: Any = None

    def __enter__(self) -> None:
        self.original = torch.tensor
        original, known, keep, thread = self.original, self.known, self.keep, self.thread

        def tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            device = kwargs.get("device")
            if (threading.get_ident() != thread or args or device is None
                    or isinstance(data, torch.Tensor) or kwargs.get("requires_grad")):
                return original(data, *args, **kwargs)  # type: ignore[no-any-return]
            device = torch.device(device)
            with _no_modes():  # lift_fresh would read it before it is known
                host = original(data, dtype=kwargs.get("dtype"),
                                pin_memory=device.type == "cuda")
            keep.append(host)
            if host.numel():
                known.add(host.untyped_storage().data_ptr())
            if device.type == "cpu":
                return host  # type: ignore[no-any-return]
            return host.to(device, non_blocking=True)  # type: ignore[no-any-return]

        torch.tensor = tensor  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        torch.tensor = self.original
