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

Every rank must make the same graphed calls in the same order (as tensor-parallel
ranks do), and the kill switch must be set alike on all ranks.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch

logger = logging.getLogger("autograph")

EAGER, WARM, CAPTURE, REPLAY = 0, 1, 2, 3  # ordered: the agreed action is the minimum
NAMES = {EAGER: "eager", WARM: "warm up", CAPTURE: "capture", REPLAY: "replay"}
DISAGREE = "ranks disagree on this call's key: every rank runs it eagerly"
BEHIND = "another rank runs this call eagerly"


def digest(key: Any) -> int:
    """A digest of a graph key that is equal on every rank for equal calls: device
    indexes (each rank has its own GPU) and argument addresses left out."""
    text = repr(_portable(key)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 2


def _portable(part: Any) -> Any:
    if isinstance(part, torch.device):
        return part.type
    if isinstance(part, (torch.dtype, torch.layout, torch.memory_format)):
        return str(part)
    if isinstance(part, type):
        return part.__qualname__
    if isinstance(part, tuple):
        return tuple(_portable(p) for p in part)
    return part


class Ranks:
    """The agreement of one graphed callable's calls across ``group``."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.step = 0
        self.alone = dist.get_world_size(group) == 1  # nobody to agree with: no collective
        self.keys_differ = False  # at the last agreement
        self._warned: set[str] = set()

    def rank(self) -> int:
        return int(self.dist.get_rank(self.group))

    def _reduce_max(self, values: list[int]) -> list[int]:
        dist = self.dist
        device = torch.device("cpu")
        if dist.get_backend(self.group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

    def agree(self, action: int, key_digest: int, name: str) -> int:
        """The action every rank takes for this call (one all-reduce)."""
        self.step += 1
        if self.alone:
            return action
        neg_action, low, high = self._reduce_max([-action, -key_digest, key_digest])
        self.keys_differ = -low != high
        agreed = EAGER if self.keys_differ else -neg_action
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s: rank %d step %d: graph %016x, proposed %s, agreed %s", name,
                         self.rank(), self.step, key_digest,
                         NAMES[action], NAMES[agreed])
        if agreed != action and (action, agreed) not in self._warned:
            self._warned.add((action, agreed))  # type: ignore[arg-type]
            logger.warning("%s: rank %d step %d: would %s graph %016x, but the ranks agree "
                           "on %s%s", name, self.rank(), self.step,
                           NAMES[action], key_digest, NAMES[agreed],
                           " (their keys differ)" if self.keys_differ else "")
        return agreed

    def agree_batch(self, rows: int, learning: bool) -> tuple[int, bool]:
        """The largest batch size of the ranks' calls (0 if a rank is not bucketing),
        and whether any rank is learning its arguments (then none pads)."""
        if self.alone:
            return rows, learning
        low, high, anyone = self._reduce_max([-rows, rows, int(learning)])
        return (0 if -low == 0 else high), bool(anyone)
