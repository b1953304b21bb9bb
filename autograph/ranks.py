"""Ranks that never diverge: agreement on what each call does, across a process group.

With ``graphed(..., group=pg)`` every call of the callable first agrees with the other
ranks of ``pg`` (one small all-reduce): each rank proposes what it would do, and all do
the least advanced of the proposals, in the order eager < warm up < capture < replay.
So a rank that must run eagerly (a failed capture, an unkeyable argument) makes all
ranks run eagerly; a rank that lost its graph (its module changed) makes the others
warm up and capture again with it; and ranks whose calls have different keys run
eagerly.  Collectives inside the graph then always meet their peers: no rank replays a
graph while another runs the same step eagerly.  With buckets, the batch size is
agreed first (the largest of the ranks'), so every rank pads to the same bucket.

The agreement runs on the host: over ``pg`` itself when it is a gloo group, otherwise
over a gloo group of the same ranks made for it at the first call (for NCCL groups).  So
it launches nothing on the GPU and never waits for the GPU: while the GPU runs the
previous steps, the hosts agree on the next one.  It cannot be skipped in steady state:
a rank's state can change between two calls (its module changed, a capture failed)
where the others cannot see it, and since no rank may replay a step that another runs
eagerly, every rank must hear from every other before each call.

Shutdown: graphs that captured NCCL collectives keep the communicator referenced, and
destroying it then waits for ever.  So ``destroy_process_group`` (wrapped here) and
interpreter exit first wait for the devices and drop every graph; calls made with a
destroyed group run eagerly.

Every rank must make the same graphed calls in the same order (as tensor-parallel
ranks do), and the kill switch must be set alike on all ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import weakref
from typing import Any

import torch

from .vocab import Action, logger

NAMES = {Action.EAGER: "eager", Action.WARM: "warm up", Action.CAPTURE: "capture",
         Action.REPLAY: "replay"}


class Ranks:
    """The agreement of one graphed callable's calls across ``group``."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        install()
        self.dist = dist
        self.group: Any = group
        self.step = 0
        self.alone = dist.get_world_size(group) == 1  # nobody to agree with: no collective
        self.closed = False  # the group was destroyed: calls run eagerly
        self.keys_differ = False  # at the last agreement
        self._channel: tuple[Any, torch.device] | None = None
        self._warned: set[tuple[Action, Action]] = set()
        _live.add(self)

    def rank(self) -> int:
        return -1 if self.closed else int(self.dist.get_rank(self.group))

    def close(self) -> None:
        """The group is gone: hold it no longer (nor its channel); calls run eagerly."""
        self.closed = True
        self.group = self._channel = None

    def _reduce_max(self, values: list[int]) -> list[int]:
        channel = self._channel
        if channel is None:
            channel = self._channel = _channel(self.group)
        group, device = channel
        t = torch.tensor(values, dtype=torch.int64, device=device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=group)
        return [int(v) for v in t.tolist()]

    def agree(self, action: Action, key_digest: int, name: str) -> Action:
        """The action every rank takes for this call (one all-reduce on the host)."""
        self.step += 1
        if self.closed:
            return Action.EAGER
        if self.alone:
            return action
        neg_action, low, high = self._reduce_max([-int(action), -key_digest, key_digest])
        self.keys_differ = -low != high
        agreed = Action.EAGER if self.keys_differ else Action(-neg_action)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s: rank %d step %d: graph %016x, proposed %s, agreed %s", name,
                         self.rank(), self.step, key_digest,
                         NAMES[action], NAMES[agreed])
        if agreed != action and (action, agreed) not in self._warned:
            self._warned.add((action, agreed))
            logger.warning("%s: rank %d step %d: would %s graph %016x, but the ranks agree "
                           "on %s%s", name, self.rank(), self.step,
                           NAMES[action], key_digest, NAMES[agreed],
                           " (their keys differ)" if self.keys_differ else "")
        return agreed

    def agree_batch(self, rows: int, learning: bool) -> tuple[int, bool]:
        """The largest batch size of the ranks' calls (0 if a rank is not bucketing),
        and whether any rank is learning its arguments (then none pads)."""
        if self.alone or self.closed:
            return rows, learning
        low, high, anyone = self._reduce_max([-rows, rows, int(learning)])
        return (0 if -low == 0 else high), bool(anyone)


# -- the channel the agreement runs over ------------------------------------------------
# gloo groups made for agreement, by the global ranks they span (one per set of ranks:
# two groups of the same ranks share one, as their calls are ordered alike on every rank)
_shadows: dict[tuple[int, ...], Any] = {}


def _channel(group: Any) -> tuple[Any, torch.device]:
    """The group and tensor device an agreement over ``group`` uses: the host always
    (``group`` if its backend is gloo, else a gloo group of its ranks), or the current
    CUDA device where gloo is missing."""
    import torch.distributed as dist

    cpu = torch.device("cpu")
    backend = str(dist.get_backend(group))
    if "gloo" in backend:
        return group, cpu
    if dist.is_gloo_available():
        ranks = tuple(dist.get_process_group_ranks(group))
        shadow = _shadows.get(ranks)
        if shadow is None:
            shadow = _shadows[ranks] = dist.new_group(
                list(ranks), backend="gloo", use_local_synchronization=True,
                group_desc="autograph_agreement")
        return shadow, cpu
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else cpu
    return group, device


# -- shutdown ------------------------------------------------------------------------------
_live: weakref.WeakSet[Ranks] = weakref.WeakSet()
_installed = False
_original_destroy: Any = None  # torch's destroy_process_group, unwrapped


def install() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` (once) so that graphs go before
    the communicators they captured, and do the same at interpreter exit."""
    global _installed, _original_destroy
    if _installed or not torch.distributed.is_available():
        return
    _installed = True
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = _original_destroy = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        release(group)
        original(group)

    for module in (dist, c10d):
        if getattr(module, "destroy_process_group", None) is original:
            module.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
    atexit.register(_at_exit)


def release(group: Any = None) -> None:
    """Before ``group`` is destroyed (None or WORLD: every group): wait for the devices,
    drop the graphs of every live graphed callable (any of them may have captured a
    collective of ``group``), and let go of ``group`` and its agreement channel."""
    import torch.distributed as dist

    world = group is None or group is dist.GroupMember.WORLD
    with contextlib.suppress(Exception):  # never stand in the way of a shutdown
        drop_all_graphs()
    for ranks in list(_live):
        if world or ranks.group is group:
            ranks.close()
    if world:
        _shadows.clear()  # the real destroy takes them with every other group
        return
    with contextlib.suppress(Exception):
        ranks_of = tuple(dist.get_process_group_ranks(group))
        shadow = _shadows.get(ranks_of)
        if shadow is not None and not any(r.group is not None and _same_ranks(r, ranks_of)
                                          for r in _live):
            del _shadows[ranks_of]
            _original_destroy(shadow)


def _same_ranks(ranks: Ranks, of: tuple[int, ...]) -> bool:
    try:
        return tuple(ranks.dist.get_process_group_ranks(ranks.group)) == of
    except Exception:  # noqa: BLE001 - a group already gone
        return False


def drop_all_graphs() -> None:
    """Wait for the devices, then drop every graph of every live graphed callable (and
    free the captured graphs themselves, whoever else still holds them)."""
    from .engines import live_engines

    gc.collect()  # graphed callables no longer referenced, in cycles: their graphs too
    graphs = []
    for engine in live_engines():
        for entry in list(engine.cache.entries.values()):
            if entry.graph is not None:
                graphs.append(entry.graph)
    for captured in graphs:  # reset() once nothing in flight reads their buffers
        with contextlib.suppress(Exception):
            captured.synchronize()
    for engine in live_engines():
        with contextlib.suppress(Exception):
            engine.reset()
    for captured in graphs:
        reset = getattr(captured.graph, "reset", None)
        if reset is not None:
            with contextlib.suppress(Exception):
                reset()
    del graphs
    gc.collect()


def _at_exit() -> None:
    """Interpreter exit without ``destroy_process_group``: graphs go first, then the
    agreement groups made here (the user's own groups are left as they are)."""
    import torch.distributed as dist

    if not _live and not (dist.is_available() and dist.is_initialized()):
        return
    with contextlib.suppress(Exception):
        drop_all_graphs()
    for ranks in list(_live):
        ranks.close()
    shadows = list(_shadows.values())
    _shadows.clear()
    for shadow in shadows:
        with contextlib.suppress(Exception):
            if shadow in dist.distributed_c10d._world.pg_map:
                _original_destroy(shadow)


install()  # at import: code that imported destroy_process_group by name later gets ours
