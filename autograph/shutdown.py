"""Shutdown with graphs that captured collectives.

Graphs that captured NCCL collectives keep the communicator referenced, and destroying
it then waits for ever.  So ``destroy_process_group`` (wrapped here, at import) and
interpreter exit first wait for the devices and drop every graph, then let go of the
agreement channels (``channels``) of the groups destroyed; the :class:`~.ranks.Ranks`
of a destroyed group close, and their calls run eagerly.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import weakref
from typing import TYPE_CHECKING, Any

import torch

from .channels import _channels, _shadows

if TYPE_CHECKING:
    from .ranks import Ranks

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
        _channels.clear()  # the real destroy takes the gloo groups made with the others
        _shadows.clear()
        return
    with contextlib.suppress(Exception):
        ranks_of = tuple(dist.get_process_group_ranks(group))
        if any(r.group is not None and _same_ranks(r, ranks_of) for r in _live):
            return  # another group of the same ranks still agrees over this channel
        channel = _channels.pop(ranks_of, None)
        shadow = getattr(channel, "group", None)
        if shadow is not None and any(shadow is s for s in _shadows):
            _shadows.remove(shadow)
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
    shadows = list(_shadows)
    _shadows.clear()
    _channels.clear()
    for shadow in shadows:
        with contextlib.suppress(Exception):
            if shadow in dist.distributed_c10d._world.pg_map:
                _original_destroy(shadow)


install()  # at import: code that imported destroy_process_group by name later gets ours
