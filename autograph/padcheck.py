"""The padding safety check: run a call eagerly as it is and padded, on copies, and say
what padding would change.

Padding is only correct when rows do not interact.  Before the first padded replay of
each bucket (per context, see ``buckets``) the call runs twice, eagerly, under
``no_grad``, on copies of its arguments: once as it is, once padded.  The real rows of
the outputs must match, and so must every non-tensor output (``x.shape[0]`` would come
back as the bucket's size); every argument must end up as the real run leaves it (a
padded argument on its real rows): padded rows may not write into a cache or table,
except inside that argument's ``pad_writes`` region, where differences are ignored (and
only there: a write anywhere else is still a problem).  Floating-point arguments the
function writes are first filled with the same random values in both runs, so a padded
row writing what the cache happens to hold already is still seen.  Then both runs
again on values of one sign (see :func:`problem`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from . import rng
from .arguments import Arguments, Key
from .padding import (
    Batch,
    Region,
    arg_of,
    compare,
    compare_writes,
    copies,
    out_dim,
    padded_call,
    size_of,
    slice_back,
)

Call = Callable[[tuple[Any, ...], dict[str, Any]], Any]


# what :func:`problem` returns when the call raises as it is (a malformed request): the
# bucket stays unchecked, and the call runs (and raises) unpadded as in eager mode
UNCHECKED = "the call raised as it is"


def problem(eager: Call, args: tuple[Any, ...], kwargs: dict[str, Any], batch: Batch,
            size: int, written: set[Key], names: Arguments, fills: list[Any],
            regions: dict[Key, Region], gens: tuple[torch.Generator, ...] = ()
            ) -> str | None:
    """What padding this call up to ``size`` changes, None when nothing does, or
    :data:`UNCHECKED` when the call raises without padding too.

    Checked on the call's own values, then on values of one sign (:func:`_signed`): a
    maximum or minimum over the batch dimension (``x.amax(0)``, ``mask.all(0)``, a
    sort) ignores padded zeros on some data only, and a tensor argument that is zero
    on this call (a weight of 0) hides a mix of rows; replays would then be wrong on
    the rest.  Sums over the batch stay exact.  ``gens``: the generators the call
    reaches besides the default ones, whose draws the check puts back too."""
    verdict = _problem(eager, args, kwargs, batch, size, written, names, fills, regions, gens)
    if verdict is not None:
        return verdict
    for sign in (1, -1):
        signed = _signed(args, kwargs, batch, sign, written, names)
        if signed is None:
            break
        verdict = _problem(eager, *signed, batch, size, written, names, fills, regions, gens)
        if verdict is not None and verdict is not UNCHECKED:
            return f"{verdict} (on values of one sign)"
    return None


def _signed(args: tuple[Any, ...], kwargs: dict[str, Any], batch: Batch, sign: int,
            written: set[Key], names: Arguments
            ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The arguments with values of one sign, or None when none changes: each
    floating-point tensor argument the call only reads (batch or not) made
    ``sign * (|x| + 1)``; each boolean batch argument all True (``sign`` 1) or all
    False; and, for a call that writes no argument, each integer batch argument filled
    with its own largest (1) or smallest value (values it holds already: indexes stay
    in range; a call that writes could scatter rows to one index and race)."""
    new_args, new_kwargs = list(args), dict(kwargs)
    in_batch = {key for key, _, _ in batch}
    keys = names.keys_of(args, kwargs)
    changed = False
    for key, canon in zip((*range(len(args)), *kwargs), keys):
        value = arg_of(args, kwargs, key)
        if not isinstance(value, torch.Tensor) or canon in written or not value.numel():
            continue
        with torch.no_grad():
            if value.is_floating_point():
                new = (value.abs() + 1) * sign
            elif key not in in_batch or value.is_complex():
                continue
            elif value.dtype is torch.bool:
                new = torch.full_like(value, sign > 0)
            elif not written:
                new = torch.full_like(value, (value.max() if sign > 0 else value.min()).item())
            else:
                continue
        if isinstance(key, int):
            new_args[key] = new
        else:
            new_kwargs[key] = new
        changed = True
    return (tuple(new_args), new_kwargs) if changed else None


def _problem(eager: Call, args: tuple[Any, ...], kwargs: dict[str, Any], batch: Batch,
             size: int, written: set[Key], names: Arguments, fills: list[Any],
             regions: dict[Key, Region], gens: tuple[torch.Generator, ...]) -> str | None:
    """:func:`problem` on these values."""
    real = size_of(batch[0][1], batch[0][2])
    start = _random_state(args, kwargs, gens)  # before the poison: it draws too
    plain_args, plain_kwargs = copies(args, kwargs)
    pad_args, pad_kwargs = copies(args, kwargs)
    _poison(written, names, plain_args, plain_kwargs, pad_args, pad_kwargs)
    pad_batch = [(k, arg_of(pad_args, pad_kwargs, k), d) for k, _, d in batch]
    padded = padded_call(pad_args, pad_kwargs, pad_batch, size, fills)
    after_poison = _random_state(args, kwargs, gens)
    try:
        with torch.no_grad():
            try:
                expect = eager(plain_args, plain_kwargs)
            except Exception:  # noqa: BLE001 - a bad call, not a verdict on padding
                return UNCHECKED
            after_plain = _random_state(args, kwargs, gens)
            _set_random_state(after_poison)  # the same draws in both runs (a sampler's)
            try:
                got = slice_back(eager(*padded), size, real, out_dim(batch))
            except Exception as exc:  # noqa: BLE001 - a padded call that fails is unsafe
                return f"the padded call raised {type(exc).__name__}"
            if not _same_states(after_plain, _random_state(args, kwargs, gens)):
                # (``multinomial`` per row: the real rows' draws equal, the generator
                # then stands elsewhere than eager's)
                return "the padded call draws more random numbers"
    finally:
        _set_random_state(start)  # the check draws nothing the call itself would
    return compare(expect, got) or compare_writes(
        *_after(names, plain_args, plain_kwargs, pad_args, pad_kwargs, padded, batch, real),
        regions)


RandomState = list[tuple[torch.Generator, torch.Tensor]]


def _random_state(args: tuple[Any, ...], kwargs: dict[str, Any],
                  gens: tuple[torch.Generator, ...]) -> RandomState:
    """The state of the host generator, of each CUDA device's the arguments are on, and
    of ``gens``; the global ones not while other threads run (setting a state back
    would hand them numbers drawn already: the check's runs then draw on, and a
    sampling step may lose its buckets), ``gens`` always (the call's own: a sampler's)."""
    if threading.active_count() > 1:
        return [(gen, gen.get_state()) for gen in gens]
    # through the generators, not ``torch.get_rng_state``: an enclosing graphed call's
    # warmup spies on that (``lifecycle.StateReads``) and would take the check for the
    # call's own
    devices = {torch.device("cpu"), *(t.device for t in (*args, *kwargs.values())
                                      if isinstance(t, torch.Tensor) and t.device.type == "cuda")}
    defaults = [gen for d in devices if (gen := rng.generator(d)) is not None]
    every = {id(g): g for g in (*defaults, *gens)}.values()
    return [(gen, gen.get_state()) for gen in every]


def _same_states(a: RandomState, b: RandomState) -> bool:
    return len(a) == len(b) and all(
        g is h and torch.equal(x, y) for (g, x), (h, y) in zip(a, b))


def _set_random_state(state: RandomState) -> None:
    for gen, value in state:
        gen.set_state(value)


# the check's own random values (drawn on the host: the global generators are the
# program's, and other threads draw from them)
_NOISE = torch.Generator().manual_seed(0x5EED)


def _poison(written: set[Key], names: Arguments, plain_args: tuple[Any, ...],
            plain_kwargs: dict[str, Any], pad_args: tuple[Any, ...],
            pad_kwargs: dict[str, Any]) -> None:
    """Fill the (copied) floating-point arguments the function writes with the same
    random values in both runs."""
    keys = names.keys_of(plain_args, plain_kwargs)
    for key, canon in zip((*range(len(plain_args)), *plain_kwargs), keys):
        if canon not in written:
            continue
        a, b = arg_of(plain_args, plain_kwargs, key), arg_of(pad_args, pad_kwargs, key)
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            noise = torch.randn(a.shape, dtype=a.dtype, generator=_NOISE).to(a.device)
            a.copy_(noise)
            b.copy_(noise)


def _after(names: Arguments, plain_args: tuple[Any, ...], plain_kwargs: dict[str, Any],
           pad_args: tuple[Any, ...], pad_kwargs: dict[str, Any],
           padded: tuple[tuple[Any, ...], dict[str, Any]], batch: Batch, real: int
           ) -> tuple[list[tuple[Key, torch.Tensor]], list[torch.Tensor]]:
    """What the check compares after both runs: per tensor argument (canonical key, the
    real run's tensor) and the padded run's tensor (for a padded argument, its real
    rows, which the function may have written in place)."""
    dims = {key: dim for key, _, dim in batch}
    plain: list[tuple[Key, torch.Tensor]] = []
    other: list[torch.Tensor] = []
    keys = names.keys_of(plain_args, plain_kwargs)
    for key, canon in zip((*range(len(plain_args)), *plain_kwargs), keys):
        p = arg_of(plain_args, plain_kwargs, key)
        if not isinstance(p, torch.Tensor):
            continue
        q = arg_of(*padded, key).narrow(dims[key], 0, real) if key in dims \
            else arg_of(pad_args, pad_kwargs, key)
        plain.append((canon, p))
        other.append(q)
    return plain, other
