"""Version counters: read, put back and advance them.

A replay writes memory behind autograd's back, so autograph advances the counters of
what a call writes as eager's in-place operators would (``replay.versioned``), puts
them back where a verified call ran twice (``verify``), and splits a training call's
advances around autograd's save (``backward.Trained.split_bumps``).  Inference tensors
have no counter: they read as None and are left alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

increment: Any = getattr(torch._C, "_increment_version", None)
_set_counters: Any = getattr(getattr(torch._C, "_autograd", None),
                             "_unsafe_set_version_counter", None)


def versions(tensors: Iterable[torch.Tensor]) -> list[int | None]:
    """Each tensor's version counter (None: an inference tensor, which has none)."""
    return [None if t.is_inference() else t._version for t in tensors]


def set_versions(tensors: Iterable[torch.Tensor], values: Iterable[int | None]) -> None:
    """Set each tensor's counter to its value (None: left alone), where this torch can."""
    pairs = [(t, v) for t, v in zip(tensors, values) if v is not None]
    if _set_counters is not None and pairs:
        _set_counters(tuple(t for t, _ in pairs), tuple(v for _, v in pairs))


def bump(tensors: list[torch.Tensor]) -> None:
    """Advance the counter of each tensor in ``tensors`` once per entry."""
    if increment is not None:
        increment(tensors)


def take_back(tensors: list[torch.Tensor]) -> None:
    """Undo :func:`bump` of ``tensors`` (each counter back by its entries)."""
    counts = Counter(id(t) for t in tensors)
    unique = list({id(t): t for t in tensors}.values())
    set_versions(unique, [t._version - counts[id(t)] for t in unique])
