"""Where the ranks' agreement runs (``ranks``): on the host, never on the GPU.

Over shared memory where all the ranks of the group are on one host
(:class:`_HostChannel`); otherwise over ``pg`` itself when it is a gloo group, or over a
gloo group of the same ranks made for it at the first call (for NCCL groups).  One
channel per set of ranks; ``shutdown`` lets go of them with their groups.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import tempfile
import time
from typing import Any

import torch


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
