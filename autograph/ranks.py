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
import mmap
import os
import socket
import tempfile
import time
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
        self._channel: Any = None
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
        return list(channel.reduce_max(values))

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
class _GroupChannel:
    """Agreement by an all-reduce over a process group (gloo: on the host)."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group, self.device = group, device

    def reduce_max(self, values: list[int]) -> list[int]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]


_WORDS = 5  # per record: step, check, then up to 3 values
_SLOT = 1 + 2 * _WORDS + 5  # per rank: pid, then a record per parity of the step


class _HostChannel:
    """Agreement through shared memory, for ranks on one host: each rank writes its
    values for step k into its own record (one of two, by the parity of k) and reads
    the others' records for step k.  No record is rewritten before every rank read it:
    writing step k + 2 needs every rank at step k + 1, done reading step k.  A record is
    taken once its step and its check (a hash of step and values) match what was read,
    so a record read half written is read again: no memory fences needed."""

    def __init__(self, buf: memoryview, me: int, world: int) -> None:
        self.buf, self.me, self.world = buf, me, world
        self.step = 0
        self.timeout = 1800.0
        buf[me * _SLOT] = os.getpid()

    def reduce_max(self, values: list[int]) -> list[int]:
        buf, n = self.buf, len(values)
        k = self.step = self.step + 1
        parity = 1 + (k & 1) * _WORDS
        mine = self.me * _SLOT + parity
        for i, v in enumerate(values):
            buf[mine + 2 + i] = v
        buf[mine + 1] = hash((k, *values))
        buf[mine] = k
        out = list(values)
        for r in range(self.world):
            if r == self.me:
                continue
            at = r * _SLOT + parity
            theirs = self._read(at, k, n, r)
            out = [max(a, b) for a, b in zip(out, theirs)]
        return out

    def _read(self, at: int, k: int, n: int, rank: int) -> list[int]:
        buf = self.buf
        spins = 0
        start = 0.0
        while True:
            if buf[at] == k:
                got = list(buf[at + 2:at + 2 + n])
                if buf[at + 1] == hash((k, *got)) and buf[at] == k:
                    return got
            spins += 1
            if spins < 100:
                continue
            if spins < 5000:  # the other rank may wait for this core
                os.sched_yield()
                continue
            now = time.monotonic()
            if not start:
                start = now
            time.sleep(0.0001 if now - start < 1 else 0.001)
            if spins % 500 == 0:
                self._check(rank, k, now - start)

    def _check(self, rank: int, k: int, waited: float) -> None:
        pid = self.buf[rank * _SLOT]
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise RuntimeError(f"autograph: rank {rank} of the group (pid {pid}) exited "
                               f"while this rank waited for it to agree on call {k}") from None
        except OSError:
            pass
        if waited > self.timeout:
            raise RuntimeError(f"autograph: rank {rank} of the group did not agree on call "
                               f"{k} within {self.timeout:.0f} s (hung, or not making the "
                               "same graphed calls)")


# channels by the global ranks they span (one per set of ranks: two groups of the same
# ranks share one, as their calls are ordered alike on every rank), and gloo groups made
_channels: dict[tuple[int, ...], Any] = {}
_shadows: list[Any] = []


def _channel(group: Any) -> Any:
    """The channel of agreements over ``group``: shared memory where all its ranks are
    on one host, else the host over gloo (``group`` itself, or a gloo group of its
    ranks), else an all-reduce over ``group`` on the current CUDA device."""
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    channel = _channels.get(ranks)
    if channel is None:
        channel = _channels[ranks] = _host_channel(group) or _gloo_channel(group, ranks)
    return channel


def _host_channel(group: Any) -> _HostChannel | None:
    """Set up shared memory among the ranks of ``group`` (two collectives over it,
    once), or None where they are not all on one host or it cannot be made."""
    import torch.distributed as dist

    if os.environ.get("AUTOGRAPH_RANKS_CHANNEL", "shm") != "shm" or \
            not os.path.isdir("/dev/shm"):
        return None
    me, world = dist.get_rank(group), dist.get_world_size(group)
    size = world * _SLOT * 8
    path = ""
    if me == 0:
        with contextlib.suppress(OSError):
            fd, path = tempfile.mkstemp(prefix="autograph-ranks-", dir="/dev/shm")
            os.ftruncate(fd, size)
            os.close(fd)
    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, (socket.gethostname(), path), group=group)
    hosts = {host for host, _ in seen}
    path = seen[0][1]
    channel = None
    if len(hosts) == 1 and path:
        with contextlib.suppress(OSError, ValueError):
            with open(path, "r+b") as f:
                mapped = mmap.mmap(f.fileno(), size)
            channel = _HostChannel(memoryview(mapped).cast("q"), me, world)
    ok: list[Any] = [None] * world
    dist.all_gather_object(ok, channel is not None, group=group)
    if me == 0 and path:
        with contextlib.suppress(OSError):
            os.unlink(path)  # mapped by every rank that needs it: gone with the last
    return channel if all(ok) else None


def _gloo_channel(group: Any, ranks: tuple[int, ...]) -> _GroupChannel:
    import torch.distributed as dist

    cpu = torch.device("cpu")
    backend = str(dist.get_backend(group))
    if "gloo" in backend:
        return _GroupChannel(group, cpu)
    if dist.is_gloo_available():
        shadow = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True,
                                group_desc="autograph_agreement")
        _shadows.append(shadow)
        return _GroupChannel(shadow, cpu)
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else cpu
    return _GroupChannel(group, device)


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
