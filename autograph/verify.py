"""Verified replays (``verify_every=N``): every Nth replay of a graph is checked against
eager.

The replay runs as usual on the caller's tensors; then the call runs eagerly on copies
of its arguments (the written ones as they were before the replay) with the module
state the graph wrote put back first, and outputs, written arguments and written state
are compared within the dtype's tolerance.  A mismatch puts the caller's tensors and
the module state back as they were, reruns the call eagerly for its true result, drops
the graph and makes its key eager for good, with a WARNING naming the largest
difference.  Graphs that draw random numbers are not checked (their replays differ
from eager by design; attention kernels run with ``dropout_p=0`` draw none), nor calls
with object arguments (passed through, not copied: an eager rerun would advance, say, a
cache's own state a second time).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .flat import Flat
from .replay import HELD
from .returned import opened
from .steps import grads_of, put_back_grads
from .versions import set_versions, versions
from .vocab import EagerReason, logger

ENV_VAR = "AUTOGRAPH_VERIFY_EVERY"


def every_from_env() -> int | None:
    """``AUTOGRAPH_VERIFY_EVERY`` as a positive int, or None when unset or invalid."""
    text = os.environ.get(ENV_VAR, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value > 0 else None


def tolerance(dtype: torch.dtype) -> float:
    """How far a replay may differ from eager: kernels chosen per stream may round
    differently, within the precision of the dtype."""
    if dtype in (torch.float16, torch.bfloat16):
        return 1e-2
    if dtype == torch.float32:
        return 1e-4
    return 1e-7


def largest_difference(expect: Any, got: Any) -> str | None:
    """None when ``got`` equals ``expect`` within tolerance, else where and by how much
    they differ most."""
    a, spec_a = pytree.tree_flatten(expect)
    b, spec_b = pytree.tree_flatten(got)
    a, b = opened(a), opened(b)  # returned objects (a DynamicCache): by their tensors
    if spec_a != spec_b:
        return "the output structure differs"
    for n, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, torch.Tensor):
            problem = _tensor_difference(x, y)
            if problem:
                return f"leaf {n}: {problem}"
        elif type(x) is not type(y) or (x != y and x == x):  # noqa: PLR0124 - NaN
            return f"leaf {n}: {x!r} != {y!r}"
    return None


def _tensor_difference(x: torch.Tensor, y: Any) -> str | None:
    if not isinstance(y, torch.Tensor) or x.shape != y.shape or x.dtype != y.dtype:
        return "shape or dtype differs"
    if not (x.is_floating_point() or x.is_complex()):
        return None if torch.equal(x, y) else "integer values differ"
    tol = tolerance(x.dtype)
    if torch.allclose(x, y, rtol=tol, atol=tol, equal_nan=True):
        return None
    diff = (x.double() - y.double()).abs().nan_to_num(float("inf")).max().item()
    return f"max abs difference {diff:.3g} (tolerance {tol:g})"


def check(eager: Callable[[tuple[Any, ...], dict[str, Any]], Any], run: Callable[[Any], Any],
          flat: Flat, written: tuple[int, ...], state: list[torch.Tensor]
          ) -> tuple[Any, str | None]:
    """Replay with ``run``, then run ``eager`` (the original call, uncounted) on copies
    and compare; returns the call's result and the largest difference, or None."""
    leaves = list(flat.leaves)
    before = _clones(leaves, flat.tensor_pos)
    state_before = [t.detach().clone() for t in state]
    counted = state + [leaves[i] for i in written]  # version counters: as one call's
    # version counters put back: a verified call advances them as one call does, not
    # as its replay, restore and eager run together
    before_versions = versions(counted)
    result = run(flat.leaves)
    versions_graph = versions(counted)
    state_graph = [t.detach().clone() for t in state]
    _restore(state, state_before)
    copies = list(leaves)
    for i, t in _clones([before.get(i) for i in range(len(leaves))], tuple(before)).items():
        copies[i] = t
    expect = eager(*flat.rebuild(copies))
    problem = largest_difference(expect, result)
    for i in written:
        problem = problem or _prefixed(f"argument {i}", _tensor_difference(copies[i], leaves[i]))
    for n, (now, graph) in enumerate(zip(state, state_graph)):
        problem = problem or _prefixed(f"state {n}", _tensor_difference(now, graph))
    if problem is None:
        set_versions(counted, versions_graph)  # the restore and the eager run: unseen
        return result, None
    for i in written:  # undo what the replay wrote, then run eagerly for real
        with torch.no_grad():
            leaves[i].copy_(before[i])
    _restore(state, state_before)
    set_versions(counted, before_versions)
    return eager(*flat.call()), problem


def _clones(leaves: list[Any], positions: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Copies of the tensors at ``positions`` that alias each other as the originals do:
    arguments sharing a storage get views of one copied storage (a read argument that
    overlaps a written one must see the write in the eager run too)."""
    storages: dict[int, Any] = {}
    out: dict[int, torch.Tensor] = {}
    for i in positions:
        t = leaves[i].detach()
        storage = t.untyped_storage()
        copy = storages.get(storage.data_ptr())
        if copy is None:
            copy = storages[storage.data_ptr()] = storage.clone()
        view = torch.empty(0, dtype=t.dtype, device=t.device)
        out[i] = view.set_(copy, t.storage_offset(), t.size(), t.stride())
    return out


def _written(captured: Any) -> list[torch.Tensor]:
    """The state a call of ``captured`` writes: parameters and buffers, and the tensors
    held elsewhere (a module's plain attribute, a plain object's) whose version its
    capture advanced.  The eager run of a check must not write them a second time."""
    tensors = {id(t): t for t in captured.state_written}
    tensors.update((id(t), t) for t in captured.bumps.state)
    tensors.update((id(t), t) for r in captured.bumps.hidden if (t := r()) is not None)
    return list(tensors.values())


def _restore(tensors: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, v in zip(tensors, values):
            t.copy_(v)


def _prefixed(where: str, problem: str | None) -> str | None:
    return f"{where}: {problem}" if problem else None


class _NoReplay(Exception):
    """The replay did not run (it failed, or an earlier output or backward holds the
    graph): the call takes the unverified path's way out."""

    def __init__(self, outcome: Any) -> None:
        super().__init__()
        self.outcome = outcome


def verified(engine: Any, entry: Any, run: Callable[[Any], Any], flat: Flat) -> Any:
    """A replay of ``entry`` checked against an eager run of the same call
    (``verify_every``): a difference drops the graph, and the key runs eagerly from
    then on (``engine`` is the ``dispatch.Engine``).  A replay that fails or is held
    is handled as an unverified one is (``replay_failed``, ``protect``)."""
    captured = entry.graph
    if captured.outputs_held():
        return engine.protect(flat)

    def replay(leaves: Any) -> Any:
        try:
            out = run(leaves)
        except Exception as exc:  # noqa: BLE001 - a failed launch: eager is still right
            raise _NoReplay(exc) from exc
        if out is HELD:
            raise _NoReplay(out)
        return out

    # a whole step's .grad: the graph's tensors, which the eager run replaces (a
    # zero_grad setting them to None): put back, as the step's guard expects them
    steps = engine.watch.steps
    grads = grads_of((*engine.watch.tensors(), *steps.parameters())) if steps.active else []
    written = _written(captured)  # and the optimizers' state (fused kernels leave its
    seen = {id(t) for t in written}  # version as it was)
    written += [t for t in steps.state_tensors() if id(t) not in seen]
    try:
        result, problem = check(engine.eager, replay, flat, captured.inplace, written)
    except _NoReplay as no:
        if no.outcome is HELD:
            return engine.protect(flat, captured.held_reason)
        return engine.replay_failed(entry, no.outcome, flat)
    stats = engine.stats
    stats.verifications += 1
    if problem is None:
        put_back_grads(grads)
        engine.replayed(entry)
        return result
    stats.verify_failures += 1
    logger.warning("%s: a verified replay differed from eager (%s): this key runs "
                   "eagerly from now on", stats.name, problem)
    with engine.cache.lock:
        engine.cache.forget_graph(entry)
        entry.give_up(EagerReason.VERIFY_FAILED, problem)
    stats.count_eager(EagerReason.VERIFY_FAILED, problem, warn=False)
    return result
